"""Tensor parallelism, the processes: start (or join) the ranks, the process group, the
command channel's transport, and the watchdogs. What runs on the ranks is in
:mod:`breakgraph.engine.executor`; what a command looks like in :mod:`breakgraph.engine.tp_channel`.

**Processes.** ``Engine(..., tp_size=N)`` makes the calling process rank 0 and starts ranks
1…N-1 itself (``torch.multiprocessing``, spawn), or, when torchrun started the job (``RANK``,
``WORLD_SIZE``, ``LOCAL_RANK`` set), joins the ranks torchrun started. Every rank builds the same
:class:`~breakgraph.engine.model_runner.ModelRunner` — its own model shard (on
``cuda:{local_rank}``, or the CPU), a KV cache of the same number of pages (the minimum over
ranks), the same prefill and decode graph buckets captured in the same order. Only rank 0 builds
an ``Engine`` (tokenizer, scheduler, sampler); the other ranks run rank 0's commands on their
runner until rank 0 shuts down, and exit.

**Communication.** Two channels:

* commands: rank 0 writes each command, signed (:mod:`breakgraph.engine.tp_channel`), under its
  own key (``cmd/<n>``) in a TCPStore; workers block reading the next key. Spawned: the store
  lives in rank 0's process and listens on 127.0.0.1 only (a socket bound there is handed to the
  store), so a worker whose rank 0 died gets a connection error at once. Under torchrun the
  commands sit in torchrun's store, which listens where torchrun's ``--master-addr`` says (the
  multi-node case), and the job's key comes from ``BREAKGRAPH_TP_SECRET``.
* data: the default ``torch.distributed`` process group, gloo for CPU tensors and NCCL for CUDA
  tensors (backend ``cpu:gloo,cuda:nccl``; gloo alone on CPU).

**Failures.** Rank 0 watches the processes it started: when one exits unexpectedly, the others
are stopped and the next (or the current) step raises :class:`TensorParallelError` naming the
rank and its exit code. A gloo collective whose peer died fails at once; on CUDA, where an NCCL
collective with a dead peer can hang, rank 0 aborts the process group and, if its step still
has not returned after ``BREAKGRAPH_TP_GRACE_S`` (``EngineConfig.tp_grace_s``), exits the
process with the same message. Workers exit when rank 0's store goes away or (spawned workers)
when their parent process is gone. Collectives time out after ``BREAKGRAPH_TP_TIMEOUT_S``
(``EngineConfig.tp_timeout_s``, model loading included).
"""

from __future__ import annotations

import atexit
import contextlib
import datetime
import logging
import os
import secrets
import signal
import socket
import sys
import threading
import time
import traceback
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from breakgraph import env
from breakgraph.distributed import ParallelState
from breakgraph.engine.config import EngineConfig
from breakgraph.engine.tp_channel import CommandChannel

if TYPE_CHECKING:
    from breakgraph.engine.model_runner import ModelRunner
    from breakgraph.models.config import ModelConfig

logger = logging.getLogger(__name__)

_FOREVER = datetime.timedelta(days=365)
LOOPBACK = "127.0.0.1"
SECRET_ENV = "BREAKGRAPH_TP_SECRET"


class TensorParallelError(RuntimeError):
    """A tensor-parallel rank failed or could not start; the engine cannot continue."""


@dataclass(frozen=True)
class _Launch:
    """What a spawned worker is told (in its spawn arguments, never over the store): its rank,
    where rank 0's store listens, the job's command key and the engine config."""

    rank: int
    world: int
    host: str
    port: int
    parent_pid: int
    key: bytes
    config: dict[str, Any]


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


def under_torchrun() -> bool:
    """Whether torchrun started this process (``RANK`` and ``WORLD_SIZE`` set)."""
    return "WORLD_SIZE" in os.environ and "RANK" in os.environ


def spawned_config() -> dict[str, Any] | None:
    """In a worker that rank 0 spawned: the config it was sent, else None."""
    return _SPAWNED.config if _SPAWNED is not None else None


# -- start-up ----------------------------------------------------------------------------------
def start(
    model_config: ModelConfig,
    dtype: torch.dtype,
    device: torch.device,
    config: EngineConfig,
    worker_main: Callable[[], None] | None = None,
) -> TPGroup:
    """Check the configuration, then start (``worker_main`` is what each spawned rank runs) or
    join the other ranks and the process group. The group's ``device`` is this rank's device."""
    from breakgraph.models.glm5 import check_tensor_parallel
    from breakgraph.models.loader import build_model

    tp_size = config.tp_size
    check_tensor_parallel(model_config, tp_size)
    if _SPAWNED is None:  # shard errors (FP8 block boundaries…) before any process starts
        build_model(model_config, "meta", dtype, parallel=ParallelState(0, tp_size))
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
        _CURRENT.abandon()  # an Engine(...) that failed half-way left its ranks behind
    if _SPAWNED is not None:
        group = TPGroup._join_spawned(_SPAWNED, device, config)
    elif under_torchrun():
        group = TPGroup._join_torchrun(device, config)
    else:
        if worker_main is None:
            raise ValueError("starting tensor-parallel ranks needs the function they run (worker_main)")
        group = TPGroup._spawn(device, config, worker_main)
    _CURRENT = group
    return group


@contextlib.contextmanager
def _environment(**values: str | None) -> Iterator[None]:
    """Environment variables set to ``values`` (None: left as they are) for the block."""
    saved = {k: os.environ.get(k) for k, v in values.items() if v is not None}
    try:
        os.environ.update({k: v for k, v in values.items() if v is not None})
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _loopback_gloo() -> dict[str, str | None]:
    """Gloo listens on the address the host name resolves to unless ``GLOO_SOCKET_IFNAME``
    names an interface: a job whose ranks all run here binds the loopback interface instead."""
    if "GLOO_SOCKET_IFNAME" in os.environ:
        return {}
    names = {name for _, name in socket.if_nameindex()}
    lo = next((n for n in ("lo", "lo0") if n in names), None)
    if lo is None:
        logger.warning("no loopback interface found; gloo listens where the host name resolves")
    return {"GLOO_SOCKET_IFNAME": lo}


@contextlib.contextmanager
def _spawn_environment() -> Iterator[None]:
    """What a spawned rank inherits: not the caller's ``__main__`` (ranks run breakgraph code
    only, so a script that builds ``Engine(tp_size=N)`` at top level needs no
    ``if __name__ == "__main__"`` guard, and a worker starts faster), no progress bars (rank 0's
    are enough), and gloo on the loopback interface."""
    main = sys.modules.get("__main__")
    saved = {k: main.__dict__[k] for k in ("__spec__", "__file__") if main is not None and k in main.__dict__}
    try:
        if main is not None:
            main.__dict__["__spec__"] = None
            main.__dict__.pop("__file__", None)
        with _environment(TQDM_DISABLE="1", **_loopback_gloo()):
            yield
    finally:
        if main is not None:
            main.__dict__.update(saved)


def _worker_entry(launch: _Launch, worker_main: Callable[[], None]) -> None:
    """Body of a spawned rank: watch the parent, then run ``worker_main`` (which joins the group
    through :func:`start` and serves rank 0)."""
    global _SPAWNED
    _SPAWNED = launch
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is rank 0's to handle
    threading.Thread(target=_watch_parent, args=(launch,), daemon=True, name="breakgraph-tp-parent").start()
    if str(launch.config.get("device") or "cpu").startswith("cpu") and not torch.cuda.is_available():
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // launch.world))
    try:
        worker_main()
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


def loopback_store(world: int, timeout: datetime.timedelta) -> Any:
    """A TCPStore server (this process) that listens on 127.0.0.1 only. TCPStore binds every
    interface whatever its host argument, so a socket is bound here and handed over (the store
    owns it from then on and closes it)."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind((LOOPBACK, 0))
    try:
        sock.listen(128)
        store = dist.TCPStore(
            LOOPBACK, sock.getsockname()[1], world, is_master=True, timeout=timeout, wait_for_workers=False,
            master_listen_fd=sock.fileno(), use_libuv=True,
        )  # fmt: skip
    except BaseException:
        sock.close()
        raise
    sock.detach()
    return store


def torchrun_key() -> bytes:
    """The command key of a torchrun job: ``BREAKGRAPH_TP_SECRET`` (hex, the same on every rank)."""
    secret = env.read(SECRET_ENV)
    try:
        key = bytes.fromhex(secret)
    except ValueError:
        key = b""
    if len(key) < 16:
        raise TensorParallelError(
            f"under torchrun every rank needs the same {SECRET_ENV} (at least 32 hex digits) to sign rank 0's "
            f"commands, e.g. {SECRET_ENV}=$(python -c 'import secrets; print(secrets.token_hex(32))') torchrun ..."
        )
    return key


# -- the group --------------------------------------------------------------------------------
class TPGroup:
    """This process's view of the tensor-parallel job: rank, device, the command channel, and
    (rank 0, spawn) the worker processes and their watchdog."""

    def __init__(
        self, rank: int, world: int, local_rank: int, device: torch.device, channel: CommandChannel,
        config: EngineConfig,
    ) -> None:  # fmt: skip
        self.rank = rank
        self.world = world
        self.local_rank = local_rank
        self.device = device
        self.config = config
        self.state = ParallelState(rank, world)
        self.channel = channel
        self._store: Any = None  # rank 0 (spawn): the store server, alive as long as the group
        self._runner: weakref.ref[ModelRunner] | None = None
        self._procs: list[tuple[int, Any]] = []
        self._ready = False
        self._closed = False
        self._busy = False
        self.failure: str | None = None

    @property
    def worker_pids(self) -> list[int]:
        """Process ids of the ranks this process started (rank 0, spawn mode)."""
        return [p.pid for _, p in self._procs]

    @property
    def store_port(self) -> int | None:
        """The port of the store this process serves (rank 0, spawn mode), else None."""
        return self._store.port if self._store is not None else None

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
    def _spawn(cls, device: torch.device, config: EngineConfig, worker_main: Callable[[], None]) -> TPGroup:
        cls._check_no_group()
        world, timeout = config.tp_size, _timeout(config)
        device = cls._rank_device(device, 0)
        store = loopback_store(world, timeout)
        key = secrets.token_bytes(32)
        group = cls(0, world, 0, device, CommandChannel(dist.PrefixStore("cmd/", store), key), config)
        group._store = store
        ctx = torch.multiprocessing.get_context("spawn")
        launches = [
            _Launch(r, world, LOOPBACK, store.port, os.getpid(), key, config.to_dict()) for r in range(1, world)
        ]
        try:
            for launch in launches:
                proc = ctx.Process(
                    target=_worker_entry, args=(launch, worker_main), name=f"breakgraph-tp{launch.rank}"
                )
                with _spawn_environment():
                    proc.start()
                group._procs.append((launch.rank, proc))
            group._wait_for_hellos(store)
            with _environment(**_loopback_gloo()):
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
        channel = CommandChannel(dist.PrefixStore("cmd/", commands), launch.key)
        group = cls(launch.rank, launch.world, launch.rank, device, channel, config)
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
        key = torchrun_key()
        device = cls._rank_device(device, local_rank)
        cls._init_process_group(device, rank, world, _timeout(config))
        host, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
        commands = dist.TCPStore(host, port, is_master=False, timeout=_FOREVER)
        channel = CommandChannel(dist.PrefixStore("breakgraph/tp/cmd/", commands), key)
        group = cls(rank, world, local_rank, device, channel, config)
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

    # -- used while the runners are built --------------------------------------------------
    def agree_on_num_pages(self, num_pages: int) -> int:
        """The smallest KV pool any rank can hold (page ids are shared, so pools must match)."""

        def agree() -> int:
            t = torch.tensor([num_pages], dtype=torch.int64)
            dist.all_reduce(t, op=dist.ReduceOp.MIN)
            return int(t.item())

        return self.guarded(agree) if self.rank == 0 else agree()

    def attach(self, runner: ModelRunner) -> None:
        """This rank's runner: its graphs are dropped before the process group is destroyed."""
        self._runner = weakref.ref(runner)

    def _drop_graphs(self) -> None:
        """Release captured graphs before the process group: graphs holding NCCL work can make
        the communicator's teardown hang."""
        runner = self._runner() if self._runner is not None else None
        if runner is not None:
            runner.drop_graphs()

    def ready(self) -> None:
        """Every rank's runner is built: from here on rank 0 drives."""
        self._ready = True

    def close_worker(self) -> None:
        """A worker leaves the job: drop its graphs and the process group."""
        self._closed = True
        self._drop_graphs()
        _destroy_group()

    # -- rank 0: failures and shutdown -------------------------------------------------------
    def check_alive(self) -> None:
        if self.failure is not None:
            raise TensorParallelError(self.failure)
        if self._closed:
            raise TensorParallelError("this tensor-parallel engine was shut down; build a new Engine")

    def guarded(self, fn: Callable[[], Any]) -> Any:
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

    def abandon(self) -> None:
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
                self.channel.post("shutdown", {})
            except Exception as exc:  # noqa: BLE001 - the store may be gone with a dead rank
                logger.debug("could not post shutdown: %s", exc)
        if not healthy:
            self._stop_processes(timeout=0.0)
        self._drop_graphs()
        _destroy_group()
        self._stop_processes()


def _timeout(config: EngineConfig) -> datetime.timedelta:
    return datetime.timedelta(seconds=config.tp_timeout_s)


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
