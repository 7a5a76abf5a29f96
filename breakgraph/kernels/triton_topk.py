"""Causal top-k selection of the DSA indexer: the ``K`` highest scores of each ragged row (Triton;
twin: ``torch.topk`` over each row's causal range, ties to the lower position).

One program per row, longest rows first (the grid runs backwards over the tokens, and a prefill
lays a request's tokens out by ascending position), so the long rows do not leave the GPU idle at
the tail. A row with ``n = pos + 1 ≤ K`` keys selects ``0…pos``. A longer row finds the ``K``-th
largest score exactly with a radix select over the scores' order-preserving 32-bit keys: a few
digits from the top (``bits``, e.g. 12/10/10), each a masked ``tl.histogram`` over the keys that
still match the digits chosen so far. The select stops early once the bucket that holds the
``K``-th key is taken whole (usually after two digits: a 12-bit first digit leaves a few hundred
keys in the bucket, a 10-bit second digit splits them into buckets of one or two). Then it writes,
in ascending position order, every position whose key lies above the threshold bucket and the
lowest-positioned ones inside it (ties go to the lower position: deterministic).

Rows of at most ``resident`` keys are read once into registers and every digit and the write run
on them; longer rows stream their keys in blocks of ``block`` per digit (one more read per digit,
mostly from L2).

The set equals ``torch.topk``'s wherever the ``K``-th score is not tied; the order is by
position, not by score (attention does not care). Graph-safe: the grid is the row count, no
host syncs.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# Radix digit plans (bits per digit from the top; they sum to 32).
DIGIT_PLANS = {"8/8/8/8": (8, 8, 8, 8), "11/11/10": (11, 11, 10, 0), "12/10/10": (12, 10, 10, 0)}


@triton.jit
def _order_key(x):
    """fp32 → uint32 whose unsigned order is the float order (``-0.0`` taken as ``+0.0``)."""
    x = tl.where(x == 0.0, 0.0, x)
    u = x.to(tl.uint32, bitcast=True)
    return tl.where((u >> 31) == 1, u ^ 0xFFFFFFFF, u | 0x80000000)


@triton.jit
def _pick_digit(hist, need, BITS: tl.constexpr):
    """The digit of the ``need``-th largest key among those counted in ``hist``: ``(digit,
    how many of its bucket still have to be taken, the bucket's size)``."""
    # at_least[d] = keys whose digit is ≥ d (non-increasing in d): the wanted digit is the
    # largest d with at_least[d] ≥ need.
    at_least = tl.sum(hist, 0) - tl.cumsum(hist, 0) + hist
    digit = tl.sum((at_least >= need).to(tl.int32), 0) - 1
    bins = tl.arange(0, 1 << BITS)
    above = tl.sum(tl.where(bins > digit, hist, 0), 0)
    count = tl.sum(tl.where(bins == digit, hist, 0), 0)
    return digit.to(tl.uint32), need - above, count


@triton.jit
def _resident_hist(u, valid, prefix, SHIFT: tl.constexpr, BITS: tl.constexpr, FIRST: tl.constexpr):
    """Histogram of the digit ``(u >> SHIFT) & (2^BITS − 1)`` over the keys in registers that
    match ``prefix`` above it."""
    if not FIRST:
        valid = valid & ((u >> (SHIFT + BITS)) == (prefix >> (SHIFT + BITS)))
    return tl.histogram(((u >> SHIFT) & ((1 << BITS) - 1)).to(tl.int32), 1 << BITS, mask=valid)


@triton.jit
def _streamed_hist(
    row, n, prefix, SHIFT: tl.constexpr, BITS: tl.constexpr, FIRST: tl.constexpr, BLOCK: tl.constexpr
):
    """:func:`_resident_hist` over ``row[0:n]`` read in blocks."""
    hist = tl.zeros([1 << BITS], tl.int32)
    for b in range(0, n, BLOCK):
        offs = b + tl.arange(0, BLOCK)
        valid = offs < n
        u = _order_key(tl.load(row + offs, mask=valid, other=0.0))
        hist += _resident_hist(u, valid, prefix, SHIFT, BITS, FIRST)
    return hist


@triton.jit
def _threshold(
    row, n, topk, u, valid, B0: tl.constexpr, B1: tl.constexpr, B2: tl.constexpr, B3: tl.constexpr,
    RESIDENT: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    """Radix select of the ``topk``-th largest key: ``(prefix, shift, need, count)`` — the keys
    whose bits above ``shift`` equal ``prefix``'s form the threshold bucket (``count`` keys), of
    which the ``need`` lowest-positioned are taken, with every key above it. ``RESIDENT``: the
    keys are ``u`` (masked by ``valid``), else they are streamed from ``row``."""
    S0: tl.constexpr = 32 - B0
    S1: tl.constexpr = S0 - B1
    S2: tl.constexpr = S1 - B2
    S3: tl.constexpr = S2 - B3
    if RESIDENT:
        hist0 = _resident_hist(u, valid, 0, S0, B0, True)
    else:
        hist0 = _streamed_hist(row, n, 0, S0, B0, True, BLOCK)
    digit, need, count = _pick_digit(hist0, topk, B0)
    prefix = digit << S0
    shift = tl.full([], S0, tl.int32)
    # Each further digit only where the bucket must be split (count > need).
    if count > need:
        if RESIDENT:
            hist1 = _resident_hist(u, valid, prefix, S1, B1, False)
        else:
            hist1 = _streamed_hist(row, n, prefix, S1, B1, False, BLOCK)
        digit, need, count = _pick_digit(hist1, need, B1)
        prefix = prefix | (digit << S1)
        shift = tl.full([], S1, tl.int32)
    if count > need:
        if RESIDENT:
            hist2 = _resident_hist(u, valid, prefix, S2, B2, False)
        else:
            hist2 = _streamed_hist(row, n, prefix, S2, B2, False, BLOCK)
        digit, need, count = _pick_digit(hist2, need, B2)
        prefix = prefix | (digit << S2)
        shift = tl.full([], S2, tl.int32)
    if B3 > 0:
        if count > need:
            if RESIDENT:
                hist3 = _resident_hist(u, valid, prefix, S3, B3, False)
            else:
                hist3 = _streamed_hist(row, n, prefix, S3, B3, False, BLOCK)
            digit, need, count = _pick_digit(hist3, need, B3)
            prefix = prefix | (digit << S3)
            shift = tl.full([], S3, tl.int32)
    return prefix, shift, need, count


@triton.jit
def _write_taken(out, offs, u, valid, p, shift, need, ties, written, equal_seen):
    """Store the positions ``offs`` taken from one block in ascending order after ``written``
    earlier ones: keys above the threshold bucket ``p`` (the keys' bits above ``shift``), and
    (``ties``) the bucket's keys only while fewer than ``need`` of them came before."""
    hi = u >> shift.to(tl.uint32)
    if ties:
        eq = (valid & (hi == p)).to(tl.int32)
        take = (valid & (hi > p)) | ((eq == 1) & (equal_seen + tl.cumsum(eq, 0) - eq < need))
        equal_seen += tl.sum(eq, 0)
    else:
        take = valid & (hi >= p)
    take_i = take.to(tl.int32)
    tl.store(out + written + tl.cumsum(take_i, 0) - take_i, offs, mask=take)
    return written + tl.sum(take_i, 0), equal_seen


@triton.jit
def _resident_select(row, out, n, topk, B0, B1, B2, B3, RESIDENT: tl.constexpr):
    """Select of a row of at most ``RESIDENT`` keys, read once into registers."""
    offs = tl.arange(0, RESIDENT)
    valid = offs < n
    u = _order_key(tl.load(row + offs, mask=valid, other=0.0))
    prefix, shift, need, count = _threshold(row, n, topk, u, valid, B0, B1, B2, B3, True, RESIDENT)
    zero = tl.zeros([], tl.int32)
    _write_taken(out, offs, u, valid, prefix >> shift.to(tl.uint32), shift, need, count > need, zero, zero)


@triton.jit
def _linear_digit(x, lo, scale):
    """Bucket ``0…255`` of ``x`` on a linear scale from ``lo`` (non-decreasing in ``x``; all 0
    where ``scale`` is 0)."""
    y = tl.where(scale > 0.0, (x - lo) * scale, 0.0)
    return tl.minimum(tl.maximum(y, 0.0), 255.0).to(tl.int32)


@triton.jit
def _linear_select(row, out, n, topk, RESIDENT: tl.constexpr, WRITE_BLOCK: tl.constexpr):
    """Select of a row of at most ``RESIDENT`` keys, read once into registers, whose first two
    digits are buckets of the row's value range instead of key bits: 256 equal slices of
    ``[min, max]``, then 256 slices of the chosen one. The buckets are non-decreasing in the
    score, so they select like radix digits, and they spread the scores evenly (the top 8 key
    bits are sign and exponent: a few buckets hold nearly every score, and the histogram's
    atomics collide). Where the second slice still holds more keys than are needed, exact 8-bit
    key digits follow over its keys. ``WRITE_BLOCK`` > 0: the positions are written from a second
    read of the row in blocks of that many keys (the row is in cache), else from the registers."""
    offs = tl.arange(0, RESIDENT)
    valid = offs < n
    x = tl.load(row + offs, mask=valid, other=0.0)
    mx = tl.max(tl.where(valid, x, float("-inf")), 0)
    mn = tl.min(tl.where(valid, x, float("inf")), 0)
    # A range too narrow (or too wide) for a finite scale puts every key in one bucket.
    ok = (mx - mn > 1e-30) & (mx - mn < 3e38)
    scale0 = tl.where(ok, 256.0 / (mx - mn), 0.0)
    width0 = tl.where(ok, (mx - mn) * (1.0 / 256.0), 0.0)
    hist0 = tl.histogram(_linear_digit(x, mn, scale0), 256, mask=valid)
    d0u, need, count = _pick_digit(hist0, topk, 8)
    d0 = d0u.to(tl.int32)
    lo1 = mn + d0.to(tl.float32) * width0
    scale1 = tl.zeros([], tl.float32)  # 0: the second digit is 0 for every key
    d1 = tl.zeros([], tl.int32)
    if count > need:
        scale1 = scale0 * 256.0
        cand = valid & (_linear_digit(x, mn, scale0) == d0)
        hist1 = tl.histogram(_linear_digit(x, lo1, scale1), 256, mask=cand)
        d1u, need, count = _pick_digit(hist1, need, 8)
        d1 = d1u.to(tl.int32)
    u = _order_key(x)
    prefix = tl.zeros([], tl.uint32)
    shift = tl.full([], 32, tl.int32)  # 32: no key digit was needed
    if count > need:
        inside = valid & (_linear_digit(x, mn, scale0) == d0) & (_linear_digit(x, lo1, scale1) == d1)
        prefix, shift, need, count = _threshold(row, n, need, u, inside, 8, 8, 8, 8, True, RESIDENT)
    if WRITE_BLOCK > 0:  # re-read the row (from cache) in blocks: no scan over the whole tile
        _write_streamed(row, out, n, mn, scale0, d0, lo1, scale1, d1, prefix, shift, need, count > need, WRITE_BLOCK)
    else:
        above, eq = _classify(x, u, valid, mn, scale0, d0, lo1, scale1, d1, prefix, shift)
        if count > need:  # ties at the threshold: the lowest positions among them
            eq_i = eq.to(tl.int32)
            take = above | (eq & (tl.cumsum(eq_i, 0) - eq_i < need))
        else:
            take = above | eq
        take_i = take.to(tl.int32)
        tl.store(out + tl.cumsum(take_i, 0) - take_i, offs, mask=take)


@triton.jit
def _classify(x, u, valid, mn, scale0, d0, lo1, scale1, d1, prefix, shift):
    """``(above, eq)``: the keys above the threshold bucket, and those inside it — the bucket
    is value-range digits ``d0, d1`` (of slices from ``mn`` by ``scale0``, from ``lo1`` by
    ``scale1``), then the key bits above ``shift`` equal to ``prefix``'s (``shift`` 32: none)."""
    b0 = _linear_digit(x, mn, scale0)
    b1 = _linear_digit(x, lo1, scale1)
    sh = tl.minimum(shift, 31).to(tl.uint32)
    key_eq = (shift == 32) | ((u >> sh) == (prefix >> sh))
    key_gt = (shift < 32) & ((u >> sh) > (prefix >> sh))
    in1 = (b0 == d0) & (b1 == d1)
    above = valid & ((b0 > d0) | ((b0 == d0) & (b1 > d1)) | (in1 & key_gt))
    return above, valid & in1 & key_eq


@triton.jit
def _inside_hist(
    row, n, mn, scale0, d0, lo1, scale1, d1, prefix, SHIFT: tl.constexpr, BITS: tl.constexpr,
    FIRST: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    """:func:`_streamed_hist` of the keys inside the value-range slice ``d0, d1``."""
    hist = tl.zeros([1 << BITS], tl.int32)
    for b in range(0, n, BLOCK):
        offs = b + tl.arange(0, BLOCK)
        valid = offs < n
        x = tl.load(row + offs, mask=valid, other=0.0)
        inside = valid & (_linear_digit(x, mn, scale0) == d0) & (_linear_digit(x, lo1, scale1) == d1)
        hist += _resident_hist(_order_key(x), inside, prefix, SHIFT, BITS, FIRST)
    return hist


@triton.jit
def _write_streamed(
    row, out, n, mn, scale0, d0, lo1, scale1, d1, prefix, shift, need, ties, BLOCK: tl.constexpr
):  # fmt: skip
    """Write the taken positions of ``row[0:n]`` (see :func:`_classify`; with ``ties``, only the
    ``need`` lowest-positioned of the bucket) in ascending order, reading the row in blocks."""
    written = tl.zeros([], tl.int32)
    equal_seen = tl.zeros([], tl.int32)
    for b in range(0, n, BLOCK):
        offs = b + tl.arange(0, BLOCK)
        valid = offs < n
        x = tl.load(row + offs, mask=valid, other=0.0)
        above, eq = _classify(x, _order_key(x), valid, mn, scale0, d0, lo1, scale1, d1, prefix, shift)
        if ties:
            eq_i = eq.to(tl.int32)
            take = above | (eq & (equal_seen + tl.cumsum(eq_i, 0) - eq_i < need))
            equal_seen += tl.sum(eq_i, 0)
        else:
            take = above | eq
        take_i = take.to(tl.int32)
        tl.store(out + written + tl.cumsum(take_i, 0) - take_i, offs, mask=take)
        written += tl.sum(take_i, 0)


@triton.jit
def _streamed_linear_select(row, out, n, topk, BLOCK: tl.constexpr):
    """:func:`_linear_select` of a row of any length, read in blocks: once for its range, once
    per digit, once to write."""
    offs0 = tl.arange(0, BLOCK)
    mx = tl.full([], float("-inf"), tl.float32)
    mn = tl.full([], float("inf"), tl.float32)
    for b in range(0, n, BLOCK):
        valid = b + offs0 < n
        x = tl.load(row + b + offs0, mask=valid, other=0.0)
        mx = tl.maximum(mx, tl.max(tl.where(valid, x, float("-inf")), 0))
        mn = tl.minimum(mn, tl.min(tl.where(valid, x, float("inf")), 0))
    ok = (mx - mn > 1e-30) & (mx - mn < 3e38)
    scale0 = tl.where(ok, 256.0 / (mx - mn), 0.0)
    width0 = tl.where(ok, (mx - mn) * (1.0 / 256.0), 0.0)
    hist0 = tl.zeros([256], tl.int32)
    for b in range(0, n, BLOCK):
        valid = b + offs0 < n
        x = tl.load(row + b + offs0, mask=valid, other=0.0)
        hist0 += tl.histogram(_linear_digit(x, mn, scale0), 256, mask=valid)
    d0u, need, count = _pick_digit(hist0, topk, 8)
    d0 = d0u.to(tl.int32)
    lo1 = mn + d0.to(tl.float32) * width0
    scale1 = tl.zeros([], tl.float32)
    d1 = tl.zeros([], tl.int32)
    if count > need:
        scale1 = scale0 * 256.0
        hist1 = tl.zeros([256], tl.int32)
        for b in range(0, n, BLOCK):
            valid = b + offs0 < n
            x = tl.load(row + b + offs0, mask=valid, other=0.0)
            cand = valid & (_linear_digit(x, mn, scale0) == d0)
            hist1 += tl.histogram(_linear_digit(x, lo1, scale1), 256, mask=cand)
        d1u, need, count = _pick_digit(hist1, need, 8)
        d1 = d1u.to(tl.int32)
    prefix = tl.zeros([], tl.uint32)
    shift = tl.full([], 32, tl.int32)
    # 8-bit key digits over the slice's keys, each only while the bucket must be split.
    if count > need:
        hist = _inside_hist(row, n, mn, scale0, d0, lo1, scale1, d1, prefix, 24, 8, True, BLOCK)
        digit, need, count = _pick_digit(hist, need, 8)
        prefix = digit << 24
        shift = tl.full([], 24, tl.int32)
    if count > need:
        hist = _inside_hist(row, n, mn, scale0, d0, lo1, scale1, d1, prefix, 16, 8, False, BLOCK)
        digit, need, count = _pick_digit(hist, need, 8)
        prefix = prefix | (digit << 16)
        shift = tl.full([], 16, tl.int32)
    if count > need:
        hist = _inside_hist(row, n, mn, scale0, d0, lo1, scale1, d1, prefix, 8, 8, False, BLOCK)
        digit, need, count = _pick_digit(hist, need, 8)
        prefix = prefix | (digit << 8)
        shift = tl.full([], 8, tl.int32)
    if count > need:
        hist = _inside_hist(row, n, mn, scale0, d0, lo1, scale1, d1, prefix, 0, 8, False, BLOCK)
        digit, need, count = _pick_digit(hist, need, 8)
        prefix = prefix | digit
        shift = tl.full([], 0, tl.int32)
    _write_streamed(row, out, n, mn, scale0, d0, lo1, scale1, d1, prefix, shift, need, count > need, BLOCK)


@triton.jit
def _streamed_select(row, out, n, topk, B0, B1, B2, B3, BLOCK: tl.constexpr):
    """Select of a row of any length, read in blocks of ``BLOCK`` keys per digit and once more
    to write."""
    offs0 = tl.arange(0, BLOCK)
    prefix, shift, need, count = _threshold(row, n, topk, offs0.to(tl.uint32), offs0 < 0, B0, B1, B2, B3, False,
                                            BLOCK)  # fmt: skip
    p = prefix >> shift.to(tl.uint32)
    ties = count > need
    written = tl.zeros([], tl.int32)
    equal_seen = tl.zeros([], tl.int32)
    for b in range(0, n, BLOCK):
        offs = b + offs0
        valid = offs < n
        u = _order_key(tl.load(row + offs, mask=valid, other=0.0))
        written, equal_seen = _write_taken(out, offs, u, valid, p, shift, need, ties, written, equal_seen)


@triton.jit
def _held_select(
    row, out, n, topk, R0, R1, R2, R3, RESIDENT: tl.constexpr, LINEAR: tl.constexpr, WRITE_BLOCK: tl.constexpr
):  # fmt: skip
    if LINEAR:
        _linear_select(row, out, n, topk, RESIDENT, WRITE_BLOCK)
    else:
        _resident_select(row, out, n, topk, R0, R1, R2, R3, RESIDENT)


@triton.jit
def _any_streamed_select(row, out, n, topk, B0, B1, B2, B3, BLOCK: tl.constexpr, LINEAR: tl.constexpr):
    if LINEAR:
        _streamed_linear_select(row, out, n, topk, BLOCK)
    else:
        _streamed_select(row, out, n, topk, B0, B1, B2, B3, BLOCK)


@triton.jit
def _topk_select_kernel(
    SCORES,
    POSITIONS,
    OUT,
    stride_st,
    stride_ot,
    num_rows,
    topk,
    R0: tl.constexpr,
    R1: tl.constexpr,
    R2: tl.constexpr,
    R3: tl.constexpr,
    B0: tl.constexpr,
    B1: tl.constexpr,
    B2: tl.constexpr,
    B3: tl.constexpr,
    BLOCK: tl.constexpr,
    RESIDENT: tl.constexpr,
    RESIDENT_SMALL: tl.constexpr,
    LINEAR: tl.constexpr,
    STREAM_LINEAR: tl.constexpr,
    WRITE_BLOCK: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    # R*: the digit plan of rows held in registers, B*: of streamed rows.
    t = (num_rows - 1 - tl.program_id(0)).to(tl.int64)  # longest rows first
    n = tl.load(POSITIONS + t).to(tl.int32) + 1
    row = SCORES + t * stride_st
    out = OUT + t * stride_ot
    if n <= topk:
        for o in range(0, topk, BLOCK_K):
            offs = o + tl.arange(0, BLOCK_K)
            tl.store(out + offs, tl.where(offs < n, offs, -1), mask=offs < topk)
    elif RESIDENT == 0:
        _any_streamed_select(row, out, n, topk, B0, B1, B2, B3, BLOCK, STREAM_LINEAR)
    elif n > RESIDENT:
        _any_streamed_select(row, out, n, topk, B0, B1, B2, B3, BLOCK, STREAM_LINEAR)
    elif RESIDENT_SMALL == 0:
        _held_select(row, out, n, topk, R0, R1, R2, R3, RESIDENT, LINEAR, WRITE_BLOCK)
    elif n > RESIDENT_SMALL:
        _held_select(row, out, n, topk, R0, R1, R2, R3, RESIDENT, LINEAR, WRITE_BLOCK)
    else:
        _held_select(row, out, n, topk, R0, R1, R2, R3, RESIDENT_SMALL, LINEAR, WRITE_BLOCK)


def select_config(row_len: int) -> dict:
    """Launch options of :func:`topk_select_triton` for rows of at most ``row_len`` keys (see
    there)."""
    return {"bits": DIGIT_PLANS["8/8/8/8"], "stream_bits": DIGIT_PLANS["8/8/8/8"], "block": 2048,
            "resident": min(16384, triton.next_power_of_2(row_len)), "resident_small": 0, "linear": True,
            "stream_linear": True, "write_block": 2048,
            "num_warps": 16}  # fmt: skip


def _check_plan(name: str, bits: tuple[int, ...]) -> None:
    if len(bits) != 4 or sum(bits) != 32 or min(bits[:3]) < 1 or max(bits) > 13:
        raise ValueError(f"{name} must be four digit widths of at most 13 summing to 32 (last may be 0), got {bits}")


def kernel_constants(row_len: int, topk: int, **opts) -> tuple[dict, int]:
    """``(constexprs of _topk_select_kernel, num_warps)`` for :func:`topk_select_triton`'s
    options ``opts`` (missing or ``None`` ones from :func:`select_config` of ``row_len``); also
    what the sm_90a compile checks take."""
    cfg = select_config(row_len)
    unknown = set(opts) - set(cfg)
    if unknown:
        raise TypeError(f"unknown select options {sorted(unknown)}")
    cfg |= {k: v for k, v in opts.items() if v is not None}
    bits, stream_bits, resident, small = cfg["bits"], cfg["stream_bits"], cfg["resident"], cfg["resident_small"]
    _check_plan("bits", bits)
    _check_plan("stream_bits", stream_bits)
    if resident & (resident - 1) or small & (small - 1) or (small and small >= resident):
        raise ValueError(f"resident, resident_small must be 0 or powers of two, the second smaller: {resident}, {small}")
    consts = dict(
        R0=bits[0], R1=bits[1], R2=bits[2], R3=bits[3],
        B0=stream_bits[0], B1=stream_bits[1], B2=stream_bits[2], B3=stream_bits[3],
        BLOCK=cfg["block"], RESIDENT=resident, RESIDENT_SMALL=small, LINEAR=bool(cfg["linear"]),
        STREAM_LINEAR=bool(cfg["stream_linear"]), WRITE_BLOCK=cfg["write_block"],
        BLOCK_K=min(1024, triton.next_power_of_2(topk)),
    )  # fmt: skip
    return consts, cfg["num_warps"]


def topk_select_triton(
    scores: torch.Tensor,
    positions: torch.Tensor,
    topk_out: torch.Tensor,
    *,
    bits: tuple[int, int, int, int] | None = None,
    stream_bits: tuple[int, int, int, int] | None = None,
    block: int | None = None,
    resident: int | None = None,
    resident_small: int | None = None,
    linear: bool | None = None,
    stream_linear: bool | None = None,
    write_block: int | None = None,
    num_warps: int | None = None,
) -> None:
    """Causal top-k of each row: ``topk_out[t]`` (int32 ``[T, K]``) gets the ``K`` positions
    ``j ≤ positions[t]`` with the largest ``scores[t, j]`` in ascending position order (ties to
    the lower position), or ``0…positions[t]`` then ``-1`` when the row has at most ``K`` keys.
    Reads ``scores[t, :positions[t] + 1]`` only (fp32, unit last stride). Graph-safe.

    Options default to :func:`select_config` of the scores' row width: ``resident`` the longest
    row held in registers (0: stream every row), ``resident_small`` a second, shorter register
    tile for rows that fit it (0: none; both powers of two); ``bits`` and ``stream_bits`` the
    radix digits from the top of the register-held and the streamed rows (four widths summing
    to 32, a trailing 0 for three digits); ``linear``: register-held rows take
    :func:`_linear_select`'s value-range digits instead of ``bits``, ``stream_linear`` streamed
    rows likewise (:func:`_streamed_linear_select`) instead of ``stream_bits``; ``write_block``
    (linear register-held rows) > 0: write from a second read of the row in blocks of that many
    keys; ``block`` the keys per streamed block. Scores must be finite.
    """
    num_tokens, topk = topk_out.shape
    consts, warps = kernel_constants(
        scores.shape[1], topk, bits=bits, stream_bits=stream_bits, block=block, resident=resident,
        resident_small=resident_small, linear=linear, stream_linear=stream_linear, write_block=write_block,
        num_warps=num_warps,
    )  # fmt: skip
    if num_tokens == 0:
        return
    _topk_select_kernel[(num_tokens,)](
        scores, positions, topk_out, scores.stride(0), topk_out.stride(0), num_tokens, topk, **consts,
        num_warps=warps,
    )  # fmt: skip
