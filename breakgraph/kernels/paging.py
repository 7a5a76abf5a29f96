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
