"""The DSA indexer's top-k where it is every causal key (the twin's rows).

When no sequence of a batch is longer than ``index_topk`` the indexer's selection is every key
position up to each token's own: row ``t`` of ``out [T, K]`` is ``0, 1, …, pos[t]`` then ``-1``.
The indexer then writes no rows: the Triton attention makes them from the positions
(``causal_rows`` of :func:`~breakgraph.kernels.sparse_mla.sparse_mla_attention`), its twin from
:func:`causal_topk_ref`.
"""

from __future__ import annotations

import torch


def causal_topk_ref(positions: torch.Tensor, out: torch.Tensor) -> None:
    """Write ``out[t, j] = j if j <= positions[t] else -1`` (``out [T, K]`` int32, ``positions [T]``)."""
    cols = torch.arange(out.shape[1], device=out.device, dtype=torch.int32)
    out.copy_(torch.where(cols[None, :] <= positions[:, None], cols[None, :], -1))
