"""Dense linear dispatch: plain ``F.linear`` or the FP8 block-scaled GEMM."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from breakgraph.kernels.fp8 import fp8_block_linear_ref


def linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    scale: torch.Tensor | None,
    block: tuple[int, int] | None,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """``x [..., K] @ W.T``; ``W`` is dequantised per block when ``scale`` is given."""
    if scale is None:
        return F.linear(x, weight, bias)
    return fp8_block_linear_ref(x, weight, scale, block, bias)
