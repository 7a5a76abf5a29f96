"""The DSA/MLA prefill surface: each piece does what it is there for."""

from __future__ import annotations

import pytest
import torch

from breakgraph import Engine
from breakgraph.engine.model_runner import BatchEntry
from breakgraph.engine.sampling import SamplingParams
from breakgraph.forward_context import ForwardMode, forward_batch_context
from breakgraph.graphs import split_op_names
from breakgraph.kernels.dense_mha import mha_form_pays
from breakgraph.layers import dsa


@pytest.fixture(scope="module")
def engine(hf_checkpoints):
    return Engine(hf_checkpoints["glm_moe_dsa"], device="cpu", dtype="float32", page_size=4)


def indexer_inputs(engine, n_tokens: int, rows: int, seed: int = 0):
    cfg = engine.config
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(rows, cfg.index_n_heads, cfg.index_head_dim, generator=g)
    k = torch.randn(rows, cfg.index_head_dim, generator=g)
    w = torch.rand(rows, cfg.index_n_heads, generator=g)
    pages = engine.kv_cache.pool.alloc(engine.kv_cache.pool.pages_for(n_tokens))
    batch = engine.runner.make_batch([BatchEntry(list(range(n_tokens)), 0, pages)], ForwardMode.EXTEND)
    return q, k, w, batch, pages


def test_both_split_ops_are_registered():
    names = split_op_names()
    for name in ("dsa_indexer_graph_dispatch", "mla_bmm_then_unified_attention", "sparse_mla_attention", "prefill_mla_attention"):
        assert f"breakgraph::{name}" in names


def test_the_indexer_dispatch_is_one_break_under_breakable_capture(engine):
    """``bcg_dsa_indexer_graph_dispatch`` (and the dispatch itself, outside torch.compile) ends the
    graph segment and runs eagerly: one recorded eager call, which replays on new inputs."""
    from breakgraph.graphs import BreakableGraph

    cfg = engine.config
    n = 2 * cfg.index_topk  # longer than index_topk: the indexer scores
    q, k, w, batch, pages = indexer_inputs(engine, n, n)
    for fn in (dsa.bcg_dsa_indexer_graph_dispatch, dsa.dsa_indexer_graph_dispatch):
        out = torch.empty(n, cfg.index_topk, dtype=torch.int32)
        g = BreakableGraph("cpu")
        with forward_batch_context(batch):
            with g.capture():
                fn(q, k, w, out, 0, 0.1)
            assert g.stats.eager_calls == 1 and "dsa_indexer_graph_dispatch" in g.describe()
            q.copy_(torch.randn_like(q))
            g.replay()
            want = torch.empty_like(out)
            dsa.dsa_indexer_graph_dispatch.eager(q, k, w, want, 0, 0.1)
        assert torch.equal(out, want)
    engine.kv_cache.pool.free(pages)


def test_short_sequences_are_not_scored_and_the_attention_makes_their_causal_rows(engine, monkeypatch):
    """When every sequence is at most ``index_topk`` long the indexer split op scores nothing
    and writes no rows (``weights`` may be None); the attention, told ``causal_rows``, reads
    what the scores would have selected (every causal key) without reading ``topk_pos``."""
    from breakgraph.kernels.sparse_mla import sparse_mla_attention as attend

    cfg = engine.config
    q, k, w, batch, pages = indexer_inputs(engine, cfg.index_topk, cfg.index_topk)
    scored = torch.empty(cfg.index_topk, cfg.index_topk, dtype=torch.int32)
    with forward_batch_context(batch):
        monkeypatch.setattr(dsa, "_should_skip_logits_computation", lambda fb, k: False)
        dsa.dsa_indexer_graph_dispatch(q, k, w, scored, 0, 0.1)
        with pytest.raises(ValueError, match="head weights are needed"):
            dsa.dsa_indexer_graph_dispatch(q, k, None, scored.clone(), 0, 0.1)
        monkeypatch.undo()

        def no_scores(*args, **kwargs):
            raise AssertionError("scores computed although every sequence fits in index_topk")

        monkeypatch.setattr(dsa, "indexer_topk", no_scores)
        untouched = torch.full_like(scored, 7)
        dsa.dsa_indexer_graph_dispatch(q, k, None, untouched, 0, 0.1)
        assert (untouched == 7).all()
    as_sets = lambda t: [sorted(x for x in row.tolist() if x >= 0) for row in t]  # noqa: E731
    assert as_sets(scored) == [list(range(p + 1)) for p in batch.positions.tolist()]
    g = torch.Generator().manual_seed(1)
    t, heads, dim, rank = cfg.index_topk, cfg.num_attention_heads, cfg.latent_dim, cfg.kv_lora_rank
    cache = engine.kv_cache.latent[0]
    cache.copy_(torch.randn(cache.shape, generator=g))
    ql = torch.randn(t, heads, dim, generator=g)
    outs = [torch.full((t, heads, rank), float("nan")) for _ in range(2)]
    common = (cache, batch.page_table, batch.token_req, engine.kv_cache.page_size, 0.1)
    attend(ql, common[0], scored, *common[1:], outs[0], positions=batch.positions)
    attend(ql, common[0], untouched, *common[1:], outs[1], positions=batch.positions, causal_rows=True)
    engine.kv_cache.pool.free(pages)
    torch.testing.assert_close(outs[1], outs[0])
    with pytest.raises(ValueError, match="causal_rows needs the token positions"):
        attend(ql, common[0], untouched, *common[1:], outs[1], causal_rows=True)


def test_long_sequences_are_scored(engine):
    cfg = engine.config
    n = 4 * cfg.index_topk
    q, k, w, batch, pages = indexer_inputs(engine, n, n)
    with forward_batch_context(batch):
        assert not dsa._should_skip_logits_computation(batch, cfg.index_topk)
    engine.kv_cache.pool.free(pages)


def test_attention_asks_for_the_dense_causal_path_in_prefill_only(engine, monkeypatch):
    """Prefill/extend passes ``dense_below = K`` (its short-position rows are dense causal);
    a decode batch passes 0, so the kernel keeps split-K for it."""
    monkeypatch.setenv("BREAKGRAPH_DENSE_MHA", "0")  # the absorbed form: its kernel call is what is checked
    seen: list[tuple[str, int]] = []
    real = dsa.sparse_mla_kernel

    def spy(*args, dense_below, **kw):
        from breakgraph.forward_context import get_forward_batch

        seen.append((get_forward_batch().mode.value, dense_below))
        return real(*args, dense_below=dense_below, **kw)

    monkeypatch.setattr(dsa, "sparse_mla_kernel", spy)
    engine.generate([[1, 2, 3, 4, 5]], SamplingParams(max_new_tokens=2))
    k = engine.config.index_topk
    assert ("extend", k) in seen and ("decode", 0) in seen
    assert {mode for mode, below in seen if below == 0} == {"decode"}


def test_attention_tells_the_kernel_the_token_counts_only_when_every_position_is_below_k(engine, monkeypatch):
    """An extend batch whose sequences all end at or before K passes each request's token count
    (the kernel may then skip its sparse launch); a longer sequence in the batch, or a decode
    batch, passes None. Any batch whose sequences all end at or before K, decode too, asks for
    causal rows (the indexer wrote none); any other does not."""
    monkeypatch.setenv("BREAKGRAPH_DENSE_MHA", "0")  # the absorbed form: its kernel call is what is checked
    seen: list[tuple[str, list[int] | None, bool, int]] = []
    real = dsa.sparse_mla_kernel

    def spy(*args, request_tokens, causal_rows, **kw):
        from breakgraph.forward_context import get_forward_batch

        fb = get_forward_batch()
        seen.append((fb.mode.value, request_tokens, causal_rows, fb.max_seq_len))
        return real(*args, request_tokens=request_tokens, causal_rows=causal_rows, **kw)

    monkeypatch.setattr(dsa, "sparse_mla_kernel", spy)
    k = engine.config.index_topk
    short = [[31, 32, 33, 34, 35], list(range(41, 41 + k))]  # new tokens (no cached prefix); the second ends at K
    engine.generate(short, SamplingParams(max_new_tokens=2))
    assert ("extend", [5, k], True, k) in seen and {n for mode, n, _, _ in seen if mode == "decode"} == {None}
    engine.generate([[1, 2, 3]], SamplingParams(max_new_tokens=3))  # decode steps over 4 and 5 tokens
    seen_rows = {(mode, causal) for mode, _, causal, _ in seen}
    assert seen_rows == {("extend", True), ("decode", True), ("decode", False)}
    assert all(causal == (longest <= k) for _, _, causal, longest in seen)
    seen.clear()
    engine.generate([[1, 2, 3], list(range(1, k + 2))], SamplingParams(max_new_tokens=1))
    assert [n for mode, n, _, _ in seen if mode == "extend"] and all(n is None and not c for _, n, c, _ in seen)


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8_e4m3"])
def test_short_prefills_attend_in_mha_form_where_it_pays(hf_checkpoints, monkeypatch, kv_cache_dtype):
    """A prefill whose sequences all stay within ``index_topk`` runs its attention in MHA form
    where that takes fewer FLOPs (fresh prompts; at the tiny dims no chunk on a cached prefix
    pays, so those keep the absorbed form), and decode in the absorbed form; every logit equals
    the absorbed form's (``BREAKGRAPH_DENSE_MHA=0``), also when the MHA form is forced (``=1``,
    chunks on prefixes included), with the plain and the FP8 latent cache."""
    folder = hf_checkpoints["glm_moe_dsa"]
    kw = dict(device="cpu", dtype="float32", page_size=4, kv_cache_dtype=kv_cache_dtype, chunked_prefill_size=4)
    engine = Engine(folder, **kw)
    k = engine.config.index_topk
    cfg = engine.config
    dims = dict(rank=cfg.kv_lora_rank, dn=cfg.qk_nope_head_dim, dr=cfg.qk_rope_head_dim, dv=cfg.v_head_dim)
    calls: list[tuple[str, str, tuple[int, ...], bool]] = []
    real_mha, real_sparse = dsa.dense_causal_mha, dsa.sparse_mla_kernel

    def record(form):
        def spy(*args, **kw):
            from breakgraph.forward_context import get_forward_batch

            fb = get_forward_batch()
            pairs = sum(e * p + e * (e + 1) // 2 for p, e in zip(fb.prefix_lens_cpu, fb.extend_lens_cpu))
            pays = mha_form_pays(fb.num_tokens, sum(fb.seq_lens_cpu), pairs, **dims)
            calls.append((form, fb.mode.value, tuple(fb.prefix_lens_cpu), pays))
            assert fb.max_seq_len <= k or form == "absorbed"
            return (real_mha if form == "mha" else real_sparse)(*args, **kw)

        return spy

    monkeypatch.setattr(dsa, "dense_causal_mha", record("mha"))
    monkeypatch.setattr(dsa, "sparse_mla_kernel", record("absorbed"))
    g = torch.Generator().manual_seed(21)
    prompts = [torch.randint(0, 128, (n,), generator=g).tolist() for n in (3, 7, 6)]  # 7 and 6: chunks of 4 + 3, 4 + 2
    got = engine.prompt_logits(prompts)
    extend = [(form, prefix, pays) for form, mode, prefix, pays in calls if mode == "extend"]
    assert ("mha", (0, 0), True) in extend and any(any(p) for _, p, _ in extend), extend  # fresh, and on prefixes
    assert all((form == "mha") == pays for form, _, pays in extend), extend  # (the tiny dims: prefixes never pay)
    monkeypatch.setenv("BREAKGRAPH_DENSE_MHA", "0")
    absorbed = Engine(folder, **kw)
    calls.clear()
    want = absorbed.prompt_logits(prompts)
    assert calls and {form for form, *_ in calls} == {"absorbed"}
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, atol=2e-5, rtol=2e-5)
    monkeypatch.setenv("BREAKGRAPH_DENSE_MHA", "1")
    calls.clear()
    for a, b in zip(Engine(folder, **kw).prompt_logits(prompts), want):
        torch.testing.assert_close(a, b, atol=2e-5, rtol=2e-5)
    assert {form for form, mode, *_ in calls if mode == "extend"} == {"mha"} and any(any(c[2]) for c in calls)
    monkeypatch.setenv("BREAKGRAPH_DENSE_MHA", "auto")
    calls.clear()
    engine.generate([prompts[0]], SamplingParams(max_new_tokens=3))  # decode: the absorbed form
    assert {form for form, mode, *_ in calls if mode == "decode"} == {"absorbed"}


def test_the_mha_form_is_chosen_by_flops_and_kept_for_the_whole_forward(engine, monkeypatch):
    """The rows layout is built once per batch and every layer reuses it (one FLOP decision a
    forward, not one a layer): one new token on a cached prefix keeps the absorbed form, a
    fresh prompt takes the MHA form with its new rows as keys (the FP8 cache: read back from
    the new tokens' own slots), a chunk on a prefix (MHA form forced: at the tiny dims a prefix
    never pays) gathers each request's keys in order, with ``key_rows`` at the tokens' own
    keys; a request longer than ``index_topk`` hands only its tokens below it to the MHA form
    (``rows``), with keys up to them; ``=0`` keeps the absorbed form even where it would pay."""
    cfg = engine.config
    k = cfg.index_topk
    dims = (k, cfg.kv_lora_rank, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim)
    decisions = []
    real = dsa.mha_form_pays
    monkeypatch.setattr(dsa, "mha_form_pays", lambda *a: decisions.append(a) or real(*a))
    engine.prompt_logits([[1, 2, 3, 4, 5]])
    assert len(decisions) == 1 and cfg.num_hidden_layers > 1  # one forward, every layer
    pool = engine.kv_cache.pool
    pages = [pool.alloc(2), pool.alloc(2), pool.alloc(pool.pages_for(k + 4))]
    fresh = engine.runner.make_batch([BatchEntry(list(range(5)), 0, pages[0])], ForwardMode.EXTEND)
    layout = dsa.mha_rows_layout(fresh, *dims, keys_from_cache=False)
    assert layout.pays and layout.every_token and layout.rows == slice(0, 5)
    assert layout.slots is None and layout.key_rows is None
    assert dsa.mha_rows_layout(fresh, *dims, keys_from_cache=False) is layout
    page = engine.kv_cache.page_size
    slots = lambda p, n: [int(p[i // page]) * page + i % page for i in range(n)]  # noqa: E731
    fp8 = dsa.mha_rows_layout(fresh, *dims, keys_from_cache=True)
    assert fp8.pays and fp8.slots.tolist() == slots(pages[0], 5) and fp8.key_rows is None and fp8.rows == slice(0, 5)
    one = engine.runner.make_batch([BatchEntry([5], 6, pages[0])], ForwardMode.EXTEND)
    assert not dsa.mha_rows_layout(one, *dims, keys_from_cache=False).pays
    monkeypatch.setenv("BREAKGRAPH_DENSE_MHA", "1")  # at the tiny dims neither a prefix nor a long request pays
    long = engine.runner.make_batch(
        [BatchEntry(list(range(3)), 0, pages[0]), BatchEntry(list(range(k + 4)), 0, pages[2])], ForwardMode.EXTEND
    )
    mixed = dsa.mha_rows_layout(long, *dims, keys_from_cache=False)
    assert mixed.pays and not mixed.every_token
    assert mixed.rows == slice(0, 3 + k)  # 3 short tokens, then the long one's first k: the keys are their rows
    assert mixed.slots is None and mixed.key_rows is None
    assert dsa.mha_rows_layout(long, *dims, keys_from_cache=True).slots.tolist() == slots(pages[0], 3) + slots(pages[2], k)
    apart = engine.runner.make_batch(
        [BatchEntry(list(range(k + 4)), 0, pages[2]), BatchEntry(list(range(3)), 0, pages[0])], ForwardMode.EXTEND
    )
    layout = dsa.mha_rows_layout(apart, *dims, keys_from_cache=False)
    assert layout.rows.tolist() == [*range(k), k + 4, k + 5, k + 6] and layout.slots is None
    past = engine.runner.make_batch([BatchEntry(list(range(3)), k, pages[2])], ForwardMode.EXTEND)
    assert not dsa.mha_rows_layout(past, *dims, keys_from_cache=True).pays  # no token below index_topk: not even forced
    both = engine.runner.make_batch(
        [BatchEntry(list(range(4)), 2, pages[0]), BatchEntry(list(range(3)), 0, pages[1])], ForwardMode.EXTEND
    )
    layout = dsa.mha_rows_layout(both, *dims, keys_from_cache=False)
    assert layout.pays and layout.rows == slice(0, 7) and layout.slots.tolist() == slots(pages[0], 6) + slots(pages[1], 3)
    assert layout.key_rows.tolist() == [2, 3, 4, 5, 6, 7, 8]  # 4 new tokens at positions 2..5, then 3 at 0..2
    crossing = engine.runner.make_batch([BatchEntry(list(range(6)), k - 2, pages[2])], ForwardMode.EXTEND)
    layout = dsa.mha_rows_layout(crossing, *dims, keys_from_cache=False)
    assert layout.rows == slice(0, 2) and layout.slots.tolist() == slots(pages[2], k)
    assert layout.key_rows.tolist() == [k - 2, k - 1]
    monkeypatch.setenv("BREAKGRAPH_DENSE_MHA", "0")
    again = engine.runner.make_batch([BatchEntry(list(range(5)), 0, pages[0])], ForwardMode.EXTEND)
    assert not dsa.mha_rows_layout(again, *dims, keys_from_cache=False).pays
    for p in pages:
        pool.free(p)


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8_e4m3", "bfloat16"])
def test_long_prefills_attend_in_mha_form_below_index_topk(hf_checkpoints, monkeypatch, kv_cache_dtype):
    """Prompts longer than ``index_topk``: their tokens below it attend in MHA form (the rows the
    layout names), the rest in the absorbed form over the indexer's rows, and every prompt logit
    equals the absorbed form's everywhere (``BREAKGRAPH_DENSE_MHA=0``) — prompts prefilled at
    once and in chunks (a chunk's prefix crossing ``index_topk`` too), with a cache of the
    activations' dtype, an FP8 cache and a bf16 cache under fp32 activations (the keys then read
    back from the cache, rounded as the absorbed form reads them)."""
    folder = hf_checkpoints["glm_moe_dsa"]
    kw = dict(device="cpu", dtype="float32", page_size=4, kv_cache_dtype=kv_cache_dtype)
    k = Engine(folder, **kw).config.index_topk
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(0, 128, (n,), generator=g).tolist() for n in (3 * k + 1, 5, 2 * k)]
    mha_tokens: list[int] = []
    real_mha = dsa.dense_causal_mha

    def spy(q_nope, *args):
        mha_tokens.append(q_nope.shape[0])
        return real_mha(q_nope, *args)

    monkeypatch.setattr(dsa, "dense_causal_mha", spy)
    results = {}
    for mode in ("0", "1"):
        monkeypatch.setenv("BREAKGRAPH_DENSE_MHA", mode)
        for chunk in (None, k + 3):
            engine = Engine(folder, **kw, **({"chunked_prefill_size": chunk} if chunk else {}))
            mha_tokens.clear()
            results[mode, chunk] = engine.prompt_logits(prompts)
            if mode == "0":
                assert not mha_tokens
            else:  # every layer: the tokens below k of the batch's requests
                assert mha_tokens and max(mha_tokens) <= 3 * k and min(mha_tokens) > 0
    want = results["0", None]
    for key, got in results.items():
        for a, b in zip(got, want):
            torch.testing.assert_close(a, b, atol=5e-5, rtol=5e-5, msg=str(key))


def test_indexer_queries_and_head_weights_must_have_the_same_rows(engine):
    q, k, w, batch, pages = indexer_inputs(engine, 5, 8)
    with forward_batch_context(batch), pytest.raises(ValueError, match="queries .8 rows. and head weights .7 rows"):
        dsa.dsa_indexer_graph_dispatch(q, k, w[:7], torch.empty(8, engine.config.index_topk, dtype=torch.int32), 0, 0.1)
    engine.kv_cache.pool.free(pages)


def test_logits_head_gate_is_a_custom_op_with_a_fake_impl():
    from torch._subclasses.fake_tensor import FakeTensorMode

    x, weight = torch.randn(5, 16), torch.randn(4, 16)
    assert torch.allclose(torch.ops.breakgraph.logits_head_gate(x, weight, 0.5), (x @ weight.T) * 0.5, atol=1e-6)
    mode = FakeTensorMode()
    fake_x, fake_w = mode.from_tensor(x.bfloat16()), mode.from_tensor(weight)
    with mode:
        out = dsa.logits_head_gate(fake_x, fake_w, 0.5)
    assert out.shape == (5, 4) and out.dtype == torch.float32


def test_breakable_capture_fuses_the_q_nope_bmm_into_the_attention_op(hf_checkpoints, monkeypatch):
    import breakgraph.layers.attention as attention

    folder = hf_checkpoints["glm_moe_dsa"]
    common = dict(device="cpu", dtype="float32", page_size=4, cuda_graph_backend_prefill="breakable",
                  cuda_graph_bs_prefill=[32])  # fmt: skip

    def segment_kernels(eng):
        return sum(eng.runner.prefill_graphs._graphs[(32, None)].stats.kernels_per_segment)

    monkeypatch.setenv("BREAKGRAPH_DENSE_MHA", "0")  # the absorbed form's ops (else one op takes the whole attention)
    fused = Engine(folder, **common)
    with monkeypatch.context() as m:
        m.setattr(attention, "_can_fuse_bmm_into_attention", lambda w_kc: False)
        unfused = Engine(folder, **common)
    layers = fused.config.num_hidden_layers
    # The q_nope BMM (and the cat that assembled the latent query) left the graph segments.
    assert segment_kernels(unfused) - segment_kernels(fused) >= layers
    assert fused.graph_stats()["islands"][32] == 0
    ids = [torch.arange(3, 33).tolist()]
    eager = Engine(folder, device="cpu", dtype="float32", page_size=4).prompt_logits(ids)[0]
    for eng in (fused, unfused):
        assert torch.allclose(eng.prompt_logits(ids)[0], eager, atol=1e-5)


def test_rotary_cache_store_only_into_a_plain_cache_of_the_rows_dtype(engine):
    """The rotary kernels store a batch's new rows (decode, prefill and extend batches alike:
    graphs capture on static slots) only into a cache of the rows' dtype that is not the FP8
    one; everywhere else (an FP8 or other-dtype cache, a forward traced by torch.compile) the
    split ops store them."""
    from types import SimpleNamespace

    latent = engine.kv_cache.latent[0]
    fp8 = torch.zeros(latent.shape[0], 656, dtype=torch.uint8)
    slots = torch.arange(3)
    cache = SimpleNamespace(latent=[latent, fp8], indexer_k=[engine.kv_cache.indexer_k[0]])

    def target(mode, name, layer, dtype=torch.float32):
        with forward_batch_context(SimpleNamespace(mode=mode, kv_cache=cache, out_cache_loc=slots)):
            return dsa.rotary_cache_store(name, layer, dtype)

    for name in ("latent", "indexer_k"):
        for mode in ForwardMode:
            store = target(mode, name, 0)
            assert store is not None and store[0] is getattr(cache, name)[0] and store[1] is slots
        assert target(ForwardMode.DECODE, name, 0, torch.bfloat16) is None  # another dtype than the cache's
    assert target(ForwardMode.EXTEND, "latent", 1) is None  # the FP8 latent cache
    traced = torch.compile(lambda x: x + (dsa.rotary_cache_store("latent", 0, x.dtype) is None), fullgraph=True, backend="eager")
    with forward_batch_context(SimpleNamespace(mode=ForwardMode.DECODE, kv_cache=cache, out_cache_loc=slots)):
        assert traced(torch.zeros(2)).tolist() == [1.0, 1.0]
