"""Breakable graphs (BCG): a capture split into graph segments and eager steps.

Mark a function that must run eagerly with ``@eager_on_graph()`` (or call it once through
``call_with_graph_break``). During ``BreakableGraph.capture`` each call of it ends the current
segment, runs the function once, records the call and starts a new segment. ``replay()`` then
alternates segment replays and the recorded calls; no Python model code runs.

Break contract (what a break function must do to be replayable):

1. Results go into preallocated buffers passed as arguments, and the function returns None; or
   it returns tensors (any pytree of them) whose storage the graph keeps: at every replay the
   fresh results are copied into the tensors returned at capture, so later segments, which
   captured reads of those tensors, see the new values. Returned shapes and dtypes must not
   change between capture and replay; returned Python scalars must not change either (they were
   frozen into the graph): :class:`StaleBreakResultError` otherwise.
2. Per-batch data comes from a context object that the function reads when it is called
   (``get_forward_context().seq_lens``), never from values bound in a closure or default argument
   at capture time: the recorded call replays with the SAME argument objects.
3. Returned tensors and arguments that live outside the graph's memory pool (weights, caches,
   static input buffers) are held by strong references for the life of the graph. Arguments
   that a segment allocated in the pool are held as non-owning aliases: replay runs in stream
   order, so a break reads and writes such a tensor before any later segment (of this bucket
   or of another bucket sharing the pool, never replayed concurrently) reuses its bytes. Holding
   them would keep every layer's break arguments of every bucket alive at once.
4. Side streams forked inside a segment are joined back before the break; otherwise
   :class:`GraphBreakError` names the break function (CUDA only).
5. Breaks called inside a break function run inline (nested breaks add no segment).

Device: ``device="cuda"`` captures CUDA graphs (all segments in one pool, shareable across
graphs via ``pool=``); ``device="cpu"`` records segments with the CPU graph backend, with the same
contract, so CPU tests prove graph safety.
"""

from __future__ import annotations

import contextlib
import functools
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, TypeVar

import torch
from torch.utils._pytree import tree_flatten

from breakgraph.graphs._compare import DEBUG_ENV, clone_all, debug_enabled, first_mismatch, tensor_leaves
from breakgraph.graphs._state import ActiveGraph, activate, active_graph
from breakgraph.graphs.capture import make_capturer
from breakgraph.graphs.errors import (
    GraphBreakError,
    GraphError,
    GraphNotCapturedError,
    GraphReplayMismatchError,
    StaleBreakResultError,
)
from breakgraph.graphs.segments import Segment

F = TypeVar("F", bound=Callable[..., Any])
_SCALARS = (bool, int, float, complex, str, type(None))


def _name(fn: Callable[..., Any]) -> str:
    name = getattr(fn, "__qualname__", None) or getattr(fn, "__name__", None) or repr(fn)
    return name.rsplit("<locals>.", 1)[-1]


def _dispatch_break(fn: Callable[..., Any], args: tuple, kwargs: dict) -> Any:
    state = active_graph()
    if state is None or state.in_break or state.phase == "replay":
        return fn(*args, **kwargs)
    return state.owner._on_break(state, fn, args, kwargs)


def eager_on_graph(enable: bool = True) -> Callable[[F], F]:
    """Decorator: make ``fn`` a graph break.

    Outside a breakable-graph capture the wrapper just calls ``fn`` (so does it under
    ``torch.compile`` tracing, at replay, and inside another break). During capture it ends the
    current segment, runs ``fn`` once, records the call for replay and starts a new segment; it
    returns what ``fn`` returned. ``fn`` must follow the break contract of this module.
    ``enable=False`` returns ``fn`` unchanged. Convention: ``bcg_<name> = eager_on_graph(True)(<name>)``.
    """

    def decorate(fn: F) -> F:
        if not enable or getattr(fn, "__breakgraph_break__", None) is not None:
            return fn

        @functools.wraps(fn)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            if torch.compiler.is_compiling():
                return fn(*args, **kwargs)
            return _dispatch_break(fn, args, kwargs)

        wrapper.__breakgraph_break__ = fn  # type: ignore[attr-defined]
        return wrapper  # type: ignore[return-value]

    return decorate


def call_with_graph_break(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """Call ``fn(*args, **kwargs)`` as a one-off graph break (same contract as ``eager_on_graph``)."""
    if torch.compiler.is_compiling():
        return fn(*args, **kwargs)
    return _dispatch_break(fn, args, kwargs)


def _forced_break() -> None:
    return None


def force_graph_break() -> None:
    """End the current segment and start a new one, with no eager work in between. A no-op
    outside a capture. (With ``drop_empty`` two forced breaks in a row leave no empty graph.)"""
    call_with_graph_break(_forced_break)


def _refresh(kept: Any, fresh: Any, name: str) -> None:
    """Copy a replay's break results into the objects returned at capture (break contract 1)."""
    kept_leaves, kept_spec = tree_flatten(kept)
    fresh_leaves, fresh_spec = tree_flatten(fresh)
    if kept_spec != fresh_spec:
        raise GraphBreakError(
            f"break `{name}` returned a different structure at replay ({fresh_spec}) than at capture "
            f"({kept_spec}). A break must return the same structure every time."
        )
    for i, (k, f) in enumerate(zip(kept_leaves, fresh_leaves)):
        if isinstance(k, torch.Tensor):
            if not isinstance(f, torch.Tensor) or f.shape != k.shape or f.dtype != k.dtype:
                got = f"{tuple(f.shape)} {f.dtype}" if isinstance(f, torch.Tensor) else type(f).__name__
                raise GraphBreakError(
                    f"break `{name}` returned {got} for output #{i} at replay but {tuple(k.shape)} "
                    f"{k.dtype} at capture. Shapes are fixed per captured bucket: pad to the bucket, "
                    "or write into a preallocated buffer."
                )
            if f.data_ptr() != k.data_ptr() or f.stride() != k.stride():
                k.copy_(f)
        elif isinstance(k, _SCALARS) and k != f:
            raise StaleBreakResultError(
                f"break `{name}` returned {f!r} for output #{i} at replay but {k!r} at capture; the graph "
                "froze the capture-time value. Return it as a device tensor, or keep it out of the graph."
            )


@dataclass
class _BreakCall:
    """A recorded break: the function, its arguments (pool tensors as non-owning aliases, see
    the break contract), its capture results."""

    fn: Callable[..., Any]
    args: tuple
    kwargs: dict
    kept: Any
    name: str
    segment_before: int

    def run(self) -> None:
        _refresh(self.kept, self.fn(*self.args, **self.kwargs), self.name)


@dataclass
class _FoldedIsland:
    """A single-kernel segment run eagerly inside an eager step (``fold_islands``)."""

    segment: int
    run: Callable[[], None]


@dataclass
class _RawSegment:
    index: int
    segment: Segment
    after_break: str | None
    before_break: str | None


@dataclass
class _GraphStep:
    index: int
    segment: Segment

    def run(self) -> None:
        self.segment.replay()


@dataclass
class _EagerStep:
    calls: list[_BreakCall | _FoldedIsland]

    def run(self) -> None:
        for call in self.calls:
            call.run()


@dataclass
class IslandInfo:
    """A segment that holds a single kernel. ``segment``: its index in capture order (segment i
    is the code between break i-1 and break i, counting empty ones). ``op``: the op, where it was
    recorded. ``folded``: run eagerly inside the neighbouring eager step instead of as a graph."""

    segment: int
    op: str | None
    after_break: str | None
    before_break: str | None
    folded: bool


@dataclass
class BreakableGraphStats:
    """What a capture produced and how often it ran.

    ``segments``: graphs replayed per replay. ``eager_steps``: eager steps per replay (adjacent
    breaks merged into one). ``breaks``: break points met at capture (forced ones included).
    ``eager_calls``: break functions called per replay. ``empty_dropped``: segments with no work
    that keep no graph. ``kernels_per_segment``: per replayed segment (None: unknown).
    ``islands``: single-kernel segments, folded or not. ``kernel_count_source``: how kernels were
    counted. ``replays``: replays so far.
    """

    segments: int = 0
    eager_steps: int = 0
    breaks: int = 0
    eager_calls: int = 0
    empty_dropped: int = 0
    kernels_per_segment: list[int | None] = field(default_factory=list)
    islands: list[IslandInfo] = field(default_factory=list)
    kernel_count_source: str = ""
    replays: int = 0

    @property
    def single_kernel_islands(self) -> int:
        """Single-kernel segments still replayed as graphs."""
        return sum(not i.folded for i in self.islands)

    @property
    def folded_islands(self) -> int:
        return sum(i.folded for i in self.islands)

    def summary(self) -> str:
        return (
            f"{self.segments} segments, {self.eager_steps} eager steps ({self.eager_calls} calls, "
            f"{self.breaks} breaks), {self.empty_dropped} empty dropped, "
            f"{self.single_kernel_islands} single-kernel islands ({self.folded_islands} folded), "
            f"kernels/segment {self.kernels_per_segment} [{self.kernel_count_source}]"
        )


@dataclass
class _Checker:
    before: list[list[torch.Tensor]]
    after: list[list[torch.Tensor]]
    next_index: int = 0


class BreakableGraph:
    """An ordered list of graph segments and eager steps, captured once, replayed many times.

    Args:
        device: "cuda" (CUDA graphs) or "cpu" (CPU graph backend). Default: cuda if available.
        pool: memory-pool handle shared by every segment of this graph; pass the same handle to
            every BreakableGraph of a runner (one per token bucket) so all share one pool
            (``new_graph_pool(device)``). Ignored on CPU.
        drop_empty: a segment with no work keeps no graph (and no empty-graph warning), and breaks
            with nothing between them replay as one eager step.
        fold_islands: run a single-kernel segment eagerly inside the neighbouring eager step
            instead of as a graph (the op is re-run into the same output tensor). The better fix
            is often to move that op into the break function; ``stats.islands`` names them.
        debug: after each replay, re-run the body eagerly and compare (needs the
            ``capture(fn, *args)`` form; the body must be idempotent on state outside its
            arguments, e.g. KV-cache stores at fixed slots). None: read
            ``BREAKGRAPH_GRAPH_DEBUG`` (then a graph captured with the ``with`` form is replayed
            unchecked, with one warning).
        stream: CUDA capture stream (default: one side stream shared by every capture on the device).
        barrier_fn: called at capture after a segment ends and before its break runs (not at
            replay): re-aligns tensor-parallel ranks before a break that holds a collective, so
            every rank reaches the same break in the same order.
        rtol, atol: tolerances of the debug comparison for floating tensors.

    Warm up before capturing (run the body once eagerly): lazy initialisation inside a CUDA
    capture fails. Input data goes into static buffers that the body reads; outputs are the
    tensors the capture returned (``self.output``), rewritten by every replay.
    """

    def __init__(
        self,
        device: str | torch.device | None = None,
        *,
        pool: Any = None,
        drop_empty: bool = True,
        fold_islands: bool = False,
        debug: bool | None = None,
        stream: Any = None,
        barrier_fn: Callable[[], Any] | None = None,
        rtol: float = 1e-4,
        atol: float = 1e-5,
    ) -> None:
        if device is None:
            device = "cuda" if torch.cuda.is_available() else "cpu"
        self.device = torch.device(device)
        self.drop_empty = drop_empty
        self.fold_islands = fold_islands
        self.debug = debug_enabled(debug)
        self._debug_from_env = debug is None
        self.rtol, self.atol = rtol, atol
        self.barrier_fn = barrier_fn
        self._capturer = make_capturer(
            self.device, pool, record_ops=fold_islands, keep_empty_warning=not drop_empty, stream=stream
        )
        self.output: Any = None
        self._reset_state()

    # ------------------------------------------------------------------ state
    def _reset_state(self) -> None:
        self._phase = "new"
        self._raw: list[_RawSegment | _BreakCall | None] = []
        self._steps: list[_GraphStep | _EagerStep] = []
        self._calls: list[_BreakCall] = []
        self._body: tuple[Callable[..., Any], tuple, dict] | None = None
        self._segment_open = False
        self._segment_index = 0
        self._after: str | None = None
        self._label = ""
        self._checker: _Checker | None = None
        self.stats = BreakableGraphStats(kernel_count_source=self._capturer.kernel_count_source)

    def reset(self) -> None:
        """Drop the captured segments and recorded calls (and their buffers); capture again after."""
        self.output = None
        self._reset_state()

    @property
    def pool(self) -> Any:
        """The memory-pool handle of this graph's segments (None on CPU)."""
        return getattr(self._capturer, "pool", None)

    @property
    def is_captured(self) -> bool:
        return self._phase == "captured"

    # ---------------------------------------------------------------- capture
    def capture(self, fn: Callable[..., Any] | None = None, /, *args: Any, **kwargs: Any) -> Any:
        """Capture. Two forms:

        * ``with g.capture(): body...`` (a context manager);
        * ``out = g.capture(fn, *args, **kwargs)``: runs ``fn`` under capture, keeps its result as
          ``g.output`` and remembers ``fn``/args for the debug check.

        Raises GraphError if this graph already holds a capture (``reset()`` first) or another
        breakable graph is capturing/replaying in this thread. Any error inside the body leaves
        the graph empty.
        """
        if fn is None:
            if args or kwargs:
                raise TypeError("capture(): arguments given without a function")
            return self._capture_block()
        with self._capture_block():
            out = fn(*args, **kwargs)
            self.output = out
        self._body = (fn, args, kwargs)
        return out

    @contextlib.contextmanager
    def _capture_block(self) -> Iterator[BreakableGraph]:
        if self._phase != "new":
            raise GraphError("BreakableGraph.capture: this graph already holds a capture; call reset() first")
        if active_graph() is not None:
            raise GraphError("BreakableGraph.capture: another breakable graph is capturing or replaying here")
        self._capturer.open()
        self._phase = "capturing"
        ok = False
        try:
            with activate(ActiveGraph("capture", self)):
                self._open_segment()
                yield self
                ok = True
        except RuntimeError as exc:
            raise self._explain(exc) from exc
        finally:
            self._finish_capture(ok)

    def _explain(self, exc: RuntimeError) -> RuntimeError:
        if isinstance(exc, GraphError) or self.device.type != "cuda" or "captur" not in str(exc).lower():
            return exc
        return GraphError(
            f"CUDA refused an operation inside {self._label}: {str(exc).splitlines()[0]}. This is "
            "usually a host sync (.item(), .tolist(), bool(tensor), nonzero, a pageable copy). Capture "
            "the same code with BreakableGraph(device='cpu') to get the op and the line, then move it "
            "into a break or keep the value on the device."
        )

    def _open_segment(self) -> None:
        where = f"after break `{self._after}`" if self._after else "start of capture"
        self._label = f"segment {self._segment_index} ({where})"
        self._capturer.begin(self._label)
        self._segment_open = True

    def _close_segment(self, reason: str) -> None:
        self._segment_open = False
        segment = self._capturer.end(reason)
        self._raw.append(_RawSegment(self._segment_index, segment, self._after, reason))

    def _finish_capture(self, ok: bool) -> None:
        built = False
        try:
            if self._segment_open:
                if ok:
                    self._close_segment("end of capture")
                else:
                    self._segment_open = False
                    self._capturer.abort()
            if ok:
                self._build()
                built = True
        finally:
            self._capturer.close()
            if built:
                self._phase = "captured"
            else:
                self.output = None
                self._reset_state()

    def _on_break(self, state: ActiveGraph, fn: Callable[..., Any], args: tuple, kwargs: dict) -> Any:
        if state.phase == "check":
            return self._check_break(state, fn, args, kwargs)
        name = _name(fn)
        self._close_segment(name)
        if self.barrier_fn is not None and fn is not _forced_break:
            self.barrier_fn()
        state.in_break = True
        try:
            result = fn(*args, **kwargs)
        finally:
            state.in_break = False
        if fn is _forced_break:
            self._raw.append(None)
        else:
            kept_args, kept_kwargs = self._capturer.non_owning((args, dict(kwargs)))
            call = _BreakCall(fn, kept_args, kept_kwargs, result, name, self._segment_index)
            self._raw.append(call)
            self._calls.append(call)
        self._segment_index += 1
        self._after = name
        self._open_segment()
        return result

    def _build(self) -> None:
        stats = self.stats
        steps: list[_GraphStep | _EagerStep] = []
        pending: list[_BreakCall | _FoldedIsland] = []
        for item in self._raw:
            stats.breaks += not isinstance(item, _RawSegment)
            if item is None:
                continue
            if isinstance(item, _BreakCall):
                pending.append(item)
                continue
            seg = item.segment
            if seg.empty and self.drop_empty:
                stats.empty_dropped += 1
                continue
            island = seg.work == 1
            folded = island and self.fold_islands and seg.fold is not None
            if island:
                op = seg.op_names[0] if seg.op_names else None
                stats.islands.append(IslandInfo(item.index, op, item.after_break, item.before_break, folded))
            if folded:
                assert seg.fold is not None
                pending.append(_FoldedIsland(item.index, seg.fold))
                continue
            if pending:
                steps.append(_EagerStep(pending))
                pending = []
            steps.append(_GraphStep(item.index, seg))
            stats.kernels_per_segment.append(seg.work)
        if pending:
            steps.append(_EagerStep(pending))
        stats.segments = sum(isinstance(s, _GraphStep) for s in steps)
        stats.eager_steps = sum(isinstance(s, _EagerStep) for s in steps)
        stats.eager_calls = len(self._calls)
        self._steps = steps

    # ----------------------------------------------------------------- replay
    def replay(self) -> Any:
        """Run the captured steps: segment replays and recorded break calls, no Python model code.

        Returns ``self.output`` (the capture's output tensors, now holding this replay's values).
        With ``debug`` on, also re-runs the body eagerly and raises GraphReplayMismatchError naming
        the first segment whose values differ. Raises GraphNotCapturedError before a capture.
        """
        if self._phase != "captured":
            raise GraphNotCapturedError("BreakableGraph.replay: nothing captured; call capture() first")
        if active_graph() is not None:
            raise GraphError(
                "BreakableGraph.replay: called inside another breakable graph's capture or replay"
            )
        if self.debug and self._body is None and self._debug_from_env:
            warnings.warn(
                f"{DEBUG_ENV} is set but this graph was captured with `with g.capture():`; the debug "
                "check needs g.capture(fn, *args) and is skipped for it",
                stacklevel=2,
            )
            self._debug_from_env = False
            self.debug = False
        if self.debug:
            self._replay_checked()
        else:
            with activate(ActiveGraph("replay", self)):
                for step in self._steps:
                    step.run()
        self.stats.replays += 1
        return self.output

    def describe(self) -> str:
        """One line per replay step: graph segments with their kernel counts, eager steps."""
        lines = []
        for step in self._steps:
            if isinstance(step, _GraphStep):
                lines.append(f"graph  segment {step.index}: {step.segment.work} kernels")
            else:
                names = [
                    c.name if isinstance(c, _BreakCall) else f"[folded segment {c.segment}]"
                    for c in step.calls
                ]
                lines.append("eager  " + ", ".join(names))
        return "\n".join(lines)

    # ------------------------------------------------------------ debug check
    def _replay_checked(self) -> None:
        if self._body is None:
            raise GraphError(
                "BreakableGraph debug check needs the body: capture with g.capture(fn, *args) "
                "instead of the `with g.capture():` form, or turn debug off"
            )
        fn, args, kwargs = self._body
        inputs = tensor_leaves((args, kwargs))
        saved_inputs = clone_all(inputs)
        before: list[list[torch.Tensor]] = []
        after: list[list[torch.Tensor]] = []
        with activate(ActiveGraph("replay", self)):
            for step in self._steps:
                if isinstance(step, _GraphStep):
                    step.run()
                    continue
                for call in step.calls:
                    if isinstance(call, _BreakCall):
                        leaves = tensor_leaves((call.args, call.kwargs))
                        before.append(clone_all(leaves))
                        call.run()
                        after.append(clone_all(leaves))
                    else:
                        call.run()
        replay_out = clone_all(tensor_leaves(self.output))
        replay_inputs = clone_all(inputs)
        for t, saved in zip(inputs, saved_inputs):
            t.copy_(saved)
        self._checker = _Checker(before, after)
        try:
            with activate(ActiveGraph("check", self)):
                eager_out = fn(*args, **kwargs)
            if self._checker.next_index != len(self._calls):
                raise GraphReplayMismatchError(
                    f"the eager body called {self._checker.next_index} breaks where the capture recorded "
                    f"{len(self._calls)}: a Python branch taken at capture is not taken now."
                )
        finally:
            self._checker = None
        last = f"segment {self._segment_index} (after the last break, to the end of the body)"
        for what, got, want in (
            ("output", tensor_leaves(eager_out), replay_out),
            ("arguments", inputs, replay_inputs),
        ):
            msg = first_mismatch(got, want, self.rtol, self.atol)
            if msg is not None:
                raise GraphReplayMismatchError(self._mismatch(last, f"body {what} {msg}"))

    def _mismatch(self, where: str, msg: str) -> str:
        return (
            f"replay differs from the eager body in {where}: {msg}. Something there was frozen at "
            "capture: a Python branch, a Python scalar or a host-side value read by model code. Read it "
            "from a device tensor, or move it into a break that reads the forward context."
        )

    def _check_break(self, state: ActiveGraph, fn: Callable[..., Any], args: tuple, kwargs: dict) -> Any:
        if fn is _forced_break:
            return None
        checker = self._checker
        assert checker is not None
        k = checker.next_index
        checker.next_index += 1
        name = _name(fn)
        if k >= len(self._calls) or self._calls[k].fn is not fn:
            expected = f"`{self._calls[k].name}`" if k < len(self._calls) else "no break"
            raise GraphReplayMismatchError(
                f"the eager body called break #{k} `{name}` where the capture recorded {expected}: a "
                "Python branch taken at capture is not taken now."
            )
        call = self._calls[k]
        leaves = tensor_leaves((args, kwargs))
        # Compare only arguments the break did not write at replay (the segment's results).
        read = [i for i, (b, a) in enumerate(zip(checker.before[k], checker.after[k])) if torch.equal(b, a)]
        msg = first_mismatch(
            [leaves[i] for i in read if i < len(leaves)],
            [checker.before[k][i] for i in read],
            self.rtol,
            self.atol,
        )
        where = f"segment {call.segment_before} (before break `{call.name}`)"
        if msg is not None:
            raise GraphReplayMismatchError(self._mismatch(where, f"argument {msg}"))
        state.in_break = True
        try:
            result = fn(*args, **kwargs)
        finally:
            state.in_break = False
        msg = first_mismatch(tensor_leaves((args, kwargs)), checker.after[k], self.rtol, self.atol)
        if msg is not None:
            raise GraphReplayMismatchError(
                self._mismatch(f"{where} or that break", f"argument after the break {msg}")
            )
        return result
