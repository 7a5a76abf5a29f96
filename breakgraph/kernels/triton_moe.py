"""MoE on the GPU: routing, token permutation, grouped expert GEMMs (bf16 and FP8 block-scaled),
SiLU-and-mul and the weighted combine. Graph-safe: static shapes, no host syncs.

Pipeline for ``x [T, D]``, ``topk_ids [T, k]`` (``P = T·k`` token-expert pairs, pair ``p = t·k + j``):

1. :func:`moe_align` — three device steps (a memset, then two Triton kernels; one program of
   one kernel up to ``ALIGN_ONE_PROGRAM_PAIRS`` pairs): count pairs per
   expert (atomics), then place each pair in an expert-sorted list whose expert segments are
   padded to a multiple of ``block_m`` rows (sentinel ``P`` in the padding); the first program
   also writes the expert of every ``block_m``-row block and the number of used blocks. The
   grid of the GEMMs is a fixed upper bound of row blocks, ``ceil(P/block_m) + min(E, P)``:
   blocks past the used count exit at once, and experts with no pairs own no block at all.
2. :func:`moe_gemm` — grouped GEMM over those row blocks. GEMM 1 gathers ``x`` rows by token
   (no permuted copy of ``x``), multiplies by the expert's gate and up rows and applies
   ``silu(g)·u`` in the epilogue, writing ``h [P, I]`` by pair. GEMM 2 multiplies ``h`` by the
   expert's ``w2`` and writes ``y [P, D]`` by pair. Weights are bf16, or e4m3 with one fp32 scale
   per 128×128 tile; for FP8 the activations are either kept in bf16 and each weight tile is
   dequantised in registers to ``bf16(w·s)`` — the very values the twin's ``block_dequant``
   makes — before a bf16 MMA (``W8A16``, ``BREAKGRAPH_MOE_W8A8=0``: the closer to the twin) or
   quantised per (row, 128 columns) to e4m3 for the fp8 tensor
   cores, each k-block's fp32 partial sum scaled by ``s_w · s_a`` (``W8A8``, the default at
   every batch size, :func:`moe_fp8_activations`): twice the MMA rate, ≈4% relative deviation from the
   bf16-activation twin on random data: two quantised GEMMs). Small row blocks use the swapped
   product ``(W·Aᵀ)ᵀ`` so that the weight rows fill the 64-row MMA side and the few tokens the
   narrow one. With a few rows per expert the GEMMs are a stream of weight bytes; the stream
   kernel (:func:`_moe_stream_kernel`, config ``KERNEL="stream"``) gives each program several
   column tiles in one pipelined loop (W8A16's GEMM 2 at decode sizes). The tile choice
   depends only on static shapes (:func:`gemm_config`).
   Row order inside an expert's segment follows atomics, but every output row is computed
   by the same k-ordered dot whatever its position, so results do not vary between runs.
3. :func:`moe_combine` — ``out[t] = Σ_j w[t, j] · y[t·k + j]`` in fp32, one pass, deterministic.

For bf16 weights on sm90/sm100 the two GEMMs can instead be ``torch._grouped_mm`` (CUTLASS,
no host sync; int32 offsets; 16-byte aligned row strides) over the unpadded expert-sorted rows
(``x`` gathered once), with :func:`silu_mul` between them; :func:`moe_combine` then reads the
rows through ``pair_pos``.

Routing (:func:`route_select`) takes the router logits and does the sigmoid (computed as
``torch.sigmoid``'s CUDA kernel computes it, so selection is bit-identical to the twin's), bias,
group-limited top-k, normalisation and scaling in one kernel.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from breakgraph import env
from breakgraph.kernels.dispatch import interpreting
from breakgraph.kernels.fp8 import FP8_DTYPE
from breakgraph.kernels.pdl import pdl_launch, pdl_wait
from breakgraph.kernels.triton_fp8 import act_quant, scaled_update

if TYPE_CHECKING:
    from breakgraph.kernels.moe import SharedExpert

def moe_fp8_activations() -> bool:
    """Whether FP8 experts quantise activations to e4m3 (W8A8) rather than multiply bf16
    activations by fp8 weight tiles dequantised in registers (W8A16): ``BREAKGRAPH_MOE_W8A8``,
    ``1`` (default) or ``0``. ``scripts/bench_kernels_moe.py --only compare`` on the H200: W8A8
    with its two quantisation launches beats the best W8A16 at every size timed (1 to 4096
    tokens), 1.2x at 1 token (50.8 vs 60.4 us a layer), 1.26x at 16, 2.2x at 1024; W8A16 stays
    closer to the bf16-activation twin (1.7e-3 relative against 3.7e-2)."""
    return env.read("BREAKGRAPH_MOE_W8A8") == "1"


def _next_pow2(n: int) -> int:
    return 1 << max(0, (int(n) - 1).bit_length())


# --------------------------------------------------------------------------------------------
# routing


@triton.jit
def _route_kernel(
    scores_ptr, bias_ptr, w_out_ptr, id_out_ptr,
    T, E, stride_s, scaling,
    TOP_K: tl.constexpr, K_P2: tl.constexpr, N_GROUP: tl.constexpr, G_P2: tl.constexpr, TOPK_GROUP: tl.constexpr,
    HAS_BIAS: tl.constexpr, NORM: tl.constexpr, BLOCK_T: tl.constexpr, E_P2: tl.constexpr,
    LOGITS: tl.constexpr = False, INTERP: tl.constexpr = False, PDL: tl.constexpr = False,
):  # fmt: skip
    """Rows ``BLOCK_T·pid…`` of :func:`route_select`; ``LOGITS``: the loaded values are router
    logits and their sigmoid is taken here, as torch's CUDA kernel computes it (``1 / (1 +
    expf(-x))``: libdevice's ``expf``, an IEEE division; the interpreter, which has no
    libdevice, takes ``tl.exp``)."""
    pid = tl.program_id(0)
    rows = pid * BLOCK_T + tl.arange(0, BLOCK_T)
    cols = tl.arange(0, E_P2)
    row_ok = rows < T
    col_ok = cols < E
    ninf = float("-inf")
    pdl_wait(PDL)
    scores = tl.load(
        scores_ptr + rows[:, None].to(tl.int64) * stride_s + cols[None, :],
        mask=row_ok[:, None] & col_ok[None, :],
        other=0.0,
    )
    if LOGITS:
        if INTERP:
            e = tl.exp(-scores)
        else:
            e = libdevice.exp(-scores)
        scores = tl.math.div_rn(tl.full(scores.shape, 1.0, tl.float32), 1.0 + e)
    choice = scores
    if HAS_BIAS:
        choice = choice + tl.load(bias_ptr + cols, mask=col_ok, other=0.0)[None, :]
    choice = tl.where(col_ok[None, :], choice, ninf)
    if TOPK_GROUP < N_GROUP:
        group_size = E // N_GROUP
        grp = cols // group_size
        gcols = tl.arange(0, G_P2)
        gscore = tl.full((BLOCK_T, G_P2), ninf, tl.float32)
        for g in tl.static_range(N_GROUP):
            in_g = (grp == g)[None, :] & col_ok[None, :]
            v = tl.where(in_g, choice, ninf)
            v1 = tl.max(v, axis=1)
            i1 = tl.min(tl.where(v == v1[:, None], cols[None, :], E_P2), axis=1)
            v2 = tl.max(tl.where(cols[None, :] == i1[:, None], ninf, v), axis=1)
            gscore = tl.where(gcols[None, :] == g, (v1 + v2)[:, None], gscore)
        kept = tl.zeros((BLOCK_T, E_P2), dtype=tl.int1)
        for _ in tl.static_range(TOPK_GROUP):
            gv = tl.max(gscore, axis=1)
            gi = tl.min(tl.where(gscore == gv[:, None], gcols[None, :], G_P2), axis=1)
            gscore = tl.where(gcols[None, :] == gi[:, None], ninf, gscore)
            kept = kept | (grp[None, :] == gi[:, None])
        choice = tl.where(kept, choice, ninf)
    kcols = tl.arange(0, K_P2)
    ids = tl.zeros((BLOCK_T, K_P2), dtype=tl.int32)
    wts = tl.zeros((BLOCK_T, K_P2), dtype=tl.float32)
    for j in tl.static_range(TOP_K):
        v = tl.max(choice, axis=1)
        i = tl.min(tl.where(choice == v[:, None], cols[None, :], E_P2), axis=1)
        i = tl.minimum(i, E - 1)  # NaN rows: any valid expert
        hit = cols[None, :] == i[:, None]
        wj = tl.sum(tl.where(hit, scores, 0.0), axis=1)
        choice = tl.where(hit, ninf, choice)
        ids = tl.where(kcols[None, :] == j, i[:, None], ids)
        wts = tl.where(kcols[None, :] == j, wj[:, None], wts)
    if NORM:
        wts = wts / (tl.sum(wts, axis=1)[:, None] + 1e-20)
    wts = wts * scaling
    out_off = rows[:, None] * TOP_K + kcols[None, :]
    out_ok = row_ok[:, None] & (kcols[None, :] < TOP_K)
    tl.store(w_out_ptr + out_off, wts, mask=out_ok)
    tl.store(id_out_ptr + out_off, ids.to(tl.int64), mask=out_ok)


#: Up to this many rows :func:`route_select` runs one single-warp program per row.
ROUTE_ONE_WARP_ROWS = 64


def route_select(
    scores: torch.Tensor,
    correction_bias: torch.Tensor | None,
    top_k: int,
    n_group: int,
    topk_group: int,
    norm_topk_prob: bool,
    routed_scaling_factor: float,
    logits: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sigmoid ``scores [T, E]`` fp32 → ``(topk_weights [T, k] fp32, topk_ids [T, k] int64)``;
    ``logits``: ``scores`` holds the router logits and the kernel takes their sigmoid (the same
    bits as ``torch.sigmoid`` on CUDA: one launch fewer).

    Same contract as :func:`breakgraph.kernels.moe.route_ref` after its sigmoid: the bias is
    added for selection only; with ``topk_group < n_group`` only experts of the best
    ``topk_group`` groups (by the sum of each group's two best biased scores) compete. Ids come
    out in descending biased score; ties go to the lower index.
    """
    t, e = scores.shape
    if scores.dtype != torch.float32 or scores.stride(-1) != 1:
        raise ValueError(
            f"route_select: scores must be fp32 with unit column stride, got {scores.dtype} {scores.stride()}"
        )
    if e % n_group or not 0 < topk_group <= n_group or not 0 < top_k <= e:
        raise ValueError(
            f"route_select: E={e}, n_group={n_group}, topk_group={topk_group}, top_k={top_k} are inconsistent"
        )
    weights = torch.empty(t, top_k, dtype=torch.float32, device=scores.device)
    ids = torch.empty(t, top_k, dtype=torch.int64, device=scores.device)
    if t == 0:
        return weights, ids
    e_p2 = _next_pow2(e)
    # few rows (decode): one warp per row, so the top-k loop's reductions stay inside the warp
    # (sm_90a at 256 experts: 1 barrier instead of 77 and 1224 instructions instead of 2864)
    block_t, warps = (1, 1) if t <= ROUTE_ONE_WARP_ROWS else (max(1, min(16, 2048 // e_p2)), 4)
    bias = correction_bias.float().contiguous() if correction_bias is not None else scores
    _route_kernel[(triton.cdiv(t, block_t),)](
        scores, bias, weights, ids, t, e, scores.stride(0), float(routed_scaling_factor),
        TOP_K=top_k, K_P2=_next_pow2(top_k), N_GROUP=n_group, G_P2=_next_pow2(n_group), TOPK_GROUP=topk_group,
        HAS_BIAS=correction_bias is not None, NORM=bool(norm_topk_prob), BLOCK_T=block_t, E_P2=e_p2,
        LOGITS=bool(logits), INTERP=interpreting(), num_warps=warps, **pdl_launch(scores.device),
    )  # fmt: skip
    return weights, ids


# --------------------------------------------------------------------------------------------
# permutation


@dataclass
class MoeLayout:
    """Expert-sorted placement of the ``P = T·k`` token-expert pairs (all on the device).

    ``sorted_pairs [max_blocks·block_m]`` int32: pair ids grouped by expert, each expert's
    segment padded to a multiple of ``block_m`` with the sentinel ``P``; ``sorted_tokens``: the
    same with token ids (``pair // k``, sentinel ``T``); ``pair_pos [P]``: where each pair landed;
    ``block_expert [max_blocks]``: expert of each row block in use (the rest unwritten); ``num_blocks [1]``: blocks in use;
    ``expert_ends [E]``: inclusive cumulative padded row counts (the ``offs`` of
    ``torch._grouped_mm`` when ``block_m == 1``).
    """

    sorted_pairs: torch.Tensor
    sorted_tokens: torch.Tensor
    pair_pos: torch.Tensor
    block_expert: torch.Tensor
    num_blocks: torch.Tensor
    expert_ends: torch.Tensor
    block_m: int
    max_blocks: int
    num_pairs: int


@triton.jit
def _pair_expert(ids_ptr, offs, ok, E, TOP_K: tl.constexpr, SLOTS: tl.constexpr):
    """Expert of pairs ``offs`` (pair ``p = t·SLOTS + j``): ``ids[t, j]`` for the ``TOP_K``
    routed slots; the shared slot ``j = TOP_K`` (when ``SLOTS > TOP_K``) is expert ``E - 1``.
    Clamped to ``[0, E)``."""
    if SLOTS > TOP_K:
        tok = offs // SLOTS
        j = offs - tok * SLOTS
        e = tl.load(ids_ptr + tok * TOP_K + j, mask=ok & (j < TOP_K), other=E - 1).to(tl.int32)
    else:
        e = tl.load(ids_ptr + offs, mask=ok, other=0).to(tl.int32)
    return tl.minimum(tl.maximum(e, 0), E - 1)


@triton.jit
def _fill_padding(sorted_ptr, tok_ptr, offs, N_SORTED, P, T):
    """Sentinels in entries ``offs`` of the sorted lists: pair ``P``, token ``T``."""
    fill = offs < N_SORTED
    tl.store(sorted_ptr + offs, tl.zeros(offs.shape, tl.int32) + P, mask=fill)
    tl.store(tok_ptr + offs, tl.zeros(offs.shape, tl.int32) + T, mask=fill)


@triton.jit
def _count_pairs(ids_ptr, counts_ptr, offs, P, E, TOP_K: tl.constexpr, SLOTS: tl.constexpr):
    ok = offs < P
    e = _pair_expert(ids_ptr, offs, ok, E, TOP_K, SLOTS)
    tl.atomic_add(counts_ptr + e, 1, mask=ok, sem="relaxed")


@triton.jit
def _segments(counts, BLOCK_M: tl.constexpr):
    """Each expert's segment: its row count padded to ``BLOCK_M``, its end and its start."""
    padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    ends = tl.cumsum(padded, axis=0)
    return padded, ends, ends - padded


@triton.jit
def _place_pairs(
    ids_ptr, cursor_ptr, sorted_ptr, tok_ptr, pos_ptr, starts, offs, P, E,
    TOP_K: tl.constexpr, SLOTS: tl.constexpr,
):  # fmt: skip
    """Pairs ``offs`` into their experts' segments (``starts`` + an atomic cursor per expert)."""
    ok = offs < P
    e = _pair_expert(ids_ptr, offs, ok, E, TOP_K, SLOTS)
    pos = tl.gather(starts, e, axis=0) + tl.atomic_add(cursor_ptr + e, 1, mask=ok, sem="relaxed")
    tl.store(sorted_ptr + pos, offs, mask=ok)
    tl.store(tok_ptr + pos, offs // SLOTS, mask=ok)
    tl.store(pos_ptr + offs, pos, mask=ok)


@triton.jit
def _write_totals(
    ends_ptr, num_blocks_ptr, block_expert_ptr, padded, ends, ev, E,
    BLOCK_M: tl.constexpr, WRITE_BLOCKS: tl.constexpr,
):  # fmt: skip
    """The layout's expert ends, used block count and (``WRITE_BLOCKS``) expert of every block in use."""
    tl.store(ends_ptr + ev, ends, mask=ev < E)
    tl.store(num_blocks_ptr, tl.sum(padded, axis=0) // BLOCK_M)
    if WRITE_BLOCKS:
        _write_block_experts(block_expert_ptr, padded, ends, ev, E, BLOCK_M=BLOCK_M)


@triton.jit
def _align_count_kernel(
    ids_ptr, counts_ptr, sorted_ptr, tok_ptr, P, N_SORTED, E, T,
    TOP_K: tl.constexpr, SLOTS: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    _count_pairs(ids_ptr, counts_ptr, offs, P, E, TOP_K, SLOTS)
    _fill_padding(sorted_ptr, tok_ptr, offs, N_SORTED, P, T)


@triton.jit
def _align_scatter_kernel(
    ids_ptr, counts_ptr, cursor_ptr, sorted_ptr, tok_ptr, pos_ptr, block_expert_ptr, num_blocks_ptr, ends_ptr,
    P, E,
    TOP_K: tl.constexpr, SLOTS: tl.constexpr, BLOCK: tl.constexpr, E_P2: tl.constexpr, BLOCK_M: tl.constexpr,
    WRITE_BLOCKS: tl.constexpr,
):  # fmt: skip
    pid = tl.program_id(0)
    ev = tl.arange(0, E_P2)
    padded, ends, starts = _segments(tl.load(counts_ptr + ev, mask=ev < E, other=0), BLOCK_M)
    offs = pid * BLOCK + tl.arange(0, BLOCK)
    _place_pairs(ids_ptr, cursor_ptr, sorted_ptr, tok_ptr, pos_ptr, starts, offs, P, E, TOP_K, SLOTS)
    if pid == 0:
        _write_totals(ends_ptr, num_blocks_ptr, block_expert_ptr, padded, ends, ev, E, BLOCK_M, WRITE_BLOCKS)


@triton.jit
def _align_one_program_kernel(
    ids_ptr, counts_ptr, cursor_ptr, sorted_ptr, tok_ptr, pos_ptr, block_expert_ptr, num_blocks_ptr, ends_ptr,
    P, N_SORTED, E, T,
    TOP_K: tl.constexpr, SLOTS: tl.constexpr, BLOCK: tl.constexpr, E_P2: tl.constexpr, BLOCK_M: tl.constexpr,
    WRITE_BLOCKS: tl.constexpr,
):  # fmt: skip
    """:func:`_align_count_kernel` and :func:`_align_scatter_kernel` in one program, counters
    zeroed here too: one launch instead of three for a few pairs. Barriers order the phases
    (the counts are read past L1, where other threads' atomics landed)."""
    ev = tl.arange(0, E_P2)
    zero = tl.zeros([E_P2], tl.int32)
    tl.store(counts_ptr + ev, zero, mask=ev < E)
    tl.store(cursor_ptr + ev, zero, mask=ev < E)
    for f0 in range(0, N_SORTED, BLOCK):
        _fill_padding(sorted_ptr, tok_ptr, f0 + tl.arange(0, BLOCK), N_SORTED, P, T)
    tl.debug_barrier()  # counters zeroed, padding written, before any count or placement
    for p0 in range(0, P, BLOCK):
        _count_pairs(ids_ptr, counts_ptr, p0 + tl.arange(0, BLOCK), P, E, TOP_K, SLOTS)
    tl.debug_barrier()  # every pair counted
    counts = tl.load(counts_ptr + ev, mask=ev < E, other=0, cache_modifier=".cg")
    padded, ends, starts = _segments(counts, BLOCK_M)
    for p0 in range(0, P, BLOCK):
        offs = p0 + tl.arange(0, BLOCK)
        _place_pairs(ids_ptr, cursor_ptr, sorted_ptr, tok_ptr, pos_ptr, starts, offs, P, E, TOP_K, SLOTS)
    _write_totals(ends_ptr, num_blocks_ptr, block_expert_ptr, padded, ends, ev, E, BLOCK_M, WRITE_BLOCKS)


@triton.jit
def _write_block_experts(block_expert_ptr, padded, ends, ev, E, BLOCK_M: tl.constexpr):
    """Expert ``e`` into the row blocks of its segment, ``(ends[e] − padded[e]) / BLOCK_M`` on:
    one masked store of every expert per step, as many steps as the longest segment has blocks
    (no reduction over blocks × experts). Blocks past those in use are not written: the GEMMs
    stop at ``num_blocks``."""
    blocks = tl.where(ev < E, padded // BLOCK_M, 0)
    first = ends // BLOCK_M - blocks
    for j in range(0, tl.max(blocks, axis=0)):
        tl.store(block_expert_ptr + first + j, ev, mask=j < blocks)


def max_row_blocks(num_pairs: int, num_experts: int, block_m: int) -> int:
    """Upper bound on the row blocks of any routing: ``Σ_e ceil(c_e / block_m)``."""
    return triton.cdiv(num_pairs, block_m) + min(num_experts, num_pairs)


#: Up to this many pairs :func:`moe_align` runs in one program (one launch instead of a memset and
#: two kernels): decode batches and short prompts (1152 pairs at 128 tokens of GLM-5 with the
#: shared slot).
ALIGN_ONE_PROGRAM_PAIRS = 2048


def moe_align(topk_ids: torch.Tensor, num_experts: int, block_m: int, shared_slot: bool = False) -> MoeLayout:
    """Sort the pairs of ``topk_ids [T, k]`` by expert on the device (see :class:`MoeLayout`).
    ``shared_slot``: every token gets one more pair, slot ``k`` (pair ``t·(k+1) + k``), routed to
    the extra expert ``num_experts`` — the shared expert, run by the same grouped GEMMs; the
    layout then counts ``T·(k+1)`` pairs over ``num_experts + 1`` experts."""
    t, k = topk_ids.shape
    slots = k + int(shared_slot)
    num_experts += int(shared_slot)
    p = t * slots
    dev = topk_ids.device
    ids = topk_ids.reshape(-1)
    if not ids.is_contiguous():
        ids = ids.contiguous()
    max_blocks = max_row_blocks(p, num_experts, block_m) if block_m > 1 else max(p, 1)
    n_sorted = max_blocks * block_m if block_m > 1 else p
    sorted_pairs = torch.empty(max(n_sorted, 1), dtype=torch.int32, device=dev)
    sorted_tokens = torch.empty_like(sorted_pairs)
    pair_pos = torch.empty(max(p, 1), dtype=torch.int32, device=dev)
    block_expert = torch.empty(max_blocks, dtype=torch.int32, device=dev)
    num_blocks = torch.empty(1, dtype=torch.int32, device=dev)
    expert_ends = torch.empty(num_experts, dtype=torch.int32, device=dev)
    block = 256
    if p <= ALIGN_ONE_PROGRAM_PAIRS:
        counters = torch.empty(2 * num_experts, dtype=torch.int32, device=dev)
        _align_one_program_kernel[(1,)](
            ids, counters, counters[num_experts:], sorted_pairs, sorted_tokens, pair_pos, block_expert, num_blocks,
            expert_ends, p, n_sorted, num_experts, t,
            TOP_K=k, SLOTS=slots, BLOCK=block, E_P2=_next_pow2(num_experts), BLOCK_M=block_m,
            WRITE_BLOCKS=block_m > 1, num_warps=4,
        )  # fmt: skip
        return MoeLayout(
            sorted_pairs, sorted_tokens, pair_pos, block_expert, num_blocks, expert_ends, block_m, max_blocks, p
        )
    counters = torch.zeros(2 * num_experts, dtype=torch.int32, device=dev)
    _align_count_kernel[(triton.cdiv(max(p, n_sorted, 1), block),)](
        ids, counters, sorted_pairs, sorted_tokens, p, n_sorted, num_experts, t,
        TOP_K=k, SLOTS=slots, BLOCK=block, num_warps=4,
    )  # fmt: skip
    _align_scatter_kernel[(max(1, triton.cdiv(p, block)),)](
        ids, counters, counters[num_experts:], sorted_pairs, sorted_tokens, pair_pos, block_expert, num_blocks,
        expert_ends, p, num_experts,
        TOP_K=k, SLOTS=slots, BLOCK=block, E_P2=_next_pow2(num_experts), BLOCK_M=block_m,
        WRITE_BLOCKS=block_m > 1, num_warps=4,
    )  # fmt: skip
    return MoeLayout(
        sorted_pairs, sorted_tokens, pair_pos, block_expert, num_blocks, expert_ends, block_m, max_blocks, p
    )


# --------------------------------------------------------------------------------------------
# grouped GEMM

@triton.jit
def _block_rows(pid_m, block_expert_ptr, sorted_ptr, P, TOP_K, GATHER: tl.constexpr, BLOCK_M: tl.constexpr):
    """Row block ``pid_m`` of the expert-sorted layout: its expert (int64), its pairs, which of
    them are real (``pair < P``; the rest pad the block) and the row of ``a`` each reads (the
    token ``pair // TOP_K`` when ``GATHER``, else the pair; row 0 for padding)."""
    expert = tl.load(block_expert_ptr + pid_m).to(tl.int64)
    pair = tl.load(sorted_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
    row_ok = pair < P
    if GATHER:
        a_row = pair // TOP_K
    else:
        a_row = pair
    return expert, pair, row_ok, tl.where(row_ok, a_row, 0)


@triton.jit
def _expert_bases(
    expert, w_ptr, ws_ptr, shw_ptr, shs_ptr, stride_we, stride_wse, SHARED_E, HAS_SHARED: tl.constexpr
):  # fmt: skip
    """Weight and scale base pointers of ``expert``: its slice of the stacked routed experts or,
    with ``HAS_SHARED``, the shared expert's own tensors for expert ``SHARED_E`` (one past the
    routed ones: the row blocks of :func:`moe_align`'s shared slot)."""
    w_base = w_ptr + expert * stride_we
    s_base = ws_ptr + expert * stride_wse
    if HAS_SHARED:
        if expert == SHARED_E:
            w_base = shw_ptr
            s_base = shs_ptr
    return w_base, s_base


@triton.jit
def _moe_gemm_kernel(
    a_ptr, as_ptr, w_ptr, ws_ptr, shw_ptr, shs_ptr, c_ptr,
    sorted_ptr, block_expert_ptr, num_blocks_ptr,
    P, N, K, TOP_K, UP_OFF, SHARED_E,
    stride_am, stride_asm, stride_asg,
    stride_we, stride_wn, stride_wse, stride_wsn, stride_wsk,
    stride_cm,
    GATHER: tl.constexpr, SILU: tl.constexpr, W_FP8: tl.constexpr, A_FP8: tl.constexpr, SWAP_AB: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    SCALE_BN: tl.constexpr, SCALE_BK: tl.constexpr, INTERP: tl.constexpr, HAS_SHARED: tl.constexpr = False,
):  # fmt: skip
    """Grouped GEMM over the layout's row blocks (see :func:`moe_gemm`)."""
    pid = tl.program_id(0)
    num_n = tl.cdiv(N, BLOCK_N)
    pid_m = pid // num_n
    pid_n = pid % num_n
    if pid_m < tl.load(num_blocks_ptr):
        expert, pair, row_ok, a_row = _block_rows(pid_m, block_expert_ptr, sorted_ptr, P, TOP_K, GATHER, BLOCK_M)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        n_ok = offs_n < N
        offs_k = tl.arange(0, BLOCK_K)
        a_ptrs = a_ptr + a_row[:, None].to(tl.int64) * stride_am + offs_k[None, :]
        w_base, s_base = _expert_bases(
            expert, w_ptr, ws_ptr, shw_ptr, shs_ptr, stride_we, stride_wse, SHARED_E, HAS_SHARED
        )  # fmt: skip
        wg_ptrs = w_base + offs_n[:, None].to(tl.int64) * stride_wn + offs_k[None, :]
        wu_ptrs = wg_ptrs + UP_OFF * stride_wn
        sg_ptr = s_base + ((pid_n * BLOCK_N) // SCALE_BN) * stride_wsn
        su_ptr = s_base + ((UP_OFF + pid_n * BLOCK_N) // SCALE_BN) * stride_wsn
        if SWAP_AB:
            acc_g = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
        else:
            acc_g = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        acc_u = tl.zeros_like(acc_g)
        for k0 in range(0, K, BLOCK_K):
            k_ok = offs_k < K - k0
            a = tl.load(a_ptrs, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
            wg = tl.load(wg_ptrs, mask=n_ok[:, None] & k_ok[None, :], other=0.0)
            # per-iteration scales (constexpr branches: nothing is carried across iterations)
            kb = k0 // SCALE_BK
            if W_FP8:
                sw_g = tl.load(sg_ptr + kb * stride_wsk)
                sw_u = tl.load(su_ptr + kb * stride_wsk)
            else:
                sw_g = 1.0
                sw_u = 1.0
            if A_FP8:
                sa = tl.load(as_ptr + a_row * stride_asm + kb * stride_asg, mask=row_ok, other=0.0)
            else:
                sa = 1.0
            acc_g = scaled_update(acc_g, a, wg, sw_g, sa, W_FP8, A_FP8, SWAP_AB, INTERP)
            if SILU:
                wu = tl.load(wu_ptrs, mask=n_ok[:, None] & k_ok[None, :], other=0.0)
                acc_u = scaled_update(acc_u, a, wu, sw_u, sa, W_FP8, A_FP8, SWAP_AB, INTERP)
            a_ptrs += BLOCK_K
            wg_ptrs += BLOCK_K
            wu_ptrs += BLOCK_K
        if SILU:
            out = acc_g / (1.0 + tl.exp(-acc_g)) * acc_u
        else:
            out = acc_g
        out = out.to(c_ptr.dtype.element_ty)
        if SWAP_AB:
            c_ptrs = c_ptr + pair[None, :].to(tl.int64) * stride_cm + offs_n[:, None]
            tl.store(c_ptrs, out, mask=row_ok[None, :] & n_ok[:, None])
        else:
            c_ptrs = c_ptr + pair[:, None].to(tl.int64) * stride_cm + offs_n[None, :]
            tl.store(c_ptrs, out, mask=row_ok[:, None] & n_ok[None, :])


@triton.jit
def _stream_store(acc_g, acc_u, c_ptr, pair, row_ok, n0, N, stride_cm, SILU: tl.constexpr, BLOCK_N: tl.constexpr):
    """Epilogue of one ``[BLOCK_N, BLOCK_M]`` tile of :func:`_moe_stream_kernel` (columns are pairs)."""
    offs_n = n0 + tl.arange(0, BLOCK_N)
    if SILU:
        out = acc_g / (1.0 + tl.exp(-acc_g)) * acc_u
    else:
        out = acc_g
    c_ptrs = c_ptr + pair[None, :].to(tl.int64) * stride_cm + offs_n[:, None]
    tl.store(c_ptrs, out.to(c_ptr.dtype.element_ty), mask=row_ok[None, :] & (offs_n < N)[:, None])


@triton.jit
def _moe_stream_kernel(
    a_ptr, as_ptr, w_ptr, ws_ptr, shw_ptr, shs_ptr, c_ptr,
    sorted_ptr, block_expert_ptr, num_blocks_ptr,
    P, N, K, TOP_K, UP_OFF, SHARED_E,
    stride_am, stride_asm, stride_asg,
    stride_we, stride_wn, stride_wse, stride_wsn, stride_wsk,
    stride_cm,
    GATHER: tl.constexpr, SILU: tl.constexpr, W_FP8: tl.constexpr, A_FP8: tl.constexpr, EVEN: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, TILES_N: tl.constexpr,
    SCALE_BN: tl.constexpr, SCALE_BK: tl.constexpr, INTERP: tl.constexpr, HAS_SHARED: tl.constexpr = False,
):  # fmt: skip
    """Few rows per expert: the weight stream of :func:`_moe_gemm_kernel` with the swapped
    product only. Program ``(b, c)`` takes row block ``b`` and ``TILES_N`` consecutive
    ``BLOCK_N`` tiles of output columns from ``c·TILES_N·BLOCK_N``, walked as one flat loop over
    (tile, k-block) so that the software pipeline runs on across tiles (GEMM 2's K is only a
    few k-blocks, and a program per tile would spend its time starting up). The output is
    stored after a tile's last k-block. ``EVEN``: ``K`` a multiple of ``BLOCK_K`` and ``N`` of
    ``TILES_N·BLOCK_N``, so that loads need no masks (rows past the pairs read row 0 of ``a``,
    their outputs are not stored). Numerics are those of :func:`_moe_gemm_kernel`."""
    pid = tl.program_id(0)
    num_c = tl.cdiv(N, BLOCK_N * TILES_N)
    pid_m = pid // num_c
    pid_c = pid % num_c
    if pid_m < tl.load(num_blocks_ptr):
        expert, pair, row_ok, a_row = _block_rows(pid_m, block_expert_ptr, sorted_ptr, P, TOP_K, GATHER, BLOCK_M)
        offs_k = tl.arange(0, BLOCK_K)
        a_ptrs = a_ptr + a_row[:, None].to(tl.int64) * stride_am + offs_k[None, :]
        w_base, s_base = _expert_bases(
            expert, w_ptr, ws_ptr, shw_ptr, shs_ptr, stride_we, stride_wse, SHARED_E, HAS_SHARED
        )  # fmt: skip
        n_first = pid_c * (TILES_N * BLOCK_N)
        k_steps = tl.cdiv(K, BLOCK_K)
        # tile-relative offsets once; per step only a scalar moves (and, EVEN, no masks at all)
        w_offs = tl.arange(0, BLOCK_N)[:, None] * stride_wn + offs_k[None, :]
        acc_g = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
        acc_u = tl.zeros_like(acc_g)
        for it in range(0, TILES_N * k_steps):
            tile = it // k_steps
            k0 = (it - tile * k_steps) * BLOCK_K
            n0 = n_first + tile * BLOCK_N
            offs_n = n0 + tl.arange(0, BLOCK_N)
            n_ok = offs_n < N
            k_ok = offs_k < K - k0
            wg_ptrs = w_base + (n0.to(tl.int64) * stride_wn + k0) + w_offs
            if EVEN:
                a = tl.load(a_ptrs + k0)
                wg = tl.load(wg_ptrs)
            else:
                a = tl.load(a_ptrs + k0, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
                wg = tl.load(wg_ptrs, mask=n_ok[:, None] & k_ok[None, :], other=0.0)
            kb = k0 // SCALE_BK
            if W_FP8:
                sw_g = tl.load(s_base + (n0 // SCALE_BN) * stride_wsn + kb * stride_wsk)
                sw_u = tl.load(s_base + ((UP_OFF + n0) // SCALE_BN) * stride_wsn + kb * stride_wsk)
            else:
                sw_g = 1.0
                sw_u = 1.0
            if A_FP8:
                sa = tl.load(as_ptr + a_row * stride_asm + kb * stride_asg, mask=row_ok, other=0.0)
            else:
                sa = tl.full((BLOCK_M,), 1.0, tl.float32)
            acc_g = scaled_update(acc_g, a, wg, sw_g, sa, W_FP8, A_FP8, True, INTERP)
            if SILU:
                if EVEN:
                    wu = tl.load(wg_ptrs + UP_OFF * stride_wn)
                else:
                    wu = tl.load(wg_ptrs + UP_OFF * stride_wn, mask=n_ok[:, None] & k_ok[None, :], other=0.0)
                acc_u = scaled_update(acc_u, a, wu, sw_u, sa, W_FP8, A_FP8, True, INTERP)
            if TILES_N > 1:
                if k0 + BLOCK_K >= K:
                    _stream_store(acc_g, acc_u, c_ptr, pair, row_ok, n0, N, stride_cm, SILU, BLOCK_N)
                    acc_g = tl.zeros_like(acc_g)
                    acc_u = tl.zeros_like(acc_u)
        if TILES_N == 1:  # after the loop, where the pipeline's buffers are free again
            _stream_store(acc_g, acc_u, c_ptr, pair, row_ok, n_first, N, stride_cm, SILU, BLOCK_N)


#: W8A8 experts keep 64-row blocks up to this many rows per expert on average: at 256 (an 8192-token
#: prompt in one forward) GEMM 1 in 3 stages and GEMM 2 took 661.6 and 773.1 µs against 684.5 and
#: 906.2 in 128-row blocks (``scripts/bench_kernels_moe.py --only sweep --sweep-tokens 8192 4096
#: --sweep-kinds W8A8``, one H200); 257-384 rows extrapolated; W8A16 and more rows (16384-token
#: forwards and longer) keep 128-row blocks past 160, untimed.
LONG_PROMPT_ROWS = 384


def gemm_config(num_pairs: int, num_experts: int, silu: bool, fp8: bool, a_fp8: bool = False) -> dict:
    """Tile choice from static shapes only (graph-safe): rows per expert on average decide
    ``BLOCK_M``; narrow row blocks use the swapped product. FP8 tiles from the tile sweep
    (``scripts/bench_kernels_moe.py --sweep``, GLM-5 TP8 rank): 4 rows per expert (128 tokens)
    keep 16-row swapped blocks; 32 rows per expert (1024 tokens) run fastest in 64-row blocks;
    GEMM 2 (K = I, two k-blocks) in 3 stages; up to ``LONG_PROMPT_ROWS`` rows per expert W8A8 keeps
    64-row blocks (GEMM 1 in 3 stages past 160). W8A16's GEMM 2 (``a_fp8`` false) with 16-row
    blocks takes the stream kernel, four 128-column tiles per program (decode batches 8…64:
    8–17% faster than the grouped kernel, ``scripts/gpu_check_moe2.sh`` on the H200); its
    GEMM 1 and W8A8 ran as fast or faster on the grouped kernel."""
    avg = num_pairs / max(1, num_experts)
    if fp8 and not a_fp8 and not silu and avg <= 16:
        return {"KERNEL": "stream", "BLOCK_M": 16, "BLOCK_N": 128, "TILES_N": 4, "BLOCK_K": 128,
                "num_warps": 4, "num_stages": 4}  # fmt: skip
    if avg <= 16:
        cfg = {"BLOCK_M": 16, "SWAP_AB": True, "num_warps": 4}
    elif avg <= 48 and not fp8:
        cfg = {"BLOCK_M": 32, "SWAP_AB": True, "num_warps": 4}
    elif avg <= (LONG_PROMPT_ROWS if fp8 and a_fp8 else 160):
        cfg = {"BLOCK_M": 64, "SWAP_AB": False, "num_warps": 4}
    else:
        cfg = {"BLOCK_M": 128, "SWAP_AB": False, "num_warps": 8}
    cfg["BLOCK_N"] = 64 if silu else 128
    cfg["BLOCK_K"] = 128
    cfg["num_stages"] = 4 if fp8 and silu and cfg["BLOCK_M"] <= 64 and avg <= 160 else 3
    return cfg


def moe_gemm(
    a: torch.Tensor,
    a_scale: torch.Tensor | None,
    weight: torch.Tensor,
    weight_scale: torch.Tensor | None,
    layout: MoeLayout,
    out: torch.Tensor,
    *,
    gather_top_k: int | None,
    silu: bool,
    block: tuple[int, int] = (128, 128),
    config: dict | None = None,
    shared: tuple[torch.Tensor, torch.Tensor | None] | None = None,
) -> torch.Tensor:
    """Grouped GEMM over ``layout``'s row blocks, writing rows of ``out`` by pair id.

    ``a``: ``x [T, K]`` (``gather_top_k=k``: row of pair ``p`` is ``p // k``) or ``h [P, K]``
    (``gather_top_k=None``); e4m3 with ``a_scale [rows, ceil(K/128)]`` or 16/32-bit with
    ``a_scale=None``. ``weight [E, N_w, K]`` (bf16, or e4m3 with ``weight_scale [E, ceil(N_w/bn),
    ceil(K/bk)]``). ``silu``: ``N_w = 2N``, output ``silu(a·W[:N]ᵀ) ⊙ (a·W[N:]ᵀ)``; else ``N = N_w``.
    ``out [P, N]``. Rows of pairs are written exactly once; nothing else is touched.
    ``config`` overrides :func:`gemm_config`'s tiles; ``KERNEL="stream"`` takes
    :func:`_moe_stream_kernel` (swapped product only; ``TILES_N`` column tiles per program).
    ``shared``: ``(weight [N_w, K], scale)`` of the shared expert, laid out like one routed
    expert (same dtype, shape and strides), which the row blocks of expert ``E`` read (a
    layout aligned with ``shared_slot``).
    """
    num_e, n_w, k = weight.shape
    if shared is not None:
        sw, ss = shared
        scales_like = weight_scale is None or (ss is not None and _like_one_of(ss, weight_scale))
        if not (_like_one_of(sw, weight) and scales_like):
            raise ValueError("moe_gemm: the shared expert must be laid out like one routed expert")
    n = n_w // 2 if silu else n_w
    w_fp8 = weight.dtype == FP8_DTYPE
    a_fp8 = a.dtype == FP8_DTYPE
    if w_fp8 != (weight_scale is not None) or a_fp8 != (a_scale is not None) or (a_fp8 and not w_fp8):
        raise ValueError("moe_gemm: scales must accompany fp8 tensors, and fp8 activations need fp8 weights")
    if a.shape[1] != k or a.stride(1) != 1 or weight.stride(2) != 1 or out.stride(1) != 1:
        raise ValueError(
            f"moe_gemm: a {tuple(a.shape)}, weight {tuple(weight.shape)} and out must be K/N-contiguous"
        )
    cfg = gemm_config(layout.num_pairs, num_e + (shared is not None), silu, w_fp8, a_fp8)
    cfg.update(config or {})
    if cfg["BLOCK_M"] != layout.block_m:
        raise ValueError(
            f"moe_gemm: layout was aligned to block_m={layout.block_m}, config has {cfg['BLOCK_M']}"
        )
    if w_fp8:
        bn, bk = block
        if bn % cfg["BLOCK_N"] or bk % cfg["BLOCK_K"] or (silu and n % bn):
            raise ValueError(
                f"moe_gemm: FP8 block {tuple(block)} needs BLOCK_N | {bn}, BLOCK_K | {bk}, and I % {bn} == 0"
            )
    else:
        bn, bk = 1, 1
    if layout.num_pairs == 0 or n == 0:
        return out
    ws = weight_scale if w_fp8 else weight
    sa = a_scale if a_fp8 else a
    kernel = _moe_gemm_kernel
    if cfg.pop("KERNEL", "grouped") == "stream":
        cfg.pop("SWAP_AB", None)  # the stream kernel always computes the swapped product
        kernel = _moe_stream_kernel
        cols = cfg.setdefault("TILES_N", 1) * cfg["BLOCK_N"]
        cfg["EVEN"] = k % cfg["BLOCK_K"] == 0 and n % cols == 0
    else:
        cols = cfg["BLOCK_N"]
    shw, shs = (shared[0], shared[1] if w_fp8 else shared[0]) if shared is not None else (weight, ws)
    grid = (layout.max_blocks * triton.cdiv(n, cols),)
    kernel[grid](
        a, sa, weight, ws, shw, shs, out, layout.sorted_pairs, layout.block_expert, layout.num_blocks,
        layout.num_pairs, n, k, gather_top_k or 1, n if silu else 0, num_e,
        a.stride(0), sa.stride(0), sa.stride(1) if sa.dim() > 1 else 0,
        weight.stride(0), weight.stride(1), ws.stride(0), ws.stride(1), ws.stride(2),
        out.stride(0),
        GATHER=gather_top_k is not None, SILU=silu, W_FP8=w_fp8, A_FP8=a_fp8,
        SCALE_BN=bn, SCALE_BK=bk, INTERP=interpreting(), HAS_SHARED=shared is not None, **cfg,
    )  # fmt: skip
    return out


# --------------------------------------------------------------------------------------------
# elementwise: SiLU-and-mul, weighted combine


@triton.jit
def _silu_mul_kernel(gu_ptr, h_ptr, R, I, stride_g, stride_h, BLOCK_R: tl.constexpr, BLOCK_I: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = tl.program_id(1) * BLOCK_I + tl.arange(0, BLOCK_I)
    ok = (rows[:, None] < R) & (cols[None, :] < I)
    base = gu_ptr + rows[:, None].to(tl.int64) * stride_g + cols[None, :]
    g = tl.load(base, mask=ok, other=0.0).to(tl.float32)
    u = tl.load(base + I, mask=ok, other=0.0).to(tl.float32)
    h = g / (1.0 + tl.exp(-g)) * u
    tl.store(
        h_ptr + rows[:, None].to(tl.int64) * stride_h + cols[None, :], h.to(h_ptr.dtype.element_ty), mask=ok
    )


def silu_mul(gate_up: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """``gate_up [R, 2I]`` → ``silu(gate_up[:, :I]) * gate_up[:, I:]`` (fp32 math)."""
    r, two_i = gate_up.shape
    i = two_i // 2
    if out is None:
        out = torch.empty(r, i, dtype=gate_up.dtype, device=gate_up.device)
    if r and i:
        grid = (triton.cdiv(r, 16), triton.cdiv(i, 128))
        _silu_mul_kernel[grid](gate_up, out, r, i, gate_up.stride(0), out.stride(0), BLOCK_R=16, BLOCK_I=128)
    return out


@triton.jit
def _combine_kernel(
    y_ptr, w_ptr, pos_ptr, res_ptr, out_ptr, D, stride_y, stride_r, stride_o,
    TOP_K: tl.constexpr, SLOTS: tl.constexpr, USE_POS: tl.constexpr, HAS_RES: tl.constexpr,
    BLOCK_D: tl.constexpr,
):  # fmt: skip
    t = tl.program_id(0)
    d = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    ok = d < D
    acc = tl.zeros((BLOCK_D,), dtype=tl.float32)
    for j in tl.static_range(SLOTS):
        p = t * SLOTS + j
        if USE_POS:
            row = tl.load(pos_ptr + p)
        else:
            row = p
        y = tl.load(y_ptr + row.to(tl.int64) * stride_y + d, mask=ok, other=0.0).to(tl.float32)
        if j < TOP_K:
            acc += tl.load(w_ptr + t * TOP_K + j) * y
        else:  # the shared expert's slot, weight 1
            acc += y
    if HAS_RES:
        acc += tl.load(res_ptr + t.to(tl.int64) * stride_r + d, mask=ok, other=0.0).to(tl.float32)
    tl.store(out_ptr + t.to(tl.int64) * stride_o + d, acc.to(out_ptr.dtype.element_ty), mask=ok)


def moe_combine(
    y: torch.Tensor,
    topk_weights: torch.Tensor,
    out: torch.Tensor,
    pair_pos: torch.Tensor | None = None,
    *,
    shared_slot: bool = False,
    residual: torch.Tensor | None = None,
) -> torch.Tensor:
    """``out[t] = Σ_j topk_weights[t, j] · y[row(t·s + j)]`` over the ``s = k`` slots of a token
    (fp32 accumulation, rounded once), where ``row(p) = pair_pos[p]`` when given (rows in
    expert order) else ``p``. ``shared_slot``: ``s = k + 1``, the last slot (the shared expert's)
    with weight 1. ``residual [T, D]``: added in the same fp32 sum."""
    t, k = topk_weights.shape
    d = out.shape[1]
    w = topk_weights.float().contiguous()
    if residual is not None and (residual.shape != out.shape or residual.stride(1) != 1):
        raise ValueError(f"moe_combine: residual must be [T, D] like out, got {tuple(residual.shape)}")
    if t and d:
        block_d = min(1024, _next_pow2(d))
        grid = (t, triton.cdiv(d, block_d))
        res = residual if residual is not None else out
        _combine_kernel[grid](
            y, w, pair_pos if pair_pos is not None else w, res, out, d, y.stride(0), res.stride(0), out.stride(0),
            TOP_K=k, SLOTS=k + int(shared_slot), USE_POS=pair_pos is not None, HAS_RES=residual is not None,
            BLOCK_D=block_d, num_warps=4,
        )  # fmt: skip
    return out


# --------------------------------------------------------------------------------------------
# the routed-expert layer


def grouped_mm_supported(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor) -> bool:
    """``torch._grouped_mm`` runs without a host sync only for bf16 on sm90/sm100 (CUTLASS);
    its TMA needs 16-byte aligned row strides."""
    if not (x.is_cuda and hasattr(torch, "_grouped_mm")):
        return False
    if x.dtype != torch.bfloat16 or w13.dtype != torch.bfloat16 or w2.dtype != torch.bfloat16:
        return False
    if torch.cuda.get_device_capability(x.device)[0] not in (9, 10):
        return False
    d, i = x.shape[1], w2.shape[2]
    return d % 8 == 0 and i % 8 == 0 and w13.is_contiguous() and w2.is_contiguous()


def fused_moe_grouped_mm(
    x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor
) -> torch.Tensor:
    """bf16 experts through ``torch._grouped_mm`` on unpadded expert-sorted rows."""
    t, k = topk_ids.shape
    num_e = w13.shape[0]
    lay = moe_align(topk_ids, num_e, 1)
    xs = x.index_select(0, lay.sorted_tokens[: t * k])
    gate_up = torch._grouped_mm(xs, w13.transpose(-2, -1), offs=lay.expert_ends)
    h = silu_mul(gate_up)
    y = torch._grouped_mm(h, w2.transpose(-2, -1), offs=lay.expert_ends)
    return moe_combine(y, topk_weights, torch.empty_like(x), lay.pair_pos)


def fused_moe_triton(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    w13_scale: torch.Tensor | None = None,
    w2_scale: torch.Tensor | None = None,
    block: tuple[int, int] = (128, 128),
    *,
    fp8_activations: bool | None = None,
    configs: tuple[dict | None, dict | None] = (None, None),
    shared: SharedExpert | None = None,
    residual: torch.Tensor | None = None,
    x_fp8: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """Routed experts with the Triton grouped GEMMs (contract of ``fused_moe_ref``), plus
    ``shared(x)`` and ``residual`` when given.

    ``fp8_activations`` (FP8 weights only; default :func:`moe_fp8_activations`) picks W8A8 over
    W8A16. ``configs`` override the tile choice of GEMM 1 / GEMM 2 (must agree on ``BLOCK_M``).
    W8A8 quantises ``x`` and ``h`` with :func:`~breakgraph.kernels.triton_fp8.act_quant`.
    ``shared`` (laid out like one routed expert, :func:`shared_like_routed`) runs as one more
    expert that every token routes to with weight 1, inside the same two GEMMs, and the combine
    adds it and ``residual``: the same launches as the routed experts alone. ``x_fp8``: ``x``
    already quantised as ``act_quant(x, 128)`` quantises it (``(codes [≥T, D] e4m3, scales
    [≥T, D/128] fp32)``, any strides, e.g. from the norm that made ``x``): W8A8 reads it instead
    of quantising ``x`` again.
    """
    t, d = x.shape
    k = topk_ids.shape[1]
    num_e, two_i, _ = w13.shape
    i = two_i // 2
    has_shared = shared is not None
    if has_shared and not shared_like_routed(w13, w2, w13_scale, w2_scale, shared):
        raise ValueError("fused_moe_triton: the shared expert must be laid out like one routed expert")
    if residual is not None and (residual.shape != x.shape or residual.stride(1) != 1):
        raise ValueError(f"fused_moe_triton: residual must be [T, D] like x, got {tuple(residual.shape)}")
    p = t * (k + has_shared)
    w_fp8 = w13.dtype == FP8_DTYPE
    if fp8_activations is None:
        fp8_activations = moe_fp8_activations()
    fp8_activations = fp8_activations and w_fp8
    cfg1 = gemm_config(p, num_e + has_shared, True, w_fp8, fp8_activations)
    cfg1.update(configs[0] or {})
    cfg2 = gemm_config(p, num_e + has_shared, False, w_fp8, fp8_activations)
    cfg2.update(configs[1] or {})
    cfg2["BLOCK_M"] = cfg1["BLOCK_M"]
    lay = moe_align(topk_ids, num_e, cfg1["BLOCK_M"], shared_slot=has_shared)
    if fp8_activations and x_fp8 is not None:
        xa, xs = x_fp8
        if xa.dtype != FP8_DTYPE or xa.shape[0] < t or xa.shape[1] != d or xa.stride(1) != 1 or xs.shape[0] < t:
            raise ValueError(
                f"fused_moe_triton: x_fp8 must be e4m3 codes [>= {t}, {d}] with their scales, "
                f"got {tuple(xa.shape)} {xa.dtype} and {tuple(xs.shape)}"
            )
    else:
        xc = x if x.stride(1) == 1 else x.contiguous()
        xa, xs = act_quant(xc, block[1], column_major_scale=False) if fp8_activations else (xc, None)
    h = torch.empty(p, i, dtype=x.dtype, device=x.device)
    sh1 = (shared.w13, shared.w13_scale) if has_shared else None
    sh2 = (shared.w2, shared.w2_scale) if has_shared else None
    moe_gemm(xa, xs, w13, w13_scale, lay, h, gather_top_k=k + has_shared, silu=True, block=block, config=cfg1,
             shared=sh1)  # fmt: skip
    ha, hs = act_quant(h, block[1], column_major_scale=False) if fp8_activations else (h, None)
    y = torch.empty(p, d, dtype=x.dtype, device=x.device)
    moe_gemm(ha, hs, w2, w2_scale, lay, y, gather_top_k=None, silu=False, block=block, config=cfg2, shared=sh2)
    return moe_combine(y, topk_weights, torch.empty_like(x), shared_slot=has_shared, residual=residual)


# --------------------------------------------------------------------------------------------
# decode: experts by routed pair, two launches for routed + shared experts


@triton.jit
def _decode_up_step(
    acc_g, acc_u, x_row, wg_ptrs, wu_ptrs, sg_ptr, su_ptr, k0, k_hi, offs_k, n_ok, stride_wsk,
    W_FP8: tl.constexpr, SCALE_BK: tl.constexpr, SCALE_X: tl.constexpr,
):  # fmt: skip
    """One ``BLOCK_K`` step of the gate and up GEMVs (columns ``k0 + offs_k`` below ``k_hi``).
    FP8 block scales: ``SCALE_X`` multiplies the row of ``x`` by each column's scale (one
    multiply per column, shared by the tile's rows, which lie in one 128-row scale block) and
    widens the codes exactly; else every weight is scaled and rounded to the activation dtype,
    the twin's dequantisation."""
    kk = k0 + offs_k
    k_ok = kk < k_hi
    xv = tl.load(x_row + kk, mask=k_ok, other=0.0)
    m = n_ok[:, None] & k_ok[None, :]
    wg = tl.load(wg_ptrs + k0, mask=m, other=0.0)
    wu = tl.load(wu_ptrs + k0, mask=m, other=0.0)
    xf = xv.to(tl.float32)
    xg = xf[None, :]
    xu = xf[None, :]
    if W_FP8:
        kb = (kk // SCALE_BK) * stride_wsk
        sg = tl.load(sg_ptr + kb, mask=k_ok, other=0.0)
        su = tl.load(su_ptr + kb, mask=k_ok, other=0.0)
        if SCALE_X:
            xg = (xf * sg)[None, :]
            xu = (xf * su)[None, :]
        else:
            wg = (wg.to(tl.float32) * sg[None, :]).to(xv.dtype)
            wu = (wu.to(tl.float32) * su[None, :]).to(xv.dtype)
    return acc_g + tl.sum(wg.to(tl.float32) * xg, axis=1), acc_u + tl.sum(wu.to(tl.float32) * xu, axis=1)


@triton.jit
def _decode_up_kernel(
    x_ptr, ids_ptr, w_ptr, ws_ptr, shw_ptr, shs_ptr, h_ptr,
    P, I, K,
    stride_xm, stride_we, stride_wn, stride_wse, stride_wsn, stride_wsk, stride_hs, stride_hp,
    K_PER_SPLIT: tl.constexpr, TOP_K: tl.constexpr, HAS_SHARED: tl.constexpr, W_FP8: tl.constexpr,
    SPLIT_K: tl.constexpr, UNROLL: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    SCALE_BN: tl.constexpr, SCALE_BK: tl.constexpr, SCALE_X: tl.constexpr = False, PDL: tl.constexpr = False,
):  # fmt: skip
    """Program ``(q, n, s)``: rows ``[n·BN, (n+1)·BN)`` of the gate and of the up projection of
    slot ``q``'s expert times its token's row of ``x``, over the k-range of split ``s``. Slots
    ``q < P`` are routed pairs (token ``q // TOP_K``, expert ``ids[q]``); ``q ≥ P`` the shared
    expert of token ``q - P``. ``SPLIT_K == 1``: writes ``h = silu(g)·u`` in ``h``'s dtype;
    else the fp32 sums ``g ‖ u`` of its split into slice ``s`` of ``h``. ``UNROLL``: the k-steps
    as straight-line code (the compiler may issue a step's loads before the last one's math)."""
    q = tl.program_id(0)
    pid_n = tl.program_id(1)
    split = tl.program_id(2)
    pdl_wait(PDL)  # the experts' ids come from the router
    expert = tl.load(ids_ptr + q, mask=q < P, other=0).to(tl.int64)
    tok = q // TOP_K
    w_base = w_ptr + expert * stride_we
    s_base = ws_ptr + expert * stride_wse
    if HAS_SHARED:
        if q >= P:
            tok = q - P
            w_base = shw_ptr
            s_base = shs_ptr
    n0 = pid_n * BLOCK_N
    offs_n = n0 + tl.arange(0, BLOCK_N)
    n_ok = offs_n < I
    offs_k = tl.arange(0, BLOCK_K)
    x_row = x_ptr + tok.to(tl.int64) * stride_xm
    wg_ptrs = w_base + offs_n[:, None].to(tl.int64) * stride_wn + offs_k[None, :]
    wu_ptrs = wg_ptrs + I * stride_wn
    sg_ptr = s_base + (n0 // SCALE_BN) * stride_wsn
    su_ptr = s_base + ((I + n0) // SCALE_BN) * stride_wsn
    acc_g = tl.zeros((BLOCK_N,), dtype=tl.float32)
    acc_u = tl.zeros((BLOCK_N,), dtype=tl.float32)
    k_lo = split * K_PER_SPLIT
    k_hi = tl.minimum(k_lo + K_PER_SPLIT, K)
    if UNROLL:
        for dk in tl.static_range(0, K_PER_SPLIT, BLOCK_K):
            acc_g, acc_u = _decode_up_step(
                acc_g, acc_u, x_row, wg_ptrs, wu_ptrs, sg_ptr, su_ptr, k_lo + dk, k_hi, offs_k, n_ok, stride_wsk,
                W_FP8, SCALE_BK, SCALE_X,
            )  # fmt: skip
    else:
        for k0 in range(k_lo, k_hi, BLOCK_K):
            acc_g, acc_u = _decode_up_step(
                acc_g, acc_u, x_row, wg_ptrs, wu_ptrs, sg_ptr, su_ptr, k0, k_hi, offs_k, n_ok, stride_wsk,
                W_FP8, SCALE_BK, SCALE_X,
            )  # fmt: skip
    h_row = h_ptr + split * stride_hs + q.to(tl.int64) * stride_hp
    if SPLIT_K == 1:
        h = acc_g / (1.0 + tl.exp(-acc_g)) * acc_u
        tl.store(h_row + offs_n, h.to(h_ptr.dtype.element_ty), mask=n_ok)
    else:
        tl.store(h_row + offs_n, acc_g, mask=n_ok)
        tl.store(h_row + I + offs_n, acc_u, mask=n_ok)


@triton.jit
def _decode_down_kernel(
    h_ptr, ids_ptr, tw_ptr, w_ptr, ws_ptr, shw_ptr, shs_ptr, res_ptr, out_ptr,
    P, D,
    stride_hs, stride_hp, stride_we, stride_wn, stride_wse, stride_wsn, stride_wsk, stride_rm, stride_om,
    I: tl.constexpr, TOP_K: tl.constexpr, HAS_SHARED: tl.constexpr, HAS_RES: tl.constexpr,
    W_FP8: tl.constexpr, SPLIT_K: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    SCALE_BN: tl.constexpr, SCALE_BK: tl.constexpr, SCALE_X: tl.constexpr = False, PDL: tl.constexpr = False,
):  # fmt: skip
    """Program ``(t, n)``: columns ``[n·BN, (n+1)·BN)`` of token ``t``'s output
    ``Σ_j w[t, j] · W2[ids[t, j]] h[t·k + j]`` (+ the shared expert's ``W2_s h[P + t]``, + the
    residual row), in fp32 and rounded once. The token's slots are laid end to end as one
    reduction axis of ``(TOP_K + HAS_SHARED)·I`` columns, walked in straight-line ``BLOCK_K``
    steps (a step may span several experts: each column gathers its own expert's weights),
    so the sum runs in one fixed order and loads need not wait for the previous step.
    ``SPLIT_K > 1``: ``h`` holds fp32 ``g ‖ u`` split sums, added in split order, then
    ``silu(g)·u`` rounded to the output dtype (what ``SPLIT_K == 1`` stores). FP8 scales:
    ``SCALE_X`` as in :func:`_decode_up_step` (on ``h``'s columns here)."""
    t = tl.program_id(0)
    pid_n = tl.program_id(1)
    n0 = pid_n * BLOCK_N
    offs_n = n0 + tl.arange(0, BLOCK_N)
    n_ok = offs_n < D
    dt = out_ptr.dtype.element_ty
    acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
    pdl_wait(PDL)
    for c0 in tl.static_range(0, (TOP_K + HAS_SHARED) * I, BLOCK_K):
        col = c0 + tl.arange(0, BLOCK_K)
        slot = col // I
        kk = col % I
        col_ok = slot < TOP_K + HAS_SHARED
        routed = slot < TOP_K
        pair = t * TOP_K + slot
        q = tl.where(routed, pair, P + t).to(tl.int64)
        expert = tl.load(ids_ptr + pair, mask=routed, other=0).to(tl.int64)
        wt = tl.load(tw_ptr + pair, mask=routed, other=1.0)
        h_ptrs = h_ptr + q * stride_hp + kk
        if SPLIT_K == 1:
            h = tl.load(h_ptrs, mask=col_ok, other=0.0).to(tl.float32)
        else:
            g = tl.zeros((BLOCK_K,), dtype=tl.float32)
            u = tl.zeros((BLOCK_K,), dtype=tl.float32)
            for s in tl.static_range(SPLIT_K):
                g += tl.load(h_ptrs + s * stride_hs, mask=col_ok, other=0.0)
                u += tl.load(h_ptrs + s * stride_hs + I, mask=col_ok, other=0.0)
            h = (g / (1.0 + tl.exp(-g)) * u).to(dt).to(tl.float32)
        w_off = offs_n[:, None].to(tl.int64) * stride_wn + kk[None, :]
        w_ptrs = w_ptr + expert[None, :] * stride_we + w_off
        s_ptrs = ws_ptr + expert * stride_wse
        if HAS_SHARED:
            w_ptrs = tl.where(routed[None, :], w_ptrs, shw_ptr + w_off)
            s_ptrs = tl.where(routed, s_ptrs, shs_ptr)
        hw = h * wt
        if W_FP8:
            sw = tl.load(s_ptrs + (n0 // SCALE_BN) * stride_wsn + (kk // SCALE_BK) * stride_wsk, mask=col_ok, other=0.0)
            if SCALE_X:  # the column's scale on h (one multiply per column), the codes widened exactly
                hw = hw * sw
        w = tl.load(w_ptrs, mask=n_ok[:, None] & col_ok[None, :], other=0.0)
        if W_FP8 and not SCALE_X:
            w = (w.to(tl.float32) * sw[None, :]).to(dt)
        acc += tl.sum(w.to(tl.float32) * hw[None, :], axis=1)
    if HAS_RES:
        acc += tl.load(res_ptr + t.to(tl.int64) * stride_rm + offs_n, mask=n_ok, other=0.0).to(tl.float32)
    tl.store(out_ptr + t.to(tl.int64) * stride_om + offs_n, acc.to(dt), mask=n_ok)


# fused_moe takes the decode kernels up to here. scripts/bench_moe_decode.py on the H200: a GLM-5
# TP8-rank MoE layer (routed + shared + residual) at 1 token 26 µs against 105 µs for the grouped
# GEMMs, at 16 tokens 284 µs against 188 (the decode kernels read each routed pair's expert,
# the grouped GEMMs each touched expert once). scripts/gpu_check_moe2.sh at 8 tokens (routed
# experts only): the two decode kernels 136 µs, the grouped path's two GEMMs alone 133 µs
# (W8A16, stream GEMM 2) before its alignment, combine and the shared expert's own launches,
# which the decode kernels fold in; at 16 tokens 248 µs against 175 µs of GEMMs.
DECODE_MAX_TOKENS = 8


def decode_config(
    num_tokens: int, top_k: int, inter: int, hidden: int, has_shared: bool, scale_x: bool | None = None
) -> dict:
    """Tiles of the two decode kernels from static shapes only (graph-safe): ``up`` (gate/up:
    ``BLOCK_N`` rows of I, ``BLOCK_K`` columns of D per step, ``SPLIT_K`` k-splits) and
    ``down`` (``BLOCK_N`` columns of D, ``BLOCK_K`` of the token's slots × I per step). Tiles of at most 8K
    elements per 4 warps (16K for down with the scales on h) compile without spills for sm_90a
    (``test_moe_decode_kernels_compile_for_sm90_without_spills``); the k-split doubles until
    the gate/up grid has four programs per SM (132 on an H200) or each split is 1024 columns
    (at one token: 4 splits, the fastest gate/up tile of ``scripts/bench_moe_decode.py``'s sweep).
    ``scale_x``: FP8 block scales on the activations (``SCALE_X``; the default,
    ``BREAKGRAPH_MOE_DEQUANT=product``: on the H200 58.9 against 89.5 µs a layer at one token,
    ``scripts/bench_kernels_moe.py --only compare``), else on every weight (``scaled``)."""
    if scale_x is None:
        scale_x = env.read("BREAKGRAPH_MOE_DEQUANT") == "product"
    slots = num_tokens * (top_k + int(has_shared))
    up_n = 16
    split = 1
    while slots * triton.cdiv(inter, up_n) * split < 4 * 132 and split < 8 and hidden // (2 * split) >= 1024:
        split *= 2
    up_k = 512
    down_n = 16 if num_tokens * triton.cdiv(hidden, 32) < 8 * 132 else 32
    return {
        # straight-line k-steps up to 3 (6 take 255 registers on sm_90a and ran slower in the sweep)
        "up": {"BLOCK_N": up_n, "BLOCK_K": up_k, "SPLIT_K": split, "UNROLL": hidden // split <= 3 * up_k,
               "num_warps": 4, "num_stages": 1, "SCALE_X": scale_x},
        # 16-column down tiles step 1024 wide with the scales on h (512 spills a few addresses);
        # with the scales on h, sm_90a one-token tiles take fewer instructions and no F2F
        # conversions (gate/up 1688 against 2904; `pytest -s tests/test_kernels_moe.py -k
        # scale_x_leaves_the_conversion_units` prints both kernels' counts)
        "down": {"BLOCK_N": down_n, "BLOCK_K": 1024 if scale_x and down_n == 16 else 512, "num_warps": 4,
                 "num_stages": 1, "SCALE_X": scale_x},
    }  # fmt: skip


def decode_supported(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    w13_scale: torch.Tensor | None,
    w2_scale: torch.Tensor | None,
    shared: SharedExpert | None = None,
) -> bool:
    """Whether :func:`fused_moe_decode` takes these tensors: unit inner strides; FP8 scales one
    per 128×128 block; a shared expert with the dtypes, shapes and strides of one routed expert."""
    num_e, two_i, d = w13.shape
    if w13.stride(2) != 1 or w2.stride(2) != 1 or x.stride(1) != 1 or w2.shape != (num_e, d, two_i // 2):
        return False
    if w13_scale is not None and (w13_scale.stride(2) != 1 or w2_scale.stride(2) != 1):
        return False
    return shared is None or shared_like_routed(w13, w2, w13_scale, w2_scale, shared)


def shared_like_routed(
    w13: torch.Tensor,
    w2: torch.Tensor,
    w13_scale: torch.Tensor | None,
    w2_scale: torch.Tensor | None,
    shared: SharedExpert,
) -> bool:
    """Whether ``shared`` has the dtypes, shapes and strides of one routed expert (and FP8
    scales exactly when the routed experts have them): then the expert kernels can run it as
    one more expert."""
    pairs = [(shared.w13, w13), (shared.w2, w2)]
    if w13_scale is not None:
        if shared.w13_scale is None or shared.w2_scale is None:
            return False
        pairs += [(shared.w13_scale, w13_scale), (shared.w2_scale, w2_scale)]
    elif shared.w13_scale is not None or shared.w2_scale is not None:
        return False
    return all(_like_one_of(a, b) for a, b in pairs)


def _like_one_of(t: torch.Tensor, stacked: torch.Tensor) -> bool:
    """Whether ``t`` has the dtype, shape and strides of one slice ``stacked[e]``."""
    same_shape = tuple(t.shape) == tuple(stacked.shape[1:])
    return t.dtype == stacked.dtype and same_shape and t.stride() == stacked.stride()[1:]


def fused_moe_decode(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    w13_scale: torch.Tensor | None = None,
    w2_scale: torch.Tensor | None = None,
    block: tuple[int, int] = (128, 128),
    *,
    shared: SharedExpert | None = None,
    residual: torch.Tensor | None = None,
    config: dict | None = None,
) -> torch.Tensor:
    """Routed experts for a few tokens in two launches, reading only the experts the tokens
    route to (contract of ``fused_moe_ref``, plus ``shared(x)`` and ``residual`` when given).

    Launch 1 (:func:`_decode_up_kernel`): gate/up GEMV + SiLU per (routed pair or shared slot,
    row tile, k-split), weights dequantised from FP8 per block in registers, one read of each
    weight tile per pair. Launch 2 (:func:`_decode_down_kernel`): per (token, column tile), the
    down GEMVs of the token's experts and the weighted sum in fp32 — a deterministic combine
    with no atomics. No host sync; the grid depends only on ``T·(k + shared)``. ``config``
    overrides :func:`decode_config` (keys ``up`` / ``down``). ``block`` must be (128, 128) for FP8.
    """
    t, d = x.shape
    k = topk_ids.shape[1]
    two_i = w13.shape[1]
    i = two_i // 2
    w_fp8 = w13.dtype == FP8_DTYPE
    if w_fp8 != (w13_scale is not None) or w_fp8 != (w2_scale is not None):
        raise ValueError("fused_moe_decode: FP8 weights need both block scales, bf16 weights none")
    if w_fp8 and tuple(block) != (128, 128):
        raise ValueError(f"fused_moe_decode: FP8 block must be (128, 128), got {tuple(block)}")
    if not decode_supported(x, w13, w2, w13_scale, w2_scale, shared):
        raise ValueError("fused_moe_decode: unsupported layout (see decode_supported)")
    if residual is not None and (residual.shape != x.shape or residual.stride(1) != 1):
        raise ValueError(f"fused_moe_decode: residual must be [T, D] like x, got {tuple(residual.shape)}")
    cfg = decode_config(t, k, i, d, shared is not None)
    for part, over in (config or {}).items():
        cfg[part] = {**cfg[part], **over}
    up, down = dict(cfg["up"]), dict(cfg["down"])
    sbn, sbk = block if w_fp8 else (1, 1)
    if w_fp8 and (i % sbn or sbn % up["BLOCK_N"] or sbn % down["BLOCK_N"]):
        raise ValueError(
            f"fused_moe_decode: FP8 needs I % 128 == 0 and BLOCK_N dividing 128, got I={i}, {up}, {down}"
        )
    out = torch.empty_like(x)
    if t == 0 or d == 0:
        return out
    p = t * k
    slots = p + (t if shared is not None else 0)
    split = up.pop("SPLIT_K")
    k_per_split = triton.cdiv(triton.cdiv(d, split), up["BLOCK_K"]) * up["BLOCK_K"]
    split = triton.cdiv(d, k_per_split)
    if split == 1:
        h = torch.empty(1, slots, i, dtype=x.dtype, device=x.device)
    else:
        h = torch.empty(split, slots, 2 * i, dtype=torch.float32, device=x.device)
    ids = topk_ids if topk_ids.is_contiguous() else topk_ids.contiguous()
    tw = topk_weights.float().contiguous()
    ws = w13_scale if w_fp8 else w13
    shw = shared.w13 if shared is not None else w13
    shs = (shared.w13_scale if w_fp8 else shw) if shared is not None else ws
    ws_strides = (ws.stride(0), ws.stride(1), ws.stride(2)) if w_fp8 else (0, 0, 0)
    _decode_up_kernel[(slots, triton.cdiv(i, up["BLOCK_N"]), split)](
        x, ids, w13, ws, shw, shs, h, p, i, d,
        x.stride(0), w13.stride(0), w13.stride(1), *ws_strides, h.stride(0), h.stride(1),
        K_PER_SPLIT=k_per_split, TOP_K=k, HAS_SHARED=shared is not None, W_FP8=w_fp8, SPLIT_K=split,
        SCALE_BN=sbn, SCALE_BK=sbk, **up, **pdl_launch(x.device),
    )  # fmt: skip
    ws2 = w2_scale if w_fp8 else w2
    shw2 = shared.w2 if shared is not None else w2
    shs2 = (shared.w2_scale if w_fp8 else shw2) if shared is not None else ws2
    ws2_strides = (ws2.stride(0), ws2.stride(1), ws2.stride(2)) if w_fp8 else (0, 0, 0)
    res = residual if residual is not None else out
    _decode_down_kernel[(t, triton.cdiv(d, down["BLOCK_N"]))](
        h, ids, tw, w2, ws2, shw2, shs2, res, out, p, d,
        h.stride(0), h.stride(1), w2.stride(0), w2.stride(1), *ws2_strides, res.stride(0), out.stride(0),
        I=i, TOP_K=k, HAS_SHARED=shared is not None, HAS_RES=residual is not None, W_FP8=w_fp8, SPLIT_K=split,
        SCALE_BN=sbn, SCALE_BK=sbk, **down, **pdl_launch(x.device),
    )  # fmt: skip
    return out
