"""Tensor-parallel world description and the collectives the layers call.

A layer reads :func:`get_parallel_state` once, when it is built, and keeps the state it got;
model construction installs the state of the rank being built with :func:`parallel_state`.
So a single-process engine and a tensor-parallel one can live in the same process, and with
``tp_size == 1`` no collective is ever called (the layers take their single-process path).

The collectives run over the default ``torch.distributed`` process group, which
:mod:`breakgraph.engine.tp_launch` sets up (gloo for CPU tensors, NCCL for CUDA tensors).

Collectives and graphs:

* CUDA (NCCL): :func:`tp_all_reduce` runs inline, so it is captured into graph segments (NCCL
  kernels are capturable; every rank captures and replays the same segments in the same
  order). Under ``torch.compile`` it is the opaque custom op ``breakgraph::tp_all_reduce_cuda``.
* CPU (gloo): a gloo collective is not a kernel the CPU graph backend can replay. The recorder
  does see ``c10d.allreduce_``, but re-running it at replay issues an asynchronous collective
  that nobody waits for, so the next op reads the tensor before the sum lands (a silent race,
  measured: a replay returned one rank's value instead of the sum). So on CPU the all-reduce is
  the break :func:`tp_all_reduce_cpu` (a :func:`~breakgraph.graphs.graph_break_op`): eager at
  capture and at replay under breakable graphs, a split op for the piecewise backend. Inside a
  plain CPU graph recording (no breakable graph to break, e.g. full decode graphs) it raises
  :class:`CollectiveInGraphError` instead of recording a race.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.distributed as dist

from breakgraph.graphs import graph_break_op, register_custom_op


class ShardingError(ValueError):
    """A model dimension (or an FP8 block grid) cannot be split evenly over the TP ranks."""


class CollectiveInGraphError(RuntimeError):
    """A CPU collective was called while a CPU graph segment was being recorded."""


@dataclass(frozen=True)
class ParallelState:
    """Which tensor-parallel rank a model (or a layer) is built for."""

    tp_rank: int = 0
    tp_size: int = 1

    def __post_init__(self) -> None:
        if self.tp_size < 1 or not 0 <= self.tp_rank < self.tp_size:
            raise ValueError(f"tensor-parallel rank {self.tp_rank} of {self.tp_size} is not a valid rank")

    def split(self, size: int, what: str) -> int:
        """``size // tp_size``; raises :class:`ShardingError` naming ``what`` if it does not divide."""
        if size % self.tp_size:
            raise ShardingError(f"{what} = {size} is not divisible by --tp-size {self.tp_size}")
        return size // self.tp_size


_STATE = ParallelState()


def get_parallel_state() -> ParallelState:
    """The state installed by :func:`parallel_state` (rank 0 of 1 outside it)."""
    return _STATE


@contextlib.contextmanager
def parallel_state(state: ParallelState | None) -> Iterator[ParallelState]:
    """Build layers for ``state`` inside the block (None: rank 0 of 1)."""
    global _STATE
    old, _STATE = _STATE, state or ParallelState()
    try:
        yield _STATE
    finally:
        _STATE = old


@dataclass(frozen=True)
class Shard:
    """This rank's piece of a checkpoint tensor: part ``rank`` of ``parts`` equal parts of
    dimension ``dim``."""

    dim: int
    rank: int
    parts: int

    def bounds(self, shape: tuple[int, ...] | torch.Size, name: str) -> tuple[int, int]:
        """``(start, length)`` along ``dim`` of a tensor of ``shape``; raises
        :class:`ShardingError` naming the tensor when the parts are not equal."""
        size = shape[self.dim]
        if size % self.parts:
            raise ShardingError(
                f"tensor {name!r}: dimension {self.dim % len(shape)} of shape {tuple(shape)} is not divisible by "
                f"--tp-size {self.parts}"
            )
        n = size // self.parts
        return self.rank * n, n

    def index(self, shape: tuple[int, ...] | torch.Size, name: str) -> tuple[slice, ...]:
        """The slice tuple that selects this shard (for safetensors' ``get_slice``)."""
        start, n = self.bounds(shape, name)
        index = [slice(None)] * len(shape)
        index[self.dim] = slice(start, start + n)
        return tuple(index)

    def take(self, tensor: torch.Tensor, name: str) -> torch.Tensor:
        start, n = self.bounds(tensor.shape, name)
        return tensor.narrow(self.dim, start, n)


# -- collectives ------------------------------------------------------------------------------
def _in_cpu_recording() -> bool:
    from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

    from breakgraph.graphs.cpu_graph import OpRecorder

    return any(isinstance(mode, OpRecorder) for mode in _get_current_dispatch_mode_stack())


@graph_break_op(mutates_args=("x",))
def tp_all_reduce_cpu(x: torch.Tensor) -> None:
    """Break: sum ``x`` over the tensor-parallel ranks in place (gloo). A break because the CPU
    graph backend cannot replay a gloo collective (see the module doc); every rank reaches it
    at the same point of the body, at capture and at replay."""
    if _in_cpu_recording():
        raise CollectiveInGraphError(
            "a tensor-parallel all-reduce was called inside a CPU graph segment; gloo collectives cannot be "
            "recorded. Run it under a breakable graph (where it is a break) or eagerly: with --tp-size > 1 on "
            "CPU use --cuda-graph-backend-decode disabled."
        )
    dist.all_reduce(x)


def _all_reduce_cuda(x: torch.Tensor) -> None:
    dist.all_reduce(x)


_all_reduce_cuda_op = register_custom_op(_all_reduce_cuda, name="tp_all_reduce_cuda", mutates_args=("x",))


def tp_all_reduce(x: torch.Tensor) -> torch.Tensor:
    """Sum ``x`` (contiguous) over the tensor-parallel ranks, in place; returns ``x``."""
    if x.is_cuda:
        if torch.compiler.is_compiling():
            _all_reduce_cuda_op(x)
        else:
            dist.all_reduce(x)
    else:
        tp_all_reduce_cpu(x)
    return x


def tp_gather_last_dim(x: torch.Tensor) -> torch.Tensor | None:
    """Concatenate every rank's ``x [..., n]`` along the last dimension on rank 0
    (``[..., n · tp_size]``); other ranks get None. Eager only (the LM head)."""
    x = x.contiguous()
    rank, world = dist.get_rank(), dist.get_world_size()
    parts = [torch.empty_like(x) for _ in range(world)] if rank == 0 else None
    dist.gather(x, parts, dst=0)
    return torch.cat(parts, dim=-1) if parts is not None else None
