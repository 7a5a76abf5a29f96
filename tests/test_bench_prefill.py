"""``breakgraph bench prefill`` on CPU: rows per backend and shape, outputs, a failing backend."""

from __future__ import annotations

import argparse
import json
import math

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
        assert 0 < r["min_ms"] <= r["median_ms"] <= r["max_ms"]
        assert math.isnan(r["floor_ms"]), "off CUDA no rate is measured: the floor must say so, not guess"
        assert (r["segments"] is not None) == (r["backend"] == "breakable")
    assert out["failures"] == {} and "breakgraph bench prefill" in out["command"]
    assert all(math.isnan(v) for v in out["peaks"].values())
    assert "| breakable | 1 × 24 |" in (tmp_path / "bench.md").read_text()


def test_prefill_floor_follows_the_measured_rates(hf_checkpoints):
    """Each phase of the floor scales with the rate that bounds it: the GEMM phase with the copy
    bandwidth (weights-bound at a short prompt), the attention phase with the gather bandwidth
    (past index_topk only), the indexer phase with the bf16 or FP8 rate."""
    from breakgraph import Engine
    from breakgraph.bench.floor import prefill_floor
    from breakgraph.bench.peaks import Peaks

    engine = Engine(hf_checkpoints["glm_moe_dsa"], device="cpu", dtype="float32", cuda_graph_backend_prefill="disabled")
    k = engine.config.index_topk
    slow, fast = Peaks(1e9, 1e15, 2e15), Peaks(2e9, 1e15, 2e15)
    a, b = prefill_floor(engine, 4, 1, slow, 1e9, False), prefill_floor(engine, 4, 1, fast, 1e9, False)
    assert a.gemm_s == pytest.approx(2 * b.gemm_s)
    assert prefill_floor(engine, k, 1, slow, 1e3, False).attention_s < 1e-6  # nothing gathered below K
    g1, g2 = prefill_floor(engine, k + 10, 1, slow, 1e3, False), prefill_floor(engine, k + 20, 1, slow, 1e3, False)
    assert g2.attention_s == pytest.approx(2 * g1.attention_s)
    assert prefill_floor(engine, k, 1, slow, 1e9, False).indexer_s == 0  # no token past K is scored
    bf16, fp8 = prefill_floor(engine, 3 * k, 1, slow, 1e9, False), prefill_floor(engine, 3 * k, 1, slow, 1e9, True)
    assert bf16.indexer_s == pytest.approx(2 * fp8.indexer_s) and bf16.indexer_s > 0
    assert bf16.total_s == pytest.approx(bf16.gemm_s + bf16.attention_s + bf16.indexer_s)


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


def test_bench_prefill_frees_the_pages_of_a_failing_shape(hf_checkpoints, tmp_path, monkeypatch):
    """A shape that fails mid-run gives its KV pages back: the pool holds one 200-token prompt
    (13 pages of the default 16) plus 3 spare pages, so a leaked batch would make the next backend's 200-token
    shape fail for want of pages."""
    from breakgraph.engine.model_runner import ModelRunner

    real = ModelRunner.forward
    calls = {"failed": 0}
    runners = []

    def forward_failing_once_at_200(self, batch, *rest, **kw):
        runners.append(self)
        if batch.input_ids.numel() == 200 and not calls["failed"]:
            calls["failed"] += 1
            raise RuntimeError("kernel launch failed at 200 tokens")
        return real(self, batch, *rest, **kw)

    monkeypatch.setattr(ModelRunner, "forward", forward_failing_once_at_200)
    args = _args(hf_checkpoints["glm_moe_dsa"], tmp_path, ["disabled", "breakable"])
    args.input_len = [8, 200]
    assert prefill.main(args) == 1
    out = json.loads((tmp_path / "bench.json").read_text())
    assert calls["failed"] == 1 and list(out["failures"]) == ["disabled"]
    assert "200 tokens" in out["failures"]["disabled"]
    assert {(r["backend"], r["input_len"]) for r in out["rows"]} == {("disabled", 8), ("breakable", 8), ("breakable", 200)}
    pool = runners[-1].kv_cache.pool
    assert pool.num_used == 0, f"{pool.num_used} pages still allocated after the run"


def test_recorded_command_line_repeats_the_run():
    """The command written into the outputs parses back to the same value of every flag."""
    import shlex

    parser = argparse.ArgumentParser()
    prefill.add_arguments(parser)
    argv = ["--model-path", "/ckpt/my model", "--input-len", "128", "4096", "--batch-size", "1", "4",
            "--backends", "breakable", "torch-compile", "--repeats", "3", "--full-ladder", "--fold-islands",
            "--no-profile", "--top-kernels", "5", "--device", "cuda", "--dtype", "bfloat16", "--output", "out/x",
            "--tp-size", "2"]  # fmt: skip
    args = parser.parse_args(argv)
    words = shlex.split(prefill.command_line(args))
    assert words[:3] == ["breakgraph", "bench", "prefill"]
    assert vars(parser.parse_args(words[3:])) == vars(args)
    defaults = parser.parse_args([])
    assert vars(parser.parse_args(shlex.split(prefill.command_line(defaults))[3:])) == vars(defaults)


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


def test_bench_engine_flags_default_to_the_engine_and_reach_it(hf_checkpoints, tmp_path, monkeypatch):
    """Every bench that builds its own engine takes ``--page-size``/``--kv-cache-dtype`` from
    EngineConfig (one default for engine, server and benches), and prefill's engine gets them."""
    from breakgraph.bench import decode, itl, ttft
    from breakgraph.engine.config import EngineConfig

    for module in (prefill, decode, ttft, itl):
        parser = argparse.ArgumentParser()
        module.add_arguments(parser)
        assert parser.parse_args(["--page-size", "8"]).page_size == 8
        assert parser.get_default("page_size") == EngineConfig.page_size, module.__name__
    seen = {}
    real = prefill.kv_capacity

    def spy(engine):
        seen["page_size"] = engine.kv_cache.page_size
        return real(engine)

    monkeypatch.setattr(prefill, "kv_capacity", spy)
    args = _args(hf_checkpoints["glm_moe_dsa"], tmp_path, ["disabled"])
    args.page_size = 8
    assert prefill.main(args) == 0
    assert seen == {"page_size": 8}
