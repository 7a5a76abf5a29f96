"""The torch-compile backend (regional torch.compile, graphs/regional.py): one traced graph serves
every layer of a kind, and users pick it like any prefill backend. Dynamo only on CPU
(``backend="eager"``); Inductor's split-op partitions and rounding are checked on CUDA
(tests/test_graphs_engine_cuda.py)."""

from __future__ import annotations

import json

import pytest
import torch

from breakgraph import Engine, SamplingParams
from breakgraph.engine.config import EngineConfig
from breakgraph.engine.model_runner import BatchEntry
from breakgraph.forward_context import ForwardMode, forward_batch_context
from breakgraph.graphs import regional
from breakgraph.graphs.regional import compiled_regions


def test_regional_compile_shares_code_across_layers_and_matches_eager(tmp_path):
    from tiny_models import dsv32_config
    from torch._dynamo.utils import counters

    layers = 10
    cfg = dsv32_config(num_hidden_layers=layers).to_dict()
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    engine = Engine(tmp_path, device="cpu", dtype="float32", load_format="dummy", page_size=4, num_pages=64)

    def hidden(model, n: int) -> torch.Tensor:
        pages = engine.kv_cache.pool.alloc(-(-n // 4))
        batch = engine.runner.make_batch([BatchEntry(list(range(n)), 0, pages)], ForwardMode.EXTEND)
        with torch.inference_mode(), forward_batch_context(batch):
            out = model(batch.input_ids, batch.positions).clone()
        engine.kv_cache.pool.free(pages)
        return out

    lengths = (24, 40, 56)
    want = [hidden(engine.model, n) for n in lengths]
    torch._dynamo.reset()
    before = counters["stats"]["unique_graphs"]
    unspec_before = torch._dynamo.config.allow_unspec_int_on_nn_module
    with compiled_regions(engine.model, backend="eager") as compiled:
        assert all(layer._compiled_call_impl is not None for layer in engine.model.model.layers)
        got = [hidden(compiled, n) for n in lengths]
    graphs = counters["stats"]["unique_graphs"] - before
    for n, a, b in zip(lengths, got, want):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5, msg=f"{n} tokens")
    # One dense layer (index 0 baked in), then the MoE layers with a symbolic index; the second
    # length makes the token count symbolic (dense, MoE); the third reuses those: 4 graphs.
    assert 2 <= graphs <= 4, f"{graphs} graphs for {layers} layers × {len(lengths)} lengths"
    assert all(layer._compiled_call_impl is None for layer in engine.model.model.layers), "layers not restored"
    assert torch._dynamo.config.allow_unspec_int_on_nn_module == unspec_before, "Dynamo config not restored"


def test_engine_runs_the_torch_compile_backend_and_switches_away(hf_checkpoints, monkeypatch):
    monkeypatch.setattr(regional, "TORCH_COMPILE_KWARGS", {"backend": "eager"})  # Dynamo only on CPU
    folder = hf_checkpoints["glm_moe_dsa"]
    prompts = [[3, 1, 4, 1, 5, 9, 2, 6], [5, 3, 5]]
    eager = Engine(folder, device="cpu", dtype="float32", page_size=4)
    params = SamplingParams(max_new_tokens=3, ignore_eos=True)
    want, want_tokens = eager.prompt_logits(prompts), [c.token_ids for c in eager.generate(prompts, params)]
    engine = Engine(folder, device="cpu", dtype="float32", page_size=4, cuda_graph_backend_prefill="torch-compile")
    layers = engine.model.model.layers
    try:
        assert engine.prefill_backend == "torch-compile" and engine.runner.decode_graphs is None
        assert all(layer._compiled_call_impl is not None for layer in layers)
        got = engine.prompt_logits(prompts)
        for a, b in zip(got, want):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
        assert [c.token_ids for c in engine.generate(prompts, params)] == want_tokens  # decode runs them too
        stats = engine.graph_stats()
        assert stats["backend"] == "torch-compile" and stats["replays"] >= 1
    finally:
        engine.set_prefill_backend("disabled")
    assert all(layer._compiled_call_impl is None for layer in layers), "layers not restored"
    assert engine.graph_stats()["backend"] == "disabled"


def test_torch_compile_refuses_decode_graphs_and_tensor_parallelism():
    with pytest.raises(ValueError, match="use --cuda-graph-backend-decode disabled"):
        EngineConfig(cuda_graph_backend_prefill="torch-compile", cuda_graph_backend_decode="full")
    with pytest.raises(ValueError, match="cannot run with --tp-size > 1"):
        EngineConfig(cuda_graph_backend_prefill="torch-compile", tp_size=2)
