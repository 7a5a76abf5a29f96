"""The FP8 latent cache in Triton: the quantising store (twin:
:func:`~breakgraph.kernels.latent_fp8.store_latent_ref`) and ``load_latent_rows``, the one
load the attention kernels use for a block of latent rows of either cache kind.

Row layout: :mod:`breakgraph.kernels.latent_fp8` (656 bytes for ``r = 512``, ``dr = 64``: 512
e4m3 codes, 4 fp32 scales, 64 bf16 RoPE values, each range 16-byte aligned). The kernels spell
its constants (groups of 128, e4m3's largest value 448) as literals.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from breakgraph.kernels.pdl import pdl_launch, pdl_wait


@triton.jit
def _fp8_offsets(rank, GROUP_SIZE: tl.constexpr):
    """Byte offsets ``(scale_off, pe_off)`` of a row for latent rank ``rank`` (see the layout)."""
    scale_off = (rank + 15) // 16 * 16
    groups = (rank + GROUP_SIZE - 1) // GROUP_SIZE
    return scale_off, scale_off + (4 * groups + 15) // 16 * 16


@triton.jit
def load_latent_rows(KV, slots, row_mask, offs_r, offs_pe, stride_kv, rank, rope_dim, FP8: tl.constexpr, DTYPE: tl.constexpr):
    """Latent rows ``slots [BLOCK_N]`` (int64 cache rows) of cache ``KV`` as the attention dots'
    operands ``(c [BLOCK_N, BLOCK_R], k_pe [BLOCK_N, BLOCK_PE])`` in ``DTYPE``: zeros where
    ``row_mask`` is false (``None``: every row is real) or a column is past ``rank``/``rope_dim``.

    ``FP8``: ``KV`` is the ``uint8`` FP8 cache (``stride_kv`` bytes per row): the e4m3 codes and
    their per-128 scales are dequantised in registers (``c8 · scale`` in fp32, rounded to
    ``DTYPE``, as :func:`~breakgraph.kernels.latent_fp8.dequantize_latent_ref` does), and the
    bf16 RoPE part is cast to ``DTYPE``. Else ``KV`` holds ``[c ‖ k_pe]`` rows of ``DTYPE``."""
    rows = KV + slots * stride_kv
    mask_c = (offs_r < rank)[None, :]
    mask_pe = (offs_pe < rope_dim)[None, :]
    if row_mask is not None:
        mask_c = row_mask[:, None] & mask_c
        mask_pe = row_mask[:, None] & mask_pe
    if FP8:
        scale_off, pe_off = _fp8_offsets(rank, 128)
        codes = tl.load(rows[:, None] + offs_r[None, :], mask=mask_c, other=0)
        scale_rows = (rows + scale_off).to(tl.pointer_type(tl.float32))
        # One [BLOCK_N] load per group of 128 columns, broadcast by selects: a [BLOCK_N, BLOCK_R]
        # load of the scales would hold one fp32 register per element. Where BLOCK_R holds more
        # groups than the row (r = 384), the extra load reads the row's zero padding (caches are
        # zero-initialised, stores never write padding) for columns whose codes are masked to 0.
        group = offs_r // 128
        scale = tl.zeros(codes.shape, tl.float32)
        for g in tl.static_range((offs_r.shape[0] + 127) // 128):
            s_g = tl.load(scale_rows + g, mask=row_mask, other=0.0) if row_mask is not None else tl.load(scale_rows + g)
            scale = tl.where(group[None, :] == g, s_g[:, None], scale)
        c = (codes.to(tl.float8e4nv, bitcast=True).to(tl.float32) * scale).to(DTYPE)
        pe_rows = (rows + pe_off).to(tl.pointer_type(tl.bfloat16))
        k_pe = tl.load(pe_rows[:, None] + offs_pe[None, :], mask=mask_pe, other=0.0).to(DTYPE)
    else:
        c = tl.load(rows[:, None] + offs_r[None, :], mask=mask_c, other=0.0)
        k_pe = tl.load(rows[:, None] + rank + offs_pe[None, :], mask=mask_pe, other=0.0)
    return c, k_pe


@triton.jit
def _store_latent_fp8_kernel(
    KV, SLOTS, C8, SCALES, PE, stride_kv, stride_c8, stride_s, stride_pe, num_rows, rank, rope_dim,
    BLOCK_T: tl.constexpr, GROUPS: tl.constexpr, GROUP_SIZE: tl.constexpr, BLOCK_PE: tl.constexpr,
    PDL: tl.constexpr = False,
):  # fmt: skip
    """Rows ``BLOCK_T·pid …`` of ``KV`` quantised into the FP8 rows ``SLOTS[i]`` (typed views of
    the one cache tensor: ``C8`` e4m3, ``SCALES`` fp32, ``PE`` bf16)."""
    pdl_wait(PDL)
    offs_t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    mask_t = offs_t < num_rows
    slot = tl.load(SLOTS + offs_t, mask=mask_t, other=0).to(tl.int64)
    src = KV + offs_t.to(tl.int64) * stride_kv
    offs_g = tl.arange(0, GROUPS)
    offs_c = offs_g[:, None] * GROUP_SIZE + tl.arange(0, GROUP_SIZE)[None, :]  # [G, S] column of the latent
    mask_c = mask_t[:, None, None] & (offs_c < rank)[None, :, :]
    x = tl.load(src[:, None, None] + offs_c[None, :, :], mask=mask_c, other=0.0).to(tl.float32)
    scale = tl.div_rn(tl.max(tl.abs(x), 2), 448.0)  # [T, G]
    safe = tl.where(scale > 0.0, scale, 1.0)
    codes = tl.where(scale[:, :, None] > 0.0, tl.div_rn(x, safe[:, :, None]), 0.0).to(tl.float8e4nv)
    tl.store(C8 + slot[:, None, None] * stride_c8 + offs_c[None, :, :], codes, mask=mask_c)
    mask_g = mask_t[:, None] & (offs_g < (rank + GROUP_SIZE - 1) // GROUP_SIZE)[None, :]
    tl.store(SCALES + slot[:, None] * stride_s + offs_g[None, :], scale, mask=mask_g)
    offs_pe = tl.arange(0, BLOCK_PE)
    mask_pe = mask_t[:, None] & (offs_pe < rope_dim)[None, :]
    pe = tl.load(src[:, None] + rank + offs_pe[None, :], mask=mask_pe, other=0.0)
    tl.store(PE + slot[:, None] * stride_pe + offs_pe[None, :], pe.to(tl.bfloat16), mask=mask_pe)


def store_latent_triton(
    c8: torch.Tensor, scales: torch.Tensor, pe: torch.Tensor, slots: torch.Tensor, kv: torch.Tensor, block_t: int = 4
) -> None:
    """Triton implementation of :func:`~breakgraph.kernels.latent_fp8.store_latent_ref` on the
    cache's typed views (:func:`~breakgraph.kernels.latent_fp8.latent_views`: ``c8 [N, r]`` e4m3,
    ``scales [N, G]`` fp32, ``pe [N, dr]`` bf16): the same bytes (IEEE division, round to nearest).
    ``kv [n, r + dr]`` has a unit last stride, ``slots [n]`` is contiguous int64."""
    n, rank = kv.shape[0], c8.shape[1]
    if n == 0:
        return
    groups, rope = scales.shape[1], pe.shape[1]
    _store_latent_fp8_kernel[(triton.cdiv(n, block_t),)](
        kv, slots, c8, scales, pe, kv.stride(0), c8.stride(0), scales.stride(0), pe.stride(0), n, rank, rope,
        BLOCK_T=block_t, GROUPS=triton.next_power_of_2(groups), GROUP_SIZE=min(128, triton.next_power_of_2(rank)),
        BLOCK_PE=max(16, triton.next_power_of_2(rope)), num_warps=4, **pdl_launch(kv.device),
    )  # fmt: skip
