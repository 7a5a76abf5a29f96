"""Runs the model on a batch: builds the :class:`ForwardBatch` from requests, calls the
decoder body (eagerly or through a graph runner) and the LM head on the rows that need it."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from breakgraph.engine.kv_cache import KVCache
from breakgraph.forward_context import ForwardBatch, ForwardMode, forward_batch_context
from breakgraph.models.glm5 import DsaForCausalLM


@dataclass(frozen=True)
class BatchEntry:
    """One request's share of a forward: ``token_ids`` at positions ``start…start+len-1``,
    cache pages ``pages`` (covering at least ``start + len`` tokens)."""

    token_ids: list[int]
    start: int
    pages: list[int]


class ModelRunner:
    """Owns nothing but references: the model and the KV cache belong to the engine."""

    def __init__(self, model: DsaForCausalLM, kv_cache: KVCache, device: torch.device) -> None:
        self.model = model
        self.kv_cache = kv_cache
        self.device = device
        self.prefill_graphs = None  # set by the engine when a prefill graph backend is on
        self.decode_graphs = None  # set by the engine when decode graphs are on

    def make_batch(self, entries: list[BatchEntry], mode: ForwardMode) -> ForwardBatch:
        """Lay out a ragged batch (see :class:`ForwardBatch`)."""
        ps = self.kv_cache.page_size
        ids, positions, token_req, slots = [], [], [], []
        for b, e in enumerate(entries):
            for i, tok in enumerate(e.token_ids):
                pos = e.start + i
                ids.append(tok)
                positions.append(pos)
                token_req.append(b)
                slots.append(e.pages[pos // ps] * ps + pos % ps)
        width = max(len(e.pages) for e in entries)
        table = [e.pages + [0] * (width - len(e.pages)) for e in entries]
        seq_lens = [e.start + len(e.token_ids) for e in entries]
        dev = self.device

        def t(x, dtype):
            return torch.tensor(x, dtype=dtype, device=dev)

        return ForwardBatch(
            mode=mode,
            input_ids=t(ids, torch.int64),
            positions=t(positions, torch.int64),
            token_req=t(token_req, torch.int64),
            out_cache_loc=t(slots, torch.int64),
            page_table=t(table, torch.int32),
            seq_lens=t(seq_lens, torch.int32),
            seq_lens_cpu=seq_lens,
            prefix_lens_cpu=[e.start for e in entries],
            extend_lens_cpu=[len(e.token_ids) for e in entries],
            kv_cache=self.kv_cache,
        )

    @contextlib.contextmanager
    def capture_context(self, num_tokens: int) -> Iterator[None]:
        """A stand-in batch for capturing a graph bucket of ``num_tokens``: one request whose
        tokens all write to, and read from, the reserved padding page 0."""
        ps = self.kv_cache.page_size
        pages = [0] * -(-num_tokens // ps)
        entry = BatchEntry([0] * num_tokens, 0, pages)
        batch = self.make_batch([entry], ForwardMode.EXTEND)
        with forward_batch_context(batch):
            yield

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch, all_logits: bool = False) -> torch.Tensor:
        """Run the body and the LM head. Returns fp32 logits for each request's last token
        ``[B, vocab]``, or for every token ``[T, vocab]`` when ``all_logits``."""
        with forward_batch_context(batch):
            if self.prefill_graphs is not None and batch.mode is ForwardMode.EXTEND:
                hidden = self.prefill_graphs.run(batch.input_ids, batch.positions)
            elif self.decode_graphs is not None and batch.mode is ForwardMode.DECODE:
                hidden = self.decode_graphs.run(batch)
            else:
                hidden = self.model(batch.input_ids, batch.positions)
        rows = hidden if all_logits else hidden[batch.logits_rows]
        return self.model.compute_logits(rows)
