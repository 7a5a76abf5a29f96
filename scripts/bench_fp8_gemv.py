"""Decode-row FP8 linears and RMSNorm at glm5-tp8-rank shapes (CUDA): µs per call.

    python scripts/bench_fp8_gemv.py [--out DIR] [--deadline-s 120]

FP8 linears (K, N as the engine runs them: q_a ‖ wk ‖ kv_a, kv_a alone, q_b, the indexer's wq_b,
o_proj, the dense MLP, the shared expert) at M = 1, 2, 4, 8, 16, 32, 64 through today's paths
(``triton``: activation quantisation + W8A8 GEMM; ``triton_w8a16``; ``scaled_mm`` where cuBLAS
takes the shape) and the GEMV (``gemv``: its default configuration; ``gemv_*``: variants of
it). Each call is timed replayed from a CUDA graph that cycles through enough copies of the
weight to exceed the L2 cache, as a decode step reads each layer's weights from HBM once.
RMSNorm: one program per row at 1/16/64 rows, the default 1-D row kernel beside the
``[groups, 128]`` row tile (``BREAKGRAPH_NORM_ROW_TILE=1``) at its default ``num_warps`` and others.

The bf16 → fp32 products of the indexer's head weights and the router, and decode's absorbed
MLA products (``bmm_into``): cuBLAS against the Triton kernel. Last, what the engine's start-up timing chooses per shape with the GEMV among its paths.
Writes ``DIR/fp8_gemv_sweep.json`` and prints the summary tables last. Past ``--deadline-s``
the remaining measurements are skipped (the tables cover what ran).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from functools import partial
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from breakgraph.kernels import triton_fp8_gemv, triton_norm  # noqa: E402
from breakgraph.kernels.fp8 import block_quant  # noqa: E402
from breakgraph.kernels.triton_fp8 import fp8_linear, scaled_mm_takes  # noqa: E402

SHAPES = {  # decode's order of importance (78 layers each for the first four), as time may run out
    "q_a|wk|kv_a": (6144, 2752), "o_proj": (2048, 6144), "wq_b": (2048, 4096), "q_b": (2048, 2048),
    "mlp.gate_up": (6144, 3072), "mlp.down": (1536, 6144), "kv_a": (6144, 576),
    "shared.gate_up": (6144, 512), "shared.down": (256, 6144),
}  # fmt: skip
ROWS = (1, 2, 4, 8, 16, 32, 64)
TODAY = ("triton", "triton_w8a16", "scaled_mm")
L2_BYTES = 200 << 20  # several times the H200's 50 MB L2


def gemv_variants(m: int) -> dict[str, dict]:
    """The GEMV configurations tried at ``m`` rows (overrides of its default; ``_programs_per_sm``
    is :func:`gemv_config`'s argument)."""
    v = {"gemv": {}, "gemv_noasm": {"ASM": False}, "gemv_sum": {"FIXUP": False}}
    for p in (4, 16):
        v[f"gemv_p{p}"] = {"_programs_per_sm": p}
    if m <= 32:
        v["gemv_n64w2"] = {"BLOCK_N": 64, "num_warps": 2}
    v["gemv_n128w4"] = {"BLOCK_N": 128, "num_warps": 4}
    if m <= 4:
        v["gemv_fma"] = {"DOT": False, "BLOCK_M": 1 if m == 1 else (2 if m == 2 else 4), "BLOCK_N": 16, "num_warps": 1}
    return v


def gemv_call(x, w8, ws, override: dict) -> torch.Tensor:
    """:func:`fp8_gemv` with ``override`` on top of its default configuration (the split
    recomputed when the override changes the tiles or programs per SM)."""
    m, k = x.shape
    n = w8.shape[0]
    sms = torch.cuda.get_device_properties(x.device).multi_processor_count
    override = dict(override)
    per_sm = override.pop("_programs_per_sm", triton_fp8_gemv.PROGRAMS_PER_SM)
    cfg = triton_fp8_gemv.gemv_config(m, n, k, sms, per_sm)
    cfg.update(override)
    tiles = -(-m // cfg["BLOCK_M"]) * -(-n // cfg["BLOCK_N"])
    k_blocks = -(-k // 128)
    cfg["SPLIT_K"] = max(1, min(-(-per_sm * sms // tiles), k_blocks // triton_fp8_gemv.MIN_SPLIT_BLOCKS))
    return triton_fp8_gemv.fp8_gemv(x, w8, ws, None, torch.bfloat16, cfg)


def graph_us(calls: list, replays: int = 5) -> float:
    """µs per call of the callables ``calls`` captured once each into one CUDA graph (best of
    ``replays``); inf when it fails."""
    try:
        for fn in calls[:2]:
            fn()
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for fn in calls:
                fn()
        graph.replay()
        torch.cuda.synchronize()
        best = float("inf")
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        for _ in range(replays):
            start.record()
            graph.replay()
            end.record()
            end.synchronize()
            best = min(best, start.elapsed_time(end) * 1e3 / len(calls))
        del graph
        return best
    except (RuntimeError, ValueError) as exc:
        print(f"    failed: {str(exc).splitlines()[0][:160]}", flush=True)
        return float("inf")


def check(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.float() - want).norm() / want.norm()).item()


def sweep_linears(deadline: float) -> dict:
    results: dict = {}
    gen = torch.Generator(device="cuda").manual_seed(0)
    for name, (k, n) in SHAPES.items():
        w8, ws = block_quant(torch.randn(n, k, device="cuda", generator=gen) / k**0.5)
        copies = max(2, min(64, -(-L2_BYTES // (n * k))))
        weights = [(w8.clone(), ws.clone()) for _ in range(copies)]
        for m in ROWS:
            if time.monotonic() > deadline:
                print(f"deadline: skipping {name} M={m} on", flush=True)
                return results
            x = torch.randn(m, k, device="cuda", generator=gen).bfloat16()
            want = triton_fp8_gemv.fp8_gemv_ref(x, w8, ws)
            row: dict[str, float] = {}
            paths = [p for p in TODAY if p != "scaled_mm" or scaled_mm_takes(k, n, x.device)]
            for path in paths:
                fn = partial(fp8_linear, x, block=(128, 128), path=path)
                row[path] = graph_us([partial(fn, weight=w, scale=s) for w, s in weights])
            for vname, override in gemv_variants(m).items():
                try:
                    err = check(gemv_call(x, w8, ws, override), want)
                except Exception as exc:  # noqa: BLE001 - a variant that fails is reported, not fatal
                    print(f"    {vname} failed: {str(exc).splitlines()[0][:160]}", flush=True)
                    row[vname] = float("inf")
                    continue
                if not err < 4e-3:
                    print(f"    {vname} WRONG: relative error {err:.2e}", flush=True)
                    row[vname] = float("inf")
                    continue
                row[vname] = graph_us([partial(gemv_call, x, w, s, override) for w, s in weights])
            results[f"{name} K={k} N={n} M={m}"] = row
            print(f"{name:15s} K={k:5d} N={n:5d} M={m:3d} " + " ".join(f"{p}={t:.1f}" for p, t in row.items()), flush=True)
        del weights
    return results


NORMS = {"input/post-attn (6144, +res, fp8)": (6144, True, True), "q_a (2048, fp8)": (2048, False, True),
         "final (6144, +res)": (6144, True, False)}  # fmt: skip


def sweep_norms(deadline: float) -> dict:
    results: dict = {}
    for name, (n, residual, quant) in NORMS.items():
        for m in (1, 16, 64):
            if time.monotonic() > deadline:
                return results
            xs = [torch.randn(m, n, device="cuda", dtype=torch.bfloat16) for _ in range(8)]
            r = torch.randn(m, n, device="cuda", dtype=torch.bfloat16) if residual else None
            w = torch.randn(n, device="cuda", dtype=torch.bfloat16)
            pad = 1 if quant else 0
            row = {
                "row1d": graph_us([partial(triton_norm._launch, x, r, w, 1e-6, pad, row_tile=False) for x in xs] * 4),
                "tile": graph_us([partial(triton_norm._launch, x, r, w, 1e-6, pad, row_tile=True) for x in xs] * 4),
            }
            for warps in (2, 4, 8, 16):
                row[f"w{warps}"] = graph_us(
                    [partial(triton_norm._launch, x, r, w, 1e-6, pad, warps, row_tile=True) for x in xs] * 4
                )  # fmt: skip
            results[f"{name} M={m}"] = row
            print(f"norm {name:34s} M={m:3d} " + " ".join(f"{p}={t:.2f}" for p, t in row.items()), flush=True)
    return results


FP32_OUT = {"indexer head weights (6144 -> 32, scaled)": (32, 32**-0.5), "router (6144 -> 256)": (256, 1.0)}


def sweep_fp32_out(deadline: float) -> dict:
    """bf16 × bf16 → fp32 products of the indexer's head weights and the router: cuBLAS (the
    split-K GEMM, its reduction, the scaling) against the one-kernel GEMV."""
    from breakgraph.kernels.linear import _mm_fp32_out
    from breakgraph.kernels.triton_fp8_gemv import gemv_fp32_out, gemv_fp32_out_ref

    results: dict = {}
    for name, (n, alpha) in FP32_OUT.items():
        ws = [(torch.randn(n, 6144, device="cuda") * 0.02).bfloat16() for _ in range(64)]
        for m in (1, 16, 64):
            if time.monotonic() > deadline:
                return results
            x = torch.randn(m, 6144, device="cuda").bfloat16()
            err = check(gemv_fp32_out(x, ws[0], alpha), gemv_fp32_out_ref(x, ws[0], alpha))
            row = {"cublas": graph_us([partial(_mm_fp32_out, x, w, alpha) for w in ws]),
                   "gemv": graph_us([partial(gemv_fp32_out, x, w, alpha) for w in ws]) if err < 1e-5 else float("inf")}  # fmt: skip
            results[f"{name} M={m}"] = row
            print(f"fp32-out {name:40s} M={m:3d} err={err:.1e} " + " ".join(f"{p}={t:.2f}" for p, t in row.items()), flush=True)
    return results


def sweep_bmm(deadline: float) -> dict:
    """Decode's absorbed-MLA products (8 heads): ``q_nope · w_kc`` into the latent query's view
    and ``attn · w_vcᵀ``, cuBLAS ``bmm(out=)`` against the one-launch Triton kernel."""
    from breakgraph.kernels.triton_fp8_gemv import bmm_rows

    heads, dn, r, dr, dv = 8, 192, 512, 64, 256
    results: dict = {}
    kc = [(torch.randn(heads, dn, r, device="cuda") * 0.1).bfloat16() for _ in range(64)]
    vc = [(torch.randn(heads, dv, r, device="cuda") * 0.1).bfloat16() for _ in range(64)]
    for t in (1, 16, 64):
        if time.monotonic() > deadline:
            return results
        q = torch.randn(t, heads, dn + dr, device="cuda").bfloat16()
        q_full = torch.zeros(t, heads, r + dr, device="cuda").bfloat16()
        attn = torch.randn(t, heads, r, device="cuda").bfloat16()
        out = torch.empty(t, heads, dv, device="cuda").bfloat16()
        a, view = q[..., :dn].transpose(0, 1), q_full[..., :r].transpose(0, 1)
        a2, out2 = attn.transpose(0, 1), out.transpose(0, 1)
        for name, calls in (
            ("q_nope·w_kc", [(a, w, view) for w in kc]),
            ("attn·w_vc^T", [(a2, w.transpose(1, 2), out2) for w in vc]),
        ):
            row = {
                "cublas": graph_us([partial(torch.bmm, x, w, out=o) for x, w, o in calls]),
                "triton": graph_us([partial(bmm_rows, x, w, o) for x, w, o in calls]),
            }
            results[f"{name} M={t}"] = row
            print(f"bmm {name:12s} M={t:3d} " + " ".join(f"{p}={v:.2f}" for p, v in row.items()), flush=True)
    return results


def engine_tables(deadline: float) -> list[str]:
    """What the engine's start-up timing (:func:`tune_fp8_paths`, up to 64 rows) chooses per shape
    with the GEMV among its paths and L2-cold weights (``BREAKGRAPH_FP8_GEMV=1``,
    ``BREAKGRAPH_FP8_TIMING_COLD=1``)."""
    import os

    from breakgraph.kernels import fp8_gemm_choice
    from breakgraph.kernels.triton_fp8 import tune_fp8_paths

    os.environ.update(BREAKGRAPH_FP8_GEMV="1", BREAKGRAPH_FP8_TIMING_COLD="1")
    lines = []
    for name, shape in SHAPES.items():
        if time.monotonic() > deadline:
            break
        table = tune_fp8_paths([shape], torch.device("cuda"), 64)[shape]
        lines.append(f"start-up choice {name} K={shape[0]} N={shape[1]}: {fp8_gemm_choice.describe(table)}")
        print(lines[-1], flush=True)
    return lines


def summary(linears: dict, norms: dict, fp32_out: dict, bmm: dict, tables: list[str]) -> str:
    lines = ["", "| linear | M | today best (µs) | gemv default | best gemv variant | speed-up |", "|---|---|---|---|---|---|"]
    for key, row in linears.items():
        today = {p: t for p, t in row.items() if p in TODAY}
        gemv = {p: t for p, t in row.items() if p.startswith("gemv")}
        tb = min(today, key=today.get)
        gb = min(gemv, key=gemv.get)
        name, rest = key.split(" K=")
        m = rest.split("M=")[1]
        lines.append(
            f"| {name} K={rest.split(' M=')[0]} | {m} | {tb} {today[tb]:.1f} | {gemv['gemv']:.1f} | {gb} {gemv[gb]:.1f} "
            f"| {today[tb] / gemv[gb]:.2f}x |"
        )
    lines += ["", "| norm | rows | 1-D row (µs, default) | row tile | row tile, best warps |", "|---|---|---|---|---|"]
    for key, row in norms.items():
        name, m = key.rsplit(" M=", 1)
        warps = {p: t for p, t in row.items() if p.startswith("w")}
        wb = min(warps, key=warps.get)
        lines.append(f"| {name} | {m} | {row['row1d']:.2f} | {row['tile']:.2f} | {wb} {warps[wb]:.2f} |")
    lines += ["", "| fp32-output product | rows | cuBLAS (µs) | GEMV (µs) |", "|---|---|---|---|"]
    for key, row in fp32_out.items():
        name, m = key.rsplit(" M=", 1)
        lines.append(f"| {name} | {m} | {row['cublas']:.2f} | {row['gemv']:.2f} |")
    for key, row in bmm.items():
        name, m = key.rsplit(" M=", 1)
        lines.append(f"| bmm {name} | {m} | {row['cublas']:.2f} | {row['triton']:.2f} |")
    return "\n".join(lines + [""] + tables)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, default=Path("."))
    ap.add_argument("--deadline-s", type=float, default=600.0, help="skip what is left after this many seconds")
    args = ap.parse_args()
    deadline = time.monotonic() + args.deadline_s
    fp32_out = sweep_fp32_out(deadline)
    bmm = sweep_bmm(deadline)
    linears = sweep_linears(deadline - 25)  # the norms keep their share of the time
    norms = sweep_norms(deadline)
    tables = engine_tables(deadline)
    args.out.mkdir(parents=True, exist_ok=True)
    body = {"linears": linears, "norms": norms, "fp32_out": fp32_out, "bmm": bmm, "start_up_tables": tables}
    (args.out / "fp8_gemv_sweep.json").write_text(json.dumps(body, indent=1))
    print(summary(linears, norms, fp32_out, bmm, tables), flush=True)


if __name__ == "__main__":
    main()
