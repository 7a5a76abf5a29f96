"""Model-agnostic graph machinery: breakable graphs (BCG) and the CPU graph backend. Imports nothing from models/, engine/ or layers/."""

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
from breakgraph.graphs.segments import new_graph_pool

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
    "StaleBreakResultError",
    "call_with_graph_break",
    "cpu_graph",
    "eager_on_graph",
    "force_graph_break",
    "is_in_breakable_cuda_graph",
    "new_graph_pool",
]
