"""Time the MoE layer at decode sizes, GLM-5 TP8 rank (FP8): today's path against the decode
kernels, beside the weight-bytes floor; then sweep the decode kernels' tiles.

    python scripts/bench_moe_decode.py                       # M = 1, 16, 64, 128, table last
    python scripts/bench_moe_decode.py --tokens 1 16 --sweep-tokens --json $OUT/moe_decode.json

"old" is what a MoE layer ran before the decode kernels, from its output to the residual add:
the routed experts' grouped GEMMs (moe_align, gate/up + SiLU, down, combine), the shared
expert's two FP8 linears with SiLU-and-mul between, and the two adds. "new" is
``fused_moe_decode`` with the shared expert and the residual folded in (two launches).
Routing is outside both. Each time is the median of CUDA-graph replays of ``LAYERS`` layers
in a row, each with its own weights and routing (so the weights come from HBM, not L2),
divided by ``LAYERS``. The floor is the bytes of the experts the tokens route to (plus the
shared expert and block scales) over 4.3 TB/s and over the copy bandwidth measured here.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import torch
import torch.nn.functional as F
import triton
import triton.testing

from breakgraph.bench.peaks import copy_rate
from breakgraph.bench.presets import PRESETS, moe_shape
from breakgraph.kernels.linear import linear
from breakgraph.kernels.moe import SharedExpert, route
from breakgraph.kernels.triton_moe import decode_config, fused_moe_decode, fused_moe_triton

E, D, INTER, TOP_K = moe_shape(PRESETS["glm5-tp8-rank"])
LAYERS = 6  # 6 × ≥ 38 MB of touched weights: well past the 50 MB L2
COPY_TBS = 4.3


def make_layer(t: int, gen: torch.Generator) -> dict:
    scale = lambda *s: torch.rand(*s, device="cuda", generator=gen) * 0.01 + 0.005  # noqa: E731

    def codes(*s: int) -> torch.Tensor:  # e4m3 codes of magnitude ≤ 1.75 with random signs (no NaN)
        c = torch.randint(0, 0x40, s, dtype=torch.uint8, device="cuda", generator=gen)
        c |= torch.randint(0, 2, s, dtype=torch.uint8, device="cuda", generator=gen) << 7
        return c.view(torch.float8_e4m3fn)

    logits = torch.randn(t, E, device="cuda", generator=gen)
    tw, ids = route(logits, torch.randn(E, device="cuda", generator=gen) * 0.1, TOP_K, 1, 1, True, 2.5)
    return {
        "w13": codes(E, 2 * INTER, D), "s13": scale(E, 2 * INTER // 128, D // 128),
        "w2": codes(E, D, INTER), "s2": scale(E, D // 128, INTER // 128),
        "shared": SharedExpert(codes(2 * INTER, D), codes(D, INTER), scale(2 * INTER // 128, D // 128),
                               scale(D // 128, INTER // 128)),
        "x": torch.randn(t, D, device="cuda", generator=gen).bfloat16(),
        "res": torch.randn(t, D, device="cuda", generator=gen).bfloat16(),
        "tw": tw, "ids": ids,
    }  # fmt: skip


def old_layer(lay: dict) -> torch.Tensor:
    x, sh = lay["x"], lay["shared"]
    out = fused_moe_triton(x, lay["w13"], lay["w2"], lay["tw"], lay["ids"], lay["s13"], lay["s2"])
    gate, up = linear(x, sh.w13, sh.w13_scale, (128, 128)).chunk(2, dim=-1)
    out = out + linear(F.silu(gate) * up, sh.w2, sh.w2_scale, (128, 128))
    return lay["res"] + out


def new_layer(lay: dict, config: dict | None = None) -> torch.Tensor:
    return fused_moe_decode(
        lay["x"], lay["w13"], lay["w2"], lay["tw"], lay["ids"], lay["s13"], lay["s2"],
        shared=lay["shared"], residual=lay["res"], config=config,
    )  # fmt: skip


def per_layer_ms(layers: list[dict], fn) -> float:
    def step():
        for lay in layers:
            fn(lay)

    return triton.testing.do_bench_cudagraph(step, rep=40, return_mode="median") / len(layers)


def floor_bytes(lay: dict) -> int:
    touched = int(torch.unique(lay["ids"]).numel()) + 1  # + the shared expert
    return touched * (3 * INTER * D + 3 * (INTER // 128) * (D // 128) * 4)


def sweep_configs() -> list[dict]:
    """Each kernel's tile, k-split and unrolling varied with the other kernel at its default."""
    ups = [{"BLOCK_N": bn, "BLOCK_K": bk, "SPLIT_K": s, "UNROLL": u, "num_warps": w}
           for bn, bk, w in ((16, 512, 4), (8, 1024, 4), (16, 256, 4), (32, 256, 8))
           for s, u in ((1, False), (2, False), (2, True), (4, True))]  # fmt: skip
    downs = [{"BLOCK_N": bn, "BLOCK_K": bk, "num_warps": w}
             for bn, bk, w in ((16, 512, 4), (16, 1024, 4), (32, 512, 8), (32, 256, 4), (64, 256, 8), (8, 1024, 4))]  # fmt: skip
    return [{"up": u} for u in ups] + [{"down": d} for d in downs]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", type=int, nargs="+", default=[1, 16, 64, 128])
    ap.add_argument("--sweep-tokens", type=int, nargs="*", default=[1, 16, 64], help="sweep tiles at these sizes")
    ap.add_argument("--budget-s", type=float, default=None, help="stop sweeping after this many seconds")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("needs a CUDA GPU")
    start = time.monotonic()
    copy_tbs = copy_rate(torch.device("cuda")) / 1e12
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}; "
          f"copy {copy_tbs:.2f} TB/s; E={E} D={D} I={INTER} top-{TOP_K} + shared, FP8; {LAYERS} layers per replay")  # fmt: skip
    rows, sweep_rows = [], []
    for t in args.tokens:
        gen = torch.Generator(device="cuda").manual_seed(t)
        layers = [make_layer(t, gen) for _ in range(LAYERS)]
        want = old_layer(layers[0])
        err = ((new_layer(layers[0]).float() - want.float()).norm() / want.float().norm()).item()
        gb = sum(floor_bytes(lay) for lay in layers) / len(layers) / 1e9
        old = per_layer_ms(layers, old_layer)
        new = per_layer_ms(layers, new_layer)
        row = {"tokens": t, "old_ms": old, "new_ms": new, "gb": gb, "floor43_ms": gb / COPY_TBS,
               "floor_meas_ms": gb / copy_tbs, "rel_err_new_vs_old": err, "config": decode_config(t, TOP_K, INTER, D, True)}  # fmt: skip
        rows.append(row)
        print(f"T={t:4d} old {old * 1e3:8.1f} us  new {new * 1e3:8.1f} us  floor {gb / COPY_TBS * 1e3:6.1f} us "
              f"({gb * 1e3:.1f} MB)  new/old rel diff {err:.1e}", flush=True)  # fmt: skip
        if t in args.sweep_tokens:
            best = None
            for cfg in sweep_configs():
                if args.budget_s is not None and time.monotonic() - start > args.budget_s:
                    print(f"  sweep T={t}: stopped at the {args.budget_s:.0f} s budget")
                    break
                try:
                    ms = per_layer_ms(layers, lambda lay, c=cfg: new_layer(lay, c))
                except Exception as exc:  # noqa: BLE001 - out of resources etc.: reported, not fatal
                    print(f"  T={t} {cfg}: {type(exc).__name__}")
                    continue
                sweep_rows.append({"tokens": t, "config": cfg, "ms": ms})
                if best is None or ms < best[0]:
                    best = (ms, cfg)
                print(f"  sweep T={t:4d} {ms * 1e3:8.1f} us  {cfg}", flush=True)
            if best is not None:
                row["best_sweep_ms"], row["best_sweep"] = best
        del layers
        torch.cuda.empty_cache()
    print("\nMoE layer at decode (per layer; routing excluded; CUDA-graph replays)")
    print(f"{'T':>5} {'old us':>9} {'new us':>9} {'best us':>9} {'floor us':>9} {'new/floor':>9} {'old/new':>8}  best sweep")
    for r in rows:
        best = r.get("best_sweep_ms", r["new_ms"])
        print(f"{r['tokens']:5d} {r['old_ms'] * 1e3:9.1f} {r['new_ms'] * 1e3:9.1f} {best * 1e3:9.1f} "
              f"{r['floor43_ms'] * 1e3:9.1f} {r['new_ms'] / r['floor43_ms']:9.2f} {r['old_ms'] / r['new_ms']:8.2f}  "
              f"{r.get('best_sweep', '')}")  # fmt: skip
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"copy_tbs": copy_tbs, "rows": rows, "sweep": sweep_rows}, f, indent=1)


if __name__ == "__main__":
    main()
