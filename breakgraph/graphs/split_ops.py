"""Custom ops and split ops: the one place where a Python function becomes a graph boundary.

* :func:`register_custom_op` makes ``fn`` an opaque ``torch.ops.breakgraph.<name>`` op (traceable
  by torch.compile through its fake implementation).
* :func:`register_split_op` adds an op to the set the piecewise backend splits FX graphs at.
* :func:`graph_break_op` does both and returns one callable that works under every backend:
  ``torch.compile`` tracing sees the op (so the piecewise backend splits there), a breakable-graph
  capture sees a break (``eager_on_graph(True)(fn)``), and plain eager code calls ``fn``.
* :func:`opaque_op` registers ``fn`` as a custom op that ``torch.compile`` traces as one opaque
  call (not a split): for kernel dispatchers whose choices read their input sizes.

Split ops return nothing: they write into the buffers named in ``mutates_args``. Custom-op
arguments are limited to what a torch schema holds (tensors, numbers, bools, strings, lists of
them, optional tensors): per-batch metadata is read from the forward context inside ``fn``.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable
from typing import Any

import torch

from breakgraph.graphs.breakable import eager_on_graph

NAMESPACE = "breakgraph"

_CUSTOM_OPS: dict[str, tuple[Callable[..., Any], Any]] = {}
_SPLIT_OPS: set[str] = set()


def _no_result(*args: Any, **kwargs: Any) -> None:
    return None


def register_custom_op(
    fn: Callable[..., Any],
    *,
    name: str | None = None,
    mutates_args: Iterable[str] = (),
    fake_impl: Callable[..., Any] | None = None,
) -> torch._ops.OpOverloadPacket:
    """Register ``fn`` as ``torch.ops.breakgraph.<name>`` and return that op.

    ``fn`` needs type hints on every argument and on its return (torch infers the schema from
    them). ``mutates_args``: names of the arguments ``fn`` writes in place. ``fake_impl``: computes
    output metadata for tracing (same signature; build outputs with ``torch.empty_like`` & co.);
    optional when ``fn`` returns None. ``name`` defaults to ``fn.__name__``.

    Registering the same function under the same name again returns the existing op; another
    function under a taken name raises ValueError.
    """
    op_name = name or fn.__name__
    qualname = f"{NAMESPACE}::{op_name}"
    if qualname in _CUSTOM_OPS:
        known_fn, op = _CUSTOM_OPS[qualname]
        if known_fn is fn:
            return op
        raise ValueError(f"op {qualname} is already registered by {known_fn!r}; pick another name=")
    try:
        op_def = torch.library.custom_op(qualname, fn, mutates_args=tuple(mutates_args))
    except ValueError as exc:
        raise ValueError(
            f"cannot make {fn.__qualname__} a custom op: {exc}. Annotate every argument (torch.Tensor, int, "
            "float, bool, str, list[int], torch.Tensor | None) and the return type."
        ) from exc
    op = getattr(getattr(torch.ops, NAMESPACE), op_name)
    if fake_impl is None:
        if op.default._schema.returns:
            raise ValueError(
                f"custom op {qualname} returns tensors, so it needs fake_impl= (a function with the same "
                "signature that returns empty tensors of the right shapes and dtypes)."
            )
        fake_impl = _no_result
    op_def.register_fake(fake_impl)
    _CUSTOM_OPS[qualname] = (fn, op)
    return op


def op_qualname(target: Any) -> str | None:
    """``"namespace::name"`` of an op object (packet, overload, custom-op def), else None."""
    if isinstance(target, torch._ops.OpOverloadPacket):
        return target._qualified_op_name
    if isinstance(target, torch._ops.OpOverload):
        return target._schema.name
    if isinstance(target, torch._library.custom_ops.CustomOpDef):
        return target._qualname
    return None


def register_split_op(op: Any) -> str:
    """Add ``op`` to the split set and return its qualified name.

    ``op``: an op object, or a name (``"foo"`` means ``breakgraph::foo``; ``"ns::foo"`` any
    namespace). Raises ValueError when the op does not exist or returns something: split ops
    write into their ``mutates_args`` buffers and return nothing.
    """
    qualname = op if isinstance(op, str) else op_qualname(op)
    if qualname is None:
        raise ValueError(
            f"register_split_op: {op!r} is not a torch op; register it with register_custom_op first"
        )
    if "::" not in qualname:
        qualname = f"{NAMESPACE}::{qualname}"
    namespace, name = qualname.split("::", 1)
    packet = getattr(getattr(torch.ops, namespace), name, None)
    if packet is None or not hasattr(packet, "default"):
        raise ValueError(f"register_split_op: no op {qualname}; register it with register_custom_op first")
    if packet.default._schema.returns:
        raise ValueError(
            f"split op {qualname} returns values; split ops must return nothing and write into buffers "
            "listed in mutates_args"
        )
    _SPLIT_OPS.add(qualname)
    return qualname


def is_split_op(target: Any) -> bool:
    """Whether an FX node target is a registered split op."""
    return op_qualname(target) in _SPLIT_OPS


def split_op_names() -> frozenset[str]:
    """Qualified names of every registered split op."""
    return frozenset(_SPLIT_OPS)


def graph_break_op(
    fn: Callable[..., Any] | None = None,
    *,
    mutates_args: Iterable[str],
    name: str | None = None,
    fake_impl: Callable[..., Any] | None = None,
) -> Any:
    """Decorator: make ``fn`` a custom op, a split op and a breakable-graph break in one place.

    The returned callable dispatches by context: under ``torch.compile`` tracing it calls
    ``torch.ops.breakgraph.<name>`` (the piecewise backend splits there); during a breakable-graph
    capture it is a break (``eager_on_graph(True)(fn)``: ends the segment, runs eagerly, replays
    later); otherwise it calls ``fn``. ``fn`` returns None and writes into ``mutates_args``.
    Attributes: ``.op`` (the torch op), ``.bcg`` (the break wrapper), ``.eager`` (``fn``).

    Example::

        @graph_break_op(mutates_args=("topk_out",))
        def dsa_topk(scores: torch.Tensor, topk_out: torch.Tensor) -> None:
            topk_out.copy_(scores.topk(topk_out.shape[-1]).indices)
    """

    def decorate(fn: Callable[..., Any]) -> Callable[..., Any]:
        op = register_custom_op(fn, name=name, mutates_args=mutates_args, fake_impl=fake_impl)
        register_split_op(op)
        bcg = eager_on_graph(True)(fn)
        dispatch = _op_when_compiling(fn, op, bcg)
        dispatch.bcg = bcg  # type: ignore[attr-defined]
        dispatch.eager = fn  # type: ignore[attr-defined]
        return dispatch

    if fn is not None:
        return decorate(fn)
    return decorate


def opaque_op(*, name: str, fake_impl: Callable[..., Any]) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Decorator: make ``fn`` the custom op ``torch.ops.breakgraph.<name>`` and return a callable
    that calls the op under ``torch.compile`` tracing and ``fn`` directly otherwise (no
    op-dispatch cost in eager code and breakable capture). Not a split op: the piecewise backend
    keeps it inside a piece, Inductor calls it as an extern kernel.

    For kernel dispatchers whose tile choices read their input sizes: traced as one opaque call
    (``fake_impl``, same signature, returns an empty output of the right shape), those choices
    neither specialise a trace with a symbolic token count nor make it recompile per size.
    ``fn`` returns a new tensor (never an alias of an input) and type-hints every argument.
    """

    def decorate(fn: Callable[..., Any]) -> Callable[..., Any]:
        return _op_when_compiling(fn, register_custom_op(fn, name=name, fake_impl=fake_impl), fn)

    return decorate


def _op_when_compiling(fn: Callable[..., Any], op: Any, otherwise: Callable[..., Any]) -> Callable[..., Any]:
    """``fn``'s stand-in: ``op`` while torch.compile traces, ``otherwise`` at run time; ``.op`` is the op."""

    @functools.wraps(fn)
    def dispatch(*args: Any, **kwargs: Any) -> Any:
        if torch.compiler.is_compiling():
            return op(*args, **kwargs)
        return otherwise(*args, **kwargs)

    dispatch.op = op  # type: ignore[attr-defined]
    return dispatch
