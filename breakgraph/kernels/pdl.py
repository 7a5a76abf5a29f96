"""Programmatic dependent launch (PDL) for the Triton kernels of a decode step or a short prefill.

A decode step (or a short prefill) is a chain of a few thousand short kernels; between two of them the GPU idles
while the second launches, and each kernel then waits on its first memory loads. With PDL
(Hopper and later) a kernel is launched while the one before it still runs: it loads what no
earlier kernel writes (its weights) and then blocks in ``griddepcontrol.wait`` until the kernel
before it has finished and its stores are visible. Right after that wait it lets the kernel
after it launch in turn, so at most one kernel waits ahead of the one that runs.

The contract for a kernel that takes ``PDL``: before :func:`pdl_wait` it reads only tensors no
kernel of the step writes (weights, scales, constants) and writes nothing; everything else
comes after. Such a kernel is launched with ``**pdl_launch(device)``. Kernels that do not take
part (cuBLAS, PyTorch's own) keep the plain stream order, and a PDL kernel after one of them
still waits for it to finish, so mixing both is safe. CUDA graphs keep the dependency as a
programmatic edge.

``BREAKGRAPH_PDL``: ``1`` on CUDA devices of compute capability 9.0 or more (older GPUs cannot
launch this way), ``0`` never, ``auto`` only inside :func:`~breakgraph.kernels.pdl_scope.pdl_scope`
``(True)`` — which the engine opens while it captures a decode graph of at most
``PDL_AUTO_MAX_ROWS`` rows and while it captures or runs a prefill of at most
``PDL_AUTO_MAX_PREFILL_TOKENS`` tokens, the sizes where PDL measured faster (a graph keeps the
launch mode it was captured with).
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from breakgraph import env
from breakgraph.graphs.cuda_segment import device_index
from breakgraph.kernels.pdl_scope import in_pdl_scope


@triton.jit
def pdl_wait(PDL: tl.constexpr):
    """Block until the previous kernel has finished (its stores visible), then let the next
    kernel launch. A no-op without ``PDL`` (and when the kernel was launched without PDL)."""
    if PDL:
        gdc_wait()
        gdc_launch_dependents()


def pdl_enabled(device: torch.device) -> bool:
    """Whether kernels on ``device`` launch with PDL (``BREAKGRAPH_PDL``: ``1``, or ``auto``
    inside ``pdl_scope(True)``; CUDA, compute capability ≥ 9.0; never under Triton's interpreter)."""
    from breakgraph.kernels.dispatch import interpreting

    mode = env.read("BREAKGRAPH_PDL")
    if device.type != "cuda" or interpreting() or mode == "0":
        return False
    # a forward traced by torch.compile (the piecewise prefill) keeps plain launches in its
    # pieces whatever scope it is traced in: Dynamo cannot trace a ContextVar read
    if mode == "auto" and (torch.compiler.is_compiling() or not in_pdl_scope()):
        return False
    return _capable(device_index(device))


@functools.cache
def _capable(index: int) -> bool:
    return torch.cuda.get_device_capability(index)[0] >= 9


def pdl_launch(device: torch.device) -> dict:
    """Launch keyword arguments for a kernel that takes ``PDL``: the constexpr and Triton's
    ``launch_pdl`` option when :func:`pdl_enabled`, else ``PDL=False`` alone."""
    if pdl_enabled(device):
        return {"PDL": True, "launch_pdl": True}
    return {"PDL": False}
