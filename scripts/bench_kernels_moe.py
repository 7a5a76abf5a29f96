"""Benchmark the MoE layer and the FP8 dense linears at GLM-5 TP8-rank shapes on one GPU.

    python scripts/bench_kernels_moe.py                   # MoE T=128,1024,8192 + dense linears
    python scripts/bench_kernels_moe.py --sweep           # + tile sweep of the Triton grouped GEMMs
    python scripts/bench_kernels_moe.py --only moe --tokens 1024 --json $OUT/moe.json
    python scripts/bench_kernels_moe.py --only sweep --sweep-tokens 16 64 1024   # sweep + layer table only
    python scripts/bench_kernels_moe.py --only compare --sweep-tokens 16 64 1 128 1024 4096   # W8A16 vs W8A8

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
    fused_moe_grouped_mm,
    fused_moe_triton,
    gemm_config,
    grouped_mm_supported,
    moe_align,
    moe_fp8_activations,
    moe_gemm,
)

E, D, INTER, TOP_K = moe_shape(PRESETS["glm5-tp8-rank"])  # GLM-5, one TP8 rank: all experts, I = 2048 / 8
H200_COPY_TBS = 4.3
DEVICE = "cuda"  # the sweep's tensors (a dry run of its logic may point it elsewhere)

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
    """GLM-5 TP8-rank expert weights for the tile sweep: random e4m3 codes of both signs (no NaN)
    and random per-block scales, made in place (no fp32 copy: many workers share the GPU)."""

    def codes(*shape):
        c = torch.randint(0, 0x7F, shape, dtype=torch.uint8, device=DEVICE)
        c |= torch.randint(0, 2, shape, dtype=torch.uint8, device=DEVICE) << 7
        return c.view(torch.float8_e4m3fn)

    def scale(n, k):
        return torch.empty(E, n // 128, k // 128, device=DEVICE).uniform_(0.5, 1.5) / (448 * k**0.5)

    return codes(E, 2 * INTER, D), scale(2 * INTER, D), codes(E, D, INTER), scale(D, INTER)


def _sweep_inputs(t: int, gemm: int):
    """Uniform random routing of ``t`` tokens and the GEMM's bf16 input (``x`` or ``h``)."""
    gen = torch.Generator(device=DEVICE).manual_seed(t)
    _, ids = route(torch.randn(t, E, device=DEVICE, generator=gen), None, TOP_K, 1, 1, True, 2.5)
    rows = t if gemm == 1 else t * TOP_K
    a = torch.randn(rows, D if gemm == 1 else INTER, device=DEVICE, generator=gen).bfloat16()
    return ids, a


def _sweep_call(weights, kind: str, gemm: int, t: int, cfg: dict):
    """``(fn, out)``: the GEMM launch being timed, ``kind`` W8A16 (bf16 activations) or W8A8 (e4m3)."""
    w13_8, s13, w2_8, s2 = weights
    ids, a = _sweep_inputs(t, gemm)
    p = t * TOP_K
    lay = moe_align(ids, E, cfg["BLOCK_M"])
    if gemm == 1:
        w, ws, out = w13_8, s13, torch.empty(p, INTER, device=DEVICE, dtype=torch.bfloat16)
    else:
        w, ws, out = w2_8, s2, torch.empty(p, D, device=DEVICE, dtype=torch.bfloat16)
    a, a_s = act_quant(a, 128, column_major_scale=False) if kind == "W8A8" else (a, None)
    fn = partial(moe_gemm, a, a_s, w, ws, lay, out, gather_top_k=TOP_K if gemm == 1 else None,
                 silu=gemm == 1, config=cfg)  # fmt: skip
    return fn, out


def _sweep_twin(weights, gemm: int, t: int) -> torch.Tensor:
    """The GEMM's twin in fp32, expert by expert: weights dequantised like ``block_dequant`` to
    bf16, bf16 inputs; GEMM 1 ends in ``silu(g)·u``. Rows by pair."""
    w13_8, s13, w2_8, s2 = weights
    ids, a = _sweep_inputs(t, gemm)
    flat = ids.reshape(-1)
    w8, ws = (w13_8, s13) if gemm == 1 else (w2_8, s2)
    out = torch.empty(flat.numel(), INTER if gemm == 1 else D, device=DEVICE)
    for e in flat.unique().tolist():
        pairs = (flat == e).nonzero().squeeze(1)
        rows = a[pairs // TOP_K] if gemm == 1 else a[pairs]
        w = block_dequant(w8[e], ws[e], (128, 128), torch.bfloat16).float()
        y = rows.float() @ w.t()
        out[pairs] = torch.nn.functional.silu(y[:, :INTER]) * y[:, INTER:] if gemm == 1 else y
    return out


DECODE_SWEEP_TOKENS = (1, 8, 16, 32, 64)
#: Rows per expert on average from which the sweep tries the wide prefill tiles (and no stream kernel).
LARGE_SWEEP_ROWS = 128


def _sweep_grid(t: int, gemm: int, kind: str) -> list[dict]:
    """Default first (:func:`gemm_config`), then the grouped kernel around it (at decode sizes
    its swapped 16-row tiles in 3 and 4 stages) and the stream kernel over column tiles, tiles
    per program and pipeline depth; for long prompts wider grouped tiles, and for GEMM 2 the
    stream kernel with 64- and 128-pair blocks walking 4-16 column tiles."""
    default = gemm_config(t * TOP_K, E, gemm == 1, True, kind == "W8A8")
    grid = [default]
    decode = t <= max(DECODE_SWEEP_TOKENS)
    if decode:
        for stages in (3, 4):
            cfg = {"BLOCK_M": 16, "SWAP_AB": True, "num_warps": 4, "BLOCK_N": 64 if gemm == 1 else 128,
                   "BLOCK_K": 128, "num_stages": stages}  # fmt: skip
            if cfg not in grid:
                grid.append(cfg)
    else:
        bm0 = default["BLOCK_M"]
        for bm in sorted({bm0, max(16, bm0 // 2), min(128, bm0 * 2)}):
            for stages in (3, 4, 5):
                cfg = {**default, "BLOCK_M": bm, "num_stages": stages, "SWAP_AB": bm <= 32,
                       "num_warps": 8 if bm >= 128 else 4}  # fmt: skip
                if cfg not in grid:
                    grid.append(cfg)
    if t * TOP_K >= LARGE_SWEEP_ROWS * E:  # long prompts: wider tiles (the FLOPs, not the weights, bound them)
        for bm, bn, warps in ((128, 128, 8), (256, 64, 8), (64, 128, 4), (128, 64, 4)):
            for stages in (3, 4):
                cfg = {"BLOCK_M": bm, "SWAP_AB": False, "num_warps": warps, "BLOCK_N": bn, "BLOCK_K": 128,
                       "num_stages": stages}  # fmt: skip
                if cfg not in grid:
                    grid.append(cfg)
        if gemm == 2:  # K = I is two k-blocks: a program per tile is mostly start-up; walk several tiles
            for bm, tn, stages in ((64, 8, 3), (64, 16, 4), (128, 4, 4), (128, 8, 3)):
                grid.append({"KERNEL": "stream", "BLOCK_M": bm, "BLOCK_N": 128, "BLOCK_K": 128, "TILES_N": tn,
                             "num_warps": 8, "num_stages": stages})  # fmt: skip
        return grid  # below: the stream kernel for few rows per expert
    tiles = [(32, 1), (64, 1), (128, 1)] if gemm == 1 else [(64, 4), (64, 8), (128, 1), (128, 2), (128, 4), (128, 8)]
    for bm in (16,) if decode else (16, 32, 64):
        for bn, tn in tiles:
            for stages in (4, 6) if decode and gemm == 1 else (4,):
                cfg = {"KERNEL": "stream", "BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": 128, "TILES_N": tn,
                       "num_warps": 8 if bn * bm >= 128 * 64 else 4, "num_stages": stages}  # fmt: skip
                if cfg not in grid:
                    grid.append(cfg)
    return grid


def _short(cfg: dict) -> str:
    """A sweep config in a few characters, e.g. ``stream m16 n128x4 k128 s4 w4``."""
    kernel = cfg.get("KERNEL", "grouped")
    swap = " swap" if kernel == "grouped" and cfg.get("SWAP_AB") else ""
    return (f"{kernel} m{cfg['BLOCK_M']} n{cfg['BLOCK_N']}x{cfg.get('TILES_N', 1)} k{cfg['BLOCK_K']} "
            f"s{cfg['num_stages']} w{cfg['num_warps']}{swap}")  # fmt: skip


def _sweep_tasks(tokens: list[int], kinds: tuple[str, ...] = ("W8A16", "W8A8")) -> list[tuple]:
    tasks = []
    for t in tokens:
        for kind in kinds:
            for gemm in (1, 2):
                tasks += [(kind, gemm, t, cfg) for cfg in _sweep_grid(t, gemm, kind)]
    return tasks


_WORKER_WEIGHTS = None


def _precompile(task) -> tuple[tuple, str | None]:
    """Run one sweep launch once in a worker process (fills Triton's on-disk cache)."""
    global _WORKER_WEIGHTS
    if _WORKER_WEIGHTS is None:
        _WORKER_WEIGHTS = _sweep_weights()
    kind, gemm, t, cfg = task
    try:
        _sweep_call(_WORKER_WEIGHTS, kind, gemm, t, cfg)[0]()
        if DEVICE == "cuda":
            torch.cuda.synchronize()
    except Exception as exc:  # noqa: BLE001 - out of resources etc.: reported, not fatal
        return task, type(exc).__name__
    return task, None


def _touched(t: int) -> int:
    ids, _ = _sweep_inputs(t, 1)
    return int((torch.bincount(ids.reshape(-1), minlength=E) > 0).sum())


def _compile_in_workers(tasks: list, jobs: int, what: str, chunksize: int) -> dict[str, str]:
    """Run each launch of ``tasks`` once in ``jobs`` spawned worker processes (Triton's on-disk
    cache then holds every kernel the timing loop needs); returns ``{repr(task): error}`` of those
    that failed and prints one line (``what``: the sweep's name)."""
    import concurrent.futures
    import multiprocessing
    import time

    failed: dict[str, str] = {}
    t0 = time.time()
    if jobs:
        ctx = multiprocessing.get_context("spawn")
        with concurrent.futures.ProcessPoolExecutor(max_workers=jobs, mp_context=ctx) as pool:
            for task, err in pool.map(_precompile, tasks, chunksize=chunksize):
                if err:
                    failed[repr(task)] = err
    print(f"\n{what}: {len(tasks)} launches compiled in {time.time() - t0:.0f} s "
          f"({len(failed)} failed: {sorted(set(failed.values()))})", flush=True)  # fmt: skip
    return failed


def sweep_moe(tokens: list[int], jobs: int, budget_s: float, kinds: tuple[str, ...] = ("W8A16", "W8A8")) -> list[dict]:
    """Time GEMM 1 (gate/up + SiLU) and GEMM 2 (down) alone over :func:`_sweep_grid` at uniform
    random routing: µs per call (median of CUDA-event timings, L2 flushed before each), the
    touched experts' weight bytes per second, and the relative error against the twin
    (:func:`_sweep_twin`; W8A8 deviates by its activation quantisation). Kernels are compiled
    first by ``jobs`` worker processes; timing stops at ``budget_s``."""
    import time

    tasks = _sweep_tasks(tokens, kinds)
    t0 = time.time()  # the budget counts the compiles too
    failed = _compile_in_workers(tasks, jobs, "Grouped-GEMM sweep", chunksize=2)
    weights = _sweep_weights()
    results = []
    for t in tokens:
        touched = _touched(t)
        twins = {g: _sweep_twin(weights, g, t) for g in (1, 2)}
        for task in tasks:
            kind, gemm, tt, cfg = task
            if tt != t or repr(task) in failed or time.time() - t0 > budget_s:
                continue
            fn, out = _sweep_call(weights, kind, gemm, t, cfg)
            fn()
            err = ((out.float() - twins[gemm]).norm() / twins[gemm].norm()).item()
            us = 1e3 * triton.testing.do_bench(fn, warmup=10, rep=30, return_mode="median")
            gb = touched * (2 if gemm == 1 else 1) * INTER * D / 1e9
            results.append({"tokens": t, "kind": kind, "gemm": gemm, "us": us, "tbs": gb / us * 1e3,
                            "err": err, "touched": touched, "config": cfg})  # fmt: skip
            print(f"  T={t:5d} {kind:5s} GEMM{gemm} {us:9.1f} us {gb / us * 1e3:5.2f} TB/s err {err:.1e} {_short(cfg)}",
                  flush=True)  # fmt: skip
    print("\nsweep summary: per (tokens, GEMM) the default, then the best 3 (µs, touched-expert TB/s, rel err)")
    for t in tokens:
        for gemm in (1, 2):
            rows = [r for r in results if r["tokens"] == t and r["gemm"] == gemm]
            if not rows:
                continue
            kind = "W8A8" if moe_fp8_activations() else "W8A16"
            default = next((r for r in rows if r["kind"] == kind
                            and r["config"] == gemm_config(t * TOP_K, E, gemm == 1, True, kind == "W8A8")), None)  # fmt: skip
            for label, r in [("dflt", default)] + [("best", r) for r in sorted(rows, key=lambda r: r["us"])[:3]]:
                if r is not None:
                    print(f"T={t:5d} G{gemm} {label:5s} {r['kind']:5s} {r['us']:8.1f} us {r['tbs']:5.2f} TB/s "
                          f"err {r['err']:.1e} {_short(r['config'])}")  # fmt: skip
    return results


def layer_moe(tokens: list[int], results: list[dict]) -> None:
    """The routed-expert layer at uniform random routing: the default dispatch (``fused_moe``: the
    decode kernels up to ``DECODE_MAX_TOKENS`` tokens, else the grouped GEMMs), the decode
    kernels at up to 16 tokens, and the Triton GEMMs with the sweep's fastest GEMM 1 and GEMM 2
    of one activation kind and ``BLOCK_M`` (a pair): µs (L2 flushed, eager: at decode sizes the
    launches' host time, not the GPU, sets these; compare kernels by the sweep), touched-expert TB/s,
    relative error against ``fused_moe_ref`` (W8A8 includes its activation quantisation)."""
    from breakgraph.kernels.moe import fused_moe
    from breakgraph.kernels.triton_moe import fused_moe_decode

    w13_8, s13, w2_8, s2 = _sweep_weights()
    print("\nMoE layer (routed experts), uniform random routing; µs per call, touched-expert TB/s, rel err vs twin")
    for t in tokens:
        gen = torch.Generator(device=DEVICE).manual_seed(1000 + t)
        x = torch.randn(t, D, device=DEVICE, generator=gen).bfloat16()
        tw, ids = route(torch.randn(t, E, device=DEVICE, generator=gen), None, TOP_K, 1, 1, True, 2.5)
        touched = int((torch.bincount(ids.reshape(-1), minlength=E) > 0).sum())
        gb = touched * 3 * INTER * D / 1e9
        want = fused_moe_ref(x, w13_8, w2_8, tw, ids, s13, s2).float()
        args = (x, w13_8, w2_8, tw, ids, s13, s2)
        variants = [("default: fused_moe", partial(fused_moe, *args))]
        if t <= 16:
            variants.append(("decode kernels", partial(fused_moe_decode, *args)))
        for kind in ("W8A16", "W8A8"):
            rows = [r for r in results if r["tokens"] == t and r["kind"] == kind]
            pairs = []
            for bm in sorted({r["config"]["BLOCK_M"] for r in rows}):
                g1 = min((r for r in rows if r["gemm"] == 1 and r["config"]["BLOCK_M"] == bm), key=lambda r: r["us"],
                         default=None)  # fmt: skip
                g2 = min((r for r in rows if r["gemm"] == 2 and r["config"]["BLOCK_M"] == bm), key=lambda r: r["us"],
                         default=None)  # fmt: skip
                if g1 and g2:
                    pairs.append((g1["us"] + g2["us"], g1["config"], g2["config"]))
            if pairs:
                _, c1, c2 = min(pairs, key=lambda p: p[0])
                fn = partial(fused_moe_triton, *args, fp8_activations=kind == "W8A8", configs=(c1, c2))
                variants.append((f"best {kind}: {_short(c1)} | {_short(c2)}", fn))
        for name, fn in variants:
            err = ((fn().float() - want).norm() / want.norm()).item()
            us = 1e3 * bench(fn)
            print(f"  T={t:5d} touched={touched:3d} {us:9.1f} us {gb / us * 1e3:5.2f} TB/s err {err:.1e}  {name}",
                  flush=True)  # fmt: skip


def _compare_grid(t: int, gemm: int) -> list[tuple[str, str, dict]]:
    """``(label, kind, config)`` rows of :func:`compare_moe` for one token count and GEMM: the
    W8A16 default (bf16 activations, every weight scaled in registers) and the W8A8 default."""
    silu = gemm == 1
    return [("W8A16", "W8A16", gemm_config(t * TOP_K, E, silu, True, False)),
            ("W8A8", "W8A8", gemm_config(t * TOP_K, E, silu, True, True))]  # fmt: skip


def compare_moe(tokens: list[int], jobs: int, budget_s: float) -> list[dict]:
    """W8A16 (``BREAKGRAPH_MOE_W8A8=0``) and W8A8 (the default), per GEMM at uniform random routing (µs per call, L2 flushed; touched-expert weight bytes per µs; relative error against
    the bf16-activation twin), W8A8's activation quantisation timed on its own; then per token
    count the layer's two GEMMs (+ quantisations) for each kind and, at decode sizes, the decode
    kernels on the routed experts; a summary table last."""
    import time

    from breakgraph.kernels.triton_moe import DECODE_MAX_TOKENS, decode_config, fused_moe_decode

    tasks = [(kind, gemm, t, cfg) for t in tokens for gemm in (1, 2) for _, kind, cfg in _compare_grid(t, gemm)]
    unique = list({repr(task): task for task in tasks}.values())
    t0 = time.time()  # the budget counts the compiles too
    failed = _compile_in_workers(unique, jobs, "MoE comparison", chunksize=1)
    weights = _sweep_weights()
    results = []
    for t in tokens:
        touched = _touched(t)
        twins = {g: _sweep_twin(weights, g, t) for g in (1, 2)}
        for gemm in (1, 2):
            gb = touched * (2 if gemm == 1 else 1) * INTER * D / 1e9
            for label, kind, cfg in _compare_grid(t, gemm):
                task = (kind, gemm, t, cfg)
                if repr(task) in failed or time.time() - t0 > budget_s:
                    continue
                fn, out = _sweep_call(weights, kind, gemm, t, cfg)
                fn()
                err = ((out.float() - twins[gemm]).norm() / twins[gemm].norm()).item()
                us = 1e3 * triton.testing.do_bench(fn, warmup=10, rep=30, return_mode="median")
                results.append({"tokens": t, "gemm": gemm, "label": label, "kind": kind, "us": us,
                                "tbs": gb / us * 1e3, "err": err, "touched": touched, "config": cfg})  # fmt: skip
                print(f"  T={t:5d} G{gemm} {label:5s} {us:8.1f} us {gb / us * 1e3:5.2f} TB/s err {err:.1e} "
                      f"{_short(cfg)}", flush=True)  # fmt: skip
            _, a = _sweep_inputs(t, gemm)
            quant = partial(act_quant, a, 128, column_major_scale=False)
            us = 1e3 * triton.testing.do_bench(quant, warmup=10, rep=30, return_mode="median")
            results.append({"tokens": t, "gemm": gemm, "label": "act quant", "kind": "W8A8", "us": us})
        if t <= DECODE_MAX_TOKENS:
            gen = torch.Generator(device=DEVICE).manual_seed(t)
            x = torch.randn(t, D, device=DEVICE, generator=gen).bfloat16()
            tw, ids = route(torch.randn(t, E, device=DEVICE, generator=gen), None, TOP_K, 1, 1, True, 2.5)
            w13_8, s13, w2_8, s2 = weights
            want = fused_moe_ref(x, w13_8, w2_8, tw, ids, s13, s2).float()
            old, new = (decode_config(t, TOP_K, INTER, D, False, scale_x=sx) for sx in (False, True))
            for label, cfg in (("decode kernels old", old), ("decode kernels", new)):
                dec = partial(fused_moe_decode, x, w13_8, w2_8, tw, ids, s13, s2, config=cfg)
                err = ((dec().float() - want).norm() / want.norm()).item()
                us = 1e3 * triton.testing.do_bench(dec, warmup=10, rep=30, return_mode="median")
                results.append({"tokens": t, "gemm": 0, "label": label, "kind": "W8A16", "us": us, "err": err,
                                "tbs": t * TOP_K * 3 * INTER * D / 1e3 / us, "touched": touched})  # fmt: skip
                print(f"  T={t:5d} {label}: {us:.1f} us, {t * TOP_K * 3 * INTER * D / 1e3 / us:.2f} TB/s of the "
                      f"routed pairs' expert bytes, err {err:.1e}", flush=True)  # fmt: skip
    _print_compare(tokens, results)
    return results


def _print_compare(tokens: list[int], results: list[dict]) -> None:
    def get(t, gemm, label):
        rows = [r for r in results if r["tokens"] == t and r["gemm"] == gemm and r["label"] == label]
        return min(rows, key=lambda r: r["us"]) if rows else None

    def cell(r):
        return f"{r['us']:7.1f} ({r['tbs']:4.2f})"

    print("\nMoE summary (µs per call, touched-expert TB/s; L2 flushed; uniform random routing).")
    print(f"{'T':>5} {'exp':>4} {'GEMM':>5} | {'W8A16':>14} | {'W8A8':>14} | {'quant':>6} | err W8A16 / W8A8")
    print("quant: act_quant of the GEMM's input (x for GEMM 1, h for GEMM 2)")
    for t in tokens:
        pair = {"w8a16": 0.0, "w8a8": 0.0}
        for gemm in (1, 2):
            w8a16, w8a8, quant = get(t, gemm, "W8A16"), get(t, gemm, "W8A8"), get(t, gemm, "act quant")
            if not (w8a16 and w8a8 and quant):
                print(f"{t:5d} G{gemm}: incomplete (budget)")
                pair = None
                break
            pair["w8a16"] += w8a16["us"]
            pair["w8a8"] += w8a8["us"] + quant["us"]
            print(f"{t:5d} {w8a16['touched']:4d} {gemm:5d} | {cell(w8a16)} | {cell(w8a8)} | {quant['us']:6.1f} | "
                  f"{w8a16['err']:.1e} / {w8a8['err']:.1e}")  # fmt: skip
        if pair:
            dec, dec0 = get(t, 0, "decode kernels"), get(t, 0, "decode kernels old")
            extra = (f"; decode kernels (routed experts only) {dec0['us']:.1f} -> {dec['us']:.1f} us "
                     f"({dec0['tbs']:.2f} -> {dec['tbs']:.2f} TB/s of routed-pair bytes)") if dec and dec0 else ""  # fmt: skip
            print(f"{t:5d} layer GEMMs: W8A16 {pair['w8a16']:.1f}, W8A8 + 2 quants {pair['w8a8']:.1f} us{extra}")


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
    ap.add_argument("--only", choices=["moe", "dense", "sweep", "compare"], default=None,
                    help="sweep: only the grouped-GEMM sweep and the layer table after it; compare: W8A16 and "
                         "W8A8 per GEMM (+ W8A8's activation quantisations), with a summary table")  # fmt: skip
    ap.add_argument(
        "--sweep", action="store_true", help="tile sweep of the Triton grouped GEMMs (FP8 weights)"
    )
    ap.add_argument("--sweep-jobs", type=int, default=8, help="processes compiling the sweep's kernels")
    ap.add_argument("--sweep-tokens", type=int, nargs="+", default=[*DECODE_SWEEP_TOKENS, 128, 1024, 4096])
    ap.add_argument("--sweep-budget-s", type=float, default=600.0, help="stop timing sweep rows after this")
    ap.add_argument("--sweep-kinds", nargs="+", default=["W8A16", "W8A8"], choices=["W8A16", "W8A8"],
                    help="activation kinds the sweep times (W8A8: FP8 activations, the default path)")
    ap.add_argument("--no-ref", action="store_true", help="skip timing the plain-PyTorch twins")
    ap.add_argument("--json", default=None, help="write all rows and ceilings here")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("needs a CUDA GPU")
    props = torch.cuda.get_device_properties(0)
    print(
        f"{props.name}, {props.multi_processor_count} SMs, torch {torch.__version__}, triton {triton.__version__}"
    )
    if args.only == "compare":
        rows = compare_moe(args.sweep_tokens, args.sweep_jobs, args.sweep_budget_s)
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"rows": rows}, f, indent=1)
        return
    ceil = measure_ceilings()
    print(
        f"measured: copy {ceil['copy_tbs']:.2f} TB/s (datasheet {H200_COPY_TBS}), bf16 mm {ceil['bf16_tflops']:.0f} "
        f"TFLOP/s, fp8 mm {ceil['fp8_tflops']:.0f} TFLOP/s; floors below use the measured values"
    )
    rows: list[dict] = []
    if args.only in (None, "moe"):
        bench_moe(args.tokens, ceil, rows, with_ref=not args.no_ref)
        torch.cuda.empty_cache()
    if args.only == "sweep" or (args.sweep and args.only in (None, "moe")):
        sweep_rows = sweep_moe(args.sweep_tokens, args.sweep_jobs, args.sweep_budget_s, tuple(args.sweep_kinds))
        layer_moe(args.sweep_tokens, sweep_rows)
        rows += sweep_rows
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
