"""The static batch graphs are captured on and replayed from, shared by prefill and decode.

A captured graph reads its inputs from fixed addresses, so every replay copies the real batch
into the same buffers. Prefill graphs read only the tokens (``input_ids``, ``positions``: their
breaks read the real per-batch layout at call time); decode graphs capture everything, so they
also read the per-request layout (one token per request) through :meth:`StaticBatch.batch`.
Padded rows are safe: token 0 at position 0, and a decode row writes to and reads from the
reserved page 0 only.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from breakgraph.forward_context import ForwardBatch, ForwardMode


@dataclass
class StaticBatch:
    """Static tensors for up to ``rows`` rows: ``input_ids``, ``positions`` int64 ``[rows]``;
    with ``max_pages`` also the decode layout ``token_req``, ``out_cache_loc`` int64 ``[rows]``,
    ``page_table`` int32 ``[rows, max_pages]``, ``seq_lens`` int32 ``[rows]`` (else None).
    A graph of ``n`` rows reads the first ``n`` rows."""

    input_ids: torch.Tensor
    positions: torch.Tensor
    token_req: torch.Tensor | None = None
    out_cache_loc: torch.Tensor | None = None
    page_table: torch.Tensor | None = None
    seq_lens: torch.Tensor | None = None

    @classmethod
    def allocate(cls, rows: int, device: torch.device, max_pages: int | None = None) -> StaticBatch:
        """Zeroed buffers (``seq_lens`` ones, ``token_req`` row ``i`` = request ``i``); the decode
        layout only when ``max_pages`` is given."""
        z = dict(dtype=torch.int64, device=device)
        tokens = dict(input_ids=torch.zeros(rows, **z), positions=torch.zeros(rows, **z))
        if max_pages is None:
            return cls(**tokens)
        return cls(
            **tokens, token_req=torch.arange(rows, **z), out_cache_loc=torch.zeros(rows, **z),
            page_table=torch.zeros(rows, max_pages, dtype=torch.int32, device=device),
            seq_lens=torch.ones(rows, dtype=torch.int32, device=device),
        )  # fmt: skip

    def tokens(self, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Views of the first ``n`` rows of ``input_ids`` and ``positions``."""
        return self.input_ids[:n], self.positions[:n]

    def load_tokens(self, input_ids: torch.Tensor, positions: torch.Tensor, n: int) -> None:
        """Copy the real tokens in and zero the rows after them up to ``n`` (padding is token 0 at position 0)."""
        real = input_ids.shape[0]
        self.input_ids[:real].copy_(input_ids)
        self.positions[:real].copy_(positions)
        self.input_ids[real:n].zero_()
        self.positions[real:n].zero_()

    def load(self, batch: ForwardBatch, n: int) -> None:
        """Copy a decode ``batch`` (``B ≤ n`` requests) in; rows ``B…n`` decode token 0 into page 0."""
        assert self.page_table is not None and self.seq_lens is not None and self.out_cache_loc is not None
        b, width = batch.batch_size, batch.page_table.shape[1]
        if width > self.page_table.shape[1]:
            raise ValueError(f"decode batch page table is {width} pages wide; graphs were captured for {self.page_table.shape[1]}")
        self.load_tokens(batch.input_ids, batch.positions, n)
        self.out_cache_loc[:b].copy_(batch.out_cache_loc)
        self.out_cache_loc[b:n].zero_()
        self.seq_lens[:b].copy_(batch.seq_lens)
        self.seq_lens[b:n].fill_(1)
        self.page_table[:b, :width].copy_(batch.page_table)
        self.page_table[:b, width:].zero_()
        self.page_table[b:n].zero_()

    def batch(self, n: int, kv_cache: Any, longest: int | None = None) -> ForwardBatch:
        """A decode ForwardBatch of views into the first ``n`` rows (what the captured breaks read).

        Its host-side lengths are frozen into the graph, so they are *upper bounds*: ``longest``
        tokens per sequence (default: a full page table). A host-side shortcut or shape taken at
        capture (skipping the indexer scores for short sequences, a score buffer as wide as the
        longest sequence, a kernel chosen by that width) must be valid for every batch the graph
        replays, so a graph captured with a smaller ``longest`` may replay only batches whose
        sequences all fit it."""
        assert self.page_table is not None and self.token_req is not None
        assert self.out_cache_loc is not None and self.seq_lens is not None
        full = self.page_table.shape[1] * kv_cache.page_size
        longest = full if longest is None else min(longest, full)
        return ForwardBatch(
            mode=ForwardMode.DECODE, input_ids=self.input_ids[:n], positions=self.positions[:n],
            token_req=self.token_req[:n], out_cache_loc=self.out_cache_loc[:n], page_table=self.page_table[:n],
            seq_lens=self.seq_lens[:n], seq_lens_cpu=[longest] * n, prefix_lens_cpu=[longest - 1] * n,
            extend_lens_cpu=[1] * n, kv_cache=kv_cache,
        )  # fmt: skip
