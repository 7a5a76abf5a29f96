"""CUDA segments: capture with ``torch.cuda.CUDAGraph`` into a shared pool, count kernels, drop
empty graphs without torch's "The CUDA Graph is empty" warning.

Kernel counting: each segment is captured with ``keep_graph=True`` so the ``cudaGraph_t`` is still
there after ``capture_end``; its nodes are listed through the driver (``cuGraphGetNodes`` and
``cuGraphNodeGetType`` from ``libcuda.so.1``, which every NVIDIA driver ships) and kernel,
memcpy, memset, host, child-graph, batch-mem-op and conditional nodes count as work. This sees
every launch, also Triton and compiled kernels. Where the driver library or ``keep_graph`` is
missing, an aten-op recorder counts instead (exact for eager PyTorch code, blind to kernels
launched outside the dispatcher); ``kernel_count_source`` says which one ran.

Segment boundaries: one capture stream for the whole session, entered once in ``open`` (one
device sync per session, not per segment). Each segment is replayed once right after it is
captured, so the capture pass computes real values and a break at capture reads real inputs.
"""

from __future__ import annotations

import ctypes
import functools
import warnings
from typing import Any

import torch

from breakgraph.graphs.cpu_graph import OpRecorder
from breakgraph.graphs.errors import GraphBreakError
from breakgraph.graphs.segments import Segment, _recorded_fold

_EMPTY_GRAPH_WARNING = "The CUDA Graph is empty"
# CUgraphNodeType values that do work: kernel, memcpy, memset, host, child graph, batch mem op,
# conditional. Not work: empty, event record/wait, semaphores, mem alloc/free.
_WORK_NODE_TYPES = frozenset({0, 1, 2, 3, 4, 12, 13})


@functools.cache
def _driver() -> tuple[Any, Any] | None:
    try:
        lib = ctypes.CDLL("libcuda.so.1")
        get_nodes = lib.cuGraphGetNodes
        get_type = lib.cuGraphNodeGetType
    except (OSError, AttributeError):
        return None
    get_nodes.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.POINTER(ctypes.c_size_t)]
    get_nodes.restype = ctypes.c_int
    get_type.argtypes = [ctypes.c_void_p, ctypes.POINTER(ctypes.c_int)]
    get_type.restype = ctypes.c_int
    return get_nodes, get_type


def _new_graph() -> tuple[torch.cuda.CUDAGraph, bool]:
    try:
        return torch.cuda.CUDAGraph(keep_graph=True), True
    except TypeError:  # torch without keep_graph
        return torch.cuda.CUDAGraph(), False


def graph_work_nodes(graph: torch.cuda.CUDAGraph) -> int | None:
    """Number of work nodes in a captured graph that still holds its ``cudaGraph_t``
    (``keep_graph=True``), or None when the driver cannot be asked."""
    driver = _driver()
    if driver is None:
        return None
    get_nodes, get_type = driver
    try:
        raw = ctypes.c_void_p(graph.raw_cuda_graph())
    except (RuntimeError, AttributeError):
        return None
    count = ctypes.c_size_t(0)
    if get_nodes(raw, None, ctypes.byref(count)) != 0:
        return None
    if count.value == 0:
        return 0
    nodes = (ctypes.c_void_p * count.value)()
    if get_nodes(raw, nodes, ctypes.byref(count)) != 0:
        return None
    work = 0
    node_type = ctypes.c_int(0)
    for node in nodes[: count.value]:
        if get_type(ctypes.c_void_p(node), ctypes.byref(node_type)) != 0:
            return None
        work += node_type.value in _WORK_NODE_TYPES
    return work


def _end_error(exc: RuntimeError, label: str, reason: str) -> Exception:
    text = str(exc).lower()
    if "unjoined" in text or "not joined" in text:
        where = "the end of the capture" if reason == "end of capture" else f"break `{reason}`"
        return GraphBreakError(
            f"a side stream used in {label} was not joined back to the capture stream before {where}. "
            "Call torch.cuda.current_stream().wait_stream(side_stream) (or wait on an event recorded "
            f"on it) before `{reason}` runs."
        )
    return exc


class CudaSegmentCapturer:
    """Capturer for CUDA: each segment is a ``torch.cuda.CUDAGraph`` in ``pool``.

    ``pool``: memory-pool handle shared by every segment (pass one handle to every graph of a
    runner so all buckets share it); a new one is made when None. ``record_ops``: also record
    aten ops (for ``fold_islands``; keeps at most one kernel op per segment alive).
    ``keep_empty_warning``: let torch's empty-graph warning through and keep the empty graph.
    ``stream``: capture stream (a new side stream when None).
    """

    def __init__(
        self,
        device: torch.device,
        pool: Any = None,
        *,
        record_ops: bool = False,
        keep_empty_warning: bool = False,
        stream: torch.cuda.Stream | None = None,
    ) -> None:
        self.device = device
        self.pool = pool if pool is not None else torch.cuda.graph_pool_handle()
        self._stream = stream
        self._record_ops = record_ops
        self._keep_empty_warning = keep_empty_warning
        self._counts_from_driver = _driver() is not None
        self.kernel_count_source = "cuda graph nodes" if self._counts_from_driver else "recorded aten ops"
        self._stream_ctx: Any = None
        self._graph: torch.cuda.CUDAGraph | None = None
        self._kept_graph = False
        self._recorder: OpRecorder | None = None
        self._label = ""

    def open(self) -> None:
        torch.cuda.synchronize(self.device)
        if self._stream is None:
            self._stream = torch.cuda.Stream(self.device)
        self._stream.wait_stream(torch.cuda.current_stream(self.device))
        self._stream_ctx = torch.cuda.stream(self._stream)
        self._stream_ctx.__enter__()

    def begin(self, label: str) -> None:
        self._label = label
        self._graph, self._kept_graph = _new_graph()
        if self._record_ops or not (self._counts_from_driver and self._kept_graph):
            self._recorder = OpRecorder(label, keep_limit=1)
            self._recorder.__enter__()
        try:
            self._graph.capture_begin(pool=self.pool)
        except BaseException:
            self._exit_recorder()
            self._graph = None
            raise

    def _exit_recorder(self) -> OpRecorder | None:
        recorder, self._recorder = self._recorder, None
        if recorder is not None:
            recorder.__exit__(None, None, None)
        return recorder

    def end(self, reason: str) -> Segment:
        graph, self._graph = self._graph, None
        assert graph is not None, "end() without begin()"
        try:
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                try:
                    graph.capture_end()
                except RuntimeError as exc:
                    raise _end_error(exc, self._label, reason) from exc
        finally:
            recorder = self._exit_recorder()
        empty = False
        for w in caught:
            if _EMPTY_GRAPH_WARNING in str(w.message):
                empty = True
                if not self._keep_empty_warning:
                    continue
            warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)
        work = graph_work_nodes(graph) if self._kept_graph else None
        if work is None and recorder is not None and recorder.complete:
            work = recorder.kernels
        if work == 0 and self._counts_from_driver and self._kept_graph:
            empty = True
        if empty and not self._keep_empty_warning:
            return Segment(replay=lambda: None, work=0, empty=True)
        if self._kept_graph:
            graph.instantiate()
        graph.replay()  # the capture pass computes real values
        names = tuple(recorder.kernel_names) if recorder is not None else ()
        fold = _recorded_fold(recorder) if work == 1 else None
        return Segment(replay=graph.replay, work=work, empty=empty, op_names=names, fold=fold, handle=graph)

    def abort(self) -> None:
        graph, self._graph = self._graph, None
        self._exit_recorder()
        if graph is not None:
            try:
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    graph.capture_end()
            except RuntimeError:
                pass  # the capture is already invalid; the original error is what matters

    def close(self) -> None:
        if self._stream_ctx is not None:
            self._stream_ctx.__exit__(None, None, None)
            self._stream_ctx = None
        assert self._stream is not None
        torch.cuda.current_stream(self.device).wait_stream(self._stream)
