"""Prefill under graphs: a ladder of token buckets, one breakable (or piecewise) capture each.

The runner knows nothing about the model. It is given the decoder *body*
``body(input_ids [n], positions [n]) -> hidden [n, D]`` and a ``capture_context(n)`` that
installs whatever per-batch state the body's breaks read while a bucket of ``n`` tokens is
captured (a dummy batch). At run time the caller installs the real per-batch state, and
:meth:`PrefillGraphRunner.run` copies the real tokens into the static input buffers, zeroes
the padding, replays the bucket's graph and returns the real rows. Batches that do not fit
the ladder, or would waste more than half the bucket on padding, run the body eagerly — and
every replay and every fallback (with its reason) is counted in its
:class:`~breakgraph.graphs.stats.GraphStats`.

What the graph segments compute may depend on how long the batch's sequences can be (the
model's ``prefill_length_bounds``: up to its DSA ``index_topk`` no indexer queries are needed).
A segment is captured on a stand-in batch, so by default it must hold for any batch; with
``length_bounds`` the breakable runner captures each bucket once more per bound, on a stand-in
that promises sequences at most that long, and a batch whose longest sequence fits replays
that graph.
"""

from __future__ import annotations

import bisect
import contextlib
import functools
import logging
import time
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from typing import Any

import torch

from breakgraph.graphs.breakable import BreakableGraph
from breakgraph.graphs.cuda_segment import pool_segments
from breakgraph.graphs.piecewise import PiecewiseBackend
from breakgraph.graphs.segments import new_graph_pool
from breakgraph.graphs.static_batch import StaticBatch
from breakgraph.graphs.stats import BucketInfo, GraphStats
from breakgraph.graphs.warmup import capture_ladder, check_warmup, warm_then_capture

logger = logging.getLogger(__name__)

MODES = ("breakable", "piecewise")  # the registry's names for the two capture modes (graphs/backends.py)
Body = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
GraphKey = tuple[int, "int | None"]  # (bucket tokens, sequence-length bound or None)


LADDERS = ("coarse", "fine")  # --cuda-graph-ladder


def default_prefill_buckets(max_tokens: int, ladder: str = "coarse") -> list[int]:
    """The token-count ladder up to ``max_tokens`` (itself included).

    ``coarse`` (19 buckets to 4096): powers of two 4…256, then 384, 512, 768, 1024, then steps
    of a quarter of the power of two below (1280, 1536, 1792, 2048, 2560, …, 4096, 5120, …). A
    batch pads by less than 2× below 256 tokens (where a prefill costs about the same at any
    length: the weights dominate), by at most 50% (257 → 384) up to 1024, by at most 25% above.
    ``fine`` (50 buckets to 4096): 4…32 step 4, 48…256 step 16, 288…512 step 32, 576…1024 step
    64, 1280…4096 step 256, then step 512."""
    if ladder not in LADDERS:
        raise ValueError(f"--cuda-graph-ladder must be one of {LADDERS}, got {ladder!r}")
    if ladder == "fine":
        steps = [*range(4, 33, 4), *range(48, 257, 16), *range(288, 513, 32), *range(576, 1025, 64)]
        steps += [*range(1280, 4097, 256), *range(4608, max_tokens + 1, 512)]
    else:
        steps = [4, 8, 16, 32, 64, 128, 256, 384, 512, 768, 1024]
        power = 1024
        while power < max_tokens:
            steps += range(power + power // 4, 2 * power + 1, power // 4)
            power *= 2
    return sorted({b for b in steps if b <= max_tokens} | {max_tokens})


class PrefillGraphRunner:
    """Captures the decoder body per token bucket and replays it for real batches.

    Args:
        body: ``(input_ids [n], positions [n]) -> hidden [n, D]``; its dynamic parts must be
            breaks (``eager_on_graph`` / ``graph_break_op``) that read per-batch state at call time.
        backend: ``"breakable"`` (BCG) or ``"piecewise"`` (torch.compile split at split ops).
        device: CUDA captures CUDA graphs; CPU uses the CPU graph backend (same contracts).
        buckets: token counts to capture (ascending); see :func:`default_prefill_buckets`.
        capture_context: ``n -> context manager`` active while bucket ``n`` warms up and is captured.
        fold_islands: BCG only; run single-kernel segments eagerly inside the neighbouring break.
        max_padding_ratio: fall back to eager when ``bucket > ratio × tokens``.
        warmup: BCG only. ``once``: the largest bucket is run eagerly before its capture (lazy
            initialisation cannot happen inside a capture); the others are captured directly,
            and one is warmed up and captured again only where a Triton kernel would have to
            compile inside its capture (:mod:`breakgraph.graphs.jit_guard`). ``every``: each
            bucket is warmed up first. Without the guard (no Triton hook) ``once`` acts as ``every``
            on CUDA.
        prepare: BCG only; called once before the first capture with one thunk per graph
            (largest bucket first), each running the body at its bucket; may run them to learn the
            kernels they launch and compile them all ahead, in parallel (the model runner's
            :meth:`~breakgraph.kernels.precompile.AheadCompiler.run_dry`).
        length_bounds: BCG only; sequence lengths below which buckets get a second graph (see
            the module docstring); ``capture_context(n, bound)`` then installs a stand-in that
            promises sequences of at most ``bound`` tokens (``capture_context(n)``: no promise).
    The hidden tensor :meth:`run` returns is graph-owned memory, valid until the next run.
    """

    def __init__(
        self,
        body: Body,
        *,
        backend: str,
        device: torch.device,
        buckets: list[int],
        capture_context: Callable[[int], AbstractContextManager[Any]],
        fold_islands: bool = False,
        max_padding_ratio: float = 2.0,
        warmup: str = "once",
        prepare: Callable[..., None] | None = None,
        length_bounds: tuple[int, ...] = (),
    ) -> None:
        if backend not in MODES:
            raise ValueError(f"prefill graph backend must be one of {MODES}, got {backend!r}")
        if not buckets or sorted(set(buckets)) != list(buckets) or buckets[0] < 1:
            raise ValueError(f"--cuda-graph-bs-prefill must be ascending positive token counts, got {buckets}")
        check_warmup(warmup)
        self.warmup = warmup
        self.prepare = prepare
        self.body = body
        self.backend = backend
        self.device = torch.device(device)
        self.buckets = list(buckets)
        self.capture_context = capture_context
        self.fold_islands = fold_islands
        self.max_padding_ratio = max_padding_ratio
        #: the sequence-length bounds of the second graphs, ascending (breakable only)
        self.length_bounds = sorted({b for b in length_bounds if b > 0}) if backend == "breakable" else []
        self.inputs = StaticBatch.allocate(self.buckets[-1], self.device)
        self.pool = new_graph_pool(self.device)
        self.stats = GraphStats(backend)
        # keyed (bucket, length bound or None: any batch)
        self._graphs: dict[GraphKey, BreakableGraph] = {}
        self._outputs: dict[GraphKey, torch.Tensor] = {}
        #: replays per length bound (None: the graphs for any batch)
        self.bound_replays: Counter[int | None] = Counter()
        self._pcg: PiecewiseBackend | None = None
        self._compiled: Body | None = None
        if backend == "piecewise":
            self._pcg = PiecewiseBackend(self.device, pool=self.pool)
            torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, len(buckets) + 8)
            # The token dimension is traced symbolically (maybe_mark_dynamic in _capture_bucket): one
            # trace serves every bucket unless the body branches on the token count.
            self._compiled = torch.compile(body, backend=self._pcg, dynamic=None, fullgraph=True)

    @property
    def max_tokens(self) -> int:
        return self.buckets[-1]

    def graph_keys(self) -> list[GraphKey]:
        """``(bucket, bound)`` of every graph to capture, largest bucket first (so smaller ones
        reuse its pool), each bucket's graph for any batch (bound None) before its bounded ones
        (a bucket longer than a bound holds several requests that short)."""
        return [(n, bound) for n in sorted(self.buckets, reverse=True) for bound in [None, *reversed(self.length_bounds)]]

    # -- capture --------------------------------------------------------------------------
    def capture(self, progress: bool = True) -> None:
        """Warm up (see ``warmup``) and capture every bucket, largest first (so smaller ones
        reuse its pool). Should a capture without warm-up fail, every bucket is captured again,
        each after a warm-up, in a new pool (logged)."""
        from tqdm.auto import tqdm

        free_before = _free_memory(self.device)
        start = time.perf_counter()

        def progress_bar(keys: list[GraphKey]) -> Any:
            bar = tqdm(keys, desc=f"Capturing prefill graphs ({self.backend})", unit="graph",
                       disable=None if progress else True)  # fmt: skip
            for key in bar:
                bar.set_postfix(tokens=key[0], free_mem=_fmt_bytes(_free_memory(self.device)))
                yield key

        def restart() -> None:
            self._graphs.clear()
            self._outputs.clear()
            self.stats.buckets.clear()
            self.pool = new_graph_pool(self.device)

        keys = self.graph_keys()
        if self.prepare is not None and self.backend == "breakable":
            self.prepare(*(functools.partial(self._run_bucket, key) for key in keys))
        capture_ladder(keys, self._capture_bucket, restart, warmup=self.warmup, device=self.device,
                       what="prefill bucket", iterate=progress_bar, retry=self.backend == "breakable",
                       label=_key_text)  # fmt: skip
        self.stats.buckets.sort(key=lambda b: b.tokens)
        self.stats.capture_s = time.perf_counter() - start
        if self._pcg is not None:
            self.stats.traces = self._pcg.stats.graphs
            logger.info("piecewise: %d torch.compile trace(s) of the body for %d buckets", self.stats.traces,
                        len(self.buckets))  # fmt: skip
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            self.stats.capture_memory_bytes = max(0, free_before - _free_memory(self.device))
            self.stats.graph_memory_bytes = sum(hi - lo for lo, hi in pool_segments(self.device, self.pool))
        largest = next(b for b in reversed(self.stats.buckets) if b.length_bound is None)
        memory = (
            f"{_fmt_bytes(self.stats.graph_memory_bytes)} in the graph pool "
            f"({_fmt_bytes(self.stats.capture_memory_bytes)} of free memory taken)"
            if self.device.type == "cuda"
            else "n/a on CPU"
        )
        bounded = "".join(f"; again for sequences of at most {bound} tokens" for bound in self.length_bounds)
        logger.info(
            "prefill graphs (%s): %d buckets %s tokens%s, captured in %.1fs (%s), graph memory %s; "
            "largest bucket: %d segments, %d breaks, %d single-kernel islands",
            self.backend, len(self.buckets), _ladder_text(self.buckets), bounded, self.stats.capture_s,
            self.stats.warmup_text(), memory, largest.segments, largest.breaks, largest.islands,
        )  # fmt: skip
        if self.backend == "breakable":
            eager = Counter(line[len("eager  "):] for line in self._graphs[(self.max_tokens, None)].describe().splitlines()
                            if line.startswith("eager"))  # fmt: skip
            logger.info("runs eagerly at each replay (breaks: per-batch lengths and pages): %s",
                        "; ".join(f"{name} ×{n}" for name, n in eager.items()))  # fmt: skip

    @contextlib.contextmanager
    def _at_bucket(self, key: GraphKey) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """The static inputs ``(ids, pos)`` of graph ``key = (bucket, bound)``, loaded, under
        inference mode and its capture context: where its dry run, warm-up and capture run the body."""
        n, bound = key
        ids, pos = self.inputs.tokens(n)
        self.inputs.load_tokens(ids[:0], pos[:0], n)
        context = self.capture_context(n) if bound is None else self.capture_context(n, bound)
        with torch.inference_mode(), context:
            yield ids, pos

    def _run_bucket(self, key: GraphKey) -> torch.Tensor:
        """The body, eagerly, on the static inputs of graph ``key`` (as its capture runs it)."""
        with self._at_bucket(key) as (ids, pos):
            return self.body(ids, pos)

    def _capture_bucket(self, key: GraphKey, warm: bool) -> None:
        t0 = time.perf_counter()
        n, bound = key
        warmup_s, warmups = 0.0, 0
        with self._at_bucket(key) as (ids, pos):
            if self.backend == "breakable":

                def warm_up() -> None:
                    self.body(ids, pos)  # lazy initialisation (kernel compiles) cannot happen inside a capture
                    _sync(self.device)

                def capture() -> tuple[BreakableGraph, torch.Tensor]:
                    graph = BreakableGraph(self.device, pool=self.pool, fold_islands=self.fold_islands)
                    return graph, graph.capture(self.body, ids, pos)

                (graph, self._outputs[key]), warmup_s, warmups = warm_then_capture(
                    warm, warm_up, capture, f"bucket {_key_text(key)}"
                )
                self._graphs[key] = graph
                s = graph.stats
                info = BucketInfo(n, 0.0, s.segments, s.breaks, s.single_kernel_islands, _sum(s.kernels_per_segment),
                                  length_bound=bound)  # fmt: skip
            else:
                assert self._pcg is not None and self._compiled is not None
                captures = self._pcg.stats.captures
                torch._dynamo.maybe_mark_dynamic(ids, 0)
                torch._dynamo.maybe_mark_dynamic(pos, 0)
                # Only the token dimension is symbolic: no automatic dynamic for the rest (a float
                # that differs between two models would become a host read of a tensor).
                with torch._dynamo.config.patch(automatic_dynamic_shapes=False):
                    t1 = time.perf_counter()
                    self._compiled(ids, pos)  # compile (first bucket, or one the trace does not cover) + warm-up
                    warmup_s, warmups = time.perf_counter() - t1, 1
                    with self._pcg.capturing():
                        self._outputs[key] = self._compiled(ids, pos)
                pieces = self._pcg.stats.captures - captures
                info = BucketInfo(n, 0.0, pieces, self._pcg.stats.split_ops // max(1, self._pcg.stats.graphs), 0, None)
        _sync(self.device)
        info.capture_s = time.perf_counter() - t0
        info.warmup_s, info.warmups = warmup_s, warmups
        self.stats.buckets.append(info)
        logger.debug(info.line())

    # -- run ------------------------------------------------------------------------------
    def bucket_for(self, num_tokens: int) -> tuple[int | None, str | None]:
        """The bucket a batch of ``num_tokens`` replays in, or ``(None, reason)`` for eager."""
        if num_tokens > self.max_tokens:
            return None, "tokens_above_largest_bucket"
        bucket = self.buckets[bisect.bisect_left(self.buckets, num_tokens)]
        if bucket > self.max_padding_ratio * num_tokens:
            return None, "padding_over_limit"
        return bucket, None

    def graph_for(self, num_tokens: int, longest: int | None = None) -> tuple[GraphKey | None, str | None]:
        """The graph ``(bucket, bound)`` a batch of ``num_tokens`` whose longest sequence is
        ``longest`` replays — the smallest captured bound it fits, else the bucket's graph for
        any batch (bound None) — or ``(None, reason)`` for eager."""
        bucket, reason = self.bucket_for(num_tokens)
        if bucket is None or (bucket, None) not in self._outputs:
            return None, reason or "bucket_not_captured"
        fits = [b for b in self.length_bounds if longest is not None and longest <= b and (bucket, b) in self._outputs]
        return (bucket, fits[0] if fits else None), None

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, longest: int | None = None) -> torch.Tensor:
        """Hidden states ``[n, D]`` for the batch (per-batch state must already be installed).
        ``longest``: the batch's longest sequence (prefix included), which picks the graph of
        the smallest length bound it fits (None: the bucket's graph for any batch)."""
        n = input_ids.shape[0]
        key, reason = self.graph_for(n, longest)
        if key is None:
            self.stats.fallbacks[reason or "bucket_not_captured"] += 1
            return self.body(input_ids, positions)
        bucket, bound = key
        self.bound_replays[bound] += 1
        self.inputs.load_tokens(input_ids, positions, bucket)
        if self.backend == "breakable":
            out = self._graphs[key].replay()
        else:
            assert self._pcg is not None and self._compiled is not None
            with self._pcg.replaying():
                out = self._compiled(*self.inputs.tokens(bucket))
        self.stats.count_replay(n, bucket)
        return out[:n]


def _key_text(key: GraphKey) -> str:
    """``"16"``, or ``"16 (sequences ≤ 2048)"`` for a bounded graph."""
    n, bound = key
    return f"{n}" + (f" (sequences ≤ {bound})" if bound is not None else "")


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _ladder_text(buckets: list[int]) -> str:
    return ", ".join(map(str, buckets)) if len(buckets) <= 24 else f"{buckets[0]}…{buckets[-1]}"


def _sum(values: list[int | None]) -> int | None:
    return None if any(v is None for v in values) else sum(v for v in values if v is not None)


def _free_memory(device: torch.device) -> int:
    if device.type != "cuda":
        return 0
    return torch.cuda.mem_get_info(device)[0]


def _fmt_bytes(n: int) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"


__all__ = ["LADDERS", "MODES", "PrefillGraphRunner", "default_prefill_buckets"]
