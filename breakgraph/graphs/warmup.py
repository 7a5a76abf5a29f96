"""Capturing a ladder of graphs with as few warm-ups as is safe (``--cuda-graph-warmup``).

A warm-up runs a bucket eagerly before its capture so that whatever initialises lazily (Triton
kernel compiles above all) happens outside the capture. The prefill and decode runners share
the policy written here:

* ``every``: each bucket is warmed up before its capture;
* ``once``: only the first (largest) bucket is; a later capture that meets a kernel not yet
  compiled is stopped before it records anything (:func:`~breakgraph.graphs.jit_guard.compile_guard`
  raises :class:`~breakgraph.graphs.jit_guard.CompileInCapture`), warmed up and captured again.
  Any other failure of a capture that ran without a warm-up leaves its pool unusable, so the
  whole ladder is captured again, every bucket warmed, in a new pool (logged).

On CUDA without the guard (a Triton without the hook) ``once`` behaves as ``every``.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable, Sequence
from typing import TypeVar

import torch

from breakgraph.graphs.jit_guard import CompileInCapture, UnwarmedCaptureFailed, compile_guard

logger = logging.getLogger(__name__)

WARMUPS = ("once", "every")  # --cuda-graph-warmup
T = TypeVar("T")


def check_warmup(warmup: str) -> None:
    """Raise a ValueError naming ``--cuda-graph-warmup`` unless ``warmup`` is one of :data:`WARMUPS`."""
    if warmup not in WARMUPS:
        raise ValueError(f"--cuda-graph-warmup must be one of {WARMUPS}, got {warmup!r}")


def capture_ladder(
    sizes: Sequence[int],
    capture_one: Callable[[int, bool], None],
    restart: Callable[[], None],
    *,
    warmup: str,
    device: torch.device,
    what: str,
    iterate: Callable[[Sequence[int]], Iterable[int]] = iter,
    retry: bool = True,
    label: Callable[[int], str] = str,
) -> None:
    """Call ``capture_one(size, warm)`` for each of ``sizes`` in order (callers pass largest
    first, so smaller buckets reuse the pool), ``warm`` per the policy above. ``what`` names a
    size in the log ("prefill bucket", "decode batch size"); ``iterate`` wraps the sizes (a
    progress bar); ``label(size)``: how the log writes a size after ``what``; ``restart()`` drops
    every capture and opens a new pool before the second pass.
    ``retry = False``: a failed capture is raised as it is (captures that warm themselves up)."""
    check_warmup(warmup)

    def one_pass(every: bool) -> None:
        for i, size in enumerate(iterate(sizes)):
            warm = every or i == 0
            try:
                capture_one(size, warm)
            except RuntimeError as exc:  # GraphError included
                if warm or not retry:
                    raise
                raise UnwarmedCaptureFailed(f"{what} {label(size)}", exc) from exc

    with compile_guard() as guarded:
        every = warmup == "every" or (device.type == "cuda" and not guarded)
        try:
            one_pass(every)
        except UnwarmedCaptureFailed as exc:  # the guard sees Triton only
            logger.warning("%s; capturing every %s again, each after a warm-up, in a new pool", exc, what)
            restart()
            one_pass(True)


def warm_then_capture(warm: bool, warm_up: Callable[[], None], capture: Callable[[], T], what: str) -> tuple[T, float, int]:
    """``capture()``'s result, after ``warm_up()`` when ``warm``; a capture stopped by
    :class:`CompileInCapture` is warmed up and tried once more (a warmed capture that meets
    one is an error: its warm-up compiled what it runs). Returns (result, warm-up seconds,
    warm-ups run). ``warm_up`` must leave the device idle (synchronise)."""
    warmup_s, warmups = 0.0, 0
    while True:
        if warm:
            t0 = time.perf_counter()
            warm_up()
            warmup_s += time.perf_counter() - t0
            warmups += 1
        try:
            return capture(), warmup_s, warmups
        except CompileInCapture as exc:
            if warm:
                raise
            logger.debug("%s: %s; warming it up and capturing again", what, exc)
            warm = True
