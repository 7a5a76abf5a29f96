"""Which GEMM runs an FP8 block-scaled linear of a given shape on this GPU.

Three paths compute the product: cuBLASLt's blockwise ``torch._scaled_mm`` and the Triton GEMM
of :mod:`breakgraph.kernels.triton_fp8` on activations quantised per token and 128 columns
(W8A8: a quantisation kernel, then the GEMM), and the Triton GEMM on the bf16 activations with
each weight tile dequantised in registers (W8A16: one kernel, no quantisation). None wins
everywhere: on the H200 (torch 2.11, CUDA 13) W8A16 or W8A8 Triton win at decode's few rows, the
Triton GEMM up to a few hundred rows (cuBLAS has no split-K for small ``M``) and cuBLAS from
there on, with the crossovers depending on ``K`` and ``N`` (``scripts/bench_kernels_moe.py
--only dense`` prints all three). So the choice is a table per ``(K, N)``: for each row-count
bucket, the path that measured fastest, timed once per process at start-up
(:func:`breakgraph.kernels.triton_fp8.tune_fp8_paths`, outside any CUDA-graph capture, each
path replayed from a CUDA graph as the engine runs it).
A shape that was not tuned takes W8A8: ``_scaled_mm`` from :data:`UNTUNED_SCALED_MM_MIN_M`
rows (where cuBLAS can run it), else the Triton GEMM.

W8A16 keeps the activations' bf16 precision (closer to a bf16 reference than W8A8, by the
≈ 2.5% that e4m3 activations cost on random data), so rows of different buckets may take
numerically different paths, as they already take different kernels.
"""

from __future__ import annotations

#: Row-count buckets of the table; ``M`` uses the largest timed bucket ``<= M`` (:func:`choose`).
M_BUCKETS = (1, 16, 64, 128, 256, 512, 1024, 2048, 4096, 8192)
#: Rows from which an untuned shape takes ``_scaled_mm`` (where cuBLAS is usable at all).
UNTUNED_SCALED_MM_MIN_M = 1024

# (device index, K, N) -> ((bucket, path), ...) in ascending bucket order
_TABLES: dict[tuple[int, int, int], tuple[tuple[int, str], ...]] = {}


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


PATHS = ("scaled_mm", "triton", "triton_w8a16")
#: Largest bucket at which W8A16 is timed: on the H200 it won only below 64 rows (below 512 for
#: the 256-deep shared-expert down projection), and each timed bucket compiles one more GEMM.
W8A16_MAX_M = 256


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
