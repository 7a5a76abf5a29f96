"""The per-batch metadata every layer reads: one object, set around each forward.

It lives at the package root, below the layers: the engine builds and installs it, the
layers read it, and neither imports the other for it.

The runner builds a :class:`ForwardBatch`, installs it with :func:`forward_batch_context`,
and the attention / indexer breaks read it with :func:`get_forward_batch` *at call time*
(also at graph replay, which is why breaks never capture per-batch values in closures).
"""

from __future__ import annotations

import contextlib
import contextvars
import enum
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from breakgraph.engine.kv_cache import KVCache


class ForwardMode(enum.Enum):
    EXTEND = "extend"  # prefill / chunked prefill: several new tokens per request
    DECODE = "decode"  # one new token per request


@dataclass
class ForwardBatch:
    """A ragged batch of requests, each adding ``extend_lens[b]`` tokens after
    ``prefix_lens[b]`` cached ones.

    Device tensors (length ``num_tokens`` or ``batch_size``; the model's activations may be
    padded to a graph bucket with more rows — breaks handle the first ``num_tokens``):
      ``input_ids [T]`` int64, ``positions [T]`` int64, ``token_req [T]`` int64 (row of each
      token's request), ``out_cache_loc [T]`` int64 (cache slot each new token is written to),
      ``page_table [B, P]`` int32 (pages of each request), ``seq_lens [B]`` int32 (length
      after this forward).
    Host copies: ``seq_lens_cpu``, ``prefix_lens_cpu``, ``extend_lens_cpu``.
    ``kv_cache`` is the engine's paged cache (owned by the engine).
    ``length_bound``: set on the stand-in batch a prefill graph is captured with — the longest
    sequence any batch the graph replays may have (see :attr:`seq_len_bound`); None elsewhere.
    ``derived``: what the breaks derive from the batch once and every layer reuses (e.g. the
    MHA form's rows and keys, :func:`~breakgraph.layers.dsa.mha_rows_layout`), by name;
    it lives as long as the batch (a copy made by ``dataclasses.replace`` starts empty).
    """

    mode: ForwardMode
    input_ids: torch.Tensor
    positions: torch.Tensor
    token_req: torch.Tensor
    out_cache_loc: torch.Tensor
    page_table: torch.Tensor
    seq_lens: torch.Tensor
    seq_lens_cpu: list[int]
    prefix_lens_cpu: list[int]
    extend_lens_cpu: list[int]
    kv_cache: KVCache
    length_bound: int | None = None
    derived: dict[str, object] = field(default_factory=dict, init=False, repr=False, compare=False)

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def batch_size(self) -> int:
        return len(self.seq_lens_cpu)

    @property
    def max_seq_len(self) -> int:
        return max(self.seq_lens_cpu) if self.seq_lens_cpu else 0

    @property
    def seq_len_bound(self) -> int:
        """How long a sequence the code captured or run on this batch must allow for: the
        ``length_bound`` of a capture's stand-in batch (its graph replays other batches), else
        :attr:`max_seq_len`. Captured code reads this; a break, which runs on the real batch at
        every replay, reads :attr:`max_seq_len`."""
        return self.length_bound if self.length_bound is not None else self.max_seq_len

    @property
    def logits_rows(self) -> list[int]:
        """Row of each request's last new token (where next-token logits come from)."""
        rows, end = [], 0
        for n in self.extend_lens_cpu:
            end += n
            rows.append(end - 1)
        return rows


# Per thread (and per asyncio task): two engines in one process never see each other's batch.
_CURRENT: contextvars.ContextVar[ForwardBatch | None] = contextvars.ContextVar("forward_batch", default=None)


@contextlib.contextmanager
def forward_batch_context(batch: ForwardBatch) -> Iterator[ForwardBatch]:
    """Make ``batch`` the current forward batch (of this thread) for the duration of the block."""
    token = _CURRENT.set(batch)
    try:
        yield batch
    finally:
        _CURRENT.reset(token)


def get_forward_batch() -> ForwardBatch:
    """The batch installed by :func:`forward_batch_context` in this thread; raises if none is."""
    batch = _CURRENT.get()
    if batch is None:
        raise RuntimeError("no ForwardBatch is installed: run the model inside forward_batch_context(batch)")
    return batch
