"""Which implementation a kernel call takes: Triton on CUDA tensors, else the plain-PyTorch twin.

``BREAKGRAPH_KERNELS=torch`` forces the twins everywhere (debugging, bisecting a kernel).
"""

from __future__ import annotations

import functools
import importlib.util
import os

import torch


@functools.cache
def triton_available() -> bool:
    return importlib.util.find_spec("triton") is not None and os.environ.get("BREAKGRAPH_KERNELS", "auto") != "torch"


def use_triton(t: torch.Tensor) -> bool:
    """True when ``t`` lives on a CUDA device and Triton kernels are enabled."""
    return t.is_cuda and triton_available()
