"""Start an engine the way ``breakgraph serve`` does and print where its start-up went.

    python scripts/startup_times.py --preset glm5-tp8-rank [--ttft 256 257 1024] [--profile 256 1024]

Builds ``Engine`` on the preset's config with dummy weights and the default settings (prefill
and decode graphs, the KV cache from free memory), logging at INFO (the graph runners' per-bucket
lines at DEBUG). Prints one JSON line ``{"startup_s": {...}, "ready_s": ...}`` from the model
runner's ``startup_s`` — the parts of its ``ready in …`` log line — with the captured buckets
and how many needed a warm-up. ``--ttft`` then times one request per prompt length (after a
warm-up request of each), printing ``ttft <len> <ms>`` lines: prompts just above a bucket pad to
the next one. ``--profile`` captures those prefill buckets (and decode batch sizes 1 and 16)
again under cProfile and prints the 30 functions with the most own time (the figures of a warm
process: its kernels are compiled by then). ``--cuda-graph-*`` engine flags pass through.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import logging
import pstats
import statistics
import time

import torch


def main() -> int:
    from breakgraph.bench.presets import PRESETS, preset_folder
    from breakgraph.cli import add_engine_arguments, engine_kwargs

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", default="glm5-tp8-rank", choices=sorted(PRESETS), help="ignored with --model-path")
    parser.add_argument("--ttft", type=int, nargs="*", default=[], help="prompt lengths to time one request each")
    parser.add_argument("--repeats", type=int, default=3, help="timed requests per --ttft length (median)")
    parser.add_argument("--profile", type=int, nargs="*", default=[], help="prefill buckets to re-capture under cProfile")
    add_engine_arguments(parser)
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("breakgraph.graphs").setLevel(logging.DEBUG)

    from breakgraph import Engine
    from breakgraph.bench.ttft import ttft_seconds

    settings = {k: v for k, v in engine_kwargs(args).items() if v is not None}
    settings["load_format"] = "dummy"
    t0 = time.perf_counter()
    engine = Engine(args.model_path or preset_folder(args.preset), **settings)
    wall = time.perf_counter() - t0
    runner = engine.runner
    stats = engine.graph_stats()
    print(json.dumps({
        "preset": args.preset, "startup_s": {k: round(v, 2) for k, v in runner.startup_s.items()},
        "ready_s": round(sum(runner.startup_s.values()), 2), "engine_s": round(wall, 2),
        "prefill_buckets": stats.get("captured_buckets"), "prefill_bounded_buckets": stats.get("bounded_buckets"),
        "prefill_warmups": sum((stats.get("warmups") or {}).values()),
        "decode_batch_sizes": stats["decode"].get("batch_sizes"),
        "decode_warmups": sum((stats["decode"].get("warmups") or {}).values()),
    }), flush=True)  # fmt: skip
    for n in args.ttft:
        ttft_seconds(engine, n, seed=0)
        times = [ttft_seconds(engine, n, seed=1 + r) for r in range(args.repeats)]
        print(f"ttft {n} {1e3 * statistics.median(times):.1f} ms (min {1e3 * min(times):.1f})", flush=True)
    if args.profile:
        from breakgraph.graphs import backends
        from breakgraph.graphs.backends import GraphSetup

        prof = cProfile.Profile()
        t1 = time.perf_counter()
        prof.enable()
        runner.set_prefill_backend(runner.prefill_backend, args.profile)
        t2 = time.perf_counter()
        if runner.decode_graphs is not None:
            backends.lookup("decode", "full").build(GraphSetup(
                runner.model, runner.device, [1, 16], kv_cache=runner.kv_cache,
                max_pages=runner.decode_graphs.buffers.page_table.shape[1], warmup=runner._warmup,
                length_bounds=runner.model.host_length_bounds(),
            ))  # fmt: skip
        prof.disable()
        t3 = time.perf_counter()
        print(f"profiled: prefill buckets {args.profile} {t2 - t1:.2f}s, decode [1, 16] {t3 - t2:.2f}s", flush=True)
        out = io.StringIO()
        pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(30)
        print(out.getvalue(), flush=True)
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    engine.shutdown()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
