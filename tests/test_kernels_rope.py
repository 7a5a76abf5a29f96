"""Rotary embedding: the Triton kernel and the ``rope`` dispatcher against the twin.

CPU: the kernel runs under Triton's interpreter in one subprocess against ``rope_ref`` on
random inputs — bf16/fp16/fp32, interleaved and half-split pairs, ``[T, D]`` and ``[T, H, D]``
(strided views), full and partial rotation — and must be bit-identical (it rounds each
product and sum as torch does); sm_90a compiles without spills; on CPU the dispatcher is the
twin. MLA's fused step (``mla_rope_kv``: kv_a norm, both rotations, the latent entry and the
query's rotary columns in one kernel) against the twins the same way. GPU (``cuda`` marker): GLM-5 shapes (MLA ``q_pe``/``k_pe``, indexer ``q``/``k``) bit-identical
to the twin, inside a CUDA graph too, and the twin under autograd.
"""

from __future__ import annotations

import pytest
import torch
from test_kernels_fp8 import _expect, compile_for_sm90

from breakgraph.kernels.rope import rope, rope_ref


def _tables(t: int, half: int, dtype: torch.dtype, device: str = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
    angle = torch.rand(t, half, device=device) * 50
    return angle.cos().to(dtype), angle.sin().to(dtype)


def _cases(device: str = "cpu"):
    """(x, rope_dim, interleaved): GLM-5-like layouts, small, as views of wider tensors."""
    q = torch.randn(7, 3, 40, device=device) * 3  # [T, H, nope ‖ pe]: pe is a strided view
    yield q[..., 24:], None, True
    yield torch.randn(7, 24, device=device)[:, 8:], None, True  # [T, D] view of a kv_a output
    yield torch.randn(7, 5, 48, device=device), 16, True  # indexer q: rotate 16 of 48, copy the rest
    yield torch.randn(7, 48, device=device), 16, False  # DeepSeek-V3.2 indexer k: half-split
    yield torch.randn(1, 17, 8, device=device), None, False  # heads past one block


def check_bit_identical_to_the_twin():
    from breakgraph.kernels.triton_rope import rope_triton, supports

    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        for x, rope_dim, interleaved in _cases():
            x = x.to(dtype)
            r = x.shape[-1] if rope_dim is None else rope_dim
            cos, sin = _tables(x.shape[0], r // 2, dtype)
            assert supports(x, cos, sin, rope_dim)
            got = rope_triton(x, cos, sin, interleaved, rope_dim)
            want = rope_ref(x, cos, sin, interleaved, rope_dim)
            assert got.is_contiguous() and got.shape == x.shape
            assert torch.equal(got, want), (dtype, tuple(x.shape), rope_dim, interleaved)


def _mla_inputs(t: int, h: int, nope: int, dr: int, r: int, dtype: torch.dtype, device: str = "cpu"):
    """q_b's output ``[T, H, nope + dr]`` and kv_a as the slice of a merged projection's output."""
    q = (torch.randn(t, h, nope + dr, device=device) * 3).to(dtype)
    merged = (torch.randn(t, 40 + r + dr, device=device) * torch.rand(t, 1, device=device) * 4).to(dtype)
    kv_a = merged[:, 40:]
    w = (1 + 0.3 * torch.randn(r, device=device)).to(dtype)
    cos, sin = _tables(t, dr // 2, dtype, device)
    return q, kv_a, cos, sin, w


def _check_mla_rope_kv(q, kv_a, cos, sin, w, exact_norm) -> None:
    """``mla_rope_kv``'s outputs against the twins: the rotary parts bit for bit, the latent
    norm by ``exact_norm(got, c)`` (bit for bit against the norm kernel under the interpreter,
    up to the summation order of Σc² against the twin on the GPU)."""
    from breakgraph.kernels.rope import mla_rope_kv

    r, dr = w.shape[0], cos.shape[1] * 2
    q_full, kv = mla_rope_kv(q, kv_a, cos, sin, w, 1e-6)
    assert q_full.shape == (q.shape[0], q.shape[1], r + dr) and kv.shape == kv_a.shape
    assert torch.equal(q_full[..., r:], rope_ref(q[..., -dr:], cos, sin, True))
    assert torch.equal(kv[:, r:], rope_ref(kv_a[:, r:], cos, sin, True))
    exact_norm(kv[:, :r].contiguous(), kv_a[:, :r])


def check_mla_rope_kv_matches_the_twins():
    from test_kernels_norm import _check_up_to_summation_order

    from breakgraph.kernels.norm import rms_norm_ref
    from breakgraph.kernels.triton_norm import rms_norm_triton

    for dtype in (torch.bfloat16, torch.float32):
        for t, h, nope, dr, r in ((5, 3, 24, 16, 256), (2, 8, 192, 64, 512), (3, 1, 8, 8, 96)):
            q, kv_a, cos, sin, w = _mla_inputs(t, h, nope, dr, r, dtype)

            def exact(got, c, dtype=dtype, w=w):
                if dtype != torch.float32:
                    assert torch.equal(got, rms_norm_triton(c, w, 1e-6))
                    _check_up_to_summation_order(got, c, w)
                else:  # the interpreter's fp32 sums depend on memory alignment (numpy's SIMD loops)
                    torch.testing.assert_close(got, rms_norm_ref(c, w, 1e-6), rtol=2**-20, atol=0)

            _check_mla_rope_kv(q, kv_a, cos, sin, w, exact)


def _indexer_inputs(t: int, h: int, d: int, r: int, dtype: torch.dtype, device: str = "cpu"):
    """wq_b's output viewed ``[T, H, D]`` and wk's ``[T, D]`` (a slice of a merged output)."""
    q = (torch.randn(t, h * d, device=device) * 2).to(dtype).view(t, h, d)
    k = (torch.randn(t, 70 + d, device=device) * 3 + 0.5).to(dtype)[:, 70:]
    w = (1 + 0.3 * torch.randn(d, device=device)).to(dtype)
    b = (0.1 * torch.randn(d, device=device)).to(dtype)
    cos, sin = _tables(t, r // 2, dtype, device)
    return q, k, cos, sin, w, b


def _check_indexer_rope_qk(q, k, cos, sin, w, b, interleaved: bool) -> None:
    """The queries bit for bit against ``rope_ref``; the key against the twin
    ``rope_ref(layer_norm(k))`` within one rounding of the LayerNorm's output (its fp32 sums
    run in another order than torch's)."""
    from breakgraph.kernels.rope import indexer_rope_qk

    r = cos.shape[1] * 2
    gq, gk = indexer_rope_qk(q, k, cos, sin, w, b, 1e-6, interleaved, r)
    assert gq.is_contiguous() and gq.shape == q.shape and gk.shape == k.shape
    assert torch.equal(gq, rope_ref(q, cos, sin, interleaved, r))
    want = rope_ref(torch.nn.functional.layer_norm(k, (k.shape[-1],), w, b, 1e-6), cos, sin, interleaved, r)
    ulp = 2.0**-7 if k.dtype == torch.bfloat16 else 2.0**-20
    err = (gk.float() - want.float()).abs() / want.float().abs().clamp(min=1e-2)
    assert err.max().item() <= 3 * ulp, err.max().item()
    assert (gk != want).float().mean().item() < 0.05
    no_q, k_alone = indexer_rope_qk(None, k, cos, sin, w, b, 1e-6, interleaved, r)  # a causal decode step's call
    assert no_q is None and torch.equal(k_alone, gk)


def check_indexer_rope_qk_matches_the_twins():
    for dtype in (torch.bfloat16, torch.float32):
        for t, h, d, r in ((5, 4, 48, 16), (2, 32, 128, 64), (3, 3, 40, 40)):
            for interleaved in (True, False):
                _check_indexer_rope_qk(*_indexer_inputs(t, h, d, r, dtype), interleaved)


def _cache_and_slots(rows: torch.Tensor, n: int = 23) -> tuple[torch.Tensor, torch.Tensor]:
    """A cache of ``n`` random rows of ``rows``' width and dtype, and distinct slots, one per row."""
    cache = torch.randn(n, rows.shape[-1], device=rows.device).to(rows.dtype)
    slots = torch.randperm(n, device=rows.device)[: rows.shape[0]]
    return cache, slots


def check_rotary_kernels_store_their_rows_in_the_cache():
    """With ``cache``/``slots`` both fused kernels write each new row to its slot, bit for bit
    the row they return, and no other cache row changes (the decode step's cache stores)."""
    from breakgraph.kernels.triton_rope import indexer_rope_qk_triton, mla_rope_kv_triton

    for dtype in (torch.bfloat16, torch.float32):
        q, kv_a, cos, sin, w = _mla_inputs(5, 8, 24, 16, 64, dtype)
        q_full, kv = q.new_empty(5, 8, 80), kv_a.new_empty(5, 80)
        cache, slots = _cache_and_slots(kv)
        before = cache.clone()
        mla_rope_kv_triton(q, kv_a, cos, sin, w, 1e-6, q_full, kv, cache=cache, slots=slots)
        want_kv = kv_a.new_empty(5, 80)
        mla_rope_kv_triton(q, kv_a, cos, sin, w, 1e-6, q.new_empty(5, 8, 80), want_kv)
        assert torch.equal(kv, want_kv) and torch.equal(cache[slots], kv), dtype
        others = torch.ones(cache.shape[0], dtype=torch.bool)
        others[slots] = False
        assert torch.equal(cache[others], before[others]), dtype

        q, k, cos, sin, w, b = _indexer_inputs(4, 3, 48, 16, dtype)
        cache, slots = _cache_and_slots(k)
        before = cache.clone()
        gq, gk = indexer_rope_qk_triton(q, k, cos, sin, w, b, 1e-6, True, cache=cache, slots=slots)
        wq, wk = indexer_rope_qk_triton(q, k, cos, sin, w, b, 1e-6, True)
        assert torch.equal(gq, wq) and torch.equal(gk, wk) and torch.equal(cache[slots], gk), dtype
        others = torch.ones(cache.shape[0], dtype=torch.bool)
        others[slots] = False
        assert torch.equal(cache[others], before[others]), dtype
        cache = before.clone()  # the key alone (no queries) stores the same rows
        no_q, k_alone = indexer_rope_qk_triton(None, k, cos, sin, w, b, 1e-6, True, cache=cache, slots=slots)
        assert no_q is None and torch.equal(k_alone, gk) and torch.equal(cache[slots], gk), dtype
        assert torch.equal(cache[others], before[others]), dtype


# --------------------------------------------------------------------------------------------
# CPU tests


@pytest.mark.parametrize(
    "name",
    [
        "check_bit_identical_to_the_twin",
        "check_mla_rope_kv_matches_the_twins",
        "check_indexer_rope_qk_matches_the_twins",
        "check_rotary_kernels_store_their_rows_in_the_cache",
    ],
)
def test_triton_rope_under_interpreter(interp_results, name):
    _expect(interp_results, name)


def test_mla_rope_kv_twin_is_the_separate_steps():
    """On CPU ``mla_rope_kv`` is the norm, the two rotations and the concatenation it replaces."""
    from breakgraph.kernels.norm import rms_norm_ref
    from breakgraph.kernels.rope import mla_rope_kv

    q, kv_a, cos, sin, w = _mla_inputs(4, 2, 24, 16, 96, torch.float32)
    q_full, kv = mla_rope_kv(q, kv_a, cos, sin, w, 1e-6)
    assert torch.equal(q_full[..., 96:], rope_ref(q[..., 24:], cos, sin, True))
    want = torch.cat([rms_norm_ref(kv_a[:, :96], w, 1e-6), rope_ref(kv_a[:, 96:], cos, sin, True)], dim=-1)
    assert torch.equal(kv, want)


def test_rotary_twins_store_their_rows_in_the_cache():
    """On CPU the dispatchers' ``store`` writes the rows they return into ``cache[slots]``."""
    from breakgraph.kernels.rope import indexer_rope_qk, mla_rope_kv

    q, kv_a, cos, sin, w = _mla_inputs(4, 2, 24, 16, 96, torch.float32)
    cache, slots = _cache_and_slots(kv_a)
    _, kv = mla_rope_kv(q, kv_a, cos, sin, w, 1e-6, store=(cache, slots))
    assert torch.equal(cache[slots], kv)
    q, k, cos, sin, w, b = _indexer_inputs(3, 2, 48, 16, torch.float32)
    cache, slots = _cache_and_slots(k)
    _, gk = indexer_rope_qk(q, k, cos, sin, w, b, 1e-6, False, 16, store=(cache, slots))
    assert torch.equal(cache[slots], gk)


def test_indexer_rope_qk_twin_is_the_separate_steps():
    """On CPU ``indexer_rope_qk`` is the rotation of ``q`` and the LayerNorm + rotation of ``k``."""
    from breakgraph.kernels.rope import indexer_rope_qk

    q, k, cos, sin, w, b = _indexer_inputs(3, 2, 48, 16, torch.float32)
    gq, gk = indexer_rope_qk(q, k, cos, sin, w, b, 1e-6, False, 16)
    assert torch.equal(gq, rope_ref(q, cos, sin, False, 16))
    assert torch.equal(gk, rope_ref(torch.nn.functional.layer_norm(k, (48,), w, b, 1e-6), cos, sin, False, 16))


@pytest.mark.parametrize("store,has_q", [(False, True), (True, True), (True, False)])
def test_indexer_rope_qk_compiles_for_sm90_without_spills(store, has_q):
    pytest.importorskip("triton")
    from breakgraph.kernels import triton_rope

    ptrs = ("q_ptr", "k_ptr", "cos_ptr", "sin_ptr", "w_ptr", "b_ptr", "q_out_ptr", "k_out_ptr", "cache_ptr")
    types = {p: "*bf16" for p in ptrs} | {"slots_ptr": "*i64", "inv_d": "fp32", "eps": "fp32"}
    constexprs = {"INTERLEAVED": True, "BLOCK_H": 32 if has_q else 1, "BLOCK_D": 128, "BLOCK_HALF": 32, "INTERP": False,
                  "STORE": store, "HAS_Q": has_q}  # fmt: skip
    info = compile_for_sm90(triton_rope._indexer_rope_qk_kernel, types, constexprs, 4, 1)
    print(f"indexer_rope_qk: {info}")
    assert info["stack"] == 0 and info["local_insts"] == 0, info


@pytest.mark.parametrize("store", [False, True])
@pytest.mark.parametrize("heads", [8, 1])
def test_mla_rope_kv_compiles_for_sm90_without_spills(heads, store):
    pytest.importorskip("triton")
    from breakgraph.kernels import triton_rope

    ptrs = ("q_ptr", "kva_ptr", "cos_ptr", "sin_ptr", "w_ptr", "q_out_ptr", "kv_ptr", "cache_ptr")
    types = {p: "*bf16" for p in ptrs} | {"slots_ptr": "*i64", "inv_r": "fp32", "eps": "fp32"}
    constexprs = {"INTERLEAVED": True, "BLOCK_R": 512, "BLOCK_H": heads, "BLOCK_HALF": 32, "INTERP": False, "STORE": store}
    info = compile_for_sm90(triton_rope._mla_rope_kv_kernel, types, constexprs, 4, 1)
    assert info["stack"] == 0 and info["local_insts"] == 0, info


@pytest.mark.parametrize("block_h,half,rest", [(16, 32, 0), (16, 32, 64), (1, 32, 0)])
def test_rope_compiles_for_sm90_without_spills(block_h, half, rest):
    pytest.importorskip("triton")
    from breakgraph.kernels import triton_rope

    types = {p: "*bf16" for p in ("x_ptr", "cos_ptr", "sin_ptr", "out_ptr")}
    constexprs = {"INTERLEAVED": True, "BLOCK_H": block_h, "BLOCK_HALF": half, "BLOCK_REST": rest, "INTERP": False}
    info = compile_for_sm90(triton_rope._rope_kernel, types, constexprs, 4, 1)
    assert info["stack"] == 0 and info["local_insts"] == 0, info


def test_rope_twin_rotates_pairs_and_copies_the_rest():
    """The twin's own contract on a hand-checkable input: pair (x0, x1) at angle θ becomes
    ``(x0 cos θ − x1 sin θ, x1 cos θ + x0 sin θ)``, written as [evens' ‖ odds']; columns past
    ``rope_dim`` are untouched; the CPU dispatcher is the twin."""
    x = torch.tensor([[1.0, 2.0, 3.0, 4.0, 9.0]])
    theta = torch.tensor([[0.5, 1.5]])
    cos, sin = theta.cos(), theta.sin()
    got = rope(x, cos, sin, interleaved=True, rope_dim=4)
    c, s = cos[0], sin[0]
    want = torch.tensor([[1 * c[0] - 2 * s[0], 3 * c[1] - 4 * s[1], 2 * c[0] + 1 * s[0], 4 * c[1] + 3 * s[1], 9.0]])
    torch.testing.assert_close(got, want)
    half_split = rope(x[:, :4], cos, sin, interleaved=False)
    torch.testing.assert_close(half_split, torch.tensor([[1 * c[0] - 3 * s[0], 2 * c[1] - 4 * s[1], 3 * c[0] + 1 * s[0], 4 * c[1] + 2 * s[1]]]))
    assert torch.equal(got, rope_ref(x, cos, sin, True, 4))


# --------------------------------------------------------------------------------------------
# GPU tests


@pytest.mark.cuda
@pytest.mark.parametrize(
    "shape,rope_dim",
    [((1024, 8, 64), None), ((1024, 64), None), ((1024, 32, 128), 64), ((1024, 128), 64), ((5, 64, 64), None)],
)
def test_rope_gpu_glm5_shapes_bit_identical(shape, rope_dim):
    x = torch.randn(*shape, device="cuda").bfloat16()
    r = shape[-1] if rope_dim is None else rope_dim
    cos, sin = _tables(shape[0], r // 2, torch.bfloat16, "cuda")
    for interleaved in (True, False):
        assert torch.equal(rope(x, cos, sin, interleaved, rope_dim), rope_ref(x, cos, sin, interleaved, rope_dim))


@pytest.mark.cuda
@pytest.mark.parametrize("t", [1, 1024])
def test_mla_rope_kv_gpu_glm5_tp8_rank(t):
    """glm5-tp8-rank: 8 heads of 192 + 64, latent 512 + 64 as the slice of the merged
    q_a ‖ wk ‖ kv_a output; rotations bit-identical to the twin, the norm up to the summation
    order of Σc²."""
    from test_kernels_norm import _check_up_to_summation_order

    q, kv_a, cos, sin, w = _mla_inputs(t, 8, 192, 64, 512, torch.bfloat16, "cuda")
    _check_mla_rope_kv(q, kv_a, cos, sin, w, lambda got, c: _check_up_to_summation_order(got, c, w))


@pytest.mark.cuda
@pytest.mark.parametrize("t", [1, 1024])
@pytest.mark.parametrize("interleaved", [True, False])
def test_indexer_rope_qk_gpu_glm5_shapes(t, interleaved):
    """The indexer at glm5-tp8-rank shapes (32 heads of 128, 64 rotated; GLM-5 interleaved,
    DeepSeek-V3.2 half-split) against the twins."""
    _check_indexer_rope_qk(*_indexer_inputs(t, 32, 128, 64, torch.bfloat16, "cuda"), interleaved)


@pytest.mark.cuda
def test_rope_cuda_graph_replay_and_autograd():
    q = torch.randn(256, 8, 256, device="cuda").bfloat16()
    cos, sin = _tables(256, 32, torch.bfloat16, "cuda")
    rope(q[..., 192:], cos, sin, True)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static = rope(q[..., 192:], cos, sin, True)
    for _ in range(2):
        q.copy_(torch.randn_like(q))
        graph.replay()
        assert torch.equal(static, rope_ref(q[..., 192:], cos, sin, True))
    x = torch.randn(4, 64, device="cuda", requires_grad=True)
    c32, s32 = _tables(4, 32, torch.float32, "cuda")
    rope(x, c32, s32, True).sum().backward()
    assert x.grad is not None
