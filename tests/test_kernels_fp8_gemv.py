"""The few-row FP8 GEMV (``breakgraph.kernels.triton_fp8_gemv``) against its fp32 twin.

CPU: the kernel under Triton's interpreter (one subprocess, fresh random inputs; FP8 weights
and the bf16-weight fp32-output form), the byte decode's arithmetic over every e4m3 code, the
sm_90a compile (registers, spills, the matrix instructions). GPU (``cuda`` marker):
glm5-tp8-rank shapes at decode row counts, every e4m3 code through the PTX decode, CUDA-graph
replays of the split-K epilogue, the dispatchers (``fp8_linear``, ``linear_fp32_out``).
"""

from __future__ import annotations

import pytest
import torch
from test_kernels_fp8 import _expect, _rel, compile_for_sm90

from breakgraph.bench.presets import PRESETS, dense_linear_shapes
from breakgraph.kernels.fp8 import FP8_DTYPE, block_quant


def _all_codes_weight(n: int, k: int, device="cpu") -> tuple[torch.Tensor, torch.Tensor]:
    """An e4m3 weight whose rows cycle through every non-NaN code (subnormals, zeros, both
    signs), with per-block scales of different magnitudes."""
    codes = torch.tensor([c for c in range(256) if c not in (0x7F, 0xFF)], dtype=torch.uint8)
    idx = (torch.arange(n)[:, None] * 7 + torch.arange(k)[None, :]) % codes.numel()
    w8 = codes[idx].view(FP8_DTYPE).to(device)
    ws = torch.exp2(torch.randint(-12, 4, (-(-n // 128), -(-k // 128))).float()) * (1 + torch.rand(-(-n // 128), -(-k // 128)))
    return w8, ws.to(device)


# --------------------------------------------------------------------------------------------
# interpreter checks (run in the subprocess)


def check_gemv_matches_fp32_twin():
    from breakgraph.kernels.triton_fp8_gemv import fp8_gemv, fp8_gemv_ref

    configs = (None, {"SPLIT_K": 1}, {"SPLIT_K": 3}, {"SPLIT_K": 3, "FIXUP": False}, {"BLOCK_N": 64, "SPLIT_K": 2})
    # the CUDA-core products, a form for one to a few rows: on the few-row shapes only (the
    # interpreter spends most of its time on their [BLOCK_N, BLOCK_M, 128] products elsewhere)
    few_rows = ({"DOT": False, "BLOCK_M": 1, "BLOCK_N": 16}, {"DOT": False, "BLOCK_M": 4, "BLOCK_N": 32, "SPLIT_K": 2})
    for m, n, k in ((1, 256, 384), (3, 200, 300), (17, 128, 1024), (40, 320, 256), (70, 96, 512)):
        w8, ws = block_quant(torch.randn(n, k) * torch.rand(n, 1))
        x = torch.randn(m, k) * torch.rand(m, 1) * 4
        bias = torch.randn(n)
        want = fp8_gemv_ref(x, w8, ws, bias)
        for cfg in configs + (few_rows if m <= 4 else ()):
            got = fp8_gemv(x, w8, ws, bias, torch.float32, cfg)
            assert got.shape == (m, n) and got.dtype == torch.float32
            assert _rel(got, want) < 1e-6, (m, n, k, cfg, _rel(got, want))
            if cfg and cfg.get("SPLIT_K", 1) > 1 and cfg.get("FIXUP", True):  # the epilogue sums as the sum kernel does
                assert torch.equal(got, fp8_gemv(x, w8, ws, bias, torch.float32, dict(cfg, FIXUP=False)))
        got = fp8_gemv(x.bfloat16(), w8, ws)
        assert got.dtype == torch.bfloat16
        assert _rel(got, fp8_gemv_ref(x.bfloat16(), w8, ws)) < 1e-2
    from breakgraph.kernels.split_k import _SPLIT_K_LOCKS

    assert not any(bool(locks.any()) for locks in _SPLIT_K_LOCKS.values()), "counters must return to zero"


def check_gemv_decodes_every_code_exactly():
    """One-hot rows of ``x`` read single weights back: every e4m3 code, times its block scale,
    exactly (the shifts by 2^-120, 2^64 and 2^56 cancel)."""
    from breakgraph.kernels.fp8 import block_dequant
    from breakgraph.kernels.triton_fp8_gemv import fp8_gemv

    n, k = 128, 256
    w8, ws = _all_codes_weight(n, k)
    cols = torch.arange(0, k, 5)
    x = torch.zeros(cols.numel(), k)
    x[torch.arange(cols.numel()), cols] = 1.0
    want = block_dequant(w8, ws, (128, 128), torch.float32)[:, cols].t()
    for cfg in ({"SPLIT_K": 1}, {"DOT": False, "BLOCK_M": 4, "BLOCK_N": 16, "SPLIT_K": 1}):
        got = fp8_gemv(x, w8, ws, None, torch.float32, cfg)
        assert torch.equal(got, want), (cfg, (got - want).abs().max())


def check_fp8_linear_takes_the_gemv_path():
    from breakgraph.kernels.triton_fp8 import fp8_linear
    from breakgraph.kernels.triton_fp8_gemv import fp8_gemv

    w8, ws = block_quant(torch.randn(256, 384))
    x = torch.randn(2, 3, 384)
    bias = torch.randn(256)
    got = fp8_linear(x, w8, ws, (128, 128), bias, path="triton_gemv")
    assert got.shape == (2, 3, 256)
    assert torch.equal(got.reshape(6, 256), fp8_gemv(x.reshape(6, 384), w8, ws, bias))


def check_gemv_fp32_out_matches_twin():
    """The 16-bit-weight form (router and indexer head weights): the fp32 product, one multiply
    by ``alpha`` (the indexer's ``32^-0.5``; 1 for the router), split or not, reduced by the last
    program or by the sum kernel; the CUDA-core products on the few-row shapes."""
    from breakgraph.kernels.triton_fp8_gemv import gemv_fp32_out, gemv_fp32_out_ref

    for m, n, k in ((1, 32, 6144), (5, 256, 768), (64, 40, 384)):
        x = (torch.randn(m, k) * torch.rand(m, 1)).bfloat16()
        w = torch.randn(n, k).bfloat16()
        runs = [(None, 1.0), (None, 32**-0.5), ({"SPLIT_K": 1}, 32**-0.5), ({"SPLIT_K": 3, "FIXUP": False}, 32**-0.5)]
        if m <= 8:
            runs.append(({"DOT": False, "BLOCK_M": 1 if m == 1 else 4, "BLOCK_N": 16}, 32**-0.5))
        for cfg, alpha in runs:
            want = gemv_fp32_out_ref(x, w, alpha)
            got = gemv_fp32_out(x, w, alpha, cfg)
            assert got.dtype == torch.float32 and got.shape == (m, n)
            assert _rel(got, want) < 1e-6, (m, n, k, alpha, cfg, _rel(got, want))
    with pytest.raises(ValueError, match="16-bit"):
        gemv_fp32_out(torch.randn(1, 128), torch.randn(8, 128))


@pytest.mark.parametrize(
    "name",
    [
        "check_gemv_matches_fp32_twin",
        "check_gemv_decodes_every_code_exactly",
        "check_fp8_linear_takes_the_gemv_path",
        "check_gemv_fp32_out_matches_twin",
    ],
)
def test_gemv_under_interpreter(interp_results, name):
    _expect(interp_results, name)


# --------------------------------------------------------------------------------------------
# CPU tests


def _emulate_ptx_decode(codes: torch.Tensor) -> torch.Tensor:
    """The PTX of ``_e4m3_bytes_to_bf16`` on 32-bit words, in int64 arithmetic: ``prmt`` puts
    bytes 0/1 (2/3) of a word in the low bytes of two 16-bit halves, then ``<< 4`` and
    ``+ 15·(t & 0x08000800)``; returns the bf16 bit patterns."""
    words = codes.to(torch.int64).view(-1, 4)
    out = []
    for lo_byte, hi_byte in ((0, 1), (2, 3)):
        t = (words[:, lo_byte] | (words[:, hi_byte] << 16)) << 4
        r = ((t & 0x08000800) * 15 + t) & 0xFFFFFFFF
        out += [r & 0xFFFF, r >> 16]
    return torch.stack([out[0], out[1], out[2], out[3]], dim=1).reshape(-1)


def test_ptx_decode_arithmetic_is_exact_for_every_code():
    codes = torch.tensor([c for c in range(256) if c not in (0x7F, 0xFF)] + [0, 0], dtype=torch.uint8)
    bits = _emulate_ptx_decode(codes)
    as_fp32 = (bits.to(torch.int32) << 16).view(torch.float32)  # bf16 bits are the top half of fp32's
    assert torch.equal(as_fp32, codes.view(FP8_DTYPE).float() * 2.0**-120)


GEMV_TYPES = {"x_ptr": "*bf16", "w_ptr": "*fp8e4nv", "ws_ptr": "*fp32", "bias_ptr": "*bf16", "c_ptr": "*fp32",
              "out_ptr": "*bf16", "lock_ptr": "*i32", "K_PER_SPLIT": 1024, "SPLIT_K": "i32", "alpha": "fp32", "N": "i32", "K": "i32",
              "stride_xm": "i32", "stride_wn": "i32", "stride_cm": "i32"}  # fmt: skip


@pytest.mark.parametrize("w_fp8", [True, False])
@pytest.mark.parametrize("m", [1, 16, 32, 64])
def test_gemv_default_configs_compile_for_sm90_without_spills(m, w_fp8):
    pytest.importorskip("triton")
    from breakgraph.kernels import triton_fp8_gemv as g

    cfg = g.gemv_config(m, 2752, 6144, 132)
    types = GEMV_TYPES if w_fp8 else dict(GEMV_TYPES, w_ptr="*bf16", out_ptr="*fp32")
    constexprs = {"W_FP8": w_fp8, "HAS_BIAS": w_fp8, "SPLIT": True, "FIXUP": True, "DOT": cfg["DOT"], "ASM": cfg["ASM"],
                  "BLOCK_M": cfg["BLOCK_M"], "BLOCK_N": cfg["BLOCK_N"], "INTERP": False}  # fmt: skip
    info = compile_for_sm90(g._fp8_gemv_kernel, types, constexprs, cfg["num_warps"], cfg["num_stages"])
    assert info["stack"] == 0 and info["local_insts"] == 0, info
    assert info["mma"] in (["HMMA"], ["HGMMA"]), info
    if cfg["num_warps"] == 1 and w_fp8:  # the decode is integer work, two instructions per code: no conversions
        assert info["loop_insts"] * 32 < 6 * cfg["BLOCK_N"] * 128, info


def test_gemv_config_splits_k_to_fill_the_gpu():
    from breakgraph.kernels.triton_fp8_gemv import MIN_SPLIT_BLOCKS, gemv_config

    for m, k, n in ((1, 6144, 2752), (1, 2048, 2048), (16, 2048, 6144), (64, 6144, 3072), (1, 256, 6144)):
        cfg = gemv_config(m, n, k, 132)
        tiles = -(-m // cfg["BLOCK_M"]) * -(-n // cfg["BLOCK_N"])
        assert 1 <= cfg["SPLIT_K"] <= max(1, (k // 128) // MIN_SPLIT_BLOCKS)
        assert tiles * cfg["SPLIT_K"] >= 132 or cfg["SPLIT_K"] == max(1, (k // 128) // MIN_SPLIT_BLOCKS), (m, k, n, cfg)


def test_linear_fp32_out_scales_once_on_cpu():
    from breakgraph.kernels.linear import linear_fp32_out

    x, w = torch.randn(3, 2, 64).bfloat16(), torch.randn(8, 64)
    assert torch.equal(linear_fp32_out(x, w, 0.125 * 3), torch.nn.functional.linear(x.float(), w) * (0.125 * 3))
    assert torch.equal(linear_fp32_out(x, w), torch.nn.functional.linear(x.float(), w))


def test_decode_paths_follow_their_knobs(monkeypatch):
    """As measured on the H200: by default the start-up timing tries the GEMV and cycles weights
    past L2, and the fp32-output products take the GEMV up to FP32_OUT_GEMV_MAX_M rows; each
    knob at 0 restores the cuBLAS/one-weight behaviour."""
    from breakgraph.kernels import fp8_gemm_choice, linear

    for name in ("BREAKGRAPH_FP8_GEMV", "BREAKGRAPH_FP8_TIMING_COLD", "BREAKGRAPH_GEMV_FP32_OUT", "BREAKGRAPH_FP8_FUSED_QUANT"):
        monkeypatch.delenv(name, raising=False)
    assert "triton_gemv" in fp8_gemm_choice.timed_paths() and fp8_gemm_choice.cold_timing()
    monkeypatch.setenv("BREAKGRAPH_FP8_GEMV", "0")
    monkeypatch.setenv("BREAKGRAPH_FP8_TIMING_COLD", "0")
    assert fp8_gemm_choice.timed_paths() == ("scaled_mm", "triton", "triton_w8a16", "triton_fused_quant")
    monkeypatch.setenv("BREAKGRAPH_FP8_FUSED_QUANT", "0")
    assert fp8_gemm_choice.timed_paths() == ("scaled_mm", "triton", "triton_w8a16")
    monkeypatch.delenv("BREAKGRAPH_FP8_FUSED_QUANT")
    assert not fp8_gemm_choice.cold_timing()
    taken = []
    monkeypatch.setattr(linear, "_mm_fp32_out_cuda", lambda x, w, a: taken.append("triton") or x.new_zeros(2, 8))
    monkeypatch.setattr(linear, "_mm_fp32_out", lambda x, w, a: taken.append("cublas") or x.new_zeros(2, 8))
    monkeypatch.setattr(linear, "use_triton_inference", lambda *t: True)
    monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda self: True))  # the dispatcher's CUDA branch
    x, w = torch.randn(2, 64).bfloat16(), torch.randn(8, 64).bfloat16()
    linear.linear_fp32_out(x, w)
    monkeypatch.setenv("BREAKGRAPH_GEMV_FP32_OUT", "0")
    linear.linear_fp32_out(x, w)
    assert taken == ["triton", "cublas"]


def test_gemv_rejects_bad_operands():
    from breakgraph.kernels.triton_fp8_gemv import fp8_gemv

    w8, ws = block_quant(torch.randn(128, 256))
    with pytest.raises(ValueError, match="float8_e4m3fn"):
        fp8_gemv(torch.randn(1, 256), w8.float(), ws)
    with pytest.raises(ValueError, match="weight_scale"):
        fp8_gemv(torch.randn(1, 256), w8, ws[:, :1])
    with pytest.raises(ValueError, match="BLOCK_N"):
        fp8_gemv(torch.randn(1, 256), w8, ws, config={"BLOCK_N": 48})


# --------------------------------------------------------------------------------------------
# GPU tests

DECODE_SHAPES = sorted({(k, n) for _, k, n in dense_linear_shapes(PRESETS["glm5-tp8-rank"])} | {(6144, 2752)})


@pytest.mark.cuda
@pytest.mark.parametrize("k,n", DECODE_SHAPES)
@pytest.mark.parametrize("m", [1, 2, 4, 8, 16, 32, 64])
def test_gemv_gpu_glm5_shapes(k, n, m):
    from breakgraph.kernels.triton_fp8_gemv import fp8_gemv, fp8_gemv_ref

    w8, ws = block_quant(torch.randn(n, k, device="cuda") / k**0.5)
    x = torch.randn(m, k, device="cuda").bfloat16()
    bias = torch.randn(n, device="cuda")
    want = fp8_gemv_ref(x, w8, ws, bias)
    got = fp8_gemv(x, w8, ws, bias, torch.float32)
    assert _rel(got, want) < 1e-5, (k, n, m, _rel(got, want))
    assert _rel(fp8_gemv(x, w8, ws), want - bias) < 4e-3


@pytest.mark.cuda
@pytest.mark.parametrize("cfg", [{"SPLIT_K": 1}, {"SPLIT_K": 1, "ASM": False}, {"SPLIT_K": 1, "DOT": False, "BLOCK_M": 4, "BLOCK_N": 16}])
def test_gemv_gpu_decodes_every_code_exactly(cfg):
    """The PTX decode and the tensor cores keep every code, subnormals included."""
    from breakgraph.kernels.fp8 import block_dequant
    from breakgraph.kernels.triton_fp8_gemv import fp8_gemv

    n, k = 256, 512
    w8, ws = _all_codes_weight(n, k, "cuda")
    cols = torch.arange(0, k, 3, device="cuda")
    x = torch.zeros(cols.numel(), k, device="cuda", dtype=torch.bfloat16)
    x[torch.arange(cols.numel()), cols] = 1.0
    want = block_dequant(w8, ws, (128, 128), torch.float32)[:, cols].t()
    for rows in range(0, cols.numel(), 64):
        got = fp8_gemv(x[rows : rows + 64], w8, ws, None, torch.float32, cfg)
        assert torch.equal(got, want[rows : rows + 64]), (cfg, rows, (got - want[rows : rows + 64]).abs().max())


@pytest.mark.cuda
@pytest.mark.parametrize("k,n", [(6144, 2752), (2048, 2048), (2048, 6144)])
@pytest.mark.parametrize("m", [1, 16, 64])
def test_gemv_split_k_epilogue_in_graph_replays(k, n, m):
    from breakgraph.kernels.split_k import _SPLIT_K_LOCKS
    from breakgraph.kernels.triton_fp8_gemv import fp8_gemv

    w8, ws = block_quant(torch.randn(n, k, device="cuda") / k**0.5)
    x = torch.randn(m, k, device="cuda").bfloat16()
    want = fp8_gemv(x, w8, ws, config={"FIXUP": False})
    assert torch.equal(fp8_gemv(x, w8, ws), want)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static = fp8_gemv(x, w8, ws)
    for _ in range(20):
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(static, want)
    assert not any(bool(locks.any()) for locks in _SPLIT_K_LOCKS.values())


@pytest.mark.cuda
@pytest.mark.parametrize("n,alpha", [(32, 32**-0.5), (256, 1.0)])
@pytest.mark.parametrize("m", [1, 4, 16, 17, 64])
def test_linear_fp32_out_gpu_router_and_indexer_shapes(n, alpha, m, monkeypatch):
    """The indexer's head weights (6144 → 32, scaled) and the router (6144 → 256) with
    ``BREAKGRAPH_GEMV_FP32_OUT=1``: the GEMV up to 16 rows, cuBLAS above, both the fp32 product
    of the exact operands up to the order of the fp32 sums (6144 terms: a few 1e-6); and in a
    CUDA graph."""
    from breakgraph.kernels.linear import linear_fp32_out

    monkeypatch.setenv("BREAKGRAPH_GEMV_FP32_OUT", "1")
    from breakgraph.kernels.triton_fp8_gemv import gemv_fp32_out_ref

    x = torch.randn(m, 6144, device="cuda").bfloat16()
    w = (torch.randn(n, 6144, device="cuda") * 0.02).bfloat16()
    want = (x.double() @ w.double().t()) * alpha
    got = linear_fp32_out(x, w, alpha)
    assert got.dtype == torch.float32 and _rel(got, want) < 5e-6
    assert _rel(got, gemv_fp32_out_ref(x, w, alpha)) < 5e-6
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static = linear_fp32_out(x, w, alpha)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(static, got)


@pytest.mark.cuda
def test_fp8_linear_auto_takes_the_gemv_where_the_table_says():
    from breakgraph.kernels import fp8_gemm_choice
    from breakgraph.kernels.linear import linear
    from breakgraph.kernels.triton_fp8_gemv import fp8_gemv

    k, n = 2048, 4096
    w8, ws = block_quant(torch.randn(n, k, device="cuda") / k**0.5)
    x = torch.randn(4, k, device="cuda").bfloat16()
    fp8_gemm_choice.set_table(torch.cuda.current_device(), k, n, ((1, "triton_gemv"), (16, "triton")))
    try:
        assert torch.equal(linear(x, w8, ws, (128, 128)), fp8_gemv(x, w8, ws))
    finally:
        fp8_gemm_choice.clear_tables()
