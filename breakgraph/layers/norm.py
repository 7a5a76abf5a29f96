"""RMSNorm as the reference computes it: statistics in fp32, weight applied in the input dtype."""

from __future__ import annotations

import torch
from torch import nn

from breakgraph.kernels.norm import fused_add_rms_norm, rms_norm, rms_norm_fp8


class RMSNorm(nn.Module):
    """``weight * (x / sqrt(mean(x²) + eps)).to(x.dtype)``. Note: MLA's ``q_a_layernorm`` and
    ``kv_a_layernorm`` use eps 1e-6 whatever the config says (as the reference does)."""

    def __init__(self, dim: int, eps: float, dtype: torch.dtype = torch.bfloat16) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim, dtype=dtype), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)

    def forward_with_residual(
        self, x: torch.Tensor, residual: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``h = residual + x`` (rounded to the dtype, as a separate add would be); returns
        ``(norm(h), h)``. One kernel on CUDA (:func:`~breakgraph.kernels.norm.fused_add_rms_norm`)."""
        return fused_add_rms_norm(x, residual, self.weight, self.eps)

    def forward_fp8(
        self, x: torch.Tensor, residual: torch.Tensor | None = None, quantize: bool = True
    ) -> tuple[torch.Tensor, torch.Tensor | None, tuple[torch.Tensor, torch.Tensor] | None]:
        """:meth:`forward` (or :meth:`forward_with_residual` with ``residual``) for an output
        that feeds FP8 linears: ``(normed, h or None, x_fp8)``, ``x_fp8`` the normed rows
        quantised for them by the same kernel where there is one (CUDA, unless ``BREAKGRAPH_NORM_FP8=0``), else None — always
        None without ``quantize`` (the consumer is not FP8). See
        :func:`~breakgraph.kernels.norm.rms_norm_fp8`."""
        if not quantize:
            if residual is None:
                return self.forward(x), None, None
            return (*self.forward_with_residual(x, residual), None)
        return rms_norm_fp8(x, self.weight, self.eps, residual)


class LayerNorm(nn.Module):
    """LayerNorm with weight and bias (the DSA indexer's key norm, eps 1e-6)."""

    def __init__(self, dim: int, eps: float = 1e-6, dtype: torch.dtype = torch.bfloat16) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim, dtype=dtype), requires_grad=False)
        self.bias = nn.Parameter(torch.zeros(dim, dtype=dtype), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.layer_norm(x, (x.shape[-1],), self.weight, self.bias, self.eps)
