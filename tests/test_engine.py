"""The engine's batched paths compute what a lone, full forward computes."""

from __future__ import annotations

import pytest
import torch

from breakgraph import Engine, SamplingParams
from breakgraph.engine.kv_cache import OutOfPagesError, PagePool
from breakgraph.engine.model_runner import BatchEntry
from breakgraph.engine.scheduler import RequestTooLongError
from breakgraph.forward_context import ForwardMode

TOL = 1e-4


def close(a: torch.Tensor, b: torch.Tensor) -> None:
    assert (a - b).abs().max().item() <= TOL * b.abs().max().item()


@pytest.fixture(scope="module")
def glm(hf_checkpoints):
    return hf_checkpoints["glm_moe_dsa"]


def random_prompts(lengths, seed=0, vocab=128):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=g).tolist() for n in lengths]


@pytest.mark.parametrize("model_type", ["glm_moe_dsa", "deepseek_v32"])
def test_ragged_batch_equals_each_request_alone(model_type, hf_checkpoints):
    engine = Engine(hf_checkpoints[model_type], device="cpu", dtype="float32", page_size=4)
    prompts = random_prompts([37, 5, 20, 41])
    together = engine.prompt_logits(prompts)
    for ids, batched in zip(prompts, together):
        close(batched, engine.prompt_logits([ids])[0])
    assert engine.kv_cache.pool.num_used == 0, "finished requests must return their pages"


def test_chunked_prefill_equals_unchunked(glm):
    prompts = random_prompts([45, 30], seed=1)
    whole = Engine(glm, device="cpu", dtype="float32", page_size=4).prompt_logits(prompts)
    chunked = Engine(glm, device="cpu", dtype="float32", page_size=4, chunked_prefill_size=7).prompt_logits(prompts)
    for a, b in zip(chunked, whole):
        close(a, b)


def test_prefix_cached_extend_equals_fresh_prefill(glm):
    engine = Engine(glm, device="cpu", dtype="float32", page_size=4)
    ids = random_prompts([40], seed=2)[0]
    pool, runner = engine.kv_cache.pool, engine.runner
    pages = pool.alloc(pool.pages_for(len(ids)))
    runner.forward(runner.make_batch([BatchEntry(ids[:23], 0, pages)], ForwardMode.EXTEND), all_logits=True)
    extended = runner.forward(runner.make_batch([BatchEntry(ids[23:], 23, pages)], ForwardMode.EXTEND), all_logits=True)
    pool.free(pages)
    fresh = engine.prompt_logits([ids])[0]
    close(extended, fresh[23:])


@pytest.mark.parametrize("model_type", ["glm_moe_dsa", "deepseek_v32"])
def test_prefill_then_decode_equals_full_forward(model_type, hf_checkpoints):
    engine = Engine(hf_checkpoints[model_type], device="cpu", dtype="float32", page_size=4)
    prompts = random_prompts([30, 12], seed=3)
    outs = engine.generate(prompts, SamplingParams(max_new_tokens=8, ignore_eos=True))
    for ids, out in zip(prompts, outs):
        assert len(out.token_ids) == 8 and out.finish_reason == "length"
        full = engine.prompt_logits([ids + out.token_ids])[0]
        predicted = full[len(ids) - 1 : -1]
        assert predicted.argmax(-1).tolist() == out.token_ids
        logprobs = torch.log_softmax(predicted, -1).gather(1, torch.tensor(out.token_ids)[:, None])[:, 0]
        assert torch.allclose(logprobs, torch.tensor(out.logprobs), atol=1e-4)


def test_more_requests_than_pages_wait_and_all_finish(glm):
    # 9 pages of 4 tokens: each request needs 4 pages, so at most two run at once.
    engine = Engine(glm, device="cpu", dtype="float32", page_size=4, num_pages=9)
    prompts = random_prompts([10] * 5, seed=4)
    outs = engine.generate(prompts, SamplingParams(max_new_tokens=6, ignore_eos=True))
    alone = [engine.generate([p], SamplingParams(max_new_tokens=6, ignore_eos=True))[0] for p in prompts]
    assert [o.token_ids for o in outs] == [a.token_ids for a in alone]
    assert engine.kv_cache.pool.num_used == 0


def test_request_that_can_never_fit_is_refused(glm):
    engine = Engine(glm, device="cpu", dtype="float32", page_size=4, num_pages=5, context_length=64)
    with pytest.raises(RequestTooLongError, match="KV pages"):
        engine.add_request(list(range(10)), SamplingParams(max_new_tokens=20))
    with pytest.raises(RequestTooLongError, match="context length"):
        engine.add_request(list(range(64)), SamplingParams(max_new_tokens=1))
    with pytest.raises(ValueError, match="outside the vocabulary"):
        engine.add_request([5, 100000])


def test_page_pool_is_all_or_nothing():
    pool = PagePool(num_pages=5, page_size=4)
    a = pool.alloc(3)
    assert 0 not in a, "page 0 is reserved for padding"
    with pytest.raises(OutOfPagesError, match="need 2 KV pages, only 1"):
        pool.alloc(2)
    assert pool.num_free == 1
    pool.free(a)
    with pytest.raises(ValueError, match="double free"):
        pool.free(a[:1])


def test_sampling_seed_topk_and_stop(glm):
    engine = Engine(glm, device="cpu", dtype="float32", page_size=4)
    prompt = random_prompts([12], seed=5)[0]
    sampled = SamplingParams(max_new_tokens=10, temperature=1.0, top_p=0.9, seed=7, ignore_eos=True)
    a = engine.generate([prompt], sampled)[0].token_ids
    b = engine.generate([prompt], sampled)[0].token_ids
    assert a == b, "same seed, same tokens"
    c = engine.generate([prompt], SamplingParams(max_new_tokens=10, temperature=1.0, seed=8, ignore_eos=True))[0]
    greedy = engine.generate([prompt], SamplingParams(max_new_tokens=10, ignore_eos=True))[0].token_ids
    top1 = engine.generate([prompt], SamplingParams(max_new_tokens=10, temperature=0.7, top_k=1, ignore_eos=True))[0]
    assert top1.token_ids == greedy
    assert c.token_ids != greedy or a != greedy, "sampling at temperature 1 should differ from greedy somewhere"
    stop_at = greedy[3]
    stopped = engine.generate([prompt], SamplingParams(max_new_tokens=10, stop_token_ids=[stop_at]))[0]
    assert stopped.finish_reason == "stop" and stopped.token_ids == greedy[: greedy.index(stop_at)]


def test_stop_string_cuts_text(tmp_path):
    engine = Engine(None, device="cpu", dtype="float32")  # default model has a tokenizer
    prompt = "Question: 3 plus 4?\nAnswer:"
    free = engine.generate([prompt], SamplingParams(max_new_tokens=12, ignore_eos=True))[0]
    assert len(free.text) > 4
    stop = free.text[2:4]
    cut = engine.generate([prompt], SamplingParams(max_new_tokens=12, stop=[stop], ignore_eos=True))[0]
    assert cut.finish_reason == "stop" and cut.text == free.text[: free.text.find(stop)]


def test_startup_log_names_each_part(glm, caplog):
    """The runner logs how long start-up took and which part took it, graph captures included."""
    with caplog.at_level("INFO", logger="breakgraph.engine.model_runner"):
        engine = Engine(glm, device="cpu", dtype="float32", page_size=4, cuda_graph_backend_prefill="breakable",
                        cuda_graph_bs_prefill=[8, 16], cuda_graph_max_bs=2)  # fmt: skip
    parts = engine.runner.startup_s
    assert list(parts) == ["load", "prefill graphs", "decode graphs"]  # no FP8 tuning off CUDA
    assert all(seconds >= 0 for seconds in parts.values()) and parts["prefill graphs"] > 0
    ready = [r.getMessage() for r in caplog.records if r.getMessage().startswith("ready in")]
    assert len(ready) == 1 and "prefill graphs" in ready[0] and "load" in ready[0]
