"""``breakgraph bench decode``: decode-step latency through the engine, beside its floor.

One model is loaded once (dummy weights). For every configured context length the decode
graphs are captured with a page table that wide (what a server with that ``--context-length``
holds), then for every batch size ``B`` requests of ``--input-len`` random tokens are prefilled
and decoded for ``--steps`` timed steps (each a host-timed ``Engine.step``, so sampling and the
host side count). Context lengths are alternated over ``--rounds`` rounds, so drift of the
machine shows as a spread instead of a difference between two configurations.

The floor of a step is the bytes it must read once ÷ the copy bandwidth this command measures:
every weight a token touches (all non-expert weights, and the routed experts the batch hits at
uniform routing: ``E·(1 − (1 − k/E)^B)`` per layer) plus each sequence's attention reads
(``min(L, index_topk)`` latent rows per layer and ``L`` indexer keys per layer with its own indexer).

``--top-kernels N`` profiles one extra step per (context, batch size) in the last round: kernels
launched per step (graph replays included) and per layer, GPU busy, and the N kernels with the
most GPU time.

``--host-profile`` times, on this thread's CPU clock, each phase of every timed ``Engine.step``
(:class:`StepPhases`): schedule, prepare (the batch's tensors), forward (body and LM head: on the
CPU real compute, not host overhead), sample, postprocess (finish rules, detokenisation) and the
rest; a table of median µs per step and phase follows the latency table. Run it on the CPU
(``--device cpu``), where host time is CPU time and nothing waits on a GPU.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import statistics
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from breakgraph.bench import record
from breakgraph.bench.peaks import copy_rate
from breakgraph.bench.prefill import profile
from breakgraph.bench.presets import PRESETS, preset_folder

logger = logging.getLogger(__name__)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--preset", default="glm5-tp8-rank-4l-bf16", choices=sorted(PRESETS),
                        help="model shape to benchmark with dummy weights (ignored with --model-path)")
    parser.add_argument("--model-path", default=None, help="a checkpoint folder; its config.json is used with dummy weights")
    parser.add_argument("--input-len", type=int, default=1024, help="prompt tokens of every request")
    parser.add_argument("--batch-size", type=int, nargs="+", default=[1], help="requests decoding together")
    parser.add_argument("--context-length", type=int, nargs="+", default=[8192],
                        help="configured context lengths to compare (the decode graphs' page-table width)")
    parser.add_argument("--steps", type=int, default=20, help="timed decode steps per (context, batch size, round)")
    parser.add_argument("--rounds", type=int, default=2, help="times the context lengths are alternated")
    parser.add_argument("--device", default=None, help="cuda or cpu (default: cuda when available)")
    parser.add_argument("--dtype", default="auto", help="activation dtype (auto = bf16 on CUDA)")
    parser.add_argument("--pdl", nargs="+", choices=["0", "1", "auto"], default=None,
                        help="BREAKGRAPH_PDL values to compare (e.g. 1 0): each round captures and times the decode "
                             "graphs once per value, alternated, so drift shows as spread (default: the environment's)")
    parser.add_argument("--top-kernels", type=int, default=0, metavar="N",
                        help="profile one more step per (context, batch size) in the last round: kernels per step "
                             "and per layer, GPU busy, and the N kernels with the most GPU time (CUDA only)")
    parser.add_argument("--host-profile", action="store_true",
                        help="time each phase of every timed step on the CPU clock of this thread (schedule, prepare, "
                             "forward, sample, postprocess, other) and print median µs per phase; use with --device cpu")
    parser.add_argument("--output", default="decode_bench", help="output prefix: writes PREFIX.json and PREFIX.md")
    from breakgraph.cli import add_config_arguments

    add_config_arguments(parser, "page_size", "kv_cache_dtype")


def step_bytes(engine, batch_size: int, seq_len: int) -> int:
    """Bytes a decode step of ``batch_size`` sequences of ``seq_len`` tokens must read once."""
    cfg = engine.config
    total = 0
    for name, p in engine.model.named_parameters():
        if name.endswith("embed_tokens.weight"):
            continue
        nbytes = p.numel() * p.element_size()
        if ".experts." in name and p.dim() == 3:
            hit = cfg.n_routed_experts * (1 - (1 - cfg.num_experts_per_tok / cfg.n_routed_experts) ** batch_size)
            nbytes = int(nbytes * hit / cfg.n_routed_experts)
        total += nbytes
    cache = engine.kv_cache
    latent_row = cache.latent[0].shape[-1] * cache.latent[0].element_size()
    index_row = next((k.shape[-1] * k.element_size() for k in cache.indexer_k if k is not None), 0)
    indexer_layers = sum(1 for i in range(cfg.num_hidden_layers) if cfg.has_indexer(i))
    attention = cfg.num_hidden_layers * min(seq_len, cfg.index_topk) * latent_row + indexer_layers * seq_len * index_row
    return total + batch_size * attention


def capture_decode_graphs(engine, context_length: int, batch_sizes: list[int]) -> float:
    """Replace the engine's decode graphs by ones for ``batch_sizes`` whose page table holds
    ``context_length`` tokens; returns the capture time in seconds."""
    from breakgraph.engine.model_runner import decode_capture_context
    from breakgraph.graphs.decode_runner import DecodeGraphRunner

    engine.runner.decode_graphs = None
    torch.cuda.empty_cache() if engine.device.type == "cuda" else None
    graphs = DecodeGraphRunner(engine.model, engine.kv_cache, engine.device, batch_sizes,
                               max_pages=engine.kv_cache.pool.pages_for(context_length),
                               length_bounds=engine.model.host_length_bounds(),
                               capture_context=decode_capture_context)  # fmt: skip
    graphs.capture(progress=False)
    engine.runner.decode_graphs = graphs
    return graphs.stats.capture_s


PHASES = ("schedule", "prepare", "forward", "sample", "postprocess", "other")


class StepPhases:
    """CPU time (``time.thread_time``) of each phase of ``Engine.step``, one dict per step.

    :meth:`attached` wraps, on ``engine`` only, the calls that make up a step: the scheduler's
    ``schedule`` (schedule), the runner's ``make_batch`` (prepare), the executor's ``forward``
    (forward), the sampler (sample) and the post-processor (postprocess); ``other`` is the rest
    of ``step`` (the engine's own bookkeeping). Only steps run while attached are recorded.
    """

    def __init__(self, engine: Any) -> None:
        self.engine = engine
        self.steps: list[dict[str, float]] = []

    @contextlib.contextmanager
    def attached(self) -> Iterator[StepPhases]:
        e = self.engine
        targets = [(e.scheduler, "schedule", "schedule"), (e.runner, "make_batch", "prepare"),
                   (e.executor, "forward", "forward"), (e, "sampler", "sample"), (e, "postprocess", "postprocess")]  # fmt: skip
        saved = [(obj, name, obj.__dict__.get(name)) for obj, name, _ in targets]
        for obj, name, phase in targets:
            setattr(obj, name, self._timed(getattr(obj, name), phase))
        real_step = e.step

        def step() -> Any:
            self.steps.append(dict.fromkeys(PHASES, 0.0))
            t0 = time.thread_time()
            try:
                return real_step()
            finally:
                row = self.steps[-1]
                row["other"] = time.thread_time() - t0 - sum(row.values())

        e.step = step
        try:
            yield self
        finally:
            del e.step
            for obj, name, old in saved:
                if old is None:
                    delattr(obj, name)
                else:
                    setattr(obj, name, old)

    def _timed(self, fn: Any, phase: str) -> Any:
        def timed(*args: Any, **kwargs: Any) -> Any:
            t0 = time.thread_time()
            try:
                return fn(*args, **kwargs)
            finally:
                self.steps[-1][phase] += time.thread_time() - t0

        return timed

    def medians_us(self) -> dict[str, float]:
        """Median µs per step of each phase, and ``host`` (every phase but forward)."""
        med = {p: 1e6 * statistics.median(s[p] for s in self.steps) for p in PHASES}
        med["host"] = 1e6 * statistics.median(sum(v for p, v in s.items() if p != "forward") for s in self.steps)
        return med


def time_decode(
    engine, batch_size: int, input_len: int, steps: int, seed: int, profile_top: int | None = None,
    phases: StepPhases | None = None,
) -> tuple[list[float], dict | None]:
    """Seconds of each of ``steps`` decode steps of ``batch_size`` fresh requests, and — when
    ``profile_top`` is not None, on CUDA — one more step under the profiler: ``{"kernels": per
    step, "gpu_busy": kernel time ÷ the median step, "top": [(name, ms, calls)] of the
    ``profile_top`` kernels with the most GPU time}``. ``phases``: records the timed steps."""
    from breakgraph import SamplingParams

    g = torch.Generator().manual_seed(seed)
    params = SamplingParams(max_new_tokens=steps + 3, ignore_eos=True)
    requests = [engine.add_request(torch.randint(0, engine.config.vocab_size, (input_len,), generator=g).tolist(),
                                   params) for _ in range(batch_size)]  # fmt: skip
    while any(r.in_prefill or not r.output_ids for r in requests):
        engine.step()
    engine.step()  # first decode step of the batch: warm-up
    times = []
    with phases.attached() if phases is not None else contextlib.nullcontext():
        for _ in range(steps):
            if engine.device.type == "cuda":
                torch.cuda.synchronize(engine.device)
            t0 = time.perf_counter()
            engine.step()
            if engine.device.type == "cuda":
                torch.cuda.synchronize(engine.device)
            times.append(time.perf_counter() - t0)
    prof = None
    if profile_top is not None and engine.device.type == "cuda":
        busy, kernels, top = profile(engine, engine.step, statistics.median(times), profile_top)
        prof = {"kernels": kernels, "gpu_busy": busy, "top": top}
    while engine.has_unfinished():
        engine.step()
    return times, prof


def _context_cell(row: dict) -> str:
    """The table's context column: the length, with the PDL setting when ``--pdl`` compares."""
    return str(row["context_length"]) + ("" if row["pdl"] is None else f" PDL={row['pdl']}")


def main(args: argparse.Namespace) -> int:
    from breakgraph import Engine

    folder = Path(args.model_path) if args.model_path else preset_folder(args.preset)
    name = args.model_path or args.preset
    page = args.page_size
    per_req = args.input_len + args.steps + 4
    engine = Engine(
        folder, device=args.device, dtype=args.dtype, load_format="dummy", page_size=page,
        num_pages=2 + max(args.batch_size) * -(-per_req // page), context_length=max(args.context_length),
        max_running_requests=max(args.batch_size), chunked_prefill_size=max(args.batch_size) * args.input_len,
        cuda_graph_backend_prefill="disabled", cuda_graph_backend_decode="disabled", kv_cache_dtype=args.kv_cache_dtype,
    )  # fmt: skip
    bandwidth = copy_rate(engine.device)
    samples: dict[tuple[int, int], list[float]] = {}
    captures: dict[int, list[float]] = {}
    profiles: dict[tuple[int, int], dict] = {}
    phases: dict[tuple[int, int], StepPhases] = {}
    for rnd in range(args.rounds):
        for ctx, pdl in [(c, p) for c in args.context_length for p in args.pdl or [None]]:
            if pdl is not None:  # read at every launch: the capture below takes it
                os.environ["BREAKGRAPH_PDL"] = pdl
            if engine.device.type == "cuda":
                captures.setdefault(ctx, []).append(capture_decode_graphs(engine, ctx, sorted(set(args.batch_size))))
            for bs in args.batch_size:
                key = (ctx, bs, pdl)
                top = args.top_kernels if args.top_kernels and rnd == args.rounds - 1 else None
                timer = phases.setdefault(key, StepPhases(engine)) if args.host_profile else None
                times, prof = time_decode(engine, bs, args.input_len, args.steps, seed=rnd * 1000 + bs, profile_top=top,
                                          phases=timer)  # fmt: skip
                samples.setdefault(key, []).extend(times)
                if prof is not None:
                    profiles[key] = prof
                logger.info("round %d context %d bs %d%s: median step %.3f ms", rnd, ctx, bs,
                            "" if pdl is None else f" PDL={pdl}", 1e3 * statistics.median(times))  # fmt: skip
    rows = []
    for (ctx, bs, pdl), times in samples.items():
        key = (ctx, bs, pdl)
        floor_s = step_bytes(engine, bs, args.input_len + args.steps // 2) / bandwidth
        rows.append({
            "context_length": ctx, "batch_size": bs, "pdl": pdl, "steps": len(times),
            "median_ms": 1e3 * statistics.median(times), "min_ms": 1e3 * min(times), "max_ms": 1e3 * max(times),
            "floor_ms": 1e3 * floor_s, "tokens_per_s": bs / statistics.median(times),
            "capture_s": statistics.median(captures[ctx]) if ctx in captures else None,
            "kernels_per_step": profiles.get(key, {}).get("kernels"),
            "gpu_busy": profiles.get(key, {}).get("gpu_busy"),
            "top_kernels": profiles.get(key, {}).get("top"),
            "host_us": phases[key].medians_us() if key in phases else None,
        })  # fmt: skip
    command = record.command_line(["breakgraph", "bench", "decode"], add_arguments, args)
    table = [f"`{command}`", "", f"copy bandwidth measured: {bandwidth / 1e12:.2f} TB/s", "",
             "| context | batch | median ms | min–max ms | floor ms | × floor | tok/s |", "|---|---|---|---|---|---|---|"]
    for r in rows:
        table.append(f"| {_context_cell(r)} | {r['batch_size']} | {r['median_ms']:.2f} | {r['min_ms']:.2f}–{r['max_ms']:.2f} "
                     f"| {r['floor_ms']:.2f} | {r['median_ms'] / r['floor_ms']:.1f} | {r['tokens_per_s']:.0f} |")  # fmt: skip
    if profiles:
        layers = engine.config.num_hidden_layers
        table += ["", "| context | batch | kernels / step | kernels / layer | GPU busy |", "|---|---|---|---|---|"]
        for r in rows:
            if r["kernels_per_step"] is not None:
                table.append(f"| {_context_cell(r)} | {r['batch_size']} | {r['kernels_per_step']} "
                             f"| {r['kernels_per_step'] / layers:.1f} | {100 * r['gpu_busy']:.0f}% |")  # fmt: skip
        for r in rows:
            for kname, ms, calls in r["top_kernels"] or []:
                table.append(f"    ctx {_context_cell(r)} bs {r['batch_size']}: {ms:8.3f} ms {calls:5d}× {kname[:90]}")
    if phases:
        table += ["", "host µs per step (CPU time of this thread, median): host = every phase but forward", "",
                  "| context | batch | " + " | ".join(PHASES) + " | host |", "|---|---|" + "---|" * (len(PHASES) + 1)]
        for r in rows:
            us = r["host_us"]
            table.append(f"| {_context_cell(r)} | {r['batch_size']} | " + " | ".join(f"{us[p]:.0f}" for p in (*PHASES, "host")) + " |")
    out = Path(args.output)
    out.parent.mkdir(parents=True, exist_ok=True)
    meta = {"model": name, "device": torch.cuda.get_device_name() if engine.device.type == "cuda" else "cpu",
            "torch": torch.__version__, "date": time.strftime("%Y-%m-%d"), "command": command,
            "copy_bandwidth_Bps": bandwidth}  # fmt: skip
    out.with_suffix(".json").write_text(json.dumps({**meta, "rows": rows}, indent=2))
    out.with_suffix(".md").write_text("\n".join(table) + "\n")
    print("\n".join(table))
    engine.shutdown()
    return 0
