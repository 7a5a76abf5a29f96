"""A gather-only kernel: the bandwidth ceiling of sparse attention at few heads.

``out[t] = Σ_k cache[idx[t, k]]`` (fp32): each program gathers one token's rows in blocks of
``BLOCK_N`` and sums them, with no other arithmetic, so its time is the time to move the
gathered rows. ``bench prefill`` times it on a cache the size of the benchmarked prompt to
take the floor of the sparse-attention phase from a measurement. Twin:
:func:`gather_rows_sum_ref`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _gather_rows_sum_kernel(
    CACHE, IDX, OUT, stride_c, stride_i, stride_o, keys, width,
    BLOCK_N: tl.constexpr, BLOCK_A: tl.constexpr, BLOCK_B: tl.constexpr,
):  # fmt: skip
    t = tl.program_id(0).to(tl.int64)
    offs_a = tl.arange(0, BLOCK_A)
    offs_b = BLOCK_A + tl.arange(0, BLOCK_B)
    mask_b = offs_b < width
    # Row-wise accumulators, reduced once at the end: the loop body is loads and adds only.
    acc_a = tl.zeros([BLOCK_N, BLOCK_A], tl.float32)
    acc_b = tl.zeros([BLOCK_N, BLOCK_B], tl.float32)
    for n0 in range(0, keys, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        valid = offs_n < keys
        rows = CACHE + tl.load(IDX + t * stride_i + offs_n, mask=valid, other=0).to(tl.int64) * stride_c
        a = tl.load(rows[:, None] + offs_a[None, :], mask=valid[:, None], other=0.0)
        b = tl.load(rows[:, None] + offs_b[None, :], mask=valid[:, None] & mask_b[None, :], other=0.0)
        acc_a += a.to(tl.float32)
        acc_b += b.to(tl.float32)
    tl.store(OUT + t * stride_o + offs_a, tl.sum(acc_a, 0))
    tl.store(OUT + t * stride_o + offs_b, tl.sum(acc_b, 0), mask=mask_b)


def gather_rows_sum_ref(cache: torch.Tensor, idx: torch.Tensor, out: torch.Tensor) -> None:
    """``out [T, W]`` fp32 ← the sum over ``k`` of ``cache[idx[t, k]]`` (``cache [N, W]``,
    ``idx [T, K]`` int32, every entry a valid row)."""
    out.copy_(cache[idx.long()].float().sum(1))


def gather_rows_sum(
    cache: torch.Tensor, idx: torch.Tensor, out: torch.Tensor, block_n: int = 16, num_warps: int = 4
) -> None:
    """:func:`gather_rows_sum_ref`'s contract in Triton; the row width splits into a power-of-two
    head part and a remainder (576 = 512 + 64), as the MLA kernels split the latent row."""
    tokens, keys = idx.shape
    width = cache.shape[1]
    block_a = 1 << (width.bit_length() - 1)
    block_b = max(16, triton.next_power_of_2(width - block_a)) if width > block_a else 16
    _gather_rows_sum_kernel[(tokens,)](
        cache, idx, out, cache.stride(0), idx.stride(0), out.stride(0), keys, width,
        BLOCK_N=block_n, BLOCK_A=block_a, BLOCK_B=block_b, num_warps=num_warps,
    )  # fmt: skip
