"""Causal top-k selection of the DSA indexer: the ``K`` highest scores of each ragged row (Triton;
twin: ``torch.topk`` over each row's causal range, ties to the lower position).

One program per row, longest rows first (the grid runs backwards over the tokens, and a prefill
lays a request's tokens out by ascending position), so the long rows do not leave the GPU idle at
the tail. A row with ``n = pos + 1 ≤ K`` keys selects ``0…pos``. A longer row finds its ``K``-th
largest score exactly, digit by digit, each digit a masked 256-bin ``tl.histogram`` over the
keys still in the running:

1. two *value-range* digits: 256 equal slices of the row's ``[min, max]``, then 256 slices of
   the chosen slice. They are non-decreasing in the score, so they select like radix digits, and
   they spread the scores over the bins: the top 8 bits of the scores' order-preserving 32-bit
   key — sign and exponent — put nearly every score in a few bins, whose histogram atomics
   collide (the previous kernel's first digit);
2. only while the chosen bucket holds more keys than are still needed (equal or nearly equal
   scores), 8-bit digits of the order-preserving key, from the top, over that bucket's keys.

The select stops as soon as the bucket holding the ``K``-th key is taken whole (usually after the
two value-range digits). Then it writes, in ascending position order, every position above the
threshold bucket and the lowest-positioned ones inside it (ties go to the lower position:
deterministic), re-reading the row in blocks (from cache).

Rows of at most ``resident`` keys are read once into registers for the digits; longer rows
stream from memory: one read for the range, one per digit, one to write. Scores must be finite.

The set equals ``torch.topk``'s wherever the ``K``-th score is not tied; the order is by
position, not by score (attention does not care). Graph-safe: the grid is the row count, no
host syncs.
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
def _pick_digit(hist, need):
    """The digit of the ``need``-th largest key among those counted in ``hist`` (256 bins):
    ``(digit, how many of its bucket still have to be taken, the bucket's size)``."""
    # at_least[d] = keys whose digit is ≥ d (non-increasing in d): the wanted digit is the
    # largest d with at_least[d] ≥ need.
    at_least = tl.sum(hist, 0) - tl.cumsum(hist, 0) + hist
    digit = tl.sum((at_least >= need).to(tl.int32), 0) - 1
    bins = tl.arange(0, 256)
    above = tl.sum(tl.where(bins > digit, hist, 0), 0)
    count = tl.sum(tl.where(bins == digit, hist, 0), 0)
    return digit, need - above, count


@triton.jit
def _range_digit(x, lo, scale):
    """Slice ``0…255`` of ``x`` from ``lo`` by ``scale`` (non-decreasing in ``x``; all 0 where
    ``scale`` is 0)."""
    y = tl.where(scale > 0.0, (x - lo) * scale, 0.0)
    return tl.minimum(tl.maximum(y, 0.0), 255.0).to(tl.int32)


@triton.jit
def _in_bucket(x, mn, scale0, d0, lo1, scale1, d1):
    """Whether ``x`` lies in value-range slice ``d0`` and, inside it, slice ``d1``."""
    return (_range_digit(x, mn, scale0) == d0) & (_range_digit(x, lo1, scale1) == d1)


@triton.jit
def _digit_hist(
    row, n, x, u, valid, lo, scale, mn, scale0, d0, lo1, scale1, d1, prefix, SHIFT: tl.constexpr,
    KIND: tl.constexpr, HELD: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    """One digit's 256-bin histogram. ``KIND`` 0: the first value-range slice (from ``lo`` by
    ``scale``) of every key; 1: the second (from ``lo`` by ``scale``) of the keys in slice
    ``d0``; 2: the key's first byte (bits ``SHIFT…SHIFT+7``) of the keys in the bucket
    ``d0, d1``; 3: a later key byte, of those whose bits above it equal ``prefix``'s. ``HELD``:
    the scores are ``x`` (masked by ``valid``; for the key bytes ``u`` are their keys and
    ``valid`` already the bucket), else they stream from ``row[0:n]`` in blocks."""
    if HELD:
        if KIND >= 2:  # the keys and the bucket mask, computed once for all key digits
            inside = valid
            if KIND == 3:
                inside = inside & ((u >> (SHIFT + 8)) == (prefix >> (SHIFT + 8)))
            hist = tl.histogram(((u >> SHIFT) & 0xFF).to(tl.int32), 256, mask=inside)
        else:
            hist = _digit_hist_block(x, valid, lo, scale, mn, scale0, d0, lo1, scale1, d1, prefix, SHIFT, KIND)
    else:
        hist = tl.zeros([256], tl.int32)
        for b in range(0, n, BLOCK):
            offs = b + tl.arange(0, BLOCK)
            m = offs < n
            xb = tl.load(row + offs, mask=m, other=0.0)
            hist += _digit_hist_block(xb, m, lo, scale, mn, scale0, d0, lo1, scale1, d1, prefix, SHIFT, KIND)
    return hist


@triton.jit
def _digit_hist_block(x, valid, lo, scale, mn, scale0, d0, lo1, scale1, d1, prefix, SHIFT: tl.constexpr,
                      KIND: tl.constexpr):  # fmt: skip
    """:func:`_digit_hist` of the scores ``x`` in registers."""
    if KIND == 0:
        hist = tl.histogram(_range_digit(x, lo, scale), 256, mask=valid)
    elif KIND == 1:
        hist = tl.histogram(_range_digit(x, lo, scale), 256, mask=valid & (_range_digit(x, mn, scale0) == d0))
    else:
        u = _order_key(x)
        inside = valid & _in_bucket(x, mn, scale0, d0, lo1, scale1, d1)
        if KIND == 3:
            inside = inside & ((u >> (SHIFT + 8)) == (prefix >> (SHIFT + 8)))
        hist = tl.histogram(((u >> SHIFT) & 0xFF).to(tl.int32), 256, mask=inside)
    return hist


@triton.jit
def _classify(x, valid, mn, scale0, d0, lo1, scale1, d1, prefix, shift):
    """``(above, eq)``: the scores above the threshold bucket, and those inside it — the bucket
    is value-range slices ``d0, d1``, then the key bits above ``shift`` equal to ``prefix``'s
    (``shift`` 32: no key digit)."""
    u = _order_key(x)
    b0 = _range_digit(x, mn, scale0)
    b1 = _range_digit(x, lo1, scale1)
    sh = tl.minimum(shift, 31).to(tl.uint32)
    key_eq = (shift == 32) | ((u >> sh) == (prefix >> sh))
    key_gt = (shift < 32) & ((u >> sh) > (prefix >> sh))
    in1 = (b0 == d0) & (b1 == d1)
    above = valid & ((b0 > d0) | ((b0 == d0) & (b1 > d1)) | (in1 & key_gt))
    return above, valid & in1 & key_eq


@triton.jit
def _select_row(row, out, n, topk, HELD: tl.constexpr, RESIDENT: tl.constexpr, BLOCK: tl.constexpr):
    """Select of one row with ``n > topk`` keys (module docstring); ``HELD``: the row fits the
    ``RESIDENT``-key register tile."""
    if HELD:
        offs = tl.arange(0, RESIDENT)
        valid = offs < n
        x = tl.load(row + offs, mask=valid, other=0.0)
        mx = tl.max(tl.where(valid, x, float("-inf")), 0)
        mn = tl.min(tl.where(valid, x, float("inf")), 0)
    else:
        offs = tl.arange(0, BLOCK)
        valid = offs < 0
        x = tl.zeros([BLOCK], tl.float32)  # unused: the digits stream the row
        mx = tl.full([], float("-inf"), tl.float32)
        mn = tl.full([], float("inf"), tl.float32)
        for b in range(0, n, BLOCK):
            m = b + offs < n
            xb = tl.load(row + b + offs, mask=m, other=0.0)
            mx = tl.maximum(mx, tl.max(tl.where(m, xb, float("-inf")), 0))
            mn = tl.minimum(mn, tl.min(tl.where(m, xb, float("inf")), 0))
    # A range too narrow (or too wide) for a finite scale puts every key in slice 0.
    ok = (mx - mn > 1e-30) & (mx - mn < 3e38)
    scale0 = tl.where(ok, 256.0 / (mx - mn), 0.0)
    width0 = tl.where(ok, (mx - mn) * (1.0 / 256.0), 0.0)
    zero_f = tl.zeros([], tl.float32)
    zero_i = tl.zeros([], tl.int32)
    prefix = tl.zeros([], tl.uint32)
    hist = _digit_hist(row, n, x, x, valid, mn, scale0, mn, scale0, zero_i, zero_f, zero_f, zero_i, prefix, 0, 0,
                       HELD, BLOCK)  # fmt: skip
    d0, need, count = _pick_digit(hist, topk)
    lo1 = mn + d0.to(tl.float32) * width0
    scale1 = zero_f  # 0: every key's second slice is 0
    d1 = zero_i
    # Each further digit only while the bucket must be split (count > need).
    if count > need:
        scale1 = scale0 * 256.0
        hist = _digit_hist(row, n, x, x, valid, lo1, scale1, mn, scale0, d0, lo1, scale1, d1, prefix, 0, 1,
                           HELD, BLOCK)  # fmt: skip
        d1, need, count = _pick_digit(hist, need)
    shift = tl.full([], 32, tl.int32)  # 32: no key digit taken
    # Key bytes over the bucket's keys, each only while the bucket must be split.
    if HELD:
        u = _order_key(x)
        bucket = valid & _in_bucket(x, mn, scale0, d0, lo1, scale1, d1)
    else:
        u = x.to(tl.uint32, bitcast=True)  # unused: the digits stream the row
        bucket = valid
    if count > need:
        hist = _digit_hist(row, n, x, u, bucket, mn, scale0, mn, scale0, d0, lo1, scale1, d1, prefix, 24, 2,
                           HELD, BLOCK)  # fmt: skip
        digit, need, count = _pick_digit(hist, need)
        prefix = digit.to(tl.uint32) << 24
        shift = tl.full([], 24, tl.int32)
    if count > need:
        hist = _digit_hist(row, n, x, u, bucket, mn, scale0, mn, scale0, d0, lo1, scale1, d1, prefix, 16, 3,
                           HELD, BLOCK)  # fmt: skip
        digit, need, count = _pick_digit(hist, need)
        prefix = prefix | (digit.to(tl.uint32) << 16)
        shift = tl.full([], 16, tl.int32)
    if count > need:
        hist = _digit_hist(row, n, x, u, bucket, mn, scale0, mn, scale0, d0, lo1, scale1, d1, prefix, 8, 3,
                           HELD, BLOCK)  # fmt: skip
        digit, need, count = _pick_digit(hist, need)
        prefix = prefix | (digit.to(tl.uint32) << 8)
        shift = tl.full([], 8, tl.int32)
    if count > need:
        hist = _digit_hist(row, n, x, u, bucket, mn, scale0, mn, scale0, d0, lo1, scale1, d1, prefix, 0, 3,
                           HELD, BLOCK)  # fmt: skip
        digit, need, count = _pick_digit(hist, need)
        prefix = prefix | digit.to(tl.uint32)
        shift = tl.full([], 0, tl.int32)
    # Write: re-read the row in blocks (no scan over a whole register tile).
    ties = count > need  # the bucket's keys are equal: only the `need` lowest-positioned
    written = zero_i
    equal_seen = zero_i
    for b in range(0, n, BLOCK):
        offs_b = b + tl.arange(0, BLOCK)
        m = offs_b < n
        xb = tl.load(row + offs_b, mask=m, other=0.0)
        above, eq = _classify(xb, m, mn, scale0, d0, lo1, scale1, d1, prefix, shift)
        if ties:
            eq_i = eq.to(tl.int32)
            take = above | (eq & (equal_seen + tl.cumsum(eq_i, 0) - eq_i < need))
            equal_seen += tl.sum(eq_i, 0)
        else:
            take = above | eq
        take_i = take.to(tl.int32)
        tl.store(out + written + tl.cumsum(take_i, 0) - take_i, offs_b, mask=take)
        written += tl.sum(take_i, 0)


@triton.jit
def _topk_select_kernel(
    SCORES,
    POSITIONS,
    OUT,
    stride_st,
    stride_ot,
    num_rows,
    topk,
    BLOCK: tl.constexpr,
    RESIDENT: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    t = (num_rows - 1 - tl.program_id(0)).to(tl.int64)  # longest rows first
    n = tl.load(POSITIONS + t).to(tl.int32) + 1
    row = SCORES + t * stride_st
    out = OUT + t * stride_ot
    if n <= topk:
        for o in range(0, topk, BLOCK_K):
            offs = o + tl.arange(0, BLOCK_K)
            tl.store(out + offs, tl.where(offs < n, offs, -1), mask=offs < topk)
    elif RESIDENT == 0:
        _select_row(row, out, n, topk, False, BLOCK, BLOCK)
    elif n > RESIDENT:
        _select_row(row, out, n, topk, False, RESIDENT, BLOCK)
    else:
        _select_row(row, out, n, topk, True, RESIDENT, BLOCK)


def select_config(row_len: int) -> dict:
    """Launch options of :func:`topk_select_triton` for rows of at most ``row_len`` keys: rows
    up to 16K keys held in registers (the row width rounded up to a power of two, at least one
    key per thread), blocks of 2048 keys, 16 warps. sm_90a: 128 registers, no spill up to 8K keys,
    40 bytes of stack at 16K (``tests/test_kernels_topk.py``)."""
    warps = 16
    resident = min(16384, max(triton.next_power_of_2(row_len), 32 * warps))
    return {"resident": resident, "block": 2048, "num_warps": warps}


def kernel_constants(row_len: int, topk: int, **opts) -> tuple[dict, int]:
    """``(constexprs of _topk_select_kernel, num_warps)`` for :func:`topk_select_triton`'s
    options ``opts`` (missing or ``None`` ones from :func:`select_config` of ``row_len``); also
    what the sm_90a compile check takes."""
    cfg = select_config(row_len)
    unknown = set(opts) - set(cfg)
    if unknown:
        raise TypeError(f"unknown select options {sorted(unknown)}")
    cfg |= {k: v for k, v in opts.items() if v is not None}
    for name in ("resident", "block"):
        if cfg[name] & (cfg[name] - 1) or (name == "block" and cfg[name] < 16):
            raise ValueError(f"{name} must be a power of two (resident may be 0), got {cfg[name]}")
    consts = {"BLOCK": cfg["block"], "RESIDENT": cfg["resident"], "BLOCK_K": min(1024, triton.next_power_of_2(topk))}
    return consts, cfg["num_warps"]


def topk_select_triton(
    scores: torch.Tensor,
    positions: torch.Tensor,
    topk_out: torch.Tensor,
    *,
    resident: int | None = None,
    block: int | None = None,
    num_warps: int | None = None,
) -> None:
    """Causal top-k of each row: ``topk_out[t]`` (int32 ``[T, K]``) gets the ``K`` positions
    ``j ≤ positions[t]`` with the largest ``scores[t, j]`` in ascending position order (ties to
    the lower position), or ``0…positions[t]`` then ``-1`` when the row has at most ``K`` keys.
    Reads ``scores[t, :positions[t] + 1]`` only (fp32, finite, unit last stride). Graph-safe.

    Options default to :func:`select_config` of the scores' row width: ``resident`` the longest
    row held in registers (a power of two; 0: stream every row), ``block`` the keys per streamed
    block (a power of two ≥ 16), ``num_warps``.
    """
    num_tokens, topk = topk_out.shape
    consts, warps = kernel_constants(scores.shape[1], topk, resident=resident, block=block, num_warps=num_warps)
    if num_tokens == 0:
        return
    _topk_select_kernel[(num_tokens,)](
        scores, positions, topk_out, scores.stride(0), topk_out.stride(0), num_tokens, topk, **consts,
        num_warps=warps,
    )  # fmt: skip
