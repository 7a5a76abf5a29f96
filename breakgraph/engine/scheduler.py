"""Continuous batching: admission by the KV pages a request needs now, preemption when decode
runs short of pages, and prefill chunks interleaved with decode steps.

*Steps.* Each step is either an *extend* step (new tokens of one or more requests still in
prefill, at most ``chunked_prefill_size`` tokens in all, so a long prompt is prefilled over
several steps) or a *decode* step (one token for every request past its prefill). While some
requests prefill and others decode, the two kinds alternate, so a running stream waits at most
one chunk and one decode step for its next token, however long a prompt being prefilled is.
Alternating steps, rather than decode rows inside the chunk's batch, keeps every decode on the
decode path (its graphs and kernels): in a mixed batch each decode would run as a one-token
extend, eagerly, with other numerics than the same request decoding alone.

*Admission.* The waiting queue is served in order. The request at its head is admitted when the
pool can give it the pages of everything it must compute before its next token — its prompt
after the prefix cache's hits, or after a preemption its prompt and output — and still keep
``watermark_pages`` free for the running requests to grow into (into an idle pool it is
admitted without the watermark). The rest of its budget is not reserved: a decode step gives a
request a new page when it fills one. Reserving the whole prompt at admission (not chunk by
chunk) means a prefill never stalls halfway for pages; only decode grows.

*Preemption.* When a decode step cannot get a request its next page, the newest running request
is preempted: its computed full pages are offered to the prefix cache, its pages released, and
it goes back to the front of the waiting queue with its output kept. On re-admission its prompt
and output are recomputed as one prefill (reusing what the cache still holds) and its next
token is sampled as it would have been (the sampler's noise depends only on the seed and the
token index). The oldest running request therefore always progresses; a request whose whole
budget (prompt + max_new_tokens, capped by the context length) exceeds the pool is refused
when it is added.

*Prefix cache.* With prefix caching on (the default), admission first looks up the longest
cached prefix of the request's tokens (:class:`~breakgraph.engine.prefix_cache.PrefixCache`):
those pages are shared and the request starts with ``num_computed`` at the end of the reused
prefix. Before each step the pages finished so far are offered to the cache, so a request
admitted later can reuse what a running one has computed.
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
    """Cumulative counts: tokens prefilled by the model (recomputation after a preemption
    included), prompt tokens reused from the prefix cache at first admission, preemptions, and
    the most requests running at once."""

    prefill_tokens: int = 0
    cached_tokens: int = 0
    preemptions: int = 0
    peak_running: int = 0


class Scheduler:
    """Plans each step over ``pool`` (see the module docstring). ``watermark_pages``: free
    pages admission leaves for the running requests to grow into."""

    def __init__(
        self,
        pool: PagePool,
        context_length: int,
        max_running: int,
        chunked_prefill_size: int,
        enable_prefix_cache: bool = True,
        watermark_pages: int = 0,
    ) -> None:
        self.pool = pool
        self.context_length = context_length
        self.max_running = max_running
        self.chunked_prefill_size = chunked_prefill_size
        self.watermark_pages = watermark_pages
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []  # in admission order: the newest last
        self.prefix_cache: PrefixCache | None = None
        self.stats = SchedulerStats()
        self._last_mode: ForwardMode | None = None
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
            hit = cache.match(req) if cache is not None and req.prompt_logits is None else []
            need = self.pool.pages_for(req.total_len) - len(hit)
            # idle cached pages count as free, but the ones this request reuses will not be
            available = self.pool.num_free - sum(self.pool.is_idle(p) for p in hit)
            if need + (self.watermark_pages if self.running else 0) > available:
                break  # first come, first served: later requests wait behind it
            self.pool.retain(hit)
            req.pages = hit + self.pool.alloc(need)
            req.num_computed = len(hit) * self.pool.page_size
            req.num_committed_pages = len(hit)
            if not req.num_preemptions:  # later hits are the request's own pages coming back
                req.num_cached_tokens = req.num_computed
                self.stats.cached_tokens += req.num_cached_tokens
            req.status = RequestStatus.RUNNING
            self.waiting.popleft()
            self.running.append(req)
        self.stats.peak_running = max(self.stats.peak_running, len(self.running))

    def schedule(self) -> StepPlan | None:
        """The next step's plan, or ``None`` when there is nothing to run. May preempt running
        requests (see the module docstring)."""
        if self.prefix_cache is not None:
            ps = self.pool.page_size
            for req in self.running:
                if req.num_computed // ps > req.num_committed_pages:  # a page filled since the last commit
                    self.prefix_cache.commit(req)
        self._admit()
        # after an extend step the decodes go first, otherwise a waiting prefill does
        order = (self._decode, self._extend) if self._last_mode is ForwardMode.EXTEND else (self._extend, self._decode)
        plan = order[0]() or order[1]()
        self._last_mode = plan.mode if plan is not None else None
        return plan

    def _extend(self) -> StepPlan | None:
        entries, budget = [], self.chunked_prefill_size
        for req in self.running:
            if budget <= 0:
                break
            if req.in_prefill:
                n = min(req.total_len - req.num_computed, budget)
                entries.append((req, n))
                budget -= n
        if not entries:
            return None
        self.stats.prefill_tokens += sum(n for _, n in entries)
        return StepPlan(ForwardMode.EXTEND, entries)

    def _decode(self) -> StepPlan | None:
        entries, ps = [], self.pool.page_size
        for req in [r for r in self.running if not r.in_prefill]:
            # a request preempted for an older one's page is skipped; planned ones are older
            # than any victim, so they stay. Most steps a request's pages already hold its tokens.
            if req.status is RequestStatus.RUNNING and (len(req.pages) * ps >= req.total_len or self._grow(req)):
                entries.append((req, 1))
        return StepPlan(ForwardMode.DECODE, entries) if entries else None

    def _grow(self, req: Request) -> bool:
        """Give ``req`` pages for all its tokens, preempting the newest running requests while
        the pool is short. ``False`` when ``req`` itself was the newest and was preempted."""
        need = self.pool.pages_for(req.total_len) - len(req.pages)
        while need > self.pool.num_free:
            victim = self.running[-1]
            self.preempt(victim)
            if victim is req:
                return False
        if need > 0:
            req.pages += self.pool.alloc(need)
        return True

    def preempt(self, req: Request) -> None:
        """Take running ``req`` out of the batch: offer its computed pages to the prefix cache,
        release its pages and queue it first, its output kept, to be recomputed on re-admission."""
        self.running.remove(req)
        self._release(req)
        req.num_computed = req.num_committed_pages = 0
        req.num_preemptions += 1
        req.status = RequestStatus.WAITING
        self.waiting.appendleft(req)
        self.stats.preemptions += 1

    def _release(self, req: Request) -> None:
        if req.pages:
            if self.prefix_cache is not None:
                self.prefix_cache.commit(req)
            # last page first: a cached chain's tail is released (and evicted) before its head
            self.pool.free(req.pages[::-1])
            req.pages = []

    def finish(self, req: Request, reason: str) -> None:
        """Mark ``req`` finished and return its pages; safe to call on a waiting request."""
        if req.finished:
            return
        if req in self.running:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        self._release(req)
        req.status = RequestStatus.FINISHED
        req.finish_reason = reason

    @property
    def num_unfinished(self) -> int:
        return len(self.waiting) + len(self.running)
