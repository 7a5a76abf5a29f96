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

from breakgraph.kernels.triton_fp8 import interpreting
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
