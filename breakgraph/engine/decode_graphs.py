"""Decode under full graphs: one graph per batch-size bucket, the whole decoder body inside.

Unlike prefill, a decode step's shapes are known up front (one token per request, a page
table as wide as the context length), so everything — attention and indexer included — is
captured. The per-batch layout lives in static buffers (:class:`DecodeGraphBuffers`) that the
captured breaks read through a static :class:`ForwardBatch`; a replay copies the real batch
in, points padded rows at the reserved page 0, and replays.
"""

from __future__ import annotations

import bisect
import logging
import time
from collections import Counter
from dataclasses import dataclass, field

import torch

from breakgraph.engine.kv_cache import KVCache
from breakgraph.forward_context import ForwardBatch, ForwardMode, forward_batch_context
from breakgraph.graphs.capture import make_capturer
from breakgraph.graphs.segments import Segment, new_graph_pool

logger = logging.getLogger(__name__)

def default_decode_buckets(max_bs: int) -> list[int]:
    """1, 2, 4, 8, then every 8 up to ``max_bs`` (included)."""
    return sorted({b for b in [1, 2, 4, 8, *range(16, max_bs + 1, 8)] if b <= max_bs} | {max_bs})


@dataclass
class DecodeGraphBuffers:
    """Static per-batch tensors for up to ``max_bs`` requests; ``page_table [max_bs, max_pages]``."""

    input_ids: torch.Tensor
    positions: torch.Tensor
    token_req: torch.Tensor
    out_cache_loc: torch.Tensor
    page_table: torch.Tensor
    seq_lens: torch.Tensor

    @classmethod
    def allocate(cls, max_bs: int, max_pages: int, device: torch.device) -> DecodeGraphBuffers:
        z = dict(dtype=torch.int64, device=device)
        return cls(
            input_ids=torch.zeros(max_bs, **z), positions=torch.zeros(max_bs, **z),
            token_req=torch.arange(max_bs, **z), out_cache_loc=torch.zeros(max_bs, **z),
            page_table=torch.zeros(max_bs, max_pages, dtype=torch.int32, device=device),
            seq_lens=torch.ones(max_bs, dtype=torch.int32, device=device),
        )  # fmt: skip

    def batch(self, bs: int, kv_cache: KVCache) -> ForwardBatch:
        """A ForwardBatch of views into the buffers (what the captured breaks read).

        Its host-side lengths are frozen into the graph, so they are the *upper bounds* (a full
        page table): a host-side shortcut taken at capture (e.g. skipping the indexer scores for
        short sequences) must be valid for every batch the graph replays."""
        longest = self.page_table.shape[1] * kv_cache.page_size
        return ForwardBatch(
            mode=ForwardMode.DECODE, input_ids=self.input_ids[:bs], positions=self.positions[:bs],
            token_req=self.token_req[:bs], out_cache_loc=self.out_cache_loc[:bs], page_table=self.page_table[:bs],
            seq_lens=self.seq_lens[:bs], seq_lens_cpu=[longest] * bs, prefix_lens_cpu=[longest - 1] * bs,
            extend_lens_cpu=[1] * bs, kv_cache=kv_cache,
        )  # fmt: skip

    def load(self, batch: ForwardBatch, bs: int) -> None:
        """Copy ``batch`` (``B ≤ bs`` requests) in; rows ``B…bs`` decode token 0 into page 0."""
        b, width = batch.batch_size, batch.page_table.shape[1]
        if width > self.page_table.shape[1]:
            raise ValueError(f"decode batch page table is {width} pages wide; graphs were captured for {self.page_table.shape[1]}")
        for name in ("input_ids", "positions", "out_cache_loc"):
            buf = getattr(self, name)
            buf[:b].copy_(getattr(batch, name))
            buf[b:bs].zero_()
        self.seq_lens[:b].copy_(batch.seq_lens)
        self.seq_lens[b:bs].fill_(1)
        self.page_table[:b, :width].copy_(batch.page_table)
        self.page_table[:b, width:].zero_()
        self.page_table[b:bs].zero_()


@dataclass
class DecodeGraphStats:
    buckets: list[int] = field(default_factory=list)
    capture_s: float = 0.0
    replays: int = 0
    fallbacks: Counter = field(default_factory=Counter)


class DecodeGraphRunner:
    """Full-graph decode for batch sizes in ``buckets``; larger batches run eagerly (counted)."""

    def __init__(self, model: torch.nn.Module, kv_cache: KVCache, device: torch.device, buckets: list[int], max_pages: int) -> None:
        self.model = model
        self.kv_cache = kv_cache
        self.device = torch.device(device)
        self.buckets = sorted(set(buckets))
        self.buffers = DecodeGraphBuffers.allocate(self.buckets[-1], max_pages, self.device)
        self.pool = new_graph_pool(self.device)
        self.stats = DecodeGraphStats()
        self._graphs: dict[int, tuple[Segment, torch.Tensor, ForwardBatch]] = {}

    def capture(self, progress: bool = True) -> None:
        """Warm up and capture each batch size, largest first, in one shared pool."""
        from tqdm.auto import tqdm

        start = time.perf_counter()
        for bs in tqdm(sorted(self.buckets, reverse=True), desc="Capturing decode graphs", unit="bs",
                       disable=None if progress else True):  # None: TQDM_DISABLE and non-TTY rules apply
            batch = self.buffers.batch(bs, self.kv_cache)
            with torch.inference_mode(), forward_batch_context(batch):
                self.model(batch.input_ids, batch.positions)  # warm-up
                capturer = make_capturer(self.device, self.pool)
                capturer.open()
                try:
                    capturer.begin(f"decode graph bs={bs}")
                    out = self.model(batch.input_ids, batch.positions)
                    segment = capturer.end("end of capture")
                finally:
                    capturer.close()
            self._graphs[bs] = (segment, out, batch)
        self.stats.buckets = list(self.buckets)
        self.stats.capture_s = time.perf_counter() - start
        logger.info("decode graphs: batch sizes %s captured in %.1fs", self.buckets, self.stats.capture_s)

    def run(self, batch: ForwardBatch) -> torch.Tensor:
        """Hidden states ``[B, D]`` for a decode batch (graph-owned memory, valid until the next run)."""
        b = batch.batch_size
        if b > self.buckets[-1]:
            self.stats.fallbacks["batch_above_largest_bucket"] += 1
            return self.model(batch.input_ids, batch.positions)
        bs = self.buckets[bisect.bisect_left(self.buckets, b)]
        segment, out, static_batch = self._graphs[bs]
        self.buffers.load(batch, bs)
        with forward_batch_context(static_batch):
            segment.replay()
        self.stats.replays += 1
        return out[:b]
