"""Rotary position embedding tables: default and YaRN frequencies, looked up by position.

GLM-5 rotates interleaved pairs ``(x0,x1),(x2,x3)…`` in MLA and in the indexer; DeepSeek-V3.2
rotates interleaved pairs in MLA and half-split pairs ``(x_i, x_{i+d/2})`` in the indexer.
The rotation itself is :func:`breakgraph.kernels.rope.rope`: it returns the rotated halves
concatenated ``[even' ‖ odd']`` (interleaved) or ``[first' ‖ second']`` (half-split), exactly
as the reference does; queries and keys get the same layout, so dot products are those of the
true rotation.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from breakgraph.models.config import RopeConfig, yarn_get_mscale


def rope_inv_freq(rope: RopeConfig, dim: int) -> tuple[torch.Tensor, float]:
    """Inverse frequencies ``[dim/2]`` fp32 and the cos/sin scale (YaRN attention factor)."""
    pos_freqs = rope.theta ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)
    if rope.rope_type == "default":
        return 1.0 / pos_freqs, 1.0
    factor = rope.factor
    if rope.attention_factor is not None:
        attention_factor = float(rope.attention_factor)
    elif rope.mscale and rope.mscale_all_dim:
        attention_factor = yarn_get_mscale(factor, rope.mscale) / yarn_get_mscale(factor, rope.mscale_all_dim)
    else:
        attention_factor = yarn_get_mscale(factor)
    orig = rope.original_max_position_embeddings

    def correction_dim(rotations: float) -> float:
        return dim * math.log(orig / (rotations * 2 * math.pi)) / (2 * math.log(rope.theta))

    low, high = correction_dim(rope.beta_fast), correction_dim(rope.beta_slow)
    if rope.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    extrapolation = 1 - ramp
    inv_freq = (1.0 / (factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation
    return inv_freq, attention_factor


class RotaryEmbedding(nn.Module):
    """Precomputed ``cos``/``sin`` tables ``[max_positions, dim/2]`` (fp32), looked up by position."""

    def __init__(self, rope: RopeConfig, dim: int, max_positions: int) -> None:
        super().__init__()
        inv_freq, scale = rope_inv_freq(rope, dim)
        freqs = torch.arange(max_positions, dtype=torch.float32)[:, None] * inv_freq[None, :]
        self.register_buffer("cos", freqs.cos() * scale, persistent=False)
        self.register_buffer("sin", freqs.sin() * scale, persistent=False)

    def lookup(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """``cos, sin`` for ``positions [T]`` → two ``[T, dim/2]`` tensors in ``dtype``."""
        return self.cos[positions].to(dtype), self.sin[positions].to(dtype)
