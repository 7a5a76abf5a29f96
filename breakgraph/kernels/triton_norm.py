"""RMSNorm on the GPU: one program per row, plain and with the residual add fused in.

Rounding follows :func:`breakgraph.kernels.norm.rms_norm_ref` as torch runs it on CUDA. The
statistics in fp32: the squares rounded before they are summed, ``mean`` as the fp32 sum ×
``fp32(1/N)`` (as torch's CUDA ``mean`` computes it), then ``+ eps`` (no FMA contraction);
``rsqrt`` is ``rsqrt.approx``, which torch's ``rsqrtf`` also compiles to (Triton emits the
``.ftz`` form: the same on these normal inputs). Then ``h · rstd`` rounded to the input dtype,
and ``weight · that`` computed in fp32 and rounded once (what torch's bf16/fp16 ``mul`` does;
the fp32 product of two bf16 values is exact). The fused residual add is ``fp32(x) +
fp32(residual)`` rounded once, like torch's ``add``. The one difference from the twin is the
summation order of ``Σh²``: the fp32 mean square can differ from torch's in its last bits,
which moves ``h · rstd`` to a neighbouring value of the dtype in rare elements (see the tests).

Kernels run under ``TRITON_INTERPRET=1`` on CPU tensors too (tests): the interpreter's own
fp32 → bf16 cast truncates, so there the value is first rounded to the bf16 grid explicitly.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from breakgraph.kernels.triton_fp8 import interpreting

MAX_HIDDEN = 8192
_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


@triton.jit
def _round_to_bf16_grid(v):
    """Round fp32 ``v`` to the nearest bf16 value (ties to even), still as fp32."""
    bits = v.to(tl.int32, bitcast=True)
    bits = bits + 0x7FFF + ((bits >> 16) & 1)
    return ((bits >> 16) << 16).to(tl.float32, bitcast=True)


@triton.jit
def _round_to(v, dtype: tl.constexpr, INTERP: tl.constexpr):
    """fp32 ``v`` → ``dtype`` with round-to-nearest-even (also under the interpreter)."""
    if INTERP and dtype == tl.bfloat16:
        v = _round_to_bf16_grid(v)
    return v.to(dtype)


@triton.jit
def _mul_rn(a, b, INTERP: tl.constexpr):
    """``a · b`` rounded on its own, never contracted with a following add into an FMA (the
    twin rounds the squares before summing them, and the mean before adding eps)."""
    if INTERP:
        return a * b
    else:
        return libdevice.mul_rn(a, b)


@triton.jit
def _rms_norm_kernel(
    x_ptr, res_ptr, w_ptr, out_ptr, res_out_ptr,
    N, stride_x, stride_res, inv_n, eps,
    HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr, INTERP: tl.constexpr,
):  # fmt: skip
    dtype: tl.constexpr = out_ptr.dtype.element_ty
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < N
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(res_ptr + row * stride_res + cols, mask=mask, other=0.0)
        x = _round_to(x.to(tl.float32) + r.to(tl.float32), dtype, INTERP)
        tl.store(res_out_ptr + row * N + cols, x, mask=mask)
    h = x.to(tl.float32)
    # fp32 scalars whatever the caller passed (inductor hands Python floats over as fp64)
    inv_n = tl.cast(inv_n, tl.float32)
    eps = tl.cast(eps, tl.float32)
    rstd = tl.math.rsqrt(_mul_rn(tl.sum(_mul_rn(h, h, INTERP), axis=0), inv_n, INTERP) + eps)
    h = _round_to(h * rstd, dtype, INTERP).to(tl.float32)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * N + cols, _round_to(w * h, dtype, INTERP), mask=mask)


def supports(x: torch.Tensor, weight: torch.Tensor, residual: torch.Tensor | None = None) -> bool:
    """Whether the Triton kernels handle these tensors (else use the twin): bf16/fp16/fp32
    ``x`` with ``weight [N]`` (and ``residual``) of the same dtype, ``N ≤ MAX_HIDDEN``, unit
    last strides."""
    tensors = (x, weight) if residual is None else (x, weight, residual)
    return (
        x.dtype in _DTYPES
        and x.dim() >= 1
        and 0 < x.shape[-1] <= MAX_HIDDEN
        and weight.shape == (x.shape[-1],)
        and (residual is None or residual.shape == x.shape)
        and all(t.dtype == x.dtype and t.stride(-1) == 1 for t in tensors)
    )


def _launch(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float):
    n = x.shape[-1]
    x2 = x.reshape(-1, n)
    out = torch.empty_like(x, memory_format=torch.contiguous_format)
    res = None if residual is None else residual.reshape(-1, n)
    res_out = None if residual is None else torch.empty_like(out)
    if x2.shape[0]:
        block = triton.next_power_of_2(n)
        _rms_norm_kernel[(x2.shape[0],)](
            x2, res, weight, out, res_out,
            n, x2.stride(0), 0 if res is None else res.stride(0), 1.0 / n, eps,
            HAS_RESIDUAL=res is not None, BLOCK=block, INTERP=interpreting(),
            num_warps=max(1, min(16, block // 512)),
        )  # fmt: skip
    return out, res_out


def rms_norm_triton(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """:func:`~breakgraph.kernels.norm.rms_norm_ref` in one kernel: ``x [..., N]`` → a new
    contiguous tensor of ``x``'s shape and dtype. Needs :func:`supports`. Graph-safe."""
    return _launch(x, None, weight, eps)[0]


def fused_add_rms_norm_triton(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`~breakgraph.kernels.norm.fused_add_rms_norm_ref` in one kernel: returns new
    contiguous ``(rms_norm(x + residual), x + residual)``. Needs :func:`supports`. Graph-safe."""
    return _launch(x, residual, weight, eps)
