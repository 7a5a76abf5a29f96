"""Prefix reuse across requests: full KV pages indexed by a hash of all tokens up to their end.

The key of a request's ``i``-th full page is a digest of the key of page ``i - 1`` and the
``page_size`` token ids of page ``i``, so equal keys mean equal token prefixes (up to a
128-bit hash collision) and the pages hold the same KV. Only full pages are cached; a page
is cached once its tokens' KV has been computed (:meth:`PrefixCache.commit`), and it stays
reusable after its requests finish, as an *idle* page of the :class:`PagePool`, until the
pool needs it back (least recently released first).

A new request reuses the longest chain of cached pages covering its prompt (a preempted one:
its prompt and output), but never all of it: at least one token is recomputed so the forward
yields the logits of the next token. The reused pages are shared read-only: a request writes only at
positions ``>= num_computed``, which lie in its own pages.
"""

from __future__ import annotations

import hashlib
from array import array

from breakgraph.engine.kv_cache import PagePool
from breakgraph.engine.request import Request


def page_key(parent: bytes, tokens: list[int]) -> bytes:
    """Key of a full page holding ``tokens`` after the prefix whose last page key is ``parent``
    (``b""`` for the first page)."""
    h = hashlib.blake2b(parent, digest_size=16)
    h.update(array("q", tokens).tobytes())
    return h.digest()


class PrefixCache:
    """Maps page keys to pages of ``pool``; the pool tells it when it evicts one."""

    def __init__(self, pool: PagePool) -> None:
        self.pool = pool
        self.page_size = pool.page_size
        self._page_of: dict[bytes, int] = {}
        self._key_of: dict[int, bytes] = {}
        pool.on_evict = self._forget

    def __len__(self) -> int:
        return len(self._page_of)

    def _keys(self, req: Request, num_pages: int) -> list[bytes]:
        """``req.page_keys`` extended to at least ``num_pages`` keys (tokens must exist)."""
        keys, ps = req.page_keys, self.page_size
        while len(keys) < num_pages:
            i = len(keys)
            keys.append(page_key(keys[-1] if keys else b"", req.token_slice(i * ps, (i + 1) * ps)))
        return keys

    def match(self, req: Request) -> list[int]:
        """Cached pages holding the longest reusable prefix of ``req``'s tokens (its prompt, and
        after a preemption its output too; at most ``total_len - 1`` tokens). Takes no
        reference: call :meth:`PagePool.retain`."""
        limit = (req.total_len - 1) // self.page_size
        pages = []
        for i in range(limit):
            page = self._page_of.get(self._keys(req, i + 1)[i])
            if page is None:
                break
            pages.append(page)
        return pages

    def commit(self, req: Request) -> None:
        """Cache every full page of ``req`` whose tokens all have their KV computed. A page
        whose key is already cached (another request computed the same prefix) is left
        alone: it is freed with its request."""
        num_full = min(req.num_computed // self.page_size, len(req.pages))
        if num_full <= req.num_committed_pages:
            return
        keys = self._keys(req, num_full)
        for i in range(req.num_committed_pages, num_full):
            page = req.pages[i]
            if keys[i] in self._page_of or page in self._key_of:
                continue
            self._page_of[keys[i]] = page
            self._key_of[page] = keys[i]
            self.pool.mark_cached(page)
        req.num_committed_pages = num_full

    def _forget(self, page: int) -> None:
        key = self._key_of.pop(page, None)
        if key is not None:
            del self._page_of[key]

    def clear(self) -> None:
        """Forget every cached page; idle ones go back to the free list."""
        for page in list(self._key_of):
            self.pool.uncache(page)
        self._page_of.clear()
        self._key_of.clear()
