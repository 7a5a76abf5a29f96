"""MoE kernels: routing, expert-sorted permutation, grouped GEMMs (bf16 / FP8 block-scaled),
SiLU-and-mul, weighted combine, and the ``route`` / ``fused_moe`` dispatchers.

CPU: the Triton kernels run under Triton's interpreter in one subprocess against the twins
(``route_ref``, ``fused_moe_ref``) on fresh random inputs, with empty experts and ragged
counts. GPU (``cuda`` marker): the GLM-5 TP8-rank workload (256 experts, D=6144, I=256, top-8,
T = 128…8192), CUDA-graph capture and replay.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from test_kernels_fp8 import OPCHECK_FP8, _expect, _rel, compile_for_sm90

from breakgraph.bench.presets import PRESETS, moe_shape
from breakgraph.kernels.fp8 import FP8_DTYPE, block_dequant, block_quant
from breakgraph.kernels.moe import SharedExpert, fused_moe, fused_moe_ref, route, route_ref, shared_expert_ref


def _skewed_ids(num_tokens: int, top_k: int, num_experts: int, live: int) -> torch.Tensor:
    """Distinct experts per token drawn from the first ``live`` experts with a skew, so that
    counts are ragged (some experts span several row blocks) and the rest get no token."""
    weights = torch.linspace(1.0, 12.0, live) ** 2
    ids = torch.stack([torch.multinomial(weights, top_k, replacement=False) for _ in range(num_tokens)])
    perm = torch.randperm(num_experts)[:live]
    return perm[ids]


def _assert_same_selection(
    ids: torch.Tensor, ids_ref: torch.Tensor, w: torch.Tensor, w_ref: torch.Tensor
) -> None:
    si, oi = ids.sort(dim=1)
    sr, orf = ids_ref.sort(dim=1)
    assert torch.equal(si, sr), f"{(si != sr).any(dim=1).sum().item()} tokens select different experts"
    torch.testing.assert_close(w.gather(1, oi), w_ref.gather(1, orf), rtol=1e-5, atol=1e-6)


def _oracle(x, w13, w2, tw, ids, w13_scale=None, w2_scale=None, quant_act=False):
    """fp32 per-expert loop; ``quant_act`` quantises GEMM inputs per (row, 128) like W8A8."""
    from breakgraph.kernels.triton_fp8 import act_dequant, act_quant_ref

    def q(a):
        return act_dequant(*act_quant_ref(a)) if quant_act else a

    if w13_scale is not None:
        w13 = block_dequant(w13, w13_scale, (128, 128), torch.float32)
        w2 = block_dequant(w2, w2_scale, (128, 128), torch.float32)
    t, k = ids.shape
    inter = w2.shape[-1]
    out = torch.zeros(t, x.shape[1], dtype=torch.float32, device=x.device)
    flat = ids.reshape(-1)
    for e in flat.unique().tolist():
        pairs = (flat == e).nonzero().squeeze(1)
        tok = pairs // k
        gu = q(x[tok].float()) @ w13[e].float().t()
        h = F.silu(gu[:, :inter]) * gu[:, inter:]
        h = h.to(x.dtype).float()  # the kernels keep h in the activation dtype
        y = q(h) @ w2[e].float().t()
        out.index_add_(0, tok, y * tw.reshape(-1)[pairs, None].float())
    return out


# --------------------------------------------------------------------------------------------
# interpreter checks (run in the subprocess)



def check_route_select_matches_route_ref():
    from breakgraph.kernels.triton_moe import route_select

    cases = [  # (E, top_k, n_group, topk_group, norm, scale, bias)
        (256, 8, 1, 1, True, 2.5, True),  # GLM-5
        (256, 8, 8, 4, True, 2.5, True),  # DeepSeek-V3.2
        (40, 3, 4, 2, False, 1.0, False),
        (64, 6, 8, 3, True, 1.0, True),
    ]
    for (e, k, ng, tg, norm, scale, has_bias), t in zip(cases, (9, 70, 9, 70)):  # one program a row up to 64 rows
        logits = torch.randn(t, e) * 3
        bias = torch.randn(e) * 0.3 if has_bias else None
        w_ref, ids_ref = route_ref(logits, bias, k, ng, tg, norm, scale)
        # the sigmoid given, or taken in the kernel from the logits
        for w, ids in (route_select(logits.sigmoid(), bias, k, ng, tg, norm, scale),
                       route_select(logits, bias, k, ng, tg, norm, scale, logits=True)):  # fmt: skip
            assert ids.dtype == torch.int64 and w.dtype == torch.float32
            _assert_same_selection(ids, ids_ref, w, w_ref)


def check_moe_align_invariants():
    from breakgraph.kernels import triton_moe

    one_program = triton_moe.ALIGN_ONE_PROGRAM_PAIRS
    assert 40 * 9 <= one_program < 300 * 8, "the cases below take both paths"
    try:
        for bound in (one_program, 0):  # the one-program kernel, then the memset and two kernels
            triton_moe.ALIGN_ONE_PROGRAM_PAIRS = bound
            _check_moe_align_invariants()
    finally:
        triton_moe.ALIGN_ONE_PROGRAM_PAIRS = one_program


def _check_moe_align_invariants():
    from breakgraph.kernels.triton_moe import max_row_blocks, moe_align

    cases = ((40, 4, 16, 6, 16), (50, 6, 32, 7, 16), (60, 8, 64, 12, 32), (40, 2, 8, 8, 1), (300, 8, 64, 40, 16))
    for t, k, e, live, bm in cases:
        ids = _skewed_ids(t, k, e, live)
        lay = moe_align(ids, e, bm)
        p = t * k
        flat = ids.reshape(-1)
        counts = torch.bincount(flat, minlength=e)
        sp = lay.sorted_pairs.long()
        real = sp[sp < p]
        assert torch.equal(real.sort().values, torch.arange(p)), "every pair exactly once"
        assert torch.equal(sp[lay.pair_pos.long()], torch.arange(p)), "pair_pos inverts the permutation"
        tok = lay.sorted_tokens.long()
        assert torch.equal(tok[sp < p], sp[sp < p] // k) and (tok[sp >= p] == t).all()
        padded = (counts + bm - 1) // bm * bm
        assert torch.equal(lay.expert_ends.long(), padded.cumsum(0))
        if bm > 1:
            nb = int(lay.num_blocks.item())
            assert nb == int((padded // bm).sum()) and lay.max_blocks == max_row_blocks(p, e, bm) >= nb
            for b in range(nb):
                rows = sp[b * bm : (b + 1) * bm]
                rows = rows[rows < p]
                assert rows.numel() > 0, "a used block has at least one row"
                assert (flat[rows] == lay.block_expert[b].long()).all(), f"block {b} mixes experts"
            assert (counts == 0).sum() > 0, "the case must include empty experts"
            assert counts.max() > bm, "the case must include an expert spanning several blocks"
    # the shared expert's slot: pair t·(k+1) + k of every token goes to expert e, after the routed ones
    for t, k, e, live, bm in ((40, 4, 16, 6, 16), (21, 8, 64, 12, 16), (9, 2, 8, 8, 1), (300, 8, 64, 40, 16)):
        ids = _skewed_ids(t, k, e, live)
        lay = moe_align(ids, e, bm, shared_slot=True)
        s = k + 1
        p = t * s
        assert lay.num_pairs == p
        pair_expert = torch.cat([ids, torch.full((t, 1), e)], dim=1).reshape(-1)
        counts = torch.bincount(pair_expert, minlength=e + 1)
        assert counts[e] == t, "every token has its shared slot"
        sp = lay.sorted_pairs.long()
        real = sp[sp < p]
        assert torch.equal(real.sort().values, torch.arange(p)), "every pair exactly once"
        assert torch.equal(sp[lay.pair_pos.long()], torch.arange(p))
        assert torch.equal(lay.sorted_tokens.long()[sp < p], real // s), "token of pair t·(k+1) + j is t"
        padded = (counts + bm - 1) // bm * bm
        assert torch.equal(lay.expert_ends.long(), padded.cumsum(0))
        if bm > 1:
            nb = int(lay.num_blocks.item())
            assert nb == int((padded // bm).sum()) and lay.max_blocks == max_row_blocks(p, e + 1, bm) >= nb
            for b in range(nb):
                rows = sp[b * bm : (b + 1) * bm]
                rows = rows[rows < p]
                assert (pair_expert[rows] == lay.block_expert[b].long()).all(), f"block {b} mixes experts"
            assert (lay.block_expert[:nb] == e).sum() == -(-t // bm), "the shared expert's blocks come last"


def check_fused_moe_triton_bf16_fp32_match_twin():
    from breakgraph.kernels.triton_moe import fused_moe_triton

    t, k, e, d, inter = 19, 4, 12, 256, 128
    x = torch.randn(t, d)
    w13 = torch.randn(e, 2 * inter, d) / d**0.5
    w2 = torch.randn(e, d, inter) / inter**0.5
    ids = _skewed_ids(t, k, e, 7)
    tw = torch.rand(t, k)
    want = fused_moe_ref(x, w13, w2, tw, ids)
    configs = [
        (None, None),
        ({"BLOCK_M": 16, "SWAP_AB": True, "BLOCK_N": 32}, {"BLOCK_M": 16, "SWAP_AB": True, "BLOCK_N": 64}),
        ({"BLOCK_M": 32, "SWAP_AB": False}, {"BLOCK_M": 32, "SWAP_AB": False}),
        ({"BLOCK_M": 64, "SWAP_AB": False, "BLOCK_K": 64}, {"BLOCK_M": 64, "SWAP_AB": True, "BLOCK_K": 32}),
    ]
    for cfg in configs:
        got = fused_moe_triton(x, w13, w2, tw, ids, configs=cfg)
        assert _rel(got, want) < 1e-3, (cfg, _rel(got, want))
    xb, w13b, w2b = x.bfloat16(), w13.bfloat16(), w2.bfloat16()
    got = fused_moe_triton(xb, w13b, w2b, tw, ids)
    assert got.dtype == torch.bfloat16
    assert _rel(got, _oracle(xb, w13b, w2b, tw, ids)) < 2e-2


def check_fused_moe_triton_fp8_matches_twin():
    from breakgraph.kernels.triton_moe import fused_moe_triton

    t, k, e, d, inter = 17, 4, 10, 384, 256
    x = torch.randn(t, d)
    w13, s13 = block_quant(torch.randn(e, 2 * inter, d) / d**0.5)
    w2, s2 = block_quant(torch.randn(e, d, inter) / inter**0.5)
    ids = _skewed_ids(t, k, e, 6)
    tw = torch.rand(t, k)
    # W8A16: bf16/fp32 activations × fp8 weight tiles
    got = fused_moe_triton(x, w13, w2, tw, ids, s13, s2, fp8_activations=False)
    assert _rel(got, fused_moe_ref(x, w13, w2, tw, ids, s13, s2)) < 1e-3
    got = fused_moe_triton(
        x, w13, w2, tw, ids, s13, s2, fp8_activations=False, configs=({"BLOCK_M": 32, "SWAP_AB": False}, None)
    )
    assert _rel(got, fused_moe_ref(x, w13, w2, tw, ids, s13, s2)) < 1e-3
    xb = x.bfloat16()
    got = fused_moe_triton(xb, w13, w2, tw, ids, s13, s2, fp8_activations=False)
    assert _rel(got, _oracle(xb, w13, w2, tw, ids, s13, s2)) < 2e-2
    # W8A8: activations quantised per (row, 128) — compare with the same quantisation in fp32
    got = fused_moe_triton(x, w13, w2, tw, ids, s13, s2, fp8_activations=True)
    assert _rel(got, _oracle(x, w13, w2, tw, ids, s13, s2, quant_act=True)) < 2e-2
    got = fused_moe_triton(xb, w13, w2, tw, ids, s13, s2, fp8_activations=True)
    assert _rel(got, _oracle(xb, w13, w2, tw, ids, s13, s2, quant_act=True)) < 2e-2


def check_fused_moe_triton_folds_shared_expert_and_residual():
    """The shared expert as one more expert inside the grouped GEMMs, and the residual in the
    combine, against the twins: fp32 and FP8 (W8A16, and W8A8 against the quantising oracle),
    swapped and plain row blocks, the stream kernel; a shared expert laid out unlike a routed
    one is refused."""
    from breakgraph.kernels.triton_moe import fused_moe_triton

    t, k, e, d, inter = 19, 4, 10, 256, 128
    x = torch.randn(t, d)
    ids = _skewed_ids(t, k, e, 6)
    tw = torch.rand(t, k)
    res = torch.randn(t, d)
    w13 = torch.randn(e, 2 * inter, d) / d**0.5
    w2 = torch.randn(e, d, inter) / inter**0.5
    shared = SharedExpert(torch.randn(2 * inter, d) / d**0.5, torch.randn(d, inter) / inter**0.5)
    want = fused_moe_ref(x, w13, w2, tw, ids) + shared_expert_ref(x, shared) + res
    for cfg in [(None, None), ({"BLOCK_M": 32, "SWAP_AB": False}, {"BLOCK_M": 32, "SWAP_AB": False}),
                ({"KERNEL": "stream", "BLOCK_N": 32}, {"KERNEL": "stream", "BLOCK_N": 64, "TILES_N": 2})]:  # fmt: skip
        got = fused_moe_triton(x, w13, w2, tw, ids, configs=cfg, shared=shared, residual=res)
        assert _rel(got, want) < 1e-3, (cfg, _rel(got, want))
    q13, s13 = block_quant(w13)
    q2, s2 = block_quant(w2)
    sq13, ss13 = block_quant(shared.w13)
    sq2, ss2 = block_quant(shared.w2)
    shared8 = SharedExpert(sq13, sq2, ss13, ss2)
    got = fused_moe_triton(x, q13, q2, tw, ids, s13, s2, fp8_activations=False, shared=shared8, residual=res)
    want = fused_moe_ref(x, q13, q2, tw, ids, s13, s2) + shared_expert_ref(x, shared8) + res
    assert _rel(got, want) < 1e-3, _rel(got, want)
    got = fused_moe_triton(x, q13, q2, tw, ids, s13, s2, fp8_activations=True, shared=shared8)
    slot = torch.full((t, 1), e)
    w13_all, s13_all = torch.cat([q13, sq13[None]]), torch.cat([s13, ss13[None]])
    w2_all, s2_all = torch.cat([q2, sq2[None]]), torch.cat([s2, ss2[None]])
    oracle = _oracle(x, w13_all, w2_all, torch.cat([tw, torch.ones(t, 1)], 1), torch.cat([ids, slot], 1),
                     s13_all, s2_all, quant_act=True)  # fmt: skip
    assert _rel(got, oracle) < 2e-2, _rel(got, oracle)
    # x quantised by its producer (column-major scales, padded rows, as the norm's kernel makes
    # them): the same codes and scales, the same result bit for bit
    from breakgraph.kernels.triton_fp8 import act_quant

    x_fp8 = act_quant(x, 128, column_major_scale=True, pad_rows=16)
    again = fused_moe_triton(x, q13, q2, tw, ids, s13, s2, fp8_activations=True, shared=shared8, x_fp8=x_fp8)
    assert torch.equal(again, got)
    try:
        fused_moe_triton(x, q13, q2, tw, ids, s13, s2, fp8_activations=True, x_fp8=(x_fp8[0][:5], x_fp8[1]))
    except ValueError as err:
        assert "x_fp8" in str(err)
    else:
        raise AssertionError("x_fp8 with too few rows was taken")
    try:
        fused_moe_triton(x, w13, w2, tw, ids, shared=SharedExpert(shared.w13[:, :128], shared.w2))
    except ValueError as err:
        assert "shared expert" in str(err)
    else:
        raise AssertionError("a shared expert of another shape was taken")


def check_moe_gemm_writes_every_pair_row_and_nothing_else():
    from breakgraph.kernels.triton_moe import gemm_config, moe_align, moe_gemm

    t, k, e, d, inter = 11, 3, 9, 128, 128
    x = torch.randn(t, d)
    w13 = torch.randn(e, 2 * inter, d) / d**0.5
    ids = _skewed_ids(t, k, e, 4)
    cfg = gemm_config(t * k, e, True, False)
    lay = moe_align(ids, e, cfg["BLOCK_M"])
    h = torch.full((t * k + 5, inter), float("nan"))
    moe_gemm(x, None, w13, None, lay, h, gather_top_k=k, silu=True, config=cfg)
    assert not torch.isnan(h[: t * k]).any(), "a pair row was not written"
    assert torch.isnan(h[t * k :]).all(), "rows past the pairs were written"
    gu = torch.einsum("pd,pnd->pn", x[torch.arange(t * k) // k], w13[ids.reshape(-1)])
    assert _rel(h[: t * k], F.silu(gu[:, :inter]) * gu[:, inter:]) < 1e-5


STREAM_CONFIGS = [  # (GEMM 1, GEMM 2) overrides for the stream kernel
    ({"KERNEL": "stream", "BLOCK_N": 32}, {"KERNEL": "stream", "BLOCK_N": 64, "TILES_N": 4}),
    ({"KERNEL": "stream", "BLOCK_N": 64, "BLOCK_K": 64}, {"KERNEL": "stream", "BLOCK_N": 128, "TILES_N": 2}),
]


def check_moe_stream_kernel_matches_twin():
    """The stream kernel (flat tile × k-block loop, several column tiles per program) against
    the twin: fp32 with a ragged last k-block and a partial last chunk of columns; FP8 weights
    (distinct block scales) with fp32 and bf16 activations, and W8A8 against the quantising oracle."""
    from breakgraph.kernels.triton_moe import fused_moe_triton

    t, k, e, d, inter = 13, 4, 11, 200, 96
    x = torch.randn(t, d)
    w13 = torch.randn(e, 2 * inter, d) / d**0.5
    w2 = torch.randn(e, d, inter) / inter**0.5
    ids = _skewed_ids(t, k, e, 6)
    tw = torch.rand(t, k)
    want = fused_moe_ref(x, w13, w2, tw, ids)
    for cfg in STREAM_CONFIGS:
        got = fused_moe_triton(x, w13, w2, tw, ids, configs=cfg)
        assert _rel(got, want) < 1e-3, (cfg, _rel(got, want))

    t, k, e, d, inter = 9, 4, 10, 384, 256
    x = torch.randn(t, d)
    w13, s13 = block_quant(torch.randn(e, 2 * inter, d) / d**0.5)
    w2, s2 = block_quant(torch.randn(e, d, inter) / inter**0.5)
    s13.uniform_(0.5, 2.0)  # distinct scales per block, so a misplaced scale shows
    s2.uniform_(0.5, 2.0)
    ids = _skewed_ids(t, k, e, 5)
    tw = torch.rand(t, k)
    want = fused_moe_ref(x, w13, w2, tw, ids, s13, s2)
    xb = x.bfloat16()
    want_b = _oracle(xb, w13, w2, tw, ids, s13, s2)
    c1, c2 = STREAM_CONFIGS  # one activation kind per tile pair: each tile pair and kind runs once
    got = fused_moe_triton(x, w13, w2, tw, ids, s13, s2, fp8_activations=False, configs=c1)
    assert _rel(got, want) < 1e-3, (c1, _rel(got, want))
    got = fused_moe_triton(xb, w13, w2, tw, ids, s13, s2, fp8_activations=False, configs=c2)
    assert _rel(got, want_b) < 2e-2, (c2, _rel(got, want_b))
    got = fused_moe_triton(x, w13, w2, tw, ids, s13, s2, fp8_activations=True, configs=c2)
    want_q = _oracle(x, w13, w2, tw, ids, s13, s2, quant_act=True)
    assert _rel(got, want_q) < 2e-2, (c2, _rel(got, want_q))
    # long prompts: GEMM 1 on 64-row blocks, GEMM 2 streaming 64-pair blocks over two column tiles
    long_prompt = ({"BLOCK_M": 64, "SWAP_AB": False}, {"KERNEL": "stream", "BLOCK_N": 128, "TILES_N": 2})
    got = fused_moe_triton(x, w13, w2, tw, ids, s13, s2, fp8_activations=True, configs=long_prompt)
    assert _rel(got, want_q) < 2e-2, (long_prompt, _rel(got, want_q))


def check_moe_stream_kernel_writes_every_pair_row_and_nothing_else():
    from breakgraph.kernels.triton_moe import moe_align, moe_gemm

    t, k, e, d, inter = 11, 3, 9, 128, 160
    h = torch.randn(t * k, inter)
    w2 = torch.randn(e, d, inter) / inter**0.5
    ids = _skewed_ids(t, k, e, 4)
    lay = moe_align(ids, e, 16)
    want = torch.einsum("pi,pdi->pd", h, w2[ids.reshape(-1)])
    for tiles, block_k in ((3, 64), (2, 32)):  # masked loads; then EVEN (N % 64 == 0, K % 32 == 0)
        y = torch.full((t * k + 5, d), float("nan"))
        cfg = {"KERNEL": "stream", "BLOCK_M": 16, "BLOCK_N": 32, "BLOCK_K": block_k, "TILES_N": tiles}
        moe_gemm(h, None, w2, None, lay, y, gather_top_k=None, silu=False, config=cfg)
        assert not torch.isnan(y[: t * k]).any(), f"a pair row was not written ({cfg})"
        assert torch.isnan(y[t * k :]).all(), f"rows past the pairs were written ({cfg})"
        assert _rel(y[: t * k], want) < 1e-5, cfg


def check_silu_mul_and_combine():
    from breakgraph.kernels.triton_moe import moe_combine, silu_mul

    gu = torch.randn(37, 2 * 200)
    assert _rel(silu_mul(gu), F.silu(gu[:, :200]) * gu[:, 200:]) < 1e-6
    t, k, d = 13, 4, 300
    y = torch.randn(t * k, d)
    w = torch.rand(t, k)
    want = (y.view(t, k, d) * w[..., None]).sum(1)
    assert _rel(moe_combine(y, w, torch.empty(t, d)), want) < 1e-6
    perm = torch.randperm(t * k)
    ys = torch.empty_like(y)
    ys[perm] = y
    assert _rel(moe_combine(ys, w, torch.empty(t, d), perm.int()), want) < 1e-6
    # the shared expert's slot (weight 1, last of each token's k + 1 rows) and the residual
    y1 = torch.randn(t * (k + 1), d)
    res = torch.randn(t, d)
    rows = y1.view(t, k + 1, d)
    want = (rows[:, :k] * w[..., None]).sum(1) + rows[:, k] + res
    assert _rel(moe_combine(y1, w, torch.empty(t, d), shared_slot=True, residual=res), want) < 1e-6
    perm = torch.randperm(t * (k + 1))
    ys = torch.empty_like(y1)
    ys[perm] = y1
    got = moe_combine(ys, w, torch.empty(t, d), perm.int(), shared_slot=True, residual=res)
    assert _rel(got, want) < 1e-6


def check_grouped_mm_path_matches_twin():
    from breakgraph.kernels.triton_moe import fused_moe_grouped_mm

    t, k, e, d, inter = 23, 4, 12, 128, 64
    x = torch.randn(t, d)
    w13 = torch.randn(e, 2 * inter, d) / d**0.5
    w2 = torch.randn(e, d, inter) / inter**0.5
    ids = _skewed_ids(t, k, e, 5)
    tw = torch.rand(t, k)
    assert _rel(fused_moe_grouped_mm(x, w13, w2, tw, ids), fused_moe_ref(x, w13, w2, tw, ids)) < 1e-3


def _decode_operands(t, k, e, d, inter, live, kind, with_shared, with_residual, dtype=torch.float32):
    """Fresh random decode operands: routed experts (``kind`` fp8 or dense ``dtype``), ids with
    ``e - live`` experts that get no token, a shared expert and a residual when asked."""

    def weights(*shape):
        w = torch.randn(*shape) / shape[-1] ** 0.5
        return block_quant(w) if kind == "fp8" else (w.to(dtype), None)

    x = torch.randn(t, d).to(dtype)
    w13, s13 = weights(e, 2 * inter, d)
    w2, s2 = weights(e, d, inter)
    ids = _skewed_ids(t, k, e, live) if live < e else torch.stack([torch.randperm(e)[:k] for _ in range(t)])
    tw = torch.rand(t, k)
    shared = None
    if with_shared:
        sw13, ss13 = weights(2 * inter, d)
        sw2, ss2 = weights(d, inter)
        shared = SharedExpert(sw13, sw2, ss13, ss2)
    res = torch.randn(t, d).to(dtype) if with_residual else None
    return x, w13, w2, tw, ids, s13, s2, shared, res


def _decode_twin(x, w13, w2, tw, ids, s13, s2, shared, res):
    want = fused_moe_ref(x, w13, w2, tw, ids, s13, s2)
    if shared is not None:
        want = want + shared_expert_ref(x, shared)
    return want if res is None else want + res


DECODE_CASES = [  # (T, k, E, D, I, experts with tokens, weights, shared, residual)
    (1, 8, 64, 384, 256, 64, "fp8", True, False),
    (3, 4, 10, 384, 256, 6, "fp8", True, True),
    (5, 4, 24, 256, 128, 9, "fp8", False, True),
    (6, 2, 16, 128, 128, 5, "fp8", True, False),
    (3, 4, 10, 256, 128, 6, "fp32", True, True),
    (6, 3, 12, 200, 96, 7, "fp32", False, False),
]


def check_fused_moe_decode_matches_twin():
    from breakgraph.kernels.triton_moe import fused_moe_decode

    for case in DECODE_CASES:
        ops = _decode_operands(*case)
        x, w13, w2, tw, ids, s13, s2, shared, res = ops
        got = fused_moe_decode(x, w13, w2, tw, ids, s13, s2, shared=shared, residual=res)
        assert got.shape == x.shape and got.dtype == x.dtype
        err = _rel(got, _decode_twin(*ops))
        assert err < 1e-5, (case, err)


def check_fused_moe_decode_tile_variants():
    """Split-K (fp32 split sums, SiLU in the down kernel), wide and narrow tiles, FP8 scales on
    every weight (``SCALE_X`` off: ``BREAKGRAPH_MOE_DEQUANT=scaled``) or on the activations
    (``SCALE_X``, the default): one function."""
    from breakgraph.kernels.triton_moe import fused_moe_decode

    ops = _decode_operands(2, 4, 12, 256, 128, 8, "fp8", True, True)
    want = _decode_twin(*ops)
    x, w13, w2, tw, ids, s13, s2, shared, res = ops
    w = {"SCALE_X": False}  # the scales on every weight
    for cfg in (  # down BLOCK_K below, at and above I = 128: a step spans part of a slot or several
        {"up": {"SPLIT_K": 1, "BLOCK_K": 128, "UNROLL": False, **w}, "down": w},
        {
            "up": {"SPLIT_K": 3, "BLOCK_N": 32, "BLOCK_K": 64, "UNROLL": True, **w},
            "down": {"BLOCK_N": 64, "BLOCK_K": 64, **w},
        },
        {
            "up": {"SPLIT_K": 2, "BLOCK_N": 128, "BLOCK_K": 64, "UNROLL": False, **w},
            "down": {"BLOCK_N": 128, "BLOCK_K": 128, **w},
        },
        {"up": {"BLOCK_N": 8, "BLOCK_K": 1024, **w}, "down": {"BLOCK_N": 64, "BLOCK_K": 1024, **w}},
        {"up": {"SCALE_X": True}, "down": {"SCALE_X": True, "BLOCK_K": 1024}},
        {"up": {"SCALE_X": True, "SPLIT_K": 2}, "down": {"SCALE_X": True, "BLOCK_K": 128}},
    ):
        got = fused_moe_decode(x, w13, w2, tw, ids, s13, s2, shared=shared, residual=res, config=cfg)
        assert _rel(got, want) < 1e-5, (cfg, _rel(got, want))


def check_fused_moe_decode_bf16_matches_fp32_oracle():
    """bf16 activations (fp8 and bf16 weights): within bf16 rounding of the fp32 computation."""
    from breakgraph.kernels.triton_moe import fused_moe_decode

    for kind in ("fp8", "bf16"):
        ops = _decode_operands(2, 4, 10, 256, 128, 6, kind, True, True, dtype=torch.bfloat16)
        x, w13, w2, tw, ids, s13, s2, shared, res = ops
        got = fused_moe_decode(x, w13, w2, tw, ids, s13, s2, shared=shared, residual=res)
        assert got.dtype == torch.bfloat16
        want = _oracle(x, w13, w2, tw, ids, s13, s2) + res.float()
        sh = shared._replace(w13=shared.w13.float(), w2=shared.w2.float()) if kind == "bf16" else shared
        want = want + shared_expert_ref(x.float(), sh)
        assert _rel(got, want) < 2e-2, (kind, _rel(got, want))


def check_fused_moe_decode_launches_two_kernels():
    """Routed + shared experts + residual: two kernel launches, and the grid holds exactly
    ``T·(k + 1)`` slots (no program for an expert no token routes to)."""
    import triton.runtime.interpreter as interp

    from breakgraph.kernels.triton_moe import fused_moe_decode

    launches = []
    original = interp.InterpretedFunction.__getitem__

    def spy(self, grid):
        launches.append((self.fn.__name__, tuple(grid)))
        return original(self, grid)

    x, w13, w2, tw, ids, s13, s2, shared, res = _decode_operands(2, 8, 64, 256, 128, 64, "fp8", True, True)
    interp.InterpretedFunction.__getitem__ = spy
    try:
        fused_moe_decode(x, w13, w2, tw, ids, s13, s2, shared=shared, residual=res, config={"up": {"SPLIT_K": 1}})
    finally:
        interp.InterpretedFunction.__getitem__ = original
    assert [name for name, _ in launches] == ["_decode_up_kernel", "_decode_down_kernel"], launches
    assert launches[0][1][0] == 2 * 9 and launches[1][1][0] == 2, launches


# --------------------------------------------------------------------------------------------
# CPU tests


@pytest.mark.slow
@pytest.mark.parametrize(
    "name",
    [
        "check_route_select_matches_route_ref",
        "check_moe_align_invariants",
        "check_fused_moe_triton_bf16_fp32_match_twin",
        "check_fused_moe_triton_fp8_matches_twin",
        "check_fused_moe_triton_folds_shared_expert_and_residual",
        "check_moe_gemm_writes_every_pair_row_and_nothing_else",
        "check_moe_stream_kernel_matches_twin",
        "check_moe_stream_kernel_writes_every_pair_row_and_nothing_else",
        "check_silu_mul_and_combine",
        "check_grouped_mm_path_matches_twin",
        "check_fused_moe_decode_matches_twin",
        "check_fused_moe_decode_tile_variants",
        "check_fused_moe_decode_bf16_matches_fp32_oracle",
        "check_fused_moe_decode_launches_two_kernels",
    ],
)
def test_triton_moe_under_interpreter(interp_results, name):
    _expect(interp_results, name)


@pytest.mark.parametrize(
    "variant",
    [  # (weights, activations, silu, swap, BLOCK_M, BLOCK_N, warps, stages)
        ("fp8", "bf16", True, True, 16, 64, 4, 4),
        ("fp8", "bf16", False, True, 32, 128, 4, 4),
        ("fp8", "bf16", True, False, 128, 64, 8, 3),
        ("fp8", "bf16", False, False, 128, 128, 8, 3),
        ("fp8", "fp8", True, True, 16, 64, 4, 4),
        ("fp8", "fp8", False, True, 16, 128, 4, 3),
        ("fp8", "fp8", True, False, 64, 64, 4, 4),
        ("fp8", "fp8", True, False, 64, 64, 4, 3),  # GEMM 1 past 160 rows per expert
        ("fp8", "fp8", False, False, 64, 128, 4, 3),
        ("fp8", "fp8", False, False, 128, 128, 8, 3),
        ("bf16", "bf16", True, True, 16, 64, 4, 3),
        ("bf16", "bf16", False, False, 128, 128, 8, 3),
    ],
)
def test_moe_gemm_compiles_for_sm90_without_spills(variant):
    """The interpreter does not type-check like the compiler: compile every GEMM flavour for
    sm_90a, and require wgmma (HGMMA / QGMMA for fp8×fp8) and no local-memory spills."""
    pytest.importorskip("triton")
    from breakgraph.kernels import triton_moe

    wdt, adt, silu, swap, bm, bn, warps, stages = variant
    ptr = {"fp8": "*fp8e4nv", "bf16": "*bf16"}
    types = {"a_ptr": ptr[adt], "as_ptr": "*fp32", "w_ptr": ptr[wdt], "ws_ptr": "*fp32", "shw_ptr": ptr[wdt],
             "shs_ptr": "*fp32", "c_ptr": "*bf16", "sorted_ptr": "*i32", "block_expert_ptr": "*i32",
             "num_blocks_ptr": "*i32"}  # fmt: skip
    fp8 = wdt == "fp8"
    constexprs = {"GATHER": silu, "SILU": silu, "W_FP8": fp8, "A_FP8": adt == "fp8", "SWAP_AB": swap,
                  "BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": 128, "SCALE_BN": 128 if fp8 else 1,
                  "SCALE_BK": 128 if fp8 else 1, "INTERP": False, "HAS_SHARED": fp8}  # fmt: skip
    info = compile_for_sm90(triton_moe._moe_gemm_kernel, types, constexprs, warps, stages)
    assert info["stack"] == 0 and info["local_insts"] == 0, info
    assert info["mma"] == (["QGMMA"] if adt == "fp8" else ["HGMMA"]), info


@pytest.mark.parametrize(
    "variant",
    [  # (activations, silu, BLOCK_N, TILES_N, BLOCK_M, warps, stages, EVEN)
        ("bf16", True, 64, 1, 16, 4, 4, True),
        ("bf16", True, 64, 1, 16, 4, 4, False),
        ("bf16", True, 32, 1, 16, 4, 6, True),
        ("bf16", False, 128, 4, 16, 4, 4, True),
        ("bf16", False, 128, 8, 16, 4, 4, True),
        ("bf16", False, 64, 4, 16, 4, 4, False),
        ("fp8", True, 128, 1, 16, 4, 4, True),
        ("fp8", True, 64, 1, 16, 4, 6, True),
        ("fp8", True, 128, 1, 64, 8, 4, True),
        ("fp8", False, 128, 4, 16, 4, 4, False),
        ("fp8", False, 128, 8, 64, 8, 4, True),
        ("fp8", False, 128, 8, 64, 8, 3, True),  # GEMM 2 of long prompts (bench_kernels_moe's sweep)
        ("fp8", False, 128, 4, 128, 8, 4, True),
    ],
)
def test_moe_stream_kernel_compiles_for_sm90_without_spills(variant):
    """The stream kernel for sm_90a at GLM-5 decode tiles: no spills, the fp8 weight tiles
    arrive by 16-byte cp.async copies (the software pipeline), fp8 × fp8 on QGMMA."""
    pytest.importorskip("triton")
    from breakgraph.kernels import triton_moe

    adt, silu, bn, tiles, bm, warps, stages, even = variant
    types = {"a_ptr": "*fp8e4nv" if adt == "fp8" else "*bf16", "as_ptr": "*fp32", "w_ptr": "*fp8e4nv",
             "ws_ptr": "*fp32", "shw_ptr": "*fp8e4nv", "shs_ptr": "*fp32", "c_ptr": "*bf16", "sorted_ptr": "*i32",
             "block_expert_ptr": "*i32", "num_blocks_ptr": "*i32"}  # fmt: skip
    constexprs = {"GATHER": silu, "SILU": silu, "W_FP8": True, "A_FP8": adt == "fp8", "EVEN": even, "BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": 128, "TILES_N": tiles, "SCALE_BN": 128,
                  "SCALE_BK": 128, "INTERP": False, "HAS_SHARED": True}  # fmt: skip
    info = compile_for_sm90(triton_moe._moe_stream_kernel, types, constexprs, warps, stages)
    print(variant, info)
    assert info["stack"] == 0 and info["local_insts"] == 0, info
    # weight and activation tiles by 16-byte copies; narrower ones only for the per-stage scales
    assert info["async_copies_16B"] > 0, info
    assert info["async_copies"] - info["async_copies_16B"] <= 3 * stages + 2, info
    if adt == "fp8":
        assert info["mma"] == ["QGMMA"], info


DECODE_AOT_VARIANTS = [  # (kernel, weights, split_k, BLOCK_N, BLOCK_K, warps, stages[, unroll])
    ("up", "fp8", 1, 16, 512, 4, 1, False),
    ("up", "fp8", 2, 16, 512, 4, 1, True),
    ("up", "fp8", 4, 16, 512, 4, 1, True),
    ("up", "fp8", 2, 8, 1024, 4, 1, True),
    ("up", "fp8", 1, 32, 256, 8, 1, False),
    ("up", "bf16", 2, 16, 512, 4, 1, True),
    ("down", "fp8", 1, 16, 512, 4, 1),
    ("down", "fp8", 2, 16, 512, 4, 1),
    ("down", "fp8", 1, 16, 1024, 4, 1),
    ("down", "fp8", 1, 32, 512, 8, 1),
    ("down", "fp8", 1, 64, 256, 8, 1),
    ("down", "bf16", 1, 16, 512, 4, 1),
]


def decode_kernel_resources(variant, scale_x: bool = True) -> dict:
    """sm_90a resource use of one decode-kernel variant (:data:`DECODE_AOT_VARIANTS` row),
    FP8 scales on the activations (``SCALE_X``, the default) or on every weight."""
    from breakgraph.kernels import triton_moe

    part, wdt, split, bn, bk, warps, stages, unroll = (*variant, True)[:8]
    fp8 = wdt == "fp8"
    wptr = "*fp8e4nv" if fp8 else "*bf16"
    common = {"W_FP8": fp8, "SPLIT_K": split, "BLOCK_N": bn, "BLOCK_K": bk, "TOP_K": 8, "HAS_SHARED": True,
              "SCALE_BN": 128 if fp8 else 1, "SCALE_BK": 128 if fp8 else 1, "SCALE_X": scale_x}  # fmt: skip
    if part == "up":  # GLM-5 TP8 rank: D = 6144 in SPLIT_K splits
        common |= {"K_PER_SPLIT": 6144 // split, "UNROLL": unroll}
    else:
        common["I"] = 256
    h = "*bf16" if split == 1 else "*fp32"
    if part == "up":
        fn = triton_moe._decode_up_kernel
        types = {"x_ptr": "*bf16", "ids_ptr": "*i64", "w_ptr": wptr, "ws_ptr": "*fp32", "shw_ptr": wptr,
                 "shs_ptr": "*fp32", "h_ptr": h}  # fmt: skip
    else:
        fn = triton_moe._decode_down_kernel
        types = {"h_ptr": h, "ids_ptr": "*i64", "tw_ptr": "*fp32", "w_ptr": wptr, "ws_ptr": "*fp32",
                 "shw_ptr": wptr, "shs_ptr": "*fp32", "res_ptr": "*bf16", "out_ptr": "*bf16"}  # fmt: skip
        common["HAS_RES"] = True
    return compile_for_sm90(fn, types, common, warps, stages)


@pytest.mark.parametrize(
    "variant,scale_x",
    # 16 × 512 down tiles: ptxas spills a few addresses with the scales on h (8 local accesses),
    # so the default takes 1024-wide steps there (decode_config)
    [(v, not (v[0] == "down" and v[1] == "fp8" and v[3] == 16 and v[4] == 512)) for v in DECODE_AOT_VARIANTS],
)
def test_moe_decode_kernels_compile_for_sm90_without_spills(variant, scale_x):
    pytest.importorskip("triton")
    info = decode_kernel_resources(variant, scale_x)
    print(variant, scale_x, info)
    assert info["stack"] == 0 and info["local_insts"] == 0, info


@pytest.mark.parametrize("variant", [DECODE_AOT_VARIANTS[2], DECODE_AOT_VARIANTS[8]])  # the one-token defaults
def test_moe_decode_kernels_scale_x_leaves_the_conversion_units(variant):
    """sm_90a: with the block scales on the activations the FP8 decode kernels convert each
    weight once (e4m3 → f16 → f32) instead of rounding each scaled weight to bf16 and back."""
    pytest.importorskip("triton")
    new, old = (decode_kernel_resources(variant, scale_x)["ops"] for scale_x in (True, False))

    def f2f(ops):
        return sum(n for op, n in ops.items() if op.startswith("F2F."))

    print(variant, sum(new.values()), sum(old.values()), f2f(new), f2f(old))
    assert f2f(new) == 0 < f2f(old) and sum(new.values()) < 0.7 * sum(old.values())


def test_moe_small_kernels_compile_for_sm90():
    pytest.importorskip("triton")
    from breakgraph.kernels import triton_moe as tm

    i32 = "*i32"
    cases = [
        (tm._route_kernel, {"scores_ptr": "*fp32", "bias_ptr": "*fp32", "w_out_ptr": "*fp32", "id_out_ptr": "*i64",
                            "scaling": "fp32"},
         {"TOP_K": 8, "K_P2": 8, "N_GROUP": 8, "G_P2": 8, "TOPK_GROUP": 4, "HAS_BIAS": True, "NORM": True,
          "BLOCK_T": 8, "E_P2": 256}),
        (tm._route_kernel, {"scores_ptr": "*fp32", "bias_ptr": "*fp32", "w_out_ptr": "*fp32", "id_out_ptr": "*i64",
                            "scaling": "fp32"},  # GLM-5: the sigmoid of the logits in the kernel
         {"TOP_K": 8, "K_P2": 8, "N_GROUP": 1, "G_P2": 1, "TOPK_GROUP": 1, "HAS_BIAS": True, "NORM": True,
          "BLOCK_T": 8, "E_P2": 256, "LOGITS": True}),
        (tm._align_count_kernel, {"ids_ptr": "*i64", "counts_ptr": i32, "sorted_ptr": i32, "tok_ptr": i32},
         {"TOP_K": 8, "SLOTS": 8, "BLOCK": 256}),
        (tm._align_count_kernel, {"ids_ptr": "*i64", "counts_ptr": i32, "sorted_ptr": i32, "tok_ptr": i32},
         {"TOP_K": 8, "SLOTS": 9, "BLOCK": 256}),  # with the shared expert's slot
        (tm._align_scatter_kernel, {"ids_ptr": "*i64"} | {n: i32 for n in tm._align_scatter_kernel.arg_names if n.endswith("_ptr") and n != "ids_ptr"},
         {"TOP_K": 8, "SLOTS": 9, "BLOCK": 256, "E_P2": 512, "BLOCK_M": 16, "WRITE_BLOCKS": True}),
        (tm._align_one_program_kernel, {"ids_ptr": "*i64"} | {n: i32 for n in tm._align_one_program_kernel.arg_names if n.endswith("_ptr") and n != "ids_ptr"},
         {"TOP_K": 8, "SLOTS": 9, "BLOCK": 256, "E_P2": 512, "BLOCK_M": 16, "WRITE_BLOCKS": True}),
        (tm._combine_kernel, {"y_ptr": "*bf16", "w_ptr": "*fp32", "pos_ptr": i32, "res_ptr": "*bf16", "out_ptr": "*bf16"},
         {"TOP_K": 8, "SLOTS": 8, "USE_POS": True, "HAS_RES": False, "BLOCK_D": 1024}),
        (tm._combine_kernel, {"y_ptr": "*bf16", "w_ptr": "*fp32", "pos_ptr": i32, "res_ptr": "*bf16", "out_ptr": "*bf16"},
         {"TOP_K": 8, "SLOTS": 9, "USE_POS": False, "HAS_RES": True, "BLOCK_D": 1024}),
        (tm._silu_mul_kernel, {"gu_ptr": "*bf16", "h_ptr": "*bf16"}, {"BLOCK_R": 16, "BLOCK_I": 128}),
    ]  # fmt: skip
    for fn, types, constexprs in cases:
        info = compile_for_sm90(fn, types, constexprs)
        assert info["stack"] == 0, (fn.__name__, info)
    # GLM-5 at decode: one single-warp program a row, its reductions inside the warp (no barrier
    # but the one after the loads)
    route_types, glm5 = cases[1][1], cases[1][2]
    info = compile_for_sm90(tm._route_kernel, route_types, glm5 | {"BLOCK_T": 1}, num_warps=1)
    assert info["stack"] == 0 and info["ops"].get("BAR.SYNC.DEFER_BLOCKING", 0) <= 1, info


def test_moe_decode_dequant_knob(monkeypatch):
    """By default (``BREAKGRAPH_MOE_DEQUANT=product``, measured faster on the H200) the decode
    kernels put the block scales on the activations; ``scaled`` scales every weight."""
    from breakgraph.kernels.triton_moe import decode_config

    def scale_x():
        cfg = decode_config(1, 8, 256, 6144, True)
        return cfg["up"]["SCALE_X"], cfg["down"]["SCALE_X"], cfg["down"]["BLOCK_K"]

    monkeypatch.delenv("BREAKGRAPH_MOE_DEQUANT", raising=False)
    assert scale_x() == (True, True, 1024)
    monkeypatch.setenv("BREAKGRAPH_MOE_DEQUANT", "scaled")
    assert scale_x() == (False, False, 512)


def test_moe_w8a8_knob_chooses_fp8_activations(monkeypatch):
    """W8A8 by default at every batch size; ``BREAKGRAPH_MOE_W8A8=0`` W8A16; ``auto`` is gone."""
    from breakgraph.kernels.triton_moe import moe_fp8_activations

    monkeypatch.delenv("BREAKGRAPH_MOE_W8A8", raising=False)
    assert moe_fp8_activations()
    monkeypatch.setenv("BREAKGRAPH_MOE_W8A8", "0")
    assert not moe_fp8_activations()
    monkeypatch.setenv("BREAKGRAPH_MOE_W8A8", "auto")
    with pytest.raises(ValueError, match="BREAKGRAPH_MOE_W8A8"):
        moe_fp8_activations()


def test_dispatchers_take_twins_on_cpu():
    logits = torch.randn(9, 32)
    bias = torch.randn(32)
    w, ids = route(logits, bias, 4, 4, 2, True, 2.5)
    w_ref, ids_ref = route_ref(logits, bias, 4, 4, 2, True, 2.5)
    assert torch.equal(ids, ids_ref) and torch.equal(w, w_ref)
    x = torch.randn(9, 64)
    w13, w2 = torch.randn(32, 64, 64), torch.randn(32, 64, 32)
    assert torch.equal(fused_moe(x, w13, w2, w, ids), fused_moe_ref(x, w13, w2, w, ids))


# --------------------------------------------------------------------------------------------
# GPU tests: GLM-5 TP8 rank (256 experts, D=6144, I=256, top-8)

E, D, INTER, TOP_K = moe_shape(PRESETS["glm5-tp8-rank"])  # GLM-5, one TP8 rank


@pytest.fixture(scope="module")
def glm5_experts():
    torch.manual_seed(0)
    w13 = torch.randn(E, 2 * INTER, D, device="cuda") / D**0.5
    w2 = torch.randn(E, D, INTER, device="cuda") / INTER**0.5
    w13_8, s13 = block_quant(w13)
    w2_8, s2 = block_quant(w2)
    return {"w13": w13.bfloat16(), "w2": w2.bfloat16(), "w13_8": w13_8, "s13": s13, "w2_8": w2_8, "s2": s2}


def _routing(t: int, skew: bool):
    logits = torch.randn(t, E, device="cuda")
    bias = torch.randn(E, device="cuda") * 0.1
    if skew:  # half the experts never chosen; the rest get ragged counts
        bias[torch.randperm(E, device="cuda")[: E // 2]] = -100.0
    return logits, bias


@pytest.mark.cuda
@pytest.mark.parametrize("t", [128, 1024, 8192])
@pytest.mark.parametrize("groups", [(1, 1), (8, 4)])
def test_route_gpu_selection_identical(t, groups):
    logits, bias = _routing(t, skew=False)
    w, ids = route(logits, bias, TOP_K, *groups, True, 2.5)
    w_ref, ids_ref = route_ref(logits, bias, TOP_K, *groups, True, 2.5)
    _assert_same_selection(ids, ids_ref, w, w_ref)


@pytest.mark.cuda
@pytest.mark.parametrize("t", [1, 16, 1024])
def test_route_sigmoid_in_kernel_is_torch_sigmoid_bit_for_bit(t):
    from breakgraph.kernels.triton_moe import route_select

    logits, bias = _routing(t, skew=False)
    logits = torch.cat([logits * 4, torch.linspace(-30, 30, logits.shape[1], device="cuda")[None]])  # tails too
    w, ids = route_select(logits, bias, TOP_K, 1, 1, True, 2.5, logits=True)
    w_torch, ids_torch = route_select(logits.sigmoid(), bias, TOP_K, 1, 1, True, 2.5)
    assert torch.equal(ids, ids_torch) and torch.equal(w, w_torch)


@pytest.mark.cuda
@pytest.mark.parametrize("t", [128, 1024, 8192])
@pytest.mark.parametrize("variant", ["bf16_grouped_mm", "bf16_triton", "fp8_w8a16", "fp8_w8a8"])
def test_fused_moe_gpu_glm5_shapes(glm5_experts, t, variant):
    from breakgraph.kernels.triton_moe import fused_moe_grouped_mm, fused_moe_triton

    g = glm5_experts
    x = torch.randn(t, D, device="cuda").bfloat16()
    logits, bias = _routing(t, skew=True)
    tw, ids = route(logits, bias, TOP_K, 1, 1, True, 2.5)
    counts = torch.bincount(ids.reshape(-1), minlength=E)
    assert (counts == 0).sum() >= E // 2
    if variant == "bf16_grouped_mm":
        got = fused_moe_grouped_mm(x, g["w13"], g["w2"], tw, ids)
        want = _oracle(x, g["w13"], g["w2"], tw, ids)
    elif variant == "bf16_triton":
        got = fused_moe_triton(x, g["w13"], g["w2"], tw, ids)
        want = _oracle(x, g["w13"], g["w2"], tw, ids)
    else:
        w8a8 = variant == "fp8_w8a8"
        got = fused_moe_triton(x, g["w13_8"], g["w2_8"], tw, ids, g["s13"], g["s2"], fp8_activations=w8a8)
        want = _oracle(x, g["w13_8"], g["w2_8"], tw, ids, g["s13"], g["s2"], quant_act=w8a8)
    assert got.dtype == torch.bfloat16 and got.shape == x.shape
    err = _rel(got, want)
    print(f"{variant} T={t}: rel err {err:.2e}")
    assert err < 2e-2


GPU_STREAM_CONFIGS = {  # (GEMM 1, GEMM 2) stream-kernel variants the GLM-5 test runs
    "w8a16": (False, {"BLOCK_N": 64, "num_stages": 4}, {"BLOCK_N": 128, "TILES_N": 4, "num_stages": 4}),
    "w8a16_deep": (False, {"BLOCK_N": 32, "num_stages": 6}, {"BLOCK_N": 128, "TILES_N": 8}),
    "w8a8": (True, {"BLOCK_N": 128, "num_stages": 4}, {"BLOCK_N": 64, "TILES_N": 4, "num_stages": 4}),
}  # fmt: skip


@pytest.mark.cuda
@pytest.mark.parametrize("t", [8, 64, 1024])
@pytest.mark.parametrize("variant", sorted(GPU_STREAM_CONFIGS))
def test_moe_stream_kernel_gpu_glm5_shapes(glm5_experts, t, variant):
    """The stream kernel at GLM-5 TP8-rank shapes against the fp32 oracle (quantising the
    activations for W8A8), skewed routing (half the experts empty, ragged counts)."""
    from breakgraph.kernels.triton_moe import fused_moe_triton

    g = glm5_experts
    w8a8, c1, c2 = GPU_STREAM_CONFIGS[variant]
    cfgs = ({"KERNEL": "stream", "BLOCK_M": 16, **c1}, {"KERNEL": "stream", "BLOCK_M": 16, **c2})
    x = torch.randn(t, D, device="cuda").bfloat16()
    tw, ids = route(*_routing(t, skew=True), TOP_K, 1, 1, True, 2.5)
    args = (g["w13_8"], g["w2_8"], tw, ids, g["s13"], g["s2"])
    got = fused_moe_triton(x, *args, fp8_activations=w8a8, configs=cfgs)
    err = _rel(got, _oracle(x, *args, quant_act=w8a8))
    print(f"stream {variant} T={t}: rel err {err:.2e}")
    assert err < 2e-2


@pytest.mark.cuda
@pytest.mark.parametrize("t", [16, 64])
def test_w8a16_gpu_glm5_shapes_rows_of_every_magnitude(glm5_experts, t):
    """W8A16 (every weight scaled) on the default tiles at GLM-5 TP8-rank shapes against the
    fp32 oracle, per token, with token rows scaled by 2⁻³⁰…2¹⁰; the worst error per scale is printed."""
    from breakgraph.kernels.triton_moe import fused_moe_triton

    g = glm5_experts
    exps = torch.arange(t, device="cuda") % 41 - 30  # 2⁻³⁰ … 2¹⁰
    x = (torch.randn(t, D, device="cuda") * 2.0 ** exps[:, None].float()).bfloat16()
    tw, ids = route(*_routing(t, skew=True), TOP_K, 1, 1, True, 2.5)
    args = (g["w13_8"], g["w2_8"], tw, ids, g["s13"], g["s2"])
    got = fused_moe_triton(x, *args, fp8_activations=False).float()
    want = _oracle(x, *args)
    err = (got - want).norm(dim=1) / want.norm(dim=1).clamp(min=1e-37)
    worst = {int(e): float(err[exps == e].max()) for e in exps.unique()}
    print(f"W8A16 T={t}: worst per-token rel err by row scale 2^e: "
          + " ".join(f"{e}:{v:.1e}" for e, v in sorted(worst.items())))  # fmt: skip
    assert err.max() < 2e-2, worst


@pytest.mark.cuda
@pytest.mark.parametrize("fp8", [False, True])
@pytest.mark.parametrize("t", [64, 512])
def test_fused_moe_dispatch_gpu_matches_twin(glm5_experts, fp8, t):
    """The dispatcher's choice (W8A8 by default) against the oracle that quantises the same
    way; bf16 against the twin."""
    from breakgraph.kernels.triton_moe import moe_fp8_activations

    g = glm5_experts
    x = torch.randn(t, D, device="cuda").bfloat16()
    tw, ids = route(*_routing(t, skew=True), TOP_K, 1, 1, True, 2.5)
    if fp8:
        args = (g["w13_8"], g["w2_8"], tw, ids, g["s13"], g["s2"])
        want = _oracle(x, *args, quant_act=moe_fp8_activations())
    else:
        args = (g["w13"], g["w2"], tw, ids)
        want = fused_moe_ref(x, *args)
    assert _rel(fused_moe(x, *args), want) < 2e-2


@pytest.mark.cuda
@pytest.mark.parametrize("fp8", [False, True])
def test_moe_layer_cuda_graph_replay(glm5_experts, fp8):
    """Routing + experts captured in one CUDA graph, replayed with new inputs."""
    g = glm5_experts
    t = 1024
    static_x = torch.randn(t, D, device="cuda").bfloat16()
    static_logits, bias = _routing(t, skew=True)

    def layer():
        tw, ids = route(static_logits, bias, TOP_K, 1, 1, True, 2.5)
        if fp8:
            return fused_moe(static_x, g["w13_8"], g["w2_8"], tw, ids, g["s13"], g["s2"])
        return fused_moe(static_x, g["w13"], g["w2"], tw, ids)

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):
            layer()
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = layer()
    for _ in range(3):
        static_x.copy_(torch.randn_like(static_x))
        static_logits.copy_(torch.randn_like(static_logits))
        graph.replay()
        torch.cuda.synchronize()
        eager = layer()
        assert _rel(static_out, eager) < 1e-6


@pytest.mark.cuda
@pytest.mark.parametrize("fp8", [False, True])
def test_fused_moe_custom_op_passes_opcheck(glm5_experts, fp8):
    """``breakgraph::fused_moe``, what torch.compile sees: schema, fake implementation and the
    kernel agree (torch.library.opcheck)."""
    g = glm5_experts
    t = 200
    x = torch.randn(t, D, device="cuda").bfloat16()
    tw, ids = route(*_routing(t, skew=True), TOP_K, 1, 1, True, 2.5)
    weights = (g["w13_8"], g["w2_8"], tw, ids, g["s13"], g["s2"]) if fp8 else (g["w13"], g["w2"], tw, ids, None, None)
    checks = {"test_utils": OPCHECK_FP8} if fp8 else {}  # else opcheck's default: every check
    torch.library.opcheck(torch.ops.breakgraph.fused_moe.default, (x, *weights, *[None] * 7, [128, 128]), **checks)
    if fp8:  # with the shared expert, the residual and x quantised by its producer
        from breakgraph.kernels.triton_fp8 import act_quant

        sh = glm5_shared_experts()
        res = torch.randn(t, D, device="cuda").bfloat16()
        xq, xs = act_quant(x, 128, column_major_scale=True, pad_rows=16)
        args = (x, *weights, sh.w13, sh.w2, sh.w13_scale, sh.w2_scale, res, xq, xs, [128, 128])
        torch.library.opcheck(torch.ops.breakgraph.fused_moe.default, args, **checks)


def glm5_shared_experts() -> SharedExpert:
    """A fresh random FP8 shared expert at GLM-5 TP8-rank shapes (seed 1), on CUDA."""
    torch.manual_seed(1)
    w13, s13 = block_quant(torch.randn(2 * INTER, D, device="cuda") / D**0.5)
    w2, s2 = block_quant(torch.randn(D, INTER, device="cuda") / INTER**0.5)
    return SharedExpert(w13, w2, s13, s2)


@pytest.fixture(scope="module")
def glm5_shared():
    return glm5_shared_experts()


@pytest.mark.cuda
@pytest.mark.parametrize("t", [1, 3, 16, 64, 128])
@pytest.mark.parametrize("fp8", [True, False])
def test_fused_moe_decode_gpu_glm5_shapes(glm5_experts, glm5_shared, t, fp8):
    """The decode kernels at GLM-5 TP8-rank shapes, routed + shared + residual, against the fp32
    oracle (FP8 weights dequantised exactly as the kernels do); every output row written."""
    from breakgraph.kernels.triton_moe import decode_config, fused_moe_decode

    g = glm5_experts
    x = torch.randn(t, D, device="cuda").bfloat16()
    res = torch.randn(t, D, device="cuda").bfloat16()
    tw, ids = route(*_routing(t, skew=t > 16), TOP_K, 1, 1, True, 2.5)
    if fp8:
        w = (g["w13_8"], g["w2_8"], tw, ids, g["s13"], g["s2"])
        shared = glm5_shared
        sh_ref = shared
    else:
        w = (g["w13"], g["w2"], tw, ids, None, None)
        sh = glm5_shared
        shared = SharedExpert(
            block_dequant(sh.w13, sh.w13_scale, (128, 128), torch.bfloat16),
            block_dequant(sh.w2, sh.w2_scale, (128, 128), torch.bfloat16),
        )
        sh_ref = SharedExpert(shared.w13.float(), shared.w2.float())
    want = _oracle(x, *w) + shared_expert_ref(x.float(), sh_ref) + res.float()
    for scale_x in (False, True) if fp8 else (False,):  # FP8 scales on every weight / on the activations
        cfg = decode_config(t, TOP_K, INTER, D, True, scale_x=scale_x)
        got = fused_moe_decode(x, *w, shared=shared, residual=res, config=cfg)
        err = _rel(got, want)
        print(f"decode fp8={fp8} SCALE_X={scale_x} T={t}: rel err {err:.2e}")
        assert got.dtype == torch.bfloat16 and err < 1e-2


@pytest.mark.cuda
@pytest.mark.parametrize("t", [1, 8, 9, 16, 64, 300])
def test_fused_moe_dispatch_decode_with_shared_matches_twin(glm5_experts, glm5_shared, t):
    """``fused_moe`` with ``shared`` and ``residual`` agrees with the twins on either side of
    ``DECODE_MAX_TOKENS``, taking the decode kernels up to it and above it the grouped GEMMs with
    the shared expert as one more expert (alignment in one program up to
    ``ALIGN_ONE_PROGRAM_PAIRS`` pairs: 300 tokens have more)."""
    from breakgraph.kernels.moe import folds_shared_expert, takes_decode_path
    from breakgraph.kernels.triton_moe import ALIGN_ONE_PROGRAM_PAIRS, DECODE_MAX_TOKENS

    assert 64 * (TOP_K + 1) <= ALIGN_ONE_PROGRAM_PAIRS < 300 * (TOP_K + 1)

    g = glm5_experts
    x = torch.randn(t, D, device="cuda").bfloat16()
    res = torch.randn(t, D, device="cuda").bfloat16()
    tw, ids = route(*_routing(t, skew=False), TOP_K, 1, 1, True, 2.5)
    args = (g["w13_8"], g["w2_8"], tw, ids, g["s13"], g["s2"])
    decode = takes_decode_path(x, g["w13_8"], g["w2_8"], ids, g["s13"], g["s2"], (128, 128), glm5_shared)
    assert decode == (t <= DECODE_MAX_TOKENS)
    assert folds_shared_expert(x, g["w13_8"], g["w2_8"], ids, g["s13"], g["s2"], (128, 128), glm5_shared)
    got = fused_moe(x, *args, shared=glm5_shared, residual=res)
    want = fused_moe_ref(x, *args) + shared_expert_ref(x, glm5_shared) + res
    # Above the bound the grouped GEMMs quantise the activations to e4m3 per 128 columns (W8A8,
    # ≈ 2.5 % from the bf16-activation twin on random data, as tests/test_kernels_fp8.py bounds
    # it): 2.1 % measured on the H200 when the shared expert ran through the FP8 dense linears.
    assert _rel(got, want) < (2e-2 if decode else 3e-2)
    if not decode:  # the same sum with the shared expert as a routed one, quantised like the kernels
        slot = torch.full((t, 1), E, device="cuda")
        w13_all = torch.cat([g["w13_8"], glm5_shared.w13[None]])
        w2_all = torch.cat([g["w2_8"], glm5_shared.w2[None]])
        s13_all = torch.cat([g["s13"], glm5_shared.w13_scale[None]])
        s2_all = torch.cat([g["s2"], glm5_shared.w2_scale[None]])
        oracle = _oracle(x, w13_all, w2_all, torch.cat([tw, torch.ones(t, 1, device="cuda")], 1),
                         torch.cat([ids, slot], 1), s13_all, s2_all, quant_act=True) + res.float()  # fmt: skip
        # the W8A8 bound of the interpreter checks against this oracle (1.0-1.2e-2 measured on an H100)
        assert _rel(got, oracle) < 2e-2


@pytest.mark.cuda
@pytest.mark.parametrize("dequant", ["scaled", "product"])
def test_moe_decode_cuda_graph_replay(glm5_experts, glm5_shared, dequant, monkeypatch):
    """Routing + decode kernels (shared + residual) captured in one CUDA graph, replayed with new
    inputs: same result as eager (FP8 scales on the weights, and on the activations)."""
    monkeypatch.setenv("BREAKGRAPH_MOE_DEQUANT", dequant)
    g = glm5_experts
    t = 4
    static_x = torch.randn(t, D, device="cuda").bfloat16()
    static_res = torch.randn(t, D, device="cuda").bfloat16()
    static_logits, bias = _routing(t, skew=False)

    def layer():
        tw, ids = route(static_logits, bias, TOP_K, 1, 1, True, 2.5)
        return fused_moe(static_x, g["w13_8"], g["w2_8"], tw, ids, g["s13"], g["s2"], shared=glm5_shared,
                         residual=static_res)  # fmt: skip

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):
            layer()
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = layer()
    for _ in range(3):
        static_x.copy_(torch.randn_like(static_x))
        static_res.copy_(torch.randn_like(static_res))
        static_logits.copy_(torch.randn_like(static_logits))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(static_out, layer()), "replay differs from eager (the kernels are deterministic)"


@pytest.mark.cuda
def test_fused_moe_decode_custom_op_passes_opcheck(glm5_experts, glm5_shared):
    g = glm5_experts
    t = 2
    x = torch.randn(t, D, device="cuda").bfloat16()
    res = torch.randn(t, D, device="cuda").bfloat16()
    tw, ids = route(*_routing(t, skew=False), TOP_K, 1, 1, True, 2.5)
    sh = glm5_shared
    args = (x, g["w13_8"], g["w2_8"], tw, ids, g["s13"], g["s2"], sh.w13, sh.w2, sh.w13_scale, sh.w2_scale, res,
            [128, 128])  # fmt: skip
    torch.library.opcheck(torch.ops.breakgraph.fused_moe_decode.default, args, test_utils=OPCHECK_FP8)


@pytest.mark.parametrize("fold", [False, True])
@pytest.mark.parametrize("fp8", [False, True])
def test_moe_block_folds_shared_expert_and_residual(monkeypatch, fold, fp8):
    """``MoE.forward(x, residual)`` = ``residual + routed(x) + shared(x)`` whether the shared
    expert and the residual go into the experts' call (the fold, forced here on the CPU,
    where the twins compute it) or are added after."""
    from breakgraph.layers.mlp import Experts, MoE
    from breakgraph.models.config import ModelConfig

    cfg = {"model_type": "glm_moe_dsa", "hidden_size": 256, "moe_intermediate_size": 128, "n_routed_experts": 8,
           "num_experts_per_tok": 2, "n_shared_experts": 1, "rope_parameters": {"rope_theta": 1e6}}  # fmt: skip
    if fp8:
        cfg["quantization_config"] = {"quant_method": "fp8", "weight_block_size": [128, 128]}
    moe = MoE(ModelConfig.from_dict(cfg), torch.float32)
    for p in moe.parameters():
        p.data.copy_((torch.randn_like(p.data, dtype=torch.float32) * 0.1).to(p.dtype))
    for p in (moe.experts.w13_scale, moe.experts.w2_scale, moe.shared_experts.gate_up_proj.weight_scale_inv,
              moe.shared_experts.down_proj.weight_scale_inv):  # fmt: skip
        if p is not None:
            p.data.uniform_(0.5, 1.5)
    assert (moe.experts.w13.dtype == FP8_DTYPE) == fp8
    seen = []
    monkeypatch.setattr(Experts, "folds_shared", lambda self, x, ids, shared: seen.append(shared) or fold)
    x, res = torch.randn(5, 256), torch.randn(5, 256)
    tw, ids = moe.gate(x)
    want = res + (moe.experts(x, tw, ids) + moe.shared_experts(x))
    got = moe(x, residual=res)
    assert seen and seen[-1] is not None, "the shared expert was offered to the experts' call"
    assert _rel(got, want) < 1e-6
    assert _rel(moe(x), want - res) < 1e-6


@pytest.mark.parametrize("groups", [8, 40])
def test_grouped_linear_fp32_matches_each_group_alone(groups):
    """The fp32 path (every-group product, or per-row weights past 32 groups) gives each row its
    own group's product, empty groups included."""
    from breakgraph.kernels import moe

    assert (groups <= moe._EVERY_GROUP_MAX) == (groups == 8)  # both paths are taken
    g = torch.Generator().manual_seed(groups)
    counts = torch.randint(0, 5, (groups,), generator=g)
    counts[1] = 0
    offsets = counts.cumsum(0).to(torch.int32)
    x = torch.randn(int(counts.sum()), 16, generator=g)
    weight = torch.randn(groups, 24, 16, generator=g)
    want = torch.cat([x[lo:hi] @ weight[e].T for e, (lo, hi) in enumerate(zip([0, *offsets[:-1].tolist()], offsets.tolist()))])
    got = moe.grouped_linear(x, weight, offsets)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.cuda
@pytest.mark.parametrize("t", [16, 300])
def test_moe_block_reads_the_norms_fp8_rows_on_gpu(t):
    """FP8 experts on CUDA above the decode kernels' bound: the MoE asks for ``x`` quantised
    (``takes_fp8_input``), and its output from the norm kernel's quantised rows is the output it
    gets quantising ``x`` itself, bit for bit (the two quantisations are the same)."""
    from breakgraph.kernels.norm import rms_norm_fp8
    from breakgraph.layers.mlp import MoE
    from breakgraph.models.config import ModelConfig

    cfg = {"model_type": "glm_moe_dsa", "hidden_size": 256, "moe_intermediate_size": 128, "n_routed_experts": 8,
           "num_experts_per_tok": 2, "n_shared_experts": 1, "rope_parameters": {"rope_theta": 1e6},
           "quantization_config": {"quant_method": "fp8", "weight_block_size": [128, 128]}}  # fmt: skip
    torch.manual_seed(t)
    moe = MoE(ModelConfig.from_dict(cfg), torch.bfloat16).cuda()
    for p in moe.parameters():
        p.data.copy_((torch.randn_like(p.data, dtype=torch.float32) * 0.1).to(p.dtype))
    for p in (moe.experts.w13_scale, moe.experts.w2_scale, moe.shared_experts.gate_up_proj.weight_scale_inv,
              moe.shared_experts.down_proj.weight_scale_inv):  # fmt: skip
        p.data.uniform_(0.5, 1.5)
    x = torch.randn(t, 256, device="cuda").bfloat16()
    res = torch.randn(t, 256, device="cuda").bfloat16()
    normed, h, x_fp8 = rms_norm_fp8(x, torch.rand(256, device="cuda").bfloat16() + 0.5, 1e-6, res)
    assert moe.takes_fp8_input(normed) and x_fp8 is not None
    with torch.no_grad():
        assert torch.equal(moe(normed, residual=h, x_fp8=x_fp8), moe(normed, residual=h))
