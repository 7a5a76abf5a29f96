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
block instead of 18, it fits 128 registers (four programs per SM) without a cap, and its score
dots can run as two independent tensor-core chains (``CHAINS``) instead of one of 36 steps.
``LAZY`` (``_softmax_step_lazy``): the accumulator is rescaled only when some row's maximum grew
by more than ``2^LAZY`` since the last rescale, so most blocks skip the ``[16, 512]`` multiply
(the terms stay relative to the stale maximum, at most ``2^LAZY``). The keys as the dots' M side
(swap-AB: 64-key blocks on wgmma, one 169 KB program per SM) measured slower than mma.sync
with heads as M at 8 and 16 heads (docs/benchmarks.md).

Dense-causal path (on when the caller passes ``positions`` and ``dense_below``): token blocks
whose tokens share a request and all sit below ``dense_below`` run
:mod:`~breakgraph.kernels.triton_dense_mla` first; the kernels here evaluate the same predicate
(``_dense_block``) and skip those blocks, so each output row is written once.

FP8 latent cache (``kv_cache`` ``uint8``, rows of :mod:`~breakgraph.kernels.latent_fp8`: 656
bytes instead of 1152): the kernels read their key blocks through one helper,
:func:`~breakgraph.kernels.triton_latent_fp8.load_latent_rows`, which dequantises the e4m3 codes
with their per-128 scales in registers to the query's dtype; the dots and softmax are as above.

Split-K (flash-decoding) for small batches: when ``T × head_blocks`` programs cannot fill
the GPU (decode), the ``K`` keys are cut into ``num_splits`` ranges (grid axis 2); each split
writes its normalised partial output and log-sum-exp to an fp32 workspace, and a second
kernel merges them. The dense path is off under split-K, so a prefill of at least
``DENSE_MIN_TOKENS`` tokens (caller passes ``dense_below``) never splits. Grids and workspace depend on
shapes only: graph-safe, no host sync.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from breakgraph.kernels.dispatch import num_sms
from breakgraph.kernels.latent_fp8 import GROUP as LATENT_GROUP
from breakgraph.kernels.latent_fp8 import LatentLayout, is_fp8_latent
from breakgraph.kernels.triton_dense_mla import dense_block as _dense_block
from breakgraph.kernels.triton_dense_mla import dense_mla_attention_triton
from breakgraph.kernels.triton_latent_fp8 import load_latent_rows

_LOG2E = 1.4426950408889634


@triton.jit
def _softmax_step(q_nope, q_pe, c, k_pe, keep, qk_scale, m_i, l_i, acc):
    """One key block of the online softmax (base 2): ``s = q·kᵀ`` where ``keep``, else ``-inf``;
    ``acc += p·c`` with ``p`` in the cache dtype. Returns the new ``(m_i, l_i, acc)``."""
    s = tl.dot(q_nope, tl.trans(c))
    s = tl.dot(q_pe, tl.trans(k_pe), s)
    s = tl.where(keep, s * qk_scale, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    m_use = tl.where(m_new == float("-inf"), 0.0, m_new)  # all-masked so far: keep p = 0
    alpha = tl.exp2(m_i - m_use)
    p = tl.exp2(s - m_use[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = tl.dot(p.to(c.dtype), c, acc * alpha[:, None])
    return m_new, l_i, acc


@triton.jit
def _softmax_step_lazy(q_nope, q_pe, c, k_pe, keep, qk_scale, m_i, l_i, acc, TAU: tl.constexpr):
    """:func:`_softmax_step` that rescales ``acc`` and ``l_i`` only when some row's maximum grew
    by more than ``TAU`` (base 2) since the last rescale: the stale maximum then bounds
    ``p ≤ 2^TAU`` (fp32 sums, bf16 ``p`` keep their relative precision) and most key blocks skip
    the ``[BLOCK_H, BLOCK_R]`` multiply. ``m_i`` is the maximum the terms are relative to."""
    s = tl.dot(q_nope, tl.trans(c))
    s = tl.dot(q_pe, tl.trans(k_pe), s)
    s = tl.where(keep, s * qk_scale, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    # -inf − -inf is NaN (a row with no key yet, none here): not a reason to rescale.
    if tl.max(tl.where(m_new > m_i, m_new - m_i, 0.0), 0) > TAU:
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_use)
        l_i = l_i * alpha
        acc = acc * alpha[:, None]
        m_i = m_new
    m_use = tl.where(m_i == float("-inf"), 0.0, m_i)
    p = tl.exp2(s - m_use[:, None])
    l_i = l_i + tl.sum(p, 1)
    acc = tl.dot(p.to(c.dtype), c, acc)
    return m_i, l_i, acc


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
):
    t = tl.program_id(0).to(tl.int64)
    hb = tl.program_id(1)
    split = tl.program_id(2)
    if DENSE_T > 0:
        if _dense_block(TOKEN_REQ, POSITIONS, t // DENSE_T, num_tokens, dense_below, DENSE_T):
            return  # written by _dense_mla_fwd_kernel

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
        for n0 in range(0, keys_per_split, BLOCK_N):
            offs_n = k_start + n0 + tl.arange(0, BLOCK_N)
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
def _dequant_group(codes, scale, DTYPE: tl.constexpr):
    """e4m3 ``codes [BLOCK_N, G]`` (uint8) times their row's ``scale [BLOCK_N]`` in fp32, rounded
    to ``DTYPE``, as :func:`~breakgraph.kernels.latent_fp8.dequantize_latent_ref` computes it."""
    return (codes.to(tl.float8e4nv, bitcast=True).to(tl.float32) * scale[:, None]).to(DTYPE)


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
    CHAINS: tl.constexpr = 1,  # 2: the score dot as two independent tensor-core chains
    KV_FP8: tl.constexpr = False,  # the FP8 latent cache; its scale and RoPE byte offsets:
    SCALE_OFF: tl.constexpr = 0,
    PE_OFF: tl.constexpr = 0,
):
    """The sparse kernel's ``LEAN`` loop with the latent row in four column groups of
    ``BLOCK_R / 4``: four key loads (6 distinct rows per thread at 32 keys, 4 warps, instead of
    18), four partial score dots and four accumulators. ``CHAINS = 2`` sums the score dots as
    two chains of 16–20 steps that the tensor cores interleave, instead of one of 36. The rows
    (``TOPK``) come from ``_topk_slots_kernel`` with ``FILL``; same arguments and outputs as
    ``_sparse_mla_fwd_kernel``. ``KV_FP8``: each group lies in one 128-column scale group, so a
    group's dequantisation is one ``[BLOCK_N]`` scale load and a row-broadcast multiply."""
    t = tl.program_id(0)  # 32-bit: widened where it addresses (fewer registers live across the loop)
    hb = tl.program_id(1)
    split = tl.program_id(2)
    if DENSE_T > 0:
        if _dense_block(TOKEN_REQ, POSITIONS, t // DENSE_T, num_tokens, dense_below, DENSE_T):
            return  # written by _dense_mla_fwd_kernel
    GR: tl.constexpr = BLOCK_R // 4
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
    for n0 in range(k_start, k_end, BLOCK_N):
        raw = tl.load(pos_row + n0 + tl.arange(0, BLOCK_N))
        valid = raw >= 0
        row = KV + tl.where(valid, raw, -1 - raw) * stride_kv
        rows = row[:, None]
        if KV_FP8:
            dtype = Q.dtype.element_ty
            scales = (row + SCALE_OFF).to(tl.pointer_type(tl.float32))
            c0 = _dequant_group(tl.load(rows + offs_g[None, :]), tl.load(scales + 0 * GR // 128), dtype)
            c1 = _dequant_group(tl.load(rows + GR + offs_g[None, :]), tl.load(scales + 1 * GR // 128), dtype)
            c2 = _dequant_group(tl.load(rows + 2 * GR + offs_g[None, :]), tl.load(scales + 2 * GR // 128), dtype)
            c3 = _dequant_group(tl.load(rows + 3 * GR + offs_g[None, :]), tl.load(scales + 3 * GR // 128), dtype)
            k_pe = tl.load((row + PE_OFF).to(tl.pointer_type(tl.bfloat16))[:, None] + offs_pe[None, :]).to(dtype)
        else:
            c0 = tl.load(rows + offs_g[None, :])
            c1 = tl.load(rows + GR + offs_g[None, :])
            c2 = tl.load(rows + 2 * GR + offs_g[None, :])
            c3 = tl.load(rows + 3 * GR + offs_g[None, :])
            k_pe = tl.load(rows + BLOCK_R + offs_pe[None, :])
        if CHAINS == 2:  # Triton folds `dot(a, b, 0) + x` into one chain, not a sum of two chains
            s = tl.dot(q1, tl.trans(c1), tl.dot(q0, tl.trans(c0)))
            s += tl.dot(q_pe, tl.trans(k_pe), tl.dot(q3, tl.trans(c3), tl.dot(q2, tl.trans(c2))))
        else:
            s = tl.dot(q_pe, tl.trans(k_pe), tl.dot(q0, tl.trans(c0)))
            s = tl.dot(q3, tl.trans(c3), tl.dot(q2, tl.trans(c2), tl.dot(q1, tl.trans(c1), s)))
        s = tl.where(valid[None, :], s * qk_scale, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        if LAZY > 0:  # as _softmax_step_lazy: rescale only past a growth of 2^LAZY
            if tl.max(tl.where(m_new > m_i, m_new - m_i, 0.0), 0) > LAZY:
                alpha = tl.exp2(m_i - tl.where(m_new == float("-inf"), 0.0, m_new))
                l_i = l_i * alpha
                acc0, acc1 = acc0 * alpha[:, None], acc1 * alpha[:, None]
                acc2, acc3 = acc2 * alpha[:, None], acc3 * alpha[:, None]
                m_i = m_new
        else:
            alpha = tl.exp2(m_i - tl.where(m_new == float("-inf"), 0.0, m_new))
            l_i = l_i * alpha
            acc0, acc1 = acc0 * alpha[:, None], acc1 * alpha[:, None]
            acc2, acc3 = acc2 * alpha[:, None], acc3 * alpha[:, None]
            m_i = m_new
        p = tl.exp2(s - tl.where(m_i == float("-inf"), 0.0, m_i)[:, None])
        l_i = l_i + tl.sum(p, 1)
        p = p.to(c0.dtype)  # the query's dtype (an FP8 cache is dequantised to it)
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
        dtype = OUT.dtype.element_ty
        tl.store(o_ptrs, (acc0 * inv).to(dtype), mask=mask_h[:, None])
        tl.store(o_ptrs + GR, (acc1 * inv).to(dtype), mask=mask_h[:, None])
        tl.store(o_ptrs + 2 * GR, (acc2 * inv).to(dtype), mask=mask_h[:, None])
        tl.store(o_ptrs + 3 * GR, (acc3 * inv).to(dtype), mask=mask_h[:, None])


@triton.jit
def _sparse_mla_batched_kernel(
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
):
    """The groups kernel's loop with the four column groups as the batch of one batched dot
    (``[4, BLOCK_H, r/4]`` queries): the compiler gives each warp one group, so a warp keeps its
    slice of the queries in registers and reads only its group of the key tile for both dots;
    the group partials of the scores are summed across warps once per block. bf16/fp16 cache."""
    t = tl.program_id(0)
    hb = tl.program_id(1)
    split = tl.program_id(2)
    if DENSE_T > 0:
        if _dense_block(TOKEN_REQ, POSITIONS, t // DENSE_T, num_tokens, dense_below, DENSE_T):
            return  # written by _dense_mla_fwd_kernel
    GR: tl.constexpr = BLOCK_R // 4
    offs_h = hb * BLOCK_H + tl.arange(0, BLOCK_H)
    mask_h = offs_h < num_heads
    offs_b = tl.arange(0, 4)
    offs_g = tl.arange(0, GR)
    offs_pe = tl.arange(0, BLOCK_PE)
    cols = offs_b[:, None, None] * GR + offs_g[None, None, :]  # [4, 1, GR]: group b's columns
    q_rows = Q + t.to(tl.int64) * stride_qt + tl.minimum(offs_h, num_heads - 1) * stride_qh
    q = tl.load(q_rows[None, :, None] + cols)  # [4, BLOCK_H, GR]
    q_pe = tl.load(q_rows[:, None] + BLOCK_R + offs_pe[None, :])
    pos_row = TOPK + t.to(tl.int64) * stride_tk

    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([4, BLOCK_H, GR], tl.float32)
    k_start = split * keys_per_split
    k_end = tl.minimum(k_start + keys_per_split, topk)
    for n0 in range(k_start, k_end, BLOCK_N):
        raw = tl.load(pos_row + n0 + tl.arange(0, BLOCK_N))
        valid = raw >= 0
        row = KV + tl.where(valid, raw, -1 - raw) * stride_kv
        c = tl.load(row[None, :, None] + cols)  # [4, BLOCK_N, GR]
        k_pe = tl.load(row[:, None] + BLOCK_R + offs_pe[None, :])
        s = tl.sum(tl.dot(q, tl.trans(c, 0, 2, 1)), 0) + tl.dot(q_pe, tl.trans(k_pe))
        s = tl.where(valid[None, :], s * qk_scale, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        if LAZY > 0:  # as _softmax_step_lazy
            if tl.max(tl.where(m_new > m_i, m_new - m_i, 0.0), 0) > LAZY:
                alpha = tl.exp2(m_i - tl.where(m_new == float("-inf"), 0.0, m_new))
                l_i = l_i * alpha
                acc = acc * alpha[None, :, None]
                m_i = m_new
        else:
            alpha = tl.exp2(m_i - tl.where(m_new == float("-inf"), 0.0, m_new))
            l_i = l_i * alpha
            acc = acc * alpha[None, :, None]
            m_i = m_new
        p = tl.exp2(s - tl.where(m_i == float("-inf"), 0.0, m_i)[:, None])
        l_i = l_i + tl.sum(p, 1)
        pb = tl.broadcast_to(p.to(c.dtype)[None, :, :], (4, BLOCK_H, BLOCK_N))
        acc = tl.dot(pb, c, acc)

    l_safe = tl.where(l_i > 0.0, l_i, 1.0)
    o = acc * (1.0 / l_safe)[None, :, None]
    if SPLIT:
        lse = tl.where(l_i > 0.0, m_i + tl.log2(l_safe), float("-inf"))
        ws_row = (t.to(tl.int64) * num_heads + offs_h) * num_splits + split
        tl.store(WS_LSE + ws_row, lse, mask=mask_h)
        tl.store(WS_O + ws_row[None, :, None] * BLOCK_R + cols, o, mask=mask_h[None, :, None])
    else:
        o_rows = OUT + t.to(tl.int64) * stride_ot + offs_h * stride_oh
        tl.store(o_rows[None, :, None] + cols, o.to(OUT.dtype.element_ty), mask=mask_h[None, :, None])


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
):
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
    TOPK, PAGE_TABLE, TOKEN_REQ, SLOTS, stride_tk, stride_pt, topk, page_size, BLOCK: tl.constexpr,
    FILL: tl.constexpr = False,
):
    """``SLOTS[t, j]`` ← the cache row of top-k position ``TOPK[t, j]`` through the page table of
    token ``t``'s request (``-1`` stays ``-1``): the sparse kernel's loop then gathers rows with
    one indirection instead of three dependent loads and a division per key.

    ``FILL`` (one program per token, ``BLOCK ≥ topk``): an unused entry holds ``-1 − f`` instead,
    ``f`` the cache row of the token's largest top-k position (of position 0 where it has
    none), so the sparse kernel's ``LEAN`` loop reads a real row there and needs no load masks."""
    t = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    inside = offs < topk
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


def default_config(
    num_tokens: int, num_heads: int, topk: int, device: torch.device, dense: bool = False, kv_fp8: bool = False
) -> dict:
    """Block sizes, warps, stages and split count for a shape (tuned guesses; see the bench).

    Split-K when the programs cannot fill the GPU (decode), except where the caller asked for
    the dense-causal path (``dense``: prefill) and there are at least ``DENSE_MIN_TOKENS``
    tokens: split-K switches that path off, and a short prompt then walks all ``topk`` slots
    of every token's row (mostly ``-1``) instead of its few causal keys. ``kv_fp8``: the cache
    is FP8 (dequantised in registers): at few heads a prefill takes one stage and no register cap
    (sm_90 ptxas: 195 registers, no spills, where two stages need 255 and the cap spills; the
    fastest of the FP8 sweep at 8K tokens), split-K decode two stages (faster in the sweep).
    At few heads on the bf16 cache (``block_h`` 16): the column-group kernel (``lean``,
    ``groups = 4``, ``lazy``; ``maxnreg`` and ``slots`` are the slots loop's, where the lean loop
    does not fit)."""
    block_h = min(64, _pow2(num_heads))
    # (BLOCK_N, warps) per BLOCK_H: the largest key block that compiles for sm_90 without
    # register spills (ptxas: 16 → 226 regs, 32 → 195, 64 → 230 with wgmma).
    block_n, num_warps = {16: (32, 4), 32: (32, 8), 64: (16, 8)}[block_h]
    programs = num_tokens * triton.cdiv(num_heads, block_h)
    splits = 1
    sms = num_sms(device)
    if programs < sms and not (dense and num_tokens >= DENSE_MIN_TOKENS):
        splits = max(1, min(triton.cdiv(2 * sms, programs), triton.cdiv(topk, 4 * block_n), 16))
    few_heads_fp8 = kv_fp8 and block_h == 16
    few_heads_bf16 = block_h == 16 and splits == 1 and not kv_fp8
    # Few heads, bf16 cache, prefill and decode: the column-group kernel with the lazy rescale
    # (where lean_supported; else the slots loop below). H200, 8 heads: 3.24 vs 3.53 ms at 8K
    # tokens, 0.061 vs 0.102 ms at decode B=64 (docs/benchmarks.md).
    groups = block_h == 16 and not kv_fp8
    return {
        "block_h": block_h,
        "block_n": block_n,
        "num_warps": num_warps,
        "num_stages": 1 if few_heads_fp8 and splits == 1 else 2,
        "num_splits": splits,
        # The slots loop (few heads, one split, bf16 cache): capping registers at 168 fits a
        # third program per SM, which outweighs the few spilled bytes (they stay in L1); the
        # keys' cache rows come from _topk_slots_kernel, so the loop issues one gather per key
        # instead of position → page → row.
        "maxnreg": 168 if few_heads_bf16 else None,
        "slots": few_heads_bf16,
        "lean": groups,
        "lazy": 8.0 if groups else 0.0,
        "groups": 4 if groups else 1,
        "chains": 1,
        "batched": False,
    }


def lean_supported(kv_cache: torch.Tensor, topk: int, rank: int, dim: int, block_n: int) -> bool:
    """Whether the sparse kernel's unmasked ``LEAN`` loop fits: power-of-two ``rank`` and rope
    widths (no column padding), ``topk`` a multiple of the key block and element offsets of the
    cache that fit 32 bits."""
    pow2 = rank == _pow2(rank) and dim - rank == _pow2(dim - rank)
    return pow2 and topk % block_n == 0 and kv_cache.shape[0] * kv_cache.stride(0) < 2**31


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
    chains: int | None = None,
    batched: bool | None = None,
) -> None:
    """Triton implementation of :func:`~breakgraph.kernels.sparse_mla.sparse_mla_attention_ref`.

    Same arguments and contract (``out [T, H, r]`` written in full), plus the dense-causal
    shortcut: with ``positions`` (``[T]`` int32/int64, each token's position in its request)
    and ``dense_below > 0``, token blocks whose tokens share a request and all sit at positions
    ``< dense_below`` attend densely to positions ``0…pos`` of the request instead of reading
    ``topk_pos``. The caller guarantees that for every token with ``pos < dense_below`` the
    top-k row holds exactly the positions ``0…pos`` (in any order, ``-1`` elsewhere): the DSA
    indexer's rows do for ``dense_below = K``. The shortcut is off under split-K (decode).

    ``kv_cache`` is a cache of ``q``'s dtype or an FP8 latent cache (``uint8`` rows of
    :mod:`~breakgraph.kernels.latent_fp8`), dequantised in registers to ``q``'s dtype.

    The keyword arguments after ``dense_below`` override :func:`default_config` and, as
    ``dense_*``, the options of
    :func:`~breakgraph.kernels.triton_dense_mla.dense_mla_attention_triton` (benchmarks, tests;
    ``dense_balanced``: its balanced kernel, default ``BREAKGRAPH_DENSE_MLA_BALANCED``);
    ``maxnreg = 0``: no register cap; ``lean``: the unmasked loop where :func:`lean_supported`,
    else ignored; ``groups = 4``: the lean loop in
    four column groups, ``r`` a multiple of 64, no register cap unless ``maxnreg`` names one
    (``chains = 2``: its score dot as two chains; ``batched``: the groups as one batched dot,
    bf16/fp16 cache);
    ``lazy``: rescale only past a growth of ``2^lazy``, 0 = every block).
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
    kv_fp8 = is_fp8_latent(kv_cache)
    cfg = default_config(num_tokens, num_heads, topk, q.device, dense=dense_below > 0, kv_fp8=kv_fp8)
    block_h = block_h or cfg["block_h"]
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
    # Four column groups (_sparse_mla_groups_kernel): the lean loop with independent score
    # chains; groups of at least 16 columns, each inside one scale group of an FP8 cache.
    fp8_ok = not kv_fp8 or (rank // 4 <= LATENT_GROUP and LATENT_GROUP % (rank // 4) == 0)
    use_groups = use_lean and fp8_ok and (cfg["groups"] if groups is None else groups) == 4 and rank % 64 == 0
    cap = maxnreg if maxnreg is not None else (None if use_groups else cfg["maxnreg"])
    block_r = _pow2(rank)
    block_pe = _pow2(dim - rank)
    qk_scale = softmax_scale * _LOG2E
    dense_t = 0
    if dense_below > 0 and splits == 1:  # the dense-causal blocks first (kernels/triton_dense_mla.py)
        dense_t = dense_mla_attention_triton(
            q, kv_cache, page_table, token_req, positions, page_size, softmax_scale, out, dense_below,
            balanced=dense_balanced, block_t=dense_block_t, block_n=dense_block_n, num_warps=dense_num_warps,
            num_stages=dense_num_stages, chunk_keys=dense_chunk_keys, page_blocks=dense_page_blocks,
            programs=dense_programs, partial_dtype=dense_partial_dtype,
        )  # fmt: skip
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
            topk_pos, page_table, token_req, rows, topk_pos.stride(0), page_table.stride(0), topk, page_size,
            BLOCK=slot_block, FILL=use_lean, num_warps=4,
        )  # fmt: skip
    shift = page_size.bit_length() - 1 if page_size & (page_size - 1) == 0 else -1
    args = (
        q, kv_cache, rows, page_table, token_req, positions if dense_t else token_req, out, ws_o, ws_lse,
        q.stride(0), q.stride(1), kv_cache.stride(0), stride_rows, page_table.stride(0),
        out.stride(0), out.stride(1),
        num_tokens, num_heads, topk, rank, dim - rank, page_size, keys_per_split, splits, dense_below, qk_scale,
    )  # fmt: skip
    tiles = dict(BLOCK_H=block_h, BLOCK_N=block_n, BLOCK_R=block_r, BLOCK_PE=block_pe, SPLIT=splits > 1,
                 DENSE_T=dense_t, LAZY=float(tau or 0), num_warps=num_warps, num_stages=num_stages,
                 maxnreg=cap or None)  # fmt: skip
    if use_groups and not kv_fp8 and (cfg["batched"] if batched is None else batched):
        _sparse_mla_batched_kernel[grid](*args, **tiles)
    elif use_groups:
        layout = LatentLayout(rank, dim - rank)
        _sparse_mla_groups_kernel[grid](*args, CHAINS=chains or cfg["chains"], KV_FP8=kv_fp8,
                                        SCALE_OFF=layout.scale_off, PE_OFF=layout.pe_off, **tiles)  # fmt: skip
    else:
        _sparse_mla_fwd_kernel[grid](
            *args, KV_FP8=kv_fp8, PAGE_SHIFT=shift, SLOTS=use_slots, LEAN=use_lean, **tiles
        )
    if splits > 1:
        _sparse_mla_merge_kernel[(num_tokens, num_heads)](
            ws_o, ws_lse, out, out.stride(0), out.stride(1), num_heads, rank, splits,
            BLOCK_S=max(2, triton.next_power_of_2(splits)), BLOCK_R=block_r, num_warps=4,
        )  # fmt: skip
