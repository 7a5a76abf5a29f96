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

import contextlib
import ctypes
import functools
import warnings
from collections.abc import Iterator
from typing import Any

import torch
from torch.utils._pytree import tree_flatten, tree_unflatten

from breakgraph.graphs.cpu_graph import OpRecorder
from breakgraph.graphs.errors import GraphBreakError, GraphError
from breakgraph.graphs.segments import Segment, recorded_fold

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


# Pools that saw a failed capture: torch (2.11) refuses every later capture into them.
_POISONED_POOLS: set[tuple[int, tuple[int, ...]]] = set()


def device_index(device: torch.device) -> int:
    """``device``'s CUDA index (the current device for a bare ``"cuda"``)."""
    return device.index if device.index is not None else torch.cuda.current_device()


def _pool_key(device: torch.device, pool: Any) -> tuple[int, tuple[int, ...]]:
    return device_index(device), tuple(pool)


@functools.cache
def _capture_stream_for(index: int) -> torch.cuda.Stream:
    return torch.cuda.Stream(index)


def capture_stream(device: torch.device) -> torch.cuda.Stream:
    """The one side stream every capture on ``device`` uses unless given another (as
    ``torch.cuda.graph`` does). One stream matters for memory: the caching allocator reuses a
    freed pool block only for allocations on the stream it was allocated on, so captures on
    fresh streams (one per bucket, one per piece) could never reuse each other's pool memory."""
    return _capture_stream_for(device_index(device))


def pool_segments(device: torch.device, pool: Any) -> list[tuple[int, int]]:
    """``[(start, end)]`` address ranges of the memory the allocator reserved for ``pool``."""
    index, key = _pool_key(device, pool)
    return [
        (s["address"], s["address"] + s["total_size"])
        for s in torch.cuda.memory_snapshot()
        if s["device"] == index and tuple(s.get("segment_pool_id", ())) == key
    ]


def _recover_failed_capture(device: torch.device, pool: Any) -> None:
    """Undo what a capture that failed half-way leaves behind in torch (2.11): when
    ``cudaStreamEndCapture`` fails inside ``capture_end`` (or ``capture_begin`` fails late), the
    allocator keeps routing to the pool ("already recording to mempool_id" at the next capture)
    and the RNG generators stay in capture mode ("Offset increment outside graph capture" at the
    next random op). End the pool routing, then run one empty capture, whose prologue/epilogue
    reset the generators. The pool itself stays unusable for captures (torch keeps it marked as
    recording), so it is remembered as poisoned."""
    key = _pool_key(device, pool)
    _POISONED_POOLS.add(key)
    try:
        torch._C._cuda_endAllocateToPool(key[0], pool)
    except (RuntimeError, AttributeError, TypeError):
        pass  # not recording: nothing to undo
    graph = torch.cuda.CUDAGraph()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            graph.capture_begin()
            graph.capture_end()
        except RuntimeError:
            pass


def _clear_cublas_workspaces() -> None:
    """Drop cuBLAS's cached per-stream workspaces. Before each segment's capture: a workspace
    cached from eager use (a break, or a warm-up run on the capture stream) lives outside the pool,
    and the clear after the captures would free it while the graphs still write into it (on an
    H100 the graphed training step then failed with "unspecified launch failure" two captures
    later). After: a workspace allocated inside the pool must not stay cached once that pool may
    be freed (a stale one makes later matmuls on a reused stream fail with
    CUBLAS_STATUS_EXECUTION_FAILED)."""
    clear = getattr(torch._C, "_cuda_clearCublasWorkspaces", None)
    if clear is not None:
        clear()


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
    runner so all buckets share it); a new one is made when None. Once every graph captured into
    a pool is freed, or after a capture into it failed, torch refuses new captures into it: take
    a new pool then. ``record_ops``: also record
    aten ops (for ``fold_islands``; keeps at most one kernel op per segment alive).
    ``keep_empty_warning``: let torch's empty-graph warning through and keep the empty graph.
    ``stream``: capture stream (default: :func:`capture_stream`, shared by every capture on the device).
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
        self._pool_ranges: list[tuple[int, int]] = []
        self._reserved_at_scan = -1

    def open(self) -> None:
        torch.cuda.synchronize(self.device)
        _clear_cublas_workspaces()
        if self._stream is None:
            self._stream = capture_stream(self.device)
        self._stream.wait_stream(torch.cuda.current_stream(self.device))
        self._stream_ctx = torch.cuda.stream(self._stream)
        self._stream_ctx.__enter__()

    def non_owning(self, tree: Any) -> Any:
        """``tree`` (a pytree of break arguments) with every tensor whose memory lies in this
        capturer's pool replaced by a non-owning alias: same address, dtype, shape and strides,
        but the allocator may hand the memory to later captures into the pool.

        Sound because every replay runs in stream order: a segment writes the tensor, the break
        reads or writes it before any later segment (of this or another bucket, never replayed
        concurrently) can reuse those bytes. Holding these tensors instead would keep every
        layer's break arguments of every bucket alive at once (tens of GiB at GLM-5 sizes).
        Tensors outside the pool (weights, caches, static inputs, break results) stay owned.
        """
        leaves, spec = tree_flatten(tree)
        if not any(isinstance(t, torch.Tensor) and t.is_cuda for t in leaves):
            return tree
        return tree_unflatten([self._alias(t) if self._in_pool(t) else t for t in leaves], spec)

    @contextlib.contextmanager
    def eager_in_pool(self) -> Iterator[None]:
        """While the block runs, every allocation on the device (any stream, any thread: an eager
        backward's too) comes from this capturer's pool, so an eager run between captures (a
        warm-up) reuses the free scratch of the graphs already in the pool instead of memory
        beside it. The pool must already hold a captured graph (torch refuses a pool all of whose
        graphs are gone), and nothing a later replay reads may live in the pool's free blocks."""
        index = device_index(self.device)
        torch._C._cuda_beginAllocateToPool(index, self.pool)
        try:
            yield
        finally:
            torch._C._cuda_endAllocateToPool(index, self.pool)
            torch._C._cuda_releasePool(index, self.pool)  # the reference the begin took

    def _in_pool(self, t: Any) -> bool:
        if not isinstance(t, torch.Tensor) or not t.is_cuda or t.untyped_storage().nbytes() == 0:
            return False
        ptr = t.untyped_storage().data_ptr()
        if not any(lo <= ptr < hi for lo, hi in self._pool_ranges):
            reserved = torch.cuda.memory_reserved(self.device)
            if reserved == self._reserved_at_scan:
                return False
            self._reserved_at_scan = reserved  # the pool may have grown since the last scan
            self._pool_ranges = pool_segments(self.device, self.pool)
        return any(lo <= ptr < hi for lo, hi in self._pool_ranges)

    @staticmethod
    def _alias(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        borrowed = torch._C._construct_storage_from_data_pointer(storage.data_ptr(), t.device, storage.nbytes())
        alias = torch.empty((), dtype=t.dtype, device=t.device)
        return alias.set_(borrowed, t.storage_offset(), t.shape, t.stride())

    def begin(self, label: str) -> None:
        self._label = label
        if _pool_key(self.device, self.pool) in _POISONED_POOLS:
            raise GraphError(
                f"cannot capture {label}: an earlier capture into this memory pool failed, and torch "
                "refuses further captures into it. Fix that error, then take a new pool "
                "(new_graph_pool('cuda')) and capture every bucket again."
            )
        _clear_cublas_workspaces()  # the segment's matmuls then take a workspace inside the pool
        self._graph, self._kept_graph = _new_graph()
        try:
            self._graph.capture_begin(pool=self.pool)
        except BaseException:
            self._graph = None
            _recover_failed_capture(self.device, self.pool)
            raise
        # Entered after capture_begin: its RNG prologue runs aten ops that are not in the graph.
        if self._record_ops or not (self._counts_from_driver and self._kept_graph):
            self._recorder = OpRecorder(label, keep_limit=1)
            self._recorder.__enter__()

    def _exit_recorder(self) -> OpRecorder | None:
        recorder, self._recorder = self._recorder, None
        if recorder is not None:
            recorder.__exit__(None, None, None)
        return recorder

    def end(self, reason: str) -> Segment:
        graph, self._graph = self._graph, None
        assert graph is not None, "end() without begin()"
        recorder = self._exit_recorder()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            try:
                graph.capture_end()
            except RuntimeError as exc:
                _recover_failed_capture(self.device, self.pool)
                raise _end_error(exc, self._label, reason) from exc
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
            # Keep the (never instantiated) graph alive: releasing the only graph of a pool drops
            # the pool's use count to zero, and the next capture into that pool then fails.
            return Segment(replay=lambda: None, work=0, empty=True, handle=graph)
        if self._kept_graph:
            graph.instantiate()
        graph.replay()  # the capture pass computes real values
        names = tuple(recorder.kernel_names) if recorder is not None else ()
        fold = recorded_fold(recorder) if work == 1 else None
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
                # the capture was invalid; the body's error is what matters
                _recover_failed_capture(self.device, self.pool)

    def close(self) -> None:
        if self._stream_ctx is not None:
            self._stream_ctx.__exit__(None, None, None)
            self._stream_ctx = None
        assert self._stream is not None
        torch.cuda.current_stream(self.device).wait_stream(self._stream)
        _clear_cublas_workspaces()
