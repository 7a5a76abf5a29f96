"""Model-agnostic graph machinery: breakable graphs (BCG), the CPU graph backend, split ops and
the piecewise torch.compile backend (PCG). Imports nothing from models/, engine/ or layers/."""

from __future__ import annotations

from breakgraph.graphs._state import is_in_breakable_cuda_graph
from breakgraph.graphs.breakable import (
    BreakableGraph,
    BreakableGraphStats,
    IslandInfo,
    call_with_graph_break,
    eager_on_graph,
    force_graph_break,
)
from breakgraph.graphs.cpu_graph import CpuGraph, cpu_graph
from breakgraph.graphs.errors import (
    GraphBreakError,
    GraphError,
    GraphNotCapturedError,
    GraphReplayMismatchError,
    HostSyncInGraphError,
    StaleBreakResultError,
)
from breakgraph.graphs.piecewise import PieceInfo, PiecewiseBackend, PiecewiseStats, split_graph
from breakgraph.graphs.segments import new_graph_pool
from breakgraph.graphs.split_ops import (
    graph_break_op,
    is_split_op,
    opaque_op,
    register_custom_op,
    register_split_op,
    split_op_names,
)

__all__ = [
    "BreakableGraph",
    "BreakableGraphStats",
    "CpuGraph",
    "GraphBreakError",
    "GraphError",
    "GraphNotCapturedError",
    "GraphReplayMismatchError",
    "HostSyncInGraphError",
    "IslandInfo",
    "PieceInfo",
    "PiecewiseBackend",
    "PiecewiseStats",
    "StaleBreakResultError",
    "call_with_graph_break",
    "cpu_graph",
    "eager_on_graph",
    "force_graph_break",
    "graph_break_op",
    "is_in_breakable_cuda_graph",
    "is_split_op",
    "new_graph_pool",
    "opaque_op",
    "register_custom_op",
    "register_split_op",
    "split_graph",
    "split_op_names",
]
