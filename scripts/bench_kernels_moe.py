"""Benchmark the MoE layer and the FP8 dense linears at GLM-5 TP8-rank shapes on one GPU.

    python scripts/bench_kernels_moe.py                   # MoE T=128,1024,8192 + dense linears
    python scripts/bench_kernels_moe.py --sweep           # + tile sweep of the Triton grouped GEMMs
    python scripts/bench_kernels_moe.py --only moe --tokens 1024 --json $OUT/moe.json

Every time is a median of CUDA-event timings (``triton.testing.do_bench``; L2 flushed between
runs) and, for the Triton paths, of CUDA-graph replays (``do_bench_cudagraph``) where launch
costs vanish (no L2 flush between replays: a dense weight under ~40 MB may be served from L2
there, so trust the eager column for its bandwidth). Each row prints the physical floors next to the time: weight bytes actually read
(experts that got at least one token) over the copy bandwidth, and FLOPs over the matrix rate;
both ceilings are measured here first (large device copy; 8192³ bf16 ``mm`` and fp8
``_scaled_mm``), with the H200 datasheet figures shown for reference.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from functools import partial

import torch
import triton
import triton.testing

from breakgraph.bench.presets import PRESETS, dense_linear_shapes, moe_shape
from breakgraph.kernels.fp8 import block_dequant, block_quant
from breakgraph.kernels.moe import fused_moe_ref, route, route_ref
from breakgraph.kernels.triton_fp8 import act_quant, fp8_linear, scaled_mm_blockwise_mode
from breakgraph.kernels.triton_moe import (
    W8A8_MIN_TOKENS,
    fused_moe_grouped_mm,
    fused_moe_triton,
    gemm_config,
    grouped_mm_supported,
    moe_align,
    moe_gemm,
)

E, D, INTER, TOP_K = moe_shape(PRESETS["glm5-tp8-rank"])  # GLM-5, one TP8 rank: all experts, I = 2048 / 8
H200_COPY_TBS = 4.3

DENSE = dense_linear_shapes(PRESETS["glm5-tp8-rank"])  # (name, K, N) per rank at TP8


def bench(fn, graph: bool = False) -> float:
    if graph:
        return triton.testing.do_bench_cudagraph(fn, rep=100, return_mode="median")
    return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")


def measure_ceilings() -> dict[str, float]:
    """Copy bandwidth (TB/s, read + write) and bf16 / fp8 matrix rates (TFLOP/s)."""
    src = torch.empty(1 << 30, dtype=torch.uint8, device="cuda").random_(0, 255)
    dst = torch.empty_like(src)
    ms = bench(lambda: dst.copy_(src))
    copy_tbs = 2 * src.numel() / ms / 1e9
    n = 8192
    a = torch.randn(n, n, device="cuda").bfloat16()
    b = torch.randn(n, n, device="cuda").bfloat16()
    bf16_tf = 2 * n**3 / bench(lambda: a @ b) / 1e9
    a8, b8 = a.to(torch.float8_e4m3fn), b.to(torch.float8_e4m3fn).t().contiguous().t()
    one = torch.ones((), device="cuda")
    try:
        fp8_tf = 2 * n**3 / bench(lambda: torch._scaled_mm(a8, b8, one, one, out_dtype=torch.bfloat16)) / 1e9
    except (RuntimeError, TypeError):
        fp8_tf = 2 * bf16_tf
    return {"copy_tbs": copy_tbs, "bf16_tflops": bf16_tf, "fp8_tflops": fp8_tf}


def row(rows: list[dict], **kw) -> None:
    rows.append(kw)
    floor = max(kw["floor_bw_ms"], kw["floor_flop_ms"])
    graph = f"{kw['graph_ms']:9.3f}" if kw.get("graph_ms") is not None else "        -"
    print(
        f"{kw['what']:<28} {kw['case']:<24} {kw['ms']:9.3f} {graph} {kw['gb']:8.3f} "
        f"{kw['gb'] / kw['best_ms']:7.2f} {kw['gb'] / kw['best_ms'] / H200_COPY_TBS:6.0%} "
        f"{kw['floor_bw_ms']:8.3f} {kw['floor_flop_ms']:8.3f} {kw['best_ms'] / floor:6.2f}",
        flush=True,
    )


HEADER = (
    f"{'what':<28} {'case':<24} {'ms':>9} {'graph ms':>9} {'w GB':>8} {'TB/s':>7} {'/4.3':>6} "
    f"{'bw floor':>8} {'flop fl':>8} {'x floor':>6}"
)


def bench_moe(tokens: list[int], ceil: dict[str, float], rows: list[dict], with_ref: bool) -> None:
    torch.manual_seed(0)
    w13 = torch.randn(E, 2 * INTER, D, device="cuda") / D**0.5
    w2 = torch.randn(E, D, INTER, device="cuda") / INTER**0.5
    w13_8, s13 = block_quant(w13)
    w2_8, s2 = block_quant(w2)
    w13_b, w2_b = w13.bfloat16(), w2.bfloat16()
    del w13, w2
    torch.cuda.empty_cache()
    per_expert = {"bf16": 3 * INTER * D * 2, "fp8": 3 * INTER * D}
    print(
        f"\nMoE layer: E={E} D={D} I={INTER} top-{TOP_K}; routed experts only (shared expert is a dense linear)"
    )
    print(HEADER)
    for t in tokens:
        x = torch.randn(t, D, device="cuda").bfloat16()
        logits = torch.randn(t, E, device="cuda")
        bias = torch.randn(E, device="cuda") * 0.1
        tw, ids = route(logits, bias, TOP_K, 1, 1, True, 2.5)
        touched = int((torch.bincount(ids.reshape(-1), minlength=E) > 0).sum())
        flops = 6.0 * t * TOP_K * INTER * D
        case = f"T={t} experts hit={touched}"

        ms = bench(partial(route, logits, bias, TOP_K, 1, 1, True, 2.5))
        gms = bench(partial(route, logits, bias, TOP_K, 1, 1, True, 2.5), graph=True)
        rms = bench(partial(route_ref, logits, bias, TOP_K, 1, 1, True, 2.5))
        row(rows, what="route (triton)", case=case, ms=ms, graph_ms=gms, gb=t * E * 4 / 1e9, best_ms=min(ms, gms),
            floor_bw_ms=t * E * 4 / ceil["copy_tbs"] / 1e9, floor_flop_ms=0.0)  # fmt: skip
        row(rows, what="route_ref", case=case, ms=rms, gb=t * E * 4 / 1e9, best_ms=rms,
            floor_bw_ms=t * E * 4 / ceil["copy_tbs"] / 1e9, floor_flop_ms=0.0)  # fmt: skip

        variants = []
        if grouped_mm_supported(x, w13_b, w2_b):
            variants.append(
                ("bf16 _grouped_mm", "bf16", partial(fused_moe_grouped_mm, x, w13_b, w2_b, tw, ids))
            )
        variants += [
            ("bf16 triton", "bf16", partial(fused_moe_triton, x, w13_b, w2_b, tw, ids)),
            ("fp8 W8A16 triton", "fp8",
             partial(fused_moe_triton, x, w13_8, w2_8, tw, ids, s13, s2, fp8_activations=False)),
            ("fp8 W8A8 triton", "fp8",
             partial(fused_moe_triton, x, w13_8, w2_8, tw, ids, s13, s2, fp8_activations=True)),
        ]  # fmt: skip
        if with_ref:
            variants += [
                ("bf16 fused_moe_ref", "bf16", partial(fused_moe_ref, x, w13_b, w2_b, tw, ids)),
                ("fp8 fused_moe_ref", "fp8", partial(fused_moe_ref, x, w13_8, w2_8, tw, ids, s13, s2)),
            ]
        for name, kind, fn in variants:
            ms = bench(fn)
            gms = bench(fn, graph=True) if "ref" not in name else None
            gb = touched * per_expert[kind] / 1e9
            rate = ceil["fp8_tflops"] if "W8A8" in name else ceil["bf16_tflops"]
            row(rows, what=name, case=case, ms=ms, graph_ms=gms, gb=gb, best_ms=min(ms, gms or ms),
                floor_bw_ms=gb / ceil["copy_tbs"], floor_flop_ms=flops / rate / 1e9)  # fmt: skip


def _sweep_weights():
    """GLM-5 TP8-rank expert weights for the tile sweep: random e4m3 codes (magnitudes ≤ 1.75,
    no NaN) and constant scales, made in place (no fp32 copy: many workers share the GPU)."""

    def codes(*shape):
        c = torch.randint(0, 0x3F, shape, dtype=torch.uint8, device="cuda")
        return c.view(torch.float8_e4m3fn)

    scale = lambda n, k: torch.full((E, n // 128, k // 128), 0.01, device="cuda")  # noqa: E731
    return codes(E, 2 * INTER, D), scale(2 * INTER, D), codes(E, D, INTER), scale(D, INTER)


def _sweep_call(weights, kind: str, gemm: int, t: int, cfg: dict):
    """The GEMM launch being timed: ``kind`` W8A16 (bf16 activations) or W8A8 (e4m3)."""
    w13_8, s13, w2_8, s2 = weights
    gen = torch.Generator(device="cuda").manual_seed(t)
    _, ids = route(torch.randn(t, E, device="cuda", generator=gen), None, TOP_K, 1, 1, True, 2.5)
    p = t * TOP_K
    lay = moe_align(ids, E, cfg["BLOCK_M"])
    if gemm == 1:
        a = torch.randn(t, D, device="cuda", generator=gen).bfloat16()
        w, ws, out = w13_8, s13, torch.empty(p, INTER, device="cuda", dtype=torch.bfloat16)
    else:
        a = torch.randn(p, INTER, device="cuda", generator=gen).bfloat16()
        w, ws, out = w2_8, s2, torch.empty(p, D, device="cuda", dtype=torch.bfloat16)
    a_s = None
    if kind == "W8A8":
        a, a_s = act_quant(a, 128, column_major_scale=False)
    return partial(moe_gemm, a, a_s, w, ws, lay, out, gather_top_k=TOP_K if gemm == 1 else None,
                   silu=gemm == 1, config=cfg)  # fmt: skip


def _sweep_grid(gemm: int, default: dict) -> list[dict]:
    bm0 = default["BLOCK_M"]
    grid = [default]
    for bm in sorted({max(16, bm0 // 2), bm0, min(128, bm0 * 2)}):
        for swap in (True, False) if bm <= 64 else (False,):
            for bn in (64, 128) if gemm == 1 else (128, 256):
                for warps in (4, 8):
                    for stages in (3, 4):
                        cfg = {"BLOCK_M": bm, "SWAP_AB": swap, "BLOCK_N": bn, "BLOCK_K": 128,
                               "num_warps": warps, "num_stages": stages}  # fmt: skip
                        if cfg != default:
                            grid.append(cfg)
    return grid


_WORKER_WEIGHTS = None


def _precompile(task) -> tuple[tuple, str | None]:
    """Run one sweep launch once in a worker process (fills Triton's on-disk cache)."""
    global _WORKER_WEIGHTS
    if _WORKER_WEIGHTS is None:
        _WORKER_WEIGHTS = _sweep_weights()
    kind, gemm, t, cfg = task
    try:
        _sweep_call(_WORKER_WEIGHTS, kind, gemm, t, cfg)()
        torch.cuda.synchronize()
    except Exception as exc:  # noqa: BLE001 - out of resources etc.: reported, not fatal
        return task, type(exc).__name__
    return task, None


def sweep_moe(tokens: list[int], jobs: int) -> list[dict]:
    """Time GEMM 1 (gate/up + SiLU) and GEMM 2 (down) alone over a tile grid around the
    default (:func:`gemm_config`), W8A16 below twice ``W8A8_MIN_TOKENS`` tokens and W8A8
    from half of it up (both around the switch). Kernels are compiled first by ``jobs`` worker processes."""
    import concurrent.futures
    import multiprocessing

    tasks = []
    for t in tokens:
        kinds = [
            k for k, on in (("W8A16", t < 2 * W8A8_MIN_TOKENS), ("W8A8", t >= W8A8_MIN_TOKENS // 2)) if on
        ]
        for kind in kinds:
            for gemm in (1, 2):
                default = gemm_config(t * TOP_K, E, gemm == 1, True)
                tasks += [(kind, gemm, t, cfg) for cfg in _sweep_grid(gemm, default)]
    failed: dict[str, str] = {}
    ctx = multiprocessing.get_context("spawn")
    with concurrent.futures.ProcessPoolExecutor(max_workers=jobs, mp_context=ctx) as pool:
        for task, err in pool.map(_precompile, tasks, chunksize=4):
            if err:
                failed[repr(task)] = err
    weights = _sweep_weights()
    results = []
    print(f"\nGrouped-GEMM tile sweep, {len(tasks)} launches ({len(failed)} failed to compile/run); "
          "ms are medians of one GEMM launch; default first, then the best 4")  # fmt: skip
    for t in tokens:
        for kind in ("W8A16", "W8A8"):
            for gemm in (1, 2):
                rows = []
                for task in tasks:
                    if task[:3] != (kind, gemm, t) or repr(task) in failed:
                        continue
                    ms = bench(_sweep_call(weights, kind, gemm, t, task[3]))
                    rows.append({"tokens": t, "kind": kind, "gemm": gemm, "ms": ms, "config": task[3]})
                if not rows:
                    continue
                default, best = rows[0], sorted(rows, key=lambda r: r["ms"])
                for label, r in [("default", default)] + [("best", r) for r in best[:4]]:
                    print(f"  T={t:5d} {kind:5s} GEMM{gemm} {label:7s} {r['ms']:8.4f} ms  {r['config']}")
                results += rows
    return results


def bench_dense(ms_rows: list[int], ceil: dict[str, float], rows: list[dict]) -> None:
    mode = scaled_mm_blockwise_mode(torch.device("cuda"))
    print(f"\nFP8 dense linears (GLM-5 TP8 rank); torch {torch.__version__}, _scaled_mm blockwise: {mode}")
    print(HEADER)
    torch.manual_seed(0)
    for name, k, n in DENSE:
        w8, ws = block_quant(torch.randn(n, k, device="cuda") / k**0.5)
        wb = block_dequant(w8, ws, (128, 128), torch.bfloat16)
        for m in ms_rows:
            x = torch.randn(m, k, device="cuda").bfloat16()
            flops = 2.0 * m * n * k
            for label, fn, wbytes, rate in (
                ("fp8 auto (scaled_mm)", partial(fp8_linear, x, w8, ws, (128, 128)), n * k, "fp8_tflops"),
                ("fp8 triton W8A8", partial(fp8_linear, x, w8, ws, (128, 128), path="triton"), n * k, "fp8_tflops"),
                ("fp8 triton W8A16", partial(fp8_linear, x, w8, ws, (128, 128), path="triton_w8a16"), n * k,
                 "bf16_tflops"),
                ("bf16 F.linear", partial(torch.nn.functional.linear, x, wb), 2 * n * k, "bf16_tflops"),
            ):  # fmt: skip
                ms = bench(fn)
                gms = bench(fn, graph=True)
                gb = wbytes / 1e9
                row(rows, what=label, case=f"{name} M={m} K={k} N={n}", ms=ms, graph_ms=gms, gb=gb,
                    best_ms=min(ms, gms), floor_bw_ms=gb / ceil["copy_tbs"], floor_flop_ms=flops / ceil[rate] / 1e9)  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", type=int, nargs="+", default=[128, 1024, 8192])
    ap.add_argument("--dense-m", type=int, nargs="+", default=[1, 128, 1024, 8192])
    ap.add_argument("--only", choices=["moe", "dense"], default=None)
    ap.add_argument(
        "--sweep", action="store_true", help="tile sweep of the Triton grouped GEMMs (FP8 weights)"
    )
    ap.add_argument("--sweep-jobs", type=int, default=8, help="processes compiling the sweep's kernels")
    ap.add_argument("--no-ref", action="store_true", help="skip timing the plain-PyTorch twins")
    ap.add_argument("--json", default=None, help="write all rows and ceilings here")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("needs a CUDA GPU")
    props = torch.cuda.get_device_properties(0)
    print(
        f"{props.name}, {props.multi_processor_count} SMs, torch {torch.__version__}, triton {triton.__version__}"
    )
    ceil = measure_ceilings()
    print(
        f"measured: copy {ceil['copy_tbs']:.2f} TB/s (datasheet {H200_COPY_TBS}), bf16 mm {ceil['bf16_tflops']:.0f} "
        f"TFLOP/s, fp8 mm {ceil['fp8_tflops']:.0f} TFLOP/s; floors below use the measured values"
    )
    rows: list[dict] = []
    if args.only in (None, "moe"):
        bench_moe(args.tokens, ceil, rows, with_ref=not args.no_ref)
        torch.cuda.empty_cache()
        if args.sweep:
            rows += sweep_moe(args.tokens, args.sweep_jobs)
            torch.cuda.empty_cache()
    if args.only in (None, "dense"):
        bench_dense(args.dense_m, ceil, rows)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {"ceilings": ceil, "rows": rows}, f, indent=1, default=lambda v: None if math.isnan(v) else v
            )


if __name__ == "__main__":
    main()
