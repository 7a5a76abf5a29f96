"""``breakgraph bench itl``: inter-token latency of running streams while a long prompt prefills.

Through ``Engine``, as a server drives it. After a warm-up request (as long as the measured
prompt, two new tokens: every prefill chunk, the long-context attention and indexer paths and
the decode shapes run once), ``--streams`` requests of ``--stream-input-len``
random tokens are prefilled, then decode ``--before-steps`` steps (the ITL *before*); then one
prompt of ``--input-len`` tokens (default: the context length less one, so it fits with one new
token) is added and the engine steps until its first token (its TTFT). Every step is one
host-timed ``Engine.step`` (it returns after the sampled tokens reach the host), and a stream's
token is stamped when its step returns. An interval between two tokens of a stream counts as
*during* the prefill when it overlaps the span from adding the long prompt to its first token
(the streams take one more token after it, so an interval spanning its end is counted).

Prints per stream the median, p99 and worst ITL before and during the prefill, the tokens each
stream got during it, and the long prompt's TTFT; writes PREFIX.json and PREFIX.md.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import time
from pathlib import Path

import torch

from breakgraph.bench import record
from breakgraph.bench.presets import PRESETS, preset_folder


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--preset", default=None, choices=sorted(PRESETS),
                        help="model shape with dummy weights (default: the built-in demo model's shape)")
    parser.add_argument("--model-path", default=None, help="a checkpoint folder; its config.json is used with dummy weights")
    parser.add_argument("--context-length", type=int, default=32768,
                        help="the engine's context length (capped by the model's)")
    parser.add_argument("--input-len", type=int, default=None,
                        help="tokens of the long prompt (default: the context length - 1)")
    parser.add_argument("--streams", type=int, default=8, help="requests decoding while the long prompt prefills")
    parser.add_argument("--stream-input-len", type=int, default=32, help="prompt tokens of each stream")
    parser.add_argument("--before-steps", type=int, default=16, help="decode steps timed before the long prompt arrives")
    parser.add_argument("--chunked-prefill-size", type=int, default=4096, help="most prompt tokens per prefill step")
    parser.add_argument("--device", default=None, help="cuda or cpu (default: cuda when available)")
    parser.add_argument("--dtype", default="auto", help="activation dtype (auto = bf16 on CUDA)")
    parser.add_argument("--output", default="itl_bench", help="output prefix: writes PREFIX.json and PREFIX.md")
    from breakgraph.cli import add_config_arguments

    add_config_arguments(parser, "page_size")


def percentile(values: list[float], q: float) -> float:
    """The nearest-rank ``q``-th percentile of ``values`` (non-empty)."""
    ordered = sorted(values)
    return ordered[max(math.ceil(q / 100 * len(ordered)) - 1, 0)]


def summarize(intervals: list[float]) -> dict:
    """Median, p99 and worst of ``intervals`` (seconds) in ms; ``None`` values when empty."""
    if not intervals:
        return {"n": 0, "median_ms": None, "p99_ms": None, "worst_ms": None}
    return {"n": len(intervals), "median_ms": 1e3 * statistics.median(intervals),
            "p99_ms": 1e3 * percentile(intervals, 99), "worst_ms": 1e3 * max(intervals)}  # fmt: skip


def split_intervals(stamps: list[float], start: float, end: float) -> tuple[list[float], list[float], int]:
    """The intervals between consecutive ``stamps`` that end before ``start`` (before) and that
    overlap ``[start, end]`` (during), and how many stamps fall inside ``(start, end]``."""
    before, during = [], []
    for a, b in zip(stamps, stamps[1:]):
        if b <= start:
            before.append(b - a)
        elif a < end:
            during.append(b - a)
    return before, during, sum(start < t <= end for t in stamps)


def stream_new_tokens(args: argparse.Namespace, input_len: int, chunk: int) -> int:
    """Tokens each stream may generate: one per chunk of the streams' own prefill (the first
    streams decode meanwhile), its timed steps before, one per chunk of the long prompt (the
    steps alternate) twice over, and a few more."""
    own = -(-args.streams * args.stream_input_len // chunk)
    return own + args.before_steps + 2 * -(-input_len // chunk) + 8


def measure(engine, args: argparse.Namespace, input_len: int) -> dict:
    """Run the streams and the long prompt (see the module docstring); the raw timings."""
    from breakgraph import SamplingParams

    g = torch.Generator().manual_seed(0)
    vocab = engine.config.vocab_size

    def tokens(n: int) -> list[int]:
        return torch.randint(0, vocab, (n,), generator=g).tolist()

    # As long as the measured prompt: every chunk shape and the long-context attention and
    # indexer paths run (and compile) once before anything is timed.
    warmup = engine.add_request(tokens(input_len), SamplingParams(max_new_tokens=2, ignore_eos=True))
    while not warmup.finished:
        engine.step()
    params = SamplingParams(max_new_tokens=stream_new_tokens(args, input_len, args.chunked_prefill_size), ignore_eos=True)
    streams = [engine.add_request(tokens(args.stream_input_len), params) for _ in range(args.streams)]
    stamps: dict[str, list[float]] = {r.rid: [] for r in streams}

    def step() -> float:
        progressed = engine.step()
        now = time.perf_counter()
        for r in progressed:
            if r.rid in stamps:
                stamps[r.rid].append(now)
        return now

    while any(not r.output_ids for r in streams):
        step()
    for times in stamps.values():  # ITL before: steady decoding only, not the streams' own prefill
        times.clear()
    for _ in range(args.before_steps):
        step()
    start = time.perf_counter()
    long = engine.add_request(tokens(input_len), SamplingParams(max_new_tokens=1, ignore_eos=True))
    end = start
    while not long.output_ids and not long.finished:
        end = step()
    cut_short = [r.rid for r in streams if r.finished]
    while any(stamps[r.rid][-1] <= end for r in streams if not r.finished):  # close the intervals open at the end
        step()
    for r in streams:
        engine.abort(r)
    while engine.has_unfinished():
        engine.step()
    return {"stamps": stamps, "start": start, "end": end, "cut_short": cut_short}


def main(args: argparse.Namespace) -> int:
    from breakgraph import Engine
    from breakgraph.demo.default_model import default_model_path

    if args.model_path:
        folder, name = Path(args.model_path), args.model_path
    elif args.preset:
        folder, name = preset_folder(args.preset), args.preset
    else:
        folder, name = default_model_path(), "demo"
    config = json.loads((folder / "config.json").read_text())
    ctx = min(args.context_length, config["max_position_embeddings"])
    input_len = args.input_len or ctx - 1
    if not args.stream_input_len < ctx or not 0 < input_len < ctx:
        raise SystemExit(f"--stream-input-len and --input-len must be below the context length {ctx}")
    stream_len = args.stream_input_len + stream_new_tokens(args, input_len, args.chunked_prefill_size)
    if stream_len > ctx:
        raise SystemExit(f"the streams' {stream_len} tokens exceed the context length {ctx}: fewer --before-steps")
    pages = -(-(input_len + 1) // args.page_size) + args.streams * -(-stream_len // args.page_size)
    engine = Engine(  # a pool for every request's whole budget: nothing is preempted
        folder, device=args.device, dtype=args.dtype, load_format="dummy", page_size=args.page_size,
        num_pages=1 + pages, context_length=ctx, max_running_requests=args.streams + 1,
        chunked_prefill_size=args.chunked_prefill_size, cuda_graph_max_bs_prefill=args.chunked_prefill_size,
        kv_watermark=0.0,
    )  # fmt: skip
    run = measure(engine, args, input_len)
    ttft = run["end"] - run["start"]
    rows = []
    for i, times in enumerate(run["stamps"].values()):
        before, during, tokens = split_intervals(times, run["start"], run["end"])
        rows.append({"stream": i, "before": summarize(before), "during": summarize(during), "tokens_during": tokens})
    chunk = engine.chunked_prefill_size
    command = record.command_line(["breakgraph", "bench", "itl"], add_arguments, args)
    worst = max((r["during"]["worst_ms"] or 0.0) for r in rows)
    table = [
        f"`{command}`", "",
        f"{name}, context {ctx}: {args.streams} streams decoding while a {input_len}-token prompt prefills in chunks "
        f"of {chunk}: TTFT {ttft:.3f} s, worst ITL during it {worst:.1f} ms", "",
        "| stream | ITL before: median / p99 / worst ms | ITL during prefill: median / p99 / worst ms | tokens during |",
        "|---|---|---|---|",
    ]  # fmt: skip

    def cell(s: dict) -> str:
        return "–" if not s["n"] else f"{s['median_ms']:.1f} / {s['p99_ms']:.1f} / {s['worst_ms']:.1f}"

    for r in rows:
        table.append(f"| {r['stream']} | {cell(r['before'])} | {cell(r['during'])} | {r['tokens_during']} |")
    if run["cut_short"]:
        table.append(f"\n{len(run['cut_short'])} streams reached the context length before the prefill ended")
    cuda = engine.device.type == "cuda"
    meta = {"model": name, "device": torch.cuda.get_device_name() if cuda else "cpu", "torch": torch.__version__,
            "date": time.strftime("%Y-%m-%d"), "command": command, "context_length": ctx, "input_len": input_len,
            "chunk": chunk, "ttft_s": ttft, "worst_itl_during_ms": worst, "streams_cut_short": len(run["cut_short"])}  # fmt: skip
    out = Path(args.output)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps({**meta, "rows": rows}, indent=2))
    out.with_suffix(".md").write_text("\n".join(table) + "\n")
    print("\n".join(table))
    engine.shutdown()
    return 0
