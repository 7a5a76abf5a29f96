"""Kernel dispatchers under ``torch.compile``: size-dependent tile choices stay out of the trace."""

from __future__ import annotations

import torch
from torch._dynamo.utils import counters

import breakgraph.kernels.linear  # noqa: F401  (registers breakgraph::fp8_linear)
import breakgraph.kernels.moe  # noqa: F401  (registers breakgraph::fused_moe)
from breakgraph.graphs import opaque_op


def _same_shape(x: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(x)


def _tile_choice(x: torch.Tensor) -> torch.Tensor:
    return x * 2 if x.shape[0] < 32 else x * 3  # a kernel choice read from the size


_opaque_tile_choice = opaque_op(name="test_tile_choice", fake_impl=_same_shape)(_tile_choice)


def _graphs_for_sizes(fn, sizes) -> int:
    torch._dynamo.reset()
    before = counters["stats"]["unique_graphs"]
    compiled = torch.compile(lambda x: fn(x + 1) - 1, backend="eager", dynamic=True, fullgraph=True)
    for n in sizes:
        x = torch.randn(n, 4)
        torch.testing.assert_close(compiled(x), _tile_choice(x + 1) - 1)
    return counters["stats"]["unique_graphs"] - before


def test_opaque_dispatcher_traces_once_for_every_size():
    sizes = (8, 16, 40, 64)
    assert _graphs_for_sizes(_opaque_tile_choice, sizes) == 1
    assert _graphs_for_sizes(_tile_choice, sizes) == 2, "control: a traced size branch guards and recompiles"


def test_kernel_ops_fake_shapes():
    x = torch.empty(3, 5, 256, device="meta", dtype=torch.bfloat16)
    w = torch.empty(384, 256, device="meta", dtype=torch.float8_e4m3fn)
    s = torch.empty(3, 2, device="meta")
    out = torch.ops.breakgraph.fp8_linear(x, w, s, [128, 128], None)
    assert out.shape == (3, 5, 384) and out.dtype == torch.bfloat16
    h = torch.empty(7, 64, device="meta", dtype=torch.bfloat16)
    w13 = torch.empty(4, 2 * 128, 64, device="meta", dtype=torch.bfloat16)
    w2 = torch.empty(4, 64, 128, device="meta", dtype=torch.bfloat16)
    ids = torch.empty(7, 2, device="meta", dtype=torch.int32)
    out = torch.ops.breakgraph.fused_moe(
        h, w13, w2, torch.empty(7, 2, device="meta"), ids, *[None] * 9, [128, 128]
    )
    assert out.shape == h.shape and out.dtype == h.dtype
