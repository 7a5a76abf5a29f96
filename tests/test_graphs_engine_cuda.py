"""Real CUDA graphs in the engine (run with ``pytest -m cuda`` on a GPU machine)."""

from __future__ import annotations

import warnings

import pytest
import torch

from breakgraph import Engine, SamplingParams
from breakgraph.bench.presets import preset_folder

pytestmark = pytest.mark.cuda


def prompts(lengths, vocab, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=g).tolist() for n in lengths]


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm()).item()


@pytest.mark.parametrize("model_type", ["glm_moe_dsa", "deepseek_v32"])
def test_bf16_tiny_models_graph_backends_equal_eager(model_type, hf_checkpoints):
    folder = hf_checkpoints[model_type]
    common = dict(device="cuda", dtype="bfloat16", page_size=4, num_pages=256, cuda_graph_backend_decode="disabled")
    ref = Engine(folder, cuda_graph_backend_prefill="disabled", **common)
    batches = [prompts(n, 128, s) for s, n in enumerate([(37, 5, 20), (64,), (9, 7)])]
    for backend in ("breakable", "piecewise"):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            eng = Engine(folder, cuda_graph_backend_prefill=backend, cuda_graph_bs_prefill=[16, 64], **common)
        assert not [w for w in caught if "empty" in str(w.message).lower()], "an empty CUDA graph was captured"
        for batch in batches:
            for a, b in zip(eng.prompt_logits(batch), ref.prompt_logits(batch)):
                assert rel_err(a, b) < 1e-2, backend
        assert eng.graph_stats()["replays"] == len(batches)


def test_decode_graphs_and_breakable_prefill_generate_like_eager(hf_checkpoints):
    folder = hf_checkpoints["glm_moe_dsa"]
    batch = prompts((30, 12, 7), 128, seed=5)
    params = SamplingParams(max_new_tokens=8, ignore_eos=True)
    common = dict(device="cuda", dtype="float32", page_size=4, num_pages=256, context_length=128)
    want = Engine(folder, cuda_graph_backend_prefill="disabled", cuda_graph_backend_decode="disabled", **common)
    got = Engine(folder, cuda_graph_backend_prefill="breakable", cuda_graph_bs_prefill=[16, 64],
                 cuda_graph_backend_decode="full", cuda_graph_max_bs=4, **common)  # fmt: skip
    assert [c.token_ids for c in got.generate(batch, params)] == [c.token_ids for c in want.generate(batch, params)]
    stats = got.graph_stats()
    assert stats["replays"] > 0 and stats["decode"]["replays"] > 0


def test_short_sequence_in_long_context_pool_replays_the_short_decode_graph(hf_checkpoints, tmp_path):
    """A page table wider than the top-k select's split threshold (a 20480-token context): the
    decode graphs of each batch size come at the threshold and at the full width. A batch of
    short sequences replays the short graph (the one-program select), a batch holding a sequence
    past the threshold the full one (the split select over its 17K keys); both equal eager."""
    import json
    import shutil

    from breakgraph.kernels.dispatch import SPLIT_SELECT_MIN_KEYS

    folder = tmp_path / "long"
    shutil.copytree(hf_checkpoints["glm_moe_dsa"], folder)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "max_position_embeddings": 32768}))
    long_batch = prompts((SPLIT_SELECT_MIN_KEYS + 700, 40), 128, seed=8)
    short_batch = prompts((50, 9), 128, seed=9)
    params = SamplingParams(max_new_tokens=6, ignore_eos=True)
    common = dict(device="cuda", dtype="float32", page_size=64, num_pages=400, context_length=20480)
    want = Engine(folder, cuda_graph_backend_prefill="disabled", cuda_graph_backend_decode="disabled", **common)
    got = Engine(folder, cuda_graph_backend_prefill="disabled", cuda_graph_backend_decode="full", cuda_graph_max_bs=2, **common)  # fmt: skip
    graphs = got.runner.decode_graphs
    assert graphs.length_bounds == [got.config.index_topk, SPLIT_SELECT_MIN_KEYS, 20480]
    for batch in (short_batch, long_batch):
        assert [c.token_ids for c in got.generate(batch, params)] == [c.token_ids for c in want.generate(batch, params)]
    assert graphs.bound_replays[SPLIT_SELECT_MIN_KEYS] >= 5 and graphs.bound_replays[20480] >= 5


def test_mid_size_model_graph_backends_agree(tmp_path, monkeypatch):
    """GLM-5 per-rank dims, 4 layers, bf16, dummy weights: breakable and piecewise match eager.
    Every sequence is within ``index_topk``, so eager and the breakable graphs attend in MHA form;
    a piece traced by torch.compile replays any batch and keeps the absorbed form, so piecewise
    is held against eager in that form (``BREAKGRAPH_DENSE_MHA=0``): the two forms round
    differently, and through the MoE routing of 4 layers that reached 3.7% (H100)."""
    folder = preset_folder("glm5-tp8-rank-4l-bf16", tmp_path)
    eng = Engine(folder, device="cuda", load_format="dummy", page_size=64, num_pages=80, context_length=2048,
                 cuda_graph_backend_prefill="disabled", cuda_graph_backend_decode="disabled")  # fmt: skip
    batch = prompts((700, 300), eng.config.vocab_size, seed=7)
    for backend in ("breakable", "piecewise"):
        monkeypatch.setenv("BREAKGRAPH_DENSE_MHA", "auto" if backend == "breakable" else "0")
        ref = eng.prompt_logits(batch)
        eng.set_prefill_backend(backend, [512, 1024])
        got = eng.prompt_logits(batch)
        assert eng.graph_stats()["replays"] == 1
        for a, b in zip(got, ref):
            assert rel_err(a, b) < 2e-2, backend
        eng.set_prefill_backend("disabled")


def test_regional_torch_compile_matches_eager(tmp_path):
    """The torch-compile backend (Inductor, CUDA graphs partitioned at the split ops,
    eager's rounding) on GLM-5 per-rank FP8 dims, 3 dense + 1 MoE layer. One request of 1024
    tokens and two of 512 share every shape: were the attention or the indexer frozen into a
    CUDA graph, the second layout would replay the first one's per-request lengths."""
    import json

    from breakgraph.bench import prefill
    from breakgraph.bench.presets import GLM5_TP8_RANK, _variant
    from breakgraph.forward_context import forward_batch_context
    from breakgraph.graphs.regional import compiled_regions

    (tmp_path / "config.json").write_text(json.dumps(_variant(GLM5_TP8_RANK, num_hidden_layers=4)))
    eng = Engine(tmp_path, device="cuda", load_format="dummy", page_size=64, num_pages=40, context_length=1100,
                 chunked_prefill_size=1024, cuda_graph_backend_prefill="disabled", cuda_graph_backend_decode="disabled")  # fmt: skip

    def hidden(fn, n: int, b: int) -> torch.Tensor:
        batch, pages = prefill.make_batch(eng, n, b)
        with torch.inference_mode(), forward_batch_context(batch):
            out = fn(batch.input_ids, batch.positions).float()
        eng.kv_cache.pool.free(pages)
        return out

    layouts = [(128, 1), (1024, 1), (512, 2)]
    want = [hidden(eng.model, n, b) for n, b in layouts]
    with compiled_regions(eng.model, mode="reduce-overhead") as forward:
        for _ in range(3):  # warm-up, CUDA graph recording, replay
            got = [hidden(forward, n, b) for n, b in layouts]
    errors = [rel_err(a, b) for a, b in zip(got, want)]
    print("regional torch-compile vs eager, rel err:", errors)
    assert max(errors) < 1e-3, errors


def test_pdl_decode_graphs_and_prefill_equal_plain_launches(tmp_path, monkeypatch):
    """GLM-5 per-rank FP8 dims, 3 dense + 1 MoE layer, dummy weights: with programmatic
    dependent launch (``BREAKGRAPH_PDL=1``) the breakable prefill and the decode graphs give the
    same prompt logits, bit for bit, and the same greedy tokens as plain launches. A kernel that
    read its input before the wait would race the kernel before it and differ."""
    import json

    from breakgraph.bench.presets import GLM5_TP8_RANK, _variant
    from breakgraph.kernels.pdl import pdl_enabled

    (tmp_path / "config.json").write_text(json.dumps(_variant(GLM5_TP8_RANK, num_hidden_layers=4)))
    batch = prompts((300, 40, 7), 1000, seed=11)
    params = SamplingParams(max_new_tokens=12, ignore_eos=True)
    results = {}
    for pdl in ("0", "1"):
        monkeypatch.setenv("BREAKGRAPH_PDL", pdl)
        assert pdl_enabled(torch.device("cuda")) == (pdl == "1")
        eng = Engine(tmp_path, device="cuda", load_format="dummy", page_size=64, num_pages=40, context_length=1024,
                     cuda_graph_backend_prefill="breakable", cuda_graph_bs_prefill=[64, 512],
                     cuda_graph_backend_decode="full", cuda_graph_max_bs=4)  # fmt: skip
        logits = eng.prompt_logits(batch)
        tokens = [c.token_ids for c in eng.generate(batch, params)]
        assert eng.graph_stats()["decode"]["replays"] > 0
        results[pdl] = (logits, tokens)
        del eng
        torch.cuda.empty_cache()
    (l0, t0), (l1, t1) = results["0"], results["1"]
    assert t1 == t0
    for a, b in zip(l1, l0):
        assert torch.equal(a, b)


@pytest.mark.parametrize("prefill", ["disabled", "breakable"])
def test_cache_stores_in_the_rotary_kernels_equal_the_split_op_stores(prefill, tmp_path, monkeypatch):
    """GLM-5 per-rank FP8 dims, 3 dense + 1 MoE layer, dummy weights, decode graphs, prefill
    eager or under breakable graphs: the latent and indexer-key rows the rotary kernels write
    (``rotary_cache_store``; in prefill graphs from the runner's static slot buffer) leave the
    caches bit for bit as the split ops' stores do, past the reserved page 0 (where a prefill
    bucket's padding rows go), and the greedy tokens equal."""
    import json

    from breakgraph.bench.presets import GLM5_TP8_RANK, _variant
    from breakgraph.kernels import rope
    from breakgraph.layers import attention

    (tmp_path / "config.json").write_text(json.dumps(_variant(GLM5_TP8_RANK, num_hidden_layers=4)))
    batch = prompts((300, 40, 7), 1000, seed=12)
    params = SamplingParams(max_new_tokens=10, ignore_eos=True)
    results = {}
    unfused_stores = []  # a store the kernels could not take (rope._store_rows with rows to write)
    store_rows = rope._store_rows
    monkeypatch.setattr(rope, "_store_rows", lambda store, rows: (unfused_stores.append(store is not None), store_rows(store, rows)))
    for fused in (True, False):
        if not fused:  # the layers store at the split ops
            monkeypatch.setattr(attention, "rotary_cache_store", lambda name, layer_id, dtype: None)
        eng = Engine(tmp_path, device="cuda", load_format="dummy", page_size=64, num_pages=40, context_length=1024,
                     cuda_graph_backend_prefill=prefill, cuda_graph_backend_decode="full", cuda_graph_max_bs=4)  # fmt: skip
        tokens = [c.token_ids for c in eng.generate(batch, params)]
        assert eng.graph_stats()["decode"]["replays"] > 0
        assert not any(unfused_stores), "a store fell back from the rotary kernels to index_put_"
        if prefill != "disabled":
            assert eng.graph_stats()["replays"] > 0
        caches = [c[64:].clone() for c in eng.kv_cache.latent] + [c[64:].clone() for c in eng.kv_cache.indexer_k if c is not None]
        results[fused] = (tokens, caches)
        del eng
        torch.cuda.empty_cache()
    (t1, c1), (t0, c0) = results[True], results[False]
    assert t1 == t0
    assert len(c1) == len(c0) and all(torch.equal(a, b) for a, b in zip(c1, c0))


def test_short_prompts_replay_the_graphs_without_indexer_queries_at_glm5_shapes(tmp_path, monkeypatch):
    """GLM-5 per-rank FP8 dims, 3 dense + 1 MoE layer, dummy weights: prompts no longer than
    ``index_topk`` replay the breakable graphs captured for sequences that short (``q_b`` alone
    from the merged linear, the indexer's rotary kernel on the key alone, no head weights, no
    indexer break), and their prompt logits equal eager's; eager runs with and without the
    indexer's queries agree (the rows are every causal key either way)."""
    import json

    from breakgraph.bench.presets import GLM5_TP8_RANK, _variant
    from breakgraph.layers import attention

    (tmp_path / "config.json").write_text(json.dumps(_variant(GLM5_TP8_RANK, num_hidden_layers=4)))
    batch = prompts((300, 40, 7), 1000, seed=13)
    common = dict(device="cuda", load_format="dummy", page_size=64, num_pages=40, context_length=4096,
                  cuda_graph_backend_decode="disabled", cuda_graph_bs_prefill=[64, 512])  # fmt: skip

    def run(prefill: str, queries: bool = False) -> tuple[list[torch.Tensor], dict]:
        with monkeypatch.context() as m:
            if queries:
                m.setattr(attention, "indexer_rows_are_causal", lambda index_topk: False)
            eng = Engine(tmp_path, cuda_graph_backend_prefill=prefill, **common)
            out = eng.prompt_logits(batch)
            graphs = eng.runner.prefill_graphs
            info = {} if graphs is None else {
                "bounded": eng.graph_stats()["bounded_buckets"], "replays": dict(graphs.bound_replays),
                "breaks": graphs._graphs[(512, 2048)].stats.breaks,
            }  # fmt: skip
            del eng
            torch.cuda.empty_cache()
            return out, info

    graph, info = run("breakable")
    assert info == {"bounded": {2048: [64, 512]}, "replays": {2048: 1}, "breaks": 4}  # the attention's only
    eager, _ = run("disabled")
    eager_queries, _ = run("disabled", queries=True)
    errs = {
        "graph vs eager": [rel_err(a, b) for a, b in zip(graph, eager)],
        "eager vs eager with queries": [rel_err(a, b) for a, b in zip(eager, eager_queries)],
    }
    print(errs)
    assert max(errs["graph vs eager"]) < 1e-3, errs
    assert max(errs["eager vs eager with queries"]) < 1e-3, errs
