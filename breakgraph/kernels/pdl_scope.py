"""Where ``BREAKGRAPH_PDL=auto`` launches with programmatic dependent launch: inside
:func:`pdl_scope` ``(True)``, which the engine opens while it captures a decode graph of at most
:data:`PDL_AUTO_MAX_ROWS` rows, and while it captures or runs a prefill of at most
:data:`PDL_AUTO_MAX_PREFILL_TOKENS` tokens (:mod:`breakgraph.kernels.pdl` reads it at each launch). Kept
apart from that module so that the engine can open a scope without importing Triton.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar

#: ``BREAKGRAPH_PDL=auto``: decode graphs of up to this many rows launch with PDL (H200,
#: glm5-tp8-rank, ``bench decode --pdl auto 0``: faster at batch 1 and 16; slower at 64 with ``1``).
PDL_AUTO_MAX_ROWS = 16
#: ``BREAKGRAPH_PDL=auto``: prefill batches of up to this many tokens on the prefill graphs (the
#: graphs and the breaks between them) launch with PDL (H200, glm5-tp8-rank, ``bench prefill
#: --input-len 128`` with ``BREAKGRAPH_PDL=1`` against ``0``: 37.01 against 38.38 ms; at 1024
#: tokens not faster: 75.25 against 64.89 ms in one run, 64.18 against 71.77 in another).
PDL_AUTO_MAX_PREFILL_TOKENS = 128

_scope: ContextVar[bool] = ContextVar("breakgraph_pdl_scope", default=False)


@contextmanager
def pdl_scope(on: bool) -> Iterator[None]:
    """Within: kernels launch with PDL under ``BREAKGRAPH_PDL=auto`` when ``on`` (``0`` and ``1``
    ignore it)."""
    token = _scope.set(on)
    try:
        yield
    finally:
        _scope.reset(token)


def in_pdl_scope() -> bool:
    """Whether the innermost :func:`pdl_scope` asks for PDL (False outside every scope). Not
    traceable by Dynamo: callers check ``torch.compiler.is_compiling()`` first."""
    return _scope.get()
