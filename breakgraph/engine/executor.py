"""How rank 0 calls the model runner: directly (:class:`LocalExecutor`, TP 1) or mirrored to the
other tensor-parallel ranks (:class:`TPExecutor`), which run :func:`serve` on a runner of their
own. Both executors offer the same methods; the engine never branches on tensor parallelism.

A mirrored call posts one command (:mod:`breakgraph.engine.tp_channel`: method name from a closed
set, typed arguments, signed) and, for a forward, broadcasts the batch's tensors; then rank 0
runs the same method on its own runner, and the collectives inside the model line the ranks up.
"""

from __future__ import annotations

import dataclasses
import sys
import traceback
from typing import NoReturn

import torch
import torch.distributed as dist

from breakgraph.engine import tp_launch
from breakgraph.engine.config import PREFILL_BACKENDS, EngineConfig
from breakgraph.engine.model_runner import ModelRunner, ModelSpec
from breakgraph.engine.tp_channel import CommandRefused, batch_from_header, batch_header, check, tensor_sizes
from breakgraph.engine.tp_launch import TensorParallelError, TPGroup
from breakgraph.forward_context import ForwardBatch


class LocalExecutor:
    """TP 1: the runner's methods, called in this process."""

    tp: TPGroup | None = None

    def __init__(self, runner: ModelRunner) -> None:
        self.runner = runner

    def forward(self, batch: ForwardBatch, all_logits: bool = False) -> torch.Tensor:
        """:meth:`ModelRunner.forward`."""
        return self.runner.forward(batch, all_logits)

    def set_prefill_backend(
        self, backend: str, buckets: list[int] | tuple[int, ...] | None = None, max_bucket: int | None = None
    ) -> None:
        """:meth:`ModelRunner.set_prefill_backend`."""
        self.runner.set_prefill_backend(backend, buckets, max_bucket)

    def shutdown(self) -> None:
        """Nothing to stop."""


class TPExecutor:
    """Rank 0 of a tensor-parallel job: each call is posted to the other ranks, then run here.
    A failure on any rank becomes a :class:`TensorParallelError` naming the rank that died."""

    def __init__(self, runner: ModelRunner, tp: TPGroup) -> None:
        self.runner = runner
        self.tp = tp

    def forward(self, batch: ForwardBatch, all_logits: bool = False) -> torch.Tensor:
        """:meth:`ModelRunner.forward` on every rank; the logits (rank 0's) are returned."""
        header, tensors = batch_header(batch)

        def step() -> torch.Tensor:
            self.tp.channel.post("forward", {"all_logits": all_logits, "batch": header})
            packed = torch.cat(tensors) if tensors else torch.empty(0, dtype=torch.int64, device=self.tp.device)
            dist.broadcast(packed, src=0)
            logits = self.runner.forward(batch, all_logits)
            self.tp.channel.synced()  # the LM head's gather has returned: every worker read the command
            return logits

        return self.tp.guarded(step)

    def set_prefill_backend(
        self, backend: str, buckets: list[int] | tuple[int, ...] | None = None, max_bucket: int | None = None
    ) -> None:
        """:meth:`ModelRunner.set_prefill_backend` on every rank (capture runs the collectives)."""
        if backend not in PREFILL_BACKENDS:  # refused here, before any rank starts on it
            raise ValueError(f"--cuda-graph-backend-prefill must be one of {PREFILL_BACKENDS}, got {backend!r}")
        if backend == "torch-compile":
            raise ValueError("the torch-compile backend runs in one process: it cannot run with --tp-size > 1")
        args = {"backend": backend, "buckets": list(buckets) if buckets else None, "max_bucket": max_bucket}
        try:
            check("set_prefill_backend", args)
        except CommandRefused as exc:
            raise ValueError(f"set_prefill_backend: {exc} (buckets and max_bucket are token counts)") from None

        def rebuild() -> None:
            self.tp.channel.post("set_prefill_backend", args)
            self.runner.set_prefill_backend(backend, buckets, max_bucket)

        self.tp.guarded(rebuild)

    def shutdown(self) -> None:
        """Stop every rank (idempotent)."""
        self.tp.shutdown()


Executor = LocalExecutor | TPExecutor


def make_executor(config: EngineConfig, spec: ModelSpec) -> Executor:
    """Build this process's runner and the executor that calls it. With ``tp_size > 1`` the
    other ranks are started (or joined, under torchrun) first; on a torchrun rank other than 0
    this serves rank 0 and ends the process instead of returning."""
    if config.tp_size == 1:
        return LocalExecutor(ModelRunner(config, spec))
    tp = tp_launch.start(spec.model_config, spec.dtype, spec.device, config, worker_main=_spawned_worker_main)
    try:
        runner = _runner_for(config, spec, tp)
    except BaseException:
        if tp.rank == 0:
            tp.abandon()  # do not leave the other ranks waiting for a collective
        raise
    if tp.rank != 0:
        serve(runner, tp)
    tp.ready()
    return TPExecutor(runner, tp)


def _runner_for(config: EngineConfig, spec: ModelSpec, tp: TPGroup) -> ModelRunner:
    runner = ModelRunner(config, dataclasses.replace(spec, device=tp.device), tp)
    tp.attach(runner)
    return runner


def _spawned_worker_main() -> None:
    """A spawned rank: build its runner from the config rank 0 sent, then serve (never returns)."""
    config = EngineConfig.from_dict(tp_launch.spawned_config())
    spec = ModelSpec.resolve(config)
    tp = tp_launch.start(spec.model_config, spec.dtype, spec.device, config)
    serve(_runner_for(config, spec, tp), tp)


def serve(runner: ModelRunner, tp: TPGroup) -> NoReturn:
    """Ranks ≥ 1: run rank 0's commands on ``runner`` until it shuts down, then exit the process.
    A command that is not rank 0's (see :mod:`~breakgraph.engine.tp_channel`) ends the rank."""
    tp.ready()
    code = 0
    try:
        while True:
            method, args = tp.channel.receive()
            if method == "shutdown":
                break
            if method == "forward":
                header = args["batch"]
                packed = torch.empty(sum(tensor_sizes(header)), dtype=torch.int64, device=tp.device)
                dist.broadcast(packed, src=0)
                runner.forward(batch_from_header(header, packed, runner.kv_cache), all_logits=args["all_logits"])
            elif method == "set_prefill_backend":
                runner.set_prefill_backend(args["backend"], args["buckets"], args["max_bucket"])
    except CommandRefused as exc:  # someone other than rank 0 wrote to the channel
        code = 1
        print(f"breakgraph tensor-parallel rank {tp.rank} refused a command and stops: {exc}", file=sys.stderr)
        sys.stderr.flush()
    except Exception as exc:  # noqa: BLE001 - any failure ends this rank with a message
        code = 1
        lost = isinstance(exc, dist.DistNetworkError) or "Connection closed" in str(exc)
        what = "lost contact with the other ranks" if lost else "failed"
        print(f"breakgraph tensor-parallel rank {tp.rank} {what}: {exc}", file=sys.stderr)
        if not lost:
            traceback.print_exc()
        sys.stderr.flush()
    finally:
        tp.close_worker()
    raise SystemExit(code)


__all__ = ["Executor", "LocalExecutor", "TPExecutor", "TensorParallelError", "make_executor", "serve"]
