"""The FP8 latent KV cache: its layout, the quantising store and every attention kernel reading it.

CPU: the store kernel and the sparse / dense-causal / split-K attention kernels run under
Triton's interpreter in a child process (the pattern and interpreter fixes of
``test_kernels_attention.py``); the twins are checked directly. sm_90a: the FP8 variants compile
without spills. The FP8 indexer key cache (``BREAKGRAPH_INDEXER_FP8=1`` with the FP8 latent cache)
is checked the same ways. GPU (``-m cuda``): GLM-5 shapes at 8, 16 and 64 heads per rank, ragged requests
with cached prefixes, rows shorter and longer than ``index_topk``, decode with a short sequence in
a long-context pool; each prints its kernel-vs-twin figure.

Error bounds (‖out − ref‖ / ‖ref‖):
- store: under the interpreter the Triton kernel writes the twin's bytes exactly (codes, scales,
  RoPE part; the padding bytes of a row are unspecified); on the GPU the RoPE part is exact, the
  scales within 1e-6 and codes that differ are rare one-step neighbours (the act-quant rule of
  ``test_kernels_fp8.py``);
- round trip: per value ``|x − dq(q(x))| ≤ 2⁻⁴·|x| + 2⁻⁹·scale`` (e4m3: 3 mantissa bits; the
  second term covers subnormal codes);
- kernels on an FP8 cache, fp32 queries (interpreter): ≤ 1e-5 of the twin on the same cache;
- bf16 queries: ≤ 3× the error of rounding the fp32 twin's output to bf16 (the gather loop also
  rounds each dequantised value to bf16, the column-group kernel each scaled probability: one
  more rounding than on a bf16 cache);
- FP8 cache against the exact cache, same inputs: ≤ 5e-2 on Gaussian rows (quantisation).
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from cuda_capture import warmed_graph

triton = pytest.importorskip("triton")
tl = pytest.importorskip("triton.language")
sys.path.insert(0, str(Path(__file__).resolve().parent))

from test_kernels_attention import (  # noqa: E402
    _DECODE,
    _DENSE,
    _RAGGED,
    _fp32_reference,
    _install_interpreter_fixes,
    make_batch,
    mla_inputs,
    rel_err,
)

from breakgraph.kernels.latent_fp8 import (  # noqa: E402
    LatentLayout,
    dequantize_latent_ref,
    latent_views,
    quantize_latent_ref,
    store_latent,
    store_latent_ref,
)
from breakgraph.kernels.triton_sparse_mla import _e4m3_codes  # noqa: E402

# ---------------------------------------------------------------------------------------
# Layout and twins (plain CPU)
# ---------------------------------------------------------------------------------------


def test_glm5_row_is_deepseek_v32s_656_bytes_with_aligned_ranges():
    lay = LatentLayout(512, 64)
    assert (lay.groups, lay.scale_off, lay.pe_off, lay.row_bytes) == (4, 512, 528, 656)
    for r, dr in ((512, 64), (64, 16), (32, 16), (48, 16), (200, 64)):
        lay = LatentLayout(r, dr)
        assert lay.scale_off % 16 == 0 and lay.pe_off % 16 == 0 and lay.row_bytes % 16 == 0
        assert lay.pe_off + 2 * dr <= lay.row_bytes < lay.pe_off + 2 * dr + 16


def test_quantize_writes_the_layout_and_round_trips_within_e4m3():
    g = torch.Generator().manual_seed(0)
    kv = torch.randn(33, 576, generator=g) * torch.logspace(-3, 3, 33)[:, None]
    kv[3, 128:256] = 0.0  # an all-zero group
    kv[4, 5] = 1e4  # one outlier: the rest of its group goes subnormal
    rows = quantize_latent_ref(kv, 512)
    assert rows.dtype == torch.uint8 and rows.shape == (33, 656)
    c8, scales, pe = latent_views(rows, 512)
    amax = kv[:, :512].view(33, 4, 128).abs().amax(-1)
    assert torch.equal(scales, amax / 448.0), "scale = amax / 448, one per 128 values, at byte 512"
    assert torch.equal(rows[:, 512:528].view(torch.float32), scales)
    assert torch.equal(pe, kv[:, 512:].bfloat16()) and torch.equal(rows[:, 528:].view(torch.bfloat16), pe)
    assert (c8[3, 128:256].float() == 0).all() and scales[3, 1] == 0
    back = dequantize_latent_ref(rows, 512, torch.float32)
    x, err = kv[:, :512], (back[:, :512] - kv[:, :512]).abs()
    bound = 2**-4 * x.abs() + 2**-9 * scales.repeat_interleave(128, dim=1)
    assert bool((err <= bound).all()), float((err - bound).max())
    assert torch.equal(back[:, 512:], kv[:, 512:].bfloat16().float())


def test_store_latent_plain_cache_casts_and_fp8_cache_quantises():
    kv = torch.randn(5, 80)
    slots = torch.tensor([7, 2, 9, 4, 1])
    plain = torch.zeros(12, 80, dtype=torch.bfloat16)
    store_latent(plain, slots, kv, 64)
    assert torch.equal(plain[slots], kv.bfloat16()) and (plain[[0, 3, 5]] == 0).all()
    fp8 = torch.zeros(12, LatentLayout(64, 16).row_bytes, dtype=torch.uint8)
    store_latent(fp8, slots, kv, 64)
    assert torch.equal(fp8[slots], quantize_latent_ref(kv, 64)) and (fp8[[0, 3, 5]] == 0).all()


def test_twin_reads_an_fp8_cache_as_its_dequantised_rows():
    """The twin on an FP8 cache equals the twin on the dequantised cache (bit for bit), and
    stays within the quantisation bound of the twin on the exact cache."""
    from breakgraph.kernels.sparse_mla import sparse_mla_attention_ref

    batch = make_batch(**_RAGGED, page_size=4)
    q, kv, tk = mla_inputs(batch, 8, 64, 16, 12, torch.float32)
    rows = quantize_latent_ref(kv, 64)
    args = (tk, batch["page_table"], batch["token_req"], 4, 80**-0.5)
    got, deq, exact = (torch.empty(q.shape[0], 8, 64) for _ in range(3))
    sparse_mla_attention_ref(q, rows, *args, got)
    sparse_mla_attention_ref(q, dequantize_latent_ref(rows, 64, torch.float32), *args, deq)
    sparse_mla_attention_ref(q, kv, *args, exact)
    assert torch.equal(got, deq)
    assert rel_err(got, exact) <= 5e-2


# ---------------------------------------------------------------------------------------
# Interpreter checks (child process, TRITON_INTERPRET=1)
# ---------------------------------------------------------------------------------------


def _interp_store_kernel():
    """The Triton store writes the twin's bytes (several ranks and rope dims, fp32/bf16 rows,
    an all-zero group, shuffled slots; rows not written stay as they were)."""
    from breakgraph.kernels.triton_latent_fp8 import store_latent_triton

    g = torch.Generator().manual_seed(1)
    for rank, rope, dtype, block_t in ((512, 64, torch.float32, 4), (64, 16, torch.bfloat16, 4),
                                       (48, 16, torch.float32, 2), (200, 16, torch.bfloat16, 4)):  # fmt: skip
        kv = (torch.randn(9, rank + rope, generator=g) * torch.rand(9, 1, generator=g) * 5).to(dtype)
        kv[2, :rank] = 0
        slots = torch.tensor([5, 3, 11, 0, 7, 8, 1, 2, 9])
        width = LatentLayout(rank, rope).row_bytes
        want = torch.randint(0, 255, (13, width), generator=g, dtype=torch.uint8)
        got = want.clone()
        store_latent_ref(want, slots, kv, rank)
        store_latent_triton(*latent_views(got, rank), slots, kv, block_t=block_t)
        for a, b in zip(latent_views(got, rank), latent_views(want, rank)):  # padding bytes are unspecified
            assert torch.equal(a.view(torch.uint8), b.view(torch.uint8)), (rank, rope, dtype)
        untouched = torch.ones(13, dtype=torch.bool)
        untouched[slots] = False
        assert torch.equal(got[untouched], want[untouched])
        print(f"store r={rank} dr={rope} {dtype}: bytes equal")


def _interp_kernels_on_fp8_cache():
    """Sparse, split-K and dense-causal paths on an FP8 cache equal the twin on the same cache
    (fp32 queries: 1e-5), and with bf16 queries stay within 3× the output's bf16 rounding."""
    from breakgraph.kernels.sparse_mla import sparse_mla_attention_ref
    from breakgraph.kernels.triton_sparse_mla import sparse_mla_attention_triton

    cases = [  # (layout, page size, heads, rank, rope, K, dense, opts)
        (_RAGGED, 4, 8, 32, 16, 24, False, {}),  # the masked loop (K not a multiple of the key block)
        (_RAGGED, 1, 20, 48, 16, 16, False, {"block_h": 16}),  # r not a power of two
        (_DECODE, 3, 4, 200, 16, 40, False, {"num_splits": 2, "block_n": 16}),  # two scale groups, split-K
        (_DENSE, 4, 8, 32, 16, 12, True, {}),
        (_DENSE, 3, 8, 32, 16, 12, True, {"dense_block_t": 4, "dense_block_n": 16}),
        (_DENSE, 4, 40, 32, 16, 12, True, {}),  # 32-64 heads: 64-row head blocks
        (_RAGGED, 4, 8, 32, 16, 32, False, {"lean": True, "lazy": 8.0, "block_n": 16}),  # unmasked loop (r < 64)
        (_DENSE, 4, 8, 64, 16, 16, True, {"block_n": 16}),  # the few-heads default: column scales, 8-row heads
        (_RAGGED, 4, 5, 64, 16, 64, False, {"block_n": 64, "num_warps": 8}),  # 5 heads of 8 rows
        (_RAGGED, 4, 16, 512, 16, 32, False, {"block_n": 16}),  # four scale groups
        (_DECODE, 8, 8, 256, 16, 48, False, {"num_splits": 3, "block_n": 16}),  # two, split-K
        (_DENSE, 4, 8, 32, 16, 12, True, {"dense_balanced": True, "dense_block_n": 16, "dense_programs": 3}),  # the balanced kernel
    ]
    for i, (layout, ps, heads, rank, rope, topk, dense, opts) in enumerate(cases):
        batch = make_batch(**layout, page_size=ps, seed=60 + i)
        q, kv, tk = mla_inputs(batch, heads, rank, rope, topk, torch.float32, seed=60 + i)
        rows = quantize_latent_ref(kv * 3, rank)
        # Past the first six cases milder scales (bf16 queries against the fp32 twin lose more with sharper
        # softmaxes).
        scale = (rank + rope) ** -0.5 * (1.0 + i / 3 if i < 6 else 1.0 + (i - 6) / 6)
        rest = (tk, batch["page_table"], batch["token_req"], ps, scale)
        kw = dict(positions=batch["positions"], dense_below=topk, **opts) if dense else opts
        ref = torch.empty(q.shape[0], heads, rank)
        sparse_mla_attention_ref(q, rows, *rest, ref)
        out = torch.full_like(ref, float("nan"))
        sparse_mla_attention_triton(q, rows, *rest, out, **kw)
        err = rel_err(out, ref)
        print(f"fp8 cache case {i} fp32 H={heads} r={rank} {kw.keys()}: {err:.2e}")
        assert err <= 1e-5, (i, err)
        out = torch.full((q.shape[0], heads, rank), float("nan"), dtype=torch.bfloat16)
        sparse_mla_attention_triton(q.bfloat16(), rows, *rest, out, **kw)
        floor, err = rel_err(ref.bfloat16(), ref), rel_err(out, ref)
        print(f"fp8 cache case {i} bf16: {err:.2e} (bf16 floor {floor:.2e})")
        assert err <= 3 * floor, (i, err, floor)


def _interp_indexer_on_fp8_keys():
    """The FP8 indexer on the FP8 key cache reads the stored codes and scales: its scores equal
    the e4m3 emulation of the queries against the dequantised stored keys (1e-4), its top-k sets
    equal the twin's on that cache within FP8 score error."""
    from test_kernels_attention import check_topk, fp8_rows, indexer_inputs, indexer_scores_ref

    from breakgraph.kernels.indexer import indexer_topk_ref
    from breakgraph.kernels.triton_indexer import indexer_scores_triton, indexer_topk_triton

    for i, (layout, ps, heads, dim, topk, opts) in enumerate([
        (_RAGGED, 4, 8, 32, 12, {}), (_RAGGED, 2, 16, 64, 12, {"block_t": 2, "block_l": 16}),
        (_DECODE, 4, 8, 32, 20, {"block_l": 16, "key_programs": 2}),
    ]):  # fmt: skip
        batch = make_batch(**layout, page_size=ps, seed=70 + i)
        q, w, kc = indexer_inputs(batch, heads, dim, torch.bfloat16, seed=70 + i)
        keys = quantize_latent_ref(kc, dim)
        assert keys.shape[1] == dim + 16
        args = (batch["page_table"], batch["token_req"], batch["positions"], ps, dim**-0.5)
        max_len = batch["page_table"].shape[1] * ps
        emu = indexer_scores_ref(fp8_rows(q), w, dequantize_latent_ref(keys, dim, torch.float32), batch, dim**-0.5)
        fin = torch.isfinite(emu)
        out = torch.full((q.shape[0], max_len), float("nan"))
        indexer_scores_triton(q, w, keys, *args, out, fp8=True, **opts)
        assert torch.equal(~torch.isnan(out), fin), "written region is not each row's causal range"
        err = rel_err(out[fin], emu[fin])
        print(f"indexer on FP8 keys case {i}: vs emulation {err:.2e}")
        assert err <= 1e-4, (i, err)
        want = torch.empty(q.shape[0], topk, dtype=torch.int32)
        indexer_topk_ref(q, w, keys, *args, want)
        got = torch.full_like(want, -7)
        indexer_topk_triton(q, w, keys, *args, got, fp8=True, block_l=16)
        exact = indexer_scores_ref(q, w, dequantize_latent_ref(keys, dim, torch.float32), batch, dim**-0.5)
        check_topk(got, want, exact, batch["positions"], 0.15)


def test_indexer_reads_fp8_key_cache_interpreted():
    _run_interpreted_here("_interp_indexer_on_fp8_keys")


def test_fp8_key_cache_only_with_the_fp8_indexer(monkeypatch):
    """KVCache keeps bf16 indexer keys unless the FP8 latent cache meets BREAKGRAPH_INDEXER_FP8=1;
    the twin dispatch reads FP8 keys either way, the Triton scorer refuses them without fp8."""
    from tiny_models import glm5_config

    from breakgraph.engine.kv_cache import KVCache
    from breakgraph.kernels.indexer import indexer_topk, indexer_topk_ref
    from breakgraph.models.config import ModelConfig

    cfg = ModelConfig.from_dict(glm5_config().to_dict())
    cpu = torch.device("cpu")
    for env, latent, fp8_keys in (("0", torch.float8_e4m3fn, False), ("1", None, False), ("1", torch.float8_e4m3fn, True)):
        monkeypatch.setenv("BREAKGRAPH_INDEXER_FP8", env)
        cache = KVCache(cfg, 3, 4, torch.float32, cpu, latent)
        k = cache.indexer_k[0]
        assert cache.fp8_index_keys == fp8_keys
        assert (k.dtype, k.shape[1]) == ((torch.uint8, 48) if fp8_keys else (torch.float32, 32))
        per_token = cfg.num_hidden_layers * cache.latent[0].shape[1] * cache.latent[0].element_size()
        per_token += sum(cfg.has_indexer(i) for i in range(cfg.num_hidden_layers)) * k.shape[1] * k.element_size()
        assert KVCache.bytes_per_page(cfg, 4, torch.float32, latent) == 4 * per_token
    batch = make_batch(**_RAGGED, page_size=4)
    from test_kernels_attention import indexer_inputs

    q, w, kc = indexer_inputs(batch, 8, 32, torch.float32)
    keys = quantize_latent_ref(kc, 32)
    args = (batch["page_table"], batch["token_req"], batch["positions"], 4, 0.2)
    a, b = (torch.empty(q.shape[0], 8, dtype=torch.int32) for _ in range(2))
    indexer_topk(q, w, keys, *args, a)
    indexer_topk_ref(q, w, dequantize_latent_ref(keys, 32, torch.float32), *args, b)
    assert torch.equal(a, b)
    from breakgraph.kernels.triton_indexer import indexer_scores_triton

    with pytest.raises(ValueError, match="fp8=True"):
        indexer_scores_triton(q.bfloat16(), w, keys, *args, torch.empty(q.shape[0], 40), fp8=False)


def test_store_kernel_writes_the_twins_bytes_interpreted():
    _run_interpreted_here("_interp_store_kernel")


def test_attention_kernels_on_fp8_cache_match_twin_interpreted():
    _run_interpreted_here("_interp_kernels_on_fp8_cache")


def test_fp8_cache_takes_column_scales_at_few_heads(monkeypatch):
    """At 8 and 16 heads an FP8 cache takes the column-group kernel with its scales on the
    columns (8-row heads padded from 5, two stages; for bf16 queries the PTX conversion at 168
    registers, for fp16 Triton's cast uncapped) at prefill and decode, as the bf16 cache takes
    it (uncapped); where the lean loop
    does not fit (``K`` not a multiple of the key block) the masked gather loop, uncapped, and
    at 64 heads the gather loop with 64-row head blocks."""
    from breakgraph.kernels import triton_sparse_mla as tsm

    cpu = torch.device("cpu")
    for num, heads, dense in ((4096, 8, True), (8, 8, False), (4096, 16, True), (8, 16, False)):
        cfg = tsm.default_config(num, heads, 2048, cpu, dense=dense, kv_fp8=True)
        got = cfg["groups"], cfg["block_h"], cfg["num_stages"], cfg["lean"], cfg["lazy"]
        assert got == (4, heads, 2, True, 8.0), (num, heads, cfg)
        assert cfg["num_splits"] == (1 if dense else 16), cfg
    cfg = tsm.default_config(4096, 64, 2048, cpu, dense=True, kv_fp8=True)
    assert (cfg["groups"], cfg["block_h"], cfg["lean"]) == (1, 64, False), cfg
    assert tsm.default_config(4096, 8, 2048, cpu, dense=True)["block_h"] == 8  # bf16 cache: 8-row heads too

    launches = []

    def record(name):
        class Record:  # stands in for a Triton kernel: records each launch's constexprs
            def __getitem__(self, grid):
                return lambda *args, **kw: launches.append((name, grid, kw))

        return Record()

    for name in ("_sparse_mla_groups_kernel", "_sparse_mla_fwd_kernel", "_topk_slots_kernel", "_sparse_mla_merge_kernel"):
        monkeypatch.setattr(tsm, name, record(name))

    def launch(heads, topk, fp8, dtype=torch.bfloat16):
        batch = make_batch(**_RAGGED, page_size=4)
        q, kv, tk = mla_inputs(batch, heads, 512, 64, topk, dtype)
        cache = quantize_latent_ref(kv.float(), 512) if fp8 else kv
        launches.clear()
        tsm.sparse_mla_attention_triton(q, cache, tk, batch["page_table"], batch["token_req"], 4, 0.1,
                                        torch.empty(q.shape[0], heads, 512, dtype=dtype))  # fmt: skip
        name, grid, kw = next(x for x in launches if x[0] in ("_sparse_mla_groups_kernel", "_sparse_mla_fwd_kernel"))
        return name, grid[1], kw["BLOCK_H"], kw["KV_FP8"], kw.get("CVT_ASM"), kw.get("LEAN"), kw["maxnreg"]

    groups, fwd = "_sparse_mla_groups_kernel", "_sparse_mla_fwd_kernel"
    assert launch(5, 64, True) == (groups, 1, 8, True, True, None, tsm.COLUMNS_MAXNREG)
    assert launch(16, 64, True) == (groups, 1, 16, True, True, None, tsm.COLUMNS_MAXNREG)
    assert launch(8, 64, False) == (groups, 1, 8, False, False, None, None)
    assert launch(8, 64, True, torch.float16) == (groups, 1, 8, True, False, None, None)  # Triton's cast: uncapped
    assert launch(8, 40, True) == (fwd, 1, 16, True, None, False, None)  # 40 keys: no whole 32-key blocks
    assert launch(64, 64, True) == (fwd, 1, 64, True, None, False, None)


def _run_interpreted_here(check: str) -> None:
    import os
    import subprocess

    env = dict(os.environ, TRITON_INTERPRET="1")
    r = subprocess.run([sys.executable, __file__, check], env=env, capture_output=True, text=True, timeout=900, check=False)
    assert r.returncode == 0, f"{check} failed under the Triton interpreter:\n{r.stdout}\n{r.stderr[-6000:]}"


# ---------------------------------------------------------------------------------------
# sm_90a: the FP8 variants compile without spills
# ---------------------------------------------------------------------------------------

RANK, ROPE, TOPK, PAGE = 512, 64, 2048, 64
GLM5_SCALE = (192 + 64) ** -0.5


@pytest.mark.parametrize("heads", [8, 16, 64])
@pytest.mark.parametrize("phase", ["prefill", "decode"])
def test_fp8_cache_kernels_compile_for_sm90_without_spills(heads, phase):
    """ptxas for sm_90a at the default configs on an FP8 cache (prefill with the dense-block
    check; decode with split-K): at few heads the column-group kernel with its scales on the
    columns, capped at ``COLUMNS_MAXNREG``, spills nothing inside its key loop, and (8 heads)
    its e4m3 conversion in inline PTX takes fewer instructions per loop trip than Triton's cast
    (which the layout pass repeats in each dot's operand layout; uncapped, as it is launched);
    the gather loop (64 heads; at 8 the fallback where the lean loop does not fit) spills
    nothing, the chunked dense-causal kernel at most 128 bytes (its bf16-cache bound), the
    balanced one nothing inside its key loop."""
    from test_kernels_fp8 import compile_for_sm90

    from breakgraph.kernels import triton_dense_mla as tdm
    from breakgraph.kernels import triton_sparse_mla as tsm

    num = 4096 if phase == "prefill" else 8
    cfg = tsm.default_config(num, heads, TOPK, torch.device("cpu"), dense=phase == "prefill", kv_fp8=True)
    dense = tdm.dense_config(heads, page_size=16)
    split = cfg["num_splits"] > 1
    assert split == (phase == "decode")
    a = dict(
        Q="*bf16", KV="*u8", TOPK="*i32", PAGE_TABLE="*i32", TOKEN_REQ="*i64", POSITIONS="*i64", OUT="*bf16",
        WS_O="*fp32", WS_LSE="*fp32", stride_qt=heads * 576, stride_qh=576, stride_kv=656, stride_tk=TOPK,
        stride_pt=37, stride_ot=heads * RANK, stride_oh=RANK, num_tokens=num - 1, num_heads=heads, topk=TOPK,
        rank=RANK, rope_dim=ROPE, page_size=16, keys_per_split=TOPK // cfg["num_splits"], num_splits=cfg["num_splits"],
        dense_below=TOPK, qk_scale=0.1, chunk_keys=512, num_chunks=4, START="*i32", num_blocks=512, page_shift=4,
    )  # fmt: skip
    consts = dict(BLOCK_H=cfg["block_h"], BLOCK_N=cfg["block_n"], BLOCK_R=RANK, BLOCK_PE=ROPE, SPLIT=split,
                  DENSE_T=0 if split else dense["block_t"], KV_FP8=True, LAZY=cfg["lazy"])  # fmt: skip
    assert (cfg["groups"] == 4) == (heads <= 16), cfg
    if heads <= 16:  # the column-group kernel, its scales on the columns, 168 registers
        layout = LatentLayout(RANK, ROPE)
        groups = consts | dict(SCALE_OFF=layout.scale_off, PE_OFF=layout.pe_off)
        info = compile_for_sm90(tsm._sparse_mla_groups_kernel, a, groups | dict(CVT_ASM=True), cfg["num_warps"],
                                cfg["num_stages"], tsm.COLUMNS_MAXNREG)  # fmt: skip
        print(f"column scales H={heads} {phase} {cfg}: {info}")
        # capped: a few bytes on the stack at prefill, none touched inside the key loop
        assert info["regs"] <= tsm.COLUMNS_MAXNREG and info["stack"] <= 16 and info["mma_loop_spills"] == 0, info
    if heads == 8:
        cast = compile_for_sm90(tsm._sparse_mla_groups_kernel, a, groups, cfg["num_warps"], cfg["num_stages"])
        print(f"  with Triton's cast: {cast}")
        assert info["loop_insts"] < cast["loop_insts"], (info, cast)
    if heads != 16:  # 64 heads; at 8 the launcher's fallback where the lean loop does not fit (16-row heads)
        consts |= dict(BLOCK_H=max(16, cfg["block_h"]))
        info = compile_for_sm90(tsm._sparse_mla_fwd_kernel, a, consts, cfg["num_warps"], cfg["num_stages"], None)
        print(f"sparse H={heads} {phase} {cfg}: {info}")
        assert info["stack"] == 0 and info["local_insts"] == 0, info
    if phase == "prefill":
        consts = dict(BLOCK_T=dense["block_t"], HEADS=dense["heads"], BLOCK_M=tdm._pow2(dense["block_t"] * dense["heads"]),
                      BLOCK_N=dense["block_n"], BLOCK_R=RANK, BLOCK_PE=ROPE, SPLIT=False, PAGE_BLOCKS=True,
                      KV_FP8=True)  # fmt: skip
        info = compile_for_sm90(tdm._dense_mla_fwd_kernel, a, consts, dense["num_warps"], dense["num_stages"])
        print(f"dense H={heads} {dense}: {info}")
        # as on the bf16 cache (tests/test_kernels_attention.py): at most 128 bytes on the stack
        assert info["stack"] <= 128 and info["mma"] == ["HGMMA"], info
        bal = tdm.balanced_config(heads)
        consts = dict(BLOCK_T=bal["block_t"], HEADS=bal["heads"], BLOCK_M=tdm._pow2(bal["block_t"] * bal["heads"]),
                      BLOCK_N=bal["block_n"], BLOCK_R=RANK, BLOCK_PE=ROPE, POW2_PAGE=True, ROW32=True,
                      KV_FP8=True)  # fmt: skip
        info = compile_for_sm90(tdm._dense_mla_balanced_kernel, a, consts, bal["num_warps"], bal["num_stages"])
        print(f"balanced dense H={heads} {bal}: {info}")
        assert info["mma_loop_spills"] == 0 and info["mma"] == ["HGMMA"], info


@pytest.mark.parametrize("num, reqs", [(4096, 1), (64, 64)])
def test_fp8_key_scores_compile_for_sm90_no_worse_than_in_kernel_quantisation(num, reqs):
    """The score kernel reading stored FP8 keys (``FP8 = 2``) spills no more than the one that
    quantises bf16 keys in registers (``FP8 = 1``), at the default configs."""
    from test_kernels_fp8 import compile_for_sm90

    from breakgraph.kernels.triton_indexer import _indexer_scores_kernel, default_config

    info = {}
    for fp8, k_type, stride_k in ((1, "*bf16", 128), (2, "*u8", 144)):
        cfg = default_config(num, reqs, 32, 4096, torch.device("cpu"), fp8)
        a = dict(Q="*bf16", W="*fp32", K=k_type, PAGE_TABLE="*i32", TOKEN_REQ="*i64", POSITIONS="*i64",
                 SCORES="*fp32", stride_qt=32 * 128, stride_qh=128, stride_wt=32, stride_k=stride_k, stride_pt=37,
                 stride_st=4096, num_tokens=num, num_heads=32, head_dim=128, page_size=64, skip_below=2048,
                 scale=0.088, segments=1)  # fmt: skip
        consts = dict(BLOCK_T=cfg["block_t"], BLOCK_H=32, BLOCK_D=128, BLOCK_L=cfg["block_l"], FP8=fp8,
                      STACKED=cfg["stacked"], PAGE_SHIFT=6, ROWS_I32=True)  # fmt: skip
        info[fp8] = compile_for_sm90(_indexer_scores_kernel, a, consts, cfg["num_warps"], cfg["num_stages"], cfg["maxnreg"])
    print(f"indexer scores T={num}: in-kernel quantisation {info[1]}, stored FP8 keys {info[2]}")
    assert info[2]["stack"] <= info[1]["stack"] and "QGMMA" in info[2]["mma"], info


# ---------------------------------------------------------------------------------------
# GPU: GLM-5 shapes
# ---------------------------------------------------------------------------------------

# name → (prefix_lens, extend_lens, page-table width in tokens)
GPU_LAYOUTS = {
    "prefill1024+3k": ([3072], [1024], 0),  # cached prefix: every row longer than K
    "ragged4096": ([0, 1000, 2500], [2000, 1097, 999], 0),  # rows shorter and longer than K, blocks straddling
    "decode64": ([int(x) for x in torch.randint(100, 8000, (64,), generator=torch.Generator().manual_seed(5))],
                 [1] * 64, 0),  # fmt: skip
    "decode_short_in_200k_pool": ([700, 3000], [1, 1], 200_000),
}


def _gpu_case(layout: str, heads: int, seed: int):
    prefix, extend, width = GPU_LAYOUTS[layout]
    batch = make_batch(prefix, extend, page_size=PAGE, device="cuda", seed=seed)
    if width:  # the page table as wide as a long configured context, the rest pointing at page 0
        table = torch.zeros(len(prefix), -(-width // PAGE), dtype=torch.int32, device="cuda")
        table[:, : batch["page_table"].shape[1]] = batch["page_table"]
        batch["page_table"] = table
    q, kv, tk = mla_inputs(batch, heads, RANK, ROPE, TOPK, torch.bfloat16, device="cuda", seed=seed)
    rows = torch.zeros(kv.shape[0], 656, dtype=torch.uint8, device="cuda")
    store_latent(rows, torch.arange(kv.shape[0], device="cuda"), kv, RANK)  # the Triton store
    decode = layout.startswith("decode")
    kw = dict(positions=batch["positions"], dense_below=0 if decode else TOPK)
    return batch, q, kv, rows, tk, kw


@pytest.mark.cuda
def test_store_kernel_matches_twin_on_gpu():
    g = torch.Generator(device="cuda").manual_seed(3)
    kv = torch.randn(5000, 576, generator=g, device="cuda").bfloat16() * 4
    slots = torch.randperm(6000, device="cuda")[:5000]
    got = torch.zeros(6000, 656, dtype=torch.uint8, device="cuda")
    want = got.clone()
    store_latent(got, slots, kv, RANK)
    store_latent_ref(want, slots, kv, RANK)
    (c8, s, pe), (c8_ref, s_ref, pe_ref) = latent_views(got, RANK), latent_views(want, RANK)
    assert torch.equal(pe, pe_ref)
    torch.testing.assert_close(s, s_ref, rtol=1e-6, atol=0)
    # As in test_kernels_fp8.py's act-quant check: the GPU's e4m3 conversion and torch's may land
    # on either side of a rounding boundary; such codes must be rare one-step neighbours.
    codes, ref = c8.view(torch.uint8), c8_ref.view(torch.uint8)
    same = (codes == ref).float().mean().item()
    differ = codes != ref
    print(f"store on GPU: {same:.6f} of e4m3 codes equal the twin's, scales equal: {torch.equal(s, s_ref)}")
    assert same > 0.999 and bool(((codes[differ].int() - ref[differ].int()).abs() == 1).all()), same


@triton.jit
def _convert_e4m3(CODES, OUT, ASM: tl.constexpr):
    offs = tl.arange(0, 16)[:, None] * 16 + tl.arange(0, 16)[None, :]
    tl.store(OUT + offs, _e4m3_codes(tl.load(CODES + offs), tl.bfloat16, ASM))


@pytest.mark.cuda
def test_e4m3_codes_in_ptx_equal_the_cast_on_gpu():
    """The column-group kernel's inline-PTX conversion gives every e4m3 code's value exactly
    (zeros, subnormals, ±448; the NaN codes stay NaN), as torch's cast does."""
    codes = torch.arange(256, dtype=torch.uint8, device="cuda")
    want = codes.view(torch.float8_e4m3fn).to(torch.bfloat16)
    for asm in (True, False):
        out = torch.empty(256, dtype=torch.bfloat16, device="cuda")
        _convert_e4m3[(1,)](codes, out, ASM=asm)
        assert torch.equal(out.isnan(), want.isnan()), asm
        fin = ~want.isnan()
        assert torch.equal(out[fin].view(torch.int16), want[fin].view(torch.int16)), asm


@pytest.mark.cuda
@pytest.mark.parametrize("opts", [{}, {"block_h": 16}, {"block_n": 64}, {"block_n": 64, "maxnreg": 0},
                                  {"maxnreg": 0}, {"lean": False}])  # fmt: skip
@pytest.mark.parametrize("layout", ["ragged4096", "decode_short_in_200k_pool"])
def test_fp8_cache_lean_variants_glm5_shapes_on_gpu(layout, opts):
    """The FP8 cache at 8 heads as the engine calls it: the default (the column-group kernel,
    its scales on the columns, 168 registers), with 16-row head blocks, 64-key blocks (capped and
    not), no cap, and the masked gather loop (the fallback where the lean loop does not fit):
    within 3× the bf16 output rounding of the fp32 twin on the same cache."""
    from breakgraph.kernels.sparse_mla import sparse_mla_attention_ref
    from breakgraph.kernels.triton_sparse_mla import sparse_mla_attention_triton

    batch, q, kv, rows, tk, kw = _gpu_case(layout, 8, seed=11)
    rest = (tk, batch["page_table"], batch["token_req"], PAGE, GLM5_SCALE)
    out = torch.full((q.shape[0], 8, RANK), float("nan"), dtype=torch.bfloat16, device="cuda")
    sparse_mla_attention_triton(q, rows, *rest, out, **kw, **opts)
    ref = torch.empty(q.shape[0], 8, RANK, device="cuda")
    with _fp32_reference():
        sparse_mla_attention_ref(q.float(), rows, *rest, ref)
    floor, err = rel_err(ref.bfloat16(), ref), rel_err(out, ref)
    assert err <= 3 * floor, f"error {err:.2e} vs bf16 rounding floor {floor:.2e}"


@pytest.mark.cuda
@pytest.mark.parametrize("heads", [8, 16, 64])
@pytest.mark.parametrize("layout", list(GPU_LAYOUTS))
def test_kernels_on_fp8_cache_match_twin_glm5_shapes_on_gpu(heads, layout, monkeypatch):
    """As the engine calls it (prefill: positions and ``dense_below = K``; decode: split-K):
    Triton on the FP8 cache within 3× the bf16 output rounding of the fp32 twin on the same
    cache, and within the quantisation bound of the kernel on the bf16 cache."""
    import breakgraph.kernels.triton_sparse_mla as tsm
    from breakgraph.kernels.sparse_mla import sparse_mla_attention, sparse_mla_attention_ref

    calls = []
    real = tsm.sparse_mla_attention_triton
    monkeypatch.setattr(tsm, "sparse_mla_attention_triton", lambda *a, **k: (calls.append(1), real(*a, **k)))
    batch, q, kv, rows, tk, kw = _gpu_case(layout, heads, seed=heads)
    rest = (tk, batch["page_table"], batch["token_req"], PAGE, GLM5_SCALE)
    out = torch.full((q.shape[0], heads, RANK), float("nan"), dtype=torch.bfloat16, device="cuda")
    sparse_mla_attention(q, rows, *rest, out, **kw)
    assert calls, "the dispatcher did not take the Triton path for the FP8 cache"
    ref = torch.empty(q.shape[0], heads, RANK, device="cuda")
    with _fp32_reference():
        sparse_mla_attention_ref(q.float(), rows, *rest, ref)
    on_bf16 = torch.empty_like(out)
    sparse_mla_attention(q, kv, *rest, on_bf16, **kw)
    floor, err, vs_bf16 = rel_err(ref.bfloat16(), ref), rel_err(out, ref), rel_err(out, on_bf16)
    print(f"fp8 cache H={heads} {layout}: kernel vs twin {err:.2e} (bf16 floor {floor:.2e}); vs bf16 cache {vs_bf16:.2e}")
    assert err <= 3 * floor, f"error {err:.2e} vs bf16 rounding floor {floor:.2e}"
    assert vs_bf16 <= 5e-2


@pytest.mark.cuda
@pytest.mark.parametrize("layout", ["ragged4096", "decode64"])
def test_fp8_indexer_on_fp8_key_cache_glm5_shapes_on_gpu(layout, monkeypatch):
    """BREAKGRAPH_INDEXER_FP8=1 on stored FP8 keys (Hi = 32, Di = 128): scores equal the e4m3
    emulation against the dequantised keys (1e-3) and the top-k sets the twin's on that cache
    within FP8 score error."""
    from test_kernels_attention import (
        IDX_DIM,
        IDX_HEADS,
        check_topk,
        fp8_rows,
        indexer_inputs,
        indexer_scores_ref,
    )

    from breakgraph.kernels.indexer import indexer_topk, indexer_topk_ref
    from breakgraph.kernels.triton_indexer import indexer_scores_triton

    monkeypatch.setenv("BREAKGRAPH_INDEXER_FP8", "1")
    prefix, extend, _ = GPU_LAYOUTS[layout]
    batch = make_batch(prefix, extend, page_size=PAGE, device="cuda", seed=9)
    q, w, kc = indexer_inputs(batch, IDX_HEADS, IDX_DIM, torch.bfloat16, device="cuda", seed=9)
    keys = torch.zeros(kc.shape[0], IDX_DIM + 16, dtype=torch.uint8, device="cuda")
    store_latent(keys, torch.arange(kc.shape[0], device="cuda"), kc, IDX_DIM)
    args = (batch["page_table"], batch["token_req"], batch["positions"], PAGE, IDX_DIM**-0.5)
    deq = dequantize_latent_ref(keys, IDX_DIM, torch.float32)
    with _fp32_reference():
        emu = indexer_scores_ref(fp8_rows(q), w, deq, batch, IDX_DIM**-0.5, dtype=torch.float32)
        exact = indexer_scores_ref(q, w, deq, batch, IDX_DIM**-0.5, dtype=torch.float32)
    scores = torch.full((q.shape[0], batch["page_table"].shape[1] * PAGE), float("nan"), device="cuda")
    indexer_scores_triton(q, w, keys, *args, scores, fp8=True)
    fin = torch.isfinite(emu)
    err = rel_err(scores[fin], emu[fin])
    print(f"fp8 cache indexer keys {layout}: scores vs emulation {err:.2e}")
    assert err <= 1e-3
    got = torch.full((q.shape[0], TOPK), -7, dtype=torch.int32, device="cuda")
    want = torch.empty_like(got)
    indexer_topk(q, w, keys, *args, got)
    with _fp32_reference():
        indexer_topk_ref(q, w, keys, *args, want)
    check_topk(got, want, exact.double(), batch["positions"], 0.15)


@pytest.mark.cuda
def test_fp8_cache_step_replays_in_cuda_graph():
    """Store + attention on the FP8 cache captured once, replayed on new inputs, equals eager."""
    from breakgraph.kernels.sparse_mla import sparse_mla_attention

    batch, q, kv, rows, tk, kw = _gpu_case("ragged4096", 8, seed=1)
    slots = torch.arange(kv.shape[0], device="cuda")
    out = torch.empty(q.shape[0], 8, RANK, dtype=torch.bfloat16, device="cuda")

    def step():
        store_latent(rows, slots, kv, RANK)
        sparse_mla_attention(q, rows, tk, batch["page_table"], batch["token_req"], PAGE, GLM5_SCALE, out, **kw)

    graph = warmed_graph(step)
    kv.copy_(torch.randn_like(kv))
    q.copy_(torch.randn_like(q))
    out.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    got, got_rows = out.clone(), rows.clone()
    step()
    torch.cuda.synchronize()
    assert torch.equal(got_rows, rows) and torch.equal(got, out) and not torch.isnan(got).any()


if __name__ == "__main__":  # child process of the interpreter checks
    _install_interpreter_fixes()
    globals()[sys.argv[1]]()
