"""Tensor-parallel world description. One process (rank 0 of 1) until tensor parallelism
lands; layers read their shard from here so they need no rewrite for it."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ParallelState:
    tp_rank: int = 0
    tp_size: int = 1


_STATE = ParallelState()


def get_parallel_state() -> ParallelState:
    return _STATE
