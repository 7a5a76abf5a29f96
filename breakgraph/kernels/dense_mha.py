"""Dense-causal MLA in its non-absorbed (MHA) form, for the prefill tokens below ``index_topk``.

Where every key a token may see is selected (a token at a position below ``index_topk``), MLA
attention is plain causal attention, and it can run in the form the model was trained in:
each key's latent ``c`` is projected per head to ``k_nope = c·w_kcᵀ`` and ``v = c·w_vcᵀ``, and
every head attends over keys ``[k_nope ‖ k_pe]`` (``dn + dr`` wide, ``k_pe`` shared by all
heads) with values ``dv`` wide. Per query, key and head that is ``2·(dn + dr + dv)`` FLOPs
against the absorbed form's ``2·(2r + dr)`` (GLM-5: 1024 against 2176), and the output is
``[T, H, dv]`` directly (no ``w_vc`` product after it); the price is projecting every key row
once (``[Tk, r] × [r, H·(dn + dv)]``), which the absorbed form's two query-side products
(``q_nope·w_kc``, ``o·w_vc``) cost for the query rows — so it pays where the keys are mostly
the batch's own new tokens (:func:`mha_form_pays`).

Key layout: the keys of a batch are rows of one packed buffer in which each request's keys are
consecutive and in position order; ``key_rows[t]`` is the row of token ``t``'s own key, so
token ``t`` (at position ``positions[t]``) sees rows ``key_rows[t] − positions[t] … key_rows[t]``.
For a batch without cached prefixes the buffer is the new tokens' latent rows themselves and
``key_rows[t] = t`` (pass None).
"""

from __future__ import annotations

import torch

from breakgraph.kernels.dispatch import use_triton

_CHUNK_ELEMS = 1 << 25


def dense_causal_mha_ref(
    q_nope: torch.Tensor,
    q_pe: torch.Tensor,
    k_nope: torch.Tensor,
    k_pe: torch.Tensor,
    v: torch.Tensor,
    positions: torch.Tensor,
    key_rows: torch.Tensor | None,
    softmax_scale: float,
    out: torch.Tensor,
) -> None:
    """Write causal attention ``softmax([q_nope ‖ q_pe]·[k_nope ‖ k_pe]ᵀ·scale)·v`` into ``out``.

    Args:
        q_nope: ``[T, H, dn]``; q_pe: ``[T, H, dr]`` (rotated); rows may be strided.
        k_nope: ``[Tk, H, dn]``; k_pe: ``[Tk, dr]`` (rotated, shared by the heads); v: ``[Tk, H, dv]``.
        positions: ``[T]`` int each token's position in its request.
        key_rows: ``[T]`` int row of each token's own key in the key buffer (None: ``t``); token
            ``t`` sees the rows ``key_rows[t] − positions[t] … key_rows[t]``.
        out: ``[T, H, dv]``, caller-owned, written in full.
    Scores and softmax in fp32, probabilities in ``v``'s dtype for the product (as the kernel).
    """
    t = q_nope.shape[0]
    rows = torch.arange(t, device=q_nope.device) if key_rows is None else key_rows.long()
    first = rows - positions.long()
    keys = torch.arange(k_nope.shape[0], device=q_nope.device)
    chunk = max(1, _CHUNK_ELEMS // max(1, q_nope.shape[1] * k_nope.shape[0]))
    for s in range(0, t, chunk):
        e = min(s + chunk, t)
        scores = torch.einsum("thd,khd->thk", q_nope[s:e].float(), k_nope.float())
        scores += torch.einsum("thd,kd->thk", q_pe[s:e].float(), k_pe.float())
        seen = (keys[None, :] >= first[s:e, None]) & (keys[None, :] <= rows[s:e, None])
        scores = (scores * softmax_scale).masked_fill(~seen[:, None, :], float("-inf"))
        probs = scores.softmax(dim=-1).to(v.dtype)
        out[s:e] = torch.einsum("thk,khd->thd", probs, v).to(out.dtype)


def dense_causal_mha(
    q_nope: torch.Tensor,
    q_pe: torch.Tensor,
    k_nope: torch.Tensor,
    k_pe: torch.Tensor,
    v: torch.Tensor,
    positions: torch.Tensor,
    key_rows: torch.Tensor | None,
    softmax_scale: float,
    out: torch.Tensor,
) -> None:
    """:func:`dense_causal_mha_ref`'s contract on the fastest implementation available: CUDA
    bf16/fp16 tensors take the Triton kernel (:mod:`breakgraph.kernels.triton_dense_mha`),
    everything else the twin."""
    args = (q_nope, q_pe, k_nope, k_pe, v, positions, key_rows, softmax_scale, out)
    if use_triton(q_nope):
        from breakgraph.kernels import triton_dense_mha

        if triton_dense_mha.supports(*args):
            triton_dense_mha.dense_causal_mha_triton(*args)
            return
    dense_causal_mha_ref(*args)


def mha_form_pays(new_tokens: int, keys: int, causal_pairs: int, rank: int, dn: int, dr: int, dv: int) -> bool:
    """Whether the MHA form takes fewer FLOPs than the absorbed form for ``causal_pairs`` (query,
    key) pairs over ``keys`` key rows (prefixes included), per head (both forms scale with the
    heads alike): the key projection ``2·keys·r·(dn + dv)`` plus the attention ``2·pairs·(dn +
    dr + dv)``, against the query-side products ``2·new_tokens·r·(dn + dv)`` plus ``2·pairs·(2r
    + dr)``. ``new_tokens``: the query tokens whose products the MHA form saves (0 where other
    tokens of the batch need the absorbed form's products anyway)."""
    mha = keys * rank * (dn + dv) + causal_pairs * (dn + dr + dv)
    absorbed = new_tokens * rank * (dn + dv) + causal_pairs * (2 * rank + dr)
    return mha < absorbed
