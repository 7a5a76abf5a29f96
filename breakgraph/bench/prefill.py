"""``breakgraph bench prefill``: prefill latency of each graph backend beside the physical floor.

One model is loaded once (dummy weights); for every backend the prefill graphs are rebuilt
and every (input length, batch size) shape is timed: median and spread over repeats,
tokens/s, and from one profiled run the GPU-busy ratio (kernel time ÷ the median wall) and the
number of kernels. The floor (:mod:`breakgraph.bench.floor`: GEMMs, latent attention and indexer,
each ``max(bytes ÷ bandwidth, FLOPs ÷ rate)``, with the rates this command measures at start by
:mod:`breakgraph.bench.peaks`) is printed beside every time.
Writes JSON, a markdown table and (with matplotlib) a PNG plot.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import logging
import statistics
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from breakgraph.bench import record
from breakgraph.bench.floor import prefill_floor
from breakgraph.bench.peaks import gather_bandwidth, measure_peaks
from breakgraph.bench.presets import PRESETS, preset_folder
from breakgraph.engine.config import PREFILL_BACKENDS as BACKENDS
from breakgraph.kernels.indexer import indexer_fp8

logger = logging.getLogger(__name__)


@dataclass
class Row:
    backend: str
    input_len: int
    batch_size: int
    median_ms: float
    min_ms: float
    max_ms: float
    tokens_per_s: float
    floor_ms: float
    gpu_busy: float | None
    kernels: int | None
    segments: int | None
    breaks: int | None
    islands: int | None
    capture_s: float | None
    graph_memory_gib: float | None
    top_kernels: list | None = None


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--preset", default="glm5-tp8-rank-4l-bf16", choices=sorted(PRESETS),
                        help="model shape to benchmark with dummy weights (ignored with --model-path)")
    parser.add_argument("--model-path", default=None, help="a checkpoint folder; its config.json is used with dummy weights")
    parser.add_argument("--input-len", type=int, nargs="+", default=[128, 1024, 4096], help="prompt lengths in tokens")
    parser.add_argument("--batch-size", type=int, nargs="+", default=[1], help="requests per prefill batch")
    parser.add_argument("--backends", nargs="+", default=["disabled", "piecewise", "breakable"], choices=BACKENDS,
                        help="prefill backends to compare (torch-compile = torch.compile(mode='reduce-overhead') of each "
                             "decoder layer, CUDA graphs partitioned at the split ops; see breakgraph.graphs.regional)")
    parser.add_argument("--repeats", type=int, default=10, help="timed runs per shape (after 2 warm-up runs)")
    parser.add_argument("--full-ladder", action="store_true",
                        help="capture the whole default bucket ladder (as a server would) instead of the benchmarked shapes only")
    parser.add_argument("--fold-islands", action="store_true", help="fold single-kernel segments into eager steps")
    parser.add_argument("--no-profile", action="store_true", help="skip the profiled run (GPU-busy ratio, kernel count)")
    parser.add_argument("--top-kernels", type=int, default=0, metavar="N",
                        help="print (and write to the JSON) the N kernels with the most GPU time in each profiled run")
    parser.add_argument("--device", default=None, help="cuda or cpu (default: cuda when available)")
    parser.add_argument("--dtype", default="auto", help="activation dtype (auto = bf16 on CUDA)")
    parser.add_argument("--output", default="prefill_bench", help="output prefix: writes PREFIX.json, PREFIX.md, PREFIX.png")
    from breakgraph.cli import add_config_arguments, add_parallel_arguments

    add_config_arguments(parser, "page_size", "kv_cache_dtype")
    add_parallel_arguments(parser)


def main(args: argparse.Namespace) -> int:
    from breakgraph import Engine

    folder = Path(args.model_path) if args.model_path else preset_folder(args.preset)
    name = args.model_path or args.preset
    tokens = [n * b for n in args.input_len for b in args.batch_size]
    max_tokens = max(tokens)
    page_size = args.page_size
    per_req = max(args.input_len) + page_size
    engine = Engine(
        folder, device=args.device, dtype=args.dtype, load_format="dummy", page_size=page_size,
        num_pages=2 + max(args.batch_size) * -(-per_req // page_size), context_length=per_req,
        chunked_prefill_size=max_tokens, cuda_graph_backend_prefill="disabled", cuda_graph_backend_decode="disabled",
        fold_islands=args.fold_islands, tp_size=args.tp_size, kv_cache_dtype=args.kv_cache_dtype,
    )  # fmt: skip
    if args.tp_size > 1 and "torch-compile" in args.backends:
        raise SystemExit("--backends torch-compile runs the model in this process only; it cannot run with --tp-size > 1")
    capacity = kv_capacity(engine)
    if capacity:
        print("KV tokens that fit at the engine's default sizing (--mem-fraction-static 0.85 of the memory free "
              "after the weights): " + ", ".join(f"{k} {v:,}" for k, v in capacity.items()))  # fmt: skip
    peaks = measure_peaks(engine.device)
    floors = {}
    row_bytes = engine.kv_cache.latent_row_bytes_for(engine.config, engine.kv_cache.latent_dtype)
    for n, b in itertools.product(args.input_len, args.batch_size):
        gather = gather_bandwidth(engine.device, n * b, row_width=row_bytes // 2)  # bf16 elements per row
        floor = prefill_floor(engine, n, b, peaks, gather, indexer_fp8())
        floors[(n, b)] = floor.total_s
        logger.info("floor %d×%d: %.2f ms = GEMMs %.2f + latent attention %.2f (gather %.2f TB/s) + indexer %.2f",
                    b, n, 1e3 * floor.total_s, 1e3 * floor.gemm_s, 1e3 * floor.attention_s, gather / 1e12,
                    1e3 * floor.indexer_s)  # fmt: skip
    logger.info("measured peaks: %s", {k: round(v, 1) for k, v in peaks.as_dict().items()})
    rows: list[Row] = []
    failures: dict[str, str] = {}
    table = ""
    for backend in args.backends:
        try:
            bench_backend(engine, backend, args, max_tokens, floors, rows)
        except Exception as exc:  # report the backend as failed, measure the others
            failures[backend] = f"{type(exc).__name__}: {str(exc).strip().splitlines()[0][:300]}"
            logger.exception("backend %s failed; going on with the next one", backend)
        engine.set_prefill_backend("disabled")
        torch.cuda.empty_cache() if engine.device.type == "cuda" else None
        # after every backend: a run cut short keeps what it measured
        table = write_outputs(rows, args, name, failures, peaks=peaks.as_dict())
    print(table)
    return 1 if failures else 0


def kv_capacity(engine, mem_fraction: float = 0.85) -> dict[str, int]:
    """Tokens a KV cache of each latent dtype would hold on ``engine``'s GPU under the engine's
    default sizing (``mem_fraction`` of the memory free now plus the bench's own small cache, page
    size of the run; page 0 reserved): ``{"bfloat16": …, "fp8_e4m3": …, "fp8_e4m3 + FP8 indexer keys": …}``
    (the last with ``BREAKGRAPH_INDEXER_FP8=1``); empty off CUDA."""
    if engine.device.type != "cuda":
        return {}
    cache = engine.kv_cache
    free, _ = torch.cuda.mem_get_info(engine.device)
    own = sum(t.numel() * t.element_size() for t in [*cache.latent, *cache.indexer_k] if t is not None)
    budget = int((free + own) * mem_fraction)
    return tokens_that_fit(engine.config, cache.page_size, engine.runner.spec.dtype, budget)


def tokens_that_fit(cfg, page_size: int, dtype: torch.dtype, budget: int) -> dict[str, int]:
    """Tokens (pages × ``page_size``, page 0 reserved) that ``budget`` bytes of KV cache hold for
    model config ``cfg`` with each latent cache: bf16, FP8, and FP8 with FP8 indexer keys
    (indexer keys otherwise in ``dtype``)."""
    from breakgraph.engine.kv_cache import KVCache

    idx_layers = sum(cfg.has_indexer(i) for i in range(cfg.num_hidden_layers))
    out = {}
    for name, latent, fp8_keys in (("bfloat16", torch.bfloat16, False), ("fp8_e4m3", torch.float8_e4m3fn, False),
                                   ("fp8_e4m3 + FP8 indexer keys", torch.float8_e4m3fn, True)):  # fmt: skip
        per_token = cfg.num_hidden_layers * KVCache.latent_row_bytes_for(cfg, latent)
        per_token += idx_layers * KVCache.index_row_bytes_for(cfg, dtype, fp8_keys)
        pages = budget // (per_token * page_size)
        out[name] = max(0, pages - 1) * page_size
    return out


def bench_backend(engine, backend: str, args, max_tokens: int, floors: dict, rows: list[Row]) -> None:
    """Time every shape under ``backend`` and append one :class:`Row` per shape to ``rows``."""
    capture_s = mem = None
    if backend in ("piecewise", "breakable"):
        shapes = sorted({n * b for n in args.input_len for b in args.batch_size})
        engine.set_prefill_backend(backend, None if args.full_ladder else shapes, max_bucket=max_tokens)
        stats = engine.runner.prefill_graphs.stats
        capture_s, mem = stats.capture_s, stats.graph_memory_bytes / 2**30
    regional = contextlib.nullcontext()
    if backend == "torch-compile":
        from breakgraph.graphs.regional import compiled_regions

        regional = compiled_regions(engine.model, mode="reduce-overhead")
    with regional as compiled:
        for n, b in itertools.product(args.input_len, args.batch_size):
            batch, pages = make_batch(engine, n, b)
            try:

                def run(batch=batch) -> None:
                    if compiled is not None:
                        from breakgraph.forward_context import forward_batch_context

                        with torch.inference_mode(), forward_batch_context(batch):
                            h = compiled(batch.input_ids, batch.positions)
                            engine.model.compute_logits(h[batch.logits_rows])
                    else:
                        engine.executor.forward(batch)

                t_first = time.perf_counter()
                for _ in range(2):
                    run()
                sync(engine)
                if backend == "torch-compile":  # compile (a new length regime) + CUDA graph recording
                    capture_s = time.perf_counter() - t_first
                times = []
                for _ in range(args.repeats):
                    t0 = time.perf_counter()
                    run()
                    sync(engine)
                    times.append(time.perf_counter() - t0)
                med = statistics.median(times)
                busy, kernels, top = (None, None, None) if args.no_profile else profile(engine, run, med, args.top_kernels)
                if top:
                    print(f"top kernels, {backend} {b}×{n} (GPU ms, calls, name):")
                    for name, ms, calls in top:
                        print(f"  {ms:9.3f} {calls:6d}  {name[:110]}")
                seg = brk = isl = None
                graphs = engine.runner.prefill_graphs
                if graphs is not None:
                    info = {(bi.tokens, bi.length_bound): bi for bi in graphs.stats.buckets}
                    key, _ = graphs.graph_for(n * b, n)  # the graph the batch replayed
                    if key in info:
                        seg, brk, isl = info[key].segments, info[key].breaks, info[key].islands
                rows.append(Row(
                    backend, n, b, med * 1e3, min(times) * 1e3, max(times) * 1e3, n * b / med, floors[(n, b)] * 1e3,
                    busy, kernels, seg, brk, isl, capture_s, mem, top,
                ))  # fmt: skip
                logger.info("%s %d×%d: %.2f ms (floor %.2f ms)", backend, b, n, med * 1e3, floors[(n, b)] * 1e3)
            finally:  # a failed shape must not hold pages the next backends need
                engine.kv_cache.pool.free(pages)


def make_batch(engine, input_len: int, batch_size: int):
    """A prefill batch of ``batch_size`` random prompts of ``input_len`` tokens on fresh pages;
    returns ``(batch, pages)``, the caller frees ``pages``. On failure nothing stays allocated."""
    from breakgraph.engine.model_runner import BatchEntry
    from breakgraph.forward_context import ForwardMode

    pool = engine.kv_cache.pool
    g = torch.Generator().manual_seed(input_len * 131 + batch_size)
    entries, pages = [], []
    try:
        for _ in range(batch_size):
            p = pool.alloc(pool.pages_for(input_len))
            pages += p
            ids = torch.randint(0, engine.config.vocab_size, (input_len,), generator=g).tolist()
            entries.append(BatchEntry(ids, 0, p))
        return engine.runner.make_batch(entries, ForwardMode.EXTEND), pages
    except BaseException:
        pool.free(pages)
        raise


def sync(engine) -> None:
    if engine.device.type == "cuda":
        torch.cuda.synchronize(engine.device)


def profile(engine, run, wall_s: float, top: int = 0) -> tuple[float | None, int | None, list | None]:
    """From one profiled run: GPU-busy ratio (union of kernel intervals ÷ ``wall_s``, the timed
    runs' median: the profiler's own host overhead stretches the profiled run's wall where the
    host is on the critical path, kernels it does not), kernel count and the ``top`` kernels by
    summed GPU time (``[(name, ms, calls)]``, None when ``top`` is 0)."""
    if engine.device.type != "cuda":
        return None, None, None
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    with torch_profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        run()
        sync(engine)
    kernels = [
        e for e in prof.events()
        if e.device_type == torch.autograd.DeviceType.CUDA and "memcpy" not in e.name.lower() and "memset" not in e.name.lower()
    ]  # fmt: skip
    spans = sorted((e.time_range.start, e.time_range.end) for e in kernels)
    ranked = None
    if top:
        by_name: dict[str, list[float]] = {}
        for e in kernels:
            acc = by_name.setdefault(e.name, [0.0, 0])
            acc[0] += (e.time_range.end - e.time_range.start) / 1e3
            acc[1] += 1
        ranked = sorted(((n, ms, calls) for n, (ms, calls) in by_name.items()), key=lambda x: -x[1])[:top]
    busy, end = 0.0, None
    for s, e in spans:
        if end is None or s > end:
            busy += e - s
            end = e
        elif e > end:
            busy += e - end
            end = e
    return busy / (wall_s * 1e6), len(spans), ranked


def write_outputs(
    rows: list[Row], args, name: str, failures: dict[str, str] | None = None, peaks: dict | None = None
) -> str:
    """Write PREFIX.json, PREFIX.md and PREFIX.png for ``rows`` (``peaks``: the measured rates the
    floors used, recorded in the JSON); returns the markdown table."""
    out = Path(args.output)
    out.parent.mkdir(parents=True, exist_ok=True)
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    meta = {"model": name, "device": device, "torch": torch.__version__, "date": time.strftime("%Y-%m-%d"),
            "command": command_line(args), "peaks": peaks}  # fmt: skip
    failures = failures or {}
    out.with_suffix(".json").write_text(
        json.dumps({**meta, "rows": [asdict(r) for r in rows], "failures": failures}, indent=2)
    )
    table = markdown_table(rows) + "".join(f"\n\n**{b} failed**: {why}" for b, why in failures.items())
    out.with_suffix(".md").write_text(f"{meta['command']}\n\n{meta['model']} on {device}, {meta['date']}\n\n{table}\n")
    try:
        plot(rows, out.with_suffix(".png"), f"{name} prefill, {device}")
    except ImportError:
        logger.warning("matplotlib is not installed: no plot written")
    return table


def command_line(args: argparse.Namespace) -> str:
    """``breakgraph bench prefill`` with every flag at its value in ``args``."""
    return record.command_line(["breakgraph", "bench", "prefill"], add_arguments, args)


def markdown_table(rows: list[Row]) -> str:
    head = ("| backend | batch × len | median ms | spread ms | floor ms | × floor | tok/s | GPU busy | kernels "
            "| segments / breaks / islands | capture s | graph mem GiB |")  # fmt: skip
    lines = [head, "|" + "---|" * 12]
    for r in rows:
        sbi = "–" if r.segments is None else f"{r.segments} / {r.breaks} / {r.islands}"
        lines.append(
            f"| {r.backend} | {r.batch_size} × {r.input_len} | {r.median_ms:.2f} | {r.min_ms:.2f}–{r.max_ms:.2f} "
            f"| {r.floor_ms:.2f} | {r.median_ms / r.floor_ms:.2f} | {r.tokens_per_s:,.0f} "
            f"| {'–' if r.gpu_busy is None else f'{100 * r.gpu_busy:.0f}%'} | {'–' if r.kernels is None else r.kernels} "
            f"| {sbi} | {'–' if r.capture_s is None else f'{r.capture_s:.1f}'} "
            f"| {'–' if r.graph_memory_gib is None else f'{r.graph_memory_gib:.2f}'} |"
        )
    return "\n".join(lines)


def plot(rows: list[Row], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for backend in dict.fromkeys(r.backend for r in rows):
        pts = sorted((r.input_len * r.batch_size, r.median_ms) for r in rows if r.backend == backend)
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=backend)
    floor = sorted({(r.input_len * r.batch_size, r.floor_ms) for r in rows})
    ax.plot([p[0] for p in floor], [p[1] for p in floor], "k--", label="physical floor")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("prefill tokens")
    ax.set_ylabel("latency (ms)")
    ax.set_title(title)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
