"""Catch a Triton kernel compile that would happen inside a CUDA-graph capture, before it does.

A Triton kernel is compiled (or read from Triton's disk cache) and loaded the first time its
specialisation is launched in a process; loading a module (``cuModuleLoadData``) is not allowed
while a stream captures, so the capture would fail and leave its memory pool unusable. That is
why a bucket is warmed up (run eagerly once) before its capture. With :func:`compile_guard`
active, a launch that misses Triton's in-process kernel cache on a capturing stream raises
:class:`CompileInCapture` instead, before anything reaches the GPU: the caller aborts that
capture (nothing invalid was recorded, the pool stays usable), warms the bucket up and captures
it again. So only buckets that meet a new kernel specialisation pay a warm-up.

Launches inside a break run on a stream that is not capturing at that moment and compile as usual.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch

from breakgraph.kernels.precompile import triton_runtime_knobs as _runtime_knobs


class CompileInCapture(Exception):
    """A Triton kernel would have compiled or loaded inside a CUDA-graph capture (``kernel``: its name)."""

    def __init__(self, kernel: str) -> None:
        super().__init__(f"Triton kernel {kernel} is not compiled yet: it cannot compile inside a capture")
        self.kernel = kernel


class UnwarmedCaptureFailed(Exception):
    """A capture that ran without a warm-up failed (``error``: why): on CUDA, something other
    than a Triton kernel may have initialised lazily inside it, and its memory pool refuses new
    captures; the runner captures everything again, each after a warm-up, in a new pool (an
    error that is not about the warm-up then comes again, from a warmed capture)."""

    def __init__(self, what: str, error: BaseException) -> None:
        first = str(error).splitlines()[0] if str(error) else repr(error)
        super().__init__(f"{what}, captured without a warm-up, failed: {first}")
        self.error = error


@contextlib.contextmanager
def compile_guard() -> Iterator[bool]:
    """Within the block, a Triton kernel-cache miss on a capturing CUDA stream raises
    :class:`CompileInCapture` (a hook installed before it is chained). Yields whether the guard
    is active; without it (no Triton, or one without the hook) a caller must warm up every
    capture."""
    runtime = _runtime_knobs()
    if runtime is None:
        yield False
        return
    previous = runtime.jit_cache_hook

    def hook(**kwargs: Any) -> Any:
        if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
            info = kwargs.get("fn")
            raise CompileInCapture(str(getattr(info, "name", info)))
        return previous(**kwargs) if previous is not None else None

    runtime.jit_cache_hook = hook
    try:
        yield True
    finally:
        runtime.jit_cache_hook = previous
