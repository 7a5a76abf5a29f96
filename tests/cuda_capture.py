"""Shared by the GPU tests: capture a call into a CUDA graph after warming it up."""

from __future__ import annotations

from collections.abc import Callable

import torch


def warmed_graph(fn: Callable[[], object]) -> torch.cuda.CUDAGraph:
    """Run ``fn`` once on a side stream (compiles and lazy allocations happen outside the
    capture), then capture a second call into a new ``torch.cuda.CUDAGraph`` and return it
    (not yet replayed)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph
