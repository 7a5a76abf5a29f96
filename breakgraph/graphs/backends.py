"""The graph backends by name, prefill and decode: the one registry that the engine's flags
(``--cuda-graph-backend-prefill``, ``--cuda-graph-backend-decode``) and the model runner read.

Each backend is a :class:`Backend`: its name, what it runs, and a builder that makes its
runner from a :class:`GraphSetup` and captures (or compiles) it. A runner has ``run`` (prefill:
``(input_ids, positions, longest) -> hidden``, ``longest`` the batch's longest sequence;
decode: ``(batch) -> hidden``) and ``stats`` (a
:class:`~breakgraph.graphs.stats.GraphStats`); a bucketed one also ``buckets``; one that
changes the model in place also ``close()``, which restores it. Adding a backend is its
runner's module in this folder and an entry here."""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any

import torch

from breakgraph.graphs import regional
from breakgraph.graphs.decode_runner import DecodeGraphRunner
from breakgraph.graphs.prefill_runner import PrefillGraphRunner


@dataclass(frozen=True)
class GraphSetup:
    """What a builder is given. ``model``: the decoder body ``(input_ids, positions) -> hidden``
    (with ``compile_regions()`` for ``torch-compile``); ``buckets``: token counts (prefill) or
    batch sizes (decode) to capture; ``capture_context(n)``: installs a stand-in batch of ``n``
    tokens while a prefill bucket is captured (decode: optional, entered while the graphs of
    ``n`` rows are captured); ``kv_cache`` and ``max_pages``: the paged cache
    a decode graph's static batch points at, and its page-table width; ``length_bounds``:
    shorter sequence lengths to capture graphs for as well (decode: see
    :class:`~breakgraph.graphs.decode_runner.DecodeGraphRunner`; breakable prefill: see
    :class:`~breakgraph.graphs.prefill_runner.PrefillGraphRunner`, whose ``capture_context``
    then also takes the bound); ``warmup``: ``once`` or
    ``every``, and ``prepare``: what runs once before the captures, handed one thunk per
    bucket (see
    :class:`~breakgraph.graphs.prefill_runner.PrefillGraphRunner`)."""

    model: Any
    device: torch.device
    buckets: list[int]
    capture_context: Callable[[int], AbstractContextManager[Any]] | None = None
    fold_islands: bool = False
    kv_cache: Any = None
    max_pages: int = 0
    length_bounds: tuple[int, ...] = ()
    warmup: str = "once"
    prepare: Callable[..., None] | None = None


@dataclass(frozen=True)
class Backend:
    """One backend. ``build`` is None for ``disabled`` (eager); ``bucketed``: it captures
    ``buckets`` (prefill chunks are capped at the largest); ``runs_decode``: a prefill backend
    that runs every forward, decode too (so no decode graphs, and one process)."""

    name: str
    phase: str  # "prefill" or "decode"
    build: Callable[[GraphSetup], Any] | None
    bucketed: bool = True
    runs_decode: bool = False


def _bucketed_prefill(mode: str) -> Callable[[GraphSetup], Any]:
    def build(setup: GraphSetup) -> PrefillGraphRunner:
        assert setup.capture_context is not None
        runner = PrefillGraphRunner(
            setup.model, backend=mode, device=setup.device, buckets=setup.buckets,
            capture_context=setup.capture_context, fold_islands=setup.fold_islands, warmup=setup.warmup,
            prepare=setup.prepare, length_bounds=setup.length_bounds,
        )  # fmt: skip
        runner.capture()
        return runner

    return build


def _regional(setup: GraphSetup) -> regional.RegionalCompileRunner:
    return regional.RegionalCompileRunner(setup.model, **regional.TORCH_COMPILE_KWARGS)


def _full_decode(setup: GraphSetup) -> DecodeGraphRunner:
    runner = DecodeGraphRunner(
        setup.model, setup.kv_cache, setup.device, setup.buckets, max_pages=setup.max_pages, warmup=setup.warmup,
        prepare=setup.prepare, length_bounds=setup.length_bounds, capture_context=setup.capture_context,
    )
    runner.capture()
    return runner


_ALL = (
    Backend("disabled", "prefill", None),
    Backend("breakable", "prefill", _bucketed_prefill("breakable")),
    Backend("piecewise", "prefill", _bucketed_prefill("piecewise")),
    Backend("torch-compile", "prefill", _regional, bucketed=False, runs_decode=True),
    Backend("disabled", "decode", None),
    Backend("full", "decode", _full_decode),
)
BACKENDS: dict[str, dict[str, Backend]] = {
    phase: {b.name: b for b in _ALL if b.phase == phase} for phase in ("prefill", "decode")
}
PREFILL_BACKENDS: tuple[str, ...] = tuple(BACKENDS["prefill"])
DECODE_BACKENDS: tuple[str, ...] = tuple(BACKENDS["decode"])


def lookup(phase: str, name: str) -> Backend:
    """The ``phase`` backend called ``name``; ``ValueError`` naming the flag for an unknown one."""
    if name not in BACKENDS[phase]:
        raise ValueError(f"--cuda-graph-backend-{phase} must be one of {tuple(BACKENDS[phase])}, got {name!r}")
    return BACKENDS[phase][name]
