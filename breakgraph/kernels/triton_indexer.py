"""DSA lightning-indexer scores over the paged key cache (Triton; twin: :func:`indexer_topk_ref`).

Scores ``I[t, j] = Σ_h w[t, h] · ReLU(scale · q[t, h]·k[j])`` for every key position
``j < L = P · page_size`` of the token's request, ``-inf`` where ``j > positions[t]``. The
causal top-k then runs on these scores with ``torch.topk`` (see
:func:`indexer_topk_triton`).

Kernel design. Grid ``(cdiv(T, BLOCK_T), cdiv(L, BLOCK_L))``; a program scores ``BLOCK_T``
consecutive query tokens against ``BLOCK_L`` key positions. Its queries are one matrix of
``BLOCK_T · Hi`` rows (token-major), so a single ``[BLOCK_T·Hi, Di] × [Di, BLOCK_L]`` dot
serves every head of every token, and each gathered key block is loaded once per program.
Head reduction: ``ReLU(logits) · w`` reshaped to ``[BLOCK_T, Hi, BLOCK_L]`` and summed over
heads. Key blocks past the largest position in the token block only write ``-inf`` (no
loads, no dot): causal prefill does about half the work of a dense pass.

Tokens of one block usually share a request (prefill lays a request's tokens out
contiguously); a block that straddles requests takes a slower branch that gathers keys per
token (a few boundary blocks per batch). Decode-like batches (``T ≤ B``) use
``BLOCK_T = 1``.

Numerics. bf16 path (default): bf16 operands, fp32 accumulate — the products are exact, so
it matches the fp32 twin up to summation order (~1e-7 relative). FP8 path (``fp8=True``, the
DeepSeek-V3.2 way): ``q`` rows (one ``(token, head)``: one 128-group for ``Di = 128``) and key
rows (one token) are quantised to e4m3 inside the kernel as ``x · (448 / amax)`` (round to
nearest; dequantisation scale ``amax / 448``), the dot runs in fp8 with fp32 accumulate, and
the positive scales factor out of the ReLU:
``I = k_scale[j] · Σ_h (w · scale · q_scale)[t, h] · ReLU(q8 · k8)``. e4m3 keeps 3 mantissa
bits, so each score is off by ~3.5 % of the score scale on Gaussian data (the same as an
exact emulation of the quantisation); near-ties in the top-k reorder.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _key_block_scores(
    q_op,
    qw,
    K,
    pages,
    offs_j,
    jmask,
    offs_d,
    mask_d,
    stride_k,
    page_size,
    BLOCK_T: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_L: tl.constexpr,
    FP8: tl.constexpr,
):
    """Scores ``[BLOCK_T, BLOCK_L]`` of the query rows ``q_op`` against one request's keys."""
    jpos = tl.where(jmask, offs_j, 0)
    page = tl.load(pages + jpos // page_size, mask=jmask, other=0).to(tl.int64)
    rows = K + (page * page_size + jpos % page_size) * stride_k
    k = tl.load(rows[:, None] + offs_d[None, :], mask=jmask[:, None] & mask_d[None, :], other=0.0)
    if FP8:
        kf = k.to(tl.float32)
        k_amax = tl.maximum(tl.max(tl.abs(kf), 1), 1e-12)
        k_op = (kf * tl.div_rn(448.0, k_amax)[:, None]).to(tl.float8e4nv)
        k_scale = k_amax * (1.0 / 448.0)
    else:
        k_op = k
    logits = tl.dot(q_op, tl.trans(k_op))  # [BLOCK_T * BLOCK_H, BLOCK_L] fp32
    contrib = tl.maximum(logits, 0.0) * qw[:, None]
    s = tl.sum(tl.reshape(contrib, (BLOCK_T, BLOCK_H, BLOCK_L)), axis=1)
    if FP8:
        s = s * k_scale[None, :]
    return s


@triton.jit
def _load_queries(
    Q,
    W,
    t0,
    num_tokens,
    num_heads,
    stride_qt,
    stride_qh,
    stride_wt,
    offs_d,
    mask_d,
    scale,
    BLOCK_T: tl.constexpr,
    BLOCK_H: tl.constexpr,
    FP8: tl.constexpr,
):
    """Query rows ``(token, head)`` of tokens ``t0 .. t0+BLOCK_T-1``, token-major, as the dot
    operand (bf16, or e4m3 with the row scale folded into the weights), and their weights."""
    r = tl.arange(0, BLOCK_T * BLOCK_H)
    row_t = (t0 + r // BLOCK_H).to(tl.int64)
    row_h = r % BLOCK_H
    row_mask = (row_t < num_tokens) & (row_h < num_heads)
    q = tl.load(
        Q + row_t[:, None] * stride_qt + row_h[:, None] * stride_qh + offs_d[None, :],
        mask=row_mask[:, None] & mask_d[None, :],
        other=0.0,
    )
    qw = tl.load(W + row_t * stride_wt + row_h, mask=row_mask, other=0.0).to(tl.float32) * scale
    if FP8:
        qf = q.to(tl.float32)
        q_amax = tl.maximum(tl.max(tl.abs(qf), 1), 1e-12)
        q_op = (qf * tl.div_rn(448.0, q_amax)[:, None]).to(tl.float8e4nv)
        qw = qw * (q_amax * (1.0 / 448.0))
    else:
        q_op = q
    return q_op, qw


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
    max_len,
    page_size,
    scale,
    BLOCK_T: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_L: tl.constexpr,
    FP8: tl.constexpr,
):
    pid_t = tl.program_id(0)
    pid_l = tl.program_id(1)
    t0 = pid_t * BLOCK_T
    offs_t = t0 + tl.arange(0, BLOCK_T)
    mask_t = offs_t < num_tokens
    offs_j = pid_l * BLOCK_L + tl.arange(0, BLOCK_L)
    offs_d = tl.arange(0, BLOCK_D)
    mask_d = offs_d < head_dim

    pos = tl.load(POSITIONS + offs_t, mask=mask_t, other=-1)
    max_pos = tl.max(pos, 0)

    scores = tl.full([BLOCK_T, BLOCK_L], float("-inf"), tl.float32)
    if pid_l * BLOCK_L <= max_pos:
        req = tl.load(TOKEN_REQ + offs_t, mask=mask_t, other=0)
        req0 = tl.load(TOKEN_REQ + t0)
        req_lo = tl.min(tl.where(mask_t, req, req0), 0)
        req_hi = tl.max(tl.where(mask_t, req, req0), 0)
        if req_lo == req_hi:
            q_op, qw = _load_queries(
                Q, W, t0, num_tokens, num_heads, stride_qt, stride_qh, stride_wt, offs_d, mask_d, scale,
                BLOCK_T, BLOCK_H, FP8,
            )  # fmt: skip
            jmask = (offs_j <= max_pos) & (offs_j < max_len)
            pages = PAGE_TABLE + req0.to(tl.int64) * stride_pt
            scores = _key_block_scores(
                q_op, qw, K, pages, offs_j, jmask, offs_d, mask_d, stride_k, page_size,
                BLOCK_T, BLOCK_H, BLOCK_L, FP8,
            )  # fmt: skip
        else:
            # The block straddles requests: score its tokens one at a time, each against
            # its own request's keys.
            for i in range(BLOCK_T):
                t_i = tl.minimum(t0 + i, num_tokens - 1)
                q_op, qw = _load_queries(
                    Q, W, t_i, num_tokens, num_heads, stride_qt, stride_qh, stride_wt, offs_d, mask_d, scale,
                    1, BLOCK_H, FP8,
                )  # fmt: skip
                jmask = (offs_j <= tl.load(POSITIONS + t_i)) & (offs_j < max_len)
                pages = PAGE_TABLE + tl.load(TOKEN_REQ + t_i).to(tl.int64) * stride_pt
                s_i = _key_block_scores(
                    q_op, qw, K, pages, offs_j, jmask, offs_d, mask_d, stride_k, page_size,
                    1, BLOCK_H, BLOCK_L, FP8,
                )  # fmt: skip
                scores = tl.where(tl.arange(0, BLOCK_T)[:, None] == i, s_i, scores)

    scores = tl.where(offs_j[None, :] <= pos[:, None], scores, float("-inf"))
    out = SCORES + offs_t.to(tl.int64)[:, None] * stride_st + offs_j[None, :]
    tl.store(out, scores, mask=mask_t[:, None] & (offs_j < max_len)[None, :])


def default_config(num_tokens: int, num_requests: int, num_heads: int) -> dict:
    """Block sizes and warps for a shape (tuned guesses; see the bench)."""
    block_h = max(16, triton.next_power_of_2(num_heads))
    block_t = 1 if num_tokens <= num_requests else max(1, 128 // block_h)
    rows = block_t * block_h
    return {"block_t": block_t, "block_l": 128, "num_warps": 8 if rows >= 128 else 4, "num_stages": 2}


def supports(
    q: torch.Tensor,
    weights: torch.Tensor,
    k_cache: torch.Tensor,
    page_table: torch.Tensor,
    token_req: torch.Tensor,
    positions: torch.Tensor,
) -> bool:
    """Whether :func:`indexer_topk_triton` handles these tensors (else use the twin):
    bf16/fp16 ``q`` and key cache of one dtype, ``Hi ≤ 128``, ``Di ≤ 256``, unit last strides."""
    return (
        q.dtype in (torch.bfloat16, torch.float16)
        and k_cache.dtype == q.dtype
        and q.dim() == 3
        and k_cache.dim() == 2
        and q.shape[-1] == k_cache.shape[-1] <= 256
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
    block_t: int | None = None,
    block_l: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
) -> None:
    """Write the indexer scores ``[T, L]`` fp32 (``-inf`` past each token's position) into
    ``scores``, whose row stride may exceed ``L`` but whose last stride is 1.

    Arguments as :func:`~breakgraph.kernels.indexer.indexer_topk_ref` (``weights`` fp32
    ``[T, Hi]``); ``fp8`` picks the FP8 e4m3 dot (module docstring). Graph-safe.
    """
    num_tokens, num_heads, head_dim = q.shape
    max_len = page_table.shape[1] * page_size
    if num_tokens == 0:
        return
    cfg = default_config(num_tokens, page_table.shape[0], num_heads)
    block_t = block_t or cfg["block_t"]
    block_l = block_l or cfg["block_l"]
    grid = (triton.cdiv(num_tokens, block_t), triton.cdiv(max_len, block_l))
    _indexer_scores_kernel[grid](
        q, weights, k_cache, page_table, token_req, positions, scores,
        q.stride(0), q.stride(1), weights.stride(0), k_cache.stride(0), page_table.stride(0), scores.stride(0),
        num_tokens, num_heads, head_dim, max_len, page_size, softmax_scale,
        BLOCK_T=block_t, BLOCK_H=max(16, triton.next_power_of_2(num_heads)),
        BLOCK_D=max(32, triton.next_power_of_2(head_dim)), BLOCK_L=block_l, FP8=fp8,
        num_warps=num_warps or cfg["num_warps"], num_stages=num_stages or cfg["num_stages"],
    )  # fmt: skip


# Bound on the fp32 score buffer per chunk of query tokens (256 MiB).
_SCORE_CHUNK_ELEMS = 1 << 26


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
    fp8: bool = False,
    **kernel_opts,
) -> None:
    """:func:`~breakgraph.kernels.indexer.indexer_topk_ref`'s contract: Triton scores, then
    ``torch.topk`` (sorted, like the twin) and ``-1`` where the chosen score is ``-inf``.

    Query tokens are processed in chunks so the score buffer stays under
    ``_SCORE_CHUNK_ELEMS`` elements. Static shapes only, no host syncs.
    """
    num_tokens, topk = topk_out.shape
    max_len = page_table.shape[1] * page_size
    k_eff = min(topk, max_len)
    chunk = max(1, min(num_tokens, _SCORE_CHUNK_ELEMS // max(1, max_len)))
    scores = torch.empty(chunk, max_len, dtype=torch.float32, device=q.device)
    for start in range(0, num_tokens, chunk):
        end = min(start + chunk, num_tokens)
        s = scores[: end - start]
        indexer_scores_triton(
            q[start:end], weights[start:end], k_cache, page_table, token_req[start:end], positions[start:end],
            page_size, softmax_scale, s, fp8=fp8, **kernel_opts,
        )  # fmt: skip
        vals, idx = s.topk(k_eff, dim=-1)
        topk_out[start:end, :k_eff] = torch.where(vals == float("-inf"), -1, idx).to(torch.int32)
    if k_eff < topk:
        topk_out[:, k_eff:] = -1
