"""Which breakable graph is capturing, replaying or checking right now (one per thread/task)."""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Literal

Phase = Literal["capture", "replay", "check"]


@dataclass
class ActiveGraph:
    """State of the breakable graph in flight.

    ``phase``: "capture" (recording segments), "replay" (running recorded steps) or "check" (the
    debug re-run of the body). ``owner``: the BreakableGraph. ``in_break``: a break function is
    running now, so breaks called inside it run inline (nested breaks).
    """

    phase: Phase
    owner: Any
    in_break: bool = False


_ACTIVE: contextvars.ContextVar[ActiveGraph | None] = contextvars.ContextVar(
    "breakgraph_active_graph", default=None
)


def active_graph() -> ActiveGraph | None:
    """The breakable graph in flight in this thread/task, or None."""
    return _ACTIVE.get()


def is_in_breakable_cuda_graph() -> bool:
    """True while a breakable graph is being captured *or* replayed (or debug-checked), on any
    device (the CPU backend counts too).

    Model code uses it to pick the graph-safe path: anything that depends on host-side values
    (sequence lengths as Python ints, a choice made from them) is frozen at capture and must not
    be taken under a graph. Break functions see it True as well, at capture and at replay.
    """
    return _ACTIVE.get() is not None


@contextlib.contextmanager
def activate(state: ActiveGraph) -> Iterator[ActiveGraph]:
    """Make ``state`` the graph in flight for the duration of the block."""
    token = _ACTIVE.set(state)
    try:
        yield state
    finally:
        _ACTIVE.reset(token)
