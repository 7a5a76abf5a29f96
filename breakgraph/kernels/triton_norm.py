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

from breakgraph.kernels.dispatch import interpreting
from breakgraph.kernels.fp8 import FP8_DTYPE
from breakgraph.kernels.pdl import pdl_launch, pdl_wait
from breakgraph.kernels.triton_fp8 import QUANT_GROUP, to_fp8

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
    x_ptr, res_ptr, w_ptr, out_ptr, res_out_ptr, q_ptr, s_ptr,
    M, N, stride_x, stride_res, stride_sm, stride_sg, inv_n, eps,
    HAS_RESIDUAL: tl.constexpr, QUANT: tl.constexpr, GROUP: tl.constexpr, BLOCK: tl.constexpr,
    INTERP: tl.constexpr, PDL: tl.constexpr = False,
):  # fmt: skip
    """Row ``pid`` of ``M``: ``out = norm(x (+ res))`` (and ``res_out = x + res``). ``QUANT``: also
    the e4m3 codes ``q [Mp, N]`` and fp32 scales ``s`` (strides ``stride_sm, stride_sg``) of ``out``
    per ``GROUP`` columns, as ``_act_quant_kernel`` computes them from ``out``; programs
    ``M ≤ pid < Mp`` write the zero padding rows (codes 0, scale 1e-12/448). ``PDL``: the
    weight is loaded before :func:`~breakgraph.kernels.pdl.pdl_wait`."""
    dtype: tl.constexpr = out_ptr.dtype.element_ty
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    real = row < M
    mask = (cols < N) & real
    if PDL:  # a weight: loaded while the kernel before this one runs
        w_early = tl.load(w_ptr + cols, mask=mask, other=0.0)
    pdl_wait(PDL)
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
    if PDL:
        w = w_early.to(tl.float32)
    else:
        w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    y = _round_to(w * h, dtype, INTERP)
    tl.store(out_ptr + row * N + cols, y, mask=mask)
    if QUANT:
        groups: tl.constexpr = BLOCK // GROUP
        yg = tl.reshape(y.to(tl.float32), (groups, GROUP))
        amax = tl.max(tl.abs(yg), axis=1)
        # IEEE-rounded divisions, as _act_quant_kernel does them: the same codes and scales
        scale = tl.math.div_rn(tl.maximum(amax, 1e-12), tl.full(amax.shape, 448.0, tl.float32))
        q = to_fp8(tl.math.div_rn(yg, scale[:, None] + tl.zeros_like(yg)), INTERP)
        # 2-D offsets built from aranges, not a reshape of ``cols``: the compiler then sees runs
        # of GROUP contiguous bytes and stores 16 at a time (a reshaped ``cols`` gave one-byte
        # stores, one L2 sector each: the kernel ran 9x slower than without QUANT on the H200)
        offs = tl.arange(0, groups)[:, None] * GROUP + tl.arange(0, GROUP)[None, :]
        tl.store(q_ptr + row * N + offs, q, mask=offs < N)
        g = tl.arange(0, groups)
        tl.store(s_ptr + row * stride_sm + g * stride_sg, scale, mask=g * GROUP < N)


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


def default_warps(n: int, quant: bool) -> int:
    """Warps of the row kernel for rows of ``n``: one per 512 columns of the power-of-two block,
    at most 16, or 8 when it also quantises. The warp count sets the order in which a row's
    squares are summed: launches with different counts may differ by an ulp of ``rstd``."""
    return max(1, min(8 if quant else 16, triton.next_power_of_2(n) // 512))


def _launch(
    x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float, quant_pad_rows: int = 0,
    num_warps: int | None = None,
):  # fmt: skip
    """Launch the row kernel with fresh outputs; ``num_warps`` overrides the default."""
    n = x.shape[-1]
    x2 = x.reshape(-1, n)
    m = x2.shape[0]
    out = torch.empty_like(x, memory_format=torch.contiguous_format)
    res = None if residual is None else residual.reshape(-1, n)
    res_out = None if residual is None else torch.empty_like(out)
    q = scale = None
    rows = m
    if quant_pad_rows:
        rows = -(-m // quant_pad_rows) * quant_pad_rows
        q = torch.empty(rows, n, dtype=FP8_DTYPE, device=x.device)
        scale = torch.empty(n // QUANT_GROUP, rows, dtype=torch.float32, device=x.device).t()
    if rows:
        block = triton.next_power_of_2(n)
        _rms_norm_kernel[(rows,)](
            x2, res, weight, out, res_out, q, scale,
            m, n, x2.stride(0), 0 if res is None else res.stride(0), *(scale.stride() if quant_pad_rows else (0, 0)),
            1.0 / n, eps,
            HAS_RESIDUAL=res is not None, QUANT=bool(quant_pad_rows), GROUP=QUANT_GROUP, BLOCK=block,
            INTERP=interpreting(), num_warps=num_warps or default_warps(n, bool(quant_pad_rows)),
            **pdl_launch(x.device),
        )  # fmt: skip
    return out, res_out, q, scale


def rms_norm_triton(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """:func:`~breakgraph.kernels.norm.rms_norm_ref` in one kernel: ``x [..., N]`` → a new
    contiguous tensor of ``x``'s shape and dtype. Needs :func:`supports`. Graph-safe."""
    return _launch(x, None, weight, eps)[0]


def fused_add_rms_norm_triton(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`~breakgraph.kernels.norm.fused_add_rms_norm_ref` in one kernel: returns new
    contiguous ``(rms_norm(x + residual), x + residual)``. Needs :func:`supports`. Graph-safe."""
    return _launch(x, residual, weight, eps)[:2]


def supports_quant(x: torch.Tensor, weight: torch.Tensor, residual: torch.Tensor | None = None) -> bool:
    """Whether :func:`rms_norm_quant_triton` handles these tensors: :func:`supports`, bf16, and a
    width that is a whole number of quantisation groups."""
    return supports(x, weight, residual) and x.dtype == torch.bfloat16 and x.shape[-1] % QUANT_GROUP == 0


def rms_norm_quant_triton(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None, pad_rows: int = 1
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor, torch.Tensor]:
    """RMSNorm (with the residual add when ``residual`` is given) and the FP8 quantisation of its
    output in one kernel: returns ``(normed, x + residual or None, q, scale)`` where the sum is
    :func:`fused_add_rms_norm_triton`'s and ``normed`` is :func:`rms_norm_triton`'s
    (:func:`fused_add_rms_norm_triton`'s) up to the order in which a row's squares are summed
    (bit for bit where :func:`default_warps` gives both launches one count: ``N ≤ 4096``), and
    ``(q [Mp, N] e4m3, scale [Mp, N/128] fp32, column-major)`` is
    :func:`~breakgraph.kernels.triton_fp8.act_quant` of ``normed`` (2-D view ``[M, N]``) with
    ``column_major_scale=True`` and ``pad_rows``, bit for bit. Needs :func:`supports_quant`.
    Graph-safe."""
    return _launch(x, residual, weight, eps, quant_pad_rows=max(1, pad_rows))
