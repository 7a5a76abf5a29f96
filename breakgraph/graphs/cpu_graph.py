"""CPU graph backend: record a segment's tensor ops once, re-execute them on replay.

It gives CPU code the same contract as a CUDA graph, so CI (no GPU) proves that model code is
graph safe:

* ``capture_begin``/``capture_end`` run the code normally while a ``TorchDispatchMode`` records
  every aten op with its argument tensors and its outputs (strong references).
* ``replay`` re-executes the recorded ops only (no Python model code). Results land in the SAME
  output tensors as at capture (through the op's ``out=`` variant, or a copy), in-place ops
  mutate the same tensors, and view ops are not re-run: a view recorded at capture keeps
  pointing at the storage it was made from. So a Python value read at capture (a shape, a
  Python branch, a scalar) is frozen exactly as a CUDA graph freezes it.
* A host sync inside a segment raises :class:`HostSyncInGraphError` naming the op and the Python
  line: ``.item()``, ``.tolist()``, ``.numpy()``, ``.cpu()``, ``bool/int/float(tensor)``
  (``aten._local_scalar_dense``), ``torch.equal``, and ops whose output shape depends on data
  (``nonzero``, ``masked_select``, ``unique``, boolean-mask indexing, ``repeat_interleave`` with
  tensor repeats and no ``output_size``).

Costs: every intermediate of a recorded segment stays alive (there is no pool reuse), and a
replay pays Python dispatch per op. It exists for correctness, not speed. Kernels that do not go
through the aten dispatcher (a compiled graph, a raw Triton launch) are invisible to it.
"""

from __future__ import annotations

import contextlib
import os
import traceback
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from breakgraph.graphs.errors import HostSyncInGraphError

aten = torch.ops.aten

# Tensor methods that hand a device value to the host.
_SYNC_METHODS = frozenset(
    {
        "item",
        "tolist",
        "numpy",
        "cpu",
        "__bool__",
        "__int__",
        "__float__",
        "__index__",
        "__complex__",
        "__array__",
    }
)
# Ops that launch no kernel: views, metadata changes, uninitialised allocations.
_NO_KERNEL_OPS = frozenset(
    {
        aten.empty.memory_format,
        aten.empty_strided.default,
        aten.empty_like.default,
        aten.new_empty.default,
        aten.new_empty_strided.default,
        aten._unsafe_view.default,
        aten.lift_fresh.default,
        aten.detach.default,
        aten.alias.default,
    }
)
# Ops whose output shape depends on the data only when an index is a boolean mask.
_INDEX_OPS = frozenset(
    {aten.index.Tensor, aten.index_put.default, aten.index_put_.default, aten._index_put_impl_.default}
)
_REPEAT_INTERLEAVE_OPS = frozenset({aten.repeat_interleave.Tensor, aten.repeat_interleave.self_Tensor})

_TORCH_DIR = os.path.dirname(torch.__file__)
_HERE = os.path.dirname(os.path.abspath(__file__))


def user_frame() -> str:
    """``file:line in function: source`` of the innermost frame outside torch and this package."""
    for frame in reversed(traceback.extract_stack()):
        name = frame.filename
        if name.startswith((_TORCH_DIR, _HERE, "<frozen")) or name.endswith("contextlib.py"):
            continue
        return f"{name}:{frame.lineno} in {frame.name}: {(frame.line or '').strip()}"
    return "<unknown location>"


def is_metadata_op(func: torch._ops.OpOverload) -> bool:
    """True for ops that launch no kernel (views, in-place metadata changes, ``empty``)."""
    return func.is_view or torch.Tag.inplace_view in func.tags or func in _NO_KERNEL_OPS


def _copied_instead_of_viewed(func: torch._ops.OpOverload, args: tuple, out: Any) -> bool:
    """True when a view-annotated op (``reshape``, ``flatten``…) returned fresh memory: it copied,
    so replay must re-run it like a kernel."""
    if not func.is_view or not isinstance(out, torch.Tensor) or not args or not isinstance(args[0], torch.Tensor):
        return False
    return out.untyped_storage().data_ptr() != args[0].untyped_storage().data_ptr()


def host_sync_reason(func: torch._ops.OpOverload, args: tuple, kwargs: dict) -> str | None:
    """Why ``func(*args, **kwargs)`` needs the host to read device data, or None if it does not."""
    if func in _INDEX_OPS:
        indices = args[1] if len(args) > 1 else kwargs.get("indices", ())
        if any(isinstance(i, torch.Tensor) and i.dtype in (torch.bool, torch.uint8) for i in indices or ()):
            return "boolean-mask indexing has a data-dependent output shape"
        return None
    if func in _REPEAT_INTERLEAVE_OPS:
        if kwargs.get("output_size") is not None:
            return None
        return "repeat_interleave with tensor repeats needs output_size= to be graph safe"
    if torch.Tag.data_dependent_output in func.tags:
        return "its result is read on the host"
    if torch.Tag.dynamic_output_shape in func.tags:
        return "its output shape depends on the data"
    return None


def _raise_host_sync(what: str, why: str, label: str) -> None:
    raise HostSyncInGraphError(
        f"host sync `{what}` inside {label or 'a graph segment'} at {user_frame()} ({why}). "
        "A replay cannot see host-side values. Keep the value on the device, give the op a static "
        "size, or move this code into a break (@eager_on_graph)."
    )


def _targets_cpu(args: tuple, kwargs: dict) -> bool:
    """Whether a ``Tensor.to(...)`` call names the CPU as its target device."""
    for value in (*args[1:], kwargs.get("device")):
        if isinstance(value, str) and value.split(":")[0] == "cpu":
            return True
        if isinstance(value, torch.device) and value.type == "cpu":
            return True
    return False


class _HostSyncGuard(TorchFunctionMode):
    """Rejects Python-level tensor methods that read device data on the host."""

    def __init__(self, label: str) -> None:
        super().__init__()
        self.label = label

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        if name in _SYNC_METHODS:
            _raise_host_sync(f"Tensor.{name}()", "it copies a device value to the host", self.label)
        if name == "to" and _targets_cpu(args, kwargs):
            _raise_host_sync("Tensor.to('cpu')", "it copies a device value to the host", self.label)
        return func(*args, **kwargs)


def _out_variant(func: torch._ops.OpOverload) -> torch._ops.OpOverload | None:
    """The ``out=`` overload of a functional single-output op, or None."""
    schema = func._schema
    if schema.is_mutable or len(schema.returns) != 1 or str(schema.returns[0].type) != "Tensor":
        return None
    names = [a.name for a in schema.arguments]
    packet = func.overloadpacket
    for overload_name in packet.overloads():
        overload = getattr(packet, overload_name)
        arguments = overload._schema.arguments
        outs = [a for a in arguments if a.is_out]
        if len(outs) == 1 and outs[0].name == "out" and [a.name for a in arguments if not a.is_out] == names:
            return overload
    return None


def _same_memory(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (
        a.data_ptr() == b.data_ptr()
        and a.shape == b.shape
        and a.stride() == b.stride()
        and a.dtype == b.dtype
    )


def land(kept: Any, fresh: Any) -> None:
    """Copy every tensor leaf of ``fresh`` into the matching leaf of ``kept`` (same pytree), unless
    both already are the same memory. Shapes and dtypes must match."""
    kept_leaves, _ = tree_flatten(kept)
    fresh_leaves, _ = tree_flatten(fresh)
    for k, f in zip(kept_leaves, fresh_leaves):
        if isinstance(k, torch.Tensor) and isinstance(f, torch.Tensor) and not _same_memory(k, f):
            k.copy_(f)


@dataclass
class RecordedOp:
    """One aten op seen at capture: the op, its arguments and its outputs, all held strongly."""

    func: torch._ops.OpOverload
    args: tuple
    kwargs: dict
    out: Any
    kernel: bool
    _out_op: torch._ops.OpOverload | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        if self.kernel and isinstance(self.out, torch.Tensor) and "out" not in self.kwargs:
            self._out_op = _out_variant(self.func)

    @property
    def name(self) -> str:
        return str(self.func)

    def replay(self) -> None:
        """Re-run the op so that its results land in the recorded output tensors."""
        if not self.kernel:
            return  # views and metadata ops keep pointing at the same storage
        if self._out_op is not None:
            try:
                self._out_op(*self.args, **self.kwargs, out=self.out)
                return
            except (RuntimeError, TypeError, ValueError):  # an out= variant with other rules: copy
                self._out_op = None
        land(self.out, self.func(*self.args, **self.kwargs))


class OpRecorder(TorchDispatchMode):
    """Records aten ops (and rejects host syncs) while active.

    ``keep_limit``: keep at most this many kernel ops; past it the recording is dropped (only the
    count goes on) and ``complete`` turns False. None keeps everything.
    """

    def __init__(self, label: str = "", keep_limit: int | None = None) -> None:
        super().__init__()
        self.label = label
        self.keep_limit = keep_limit
        self.ops: list[RecordedOp] = []
        self.kernels = 0
        self.kernel_names: list[str] = []
        self.complete = True

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        why = host_sync_reason(func, args, kwargs)
        if why is not None:
            _raise_host_sync(str(func), why, self.label)
        out = func(*args, **kwargs)
        kernel = not is_metadata_op(func) or _copied_instead_of_viewed(func, args, out)
        if kernel:
            self.kernels += 1
            if len(self.kernel_names) < 8:
                self.kernel_names.append(str(func))
        if self.complete:
            if self.keep_limit is not None and self.kernels > self.keep_limit:
                self.ops.clear()
                self.complete = False
            else:
                self.ops.append(RecordedOp(func, args, kwargs, out, kernel))
        return out


class CpuGraph:
    """CPU stand-in for ``torch.cuda.CUDAGraph`` (same life cycle: capture once, replay many).

    Contract: tensors read by the captured code must stay the same tensor objects (static
    buffers); write new inputs into them before ``replay``. Outputs of the capture are the
    tensors the replay writes. Host syncs raise :class:`HostSyncInGraphError` during capture.
    """

    def __init__(self) -> None:
        self._recorder: OpRecorder | None = None
        self._guard: _HostSyncGuard | None = None
        self._capturing = False

    def capture_begin(self, label: str = "a CPU graph", keep_limit: int | None = None) -> None:
        """Start recording on this thread. ``label`` names the segment in error messages."""
        if self._capturing or self._recorder is not None:
            raise RuntimeError("CpuGraph.capture_begin: this graph already holds a capture")
        self._recorder = OpRecorder(label, keep_limit)
        self._guard = _HostSyncGuard(label)
        self._guard.__enter__()
        self._recorder.__enter__()
        self._capturing = True

    def capture_end(self) -> None:
        """Stop recording. Safe to call after an error inside the captured code."""
        if not self._capturing:
            return
        self._capturing = False
        assert self._recorder is not None and self._guard is not None
        self._recorder.__exit__(None, None, None)
        self._guard.__exit__(None, None, None)

    @property
    def recorder(self) -> OpRecorder:
        if self._recorder is None:
            raise RuntimeError("CpuGraph: nothing captured yet")
        return self._recorder

    @property
    def kernels(self) -> int:
        """Number of recorded ops that would launch a kernel on a GPU."""
        return self.recorder.kernels

    @property
    def empty(self) -> bool:
        """True when the capture holds no kernel (views and allocations only)."""
        return self.recorder.kernels == 0

    @property
    def op_names(self) -> tuple[str, ...]:
        """Names of the first recorded kernel ops (at most 8)."""
        return tuple(self.recorder.kernel_names)

    def replay(self) -> None:
        """Re-execute the recorded ops in order, writing into the recorded tensors."""
        if self._capturing:
            raise RuntimeError("CpuGraph.replay: capture still in progress")
        with torch.no_grad():  # recorded kernels, backward ones included: nothing for autograd to track
            for op in self.recorder.ops:
                op.replay()


@contextlib.contextmanager
def cpu_graph(graph: CpuGraph, label: str = "a CPU graph") -> Iterator[CpuGraph]:
    """Capture the block into ``graph`` (the CPU twin of ``torch.cuda.graph``)."""
    graph.capture_begin(label)
    try:
        yield graph
    finally:
        graph.capture_end()
