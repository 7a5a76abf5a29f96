"""Rotary embedding on the GPU in one kernel (twin: :func:`breakgraph.kernels.rope.rope_ref`).

One program per (token, block of heads): loads the token's ``cos/sin`` once, rotates the
first ``R`` columns of its rows and copies the rest into a new contiguous tensor. The twin
runs seven kernels (four products, a difference, a sum, the concatenation) and more for a
partial rotation; the arithmetic here repeats its rounding: each product and the sum or
difference are rounded to the dtype on their own (no FMA), so the result is bit-identical.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from breakgraph.kernels.dispatch import interpreting
from breakgraph.kernels.pdl import pdl_launch, pdl_wait
from breakgraph.kernels.triton_norm import _DTYPES, _mul_rn, _round_to


@triton.jit
def _rope_kernel(
    x_ptr, cos_ptr, sin_ptr, out_ptr,
    H, D, HALF, stride_xt, stride_xh, stride_ct, stride_st,
    INTERLEAVED: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr, BLOCK_REST: tl.constexpr,
    INTERP: tl.constexpr,
):  # fmt: skip
    dtype: tl.constexpr = out_ptr.dtype.element_ty
    t = tl.program_id(0).to(tl.int64)
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    h_ok = heads < H
    j = tl.arange(0, BLOCK_HALF)
    j_ok = j < HALF
    c = tl.load(cos_ptr + t * stride_ct + j, mask=j_ok, other=0.0).to(tl.float32)[None, :]
    s = tl.load(sin_ptr + t * stride_st + j, mask=j_ok, other=0.0).to(tl.float32)[None, :]
    x_rows = x_ptr + t * stride_xt + heads[:, None].to(tl.int64) * stride_xh
    if INTERLEAVED:
        i1, i2 = 2 * j, 2 * j + 1
    else:
        i1, i2 = j, j + HALF
    m = h_ok[:, None] & j_ok[None, :]
    x1 = tl.load(x_rows + i1[None, :], mask=m, other=0.0).to(tl.float32)
    x2 = tl.load(x_rows + i2[None, :], mask=m, other=0.0).to(tl.float32)
    # x1·cos − x2·sin and x2·cos + x1·sin, each product and the sum rounded as torch does
    a = _round_to(_mul_rn(x1, c, INTERP), dtype, INTERP).to(tl.float32)
    b = _round_to(_mul_rn(x2, s, INTERP), dtype, INTERP).to(tl.float32)
    o1 = _round_to(a - b, dtype, INTERP)
    a = _round_to(_mul_rn(x2, c, INTERP), dtype, INTERP).to(tl.float32)
    b = _round_to(_mul_rn(x1, s, INTERP), dtype, INTERP).to(tl.float32)
    o2 = _round_to(a + b, dtype, INTERP)
    o_rows = out_ptr + (t * H + heads[:, None].to(tl.int64)) * D
    tl.store(o_rows + j[None, :], o1, mask=m)
    tl.store(o_rows + HALF + j[None, :], o2, mask=m)
    if BLOCK_REST > 0:  # columns past the rotary part, copied
        r = 2 * HALF + tl.arange(0, BLOCK_REST)
        mr = h_ok[:, None] & (r < D)[None, :]
        tl.store(o_rows + r[None, :], tl.load(x_rows + r[None, :], mask=mr, other=0.0), mask=mr)


def supports(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, rope_dim: int | None) -> bool:
    """bf16/fp16/fp32 ``x [T, D]`` or ``[T, H, D]`` (unit last stride), ``cos/sin [T, R/2]`` of
    its dtype with unit last strides, ``R`` even and ≤ D."""
    d = x.shape[-1] if x.dim() else 0
    r = d if rope_dim is None else rope_dim
    return (
        x.dtype in _DTYPES
        and x.dim() in (2, 3)
        and x.stride(-1) == 1
        and 0 < r <= d
        and r % 2 == 0
        and all(t.dtype == x.dtype and t.dim() == 2 and t.shape == (x.shape[0], r // 2) for t in (cos, sin))
        and cos.stride(-1) == 1
        and sin.stride(-1) == 1
    )


def rope_triton(
    x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool, rope_dim: int | None = None
) -> torch.Tensor:
    """:func:`~breakgraph.kernels.rope.rope_ref` in one kernel; returns a new contiguous tensor
    of ``x``'s shape and dtype. Needs :func:`supports`. Graph-safe."""
    x3 = x if x.dim() == 3 else x.unsqueeze(1)
    t, h, d = x3.shape
    half = (d if rope_dim is None else rope_dim) // 2
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    if t and h:
        block_h = min(16, triton.next_power_of_2(h))
        rest = d - 2 * half
        _rope_kernel[(t, triton.cdiv(h, block_h))](
            x3, cos, sin, out, h, d, half, x3.stride(0), x3.stride(1), cos.stride(0), sin.stride(0),
            INTERLEAVED=interleaved, BLOCK_H=block_h, BLOCK_HALF=triton.next_power_of_2(half),
            BLOCK_REST=triton.next_power_of_2(rest) if rest else 0, INTERP=interpreting(), num_warps=4,
        )  # fmt: skip
    return out


# --------------------------------------------------------------------------------------------
# MLA: the latent entry (kv_a norm, k_pe rotation) and the query's rotary part in one kernel


@triton.jit
def _rotate_pairs(x1, x2, c, s, dtype: tl.constexpr, INTERP: tl.constexpr):
    """``(x1·c − x2·s, x2·c + x1·s)``, each product and the sum or difference rounded to
    ``dtype`` as torch rounds each op (what ``_rope_kernel`` computes)."""
    a = _round_to(_mul_rn(x1, c, INTERP), dtype, INTERP).to(tl.float32)
    b = _round_to(_mul_rn(x2, s, INTERP), dtype, INTERP).to(tl.float32)
    o1 = _round_to(a - b, dtype, INTERP)
    a = _round_to(_mul_rn(x2, c, INTERP), dtype, INTERP).to(tl.float32)
    b = _round_to(_mul_rn(x1, s, INTERP), dtype, INTERP).to(tl.float32)
    return o1, _round_to(a + b, dtype, INTERP)


@triton.jit
def _mla_rope_kv_kernel(
    q_ptr, kva_ptr, cos_ptr, sin_ptr, w_ptr, q_out_ptr, kv_ptr, cache_ptr, slots_ptr,
    H, R, NOPE, HALF, stride_qt, stride_qh, stride_kvat, stride_ct, stride_st, stride_qot, stride_qoh, stride_kvt,
    stride_cache, inv_r, eps,
    INTERLEAVED: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr,
    INTERP: tl.constexpr, STORE: tl.constexpr = False,
    PDL: tl.constexpr = False,
):  # fmt: skip
    """Token ``pid``: ``kv[t] = [rms_norm(kv_a[t, :R]) ‖ rope(kv_a[t, R:])]`` and
    ``q_out[t, h, R:] = rope(q[t, h, NOPE:])`` for every head ``h``; the norm is
    ``_rms_norm_kernel``'s arithmetic, the rotations ``_rope_kernel``'s. ``STORE``: the same
    ``kv`` row also goes to cache row ``slots[t]`` (int64)."""
    pdl_wait(PDL)
    dtype: tl.constexpr = kv_ptr.dtype.element_ty
    t = tl.program_id(0).to(tl.int64)
    if STORE:
        cache_row = cache_ptr + tl.load(slots_ptr + t) * stride_cache
    # the latent part: RMSNorm of c
    cols = tl.arange(0, BLOCK_R)
    c_ok = cols < R
    h = tl.load(kva_ptr + t * stride_kvat + cols, mask=c_ok, other=0.0).to(tl.float32)
    inv_r = tl.cast(inv_r, tl.float32)
    eps = tl.cast(eps, tl.float32)
    rstd = tl.math.rsqrt(_mul_rn(tl.sum(_mul_rn(h, h, INTERP), axis=0), inv_r, INTERP) + eps)
    h = _round_to(h * rstd, dtype, INTERP).to(tl.float32)
    w = tl.load(w_ptr + cols, mask=c_ok, other=0.0).to(tl.float32)
    c = _round_to(w * h, dtype, INTERP)
    tl.store(kv_ptr + t * stride_kvt + cols, c, mask=c_ok)
    if STORE:
        tl.store(cache_row + cols, c, mask=c_ok)
    # the rotary parts: k_pe (one row) and q_pe (H rows)
    j = tl.arange(0, BLOCK_HALF)
    j_ok = j < HALF
    cs = tl.load(cos_ptr + t * stride_ct + j, mask=j_ok, other=0.0).to(tl.float32)
    sn = tl.load(sin_ptr + t * stride_st + j, mask=j_ok, other=0.0).to(tl.float32)
    if INTERLEAVED:
        i1, i2 = 2 * j, 2 * j + 1
    else:
        i1, i2 = j, j + HALF
    k_row = kva_ptr + t * stride_kvat + R
    x1 = tl.load(k_row + i1, mask=j_ok, other=0.0).to(tl.float32)
    x2 = tl.load(k_row + i2, mask=j_ok, other=0.0).to(tl.float32)
    o1, o2 = _rotate_pairs(x1, x2, cs, sn, dtype, INTERP)
    tl.store(kv_ptr + t * stride_kvt + R + j, o1, mask=j_ok)
    tl.store(kv_ptr + t * stride_kvt + R + HALF + j, o2, mask=j_ok)
    if STORE:
        tl.store(cache_row + R + j, o1, mask=j_ok)
        tl.store(cache_row + R + HALF + j, o2, mask=j_ok)
    heads = tl.arange(0, BLOCK_H)
    m = (heads < H)[:, None] & j_ok[None, :]
    q_rows = q_ptr + t * stride_qt + heads[:, None].to(tl.int64) * stride_qh + NOPE
    x1 = tl.load(q_rows + i1[None, :], mask=m, other=0.0).to(tl.float32)
    x2 = tl.load(q_rows + i2[None, :], mask=m, other=0.0).to(tl.float32)
    o1, o2 = _rotate_pairs(x1, x2, cs[None, :], sn[None, :], dtype, INTERP)
    o_rows = q_out_ptr + t * stride_qot + heads[:, None].to(tl.int64) * stride_qoh + R
    tl.store(o_rows + j[None, :], o1, mask=m)
    tl.store(o_rows + HALF + j[None, :], o2, mask=m)


def mla_rope_kv_supports(q: torch.Tensor, kv_a: torch.Tensor, cos: torch.Tensor, weight: torch.Tensor) -> bool:
    """``q [T, H, nope + dr]`` and ``kv_a [T, r + dr]`` of one dtype with unit last strides,
    ``cos`` ``[T, dr/2]`` of that dtype, ``weight [r]``, ``r ≤ 8192`` and ``H ≤ 128``."""
    return (
        q.dim() == 3 and kv_a.dim() == 2 and q.shape[0] == kv_a.shape[0] and q.dtype in _DTYPES
        and all(t.dtype == q.dtype and t.stride(-1) == 1 for t in (q, kv_a, cos, weight))
        and cos.dim() == 2 and cos.shape[0] == q.shape[0] and 0 < weight.shape[0] <= 8192 and q.shape[1] <= 128
    )  # fmt: skip


def cache_store_supports(cache: torch.Tensor, slots: torch.Tensor, rows: torch.Tensor) -> bool:
    """Whether the rotary kernels can write ``rows [T, W]`` into ``cache[slots]`` themselves:
    a plain cache ``[N, W]`` of the rows' dtype with a unit last stride, ``slots [T]`` int64."""
    return (
        cache.dim() == 2 and cache.dtype == rows.dtype and cache.shape[1] == rows.shape[-1] and cache.stride(1) == 1
        and slots.dtype == torch.int64 and slots.shape == (rows.shape[0],) and slots.is_contiguous()
        and cache.device == rows.device and slots.device == rows.device
    )  # fmt: skip


def mla_rope_kv_triton(
    q: torch.Tensor, kv_a: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, weight: torch.Tensor, eps: float,
    q_out: torch.Tensor, kv: torch.Tensor, interleaved: bool = True,
    cache: torch.Tensor | None = None, slots: torch.Tensor | None = None,
) -> None:  # fmt: skip
    """One kernel for :func:`~breakgraph.kernels.rope.mla_rope_kv` (see there): writes ``kv
    [T, r + dr]`` and ``q_out[..., r:]`` (``q_out [T, H, r + dr]``, unit last stride), and with
    ``cache``/``slots`` (:func:`cache_store_supports`) the ``kv`` rows into ``cache[slots]`` too.
    Needs :func:`mla_rope_kv_supports`. Graph-safe."""
    t, h, _ = q.shape
    r = weight.shape[0]
    half = cos.shape[1]
    if t == 0:
        return
    store = cache is not None
    block_r = triton.next_power_of_2(r)
    _mla_rope_kv_kernel[(t,)](
        q, kv_a, cos, sin, weight, q_out, kv, cache if store else kv, slots if store else kv,
        h, r, q.shape[2] - 2 * half, half, q.stride(0), q.stride(1), kv_a.stride(0), cos.stride(0), sin.stride(0),
        q_out.stride(0), q_out.stride(1), kv.stride(0), cache.stride(0) if store else 0, 1.0 / r, eps,
        INTERLEAVED=interleaved, BLOCK_R=block_r, BLOCK_H=triton.next_power_of_2(h),
        BLOCK_HALF=triton.next_power_of_2(half), INTERP=interpreting(), STORE=store, num_warps=4,
        **pdl_launch(q.device),
    )  # fmt: skip


# --------------------------------------------------------------------------------------------
# DSA indexer: the queries' rotation and the key's LayerNorm + rotation in one kernel


@triton.jit
def _indexer_rope_qk_kernel(
    q_ptr, k_ptr, cos_ptr, sin_ptr, w_ptr, b_ptr, q_out_ptr, k_out_ptr, cache_ptr, slots_ptr,
    H, D, HALF, stride_qt, stride_qh, stride_kt, stride_ct, stride_st, stride_cache, inv_d, eps,
    INTERLEAVED: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_HALF: tl.constexpr,
    INTERP: tl.constexpr, STORE: tl.constexpr = False,
    PDL: tl.constexpr = False, HAS_Q: tl.constexpr = True,
):  # fmt: skip
    """Token ``pid``: ``q_out[t] = rope(q[t])`` (``H`` heads of ``D``, the first ``2·HALF``
    columns rotated, the rest copied; not without ``HAS_Q``) and ``k_out[t] =
    rope(layer_norm(k[t]))``. ``STORE``: the same key row also goes to cache row ``slots[t]``
    (int64)."""
    pdl_wait(PDL)
    dtype: tl.constexpr = k_out_ptr.dtype.element_ty
    t = tl.program_id(0).to(tl.int64)
    if STORE:
        cache_row = cache_ptr + tl.load(slots_ptr + t) * stride_cache
    j = tl.arange(0, BLOCK_HALF)
    j_ok = j < HALF
    cs = tl.load(cos_ptr + t * stride_ct + j, mask=j_ok, other=0.0).to(tl.float32)
    sn = tl.load(sin_ptr + t * stride_st + j, mask=j_ok, other=0.0).to(tl.float32)
    if INTERLEAVED:
        i1, i2 = 2 * j, 2 * j + 1
    else:
        i1, i2 = j, j + HALF
    d = tl.arange(0, BLOCK_D)
    if HAS_Q:  # the queries: rotate the first 2·HALF columns of every head, copy the rest
        heads = tl.arange(0, BLOCK_H)
        h_ok = heads < H
        m = h_ok[:, None] & j_ok[None, :]
        q_rows = q_ptr + t * stride_qt + heads[:, None].to(tl.int64) * stride_qh
        o_rows = q_out_ptr + (t * H + heads[:, None].to(tl.int64)) * D
        x1 = tl.load(q_rows + i1[None, :], mask=m, other=0.0).to(tl.float32)
        x2 = tl.load(q_rows + i2[None, :], mask=m, other=0.0).to(tl.float32)
        o1, o2 = _rotate_pairs(x1, x2, cs[None, :], sn[None, :], dtype, INTERP)
        tl.store(o_rows + j[None, :], o1, mask=m)
        tl.store(o_rows + HALF + j[None, :], o2, mask=m)
        rest = h_ok[:, None] & ((d >= 2 * HALF) & (d < D))[None, :]
        tl.store(o_rows + d[None, :], tl.load(q_rows + d[None, :], mask=rest, other=0.0), mask=rest)
    # the key: LayerNorm in fp32 (rounded once, as torch's kernel does), then the same rotation
    d_ok = d < D
    k_in = k_ptr + t * stride_kt
    x = tl.load(k_in + d, mask=d_ok, other=0.0).to(tl.float32)
    inv_d = tl.cast(inv_d, tl.float32)
    mean = tl.sum(x, axis=0) * inv_d
    xc = tl.where(d_ok, x - mean, 0.0)
    rstd = tl.math.rsqrt(tl.sum(xc * xc, axis=0) * inv_d + tl.cast(eps, tl.float32))
    w = tl.load(w_ptr + d, mask=d_ok, other=0.0).to(tl.float32)
    b = tl.load(b_ptr + d, mask=d_ok, other=0.0).to(tl.float32)
    kn = _round_to(xc * rstd * w + b, dtype, INTERP)
    k_row = k_out_ptr + t * D
    tl.store(k_row + d, kn, mask=d_ok & (d >= 2 * HALF))
    if STORE:
        tl.store(cache_row + d, kn, mask=d_ok & (d >= 2 * HALF))
    # the rotated pairs: their inputs and weights loaded again in pair order (cache hits) and
    # normed by the same expression, so the same bits as kn's without gathering registers
    x1 = _round_to((tl.load(k_in + i1, mask=j_ok, other=0.0).to(tl.float32) - mean) * rstd
                   * tl.load(w_ptr + i1, mask=j_ok, other=0.0).to(tl.float32)
                   + tl.load(b_ptr + i1, mask=j_ok, other=0.0).to(tl.float32), dtype, INTERP).to(tl.float32)  # fmt: skip
    x2 = _round_to((tl.load(k_in + i2, mask=j_ok, other=0.0).to(tl.float32) - mean) * rstd
                   * tl.load(w_ptr + i2, mask=j_ok, other=0.0).to(tl.float32)
                   + tl.load(b_ptr + i2, mask=j_ok, other=0.0).to(tl.float32), dtype, INTERP).to(tl.float32)  # fmt: skip
    o1, o2 = _rotate_pairs(x1, x2, cs, sn, dtype, INTERP)
    tl.store(k_row + j, o1, mask=j_ok)
    tl.store(k_row + HALF + j, o2, mask=j_ok)
    if STORE:
        tl.store(cache_row + j, o1, mask=j_ok)
        tl.store(cache_row + HALF + j, o2, mask=j_ok)


def indexer_rope_qk_supports(q: torch.Tensor | None, k: torch.Tensor, cos: torch.Tensor, weight: torch.Tensor) -> bool:
    """``q [T, H, D]`` (or None) and ``k [T, D]`` of one 16-bit or fp32 dtype with unit last strides
    (``H ≤ 64``, ``D ≤ 1024``), ``cos [T, R/2]`` of that dtype, ``weight`` (and the bias) ``[D]``."""
    if q is None:  # the key alone: the same checks on it as one head
        q = k.unsqueeze(1) if k.dim() == 2 else k
    return (
        q.dim() == 3 and k.dim() == 2 and q.shape[0] == k.shape[0] and q.shape[2] == k.shape[1]
        and q.dtype in _DTYPES and q.shape[1] <= 64 and k.shape[1] <= 1024
        and all(t.dtype == q.dtype and t.stride(-1) == 1 for t in (q, k, cos, weight))
        and cos.dim() == 2 and cos.shape[0] == q.shape[0] and 0 < 2 * cos.shape[1] <= q.shape[2]
        and weight.shape == (k.shape[1],)
    )  # fmt: skip


def indexer_rope_qk_triton(
    q: torch.Tensor | None, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, weight: torch.Tensor,
    bias: torch.Tensor, eps: float, interleaved: bool,
    cache: torch.Tensor | None = None, slots: torch.Tensor | None = None,
) -> tuple[torch.Tensor | None, torch.Tensor]:  # fmt: skip
    """One kernel for :func:`~breakgraph.kernels.rope.indexer_rope_qk`: new contiguous ``(q_out,
    k_out)`` (``q`` None: ``(None, k_out)``, the kernel compiled without the queries' part), and
    with ``cache``/``slots`` (:func:`cache_store_supports`) the ``k_out`` rows written into
    ``cache[slots]`` too. Needs :func:`indexer_rope_qk_supports` (and ``bias`` like
    ``weight``). Graph-safe."""
    t, d = k.shape
    h = q.shape[1] if q is not None else 0
    q_out = torch.empty(t, h, d, dtype=q.dtype, device=q.device) if q is not None else None
    k_out = torch.empty(t, d, dtype=k.dtype, device=k.device)
    store = cache is not None
    if t:
        half = cos.shape[1]
        q_in = q if q is not None else k.unsqueeze(1)  # placeholder pointers without queries
        _indexer_rope_qk_kernel[(t,)](
            q_in, k, cos, sin, weight, bias, q_out if q is not None else k_out, k_out,
            cache if store else k_out, slots if store else k_out,
            h, d, half, q_in.stride(0), q_in.stride(1), k.stride(0), cos.stride(0), sin.stride(0),
            cache.stride(0) if store else 0, 1.0 / d, eps,
            INTERLEAVED=interleaved, BLOCK_H=triton.next_power_of_2(max(h, 1)), BLOCK_D=triton.next_power_of_2(d),
            BLOCK_HALF=triton.next_power_of_2(half), INTERP=interpreting(), STORE=store, num_warps=4,
            HAS_Q=q is not None, **pdl_launch(k.device),
        )  # fmt: skip
    return q_out, k_out
