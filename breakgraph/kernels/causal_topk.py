"""The DSA indexer's top-k where it is every causal key (twin and dispatch).

When no sequence of a batch is longer than ``index_topk`` the indexer's selection is every key
position up to each token's own: row ``t`` of ``out [T, K]`` is ``0, 1, …, pos[t]`` then ``-1``.
"""

from __future__ import annotations

import torch

from breakgraph.kernels.dispatch import use_triton


def causal_topk_ref(positions: torch.Tensor, out: torch.Tensor) -> None:
    """Write ``out[t, j] = j if j <= positions[t] else -1`` (``out [T, K]`` int32, ``positions [T]``)."""
    cols = torch.arange(out.shape[1], device=out.device, dtype=torch.int32)
    out.copy_(torch.where(cols[None, :] <= positions[:, None], cols[None, :], -1))


def causal_topk(positions: torch.Tensor, out: torch.Tensor) -> None:
    """Dispatch :func:`causal_topk_ref`'s contract: CUDA int32 ``out`` with a unit column stride
    takes one Triton kernel (:mod:`breakgraph.kernels.triton_causal_topk`; the twin is four
    kernels), everything else the twin. Graph-safe."""
    if use_triton(out) and out.dtype == torch.int32 and out.dim() == 2 and out.stride(1) == 1:
        from breakgraph.kernels.triton_causal_topk import causal_topk_triton

        causal_topk_triton(positions, out)
        return
    causal_topk_ref(positions, out)
