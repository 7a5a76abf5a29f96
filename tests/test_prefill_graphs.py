"""Prefill under breakable and piecewise graphs (CPU graph backend) computes what eager does."""

from __future__ import annotations

import contextlib
import logging

import pytest
import torch

from breakgraph import Engine, SamplingParams
from breakgraph.engine.model_runner import BatchEntry
from breakgraph.forward_context import ForwardMode, forward_batch_context
from breakgraph.graphs.decode_runner import default_decode_buckets
from breakgraph.graphs.jit_guard import CompileInCapture
from breakgraph.graphs.prefill_runner import PrefillGraphRunner, default_prefill_buckets
from breakgraph.layers.dsa import dsa_indexer_graph_dispatch, sparse_mla_attention
from breakgraph.layers.linear import LinearBase

BUCKETS = [16, 64]


def ragged_batches(seed: int = 0) -> list[list[list[int]]]:
    g = torch.Generator().manual_seed(seed)
    shapes = [(37, 5, 20), (64,), (9, 7), (40, 3)]  # two batches share bucket 64, one bucket 16
    return [[torch.randint(0, 128, (n,), generator=g).tolist() for n in shape] for shape in shapes]


@pytest.fixture(scope="module", params=["glm_moe_dsa", "deepseek_v32"])
def engines(request, hf_checkpoints):
    folder = hf_checkpoints[request.param]
    common = dict(device="cpu", dtype="float32", page_size=4, cuda_graph_bs_prefill=BUCKETS)
    return {
        "disabled": Engine(folder, device="cpu", dtype="float32", page_size=4),
        "breakable": Engine(folder, cuda_graph_backend_prefill="breakable", **common),
        "piecewise": Engine(folder, cuda_graph_backend_prefill="piecewise", **common),
    }


def test_graph_backends_equal_eager_logits_and_tokens(engines):
    for batch in ragged_batches():
        ref = engines["disabled"].prompt_logits(batch)
        for name in ("breakable", "piecewise"):
            got = engines[name].prompt_logits(batch)
            for a, b in zip(got, ref):
                assert torch.allclose(a, b, atol=1e-5, rtol=1e-5), f"{name} differs from eager"
    params = SamplingParams(max_new_tokens=6, ignore_eos=True)
    prompts = ragged_batches(seed=1)[0]
    want = [c.token_ids for c in engines["disabled"].generate(prompts, params)]
    for name in ("breakable", "piecewise"):
        assert [c.token_ids for c in engines[name].generate(prompts, params)] == want, name
        stats = engines[name].graph_stats()
        assert stats["replays"] >= len(ragged_batches()) + 1, "graphs were selected but prefill ran eagerly"
        assert stats["captured_buckets"] == BUCKETS
    assert engines["piecewise"].graph_stats()["traces"] == 1, "one symbolic-length trace serves both buckets"


def test_breakable_capture_counts(engines):
    stats = engines["breakable"].graph_stats()
    cfg = engines["breakable"].config
    n_indexers = sum(cfg.has_indexer(i) for i in range(cfg.num_hidden_layers))
    expected_breaks = cfg.num_hidden_layers + n_indexers  # one attention break per layer + indexers
    assert stats["breaks"][64] == expected_breaks
    # drop_empty: the code between an indexer break and its attention break holds no kernel
    # (only the output allocation), so that segment is dropped.
    assert stats["segments"][64] == expected_breaks + 1 - n_indexers


def test_fallbacks_are_counted_with_their_reason(engines):
    engine = engines["breakable"]
    before = dict(engine.graph_stats()["fallbacks"])
    g = torch.Generator().manual_seed(3)
    engine.prompt_logits([torch.randint(0, 128, (5,), generator=g).tolist()])  # 5 tokens → bucket 16 > 2×5
    engine.prompt_logits([torch.randint(0, 128, (60,), generator=g).tolist()] * 2)  # 120 tokens > 64
    after = engine.graph_stats()["fallbacks"]
    assert after.get("padding_over_limit", 0) == before.get("padding_over_limit", 0) + 1
    # chunks are capped at the largest bucket, so 120 tokens run as two replayed chunks
    assert after.get("tokens_above_largest_bucket", 0) == before.get("tokens_above_largest_bucket", 0)
    assert engine.scheduler.chunked_prefill_size == BUCKETS[-1]


def test_breaks_zero_padded_rows(hf_checkpoints):
    """Rows past the batch's real tokens leave a break as zeros / -1 (garbage must not reach MoE),
    in a batch longer than ``index_topk`` (a shorter one's indexer writes no rows)."""
    engine = Engine(hf_checkpoints["glm_moe_dsa"], device="cpu", dtype="float32", page_size=4)
    cfg, runner = engine.config, engine.runner
    n, padded = cfg.index_topk + 3, cfg.index_topk + 6
    pages = engine.kv_cache.pool.alloc(-(-n // 4))
    batch = runner.make_batch([BatchEntry(list(range(n)), 0, pages)], ForwardMode.EXTEND)
    heads, latent = cfg.num_attention_heads, cfg.latent_dim
    with forward_batch_context(batch):
        topk = torch.full((padded, cfg.index_topk), 7, dtype=torch.int32)
        q = torch.randn(padded, cfg.index_n_heads, cfg.index_head_dim)
        dsa_indexer_graph_dispatch(q, torch.randn(padded, cfg.index_head_dim), torch.rand(padded, cfg.index_n_heads), topk, 0, 0.1)
        out = torch.full((padded, heads, cfg.kv_lora_rank), float("nan"))
        sparse_mla_attention(torch.randn(padded, heads, latent), torch.randn(padded, latent), topk, out, 0, 0.1)
    assert (topk[n:] == -1).all() and (topk[:n, 0] >= 0).all()
    assert (out[n:] == 0).all() and torch.isfinite(out[:n]).all()


def test_default_bucket_ladder_is_coarse_with_bounded_padding():
    b = default_prefill_buckets(4096)
    assert b == [4, 8, 16, 32, 64, 128, 256, 384, 512, 768, 1024, 1280, 1536, 1792, 2048, 2560, 3072, 3584, 4096]
    assert default_prefill_buckets(8192)[-5:] == [4096, 5120, 6144, 7168, 8192]
    assert default_prefill_buckets(100)[-2:] == [64, 100] and default_prefill_buckets(3000)[-2:] == [2560, 3000]
    # the padding the help text states: < 2x (so never an eager fallback) from 3 tokens,
    # <= 50% from 257 to 1024 tokens, <= 25% above
    for n in range(3, 4097):
        bucket = next(x for x in b if x >= n)
        assert bucket < 2 * n or n < 3
        if n > 256:
            assert bucket <= (1.25 if n > 1024 else 1.5) * n, n


def test_fine_ladder_is_the_former_one():
    b = default_prefill_buckets(8192, "fine")
    assert b[:8] == [4, 8, 12, 16, 20, 24, 28, 32]
    assert {48, 256, 288, 512, 576, 1024, 1280, 4096, 4608, 8192} <= set(b)
    assert b == sorted(set(b)) and b[-1] == 8192 and len(default_prefill_buckets(4096, "fine")) == 50
    with pytest.raises(ValueError, match="--cuda-graph-ladder"):
        default_prefill_buckets(64, "finest")


def test_decode_ladders():
    assert default_decode_buckets(64) == [1, 2, 4, 8, 16, 32, 48, 64]
    assert default_decode_buckets(64, "fine") == [1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64]
    assert default_decode_buckets(20) == [1, 2, 4, 8, 16, 20] and default_decode_buckets(3) == [1, 2, 3]


def test_one_warmup_for_the_ladder_unless_asked_for_every(hf_checkpoints):
    """Default: only the largest bucket runs eagerly before its capture (the logits still equal
    eager's: test_graph_backends_equal_eager_logits_and_tokens); ``every`` warms up each."""
    folder = hf_checkpoints["glm_moe_dsa"]
    common = dict(device="cpu", dtype="float32", page_size=4, cuda_graph_bs_prefill=[8, 16, 64])
    once = Engine(folder, cuda_graph_backend_prefill="breakable", **common)
    assert once.graph_stats()["warmups"] == {8: 0, 16: 0, 64: 1}
    every = Engine(folder, cuda_graph_backend_prefill="breakable", cuda_graph_warmup="every", **common)
    assert every.graph_stats()["warmups"] == {8: 2, 16: 2, 64: 2}  # each bucket has a graph for sequences ≤ 8 too
    batch = ragged_batches(seed=4)[0]
    for a, b in zip(once.prompt_logits(batch), every.prompt_logits(batch)):
        assert torch.equal(a, b)


def test_a_capture_that_would_compile_is_warmed_up_and_captured_again():
    """A kernel compile met inside a capture (CompileInCapture, raised by the Triton guard on
    CUDA) aborts that capture; the bucket is warmed up, captured again and replays correctly."""
    torch.manual_seed(0)
    table = torch.randn(32, 8)
    state = {"raise_for": {16}}

    def body(ids: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        n = ids.shape[0]
        h = table[ids] * 2 + pos[:, None].float()
        if n in state["raise_for"]:
            state["raise_for"].discard(n)
            raise CompileInCapture("fake_kernel")
        return h.relu()

    runner = PrefillGraphRunner(body, backend="breakable", device=torch.device("cpu"), buckets=[8, 16, 64],
                                capture_context=lambda n: contextlib.nullcontext())  # fmt: skip
    runner.capture(progress=False)
    assert {b.tokens: b.warmups for b in runner.stats.buckets} == {8: 0, 16: 1, 64: 1}
    ids, pos = torch.randint(0, 32, (13,)), torch.arange(13)
    with torch.inference_mode():  # as the model runner replays
        got = runner.run(ids, pos)
    assert torch.equal(got, body(ids, pos)) and runner.stats.replays == 1


@pytest.mark.parametrize("model_type", ["glm_moe_dsa", "deepseek_v32"])
def test_full_decode_graphs_equal_eager(model_type, hf_checkpoints):
    folder = hf_checkpoints[model_type]
    prompts = ragged_batches(seed=2)[0]
    params = [SamplingParams(max_new_tokens=n, ignore_eos=True) for n in (3, 5, 8)]
    common = dict(device="cpu", dtype="float32", page_size=4, context_length=96)
    want = Engine(folder, **common).generate(prompts, params)
    engine = Engine(folder, cuda_graph_backend_decode="full", cuda_graph_max_bs=2, **common)
    got = engine.generate(prompts, params)  # 3 running > 2: fall back until one finishes
    assert [c.token_ids for c in got] == [c.token_ids for c in want]
    decode = engine.graph_stats()["decode"]
    assert decode["batch_sizes"] == [1, 2]
    assert decode["warmups"] == {1: 0, 2: 1}, "one warm-up, at the largest batch size"
    assert decode["replays"] > 0 and decode["fallbacks"].get("batch_above_largest_bucket", 0) > 0


def test_decode_graphs_per_length_bound_equal_eager(hf_checkpoints, monkeypatch):
    """With a length bound below the context (the model's ``host_length_bounds``), each batch size
    has a graph for sequences up to the bound and one for the full page table; a batch replays the
    smaller graph its longest sequence fits, and every step equals eager."""
    from breakgraph.models.glm5 import DsaForCausalLM

    folder = hf_checkpoints["glm_moe_dsa"]
    g = torch.Generator().manual_seed(4)
    prompts = [torch.randint(0, 128, (n,), generator=g).tolist() for n in (10, 20, 30)]
    params = SamplingParams(max_new_tokens=8, ignore_eos=True)
    common = dict(device="cpu", dtype="float32", page_size=4, context_length=96)
    want = Engine(folder, **common).generate(prompts, params)
    monkeypatch.setattr(DsaForCausalLM, "host_length_bounds", lambda self: (24, 500))  # 500: past the context
    engine = Engine(folder, cuda_graph_backend_decode="full", cuda_graph_max_bs=4, **common)
    graphs = engine.runner.decode_graphs
    assert graphs.length_bounds == [24, 96] and set(graphs._graphs) == {(b, n) for b in graphs.buckets for n in (24, 96)}
    got = engine.generate(prompts, params)
    assert [c.token_ids for c in got] == [c.token_ids for c in want]
    assert graphs.bound_replays[96] > 0 and graphs.bound_replays[24] == 0, "30-token prompts: every batch is long"
    short = engine.generate(prompts[:1], params)  # 10 + 8 tokens: the short graphs
    assert short[0].token_ids == want[0].token_ids and graphs.bound_replays[24] > 0


def test_prefill_graphs_up_to_index_topk_skip_the_indexer_queries(hf_checkpoints, monkeypatch):
    """Each breakable bucket gets a second graph, captured on a stand-in that promises sequences
    no longer than ``index_topk`` (requests that short): its segments compute no indexer queries
    (``q_b`` alone, the indexer's rotary step on the key alone), while the graphs for any batch,
    captured on a stand-in that states the context length, do. Batches of short prompts replay
    the short graphs (one bucket longer than the bound), a later chunk of a long prompt (a short
    chunk after a long prefix) the graph for any batch; every logit equals eager."""
    from breakgraph.forward_context import get_forward_batch
    from breakgraph.layers import attention

    folder = hf_checkpoints["glm_moe_dsa"]
    common = dict(device="cpu", dtype="float32", page_size=4, context_length=96)
    eager = Engine(folder, **common)
    seen = []

    def spy(q, *args, **kwargs):
        seen.append((get_forward_batch().length_bound, q is not None))
        return real(q, *args, **kwargs)

    real = attention.indexer_rope_qk
    monkeypatch.setattr(attention, "indexer_rope_qk", spy)
    engine = Engine(folder, cuda_graph_backend_prefill="breakable", cuda_graph_bs_prefill=[4, 8, 16], **common)
    k, graphs = engine.config.index_topk, engine.runner.prefill_graphs
    assert k == 8 and set(graphs._graphs) == {(n, bound) for n in (4, 8, 16) for bound in (None, k)}
    assert engine.graph_stats()["bounded_buckets"] == {k: [4, 8, 16]}
    # the short graphs hold no indexer breaks: with the keys stored by the rotary kernel there is
    # nothing left for them to do
    cfg = engine.config
    layers, indexers = cfg.num_hidden_layers, sum(cfg.has_indexer(i) for i in range(cfg.num_hidden_layers))
    assert graphs._graphs[(16, None)].stats.breaks == layers + indexers and graphs._graphs[(16, k)].stats.breaks == layers
    assert {(bound, has_q) for bound, has_q in seen if bound is not None} == {(k, False), (96, True)}
    g = torch.Generator().manual_seed(12)
    short = [torch.randint(0, 128, (n,), generator=g).tolist() for n in (5, 3)]  # bucket 8, sequences ≤ 8
    many = [torch.randint(0, 128, (n,), generator=g).tolist() for n in (6, 8, 1)]  # bucket 16, sequences ≤ 8
    long = [torch.randint(0, 128, (18,), generator=g).tolist()]  # chunks of 16 and 2 (bucket 4 after 16 tokens)
    for batch, bound in ((short, k), (many, k), (long, None)):
        before = graphs.bound_replays[bound]
        for a, b in zip(engine.prompt_logits(batch), eager.prompt_logits(batch)):
            torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
        assert graphs.bound_replays[bound] > before
    assert graphs.bound_replays[None] == 2 and graphs.stats.fallbacks == {}
    monkeypatch.setenv("BREAKGRAPH_PREFILL_LENGTH_BOUNDS", "0")  # one graph per bucket
    plain = Engine(folder, cuda_graph_backend_prefill="breakable", cuda_graph_bs_prefill=[4, 8, 16], **common)
    assert set(plain.runner.prefill_graphs._graphs) == {(4, None), (8, None), (16, None)}
    assert plain.graph_stats()["bounded_buckets"] == {}


def test_buckets_longer_than_a_short_context_capture_and_replay_like_eager(hf_checkpoints):
    """A context no longer than ``index_topk``: every batch selects every causal key, so every
    graph skips the indexer's queries — and a bucket longer than the context is captured on
    requests no longer than it (one long stand-in sequence would need the scores it skipped)."""
    folder = hf_checkpoints["glm_moe_dsa"]
    common = dict(device="cpu", dtype="float32", page_size=4, context_length=8)
    engine = Engine(folder, cuda_graph_backend_prefill="breakable", cuda_graph_bs_prefill=[4, 8, 16], **common)
    assert engine.graph_stats()["captured_buckets"] == [4, 8, 16] and engine.graph_stats()["bounded_buckets"] == {}
    g = torch.Generator().manual_seed(14)
    batch = [torch.randint(0, 128, (n,), generator=g).tolist() for n in (7, 6, 2)]  # 15 tokens: bucket 16
    for a, b in zip(engine.prompt_logits(batch), Engine(folder, **common).prompt_logits(batch)):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
    assert engine.graph_stats()["replays"] == 1


def test_a_short_prefill_in_a_padded_bucket_leaves_other_requests_cache_rows(hf_checkpoints):
    """Prefill graphs write the new cache rows from the slots loaded before each replay: a
    10-token batch replayed in the 16-token bucket after a 16-token one writes its padding rows
    to the reserved page 0, not to the earlier batch's slots (which the static buffer held)."""
    engine = Engine(hf_checkpoints["glm_moe_dsa"], device="cpu", dtype="float32", page_size=4,
                    cuda_graph_backend_prefill="breakable", cuda_graph_bs_prefill=[16, 64])  # fmt: skip
    runner, pool, cache = engine.runner, engine.kv_cache.pool, engine.kv_cache
    g = torch.Generator().manual_seed(6)
    first_pages, second_pages = pool.alloc(4), pool.alloc(3)
    first = runner.make_batch([BatchEntry(torch.randint(0, 128, (16,), generator=g).tolist(), 0, first_pages)], ForwardMode.EXTEND)
    runner.forward(first)
    rows = first.out_cache_loc
    kept = [c[rows].clone() for c in (*cache.latent, *cache.indexer_k) if c is not None]
    second = runner.make_batch([BatchEntry(torch.randint(0, 128, (10,), generator=g).tolist(), 0, second_pages)], ForwardMode.EXTEND)
    replays = engine.graph_stats()["replays"]
    runner.forward(second)
    assert engine.graph_stats()["replays"] == replays + 1  # the 16-token bucket, 6 rows of padding
    now = [c[rows] for c in (*cache.latent, *cache.indexer_k) if c is not None]
    assert all(torch.equal(a, b) for a, b in zip(kept, now))
    pool.free(first_pages + second_pages)


def test_decode_graphs_up_to_index_topk_skip_the_indexer_scores(hf_checkpoints, monkeypatch):
    """The model's length bounds start at ``index_topk``: each batch size has a decode graph for
    sequences that short, captured without the indexer's queries, head weights and scores (the
    top-k is every causal key; the merged ``q_b ‖ wq_b`` linear computes ``q_b`` alone), which a
    short batch replays with eager's tokens; the longer graphs compute them."""
    from breakgraph.forward_context import get_forward_batch
    from breakgraph.layers import attention, dsa

    folder = hf_checkpoints["glm_moe_dsa"]
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(0, 128, (n,), generator=g).tolist() for n in (2, 3, 4)]
    params = SamplingParams(max_new_tokens=4, ignore_eos=True)  # at most 8 tokens: index_topk
    common = dict(device="cpu", dtype="float32", page_size=4, context_length=96)
    want = Engine(folder, **common).generate(prompts, params)
    seen = {"weights": [], "scores": [], "queries": [], "q_b alone": []}

    def spy(name, real, counts=lambda *args: True):
        def call(*args, **kwargs):
            fb = get_forward_batch()
            if counts(*args):
                seen[name].append((fb.mode, fb.max_seq_len))
            return real(*args, **kwargs)

        return call

    monkeypatch.setattr(attention, "logits_head_gate", spy("weights", attention.logits_head_gate))
    monkeypatch.setattr(dsa, "indexer_topk", spy("scores", dsa.indexer_topk))
    monkeypatch.setattr(attention, "indexer_rope_qk", spy("queries", attention.indexer_rope_qk, lambda q, *a: q is not None))
    first = spy("q_b alone", LinearBase.forward_first)
    monkeypatch.setattr(LinearBase, "forward_first", lambda self, *a, **kw: first(self, *a, **kw))
    engine = Engine(folder, cuda_graph_backend_decode="full", cuda_graph_max_bs=4, **common)
    k, graphs = engine.config.index_topk, engine.runner.decode_graphs
    assert graphs.length_bounds == [k, 96]
    for name in ("weights", "scores", "queries"):
        decode = [n for mode, n in seen[name] if mode is ForwardMode.DECODE]
        assert decode and min(decode) > k, f"the short decode graphs computed the indexer's {name}"
    assert seen["q_b alone"] and all(mode is ForwardMode.DECODE and n <= k for mode, n in seen["q_b alone"])
    got = engine.generate(prompts, params)
    assert [c.token_ids for c in got] == [c.token_ids for c in want]
    assert graphs.bound_replays[k] > 0


def test_chunked_prefill_under_graphs_equals_eager(engines):
    """Prompts longer than the largest bucket are prefilled in bucket-sized chunks, each
    attending to the chunks before it through the paged cache."""
    g = torch.Generator().manual_seed(9)
    prompts = [torch.randint(0, 128, (n,), generator=g).tolist() for n in (150, 70)]
    ref = engines["disabled"].prompt_logits(prompts)
    for name in ("breakable", "piecewise"):
        before = engines[name].graph_stats()["replays"]
        for a, b in zip(engines[name].prompt_logits(prompts), ref):
            assert torch.allclose(a, b, atol=1e-5, rtol=1e-5), name
        assert engines[name].graph_stats()["replays"] - before >= 3, "220 tokens take at least 3 replayed chunks of 64"


def test_a_failed_capture_without_warmup_captures_every_bucket_again_warmed(caplog):
    """Should a capture without a warm-up fail (on CUDA: something initialised lazily that the
    Triton guard cannot see), the whole ladder is captured again with a warm-up each."""
    table = torch.randn(32, 8)
    calls = {"n16": 0}

    def body(ids: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        if ids.shape[0] == 16:
            calls["n16"] += 1
            if calls["n16"] == 1:
                raise RuntimeError("operation not permitted when stream is capturing")
        return (table[ids] + pos[:, None].float()).relu()

    runner = PrefillGraphRunner(body, backend="breakable", device=torch.device("cpu"), buckets=[16, 64],
                                capture_context=lambda n: contextlib.nullcontext())  # fmt: skip
    with caplog.at_level(logging.WARNING, logger="breakgraph.graphs.prefill_runner"):
        runner.capture(progress=False)
    assert {b.tokens: b.warmups for b in runner.stats.buckets} == {16: 1, 64: 1}
    assert any("prefill bucket 16, captured without a warm-up, failed" in r.getMessage() for r in caplog.records)
    ids, pos = torch.randint(0, 32, (9,)), torch.arange(9)
    with torch.inference_mode():
        assert torch.equal(runner.run(ids, pos), body(ids, pos))


def test_prepare_gets_every_bucket_once_before_the_first_capture():
    """``prepare`` (the model runner's compile-ahead dry run) is called once, before any
    capture, with one thunk per bucket, largest first, each running the body on that bucket's
    static inputs inside its capture context; warm-ups do not call it again."""
    table = torch.randn(32, 8)
    calls, seen, contexts = [], [], []

    def body(ids: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        seen.append(ids.shape[0])
        return (table[ids] * 3 - pos[:, None].float()).tanh()

    @contextlib.contextmanager
    def capture_context(n):
        contexts.append(n)
        yield

    built = {}

    def prepare(*thunks):
        assert not built["runner"]._graphs, "prepare runs before the first capture"
        seen.clear(), contexts.clear()
        calls.append([thunk().shape[0] for thunk in thunks])  # each thunk runs the body at its bucket
        assert seen == contexts == [64, 16, 8]

    for warmup in ("once", "every"):
        calls.clear()
        runner = PrefillGraphRunner(body, backend="breakable", device=torch.device("cpu"), buckets=[8, 16, 64],
                                    capture_context=capture_context, prepare=prepare, warmup=warmup)  # fmt: skip
        built["runner"] = runner
        runner.capture(progress=False)
        assert calls == [[64, 16, 8]], (warmup, calls)
        ids, pos = torch.randint(0, 32, (11,)), torch.arange(11)
        with torch.inference_mode():
            assert torch.equal(runner.run(ids, pos), body(ids, pos))


def test_decode_prepare_gets_every_graph_once_before_the_first_capture(hf_checkpoints, monkeypatch):
    """The decode runner hands ``prepare`` one thunk per (batch size, length bound), largest
    first, before any capture; each runs the model on that graph's static batch (a decode batch
    of its rows), and the graphs captured after it still equal eager."""
    from breakgraph.engine import model_runner
    from breakgraph.forward_context import get_forward_batch
    from breakgraph.models.glm5 import DsaForCausalLM

    folder = hf_checkpoints["glm_moe_dsa"]
    calls = []

    def prepare(*thunks):
        calls.append([thunk().shape[0] for thunk in thunks])  # hidden rows: the graph's batch size

    monkeypatch.setattr(model_runner.ModelRunner, "_prepare", property(lambda self: prepare))  # no prefill graphs here
    monkeypatch.setattr(DsaForCausalLM, "host_length_bounds", lambda self: (24, 500))
    common = dict(device="cpu", dtype="float32", page_size=4, context_length=96)
    engine = Engine(folder, cuda_graph_backend_decode="full", cuda_graph_max_bs=4, **common)
    assert calls == [[4, 4, 2, 2, 1, 1]], calls  # (4, 96), (4, 24), (2, 96), ...
    with pytest.raises(RuntimeError):
        get_forward_batch()  # the thunks leave no batch installed
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(0, 128, (n,), generator=g).tolist() for n in (10, 30)]
    params = SamplingParams(max_new_tokens=6, ignore_eos=True)
    want = Engine(folder, **common).generate(prompts, params)
    assert [c.token_ids for c in engine.generate(prompts, params)] == [c.token_ids for c in want]
