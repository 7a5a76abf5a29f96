"""Prefix reuse: refcounted pages, LRU eviction of idle cached pages, and requests that reuse a
cached prefix compute fewer tokens yet produce the same tokens and log-probabilities."""

from __future__ import annotations

import pytest
import torch

from breakgraph import Engine, SamplingParams
from breakgraph.engine.kv_cache import OutOfPagesError, PagePool
from breakgraph.engine.prefix_cache import PrefixCache
from breakgraph.engine.request import Request

pytestmark = pytest.mark.usefixtures("one_intra_op_thread")


def random_ids(n: int, seed: int, vocab: int = 2048) -> list[int]:
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def test_pool_refcounts_and_keeps_cached_pages_idle_until_evicted():
    pool = PagePool(num_pages=5, page_size=4)  # 4 usable pages
    evicted = []
    pool.on_evict = evicted.append
    a = pool.alloc(2)
    pool.mark_cached(a[0])
    pool.retain([a[0]])  # shared by a second holder
    pool.free(a)
    assert pool.refcount(a[0]) == 1 and pool.num_used == 1
    pool.free([a[0]])
    assert pool.num_used == 0 and pool.num_cached_idle == 1 and pool.num_free == 4
    pool.retain([a[0]])  # reuse an idle cached page
    assert pool.num_cached_idle == 0 and pool.num_used == 1
    pool.free([a[0]])
    b = pool.alloc(4)  # only 3 free pages: the idle one is evicted
    assert evicted == [a[0]] and a[0] in b
    with pytest.raises(OutOfPagesError):
        pool.alloc(1)
    pool.free(b)
    assert pool.num_free == 4 and pool.num_cached_idle == 0, "an evicted page is no longer cached"
    with pytest.raises(ValueError, match="is free"):
        pool.retain(b[:1])


def test_match_reuses_full_pages_but_always_leaves_a_token_to_compute():
    pool = PagePool(num_pages=16, page_size=4)
    cache = PrefixCache(pool)
    ids = random_ids(12, seed=0)
    first = Request(ids, SamplingParams())
    first.pages = pool.alloc(4)
    first.num_computed = 12
    cache.commit(first)
    assert len(cache) == 3
    # exactly the same prompt: 3 full pages cached, but only 2 may be reused (12 - 1 tokens)
    assert cache.match(Request(list(ids), SamplingParams())) == first.pages[:2]
    # a longer prompt sharing 9 tokens reuses the 2 pages that are fully inside the prefix
    other = Request(ids[:9] + random_ids(7, seed=1), SamplingParams())
    assert cache.match(other) == first.pages[:2]
    # a different first page means no reuse at all, even if later pages match
    assert cache.match(Request([ids[0] + 1] + ids[1:] + [5], SamplingParams())) == []
    pool.free(first.pages[::-1])
    assert pool.num_used == 0 and pool.num_cached_idle == 3
    cache.clear()
    assert pool.num_cached_idle == 0 and pool.num_free == 15


@pytest.fixture(scope="module")
def glm():
    """The default tiny model. Its index_topk is 32, so with prompt + output under 32 tokens
    the sparse attention selects every causal key: results do not hinge on top-k near-ties
    (which random weights have, and which batch composition can flip)."""
    from breakgraph.demo.default_model import default_model_path

    return default_model_path()


GREEDY = SamplingParams(max_new_tokens=6, ignore_eos=True)


def run(engine: Engine, prompt: list[int], params: SamplingParams = GREEDY) -> Request:
    req = engine.add_request(prompt, params)
    while not req.finished:
        engine.step()
    return req


def test_second_request_with_same_prefix_computes_fewer_tokens_same_output(glm):
    engine = Engine(glm, device="cpu", dtype="float32", page_size=4)
    shared = random_ids(17, seed=2)
    first = run(engine, shared + random_ids(6, seed=3))
    before = engine.scheduler.stats.prefill_tokens
    prompt = shared + random_ids(5, seed=4)
    second = run(engine, prompt)
    assert second.num_cached_tokens == 16, "the 4 full pages of the shared 17 tokens are reused"
    assert engine.scheduler.stats.prefill_tokens - before == len(prompt) - 16
    assert first.output_ids  # the first request did run

    fresh = Engine(glm, device="cpu", dtype="float32", page_size=4)
    fresh.scheduler.set_prefix_caching(False)
    ref = run(fresh, prompt)
    assert ref.num_cached_tokens == 0
    assert second.output_ids == ref.output_ids
    assert torch.allclose(torch.tensor(second.output_logprobs), torch.tensor(ref.output_logprobs), atol=1e-4)
    assert engine.kv_cache.pool.num_used == 0, "only idle cached pages remain"
    assert engine.kv_cache.pool.num_cached_idle > 0


def test_prompt_logits_with_a_cached_prefix_equal_fresh_ones(glm):
    engine = Engine(glm, device="cpu", dtype="float32", page_size=4)
    ids = random_ids(22, seed=5)
    fresh = engine.prompt_logits([ids])[0]
    run(engine, ids)  # caches the prompt's pages
    again = engine.prompt_logits([ids])[0]  # asks for every position: must not reuse the prefix
    assert again.shape == fresh.shape
    assert torch.allclose(again, fresh, atol=1e-5)


def test_chunked_prefill_of_the_uncached_rest_equals_unchunked(glm):
    prompts = [random_ids(10, seed=6) + random_ids(n, seed=7 + n) for n in (9, 14)]
    whole = Engine(glm, device="cpu", dtype="float32", page_size=4)
    chunked = Engine(glm, device="cpu", dtype="float32", page_size=4, chunked_prefill_size=5)
    for engine in (whole, chunked):
        run(engine, prompts[0][:10] + [1, 2, 3])
    for a, b in zip(whole.generate(prompts, GREEDY), chunked.generate(prompts, GREEDY)):
        assert a.token_ids == b.token_ids
        assert torch.allclose(torch.tensor(a.logprobs), torch.tensor(b.logprobs), atol=1e-4)
    assert chunked.scheduler.stats.cached_tokens == whole.scheduler.stats.cached_tokens > 0


def test_idle_cached_pages_are_evicted_when_the_pool_runs_short(glm):
    # 10 usable pages of 4 tokens; each request needs 5 (12 prompt + 6 new tokens).
    engine = Engine(glm, device="cpu", dtype="float32", page_size=4, num_pages=11)
    prompts = [random_ids(12, seed=20 + i) for i in range(6)]
    outs = [run(engine, p) for p in prompts]
    pool = engine.kv_cache.pool
    assert pool.num_used == 0 and pool.num_cached_idle <= pool.capacity_pages
    assert len(engine.scheduler.prefix_cache) == pool.num_cached_idle
    together = engine.generate(prompts, GREEDY)  # two at a time, evicting as it goes
    assert [o.token_ids for o in together] == [r.output_ids for r in outs]
    assert pool.num_used == 0
