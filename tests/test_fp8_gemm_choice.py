"""The per-shape FP8 GEMM choice table (CPU: the table logic; tests/test_kernels_fp8.py times
the paths on the GPU)."""

import json
import logging

import pytest

from breakgraph.kernels import fp8_gemm_choice as choice


@pytest.fixture(autouse=True)
def _no_tables():
    choice.clear_tables()
    yield
    choice.clear_tables()


def test_table_from_timings_picks_the_faster_and_skips_failures():
    inf = float("inf")
    timings = {
        1024: {"scaled_mm": 2e-5, "triton": 3e-5},
        1: {"scaled_mm": inf, "triton": 1e-5},
        128: {"scaled_mm": 1e-5, "triton": 1e-5},  # a tie goes to the name first in order
        64: {"scaled_mm": inf, "triton": float("nan")},  # both failed: left out
    }
    assert choice.table_from_timings(timings) == ((1, "triton"), (128, "scaled_mm"), (1024, "scaled_mm"))


def test_choose_follows_the_table_per_device_and_shape():
    choice.set_table(0, 6144, 2048, ((1, "triton_w8a16"), (16, "triton"), (256, "triton"), (512, "scaled_mm")))
    assert choice.choose(1, 6144, 2048, 0, True) == "triton_w8a16"
    assert choice.choose(15, 6144, 2048, 0, True) == "triton_w8a16"
    assert choice.choose(16, 6144, 2048, 0, True) == "triton"
    assert choice.choose(511, 6144, 2048, 0, True) == "triton"
    assert choice.choose(512, 6144, 2048, 0, True) == "scaled_mm"
    assert choice.choose(9000, 6144, 2048, 0, True) == "scaled_mm"
    # another device or shape: the untuned rule, W8A8 throughout
    m = choice.UNTUNED_SCALED_MM_MIN_M
    assert choice.choose(m - 1, 6144, 2048, 1, True) == "triton"
    assert choice.choose(m, 6144, 2048, 1, True) == "scaled_mm"
    assert choice.choose(m, 6144, 2048, 1, False) == "triton", "cuBLAS cannot run it: Triton"
    assert choice.choose(m - 1, 2048, 2048, 0, True) == "triton"


def test_describe_names_each_run_of_one_path():
    assert choice.describe(((1, "triton"), (64, "triton"), (1024, "scaled_mm"))) == (
        "triton M<1024, scaled_mm M>=1024"
    )
    assert choice.describe(((1, "triton"),)) == "triton all M"
    assert choice.describe(((1, "triton"), (16, "scaled_mm"), (64, "triton"))) == (
        "triton M<16, scaled_mm M>=16 M<64, triton M>=64"
    )


def test_scaled_mm_shape_rule(monkeypatch):
    """Off CUDA never; on a GPU whose probe passed, only K a multiple of 4 × 128 (cuBLAS reads
    the weight scales with a row stride rounded up to 4: other K give wrong products) and N a
    multiple of 64 (kv_a's 576 included)."""
    import torch

    pytest.importorskip("triton")
    from breakgraph.kernels import triton_fp8

    assert not triton_fp8.scaled_mm_takes(6144, 2048, torch.device("cpu"))
    monkeypatch.setattr(triton_fp8, "scaled_mm_blockwise_mode", lambda device: "pad16")
    gpu = torch.device("cuda", 0)
    for k, n, want in [
        (6144, 2048, True),
        (6144, 576, True),
        (2048, 6144, True),
        (512, 3584, True),
        (256, 6144, False),
        (384, 256, False),
        (1536, 6144, True),
        (640, 2048, False),
        (6144, 100, False),
    ]:
        assert triton_fp8.scaled_mm_takes(k, n, gpu) is want, (k, n)
    monkeypatch.setattr(triton_fp8, "scaled_mm_blockwise_mode", lambda device: None)
    assert not triton_fp8.scaled_mm_takes(6144, 2048, gpu)


# -- the on-disk cache of measured tables -------------------------------------------------------

KEY = {"format": choice.CACHE_FORMAT, "gpu": "NVIDIA H200", "torch": "2.11.0", "triton": "3.6.0", "buckets": [1, 16]}


class FakeTune:
    """Stands in for the GPU timing: a table per shape, and which shapes it was asked for."""

    def __init__(self):
        self.asked: list[set] = []

    def __call__(self, shapes):
        self.asked.append(set(shapes))
        return {(k, n): ((1, "triton_w8a16"), (16, "scaled_mm" if k % 512 == 0 else "triton")) for k, n in shapes}


def test_cache_round_trip_times_only_what_the_file_lacks(tmp_path):
    tune = FakeTune()
    tables, cached = choice.load_or_tune({(6144, 2048), (256, 6144)}, KEY, tune, tmp_path)
    assert cached == 0 and tune.asked == [{(6144, 2048), (256, 6144)}]
    path = choice.cache_file(tmp_path, KEY)
    assert path.exists() and path.parent == tmp_path / "fp8_gemm_choice"
    again, cached = choice.load_or_tune({(6144, 2048), (256, 6144)}, KEY, tune, tmp_path)
    assert cached == 2 and len(tune.asked) == 1 and again == tables, "a second start times nothing"
    more, cached = choice.load_or_tune({(6144, 2048), (2048, 4096)}, KEY, tune, tmp_path)
    assert cached == 1 and tune.asked[-1] == {(2048, 4096)}
    assert set(more) == {(6144, 2048), (2048, 4096)} and more[(6144, 2048)] == tables[(6144, 2048)]
    _, cached = choice.load_or_tune({(6144, 2048), (256, 6144), (2048, 4096)}, KEY, tune, tmp_path)
    assert cached == 3, "the file holds the union"


def test_another_gpu_or_version_measures_again(tmp_path):
    tune = FakeTune()
    choice.load_or_tune({(6144, 2048)}, KEY, tune, tmp_path)
    other = {**KEY, "triton": "3.7.0"}
    assert choice.cache_file(tmp_path, other) != choice.cache_file(tmp_path, KEY)
    _, cached = choice.load_or_tune({(6144, 2048)}, other, tune, tmp_path)
    assert cached == 0 and len(tune.asked) == 2
    # a file of another key put where this key's belongs is not believed
    choice.cache_file(tmp_path, KEY).write_text(choice.cache_file(tmp_path, other).read_text())
    _, cached = choice.load_or_tune({(6144, 2048)}, KEY, tune, tmp_path)
    assert cached == 0 and len(tune.asked) == 3


@pytest.mark.parametrize(
    "content",
    [
        b"\x00\xff not json",
        b'{"key": ',
        b"[]",
        json.dumps({"key": KEY, "tables": [{"k": 6144, "n": 2048, "table": [[1, "cublas_magic"]]}]}).encode(),
        json.dumps({"key": KEY, "tables": [{"k": 6144, "n": 2048, "table": [[16, "triton"], [1, "triton"]]}]}).encode(),
        json.dumps({"key": KEY, "tables": [{"k": 6144}]}).encode(),
    ],
)
def test_a_corrupt_file_is_logged_and_measured_again(tmp_path, caplog, content):
    path = choice.cache_file(tmp_path, KEY)
    path.parent.mkdir(parents=True)
    path.write_bytes(content)
    tune = FakeTune()
    with caplog.at_level(logging.WARNING, logger=choice.__name__):
        tables, cached = choice.load_or_tune({(6144, 2048)}, KEY, tune, tmp_path)
    assert cached == 0 and tune.asked == [{(6144, 2048)}]
    assert any("unreadable" in r.getMessage() and str(path) in r.getMessage() for r in caplog.records)
    _, cached = choice.load_or_tune({(6144, 2048)}, KEY, tune, tmp_path)
    assert cached == 1, "the file was rewritten whole"


def test_no_cache_dir_and_an_unwritable_one(tmp_path, caplog):
    tune = FakeTune()
    choice.load_or_tune({(6144, 2048)}, KEY, tune, None)
    choice.load_or_tune({(6144, 2048)}, KEY, tune, None)
    assert len(tune.asked) == 2 and not (tmp_path / "fp8_gemm_choice").exists()
    blocker = tmp_path / "file"
    blocker.write_text("")
    with caplog.at_level(logging.WARNING, logger=choice.__name__):
        tables, cached = choice.load_or_tune({(6144, 2048)}, KEY, tune, blocker)  # a file where a folder goes
    assert set(tables) == {(6144, 2048)} and any("could not be written" in r.getMessage() for r in caplog.records)


def test_cache_dir_follows_the_environment(monkeypatch, tmp_path):
    monkeypatch.delenv("BREAKGRAPH_CACHE_DIR", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert choice.cache_dir() == tmp_path / "xdg" / "breakgraph"
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert choice.cache_dir() == tmp_path / "home" / ".cache" / "breakgraph"
    monkeypatch.setenv("BREAKGRAPH_CACHE_DIR", str(tmp_path / "mine"))
    assert choice.cache_dir() == tmp_path / "mine"
    monkeypatch.setenv("BREAKGRAPH_CACHE_DIR", "off")
    assert choice.cache_dir() is None


def test_producers_quantise_only_for_paths_that_read_fp8_activations(monkeypatch):
    """A norm quantises its output for the next FP8 linear only where the path that linear takes at
    that row count reads the codes (W8A8: ``_scaled_mm``, Triton); the GEMV and W8A16 read bf16."""
    import torch

    from breakgraph.kernels import linear as klinear
    from breakgraph.kernels import triton_fp8
    from breakgraph.layers.linear import ReplicatedLinear
    from breakgraph.models.config import Fp8Config

    fp8 = ReplicatedLinear(256, 128, fp8=Fp8Config(), dtype=torch.bfloat16)
    plain = ReplicatedLinear(256, 128, dtype=torch.bfloat16)
    rows = (1, 8, 16, 63, 64, 128, 4096)
    x = {m: torch.empty(m, 256, dtype=torch.bfloat16) for m in rows}
    # on the CPU nothing is decided by the path: a producer that can quantise keeps doing so
    assert all(fp8.takes_fp8_input(x[m]) for m in rows) and not any(plain.takes_fp8_input(x[m]) for m in rows)
    monkeypatch.setattr(klinear, "use_triton", lambda t: True)
    monkeypatch.setattr(triton_fp8, "device_index", lambda device: 0)
    monkeypatch.setattr(triton_fp8, "scaled_mm_blockwise_mode", lambda device: "any")
    choice.set_table(0, 256, 128, ((1, "triton_gemv"), (16, "triton"), (64, "triton_w8a16"), (128, "scaled_mm")))
    assert [fp8.takes_fp8_input(x[m]) for m in rows] == [False, False, True, True, False, True, True]
    assert not any(plain.takes_fp8_input(x[m]) for m in rows)
    # a 3-D input counts its rows
    assert fp8.takes_fp8_input(torch.empty(2, 8, 256, dtype=torch.bfloat16))
