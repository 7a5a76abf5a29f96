"""``breakgraph bench ttft``: time to first token of long prompts through the engine.

Unlike ``bench prefill`` (one unchunked forward outside the engine), every prompt here goes
through ``Engine`` as a server request does: the scheduler cuts it into chunks of
``--chunked-prefill-size`` tokens, each chunk runs under the prefill graphs (breakable by
default) against the KV cache the earlier chunks wrote, and the first token is sampled.
Prints, per prompt length, the median TTFT over ``--repeats`` requests and the peak GPU
memory the prefill added above the loaded model and cache.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from breakgraph.bench import record
from breakgraph.bench.presets import PRESETS, preset_folder


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--preset", default="glm5-tp8-rank-4l-bf16", choices=sorted(PRESETS),
                        help="model shape to benchmark with dummy weights (ignored with --model-path)")
    parser.add_argument("--model-path", default=None, help="a checkpoint folder; its config.json is used with dummy weights")
    parser.add_argument("--input-len", type=int, nargs="+", default=[32768], help="prompt lengths in tokens")
    parser.add_argument("--repeats", type=int, default=1, help="timed requests per length (after one warm-up of the shortest)")
    parser.add_argument("--chunked-prefill-size", type=int, default=4096, help="most prompt tokens per prefill step")
    parser.add_argument("--cuda-graph-backend-prefill", default=None, choices=["disabled", "breakable", "piecewise"],
                        help="prefill graphs (default: breakable on CUDA)")
    parser.add_argument("--device", default=None, help="cuda or cpu (default: cuda when available)")
    parser.add_argument("--dtype", default="auto", help="activation dtype (auto = bf16 on CUDA)")
    parser.add_argument("--output", default="ttft_bench", help="output prefix: writes PREFIX.json and PREFIX.md")
    from breakgraph.cli import add_config_arguments

    add_config_arguments(parser, "page_size", "kv_cache_dtype")


def ttft_seconds(engine, input_len: int, seed: int) -> float:
    """Seconds from adding one request of ``input_len`` random tokens to its first token."""
    from breakgraph import SamplingParams

    g = torch.Generator().manual_seed(seed)
    prompt = torch.randint(0, engine.config.vocab_size, (input_len,), generator=g).tolist()
    if engine.device.type == "cuda":
        torch.cuda.synchronize(engine.device)
    t0 = time.perf_counter()
    req = engine.add_request(prompt, SamplingParams(max_new_tokens=1, ignore_eos=True))
    while not req.output_ids:
        engine.step()
    elapsed = time.perf_counter() - t0
    while engine.has_unfinished():
        engine.step()
    return elapsed


def main(args: argparse.Namespace) -> int:
    from breakgraph import Engine

    folder = Path(args.model_path) if args.model_path else preset_folder(args.preset)
    page = args.page_size
    longest = max(args.input_len) + page
    engine = Engine(
        folder, device=args.device, dtype=args.dtype, load_format="dummy", page_size=page,
        num_pages=2 + -(-longest // page), context_length=longest, max_running_requests=1,
        chunked_prefill_size=args.chunked_prefill_size, cuda_graph_backend_prefill=args.cuda_graph_backend_prefill,
        cuda_graph_backend_decode="disabled", kv_cache_dtype=args.kv_cache_dtype,
    )  # fmt: skip
    cuda = engine.device.type == "cuda"
    ttft_seconds(engine, min(args.input_len), seed=0)  # warm-up: kernels compiled, graphs replayed once
    rows = []
    for n in args.input_len:
        if cuda:
            torch.cuda.synchronize(engine.device)
            base = torch.cuda.memory_allocated(engine.device)
            torch.cuda.reset_peak_memory_stats(engine.device)
        times = [ttft_seconds(engine, n, seed=1 + i) for i in range(args.repeats)]
        peak = (torch.cuda.max_memory_allocated(engine.device) - base) / 2**30 if cuda else None
        rows.append({"input_len": n, "median_s": statistics.median(times), "min_s": min(times), "max_s": max(times),
                     "repeats": len(times), "chunk": engine.chunked_prefill_size, "prefill_peak_gib": peak})  # fmt: skip
        print(f"{n} tokens: TTFT {statistics.median(times):.3f} s (chunks of {engine.chunked_prefill_size}), "
              f"prefill peak {peak if peak is None else round(peak, 2)} GiB", flush=True)  # fmt: skip
    command = record.command_line(["breakgraph", "bench", "ttft"], add_arguments, args)
    table = [f"`{command}`", "", "| prompt tokens | TTFT s (median) | min–max s | chunk | prefill peak GiB |",
             "|---|---|---|---|---|"]
    for r in rows:
        peak = "–" if r["prefill_peak_gib"] is None else f"{r['prefill_peak_gib']:.2f}"
        table.append(f"| {r['input_len']} | {r['median_s']:.3f} | {r['min_s']:.3f}–{r['max_s']:.3f} | {r['chunk']} | {peak} |")
    out = Path(args.output)
    out.parent.mkdir(parents=True, exist_ok=True)
    meta = {"model": args.model_path or args.preset, "torch": torch.__version__, "date": time.strftime("%Y-%m-%d"),
            "device": torch.cuda.get_device_name() if cuda else "cpu", "command": command}  # fmt: skip
    out.with_suffix(".json").write_text(json.dumps({**meta, "rows": rows}, indent=2))
    out.with_suffix(".md").write_text("\n".join(table) + "\n")
    print("\n".join(table))
    engine.shutdown()
    return 0
