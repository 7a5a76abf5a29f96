"""Rotary position embedding applied to activations: the plain-PyTorch twin and the dispatcher.

``x [T, ..., D]`` with ``cos/sin [T, R/2]`` (R = ``rope_dim`` ≤ D, default D): the first R
columns are rotated as pairs — interleaved ``(x0,x1),(x2,x3)…`` or half-split
``(x_i, x_{i+R/2})`` — and written as the two rotated halves ``[x1·cos − x2·sin ‖ x2·cos +
x1·sin]``, exactly as the reference does; the other ``D − R`` columns are copied. Every
product and sum is rounded to ``x``'s dtype as torch rounds each op (the kernel too).
"""

from __future__ import annotations

import torch

from breakgraph.kernels.dispatch import use_triton_inference
from breakgraph.kernels.latent_fp8 import store_latent
from breakgraph.kernels.norm import rms_norm


def rope_ref(
    x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool, rope_dim: int | None = None
) -> torch.Tensor:
    """The twin: rotate the first ``rope_dim`` columns of ``x`` (see the module docstring)."""
    d = x.shape[-1] if rope_dim is None else rope_dim
    part = x[..., :d]
    while cos.dim() < x.dim():
        cos, sin = cos.unsqueeze(-2), sin.unsqueeze(-2)
    if interleaved:
        x1, x2 = part[..., 0::2], part[..., 1::2]
    else:
        x1, x2 = part[..., : d // 2], part[..., d // 2 :]
    rotated = [x1 * cos - x2 * sin, x2 * cos + x1 * sin]
    return torch.cat(rotated if d == x.shape[-1] else [*rotated, x[..., d:]], dim=-1)


def rope(
    x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool, rope_dim: int | None = None
) -> torch.Tensor:
    """Dispatch :func:`rope_ref`'s contract (a new tensor of ``x``'s shape): CUDA tensors of one
    dtype outside autograd recording take one Triton kernel
    (:mod:`breakgraph.kernels.triton_rope`), everything else the twin."""
    if use_triton_inference(x, cos, sin):
        from breakgraph.kernels import triton_rope

        if triton_rope.supports(x, cos, sin, rope_dim):
            return triton_rope.rope_triton(x, cos, sin, interleaved, rope_dim)
    return rope_ref(x, cos, sin, interleaved, rope_dim)


CacheStore = tuple[torch.Tensor, torch.Tensor]
"""``(cache [N, W], slots [T] int64)``: where a fused rotary step also writes its ``T`` new
cache rows (a plain cache of the rows' dtype; see the ``store`` arguments below)."""


def _store_rows(store: CacheStore | None, rows: torch.Tensor) -> None:
    """The store without the kernel: the first ``len(slots)`` rows into ``cache[slots]``, as the
    split ops store (:func:`~breakgraph.kernels.latent_fp8.store_latent`)."""
    if store is not None:
        cache, slots = store
        store_latent(cache, slots, rows[: slots.shape[0]], rows.shape[-1])


def _kernel_store(store: CacheStore | None, rows: torch.Tensor) -> tuple[bool, dict]:
    """Whether the Triton kernel can take ``store`` for ``rows`` (always, when there is none),
    and its keyword arguments."""
    from breakgraph.kernels.triton_rope import cache_store_supports

    if store is None:
        return True, {}
    cache, slots = store
    return cache_store_supports(cache, slots, rows), {"cache": cache, "slots": slots}


def mla_rope_kv(
    q: torch.Tensor, kv_a: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, weight: torch.Tensor, eps: float,
    store: CacheStore | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """MLA's steps between its projections and attention, for ``q [T, H, nope + dr]`` (q_b's
    output) and ``kv_a [T, r + dr]`` (``r = weight.shape[0]``, interleaved RoPE):

    returns ``(q_full [T, H, r + dr], kv [T, r + dr])`` with ``q_full[..., r:] =
    rope(q[..., nope:])`` — its first ``r`` columns are left for the caller (``q_nope · w_kc``)
    — and ``kv = [rms_norm(kv_a[:, :r], weight, eps) ‖ rope(kv_a[:, r:])]``. ``store = (cache,
    slots)``: the ``kv`` rows are also written to ``cache[slots]`` (by the kernel itself where it
    runs: no separate store launch). CUDA tensors outside autograd recording take one Triton
    kernel (:func:`~breakgraph.kernels.triton_rope.mla_rope_kv_triton`: the norm kernel's and the
    rope kernel's arithmetic, so the same values as the dispatchers give), everything else the twins."""
    t, h, _ = q.shape
    r = weight.shape[0]
    dr = kv_a.shape[-1] - r
    q_full = q.new_empty(t, h, r + dr)
    if use_triton_inference(q, kv_a, cos, sin, weight):
        from breakgraph.kernels import triton_rope

        if triton_rope.mla_rope_kv_supports(q, kv_a, cos, weight) and cos.shape[1] * 2 == dr:
            kv = kv_a.new_empty(t, r + dr)
            fused, kwargs = _kernel_store(store, kv)
            triton_rope.mla_rope_kv_triton(q, kv_a, cos, sin, weight, eps, q_full, kv, **kwargs if fused else {})
            if not fused:
                _store_rows(store, kv)
            return q_full, kv
    c, k_pe = kv_a.split([r, dr], dim=-1)
    q_full[..., r:] = rope(q[..., q.shape[-1] - dr :], cos, sin, interleaved=True)
    kv = torch.cat([rms_norm(c, weight, eps), rope(k_pe, cos, sin, interleaved=True)], dim=-1)
    _store_rows(store, kv)
    return q_full, kv


def indexer_rope_qk(
    q: torch.Tensor | None, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, weight: torch.Tensor,
    bias: torch.Tensor, eps: float, interleaved: bool, rope_dim: int, store: CacheStore | None = None,
) -> tuple[torch.Tensor | None, torch.Tensor]:  # fmt: skip
    """The DSA indexer's steps before scoring: ``(rope(q), rope(layer_norm(k)))`` for queries
    ``q [T, H, D]`` and the key ``k [T, D]`` (``layer_norm`` over ``D`` with ``weight``, ``bias``,
    ``eps``; the first ``rope_dim`` columns rotated); ``q`` None: the key alone (``(None, …)``).
    ``store = (cache, slots)``: the key rows are also written to ``cache[slots]`` (by the kernel
    itself where it runs). CUDA tensors outside
    autograd recording take one Triton kernel
    (:func:`~breakgraph.kernels.triton_rope.indexer_rope_qk_triton`: the rotations are the rope
    kernel's bits; the LayerNorm is fp32 like torch's, rounded once, its sums in another order),
    everything else the twins."""
    if use_triton_inference(*([q] if q is not None else []), k, cos, sin, weight, bias):
        from breakgraph.kernels import triton_rope

        if triton_rope.indexer_rope_qk_supports(q, k, cos, weight) and 2 * cos.shape[1] == rope_dim:
            fused, kwargs = _kernel_store(store, k)
            q_out, k_out = triton_rope.indexer_rope_qk_triton(
                q, k, cos, sin, weight, bias, eps, interleaved, **kwargs if fused else {}
            )
            if not fused:
                _store_rows(store, k_out)
            return q_out, k_out
    k = rope(torch.nn.functional.layer_norm(k, (k.shape[-1],), weight, bias, eps), cos, sin, interleaved, rope_dim)
    _store_rows(store, k)
    return (rope(q, cos, sin, interleaved, rope_dim) if q is not None else None), k
