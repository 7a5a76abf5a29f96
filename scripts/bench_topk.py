"""Sweep of the DSA top-k select (``breakgraph/kernels/triton_topk.py``, K = 2048) on one GPU.

Every variant runs on every shape, is checked against the exact top-k set (ties to the lower
position, each position once, ``-1`` after short rows) and timed with CUDA-graph replay:

* ``prefill 8k`` / ``prefill 16k``: all rows of one prefill (row ``t`` has ``t + 1`` keys),
  scored by the indexer kernel on random GLM-5-shaped queries and keys (rows below K unscored,
  as the engine leaves them); ``+sink``: the same rows with position 0 lifted 30 score
  standard deviations above the rest (an attention-sink outlier that widens the value range);
* ``L=32k|128k B=…``: ``B`` long rows of random normal scores (decode / extend), lengths just
  under ``L``.

    python scripts/bench_topk.py                 # the whole sweep, table last
    python scripts/bench_topk.py --quick         # the defaults' neighbours on five shapes (≈ 2 min)
    python scripts/bench_topk.py --shapes "prefill 8k" --variants "radix (old)" "range b2048 bins128"

Columns: µs per call, speed-up over ``radix (old)`` (the select before the range variants),
ms over 78 layers (prefill shapes: one call per layer), exact.
"""

from __future__ import annotations

import argparse
import sys
from functools import partial
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_kernels_attention import TOPK, bench, topk_exact, topk_rows  # noqa: E402

from breakgraph.kernels.triton_topk import default_method, topk_select_triton  # noqa: E402

LAYERS = 78
QUICK_SHAPES = ["prefill 8k", "prefill 16k", "prefill 16k +sink", "L=128k B=1", "L=128k B=64"]
QUICK = ["default", "radix (old)", "range b1024 bins128", "range b256 bins128", "range b512 bins64",
         "range b512 bins128 ls2048", "split b2048 bins64", "split b2048 bins128"]  # fmt: skip


def variants() -> dict:
    """Name → options of :func:`topk_select_triton` (``default``: what the engine's call takes
    for the shape)."""
    out = {"default": {}, "radix (old)": dict(method="radix")}
    for bins in (32, 64, 128, 256):
        out[f"range b2048 bins{bins}"] = dict(method="range", block=2048, bins=bins)
    out["range b1024 bins64"] = dict(method="range", block=1024, bins=64)
    out["range b1024 bins128"] = dict(method="range", block=1024, bins=128)
    out["range b512 bins64"] = dict(method="range", block=512, bins=64)
    out["range b512 bins128"] = dict(method="range", block=512, bins=128)
    out["range b256 bins128"] = dict(method="range", block=256, bins=128)
    out["range b512 bins128 ls2048"] = dict(method="range", block=512, bins=128, list_sort=2048)
    out["range b2048 bins64 w8"] = dict(method="range", block=2048, bins=64, num_warps=8)
    for bins in (64, 128, 256):
        out[f"split b2048 bins{bins}"] = dict(method="split", block=2048, bins=bins)
    for splits in (8, 64):
        out[f"split b2048 bins128 s{splits}"] = dict(method="split", block=2048, bins=128, splits=splits)
    return out


def runs_on(name: str, shape: str) -> bool:
    """Whether the sweep times variant ``name`` on ``shape``: split variants on long rows only
    (one row per program already fills the GPU at prefill), range variants beyond the main
    ones at prefill only."""
    method = variants()[name].get("method")
    if shape.startswith("prefill"):
        return method != "split"
    return method != "range" or name in ("range b2048 bins64", "range b2048 bins128")


def long_rows(width: int, rows: int, g) -> tuple[torch.Tensor, torch.Tensor]:
    """``rows`` rows of random normal scores, lengths ``width - 97 i``."""
    pos = torch.tensor([width - 1 - 97 * i for i in range(rows)], device="cuda")
    return torch.randn(rows, width, generator=g, device="cuda"), pos


def shapes() -> list[str]:
    long = [f"L={w // 1024}k B={b}" for w in (32768, 131072) for b in (1, 8, 64)]
    return ["prefill 8k", "prefill 16k", *long, "prefill 16k +sink"]


def make(shape: str, g) -> tuple[torch.Tensor, torch.Tensor]:
    if shape.startswith("prefill"):
        scores, pos = topk_rows(shape.removesuffix(" +sink"), g)
        if shape.endswith("+sink"):
            scores[:, 0] += 30 * scores[-1].std()  # the last row is scored over its whole width
        return scores, pos
    width, rows = shape.removeprefix("L=").split(" B=")
    return long_rows(int(width.removesuffix("k")) * 1024, int(rows), g)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shapes", nargs="+", default=shapes(), choices=shapes(), metavar="SHAPE",
                   help=f"shapes to run (default all: {', '.join(shapes())})")  # fmt: skip
    p.add_argument("--variants", nargs="+", default=list(variants()), choices=list(variants()), metavar="NAME",
                   help="variants to run (default all)")  # fmt: skip
    p.add_argument(
        "--quick", action="store_true", help=f"only {', '.join(QUICK_SHAPES)}; variants {', '.join(QUICK)}"
    )
    args = p.parse_args()
    if args.quick:
        args.shapes, args.variants = QUICK_SHAPES, QUICK
    table = []
    for shape in args.shapes:
        g = torch.Generator(device="cuda").manual_seed(1)
        scores, pos = make(shape, g)
        out = torch.empty(pos.shape[0], TOPK, dtype=torch.int32, device=scores.device)
        rows = []
        for name in args.variants:
            opts = variants()[name]
            if not runs_on(name, shape):
                continue
            out.fill_(-7)
            topk_select_triton(scores, pos, out, **opts)
            exact = topk_exact(out, scores, pos)
            us = bench(partial(topk_select_triton, scores, pos, out, **opts), rep=20) * 1e3
            label = (
                f"{name} = {default_method(pos.shape[0], scores.shape[1], TOPK)}"
                if name == "default"
                else name
            )
            rows.append((name, label, us, exact))
            print(f"    {shape:<18} {label:<28} {us:10.1f} us  exact={exact}", flush=True)
        base = next((us for name, _, us, _ in rows if name == "radix (old)"), None)
        table += [(shape, label, us, exact, base) for _, label, us, exact in rows]
        del scores
        torch.cuda.empty_cache()
    print(f"\n{'shape':<18} {'variant':<28} {'us':>10} {'x old':>6} {'78 layers ms':>13} exact")
    for shape, name, us, exact, base in table:
        layers = f"{us * LAYERS / 1e3:13.1f}" if shape.startswith("prefill") else f"{'-':>13}"
        speed = f"{base / us:6.2f}" if base else f"{'-':>6}"
        print(f"{shape:<18} {name:<28} {us:10.1f} {speed} {layers} {exact}")


if __name__ == "__main__":
    main()
