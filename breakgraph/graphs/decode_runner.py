"""Decode under full graphs (the ``full`` decode backend): one graph per batch-size bucket (and
sequence-length bound, below), the whole decoder body inside.

Unlike prefill, a decode step's shapes are known up front (one token per request, a page
table as wide as the context length), so everything — attention and indexer included — is
captured. The per-batch layout lives in a :class:`~breakgraph.graphs.static_batch.StaticBatch`
whose views the captured breaks read as a static ForwardBatch; a replay copies the real batch
in, points padded rows at the reserved page 0, and replays.

A step's host-side choices may depend on the longest sequence (a score buffer's width, a kernel
picked by it), which a graph freezes at its upper bound. ``length_bounds`` (the model's: see
``host_length_bounds``) adds, per batch size, a graph captured for sequences up to each bound
below the page table's width; a batch replays the graph of the smallest bound its longest
sequence fits, so a short conversation in a long-context engine does not pay for the width.
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

from breakgraph.forward_context import ForwardBatch, forward_batch_context
from breakgraph.graphs.capture import make_capturer
from breakgraph.graphs.prefill_runner import LADDERS
from breakgraph.graphs.segments import Segment, new_graph_pool
from breakgraph.graphs.static_batch import StaticBatch
from breakgraph.graphs.stats import BucketInfo, GraphStats
from breakgraph.graphs.warmup import capture_ladder, check_warmup, warm_then_capture

logger = logging.getLogger(__name__)

Body = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def default_decode_buckets(max_bs: int, ladder: str = "coarse") -> list[int]:
    """1, 2, 4, 8, then every 16 (``coarse``: 8 batch sizes to 64) or every 8 (``fine``: 11)
    up to ``max_bs`` (included). A padded decode row costs little (it reads the reserved page
    0 and routes to the same experts as every other padded row)."""
    if ladder not in LADDERS:
        raise ValueError(f"--cuda-graph-ladder must be one of {LADDERS}, got {ladder!r}")
    step = 16 if ladder == "coarse" else 8
    return sorted({b for b in [1, 2, 4, 8, *range(16, max_bs + 1, step)] if b <= max_bs} | {max_bs})


class DecodeGraphRunner:
    """Full-graph decode for batch sizes in ``buckets``; larger batches run eagerly (counted).

    ``model`` is the decoder body ``(input_ids [B], positions [B]) -> hidden [B, D]``;
    ``kv_cache`` the paged cache the static batch points at; ``max_pages`` the page-table
    width captured (the longest context a replayed batch may have); ``length_bounds``: sequence
    lengths below that width to capture graphs for as well (see the module docstring);
    ``warmup`` as for :class:`~breakgraph.graphs.prefill_runner.PrefillGraphRunner` (``once``:
    only the first graph, and any whose capture would compile a kernel, runs eagerly before its
    capture); ``capture_context(bs)``: a context manager entered while the graphs of ``bs`` rows
    warm up and are captured (what the model's kernels read at launch, such as a launch mode);
    ``prepare`` as for the prefill runner: called once before the first capture with one thunk
    per graph, each running the model on that graph's static batch."""

    backend = "full"

    def __init__(
        self, model: Body, kv_cache: Any, device: torch.device, buckets: list[int], max_pages: int,
        warmup: str = "once", prepare: Callable[..., None] | None = None,
        length_bounds: tuple[int, ...] = (),
        capture_context: Callable[[int], AbstractContextManager[Any]] | None = None,
    ) -> None:  # fmt: skip
        check_warmup(warmup)
        self.capture_context = capture_context
        self.warmup = warmup
        self.prepare = prepare
        self.model = model
        self.kv_cache = kv_cache
        self.device = torch.device(device)
        self.buckets = sorted(set(buckets))
        full = max_pages * kv_cache.page_size
        #: the longest sequence each batch size has a graph for, ascending (the last: a full page table)
        self.length_bounds = sorted({b for b in length_bounds if 0 < b < full} | {full})
        self.buffers = StaticBatch.allocate(self.buckets[-1], self.device, max_pages=max_pages)
        self.pool = new_graph_pool(self.device)
        self.stats = GraphStats(self.backend, phase="decode")
        self._graphs: dict[tuple[int, int], tuple[Segment, torch.Tensor, ForwardBatch]] = {}
        #: replays per length bound (which graphs the batches took)
        self.bound_replays: Counter[int] = Counter()

    def capture(self, progress: bool = True) -> None:
        """Warm up (see ``warmup``) and capture each (batch size, length bound), largest first,
        in one shared pool; should a capture without warm-up fail, all are captured again, each
        after a warm-up, in a new pool (logged)."""
        from tqdm.auto import tqdm

        start = time.perf_counter()

        def progress_bar(sizes: list[int]) -> Any:  # None: TQDM_DISABLE and non-TTY rules apply
            return tqdm(sizes, desc="Capturing decode graphs", unit="graph", disable=None if progress else True)

        def restart() -> None:
            self._graphs.clear()
            self.stats.buckets.clear()
            self.pool = new_graph_pool(self.device)

        keys = [(bs, bound) for bs in sorted(self.buckets, reverse=True) for bound in reversed(self.length_bounds)]
        if self.prepare is not None:
            self.prepare(*(functools.partial(self._run_one, key) for key in keys))
        capture_ladder(keys, self._capture_one, restart, warmup=self.warmup, device=self.device,
                       what="decode graph (batch size, longest sequence)", iterate=progress_bar)  # fmt: skip
        self.stats.buckets.sort(key=lambda b: b.tokens)
        self.stats.capture_s = time.perf_counter() - start
        logger.info("decode graphs: batch sizes %s, for sequences up to %s tokens, captured in %.1fs (%s)",
                    self.buckets, " and ".join(map(str, self.length_bounds)), self.stats.capture_s,
                    self.stats.warmup_text())  # fmt: skip

    @contextlib.contextmanager
    def _at_graph(self, key: tuple[int, int]) -> Iterator[ForwardBatch]:
        """The static batch of ``key = (batch size, length bound)``, installed, under inference
        mode and the capture context of its rows: where its dry run, warm-up and capture run."""
        bs, bound = key
        batch = self.buffers.batch(bs, self.kv_cache, longest=bound)
        context = self.capture_context(bs) if self.capture_context is not None else contextlib.nullcontext()
        with torch.inference_mode(), forward_batch_context(batch), context:
            yield batch

    def _run_one(self, key: tuple[int, int]) -> torch.Tensor:
        """The model, eagerly, on the static batch of ``key`` (as its capture runs it)."""
        with self._at_graph(key) as batch:
            return self.model(batch.input_ids, batch.positions)

    def _capture_one(self, key: tuple[int, int], warm: bool) -> None:
        t0 = time.perf_counter()
        bs, bound = key
        with self._at_graph(key) as batch:

            def warm_up() -> None:
                self.model(batch.input_ids, batch.positions)  # kernel compiles cannot happen inside a capture
                if self.device.type == "cuda":
                    torch.cuda.synchronize(self.device)

            def capture() -> tuple[Segment, torch.Tensor]:
                capturer = make_capturer(self.device, self.pool)
                capturer.open()
                try:
                    capturer.begin(f"decode graph bs={bs} longest={bound}")
                    try:
                        out = self.model(batch.input_ids, batch.positions)
                    except BaseException:
                        capturer.abort()
                        raise
                    return capturer.end("end of capture"), out
                finally:
                    capturer.close()

            (segment, out), warmup_s, warmups = warm_then_capture(warm, warm_up, capture, f"decode bs {bs} (≤ {bound})")
        self._graphs[key] = (segment, out, batch)
        self.stats.buckets.append(BucketInfo(bs, time.perf_counter() - t0, 1, 0, 0, None, warmup_s, warmups))

    def run(self, batch: ForwardBatch) -> torch.Tensor:
        """Hidden states ``[B, D]`` for a decode batch (graph-owned memory, valid until the next run)."""
        b = batch.batch_size
        if b > self.buckets[-1]:
            self.stats.fallbacks["batch_above_largest_bucket"] += 1
            return self.model(batch.input_ids, batch.positions)
        bs = self.buckets[bisect.bisect_left(self.buckets, b)]
        bound = self.length_bounds[min(bisect.bisect_left(self.length_bounds, batch.max_seq_len), len(self.length_bounds) - 1)]
        segment, out, static_batch = self._graphs[(bs, bound)]
        self.bound_replays[bound] += 1
        self.buffers.load(batch, bs)
        with forward_batch_context(static_batch):
            segment.replay()
        self.stats.count_replay(b, bs)
        return out[:b]
