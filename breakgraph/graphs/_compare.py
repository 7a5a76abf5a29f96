"""Snapshots and comparisons used by the debug checks (BreakableGraph and the piecewise backend)."""

from __future__ import annotations

from typing import Any

import torch
from torch.utils._pytree import tree_flatten

from breakgraph import env

DEBUG_ENV = "BREAKGRAPH_GRAPH_DEBUG"


def debug_enabled(flag: bool | None) -> bool:
    """``flag`` if given, else whether the environment sets ``BREAKGRAPH_GRAPH_DEBUG=1``."""
    if flag is not None:
        return flag
    return env.read(DEBUG_ENV) not in ("", "0", "false", "False")


def tensor_leaves(tree: Any) -> list[torch.Tensor]:
    """The tensors of a pytree (args tuples, dicts, dataclass-free containers), in order."""
    leaves, _ = tree_flatten(tree)
    return [x for x in leaves if isinstance(x, torch.Tensor)]


def clone_all(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    return [t.detach().clone() for t in tensors]


def first_mismatch(got: list[torch.Tensor], want: list[torch.Tensor], rtol: float, atol: float) -> str | None:
    """A description of the first tensor of ``got`` that differs from ``want``, or None."""
    if len(got) != len(want):
        return f"{len(got)} tensors where {len(want)} were expected"
    for i, (g, w) in enumerate(zip(got, want)):
        if g.shape != w.shape or g.dtype != w.dtype:
            return f"tensor #{i}: {tuple(g.shape)} {g.dtype} vs {tuple(w.shape)} {w.dtype}"
        if g.dtype.is_floating_point or g.dtype.is_complex:
            same = torch.allclose(g, w, rtol=rtol, atol=atol, equal_nan=True)
        else:
            same = torch.equal(g, w)
        if not same:
            return f"tensor #{i} {tuple(g.shape)} {g.dtype}: {_describe_diff(g, w)}"
    return None


def _describe_diff(g: torch.Tensor, w: torch.Tensor) -> str:
    if g.dtype == torch.bool:
        return f"{int((g != w).sum())} of {g.numel()} elements differ"
    if g.dtype.is_complex:
        delta = (g - w).abs()
    else:
        delta = (g.to(torch.float64) - w.to(torch.float64)).abs()
    return f"max abs diff {float(delta.nan_to_num(float('inf')).max()):.3g}"
