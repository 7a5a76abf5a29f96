"""One captured segment, the capturer protocol, and the CPU capturer
(:func:`breakgraph.graphs.capture.make_capturer` picks the capturer for a device).

A capturer is opened once per capture session (a BreakableGraph capture, or one piece capture
of the piecewise backend), then alternates ``begin(label)`` / ``end(reason)``; each ``end``
returns a :class:`Segment`. Both devices give the same answers:

* ``work``: kernels in the segment (CUDA: kernel, memcpy and memset nodes of the captured graph,
  read from the driver; CPU: recorded aten ops that launch a kernel). None when unknown.
* ``empty``: nothing was captured. An empty segment keeps no graph.
* ``fold``: for a single-kernel segment whose one op was recorded, a callable that re-runs that
  op eagerly into the same output tensor (used by ``fold_islands``), else None.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from breakgraph.graphs.cpu_graph import CpuGraph, OpRecorder


@dataclass
class Segment:
    """A captured segment. ``replay()`` runs it; see the module docstring for the fields."""

    replay: Callable[[], None]
    work: int | None
    empty: bool
    op_names: tuple[str, ...] = ()
    fold: Callable[[], None] | None = None
    handle: Any = None  # the CUDAGraph / CpuGraph, kept alive with the segment


class SegmentCapturer(Protocol):
    """What BreakableGraph and the piecewise backend need from a device."""

    kernel_count_source: str

    def open(self) -> None: ...
    def begin(self, label: str) -> None: ...
    def end(self, reason: str) -> Segment: ...
    def abort(self) -> None: ...
    def close(self) -> None: ...
    def non_owning(self, tree: Any) -> Any: ...
    def eager_in_pool(self) -> contextlib.AbstractContextManager: ...


def recorded_fold(recorder: OpRecorder | None) -> Callable[[], None] | None:
    """An eager re-run of a recording that holds exactly one kernel op, else None."""
    if recorder is None or not recorder.complete or recorder.kernels != 1:
        return None
    ops = [op for op in recorder.ops if op.kernel]

    def run() -> None:
        for op in ops:
            op.replay()

    return run


class CpuSegmentCapturer:
    """Capturer for the CPU backend: each segment is a :class:`CpuGraph`."""

    kernel_count_source = "recorded aten ops"

    def __init__(self) -> None:
        self._graph: CpuGraph | None = None

    def open(self) -> None:
        pass

    def non_owning(self, tree: Any) -> Any:
        """Break arguments are kept as they are: CPU graphs hold their tensors anyway."""
        return tree

    def eager_in_pool(self) -> contextlib.AbstractContextManager:
        """Nothing to route: the CPU backend has no pool."""
        return contextlib.nullcontext()

    def begin(self, label: str) -> None:
        self._graph = CpuGraph()
        self._graph.capture_begin(label)

    def end(self, reason: str) -> Segment:
        graph, self._graph = self._graph, None
        assert graph is not None, "end() without begin()"
        graph.capture_end()
        return Segment(
            replay=graph.replay,
            work=graph.kernels,
            empty=graph.empty,
            op_names=graph.op_names,
            fold=recorded_fold(graph.recorder),
            handle=graph,
        )

    def abort(self) -> None:
        if self._graph is not None:
            self._graph.capture_end()
            self._graph = None

    def close(self) -> None:
        pass


def new_graph_pool(device: str | torch.device) -> Any:
    """A memory-pool handle to share between every graph of one runner (all buckets).

    CUDA: ``torch.cuda.graph_pool_handle()``. CPU: None (the CPU backend keeps every recorded
    tensor alive and has no pool).
    """
    if torch.device(device).type == "cuda":
        return torch.cuda.graph_pool_handle()
    return None
