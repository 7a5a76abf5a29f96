"""Compile Triton kernels in worker processes before their first launch.

A Triton kernel compiles (about a second of one CPU core) the first time a process launches one
of its specialisations. Start-up code about to launch dozens of new specialisations one after
another — the FP8 GEMM path timing, :func:`breakgraph.kernels.triton_fp8.tune_fp8_paths` — can
instead

1. run once under :func:`recording`: every launch that would compile is recorded (its
   specialisation as Triton serialises it) and skipped — the kernel does not run and its outputs
   hold whatever their memory held, so only code that cannot fault on such values (no indexing
   by a kernel's output) may run under it;
2. :func:`compile_in_workers`: compile the records in parallel processes into Triton's on-disk
   cache (the workers inherit ``TRITON_CACHE_DIR`` and the rest of the environment);
3. run for real: each compile is now a read of that cache.

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
import time
from collections.abc import Iterator
from concurrent.futures import ProcessPoolExecutor
from typing import Any

logger = logging.getLogger(__name__)

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


def compile_record(record: Record, target: tuple) -> None:
    """Compile one record for ``target`` (``(backend, arch, warp_size)``, the GPU's
    ``triton.backends.compiler.GPUTarget``) into Triton's on-disk cache, as the launch in the
    recording process would have (the same source, signature, constants, attributes and
    options, hence the same cache key). Needs no GPU."""
    import triton
    import triton.language as tl
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    module, name, data = record
    fn: Any = importlib.import_module(module)
    for part in name.split("."):
        fn = getattr(fn, part)
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
    triton.compile(ASTSource(fn, signature, constexprs, attrs), target=GPUTarget(*target), options=options)


def _compile_in_worker(record: Record, target: tuple) -> bool:
    try:
        compile_record(record, target)
        return True
    except Exception:  # the launch compiles it then, and raises what is wrong with it
        return False


def compile_in_workers(records: list[Record], target: tuple, workers: int) -> int:
    """Compile ``records`` in up to ``workers`` spawned processes (see :func:`compile_record`);
    returns how many compiled. Nothing is raised: a record that fails here compiles at its
    launch. Logs the count and the time."""
    if not records:
        return 0
    t0 = time.perf_counter()
    workers = max(1, min(workers, len(records)))
    done = 0
    try:
        context = multiprocessing.get_context("spawn")  # never fork a process that holds CUDA
        with ProcessPoolExecutor(max_workers=workers, mp_context=context) as pool:
            done = sum(pool.map(_compile_in_worker, records, [target] * len(records)))
    except (OSError, RuntimeError) as exc:  # no processes here: each kernel compiles at its launch
        logger.warning("Triton kernels not compiled ahead (%s)", exc)
    logger.info("Triton: %d of %d kernel specialisations compiled ahead in %d processes in %.1fs",
                done, len(records), workers, time.perf_counter() - t0)  # fmt: skip
    return done


def default_workers(share: int = 1) -> int:
    """Worker processes for :func:`compile_in_workers`: the CPUs this process may use, divided
    by ``share`` (processes of one host compiling at once, e.g. tensor-parallel ranks), less one."""
    try:
        cpus = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        cpus = os.cpu_count() or 1
    return max(1, cpus // max(1, share) - 1)
