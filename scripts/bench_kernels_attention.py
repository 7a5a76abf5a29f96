"""Micro-benchmark of the sparse MLA attention and DSA indexer kernels on GLM-5 shapes.

    python scripts/bench_kernels_attention.py             # table on the GPU
    python scripts/bench_kernels_attention.py --sweep     # also try block configs, report the best
    python scripts/bench_kernels_attention.py --twin      # also time the plain-PyTorch twins
    python scripts/bench_kernels_attention.py --variants --heads 8  # sparse MLA loop variants vs default
    python scripts/bench_kernels_attention.py --aot       # no GPU needed: compile for sm_90 and
                                                          # print registers / spills / shared memory
    python scripts/bench_kernels_attention.py --only mla --kv-cache-dtype bfloat16 fp8_e4m3
                                                          # sparse MLA on a bf16 and an FP8 latent cache
    python scripts/bench_kernels_attention.py --only topk # top-k select variants, exactness checked

Every row prints the physical floor next to the time: ``max(bytes / 4.3 TB/s, flops / peak)``
(H200: 4.3 TB/s copy, ~790 TFLOP/s bf16 dense, ~2× that in FP8). Bytes count each unique
cache row once (the HBM minimum); "gathered" counts every row a kernel loads (through L2:
keys shared by neighbouring tokens are re-read). Times are medians of CUDA-graph replays.
"""

# ruff: noqa: C408 — keyword dict() mirrors the kernels' argument names

from __future__ import annotations

import argparse
import itertools
import sys
import time
from functools import partial
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

HBM_TBS, BF16_TFLOPS, FP8_TFLOPS = 4.3, 790.0, 1580.0
RANK, ROPE, TOPK, IDX_HEADS, IDX_DIM, PAGE = 512, 64, 2048, 32, 128, 64
GLM5_SCALE = (192 + 64) ** -0.5

# name → (prefix_lens, extend_lens[, page-table width in tokens])
LAYOUTS = {
    "prefill 1k": ([0], [1024]),
    "prefill 2k": ([0], [2048]),  # every token below K: all dense-causal
    "prefill 1k (+3k prefix)": ([3072], [1024]),
    "prefill 4k": ([0], [4096]),
    "prefill 8k (2×4k)": ([0, 0], [4096, 4096]),
    "prefill 8k": ([0], [8192]),
    "prefill 16k": ([0], [16384]),
    "prefill 2k (+30k prefix)": ([30720], [2048]),
    "decode B=1 (L=1k, 8k pool)": ([1023], [1], 8192),
    "decode B=1 (L=1k, 200k pool)": ([1023], [1], 200_000),
    "decode B=64 (L~4k)": ([4000 + 37 * i for i in range(64)], [1] * 64),
    "decode B=64 (L~16k)": ([16000 + 37 * i for i in range(64)], [1] * 64),
    "decode B=1 (L~8k)": ([8191], [1]),
    "decode B=16 (L~8k)": ([7500 + 41 * i for i in range(16)], [1] * 16),
    "decode B=64 (L~8k)": ([7000 + 19 * i for i in range(64)], [1] * 64),
}


def make_batch(prefix_lens, extend_lens, width=0, device="cuda", seed=0):
    g = torch.Generator().manual_seed(seed)
    page_size = PAGE
    seq = [p + e for p, e in zip(prefix_lens, extend_lens)]
    npages = [-(-n // page_size) for n in seq]
    total = 1 + sum(npages)
    perm = (torch.randperm(total - 1, generator=g) + 1).tolist()
    table = torch.zeros(len(seq), max(max(npages), -(-width // page_size)), dtype=torch.int32)
    used = 0
    for b, n in enumerate(npages):
        table[b, :n] = torch.tensor(perm[used : used + n], dtype=torch.int32)
        used += n
    req = torch.cat([torch.full((e,), b, dtype=torch.int64) for b, e in enumerate(extend_lens)])
    pos = torch.cat([torch.arange(p, p + e, dtype=torch.int64) for p, e in zip(prefix_lens, extend_lens)])
    return {
        "page_table": table.to(device),
        "token_req": req.to(device),
        "positions": pos.to(device),
        "num_slots": total * page_size,
    }


def random_topk(positions, topk, max_len, seed=0):
    """Causal top-k positions (random subset, the token itself included), -1 padded."""
    g = torch.Generator(device=positions.device).manual_seed(seed)
    key = torch.rand(positions.shape[0], max_len, generator=g, device=positions.device)
    j = torch.arange(max_len, device=positions.device)
    key = key.masked_fill(j[None, :] > positions[:, None], -1.0)
    key[torch.arange(positions.shape[0], device=positions.device), positions] = 2.0
    vals, idx = key.topk(min(topk, max_len), dim=-1)
    out = torch.full((positions.shape[0], topk), -1, dtype=torch.int32, device=positions.device)
    out[:, : idx.shape[1]] = torch.where(vals < 0, -1, idx).int()
    return out


def bench(fn, rep: int = 100) -> float:
    import triton.testing

    fn()
    torch.cuda.synchronize()
    try:
        return triton.testing.do_bench_cudagraph(fn, rep=rep, return_mode="median")
    except Exception:  # noqa: BLE001 — fall back to eager timing if capture is refused
        return triton.testing.do_bench(fn, warmup=25, rep=rep, return_mode="median")


def row(name, ms, flops, unique_bytes, gathered_bytes, peak_tflops):
    floor_ms = max(unique_bytes / (HBM_TBS * 1e12), flops / (peak_tflops * 1e12)) * 1e3
    tflops = flops / (ms * 1e-3) / 1e12
    print(
        f"{name:<46} {ms:8.3f} {floor_ms:8.3f} {floor_ms / ms:6.0%} {tflops:8.1f} {tflops / peak_tflops:6.0%}"
        f" {unique_bytes / (ms * 1e-3) / 1e12:7.2f} {gathered_bytes / (ms * 1e-3) / 1e12:8.2f}"
    )


HEADER = f"{'shape':<46} {'ms':>8} {'floor':>8} {'of fl':>6} {'TFLOP/s':>8} {'of pk':>6} {'TB/s':>7} {'gath TB/s':>8}"


def mla_case(heads, layout, seed=0, kv_dtype="bfloat16"):
    """Inputs of one shape; ``kv_dtype`` ``fp8_e4m3``: the cache is the FP8 latent cache (656-byte
    rows, quantised by the store kernel), and the byte counts are of those rows."""
    from breakgraph.kernels.latent_fp8 import LatentLayout, latent_views
    from breakgraph.kernels.triton_latent_fp8 import store_latent_triton

    batch = make_batch(*LAYOUTS[layout], seed=seed)
    g = torch.Generator(device="cuda").manual_seed(seed)
    num = batch["positions"].shape[0]
    q = torch.randn(num, heads, RANK + ROPE, generator=g, device="cuda").bfloat16()
    kv = torch.randn(batch["num_slots"], RANK + ROPE, generator=g, device="cuda").bfloat16()
    row_bytes = (RANK + ROPE) * 2
    if kv_dtype == "fp8_e4m3":
        row_bytes = LatentLayout(RANK, ROPE).row_bytes
        cache = torch.zeros(kv.shape[0], row_bytes, dtype=torch.uint8, device="cuda")
        store_latent_triton(*latent_views(cache, RANK), torch.arange(kv.shape[0], device="cuda"), kv)
        kv = cache
    max_len = batch["page_table"].shape[1] * PAGE
    tk = random_topk(batch["positions"], TOPK, max_len, seed)
    out = torch.empty(num, heads, RANK, dtype=torch.bfloat16, device="cuda")
    valid = tk >= 0
    n_valid = int(valid.sum())
    from breakgraph.kernels.paging import positions_to_slots

    slots = positions_to_slots(tk, batch["page_table"], batch["token_req"], PAGE)[valid]
    n_unique = int(torch.unique(slots).numel())
    flops = 2 * n_valid * heads * (RANK + ROPE + RANK)
    io = q.numel() * 2 + out.numel() * 2 + tk.numel() * 4
    return (q, kv, tk, batch, out), flops, n_unique * row_bytes + io, n_valid * row_bytes + io


def _layouts(args, default):
    return args.layouts or default


def run_mla(args):
    from breakgraph.kernels.sparse_mla import sparse_mla_attention_ref
    from breakgraph.kernels.triton_sparse_mla import default_config, sparse_mla_attention_triton

    print(f"\nsparse MLA attention (bf16 queries, r=512, dr=64, K=2048, page 64; caches: {' and '.join(args.kv_cache_dtype)})")
    print("  as the engine calls it (prefill: positions, dense_below=K, token blocks below K run dense-causal;")
    print("  decode: dense_below=0, split-K);")
    print("  '[sparse only]' rows: the same shape without the dense path")
    print(HEADER)
    layouts = _layouts(args, [k for k in LAYOUTS if "pool" not in k and "prefix)" not in k])
    summary, args.sweep_start = [], time.monotonic()
    for heads, layout, kv_dtype in itertools.product(args.heads, layouts, args.kv_cache_dtype):
        fp8 = kv_dtype == "fp8_e4m3"
        (q, kv, tk, batch, out), flops, ubytes, gbytes = mla_case(heads, layout, kv_dtype=kv_dtype)
        a = (q, kv, tk, batch["page_table"], batch["token_req"], PAGE, GLM5_SCALE, out)
        dense_below = 0 if layout.startswith("decode") else TOPK  # as layers/dsa.py passes it
        engine = dict(positions=batch["positions"], dense_below=dense_below)
        cfg = default_config(q.shape[0], heads, TOPK, q.device, dense=dense_below > 0, kv_fp8=fp8)
        has_dense = dense_below > 0 and cfg["num_splits"] == 1 and bool((batch["positions"] < TOPK).any())
        name = f"H={heads} {layout}{' fp8' if fp8 else ''}"
        ms = bench(partial(sparse_mla_attention_triton, *a, **engine))
        row(f"{name} [splits {cfg['num_splits']}]", ms, flops, ubytes, gbytes, BF16_TFLOPS)
        if has_dense:
            row(f"{name} [sparse only]", bench(partial(sparse_mla_attention_triton, *a)), flops, ubytes, gbytes,
                BF16_TFLOPS)  # fmt: skip
        if args.sweep:
            best = sweep_mla(args, a, engine, cfg, heads, fp8, ms, gbytes, out)
            summary.append((name, ms, gbytes, best))
        if args.twin:
            ms = bench(partial(sparse_mla_attention_ref, *a))
            row(f"{name} [twin]", ms, flops, ubytes, gbytes, BF16_TFLOPS)
    if summary:
        print(f"\n{'shape':<34} {'default ms':>10} {'gath TB/s':>9} {'best ms':>8} {'gath TB/s':>9}  best config")
        for name, ms, gbytes, (best_t, best_opts) in summary:
            print(f"{name:<34} {ms:10.3f} {gbytes / (ms * 1e-3) / 1e12:9.2f} {best_t:8.3f}"
                  f" {gbytes / (best_t * 1e-3) / 1e12:9.2f}  {best_opts}")  # fmt: skip


# The few-heads prefill (BLOCK_H = 16: 8 or 16 heads, one split, bf16 cache), most telling
# first (a --budget cuts the tail). The default (mma.sync, 32-key blocks, 2 stages, 168-register
# cap, cache rows precomputed by _topk_slots_kernel) is timed apart; "slots": False is the loop
# that walks position → page → row itself (power-of-two pages: shifts, no division); more
# stages give more key buffers only from 5 on (the index loads take the earlier stages).
FEW_HEADS_VARIANTS = [
    dict(slots=False),
    dict(block_n=64, num_warps=8, num_stages=2, maxnreg=0),
    dict(block_n=32, num_warps=4, num_stages=2, maxnreg=0),
    dict(block_n=16, num_warps=4, num_stages=2, maxnreg=168),
    dict(block_n=32, num_warps=4, num_stages=3, maxnreg=168),
    dict(block_n=64, num_warps=8, num_stages=3, maxnreg=0),
    dict(slots=False, block_n=16, num_warps=4, num_stages=7, maxnreg=168),
]


def sweep_mla(args, a, engine, cfg, heads, fp8, default_ms, gbytes, out):
    """Time tile variants of one shape against its default (the whole call, as the engine makes
    it); prints one line per variant and returns the fastest ``(ms, opts)``. Past ``--budget``
    seconds (counted from the first shape) only the grid's first variant is timed."""
    import triton

    from breakgraph.kernels.triton_sparse_mla import sparse_mla_attention_triton

    best = (default_ms, "default")
    if cfg["block_h"] <= 16 and cfg["num_splits"] == 1 and not fp8:
        grid = [dict(v) for v in FEW_HEADS_VARIANTS]
    elif fp8 and args.sweep_fp8_small:  # the few candidates sm_90 ptxas compiles without (many) spills
        grid = [dict(block_n=bn, num_stages=ns, maxnreg=mr, num_splits=cfg["num_splits"])
                 for bn, ns, mr in ((32, 1, None), (32, 2, None), (16, 2, None), (16, 1, None), (32, 1, 168))]  # fmt: skip
    else:
        block_hs = [b for b in (16, 32, 64) if b <= max(16, triton.next_power_of_2(heads))]
        grid = [dict(slots=True)] + [dict(block_h=bh, block_n=bn, num_warps=nw, num_stages=ns, num_splits=cfg["num_splits"], maxnreg=mr)
                for bh, bn, nw, ns, mr in itertools.product(block_hs, (16, 32), (4,), (2, 3), (None, 168, 128))]  # fmt: skip
    want = out.clone()
    if cfg["num_splits"] > 1:  # decode: also the split count, default blocks
        grid += [dict(num_splits=sp) for sp in (1, 2, 4, 8, 16)]
    for i, opts in enumerate(grid):
        if i > 0 and args.budget and time.monotonic() - args.sweep_start > args.budget:
            print(f"    budget spent: {opts} and the rest skipped")
            break
        try:
            t = bench(partial(sparse_mla_attention_triton, *a, **engine, **opts))
        except Exception as e:  # noqa: BLE001 — e.g. out of shared memory
            print(f"    {opts}: {type(e).__name__} {str(e)[:100]}")
            continue
        diff = ((out.float() - want.float()).norm() / want.float().norm()).item()
        print(f"    {t:8.3f} ms  gathered {gbytes / (t * 1e-3) / 1e12:5.2f} TB/s  vs default {diff:.1e}  {opts}",
              flush=True)  # fmt: skip
        if t < best[0]:
            best = (t, opts)
    print(f"    best {best[0]:.3f} ms with {best[1]}")
    return best


# --variants: the sparse kernel's loop variants at 8 heads against the default, as the engine
# calls it (prefill with the dense path, decode with split-K); each with the default tiles
# unless it names its own. The default at few heads is the column-group kernel
# (_sparse_mla_groups_kernel: the lean loop in four column groups, the lazy rescale, 8-row head
# blocks); the loop is bound by shared-memory traffic (ncu), and it reads the query tile from
# shared memory once per key block, so 64-key blocks halve those reads per key (at 84 KB of
# shared memory per program: two programs per SM instead of four), 8 warps split the keys
# further at twice the query reads.
MLA_VARIANTS = [
    dict(block_h=16),  # the default before the 8-row head blocks
    dict(block_n=64),
    dict(block_n=64, num_warps=8),
    dict(num_warps=8),
    dict(num_stages=3),
]
# The FP8 cache: the default (the column-group kernel with the scales on the columns, the codes
# converted exactly in inline PTX, 8-row heads, two stages, COLUMNS_MAXNREG = 168 registers:
# three programs per SM, 174 uncapped: two) against its 16-row head block, 64-key blocks
# (capped and uncapped: decode B=1 measured 0.014 ms uncapped against 0.016 at the default)
# and no cap, and the masked gather loop dequantising the tile (the fallback where the lean
# loop does not fit).
MLA_FP8_VARIANTS = [
    dict(block_h=16),
    dict(block_n=64),
    dict(block_n=64, maxnreg=0),
    dict(maxnreg=0),
    dict(lean=False),
]
VARIANT_LAYOUTS = ["prefill 8k", "prefill 16k", "decode B=1 (L~8k)", "decode B=16 (L~8k)", "decode B=64 (L~8k)"]


def run_mla_variants(args):
    """ms, gathered TB/s and the largest error against the default of each variant per shape
    (shapes outer, cache kinds inner); past ``--budget`` seconds only the defaults are timed.
    The summary's last column: the default's ms × 78 layers."""
    from breakgraph.kernels.triton_sparse_mla import default_config, sparse_mla_attention_triton

    heads = args.heads[0]
    print(f"\nsparse MLA loop variants, H={heads}, page {PAGE} (engine calls: prefill dense_below=K)")
    rows, start = [], time.monotonic()
    for layout, kv_dtype in itertools.product(_layouts(args, VARIANT_LAYOUTS), args.kv_cache_dtype):
        fp8 = kv_dtype == "fp8_e4m3"
        (q, kv, tk, batch, out), _, _, gbytes = mla_case(heads, layout, kv_dtype=kv_dtype)
        a = (q, kv, tk, batch["page_table"], batch["token_req"], PAGE, GLM5_SCALE, out)
        engine = dict(positions=batch["positions"], dense_below=0 if layout.startswith("decode") else TOPK)
        cfg = default_config(q.shape[0], heads, TOPK, q.device, dense=engine["dense_below"] > 0, kv_fp8=fp8)
        layout = f"{layout}{' fp8' if fp8 else ''}"
        ms = bench(partial(sparse_mla_attention_triton, *a, **engine))
        want = out.float().clone()
        print(f"  {layout:<26} default {ms:8.3f} ms  gathered {gbytes / (ms * 1e-3) / 1e12:5.2f} TB/s  "
              f"(splits {cfg['num_splits']})", flush=True)  # fmt: skip
        best = (ms, "default")
        for opts in MLA_FP8_VARIANTS if fp8 else MLA_VARIANTS:
            if args.budget and time.monotonic() - start > args.budget:
                print(f"    budget spent: {opts} and the rest skipped")
                break
            try:
                t = bench(partial(sparse_mla_attention_triton, *a, **engine, **opts))
            except Exception as e:  # noqa: BLE001 — e.g. out of shared memory
                print(f"    {opts}: {type(e).__name__} {str(e)[:100]}")
                continue
            err = (out.float() - want).abs().max().item()
            print(f"    {t:8.3f} ms  gathered {gbytes / (t * 1e-3) / 1e12:5.2f} TB/s  x{ms / t:4.2f}  max err vs default"
                  f" {err:.1e}  {opts}", flush=True)  # fmt: skip
            best = min(best, (t, opts), key=lambda b: b[0])
        rows.append((layout, ms, gbytes, best))
    print(f"\n{'shape':<26} {'default ms':>10} {'gath TB/s':>9} {'best ms':>8} {'gath TB/s':>9} {'x':>5}"
          f" {'78 layers ms':>12}  best")  # fmt: skip
    for layout, ms, gbytes, (t, opts) in rows:
        print(f"{layout:<26} {ms:10.3f} {gbytes / (ms * 1e-3) / 1e12:9.2f} {t:8.3f} {gbytes / (t * 1e-3) / 1e12:9.2f}"
              f" {ms / t:5.2f} {ms * 78:12.1f}  {opts}")  # fmt: skip


def selection_overlap(a: torch.Tensor, b: torch.Tensor, rows: torch.Tensor) -> float:
    """Mean over ``rows`` of |a ∩ b| / |a| for two top-k position tables (``-1`` unused)."""
    a, b = a[rows].long(), b[rows].long()
    width = int(max(a.max(), b.max())) + 2
    hit = torch.zeros(rows.numel(), width, dtype=torch.bool, device=a.device)
    hit.scatter_(1, a.clamp(min=-1) + 1, True)
    common = hit.gather(1, b.clamp(min=-1) + 1) & (b >= 0)
    return float((common.sum(1).float() / (a >= 0).sum(1).clamp(min=1)).mean())


# Score-kernel variants the indexer sweep times (stacked prefill path): tokens per program,
# key block, warps, stages, register cap.
INDEXER_VARIANTS = [
    dict(block_t=4, block_l=64, num_warps=4, num_stages=2, maxnreg=168),
    dict(block_t=4, block_l=64, num_warps=4, num_stages=3, maxnreg=168),
    dict(block_t=4, block_l=64, num_warps=4, num_stages=3, maxnreg=None),
    dict(block_t=8, block_l=64, num_warps=8, num_stages=2, maxnreg=128),
    dict(block_t=8, block_l=64, num_warps=8, num_stages=3, maxnreg=None),
    dict(block_t=8, block_l=64, num_warps=8, num_stages=3, maxnreg=128),
    dict(block_t=4, block_l=128, num_warps=8, num_stages=3, maxnreg=168),
]
# Measured and dropped on the H200 (docs/benchmarks.md, 2026-12-03 night): bf16 8 tokens × 128 keys,
# 8 warps, uncapped (ptxas fails on it there); FP8 keys 8 × 64, 8 warps, 168 registers (2.81-2.83 ms
# at 16K tokens against the FP8 default's 2.52).
# The same on the FP8 key cache (e4m3 rows stored once, read as stored).
INDEXER_FP8_VARIANTS = [
    dict(block_t=4, block_l=64, num_warps=4, num_stages=3, maxnreg=None),
    dict(block_t=8, block_l=64, num_warps=8, num_stages=3, maxnreg=None),
    dict(block_t=4, block_l=128, num_warps=8, num_stages=3, maxnreg=None),
]


def run_indexer(args):
    from breakgraph.kernels.indexer import indexer_topk_ref
    from breakgraph.kernels.latent_fp8 import store_latent
    from breakgraph.kernels.triton_indexer import (
        default_config,
        indexer_scores_triton,
        indexer_topk_triton,
        topk_select_triton,
    )

    print("\nDSA indexer (Hi=32, Di=128, K=2048, page 64): length-true scores, the top-k select, both;")
    print("  TFLOP/s count the causal work of the scored tokens (2·Σ_{pos≥K}(pos+1)·Hi·Di);")
    print("  'torch.topk (full width)' sorts the score rows over the whole page-table width, as the engine did before;")
    print("  'fp8' quantises bf16 keys in the kernel, 'fp8 keys' reads the FP8 key cache (e4m3 rows stored once)")
    print(HEADER)
    default = [k for k in LAYOUTS if k not in ("prefill 8k (2×4k)",)]
    summary, start = [], time.monotonic()
    for layout in _layouts(args, default):
        batch = make_batch(*LAYOUTS[layout], seed=1)
        g = torch.Generator(device="cuda").manual_seed(1)
        num = batch["positions"].shape[0]
        q = torch.randn(num, IDX_HEADS, IDX_DIM, generator=g, device="cuda").bfloat16()
        w = torch.randn(num, IDX_HEADS, generator=g, device="cuda") * IDX_HEADS**-0.5
        kc = torch.randn(batch["num_slots"], IDX_DIM, generator=g, device="cuda").bfloat16()
        kc8 = torch.zeros(kc.shape[0], IDX_DIM + 16, dtype=torch.uint8, device="cuda")
        store_latent(kc8, torch.arange(kc.shape[0], device="cuda"), kc, IDX_DIM)
        pt, req, pos = batch["page_table"], batch["token_req"], batch["positions"]
        row_len = pt.shape[1] * PAGE
        scores = torch.empty(num, row_len, device="cuda")
        topk = torch.empty(num, TOPK, dtype=torch.int32, device="cuda")
        causal = int((pos + 1).sum())
        scored = int((pos + 1)[pos >= TOPK].sum())  # tokens below K are not scored (skip_below=K)
        n_keys = int(((pos.new_zeros(pt.shape[0]).scatter_reduce(0, req, pos, "amax")) + 1).sum())
        io = q.numel() * 2 + w.numel() * 4 + n_keys * IDX_DIM * 2
        s_bytes = io + causal * 4
        t_bytes = s_bytes + causal * 4 + topk.numel() * 4
        rest = (pt, req, pos, PAGE, IDX_DIM**-0.5)
        flops = 2 * scored * IDX_HEADS * IDX_DIM
        chosen = {}
        for mode in ("bf16", "fp8", "fp8 keys"):
            fp8 = mode != "bf16"
            a = (q, w, kc8 if mode == "fp8 keys" else kc, *rest)
            peak = FP8_TFLOPS if fp8 else BF16_TFLOPS
            tag = f"{layout} {mode}"
            cfg = default_config(num, pt.shape[0], IDX_HEADS, row_len, q.device, {"bf16": 0, "fp8": 1}.get(mode, 2))
            ms = bench(partial(indexer_scores_triton, *a, scores, fp8=fp8, skip_below=TOPK))
            row(f"{tag} scores [bt {cfg['block_t']} kp {cfg['key_programs']}]", ms, flops, s_bytes, s_bytes, peak)
            summary.append((layout, mode, "default", ms, flops / (ms * 1e-3) / 1e12, 0.0))
            if mode == "bf16":
                ms = bench(partial(topk_select_triton, scores, pos, topk))
                row(f"{layout} select", ms, 0, causal * 4, causal * 4, peak)
                if num * row_len <= 1 << 28 and row_len >= TOPK:
                    ms = bench(partial(torch.topk, scores, TOPK, dim=-1))
                    row(f"{layout} torch.topk (full width)", ms, 0, scores.numel() * 4, scores.numel() * 4, peak)
            ms = bench(partial(indexer_topk_triton, *a, topk, fp8=fp8))
            row(f"{tag} scores+select", ms, flops, t_bytes, t_bytes, peak)
            chosen[mode] = topk.clone()
            stacked = num > pt.shape[0]
            if args.sweep and mode != "fp8" and stacked and (layout.startswith("prefill 16k") or args.layouts):
                scores.zero_()
                indexer_scores_triton(*a, scores, fp8=fp8, skip_below=TOPK)
                want = scores.clone()
                best = (1e9, None)
                for opts in INDEXER_VARIANTS if mode == "bf16" else INDEXER_FP8_VARIANTS:
                    if args.budget and time.monotonic() - start > args.budget:
                        print(f"    out of --budget: {opts} not timed")
                        continue
                    try:
                        scores.zero_()
                        indexer_scores_triton(*a, scores, fp8=fp8, skip_below=TOPK, **opts)
                        diff = ((scores - want).norm() / want.norm()).item()
                        t = bench(partial(indexer_scores_triton, *a, scores, fp8=fp8, skip_below=TOPK, **opts), rep=40)
                    except Exception as e:  # noqa: BLE001 — e.g. out of shared memory
                        print(f"    {opts}: {type(e).__name__} {str(e)[:120]}")
                        continue
                    tf = flops / (t * 1e-3) / 1e12
                    print(f"    {t:8.3f} ms  {tf:6.1f} TFLOP/s  vs default {diff:.1e}  {opts}", flush=True)
                    summary.append((layout, mode, _short(opts), t, tf, diff))
                    if t < best[0]:
                        best = (t, opts)
                print(f"    best scores {best[0]:.3f} ms with {best[1]}")
        for mib in args.score_buffers:
            a = (q, w, kc, *rest)
            opts = dict(score_buffer_elems=mib << 18)
            ms = bench(partial(indexer_topk_triton, *a, topk, **opts))
            same = torch.equal(topk.sort(dim=1).values, chosen["bf16"].sort(dim=1).values)  # chunks may differ in method
            chunk = min(num, (mib << 18) // row_len)
            row(f"{layout} bf16 scores+select, {mib} MiB buffer ({chunk} tokens){'' if same else ' DIFFERS'}",
                ms, flops, t_bytes, t_bytes, BF16_TFLOPS)  # fmt: skip
            summary.append((layout, "bf16", f"scores+select {mib} MiB", ms, flops / (ms * 1e-3) / 1e12, 0.0 if same else 1.0))
        sparse_rows = (pos >= TOPK).nonzero().flatten()[::16]
        if sparse_rows.numel():
            for mode in ("fp8", "fp8 keys"):
                print(f"    {layout}: {mode} selection keeps {selection_overlap(chosen['bf16'], chosen[mode], sparse_rows):.2%} "
                      f"of the bf16 selection (rows past K, every 16th)")  # fmt: skip
        if args.twin:
            ms = bench(partial(indexer_topk_ref, q, w, kc, *rest, topk))
            row(f"{layout} [twin]", ms, 2 * causal * IDX_HEADS * IDX_DIM, t_bytes, t_bytes, BF16_TFLOPS)
    if (args.sweep or args.score_buffers) and summary:
        print(f"\nindexer scores, one layer: {'layout':<12} {'keys':<9} {'variant':<34} {'ms':>7} {'TFLOP/s':>8} {'vs default':>10}")
        for layout, mode, name, t, tf, diff in summary:
            print(f"  {layout:<12} {mode:<9} {name:<34} {t:7.3f} {tf:8.1f} {diff:10.1e}")


def _short(opts: dict) -> str:
    """``bt 4 bl 64 w 4 st 3 r 168`` for a score-kernel variant."""
    return f"bt {opts['block_t']} bl {opts['block_l']} w {opts['num_warps']} st {opts['num_stages']} r {opts['maxnreg']}"


def topk_variants() -> dict:
    """Name → options of :func:`~breakgraph.kernels.triton_topk.topk_select_triton`: the default
    (the method :func:`~breakgraph.kernels.triton_topk.default_method` picks for the shape) and
    each method forced (``scripts/bench_topk.py`` sweeps their blocks and bins)."""
    return {"default": {}, "range": dict(method="range"), "split": dict(method="split"),
            "radix": dict(method="radix")}  # fmt: skip


def topk_rows(layout: str, g) -> tuple[torch.Tensor, torch.Tensor]:
    """(scores, positions) of one shape: the prefill layouts score random GLM-5-shaped queries and
    keys with the indexer kernel (rows below K are left unscored, as the engine leaves them);
    "decode B=64 (L~128k)" is 64 rows of 124K–128K random normal scores."""
    from breakgraph.kernels.triton_indexer import indexer_scores_triton

    if layout == "decode B=64 (L~128k)":
        pos = torch.tensor([131071 - 97 * i for i in range(64)], device="cuda")
        return torch.randn(64, 131072, generator=g, device="cuda"), pos
    batch = make_batch(*LAYOUTS[layout], seed=1)
    num = batch["positions"].shape[0]
    q = torch.randn(num, IDX_HEADS, IDX_DIM, generator=g, device="cuda").bfloat16()
    w = torch.randn(num, IDX_HEADS, generator=g, device="cuda") * IDX_HEADS**-0.5
    kc = torch.randn(batch["num_slots"], IDX_DIM, generator=g, device="cuda").bfloat16()
    pt, pos = batch["page_table"], batch["positions"]
    scores = torch.empty(num, pt.shape[1] * PAGE, device="cuda")
    indexer_scores_triton(q, w, kc, pt, batch["token_req"], pos, PAGE, IDX_DIM**-0.5, scores, skip_below=TOPK)
    return scores, pos


def topk_exact(got: torch.Tensor, scores: torch.Tensor, pos: torch.Tensor) -> bool:
    """Whether every row of ``got`` holds the exact top-K set of its causal scores (the
    lowest positions among ties at the K-th score), each position once (in any order), ``-1``
    after short rows."""
    j = torch.arange(scores.shape[1], device=scores.device)
    causal = j[None, :] <= pos[:, None]
    masked = scores.masked_fill(~causal, float("-inf"))
    kth = masked.topk(TOPK, dim=1).values[:, -1:]
    above = (masked > kth) & causal
    ties = (masked == kth) & causal
    need = TOPK - above.sum(1, keepdim=True)
    want = above | (ties & (ties.cumsum(1) <= need))
    short = pos < TOPK
    want[short] = causal[short]
    valid = got >= 0
    width = scores.shape[1]
    hit = torch.zeros(want.shape[0], width + 1, dtype=torch.bool, device=want.device)  # last column: the -1s
    hit.scatter_(1, torch.where(valid, got.long(), width), True)
    distinct = torch.equal(hit[:, :width].sum(1), valid.sum(1))
    tails = bool((valid[:, :-1] | ~valid[:, 1:]).all())  # -1 only after the positions
    return distinct and tails and torch.equal(hit[:, :width], want) and torch.equal(valid.sum(1), want.sum(1))


def run_topk(args):
    """Time every select variant per shape against ``torch.topk`` over the same causal rows,
    check each against the exact set; the table comes last."""
    from breakgraph.kernels.triton_topk import topk_select_triton

    print("\nDSA top-k select (K=2048): one layer, ms; 'x topk': speed-up over torch.topk of the causal rows")
    table = []
    for layout in _layouts(args, ["prefill 16k", "prefill 8k", "decode B=64 (L~128k)"]):
        g = torch.Generator(device="cuda").manual_seed(1)
        scores, pos = topk_rows(layout, g)
        j = torch.arange(scores.shape[1], device="cuda")
        masked = scores.masked_fill(j[None, :] > pos[:, None], float("-inf"))
        base = bench(partial(torch.topk, masked, TOPK, dim=1), rep=50)
        table.append((layout, "torch.topk (causal rows, -inf past them)", base, 1.0, base * 78, "-"))
        del masked
        topk = torch.empty(pos.shape[0], TOPK, dtype=torch.int32, device="cuda")
        for name, opts in topk_variants().items():
            topk.fill_(-7)
            topk_select_triton(scores, pos, topk, **opts)
            exact = topk_exact(topk, scores, pos)
            ms = bench(partial(topk_select_triton, scores, pos, topk, **opts), rep=50)
            table.append((layout, name, ms, base / ms, ms * 78, exact))
            print(f"    {layout:<22} {name:<40} {ms:8.3f} ms  exact={exact}", flush=True)
    print(f"\n{'layout':<22} {'variant':<40} {'ms':>8} {'x topk':>6} {'78 layers ms':>13} exact")
    for layout, name, ms, speedup, total, exact in table:
        print(f"{layout:<22} {name:<40} {ms:8.3f} {speedup:6.2f} {total:13.1f} {exact}")


# ----------------------------------------------------------------------------------------
# --aot: compile for sm_90 without a GPU (Triton ships ptxas) and read the resource report
# ----------------------------------------------------------------------------------------


def run_aot_fp8(a: dict, dense: dict) -> None:
    """The FP8 cache at 8 heads, prefill: the default (the column-group kernel, its scales on
    the columns, the codes converted in inline PTX; Triton's cast in its place), the --variants
    tiles."""
    from breakgraph.kernels.aot import compile_for_sm90 as aot_report
    from breakgraph.kernels.latent_fp8 import LatentLayout
    from breakgraph.kernels.paging import page_shift
    from breakgraph.kernels.triton_sparse_mla import (
        COLUMNS_MAXNREG,
        _sparse_mla_fwd_kernel,
        _sparse_mla_groups_kernel,
    )
    from breakgraph.kernels.triton_sparse_mla import default_config as mla_cfg

    cpu, lay = torch.device("cpu"), LatentLayout(RANK, ROPE)
    a = a | dict(KV="*u8", stride_kv=lay.row_bytes)
    cases = [("default", {}, True), ("Triton's cast (fp16 queries: uncapped)", dict(maxnreg=0), False)]
    cases += [(str(v), v, True) for v in MLA_FP8_VARIANTS]
    for name, v, asm in cases:
        w = mla_cfg(4096, 8, TOPK, cpu, dense=True, kv_fp8=True) | v
        if not w["lean"]:  # the masked gather loop, dequantising the tile
            f = dict(BLOCK_H=16, BLOCK_N=w["block_n"], BLOCK_R=RANK, BLOCK_PE=ROPE, SPLIT=False,
                     DENSE_T=dense["block_t"], KV_FP8=True, PAGE_SHIFT=page_shift(PAGE), LAZY=w["lazy"])  # fmt: skip
            r = aot_report(_sparse_mla_fwd_kernel, a, f, w["num_warps"], w["num_stages"], w["maxnreg"])
            print(f"    fp8 cache {name} {r}")
            continue
        g = dict(BLOCK_H=w["block_h"], BLOCK_N=w["block_n"], BLOCK_R=RANK, BLOCK_PE=ROPE, SPLIT=False,
                 DENSE_T=dense["block_t"], LAZY=w["lazy"], KV_FP8=True, SCALE_OFF=lay.scale_off, PE_OFF=lay.pe_off,
                 CVT_ASM=asm)  # fmt: skip
        cap = v.get("maxnreg", COLUMNS_MAXNREG) or None  # the launcher's cap; maxnreg=0: none
        r = aot_report(_sparse_mla_groups_kernel, a, g, w["num_warps"], w["num_stages"], cap)
        print(f"    fp8 cache {name} {r}")


def run_aot():
    from breakgraph.kernels.aot import compile_for_sm90 as aot_report
    from breakgraph.kernels.paging import page_shift
    from breakgraph.kernels.triton_dense_mla import dense_config
    from breakgraph.kernels.triton_indexer import _indexer_scores_kernel
    from breakgraph.kernels.triton_indexer import default_config as idx_cfg
    from breakgraph.kernels.triton_sparse_mla import (
        _sparse_mla_fwd_kernel,
        _sparse_mla_groups_kernel,
        _sparse_mla_merge_kernel,
    )
    from breakgraph.kernels.triton_sparse_mla import default_config as mla_cfg

    cpu = torch.device("cpu")
    print("sm_90 compile report (cuobjdump: registers, stack, spill instructions, MMA, shared memory)")
    for heads, num in ((8, 4096), (8, 64), (64, 4096), (64, 64), (128, 4096)):
        cfg = mla_cfg(num, heads, TOPK, cpu)
        dense = dense_config(heads)
        a = dict(
            Q="*bf16", KV="*bf16", TOPK="*i32", PAGE_TABLE="*i32", TOKEN_REQ="*i64", POSITIONS="*i64", OUT="*bf16",
            WS_O="*fp32", WS_LSE="*fp32", stride_qt=heads * 576, stride_qh=576, stride_kv=576, stride_tk=TOPK,
            stride_pt=37, stride_ot=heads * RANK, stride_oh=RANK, num_tokens=num, num_heads=heads, topk=TOPK,
            rank=RANK, rope_dim=ROPE, page_size=PAGE, keys_per_split=512, num_splits=4, dense_below=TOPK, qk_scale=0.1,
        )  # fmt: skip
        split = cfg["num_splits"] > 1
        consts = dict(BLOCK_H=cfg["block_h"], BLOCK_N=cfg["block_n"], BLOCK_R=512, BLOCK_PE=64, SPLIT=split,
                      DENSE_T=0 if split else dense["block_t"], SLOTS=cfg["slots"],
                      PAGE_SHIFT=page_shift(PAGE))  # fmt: skip
        if cfg["groups"] == 4:  # the column-group kernel (no register cap)
            g = {k: consts[k] for k in ("BLOCK_H", "BLOCK_N", "BLOCK_R", "BLOCK_PE", "SPLIT", "DENSE_T")}
            g |= dict(LAZY=cfg["lazy"])
            r = aot_report(_sparse_mla_groups_kernel, a, g, cfg["num_warps"], cfg["num_stages"], None)
        else:
            r = aot_report(_sparse_mla_fwd_kernel, a, consts, cfg["num_warps"], cfg["num_stages"], cfg["maxnreg"])
        print(f"  sparse_mla H={heads:<3} T={num:<5} {cfg} {r}")
        if heads == 8 and not split:  # the few-heads sweep's tiles, and the loop before slots and shifts
            consts |= dict(BLOCK_H=16)  # the slots loop keeps 16-row head blocks
            walk = consts | dict(SLOTS=False, PAGE_SHIFT=-1)
            r = aot_report(_sparse_mla_fwd_kernel, a, walk, cfg["num_warps"], cfg["num_stages"], cfg["maxnreg"])
            print(f"    page walk with a runtime division (before slots and shifts) {r}")
            for v in FEW_HEADS_VARIANTS:
                v = cfg | v
                consts |= dict(BLOCK_N=v["block_n"], SLOTS=v["slots"])
                r = aot_report(_sparse_mla_fwd_kernel, a, consts, v["num_warps"], v["num_stages"], v["maxnreg"] or None)
                print(f"    sweep tile {v} {r}")
            for v in MLA_VARIANTS:  # --variants: the lean loops (one column group, or four)
                w = cfg | v
                lean = dict(BLOCK_H=w["block_h"], BLOCK_N=w["block_n"], BLOCK_R=512, BLOCK_PE=64, SPLIT=False,
                            DENSE_T=dense["block_t"], LAZY=w["lazy"])  # fmt: skip
                if w["groups"] == 4:
                    fn, cap = _sparse_mla_groups_kernel, v.get("maxnreg")
                else:
                    fn, cap = _sparse_mla_fwd_kernel, w["maxnreg"]
                    lean |= dict(BLOCK_H=16, SLOTS=True, LEAN=w["lean"], PAGE_SHIFT=page_shift(PAGE))
                r = aot_report(fn, a, lean, w["num_warps"], w["num_stages"], cap or None)
                print(f"    variant {v} {r}")
            run_aot_fp8(a, dense)
    a = dict(WS_O="*fp32", WS_LSE="*fp32", OUT="*bf16", stride_ot=8 * RANK, stride_oh=RANK, num_heads=8,
             rank=RANK, num_splits=5)  # fmt: skip
    print(f"  sparse_mla merge {aot_report(_sparse_mla_merge_kernel, a, dict(BLOCK_S=8, BLOCK_R=512), 4, 1)}")
    for num, reqs in ((4096, 1), (64, 64)):
        for fp8 in (False, True):
            cfg = idx_cfg(num, reqs, IDX_HEADS, 4096, cpu, int(fp8))
            a = dict(
                Q="*bf16", W="*fp32", K="*bf16", PAGE_TABLE="*i32", TOKEN_REQ="*i64", POSITIONS="*i64",
                SCORES="*fp32", stride_qt=IDX_HEADS * IDX_DIM, stride_qh=IDX_DIM, stride_wt=IDX_HEADS,
                stride_k=IDX_DIM, stride_pt=37, stride_st=4096, num_tokens=num, num_heads=IDX_HEADS,
                head_dim=IDX_DIM, page_size=PAGE, skip_below=TOPK, scale=0.088,
            )  # fmt: skip
            # as the launch specialises a page of 64; the shift with 64-bit row offsets; a division
            for shift, i32 in ((page_shift(PAGE), True), (page_shift(PAGE), False), (-1, False)):
                consts = dict(BLOCK_T=cfg["block_t"], BLOCK_H=32, BLOCK_D=128, BLOCK_L=cfg["block_l"], FP8=fp8,
                              STACKED=cfg["stacked"], PAGE_SHIFT=shift, ROWS_I32=i32)  # fmt: skip
                r = aot_report(_indexer_scores_kernel, a, consts, cfg["num_warps"], cfg["num_stages"], cfg["maxnreg"])
                print(f"  indexer T={num:<5} B={reqs:<3} fp8={fp8!s:<5} page_shift={shift:<2} rows_i32={i32!s:<5} {cfg} {r}")
    a |= dict(num_tokens=4096)
    for keys, variants in (("bf16", INDEXER_VARIANTS), ("fp8 keys", INDEXER_FP8_VARIANTS)):
        fp8_keys = keys == "fp8 keys"
        k = dict(K="*u8", stride_k=IDX_DIM + 16) if fp8_keys else dict(K="*bf16", stride_k=IDX_DIM)
        for v in variants:
            consts = dict(BLOCK_T=v["block_t"], BLOCK_H=32, BLOCK_D=128, BLOCK_L=v["block_l"], FP8=2 if fp8_keys else 0,
                          STACKED=True, PAGE_SHIFT=page_shift(PAGE), ROWS_I32=True)  # fmt: skip
            r = aot_report(_indexer_scores_kernel, a | k, consts, v["num_warps"], v["num_stages"], v["maxnreg"])
            print(f"  indexer sweep T=4096 {keys:<8} {_short(v):<34} {r}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sweep", action="store_true", help="try block configs per shape and print the best")
    p.add_argument("--variants", action="store_true",
                   help="time the sparse MLA loop variants (lean, lazy rescale, tiles) against the default at "
                        "the first --heads; shapes: --layouts (default: prefill 8k/16k, decode B=1/16/64 at ~8k)")
    p.add_argument("--twin", action="store_true", help="also time the plain-PyTorch twins")
    p.add_argument("--aot", action="store_true", help="compile for sm_90 only (no GPU) and print resources")
    p.add_argument("--only", choices=("mla", "indexer", "topk"),
                   help="run one kernel (topk: the select variants; the dense-causal path: scripts/bench_dense_mla.py)")
    p.add_argument("--budget", type=float, default=0.0,
                   help="seconds for a --sweep (indexer and mla: past it only the defaults)")
    p.add_argument("--layouts", nargs="+", choices=sorted([*LAYOUTS, "decode B=64 (L~128k)"]),
                   help="shapes to run (default: all of a kernel's; 'decode B=64 (L~128k)': --only topk only)")
    p.add_argument("--heads", type=int, nargs="+", default=[8, 64], help="MLA heads per GPU (8: TP8, 64: TP1)")
    p.add_argument("--kv-cache-dtype", nargs="+", default=["bfloat16"], choices=("bfloat16", "fp8_e4m3"),
                   help="latent cache(s) the MLA rows run on (fp8_e4m3: the FP8 latent cache, 656-byte rows)")
    p.add_argument("--sweep-fp8-small", action="store_true",
                   help="with --sweep: on the FP8 cache try only a handful of tile/stage/register choices")
    p.add_argument("--score-buffers", type=int, nargs="+", default=[], metavar="MIB",
                   help="--only indexer: also time scores+select (bf16) with the score buffer capped at these MiB "
                        "(query tokens go in chunks that fit it; the default cap is 256 MiB)")
    p.add_argument("--page-size", type=int, default=PAGE,
                   help="KV page size (a page as large as the cache makes the page-table lookups trivial)")
    args = p.parse_args()
    topk_only = sorted(set(args.layouts or ()) - set(LAYOUTS))
    if topk_only and args.only != "topk":
        p.error(f"--layouts {', '.join(map(repr, topk_only))} is a --only topk shape")
    globals()["PAGE"] = args.page_size
    if args.aot:
        run_aot()
        return
    if not torch.cuda.is_available():
        sys.exit("needs a CUDA device (or pass --aot)")
    print(
        f"{torch.cuda.get_device_name()}  peaks: {HBM_TBS} TB/s, {BF16_TFLOPS} TFLOP/s bf16, {FP8_TFLOPS} fp8"
    )
    if args.only == "topk":
        run_topk(args)
        return
    if args.variants:
        run_mla_variants(args)
        return
    if args.only in (None, "mla"):
        run_mla(args)
    if args.only in (None, "indexer"):
        run_indexer(args)


if __name__ == "__main__":
    main()
