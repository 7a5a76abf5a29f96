"""Paged KV cache: a page allocator with a free list, the MLA latent cache and the DSA
indexer key cache.

Slot ``s`` of page ``p`` is row ``p * page_size + s`` of every per-layer cache tensor.
Page 0 is reserved as a sink for padded tokens (graph buckets write there), so it is
never handed out. Pages are reference-counted so that requests sharing a prompt prefix can
share its pages (see :mod:`breakgraph.engine.prefix_cache`).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable

import torch

from breakgraph.kernels.indexer import indexer_fp8
from breakgraph.kernels.latent_fp8 import LatentLayout
from breakgraph.models.config import ModelConfig


class OutOfPagesError(RuntimeError):
    """The page pool cannot satisfy an allocation; nothing was allocated."""


class PagePool:
    """Allocator of fixed-size, reference-counted pages.

    A page is in exactly one of three states: *free*; *referenced* (``refcount > 0``, held by
    one or more requests); *idle* (``refcount == 0`` but marked cached by the prefix cache, so
    its KV may be reused). Idle pages are kept in least-recently-released order and are
    evicted, oldest first, when :meth:`alloc` runs out of free pages; ``on_evict(page)`` then
    tells the prefix cache to forget the page. ``alloc`` is all-or-nothing.
    """

    def __init__(self, num_pages: int, page_size: int) -> None:
        if num_pages < 2:
            raise ValueError(f"num_pages must be >= 2 (page 0 is reserved), got {num_pages}")
        self.num_pages = num_pages
        self.page_size = page_size
        self._free = list(range(num_pages - 1, 0, -1))  # pop() hands out low ids first
        self._refs: dict[int, int] = {}
        self._cached: set[int] = set()
        self._idle: OrderedDict[int, None] = OrderedDict()  # cached, unreferenced; oldest first
        self.on_evict: Callable[[int], None] | None = None

    @property
    def num_free(self) -> int:
        """Pages :meth:`alloc` can hand out now: free ones plus idle cached ones (evictable)."""
        return len(self._free) + len(self._idle)

    @property
    def num_used(self) -> int:
        """Pages referenced by at least one request."""
        return len(self._refs)

    @property
    def num_cached_idle(self) -> int:
        """Unreferenced pages kept for prefix reuse (evicted when the pool runs short)."""
        return len(self._idle)

    @property
    def capacity_pages(self) -> int:
        """Pages a request can ever get (all but the reserved page 0)."""
        return self.num_pages - 1

    def pages_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.page_size)

    def is_idle(self, page: int) -> bool:
        return page in self._idle

    def refcount(self, page: int) -> int:
        return self._refs.get(page, 0)

    def alloc(self, n: int) -> list[int]:
        """``n`` fresh pages (refcount 1), evicting idle cached pages when free ones run out."""
        if n > self.num_free:
            raise OutOfPagesError(f"need {n} KV pages, only {self.num_free} of {self.capacity_pages} are free")
        pages = []
        for _ in range(n):
            if self._free:
                page = self._free.pop()
            else:
                page, _ = self._idle.popitem(last=False)
                self._cached.discard(page)
                if self.on_evict is not None:
                    self.on_evict(page)
            self._refs[page] = 1
            pages.append(page)
        return pages

    def retain(self, pages: list[int]) -> None:
        """Add a reference to each page; each must be referenced or idle (not free)."""
        for p in pages:
            if p not in self._refs and p not in self._idle:
                raise ValueError(f"page {p} is free; only referenced or cached pages can be retained")
        for p in pages:
            self._idle.pop(p, None)
            self._refs[p] = self._refs.get(p, 0) + 1

    def free(self, pages: list[int]) -> None:
        """Drop one reference from each page. A page left unreferenced becomes idle if it is
        cached (most recently used last, so pages released first are evicted first) and free
        otherwise."""
        for p in pages:
            if p not in self._refs:
                raise ValueError(f"page {p} is not allocated (double free?)")
            self._refs[p] -= 1
            if self._refs[p] == 0:
                del self._refs[p]
                if p in self._cached:
                    self._idle[p] = None
                else:
                    self._free.append(p)

    def mark_cached(self, page: int) -> None:
        """Keep ``page`` (referenced now) as idle instead of freeing it when its last reference goes."""
        if page not in self._refs:
            raise ValueError(f"page {page} is not referenced; only pages in use can be marked cached")
        self._cached.add(page)

    def uncache(self, page: int) -> None:
        """Forget that ``page`` is cached; an idle page becomes free right away."""
        self._cached.discard(page)
        if page in self._idle:
            del self._idle[page]
            self._free.append(page)


class KVCache:
    """Per-layer caches over one :class:`PagePool`.

    ``latent[layer]``: ``[num_slots, kv_lora_rank + rope]`` (576 wide for GLM-5) of
    ``latent_dtype`` (default: ``dtype``); with ``latent_dtype=torch.float8_e4m3fn`` it is the
    FP8 latent cache instead, ``uint8 [num_slots, row_bytes]`` rows of
    :mod:`breakgraph.kernels.latent_fp8` (656 bytes for GLM-5: e4m3 latent, fp32 scale per 128,
    bf16 RoPE part), written by :func:`~breakgraph.kernels.latent_fp8.store_latent`.
    ``indexer_k[layer]``: ``[num_slots, index_head_dim]`` of ``dtype`` for layers with their own
    indexer (``None`` for GLM-5.2 "shared" layers); with the FP8 latent cache *and* the FP8 indexer
    (``BREAKGRAPH_INDEXER_FP8=1``, read when the cache is built) FP8 key rows instead, ``uint8``
    ``[num_slots, 144]`` for GLM-5 (128 e4m3 codes, one fp32 scale ``amax / 448``), which the
    FP8 score kernel reads as stored. The default (bf16) indexer keeps bf16 keys.
    """

    def __init__(
        self,
        config: ModelConfig,
        num_pages: int,
        page_size: int,
        dtype: torch.dtype,
        device: torch.device,
        latent_dtype: torch.dtype | None = None,
    ) -> None:
        self.pool = PagePool(num_pages, page_size)
        self.page_size = page_size
        self.latent_dtype = latent_dtype or dtype
        self.fp8_latent = self.latent_dtype == torch.float8_e4m3fn
        num_slots = num_pages * page_size
        storage = torch.uint8 if self.fp8_latent else self.latent_dtype
        width = self.latent_row_bytes_for(config, self.latent_dtype) // storage.itemsize
        self.latent = [
            torch.zeros(num_slots, width, dtype=storage, device=device) for _ in range(config.num_hidden_layers)
        ]
        self.fp8_index_keys = self.fp8_latent and indexer_fp8()
        key_dtype = torch.uint8 if self.fp8_index_keys else dtype
        key_width = self.index_row_bytes_for(config, dtype, self.fp8_index_keys) // key_dtype.itemsize
        self.indexer_k = [
            torch.zeros(num_slots, key_width, dtype=key_dtype, device=device) if config.has_indexer(i) else None
            for i in range(config.num_hidden_layers)
        ]

    @property
    def num_tokens(self) -> int:
        """Token slots a request can ever get (every page but the reserved page 0)."""
        return self.pool.capacity_pages * self.page_size

    @staticmethod
    def latent_row_bytes_for(config: ModelConfig, latent_dtype: torch.dtype) -> int:
        """Bytes of one token's latent entry in one layer (GLM-5: 1152 in bf16, 656 in FP8)."""
        if latent_dtype == torch.float8_e4m3fn:
            return LatentLayout(config.kv_lora_rank, config.qk_rope_head_dim).row_bytes
        return config.latent_dim * latent_dtype.itemsize

    @staticmethod
    def index_row_bytes_for(config: ModelConfig, dtype: torch.dtype, fp8: bool) -> int:
        """Bytes of one token's indexer key in one layer: ``index_head_dim`` values of ``dtype``,
        or with ``fp8`` an FP8 key row (e4m3 codes, one fp32 scale; GLM-5: 144 bytes, bf16: 256)."""
        if fp8:
            return LatentLayout(config.index_head_dim, 0).row_bytes
        return config.index_head_dim * dtype.itemsize

    @staticmethod
    def bytes_per_page(
        config: ModelConfig, page_size: int, dtype: torch.dtype, latent_dtype: torch.dtype | None = None
    ) -> int:
        """Bytes of one page over all layers: latent rows of ``latent_dtype`` (default ``dtype``)
        and indexer keys of ``dtype`` (FP8 key rows where the FP8 latent cache meets the FP8
        indexer, as :class:`KVCache` allocates them)."""
        n_idx = sum(config.has_indexer(i) for i in range(config.num_hidden_layers))
        fp8 = latent_dtype == torch.float8_e4m3fn
        latent = config.num_hidden_layers * KVCache.latent_row_bytes_for(config, latent_dtype or dtype)
        keys = n_idx * KVCache.index_row_bytes_for(config, dtype, fp8 and indexer_fp8())
        return (latent + keys) * page_size
