"""Dense linear dispatch: plain ``F.linear`` or the FP8 block-scaled GEMM."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from breakgraph.kernels.dispatch import use_triton
from breakgraph.kernels.fp8 import FP8_DTYPE, fp8_block_linear_ref


def linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    scale: torch.Tensor | None,
    block: tuple[int, int] | None,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """``x [..., K] @ W.T``; ``W`` is dequantised per block when ``scale`` is given.

    FP8 on CUDA: activations quantised per (token, 128 columns) to e4m3, then
    ``torch._scaled_mm``'s blockwise recipe when this torch accepts it (probed once), else a
    Triton block-scaled GEMM (:func:`breakgraph.kernels.triton_fp8.fp8_linear`). The weight
    and its ``weight_scale_inv`` are used as loaded; no preparation step.
    """
    if scale is None:
        return F.linear(x, weight, bias)
    if use_triton(x) and weight.dtype == FP8_DTYPE and block is not None:
        from breakgraph.kernels.triton_fp8 import fp8_linear

        return fp8_linear(x, weight, scale, block, bias)
    return fp8_block_linear_ref(x, weight, scale, block, bias)
