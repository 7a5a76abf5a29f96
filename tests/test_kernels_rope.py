"""Rotary embedding: the Triton kernel and the ``rope`` dispatcher against the twin.

CPU: the kernel runs under Triton's interpreter in one subprocess against ``rope_ref`` on
random inputs — bf16/fp16/fp32, interleaved and half-split pairs, ``[T, D]`` and ``[T, H, D]``
(strided views), full and partial rotation — and must be bit-identical (it rounds each
product and sum as torch does); sm_90a compiles without spills; on CPU the dispatcher is the
twin. GPU (``cuda`` marker): GLM-5 shapes (MLA ``q_pe``/``k_pe``, indexer ``q``/``k``) bit-identical
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


# --------------------------------------------------------------------------------------------
# CPU tests


def test_triton_rope_under_interpreter(interp_results):
    _expect(interp_results, "check_bit_identical_to_the_twin")


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
