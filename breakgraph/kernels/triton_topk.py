"""Causal top-k selection of the DSA indexer: the ``K`` highest scores of each ragged row (Triton;
twin: ``torch.topk`` over each row's causal range, ties to the lower position).

One program per row, reading only the row's causal range ``0…pos``. A row with ``n = pos + 1 ≤
K`` keys selects ``0…pos``. A longer row finds its ``K``-th largest score exactly with a radix
select over the scores' order-preserving 32-bit keys: four passes over the row, each a masked
256-bin ``tl.histogram`` of the next 8-bit digit (from the top) of the keys whose higher digits
match the ones chosen so far. One more pass writes, in ascending position order, every position
with a larger key and the lowest-positioned ones equal to it (ties go to the lower position:
deterministic). The set equals ``torch.topk``'s wherever the ``K``-th score is not tied; the
order is by position, not by score (attention does not care). Graph-safe: the grid is the row
count, no host syncs.

A variant whose first two digits were value-range slices of the row's ``[min, max]``, with rows
of up to 16K keys held in registers, was measured slower in the engine on one H200 (72.2 vs
57.0 ms at 8192 tokens, 303.8 vs 235.7 ms at 16384: ``breakgraph bench prefill --preset
glm5-tp8-rank --input-len 8192 16384 --backends breakable --top-kernels 10``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _order_key(x):
    """fp32 → uint32 whose unsigned order is the float order (``-0.0`` taken as ``+0.0``)."""
    x = tl.where(x == 0.0, 0.0, x)
    u = x.to(tl.uint32, bitcast=True)
    return tl.where((u >> 31) == 1, u ^ 0xFFFFFFFF, u | 0x80000000)


@triton.jit
def _topk_select_kernel(
    SCORES,
    POSITIONS,
    OUT,
    stride_st,
    stride_ot,
    topk,
    BLOCK: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    n = tl.load(POSITIONS + t).to(tl.int32) + 1
    row = SCORES + t * stride_st
    out = OUT + t * stride_ot
    if n <= topk:
        for o in range(0, topk, BLOCK_K):
            offs = o + tl.arange(0, BLOCK_K)
            tl.store(out + offs, tl.where(offs < n, offs, -1), mask=offs < topk)
    else:
        # Radix select of the topk-th largest key, 8 bits at a time from the top.
        prefix = tl.zeros([], tl.uint32)
        need = topk  # how many of the keys matching `prefix` still have to be taken
        bins = tl.arange(0, 256)
        for level in tl.static_range(4):
            shift = 24 - 8 * level
            hist = tl.zeros([256], tl.int32)
            for b in range(0, n, BLOCK):
                offs = b + tl.arange(0, BLOCK)
                valid = offs < n
                u = _order_key(tl.load(row + offs, mask=valid, other=0.0))
                if level > 0:
                    valid = valid & ((u >> (shift + 8)) == (prefix >> (shift + 8)))
                hist += tl.histogram(((u >> shift) & 0xFF).to(tl.int32), 256, mask=valid)
            # at_least[d] = matching keys whose digit is ≥ d (non-increasing in d): the wanted
            # digit is the largest d with at_least[d] ≥ need.
            at_least = tl.sum(hist, 0) - tl.cumsum(hist, 0) + hist
            digit = tl.sum((at_least >= need).to(tl.int32), 0) - 1
            above = tl.sum(tl.where(bins > digit, hist, 0), 0)
            need -= above
            prefix = prefix | (digit.to(tl.uint32) << shift)
        # Write every key above the threshold and the first `need` equal to it, by position.
        written = 0
        equal_seen = 0
        for b in range(0, n, BLOCK):
            offs = b + tl.arange(0, BLOCK)
            valid = offs < n
            u = _order_key(tl.load(row + offs, mask=valid, other=0.0))
            eq = (valid & (u == prefix)).to(tl.int32)
            eq_rank = equal_seen + tl.cumsum(eq, 0) - eq
            take = (valid & (u > prefix)) | ((eq == 1) & (eq_rank < need))
            take_i = take.to(tl.int32)
            slot = written + tl.cumsum(take_i, 0) - take_i
            tl.store(out + slot, offs, mask=take)
            written += tl.sum(take_i, 0)
            equal_seen += tl.sum(eq, 0)


def topk_select_triton(
    scores: torch.Tensor, positions: torch.Tensor, topk_out: torch.Tensor, *, block: int = 512, num_warps: int = 4
) -> None:
    """Causal top-k of each row: ``topk_out[t]`` (int32 ``[T, K]``) gets the ``K`` positions
    ``j ≤ positions[t]`` with the largest ``scores[t, j]`` in ascending position order (ties to
    the lower position), or ``0…positions[t]`` then ``-1`` when the row has at most ``K`` keys.
    Reads ``scores[t, :positions[t] + 1]`` only. Graph-safe."""
    num_tokens, topk = topk_out.shape
    if num_tokens == 0:
        return
    _topk_select_kernel[(num_tokens,)](
        scores, positions, topk_out, scores.stride(0), topk_out.stride(0), topk,
        BLOCK=block, BLOCK_K=min(1024, triton.next_power_of_2(topk)), num_warps=num_warps,
    )  # fmt: skip
