"""FP8 (e4m3) block-scaled dense linear on the GPU: activation quantisation + block-scaled GEMM.

``y = x @ dequant(W).T`` for ``W [N, K]`` float8_e4m3fn with one fp32 scale per 128×128 tile
(``weight_scale_inv [ceil(N/128), ceil(K/128)]``, multiply to dequantise). Paths, best first:

1. ``torch._scaled_mm`` (cuBLASLt, "1x128 × 128x128" blockwise recipe): the activations are
   quantised per (token, 128-column group) by :func:`act_quant` into ``a8 [M, K]`` and a
   column-major ``scale_a [M, K/128]`` (strides ``(1, M)``); ``scale_b`` is
   ``weight_scale_inv.t()`` — a free view, because the checkpoint's row-major
   ``[N/128, K/128]`` transposed *is* the column-major ``[K/128, N/128]`` that ``_scaled_mm``
   wants. Needs ``K`` a multiple of 512 (:data:`SCALED_MM_K_MULTIPLE`), ``N`` of 64 and bf16
   output; whether this torch/cuBLAS accepts the recipe is probed once per device
   (:func:`scaled_mm_blockwise_mode`) and cached.
2. :func:`fp8_gemm`: a Triton block-scaled GEMM (any ``M``/``N``/``K``, 128-wide k-blocks),
   activations either quantised the same way (``W8A8``, default) or kept in bf16 with the
   weight tile dequantised in registers (``W8A16``; ``bf16(w·s)`` as the dequantising twin
   computes it, so it matches the twin to summation order). Where the output tiles cannot
   fill the GPU (a short prompt through a projection with large ``K`` and small ``N``), the
   K range is split over several programs that store fp32 partials, summed in a fixed order
   (deterministic) by the last of a tile's programs to finish (arrivals counted per tile), or
   by a second kernel where the counters cannot be used.
   Paths 1 and 2 are chosen per shape and row count by measurement
   (:mod:`breakgraph.kernels.fp8_gemm_choice`).
3. Dequantise + matmul (:func:`breakgraph.kernels.fp8.fp8_block_linear_ref`) for other blocks.

Numerics: per-token-group e4m3 activations have 3 mantissa bits, so on random data the W8A8
result differs from the bf16-activation twin by ≈2.5% (relative Frobenius error), the price of
the fp8 tensor cores that the DeepSeek/GLM FP8 checkpoints were trained with. Against
:func:`fp8_gemm_ref` (the same quantised activations, dequantised, fp32 matmul) it agrees to
fp32/bf16 rounding. No weight preparation is needed: every layout used here is a view of the
checkpoint tensors.

Kernels run under ``TRITON_INTERPRET=1`` on CPU tensors too (tests): there, bf16/fp8 dot
operands are upcast to fp32 and fp32→e4m3 rounding is done explicitly (the interpreter's own
conversion does not carry mantissa overflow into the exponent).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from functools import partial
from typing import TYPE_CHECKING

import torch
import triton
import triton.language as tl

from breakgraph.kernels import fp8_gemm_choice
from breakgraph.kernels.dispatch import device_index, interpreting, num_sms
from breakgraph.kernels.fp8 import FP8_DTYPE, FP8_MAX, block_dequant, fp8_block_linear_ref
from breakgraph.kernels.pdl import pdl_launch, pdl_wait
from breakgraph.kernels.split_k import SPLIT_K_LOCK_SLOTS, _split_k_locks, _split_k_sum_kernel

if TYPE_CHECKING:
    from breakgraph.kernels.precompile import AheadCompiler

logger = logging.getLogger(__name__)

QUANT_GROUP = 128
_SCALE_EPS = 1e-12


# --------------------------------------------------------------------------------------------
# jit helpers shared with triton_moe


@triton.jit
def _round_to_e4m3_grid(v):
    """Round fp32 ``v`` (|v| ≤ 448) to the nearest e4m3 value, ties to even, in fp32 arithmetic."""
    bits = v.to(tl.int32, bitcast=True)
    exp = ((bits >> 23) & 0xFF) - 127
    exp = tl.maximum(exp, -6)  # e4m3 subnormals share the 2^-9 spacing of the lowest binade
    ulp = ((exp - 3 + 127) << 23).to(tl.float32, bitcast=True)
    magic = 12582912.0  # 1.5 * 2^23: adding and subtracting it rounds |y| < 2^22 to an integer (RNE)
    y = v / ulp
    return ((y + magic) - magic) * ulp


@triton.jit
def to_fp8(v, INTERP: tl.constexpr):
    """fp32 → float8e4nv with round-to-nearest-even and saturation to ±448."""
    v = tl.clamp(v, -448.0, 448.0)
    if INTERP:
        v = _round_to_e4m3_grid(v)
    return v.to(tl.float8e4nv)


@triton.jit
def mma(a, b, acc, INTERP: tl.constexpr):
    """``acc + a @ b`` in fp32 (``tl.dot``); the interpreter cannot multiply bf16/fp8 operands."""
    if INTERP:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), acc)
    else:
        return tl.dot(a, b, acc)


# --------------------------------------------------------------------------------------------
# activation quantisation


@triton.jit
def _act_quant_kernel(
    x_ptr, q_ptr, s_ptr,
    M, M_OUT, K,
    stride_xm, stride_qm, stride_sm, stride_sg,
    BLOCK_M: tl.constexpr, GROUP: tl.constexpr, INTERP: tl.constexpr,
    PDL: tl.constexpr = False,
):  # fmt: skip
    pdl_wait(PDL)
    pid_m = tl.program_id(0)
    g = tl.program_id(1)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = g * GROUP + tl.arange(0, GROUP)
    col_ok = cols < K
    x = tl.load(
        x_ptr + rows[:, None].to(tl.int64) * stride_xm + cols[None, :],
        mask=(rows[:, None] < M) & col_ok[None, :],
        other=0.0,
    ).to(tl.float32)
    amax = tl.max(tl.abs(x), axis=1)
    # IEEE-rounded divisions, as torch does them: the codes and scales match the twin bit for bit
    scale = tl.math.div_rn(tl.maximum(amax, 1e-12), tl.full(amax.shape, 448.0, tl.float32))
    q = to_fp8(tl.math.div_rn(x, scale[:, None] + tl.zeros_like(x)), INTERP)
    out_ok = rows < M_OUT
    tl.store(
        q_ptr + rows[:, None].to(tl.int64) * stride_qm + cols[None, :],
        q,
        mask=out_ok[:, None] & col_ok[None, :],
    )
    tl.store(s_ptr + rows * stride_sm + g * stride_sg, scale, mask=out_ok)


def act_quant(
    x: torch.Tensor, group: int = QUANT_GROUP, *, column_major_scale: bool = True, pad_rows: int = 1
) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantise ``x [M, K]`` to e4m3 with one fp32 scale per (row, ``group`` columns).

    Returns ``(q [Mp, K] float8_e4m3fn, scale [Mp, ceil(K/group)] fp32)`` where ``Mp`` is ``M``
    rounded up to ``pad_rows`` (extra rows are zeros with a tiny scale). ``scale = amax/448``
    (dequantise by multiplying). ``column_major_scale`` lays the scale out with strides
    ``(1, Mp)``, as ``torch._scaled_mm``'s 1x128 recipe requires. Graph-safe.
    """
    if x.dim() != 2 or x.stride(-1) != 1:
        raise ValueError(
            f"act_quant: x must be 2-D with unit column stride, got shape {tuple(x.shape)} strides {x.stride()}"
        )
    m, k = x.shape
    mp = -(-m // pad_rows) * pad_rows
    ng = -(-k // group)
    q = torch.empty(mp, k, dtype=FP8_DTYPE, device=x.device)
    scale = (
        torch.empty(ng, mp, dtype=torch.float32, device=x.device).t()
        if column_major_scale
        else (torch.empty(mp, ng, dtype=torch.float32, device=x.device))
    )
    if mp and k:
        block_m = 16 if group >= 128 else 32
        grid = (triton.cdiv(mp, block_m), ng)
        _act_quant_kernel[grid](
            x, q, scale, m, mp, k, x.stride(0), q.stride(0), scale.stride(0), scale.stride(1),
            BLOCK_M=block_m, GROUP=group, INTERP=interpreting(), num_warps=4, **pdl_launch(x.device),
        )  # fmt: skip
    return q, scale


def act_quant_ref(x: torch.Tensor, group: int = QUANT_GROUP) -> tuple[torch.Tensor, torch.Tensor]:
    """Plain-PyTorch twin of :func:`act_quant` (row-major scale, no padding)."""
    m, k = x.shape
    ng = -(-k // group)
    xp = x.new_zeros((m, ng * group), dtype=torch.float32)
    xp[:, :k] = x.float()
    tiles = xp.view(m, ng, group)
    scale = tiles.abs().amax(dim=-1).clamp(min=_SCALE_EPS) / FP8_MAX
    q = (tiles / scale[..., None]).clamp(-FP8_MAX, FP8_MAX).view(m, ng * group)[:, :k].to(FP8_DTYPE)
    return q.contiguous(), scale


def act_dequant(q: torch.Tensor, scale: torch.Tensor, group: int = QUANT_GROUP) -> torch.Tensor:
    """``q [M, K]`` e4m3 × per-(row, group) ``scale`` → fp32."""
    k = q.shape[-1]
    return q.float() * scale.float().repeat_interleave(group, dim=-1)[..., :k]


# --------------------------------------------------------------------------------------------
# Triton block-scaled GEMM


@triton.jit
def scaled_update(
    acc, a, w, sw, sa, W_FP8: tl.constexpr, A_FP8: tl.constexpr, SWAP_AB: tl.constexpr, INTERP: tl.constexpr
):
    """``acc + a·wᵀ`` (``[BM, BN]``), or its transpose ``w·aᵀ`` (``[BN, BM]``) when ``SWAP_AB``,
    for one k-block with block scales.

    fp8 ``w`` with 16-bit ``a``: the tile is dequantised in registers, ``(w·sw)`` rounded to
    ``a``'s dtype exactly as the dequantising twin does, so the MMAs chain on one accumulator.
    fp8 ``w`` and fp8 ``a``: the k-block's fp32 partial sum is multiplied by ``sw`` and the
    per-row activation scales ``sa [BM]`` (a fresh accumulator per k-block, DeepSeek-style)."""
    if W_FP8 and A_FP8:
        if SWAP_AB:
            d = mma(w, tl.trans(a), tl.zeros_like(acc), INTERP)
            return acc + d * (sa[None, :] * sw)
        else:
            d = mma(a, tl.trans(w), tl.zeros_like(acc), INTERP)
            return acc + d * (sa[:, None] * sw)
    else:
        if W_FP8:
            w = (w.to(tl.float32) * sw).to(a.dtype)
        if SWAP_AB:
            return mma(w, tl.trans(a), acc, INTERP)
        else:
            return mma(a, tl.trans(w), acc, INTERP)


@triton.jit
def _fp8_gemm_kernel(
    a_ptr, as_ptr, w_ptr, ws_ptr, bias_ptr, c_ptr, out_ptr, lock_ptr,
    M, N, K, K_PER_SPLIT,
    stride_am, stride_asm, stride_asg, stride_wn, stride_wsn, stride_wsk, stride_cm,
    A_FP8: tl.constexpr, HAS_BIAS: tl.constexpr, SWAP_AB: tl.constexpr, SPLIT_K: tl.constexpr,
    FIXUP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    SCALE_BN: tl.constexpr, SCALE_BK: tl.constexpr, GROUP_M: tl.constexpr, INTERP: tl.constexpr,
    PDL: tl.constexpr = False, A_QUANT: tl.constexpr = False,
):  # fmt: skip
    """``c = Σ_kb (a[:, kb] · w[:, kb]ᵀ) · sa[:, kb] · sw[n // SCALE_BN, kb]``; ``a`` fp8 (with
    ``sa``) or 16-bit (then each ``w`` tile is dequantised to ``a``'s dtype in registers).
    ``A_QUANT``: 16-bit ``a`` quantised here, per row and k-block, to the e4m3 codes and scales
    :func:`_act_quant_kernel` writes (the same arithmetic), then multiplied as fp8 ``a``.
    ``SWAP_AB`` computes the transposed tile so that weight rows fill the 64-row MMA side.
    ``SPLIT_K > 1``: program ``(·, s)`` sums the k-range ``[s·K_PER_SPLIT, (s+1)·K_PER_SPLIT)``
    and stores its fp32 partial (no bias) in slice ``s`` of ``c`` (an ``[SPLIT_K, M, N]``
    workspace); :func:`_split_k_sum_kernel` adds the slices in order, or with ``FIXUP`` the
    last of a tile's programs to arrive does (``lock_ptr[pid]`` counts the arrivals and is
    reset to 0 by that program) and writes ``out`` (the same order and arithmetic as the sum
    kernel: the same bits, one launch fewer)."""
    pdl_wait(PDL)
    pid = tl.program_id(0)
    split = tl.program_id(1)
    num_m = tl.cdiv(M, BLOCK_M)
    num_n = tl.cdiv(N, BLOCK_N)
    # grouped order: GROUP_M row-tiles sweep the columns together so weight tiles are reused in L2
    per_group = GROUP_M * num_n
    first_m = (pid // per_group) * GROUP_M
    group_rows = tl.minimum(num_m - first_m, GROUP_M)
    pid_m = first_m + (pid % per_group) % group_rows
    pid_n = (pid % per_group) // group_rows

    if SPLIT_K > 1:  # this program's k-range: move the base pointers before the tile pointers
        k_first = split * K_PER_SPLIT
        a_ptr += k_first
        w_ptr += k_first
        as_ptr += (k_first // SCALE_BK) * stride_asg
        ws_ptr += (k_first // SCALE_BK) * stride_wsk
        K = tl.minimum(K - k_first, K_PER_SPLIT)

    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    m_ok = rm < M
    n_ok = rn < N
    a_ptrs = a_ptr + rm[:, None].to(tl.int64) * stride_am + rk[None, :]
    w_ptrs = w_ptr + rn[:, None].to(tl.int64) * stride_wn + rk[None, :]
    ws_row = ws_ptr + ((pid_n * BLOCK_N) // SCALE_BN) * stride_wsn
    if SWAP_AB:
        acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    else:
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k_ok = rk < K - k0
        a = tl.load(a_ptrs, mask=m_ok[:, None] & k_ok[None, :], other=0.0)
        w = tl.load(w_ptrs, mask=n_ok[:, None] & k_ok[None, :], other=0.0)
        kb = k0 // SCALE_BK
        sw = tl.load(ws_row + kb * stride_wsk)
        if A_QUANT:  # as _act_quant_kernel: IEEE-rounded divisions, the same codes and scales
            af = a.to(tl.float32)
            sa = tl.math.div_rn(tl.maximum(tl.max(tl.abs(af), axis=1), 1e-12), tl.full((BLOCK_M,), 448.0, tl.float32))
            a = to_fp8(tl.math.div_rn(af, sa[:, None] + tl.zeros_like(af)), INTERP)
        elif A_FP8:
            sa = tl.load(as_ptr + rm * stride_asm + kb * stride_asg, mask=m_ok, other=0.0)
        else:
            sa = 1.0
        acc = scaled_update(acc, a, w, sw, sa, True, A_FP8 or A_QUANT, SWAP_AB, INTERP)
        a_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    if SWAP_AB:
        offs = rm[None, :].to(tl.int64) * stride_cm + rn[:, None]
        mask = m_ok[None, :] & n_ok[:, None]
    else:
        offs = rm[:, None].to(tl.int64) * stride_cm + rn[None, :]
        mask = m_ok[:, None] & n_ok[None, :]
    if SPLIT_K == 1:
        if HAS_BIAS:
            acc += _bias_tile(bias_ptr, rn, n_ok, SWAP_AB)
        tl.store(c_ptr + offs, acc.to(c_ptr.dtype.element_ty), mask=mask)
    else:
        tl.store(c_ptr + split.to(tl.int64) * M * stride_cm + offs, acc, mask=mask)
        if FIXUP:
            tl.debug_barrier()  # every thread's partial is stored before the arrival is counted
            arrived = tl.atomic_add(lock_ptr + pid, 1, sem="acq_rel", scope="gpu")
            if arrived == SPLIT_K - 1:
                # the slices in order, read from L2 (.cg: not a stale L1 line), as the sum kernel adds them
                slice_ptrs = c_ptr + offs
                total = tl.load(slice_ptrs, mask=mask, other=0.0, cache_modifier=".cg")
                for _ in tl.static_range(1, SPLIT_K):
                    slice_ptrs += M * stride_cm
                    total += tl.load(slice_ptrs, mask=mask, other=0.0, cache_modifier=".cg")
                if HAS_BIAS:
                    total += _bias_tile(bias_ptr, rn, n_ok, SWAP_AB)
                tl.store(out_ptr + offs, total.to(out_ptr.dtype.element_ty), mask=mask)
                tl.atomic_xchg(lock_ptr + pid, 0)  # ready for the next launch (and graph replay)


@triton.jit
def _bias_tile(bias_ptr, rn, n_ok, SWAP_AB: tl.constexpr):
    """The fp32 bias of columns ``rn``, broadcast along the tile's row side."""
    b = tl.load(bias_ptr + rn, mask=n_ok, other=0.0).to(tl.float32)
    if SWAP_AB:
        return b[:, None]
    else:
        return b[None, :]


SPLIT_K_MAX = 8
SPLIT_K_MIN_BLOCKS = 4  # k-blocks of 128 per split, at least
def _gemm_config(m: int, n: int, k: int, num_sms: int) -> dict:
    """Tiles and split from the static shape only (graph-safe). Few rows take the swapped
    product (wgmma needs 64 rows). When the output tiles cannot fill the GPU — the many-``K``,
    few-``N`` projections of a short prompt — the K range is split over up to
    ``SPLIT_K_MAX`` programs, no more than ``k-blocks // SPLIT_K_MIN_BLOCKS`` of them (the
    last split may hold fewer blocks)."""
    if m <= 16:
        cfg = {"BLOCK_M": 16, "BLOCK_N": 64, "SWAP_AB": True, "num_warps": 4, "num_stages": 4}
    elif m <= 32:
        cfg = {"BLOCK_M": 32, "BLOCK_N": 64, "SWAP_AB": True, "num_warps": 4, "num_stages": 4}
    elif m <= 64:
        cfg = {"BLOCK_M": 64, "BLOCK_N": 128, "SWAP_AB": False, "num_warps": 4, "num_stages": 3}
    else:
        cfg = {"BLOCK_M": 128, "BLOCK_N": 128, "SWAP_AB": False, "num_warps": 8, "num_stages": 3}
    tiles = triton.cdiv(m, cfg["BLOCK_M"]) * triton.cdiv(n, cfg["BLOCK_N"])
    k_blocks = triton.cdiv(k, 128)
    cfg["SPLIT_K"] = max(1, min(SPLIT_K_MAX, num_sms // tiles, k_blocks // SPLIT_K_MIN_BLOCKS))
    return cfg


def fp8_gemm(
    a: torch.Tensor,
    a_scale: torch.Tensor | None,
    weight: torch.Tensor,
    weight_scale: torch.Tensor,
    block: tuple[int, int] = (128, 128),
    out_dtype: torch.dtype = torch.bfloat16,
    bias: torch.Tensor | None = None,
    config: dict | None = None,
    quantize_a: bool = False,
) -> torch.Tensor:
    """Triton block-scaled GEMM: ``a [M, K] @ dequant(weight [N, K]).T`` → ``[M, N] out_dtype``.

    ``a`` is either e4m3 with ``a_scale [M, ceil(K/128)]`` (any strides; :func:`act_quant`'s
    output) or bf16/fp16/fp32 with ``a_scale=None`` (weight tiles are dequantised to ``a``'s
    dtype in registers; ``quantize_a``: instead ``a`` is quantised in the kernel, per row and 128
    columns, exactly as :func:`act_quant` does it, and multiplied as e4m3 — the result of
    ``act_quant`` then this GEMM, bit for bit, in one launch). ``weight_scale [ceil(N/bn),
    ceil(K/bk)]``. Needs ``block == (128, 128)``.
    ``config`` overrides the tile choice (``FIXUP=False``: reduce a split K with the separate
    sum kernel). Graph-safe.
    """
    if tuple(block) != (128, 128):
        raise ValueError(f"fp8_gemm supports block (128, 128), got {tuple(block)}")
    m, k = a.shape
    n = weight.shape[0]
    if weight.shape[1] != k or weight.stride(1) != 1 or a.stride(1) != 1:
        raise ValueError(
            f"fp8_gemm: a {tuple(a.shape)} and weight {tuple(weight.shape)} must be K-contiguous with equal K"
        )
    a_fp8 = a.dtype == FP8_DTYPE
    if a_fp8 != (a_scale is not None):
        raise ValueError("fp8_gemm: a_scale must be given exactly when a is float8_e4m3fn")
    if quantize_a and a_fp8:
        raise ValueError("fp8_gemm: quantize_a needs 16- or 32-bit activations, a is float8_e4m3fn already")
    cfg = dict(_gemm_config(m, n, k, num_sms(a.device)), BLOCK_K=128, GROUP_M=8, FIXUP=True)
    cfg.update(config or {})
    if quantize_a and not cfg["SWAP_AB"] and "num_warps" not in (config or {}):
        cfg["num_warps"] = 8  # the 16-bit tile and its codes beside the accumulator: 4 warps spill (sm_90a)
    if 128 % cfg["BLOCK_N"] or cfg["BLOCK_K"] != 128:
        raise ValueError(f"fp8_gemm: BLOCK_N must divide 128 and BLOCK_K must be 128, got {cfg}")
    out = torch.empty(m, n, dtype=out_dtype, device=a.device)
    if m == 0 or n == 0:
        return out
    split = cfg["SPLIT_K"]
    k_per_split = max(128, triton.cdiv(triton.cdiv(k, 128), split) * 128)
    split = max(1, triton.cdiv(k, k_per_split))  # no empty split
    target = torch.empty(split, m, n, dtype=torch.float32, device=a.device) if split > 1 else out
    sa = a_scale if a_fp8 else weight_scale  # placeholder pointer when unused
    tiles = triton.cdiv(m, cfg["BLOCK_M"]) * triton.cdiv(n, cfg["BLOCK_N"])
    locks = _split_k_locks(a.device) if split > 1 and cfg["FIXUP"] and tiles <= SPLIT_K_LOCK_SLOTS else None
    _fp8_gemm_kernel[(tiles, split)](
        a, sa, weight, weight_scale, bias if bias is not None else out, target, out, locks if locks is not None else out,
        m, n, k, k_per_split,
        a.stride(0), sa.stride(0), sa.stride(1), weight.stride(0), weight_scale.stride(0), weight_scale.stride(1),
        target.stride(-2),
        A_FP8=a_fp8, A_QUANT=quantize_a, HAS_BIAS=bias is not None, SCALE_BN=block[0], SCALE_BK=block[1],
        INTERP=interpreting(),
        **dict(cfg, SPLIT_K=split, FIXUP=locks is not None), **pdl_launch(a.device),
    )  # fmt: skip
    if split > 1 and locks is None:
        block_sum = 1024
        _split_k_sum_kernel[(triton.cdiv(m * n, block_sum),)](
            target, bias if bias is not None else out, out, m * n, n,
            SPLIT_K=split, HAS_BIAS=bias is not None, BLOCK=block_sum, num_warps=4,
        )  # fmt: skip
    return out


def fp8_gemm_ref(
    a: torch.Tensor,
    a_scale: torch.Tensor | None,
    weight: torch.Tensor,
    weight_scale: torch.Tensor,
    block: tuple[int, int] = (128, 128),
    out_dtype: torch.dtype = torch.bfloat16,
    bias: torch.Tensor | None = None,
    config: dict | None = None,
) -> torch.Tensor:
    """Plain-PyTorch twin of :func:`fp8_gemm` (fp32 math on dequantised operands)."""
    af = act_dequant(a, a_scale, block[1]) if a_scale is not None else a.float()
    out = af @ block_dequant(weight, weight_scale, block, torch.float32).t()
    if bias is not None:
        out = out + bias.float()
    return out.to(out_dtype)


# --------------------------------------------------------------------------------------------
# torch._scaled_mm blockwise probe and the dense linear


_SCALED_MM_MODE: dict[int, str | None] = {}


def _scaled_mm_call(
    x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, pad_rows: int,
    x_fp8: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:  # fmt: skip
    m = x.shape[0]
    a8, sa = x_fp8 if x_fp8 is not None else act_quant(x, QUANT_GROUP, column_major_scale=True, pad_rows=pad_rows)
    out = torch._scaled_mm(a8, weight.t(), scale_a=sa, scale_b=scale.t(), out_dtype=torch.bfloat16)
    return out if out.shape[0] == m else out[:m]


def quant_pad_rows(device: torch.device) -> int:
    """The row padding ``_scaled_mm`` needs of quantised activations on ``device`` (16 where the
    probe answered ``"pad16"``, else 1): what a producer that quantises for the FP8 linears
    (:func:`~breakgraph.kernels.triton_norm.rms_norm_quant_triton`) pads to."""
    return 16 if scaled_mm_blockwise_mode(device) == "pad16" else 1


# cuBLASLt reads the 128×128 weight scales with their row stride rounded up to 4 k-blocks: a K
# that is not a multiple of 4 × 128 gives wrong products without an error (H200, torch 2.11 +
# CUDA 13: relative error 4.4 at K = 256, ~1e3 at K = 384) or "Invalid scaling configuration"
# when the scales are padded; so such K never take _scaled_mm.
SCALED_MM_K_MULTIPLE = 512
# Output widths that are not a multiple of 128 (kv_a's 576) run with a partial last scale block;
# the probe checks one (N = 320), and N must keep bf16 rows 128-byte aligned.
SCALED_MM_N_MULTIPLE = 64
_PROBE_SHAPES = ((512, 384), (1024, 320))


def scaled_mm_blockwise_mode(device: torch.device) -> str | None:
    """Whether ``torch._scaled_mm`` takes the 1x128 × 128x128 blockwise recipe on ``device``.

    Returns ``"any"`` (any row count), ``"pad16"`` (row counts padded to 16: cuBLASLt finds no
    algorithm below 16 rows on the H200) or ``None``. Probed once per device with random
    problems of :data:`_PROBE_SHAPES` (``K`` a multiple of :data:`SCALED_MM_K_MULTIPLE`, one
    ``N`` not a multiple of 128) checked against :func:`fp8_gemm_ref`; never probed during
    CUDA-graph capture (then ``None`` is returned without caching, so the caller's warm-up
    decides).
    """
    if device.type != "cuda" or not hasattr(torch, "_scaled_mm"):
        return None
    idx = device_index(device)
    if idx in _SCALED_MM_MODE:
        return _SCALED_MM_MODE[idx]
    if torch.cuda.is_current_stream_capturing():
        return None
    gen = torch.Generator(device=device).manual_seed(1234)
    from breakgraph.kernels.fp8 import block_quant

    weights = [block_quant(torch.randn(n, k, device=device, generator=gen)) for k, n in _PROBE_SHAPES]

    def works(rows: tuple[int, ...], pad: int) -> bool:
        for (k, _), (w8, ws) in zip(_PROBE_SHAPES, weights):
            for m in rows:
                x = torch.randn(m, k, device=device, generator=gen).bfloat16()
                try:
                    got = _scaled_mm_call(x, w8, ws, pad).float()
                except (RuntimeError, NotImplementedError, ValueError, TypeError):
                    return False
                a8, sa = act_quant_ref(x)
                want = fp8_gemm_ref(a8, sa, w8, ws, out_dtype=torch.float32)
                err = ((got - want).norm() / want.norm().clamp(min=1e-30)).item()
                if not err < 1e-2:
                    return False
        return True

    mode = "any" if works((1, 7, 64, 200), 1) else ("pad16" if works((1, 7, 64, 200), 16) else None)
    _SCALED_MM_MODE[idx] = mode
    return mode


def reads_quantized_input(m: int, k: int, n: int, x_dtype: torch.dtype, device: torch.device) -> bool:
    """Whether :func:`fp8_linear` (path ``auto``) on ``m`` rows of a ``[n, k]`` weight with
    128×128 blocks takes its activations quantised (the W8A8 paths: ``_scaled_mm`` and the
    Triton W8A8 GEMM, which read a producer's ``x_fp8``); False where it reads them as they are
    (the GEMV and W8A16). The W8A8 GEMM that quantises its activations itself counts as reading
    them quantised: given a producer's codes it takes them (one launch either way)."""
    cublas_ok = x_dtype == torch.bfloat16 and scaled_mm_takes(k, n, device)
    return fp8_gemm_choice.choose(m, k, n, device_index(device), cublas_ok) in ("scaled_mm", "triton", "triton_fused_quant")


def scaled_mm_takes(k: int, n: int, device: torch.device) -> bool:
    """Whether a bf16 ``[M, k] @ [k, n]`` FP8 linear may run through ``_scaled_mm`` on ``device``
    (the probe passed and the shape meets :data:`SCALED_MM_K_MULTIPLE` /
    :data:`SCALED_MM_N_MULTIPLE`)."""
    return (
        k % SCALED_MM_K_MULTIPLE == 0
        and n % SCALED_MM_N_MULTIPLE == 0
        and scaled_mm_blockwise_mode(device) is not None
    )


def fp8_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    scale: torch.Tensor,
    block: tuple[int, int],
    bias: torch.Tensor | None = None,
    *,
    path: str = "auto",
    x_fp8: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """GPU FP8 block-scaled linear ``x [..., K] @ dequant(weight [N, K]).T`` (+ bias).

    ``path``: ``auto`` (per shape and row count, the fastest of ``_scaled_mm``, the Triton W8A8
    and W8A16 GEMMs and the few-row GEMV as :mod:`breakgraph.kernels.fp8_gemm_choice` measured
    it), ``scaled_mm`` (where cuBLAS can run the shape, else Triton W8A8), ``triton`` (W8A8),
    ``triton_w8a16`` (bf16 activations), ``triton_gemv`` (bf16 activations, few rows:
    :mod:`breakgraph.kernels.triton_fp8_gemv`), ``triton_fused_quant`` (``triton``'s result in
    one launch: up to ``FUSED_QUANT_MAX_M`` rows without ``x_fp8`` the GEMM quantises the
    activations itself; otherwise exactly ``triton``), ``dequant``.

    ``x_fp8``: ``x`` already quantised, ``(q [Mp, K] e4m3, scale [Mp, K/128] fp32)`` with
    ``column_major_scale=True`` and ``pad_rows=quant_pad_rows(device)`` as :func:`act_quant`
    returns them for ``x``'s rows (``Mp ≥ M``): the W8A8 paths take it instead of quantising;
    W8A16 and the GEMV ignore it.
    """
    lead, k = x.shape[:-1], x.shape[-1]
    n = weight.shape[0]
    x2 = x.reshape(-1, k)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    block = tuple(block)
    if block != (128, 128) or path == "dequant" or not scale.is_contiguous():
        return fp8_block_linear_ref(x, weight, scale, block, bias)
    cublas_ok = x.dtype == torch.bfloat16 and scaled_mm_takes(k, n, x.device)
    if path == "auto":
        path = fp8_gemm_choice.choose(x2.shape[0], k, n, device_index(x.device), cublas_ok)
    if path == "scaled_mm" and cublas_ok:
        pad = quant_pad_rows(x.device)
        given = x_fp8 if x_fp8 is not None and x_fp8[0].shape[0] == -(-x2.shape[0] // pad) * pad else None
        out = _scaled_mm_call(x2, weight, scale, pad, given)
        if bias is not None:
            out = out + bias
        return out.reshape(*lead, n)
    if path == "triton_gemv":
        from breakgraph.kernels.triton_fp8_gemv import fp8_gemv

        out = fp8_gemv(x2, weight, scale, bias, x.dtype)
    elif path == "triton_w8a16":
        out = fp8_gemm(x2, None, weight, scale, block, x.dtype, bias)
    elif path == "triton_fused_quant" and x_fp8 is None and x2.shape[0] <= fp8_gemm_choice.FUSED_QUANT_MAX_M:
        out = fp8_gemm(x2, None, weight, scale, block, x.dtype, bias, quantize_a=True)
    else:
        m = x2.shape[0]
        if x_fp8 is not None and x_fp8[0].shape[0] >= m:
            a8, sa = x_fp8[0][:m], x_fp8[1][:m]
        else:
            a8, sa = act_quant(x2, QUANT_GROUP, column_major_scale=False)
        out = fp8_gemm(a8, sa, weight, scale, block, x.dtype, bias)
    return out.reshape(*lead, n)


# --------------------------------------------------------------------------------------------
# start-up timing of the paths (the table fp8_gemm_choice reads)


#: Bytes of weight copies one timed graph cycles through: several times an H200's 50 MB L2, so
#: that each call reads its weight from HBM, as a decode step reads each layer's.
TIMING_WEIGHT_BYTES = 200 << 20
_TIMING_MAX_COPIES = 64


def _graph_seconds(fns: list[Callable[[], object]], replays: int = 3) -> float:
    """Seconds per call of the callables ``fns``, captured in order into one CUDA graph and
    replayed (best of ``replays``); ``inf`` when one fails."""
    try:
        for fn in fns[:2]:
            fn()
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for fn in fns:
                fn()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        best = float("inf")
        for _ in range(replays):
            start.record()
            graph.replay()
            end.record()
            end.synchronize()
            best = min(best, start.elapsed_time(end) / 1e3 / len(fns))
        return best
    except (RuntimeError, NotImplementedError, ValueError):
        return float("inf")


def tune_fp8_paths(
    shapes: Iterable[tuple[int, int]], device: torch.device, max_m: int, ahead: AheadCompiler | None = None
) -> dict[tuple[int, int], tuple]:
    """Time every path for every ``(K, N)`` in ``shapes`` at each bucket ``<= max_m`` on
    ``device`` (CUDA, outside capture; random weights of that shape, each timed graph ten calls
    of one weight, or with ``BREAKGRAPH_FP8_TIMING_COLD=1`` cycling through copies of it past
    L2: :data:`TIMING_WEIGHT_BYTES`) and record the tables that
    :func:`~breakgraph.kernels.fp8_gemm_choice.choose` reads (``_scaled_mm`` only where it can run the shape). Returns
    ``{(K, N): table}``; logs one line per shape. With ``ahead``, the Triton kernels every
    candidate launches are first compiled in its worker processes at once
    (:mod:`breakgraph.kernels.precompile`), so that the timing reads them from Triton's cache."""
    from breakgraph.kernels.fp8 import block_quant

    idx = device_index(device)
    gen = torch.Generator(device=device).manual_seed(0)
    buckets = fp8_gemm_choice.timed_buckets(max_m)
    candidates = {
        (k, n): [p for p in fp8_gemm_choice.timed_paths() if p != "scaled_mm" or scaled_mm_takes(k, n, device)]
        for k, n in sorted(set(shapes))
    }  # the probe runs here, before any launch is recorded
    if ahead is not None:
        ahead.run_dry(partial(_launch_candidates, candidates, buckets, device))
        torch.cuda.synchronize(device)
    tuned: dict[tuple[int, int], tuple] = {}
    for (k, n), paths in candidates.items():
        w8, ws = block_quant(torch.randn(n, k, device=device, generator=gen) / k**0.5)
        copies = [(w8, ws)] * 10
        if fp8_gemm_choice.cold_timing():
            copies = [(w8, ws)] + [(w8.clone(), ws.clone()) for _ in range(_timing_copies(n * k) - 1)]
        timings: dict[int, dict[str, float]] = {}
        for bucket in buckets:
            x = torch.randn(bucket, k, device=device, generator=gen).to(torch.bfloat16)
            timings[bucket] = {
                path: _graph_seconds([partial(fp8_linear, x, w, s, (128, 128), path=path) for w, s in copies])
                for path in paths
                if fp8_gemm_choice.timed_at(path, bucket)
            }
            del x
        del copies
        table = fp8_gemm_choice.table_from_timings(timings)
        fp8_gemm_choice.set_table(idx, k, n, table)
        tuned[(k, n)] = table
        logger.info("fp8 linear K=%d N=%d: %s", k, n, fp8_gemm_choice.describe(table))
    return tuned


def _timing_copies(weight_bytes: int) -> int:
    """How many copies of a weight of ``weight_bytes`` one timed graph cycles through."""
    return max(2, min(_TIMING_MAX_COPIES, -(-TIMING_WEIGHT_BYTES // max(1, weight_bytes))))


def _launch_candidates(candidates: dict[tuple[int, int], list[str]], buckets: list[int], device: torch.device) -> None:
    """Run every candidate once on zero operands (the dry run that records their kernels)."""
    from breakgraph.kernels.fp8 import block_quant

    for (k, n), paths in candidates.items():
        w8, ws = block_quant(torch.zeros(n, k, device=device))
        for bucket in buckets:
            x = torch.zeros(bucket, k, device=device, dtype=torch.bfloat16)
            for path in paths:
                if fp8_gemm_choice.timed_at(path, bucket):
                    fp8_linear(x, w8, ws, (128, 128), path=path)
