"""Dense-causal MLA attention over the paged latent cache (Triton; twin:
:func:`~breakgraph.kernels.sparse_mla.sparse_mla_attention_ref`).

The DSA indexer selects ``min(K, pos + 1)`` keys, so a token at ``pos < K`` has every causal
key ``0…pos`` in its top-k row: its sparse attention *is* dense causal attention. Absorbed MLA
is MQA (every head attends to the same latent rows ``[c ‖ k_pe]``), so a key row loaded once
serves every query row of a tile: ``BLOCK_T`` consecutive tokens × up to 64 heads
(``M = BLOCK_T·H ≤ 64`` rows, token-major: 8 tokens at ``H = 8``). ``s = q_nope·c + q_pe·k_pe``
(fp32 accumulate), online softmax in fp32 (base 2), ``acc += p·c`` with ``p`` in the cache
dtype, as the twin does; the ``[64, 512]`` fp32 accumulator takes 8 warps. A token block runs
here when all its real tokens share a request and sit below ``dense_below``
(:func:`dense_block`); the sparse kernels evaluate the same predicate and skip those blocks, so
each output row is written once.

Two kernels, one launcher (:func:`dense_mla_attention_triton`):

**Chunked** (``_dense_mla_fwd_kernel``; the default until the balanced one is measured on the
H200). One program per token block walks the key positions ``0…max pos`` of its request in
blocks of ``BLOCK_N``, through the page table, with a per-row causal mask; blocks with the
longest key ranges start first. The key block is the largest of 64, 32, 16 dividing the page
size, so a block lies in one page: one page-table entry per block, loaded an iteration ahead.
Key chunks (flash-decoding over the causal triangle) when the token blocks cannot fill the GPU
(a short prompt at few heads: 128 blocks at 1k tokens × 8 heads): grid axis 2 cuts each block's
keys into chunks of ``chunk_keys``; a block whose keys fit one chunk writes its output
directly, the others write per-chunk partials (normalised output + log-sum-exp, fp32) that
``_dense_mla_merge_kernel`` combines. The grid is sized by the page table's width (a shape),
so programs past a block's last key exit at once. (At the engine's page of 16 this kernel
takes 16-key blocks: sm_90a ptxas gives its key loop 701 instructions per 16 keys against 1214
per 64 with 64-key blocks, `scripts/bench_dense_mla.py --aot`; the H200 sweep at 1k × 8 heads
measured 99.0 against 66.9 µs, docs/benchmarks.md.)

**Balanced** (``_dense_mla_balanced_kernel``; ``BREAKGRAPH_DENSE_MLA_BALANCED=1`` or
``balanced=True``; by default at pages under 64 tokens, see :data:`BALANCED_BELOW_PAGE`). Key rows: each key's cache row comes from its own
page-table entry (a shift and a mask for a power-of-two page; 32-bit row offsets where the
cache's fit), so the 64-key blocks do not depend on the page size. In 32-bit arithmetic the key
loop spills nothing (sm_90a ptxas: 1095 instructions per 64 keys; the spills of the
255-register program sit outside it, around the token-block switches).

Balanced split (stream-K over key blocks). The work is the concatenation, over the dense token
blocks, of each block's ``cdiv(last position + 1, BLOCK_N)`` key blocks; ``_dense_plan_kernel``
(one program, one step up to 8k tokens) writes their prefix sums (``START``, ``num_blocks + 1``
entries). Forward program ``p`` takes the key blocks ``[p·W, (p + 1)·W)`` of the concatenation,
``W = cdiv(total, P)``, starting in the token block it finds by counting the ends ``≤ p·W``,
and walks across token-block boundaries: a token block it covers whole goes to the output; only
its first and last token blocks can be covered in part, and those become partials (normalised
output and base-2 log-sum-exp, fp32) in workspace slots ``2p`` (its first token block) and
``2p + 1`` (its last), which ``_dense_mla_balanced_merge_kernel`` combines. So every program walks the
same number of key blocks (± 1) whatever the prompt: fresh, on a cached prefix, or many ragged
requests. Grids and workspace depend on shapes only, the kernels on no shape but their tiles:
graph-safe, no host sync, one compile for every token bucket.

FP8 latent cache (``kv_cache`` ``uint8``): key rows are read through
:func:`~breakgraph.kernels.triton_latent_fp8.load_latent_rows`, dequantised in registers.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from breakgraph import env
from breakgraph.kernels.dispatch import num_sms
from breakgraph.kernels.latent_fp8 import is_fp8_latent
from breakgraph.kernels.paging import rows_fit_int32
from breakgraph.kernels.triton_latent_fp8 import load_latent_rows

_LOG2E = 1.4426950408889634
_MERGE_COLS = 128  # output columns per program of the merge kernels
_PLAN_TOKENS = 8192  # tokens per step of _dense_plan_kernel (one step up to 8k tokens)


@triton.jit
def dense_block(TOKEN_REQ, POSITIONS, block, num_tokens, dense_below, BLOCK_T: tl.constexpr):
    """Whether token block ``block`` (tokens ``block·BLOCK_T …``) runs on the dense path: its
    real tokens all belong to one request and all sit at positions ``< dense_below``."""
    offs = block * BLOCK_T + tl.arange(0, BLOCK_T)
    real = offs < num_tokens
    req = tl.load(TOKEN_REQ + offs, mask=real, other=0)
    pos = tl.load(POSITIONS + offs, mask=real, other=0)
    first_req = tl.load(TOKEN_REQ + block * BLOCK_T)
    others = tl.sum((real & (req != first_req)).to(tl.int32), 0)
    return (others == 0) & (tl.max(pos, 0) < dense_below)


@triton.jit
def _block_tiles(TOKEN_REQ, POSITIONS, blocks, num_tokens, num_blocks, dense_below, BLOCK_T: tl.constexpr,
                 BLOCK_N: tl.constexpr):  # fmt: skip
    """Key blocks (int32) of each token block in ``blocks``: ``cdiv(last position + 1, BLOCK_N)``
    where :func:`dense_block` holds, else 0 (also past ``num_blocks``)."""
    inside = blocks < num_blocks
    offs = blocks[:, None] * BLOCK_T + tl.arange(0, BLOCK_T)[None, :]
    real = (offs < num_tokens) & inside[:, None]
    req = tl.load(TOKEN_REQ + offs, mask=real, other=0)
    pos = tl.load(POSITIONS + offs, mask=real, other=0)
    first_req = tl.load(TOKEN_REQ + blocks * BLOCK_T, mask=inside, other=0)
    others = tl.sum((real & (req != first_req[:, None])).to(tl.int32), 1)
    last = tl.max(pos, 1)
    dense = inside & (others == 0) & (last < dense_below)
    return tl.where(dense, (last + BLOCK_N) // BLOCK_N, 0).to(tl.int32)


@triton.jit
def _dense_plan_kernel(
    TOKEN_REQ, POSITIONS, START, num_tokens, num_blocks, dense_below,
    BLOCK_T: tl.constexpr, BLOCK_N: tl.constexpr, CHUNK: tl.constexpr,
):  # fmt: skip
    """``START[b]``: key blocks (:func:`_block_tiles`) of the token blocks before ``b``;
    ``START[num_blocks]``: all of them. One program, ``CHUNK`` token blocks per step."""
    offs = tl.arange(0, CHUNK)
    total = 0
    for c0 in range(0, num_blocks, CHUNK):
        tiles = _block_tiles(TOKEN_REQ, POSITIONS, c0 + offs, num_tokens, num_blocks, dense_below, BLOCK_T, BLOCK_N)
        tl.store(START + 1 + c0 + offs, total + tl.cumsum(tiles, 0), mask=c0 + offs < num_blocks)
        total += tl.sum(tiles, 0)
    tl.store(START, 0)


@triton.jit
def softmax_step(q_nope, q_pe, c, k_pe, keep, qk_scale, m_i, l_i, acc):
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
def merge_partial(lse, o, m_i, l_i, acc):
    """Fold one partial — a normalised output ``o [M, C]`` over some keys with its base-2
    log-sum-exp ``lse [M]`` (``-inf``: no keys) — into the running ``(m_i, l_i, acc)``, weight
    ``2^(lse − max)``. Returns the new triple; the merged output is ``acc / l_i`` (where
    ``l_i > 0``)."""
    m_new = tl.maximum(m_i, lse)
    m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m_i - m_use)
    w = tl.exp2(lse - m_use)
    return m_new, l_i * alpha + w, acc * alpha[:, None] + o * w[:, None]


@triton.jit
def _dense_mla_balanced_kernel(
    Q,
    KV,
    PAGE_TABLE,
    TOKEN_REQ,
    POSITIONS,
    START,
    OUT,
    WS_O,
    WS_LSE,
    stride_qt,
    stride_qh,
    stride_kv,
    stride_pt,
    stride_ot,
    stride_oh,
    num_tokens,
    num_heads,
    num_blocks,
    rank,
    rope_dim,
    page_size,
    page_shift,  # log2(page_size) where POW2_PAGE
    qk_scale,  # softmax_scale · log2(e)
    BLOCK_T: tl.constexpr,
    HEADS: tl.constexpr,  # heads per program
    BLOCK_M: tl.constexpr,  # ≥ BLOCK_T · HEADS rows, token-major
    BLOCK_N: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_PE: tl.constexpr,
    POW2_PAGE: tl.constexpr,  # page_size is a power of two: shifts, not a division per key
    ROW32: tl.constexpr,  # the cache's element offsets fit 32 bits: 32-bit row addresses
    KV_FP8: tl.constexpr = False,  # KV is the uint8 FP8 latent cache (kernels/latent_fp8.py)
    SCAN: tl.constexpr = 1024,  # START entries per step of the search for the first token block
):
    p = tl.program_id(0)
    hb = tl.program_id(1)
    total = tl.load(START + num_blocks)
    per = (total + tl.num_programs(0) - 1) // tl.num_programs(0)
    lo = p * per
    hi = tl.minimum(lo + per, total)
    if lo >= hi:
        return  # the work is shorter than the grid
    # The first token block: the number of blocks whose key blocks end at or before lo.
    offs_s = tl.arange(0, SCAN)
    first_block = 0
    for c0 in range(0, num_blocks, SCAN):
        ends = tl.load(START + 1 + c0 + offs_s, mask=c0 + offs_s < num_blocks, other=lo + 1)
        first_block += tl.sum((ends <= lo).to(tl.int32), 0)
    h0 = hb * HEADS
    # Row m = (token t0 + m // HEADS, head h0 + m % HEADS); 64-bit bases, 32-bit row offsets.
    offs_m = tl.arange(0, BLOCK_M)
    t_m, h_m = offs_m // HEADS, offs_m % HEADS
    offs_n = tl.arange(0, BLOCK_N)
    offs_r = tl.arange(0, BLOCK_R)
    offs_pe = tl.arange(0, BLOCK_PE)
    mask_r = offs_r < rank
    mask_pe = offs_pe < rope_dim
    block = first_block
    tile = lo
    while tile < hi:
        start = tl.load(START + block)
        end = tl.load(START + block + 1)
        seg_hi = tl.minimum(end, hi)
        if seg_hi > tile:  # token blocks off the dense path own no key blocks
            t0 = block * BLOCK_T
            mask_m = (offs_m < BLOCK_T * HEADS) & (t0 + t_m < num_tokens) & (h0 + h_m < num_heads)
            row_pos = tl.load(POSITIONS + t0 + t_m, mask=mask_m, other=-1).to(tl.int32)
            last = tl.max(row_pos, 0)
            q_rows = Q + t0.to(tl.int64) * stride_qt + h0 * stride_qh + (t_m * stride_qt + h_m * stride_qh)[:, None]
            q_nope = tl.load(q_rows + offs_r[None, :], mask=mask_m[:, None] & mask_r[None, :], other=0.0)
            q_pe = tl.load(q_rows + rank + offs_pe[None, :], mask=mask_m[:, None] & mask_pe[None, :], other=0.0)
            pages = PAGE_TABLE + tl.load(TOKEN_REQ + t0).to(tl.int64) * stride_pt
            m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
            l_i = tl.zeros([BLOCK_M], tl.float32)
            acc = tl.zeros([BLOCK_M, BLOCK_R], tl.float32)
            for n0 in range((tile - start) * BLOCK_N, (seg_hi - start) * BLOCK_N, BLOCK_N):
                key_pos = n0 + offs_n
                # Keys past `last` re-read row `last` (finite, in cache; the causal mask drops
                # them): unmasked loads keep the 576-wide gather cheap in registers.
                kp = tl.minimum(key_pos, last)
                if POW2_PAGE:
                    slot = (tl.load(pages + (kp >> page_shift)) << page_shift) + (kp & (page_size - 1))
                else:
                    slot = tl.load(pages + kp // page_size) * page_size + kp % page_size
                if not ROW32:
                    slot = slot.to(tl.int64)
                c, k_pe = load_latent_rows(KV, slot, None, offs_r, offs_pe, stride_kv, rank, rope_dim, KV_FP8, Q.dtype.element_ty)  # fmt: skip
                causal = key_pos[None, :] <= row_pos[:, None]
                m_i, l_i, acc = softmax_step(q_nope, q_pe, c, k_pe, causal, qk_scale, m_i, l_i, acc)
            l_safe = tl.where(l_i > 0.0, l_i, 1.0)
            o = acc * (1.0 / l_safe)[:, None]
            if (tile == start) & (seg_hi == end):  # the whole token block
                o_rows = OUT + t0.to(tl.int64) * stride_ot + h0 * stride_oh + (t_m * stride_ot + h_m * stride_oh)[:, None]
                tl.store(o_rows + offs_r[None, :], o.to(OUT.dtype.element_ty), mask=mask_m[:, None] & mask_r[None, :])
            else:  # a partial for _dense_mla_balanced_merge_kernel
                item = ((2 * p + (block != first_block).to(tl.int32)) * tl.num_programs(1) + hb).to(tl.int64)
                lse = tl.where(l_i > 0.0, m_i + tl.log2(l_safe), float("-inf"))
                tl.store(WS_LSE + item * BLOCK_M + offs_m, lse)
                tl.store(WS_O + (item * BLOCK_M + offs_m)[:, None] * BLOCK_R + offs_r[None, :], o.to(WS_O.dtype.element_ty))
        tile = tl.maximum(tile, seg_hi)
        block += 1


@triton.jit
def _dense_mla_balanced_merge_kernel(
    WS_O,
    WS_LSE,
    START,
    OUT,
    stride_ot,
    stride_oh,
    num_tokens,
    num_heads,
    num_blocks,
    rank,
    num_programs,  # P of the forward kernel
    BLOCK_T: tl.constexpr,
    HEADS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_R: tl.constexpr,  # the workspace row width
    BLOCK_C: tl.constexpr,  # output columns per program
):
    """Combines the partials of the token blocks that several forward programs shared (the
    others were written by the forward kernel): weights ``2^(lse_j − max lse)``."""
    block = tl.program_id(0)
    hb = tl.program_id(1)
    start = tl.load(START + block)
    end = tl.load(START + block + 1)
    if end == start:
        return  # not a dense block
    total = tl.load(START + num_blocks)
    per = (total + num_programs - 1) // num_programs
    p_first = start // per
    p_last = (end - 1) // per
    if p_first == p_last:
        return  # one program: written directly
    t0 = block * BLOCK_T
    h0 = hb * HEADS
    offs_m = tl.arange(0, BLOCK_M)
    t_m, h_m = offs_m // HEADS, offs_m % HEADS
    mask_m = (offs_m < BLOCK_T * HEADS) & (t0 + t_m < num_tokens) & (h0 + h_m < num_heads)
    offs_c = tl.program_id(2) * BLOCK_C + tl.arange(0, BLOCK_C)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_C], tl.float32)
    for p in range(p_first, p_last + 1):
        # Slot 2p holds a program's first token block, 2p + 1 its last: only the first of the
        # programs sharing this block can have started in an earlier block.
        item = ((2 * p + ((p == p_first) & (p * per < start)).to(tl.int32)) * tl.num_programs(1) + hb).to(tl.int64)
        rows = item * BLOCK_M + offs_m
        lse = tl.load(WS_LSE + rows)
        o = tl.load(WS_O + rows[:, None] * BLOCK_R + offs_c[None, :]).to(tl.float32)
        m_i, l_i, acc = merge_partial(lse, o, m_i, l_i, acc)
    o = acc * (1.0 / tl.where(l_i > 0.0, l_i, 1.0))[:, None]
    o_rows = OUT + t0.to(tl.int64) * stride_ot + h0 * stride_oh + (t_m * stride_ot + h_m * stride_oh)[:, None]
    tl.store(o_rows + offs_c[None, :], o.to(OUT.dtype.element_ty), mask=mask_m[:, None] & (offs_c < rank)[None, :])


@triton.jit
def _dense_mla_fwd_kernel(
    Q,
    KV,
    PAGE_TABLE,
    TOKEN_REQ,
    POSITIONS,
    OUT,
    WS_O,
    WS_LSE,
    stride_qt,
    stride_qh,
    stride_kv,
    stride_pt,
    stride_ot,
    stride_oh,
    num_tokens,
    num_heads,
    rank,
    rope_dim,
    page_size,
    dense_below,
    chunk_keys,  # keys per chunk (a multiple of BLOCK_N); grid axis 2 walks the chunks
    qk_scale,  # softmax_scale · log2(e)
    BLOCK_T: tl.constexpr,
    HEADS: tl.constexpr,  # heads per program
    BLOCK_M: tl.constexpr,  # ≥ BLOCK_T · HEADS rows, token-major
    BLOCK_N: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_PE: tl.constexpr,
    SPLIT: tl.constexpr,  # several chunks: blocks whose keys span more than one write partials
    PAGE_BLOCKS: tl.constexpr,  # page_size % BLOCK_N == 0: a key block lies in one page
    KV_FP8: tl.constexpr = False,  # KV is the uint8 FP8 latent cache (kernels/latent_fp8.py)
):
    block = tl.num_programs(0) - 1 - tl.program_id(0)  # the longest key ranges start first
    if not dense_block(TOKEN_REQ, POSITIONS, block, num_tokens, dense_below, BLOCK_T):
        return  # written by _sparse_mla_fwd_kernel
    t0 = block * BLOCK_T
    hb = tl.program_id(1)
    chunk = tl.program_id(2)
    h0 = hb * HEADS
    # Row m = (token t0 + m // HEADS, head h0 + m % HEADS); 64-bit bases, 32-bit row offsets.
    offs_m = tl.arange(0, BLOCK_M)
    t_m, h_m = offs_m // HEADS, offs_m % HEADS
    mask_m = (offs_m < BLOCK_T * HEADS) & (t0 + t_m < num_tokens) & (h0 + h_m < num_heads)
    row_pos = tl.load(POSITIONS + t0 + t_m, mask=mask_m, other=-1)
    last = tl.max(row_pos, 0)
    k_lo = chunk * chunk_keys
    if k_lo > last:
        return  # this block's keys end before the chunk
    k_hi = tl.minimum(k_lo + chunk_keys, last + 1)
    offs_r = tl.arange(0, BLOCK_R)
    offs_pe = tl.arange(0, BLOCK_PE)
    mask_r = offs_r < rank
    mask_pe = offs_pe < rope_dim

    q_rows = Q + t0.to(tl.int64) * stride_qt + h0 * stride_qh + (t_m * stride_qt + h_m * stride_qh)[:, None]
    q_nope = tl.load(q_rows + offs_r[None, :], mask=mask_m[:, None] & mask_r[None, :], other=0.0)
    q_pe = tl.load(q_rows + rank + offs_pe[None, :], mask=mask_m[:, None] & mask_pe[None, :], other=0.0)
    pages = PAGE_TABLE + tl.load(TOKEN_REQ + t0).to(tl.int64) * stride_pt

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_R], tl.float32)
    if PAGE_BLOCKS:
        page = tl.load(pages + k_lo // page_size).to(tl.int64)
    for n0 in range(k_lo, k_hi, BLOCK_N):
        key_pos = n0 + tl.arange(0, BLOCK_N)
        # Keys past `last` re-read row `last` (finite, in cache, in n0's page; the causal
        # mask drops them): unmasked loads keep the 576-wide gather cheap in registers.
        kp = tl.minimum(key_pos, last)
        if PAGE_BLOCKS:  # one page-table entry per key block, loaded an iteration ahead
            slot = page * page_size + (n0 % page_size) + (kp - n0)
            page = tl.load(pages + tl.minimum(n0 + BLOCK_N, last) // page_size).to(tl.int64)
        else:
            slot = tl.load(pages + kp // page_size).to(tl.int64) * page_size + kp % page_size
        c, k_pe = load_latent_rows(KV, slot, None, offs_r, offs_pe, stride_kv, rank, rope_dim, KV_FP8, Q.dtype.element_ty)  # fmt: skip
        causal = key_pos[None, :] <= row_pos[:, None]
        m_i, l_i, acc = softmax_step(q_nope, q_pe, c, k_pe, causal, qk_scale, m_i, l_i, acc)

    l_safe = tl.where(l_i > 0.0, l_i, 1.0)
    o = acc * (1.0 / l_safe)[:, None]
    if SPLIT:
        partial = last >= chunk_keys  # several chunks: a partial for _dense_mla_merge_kernel
    else:
        partial = False
    if partial:
        item = (block.to(tl.int64) * tl.num_programs(1) + hb) * tl.num_programs(2) + chunk
        lse = tl.where(l_i > 0.0, m_i + tl.log2(l_safe), float("-inf"))
        tl.store(WS_LSE + item * BLOCK_M + offs_m, lse)
        tl.store(WS_O + (item * BLOCK_M + offs_m)[:, None] * BLOCK_R + offs_r[None, :], o)
    else:
        o_rows = OUT + t0.to(tl.int64) * stride_ot + h0 * stride_oh + (t_m * stride_ot + h_m * stride_oh)[:, None]
        tl.store(o_rows + offs_r[None, :], o.to(OUT.dtype.element_ty), mask=mask_m[:, None] & mask_r[None, :])


@triton.jit
def _dense_mla_merge_kernel(
    WS_O,
    WS_LSE,
    TOKEN_REQ,
    POSITIONS,
    OUT,
    stride_ot,
    stride_oh,
    num_tokens,
    num_heads,
    rank,
    dense_below,
    chunk_keys,
    num_chunks,
    BLOCK_T: tl.constexpr,
    HEADS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_R: tl.constexpr,  # the workspace row width
    BLOCK_C: tl.constexpr,  # output columns per program
):
    """Combines the chunk partials of the dense blocks that span several chunks (the others
    were written by the forward kernel): weights ``2^(lse_j − max lse)``."""
    nblocks = tl.num_programs(0)
    block = nblocks - 1 - tl.program_id(0)
    if not dense_block(TOKEN_REQ, POSITIONS, block, num_tokens, dense_below, BLOCK_T):
        return
    t0 = block * BLOCK_T
    hb = tl.program_id(1)
    h0 = hb * HEADS
    offs_m = tl.arange(0, BLOCK_M)
    t_m, h_m = offs_m // HEADS, offs_m % HEADS
    mask_m = (offs_m < BLOCK_T * HEADS) & (t0 + t_m < num_tokens) & (h0 + h_m < num_heads)
    last = tl.max(tl.load(POSITIONS + t0 + t_m, mask=mask_m, other=-1), 0)
    if last < chunk_keys:
        return  # one chunk: written directly
    offs_c = tl.program_id(2) * BLOCK_C + tl.arange(0, BLOCK_C)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_C], tl.float32)
    base = (block.to(tl.int64) * tl.num_programs(1) + hb) * num_chunks
    for chunk in range(0, tl.minimum(last // chunk_keys + 1, num_chunks)):
        rows = (base + chunk) * BLOCK_M + offs_m
        lse = tl.load(WS_LSE + rows)
        o = tl.load(WS_O + rows[:, None] * BLOCK_R + offs_c[None, :])
        m_i, l_i, acc = merge_partial(lse, o, m_i, l_i, acc)
    o = acc * (1.0 / tl.where(l_i > 0.0, l_i, 1.0))[:, None]
    o_rows = OUT + t0.to(tl.int64) * stride_ot + h0 * stride_oh + (t_m * stride_ot + h_m * stride_oh)[:, None]
    tl.store(o_rows + offs_c[None, :], o.to(OUT.dtype.element_ty), mask=mask_m[:, None] & (offs_c < rank)[None, :])


def _pow2(n: int) -> int:
    return max(16, triton.next_power_of_2(n))


# (key block, stages) of the chunked kernel by the largest key block dividing the page size
# (one page-table entry per block), from the H200 sweep at 1k tokens × 8 heads, page 64
# (`scripts/bench_kernels_attention.py --only dense --sweep`): 64 keys and 2 stages beat 32
# and 3 (66.9 vs 73.3 µs with chunks; 81.8 vs 101.3 without) although ptxas spills
# ~100 bytes there; 16 keys: 99.0 µs.
_DENSE_TILES = ((64, 2), (32, 3), (16, 3))


def dense_config(
    num_heads: int,
    num_tokens: int = 0,
    max_keys: int = 0,
    device: torch.device | None = None,
    page_size: int = 64,
) -> dict:
    """Tiles of the chunked dense-causal kernel: ``block_t`` tokens × ``heads`` heads per program, so
    ``block_t · heads ≤ 64`` rows share each key block (``H = 8``: 8 tokens; ``H ≥ 64``: one
    token, heads in blocks of 64); 8 warps hold the ``[64, 512]`` fp32 accumulator. The key
    block is the largest of 64, 32, 16 that divides ``page_size`` (a block then lies in one
    page); other page sizes, and head blocks that are not powers of two, take 16 or 32 keys
    with a page-table entry per key, 2 stages.

    ``chunk_keys`` (0: one chunk) cuts each block's key range into chunks of that many keys,
    one program each, merged afterwards: only when the token blocks alone cannot fill the
    GPU (``num_tokens``, ``device`` given) and the causal triangle is lopsided — the longest
    range (``max_keys``: the page table's width, at most ``K``) at least 1.5× the mean range
    of a prompt without cached prefix, i.e. ``num_tokens ≥ ⅔ max_keys`` — sized to half the
    longest range (rounded down to the key block, at least two blocks), so the long blocks
    split and the short ones stay whole. (On the H200 at 1k tokens × 8 heads: fresh, 81.8 →
    66.9 µs; on a 1k prefix, where every block walks 1–2k keys, chunks measured slower.)
    Shapes only: graph-safe."""
    heads = min(num_heads, 64)
    block_t = 1 << ((64 // heads).bit_length() - 1)  # a power of two
    if heads & (heads - 1):
        block_n, stages = 16, 2
    else:
        block_n, stages = next(((n, st) for n, st in _DENSE_TILES if page_size % n == 0), (32, 2))
    chunk = 0
    if device is not None and num_tokens > 0:
        blocks = triton.cdiv(num_tokens, block_t) * triton.cdiv(num_heads, heads)
        longest = max_keys if max_keys > 0 else num_tokens
        lopsided = 3 * min(num_tokens, longest) >= 2 * longest  # longest ≥ 1.5 × the mean (fresh)
        if blocks < num_sms(device) and lopsided:
            chunk = max(longest // 2 // block_n, 2) * block_n
    return {"block_t": block_t, "heads": heads, "block_n": block_n, "num_warps": 8, "num_stages": stages,
            "chunk_keys": chunk}  # fmt: skip


def balanced_config(num_heads: int, device: torch.device | None = None) -> dict:
    """Tiles of the balanced dense-causal kernel: ``block_t`` tokens × ``heads`` heads per tile, so
    ``block_t · heads ≤ 64`` rows share each key block (``H = 8``: 8 tokens; ``H ≥ 64``: one
    token, heads in blocks of 64); 8 warps hold the ``[64, 512]`` fp32 accumulator; key blocks
    of 64 (16 where the head block is not a power of two), 2 stages. ``programs``: the forward
    grid's programs per head block (the balanced split), together one per SM of ``device``
    (132 without one): the kernel fits one program per SM; ``partial_dtype``: the dtype of the
    partial outputs of shared token blocks (their log-sum-exp stays fp32). Shapes only:
    graph-safe."""
    heads = min(num_heads, 64)
    block_t = 1 << ((64 // heads).bit_length() - 1)  # a power of two
    block_n = 16 if heads & (heads - 1) else 64
    head_blocks = triton.cdiv(num_heads, heads)
    sms = num_sms(device) if device is not None else 132
    return {"block_t": block_t, "heads": heads, "block_n": block_n, "num_warps": 8, "num_stages": 2,
            "programs": max(1, sms // head_blocks), "partial_dtype": torch.float32}  # fmt: skip


# H200, 8 heads (scripts/bench_dense_mla.py): at page 16 the balanced kernel 266 vs 317 us a layer at
# 8K tokens and even at 1K; at page 64 the chunked kernel's 64-key page blocks win (158 vs 266 at 8K).
BALANCED_BELOW_PAGE = 64


def dense_mla_attention_triton(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    page_table: torch.Tensor,
    token_req: torch.Tensor,
    positions: torch.Tensor,
    page_size: int,
    softmax_scale: float,
    out: torch.Tensor,
    dense_below: int,
    *,
    balanced: bool | None = None,
    block_t: int | None = None,
    block_n: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
    chunk_keys: int | None = None,
    page_blocks: bool | None = None,
    programs: int | None = None,
    partial_dtype: torch.dtype | None = None,
) -> int:
    """Writes the rows of ``out [T, H, r]`` of the token blocks on the dense path (their tokens
    in one request, every position ``< dense_below``): attention of each to the latent rows of
    positions ``0…pos`` of its request, as the twin computes over a top-k row holding exactly
    those. Other rows are left alone. Returns the token block (``block_t``) the sparse kernels
    must skip by :func:`dense_block`.

    Tensors as :func:`~breakgraph.kernels.triton_sparse_mla.sparse_mla_attention_triton` takes
    them (``positions`` contiguous ``[T]``, inside the page table, which bounds the work).
    ``balanced`` takes the balanced split with per-key page entries, else the chunked kernel;
    default from ``BREAKGRAPH_DENSE_MLA_BALANCED`` (``auto``: balanced at pages under
    :data:`BALANCED_BELOW_PAGE` tokens, where the chunked kernel's key blocks shrink to a page). The other
    keyword arguments override :func:`dense_config` / :func:`balanced_config` (benchmarks,
    tests; ``block_t`` a power of two). Chunked kernel: ``chunk_keys = 0``: one chunk;
    ``page_blocks``: one page-table entry per key block, which needs ``page_size`` divisible by
    the key block — by default on where it is. Balanced kernel: ``programs``: forward programs
    per head block; ``partial_dtype``: fp32 or the query's dtype, which halves the partials'
    bytes and adds one rounding of them."""
    if _takes_balanced(page_size, balanced):
        return _balanced(q, kv_cache, page_table, token_req, positions, page_size, softmax_scale, out, dense_below,
                         block_t, block_n, num_warps, num_stages, programs, partial_dtype)  # fmt: skip
    return _chunked(q, kv_cache, page_table, token_req, positions, page_size, softmax_scale, out, dense_below,
                    block_t, block_n, num_warps, num_stages, chunk_keys, page_blocks)  # fmt: skip


def _takes_balanced(page_size: int, balanced: bool | None) -> bool:
    """The kernel choice of :func:`dense_mla_attention_triton` (``BREAKGRAPH_DENSE_MLA_BALANCED``)."""
    if balanced is not None:
        return balanced
    flag = env.read("BREAKGRAPH_DENSE_MLA_BALANCED")
    return page_size < BALANCED_BELOW_PAGE if flag == "auto" else flag == "1"


def dense_token_block(
    q: torch.Tensor, page_table: torch.Tensor, page_size: int, dense_below: int, *,
    balanced: bool | None = None, block_t: int | None = None,
) -> int:  # fmt: skip
    """The token block :func:`dense_mla_attention_triton` takes for these arguments (what it
    returns; both of its launches take theirs from here), without launching it: a caller that
    attends the dense blocks' tokens some other way tells the sparse kernel which blocks to skip (``dense_elsewhere`` of
    :func:`~breakgraph.kernels.triton_sparse_mla.sparse_mla_attention_triton`)."""
    if block_t:
        return block_t
    num_tokens, num_heads, _ = q.shape
    if _takes_balanced(page_size, balanced):
        return balanced_config(num_heads, q.device)["block_t"]
    max_keys = min(dense_below, page_table.shape[1] * page_size)
    return dense_config(num_heads, num_tokens, max_keys, q.device, page_size)["block_t"]


def _chunked(q, kv_cache, page_table, token_req, positions, page_size, softmax_scale, out, dense_below,
             dense_t, dense_n, num_warps, num_stages, chunk_keys, page_blocks) -> int:  # fmt: skip
    """The chunked kernel's launch (grid: token blocks × head blocks × key chunks)."""
    num_tokens, num_heads, dim = q.shape
    rank = out.shape[-1]
    block_r, block_pe = _pow2(rank), _pow2(dim - rank)
    max_keys = min(dense_below, page_table.shape[1] * page_size)
    dense = dense_config(num_heads, num_tokens, max_keys, q.device, page_size)
    dense_t = dense_token_block(q, page_table, page_size, dense_below, balanced=False, block_t=dense_t)
    block_m = _pow2(dense_t * dense["heads"])
    dense_n = dense_n or dense["block_n"]
    chunk = dense["chunk_keys"] if chunk_keys is None else chunk_keys
    chunk = triton.cdiv(chunk or dense_below, dense_n) * dense_n
    num_chunks = triton.cdiv(max_keys, chunk) if chunk < dense_below else 1
    grid = (triton.cdiv(num_tokens, dense_t), triton.cdiv(num_heads, dense["heads"]), num_chunks)
    page_blocks = page_size % dense_n == 0 if page_blocks is None else page_blocks
    if page_blocks and page_size % dense_n:
        raise ValueError(f"dense_page_blocks needs page_size ({page_size}) divisible by the key block ({dense_n})")
    if num_chunks > 1:
        items = grid[0] * grid[1] * num_chunks * block_m
        ws_o = torch.empty(items, block_r, dtype=torch.float32, device=q.device)
        ws_lse = torch.empty(items, dtype=torch.float32, device=q.device)
    else:
        ws_o = ws_lse = out  # unused
    common = (out.stride(0), out.stride(1), num_tokens, num_heads, rank)
    _dense_mla_fwd_kernel[grid](
        q, kv_cache, page_table, token_req, positions, out, ws_o, ws_lse,
        q.stride(0), q.stride(1), kv_cache.stride(0), page_table.stride(0), *common,
        dim - rank, page_size, dense_below, chunk, softmax_scale * _LOG2E,
        BLOCK_T=dense_t, HEADS=dense["heads"], BLOCK_M=block_m, BLOCK_N=dense_n, BLOCK_R=block_r,
        BLOCK_PE=block_pe, SPLIT=num_chunks > 1, PAGE_BLOCKS=page_blocks, KV_FP8=is_fp8_latent(kv_cache),
        num_warps=num_warps or dense["num_warps"], num_stages=num_stages or dense["num_stages"],
    )  # fmt: skip
    if num_chunks > 1:
        merge_cols = min(_MERGE_COLS, block_r)
        _dense_mla_merge_kernel[(grid[0], grid[1], triton.cdiv(block_r, merge_cols))](
            ws_o, ws_lse, token_req, positions, out, *common, dense_below, chunk, num_chunks,
            BLOCK_T=dense_t, HEADS=dense["heads"], BLOCK_M=block_m, BLOCK_R=block_r, BLOCK_C=merge_cols,
            num_warps=4,
        )  # fmt: skip
    return dense_t


def _balanced(q, kv_cache, page_table, token_req, positions, page_size, softmax_scale, out, dense_below,
              block_t, block_n, num_warps, num_stages, programs, partial_dtype) -> int:  # fmt: skip
    """The balanced kernel's launch (plan, forward over ``P`` × head blocks, merge)."""
    num_tokens, num_heads, dim = q.shape
    rank = out.shape[-1]
    cfg = balanced_config(num_heads, q.device)
    block_t = dense_token_block(q, page_table, page_size, dense_below, balanced=True, block_t=block_t)
    block_n = block_n or cfg["block_n"]
    heads = cfg["heads"]
    block_m = _pow2(block_t * heads)
    block_r = _pow2(rank)
    num_blocks = triton.cdiv(num_tokens, block_t)
    head_blocks = triton.cdiv(num_heads, heads)
    max_keys = min(dense_below, page_table.shape[1] * page_size)
    # More programs than key blocks could ever exist only add idle programs and workspace.
    grid_p = max(1, min(programs or cfg["programs"], num_blocks * triton.cdiv(max_keys, block_n)))
    start = torch.empty(num_blocks + 1, dtype=torch.int32, device=q.device)
    _dense_plan_kernel[(1,)](
        token_req, positions, start, num_tokens, num_blocks, dense_below,
        BLOCK_T=block_t, BLOCK_N=block_n, CHUNK=_PLAN_TOKENS // block_t, num_warps=8,
    )  # fmt: skip
    items = 2 * grid_p * head_blocks * block_m
    ws_o = torch.empty(items, block_r, dtype=partial_dtype or cfg["partial_dtype"], device=q.device)
    ws_lse = torch.empty(items, dtype=torch.float32, device=q.device)
    pow2_page = page_size & (page_size - 1) == 0
    common = (out.stride(0), out.stride(1), num_tokens, num_heads, num_blocks, rank)
    _dense_mla_balanced_kernel[(grid_p, head_blocks)](
        q, kv_cache, page_table, token_req, positions, start, out, ws_o, ws_lse,
        q.stride(0), q.stride(1), kv_cache.stride(0), page_table.stride(0), *common,
        dim - rank, page_size, page_size.bit_length() - 1, softmax_scale * _LOG2E,
        BLOCK_T=block_t, HEADS=heads, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_R=block_r, BLOCK_PE=_pow2(dim - rank),
        POW2_PAGE=pow2_page, ROW32=rows_fit_int32(kv_cache), KV_FP8=is_fp8_latent(kv_cache),
        num_warps=num_warps or cfg["num_warps"], num_stages=num_stages or cfg["num_stages"],
    )  # fmt: skip
    merge_cols = min(_MERGE_COLS, block_r)
    _dense_mla_balanced_merge_kernel[(num_blocks, head_blocks, triton.cdiv(block_r, merge_cols))](
        ws_o, ws_lse, start, out, *common, grid_p,
        BLOCK_T=block_t, HEADS=heads, BLOCK_M=block_m, BLOCK_R=block_r, BLOCK_C=merge_cols, num_warps=4,
    )  # fmt: skip
    return block_t
