"""The DSA lightning indexer's scoring and causal top-k (plain-PyTorch twin).

Scores for query token ``t`` of request ``b`` against every cached key ``j ≤ pos[t]`` of
that request: ``I[t, j] = Σ_h w[t, h] · ReLU(scale · q[t, h] · k[j])``; the result is the
top-``k`` key *positions* (int32, ``-1`` where fewer than ``k`` keys exist).
"""

from __future__ import annotations

import torch

from breakgraph import env
from breakgraph.kernels.dispatch import use_triton
from breakgraph.kernels.latent_fp8 import dequantize_latent_ref, is_fp8_latent
from breakgraph.kernels.paging import positions_to_slots

# Bound on the elements of the gathered-key temporary per chunk of query tokens.
_CHUNK_ELEMS = 1 << 25


def indexer_topk_ref(
    q: torch.Tensor,
    weights: torch.Tensor,
    k_cache: torch.Tensor,
    page_table: torch.Tensor,
    token_req: torch.Tensor,
    positions: torch.Tensor,
    page_size: int,
    softmax_scale: float,
    topk_out: torch.Tensor,
) -> None:
    """Write the causal top-k key positions of each query token into ``topk_out``.

    Args:
        q: ``[T, Hi, Di]`` indexer queries (RoPE applied).
        weights: ``[T, Hi]`` fp32 head weights (already × ``Hi^-0.5``).
        k_cache: ``[num_slots, Di]`` indexer key cache (this layer), or the FP8 key cache
            (``uint8`` rows of :mod:`~breakgraph.kernels.latent_fp8` without a RoPE part: e4m3
            codes and one fp32 scale), dequantised.
        page_table: ``[B, P]`` int32 page ids per request.
        token_req: ``[T]`` request row of each token; ``positions``: ``[T]`` its position.
        topk_out: ``[T, K]`` int32, written in full (``-1`` for unused columns). Caller owns it.
    Graph-safe: static shapes only, no host syncs.
    """
    num_tokens, topk = topk_out.shape
    max_len = page_table.shape[1] * page_size
    k_eff = min(topk, max_len)
    key_pos = torch.arange(max_len, device=q.device)
    chunk = max(1, _CHUNK_ELEMS // max(1, max_len * k_cache.shape[-1]))
    for start in range(0, num_tokens, chunk):
        end = min(start + chunk, num_tokens)
        req = token_req[start:end]
        slots = positions_to_slots(key_pos.expand(end - start, max_len), page_table, req, page_size)
        keys = k_cache[slots]  # [c, L, Di]
        keys = dequantize_latent_ref(keys, q.shape[-1], torch.float32) if is_fp8_latent(keys) else keys.float()
        s = torch.einsum("thd,tld->thl", q[start:end].float(), keys) * softmax_scale
        scores = torch.einsum("th,thl->tl", weights[start:end].float(), s.relu())
        causal = key_pos[None, :] <= positions[start:end, None]
        scores = scores.masked_fill(~causal, float("-inf"))
        vals, idx = scores.topk(k_eff, dim=-1)
        idx = torch.where(vals == float("-inf"), torch.full_like(idx, -1), idx)  # +inf is a key like any other
        topk_out[start:end, :k_eff] = idx.to(torch.int32)
    if k_eff < topk:
        topk_out[:, k_eff:] = -1


def indexer_topk(
    q: torch.Tensor,
    weights: torch.Tensor,
    k_cache: torch.Tensor,
    page_table: torch.Tensor,
    token_req: torch.Tensor,
    positions: torch.Tensor,
    page_size: int,
    softmax_scale: float,
    topk_out: torch.Tensor,
    *,
    max_seq_len: int | None = None,
) -> None:
    """Dispatch :func:`indexer_topk_ref`'s contract to the fastest implementation available.

    CUDA tensors with a supported layout take the length-true Triton scores and radix top-k
    select (:mod:`breakgraph.kernels.triton_indexer`; rows in ascending position order within parts, the same
    set as the twin's wherever the ``K``-th score is not tied); the score dot runs in bf16, or in
    FP8 e4m3 when ``BREAKGRAPH_INDEXER_FP8=1`` (which reads an FP8 key cache as stored; the
    engine's KV cache holds FP8 keys only in that mode). ``max_seq_len`` (host int, optional)
    bounds every token's ``position + 1`` and sizes the Triton path's score buffer. Everything
    else takes the twin (an FP8 key cache without the FP8 indexer too).
    """
    if use_triton(q):
        from breakgraph.kernels import triton_indexer

        fp8_keys = is_fp8_latent(k_cache)
        if triton_indexer.supports(q, weights, k_cache, page_table, token_req, positions) and (
            indexer_fp8() or not fp8_keys
        ):
            triton_indexer.indexer_topk_triton(
                q, weights, k_cache, page_table, token_req, positions, page_size, softmax_scale, topk_out,
                max_seq_len=max_seq_len, fp8=indexer_fp8(),
            )  # fmt: skip
            return
    indexer_topk_ref(q, weights, k_cache, page_table, token_req, positions, page_size, softmax_scale, topk_out)


def indexer_fp8() -> bool:
    """Whether the Triton indexer scores in FP8 (``BREAKGRAPH_INDEXER_FP8=1``; default bf16)."""
    return env.read("BREAKGRAPH_INDEXER_FP8") == "1"
