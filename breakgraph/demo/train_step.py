"""The demo trainer's step — forward and losses, backward, the router-bias balance update — run
eagerly or replayed from graphs; the gradient clip and the AdamW update always run eagerly after it.

The demo model is small: one forward and backward launch about 2,200 kernels (a CPU capture logs
the count; it does not grow with the batch), each a few microseconds on a GPU, so an eager step
waits on the host launching them. :class:`GraphedSteps`
captures the step once per (padded length, attention stage) and replays it:

* batches are padded at the end to a multiple of ``length_step`` tokens (padding is masked out of
  every loss and of the expert loads, so the gradients are those of the unpadded batch);
* the inputs are static buffers of the key's graph, copied into before a replay; the gradients
  are the parameters' own ``.grad`` tensors, made before the first capture and shared by every
  graph (each replay zeroes them and the backward accumulates into them), so the eager clip and
  optimizer read whichever graph ran last;
* on CUDA the graphs share one memory pool: a replay writes every pool tensor it reads, the
  inputs and gradients live outside the pool, and a step's result is read before the next step —
  so graphs may replay in any order. A new key first runs its step eagerly as a warm-up (on the
  capture stream; its bias update undone), then captures it, which on CUDA records without
  running; the capturer's first replay of the new graph is the batch's step. On the CPU the stand-in
  :class:`~breakgraph.graphs.cpu_graph.CpuGraph` runs the step while it records it, and refuses
  host syncs, which is how the tests prove the step graph-safe without a GPU. Both are the graph
  package's segment capturers (:func:`~breakgraph.graphs.capture.make_capturer`), as the model's
  prefill and decode graphs use them.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass

import torch

from breakgraph.graphs.capture import make_capturer
from breakgraph.graphs.segments import Segment, SegmentCapturer, new_graph_pool
from breakgraph.layers.mlp import MoE
from breakgraph.models.glm5 import DsaForCausalLM


@dataclass
class StepResult:
    """What a step leaves besides the gradients: ``lm`` and ``index_kl`` (detached scalars) and
    ``expert_load [moe_layers, E]`` (or None). For a replayed graph these are the graph's output
    tensors, valid until the next step."""

    lm: torch.Tensor
    index_kl: torch.Tensor
    expert_load: torch.Tensor | None


class TrainStep:
    """Forward, backward and bias update of one batch: ``losses_fn(model, ids, labels, valid,
    sparse=...)`` returns ``(loss, lm, index_kl, expert_load)`` (the signature of
    :func:`breakgraph.demo.train.training_losses` with its keyword options bound). Gradients
    accumulate into the parameters' ``.grad`` after a zeroing that keeps the tensors
    (``set_to_none=False``), so a graph captured around the step keeps writing the same ones.
    Each MoE router's ``e_score_correction_bias`` moves ``±bias_update_rate`` towards equal load."""

    def __init__(
        self,
        model: DsaForCausalLM,
        losses_fn: Callable,
        *,
        amp: bool,
        bias_update_rate: float,
    ) -> None:
        self.model = model
        self.losses_fn = losses_fn
        self.amp = amp
        self.biases = [
            layer.mlp.gate.e_score_correction_bias
            for layer in model.model.layers
            if isinstance(layer.mlp, MoE)
        ]
        self.bias_update_rate = bias_update_rate
        self.params = [p for p in model.parameters() if p.requires_grad]

    def make_grads(self) -> None:
        """Give every trainable parameter a zero ``.grad`` where it has none (graphs write into them)."""
        for p in self.params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)

    def __call__(
        self, ids: torch.Tensor, labels: torch.Tensor, valid: torch.Tensor, sparse: bool
    ) -> StepResult:
        grads = [p.grad for p in self.params if p.grad is not None]
        if grads:
            torch._foreach_zero_(grads)
        device_type = ids.device.type
        # no autocast cache: graph capture needs each cast to be a recorded kernel of the step
        amp = (
            torch.autocast(device_type, dtype=torch.bfloat16, cache_enabled=False)
            if self.amp
            else nullcontext()
        )
        with amp:
            loss, lm, index_kl, expert_load = self.losses_fn(self.model, ids, labels, valid, sparse=sparse)
        loss.backward()
        with torch.no_grad():
            if expert_load is not None and self.bias_update_rate:
                for bias, load in zip(self.biases, expert_load.float()):
                    bias.add_(torch.sign(load.mean() - load) * self.bias_update_rate)
        return StepResult(lm.detach(), index_kl.detach(), expert_load)


def pad_batch(
    ids: torch.Tensor, labels: torch.Tensor, valid: torch.Tensor, length: int, pad_id: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``ids``/``labels``/``valid [B, S]`` right-padded to ``[B, length]``: ``pad_id``, ``-100`` (no
    loss) and False (not a token)."""
    extra = length - ids.shape[1]
    if extra < 0:
        raise ValueError(f"pad_batch: the batch has {ids.shape[1]} tokens a row, more than {length}")
    if extra == 0:
        return ids, labels, valid
    pad = torch.nn.functional.pad
    return (
        pad(ids, (0, extra), value=pad_id),
        pad(labels, (0, extra), value=-100),
        pad(valid, (0, extra), value=False),
    )


@dataclass
class _Captured:
    graph: Segment
    inputs: tuple[torch.Tensor, torch.Tensor, torch.Tensor]
    result: StepResult


class GraphedSteps:
    """:class:`TrainStep` replayed from one graph per (batch size, padded length, stage); see the
    module doc. ``length_step``: the padded lengths' multiple, capped at ``max_length`` (the
    model's positions). ``longest``: the data's longest row; the first batch of each batch size
    and stage is padded to it, so that the first graph in the shared pool is the largest and the
    shorter ones captured later fit in its memory (captured in the order the lengths come, each new
    longest length grew the pool by a whole step: 60 GiB after four lengths on an H100, and the
    fifth ran out of memory). ``log``: told each capture. A capture that fails turns the graphs
    off: that step's result is its eager run's, and every later step runs eagerly."""

    def __init__(
        self,
        step: TrainStep,
        pad_id: int,
        max_length: int,
        length_step: int = 32,
        longest: int | None = None,
        log: Callable[[str], None] | None = None,
    ) -> None:
        self.step = step
        self.pad_id = pad_id
        self.max_length = max_length
        self.length_step = length_step
        self.longest = None if longest is None else self.padded_length(longest)
        self.log = log or (lambda msg: None)
        self.graphs: dict[tuple[int, int, bool], _Captured] = {}
        self.capture_seconds = 0.0
        self.off = False
        self._pool = None  # one memory pool for every graph (CUDA; None on the CPU)

    def padded_length(self, tokens: int) -> int:
        return max(tokens, min(-(-tokens // self.length_step) * self.length_step, self.max_length))

    def __call__(
        self, ids: torch.Tensor, labels: torch.Tensor, valid: torch.Tensor, sparse: bool
    ) -> StepResult:
        """One step on ``ids``/``labels``/``valid [B, S]`` (on the model's device): a replay, or
        for a new key its first run and capture. Same contract as :class:`TrainStep`, except that
        the result's tensors are the graph's outputs: read them before the next step (a replay of
        another graph may overwrite them — the graphs share one memory pool)."""
        if self.off:
            return self.step(ids, labels, valid, sparse)
        unpadded = (ids, labels, valid)
        length = self.padded_length(ids.shape[1])
        if self.longest is not None and (ids.shape[0], max(length, self.longest), sparse) not in self.graphs:
            length = max(length, self.longest)  # the first graph of its batch size and stage: the largest
        key = (ids.shape[0], length, sparse)
        ids, labels, valid = pad_batch(ids, labels, valid, key[1], self.pad_id)
        captured = self.graphs.get(key)
        if captured is None:
            return self._capture(key, (ids, labels, valid), unpadded)
        for static, new in zip(captured.inputs, (ids, labels, valid)):
            static.copy_(new, non_blocking=True)
        captured.graph.replay()
        return captured.result

    def _capture(self, key: tuple[int, int, bool], padded: tuple, unpadded: tuple) -> StepResult:
        """Warm up, capture and first replay of ``key``'s graph on ``padded`` batch tensors; if
        any of it fails, the graphs go off and the step runs eagerly on ``unpadded``."""
        ids, labels, valid = padded
        t0 = time.perf_counter()
        what = f"the training step at {key[0]} × {key[1]} tokens, {'sparse' if key[2] else 'dense'} attention"
        self.step.make_grads()
        inputs = (ids.clone(), labels.clone(), valid.clone())
        if self._pool is None:
            self._pool = new_graph_pool(ids.device)
        capturer = make_capturer(ids.device, self._pool)
        failed = None
        capturer.open()
        try:
            try:
                self._warm_up(capturer, inputs, key[2])  # out of memory here: the graphs go off too
                capturer.begin(what)
                try:
                    result = self.step(*inputs, key[2])  # the CPU stand-in runs while it records
                except BaseException:
                    capturer.abort()
                    raise
                segment = capturer.end("the end of the training step")
            except Exception as exc:  # noqa: BLE001 - a host sync or other refusal: go on without graphs
                failed = exc
        finally:
            capturer.close()
        if failed is not None:
            self._turn_off(what, failed)  # first: the graphs' pool is freed before the eager step
            failed = None  # its traceback holds the failed run's frames and their tensors
            return self.step(*unpadded, key[2])
        self.graphs[key] = _Captured(segment, inputs, result)
        seconds = time.perf_counter() - t0
        self.capture_seconds += seconds
        kernels = f", {segment.work} kernels" if segment.work is not None else ""
        if ids.device.type == "cuda":
            kernels += f", {torch.cuda.memory_reserved(ids.device) / 2**30:.1f} GiB reserved"
        self.log(f"captured {what} ({len(self.graphs)} graphs, {seconds:.1f}s{kernels})")
        return result

    def _warm_up(self, capturer: SegmentCapturer, inputs: tuple[torch.Tensor, ...], sparse: bool) -> None:
        """One eager run of the step before a capture (on CUDA, on the capture stream: lazy set-up
        and kernel compiles happen outside the graph; on the CPU it keeps both paths alike, so the
        tests see it undone), undone where it leaves a trace: the router biases it moved are put
        back, since the capture's own run (the CPU stand-in's, or the capturer's first CUDA replay)
        is the batch's step; the gradients it leaves are rewritten by that run.

        Its memory on CUDA: once a graph holds the pool, the warm-up allocates from the pool
        (``capturer.eager_in_pool``), whose free blocks are the captured graphs' scratch, so it
        needs no memory beside the pool. Before the first graph the pool does not exist yet: the
        warm-up allocates as usual and its cache is emptied afterwards."""
        biases = [bias.clone() for bias in self.step.biases]
        in_pool = bool(self.graphs)  # a graph holds the pool
        with capturer.eager_in_pool() if in_pool else nullcontext():
            self.step(*inputs, sparse)
        with torch.no_grad():
            for bias, before in zip(self.step.biases, biases):
                bias.copy_(before)
        if inputs[0].is_cuda and not in_pool:
            torch.cuda.empty_cache()

    def _turn_off(self, what: str, exc: BaseException) -> None:
        cause = f" (after {type(exc.__context__).__name__}: {exc.__context__})" if exc.__context__ else ""
        self.log(
            f"capturing {what} failed ({type(exc).__name__}: {str(exc)[:300]}{cause}); eager steps from here"
        )
        self.off = True
        self.graphs.clear()
