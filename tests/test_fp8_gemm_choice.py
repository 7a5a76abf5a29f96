"""The per-shape FP8 GEMM choice table (CPU: the table logic; tests/test_kernels_fp8.py times
the paths on the GPU)."""

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
