"""RMSNorm, plain and with the residual add fused in (plain-PyTorch twins and dispatchers).

The math is the reference's: statistics in fp32, ``h · rsqrt(mean(h²) + eps)`` cast back to
the input dtype, then multiplied by the weight in that dtype. The fused form adds the residual
first (in the input dtype, as ``h + attn`` does) and returns the sum as the new residual.
"""

from __future__ import annotations

import torch

from breakgraph import env
from breakgraph.kernels.dispatch import use_triton_inference


def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``weight * (x / sqrt(mean(x²) + eps)).to(x.dtype)`` over the last dimension of ``x``."""
    dtype = x.dtype
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(dtype)


def fused_add_rms_norm_ref(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """``h = residual + x``; returns ``(rms_norm_ref(h, weight, eps), h)``."""
    h = residual + x
    return rms_norm_ref(h, weight, eps), h


def _triton_ok(x: torch.Tensor, weight: torch.Tensor, residual: torch.Tensor | None = None) -> bool:
    """CUDA tensors the Triton kernels support, outside autograd recording (they have no
    backward: training forwards take the twin)."""
    if not use_triton_inference(x, weight, residual):
        return False
    from breakgraph.kernels import triton_norm

    return triton_norm.supports(x, weight, residual)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Dispatch :func:`rms_norm_ref`'s contract: CUDA tensors of one dtype (bf16/fp16/fp32,
    hidden ≤ 8192, unit last stride, no autograd) take the Triton kernel
    (:mod:`breakgraph.kernels.triton_norm`, returns a new contiguous tensor); everything else
    takes the twin."""
    if _triton_ok(x, weight):
        from breakgraph.kernels.triton_norm import rms_norm_triton

        return rms_norm_triton(x, weight, eps)
    return rms_norm_ref(x, weight, eps)


def fused_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Dispatch :func:`fused_add_rms_norm_ref`'s contract (``(normed, x + residual)``, both new
    tensors) like :func:`rms_norm`: one Triton kernel on CUDA, else the twin."""
    if _triton_ok(x, weight, residual):
        from breakgraph.kernels.triton_norm import fused_add_rms_norm_triton

        return fused_add_rms_norm_triton(x, residual, weight, eps)
    return fused_add_rms_norm_ref(x, residual, weight, eps)


def rms_norm_fp8(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor | None, tuple[torch.Tensor, torch.Tensor] | None]:
    """:func:`rms_norm` (or :func:`fused_add_rms_norm` with ``residual``) for a norm whose output
    feeds FP8 linears: returns ``(normed, x + residual or None, x_fp8)``, where ``x_fp8`` is
    ``normed`` quantised for the FP8 GEMMs (``(codes, scales)``, the ``x_fp8`` argument of
    :func:`~breakgraph.kernels.linear.linear`) from the same kernel on CUDA (bf16, width a
    multiple of 128: :func:`~breakgraph.kernels.triton_norm.rms_norm_quant_triton`), else None
    (the linears quantise, or not, themselves; also with ``BREAKGRAPH_NORM_FP8=0``). On the H200
    the quantising kernel takes 125.5 µs at 8192 × 6144 where the norm and the separate
    quantisation take 101.3 + 46.8 (``python scripts/bench_norm_quant.py``)."""
    if env.read("BREAKGRAPH_NORM_FP8") == "1" and _triton_ok(x, weight, residual):
        from breakgraph.kernels import triton_fp8, triton_norm

        if triton_norm.supports_quant(x, weight, residual):
            normed, res_out, q, scale = triton_norm.rms_norm_quant_triton(
                x, weight, eps, residual, triton_fp8.quant_pad_rows(x.device)
            )
            return normed, res_out, (q, scale)
    if residual is None:
        return rms_norm(x, weight, eps), None, None
    normed, res_out = fused_add_rms_norm(x, residual, weight, eps)
    return normed, res_out, None
