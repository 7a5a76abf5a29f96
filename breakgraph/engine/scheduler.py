"""Continuous batching with chunked prefill and admission by KV pages.

Each step is either an *extend* step (new prompt tokens of one or more requests, at most
``chunked_prefill_size`` tokens in all, so a long prompt is prefilled over several steps)
or a *decode* step (one token for every running request). A request is admitted only when
the pool can reserve pages for its whole budget (prompt + max_new_tokens, capped by the
context length), so a running request never runs out of pages; the others wait in order.

With prefix caching on (the default), admission first looks up the longest cached prefix of
the prompt (:class:`~breakgraph.engine.prefix_cache.PrefixCache`): those pages are shared,
only the rest of the budget is allocated, and the request starts with ``num_computed`` at
the end of the reused prefix. Before each step the pages finished so far are offered to the
cache, so a request admitted later can reuse what a running one has computed.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from breakgraph.engine.kv_cache import PagePool
from breakgraph.engine.prefix_cache import PrefixCache
from breakgraph.engine.request import Request, RequestStatus
from breakgraph.forward_context import ForwardMode


class RequestTooLongError(ValueError):
    """The request can never fit (context length or the whole KV pool)."""


@dataclass
class StepPlan:
    """What the next forward runs: ``(request, num_new_tokens)`` pairs in batch order."""

    mode: ForwardMode
    entries: list[tuple[Request, int]]


@dataclass
class SchedulerStats:
    """Cumulative counts: prompt tokens prefilled by the model and prompt tokens reused from
    the prefix cache."""

    prefill_tokens: int = 0
    cached_tokens: int = 0


class Scheduler:
    def __init__(
        self,
        pool: PagePool,
        context_length: int,
        max_running: int,
        chunked_prefill_size: int,
        enable_prefix_cache: bool = True,
    ) -> None:
        self.pool = pool
        self.context_length = context_length
        self.max_running = max_running
        self.chunked_prefill_size = chunked_prefill_size
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.prefix_cache: PrefixCache | None = None
        self.stats = SchedulerStats()
        self.set_prefix_caching(enable_prefix_cache)

    def set_prefix_caching(self, enabled: bool) -> None:
        """Turn prefix reuse on or off; turning it off drops every cached page."""
        if enabled and self.prefix_cache is None:
            self.prefix_cache = PrefixCache(self.pool)
        elif not enabled and self.prefix_cache is not None:
            self.prefix_cache.clear()
            self.pool.on_evict = None
            self.prefix_cache = None

    def budget_tokens(self, req: Request) -> int:
        return min(len(req.prompt_ids) + req.params.max_new_tokens, self.context_length)

    def check(self, req: Request) -> None:
        """Raise :class:`RequestTooLongError` if ``req`` could never be served."""
        n = len(req.prompt_ids)
        if n == 0:
            raise RequestTooLongError("the prompt is empty")
        if n >= self.context_length:
            raise RequestTooLongError(
                f"the prompt has {n} tokens; the context length is {self.context_length} (prompt + at least 1 new token)"
            )
        need = self.pool.pages_for(self.budget_tokens(req))
        if need > self.pool.capacity_pages:
            raise RequestTooLongError(
                f"the request needs {need} KV pages but the cache holds {self.pool.capacity_pages}; "
                "lower max_new_tokens or give the cache more memory"
            )

    def add(self, req: Request) -> None:
        self.check(req)
        self.waiting.append(req)

    def _admit(self) -> None:
        cache = self.prefix_cache
        while self.waiting and len(self.running) < self.max_running:
            req = self.waiting[0]
            need = self.pool.pages_for(self.budget_tokens(req))
            hit = cache.match(req) if cache is not None and req.prompt_logits is None else []
            # idle cached pages count as free, but the ones this request reuses will not be
            available = self.pool.num_free - sum(self.pool.is_idle(p) for p in hit)
            if need - len(hit) > available:
                break  # first come, first served: later requests wait behind it
            self.pool.retain(hit)
            req.pages = hit + self.pool.alloc(need - len(hit))
            req.num_computed = req.num_cached_tokens = len(hit) * self.pool.page_size
            req.num_committed_pages = len(hit)
            self.stats.cached_tokens += req.num_cached_tokens
            req.status = RequestStatus.RUNNING
            self.waiting.popleft()
            self.running.append(req)

    def schedule(self) -> StepPlan | None:
        """The next step's plan, or ``None`` when there is nothing to run."""
        if self.prefix_cache is not None:
            for req in self.running:
                self.prefix_cache.commit(req)
        self._admit()
        prefilling = [r for r in self.running if r.in_prefill]
        if prefilling:
            entries, budget = [], self.chunked_prefill_size
            for req in prefilling:
                if budget <= 0:
                    break
                n = min(len(req.prompt_ids) - req.num_computed, budget)
                entries.append((req, n))
                budget -= n
            self.stats.prefill_tokens += sum(n for _, n in entries)
            return StepPlan(ForwardMode.EXTEND, entries)
        if self.running:
            return StepPlan(ForwardMode.DECODE, [(r, 1) for r in self.running])
        return None

    def finish(self, req: Request, reason: str) -> None:
        """Mark ``req`` finished and return its pages; safe to call on a waiting request."""
        if req.finished:
            return
        if req in self.running:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        if req.pages:
            if self.prefix_cache is not None:
                self.prefix_cache.commit(req)
            # last page first: a cached chain's tail is released (and evicted) before its head
            self.pool.free(req.pages[::-1])
            req.pages = []
        req.status = RequestStatus.FINISHED
        req.finish_reason = reason

    @property
    def num_unfinished(self) -> int:
        return len(self.waiting) + len(self.running)
