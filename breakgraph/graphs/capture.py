"""The segment capturer for a device (CPU graphs or CUDA graphs); see :mod:`breakgraph.graphs.segments`."""

from __future__ import annotations

from typing import Any

import torch

from breakgraph.graphs.cuda_segment import CudaSegmentCapturer
from breakgraph.graphs.segments import CpuSegmentCapturer, SegmentCapturer


def make_capturer(
    device: torch.device,
    pool: Any = None,
    *,
    record_ops: bool = False,
    keep_empty_warning: bool = False,
    stream: Any = None,
) -> SegmentCapturer:
    """The capturer for ``device``. ``record_ops`` (CUDA only) also records aten ops so that
    single-kernel segments can be folded; ``keep_empty_warning`` lets torch's "The CUDA Graph is
    empty" warning through (used when empty segments are kept on purpose)."""
    if device.type == "cpu":
        return CpuSegmentCapturer()
    if device.type == "cuda":
        return CudaSegmentCapturer(
            device, pool, record_ops=record_ops, keep_empty_warning=keep_empty_warning, stream=stream
        )
    raise ValueError(f"graph capture supports device 'cuda' or 'cpu', got {device!s}")
