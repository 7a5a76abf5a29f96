"""Paged KV cache: a page allocator with a free list, the MLA latent cache and the DSA
indexer key cache.

Slot ``s`` of page ``p`` is row ``p * page_size + s`` of every per-layer cache tensor.
Page 0 is reserved as a sink for padded tokens (graph buckets write there), so it is
never handed out.
"""

from __future__ import annotations

import torch

from breakgraph.models.config import ModelConfig


class OutOfPagesError(RuntimeError):
    """The page pool cannot satisfy an allocation; nothing was allocated."""


class PagePool:
    """Allocator of fixed-size pages. ``alloc`` is all-or-nothing; ``free`` returns pages."""

    def __init__(self, num_pages: int, page_size: int) -> None:
        if num_pages < 2:
            raise ValueError(f"num_pages must be >= 2 (page 0 is reserved), got {num_pages}")
        self.num_pages = num_pages
        self.page_size = page_size
        self._free = list(range(num_pages - 1, 0, -1))  # pop() hands out low ids first
        self._used: set[int] = set()

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return len(self._used)

    @property
    def capacity_pages(self) -> int:
        """Pages a request can ever get (all but the reserved page 0)."""
        return self.num_pages - 1

    def pages_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.page_size)

    def alloc(self, n: int) -> list[int]:
        if n > len(self._free):
            raise OutOfPagesError(f"need {n} KV pages, only {len(self._free)} of {self.capacity_pages} are free")
        pages = [self._free.pop() for _ in range(n)]
        self._used.update(pages)
        return pages

    def free(self, pages: list[int]) -> None:
        for p in pages:
            if p not in self._used:
                raise ValueError(f"page {p} is not allocated (double free?)")
            self._used.remove(p)
            self._free.append(p)


class KVCache:
    """Per-layer caches over one :class:`PagePool`.

    ``latent[layer]``: ``[num_slots, kv_lora_rank + rope]`` (576 wide for GLM-5).
    ``indexer_k[layer]``: ``[num_slots, index_head_dim]`` for layers with their own indexer
    (``None`` for GLM-5.2 "shared" layers).
    """

    def __init__(
        self, config: ModelConfig, num_pages: int, page_size: int, dtype: torch.dtype, device: torch.device
    ) -> None:
        self.pool = PagePool(num_pages, page_size)
        self.page_size = page_size
        num_slots = num_pages * page_size
        self.latent = [
            torch.zeros(num_slots, config.latent_dim, dtype=dtype, device=device)
            for _ in range(config.num_hidden_layers)
        ]
        self.indexer_k = [
            torch.zeros(num_slots, config.index_head_dim, dtype=dtype, device=device) if config.has_indexer(i) else None
            for i in range(config.num_hidden_layers)
        ]

    @staticmethod
    def bytes_per_page(config: ModelConfig, page_size: int, dtype: torch.dtype) -> int:
        elem = torch.empty((), dtype=dtype).element_size()
        n_idx = sum(config.has_indexer(i) for i in range(config.num_hidden_layers))
        per_token = config.num_hidden_layers * config.latent_dim + n_idx * config.index_head_dim
        return per_token * page_size * elem
