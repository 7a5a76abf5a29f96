"""The scheduler's decisions, without a model: admission by the pages a request needs now plus
the watermark, decode growing pages and preempting the newest request, recomputation on
re-admission, and prefill chunks alternating with decode steps."""

from __future__ import annotations

import pytest

from breakgraph.engine.kv_cache import PagePool
from breakgraph.engine.request import Request, RequestStatus
from breakgraph.engine.sampling import SamplingParams
from breakgraph.engine.scheduler import RequestTooLongError, Scheduler
from breakgraph.forward_context import ForwardMode

PS = 4  # tokens per page


def make(num_pages: int, watermark: int = 0, chunk: int = 64, max_running: int = 16, cache: bool = False) -> Scheduler:
    return Scheduler(PagePool(num_pages, PS), 256, max_running, chunk, enable_prefix_cache=cache, watermark_pages=watermark)


def req(prompt_len: int, max_new: int = 20, first: int = 0) -> Request:
    return Request(list(range(first, first + prompt_len)), SamplingParams(max_new_tokens=max_new))


def step(sched: Scheduler):
    """One planned step as the engine runs it: each entry's tokens computed, and a token
    appended where the request reached its end (the sampled one)."""
    plan = sched.schedule()
    if plan is None:
        return None
    for r, n in plan.entries:
        assert len(r.pages) * PS >= r.num_computed + n, "a planned entry has pages for its tokens"
        r.num_computed += n
        if r.num_computed == r.total_len:
            r.output_ids.append(1000 + len(r.output_ids))
    return plan


def test_admission_takes_the_prompts_pages_not_the_whole_budget():
    sched = make(num_pages=21)  # 20 usable pages; each budget (10 + 60 tokens) needs 18: one at a time
    reqs = [req(10, max_new=60) for _ in range(6)]
    for r in reqs:
        sched.add(r)
    step(sched)
    assert [r.status for r in reqs] == [RequestStatus.RUNNING] * 6, "6 prompts of 3 pages fit in 20 pages"
    assert all(len(r.pages) == 3 for r in reqs)
    assert sched.pool.num_free == 2


def test_the_watermark_holds_pages_back_from_admission_but_not_from_an_idle_pool():
    sched = make(num_pages=11, watermark=3)  # 10 usable
    a, b, c = req(24, max_new=8), req(4, max_new=8), req(4, max_new=8)  # a: 6 pages; b, c: 1 page each
    for r in (a, b, c):
        sched.add(r)
    sched.schedule()
    # a alone takes 6 of 10 pages (no watermark when nothing runs); b leaves 3 free: admitted;
    # c would leave 2 < 3: waits
    assert (a.status, b.status, c.status) == (RequestStatus.RUNNING, RequestStatus.RUNNING, RequestStatus.WAITING)
    assert list(sched.waiting) == [c]


def test_decode_grows_pages_and_preempts_the_newest_when_the_pool_runs_short():
    sched = make(num_pages=7)  # 6 usable pages
    a, b, c = req(4), req(4), req(4)
    for r in (a, b, c):
        sched.add(r)
    plan = step(sched)
    assert plan.mode is ForwardMode.EXTEND and [len(r.pages) for r in (a, b, c)] == [1, 1, 1]
    plan = step(sched)  # every request has 5 tokens now: each needs a second page
    assert plan.mode is ForwardMode.DECODE and [len(r.pages) for r in (a, b, c)] == [2, 2, 2]
    for _ in range(3):  # tokens 6..8 fit in the second pages
        assert step(sched).mode is ForwardMode.DECODE
    assert sched.stats.preemptions == 0 and sched.pool.num_free == 0
    plan = step(sched)  # 9 tokens: a needs a third page; c (the newest) is preempted for it, then b
    # takes c's freed pages
    assert [r for r, _ in plan.entries] == [a, b]
    assert sched.stats.preemptions == 1 and c.num_preemptions == 1
    assert c.status is RequestStatus.WAITING and list(sched.waiting) == [c] and c.pages == [] and c.num_computed == 0
    assert c.output_ids == [1000, 1001, 1002, 1003, 1004], "a preempted request keeps its output"
    assert [len(r.pages) for r in (a, b)] == [3, 3]


def test_preempting_the_request_that_needs_the_page_when_it_is_the_newest():
    sched = make(num_pages=4)  # 3 usable pages
    a, b = req(6, max_new=6), req(4, max_new=8)  # a: 2 pages, b: 1
    sched.add(a)
    sched.add(b)
    step(sched)  # both prefilled: a has 7 tokens (2 pages), b 5 tokens: needs a second page
    plan = step(sched)  # a fits; b (newest) is preempted to give itself a page: nothing left to take
    assert [r for r, _ in plan.entries] == [a] and b.status is RequestStatus.WAITING
    assert sched.stats.preemptions == 1


def test_a_preempted_request_is_recomputed_with_its_output_reusing_its_cached_pages():
    sched = make(num_pages=17, cache=True)
    r = req(7)
    sched.add(r)
    for _ in range(3):  # prefill, two decodes: 9 tokens computed, 10 known
        step(sched)
    pages, out = list(r.pages), list(r.output_ids)
    sched.preempt(r)
    assert (r.status, r.pages, r.num_computed, list(sched.waiting)) == (RequestStatus.WAITING, [], 0, [r])
    assert sched.pool.num_used == 0 and sched.pool.num_cached_idle == 2, "its two full pages stay cached"
    plan = sched.schedule()
    # re-admitted: the two cached pages (prompt and its first output token) come back, and one
    # prefill recomputes the rest, up to the last output token, whose successor it samples
    assert r.status is RequestStatus.RUNNING and r.pages[:2] == pages[:2] and r.num_computed == 2 * PS
    assert plan.mode is ForwardMode.EXTEND and plan.entries == [(r, r.total_len - 2 * PS)]
    assert r.output_ids == out and r.num_cached_tokens == 0, "hits on its own pages are not prompt-cache hits"
    assert sched.stats.preemptions == 1 and sched.stats.cached_tokens == 0


def test_prefill_chunks_alternate_with_decode_steps():
    sched = make(num_pages=64, chunk=8)
    streams = [req(4), req(4)]
    for r in streams:
        sched.add(r)
    step(sched)
    long = req(40)
    sched.add(long)
    modes = []
    while long.in_prefill:
        modes.append(step(sched).mode)
    # 40 tokens in 5 chunks of 8, a decode step of the streams before each
    assert modes == [ForwardMode.DECODE, ForwardMode.EXTEND] * 5
    assert all(len(r.output_ids) == 1 + 5 for r in streams), "streams decoded between the long prompt's chunks"


def test_a_request_whose_whole_budget_exceeds_the_pool_is_refused_at_once():
    sched = make(num_pages=11)  # 10 usable pages = 40 tokens
    with pytest.raises(RequestTooLongError, match="needs 11 KV pages but the cache holds 10"):
        sched.add(req(4, max_new=40))
    sched.add(req(4, max_new=36))  # exactly the pool: accepted
    assert len(sched.waiting) == 1


def test_the_watermark_setting_is_a_share_of_the_pool():
    from breakgraph.engine.config import EngineConfig

    for bad in (-0.1, 1.0):
        with pytest.raises(ValueError, match="--kv-watermark must be in"):
            EngineConfig(kv_watermark=bad)
    assert EngineConfig().kv_watermark == 0.01
