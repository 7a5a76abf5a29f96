"""FP8 block-scaled linear for few rows (decode): bf16 activations, weights streamed once.

``y = x @ dequant(W).T`` for ``x [M, K]`` bf16/fp16/fp32 (M = 1…64), ``W [N, K]`` e4m3 with
one fp32 scale per 128×128 tile. At these row counts the product is bound by reading ``W``
(a few MB per projection), so the kernel does only what that needs: no activation
quantisation launch, the K range split over enough programs to keep the memory system busy
(``SPLIT_K``; the fp32 partials are summed in a fixed order by the last of a tile's programs to
arrive, or by the sum kernel of :mod:`~breakgraph.kernels.split_k`), and the weights decoded
with integer operations instead of conversions:

* an e4m3 byte ``s eeee mmm`` moved into a bf16 (or fp32) bit pattern — sign to the top bit,
  ``eeee mmm`` four bits below the exponent's top — *is* the e4m3 value times ``2^-120``
  (the exponent biases are 7 and 127), exactly, subnormals included;
* the activations are multiplied by ``2^64`` (exact: a power of two) and the tile's block
  scale by ``2^56``, so every product ``w·2^-120 · x·2^64`` stays clear of fp32 subnormals
  (``|w·x| ≥ 2^-70`` does), and the block scale ``× 2^56`` undoes both per 128-column partial sum.

So the result is the fp32 block-scaled product of the exact operands (what
:func:`fp8_gemv_ref` computes), up to fp32 summation order — closer to it than the W8A16 GEMM,
which rounds each dequantised weight to bf16. Two inner products: ``DOT`` (tensor cores,
the weight tile on the 32…64-row side, the activations padded to ``BLOCK_M ≥ 16`` rows and
taken as bf16 — exact for bf16 activations, rounded for fp16/fp32 ones) or
broadcast multiply-and-sum in fp32 on the CUDA cores (``DOT=False``, for one to a few rows).
Which of this, ``_scaled_mm`` and the other Triton GEMMs runs a shape is measured at start-up
(:mod:`~breakgraph.kernels.fp8_gemm_choice`).

Runs under ``TRITON_INTERPRET=1`` on CPU tensors too (tests).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from breakgraph.kernels.dispatch import interpreting, num_sms
from breakgraph.kernels.fp8 import FP8_DTYPE, block_dequant
from breakgraph.kernels.pdl import pdl_launch, pdl_wait
from breakgraph.kernels.split_k import SPLIT_K_LOCK_SLOTS, _split_k_locks, _split_k_sum_kernel


@triton.jit
def _e4m3_bits_to_bf16(b):
    """e4m3 codes (``int32`` holding the byte) → bf16 ``value · 2^-120``, exactly."""
    bits = ((b & 0x80) << 8) | ((b & 0x7F) << 4)
    return bits.to(tl.int16).to(tl.bfloat16, bitcast=True)


@triton.jit
def _e4m3_bytes_to_bf16(b):
    """e4m3 codes as ``uint8`` → bf16 ``value · 2^-120`` (exactly), four codes per 32-bit word:
    ``prmt`` spreads two bytes into the low bytes of two 16-bit halves, ``<< 4`` places
    ``eeee mmm`` under the bf16 exponent's top and the sign at bit 11, and ``+ 15·(bit 11)``
    moves that sign to bit 15 (two codes per instruction: 2 instructions per code)."""
    return tl.inline_asm_elementwise(
        """
        {
        .reg .b32 lo, hi, slo, shi;
        prmt.b32 lo, $2, 0, 0x4140;
        prmt.b32 hi, $2, 0, 0x4342;
        shl.b32 lo, lo, 4;
        shl.b32 hi, hi, 4;
        and.b32 slo, lo, 0x08000800;
        and.b32 shi, hi, 0x08000800;
        mad.lo.u32 $0, slo, 15, lo;
        mad.lo.u32 $1, shi, 15, hi;
        }
        """,
        "=r,=r,r",
        [b],
        dtype=tl.bfloat16,
        is_pure=True,
        pack=4,
    )


@triton.jit
def _prefetch_l2(ptrs):
    """``prefetch.global.L2`` of the 128-byte line at each pointer (no value; a hint only)."""
    tl.inline_asm_elementwise("prefetch.global.L2 [$1]; // $0", "=r,l", [ptrs], dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def _e4m3_bits_to_fp32(b):
    """e4m3 codes (``int32`` holding the byte) → fp32 ``value · 2^-120``, exactly."""
    bits = ((b & 0x80) << 24) | ((b & 0x7F) << 20)
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def _fp8_gemv_kernel(
    x_ptr, w_ptr, ws_ptr, bias_ptr, c_ptr, out_ptr, lock_ptr,
    M, N, K, K_PER_SPLIT, SPLIT_K, alpha,
    stride_xm, stride_wn, stride_wsn, stride_wsk, stride_cm,
    W_FP8: tl.constexpr, HAS_BIAS: tl.constexpr, SPLIT: tl.constexpr, FIXUP: tl.constexpr, DOT: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, ASM: tl.constexpr, INTERP: tl.constexpr,
    MAX_SPLIT: tl.constexpr = 1, PDL: tl.constexpr = False,
):  # fmt: skip
    """Tile ``(pid_n, pid_m)`` of ``c = alpha · Σ_kb (w'[:, kb] · x'[:, kb]ᵀ) · sw'[kb] (+ bias)``
    over this program's k-range (``program_id(2)`` of ``SPLIT_K``), ``w'``/``x'``/``sw'`` the
    shifted operands of the module docstring (``W_FP8``; else ``w`` has ``x``'s 16-bit dtype
    and is used as it is, without block scales); the tile is computed transposed
    (``[BLOCK_N, BLOCK_M]``).
    ``BLOCK_N`` divides 128, so one block scale covers the tile's rows per k-block. Split K
    (``SPLIT``, ``SPLIT_K > 1`` programs per tile, a runtime count: one compiled kernel serves
    every split):
    the partial goes to slice ``s`` of ``c`` (``[SPLIT_K, M, N]`` fp32) and, with ``FIXUP``,
    the last program of the tile to arrive sums the slices in order into ``out`` and resets
    its counter ``lock_ptr[tile]`` (``MAX_SPLIT > 1``, a power of two ≥ ``SPLIT_K``: the loads of
    the slices unrolled and issued together; 1: one after another); without,
    ``_split_k_sum_kernel`` does. ``PDL``: the first two k-blocks of the tile's weight rows are prefetched into L2
    before :func:`~breakgraph.kernels.pdl.pdl_wait`, so they stream in while the kernel before
    this one runs."""
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    split = tl.program_id(2)
    k_first = split * K_PER_SPLIT
    k_end = tl.minimum(K, k_first + K_PER_SPLIT)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rk = tl.arange(0, 128)
    n_ok = rn < N
    m_ok = rm < M
    if W_FP8:  # the codes as bytes, for the integer decode
        w_base = w_ptr.to(tl.pointer_type(tl.uint8))
    else:
        w_base = w_ptr
    w_ptrs = w_base + rn[:, None].to(tl.int64) * stride_wn + (k_first + rk)[None, :]
    x_ptrs = x_ptr + rm[:, None].to(tl.int64) * stride_xm + (k_first + rk)[None, :]
    ws_ptrs = ws_ptr + ((pid_n * BLOCK_N) // 128) * stride_wsn + (k_first // 128) * stride_wsk
    if DOT:
        acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    else:  # products summed elementwise over the k-range, reduced once at the end
        acc3 = tl.zeros((BLOCK_N, BLOCK_M, 128), dtype=tl.float32)
    if PDL:  # the first k-blocks' weight rows into L2 while the kernel before this one runs
        _prefetch_l2(tl.where(n_ok, w_base + rn.to(tl.int64) * stride_wn + k_first, w_base))
        _prefetch_l2(tl.where(n_ok & (k_first + 128 < k_end), w_base + rn.to(tl.int64) * stride_wn + k_first + 128, w_base))
    pdl_wait(PDL)  # x and every store come after
    for k0 in range(k_first, k_end, 128):
        k_ok = rk < k_end - k0
        b = tl.load(w_ptrs, mask=n_ok[:, None] & k_ok[None, :], other=0)
        x = tl.load(x_ptrs, mask=m_ok[:, None] & k_ok[None, :], other=0.0)
        if W_FP8:
            x = x.to(tl.float32) * 18446744073709551616.0  # 2^64
            sw = tl.load(ws_ptrs) * 72057594037927936.0  # 2^56
            if INTERP:  # the interpreter has no 16-bit bitcasts or PTX; the fp32 pattern is the same value
                w = _e4m3_bits_to_fp32(b.to(tl.int32))
            elif ASM:
                w = _e4m3_bytes_to_bf16(b)
            elif DOT:
                w = _e4m3_bits_to_bf16(b.to(tl.int32))
            else:
                w = _e4m3_bits_to_fp32(b.to(tl.int32))
        else:
            sw = 1.0
            w = b
        if DOT:
            if INTERP:  # the interpreter multiplies no 16-bit operands
                acc += tl.dot(w.to(tl.float32), tl.trans(x.to(tl.float32))) * sw
            else:
                acc += tl.dot(w, tl.trans(x.to(w.dtype))) * sw
        else:  # x·sw rounds in fp32 (the product of the exact operands, to fp32 rounding)
            acc3 += w.to(tl.float32)[:, None, :] * (x.to(tl.float32) * sw)[None, :, :]
        w_ptrs += 128
        x_ptrs += 128
        ws_ptrs += stride_wsk
    if not DOT:
        acc = tl.sum(acc3, axis=2)
    offs = rm[None, :].to(tl.int64) * stride_cm + rn[:, None]
    mask = m_ok[None, :] & n_ok[:, None]
    if not SPLIT:
        acc = acc * alpha
        if HAS_BIAS:
            acc += tl.load(bias_ptr + rn, mask=n_ok, other=0.0).to(tl.float32)[:, None]
        tl.store(c_ptr + offs, acc.to(c_ptr.dtype.element_ty), mask=mask)
    else:
        tl.store(c_ptr + split.to(tl.int64) * M * stride_cm + offs, acc, mask=mask)
        if FIXUP:
            tile = pid_m * tl.num_programs(0) + pid_n
            tl.debug_barrier()  # every thread's partial is stored before the arrival is counted
            arrived = tl.atomic_add(lock_ptr + tile, 1, sem="acq_rel", scope="gpu")
            if arrived == SPLIT_K - 1:
                # read from L2 (.cg), added in slice order as the sum kernel adds
                total = tl.load(c_ptr + offs, mask=mask, other=0.0, cache_modifier=".cg")
                if MAX_SPLIT > 1:  # unrolled: the slices' loads are in flight together
                    for s in tl.static_range(1, MAX_SPLIT):
                        part = tl.load(c_ptr + s * M * stride_cm + offs, mask=mask & (s < SPLIT_K), other=0.0,
                                       cache_modifier=".cg")  # fmt: skip
                        total += part
                else:
                    for s in range(1, SPLIT_K):
                        total += tl.load(c_ptr + s * M * stride_cm + offs, mask=mask, other=0.0, cache_modifier=".cg")
                total = total * alpha
                if HAS_BIAS:
                    total += tl.load(bias_ptr + rn, mask=n_ok, other=0.0).to(tl.float32)[:, None]
                tl.store(out_ptr + offs, total.to(out_ptr.dtype.element_ty), mask=mask)
                tl.atomic_xchg(lock_ptr + tile, 0)  # ready for the next launch (and graph replay)


#: Programs one GEMV aims to launch per SM: several small programs per SM (one or two warps
#: each) keep more weight bytes in flight than one large one.
PROGRAMS_PER_SM = 8
#: Fewest k-blocks of 128 one program sums (below this the partials cost more than they save).
MIN_SPLIT_BLOCKS = 2


def gemv_config(m: int, n: int, k: int, sms: int, programs_per_sm: int = PROGRAMS_PER_SM) -> dict:
    """Tiles, split and launch options from the static shape only (graph-safe): tensor cores
    (``DOT``) with the byte decode in PTX (``ASM``); up to 32 rows (padded to 16/32) one warp
    on 32 weight rows (more warps would each decode the same weights for their share of the
    rows), above that four warps on 64 weight rows (wgmma; one warp would spill on sm_90a);
    K split so that about ``programs_per_sm`` programs per SM run, each summing at least
    :data:`MIN_SPLIT_BLOCKS` k-blocks."""
    block_m = 16 if m <= 16 else (32 if m <= 32 else 64)
    block_n = 32 if block_m <= 32 else 64
    tiles = triton.cdiv(m, block_m) * triton.cdiv(n, block_n)
    k_blocks = triton.cdiv(k, 128)
    split = max(1, min(triton.cdiv(programs_per_sm * sms, tiles), k_blocks // MIN_SPLIT_BLOCKS))
    return {"BLOCK_M": block_m, "BLOCK_N": block_n, "DOT": True, "ASM": True, "SPLIT_K": split, "FIXUP": True,
            "num_warps": 1 if block_m <= 32 else 4, "num_stages": 3}  # fmt: skip


def fp8_gemv(
    x: torch.Tensor,
    weight: torch.Tensor,
    weight_scale: torch.Tensor,
    bias: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
    config: dict | None = None,
) -> torch.Tensor:
    """``x [M, K] @ dequant(weight [N, K]).T (+ bias)`` → ``[M, N]`` in ``out_dtype`` (default
    ``x``'s dtype) for 128×128 block scales ``weight_scale [ceil(N/128), ceil(K/128)]``.
    ``x`` bf16/fp16/fp32 with unit column stride, ``weight`` K-contiguous e4m3. ``config``
    overrides :func:`gemv_config` (``BLOCK_N`` must divide 128; ``FIXUP=False``: the split K is
    summed by the separate kernel). Graph-safe."""
    m, k = x.shape
    n = weight.shape[0]
    if weight.dtype != FP8_DTYPE or weight.shape[1] != k or weight.stride(1) != 1 or x.stride(1) != 1:
        raise ValueError(
            f"fp8_gemv: weight {tuple(weight.shape)} must be float8_e4m3fn and K-contiguous like x {tuple(x.shape)}"
        )
    if tuple(weight_scale.shape) != (triton.cdiv(n, 128), triton.cdiv(k, 128)):
        raise ValueError(f"fp8_gemv: weight_scale {tuple(weight_scale.shape)} is not one scale per 128x128 block")
    return _gemv(x, weight, weight_scale, bias, out_dtype or x.dtype, 1.0, config)


def gemv_fp32_out(x: torch.Tensor, weight: torch.Tensor, alpha: float = 1.0, config: dict | None = None) -> torch.Tensor:
    """``alpha · (x [M, K] @ weight [N, K]ᵀ)`` in fp32 for 16-bit ``x`` and ``weight`` of one dtype
    (unit column strides): exact products summed in fp32, then one multiply by ``alpha`` — the
    contract of :func:`~breakgraph.kernels.linear.linear_fp32_out` (times ``alpha``) in one
    kernel for few rows, where cuBLAS launches a split-K GEMM, its reduction and the scaling.
    ``config`` as for :func:`fp8_gemv` (``ASM`` does not apply). Graph-safe."""
    if weight.dtype != x.dtype or x.dtype not in (torch.bfloat16, torch.float16) or weight.shape[1] != x.shape[1]:
        raise ValueError(f"gemv_fp32_out: x {x.dtype} {tuple(x.shape)} and weight {weight.dtype} "
                         f"{tuple(weight.shape)} must be one 16-bit dtype with equal K")  # fmt: skip
    if weight.stride(1) != 1 or x.stride(1) != 1:
        raise ValueError("gemv_fp32_out: x and weight must have unit column strides")
    return _gemv(x, weight, None, None, torch.float32, alpha, config)


def _gemv(
    x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor | None, bias: torch.Tensor | None,
    out_dtype: torch.dtype, alpha: float, config: dict | None,
) -> torch.Tensor:  # fmt: skip
    m, k = x.shape
    n = weight.shape[0]
    cfg = dict(gemv_config(m, n, k, num_sms(x.device)))
    cfg.update(config or {})
    if 128 % cfg["BLOCK_N"]:
        raise ValueError(f"fp8_gemv: BLOCK_N must divide 128, got {cfg['BLOCK_N']}")
    out = torch.empty(m, n, dtype=out_dtype, device=x.device)
    if m == 0 or n == 0:
        return out
    k_per_split = max(128, triton.cdiv(triton.cdiv(k, 128), cfg["SPLIT_K"]) * 128)
    split = max(1, triton.cdiv(k, k_per_split))  # no empty split
    grid = (triton.cdiv(n, cfg["BLOCK_N"]), triton.cdiv(m, cfg["BLOCK_M"]), split)
    locks = None
    if split > 1 and cfg["FIXUP"] and grid[0] * grid[1] <= SPLIT_K_LOCK_SLOTS:
        locks = _split_k_locks(x.device)
    target = torch.empty(split, m, n, dtype=torch.float32, device=x.device) if split > 1 else out
    ws = weight_scale if weight_scale is not None else out  # placeholder pointer without block scales
    _fp8_gemv_kernel[grid](
        x, weight, ws, bias if bias is not None else out, target, out, locks if locks is not None else out,
        m, n, k, k_per_split, split, alpha,
        x.stride(0), weight.stride(0), ws.stride(0), ws.stride(1), target.stride(-2),
        W_FP8=weight_scale is not None, HAS_BIAS=bias is not None, SPLIT=split > 1, FIXUP=locks is not None,
        DOT=cfg["DOT"], BLOCK_M=cfg["BLOCK_M"], BLOCK_N=cfg["BLOCK_N"], ASM=cfg["ASM"], INTERP=interpreting(),
        # the unrolled fixup holds every slice's tile: one-warp tiles only (4-warp ones would spill)
        MAX_SPLIT=triton.next_power_of_2(split) if locks is not None and cfg["num_warps"] == 1 else 1,
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"], **pdl_launch(x.device),
    )  # fmt: skip
    if split > 1 and locks is None:
        block = 1024
        _split_k_sum_kernel[(triton.cdiv(m * n, block),)](
            target, bias if bias is not None else out, out, m * n, n,
            SPLIT_K=split, HAS_BIAS=bias is not None, BLOCK=block, num_warps=4,
        )  # fmt: skip
        if alpha != 1.0:  # only the fp32-output form scales, and it has no bias
            out.mul_(alpha)
    return out


def gemv_fp32_out_ref(x: torch.Tensor, weight: torch.Tensor, alpha: float = 1.0) -> torch.Tensor:
    """The twin of :func:`gemv_fp32_out`: the fp32 product of the exact operands, times ``alpha``."""
    return (x.float() @ weight.float().t()) * alpha


def fp8_gemv_ref(
    x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """The fp32 product :func:`fp8_gemv` computes: ``x`` and the dequantised weight in fp32
    (no rounding of either), ``+ bias``; returns fp32."""
    out = x.float() @ block_dequant(weight, weight_scale, (128, 128), torch.float32).t()
    return out + bias.float() if bias is not None else out
