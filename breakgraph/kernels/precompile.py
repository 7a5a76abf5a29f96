"""Compile Triton kernels in worker processes before their first launch.

A Triton kernel compiles (about a second of one CPU core) the first time a process launches one
of its specialisations. Start-up code about to launch dozens of new specialisations one after
another — the FP8 GEMM path timing (:func:`breakgraph.kernels.triton_fp8.tune_fp8_paths`), a
graph runner's warm-up before a capture — can instead

1. run once under :func:`recording`: every launch that would compile is recorded (its
   specialisation as Triton serialises it) and skipped — the kernel does not run, and its outputs
   hold zeros where they were allocated under :func:`zero_fill`
   (:meth:`AheadCompiler.run_dry` does both), so code that indexes by a kernel's output stays in
   its buffers;
2. compile the records in parallel processes (:class:`AheadCompiler`) into Triton's on-disk
   cache (the workers inherit ``TRITON_CACHE_DIR`` and the rest of the environment);
3. load them into the process (:func:`load_record`, after a dry run): the real run's launches
   then find them in the process's own kernel cache, so a graph capture that follows needs no
   warm-up for them (otherwise each is a read of the disk cache at its first launch).

A record a worker fails on, or compiles under another cache key, costs only its compile at the
launch, as without this module.
"""

from __future__ import annotations

import contextlib
import importlib
import json
import logging
import multiprocessing
import os
import sys
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures import TimeoutError as FuturesTimeout
from typing import Any

logger = logging.getLogger(__name__)

#: Seconds one batch of records may take in the workers before the rest compile at their launch.
COMPILE_TIMEOUT_S = 300
#: (module, qualified name of the ``@triton.jit`` function, Triton's specialization data JSON)
Record = tuple[str, str, str]


def triton_runtime_knobs() -> Any:
    """``triton.knobs.runtime`` where it has ``jit_cache_hook`` (Triton 3.4 and later), else None."""
    try:
        from triton import knobs
    except ImportError:
        return None
    runtime = getattr(knobs, "runtime", None)
    return runtime if runtime is not None and hasattr(runtime, "jit_cache_hook") else None


@contextlib.contextmanager
def recording() -> Iterator[list[Record] | None]:
    """Within the block, a Triton launch that would compile is recorded and skipped (see the
    module docstring). Yields the list the records go to (each specialisation once), or None
    where the installed Triton has no ``knobs.runtime.jit_cache_hook`` (launches then compile
    and run as usual)."""
    runtime = triton_runtime_knobs()
    if runtime is None:
        yield None
        return
    previous = runtime.jit_cache_hook
    records: list[Record] = []
    seen: set[tuple[str, str, str]] = set()

    def hook(**kwargs: Any) -> bool:
        if previous is not None and previous(**kwargs):
            return True
        fn, key = kwargs["fn"], str(kwargs["key"])
        if (fn.module, fn.name, key) not in seen:
            seen.add((fn.module, fn.name, key))
            records.append((fn.module, fn.name, kwargs["compile"]["specialization_data"]))
        return True  # Triton then neither compiles nor launches

    runtime.jit_cache_hook = hook
    try:
        yield records
    finally:
        runtime.jit_cache_hook = previous


def _tuples(value: Any) -> Any:
    return tuple(_tuples(v) for v in value) if isinstance(value, list) else value


def _jit_function(module: str, name: str) -> Any:
    """The ``@triton.jit`` function a record names."""
    fn: Any = importlib.import_module(module)
    for part in name.split("."):
        fn = getattr(fn, part)
    return fn


def load_record(record: Record) -> bool:
    """Put one compiled record into this process's kernel cache (Triton's ``preload``: a read
    of the on-disk cache, or a compile where it misses) and load its module on the current GPU,
    as its first launch would. Without this a launch finds the kernel on disk only after a
    miss in the process's own cache — which a graph capture's guard takes for a compile.
    Returns whether it loaded; a failure leaves the kernel to its first launch."""
    try:
        kernel = _jit_function(record[0], record[1]).preload(record[2])
    except Exception as exc:  # a record this Triton cannot load: only a head start
        logger.debug("Triton kernel %s not loaded ahead (%s)", record[1], exc)
        return False
    if kernel is None:  # a jit_cache_hook (a recording, a capture's guard) took the compile
        return False
    try:
        kernel._init_handles()  # the module on the GPU and its launcher now, not at the first launch
    except Exception as exc:  # private API; the first launch does it then
        logger.debug("Triton kernel %s cached but its module not loaded ahead (%s)", record[1], exc)
    return True


def compile_record(record: Record, target: tuple) -> None:
    """Compile one record for ``target`` (``(backend, arch, warp_size)``, the GPU's
    ``triton.backends.compiler.GPUTarget``) into Triton's on-disk cache, as the launch in the
    recording process would have (the same source, signature, constants, attributes and
    options, hence the same cache key), and, where this process has the GPU's driver, build the
    kernel's launcher into that cache as well (:func:`load_record` then only loads it). The
    compile needs no GPU."""
    import triton
    import triton.language as tl
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    module, name, data = record
    fn = _jit_function(module, name)
    spec = json.loads(data)

    def constant(value: Any) -> Any:
        if tl.dtype.is_dtype(value):
            return tl.dtype(value)
        if isinstance(value, dict) and "constexpr" in value:
            return tl.constexpr(value["constexpr"])
        return value

    constexprs = {tuple(k): constant(v) for k, v in zip(spec["constant_keys"], spec["constant_vals"])}
    attrs = {tuple(k): v for k, v in zip(spec["attrs_keys"], spec["attrs_vals"])}
    signature = {k: _tuples(v) for k, v in spec["signature"].items()}
    options = {k: _tuples(v) for k, v in spec["options"].items()}
    kernel = triton.compile(ASTSource(fn, signature, constexprs, attrs), target=GPUTarget(*target), options=options)
    try:  # its launcher too (a C module built per signature, cached on disk like the kernel)
        triton.runtime.driver.active.launcher_cls(kernel.src, kernel.metadata)
    except Exception:  # no GPU driver here: the process that loads the kernel builds it
        pass


def _compile_in_worker(record: Record, target: tuple) -> bool:
    try:
        compile_record(record, target)
        return True
    except Exception:  # the launch compiles it then, and raises what is wrong with it
        return False


def _import_in_worker() -> None:
    import breakgraph.kernels.triton_fp8  # noqa: F401  (torch and triton: a worker's slow part)


_EMPTY_OPS = ("empty.memory_format", "empty_strided.default", "empty_like.default", "new_empty.default",
              "new_empty_strided.default")  # fmt: skip


@contextlib.contextmanager
def zero_fill() -> Iterator[None]:
    """Within the block every tensor allocated through the dispatcher (``torch.empty`` and kin)
    starts zeroed: what a skipped kernel leaves in its outputs is then zeros, which later code
    may use as indices or counts without leaving its buffers."""
    from torch.utils._python_dispatch import TorchDispatchMode

    empties = {f"aten.{op}" for op in _EMPTY_OPS}  # by name: overload objects can be re-made

    class ZeroFill(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[override]
            out = func(*args, **(kwargs or {}))
            if str(func) in empties:
                out.zero_()
            return out

    with ZeroFill():
        yield


@contextlib.contextmanager
def _main_not_inherited() -> Iterator[None]:
    """Processes spawned within do not import the caller's ``__main__`` (a script that builds an
    engine at top level would otherwise build one in every worker); they run this module only."""
    main = sys.modules.get("__main__")
    saved = {k: main.__dict__[k] for k in ("__spec__", "__file__") if main is not None and k in main.__dict__}
    try:
        if main is not None:
            main.__dict__["__spec__"] = None
            main.__dict__.pop("__file__", None)
        yield
    finally:
        if main is not None:
            main.__dict__.update(saved)


class AheadCompiler:
    """Worker processes that compile recorded Triton specialisations into the disk cache, kept
    for one start-up: spawned at construction (they import torch and Triton meanwhile), closed
    by :meth:`close`. Every failure is logged and leaves the kernels to compile at their launch."""

    def __init__(self, workers: int, target: tuple | None = None) -> None:
        self.workers = workers
        self.target = target  # (backend, arch, warp size); None: this process's GPU
        self.recorded = self.compiled = self.loaded = 0
        self.seconds = 0.0
        self._pool: ProcessPoolExecutor | None = None
        try:
            context = multiprocessing.get_context("spawn")  # never fork a process that holds CUDA
            self._pool = ProcessPoolExecutor(max_workers=workers, mp_context=context)
            with _main_not_inherited():
                for _ in range(workers):  # starts every worker now
                    self._pool.submit(_import_in_worker)
        except Exception as exc:  # e.g. a daemonic process may not have children
            logger.warning("Triton kernels will not be compiled ahead (%s)", exc)
            self._pool = None

    def compile(self, records: list[Record]) -> int:
        """Compile ``records`` in the workers for this process's GPU (waits); returns how many compiled."""
        return len(self._compile_each(records))

    def _compile_each(self, records: list[Record]) -> list[Record]:
        """:meth:`compile`, returning the records that compiled."""
        if self._pool is None or not records:
            return []
        if self.target is None:
            import triton

            t = triton.runtime.driver.active.get_current_target()
            self.target = (t.backend, t.arch, t.warp_size)
        t0 = time.perf_counter()
        try:
            ok = list(self._pool.map(_compile_in_worker, records, [self.target] * len(records), timeout=COMPILE_TIMEOUT_S))
            done = [r for r, compiled in zip(records, ok) if compiled]
        except (OSError, RuntimeError, FuturesTimeout) as exc:  # a broken pool is a RuntimeError
            logger.warning("Triton kernels no longer compiled ahead (%s)", exc)
            self._pool, done = None, []
        self.recorded, self.compiled = self.recorded + len(records), self.compiled + len(done)
        self.seconds += time.perf_counter() - t0
        return done

    def run_dry(self, *thunks: Callable[[], Any]) -> None:
        """Run each of ``thunks`` once with every Triton launch that would compile recorded and
        skipped (:func:`recording`) and new tensors zeroed (:func:`zero_fill`), then compile
        what they recorded in the workers, in one batch (one wait for the slowest compile, not
        one per thunk). A thunk must need no kernel's results on the host (graph-safe code:
        what it launches depends on shapes and host metadata only). An error in one is logged;
        the others still run, and what was recorded is compiled."""
        if self._pool is None:
            return
        with recording() as records:
            if records is None:
                return
            for thunk in thunks:
                try:
                    with zero_fill():
                        thunk()
                except Exception as exc:  # only a head start: the real run that follows decides
                    logger.warning("a dry run for compiling ahead stopped (%s)", exc)
        compiled = self._compile_each(records)  # only these: loading another would compile it here
        t0 = time.perf_counter()
        self.loaded += sum(load_record(r) for r in compiled)
        self.seconds += time.perf_counter() - t0

    def close(self) -> None:
        """Stop the workers and log what they compiled."""
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
            self._pool = None
        if self.recorded:
            logger.info("Triton: %d of %d kernel specialisations compiled ahead in %d processes, %d loaded (%.1fs "
                        "waited for them)", self.compiled, self.recorded, self.workers, self.loaded, self.seconds)  # fmt: skip


def default_workers(share: int = 1) -> int:
    """Worker processes for an :class:`AheadCompiler`: the CPUs this process may use, divided
    by ``share`` (processes of one host compiling at once, e.g. tensor-parallel ranks), less one."""
    try:
        cpus = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        cpus = os.cpu_count() or 1
    return max(1, cpus // max(1, share) - 1)
