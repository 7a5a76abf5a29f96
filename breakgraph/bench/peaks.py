"""The machine's ceilings, measured where the benchmark runs (never typed in): copy bandwidth,
dense bf16 and FP8 matrix rates, and the rate at which a kernel gathers random latent-cache
rows (what sparse MLA past ``index_topk`` does), for a cache of a given size.

Each figure is the median of repeated timed runs on random data after a warm-up. On a
machine without CUDA every figure is NaN (floors are then not meaningful and print as such).
"""

from __future__ import annotations

import functools
import statistics
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Peaks:
    copy_Bps: float  # device-to-device copy, bytes read + written per second
    bf16_flops: float  # dense bf16 matmul, 8192³
    fp8_flops: float  # dense FP8 e4m3 matmul (torch._scaled_mm, bf16 out), 8192³

    def as_dict(self) -> dict:
        return {"copy_TBps": self.copy_Bps / 1e12, "bf16_TFLOPs": self.bf16_flops / 1e12, "fp8_TFLOPs": self.fp8_flops / 1e12}


def _median_seconds(fn, repeats: int = 10, warmup: int = 3) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return statistics.median(times)


def copy_rate(dev: torch.device) -> float:
    """Bytes/s of a device-to-device copy of 1 GiB (bytes read + written), median of timed runs;
    NaN off CUDA."""
    if dev.type != "cuda":
        return float("nan")
    src = torch.empty(1 << 30, dtype=torch.uint8, device=dev).random_()
    dst = torch.empty_like(src)
    return 2 * src.numel() / _median_seconds(lambda: dst.copy_(src))


def measure_peaks(device: torch.device) -> Peaks:
    """Measure :class:`Peaks` on ``device`` (a few seconds, once per process and device; all NaN
    off CUDA)."""
    if device.type != "cuda":
        return Peaks(float("nan"), float("nan"), float("nan"))
    return _cuda_peaks(device.index if device.index is not None else torch.cuda.current_device())


@functools.cache
def _cuda_peaks(device_index: int) -> Peaks:
    dev = torch.device("cuda", device_index)
    copy = copy_rate(dev)
    n = 8192
    a = torch.randn(n, n, device=dev, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=dev, dtype=torch.bfloat16)
    bf16 = 2 * n**3 / _median_seconds(lambda: a @ b)
    a8, b8 = a.to(torch.float8_e4m3fn), b.to(torch.float8_e4m3fn).t().contiguous().t()
    one = torch.ones((), device=dev)
    fp8 = 2 * n**3 / _median_seconds(lambda: torch._scaled_mm(a8, b8, scale_a=one, scale_b=one, out_dtype=torch.bfloat16))
    return Peaks(copy, bf16, fp8)


def gather_bandwidth(device: torch.device, cache_rows: int, row_width: int = 576, keys: int = 2048) -> float:
    """Bytes/s of gathered rows for a kernel that, for each of 2048 tokens, reads ``keys`` random
    rows of a bf16 ``[cache_rows, row_width]`` cache on ``device`` and only sums them (the gather
    limit of sparse attention at few heads: no arithmetic to hide behind; the best of a few tile
    shapes). NaN off CUDA."""
    if device.type != "cuda":
        return float("nan")
    return _cuda_gather(device.index if device.index is not None else torch.cuda.current_device(), cache_rows,
                        row_width, keys)  # fmt: skip


@functools.cache
def _cuda_gather(device_index: int, cache_rows: int, row_width: int, keys: int) -> float:
    from breakgraph.kernels.triton_gather import gather_rows_sum

    dev = torch.device("cuda", device_index)
    tokens = 2048
    g = torch.Generator(device=dev).manual_seed(0)
    cache = torch.randn(cache_rows, row_width, device=dev, dtype=torch.bfloat16, generator=g)
    idx = torch.randint(0, cache_rows, (tokens, keys), device=dev, generator=g, dtype=torch.int32)
    out = torch.empty(tokens, row_width, device=dev, dtype=torch.float32)
    configs = [(8, 4), (16, 4), (16, 8), (32, 8)]  # (rows per load, warps): the ceiling is the best of them
    seconds = min(_median_seconds(lambda c=c: gather_rows_sum(cache, idx, out, *c)) for c in configs)
    return tokens * keys * row_width * cache.element_size() / seconds
