"""The model runner: everything one rank needs to run the model, and nothing about requests.

``ModelRunner(config, ...)`` reads top to bottom as a rank's life: load the model (this rank's
shard under tensor parallelism), size the paged KV cache (the same number of pages on every
rank), capture the prefill and decode graphs the config asks for. Then :meth:`forward` runs
a :class:`ForwardBatch` through the decoder body (eagerly or through a graph runner) and the LM
head. Rank 0 calls it through an executor (:mod:`breakgraph.engine.executor`); the other ranks
hold one runner each and run what rank 0 asks.
"""

from __future__ import annotations

import contextlib
import logging
import time
from array import array
from collections.abc import Iterator
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, NamedTuple

import torch

from breakgraph import env
from breakgraph.engine.config import EngineConfig
from breakgraph.engine.kv_cache import KVCache
from breakgraph.forward_context import ForwardBatch, ForwardMode, forward_batch_context
from breakgraph.graphs import backends
from breakgraph.graphs.backends import GraphSetup
from breakgraph.graphs.decode_runner import default_decode_buckets
from breakgraph.graphs.prefill_runner import default_prefill_buckets
from breakgraph.graphs.stats import disabled_stats
from breakgraph.kernels.pdl_scope import PDL_AUTO_MAX_PREFILL_TOKENS, PDL_AUTO_MAX_ROWS, pdl_scope
from breakgraph.models.config import ModelConfig
from breakgraph.models.loader import load_model

if TYPE_CHECKING:
    from breakgraph.engine.tp_launch import TPGroup

logger = logging.getLogger(__name__)

def to_device_async(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """Host tensor ``t`` on ``device``: through pinned memory without waiting on CUDA, ``t``
    itself on the CPU."""
    if device.type == "cuda":
        return t.pin_memory().to(device, non_blocking=True)
    return t.to(device)


DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def _ahead_compiler(config: EngineConfig) -> Any:
    """An :class:`~breakgraph.kernels.precompile.AheadCompiler` with this rank's share of the
    host's CPUs, or None (``BREAKGRAPH_COMPILE_AHEAD=0``, or no Triton with the hook it needs;
    ``fp8``: for the FP8 timing only, not before graph warm-ups)."""
    from breakgraph.kernels import precompile

    if env.read("BREAKGRAPH_COMPILE_AHEAD") == "0" or precompile.triton_runtime_knobs() is None:
        return None
    return precompile.AheadCompiler(precompile.default_workers(share=config.tp_size))


def resolve_dtype(dtype: str | torch.dtype | None, device: torch.device) -> torch.dtype:
    """``auto`` → bf16 on CUDA, fp32 elsewhere; else the named dtype."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype in (None, "auto"):
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if dtype not in DTYPES:
        raise ValueError(f"--dtype must be one of {['auto', *DTYPES]}, got {dtype!r}")
    return DTYPES[dtype]


def resolve_kv_cache_dtype(kv_cache_dtype: str | None, dtype: torch.dtype) -> torch.dtype:
    """The latent cache's dtype for ``--kv-cache-dtype``: ``auto`` → the activation ``dtype``,
    ``bfloat16``, or ``fp8_e4m3`` → ``torch.float8_e4m3fn`` (the FP8 latent cache)."""
    if kv_cache_dtype in (None, "auto"):
        return dtype
    named = {"bfloat16": torch.bfloat16, "fp8_e4m3": torch.float8_e4m3fn}
    if kv_cache_dtype not in named:
        raise ValueError(f"--kv-cache-dtype must be one of {['auto', *named]}, got {kv_cache_dtype!r}")
    return named[kv_cache_dtype]


def decode_capture_context(rows: int) -> contextlib.AbstractContextManager:
    """What a decode graph of ``rows`` rows is captured under: programmatic dependent launch for
    the batch sizes where it measured faster, under ``BREAKGRAPH_PDL=auto`` (kernels/pdl.py)."""
    return pdl_scope(rows <= PDL_AUTO_MAX_ROWS)


def prefill_pdl_context(num_tokens: int) -> contextlib.AbstractContextManager:
    """What a prefill of ``num_tokens`` tokens on the prefill graphs (a bucket's capture, or a
    batch's run: its graph replays and the breaks between them) launches under: programmatic
    dependent launch up to the token count where it measured faster, under
    ``BREAKGRAPH_PDL=auto`` (kernels/pdl.py). Kernels traced into a ``torch.compile`` piece keep
    plain launches; a prefill without graphs runs outside the scope."""
    return pdl_scope(num_tokens <= PDL_AUTO_MAX_PREFILL_TOKENS)


@dataclass(frozen=True)
class ModelSpec:
    """What the config resolves to before anything is loaded: the model's config, the device,
    the dtype, the context length (the config's, capped by the model's) and the latent KV
    cache's dtype (``torch.float8_e4m3fn``: the FP8 latent cache)."""

    model_config: ModelConfig
    device: torch.device
    dtype: torch.dtype
    context_length: int
    kv_cache_dtype: torch.dtype

    @classmethod
    def resolve(cls, config: EngineConfig, device: torch.device | None = None) -> ModelSpec:
        """Read ``config.json`` of ``config.model_path`` (which must be set). ``device``
        overrides the config's (a tensor-parallel rank's own device)."""
        if config.model_path is None:
            raise ValueError("EngineConfig.model_path must be set to build a model runner")
        device = device or torch.device(config.device or ("cuda" if torch.cuda.is_available() else "cpu"))
        model_config = ModelConfig.from_pretrained(config.model_path)
        most = model_config.max_position_embeddings
        dtype = resolve_dtype(config.dtype, device)
        context = min(config.context_length or most, most)
        return cls(model_config, device, dtype, context, resolve_kv_cache_dtype(config.kv_cache_dtype, dtype))


class BatchEntry(NamedTuple):
    """One request's share of a forward: ``token_ids`` at positions ``start…start+len-1``,
    cache pages ``pages`` (covering at least ``start + len`` tokens). A named tuple: one is
    made per request and step."""

    token_ids: list[int]
    start: int
    pages: list[int]


class ModelRunner:
    """The model, its KV cache and its graphs on one rank (see the module docstring).

    ``tp`` is this rank's tensor-parallel group (None at TP 1): the model is loaded as its
    shard and the KV pool sized to the smallest any rank can hold."""

    def __init__(self, config: EngineConfig, spec: ModelSpec, tp: TPGroup | None = None) -> None:
        self.config = config
        self.spec = spec
        self.device = spec.device
        t0 = time.perf_counter()
        # Worker processes that compile kernels ahead of the FP8 timing and the graph warm-ups;
        # spawned first, so that they import while the model loads; closed once ready.
        self._ahead = _ahead_compiler(config) if spec.device.type == "cuda" else None
        try:
            self._start(config, spec, tp, t0)
        finally:
            if self._ahead is not None:
                self._ahead.close()
                self._ahead = None

    def _start(self, config: EngineConfig, spec: ModelSpec, tp: TPGroup | None, t0: float) -> None:
        self.model = load_model(
            config.model_path, config=spec.model_config, device=spec.device, dtype=spec.dtype,
            load_format=config.load_format, max_positions=spec.context_length, seed=config.seed,
            parallel=tp.state if tp is not None else None,
        )  # fmt: skip
        self.startup_s = {"load": time.perf_counter() - t0}
        logger.info(
            "loaded %s (%s, %s) in %.1fs", config.model_path, spec.model_config.model_type, spec.dtype,
            self.startup_s["load"],
        )  # fmt: skip
        if spec.model_config.fp8 is not None and spec.device.type == "cuda":
            t1 = time.perf_counter()
            self._tune_fp8_linears()  # now, before any capture: every backend then takes the same GEMMs
            self.startup_s["fp8 tuning"] = time.perf_counter() - t1
        num_pages = config.num_pages or self._default_num_pages()
        if tp is not None:
            num_pages = tp.agree_on_num_pages(num_pages)
        self.kv_cache = KVCache(spec.model_config, num_pages, config.page_size, spec.dtype, spec.device, spec.kv_cache_dtype)
        logger.info(
            "KV cache: %d pages × %d = %d tokens fit (latent %s, %d bytes per token and layer; %.3g GiB)",
            num_pages - 1, config.page_size, self.kv_cache.num_tokens, str(spec.kv_cache_dtype).removeprefix("torch."),
            KVCache.latent_row_bytes_for(spec.model_config, spec.kv_cache_dtype),
            num_pages * self._bytes_per_page() / 2**30,
        )  # fmt: skip
        # The runners of the prefill and decode backends (graphs/backends.py); None: eager.
        self.prefill_graphs: Any = None
        self.decode_graphs: Any = None
        # The cache slots of a bucketed prefill graph's rows (see capture_context); None without.
        self._prefill_slots: torch.Tensor | None = None
        self.prefill_backend = "disabled"
        on_cuda = spec.device.type == "cuda"
        prefill = config.cuda_graph_backend_prefill or ("breakable" if on_cuda else "disabled")
        t1 = time.perf_counter()
        self.set_prefill_backend(prefill, config.cuda_graph_bs_prefill, config.cuda_graph_max_bs_prefill)
        self.startup_s["prefill graphs"] = time.perf_counter() - t1
        t1 = time.perf_counter()
        decode_default = "full" if on_cuda and not backends.lookup("prefill", prefill).runs_decode else "disabled"
        decode = backends.lookup("decode", config.cuda_graph_backend_decode or decode_default)
        if decode.build is not None:
            max_bs = config.cuda_graph_max_bs or min(config.max_running_requests, 64)
            self.decode_graphs = decode.build(GraphSetup(
                self.model, spec.device, default_decode_buckets(max_bs, config.cuda_graph_ladder),
                kv_cache=self.kv_cache, max_pages=self.kv_cache.pool.pages_for(spec.context_length),
                length_bounds=self.model.host_length_bounds(), warmup=self._warmup, prepare=self._prepare,
                capture_context=decode_capture_context,
            ))  # fmt: skip
        self.startup_s["decode graphs"] = time.perf_counter() - t1
        logger.info(
            "ready in %.1fs (%s)", time.perf_counter() - t0,
            ", ".join(f"{part} {seconds:.1f}s" for part, seconds in self.startup_s.items()),
        )  # fmt: skip

    def _tune_fp8_linears(self) -> None:
        """Choose the FP8 GEMM path (``_scaled_mm``, Triton W8A8 or W8A16) per row-count bucket
        for every FP8 linear shape of the model (and the partial products of merged linears:
        :attr:`~breakgraph.layers.linear.LinearBase.partial_parts`), up to the largest prefill
        step: read from the
        on-disk cache where this GPU and these versions measured them before, timed otherwise
        (:mod:`breakgraph.kernels.fp8_gemm_choice`; the candidates' Triton kernels compiled
        in parallel processes first, :mod:`breakgraph.kernels.precompile`)."""
        from breakgraph.kernels import fp8_gemm_choice as choice
        from breakgraph.kernels.dispatch import device_index
        from breakgraph.kernels.triton_fp8 import scaled_mm_blockwise_mode, tune_fp8_paths
        from breakgraph.layers.linear import LinearBase

        # The cuBLAS probe runs real kernels: now, not first inside a compile-ahead dry run
        # (which skips kernel launches) even when every table comes from the cache.
        scaled_mm_blockwise_mode(self.device)

        linears = [m for m in self.model.modules() if isinstance(m, LinearBase) and m.quantized]
        # with the products of merged linears' leading parts alone (the attention's q_b without
        # the indexer's queries, over sequences up to index_topk)
        shapes = {(m.in_features, m.out_features) for m in linears}.union(*(m.partial_shapes() for m in linears))
        t0 = time.perf_counter()
        max_m = self.config.chunked_prefill_size
        root = choice.cache_dir()
        key = choice.environment_key(self.device, max_m)
        def tune(missing: set[tuple[int, int]]) -> dict:
            return tune_fp8_paths(missing, self.device, max_m=max_m, ahead=self._ahead)

        tables, cached = choice.load_or_tune(shapes, key, tune, root)
        for (k, n), table in tables.items():
            choice.set_table(device_index(self.device), k, n, table)
        where = f" ({cached} read from {choice.cache_file(root, key)})" if cached else ""
        logger.info(
            "fp8 linears: GEMM paths of %d shapes chosen in %.1fs, %d timed%s",
            len(shapes), time.perf_counter() - t0, len(shapes) - cached, where,
        )  # fmt: skip

    def _default_num_pages(self) -> int:
        cfg, spec = self.config, self.spec
        per_page = self._bytes_per_page()
        if spec.device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(spec.device)
            budget = int(free * cfg.mem_fraction_static)
        else:
            want = -(-spec.context_length // cfg.page_size) * min(cfg.max_running_requests, 8) + 1
            budget = min(want * per_page, 2 << 30)
        return max(2, budget // per_page)

    def _bytes_per_page(self) -> int:
        spec = self.spec
        return KVCache.bytes_per_page(spec.model_config, self.config.page_size, spec.dtype, spec.kv_cache_dtype)

    @property
    def max_prefill_tokens(self) -> int:
        """The most prompt tokens one prefill step may take: the config's chunk, capped by the
        largest prefill graph bucket."""
        chunk = self.config.chunked_prefill_size
        graphs = self.prefill_graphs
        bucketed = graphs is not None and backends.lookup("prefill", self.prefill_backend).bucketed
        return min(chunk, graphs.buckets[-1]) if bucketed else chunk

    def set_prefill_backend(
        self, backend: str, buckets: list[int] | tuple[int, ...] | None = None, max_bucket: int | None = None
    ) -> None:
        """(Re)build the prefill graphs: capture ``buckets`` (default: the config's ladder up to
        ``max_bucket``, itself defaulting to ``min(chunked_prefill_size, 4096)``) for ``backend``;
        ``disabled`` drops them. ``torch-compile`` compiles the model's regions in place instead
        (no buckets; every forward, decode too, runs them), in one process without decode graphs."""
        entry = backends.lookup("prefill", backend)
        if entry.runs_decode and (self.decode_graphs is not None or self.config.tp_size > 1):
            raise ValueError(f"the {backend} backend runs at --tp-size 1 without decode graphs")
        self._close_prefill_graphs()
        self.prefill_backend = backend
        self._prefill_slots = None
        if entry.build is None:
            return
        if not entry.bucketed:
            self.prefill_graphs = entry.build(GraphSetup(self.model, self.device, []))
            return
        max_bucket = max_bucket or min(self.config.chunked_prefill_size, 4096)
        buckets = sorted(set(buckets)) if buckets else default_prefill_buckets(max_bucket, self.config.cuda_graph_ladder)
        if self.config.chunked_prefill_size > buckets[-1]:
            logger.info("prefill chunks capped at the largest graph bucket: %d tokens", buckets[-1])
        self._prefill_slots = torch.zeros(buckets[-1], dtype=torch.int64, device=self.device)
        bounds = getattr(self.model, "prefill_length_bounds", tuple)() if env.read("BREAKGRAPH_PREFILL_LENGTH_BOUNDS") == "1" else ()
        self.prefill_graphs = entry.build(GraphSetup(
            self.model, self.device, buckets, capture_context=self.capture_context,
            fold_islands=self.config.fold_islands, warmup=self._warmup, prepare=self._prepare,
            length_bounds=tuple(b for b in bounds if b < self.spec.context_length),
        ))  # fmt: skip

    @property
    def _prepare(self) -> Any:
        # before a ladder's captures: every bucket's kernels compiled ahead, in parallel, in one batch
        ahead = getattr(self, "_ahead", None)
        return ahead.run_dry if ahead is not None and env.read("BREAKGRAPH_COMPILE_AHEAD") == "1" else None

    @property
    def _warmup(self) -> str:
        # Tensor-parallel ranks hold collectives in their breaks: every rank must run the same
        # captures in the same order, which a capture retried on one rank only would break.
        return "every" if self.config.tp_size > 1 else self.config.cuda_graph_warmup

    def _close_prefill_graphs(self) -> None:
        close = getattr(self.prefill_graphs, "close", None)  # a runner that changed the model restores it
        if close is not None:
            close()
        self.prefill_graphs = None

    def drop_graphs(self) -> None:
        """Release the captured graphs (before a process group they may hold work of goes away)."""
        self._close_prefill_graphs()
        self.decode_graphs = None

    def graph_stats(self) -> dict[str, Any]:
        """What the prefill graphs did (backend, captured buckets, capture time, graph memory,
        replays, eager fallbacks by reason), with decode's under ``decode``; a phase without
        graphs reports ``{"backend": "disabled", "replays": 0, "fallbacks": {}}``."""
        prefill, decode = self.prefill_graphs, self.decode_graphs
        stats = prefill.stats.as_dict() if prefill is not None else disabled_stats()
        stats["decode"] = decode.stats.as_dict() if decode is not None else disabled_stats()
        return stats

    def make_batch(self, entries: list[BatchEntry], mode: ForwardMode) -> ForwardBatch:
        """Lay out a ragged batch (see :class:`ForwardBatch`). The host work is per request and
        per page, not per token, in typed arrays (a tensor from a list of ints converts each one);
        the int64 and the int32 fields each go to the device in one copy, without waiting for it."""
        ps = self.kv_cache.page_size
        starts = [e.start for e in entries]
        lens = [len(e.token_ids) for e in entries]
        seq_lens = [s + n for s, n in zip(starts, lens)]
        if max(lens) == 1:  # one token each (decode): one pass per field
            ids = array("q", [e.token_ids[0] for e in entries])
            positions, token_req = array("q", starts), array("q", range(len(entries)))
            slots = array("q", [e.pages[p // ps] * ps + p % ps for e, p in zip(entries, starts)])
        else:
            ids, positions, token_req, slots = array("q"), array("q"), array("q"), array("q")
            for b, (e, pos, end) in enumerate(zip(entries, starts, seq_lens)):
                ids.extend(e.token_ids)
                positions.extend(range(pos, end))
                token_req.extend([b] * (end - pos))
                while pos < end:  # one run of slots per page
                    page_end = min(end, (pos // ps + 1) * ps)
                    shift = (e.pages[pos // ps] - pos // ps) * ps  # slot - position within this page
                    slots.extend(range(pos + shift, page_end + shift))
                    pos = page_end
        width = max(len(e.pages) for e in entries)
        table, zeros = array("i", seq_lens), array("i", bytes(4 * width))
        for e in entries:
            table.extend(e.pages)
            table.extend(zeros[: width - len(e.pages)])
        T, B = len(ids), len(entries)
        i64 = to_device_async(torch.frombuffer(ids + positions + token_req + slots, dtype=torch.int64), self.device)
        i32 = to_device_async(torch.frombuffer(table, dtype=torch.int32), self.device)
        input_ids, positions_t, token_req_t, slots_t = i64.view(4, T)
        return ForwardBatch(
            mode=mode, input_ids=input_ids, positions=positions_t, token_req=token_req_t, out_cache_loc=slots_t,
            page_table=i32[B:].view(B, width), seq_lens=i32[:B], seq_lens_cpu=seq_lens,
            prefix_lens_cpu=starts, extend_lens_cpu=lens, kv_cache=self.kv_cache,
        )  # fmt: skip

    @contextlib.contextmanager
    def capture_context(self, num_tokens: int, length_bound: int | None = None) -> Iterator[None]:
        """A stand-in batch for capturing a graph bucket of ``num_tokens``: requests whose
        tokens all write to, and read from, the reserved padding page 0 — one, or as many as
        keep each within the stand-in's ``length_bound`` (below), so its own lengths never
        contradict what it promises. Its ``out_cache_loc``
        is a view of the runner's static slot buffer, so kernels captured in a segment (the
        rotary steps that write the new cache rows, :func:`~breakgraph.layers.dsa.rotary_cache_store`)
        read each replay's slots, which :meth:`forward` loads before every replay. Its
        ``length_bound`` is ``length_bound`` (a graph for batches of sequences that short), else
        the context length (a graph for any batch)."""
        ps = self.kv_cache.page_size
        bound = length_bound if length_bound is not None else self.spec.context_length
        sizes = [min(bound, num_tokens - start) for start in range(0, num_tokens, bound)]
        batch = self.make_batch([BatchEntry([0] * m, 0, [0] * -(-m // ps)) for m in sizes], ForwardMode.EXTEND)
        if self._prefill_slots is not None:
            slots = self._prefill_slots[:num_tokens]
            slots.copy_(batch.out_cache_loc)
            batch = replace(batch, out_cache_loc=slots)
        batch = replace(batch, length_bound=bound)
        with forward_batch_context(batch), prefill_pdl_context(num_tokens):
            yield

    def _load_prefill_slots(self, batch: ForwardBatch) -> None:
        """Copy the batch's cache slots into the static slot buffer the prefill graphs read;
        the rows past them (a bucket's padding) write to slot 0, in the reserved page 0. A
        batch longer than the buffer runs eagerly, on its own slots."""
        slots, n = self._prefill_slots, batch.num_tokens
        if slots is not None and n <= slots.shape[0]:
            slots[:n].copy_(batch.out_cache_loc)
            slots[n:].zero_()

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch, all_logits: bool = False) -> torch.Tensor:
        """Run the body and the LM head. Returns fp32 logits for each request's last token
        ``[B, vocab]``, or for every token ``[T, vocab]`` when ``all_logits``."""
        prefill, decode = self.prefill_graphs, self.decode_graphs
        runs_all = prefill is not None and backends.lookup("prefill", self.prefill_backend).runs_decode
        with forward_batch_context(batch):
            if prefill is not None and (runs_all or batch.mode is ForwardMode.EXTEND):
                self._load_prefill_slots(batch)
                extend = batch.mode is ForwardMode.EXTEND  # (a backend that runs decode too: not those)
                with prefill_pdl_context(batch.num_tokens) if extend else contextlib.nullcontext():
                    hidden = prefill.run(batch.input_ids, batch.positions, batch.max_seq_len)
            elif decode is not None and batch.mode is ForwardMode.DECODE:
                hidden = decode.run(batch)
            else:
                hidden = self.model(batch.input_ids, batch.positions)
        if all_logits:
            rows = hidden
        elif batch.num_tokens == batch.batch_size:  # one token per request: every row, in order
            rows = hidden[: batch.batch_size]
        else:  # the index goes to the device without a wait (an index list would copy it with one)
            index = torch.frombuffer(array("q", batch.logits_rows), dtype=torch.int64)
            rows = hidden.index_select(0, to_device_async(index, hidden.device))
        return self.model.compute_logits(rows)
