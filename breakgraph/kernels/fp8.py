"""FP8 (e4m3) block-scaled weights: quantise, dequantise, and the block-scaled linear.

Checkpoint convention: ``weight`` float8_e4m3fn ``[..., N, K]`` and ``weight_scale_inv`` fp32
``[..., ceil(N/bn), ceil(K/bk)]``; the real weight is ``weight * scale`` per (bn, bk) tile.
Edge tiles may be partial. The plain-PyTorch functions here are the CPU path and the oracle
for the GPU kernels.
"""

from __future__ import annotations

import torch

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0


def expand_block_scale(scale: torch.Tensor, shape: torch.Size, block: tuple[int, int]) -> torch.Tensor:
    """Repeat a per-tile ``scale [..., nb, kb]`` to the full ``shape [..., N, K]`` (fp32)."""
    bn, bk = block
    n, k = shape[-2], shape[-1]
    full = scale.float().repeat_interleave(bn, dim=-2).repeat_interleave(bk, dim=-1)
    return full[..., :n, :k]


def block_dequant(weight: torch.Tensor, scale: torch.Tensor, block: tuple[int, int], dtype: torch.dtype) -> torch.Tensor:
    """``weight [..., N, K]`` fp8 × ``scale [..., ceil(N/bn), ceil(K/bk)]`` → ``dtype`` tensor."""
    expected = (*weight.shape[:-2], -(-weight.shape[-2] // block[0]), -(-weight.shape[-1] // block[1]))
    if tuple(scale.shape) != expected:
        raise ValueError(f"weight_scale_inv has shape {tuple(scale.shape)}, expected {expected} for weight {tuple(weight.shape)}")
    return (weight.float() * expand_block_scale(scale, weight.shape, block)).to(dtype)


def block_quant(weight: torch.Tensor, block: tuple[int, int] = (128, 128)) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantise ``weight [..., N, K]`` to fp8 e4m3 with one fp32 scale per (bn, bk) tile.

    Returns ``(weight_fp8, scale_inv)`` where ``scale_inv = amax(tile) / 448`` (so that
    dequantisation multiplies), as in DeepSeek/GLM FP8 checkpoints.
    """
    bn, bk = block
    *lead, n, k = weight.shape
    nb, kb = -(-n // bn), -(-k // bk)
    padded = weight.new_zeros((*lead, nb * bn, kb * bk), dtype=torch.float32)
    padded[..., :n, :k] = weight.float()
    tiles = padded.view(*lead, nb, bn, kb, bk)
    amax = tiles.abs().amax(dim=(-3, -1)).clamp(min=1e-12)
    scale = amax / FP8_MAX
    q = (tiles / scale[..., :, None, :, None]).clamp(-FP8_MAX, FP8_MAX)
    q = q.view(*lead, nb * bn, kb * bk)[..., :n, :k].to(FP8_DTYPE)
    return q.contiguous(), scale.contiguous()


def fp8_block_linear_ref(
    x: torch.Tensor,
    weight: torch.Tensor,
    scale: torch.Tensor,
    block: tuple[int, int],
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """``x [..., K] @ dequant(weight [N, K]).T`` in ``x.dtype`` (the twin of the GPU FP8 GEMM)."""
    return torch.nn.functional.linear(x, block_dequant(weight, scale, block, x.dtype), bias)
