"""Tensor parallelism: one process per rank; rank 0 drives, the others follow.

**Processes.** ``Engine(..., tp_size=N)`` makes the calling process rank 0 and starts ranks
1…N-1 itself (``torch.multiprocessing``, spawn), or, when torchrun started the job (``RANK``,
``WORLD_SIZE``, ``LOCAL_RANK`` set), joins the ranks torchrun started. Every rank builds the same
:class:`~breakgraph.engine.engine.Engine` — its own model shard (on ``cuda:{local_rank}``, or the
CPU), a KV cache of the same number of pages (the minimum over ranks), the same prefill and
decode graph buckets captured in the same order. Only rank 0 keeps the tokenizer, the scheduler
and the sampler. On ranks ≥ 1, ``Engine(...)`` then serves rank 0's commands until rank 0 shuts
down, and exits the process (it never returns).

**Communication.** Two channels:

* commands: rank 0 writes each command under its own key (``cmd/<n>``, pickled) in a TCPStore;
  workers block reading the next key. The store lives in rank 0's process (spawn), so a worker
  whose rank 0 died gets a connection error at once instead of waiting forever.
* data: the default ``torch.distributed`` process group, gloo for CPU tensors and NCCL for CUDA
  tensors (backend ``cpu:gloo,cuda:nccl``; gloo alone on CPU). For every forward rank 0 posts a
  header (mode, host-side lists, tensor shapes) and broadcasts the batch's device tensors packed
  into one int64 tensor; each worker unpacks them into a :class:`ForwardBatch` over its own KV
  cache; all ranks run the decoder body (the all-reduces live in the layers) and the LM head,
  whose vocabulary slices are gathered to rank 0.

**Failures.** Rank 0 watches the processes it started: when one exits unexpectedly, the others
are stopped and the next (or the current) step raises :class:`TensorParallelError` naming the
rank and its exit code. A gloo collective whose peer died fails at once; on CUDA, where an NCCL
collective with a dead peer can hang, rank 0 aborts the process group and, if its step still
has not returned after ``BREAKGRAPH_TP_GRACE_S`` (default 30 s), exits the process with the same
message. Workers exit when rank 0's store goes away or (spawned workers) when their parent
process is gone. Collectives time out after ``BREAKGRAPH_TP_TIMEOUT_S`` (default 1800 s, model
loading included).
"""

from __future__ import annotations

import atexit
import contextlib
import datetime
import logging
import os
import pickle
import signal
import sys
import threading
import time
import traceback
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING, Any, NoReturn

import torch
import torch.distributed as dist

from breakgraph.distributed import ParallelState
from breakgraph.engine.config import EngineConfig
from breakgraph.engine.model_runner import ModelRunner
from breakgraph.forward_context import ForwardBatch, ForwardMode

if TYPE_CHECKING:
    from breakgraph.engine.engine import Engine
    from breakgraph.engine.kv_cache import KVCache
    from breakgraph.models.glm5 import DsaForCausalLM

logger = logging.getLogger(__name__)

_FOREVER = datetime.timedelta(days=365)


class TensorParallelError(RuntimeError):
    """A tensor-parallel rank failed or could not start; the engine cannot continue."""


@dataclass(frozen=True)
class _Launch:
    """What a spawned worker is told: its rank and where rank 0's store listens."""

    rank: int
    world: int
    host: str
    port: int
    parent_pid: int


_SPAWNED: _Launch | None = None  # set in a worker process started by rank 0
_CURRENT: TPGroup | None = None  # the group of this process (one tensor-parallel engine at a time)


def _describe_exit(code: int | None) -> str:
    if code is None:
        return "is still running"
    if code < 0:
        try:
            return f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with code {code}"


# -- start-up ----------------------------------------------------------------------------------
def start(engine: Engine, config: EngineConfig) -> TPGroup:
    """Check the configuration, start (or join) the other ranks and the process group.

    Called from ``Engine.__init__`` after the config is read; sets ``engine.device`` to this
    rank's device. Spawned ranks are sent ``config``.
    """
    tp_size = config.tp_size
    from breakgraph.models.glm5 import check_tensor_parallel
    from breakgraph.models.loader import build_model

    check_tensor_parallel(engine.config, tp_size)
    if _SPAWNED is None:  # shard errors (FP8 block boundaries…) before any process starts
        build_model(engine.config, "meta", engine.dtype, parallel=ParallelState(0, tp_size))
    device = engine.device
    if device.type not in ("cpu", "cuda"):
        raise ValueError(f"--tp-size {tp_size}: tensor parallelism runs on 'cuda' or 'cpu', not {device}")
    if device.type == "cuda" and tp_size > torch.cuda.device_count():
        raise ValueError(
            f"--tp-size {tp_size} needs {tp_size} CUDA devices (one per rank) but {torch.cuda.device_count()} "
            "are visible; lower --tp-size or set CUDA_VISIBLE_DEVICES"
        )
    if device.type == "cpu" and config.cuda_graph_backend_decode == "full":
        raise ValueError(
            "--cuda-graph-backend-decode full cannot run with --tp-size > 1 on CPU: the CPU graph backend cannot "
            "record gloo collectives inside a full graph; use 'disabled'"
        )
    global _CURRENT
    if _CURRENT is not None and not _CURRENT._closed:
        if _CURRENT._ready:
            raise TensorParallelError(
                "a tensor-parallel engine is already running in this process; call its shutdown() first"
            )
        _CURRENT._abandon()  # an Engine(...) that failed half-way left its ranks behind
    if _SPAWNED is not None:
        group = TPGroup._join_spawned(_SPAWNED, device, config)
    elif "WORLD_SIZE" in os.environ and "RANK" in os.environ:
        group = TPGroup._join_torchrun(device, config)
    else:
        group = TPGroup._spawn(device, config)
    _CURRENT = group
    engine.device = group.device
    return group


@contextlib.contextmanager
def _spawn_environment() -> Iterator[None]:
    """What a spawned rank inherits: not the caller's ``__main__`` (ranks run breakgraph code
    only, so a script that builds ``Engine(tp_size=N)`` at top level needs no
    ``if __name__ == "__main__"`` guard, and a worker starts faster), and no progress bars
    (rank 0's are enough)."""
    main = sys.modules.get("__main__")
    saved = {k: main.__dict__[k] for k in ("__spec__", "__file__") if main is not None and k in main.__dict__}
    tqdm_env = os.environ.get("TQDM_DISABLE")
    try:
        if main is not None:
            main.__dict__["__spec__"] = None
            main.__dict__.pop("__file__", None)
        os.environ["TQDM_DISABLE"] = "1"
        yield
    finally:
        if main is not None:
            main.__dict__.update(saved)
        if tqdm_env is None:
            os.environ.pop("TQDM_DISABLE", None)
        else:
            os.environ["TQDM_DISABLE"] = tqdm_env


def _worker_entry(launch: _Launch, config: dict[str, Any]) -> None:
    """Body of a spawned rank: build the Engine as rank ``launch.rank`` (which then serves)."""
    global _SPAWNED
    _SPAWNED = launch
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is rank 0's to handle
    threading.Thread(target=_watch_parent, args=(launch,), daemon=True, name="breakgraph-tp-parent").start()
    if str(config.get("device") or "cpu").startswith("cpu") and not torch.cuda.is_available():
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // launch.world))
    from breakgraph.engine.engine import Engine

    try:
        Engine(EngineConfig.from_dict(config))
    except (SystemExit, KeyboardInterrupt):
        raise
    except BaseException as exc:  # noqa: BLE001 - reported, then the rank exits
        print(
            f"breakgraph tensor-parallel rank {launch.rank} failed during start-up: {exc!r}", file=sys.stderr
        )
        traceback.print_exc()
        sys.stderr.flush()
        os._exit(1)


def _watch_parent(launch: _Launch) -> None:
    """Exit this worker when the process that started it (rank 0) is gone."""
    while True:
        time.sleep(1.0)
        if os.getppid() != launch.parent_pid:
            print(
                f"breakgraph tensor-parallel rank {launch.rank}: rank 0 (pid {launch.parent_pid}) is gone; exiting",
                file=sys.stderr,
                flush=True,
            )
            os._exit(1)


# -- the group --------------------------------------------------------------------------------
class TPGroup:
    """This process's view of the tensor-parallel job: rank, device, the command channel, and
    (rank 0, spawn) the worker processes and their watchdog."""

    def __init__(
        self, rank: int, world: int, local_rank: int, device: torch.device, commands: Any, config: EngineConfig
    ) -> None:
        self.rank = rank
        self.config = config
        self.world = world
        self.local_rank = local_rank
        self.device = device
        self.state = ParallelState(rank, world)
        self._commands = commands  # a store: rank 0 writes cmd/<n>, workers read it
        self._store: Any = None  # rank 0 (spawn): the store server, alive as long as the group
        self._runner: weakref.ref[TPModelRunner] | None = None
        self._seq = 0
        self._last_forward = 0  # rank 0: the newest forward command
        self._deleted_through = 0  # rank 0: command keys deleted from the store so far
        self._procs: list[tuple[int, Any]] = []
        self._owns_group = True
        self._ready = False
        self._closed = False
        self._busy = False
        self.failure: str | None = None

    @property
    def worker_pids(self) -> list[int]:
        """Process ids of the ranks this process started (rank 0, spawn mode)."""
        return [p.pid for _, p in self._procs]

    # -- constructors ---------------------------------------------------------------------
    @staticmethod
    def _backend(device: torch.device) -> str:
        return "cpu:gloo,cuda:nccl" if device.type == "cuda" else "gloo"

    @staticmethod
    def _rank_device(device: torch.device, local_rank: int) -> torch.device:
        if device.type != "cuda":
            return device
        torch.cuda.set_device(local_rank)
        return torch.device("cuda", local_rank)

    @staticmethod
    def _check_no_group() -> None:
        if dist.is_initialized():
            raise TensorParallelError(
                "a torch.distributed process group already exists in this process: one tensor-parallel engine per "
                "process (call shutdown() on the previous Engine first)"
            )

    @classmethod
    def _init_process_group(
        cls, device: torch.device, rank: int, world: int, timeout: datetime.timedelta, store: Any = None
    ) -> None:
        cls._check_no_group()
        kwargs: dict[str, Any] = {"backend": cls._backend(device), "rank": rank, "world_size": world}
        kwargs["timeout"] = timeout
        if store is not None:
            kwargs["store"] = store
        else:
            kwargs["init_method"] = "env://"
        if device.type == "cuda":
            kwargs["device_id"] = device
        dist.init_process_group(**kwargs)

    @classmethod
    def _spawn(cls, device: torch.device, config: EngineConfig) -> TPGroup:
        cls._check_no_group()
        world, timeout = config.tp_size, _timeout(config)
        device = cls._rank_device(device, 0)
        store = dist.TCPStore("127.0.0.1", 0, world, is_master=True, timeout=timeout, wait_for_workers=False)
        group = cls(0, world, 0, device, dist.PrefixStore("cmd/", store), config)
        group._store = store
        ctx = torch.multiprocessing.get_context("spawn")
        launches = [_Launch(r, world, "127.0.0.1", store.port, os.getpid()) for r in range(1, world)]
        try:
            for launch in launches:
                proc = ctx.Process(
                    target=_worker_entry, args=(launch, config.to_dict()), name=f"breakgraph-tp{launch.rank}"
                )
                with _spawn_environment():
                    proc.start()
                group._procs.append((launch.rank, proc))
            group._wait_for_hellos(store)
            cls._init_process_group(device, 0, world, timeout, dist.PrefixStore("pg/", store))
        except BaseException:
            group._stop_processes()
            raise
        atexit.register(group.shutdown)
        threading.Thread(target=group._watch_workers, daemon=True, name="breakgraph-tp-watchdog").start()
        logger.info(
            "tensor parallelism: %d ranks on %s (worker pids %s)", world, device.type, group.worker_pids
        )
        return group

    @classmethod
    def _join_spawned(cls, launch: _Launch, device: torch.device, config: EngineConfig) -> TPGroup:
        device = cls._rank_device(device, launch.rank)
        timeout = _timeout(config)
        store = dist.TCPStore(launch.host, launch.port, launch.world, is_master=False, timeout=timeout)
        commands = dist.TCPStore(launch.host, launch.port, is_master=False, timeout=_FOREVER)
        group = cls(launch.rank, launch.world, launch.rank, device, dist.PrefixStore("cmd/", commands), config)
        store.set(f"hello/{launch.rank}", "1")
        cls._init_process_group(device, launch.rank, launch.world, timeout, dist.PrefixStore("pg/", store))
        return group

    @classmethod
    def _join_torchrun(cls, device: torch.device, config: EngineConfig) -> TPGroup:
        tp_size = config.tp_size
        rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        local_rank = int(os.environ.get("LOCAL_RANK", rank))
        if world != tp_size:
            raise ValueError(
                f"torchrun started WORLD_SIZE={world} processes but --tp-size is {tp_size}; make them equal"
            )
        device = cls._rank_device(device, local_rank)
        cls._init_process_group(device, rank, world, _timeout(config))
        host, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
        commands = dist.TCPStore(host, port, is_master=False, timeout=_FOREVER)
        group = cls(rank, world, local_rank, device, dist.PrefixStore("breakgraph/tp/cmd/", commands), config)
        if rank == 0:
            atexit.register(group.shutdown)
        return group

    def _wait_for_hellos(self, store: Any) -> None:
        """Wait until every spawned rank has started (imports done), or report the one that died."""
        keys = [f"hello/{r}" for r, _ in self._procs]
        deadline = time.monotonic() + self.config.tp_timeout_s
        while not store.check(keys):
            for r, p in self._procs:
                if p.exitcode is not None:
                    raise TensorParallelError(
                        f"tensor-parallel rank {r} (pid {p.pid}) {_describe_exit(p.exitcode)} during start-up; "
                        "its error is printed above"
                    )
            if time.monotonic() > deadline:
                raise TensorParallelError(f"tensor-parallel ranks did not start within {_timeout(self.config)}")
            time.sleep(0.05)

    # -- used by the Engine -----------------------------------------------------------------
    def agree_on_num_pages(self, num_pages: int) -> int:
        """The smallest KV pool any rank can hold (page ids are shared, so pools must match)."""

        def agree() -> int:
            t = torch.tensor([num_pages], dtype=torch.int64)
            dist.all_reduce(t, op=dist.ReduceOp.MIN)
            return int(t.item())

        return self._guarded(agree) if self.rank == 0 else agree()

    def make_runner(self, model: DsaForCausalLM, kv_cache: KVCache, device: torch.device) -> TPModelRunner:
        runner = TPModelRunner(model, kv_cache, device, self)
        self._runner = weakref.ref(runner)
        return runner

    def _drop_graphs(self) -> None:
        """Release captured graphs before the process group: graphs holding NCCL work can make
        the communicator's teardown hang."""
        runner = self._runner() if self._runner is not None else None
        if runner is not None:
            runner.prefill_graphs = runner.decode_graphs = None

    def ready(self, engine: Engine) -> None:
        """End of ``Engine.__init__``: rank 0 starts driving; other ranks serve (never return)."""
        self._ready = True
        if self.rank != 0:
            self.serve(engine)

    def on_set_prefill_backend(
        self, backend: str, buckets: list[int] | tuple[int, ...] | None, max_bucket: int | None
    ) -> None:
        """Rank 0, after start-up: make every worker rebuild its prefill graphs the same way."""
        if self.rank == 0 and self._ready:
            self._guarded(lambda: self._post(("set_prefill_backend", backend, buckets, max_bucket)))

    # -- commands -------------------------------------------------------------------------
    def _post(self, command: tuple) -> None:
        self._seq += 1
        self._commands.set(str(self._seq), pickle.dumps(command))
        # Every worker has read the commands up to the last forward: rank 0 posts again only
        # after that forward's logits came back from all of them. Later commands may be unread.
        while self._deleted_through < self._last_forward:
            self._deleted_through += 1
            self._commands.delete_key(str(self._deleted_through))

    def _receive(self) -> tuple:
        self._seq += 1
        return pickle.loads(self._commands.get(str(self._seq)))

    def send_batch(self, batch: ForwardBatch, all_logits: bool) -> None:
        """Rank 0: post the batch's header and broadcast its device tensors."""
        header, tensors = [], []
        for f in fields(ForwardBatch):
            value = getattr(batch, f.name)
            if f.name == "kv_cache":
                continue
            if isinstance(value, torch.Tensor):
                if value.dtype.is_floating_point or value.dtype.is_complex:
                    raise TypeError(
                        f"ForwardBatch.{f.name} is {value.dtype}; only integer tensors are sent to workers"
                    )
                header.append((f.name, "tensor", str(value.dtype).removeprefix("torch."), tuple(value.shape)))
                tensors.append(value.reshape(-1).to(torch.int64))
            else:
                header.append((f.name, "value", value.value if isinstance(value, ForwardMode) else value))
        self._post(("forward", all_logits, header))
        self._last_forward = self._seq
        packed = torch.cat(tensors) if tensors else torch.empty(0, dtype=torch.int64, device=self.device)
        dist.broadcast(packed, src=0)

    def _receive_batch(self, header: list, kv_cache: KVCache) -> ForwardBatch:
        sizes = [_numel(item[3]) for item in header if item[1] == "tensor"]
        packed = torch.empty(sum(sizes), dtype=torch.int64, device=self.device)
        dist.broadcast(packed, src=0)
        chunks = iter(packed.split(sizes))
        values: dict[str, Any] = {"kv_cache": kv_cache}
        for name, kind, *rest in header:
            if kind == "tensor":
                dtype, shape = getattr(torch, rest[0]), rest[1]
                values[name] = next(chunks).view(shape).to(dtype)
            else:
                values[name] = ForwardMode(rest[0]) if name == "mode" else rest[0]
        return ForwardBatch(**values)

    def serve(self, engine: Engine) -> NoReturn:
        """Ranks ≥ 1: run rank 0's commands until it shuts down, then exit the process."""
        code = 0
        try:
            while True:
                command = self._receive()
                if command[0] == "shutdown":
                    break
                if command[0] == "forward":
                    _, all_logits, header = command
                    batch = self._receive_batch(header, engine.kv_cache)
                    engine.runner.forward(batch, all_logits=all_logits)
                elif command[0] == "set_prefill_backend":
                    _, backend, buckets, max_bucket = command
                    engine.set_prefill_backend(backend, buckets, max_bucket)
                else:
                    raise TensorParallelError(f"unknown command {command[0]!r} from rank 0")
        except Exception as exc:  # noqa: BLE001 - any failure ends this rank with a message
            code = 1
            lost = isinstance(exc, dist.DistNetworkError) or "Connection closed" in str(exc)
            what = "lost contact with the other ranks" if lost else "failed"
            print(f"breakgraph tensor-parallel rank {self.rank} {what}: {exc}", file=sys.stderr)
            if not lost:
                traceback.print_exc()
            sys.stderr.flush()
        finally:
            self._closed = True
            self._drop_graphs()
            _destroy_group()
        raise SystemExit(code)

    # -- rank 0: failures and shutdown -------------------------------------------------------
    def check_alive(self) -> None:
        if self.failure is not None:
            raise TensorParallelError(self.failure)
        if self._closed:
            raise TensorParallelError("this tensor-parallel engine was shut down; build a new Engine")

    def _guarded(self, fn: Callable[[], Any]) -> Any:
        """Rank 0: run ``fn``, which the other ranks take part in. Any failure stops every rank
        and becomes a :class:`TensorParallelError` naming the rank that died, if one did."""
        self.check_alive()
        self._busy = True
        try:
            return fn()
        except TensorParallelError:
            raise
        except Exception as exc:
            raise self._fail(exc) from exc
        except BaseException:  # Ctrl-C half-way through a step: the ranks are out of step for good
            self.failure = "a step was interrupted on rank 0; every rank was stopped, build a new Engine"
            self.shutdown()
            raise
        finally:
            self._busy = False

    def _fail(self, exc: BaseException) -> TensorParallelError:
        """A step failed on rank 0: find out which rank died, stop everything, explain."""
        deadline = time.monotonic() + 5.0
        while self.failure is None and self._procs and time.monotonic() < deadline:
            self._check_workers()
            time.sleep(0.05)
        if self.failure is None:
            self.failure = f"tensor-parallel step failed on rank 0: {exc}; every rank was stopped"
        self.shutdown()
        return TensorParallelError(self.failure)

    def _check_workers(self) -> bool:
        for r, p in self._procs:
            if p.exitcode is not None and not self._closed and self.failure is None:
                self.failure = (
                    f"tensor-parallel rank {r} (pid {p.pid}) {_describe_exit(p.exitcode)}; every rank was stopped, "
                    "build a new Engine"
                )
                return True
        return False

    def _watch_workers(self) -> None:
        """Rank 0 (spawn): notice a worker that exits, stop the rest, unblock or end rank 0."""
        while not self._closed:
            if self._check_workers():
                logger.error("%s", self.failure)
                print(f"breakgraph: {self.failure}", file=sys.stderr, flush=True)
                self._stop_processes(timeout=0.0)
                if self.device.type == "cuda":
                    _abort_group()
                    deadline = time.monotonic() + self.config.tp_grace_s
                    while self._busy and time.monotonic() < deadline:
                        time.sleep(0.1)
                    if self._busy:
                        print(
                            f"breakgraph: rank 0 is stuck in a collective after: {self.failure}",
                            file=sys.stderr,
                        )
                        os._exit(1)
                return
            time.sleep(0.2)

    def _stop_processes(self, timeout: float = 10.0) -> None:
        deadline = time.monotonic() + timeout
        for _, p in self._procs:
            p.join(max(0.0, deadline - time.monotonic()))
        for _, p in self._procs:
            if p.exitcode is None:
                p.terminate()
        for _, p in self._procs:
            p.join(2.0)
            if p.exitcode is None:
                p.kill()
                p.join(2.0)

    def _abandon(self) -> None:
        """Stop the ranks of an engine whose construction failed on this rank."""
        if self.failure is None:
            self.failure = "the engine failed during start-up on rank 0"
        self._closed = True
        atexit.unregister(self.shutdown)
        self._stop_processes(timeout=0.0)
        self._drop_graphs()
        _destroy_group()

    def shutdown(self) -> None:
        """Stop every rank (rank 0; idempotent). Workers leave their serve loop and exit."""
        if self._closed or self.rank != 0:
            return
        healthy = self.failure is None
        self._closed = True
        atexit.unregister(self.shutdown)
        if healthy:
            try:
                self._post(("shutdown",))
            except Exception as exc:  # noqa: BLE001 - the store may be gone with a dead rank
                logger.debug("could not post shutdown: %s", exc)
        if not healthy:
            self._stop_processes(timeout=0.0)
        self._drop_graphs()
        _destroy_group()
        self._stop_processes()


def _timeout(config: EngineConfig) -> datetime.timedelta:
    return datetime.timedelta(seconds=config.tp_timeout_s)


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def _destroy_group(timeout: float = 30.0) -> None:
    """Destroy the default process group, giving up (with a warning) after ``timeout`` seconds:
    an NCCL teardown can hang, and shutting down must not."""
    if not dist.is_initialized():
        return

    def destroy() -> None:
        try:
            dist.destroy_process_group()
        except Exception as exc:  # noqa: BLE001 - a group whose peers died may not tear down cleanly
            logger.debug("destroy_process_group: %s", exc)

    thread = threading.Thread(target=destroy, daemon=True, name="breakgraph-tp-destroy")
    thread.start()
    thread.join(timeout)
    if thread.is_alive():
        logger.warning(
            "destroy_process_group did not return within %.0fs; leaving the process group behind", timeout
        )


def _abort_group() -> None:
    abort = getattr(dist.distributed_c10d, "_abort_process_group", None)
    if abort is not None:
        try:
            abort()
        except Exception as exc:  # noqa: BLE001 - best effort, the watchdog exits next
            logger.debug("abort process group: %s", exc)


class TPModelRunner(ModelRunner):
    """The model runner of a tensor-parallel rank. On rank 0 every forward first sends the batch
    to the other ranks (so they run the same forward); a failure anywhere becomes a
    :class:`TensorParallelError` naming the rank that died. On the other ranks it is the plain
    runner, called by the serve loop."""

    def __init__(
        self, model: DsaForCausalLM, kv_cache: KVCache, device: torch.device, group: TPGroup
    ) -> None:
        super().__init__(model, kv_cache, device)
        self.group = group

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch, all_logits: bool = False) -> torch.Tensor:
        if self.group.rank != 0:
            return super().forward(batch, all_logits)

        def step() -> torch.Tensor:
            self.group.send_batch(batch, all_logits)
            return super(TPModelRunner, self).forward(batch, all_logits)

        return self.group._guarded(step)
