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
