"""Causal top-k selection of the DSA indexer: the ``K`` highest scores of each ragged row (Triton;
twin: ``torch.topk`` over each row's causal range, ties to the lower position).

Every method uses only the row's causal range ``0…pos`` (rows whose width is a multiple of 4
are read in 16-byte vectors, up to 3 keys past ``pos``, which are masked). A row with ``n = pos
+ 1 ≤ K`` keys selects ``0…pos`` then ``-1``. A longer row selects every position whose score
is above the exact ``K``-th largest order key (fp32 → uint32, order-preserving, ``-0.0`` as
``+0.0``) and the lowest-positioned ones equal to it (ties go to the lower position:
deterministic). The set equals ``torch.topk``'s wherever the ``K``-th score is not tied. The
order is by position within parts, not by score: ascending, except that the range select
writes the keys above its threshold bin first and the rest of the selection after them, each
part ascending. Attention does not care up to rounding: the
sparse kernel sums a row's keys in its order, so the last bits of a token's attention output can
depend on which method its chunk of rows took. Graph-safe: grids and scratch come from shapes,
no host syncs.

Methods (:func:`topk_select_triton`):

* ``range`` (one program per row; prefill): a min/max pass; one ``BINS``-bin histogram of
  the value-range bins ``⌊(x − min) · BINS / (max − min)⌋`` (monotone in ``x``); the bin holding
  the ``K``-th key is the *threshold bin*, every key above it is selected. A threshold bin of
  more than ``K`` keys is split again by a second value-range histogram of its keys. If it
  then holds at most ``K`` keys (usually a few hundred), one pass writes the positions above
  it to the output row and lists the bin's positions in a scratch row (``[T, K]`` int32), the
  exact threshold comes from the list alone (one sort of its keys in registers for lists up to
  ``list_sort`` keys, else a radix select over it), and the list's selected positions are
  appended. Otherwise (a constant row, a range past fp32's, outliers that squeeze the rest
  into one bin twice) a radix select over the whole row and a write pass do. Three passes over
  the row instead of the radix method's five, one of them a histogram.
* ``split`` (few long rows; decode, extend): the same steps with the passes over the row split
  across ``splits`` programs per row (min/max, histograms summed with integer atomics, list);
  one program per row then finishes from the list and writes.
* ``radix`` (the select before these, kept for comparison): four passes over the row, each a
  masked 256-bin histogram of the next 8-bit digit of the keys whose higher digits match the
  ones chosen so far, then the write pass.

``tl.histogram`` costs about ``BINS / 32`` warp ballots per key, so few bins make the histogram
cheap; more bins keep the list short when an outlier widens the range. Measured on one H200
(``python scripts/bench_topk.py``, µs per layer, all rows exact): all rows of an 8192-token
prefill 712.6 radix → 402.4 range (blocks of 2048 keys, 128 bins; 341.5 with blocks of 1024
and 64 bins); 16384 tokens 2815.1 → 1239.6 (1086.2); the same 16K rows with a sink outlier
2817.5 → 1554.2 with 128 bins (3161.0 with 64, 1373.6 with 256); 1 / 64 rows of ~128K keys
920.7 / 926.1 radix → 78.8 / 131.1 split (225 / 229 range, one program per row). The defaults
come from these: 128 bins, split below 256 rows wider than 16K keys; since the write-and-list
pass, blocks of 512 keys (``RANGE_BLOCK``; before, 1024).

A sampled select was measured slower and removed: a bracket around the ``K``-th key read off a
sorted sample of 512 or 1024 keys of the row, one pass counting the keys above its ends and the
write-and-list pass, the range select where the bracket missed — half the instructions per key
of the range select's min/max and histogram passes (135 against 63 + 443 per step of 1024 keys
in the sm_90a compile), but the sort of the sample in registers costs more than it saves: on one
H100 (``python scripts/bench_topk.py --quick`` at commit e234fa5, µs per call) 378.5 / 525.1
with samples of 512 / 1024 against 217.5 for the range select at all rows of an 8192-token
prefill, 1271.3 / 1533.7 against 818.6 at 16384 tokens, 246.7 / 251.1 against 71.9 (split) for
one row of 128K keys.

A variant whose first two digits were value-range slices of the row's ``[min, max]``, with rows
of up to 16K keys held in registers, was measured slower in the engine on one H200 (72.2 vs
57.0 ms at 8192 tokens, 303.8 vs 235.7 ms at 16384: ``breakgraph bench prefill --preset
glm5-tp8-rank --input-len 8192 16384 --backends breakable --top-kernels 10``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from breakgraph.kernels.dispatch import SPLIT_SELECT_MIN_KEYS
from breakgraph.kernels.pdl import pdl_launch, pdl_wait


@triton.jit
def _order_key(x):
    """fp32 → uint32 whose unsigned order is the float order (``-0.0`` taken as ``+0.0``)."""
    x = tl.where(x == 0.0, 0.0, x)
    u = x.to(tl.uint32, bitcast=True)
    return tl.where((u >> 31) == 1, u ^ 0xFFFFFFFF, u | 0x80000000)


@triton.jit
def _load_row(row, offs, end, VEC: tl.constexpr):
    """``row[offs]`` where ``offs < end`` rounded up to ``VEC`` (so the loads vectorise; the
    caller masks the keys past ``end``, whatever they hold), ``0.0`` past that."""
    return tl.load(row + offs, mask=offs < (end + VEC - 1) // VEC * VEC, other=0.0)


@triton.jit
def _radix_threshold(row, idx, n, need, kmin, kmax, INDIRECT: tl.constexpr, BLOCK: tl.constexpr,
                     VEC: tl.constexpr, SKIP: tl.constexpr):  # fmt: skip
    """(order key ``T`` of the ``need``-th largest of ``n`` scores, ``e``: how many keys equal to
    ``T`` that rank takes, ``m``: how many keys equal ``T``). The scores are ``row[0…n)``, or
    ``row[idx[0…n)]`` when ``INDIRECT``. Four masked 256-bin histograms, 8 bits at a time from
    the top; with ``SKIP``, the digits the keys' bounds ``kmin ≤ kmax`` share need none."""
    prefix = tl.zeros([], tl.uint32)
    last = n
    for level in tl.static_range(4):
        shift = 24 - 8 * level
        if SKIP:
            shared = ((kmin ^ kmax) >> shift) == 0
        else:
            shared = False
        if shared:  # every key has this digit (and the ones above)
            prefix = (kmin >> shift) << shift
        else:
            prefix, need, last = _radix_level(row, idx, n, need, prefix, shift, INDIRECT, BLOCK, VEC)
    return prefix, need, last


@triton.jit
def _radix_level(row, idx, n, need, prefix, SHIFT: tl.constexpr, INDIRECT: tl.constexpr, BLOCK: tl.constexpr,
                 VEC: tl.constexpr):  # fmt: skip
    """One digit of :func:`_radix_threshold`, at bit ``SHIFT``, among the keys whose higher
    digits are ``prefix``'s: ``(prefix with the digit, need, how many keys match it)``."""
    hist = tl.zeros([256], tl.int32)
    for b in range(0, n, BLOCK):
        offs = b + tl.arange(0, BLOCK)
        valid = offs < n
        if INDIRECT:
            u = _order_key(tl.load(row + tl.load(idx + offs, mask=valid, other=0), mask=valid, other=0.0))
        else:
            u = _order_key(_load_row(row, offs, n, VEC))
        if SHIFT < 24:
            valid = valid & ((u >> (SHIFT + 8)) == (prefix >> (SHIFT + 8)))
        hist += tl.histogram(((u >> SHIFT) & 0xFF).to(tl.int32), 256, mask=valid)
    # at_least[d] = matching keys whose digit is ≥ d (non-increasing in d): the wanted digit is
    # the largest d with at_least[d] ≥ need.
    bins = tl.arange(0, 256)
    at_least = tl.sum(hist, 0) - tl.cumsum(hist, 0) + hist
    digit = tl.sum((at_least >= need).to(tl.int32), 0) - 1
    need -= tl.sum(tl.where(bins > digit, hist, 0), 0)
    return prefix | (digit.to(tl.uint32) << SHIFT), need, tl.sum(tl.where(bins == digit, hist, 0), 0)


@triton.jit
def _block(b, BLOCK: tl.constexpr, ROW: tl.constexpr):
    """Offsets ``b…b+BLOCK``: a vector, or (``ROW > 1``) a ``[BLOCK // ROW, ROW]`` tile in row-major
    order, whose prefix counts (:func:`_rank`) cost about half as many instructions."""
    if ROW == 1:
        return b + tl.arange(0, BLOCK)
    else:
        return b + tl.arange(0, BLOCK // ROW)[:, None] * ROW + tl.arange(0, ROW)[None, :]


@triton.jit
def _rank(m, ROW: tl.constexpr):
    """(exclusive prefix count of the int32 flags ``m`` in offset order, their total) for a
    block from :func:`_block`."""
    if ROW == 1:
        return tl.cumsum(m, 0) - m, tl.sum(m, 0)
    else:
        per_row = tl.sum(m, 1)
        return (tl.cumsum(per_row, 0) - per_row)[:, None] + tl.cumsum(m, 1) - m, tl.sum(per_row, 0)


@triton.jit
def _write_selected(
    row, out, n, key, take_eq, num_eq, BLOCK: tl.constexpr, VEC: tl.constexpr, ROW: tl.constexpr
):
    """Write, in ascending position order, every position of ``row[0…n)`` whose order key is
    above ``key`` and the lowest ``take_eq`` of the ``num_eq`` equal to it."""
    written = 0
    if take_eq == num_eq:  # no tie to break at the threshold: one prefix count per block
        for b in range(0, n, BLOCK):
            offs = _block(b, BLOCK, ROW)
            take = (offs < n) & (_order_key(_load_row(row, offs, n, VEC)) >= key)
            slot, count = _rank(take.to(tl.int32), ROW)
            tl.store(out + written + slot, offs, mask=take)
            written += count
    else:
        equal_seen = 0
        for b in range(0, n, BLOCK):
            offs = _block(b, BLOCK, ROW)
            valid = offs < n
            u = _order_key(_load_row(row, offs, n, VEC))
            eq = (valid & (u == key)).to(tl.int32)
            eq_rank, eq_count = _rank(eq, ROW)
            take = (valid & (u > key)) | ((eq == 1) & (equal_seen + eq_rank < take_eq))
            slot, count = _rank(take.to(tl.int32), ROW)
            tl.store(out + written + slot, offs, mask=take)
            written += count
            equal_seen += eq_count


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
    PDL: tl.constexpr = False,
):
    """The radix select: four histogram passes over the row, one write pass."""
    pdl_wait(PDL)
    t = tl.program_id(0).to(tl.int64)
    n = tl.load(POSITIONS + t).to(tl.int32) + 1
    row = SCORES + t * stride_st
    out = OUT + t * stride_ot
    if n <= topk:
        _short_row(out, n, topk, BLOCK_K)
    else:
        none = tl.zeros([], tl.uint32)  # no key bounds: SKIP is off
        key, take_eq, num_eq = _radix_threshold(row, row, n, topk, none, none, False, BLOCK, 1, False)
        _write_selected(row, out, n, key, take_eq, num_eq, BLOCK, 1, 1)


@triton.jit
def _range_bin(x, lo, scale, BINS: tl.constexpr):
    """Value-range bin of ``x ≥ lo``: ``⌊(x − lo) · scale⌋`` clamped to ``[0, BINS)``; monotone
    in ``x`` (each rounded step is)."""
    return tl.minimum(tl.maximum(((x - lo) * scale).to(tl.int32), 0), BINS - 1)


@triton.jit
def _span(row, start, end, BLOCK: tl.constexpr, VEC: tl.constexpr):
    """(min, max) of ``row[start…end)`` (``+inf, -inf`` when empty)."""
    lo_acc = tl.full([BLOCK], float("inf"), tl.float32)
    hi_acc = tl.full([BLOCK], float("-inf"), tl.float32)
    for b in range(start, end, BLOCK):
        offs = b + tl.arange(0, BLOCK)
        x = _load_row(row, offs, end, VEC)
        hi_acc = tl.maximum(hi_acc, tl.where(offs < end, x, float("-inf")))
        lo_acc = tl.minimum(lo_acc, tl.where(offs < end, x, float("inf")))
    return tl.min(lo_acc, 0), tl.max(hi_acc, 0)


@triton.jit
def _range_scale(lo, hi, BINS: tl.constexpr):
    """(bins per unit of score, whether the range is usable): a constant row (``+inf``) or a
    range past fp32's (``0``) is not; its scale is then 0."""
    scale = BINS / (hi - lo)
    ranged = (scale > 0.0) & (scale < float("inf"))
    return tl.where(ranged, scale, 0.0), ranged


@triton.jit
def _range_hist(row, start, end, lo, scale, BINS: tl.constexpr, BLOCK: tl.constexpr, VEC: tl.constexpr):
    """``BINS``-bin histogram of the value-range bins of ``row[start…end)``."""
    hist = tl.zeros([BINS], tl.int32)
    for b in range(start, end, BLOCK):
        offs = b + tl.arange(0, BLOCK)
        valid = offs < end
        x = _load_row(row, offs, end, VEC)
        hist += tl.histogram(_range_bin(x, lo, scale, BINS), BINS, mask=valid)
    return hist


@triton.jit
def _in_cut(x, lo, scale, cut, lo2, scale2, cut2, BINS: tl.constexpr, TWO: tl.constexpr):
    """Whether ``x`` lies in the threshold bin: level-1 bin ``cut`` and, with ``TWO`` levels,
    level-2 bin ``cut2`` within it."""
    inside = _range_bin(x, lo, scale, BINS) == cut
    if TWO:
        inside = inside & (_range_bin(x, lo2, scale2, BINS) == cut2)
    return inside


@triton.jit
def _range_hist2(row, start, end, lo, scale, cut, lo2, scale2, BINS: tl.constexpr, BLOCK: tl.constexpr,
                 VEC: tl.constexpr):  # fmt: skip
    """``BINS``-bin histogram of the level-2 bins of the keys of ``row[start…end)`` in level-1
    bin ``cut``."""
    hist = tl.zeros([BINS], tl.int32)
    for b in range(start, end, BLOCK):
        offs = b + tl.arange(0, BLOCK)
        x = _load_row(row, offs, end, VEC)
        inside = (offs < end) & (_range_bin(x, lo, scale, BINS) == cut)
        hist += tl.histogram(_range_bin(x, lo2, scale2, BINS), BINS, mask=inside)
    return hist


@triton.jit
def _refine(lo, scale, cut, BINS: tl.constexpr):
    """(lo, scale) of the second level over level-1 bin ``cut``, and whether it is usable. Any
    monotone map of the bin's keys would do (keys rounded outside its nominal bounds clamp to
    the end bins)."""
    scale2 = scale * BINS
    return lo + cut.to(tl.float32) / scale, scale2, scale2 < float("inf")


@triton.jit
def _cut(hist, topk, BINS: tl.constexpr):
    """(threshold bin: the highest whose keys and those above number ≥ ``topk``, how many of
    its keys the top-k takes, how many keys it holds)."""
    bins = tl.arange(0, BINS)
    at_least = tl.sum(hist, 0) - tl.cumsum(hist, 0) + hist
    cut = tl.sum((at_least >= topk).to(tl.int32), 0) - 1
    return cut, topk - tl.sum(tl.where(bins > cut, hist, 0), 0), tl.sum(tl.where(bins == cut, hist, 0), 0)


@triton.jit
def _list_candidates(row, out, start, end, lo, scale, cut, lo2, scale2, cut2, base, cap, BINS: tl.constexpr,
                     BLOCK: tl.constexpr, VEC: tl.constexpr, TWO: tl.constexpr):  # fmt: skip
    """Write the positions of ``row[start…end)`` in the threshold bin (:func:`_in_cut`) to
    ``out[base…]`` (at most ``cap`` slots)."""
    listed = 0
    for b in range(start, end, BLOCK):
        offs = _block(b, BLOCK, 4)
        x = _load_row(row, offs, end, VEC)
        cand = (offs < end) & _in_cut(x, lo, scale, cut, lo2, scale2, cut2, BINS, TWO)
        slot, count = _rank(cand.to(tl.int32), 4)
        slot += base + listed
        tl.store(out + slot, offs, mask=cand & (slot < cap))
        listed += count


@triton.jit
def _list_bounds(row, idx, n, BLOCK: tl.constexpr):
    """(smallest, largest) order key of the scores ``row[idx[0…n)]``."""
    kmin = tl.full([BLOCK], 0xFFFFFFFF, tl.uint32)
    kmax = tl.zeros([BLOCK], tl.uint32)
    for b in range(0, n, BLOCK):
        offs = b + tl.arange(0, BLOCK)
        valid = offs < n
        u = _order_key(tl.load(row + tl.load(idx + offs, mask=valid, other=0), mask=valid, other=0.0))
        kmin = tl.minimum(kmin, tl.where(valid, u, kmin))
        kmax = tl.maximum(kmax, tl.where(valid, u, kmax))
    return tl.min(kmin, 0), tl.max(kmax, 0)


# Keys per step of the passes over a candidate list (a few hundred keys, usually).
LIST_BLOCK: tl.constexpr = tl.constexpr(256)


@triton.jit
def _sort_threshold(row, idx, n, need, SIZE: tl.constexpr, PART: tl.constexpr):
    """:func:`_radix_threshold`'s result for the ``n ≤ N = SIZE // PART`` scores
    ``row[idx[0…n)]``, from one sort of their keys in registers (the padding, key 0, sorts below
    every finite score's)."""
    N: tl.constexpr = SIZE // PART
    offs = tl.arange(0, N)
    valid = offs < n
    u = _order_key(tl.load(row + tl.load(idx + offs, mask=valid, other=0), mask=valid, other=0.0))
    u = tl.where(valid, u, tl.zeros_like(u))
    key = tl.sum(tl.where(offs == N - need, tl.sort(u), tl.zeros_like(u)), 0)
    above = tl.sum((valid & (u > key)).to(tl.int32), 0)
    return key, need - above, tl.sum((valid & (u == key)).to(tl.int32), 0)


@triton.jit
def _list_threshold(row, idx, num_cand, need, VEC: tl.constexpr, LIST_SORT: tl.constexpr):
    """:func:`_radix_threshold`'s result for the ``num_cand`` scores ``row[idx[0…num_cand)]``
    (``need`` of them taken): one sort in registers for lists up to ``LIST_SORT`` keys, else the
    radix select over the list."""
    if num_cand <= LIST_SORT // 4:
        key, take_eq, num_eq = _sort_threshold(row, idx, num_cand, need, LIST_SORT, 4)
    elif num_cand <= LIST_SORT // 2:
        key, take_eq, num_eq = _sort_threshold(row, idx, num_cand, need, LIST_SORT, 2)
    elif num_cand <= LIST_SORT:
        key, take_eq, num_eq = _sort_threshold(row, idx, num_cand, need, LIST_SORT, 1)
    else:
        kmin, kmax = _list_bounds(row, idx, num_cand, LIST_BLOCK)
        key, take_eq, num_eq = _radix_threshold(row, idx, num_cand, need, kmin, kmax, True, LIST_BLOCK, VEC, True)
    return key, take_eq, num_eq


@triton.jit
def _write_above_and_list(row, out, cand, n, lo, scale, cut, lo2, scale2, cut2, BINS: tl.constexpr,
                          BLOCK: tl.constexpr, VEC: tl.constexpr, MODE: tl.constexpr):  # fmt: skip
    """One pass over ``row[0…n)``: the positions above the threshold (every one of them is
    selected) to ``out`` and those at it (the candidates) to ``cand``, each in ascending position
    order. ``MODE`` 1: the threshold is :func:`_in_cut`'s level-1 bin ``cut``, 2: its level-2 bin
    ``cut2`` within it."""
    written = 0
    listed = 0
    for b in range(0, n, BLOCK):
        offs = _block(b, BLOCK, 4)
        x = _load_row(row, offs, n, VEC)
        valid = offs < n
        bin1 = _range_bin(x, lo, scale, BINS)
        if MODE == 2:
            bin2 = _range_bin(x, lo2, scale2, BINS)
            above = valid & ((bin1 > cut) | ((bin1 == cut) & (bin2 > cut2)))
            inside = valid & (bin1 == cut) & (bin2 == cut2)
        else:
            above = valid & (bin1 > cut)
            inside = valid & (bin1 == cut)
        # both prefix counts from one scan: above in the low 16 bits, inside in the high ones
        # (each count is at most the block's keys, fewer than 2^15: the sum stays below 2^31)
        slots, counts = _rank(above.to(tl.int32) + (inside.to(tl.int32) << 16), 4)
        tl.store(out + written + (slots & 0xFFFF), offs, mask=above)
        tl.store(cand + listed + (slots >> 16), offs, mask=inside)
        written += counts & 0xFFFF
        listed += counts >> 16


@triton.jit
def _write_listed(row, cand, num_cand, out, key, take_eq):
    """Append to ``out``, in the list's (ascending position) order, the candidates
    ``cand[0…num_cand)`` whose order key is above ``key`` and the first ``take_eq`` of those
    equal to it."""
    written = 0
    equal_seen = 0
    for b in range(0, num_cand, LIST_BLOCK):
        offs = b + tl.arange(0, LIST_BLOCK)
        valid = offs < num_cand
        pos = tl.load(cand + offs, mask=valid, other=0)
        u = _order_key(tl.load(row + pos, mask=valid, other=0.0))
        eq = (valid & (u == key)).to(tl.int32)
        eq_rank, eq_count = _rank(eq, 1)
        take = (valid & (u > key)) | ((eq == 1) & (equal_seen + eq_rank < take_eq))
        slot, count = _rank(take.to(tl.int32), 1)
        tl.store(out + written + slot, pos, mask=take)
        written += count
        equal_seen += eq_count


@triton.jit
def _finish(row, out, n, topk, listed, num_cand, need, lo, hi, BLOCK: tl.constexpr, VEC: tl.constexpr,
            LIST_SORT: tl.constexpr):  # fmt: skip
    """The select's last steps for a row of ``n > topk`` keys with scores in ``[lo, hi]``: the
    exact threshold from the ``num_cand`` candidate positions listed in ``out`` when ``listed``
    (``need`` of them taken; a sort when they are at most ``LIST_SORT``, else the radix select),
    else from the whole row; then the write pass."""
    if listed:
        tl.debug_barrier()  # the list was written by other threads
        key, take_eq, num_eq = _list_threshold(row, out, num_cand, need, VEC, LIST_SORT)
        tl.debug_barrier()  # read before the write pass overwrites it
    else:
        kmin = _order_key(lo)
        kmax = _order_key(hi)
        key, take_eq, num_eq = _radix_threshold(row, row, n, topk, kmin, kmax, False, BLOCK, VEC, True)
    _write_selected(row, out, n, key, take_eq, num_eq, BLOCK, VEC, 4)


@triton.jit
def _short_row(out, n, topk, BLOCK_K: tl.constexpr):
    """A row of ``n ≤ topk`` keys: ``0…n-1`` then ``-1``."""
    for o in range(0, topk, BLOCK_K):
        offs = o + tl.arange(0, BLOCK_K)
        tl.store(out + offs, tl.where(offs < n, offs, -1), mask=offs < topk)


@triton.jit
def _range_select_kernel(
    SCORES,
    POSITIONS,
    OUT,
    CAND,
    stride_st,
    stride_ot,
    stride_ct,
    topk,
    BLOCK: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BINS: tl.constexpr,
    VEC: tl.constexpr,
    LIST_SORT: tl.constexpr,
    PDL: tl.constexpr = False,
):
    """The range select, one program per row: min/max pass, histogram pass (and a second one
    over a crowded threshold bin), one pass writing the keys above the threshold bin to ``OUT``
    and listing the bin's keys in ``CAND`` (scratch ``[T, K]``), the threshold from the list,
    the list's selected keys appended. Programs take the rows last to first: a prefill's longest
    rows start first."""
    pdl_wait(PDL)
    t = (tl.num_programs(0) - 1 - tl.program_id(0)).to(tl.int64)
    n = tl.load(POSITIONS + t).to(tl.int32) + 1
    row = SCORES + t * stride_st
    out = OUT + t * stride_ot
    cand = CAND + t * stride_ct
    if n <= topk:
        _short_row(out, n, topk, BLOCK_K)
    else:
        _range_row(row, out, cand, n, topk, BLOCK, BINS, VEC, LIST_SORT)


@triton.jit
def _range_row(row, out, cand, n, topk, BLOCK: tl.constexpr, BINS: tl.constexpr, VEC: tl.constexpr,
               LIST_SORT: tl.constexpr):  # fmt: skip
    """The range select of one row of ``n > topk`` keys (:func:`_range_select_kernel`)."""
    lo, hi = _span(row, 0, n, BLOCK, VEC)
    scale, ranged = _range_scale(lo, hi, BINS)
    cut, need, num_cand = _cut(_range_hist(row, 0, n, lo, scale, BINS, BLOCK, VEC), topk, BINS)
    lo2, scale2, refinable = _refine(lo, scale, cut, BINS)
    cut2 = 0
    if ranged & (num_cand > topk) & refinable:  # a crowded threshold bin: split it again
        hist2 = _range_hist2(row, 0, n, lo, scale, cut, lo2, scale2, BINS, BLOCK, VEC)
        cut2, need, num_cand = _cut(hist2, need, BINS)
    else:
        scale2 = 0.0
    if ranged & (num_cand <= topk):  # the keys above the threshold bin, and the bin's listed
        if scale2 == 0.0:
            _write_above_and_list(row, out, cand, n, lo, scale, cut, lo2, scale2, cut2, BINS, BLOCK, VEC, 1)
        else:
            _write_above_and_list(row, out, cand, n, lo, scale, cut, lo2, scale2, cut2, BINS, BLOCK, VEC, 2)
        tl.debug_barrier()  # the list was written by other threads
        key, take_eq, _ = _list_threshold(row, cand, num_cand, need, VEC, LIST_SORT)
        _write_listed(row, cand, num_cand, out + (topk - need), key, take_eq)
    else:
        _finish(row, out, n, topk, False, num_cand, need, lo, hi, BLOCK, VEC, LIST_SORT)


# The split select: SPLITS programs per row for the passes over the row, one for the rest.
# Scratch: SPAN [T, SPLITS, 2] fp32 (each part's min, max), HIST [T, 2 * BINS + 1] int32 zeroed
# (the row's level-1 and level-2 histograms, then how many candidates are listed), summed with
# integer atomics (exact, so the result is deterministic whatever their order).


@triton.jit
def _split_span_kernel(SCORES, POSITIONS, SPAN, stride_st, topk, CHUNK: tl.constexpr, SPLITS: tl.constexpr,
                       BLOCK: tl.constexpr, VEC: tl.constexpr, PDL: tl.constexpr = False):  # fmt: skip
    """Part ``s`` of row ``t``: its min and max to ``SPAN``."""
    pdl_wait(PDL)
    t = tl.program_id(0).to(tl.int64)
    s = tl.program_id(1)
    n = tl.load(POSITIONS + t).to(tl.int32) + 1
    end = tl.where(n > topk, tl.minimum(n, (s + 1) * CHUNK), 0)
    lo, hi = _span(SCORES + t * stride_st, s * CHUNK, end, BLOCK, VEC)
    tl.store(SPAN + (t * SPLITS + s) * 2, lo)
    tl.store(SPAN + (t * SPLITS + s) * 2 + 1, hi)


@triton.jit
def _row_span(SPAN, t, BINS: tl.constexpr, SPLITS: tl.constexpr):
    """(lo, scale, ranged, hi) of row ``t`` from its parts' spans."""
    parts = SPAN + t * SPLITS * 2 + tl.arange(0, SPLITS) * 2
    lo = tl.min(tl.load(parts), 0)
    hi = tl.max(tl.load(parts + 1), 0)
    scale, ranged = _range_scale(lo, hi, BINS)
    return lo, scale, ranged, hi


@triton.jit
def _split_hist_kernel(SCORES, POSITIONS, SPAN, HIST, stride_st, topk, CHUNK: tl.constexpr, SPLITS: tl.constexpr,
                       BINS: tl.constexpr, BLOCK: tl.constexpr, VEC: tl.constexpr, PDL: tl.constexpr = False):  # fmt: skip
    """Part ``s`` of row ``t``: its level-1 histogram added to the row's in ``HIST``."""
    pdl_wait(PDL)
    t = tl.program_id(0).to(tl.int64)
    s = tl.program_id(1)
    n = tl.load(POSITIONS + t).to(tl.int32) + 1
    if (n > topk) & (s * CHUNK < n):
        lo, scale, _, _ = _row_span(SPAN, t, BINS, SPLITS)
        end = tl.minimum(n, (s + 1) * CHUNK)
        hist = _range_hist(SCORES + t * stride_st, s * CHUNK, end, lo, scale, BINS, BLOCK, VEC)
        tl.atomic_add(HIST + t * (2 * BINS + 1) + tl.arange(0, BINS), hist, sem="relaxed")


@triton.jit
def _split_levels(SPAN, HIST, t, topk, BINS: tl.constexpr, SPLITS: tl.constexpr):
    """Row ``t``'s ``(lo, scale, cut, lo2, scale2, cut2, need, num_cand, ranged, hi)`` from the
    scratch; the level-2 histogram counts only when the level-1 threshold bin was refined."""
    lo, scale, ranged, hi = _row_span(SPAN, t, BINS, SPLITS)
    hist_row = HIST + t * (2 * BINS + 1)
    cut, need, num_cand = _cut(tl.load(hist_row + tl.arange(0, BINS)), topk, BINS)
    lo2, scale2, refinable = _refine(lo, scale, cut, BINS)
    refined = ranged & (num_cand > topk) & refinable
    cut2 = 0
    if refined:
        cut2, need, num_cand = _cut(tl.load(hist_row + BINS + tl.arange(0, BINS)), need, BINS)
    else:
        scale2 = 0.0
    return lo, scale, cut, lo2, scale2, cut2, need, num_cand, ranged, hi


@triton.jit
def _split_refine_kernel(SCORES, POSITIONS, SPAN, HIST, stride_st, topk, CHUNK: tl.constexpr,
                         SPLITS: tl.constexpr, BINS: tl.constexpr, BLOCK: tl.constexpr, VEC: tl.constexpr, PDL: tl.constexpr = False):  # fmt: skip
    """Part ``s`` of row ``t``, when the row's threshold bin is crowded: its level-2 histogram
    of that bin added to the row's."""
    pdl_wait(PDL)
    t = tl.program_id(0).to(tl.int64)
    s = tl.program_id(1)
    n = tl.load(POSITIONS + t).to(tl.int32) + 1
    if (n > topk) & (s * CHUNK < n):
        lo, scale, ranged, _ = _row_span(SPAN, t, BINS, SPLITS)
        hist_row = HIST + t * (2 * BINS + 1)
        cut, _, num_cand = _cut(tl.load(hist_row + tl.arange(0, BINS)), topk, BINS)
        lo2, scale2, refinable = _refine(lo, scale, cut, BINS)
        if ranged & (num_cand > topk) & refinable:
            end = tl.minimum(n, (s + 1) * CHUNK)
            hist = _range_hist2(
                SCORES + t * stride_st, s * CHUNK, end, lo, scale, cut, lo2, scale2, BINS, BLOCK, VEC
            )
            tl.atomic_add(hist_row + BINS + tl.arange(0, BINS), hist, sem="relaxed")


@triton.jit
def _split_list_kernel(SCORES, POSITIONS, SPAN, HIST, OUT, stride_st, stride_ot, topk, CHUNK: tl.constexpr,
                       SPLITS: tl.constexpr, BINS: tl.constexpr, BLOCK: tl.constexpr, VEC: tl.constexpr, PDL: tl.constexpr = False):  # fmt: skip
    """Part ``s`` of row ``t``: its threshold-bin keys listed in ``OUT``'s row."""
    pdl_wait(PDL)
    t = tl.program_id(0).to(tl.int64)
    s = tl.program_id(1)
    n = tl.load(POSITIONS + t).to(tl.int32) + 1
    if (n > topk) & (s * CHUNK < n):
        lo, scale, cut, lo2, scale2, cut2, _, num_cand, ranged, _ = _split_levels(
            SPAN, HIST, t, topk, BINS, SPLITS
        )
        if ranged & (num_cand <= topk):
            args = (SCORES + t * stride_st, OUT + t * stride_ot, HIST + t * (2 * BINS + 1) + 2 * BINS, s * CHUNK,
                    tl.minimum(n, (s + 1) * CHUNK), lo, scale, cut, lo2, scale2, cut2, topk)  # fmt: skip
            if scale2 == 0.0:
                _list_part(*args, BINS, BLOCK, VEC, False)
            else:
                _list_part(*args, BINS, BLOCK, VEC, True)


@triton.jit
def _list_part(row, out, count_ptr, start, end, lo, scale, cut, lo2, scale2, cut2, cap, BINS: tl.constexpr,
               BLOCK: tl.constexpr, VEC: tl.constexpr, TWO: tl.constexpr):  # fmt: skip
    """List one part's candidates: count them, take that many slots of the row's list (``*count_ptr``
    counts the slots taken; parts list in any order, only the candidates' keys count), list them."""
    count = tl.zeros([BLOCK], tl.int32)
    for b in range(start, end, BLOCK):
        offs = b + tl.arange(0, BLOCK)
        x = _load_row(row, offs, end, VEC)
        count += ((offs < end) & _in_cut(x, lo, scale, cut, lo2, scale2, cut2, BINS, TWO)).to(tl.int32)
    count_all = tl.sum(count, 0)
    if count_all > 0:
        base = tl.atomic_add(count_ptr, count_all, sem="relaxed")
        _list_candidates(
            row, out, start, end, lo, scale, cut, lo2, scale2, cut2, base, cap, BINS, BLOCK, VEC, TWO
        )


@triton.jit
def _split_finish_kernel(SCORES, POSITIONS, SPAN, HIST, OUT, stride_st, stride_ot, topk, SPLITS: tl.constexpr,
                         BINS: tl.constexpr, BLOCK: tl.constexpr, BLOCK_K: tl.constexpr, VEC: tl.constexpr,
                         LIST_SORT: tl.constexpr, PDL: tl.constexpr = False):  # fmt: skip
    """Row ``t``: the threshold from its list (or from the whole row), then the write pass."""
    pdl_wait(PDL)
    t = tl.program_id(0).to(tl.int64)
    n = tl.load(POSITIONS + t).to(tl.int32) + 1
    out = OUT + t * stride_ot
    if n <= topk:
        _short_row(out, n, topk, BLOCK_K)
    else:
        lo, _, _, _, _, _, need, num_cand, ranged, hi = _split_levels(SPAN, HIST, t, topk, BINS, SPLITS)
        listed = ranged & (num_cand <= topk)
        _finish(SCORES + t * stride_st, out, n, topk, listed, num_cand, need, lo, hi, BLOCK, VEC, LIST_SORT)


METHODS = ("range", "radix", "split")
# Keys per step of the range select: 512 took 4.5% less than 1024 at all rows of an 8192-token
# prefill, 4.7% at 16384 and 1.6% with a sink (one H100, scripts/bench_topk.py --quick).
RANGE_BLOCK = 512


def topk_select_triton(
    scores: torch.Tensor,
    positions: torch.Tensor,
    topk_out: torch.Tensor,
    *,
    method: str | None = None,
    block: int | None = None,
    bins: int = 128,
    splits: int | None = None,
    list_sort: int = 1024,
    num_warps: int = 4,
) -> None:
    """Causal top-k of each row: ``topk_out[t]`` (int32 ``[T, K]``) gets the ``K`` positions
    ``j ≤ positions[t]`` with the largest ``scores[t, j]`` (ties to the lower position; in
    ascending position order within the parts of the module docstring), or ``0…positions[t]``
    then ``-1`` when the row has at most ``K`` keys.
    Reads ``scores[t, :positions[t] + 1]`` only. Graph-safe (the choice below and the grid
    depend on shapes only).

    ``method``: ``"range"`` (one program per row), ``"split"`` (``splits`` programs per
    row for the passes over the row; for few long rows) or ``"radix"`` (the four-pass radix
    select); default :func:`default_method`. ``block``: keys per loop step (default 512 for
    range and radix, 2048 for split); ``bins``: the value-range histogram's bins;
    ``list_sort`` (a power of two ≥ 4): the longest candidate list finished by a sort in
    registers (longer ones by the radix select)."""
    num_tokens, topk = topk_out.shape
    method = method or default_method(num_tokens, scores.shape[1], topk)
    if method not in METHODS:
        raise ValueError(f"method: expected one of {METHODS}, got {method!r}")
    if num_tokens == 0:
        return
    block_k = min(1024, triton.next_power_of_2(topk))
    strides = (scores.stride(0), topk_out.stride(0))
    pdl = pdl_launch(scores.device)
    # Rows whose ends may be rounded up to 4 keys without leaving the tensor vectorise.
    vec = 4 if scores.shape[1] % 4 == 0 and scores.stride(0) % 4 == 0 else 1
    if method == "radix":
        _topk_select_kernel[(num_tokens,)](
            scores,
            positions,
            topk_out,
            *strides,
            topk,
            BLOCK=block or 512,
            BLOCK_K=block_k,
            num_warps=num_warps,
            **pdl,
        )
    elif method == "range":
        # scratch for the threshold's candidates, [T, K] int32; none where no row can pass K keys
        cand = torch.empty(num_tokens, topk, dtype=torch.int32, device=scores.device) if scores.shape[1] > topk else topk_out
        if (block or RANGE_BLOCK) >= 1 << 15:
            raise ValueError(f"block: fewer than 32768 keys a step for the range select, got {block}")
        opts = dict(BLOCK=block or RANGE_BLOCK, BLOCK_K=block_k, BINS=bins, VEC=vec, LIST_SORT=list_sort, num_warps=num_warps)
        _range_select_kernel[(num_tokens,)](scores, positions, topk_out, cand, *strides, cand.stride(0), topk, **opts, **pdl)
    else:
        block = block or 2048
        splits = splits or default_splits(num_tokens, scores.shape[1], block)
        chunk = triton.cdiv(triton.cdiv(scores.shape[1], splits), block) * block
        span = torch.empty(num_tokens, splits, 2, dtype=torch.float32, device=scores.device)
        hist = torch.zeros(num_tokens, 2 * bins + 1, dtype=torch.int32, device=scores.device)
        grid = (num_tokens, splits)
        opts = dict(SPLITS=splits, BLOCK=block, VEC=vec, num_warps=num_warps, **pdl)
        _split_span_kernel[grid](scores, positions, span, scores.stride(0), topk, CHUNK=chunk, **opts)
        _split_hist_kernel[grid](
            scores, positions, span, hist, scores.stride(0), topk, CHUNK=chunk, BINS=bins, **opts
        )
        _split_refine_kernel[grid](
            scores, positions, span, hist, scores.stride(0), topk, CHUNK=chunk, BINS=bins, **opts
        )
        _split_list_kernel[grid](
            scores, positions, span, hist, topk_out, *strides, topk, CHUNK=chunk, BINS=bins, **opts
        )
        _split_finish_kernel[(num_tokens,)](
            scores, positions, span, hist, topk_out, *strides, topk, BINS=bins, BLOCK_K=block_k, LIST_SORT=list_sort,
            **opts,
        )  # fmt: skip


def default_splits(num_tokens: int, width: int, block: int, num_programs: int = 512) -> int:
    """Programs per row of the split select: enough for about ``num_programs`` in all, each
    part at least ``block`` keys, a power of two ≤ 64."""
    want = min(64, max(1, num_programs // max(1, num_tokens)), max(1, width // block))
    return 1 << (want.bit_length() - 1)


def default_method(num_tokens: int, width: int, topk: int) -> str:
    """The select for ``num_tokens`` rows of up to ``width`` keys: ``split`` for fewer rows
    than about two per SM when rows are long (over ``SPLIT_SELECT_MIN_KEYS`` = 16K keys), else
    ``range``."""
    return "split" if num_tokens < 256 and width > SPLIT_SELECT_MIN_KEYS else "range"
