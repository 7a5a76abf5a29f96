"""``bench decode`` and ``bench ttft`` run through the engine on CPU (the built-in demo model):
they time what they say, record a command that reproduces the run, and write their outputs."""

from __future__ import annotations

import json
import os
import shlex

import pytest

from breakgraph.cli import build_parser, main
from breakgraph.demo.default_model import default_model_path


@pytest.fixture(scope="module")
def demo() -> str:
    return str(default_model_path())


def test_bench_decode_times_every_context_and_batch(demo, tmp_path, monkeypatch):
    import breakgraph.bench.decode as bd

    steps_seen = []
    real = bd.time_decode
    monkeypatch.setattr(bd, "time_decode", lambda *a, **k: steps_seen.append(a[1:3]) or real(*a, **k))
    profiled = []
    real_profile = bd.profile
    monkeypatch.setattr(bd, "profile", lambda *a, **k: profiled.append(a[3]) or real_profile(*a, **k))
    out = tmp_path / "dec"
    argv = ["bench", "decode", "--model-path", demo, "--device", "cpu", "--input-len", "20", "--batch-size", "1", "2",
            "--context-length", "128", "256", "--steps", "3", "--rounds", "2", "--top-kernels", "4",
            "--output", str(out)]  # fmt: skip
    assert main(argv) == 0
    data = json.loads(out.with_suffix(".json").read_text())
    rows = {(r["context_length"], r["batch_size"]): r for r in data["rows"]}
    assert set(rows) == {(128, 1), (128, 2), (256, 1), (256, 2)}
    assert all(r["steps"] == 6 and 0 < r["min_ms"] <= r["median_ms"] <= r["max_ms"] for r in rows.values())
    assert steps_seen == [(1, 20), (2, 20)] * 4, "rounds must alternate the context lengths"
    assert profiled == [], "the profiler runs on CUDA only"
    assert all(r["kernels_per_step"] is None and r["top_kernels"] is None for r in rows.values())
    recorded = build_parser().parse_args(shlex.split(data["command"])[1:])
    assert recorded.context_length == [128, 256] and recorded.batch_size == [1, 2] and recorded.rounds == 2


def test_bench_decode_pdl_alternates_the_switch_per_round(demo, tmp_path, monkeypatch):
    import breakgraph.bench.decode as bd

    monkeypatch.setenv("BREAKGRAPH_PDL", "0")
    seen = []
    real = bd.time_decode
    monkeypatch.setattr(bd, "time_decode", lambda *a, **k: seen.append(os.environ["BREAKGRAPH_PDL"]) or real(*a, **k))
    out = tmp_path / "pdl"
    argv = ["bench", "decode", "--model-path", demo, "--device", "cpu", "--input-len", "12", "--batch-size", "1",
            "--context-length", "128", "--steps", "2", "--rounds", "2", "--pdl", "1", "0", "--output", str(out)]  # fmt: skip
    assert main(argv) == 0
    assert seen == ["1", "0", "1", "0"], "each round must time every PDL value, alternated"
    data = json.loads(out.with_suffix(".json").read_text())
    rows = {(r["context_length"], r["pdl"]): r for r in data["rows"]}
    assert set(rows) == {(128, "1"), (128, "0")} and all(r["steps"] == 4 for r in rows.values())
    assert "| 128 PDL=1 | 1 |" in out.with_suffix(".md").read_text()


def test_bench_ttft_goes_through_chunked_prefill(demo, tmp_path, monkeypatch):
    from breakgraph.engine.model_runner import ModelRunner

    batch_tokens = []
    real = ModelRunner.make_batch

    def make_batch(self, entries, mode):
        batch_tokens.append(sum(len(e.token_ids) for e in entries))
        return real(self, entries, mode)

    monkeypatch.setattr(ModelRunner, "make_batch", make_batch)
    out = tmp_path / "ttft"
    argv = ["bench", "ttft", "--model-path", demo, "--device", "cpu", "--input-len", "100", "--chunked-prefill-size", "32",
            "--output", str(out)]  # fmt: skip
    assert main(argv) == 0
    data = json.loads(out.with_suffix(".json").read_text())
    (row,) = data["rows"]
    assert row["input_len"] == 100 and row["median_s"] > 0 and row["chunk"] == 32
    assert max(batch_tokens) == 32 and batch_tokens.count(32) >= 2 * 3, "prompts were not prefilled in chunks of 32"
    assert "--chunked-prefill-size 32" in data["command"]


@pytest.mark.cuda
def test_bench_decode_profiles_kernels_per_step_on_gpu(tmp_path):
    out = tmp_path / "dec"
    argv = ["bench", "decode", "--preset", "glm5-tp8-rank-4l-bf16", "--input-len", "64", "--batch-size", "1",
            "--context-length", "4096", "--steps", "4", "--rounds", "1", "--top-kernels", "3", "--output", str(out)]  # fmt: skip
    assert main(argv) == 0
    (row,) = json.loads(out.with_suffix(".json").read_text())["rows"]
    assert row["kernels_per_step"] > 4, "a 4-layer decode step launches more than one kernel per layer"
    assert 0 < row["gpu_busy"] and len(row["top_kernels"]) == 3
    assert "kernels / layer" in out.with_suffix(".md").read_text()


def test_bench_decode_host_profile_times_every_phase_of_the_step(demo, tmp_path):
    out = tmp_path / "dec"
    argv = ["bench", "decode", "--model-path", demo, "--device", "cpu", "--input-len", "12", "--batch-size", "1", "3",
            "--context-length", "128", "--steps", "3", "--rounds", "1", "--host-profile", "--output", str(out)]  # fmt: skip
    assert main(argv) == 0
    rows = json.loads(out.with_suffix(".json").read_text())["rows"]
    for r in rows:
        us = r["host_us"]
        assert set(us) == {"schedule", "prepare", "forward", "sample", "postprocess", "other", "host"}
        assert all(us[p] > 0 for p in ("schedule", "prepare", "forward", "sample", "postprocess")), us
        assert us["forward"] > us["prepare"], "the model forward is the largest phase on the CPU"
    assert "| schedule | prepare | forward | sample | postprocess | other | host |" in out.with_suffix(".md").read_text()


def test_step_phases_split_the_whole_step_and_detach_cleanly(demo):
    from breakgraph import Engine, SamplingParams
    from breakgraph.bench.decode import PHASES, StepPhases

    engine = Engine(demo, device="cpu", load_format="dummy", cuda_graph_backend_prefill="disabled")
    engine.add_request([5, 6, 7], SamplingParams(max_new_tokens=4, ignore_eos=True))
    timer = StepPhases(engine)
    with timer.attached():
        while engine.has_unfinished():
            engine.step()
    assert len(timer.steps) == 4 and all(set(s) == set(PHASES) for s in timer.steps)
    assert all(s["forward"] > 0 and s["other"] >= 0 for s in timer.steps)
    assert "step" not in vars(engine) and "schedule" not in vars(engine.scheduler), "still wrapped"
    assert "make_batch" not in vars(engine.runner) and "forward" not in vars(engine.executor), "still wrapped"
    assert type(engine.sampler).__name__ == "Sampler" and type(engine.postprocess).__name__ == "Postprocessor"
    engine.add_request([5, 6], SamplingParams(max_new_tokens=1, ignore_eos=True))
    engine.step()
    assert len(timer.steps) == 4, "a step after detaching was recorded"
