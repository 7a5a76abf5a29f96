"""The FP8 latent KV cache row (DeepSeek-V3.2's layout) and its plain-PyTorch twins.

A cache of this kind is one ``uint8`` tensor ``[num_slots, row_bytes]`` per layer; each row
holds one token's latent entry ``[c ‖ k_pe]`` as three byte ranges, each starting at a
multiple of 16 bytes (and ``row_bytes`` is one too), so every range of every row loads with
aligned 16-byte vector loads:

* ``[0, r)``: the ``r`` latent values ``c`` in float8 e4m3fn, quantised per group of 128:
  ``scale = amax / 448``, ``c8 = c / scale`` (round to nearest, IEEE division);
* ``[scale_off, scale_off + 4·G)``: the ``G = ceil(r / 128)`` fp32 scales (dequantise:
  ``c ≈ c8 · scale``; an all-zero group has scale 0 and codes 0);
* ``[pe_off, pe_off + 2·dr)``: the ``dr`` RoPE values ``k_pe`` in bf16.

with ``scale_off = align16(r)`` and ``pe_off = scale_off + align16(4·G)``. For GLM-5 /
DeepSeek-V3.2 (``r = 512``, ``dr = 64``): 512 + 16 + 128 = **656 bytes** per token and layer
(a bf16 cache row: 1152), the layout DeepSeek-V3.2's FP8 cache uses. Tiny test models
(``r < 128``) have one group of ``r`` values.

Writers call :func:`store_latent` (Triton on CUDA: :mod:`breakgraph.kernels.triton_latent_fp8`);
readers dequantise rows with :func:`dequantize_latent_ref` (the twins) or in registers (the
Triton attention kernels, through ``load_latent_rows``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from breakgraph.kernels.dispatch import use_triton
from breakgraph.kernels.fp8 import FP8_DTYPE, FP8_MAX

GROUP = 128  # latent values per scale


def _align16(n: int) -> int:
    return -(-n // 16) * 16


@dataclass(frozen=True)
class LatentLayout:
    """Byte offsets of one FP8 cache row for latent rank ``rank`` and rope dim ``rope``."""

    rank: int
    rope: int

    @property
    def groups(self) -> int:
        return -(-self.rank // GROUP)

    @property
    def scale_off(self) -> int:
        return _align16(self.rank)

    @property
    def pe_off(self) -> int:
        return self.scale_off + _align16(4 * self.groups)

    @property
    def row_bytes(self) -> int:
        return _align16(self.pe_off + 2 * self.rope)


def is_fp8_latent(cache: torch.Tensor) -> bool:
    """Whether ``cache`` is an FP8 latent cache (``uint8`` rows of this module's layout)."""
    return cache.dtype == torch.uint8


def latent_views(cache: torch.Tensor, rank: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Typed views of an FP8 cache ``[N, row_bytes]``: ``(c8 [N, rank] float8_e4m3fn,
    scales [N, G] fp32, k_pe [N, rope] bf16)`` (no copies; ``rope`` from the row width)."""
    n, row = cache.shape
    lay = _layout_of(row, rank)
    c8 = cache[:, :rank].view(FP8_DTYPE)
    scales = cache.view(torch.float32)[:, lay.scale_off // 4 : lay.scale_off // 4 + lay.groups]
    pe = cache.view(torch.bfloat16)[:, lay.pe_off // 2 : lay.pe_off // 2 + lay.rope]
    return c8, scales, pe


def _layout_of(row_bytes: int, rank: int) -> LatentLayout:
    """The layout of ``row_bytes``-wide rows for ``rank`` (its rope dim is what fills the row)."""
    base = LatentLayout(rank, 0)
    rope = (row_bytes - base.pe_off) // 2
    lay = LatentLayout(rank, rope)
    if rope < 0 or lay.row_bytes != row_bytes:
        raise ValueError(f"an FP8 latent row of {row_bytes} bytes does not fit latent rank {rank}")
    return lay


def quantize_latent_ref(kv: torch.Tensor, rank: int) -> torch.Tensor:
    """Rows ``kv [n, rank + rope]`` (any float dtype) → FP8 cache rows ``[n, row_bytes]`` uint8."""
    n, dim = kv.shape
    lay = LatentLayout(rank, dim - rank)
    out = torch.zeros(n, lay.row_bytes, dtype=torch.uint8, device=kv.device)
    c = kv[:, :rank].float()
    pad = lay.groups * GROUP - rank
    groups = torch.nn.functional.pad(c, (0, pad)).view(n, lay.groups, GROUP)
    amax = groups.abs().amax(-1)  # [n, G]
    # A tensor divisor: CUDA divides by a Python scalar as a product with its reciprocal, which
    # is not IEEE division (the Triton store divides as IEEE).
    scale = amax / torch.full_like(amax, FP8_MAX)
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    codes = torch.where(scale[..., None] > 0, groups / safe[..., None], torch.zeros_like(groups))
    c8, scales, pe = latent_views(out, rank)
    c8.copy_(codes.view(n, -1)[:, :rank].to(FP8_DTYPE))
    scales.copy_(scale)
    pe.copy_(kv[:, rank:].to(torch.bfloat16))
    return out


def dequantize_latent_ref(rows: torch.Tensor, rank: int, dtype: torch.dtype) -> torch.Tensor:
    """FP8 cache rows ``[..., row_bytes]`` uint8 → ``[..., rank + rope]`` in ``dtype``:
    ``c8 · scale`` (in fp32, then rounded to ``dtype``, as the kernels do) ‖ ``k_pe``."""
    shape = rows.shape[:-1]
    c8, scales, pe = latent_views(rows.reshape(-1, rows.shape[-1]), rank)
    scale = scales.repeat_interleave(GROUP, dim=-1)[:, :rank]
    c = (c8.float() * scale).to(dtype)
    return torch.cat([c, pe.to(dtype)], dim=-1).view(*shape, -1)


def store_latent_ref(cache: torch.Tensor, slots: torch.Tensor, kv: torch.Tensor, rank: int) -> None:
    """Quantise rows ``kv [n, rank + rope]`` into FP8 cache rows ``cache[slots]`` (``slots`` [n] int64)."""
    cache[slots] = quantize_latent_ref(kv, rank)


def store_latent(cache: torch.Tensor, slots: torch.Tensor, kv: torch.Tensor, rank: int) -> None:
    """Write the latent entries ``kv [n, rank + rope]`` into cache rows ``slots [n]`` (int64).

    A plain cache (bf16/fp16/fp32) takes ``kv`` cast to its dtype; an FP8 cache
    (:func:`is_fp8_latent`) quantises on store: the Triton kernel on CUDA, else the twin
    :func:`store_latent_ref` (both give the same bytes). Graph-safe: no host syncs."""
    if not is_fp8_latent(cache):
        cache[slots] = kv.to(cache.dtype)
        return
    if use_triton(kv) and kv.dim() == 2 and kv.stride(-1) == 1 and slots.is_contiguous() and cache.is_contiguous():
        from breakgraph.kernels.triton_latent_fp8 import store_latent_triton

        store_latent_triton(*latent_views(cache, rank), slots, kv)
        return
    store_latent_ref(cache, slots, kv, rank)
