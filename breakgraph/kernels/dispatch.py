"""Which implementation a kernel call takes: Triton on CUDA tensors, else the plain-PyTorch twin.

``BREAKGRAPH_KERNELS=torch`` forces the twins everywhere (debugging, bisecting a kernel).
Decided once at import, so ``torch.compile`` sees a constant.
"""

from __future__ import annotations

import functools
import importlib.util
import os

import torch

from breakgraph import env
from breakgraph.graphs.cuda_segment import device_index


def interpreting() -> bool:
    """True when Triton runs kernels through its CPU interpreter."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


#: Score rows longer than this many keys take the split top-k select on CUDA (several programs
#: per row, for few rows: :func:`breakgraph.kernels.triton_topk.default_method`), a choice made
#: on the host from the score buffer's width, which follows the batch's longest sequence.
SPLIT_SELECT_MIN_KEYS = 16384

TRITON_ENABLED = (
    importlib.util.find_spec("triton") is not None and env.read("BREAKGRAPH_KERNELS") != "torch"
)


def use_triton(t: torch.Tensor) -> bool:
    """True when ``t`` lives on a CUDA device and Triton kernels are enabled."""
    return t.is_cuda and TRITON_ENABLED


def use_triton_inference(*tensors: torch.Tensor | None) -> bool:
    """:func:`use_triton` for the first tensor, and no autograd recording through any of them:
    for kernels without a backward (training forwards take the twin)."""
    if not use_triton(tensors[0]):
        return False
    return not (torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors))


def num_sms(device: torch.device) -> int:
    """Streaming multiprocessors of ``device``; 132 (an H200's) off CUDA, where only Triton's
    interpreter and the tile-choice tests ask."""
    if device.type != "cuda":
        return 132
    return _cuda_sms(device_index(device))


@functools.cache
def _cuda_sms(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count
