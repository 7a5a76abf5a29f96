"""Piecewise graphs (PCG): a ``torch.compile`` backend that splits the FX graph at split ops and
captures one graph per piece per input shape (token bucket).

Use::

    backend = PiecewiseBackend(device="cuda", pool=new_graph_pool("cuda"))
    compiled = torch.compile(model, backend=backend)
    compiled(*bucket_inputs)                 # eager pieces: warm-up / fallback
    with backend.capturing():
        compiled(*bucket_inputs)             # capture every piece for these shapes (if new)
    with backend.replaying():
        out = compiled(*bucket_inputs)       # replay; a shape never captured raises

Pieces between split ops become CUDA graphs (CUDA, all in ``pool``) or CPU graph recordings
(CPU); split ops run eagerly between them, in the original order. A piece's graph reads the
tensors it was captured with: when a later call passes other tensor objects with different
memory, their values are copied into the captured ones first (a no-op for static buffers,
parameters and outputs of earlier pieces, which keep their addresses). Returned tensors are the
captured outputs and are rewritten by the next replay: copy what you keep. Inputs and outputs
that live in the pool are kept as non-owning aliases (the last piece's outputs excepted), so the
pool holds about one bucket's activations, not every piece's of every bucket.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import fx
from torch.fx.passes.split_module import split_module
from torch.utils._pytree import tree_flatten

from breakgraph.graphs._compare import debug_enabled, first_mismatch, tensor_leaves
from breakgraph.graphs.capture import make_capturer
from breakgraph.graphs.errors import GraphNotCapturedError, GraphReplayMismatchError
from breakgraph.graphs.segments import Segment, new_graph_pool
from breakgraph.graphs.split_ops import is_split_op, op_qualname

PieceCompiler = Callable[[fx.GraphModule, list[Any]], Callable[..., Any]]

_EMPTY_FUNCTIONS = (torch.empty, torch.empty_like, torch.empty_strided)
_EMPTY_METHODS = ("new_empty", "new_empty_strided")


def _uninitialised_outputs(gm: fx.GraphModule) -> set[int]:
    """Positions (in the flattened output) of outputs that are bare ``empty`` allocations: buffers
    a later split op fills, whose values the debug check must not compare."""
    output = next(n for n in gm.graph.nodes if n.op == "output")
    leaves, _ = tree_flatten(output.args[0])
    return {
        i
        for i, node in enumerate(leaves)
        if isinstance(node, fx.Node)
        and (
            (node.op == "call_function" and node.target in _EMPTY_FUNCTIONS)
            or (node.op == "call_method" and node.target in _EMPTY_METHODS)
        )
    }


@dataclass
class PieceInfo:
    """One submodule of a split graph: ``name`` (``submod_<index>``), ``is_split`` (a split-op
    call run eagerly) or a graph piece, and ``split_op`` (the op's qualified name, if any)."""

    name: str
    index: int
    is_split: bool
    split_op: str | None = None


def split_graph(
    gm: fx.GraphModule, is_split: Callable[[Any], bool] = is_split_op
) -> tuple[fx.GraphModule, list[PieceInfo]]:
    """Split ``gm`` at every node whose target ``is_split``; keep the original node order.

    Each split-op call gets a submodule of its own (odd index); the nodes between split ops form
    graph pieces (even index). Returns the split module and its pieces in execution order.
    """
    partition: dict[fx.Node, int] = {}
    split_names: dict[int, str | None] = {}
    current = 0
    for node in gm.graph.nodes:
        if node.op in ("placeholder", "output"):
            continue
        if node.op == "call_function" and is_split(node.target):
            current += 1
            partition[node] = current
            split_names[current] = op_qualname(node.target)
            current += 1
        else:
            partition[node] = current
    split = split_module(gm, gm, lambda node: partition[node], keep_original_order=True)
    pieces = []
    for node in split.graph.nodes:
        if node.op == "call_module":
            index = int(str(node.target).removeprefix("submod_"))
            pieces.append(PieceInfo(str(node.target), index, index % 2 == 1, split_names.get(index)))
    return split, pieces


@dataclass
class PiecewiseStats:
    """``graphs``: FX graphs received from torch.compile. ``pieces``: graph pieces and
    ``split_ops``: split-op calls, summed over those graphs. ``captures``: (piece, shape) graphs
    captured, ``empty_pieces`` of which hold no work. ``replays``: piece replays.
    ``eager_runs``: piece runs outside capturing()/replaying()."""

    graphs: int = 0
    pieces: int = 0
    split_ops: int = 0
    captures: int = 0
    empty_pieces: int = 0
    replays: int = 0
    eager_runs: int = 0
    split_op_names: list[str] = field(default_factory=list)


def _shape_key(args: tuple) -> tuple:
    key: list[Any] = []
    for a in args:
        if isinstance(a, torch.Tensor):
            key.append((tuple(a.shape), a.stride(), a.dtype, a.device))
        elif isinstance(a, (int, float, bool, str, type(None))):
            key.append(a)
        else:
            key.append(type(a).__name__)
    return tuple(key)


@dataclass
class _Entry:
    inputs: list[Any]
    outputs: Any
    segment: Segment

    def load(self, args: tuple) -> None:
        for static, a in zip(self.inputs, args):
            moved = isinstance(a, torch.Tensor) and a is not static
            if moved and (a.data_ptr() != static.data_ptr() or a.stride() != static.stride()):
                static.copy_(a)


class _GraphPiece(torch.nn.Module):
    """Runs one graph piece: eagerly, or through its captured graph for the call's shapes."""

    def __init__(self, gm: fx.GraphModule, index: int, backend: PiecewiseBackend, last: bool) -> None:
        super().__init__()
        self.gm = gm
        self.index = index
        self.last = last
        self._backend = backend
        self._entries: dict[tuple, _Entry] = {}
        self._compiled: Callable[..., Any] | None = None
        self._skip_in_check = _uninitialised_outputs(gm)

    def _run(self, *args: Any) -> Any:
        if self._backend.piece_compiler is None:
            return self.gm(*args)
        if self._compiled is None:
            self._compiled = self._backend.piece_compiler(self.gm, list(args))
        return self._compiled(*args)

    def forward(self, *args: Any) -> Any:
        backend = self._backend
        if backend.mode == "eager":
            backend.stats.eager_runs += 1
            return self._run(*args)
        key = _shape_key(args)
        entry = self._entries.get(key)
        if entry is None:
            if backend.mode == "replay":
                raise GraphNotCapturedError(
                    f"piece {self.index} has no graph for inputs {key}; capture this bucket first "
                    "(`with backend.capturing(): compiled(*inputs)`)"
                )
            return self._capture(key, args)
        entry.load(args)
        entry.segment.replay()
        backend.stats.replays += 1
        if backend.debug:
            self._check(entry, args)
        return entry.outputs

    def _capture(self, key: tuple, args: tuple) -> Any:
        backend = self._backend
        capturer = make_capturer(backend.device, backend.pool, stream=backend.stream)
        capturer.open()
        try:
            capturer.begin(f"piece {self.index} (inputs {key})")
            try:
                outputs = self._run(*args)
            except BaseException:
                capturer.abort()
                raise
            segment = capturer.end(f"end of piece {self.index}")
        finally:
            capturer.close()
        # Pool tensors are kept as non-owning aliases (as breakable graphs keep break arguments):
        # replay runs in stream order, so later pieces and buckets may reuse those bytes. The
        # last piece's outputs are what the caller gets back: those stay owned.
        kept_outputs = outputs if self.last else capturer.non_owning(outputs)
        self._entries[key] = _Entry(capturer.non_owning(list(args)), kept_outputs, segment)
        backend.stats.captures += 1
        backend.stats.empty_pieces += segment.empty
        return outputs

    def _check(self, entry: _Entry, args: tuple) -> None:
        backend = self._backend
        fresh_args = [a.detach().clone() if isinstance(a, torch.Tensor) else a for a in args]
        expected = self._run(*fresh_args)
        got, want = tree_flatten(entry.outputs)[0], tree_flatten(expected)[0]
        keep = [i for i in range(len(want)) if i not in self._skip_in_check]
        msg = first_mismatch(
            tensor_leaves([got[i] for i in keep]),
            tensor_leaves([want[i] for i in keep]),
            backend.rtol,
            backend.atol,
        )
        if msg is not None:
            raise GraphReplayMismatchError(
                f"piece {self.index} replayed values that differ from running it eagerly: {msg}. Something "
                "in it was frozen at capture (a Python value baked into the traced graph?)."
            )


class PiecewiseBackend:
    """``torch.compile`` backend: split at split ops, one graph per piece per input shape.

    Args:
        device: "cuda" (CUDA graphs) or "cpu" (CPU graph backend). Default: cuda if available.
        pool: CUDA memory-pool handle shared by every piece and every bucket (default: a new one).
        piece_compiler: optional ``(piece_gm, example_args) -> callable`` applied to each graph
            piece on its first run (e.g. ``torch._inductor.compile`` on CUDA). Default: plain FX.
        stream: CUDA capture stream (default: one side stream shared by every capture on the device).
        debug: after every piece replay, re-run the piece eagerly on copies and compare
            (GraphReplayMismatchError names the piece). None: read ``BREAKGRAPH_GRAPH_DEBUG``.

    Modes: outside ``capturing()``/``replaying()`` pieces run eagerly. Warm up (one eager call per
    bucket) before capturing on CUDA: lazy library initialisation fails inside a capture.
    """

    def __init__(
        self,
        device: str | torch.device | None = None,
        *,
        pool: Any = None,
        piece_compiler: PieceCompiler | None = None,
        stream: Any = None,
        debug: bool | None = None,
        rtol: float = 1e-4,
        atol: float = 1e-5,
    ) -> None:
        if device is None:
            device = "cuda" if torch.cuda.is_available() else "cpu"
        self.device = torch.device(device)
        self.pool = pool if pool is not None else new_graph_pool(self.device)
        self.piece_compiler = piece_compiler
        self.stream = stream
        self.debug = debug_enabled(debug)
        self.rtol, self.atol = rtol, atol
        self.mode = "eager"
        self.stats = PiecewiseStats()

    def __call__(self, gm: fx.GraphModule, example_inputs: list[Any]) -> Callable[..., Any]:
        split, pieces = split_graph(gm)
        last = max((p.index for p in pieces if not p.is_split), default=-1)
        for piece in pieces:
            if piece.is_split:
                self.stats.split_ops += 1
                if piece.split_op is not None and piece.split_op not in self.stats.split_op_names:
                    self.stats.split_op_names.append(piece.split_op)
                continue
            setattr(split, piece.name, _GraphPiece(getattr(split, piece.name), piece.index, self, piece.index == last))
            self.stats.pieces += 1
        self.stats.graphs += 1
        return split

    @contextlib.contextmanager
    def _mode(self, mode: str) -> Iterator[None]:
        previous, self.mode = self.mode, mode
        try:
            yield
        finally:
            self.mode = previous

    @contextlib.contextmanager
    def capturing(self) -> Iterator[None]:
        """Calls inside capture a graph for every piece whose input shapes are new (a piece
        already captured for these shapes replays). Results are correct on both devices."""
        with self._mode("capture"):
            yield

    @contextlib.contextmanager
    def replaying(self) -> Iterator[None]:
        """Calls inside must replay: a piece with no graph for the call's shapes raises
        GraphNotCapturedError. Raises the same on exit when no piece replayed while the compiled
        model has pieces: torch.compile ran the model without this backend (a recompile limit?)."""
        replays = self.stats.replays
        with self._mode("replay"):
            yield
        if self.stats.pieces and self.stats.replays == replays:
            raise GraphNotCapturedError(
                "no captured piece ran inside replaying(): torch.compile executed the model without this "
                "backend (recompile limit reached? a different backend?). Check torch._dynamo logs."
            )
