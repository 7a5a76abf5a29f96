"""Sparse MLA attention over the paged latent cache (Triton; twin: :func:`sparse_mla_attention_ref`).

Absorbed MLA is MQA: every head of a token attends to the *same* latent rows ``[c ‖ k_pe]``.
Both kernels below split a row into its ``r`` part (the value, also the bulk of the key) and
its rope part, so ``D = r + dr = 576`` needs no power-of-two padding:
``s = q_nope·c + q_pe·k_pe`` (two dots, fp32 accumulate), online softmax in fp32 (base 2),
``acc += p·c`` with ``p`` cast to the cache dtype, as the twin does.

Sparse path (``_sparse_mla_fwd_kernel``). One program owns one token and a block of
``BLOCK_H`` heads (all heads when ``H ≤ 64``) and gathers that token's ``K`` top-k rows, so
a gathered row serves one token's heads only. ``-1`` positions are masked out of the loads (no
memory traffic), but the program still walks all ``K`` columns. At few heads the loop is
bound by instruction issue, not by the gather (H200 ``ncu``: ~6 warp cycles per issued
instruction, DRAM idle, L2 hit 99%), so the key-row addresses come from ``_topk_slots_kernel``,
which turns the top-k positions into cache rows once per call (``SLOTS``): the loop then loads
one int32 per key instead of walking position → page → row itself (where it still does, pages
of a power-of-two size use shifts, ``PAGE_SHIFT``, not an emulated division per key and layout).
``LEAN`` (power-of-two widths, ``K`` a multiple of the key block): the slots
kernel writes ``-1 − f`` for unused entries, ``f`` the cache row of the token's largest
position, so the loop loads whole key blocks and rows without masks (the unused keys read a
real, finite row and are dropped from the scores), with loop-invariant column pointers and one
32-bit row offset per key (an FP8 cache: its load helper with the widths as constants and no
row mask): the masked loop spends ~16 instructions of address and predicate
math per 16-byte copy (sm_90 SASS), the lean one ~4. ``_sparse_mla_groups_kernel`` is the lean
loop with the row in four column groups of ``r/4``: each thread gathers 6 distinct rows per
block instead of 18 and it fits 128 registers (four programs per SM) without a cap. Its head
block is padded to 8 rows, not 16: the loop reads the query tile from shared memory again for
every key block (the ``mma.sync`` A operand of all 576 columns would take 144 registers), so
the padding costs shared-memory bandwidth, which bounds the loop (H200 ``ncu``: L1/shared 78%
busy, short-scoreboard stalls on shared memory; DRAM idle).
``LAZY`` (``_online_softmax``): the accumulator is rescaled only when some row's maximum grew
by more than ``2^LAZY`` since the last rescale, so most blocks skip the ``[16, 512]`` multiply
(the terms stay relative to the stale maximum, at most ``2^LAZY``). The keys as the dots' M side
(swap-AB: 64-key blocks on wgmma, one 169 KB program per SM) measured slower than mma.sync
with heads as M at 8 and 16 heads (docs/benchmarks.md).

Dense-causal path (on when the caller passes ``positions`` and ``dense_below``): token blocks
whose tokens share a request and all sit below ``dense_below`` run
:mod:`~breakgraph.kernels.triton_dense_mla` first; the kernels here evaluate the same predicate
(``_dense_block``) and skip those blocks, so each output row is written once.

FP8 latent cache (``kv_cache`` ``uint8``, rows of :mod:`~breakgraph.kernels.latent_fp8`: 656
bytes instead of 1152): the column-group kernel takes the e4m3 codes into its dots as they are
(converted exactly to bf16) and puts each key's per-128 scale on the score and probability
columns of its group (H200, 8 heads: 1.6x at prefill 8K-16K, 1.5-2.1x at decode against
dequantising the gathered tile); the other kernels dequantise the codes with their scales in
registers to the query's dtype through
:func:`~breakgraph.kernels.triton_latent_fp8.load_latent_rows`. The dots and softmax are as above.

Split-K (flash-decoding) for small batches: when ``T × head_blocks`` programs cannot fill
the GPU (decode), the ``K`` keys are cut into ``num_splits`` ranges (grid axis 2); each split
writes its normalised partial output and log-sum-exp to an fp32 workspace, and a second
kernel merges them. The dense path is off under split-K, so a prefill of at least
``DENSE_MIN_TOKENS`` tokens (caller passes ``dense_below``) never splits. Grids and workspace depend on
shapes only: graph-safe, no host sync.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import triton
import triton.language as tl

from breakgraph.kernels.dispatch import interpreting, num_sms
from breakgraph.kernels.latent_fp8 import GROUP as LATENT_GROUP
from breakgraph.kernels.latent_fp8 import LatentLayout, is_fp8_latent
from breakgraph.kernels.paging import page_shift, rows_fit_int32
from breakgraph.kernels.pdl import pdl_launch, pdl_wait
from breakgraph.kernels.triton_dense_mla import dense_block as _dense_block
from breakgraph.kernels.triton_dense_mla import dense_mla_attention_triton, dense_token_block
from breakgraph.kernels.triton_dense_mla import softmax_step as _softmax_step
from breakgraph.kernels.triton_latent_fp8 import load_latent_rows

_LOG2E = 1.4426950408889634


@triton.jit
def _online_softmax(s, m_i, l_i, TAU: tl.constexpr):
    """One key block of the online softmax (base 2) on scores ``s [M, N]`` (``-inf``: dropped).
    Returns ``(p, alpha, rescale, m_i, l_i)``: the caller computes ``acc · alpha`` where
    ``rescale`` and then adds ``p·v``. ``TAU > 0``: the maxima (and so ``acc``) move only when
    some row's maximum grew by more than ``TAU`` since the last move: the stale maximum bounds
    ``p ≤ 2^TAU`` (fp32 sums, bf16 ``p`` keep their relative precision) and most key blocks skip
    the accumulator's multiply. ``m_i`` is the maximum the terms are relative to."""
    m_new = tl.maximum(m_i, tl.max(s, 1))
    if TAU > 0:
        # -inf − -inf is NaN (a row with no key yet): not a reason to rescale.
        rescale = tl.max(tl.where(m_new > m_i, m_new - m_i, 0.0), 0) > TAU
        m_new = tl.where(rescale, m_new, m_i)
    else:
        rescale = True
    m_use = tl.where(m_new == float("-inf"), 0.0, m_new)  # all-masked so far: keep p = 0
    alpha = tl.exp2(m_i - m_use)
    p = tl.exp2(s - m_use[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    return p, alpha, rescale, m_new, l_i


@triton.jit
def _softmax_step_lazy(q_nope, q_pe, c, k_pe, keep, qk_scale, m_i, l_i, acc, TAU: tl.constexpr):
    """:func:`~breakgraph.kernels.triton_dense_mla.softmax_step` with the lazy rescale of :func:`_online_softmax` (``TAU > 0``)."""
    s = tl.dot(q_nope, tl.trans(c))
    s = tl.dot(q_pe, tl.trans(k_pe), s)
    s = tl.where(keep, s * qk_scale, float("-inf"))
    p, alpha, rescale, m_i, l_i = _online_softmax(s, m_i, l_i, TAU)
    if rescale:
        acc = acc * alpha[:, None]
    acc = tl.dot(p.to(c.dtype), c, acc)
    return m_i, l_i, acc


@triton.jit
def _packed_end(POSITIONS, t, topk, k_end, BLOCK_N: tl.constexpr):
    """``k_end`` cut at the row's valid columns, rounded up to whole key blocks: a packed row
    (``PACKED``) holds its ``min(topk, pos + 1)`` keys in its first columns and ``-1`` after them."""
    count = tl.minimum(tl.load(POSITIONS + t).to(tl.int32) + 1, topk)
    return tl.minimum(k_end, (count + BLOCK_N - 1) // BLOCK_N * BLOCK_N)


@triton.jit
def _sparse_mla_fwd_kernel(
    Q,
    KV,
    TOPK,
    PAGE_TABLE,
    TOKEN_REQ,
    POSITIONS,
    OUT,
    WS_O,
    WS_LSE,
    stride_qt,
    stride_qh,
    stride_kv,
    stride_tk,
    stride_pt,
    stride_ot,
    stride_oh,
    num_tokens,
    num_heads,
    topk,
    rank,
    rope_dim,
    page_size,
    keys_per_split,
    num_splits,
    dense_below,
    qk_scale,  # softmax_scale · log2(e)
    BLOCK_H: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_PE: tl.constexpr,
    SPLIT: tl.constexpr,
    DENSE_T: tl.constexpr,  # token block of the dense kernel; 0: no dense path
    KV_FP8: tl.constexpr = False,  # KV is the uint8 FP8 latent cache (kernels/latent_fp8.py)
    PAGE_SHIFT: tl.constexpr = -1,  # log2(page_size) for a power-of-two page, else -1
    SLOTS: tl.constexpr = False,  # TOPK holds each key's cache row (-1 unused), not its position
    LEAN: tl.constexpr = False,  # SLOTS rows hold -1 - (a real row) where unused: unmasked loads
    LAZY: tl.constexpr = 0,  # > 0: rescale only when a row maximum grows by more than this (log2)
    PACKED: tl.constexpr = False,  # each row's keys are its first min(topk, pos + 1) columns
    CAUSAL: tl.constexpr = False,  # (not SLOTS) row t is 0…POSITIONS[t]: TOPK is not read
    PDL: tl.constexpr = False,
):
    pdl_wait(PDL)
    t = tl.program_id(0).to(tl.int64)
    hb = tl.program_id(1)
    split = tl.program_id(2)
    if DENSE_T > 0:
        if _dense_block(TOKEN_REQ, POSITIONS, t // DENSE_T, num_tokens, dense_below, DENSE_T):
            return  # written by the dense-causal kernel (triton_dense_mla)

    offs_h = hb * BLOCK_H + tl.arange(0, BLOCK_H)
    offs_r = tl.arange(0, BLOCK_R)
    offs_pe = tl.arange(0, BLOCK_PE)
    mask_h = offs_h < num_heads
    mask_r = offs_r < rank
    mask_pe = offs_pe < rope_dim

    q_rows = Q + t * stride_qt + offs_h[:, None] * stride_qh
    q_nope = tl.load(q_rows + offs_r[None, :], mask=mask_h[:, None] & mask_r[None, :], other=0.0)
    q_pe = tl.load(q_rows + rank + offs_pe[None, :], mask=mask_h[:, None] & mask_pe[None, :], other=0.0)

    req = tl.load(TOKEN_REQ + t).to(tl.int64)
    pages = PAGE_TABLE + req * stride_pt
    pos_row = TOPK + t * stride_tk

    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_R], tl.float32)

    k_start = split * keys_per_split
    k_end = tl.minimum(k_start + keys_per_split, topk)
    if PACKED:  # no block past the row's keys (a split past them does nothing)
        k_end = _packed_end(POSITIONS, t, topk, k_end, BLOCK_N)
    if LEAN:  # whole blocks (topk % BLOCK_N == 0), rank == BLOCK_R, rope_dim == BLOCK_PE
        # Loop-invariant column pointers; per key one 32-bit row offset (the caller checks the
        # cache's size): no masks, no 64-bit multiply per key in the loop.
        c_cols = KV + offs_r[None, :]
        pe_cols = KV + BLOCK_R + offs_pe[None, :]
        for n0 in range(k_start, k_end, BLOCK_N):
            raw = tl.load(pos_row + n0 + tl.arange(0, BLOCK_N))
            valid = raw >= 0
            row = tl.where(valid, raw, -1 - raw)
            if KV_FP8:  # the widths as constants: no masks in the helper either
                c, k_pe = load_latent_rows(KV, row, None, offs_r, offs_pe, stride_kv, BLOCK_R, BLOCK_PE, True, Q.dtype.element_ty)  # fmt: skip
            else:
                c = tl.load(c_cols + (row * stride_kv)[:, None])
                k_pe = tl.load(pe_cols + (row * stride_kv)[:, None])
            if LAZY > 0:
                m_i, l_i, acc = _softmax_step_lazy(q_nope, q_pe, c, k_pe, valid[None, :], qk_scale, m_i, l_i, acc, LAZY)
            else:
                m_i, l_i, acc = _softmax_step(q_nope, q_pe, c, k_pe, valid[None, :], qk_scale, m_i, l_i, acc)
    else:
        last = tl.load(POSITIONS + t) if CAUSAL else 0  # the row's last key (CAUSAL: keys 0…last)
        for n0 in range(0, k_end - k_start, BLOCK_N):
            offs_n = k_start + n0 + tl.arange(0, BLOCK_N)
            if CAUSAL:
                pos = tl.where((offs_n < k_end) & (offs_n <= last), offs_n, -1)
            else:
                pos = tl.load(pos_row + offs_n, mask=offs_n < k_end, other=-1)
            valid = pos >= 0
            pos = tl.where(valid, pos, 0)
            if SLOTS:  # TOPK holds cache rows (_topk_slots_kernel): no page-table step in the loop
                slot = pos.to(tl.int64)
            elif PAGE_SHIFT >= 0:  # shifts, not a runtime division per key and layout
                page = tl.load(pages + (pos >> PAGE_SHIFT), mask=valid, other=0)
                slot = ((page << PAGE_SHIFT) + (pos & ((1 << PAGE_SHIFT) - 1))).to(tl.int64)
            else:
                page = tl.load(pages + pos // page_size, mask=valid, other=0).to(tl.int64)
                slot = page * page_size + pos % page_size
            c, k_pe = load_latent_rows(KV, slot, valid, offs_r, offs_pe, stride_kv, rank, rope_dim, KV_FP8, Q.dtype.element_ty)  # fmt: skip
            if LAZY > 0:
                m_i, l_i, acc = _softmax_step_lazy(q_nope, q_pe, c, k_pe, valid[None, :], qk_scale, m_i, l_i, acc, LAZY)
            else:
                m_i, l_i, acc = _softmax_step(q_nope, q_pe, c, k_pe, valid[None, :], qk_scale, m_i, l_i, acc)

    # A row that saw no valid key has l = 0: write 0 (the twin gives NaN there; callers
    # always pass at least the token's own position).
    l_safe = tl.where(l_i > 0.0, l_i, 1.0)
    o = acc * (1.0 / l_safe)[:, None]
    if SPLIT:
        lse = tl.where(l_i > 0.0, m_i + tl.log2(l_safe), float("-inf"))
        ws_row = (t * num_heads + offs_h) * num_splits + split
        tl.store(WS_LSE + ws_row, lse, mask=mask_h)
        tl.store(WS_O + ws_row[:, None] * BLOCK_R + offs_r[None, :], o, mask=mask_h[:, None])
    else:
        o_ptrs = OUT + t * stride_ot + offs_h[:, None] * stride_oh + offs_r[None, :]
        tl.store(o_ptrs, o.to(OUT.dtype.element_ty), mask=mask_h[:, None] & mask_r[None, :])


@triton.jit
def _e4m3_codes(codes, DTYPE: tl.constexpr, ASM: tl.constexpr):
    """e4m3 ``codes`` (uint8) as ``DTYPE`` values, exactly (every e4m3 value is a bf16 value).

    ``ASM`` (bf16, compiled for sm_89+): four codes per 32-bit register through two
    ``cvt.rn.f16x2.e4m3x2`` and fp32 into two bf16 pairs. Declared impure, so the layout pass
    converts the tile once (into shared memory for both dots) instead of rematerialising the
    cast in each dot's operand layout (sm_90a, 8 heads, ``scripts/bench_kernels_attention.py
    --aot``: 901 instead of 1397 instructions per loop trip, 174 registers instead of 255 and
    16 bytes of spills, the codes fetched by ``cp.async``). Else Triton's cast (the interpreter)."""
    if ASM:
        return tl.inline_asm_elementwise(
            """{
            .reg .b16 c01, c23, l0, l1, l2, l3;
            .reg .b32 h0, h1;
            .reg .f32 f0, f1, f2, f3;
            mov.b32 {c01, c23}, $2;
            cvt.rn.f16x2.e4m3x2 h0, c01;
            cvt.rn.f16x2.e4m3x2 h1, c23;
            mov.b32 {l0, l1}, h0;
            mov.b32 {l2, l3}, h1;
            cvt.f32.f16 f0, l0;
            cvt.f32.f16 f1, l1;
            cvt.f32.f16 f2, l2;
            cvt.f32.f16 f3, l3;
            cvt.rn.bf16x2.f32 $0, f1, f0;
            cvt.rn.bf16x2.f32 $1, f3, f2;
            }""",
            "=r,=r,r",
            [codes],
            dtype=tl.bfloat16,
            is_pure=False,
            pack=4,
        )
    else:
        return codes.to(tl.float8e4nv, bitcast=True).to(DTYPE)


@triton.jit
def _sparse_mla_groups_kernel(
    Q,
    KV,
    TOPK,
    PAGE_TABLE,
    TOKEN_REQ,
    POSITIONS,
    OUT,
    WS_O,
    WS_LSE,
    stride_qt,
    stride_qh,
    stride_kv,
    stride_tk,
    stride_pt,
    stride_ot,
    stride_oh,
    num_tokens,
    num_heads,
    topk,
    rank,
    rope_dim,
    page_size,
    keys_per_split,
    num_splits,
    dense_below,
    qk_scale,  # softmax_scale · log2(e)
    BLOCK_H: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_R: tl.constexpr,  # == rank
    BLOCK_PE: tl.constexpr,  # == rope_dim
    SPLIT: tl.constexpr,
    DENSE_T: tl.constexpr,
    LAZY: tl.constexpr = 0,
    KV_FP8: tl.constexpr = False,  # the FP8 latent cache; its offsets:
    SCALE_OFF: tl.constexpr = 0,
    PE_OFF: tl.constexpr = 0,
    CVT_ASM: tl.constexpr = False,  # KV_FP8 with bf16 queries on the GPU: _e4m3_codes's ASM
    PACKED: tl.constexpr = False,  # each row's keys are its first min(topk, pos + 1) columns
    PDL: tl.constexpr = False,
):
    """The sparse kernel's ``LEAN`` loop with the latent row in four column groups of
    ``BLOCK_R / 4``: four key loads (6 distinct rows per thread at 32 keys, 4 warps, instead of
    18), four partial score dots and four accumulators. The rows (``TOPK``) come from
    ``_topk_slots_kernel`` with ``FILL``; same arguments and outputs as ``_sparse_mla_fwd_kernel``.

    ``KV_FP8``: each group lies in one 128-column scale group, so its scale is one number per
    key: the dots take the e4m3 codes as they are (converted exactly to the query's dtype) and
    the scales go on the ``[BLOCK_H, BLOCK_N]`` side instead of on every element of the tile:
    ``s = Σ_g (q_g·c8_gᵀ) · scale_g`` and ``acc_g += (p · scale_g) · c8_g``."""
    pdl_wait(PDL)
    t = tl.program_id(0)  # 32-bit: widened where it addresses (fewer registers live across the loop)
    hb = tl.program_id(1)
    split = tl.program_id(2)
    if DENSE_T > 0:
        if _dense_block(TOKEN_REQ, POSITIONS, t // DENSE_T, num_tokens, dense_below, DENSE_T):
            return  # written by the dense-causal kernel (triton_dense_mla)
    GR: tl.constexpr = BLOCK_R // 4
    dtype = Q.dtype.element_ty
    offs_h = hb * BLOCK_H + tl.arange(0, BLOCK_H)
    offs_g = tl.arange(0, GR)
    offs_pe = tl.arange(0, BLOCK_PE)
    mask_h = offs_h < num_heads
    # Padding rows (heads past num_heads) repeat the last head: unmasked loads, never stored.
    q_rows = Q + t.to(tl.int64) * stride_qt + tl.minimum(offs_h, num_heads - 1)[:, None] * stride_qh
    q0 = tl.load(q_rows + offs_g[None, :])
    q1 = tl.load(q_rows + GR + offs_g[None, :])
    q2 = tl.load(q_rows + 2 * GR + offs_g[None, :])
    q3 = tl.load(q_rows + 3 * GR + offs_g[None, :])
    q_pe = tl.load(q_rows + BLOCK_R + offs_pe[None, :])
    pos_row = TOPK + t.to(tl.int64) * stride_tk

    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc0 = tl.zeros([BLOCK_H, GR], tl.float32)
    acc1 = tl.zeros([BLOCK_H, GR], tl.float32)
    acc2 = tl.zeros([BLOCK_H, GR], tl.float32)
    acc3 = tl.zeros([BLOCK_H, GR], tl.float32)
    k_start = split * keys_per_split
    k_end = tl.minimum(k_start + keys_per_split, topk)
    if PACKED:
        k_end = _packed_end(POSITIONS, t, topk, k_end, BLOCK_N)
    for n0 in range(k_start, k_end, BLOCK_N):
        raw = tl.load(pos_row + n0 + tl.arange(0, BLOCK_N))
        valid = raw >= 0
        row = KV + tl.where(valid, raw, -1 - raw) * stride_kv
        rows = row[:, None]
        if KV_FP8:
            # Scale group of column group g: g·GR // 128 (all four in group 0 where r ≤ 128).
            scales = (row + SCALE_OFF).to(tl.pointer_type(tl.float32))
            sc0 = tl.load(scales + 0 * GR // 128)
            sc1 = tl.load(scales + 1 * GR // 128)
            sc2 = tl.load(scales + 2 * GR // 128)
            sc3 = tl.load(scales + 3 * GR // 128)
            k_pe = tl.load((row + PE_OFF).to(tl.pointer_type(tl.bfloat16))[:, None] + offs_pe[None, :]).to(dtype)
            c0 = _e4m3_codes(tl.load(rows + offs_g[None, :]), dtype, CVT_ASM)
            c1 = _e4m3_codes(tl.load(rows + GR + offs_g[None, :]), dtype, CVT_ASM)
            c2 = _e4m3_codes(tl.load(rows + 2 * GR + offs_g[None, :]), dtype, CVT_ASM)
            c3 = _e4m3_codes(tl.load(rows + 3 * GR + offs_g[None, :]), dtype, CVT_ASM)
        else:
            c0 = tl.load(rows + offs_g[None, :])
            c1 = tl.load(rows + GR + offs_g[None, :])
            c2 = tl.load(rows + 2 * GR + offs_g[None, :])
            c3 = tl.load(rows + 3 * GR + offs_g[None, :])
            k_pe = tl.load(rows + BLOCK_R + offs_pe[None, :])
        if KV_FP8:
            s = tl.dot(q_pe, tl.trans(k_pe))
            s += tl.dot(q0, tl.trans(c0)) * sc0[None, :]
            s += tl.dot(q1, tl.trans(c1)) * sc1[None, :]
            s += tl.dot(q2, tl.trans(c2)) * sc2[None, :]
            s += tl.dot(q3, tl.trans(c3)) * sc3[None, :]
        else:
            s = tl.dot(q_pe, tl.trans(k_pe), tl.dot(q0, tl.trans(c0)))
            s = tl.dot(q3, tl.trans(c3), tl.dot(q2, tl.trans(c2), tl.dot(q1, tl.trans(c1), s)))
        s = tl.where(valid[None, :], s * qk_scale, float("-inf"))
        p, alpha, rescale, m_i, l_i = _online_softmax(s, m_i, l_i, LAZY)
        if rescale:
            acc0, acc1 = acc0 * alpha[:, None], acc1 * alpha[:, None]
            acc2, acc3 = acc2 * alpha[:, None], acc3 * alpha[:, None]
        if KV_FP8:
            acc0 = tl.dot((p * sc0[None, :]).to(dtype), c0, acc0)
            acc1 = tl.dot((p * sc1[None, :]).to(dtype), c1, acc1)
            acc2 = tl.dot((p * sc2[None, :]).to(dtype), c2, acc2)
            acc3 = tl.dot((p * sc3[None, :]).to(dtype), c3, acc3)
        else:
            p = p.to(dtype)
            acc0 = tl.dot(p, c0, acc0)
            acc1 = tl.dot(p, c1, acc1)
            acc2 = tl.dot(p, c2, acc2)
            acc3 = tl.dot(p, c3, acc3)

    l_safe = tl.where(l_i > 0.0, l_i, 1.0)
    inv = (1.0 / l_safe)[:, None]
    if SPLIT:
        lse = tl.where(l_i > 0.0, m_i + tl.log2(l_safe), float("-inf"))
        ws_row = (t.to(tl.int64) * num_heads + offs_h) * num_splits + split
        tl.store(WS_LSE + ws_row, lse, mask=mask_h)
        o_ptrs = WS_O + ws_row[:, None] * BLOCK_R + offs_g[None, :]
        tl.store(o_ptrs, acc0 * inv, mask=mask_h[:, None])
        tl.store(o_ptrs + GR, acc1 * inv, mask=mask_h[:, None])
        tl.store(o_ptrs + 2 * GR, acc2 * inv, mask=mask_h[:, None])
        tl.store(o_ptrs + 3 * GR, acc3 * inv, mask=mask_h[:, None])
    else:
        o_ptrs = OUT + t.to(tl.int64) * stride_ot + offs_h[:, None] * stride_oh + offs_g[None, :]
        o_type = OUT.dtype.element_ty
        tl.store(o_ptrs, (acc0 * inv).to(o_type), mask=mask_h[:, None])
        tl.store(o_ptrs + GR, (acc1 * inv).to(o_type), mask=mask_h[:, None])
        tl.store(o_ptrs + 2 * GR, (acc2 * inv).to(o_type), mask=mask_h[:, None])
        tl.store(o_ptrs + 3 * GR, (acc3 * inv).to(o_type), mask=mask_h[:, None])


@triton.jit
def _sparse_mla_merge_kernel(
    WS_O,
    WS_LSE,
    OUT,
    stride_ot,
    stride_oh,
    num_heads,
    rank,
    num_splits,
    BLOCK_S: tl.constexpr,
    BLOCK_R: tl.constexpr,
    PDL: tl.constexpr = False,
):
    pdl_wait(PDL)
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    offs_s = tl.arange(0, BLOCK_S)
    offs_r = tl.arange(0, BLOCK_R)
    mask_s = offs_s < num_splits
    ws_row = (t * num_heads + h) * num_splits + offs_s
    lse = tl.load(WS_LSE + ws_row, mask=mask_s, other=float("-inf"))
    m = tl.max(lse, 0)
    m = tl.where(m == float("-inf"), 0.0, m)
    w = tl.exp2(lse - m)
    w_sum = tl.sum(w, 0)
    o = tl.load(WS_O + ws_row[:, None] * BLOCK_R + offs_r[None, :], mask=mask_s[:, None], other=0.0)
    o = tl.sum(o * w[:, None], 0) / tl.where(w_sum > 0.0, w_sum, 1.0)
    tl.store(OUT + t * stride_ot + h * stride_oh + offs_r, o.to(OUT.dtype.element_ty), mask=offs_r < rank)


@triton.jit
def _topk_slots_kernel(
    TOPK, PAGE_TABLE, TOKEN_REQ, POSITIONS, SLOTS, stride_tk, stride_pt, topk, page_size, BLOCK: tl.constexpr,
    FILL: tl.constexpr = False,
    CAUSAL: tl.constexpr = False,
    PDL: tl.constexpr = False,
    num_tokens=0, dense_below=0, DENSE_T: tl.constexpr = 0,
):
    """``SLOTS[t, j]`` ← the cache row of top-k position ``TOPK[t, j]`` through the page table of
    token ``t``'s request (``-1`` stays ``-1``): the sparse kernel's loop then gathers rows with
    one indirection instead of three dependent loads and a division per key.

    ``CAUSAL``: row ``t`` is every position ``0…POSITIONS[t]`` in order, then ``-1`` (what the
    indexer's row is when the sequence is at most ``topk`` long); ``TOPK`` is not read.
    ``FILL`` (one program per token, ``BLOCK ≥ topk``): an unused entry holds ``-1 − f`` instead,
    ``f`` the cache row of the token's largest top-k position (of position 0 where it has
    none), so the sparse kernel's ``LEAN`` loop reads a real row there and needs no load masks.
    ``DENSE_T > 0``: a token of a block on the dense-causal path (the sparse kernels skip it)
    gets no row written (``POSITIONS`` must then be the positions)."""
    pdl_wait(PDL)
    t = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    inside = offs < topk
    if DENSE_T > 0:  # the row is never read: no store
        inside = inside & ~_dense_block(TOKEN_REQ, POSITIONS, t // DENSE_T, num_tokens, dense_below, DENSE_T)
    if CAUSAL:
        pos = tl.where(inside & (offs <= tl.load(POSITIONS + t)), offs, -1)
    else:
        pos = tl.load(TOPK + t * stride_tk + offs, mask=inside, other=-1)
    valid = pos >= 0
    pos = tl.where(valid, pos, 0)
    pages = PAGE_TABLE + tl.load(TOKEN_REQ + t).to(tl.int64) * stride_pt
    page = tl.load(pages + pos // page_size, mask=valid, other=0)
    unused = -1
    if FILL:
        top = tl.max(pos, 0)
        unused = -1 - (tl.load(pages + top // page_size) * page_size + top % page_size)
    tl.store(SLOTS + t * topk + offs, tl.where(valid, page * page_size + pos % page_size, unused), mask=inside)


def _pow2(n: int) -> int:
    return max(16, triton.next_power_of_2(n))


_SLOT_BLOCK = 1024  # top-k columns per program of _topk_slots_kernel
DENSE_MIN_TOKENS = 16  # with the dense path asked for, split-K only below this many tokens


# The column-group kernel on an FP8 cache with the PTX conversion: 168 registers (174 uncapped)
# fit a third program per SM (H200, 8 heads: 4.20 vs 4.73 ms at prefill 8K, 0.066 vs 0.093 at
# decode B=64; scripts/bench_kernels_attention.py --variants). Else (fp16 queries: Triton's
# cast of the codes) it runs uncapped: the cap was measured with the PTX conversion only.
COLUMNS_MAXNREG = 168


def default_config(
    num_tokens: int,
    num_heads: int,
    topk: int,
    device: torch.device,
    dense: bool = False,
    kv_fp8: bool = False,
) -> dict:
    """Block sizes, warps, stages and split count for a shape (tuned guesses; see the bench).

    Split-K when the programs cannot fill the GPU (decode), except where the caller asked for
    the dense-causal path (``dense``: prefill) and there are at least ``DENSE_MIN_TOKENS``
    tokens: split-K switches that path off, and a short prompt then walks all ``topk`` slots
    of every token's row (mostly ``-1``) instead of its few causal keys. At few heads (8 or 16)
    the column-group kernel (``lean``, ``groups = 4``, ``lazy``) with its heads padded to 8
    rows only, on the bf16 cache and on an FP8 cache (``kv_fp8``: the scales on its score and
    probability columns), prefill and decode; ``block_h`` 16, ``maxnreg`` and ``slots`` are
    the fallback's where the lean loop does not fit (:func:`lean_supported`)."""
    block_h = min(64, _pow2(num_heads))
    # (BLOCK_N, warps) per BLOCK_H: the largest key block that compiles for sm_90 without
    # register spills (ptxas: 16 → 226 regs, 32 → 195, 64 → 230 with wgmma).
    block_n, num_warps = {16: (32, 4), 32: (32, 8), 64: (16, 8)}[block_h]
    programs = num_tokens * triton.cdiv(num_heads, block_h)
    splits = 1
    sms = num_sms(device)
    if programs < sms and not (dense and num_tokens >= DENSE_MIN_TOKENS):
        splits = max(1, min(triton.cdiv(2 * sms, programs), triton.cdiv(topk, 4 * block_n), 16))
    few_heads = block_h == 16
    # Few heads, prefill and decode: the column-group kernel with the lazy rescale, its head
    # block padded only to 8 (the loop reads the query tile from shared memory again per key
    # block, so the padding costs shared-memory bandwidth). H200, 8 heads, bf16 cache (run0
    # sweep): 2.617 vs 3.270 ms at 8K tokens, 5.800 vs 7.217 at 16K, 0.055 vs 0.061 at decode
    # B=64. FP8 cache, the scales on the columns against the tile dequantised (prefill: the
    # column groups, 16-row heads, one stage; decode: the gather loop): 4.202 vs 6.620 ms at 8K,
    # 9.423 vs 14.821 at 16K, 0.066 vs 0.135 at decode B=64, 0.016 vs 0.021 at B=1 (sweep of
    # commit 9cf0db3, docs/benchmarks.md).
    return {
        "block_h": max(8, triton.next_power_of_2(num_heads)) if few_heads else block_h,
        "block_n": block_n,
        "num_warps": num_warps,
        "num_stages": 2,
        "num_splits": splits,
        # The slots loop (few heads, one split, bf16 cache): capping registers at 168 fits a
        # third program per SM, which outweighs the few spilled bytes (they stay in L1); the
        # keys' cache rows come from _topk_slots_kernel, so the loop issues one gather per key
        # instead of position → page → row.
        "maxnreg": 168 if few_heads and splits == 1 and not kv_fp8 else None,
        "slots": few_heads and splits == 1 and not kv_fp8,
        "lean": few_heads,
        "lazy": 8.0 if few_heads else 0.0,
        "groups": 4 if few_heads else 1,
    }


def lean_supported(kv_cache: torch.Tensor, topk: int, rank: int, dim: int, block_n: int) -> bool:
    """Whether the sparse kernel's unmasked ``LEAN`` loop fits: power-of-two ``rank`` and rope
    widths (no column padding), ``topk`` a multiple of the key block and element offsets of the
    cache that fit 32 bits."""
    pow2 = rank == _pow2(rank) and dim - rank == _pow2(dim - rank)
    return pow2 and topk % block_n == 0 and rows_fit_int32(kv_cache)


def supports(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    topk_pos: torch.Tensor,
    page_table: torch.Tensor,
    token_req: torch.Tensor,
    out: torch.Tensor,
    positions: torch.Tensor | None = None,
) -> bool:
    """Whether :func:`sparse_mla_attention_triton` handles these tensors (else use the twin):
    bf16/fp16 ``q``, a cache of the same dtype or an FP8 latent cache of this ``r`` and rope dim
    (:mod:`~breakgraph.kernels.latent_fp8`), ``0 < r < D``, unit last strides."""
    tensors = (q, kv_cache, topk_pos, page_table, token_req, out, positions)
    rank = out.shape[-1]
    if is_fp8_latent(kv_cache):
        width_ok = kv_cache.shape[-1] == LatentLayout(rank, q.shape[-1] - rank).row_bytes
    else:
        width_ok = kv_cache.dtype == q.dtype and q.shape[-1] == kv_cache.shape[-1]
    return (
        q.dtype in (torch.bfloat16, torch.float16)
        and width_ok
        and q.dim() == 3
        and kv_cache.dim() == 2
        and 0 < rank < q.shape[-1]
        and all(t.stride(-1) == 1 for t in tensors if t is not None)
    )


def sparse_mla_attention_triton(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    topk_pos: torch.Tensor,
    page_table: torch.Tensor,
    token_req: torch.Tensor,
    page_size: int,
    softmax_scale: float,
    out: torch.Tensor,
    *,
    positions: torch.Tensor | None = None,
    dense_below: int = 0,
    request_tokens: Sequence[int] | None = None,
    packed_rows: bool = False,
    causal_rows: bool = False,
    dense_elsewhere: bool = False,
    block_h: int | None = None,
    block_n: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
    num_splits: int | None = None,
    dense_block_t: int | None = None,
    dense_block_n: int | None = None,
    dense_num_stages: int | None = None,
    dense_num_warps: int | None = None,
    dense_chunk_keys: int | None = None,
    dense_page_blocks: bool | None = None,
    dense_balanced: bool | None = None,
    dense_programs: int | None = None,
    dense_partial_dtype: torch.dtype | None = None,
    maxnreg: int | None = None,
    slots: bool | None = None,
    lean: bool | None = None,
    lazy: float | None = None,
    groups: int | None = None,
) -> None:
    """Triton implementation of :func:`~breakgraph.kernels.sparse_mla.sparse_mla_attention_ref`.

    Same arguments and contract (``out [T, H, r]`` written in full), plus the dense-causal
    shortcut: with ``positions`` (``[T]`` int32/int64, each token's position in its request)
    and ``dense_below > 0``, token blocks whose tokens share a request and all sit at positions
    ``< dense_below`` attend densely to positions ``0…pos`` of the request instead of reading
    ``topk_pos``. The caller guarantees that for every token with ``pos < dense_below`` the
    top-k row holds exactly the positions ``0…pos`` (in any order, ``-1`` elsewhere): the DSA
    indexer's rows do for ``dense_below = K``. The shortcut is off under split-K (decode).

    ``request_tokens`` (host ints: each request's count of tokens in this batch, in order) is
    the caller's word that every token sits at a position ``< dense_below`` (it knows from its
    host sequence lengths). Where every count but the last is then a multiple of the dense
    token block, every block lies in one request and is on the dense path: the cache-row and
    sparse launches, which would find no block to do, are skipped (a prompt of any length
    under ``K`` alone in its batch: two launches a layer fewer).

    ``kv_cache`` is a cache of ``q``'s dtype or an FP8 latent cache (``uint8`` rows of
    :mod:`~breakgraph.kernels.latent_fp8`; the column-group kernel puts its scales on the score
    and probability columns, the others dequantise it in registers to ``q``'s dtype).

    ``packed_rows``: the caller's word that each token's keys are the first ``min(K, pos + 1)``
    columns of its ``topk_pos`` row (in any order) and ``-1`` fills the rest, as the DSA
    indexer writes them (its select puts ``0…pos`` first in a short row; the twin's ``topk``
    puts the finite scores first); needs ``positions``. Under split-K (decode, and extend
    batches of fewer than ``DENSE_MIN_TOKENS`` tokens) each program then stops at the row's
    last key block: a decode step over contexts shorter than ``K`` gathers only their keys, not
    ``K`` rows of which the rest are masked. (Without split-K the rows past the dense path are
    long, and ptxas gives the 16-head column-group kernel 190 registers instead of 128 with the
    bound: it is not applied there.)

    ``causal_rows``: the caller's word that every token's row is all of its positions
    ``0…pos`` (every sequence is at most ``K`` long: the indexer's rows then are; needs
    ``positions``, implies ``packed_rows``): the rows are made from the positions — by the
    cache-row kernel where it runs (few heads), else in the gather loop, which then stops at
    the row's last key block with or without split-K — and ``topk_pos``, which the indexer
    then need not write, is not read (only its shape).

    ``dense_elsewhere``: the caller attends the tokens of the dense-causal blocks itself (every
    token below ``dense_below``, say, in another form): no dense launch is made, the sparse kernel
    still skips those blocks, and their rows of ``out`` are left unwritten (under split-K, with
    no dense path, every row is written as without it).

    The keyword arguments after ``dense_elsewhere`` override :func:`default_config` and, as
    ``dense_*``, the options of
    :func:`~breakgraph.kernels.triton_dense_mla.dense_mla_attention_triton` (benchmarks, tests;
    ``dense_balanced``: its balanced kernel, default ``BREAKGRAPH_DENSE_MLA_BALANCED``);
    ``maxnreg = 0``: no register cap; ``lean``: the unmasked loop where :func:`lean_supported`,
    else ignored; ``groups = 4``: the lean loop in four column groups, ``r`` a multiple of 64, no
    register cap (``COLUMNS_MAXNREG`` on an FP8 cache with bf16 queries) unless ``maxnreg`` names one; ``lazy``: rescale only past a growth of
    ``2^lazy``, 0 = every block).
    ``topk_pos`` and ``page_table`` must have a unit last stride; ``token_req`` and
    ``positions`` are contiguous ``[T]``; positions lie inside the page table
    (``< page_table.shape[1] · page_size``), which bounds the dense path's work.
    """
    num_tokens, num_heads, dim = q.shape
    topk = topk_pos.shape[1]
    rank = out.shape[-1]
    if num_tokens == 0:
        return
    if dense_below > 0 and positions is None:
        raise ValueError("dense_below > 0 needs the token positions")
    if (packed_rows or causal_rows) and positions is None:
        raise ValueError("packed_rows and causal_rows need the token positions")
    packed_rows = packed_rows or causal_rows
    kv_fp8 = is_fp8_latent(kv_cache)
    cfg = default_config(num_tokens, num_heads, topk, q.device, dense=dense_below > 0, kv_fp8=kv_fp8)
    block_n = block_n or cfg["block_n"]
    num_warps = num_warps or cfg["num_warps"]
    num_stages = num_stages or cfg["num_stages"]
    splits = num_splits or cfg["num_splits"]
    keys_per_split = triton.cdiv(triton.cdiv(topk, splits), block_n) * block_n
    splits = triton.cdiv(topk, keys_per_split)
    use_slots = cfg["slots"] if slots is None else slots
    # The unmasked loop: whole key blocks and row widths, 32-bit row offsets; its rows come
    # from _topk_slots_kernel with the unused entries filled.
    use_lean = (cfg["lean"] if lean is None else lean) and lean_supported(kv_cache, topk, rank, dim, block_n)
    use_slots = use_slots or use_lean
    tau = cfg["lazy"] if lazy is None else lazy
    # Four column groups (_sparse_mla_groups_kernel): the lean loop in four loads, dots and
    # accumulators; groups of at least 16 columns, each inside one scale group of an FP8 cache.
    fp8_ok = not kv_fp8 or (rank // 4 <= LATENT_GROUP and LATENT_GROUP % (rank // 4) == 0)
    use_groups = use_lean and fp8_ok and (cfg["groups"] if groups is None else groups) == 4 and rank % 64 == 0
    # The e4m3 codes converted in inline PTX (bf16 queries, on the GPU); the cap is measured with it.
    asm = kv_fp8 and q.dtype == torch.bfloat16 and not interpreting()
    groups_cap = COLUMNS_MAXNREG if asm else None
    cap = maxnreg if maxnreg is not None else (groups_cap if use_groups else cfg["maxnreg"])
    block_h = block_h or (cfg["block_h"] if use_groups else max(16, cfg["block_h"]))
    block_r = _pow2(rank)
    block_pe = _pow2(dim - rank)
    qk_scale = softmax_scale * _LOG2E
    dense_t = 0
    if dense_below > 0 and splits == 1 and dense_elsewhere:  # the caller's: only which blocks to skip
        dense_t = dense_token_block(
            q, page_table, page_size, dense_below, balanced=dense_balanced, block_t=dense_block_t
        )  # fmt: skip
    elif dense_below > 0 and splits == 1:  # the dense-causal blocks first (kernels/triton_dense_mla.py)
        dense_t = dense_mla_attention_triton(
            q, kv_cache, page_table, token_req, positions, page_size, softmax_scale, out, dense_below,
            balanced=dense_balanced, block_t=dense_block_t, block_n=dense_block_n, num_warps=dense_num_warps,
            num_stages=dense_num_stages, chunk_keys=dense_chunk_keys, page_blocks=dense_page_blocks,
            programs=dense_programs, partial_dtype=dense_partial_dtype,
        )  # fmt: skip
        if request_tokens is not None and all(n % dense_t == 0 for n in request_tokens[:-1]):
            return  # every token block was dense: the sparse kernel would find none to do
    grid = (num_tokens, triton.cdiv(num_heads, block_h), splits)
    if splits > 1:
        ws_o = torch.empty(num_tokens * num_heads * splits, block_r, dtype=torch.float32, device=q.device)
        ws_lse = torch.empty(num_tokens * num_heads * splits, dtype=torch.float32, device=q.device)
    else:
        ws_o = ws_lse = out  # unused
    rows, stride_rows = topk_pos, topk_pos.stride(0)
    if use_slots:  # each key's cache row, computed once (graph-safe: a shape-sized workspace)
        rows, stride_rows = torch.empty(num_tokens, topk, dtype=torch.int32, device=q.device), topk
        slot_block = triton.next_power_of_2(topk) if use_lean else _SLOT_BLOCK
        _topk_slots_kernel[(num_tokens, triton.cdiv(topk, slot_block))](
            topk_pos, page_table, token_req, positions if causal_rows or dense_t else token_req, rows,
            topk_pos.stride(0), page_table.stride(0), topk, page_size, BLOCK=slot_block, FILL=use_lean,
            CAUSAL=causal_rows, num_warps=4, **pdl_launch(q.device),
            num_tokens=num_tokens, dense_below=dense_below, DENSE_T=dense_t,
        )  # fmt: skip
    shift = page_shift(page_size)
    causal_in_loop = causal_rows and not use_slots  # else the cache-row kernel makes the rows
    # the rows' bound: under split-K, and in the fwd kernel's causal loop (docstring)
    packed = packed_rows and (splits > 1 or causal_in_loop)
    args = (
        q, kv_cache, rows, page_table, token_req, positions if dense_t or packed else token_req, out,
        ws_o, ws_lse,
        q.stride(0), q.stride(1), kv_cache.stride(0), stride_rows, page_table.stride(0),
        out.stride(0), out.stride(1),
        num_tokens, num_heads, topk, rank, dim - rank, page_size, keys_per_split, splits, dense_below, qk_scale,
    )  # fmt: skip
    tiles = dict(BLOCK_H=block_h, BLOCK_N=block_n, BLOCK_R=block_r, BLOCK_PE=block_pe, SPLIT=splits > 1,
                 DENSE_T=dense_t, LAZY=float(tau or 0), PACKED=packed, num_warps=num_warps, num_stages=num_stages,
                 maxnreg=cap or None, **pdl_launch(q.device))  # fmt: skip
    if use_groups:
        layout = LatentLayout(rank, dim - rank)
        _sparse_mla_groups_kernel[grid](*args, KV_FP8=kv_fp8, SCALE_OFF=layout.scale_off, PE_OFF=layout.pe_off,
                                        CVT_ASM=asm, **tiles)  # fmt: skip
    else:
        _sparse_mla_fwd_kernel[grid](
            *args, KV_FP8=kv_fp8, PAGE_SHIFT=shift, SLOTS=use_slots, LEAN=use_lean,
            CAUSAL=causal_in_loop, **tiles,
        )  # fmt: skip
    if splits > 1:
        _sparse_mla_merge_kernel[(num_tokens, num_heads)](
            ws_o, ws_lse, out, out.stride(0), out.stride(1), num_heads, rank, splits,
            BLOCK_S=max(2, triton.next_power_of_2(splits)), BLOCK_R=block_r, num_warps=4, **pdl_launch(q.device),
        )  # fmt: skip
