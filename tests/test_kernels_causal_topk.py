"""The causal top-k rows of a short batch (every key up to each token's position): the Triton
kernel under the interpreter on CPU and on the GPU (``cuda`` marker, glm5's ``index_topk`` 2048)
against the twin, which must be the contract itself."""

from __future__ import annotations

import pytest
import torch
from test_kernels_fp8 import _expect

from breakgraph.kernels.causal_topk import causal_topk, causal_topk_ref


def _positions(t: int, k: int, device: str = "cpu") -> torch.Tensor:
    """Random positions, the first and last column's edge cases among them (0, k − 1, past k)."""
    pos = torch.randint(0, k + 5, (t,), device=device)
    pos[0], pos[-1] = 0, k - 1
    return pos


def check_kernel_is_the_twin():
    from breakgraph.kernels.triton_causal_topk import causal_topk_triton

    for t, k, block in ((7, 50, 16), (3, 2048, 1024), (1, 5, 1024)):
        pos = _positions(t, k)
        got = torch.full((t + 2, k), 7, dtype=torch.int32)  # rows past t stay as they were
        causal_topk_triton(pos, got[:t], block)
        want = torch.empty(t, k, dtype=torch.int32)
        causal_topk_ref(pos, want)
        assert torch.equal(got[:t], want) and (got[t:] == 7).all(), (t, k, block)


def test_triton_causal_topk_under_interpreter(interp_results):
    _expect(interp_results, "check_kernel_is_the_twin")


def test_twin_is_every_causal_position():
    pos = torch.tensor([0, 3, 9])
    out = torch.empty(3, 5, dtype=torch.int32)
    causal_topk(pos, out)  # CPU: the twin
    assert out.tolist() == [[0, -1, -1, -1, -1], [0, 1, 2, 3, -1], [0, 1, 2, 3, 4]]


@pytest.mark.cuda
def test_causal_topk_gpu_index_topk_2048():
    pos = _positions(300, 2048, "cuda")
    got = torch.empty(300, 2048, dtype=torch.int32, device="cuda")
    want = torch.empty_like(got)
    causal_topk(pos, got)
    causal_topk_ref(pos, want)
    assert torch.equal(got, want)
