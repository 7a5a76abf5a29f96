"""Errors raised by the graph machinery. Each one says what went wrong and what to do next."""

from __future__ import annotations


class GraphError(RuntimeError):
    """Base class of every error raised by ``breakgraph.graphs``."""


class HostSyncInGraphError(GraphError):
    """A segment asked the host for a device value (``.item()``, ``.tolist()``, ``bool(t)``,
    ``nonzero`` ...). A replay cannot see host-side values: move the code into a break or keep the
    value on the device."""


class GraphBreakError(GraphError):
    """A break broke its contract (side stream not joined, returned value changed shape, nested
    capture ...). The message names the break function."""


class StaleBreakResultError(GraphBreakError):
    """A break returned a different Python value at replay than at capture: the graph froze the
    capture-time value, so the replay would be wrong."""


class GraphReplayMismatchError(GraphError):
    """The debug check found that a replay differs from running the body eagerly. The message
    names the first segment (or piece) whose values differ."""


class GraphNotCapturedError(GraphError):
    """A replay was asked for a graph (or a bucket) that was never captured."""
