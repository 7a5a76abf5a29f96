"""``breakgraph bench prefill`` on CPU: rows per backend and shape, outputs, a failing backend."""

from __future__ import annotations

import argparse
import json

import pytest

from breakgraph.bench import prefill


def _args(model_path, tmp_path, backends) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    prefill.add_arguments(parser)
    return parser.parse_args([
        "--model-path", str(model_path), "--device", "cpu", "--input-len", "8", "24", "--repeats", "2",
        "--backends", *backends, "--output", str(tmp_path / "bench"),
    ])  # fmt: skip


def test_bench_prefill_times_every_backend_and_shape(hf_checkpoints, tmp_path):
    args = _args(hf_checkpoints["glm_moe_dsa"], tmp_path, ["disabled", "breakable"])
    assert prefill.main(args) == 0
    out = json.loads((tmp_path / "bench.json").read_text())
    got = {(r["backend"], r["input_len"]) for r in out["rows"]}
    assert got == {(b, n) for b in ("disabled", "breakable") for n in (8, 24)}
    for r in out["rows"]:
        assert 0 < r["min_ms"] <= r["median_ms"] <= r["max_ms"] and r["floor_ms"] > 0
        assert (r["segments"] is not None) == (r["backend"] == "breakable")
    assert out["failures"] == {} and "breakgraph bench prefill" in out["command"]
    assert "| breakable | 1 × 24 |" in (tmp_path / "bench.md").read_text()


def test_bench_prefill_reports_a_failing_backend_and_measures_the_others(hf_checkpoints, tmp_path, monkeypatch):
    real = prefill.bench_backend

    def flaky(engine, backend, *rest):
        if backend == "piecewise":
            raise RuntimeError("out of memory while capturing piece 3")
        return real(engine, backend, *rest)

    monkeypatch.setattr(prefill, "bench_backend", flaky)
    args = _args(hf_checkpoints["glm_moe_dsa"], tmp_path, ["disabled", "piecewise", "breakable"])
    assert prefill.main(args) == 1
    out = json.loads((tmp_path / "bench.json").read_text())
    assert {r["backend"] for r in out["rows"]} == {"disabled", "breakable"}
    assert "out of memory" in out["failures"]["piecewise"]
    assert "**piecewise failed**" in (tmp_path / "bench.md").read_text()


@pytest.mark.parametrize("flag", ["--top-kernels", "--backends", "--input-len"])
def test_bench_prefill_help_names_flags(flag):
    parser = argparse.ArgumentParser()
    prefill.add_arguments(parser)
    assert flag in parser.format_help()


def test_dense_linear_shapes_are_the_models():
    import torch

    from breakgraph.bench.presets import PRESETS, dense_linear_shapes
    from breakgraph.models.config import ModelConfig
    from breakgraph.models.loader import build_model

    cfg = PRESETS["glm5-tp8-rank-4l-bf16"]
    model = build_model(ModelConfig.from_dict(cfg), "meta", dtype=torch.bfloat16)
    params = dict(model.named_parameters())
    prefix = {"mlp": "model.layers.0.mlp", "shared": "model.layers.3.mlp.shared_experts"}
    for name, k, n in dense_linear_shapes(cfg):
        head, _, rest = name.partition(".")
        where = f"{prefix[head]}.{rest}" if head in prefix else f"model.layers.3.self_attn.{name}"
        assert params[f"{where}.weight"].shape == (n, k), name


def test_regional_compile_shares_code_across_layers_and_matches_eager(tmp_path):
    """The torch-compile backend compiles each decoder layer; one traced graph must serve every
    layer of a kind (not one per layer) and give eager's hidden states. Dynamo only here
    (``backend="eager"``); Inductor's split-op partitions and rounding are checked on CUDA
    (tests/test_graphs_engine_cuda.py)."""
    import torch
    from tiny_models import dsv32_config
    from torch._dynamo.utils import counters

    from breakgraph import Engine
    from breakgraph.forward_context import forward_batch_context

    layers = 10
    cfg = dsv32_config(num_hidden_layers=layers).to_dict()
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    engine = Engine(tmp_path, device="cpu", dtype="float32", load_format="dummy", page_size=4, num_pages=64)

    def hidden(model, n: int) -> torch.Tensor:
        batch, pages = prefill.make_batch(engine, n, 1)
        with torch.inference_mode(), forward_batch_context(batch):
            out = model(batch.input_ids, batch.positions).clone()
        engine.kv_cache.pool.free(pages)
        return out

    lengths = (24, 40, 56)
    want = [hidden(engine.model, n) for n in lengths]
    torch._dynamo.reset()
    before = counters["stats"]["unique_graphs"]
    unspec_before = torch._dynamo.config.allow_unspec_int_on_nn_module
    with prefill.compiled_decoder_layers(engine.model, backend="eager") as compiled:
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
