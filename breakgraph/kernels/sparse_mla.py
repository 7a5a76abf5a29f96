"""Sparse MLA attention in latent space (plain-PyTorch twin).

Absorbed MLA runs as MQA: every head's query ``[q_nope·w_kc ‖ q_pe]`` (``kv_lora_rank +
rope`` wide) attends to the latent cache entries ``[c ‖ k_pe]`` of its top-k key positions;
the value is the ``c`` part. The result stays in latent space (``[T, H, kv_lora_rank]``);
the caller applies ``w_vc``.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from breakgraph.kernels.causal_topk import causal_topk_ref
from breakgraph.kernels.dispatch import use_triton
from breakgraph.kernels.latent_fp8 import dequantize_latent_ref, is_fp8_latent
from breakgraph.kernels.paging import positions_to_slots

_CHUNK_ELEMS = 1 << 25


def sparse_mla_attention_ref(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    topk_pos: torch.Tensor,
    page_table: torch.Tensor,
    token_req: torch.Tensor,
    page_size: int,
    softmax_scale: float,
    out: torch.Tensor,
    *,
    positions: torch.Tensor | None = None,
    dense_below: int = 0,
) -> None:
    """Write ``softmax(q·kvᵀ·scale) · kv[:, :r]`` over each token's top-k keys into ``out``.

    Args:
        q: ``[T, H, D]`` latent queries (D = kv_lora_rank + rope dim).
        kv_cache: ``[num_slots, D]`` latent cache (this layer), or an FP8 latent cache
            (``uint8`` rows of :mod:`~breakgraph.kernels.latent_fp8`), dequantised to ``q``'s
            dtype.
        topk_pos: ``[T, K]`` int32 key positions, ``-1`` = unused.
        page_table: ``[B, P]`` int32 pages of each request; ``token_req``: ``[T]`` request row
            of each token.
        out: ``[T, H, r]`` (r = ``out.shape[-1]``), caller-owned; written in full.
        positions, dense_below: a hint for kernels with a dense-causal path: ``positions``
            ``[T]`` (int32/int64) is each token's position in its request, and the caller
            guarantees that the top-k row of every token with ``pos < dense_below`` holds
            exactly the positions ``0…pos`` (``-1`` elsewhere), as the DSA indexer's rows do
            for ``dense_below = K``. Attention over that row *is* dense causal attention, so
            this twin ignores both: its result is the same either way.
    Softmax runs in fp32. Graph-safe: static shapes, no host syncs.
    """
    num_tokens, k = topk_pos.shape
    rank = out.shape[-1]
    fp8 = is_fp8_latent(kv_cache)
    chunk = max(1, _CHUNK_ELEMS // max(1, k * kv_cache.shape[-1]))
    for start in range(0, num_tokens, chunk):
        end = min(start + chunk, num_tokens)
        pos = topk_pos[start:end]
        slots = positions_to_slots(pos, page_table, token_req[start:end], page_size)
        kv = kv_cache[slots]  # [c, K, D]
        if fp8:
            kv = dequantize_latent_ref(kv, rank, q.dtype)
        elif kv.dtype != q.dtype:  # e.g. a bf16 cache under fp32 activations (CPU)
            kv = kv.to(q.dtype)
        qc = q[start:end]
        scores = torch.einsum("thd,tkd->thk", qc, kv).float() * softmax_scale
        scores = scores.masked_fill((pos < 0)[:, None, :], float("-inf"))
        probs = scores.softmax(dim=-1).to(kv.dtype)
        out[start:end] = torch.einsum("thk,tkr->thr", probs, kv[..., :rank]).to(out.dtype)


def sparse_mla_attention(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    topk_pos: torch.Tensor,
    page_table: torch.Tensor,
    token_req: torch.Tensor,
    page_size: int,
    softmax_scale: float,
    out: torch.Tensor,
    *,
    positions: torch.Tensor | None = None,
    dense_below: int = 0,
    request_tokens: Sequence[int] | None = None,
    packed_rows: bool = False,
    causal_rows: bool = False,
    dense_elsewhere: bool = False,
) -> None:
    """Dispatch :func:`sparse_mla_attention_ref`'s contract to the fastest implementation available.

    CUDA bf16/fp16 tensors with a unit last stride take the Triton kernel
    (:mod:`breakgraph.kernels.triton_sparse_mla`), which runs token blocks below
    ``dense_below`` on its dense-causal path; everything else takes the twin.
    ``request_tokens``: each request's token count, given only when every token sits below
    ``dense_below`` (the Triton kernel then skips its sparse launch where every token block is
    dense; the twin ignores it). ``packed_rows``: each row holds its ``min(K, pos + 1)`` keys in
    its first columns, ``-1`` after them (the Triton kernel stops there; the twin reads every
    column, which gives the same result). ``causal_rows``: every token's row is all of its
    positions ``0…pos`` (every sequence at most ``K`` long; needs ``positions``): ``topk_pos`` is
    not read, only its shape — the Triton kernel makes the rows from the positions, the twin
    writes them into a tensor of its own first. ``dense_elsewhere``: the caller attends every
    token below ``dense_below`` itself and overwrites their rows of ``out``: the Triton kernel
    then leaves the rows of its dense-causal blocks unwritten, and the twin fills the rows of
    every token below ``dense_below`` with NaN (a row the caller misses shows).
    """
    if causal_rows and positions is None:
        raise ValueError("causal_rows needs the token positions")
    args = (q, kv_cache, topk_pos, page_table, token_req, page_size, softmax_scale, out)
    if use_triton(q):
        from breakgraph.kernels import triton_sparse_mla

        if triton_sparse_mla.supports(q, kv_cache, topk_pos, page_table, token_req, out, positions):
            triton_sparse_mla.sparse_mla_attention_triton(
                *args, positions=positions, dense_below=dense_below, request_tokens=request_tokens,
                packed_rows=packed_rows, causal_rows=causal_rows, dense_elsewhere=dense_elsewhere,
            )  # fmt: skip
            return
    if causal_rows:
        rows = torch.empty_like(topk_pos)
        causal_topk_ref(positions, rows)
        args = (q, kv_cache, rows, *args[3:])
    sparse_mla_attention_ref(*args, positions=positions, dense_below=dense_below)
    if dense_elsewhere and dense_below > 0 and positions is not None:
        out[positions[: out.shape[0]] < dense_below] = float("nan")
