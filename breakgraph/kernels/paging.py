"""Paged-cache addressing shared by the attention and indexer kernels."""

from __future__ import annotations

import torch


def positions_to_slots(
    pos: torch.Tensor, page_table: torch.Tensor, token_req: torch.Tensor, page_size: int
) -> torch.Tensor:
    """Map key positions ``pos [T, K]`` (``-1`` = none) of each token's request to cache slots.

    ``slot = page_table[req, pos // page_size] * page_size + pos % page_size``; ``-1``
    positions map to slot 0 (the reserved padding page), callers mask them. Returns int64.
    """
    p = pos.long().clamp(min=0)
    pages = page_table.long()[token_req.long()[:, None], p // page_size]
    return pages * page_size + p % page_size


def page_shift(page_size: int) -> int:
    """log2 of a power-of-two ``page_size`` (the kernels' ``PAGE_SHIFT``: a shift and a mask per
    key instead of an emulated runtime division), else -1."""
    return page_size.bit_length() - 1 if page_size & (page_size - 1) == 0 else -1


def rows_fit_int32(cache: torch.Tensor) -> bool:
    """Whether every element offset of ``cache``'s rows (up to its last row's start, by its row
    stride) fits a 32-bit int, so the kernels may address rows with int32 products."""
    return cache.shape[0] * cache.stride(0) < 2**31
