"""DSA lightning indexer over the paged key cache: scores and causal top-k selection (Triton;
twin: :func:`~breakgraph.kernels.indexer.indexer_topk_ref`).

Two kernels, both *length-true*: their work, stores and reads cover each query token's causal
range ``0…positions[t]`` only, never the page table's full width, so a decode step costs the
same whatever context length the pool was configured for.

Scores (``_indexer_scores_kernel``): ``I[t, j] = Σ_h w[t, h] · ReLU(scale · q[t, h]·k[j])``
for ``j ≤ positions[t]``. Grid ``(token blocks, key programs)``; a program owns ``BLOCK_T``
consecutive tokens and walks the key blocks ``0…max pos`` of the block (strided over the ``key
programs`` of its token block, so a few decode tokens still fill the GPU; the loop bound is read
on the device, so the grid never depends on lengths). Each gathered ``[BLOCK_L, Di]`` key block
serves every token of the program with the *heads along the dot's columns*, so the
ReLU-weighted head sum is a reduction inside each thread's registers (plus a few lane shuffles).
Prefill (stacked): the ``BLOCK_T·Hi`` query rows of the block are the columns of one wgmma per
key block, ``[BLOCK_L, BLOCK_T·Hi]`` in fp32, summed per token by a reshape; pipeline stages (2 for bf16 keys, 3 for FP8)
let the page-table and key loads run ahead of the dot; a power-of-two page turns each key's
position → page → row walk into shifts and masks (``PAGE_SHIFT``; a runtime division is an
emulated call per key layout; with int32 row offsets where the cache allows, 544 → 383 sm_90a
instructions per key block at the prefill tile and 1228 → 577 at decode, the shifts alone 400 and
650, `scripts/bench_kernels_attention.py --aot`; the prefill time did not move
on the H200 — 2.054 / 2.056 ms at 16K tokens, 527 TFLOP/s of causal work: the tensor cores bound
it there). Token blocks whose tokens all sit below
``skip_below`` are not scored (their selection is every causal key).

Tokens of one block usually share a request (prefill lays a request's tokens out
contiguously). In a batch of ``R`` requests the stacked grid has ``min(BLOCK_T, R)`` programs per
(token block, key program), the ``s``-th scoring the block's tokens of its ``s``-th request
against that request's keys (the others return at once), so a straddling block costs no
separate code path. Decode-like batches use ``BLOCK_T = 1``.

Selection: :func:`~breakgraph.kernels.triton_topk.topk_select_triton` (exact select over each
row's causal range, ties to the lower position, positions ascending within parts; its method by the
chunk's shape: one program per row, or several per row for few long rows).

Numerics. bf16 path (default): bf16 operands, fp32 accumulate — the products are exact, so
scores match the fp32 twin up to summation order (~1e-7 relative). FP8 path (``fp8=True``,
the DeepSeek-V3.2 way): query rows (one ``(token, head)``) and key rows are quantised to e4m3
inside the kernel as ``x · (448 / amax)`` (dequantisation scale ``amax / 448``), the dot runs
in fp8 with fp32 accumulate, and the positive scales factor out of the ReLU:
``I = k_scale[j] · Σ_h (w · scale · q_scale)[t, h] · ReLU(q8 · k8)``. e4m3 keeps 3 mantissa
bits, so each score is off by ~3.5 % of the score scale on Gaussian data; near-ties reorder.

Memory: the fp32 score rows of a chunk of query tokens live in one buffer of at most
``SCORE_BUFFER_ELEMS`` elements (256 MiB), as wide as the longest row of the batch.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from breakgraph.kernels.dispatch import num_sms
from breakgraph.kernels.paging import page_shift, rows_fit_int32
from breakgraph.kernels.pdl import pdl_launch, pdl_wait
from breakgraph.kernels.triton_topk import topk_select_triton


@triton.jit
def _quantize_rows_e4m3(x):
    """Rows of ``x`` to e4m3 with one scale per row: ``(x8, dequant scale [rows])``."""
    xf = x.to(tl.float32)
    amax = tl.maximum(tl.max(tl.abs(xf), 1), 1e-12)
    return (xf * tl.div_rn(448.0, amax)[:, None]).to(tl.float8e4nv), amax * (1.0 / 448.0)


@triton.jit
def _load_keys(
    K, pages, offs_j, jmask, offs_d, mask_d, stride_k, page_size,
    FP8: tl.constexpr, PAGE_SHIFT: tl.constexpr, ROWS_I32: tl.constexpr,
):  # fmt: skip
    """Key rows ``[BLOCK_L, BLOCK_D]`` of positions ``offs_j`` through one request's pages, as the
    dot operand, and their dequantisation scales (ones in bf16). ``FP8 == 2``: ``K`` is the FP8
    key cache (``uint8`` rows of :mod:`~breakgraph.kernels.latent_fp8` with no RoPE part: e4m3
    codes, then their fp32 scale in the row's last 16 bytes), read as stored. ``PAGE_SHIFT``:
    log2 of a power-of-two page (a shift and a mask per key), else -1 (a runtime division, an
    emulated call per key layout); ``ROWS_I32``: the cache's element offsets fit in int32."""
    jpos = tl.where(jmask, offs_j, 0)
    if PAGE_SHIFT >= 0:
        page = tl.load(pages + (jpos >> PAGE_SHIFT), mask=jmask, other=0)
        slot = (page << PAGE_SHIFT) + (jpos & ((1 << PAGE_SHIFT) - 1))
    else:
        page = tl.load(pages + jpos // page_size, mask=jmask, other=0)
        slot = page * page_size + jpos % page_size
    if ROWS_I32:
        rows = K + slot.to(tl.int32) * stride_k
    else:
        rows = K + slot.to(tl.int64) * stride_k
    if FP8 == 2:  # read as e4m3 (no bitcast between the load and the dot: it stays pipelineable)
        k_op = tl.load(rows.to(tl.pointer_type(tl.float8e4nv))[:, None] + offs_d[None, :],
                       mask=jmask[:, None] & mask_d[None, :], other=0.0)  # fmt: skip
        k_scale = tl.load((rows + stride_k - 16).to(tl.pointer_type(tl.float32)), mask=jmask, other=0.0)
    else:
        k = tl.load(rows[:, None] + offs_d[None, :], mask=jmask[:, None] & mask_d[None, :], other=0)
        if FP8:
            k_op, k_scale = _quantize_rows_e4m3(k)
        else:
            k_op, k_scale = k, tl.full([k.shape[0]], 1.0, tl.float32)
    return k_op, k_scale


@triton.jit
def _token_scores(
    Q, W, t, k_op, k_scale, offs_h, mask_h, offs_d, mask_d, stride_qt, stride_qh, stride_wt, scale,
    FP8: tl.constexpr,
):
    """Scores ``[BLOCK_L]`` of token ``t`` (int64) against one key block: heads on the dot's
    columns, reduced along each row."""
    q = tl.load(
        Q + t * stride_qt + offs_h[:, None] * stride_qh + offs_d[None, :],
        mask=mask_h[:, None] & mask_d[None, :],
        other=0.0,
    )
    w = tl.load(W + t * stride_wt + offs_h, mask=mask_h, other=0.0).to(tl.float32) * scale
    if FP8:
        q, q_scale = _quantize_rows_e4m3(q)
        w = w * q_scale
    logits = tl.dot(k_op, tl.trans(q))  # [BLOCK_L, BLOCK_H] fp32
    return tl.sum(tl.maximum(logits, 0.0) * w[None, :], 1) * k_scale


@triton.jit
def _stacked_scores(
    Q, W, K, SCORES, TOKEN_REQ, pages, req_s, t0, pid_l, key_programs, pos, max_pos, offs_d, mask_d,
    stride_qt, stride_qh, stride_wt, stride_k, stride_st, num_tokens, num_heads, page_size, scale,
    BLOCK_T: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_L: tl.constexpr, FP8: tl.constexpr,
    PAGE_SHIFT: tl.constexpr, ROWS_I32: tl.constexpr,
):
    """Scores of the block's tokens (``t0…t0 + BLOCK_T - 1``) of request ``req_s`` (``pos``:
    their positions, ``-1`` for the others): their ``BLOCK_T·Hi`` query rows stacked on the columns of
    one dot per key block, each token's head sum a register reduction of the fp32 terms."""
    r = tl.arange(0, BLOCK_T * BLOCK_H)
    row_t = t0 + r // BLOCK_H
    row_h = r % BLOCK_H
    row_mask = (row_t < num_tokens) & (row_h < num_heads)
    row_mask &= tl.load(TOKEN_REQ + row_t, mask=row_mask, other=-1) == req_s
    q = tl.load(
        Q + row_t.to(tl.int64)[:, None] * stride_qt + row_h[:, None] * stride_qh + offs_d[None, :],
        mask=row_mask[:, None] & mask_d[None, :],
        other=0.0,
    )
    qw = tl.load(W + row_t.to(tl.int64) * stride_wt + row_h, mask=row_mask, other=0.0).to(tl.float32) * scale
    if FP8:
        q, q_scale = _quantize_rows_e4m3(q)
        qw = qw * q_scale
    cols = tl.arange(0, BLOCK_T)
    out_rows = SCORES + (t0 + cols).to(tl.int64)[None, :] * stride_st
    for kb in range(pid_l, tl.cdiv(max_pos + 1, BLOCK_L), key_programs):
        offs_j = kb * BLOCK_L + tl.arange(0, BLOCK_L)
        k_op, k_scale = _load_keys(
            K, pages, offs_j, offs_j <= max_pos, offs_d, mask_d, stride_k, page_size, FP8, PAGE_SHIFT, ROWS_I32
        )
        logits = tl.dot(k_op, tl.trans(q))  # [BLOCK_L, BLOCK_T·Hi]
        terms = tl.maximum(logits, 0.0) * qw[None, :]
        s = tl.sum(tl.reshape(terms, [BLOCK_L, BLOCK_T, BLOCK_H]), 2)  # [BLOCK_L, BLOCK_T]
        tl.store(out_rows + offs_j[:, None], s * k_scale[:, None], mask=offs_j[:, None] <= pos[None, :])


@triton.jit
def _indexer_scores_kernel(
    Q,
    W,
    K,
    PAGE_TABLE,
    TOKEN_REQ,
    POSITIONS,
    SCORES,
    stride_qt,
    stride_qh,
    stride_wt,
    stride_k,
    stride_pt,
    stride_st,
    num_tokens,
    num_heads,
    head_dim,
    page_size,
    skip_below,
    scale,
    segments,
    BLOCK_T: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_L: tl.constexpr,
    FP8: tl.constexpr,
    STACKED: tl.constexpr,
    PAGE_SHIFT: tl.constexpr = -1,  # log2(page_size) for a power-of-two page, else -1
    ROWS_I32: tl.constexpr = False,  # the key cache's element offsets fit in int32
    PDL: tl.constexpr = False,
):
    # Later token blocks have longer causal ranges: start them first.
    pdl_wait(PDL)
    t0 = (tl.num_programs(0) - 1 - tl.program_id(0)) * BLOCK_T
    pid_l = tl.program_id(1)
    key_programs = tl.num_programs(1) // segments
    offs_t = t0 + tl.arange(0, BLOCK_T)
    mask_t = offs_t < num_tokens
    pos = tl.load(POSITIONS + offs_t, mask=mask_t, other=-1)
    max_pos = tl.max(pos, 0)
    if max_pos < skip_below:
        return  # every token's selection is all of its causal keys
    offs_h = tl.arange(0, BLOCK_H)
    mask_h = offs_h < num_heads
    offs_d = tl.arange(0, BLOCK_D)
    mask_d = offs_d < head_dim

    req = tl.load(TOKEN_REQ + offs_t, mask=mask_t, other=0)
    if STACKED:
        # Program (block, seg·key_programs + l) scores the tokens of the block's seg-th request
        # (blocks straddle requests rarely; then a second program scores the next request's part).
        seg = pid_l // key_programs
        pid_l = pid_l % key_programs
        prev = tl.load(TOKEN_REQ + offs_t - 1, mask=mask_t & (offs_t > t0), other=0)
        seg_t = tl.cumsum((mask_t & (offs_t > t0) & (req != prev)).to(tl.int32), 0)
        mine = mask_t & (seg_t == seg)
        if tl.sum(mine.to(tl.int32), 0) > 0:
            req_s = tl.max(tl.where(mine, req, 0), 0)
            pos_s = tl.where(mine, pos, -1)
            _stacked_scores(
                Q, W, K, SCORES, TOKEN_REQ, PAGE_TABLE + req_s.to(tl.int64) * stride_pt, req_s, t0, pid_l,
                key_programs, pos_s, tl.max(pos_s, 0), offs_d, mask_d, stride_qt, stride_qh, stride_wt,
                stride_k, stride_st, num_tokens, num_heads, page_size, scale,
                BLOCK_T, BLOCK_H, BLOCK_L, FP8, PAGE_SHIFT, ROWS_I32,
            )  # fmt: skip
    else:
        req0 = tl.load(TOKEN_REQ + t0)
        one_request = tl.sum((mask_t & (req != req0)).to(tl.int32), 0) == 0
        pages0 = PAGE_TABLE + req0.to(tl.int64) * stride_pt
        for kb in range(pid_l, tl.cdiv(max_pos + 1, BLOCK_L), key_programs):
            offs_j = kb * BLOCK_L + tl.arange(0, BLOCK_L)
            # The keys of the block's request (none loaded when the block straddles requests).
            jmask = (offs_j <= max_pos) & one_request
            k_op, k_scale = _load_keys(
                K, pages0, offs_j, jmask, offs_d, mask_d, stride_k, page_size, FP8, PAGE_SHIFT, ROWS_I32
            )
            for i in tl.static_range(BLOCK_T):
                t_i = t0 + i
                if t_i < num_tokens:
                    pos_i = tl.load(POSITIONS + t_i)
                    if kb * BLOCK_L <= pos_i:
                        if not one_request:  # the block straddles requests: this token's own keys
                            pages = PAGE_TABLE + tl.load(TOKEN_REQ + t_i).to(tl.int64) * stride_pt
                            k_op, k_scale = _load_keys(
                                K, pages, offs_j, offs_j <= pos_i, offs_d, mask_d, stride_k, page_size,
                                FP8, PAGE_SHIFT, ROWS_I32,
                            )  # fmt: skip
                        s = _token_scores(
                            Q, W, t_i.to(tl.int64), k_op, k_scale, offs_h, mask_h, offs_d, mask_d,
                            stride_qt, stride_qh, stride_wt, scale, FP8,
                        )  # fmt: skip
                        tl.store(SCORES + t_i.to(tl.int64) * stride_st + offs_j, s, mask=offs_j <= pos_i)


def default_config(
    num_tokens: int, num_requests: int, num_heads: int, row_len: int, device: torch.device, fp8: int = 0
) -> dict:
    """Tiles of the score kernel for a shape: ``block_t`` tokens per program (1 for decode-like
    batches), key blocks of ``block_l``, and ``key_programs`` per token block — enough programs
    to fill the GPU, capped at 64 so the grid does not grow with the configured context.
    ``fp8``: 0 bf16 keys, 1 FP8 quantised in the kernel, 2 the stored FP8 key cache."""
    stacked = num_tokens > num_requests
    # Stacked tiles from the H200 sweep (`scripts/bench_kernels_attention.py --only indexer --sweep`):
    # bf16, 8 tokens and 8 warps (two warpgroups, 4 tokens × 32 heads each), 2 stages, registers
    # capped at 128 (two programs per SM); FP8, 4 tokens and 4 warps, 3 stages, uncapped (stored
    # keys) or at 168 (in-kernel quantisation, as measured).
    # At most 256 query rows per program (more heads: fewer tokens).
    rows = 256 // max(16, triton.next_power_of_2(num_heads))
    if not stacked:
        tiles = {"block_t": 1, "block_l": 128, "num_warps": 8, "num_stages": 2, "maxnreg": None}
    elif fp8:
        tiles = {"block_t": min(4, rows), "block_l": 64, "num_warps": 4, "num_stages": 3,
                 "maxnreg": 168 if fp8 == 1 else None}  # fmt: skip
    else:
        tiles = {"block_t": min(8, rows), "block_l": 64, "num_warps": 8, "num_stages": 2, "maxnreg": 128}
    token_blocks = triton.cdiv(num_tokens, tiles["block_t"])
    key_programs = max(1, min(triton.cdiv(row_len, tiles["block_l"]), triton.cdiv(4 * num_sms(device), token_blocks), 64))
    return {**tiles, "key_programs": key_programs, "stacked": stacked}


def supports(
    q: torch.Tensor,
    weights: torch.Tensor,
    k_cache: torch.Tensor,
    page_table: torch.Tensor,
    token_req: torch.Tensor,
    positions: torch.Tensor,
) -> bool:
    """Whether :func:`indexer_topk_triton` handles these tensors (else use the twin):
    bf16/fp16 ``q`` and a key cache of the same dtype or the FP8 key cache (``uint8`` rows of
    ``align16(Di) + 16`` bytes; scored with ``fp8=True`` only), ``Hi ≤ 128``, ``Di ≤ 256``, unit
    last strides."""
    di = q.shape[-1]
    if k_cache.dtype == torch.uint8:
        width_ok = k_cache.shape[-1] == -(-di // 16) * 16 + 16
    else:
        width_ok = k_cache.dtype == q.dtype and k_cache.shape[-1] == di
    return (
        q.dtype in (torch.bfloat16, torch.float16)
        and width_ok
        and q.dim() == 3
        and k_cache.dim() == 2
        and di <= 256
        and q.shape[1] <= 128
        and all(t.stride(-1) == 1 for t in (q, weights, k_cache, page_table, token_req, positions))
    )


def indexer_scores_triton(
    q: torch.Tensor,
    weights: torch.Tensor,
    k_cache: torch.Tensor,
    page_table: torch.Tensor,
    token_req: torch.Tensor,
    positions: torch.Tensor,
    page_size: int,
    softmax_scale: float,
    scores: torch.Tensor,
    *,
    fp8: bool = False,
    skip_below: int = 0,
    row_len: int | None = None,
    block_t: int | None = None,
    block_l: int | None = None,
    key_programs: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
    stacked: bool | None = None,
    maxnreg: int | None = None,
) -> None:
    """Write the indexer scores of each token ``t`` at positions ``0…positions[t]`` into row
    ``t`` of ``scores`` (fp32, unit last stride, at least ``positions[t] + 1`` wide); nothing
    past a row's position is written.

    Arguments as :func:`~breakgraph.kernels.indexer.indexer_topk_ref` (``weights`` fp32
    ``[T, Hi]``); ``fp8`` picks the FP8 e4m3 dot (module docstring); token blocks whose
    positions are all ``< skip_below`` are skipped; ``row_len`` (host int, default the page
    table's width) bounds the rows for the grid choice only; ``block_t`` … ``maxnreg`` override
    :func:`default_config`'s tiles. Graph-safe.
    """
    num_tokens, num_heads, head_dim = q.shape
    if num_tokens == 0:
        return
    if k_cache.dtype == torch.uint8 and not fp8:
        raise ValueError("an FP8 indexer key cache is scored by the FP8 indexer only (fp8=True)")
    row_len = row_len or page_table.shape[1] * page_size
    fp8_mode = 2 if k_cache.dtype == torch.uint8 else int(fp8)
    cfg = default_config(num_tokens, page_table.shape[0], num_heads, row_len, q.device, fp8_mode)
    block_t = block_t or cfg["block_t"]
    use_stacked = (cfg["stacked"] if stacked is None else stacked) and block_t > 1
    block_h = max(16, triton.next_power_of_2(num_heads))
    if use_stacked and block_t * block_h > 256:  # on the H200, 16 × 32 columns gave wrong sums
        raise ValueError(f"the stacked dot takes at most 256 query rows, got block_t={block_t} × {block_h} heads")
    # Stacked blocks of a multi-request batch may straddle requests: a program per request part
    # (a block of block_t tokens holds parts of at most min(block_t, requests) requests). A
    # runtime argument, not a constexpr: a new request count must not compile a new kernel.
    segments = min(block_t, page_table.shape[0]) if use_stacked else 1
    grid = (triton.cdiv(num_tokens, block_t), (key_programs or cfg["key_programs"]) * segments)
    _indexer_scores_kernel[grid](
        q, weights, k_cache, page_table, token_req, positions, scores,
        q.stride(0), q.stride(1), weights.stride(0), k_cache.stride(0), page_table.stride(0), scores.stride(0),
        num_tokens, num_heads, head_dim, page_size, skip_below, softmax_scale, segments,
        BLOCK_T=block_t, BLOCK_H=block_h,
        BLOCK_D=max(32, triton.next_power_of_2(head_dim)), BLOCK_L=block_l or cfg["block_l"],
        FP8=fp8_mode,
        STACKED=use_stacked,
        PAGE_SHIFT=page_shift(page_size),
        ROWS_I32=rows_fit_int32(k_cache),
        num_warps=num_warps or cfg["num_warps"], num_stages=num_stages or cfg["num_stages"],
        maxnreg=maxnreg or cfg["maxnreg"], **pdl_launch(q.device),
    )  # fmt: skip


# The fp32 score rows of one chunk of query tokens (256 MiB).
SCORE_BUFFER_ELEMS = 1 << 26


def indexer_topk_triton(
    q: torch.Tensor,
    weights: torch.Tensor,
    k_cache: torch.Tensor,
    page_table: torch.Tensor,
    token_req: torch.Tensor,
    positions: torch.Tensor,
    page_size: int,
    softmax_scale: float,
    topk_out: torch.Tensor,
    *,
    max_seq_len: int | None = None,
    fp8: bool = False,
    score_buffer_elems: int = 0,
    **kernel_opts,
) -> None:
    """:func:`~breakgraph.kernels.indexer.indexer_topk_ref`'s contract (set-wise: a row's
    positions come in ascending order within the select's parts, not the twin's order) with
    the length-true kernels of this module.

    ``max_seq_len`` (host int, default the page table's width) bounds every token's
    ``position + 1``: the score buffer is that wide, and query tokens go in chunks so it stays
    under ``score_buffer_elems`` fp32 values (default ``SCORE_BUFFER_ELEMS``). Static shapes
    only, no host syncs.
    """
    num_tokens, topk = topk_out.shape
    width = page_table.shape[1] * page_size
    row_len = min(max_seq_len or width, width)
    if num_tokens == 0:
        return
    chunk = max(1, min(num_tokens, (score_buffer_elems or SCORE_BUFFER_ELEMS) // max(1, row_len)))
    scores = torch.empty(chunk, row_len, dtype=torch.float32, device=q.device)
    for start in range(0, num_tokens, chunk):
        end = min(start + chunk, num_tokens)
        indexer_scores_triton(
            q[start:end], weights[start:end], k_cache, page_table, token_req[start:end], positions[start:end],
            page_size, softmax_scale, scores, fp8=fp8, skip_below=topk, row_len=row_len, **kernel_opts,
        )  # fmt: skip
        topk_select_triton(scores, positions[start:end], topk_out[start:end])
