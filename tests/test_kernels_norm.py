"""RMSNorm kernels: the Triton row kernel (plain and with the residual add fused in) and the
``rms_norm`` / ``fused_add_rms_norm`` dispatchers.

CPU: the Triton kernel runs under Triton's interpreter in one subprocess against the twins
(``rms_norm_ref``, ``fused_add_rms_norm_ref``): bit-identical where the fp32 sum of squares is
exact in any order, else equal up to what the summation order can change; the norm with the
FP8 quantisation of its output fused in is the norm then ``act_quant`` bit for bit; sm_90a
compiles without spills; the dispatchers take the twins on CPU. GPU (``cuda`` marker): GLM-5 widths
(6144 hidden, 2048 ``q_lora_rank``, 512 ``kv_lora_rank``) × decode and prefill rows in bf16, CUDA-graph
replay, and the twin under autograd.
"""

from __future__ import annotations

import pytest
import torch
from test_kernels_fp8 import _expect, compile_for_sm90

from breakgraph.kernels.norm import fused_add_rms_norm, fused_add_rms_norm_ref, rms_norm, rms_norm_ref

EPS = 1e-6


def _small_multiples(*shape: int, dtype: torch.dtype) -> torch.Tensor:
    """Nonzero multiples of 1/8 up to ±15/8: their squares sum exactly in fp32 in any order."""
    k = torch.randint(1, 16, shape) * (torch.randint(0, 2, shape) * 2 - 1)
    return (k / 8).to(dtype)


def _weight(n: int, dtype: torch.dtype, device: str = "cpu") -> torch.Tensor:
    return (1 + 0.3 * torch.randn(n, device=device)).to(dtype)


def _check_up_to_summation_order(got: torch.Tensor, x: torch.Tensor, weight: torch.Tensor) -> float:
    """Assert ``got`` is the twin's result up to the summation order of ``Σx²``; return the
    fraction of elements that differ from the twin.

    16-bit: every element is ``weight · ĥ`` rounded once, ``ĥ`` the twin's ``h·rstd`` in the
    dtype or one of its two neighbours (a last-bit change of the fp32 mean square moves
    ``h·rstd`` across a rounding boundary in rare elements, at most 1 in 1000 here; after the
    weight product that can be 2 ulps). fp32: within 8 ulps (the mean square's last bits reach
    the output directly: 20–40% of the elements differ, by up to 4 ulps under the interpreter)."""
    want = rms_norm_ref(x, weight, EPS)
    assert got.shape == want.shape and got.dtype == want.dtype and got.is_contiguous()
    differing = (got != want).float().mean().item()
    if x.dtype == torch.float32:
        torch.testing.assert_close(got, want, rtol=2**-20, atol=0)
        return differing
    h = x.float()
    h_dt = (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + EPS)).to(x.dtype)
    bits = h_dt.view(torch.int16)
    explained = torch.zeros_like(got, dtype=torch.bool)
    for h_cand in (h_dt, (bits - 1).view(x.dtype), (bits + 1).view(x.dtype)):
        explained |= weight * h_cand == got
    assert explained.all(), f"{(~explained).sum().item()} elements are not weight·(h·rstd ± 1 ulp)"
    assert differing < 1e-3, f"{differing:.2e} of the elements differ from the twin"
    return differing


# --------------------------------------------------------------------------------------------
# interpreter checks (run in the subprocess)


def check_bit_identical_when_the_sum_of_squares_is_exact():
    """Where ``Σx²`` is exact the kernel is the twin bit for bit: the cast of ``h·rstd``, the
    once-rounded weight product (ties to even) and the once-rounded residual add."""
    from breakgraph.kernels.triton_norm import fused_add_rms_norm_triton, rms_norm_triton

    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        x = _small_multiples(33, 256, dtype=dtype)
        residual = _small_multiples(33, 256, dtype=dtype)
        w = _weight(256, dtype)
        assert torch.equal(rms_norm_triton(x, w, EPS), rms_norm_ref(x, w, EPS)), dtype
        normed, new_res = fused_add_rms_norm_triton(x, residual, w, EPS)
        want_normed, want_res = fused_add_rms_norm_ref(x, residual, w, EPS)
        assert torch.equal(new_res, want_res) and torch.equal(normed, want_normed), dtype


def check_matches_twin_up_to_summation_order():
    """Random rows (hidden 256 and 320, leading shapes, a strided input): the new residual is
    bit-identical; the normed output as :func:`_check_up_to_summation_order` allows."""
    from breakgraph.kernels.triton_norm import fused_add_rms_norm_triton, rms_norm_triton

    for n in (256, 320):
        for dtype in (torch.bfloat16, torch.float16, torch.float32):
            w = _weight(n, dtype)
            scale = torch.rand(3, 7, 1) * 8 + 0.1
            x = (torch.randn(3, 7, n) * scale).to(dtype)
            wide = torch.randn(19, n + 40).to(dtype)
            for inp in (x, wide[:, 3 : 3 + n]):
                _check_up_to_summation_order(rms_norm_triton(inp, w, EPS), inp, w)
            residual = torch.randn(3, 7, n).to(dtype)
            normed, new_res = fused_add_rms_norm_triton(x, residual, w, EPS)
            want_res = residual + x
            assert torch.equal(new_res, want_res), (n, dtype)
            _check_up_to_summation_order(normed, want_res, w)


def check_norm_quant_is_norm_then_act_quant():
    """``rms_norm_quant_triton`` (with and without the residual, padded rows, a strided input) =
    ``rms_norm_triton`` / ``fused_add_rms_norm_triton`` then ``act_quant(column_major_scale=True)``
    bit for bit: same normed rows, same residual, same e4m3 codes and scales, zero padding rows;
    and the fp32 reference (the twin's norm, ``act_quant_ref``) agrees."""
    from breakgraph.kernels.triton_fp8 import act_dequant, act_quant, act_quant_ref
    from breakgraph.kernels.triton_norm import (
        fused_add_rms_norm_triton,
        rms_norm_quant_triton,
        rms_norm_triton,
    )

    for m, n, pad in ((5, 256, 1), (3, 384, 16), (1, 2048, 1)):
        w = _weight(n, torch.bfloat16)
        x = (torch.randn(m, n) * torch.rand(m, 1) * 4).bfloat16()
        wide = torch.randn(m, n + 64).bfloat16()[:, 32 : 32 + n]
        residual = torch.randn(m, n).bfloat16()
        for inp, res in ((x, None), (wide, None), (x, residual)):
            normed, res_out, q, s = rms_norm_quant_triton(inp, w, EPS, res, pad)
            if res is None:
                want, want_res = rms_norm_triton(inp, w, EPS), None
                assert res_out is None
            else:
                want, want_res = fused_add_rms_norm_triton(inp, res, w, EPS)
                assert torch.equal(res_out, want_res)
            assert torch.equal(normed, want)
            wq, ws = act_quant(want, column_major_scale=True, pad_rows=pad)
            mp = -(-m // pad) * pad
            assert q.shape == (mp, n) and s.shape == (mp, n // 128) and s.stride() == (1, mp), (q.shape, s.stride())
            assert torch.equal(q.view(torch.uint8), wq.view(torch.uint8)), "codes differ from act_quant"
            assert torch.equal(s, ws), "scales differ from act_quant"
            assert (q[m:].float() == 0).all()
            # fp32 reference: the twin's norm of the fp32 input, quantised by act_quant_ref
            ref_in = inp.float() if res is None else (inp.float() + res.float())
            ref = rms_norm_ref(ref_in, w.float(), EPS)
            rq, rs = act_quant_ref(ref)
            assert (act_dequant(q[:m], s[:m]) - act_dequant(rq, rs)).norm() < 0.05 * ref.norm()


# --------------------------------------------------------------------------------------------
# CPU tests


@pytest.mark.parametrize(
    "name",
    [
        "check_bit_identical_when_the_sum_of_squares_is_exact",
        "check_matches_twin_up_to_summation_order",
        "check_norm_quant_is_norm_then_act_quant",
    ],
)
def test_triton_norm_under_interpreter(interp_results, name):
    _expect(interp_results, name)


@pytest.mark.parametrize("residual", [False, True])
@pytest.mark.parametrize("n,warps", [(6144, 16), (6144, 8), (6144, 4), (2048, 4), (512, 1), (96, 1)])
def test_rms_norm_compiles_for_sm90_without_spills(residual, n, warps):
    triton = pytest.importorskip("triton")
    from breakgraph.kernels import triton_norm

    for quant in (False, True) if n % 128 == 0 else (False,):
        types = {p: "*bf16" for p in ("x_ptr", "res_ptr", "w_ptr", "out_ptr", "res_out_ptr")}
        types |= {"inv_n": "fp32", "eps": "fp32", "q_ptr": "*fp8e4nv", "s_ptr": "*fp32"}
        constexprs = {"HAS_RESIDUAL": residual, "QUANT": quant, "GROUP": 128, "BLOCK": triton.next_power_of_2(n), "INTERP": False}
        if not residual:
            constexprs |= {"res_ptr": None, "res_out_ptr": None}
        if not quant:
            constexprs |= {"q_ptr": None, "s_ptr": None}
        info = compile_for_sm90(triton_norm._rms_norm_kernel, types, constexprs, warps, 1)
        print(f"rms_norm N={n} warps={warps} residual={residual} quant={quant}: {info}")
        assert info["stack"] == 0 and info["local_insts"] == 0, info
        # the e4m3 codes leave in 16-byte stores (one-byte stores made the kernel 9x slower)
        assert info["narrow_stores"] == 0, info


def test_dispatchers_take_twins_on_cpu_and_the_module_math_is_unchanged():
    from breakgraph.layers.norm import RMSNorm

    norm = RMSNorm(96, 1e-5, torch.float32)
    norm.weight.data.normal_()
    x, residual = torch.randn(5, 96), torch.randn(5, 96)
    h = x.float()
    before = norm.weight * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-5)).to(x.dtype)
    assert torch.equal(norm(x), before) and torch.equal(rms_norm(x, norm.weight, 1e-5), before)
    normed, new_res = norm.forward_with_residual(x, residual)
    assert torch.equal(new_res, residual + x) and torch.equal(normed, norm(residual + x))
    for got, want in zip(
        fused_add_rms_norm(x, residual, norm.weight, 1e-5),
        fused_add_rms_norm_ref(x, residual, norm.weight, 1e-5),
    ):
        assert torch.equal(got, want)


# --------------------------------------------------------------------------------------------
# GPU tests


@pytest.mark.cuda
@pytest.mark.parametrize("n", [6144, 2048, 512])
@pytest.mark.parametrize("rows", [1, 16, 64, 1024])
def test_rms_norm_gpu_glm5_widths(n, rows):
    x = (torch.randn(rows, n, device="cuda") * torch.rand(rows, 1, device="cuda") * 4).bfloat16()
    residual = torch.randn(rows, n, device="cuda").bfloat16()
    w = _weight(n, torch.bfloat16, "cuda")
    frac = _check_up_to_summation_order(rms_norm(x, w, EPS), x, w)
    normed, new_res = fused_add_rms_norm(x, residual, w, EPS)
    assert torch.equal(new_res, residual + x)
    frac_fused = _check_up_to_summation_order(normed, new_res, w)
    print(f"hidden {n}, {rows} rows: elements differing from the twin: {frac:.2e} (plain), {frac_fused:.2e} (fused)")


@pytest.mark.cuda
@pytest.mark.parametrize("n,rows", [(6144, 1), (6144, 16), (6144, 64), (6144, 1024), (2048, 1), (2048, 1024)])
def test_rms_norm_quant_gpu_glm5_shapes(n, rows):
    """glm5-tp8-rank widths (6144 hidden before the q_a ‖ wk ‖ kv_a projection, 2048 q_lora
    before q_b and wq_b), decode and prefill rows: the fused norm + quantisation is the norm
    kernel (at the quantising launch's warp count: another count sums the squares in another
    order, which may move a row's ``rstd`` by an ulp) then ``act_quant``, bit for bit, with and
    without the residual add; both launches are the twin up to the summation order."""
    from breakgraph.kernels.triton_fp8 import act_quant
    from breakgraph.kernels.triton_norm import _launch, default_warps, rms_norm_quant_triton, rms_norm_triton

    x = (torch.randn(rows, n, device="cuda") * 3).bfloat16()
    residual = torch.randn_like(x)
    w = _weight(n, torch.bfloat16, "cuda")
    warps = default_warps(n, quant=True)  # the quantising launch's
    for res in (None, residual):
        normed, res_out, q, s = rms_norm_quant_triton(x, w, EPS, res, 16)
        want, want_res, _, _ = _launch(x, res, w, EPS, num_warps=warps)
        wq, ws = act_quant(want, column_major_scale=True, pad_rows=16)
        assert torch.equal(normed, want) and torch.equal(s, ws)
        assert torch.equal(q.view(torch.uint8), wq.view(torch.uint8))
        assert res is None or torch.equal(res_out, want_res)
        if res is None:  # the plain launch sums in its own order: both are the twin up to that order
            _check_up_to_summation_order(normed, x, w)
            _check_up_to_summation_order(rms_norm_triton(x, w, EPS), x, w)


@pytest.mark.cuda
def test_fused_add_rms_norm_cuda_graph_replay():
    x = torch.randn(256, 6144, device="cuda").bfloat16()
    residual = torch.randn_like(x)
    w = _weight(6144, torch.bfloat16, "cuda")
    fused_add_rms_norm(x, residual, w, EPS)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_normed, static_res = fused_add_rms_norm(x, residual, w, EPS)
    for _ in range(3):
        x.copy_(torch.randn_like(x))
        residual.copy_(torch.randn_like(residual))
        graph.replay()
        normed, new_res = fused_add_rms_norm(x, residual, w, EPS)
        assert torch.equal(static_normed, normed) and torch.equal(static_res, new_res)


@pytest.mark.cuda
def test_dispatchers_keep_autograd_on_gpu():
    """Under autograd recording the dispatchers take the twins (the kernel has no backward)."""
    x = torch.randn(8, 512, device="cuda", requires_grad=True)
    w = torch.ones(512, device="cuda")
    rms_norm(x, w, EPS).sum().backward()
    assert x.grad is not None
    normed, _ = fused_add_rms_norm(x, torch.randn_like(x), w.requires_grad_(), EPS)
    assert normed.grad_fn is not None
