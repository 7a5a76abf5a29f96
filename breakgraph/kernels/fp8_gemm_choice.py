"""Which GEMM runs an FP8 block-scaled linear of a given shape on this GPU.

Five paths compute the product: cuBLASLt's blockwise ``torch._scaled_mm`` and the Triton GEMM
of :mod:`breakgraph.kernels.triton_fp8` on activations quantised per token and 128 columns
(W8A8: a quantisation kernel, then the GEMM, or the producer's codes), the same GEMM
quantising its activation tiles itself where no producer's codes come (the same codes and
scales, so the same result, one launch fewer; up to :data:`FUSED_QUANT_MAX_M` rows), the
Triton GEMM on the bf16 activations with
each weight tile dequantised in registers (W8A16: one kernel, no quantisation), and for few
rows the GEMV of :mod:`breakgraph.kernels.triton_fp8_gemv` (bf16 activations, the weights
decoded by integer operations, K split over many programs; timed unless
``BREAKGRAPH_FP8_GEMV=0``). None wins
everywhere: on the H200 (torch 2.11, CUDA 13) W8A16 or W8A8 Triton win at decode's few rows, the
Triton GEMM up to a few hundred rows (cuBLAS has no split-K for small ``M``) and cuBLAS from
there on, with the crossovers depending on ``K`` and ``N`` (``scripts/bench_kernels_moe.py
--only dense`` prints all three). So the choice is a table per ``(K, N)``: for each row-count
bucket, the path that measured fastest, timed once per process at start-up
(:func:`breakgraph.kernels.triton_fp8.tune_fp8_paths`, outside any CUDA-graph capture, each
path replayed from a CUDA graph as the engine runs it; with ``BREAKGRAPH_FP8_TIMING_COLD=1``
over copies of the weight that do not fit in L2 together, so that every call reads its weight
from memory as a decode step does).
A shape that was not tuned takes W8A8: ``_scaled_mm`` from :data:`UNTUNED_SCALED_MM_MIN_M`
rows (where cuBLAS can run it), else the Triton GEMM.

The measured tables are kept on disk (:func:`load_or_tune`), one JSON file per GPU model,
torch / Triton / CUDA versions and timed buckets, under :func:`cache_dir`
(``$BREAKGRAPH_CACHE_DIR``, else ``$XDG_CACHE_HOME/breakgraph``, else ``~/.cache/breakgraph``;
``BREAKGRAPH_CACHE_DIR=off`` keeps nothing): a second start on the same machine times only the
shapes the file lacks. Deleting the folder is always safe; a file that cannot be read is
logged and measured again.

W8A16 and the GEMV keep the activations' bf16 precision (closer to a bf16 reference than W8A8,
by the ≈ 2.5% that e4m3 activations cost on random data), so rows of different buckets may take
numerically different paths, as they already take different kernels.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import tempfile
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

Table = tuple[tuple[int, str], ...]

#: Row-count buckets of the table; ``M`` uses the largest timed bucket ``<= M`` (:func:`choose`).
M_BUCKETS = (1, 16, 64, 128, 256, 512, 1024, 2048, 4096, 8192)
#: Rows from which an untuned shape takes ``_scaled_mm`` (where cuBLAS is usable at all).
UNTUNED_SCALED_MM_MIN_M = 1024

# (device index, K, N) -> ((bucket, path), ...) in ascending bucket order
_TABLES: dict[tuple[int, int, int], tuple[tuple[int, str], ...]] = {}


def timed_buckets(max_m: int) -> list[int]:
    """The row-count buckets the start-up timing measures for rows up to ``max_m``."""
    return [b for b in M_BUCKETS if b <= max(1, max_m)]


def table_from_timings(timings: dict[int, dict[str, float]]) -> tuple[tuple[int, str], ...]:
    """``{bucket: {path: seconds}}`` → ``((bucket, fastest path), ...)`` by ascending bucket.

    A path whose time is missing or not finite (it failed) never wins; a bucket where every
    path failed is left out (its rows use the next lower bucket's choice)."""
    table = []
    for bucket in sorted(timings):
        ok = {p: t for p, t in timings[bucket].items() if t == t and t != float("inf")}
        if ok:
            table.append((bucket, min(sorted(ok), key=ok.__getitem__)))
    return tuple(table)


PATHS = ("scaled_mm", "triton", "triton_w8a16", "triton_gemv", "triton_fused_quant")
#: Largest bucket at which W8A16 is timed: on the H200 it won only below 64 rows (below 512 for
#: the 256-deep shared-expert down projection), and each timed bucket compiles one more GEMM.
W8A16_MAX_M = 256
#: Largest bucket at which the few-row GEMV (:mod:`breakgraph.kernels.triton_fp8_gemv`) is timed.
GEMV_MAX_M = 64
#: Largest bucket at which the Triton W8A8 GEMM that quantises its activations itself is timed,
#: and the most rows it quantises itself (more take the quantisation kernel): each of its
#: programs quantises the activation tiles it reads, which the column tiles of a few rows repeat
#: cheaply (it saves the quantisation kernel's launch), many rows not.
FUSED_QUANT_MAX_M = 64
_MAX_M = {"triton_w8a16": W8A16_MAX_M, "triton_gemv": GEMV_MAX_M, "triton_fused_quant": FUSED_QUANT_MAX_M}


def timed_paths() -> tuple[str, ...]:
    """The paths the start-up timing tries: :data:`PATHS`, the GEMV only with
    ``BREAKGRAPH_FP8_GEMV=1`` and the self-quantising W8A8 GEMM only with
    ``BREAKGRAPH_FP8_FUSED_QUANT=1`` (both the default)."""
    from breakgraph import env

    off = {p for p, knob in (("triton_gemv", "BREAKGRAPH_FP8_GEMV"), ("triton_fused_quant", "BREAKGRAPH_FP8_FUSED_QUANT"))
           if env.read(knob) == "0"}  # fmt: skip
    return tuple(p for p in PATHS if p not in off)


def cold_timing() -> bool:
    """Whether each timed graph cycles through weight copies past L2 (``BREAKGRAPH_FP8_TIMING_COLD=1``;
    the default; ``0``: one weight, replayed)."""
    from breakgraph import env

    return env.read("BREAKGRAPH_FP8_TIMING_COLD") == "1"


def timed_at(path: str, bucket: int) -> bool:
    """Whether the start-up timing tries ``path`` at row-count ``bucket`` (the bf16-activation
    paths only up to their largest bucket, :data:`W8A16_MAX_M`, :data:`GEMV_MAX_M` and
    :data:`FUSED_QUANT_MAX_M`)."""
    return bucket <= _MAX_M.get(path, bucket)


def choose(m: int, k: int, n: int, device_index: int, scaled_mm_ok: bool) -> str:
    """One of :data:`PATHS` for an ``[m, k] @ [k, n]`` FP8 linear on that device, from the
    tuned table, else ``"scaled_mm"`` from :data:`UNTUNED_SCALED_MM_MIN_M` rows
    where ``scaled_mm_ok`` (cuBLAS can run the shape), else ``"triton"``."""
    table = _TABLES.get((device_index, k, n))
    if not table:
        return "scaled_mm" if scaled_mm_ok and m >= UNTUNED_SCALED_MM_MIN_M else "triton"
    path = table[0][1]
    for bucket, p in table:
        if bucket <= m:
            path = p
    return path


def set_table(device_index: int, k: int, n: int, table: tuple[tuple[int, str], ...]) -> None:
    """Record the choice table of one shape (what the start-up timing measured, or a test's)."""
    _TABLES[(device_index, k, n)] = tuple(table)


def clear_tables() -> None:
    """Forget every tuned table (tests)."""
    _TABLES.clear()


def describe(table: tuple[tuple[int, str], ...]) -> str:
    """``"triton M<1024, scaled_mm M>=1024"``-style summary of a choice table."""
    runs: list[tuple[int, str]] = []
    for bucket, path in table:
        if not runs or runs[-1][1] != path:
            runs.append((bucket, path))
    parts = []
    for i, (start, path) in enumerate(runs):
        end = runs[i + 1][0] if i + 1 < len(runs) else None
        lo = f"M>={start}" if i else ""
        hi = f"M<{end}" if end is not None else ""
        parts.append(f"{path} {' '.join(s for s in (lo, hi) if s) or 'all M'}")
    return ", ".join(parts)


# --------------------------------------------------------------------------------------------
# the on-disk cache of measured tables

#: Bumped when the meaning of a cached table changes (paths, buckets, how they are timed).
CACHE_FORMAT = 1


def cache_dir() -> Path | None:
    """Where start-up measurements are kept: ``$BREAKGRAPH_CACHE_DIR``, else
    ``$XDG_CACHE_HOME/breakgraph``, else ``~/.cache/breakgraph``; None when
    ``BREAKGRAPH_CACHE_DIR`` is ``off``."""
    from breakgraph import env

    chosen = env.read("BREAKGRAPH_CACHE_DIR")
    if chosen == "off":
        return None
    if chosen:
        return Path(chosen).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg) if xdg else Path.home() / ".cache") / "breakgraph"


def environment_key(device: Any, max_m: int) -> dict[str, Any]:
    """What a measured table depends on besides its shape: the GPU model of CUDA ``device``,
    the torch, CUDA and Triton versions, the timed buckets and paths, L2-cold timing where it is
    on, :data:`CACHE_FORMAT`."""
    import torch
    import triton

    props = torch.cuda.get_device_properties(device)
    paths = timed_paths()
    key = {
        "format": CACHE_FORMAT,
        "gpu": props.name,
        "capability": f"{props.major}.{props.minor}",
        "sms": props.multi_processor_count,
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "triton": triton.__version__,
        "buckets": timed_buckets(max_m),
        "paths": list(paths),
        "w8a16_max_m": W8A16_MAX_M,
    }
    if "triton_gemv" in paths:  # keys without the switches on stay what they were
        key["gemv_max_m"] = GEMV_MAX_M
    if "triton_fused_quant" in paths:
        key["fused_quant_max_m"] = FUSED_QUANT_MAX_M
    if cold_timing():
        key["cold_weights"] = True
    return key


def cache_file(root: Path, key: dict[str, Any]) -> Path:
    """The file under ``root`` that holds the tables measured under ``key``."""
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
    return root / "fp8_gemm_choice" / f"{digest}.json"


def _read_tables(path: Path, key: dict[str, Any]) -> dict[tuple[int, int], Table]:
    """The tables in ``path`` (``{}`` when it does not exist); ``ValueError`` when it is not a
    file this module wrote for ``key``."""
    try:
        text = path.read_text()
    except FileNotFoundError:
        return {}
    data = json.loads(text)  # JSONDecodeError is a ValueError
    if not isinstance(data, dict) or data.get("key") != key or not isinstance(data.get("tables"), list):
        raise ValueError("not a table file of this GPU and these versions")
    tables: dict[tuple[int, int], Table] = {}
    for entry in data["tables"]:
        k, n, rows = entry["k"], entry["n"], entry["table"]
        table = tuple((int(bucket), str(path_)) for bucket, path_ in rows)
        if not isinstance(k, int) or not isinstance(n, int) or any(p not in PATHS for _, p in table):
            raise ValueError(f"bad entry {entry!r}")
        if [b for b, _ in table] != sorted({b for b, _ in table}):
            raise ValueError(f"buckets out of order in {entry!r}")
        tables[(k, n)] = table
    return tables


def _write_tables(path: Path, key: dict[str, Any], tables: dict[tuple[int, int], Table]) -> None:
    """Write ``tables`` to ``path`` atomically (a reader never sees half a file)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    body = {
        "key": key,
        "tables": [{"k": k, "n": n, "table": [list(row) for row in t]} for (k, n), t in sorted(tables.items())],
    }
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name, suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(body, f, indent=1)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def load_or_tune(
    shapes: Iterable[tuple[int, int]],
    key: dict[str, Any],
    tune: Callable[[set[tuple[int, int]]], dict[tuple[int, int], Table]],
    root: Path | None,
) -> tuple[dict[tuple[int, int], Table], int]:
    """The choice table of every ``(K, N)`` in ``shapes``: read from the cache file of ``key``
    under ``root`` where it holds them, measured by ``tune(missing shapes)`` otherwise (then the
    file is rewritten with both). Returns ``(tables, how many came from the file)``.

    ``root`` None: no file, every shape is measured. A file that cannot be read or was not
    written for ``key`` is logged and measured over; one that cannot be written is logged (the
    tables still hold for this process). Does not record the tables (:func:`set_table`)."""
    wanted = set(shapes)
    path = cache_file(root, key) if root is not None else None
    cached: dict[tuple[int, int], Table] = {}
    if path is not None:
        try:
            cached = _read_tables(path, key)
        except (OSError, ValueError, KeyError, TypeError) as exc:
            logger.warning("FP8 GEMM choice cache %s is unreadable (%s): measuring again", path, exc)
            cached = {}
    hits = {s: cached[s] for s in wanted if s in cached}
    missing = wanted - set(hits)
    measured = tune(missing) if missing else {}
    if path is not None and missing:
        try:
            _write_tables(path, key, {**cached, **measured})
        except OSError as exc:
            logger.warning("FP8 GEMM choice cache %s could not be written (%s)", path, exc)
    return {**hits, **{s: measured[s] for s in missing if s in measured}}, len(hits)
