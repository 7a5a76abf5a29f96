"""Rotary position embedding applied to activations: the plain-PyTorch twin and the dispatcher.

``x [T, ..., D]`` with ``cos/sin [T, R/2]`` (R = ``rope_dim`` ≤ D, default D): the first R
columns are rotated as pairs — interleaved ``(x0,x1),(x2,x3)…`` or half-split
``(x_i, x_{i+R/2})`` — and written as the two rotated halves ``[x1·cos − x2·sin ‖ x2·cos +
x1·sin]``, exactly as the reference does; the other ``D − R`` columns are copied. Every
product and sum is rounded to ``x``'s dtype as torch rounds each op (the kernel too).
"""

from __future__ import annotations

import torch

from breakgraph.kernels.dispatch import use_triton_inference


def rope_ref(
    x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool, rope_dim: int | None = None
) -> torch.Tensor:
    """The twin: rotate the first ``rope_dim`` columns of ``x`` (see the module docstring)."""
    d = x.shape[-1] if rope_dim is None else rope_dim
    part = x[..., :d]
    while cos.dim() < x.dim():
        cos, sin = cos.unsqueeze(-2), sin.unsqueeze(-2)
    if interleaved:
        x1, x2 = part[..., 0::2], part[..., 1::2]
    else:
        x1, x2 = part[..., : d // 2], part[..., d // 2 :]
    rotated = [x1 * cos - x2 * sin, x2 * cos + x1 * sin]
    return torch.cat(rotated if d == x.shape[-1] else [*rotated, x[..., d:]], dim=-1)


def rope(
    x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool, rope_dim: int | None = None
) -> torch.Tensor:
    """Dispatch :func:`rope_ref`'s contract (a new tensor of ``x``'s shape): CUDA tensors of one
    dtype outside autograd recording take one Triton kernel
    (:mod:`breakgraph.kernels.triton_rope`), everything else the twin."""
    if use_triton_inference(x, cos, sin):
        from breakgraph.kernels import triton_rope

        if triton_rope.supports(x, cos, sin, rope_dim):
            return triton_rope.rope_triton(x, cos, sin, interleaved, rope_dim)
    return rope_ref(x, cos, sin, interleaved, rope_dim)
