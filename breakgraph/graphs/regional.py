"""Regional ``torch.compile``: the ``torch-compile`` prefill backend.

The model names its regions (``compile_regions()``: for a decoder, its layers); each region is
compiled in place, and the body runs as it always does, calling the compiled regions. The
graph code knows nothing of the model beyond that method.

Regions of one kind share their compiled code: a layer index the split ops take is traced as a
symbol, so 78 layers compile once per layer kind (dense / MoE) and length regime, where
compiling the whole model traces 78 unrolled layers per shape. Lengths after the first are
traced symbolically (PyTorch's default ``dynamic=None``). Inductor partitions its CUDA graphs
at the split ops: the per-batch parts (indexer top-k, attention over per-request lengths) run
eagerly between graphs, as under the breakable and piecewise backends. Fused bf16 arithmetic is
rounded where eager rounds it (``emulate_precision_casts``): without it Inductor keeps fp32
intermediates and its hidden states drift from eager's. Each forward first marks a new
CUDA-graph-tree step: every region call is its own compiled invocation, which CUDA graph trees
would otherwise take for a new iteration (freeing the previous region's output).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any, Protocol

import torch
from torch import nn

from breakgraph.graphs.split_ops import split_op_names
from breakgraph.graphs.stats import GraphStats

Body = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
TORCH_COMPILE_KWARGS: dict[str, Any] = {"mode": "reduce-overhead"}  # the torch-compile backend's torch.compile options


class RegionalModel(Protocol):
    """What the ``torch-compile`` backend needs from a model: its body, and its regions."""

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor: ...
    def compile_regions(self) -> list[nn.Module]: ...


@contextlib.contextmanager
def compiled_regions(model: RegionalModel, **compile_kwargs: Any) -> Iterator[Body]:
    """Compile each of ``model.compile_regions()`` in place while the context is open; yields
    ``forward(input_ids, positions)``, the model's forward that first starts a new
    CUDA-graph-tree step. ``compile_kwargs`` go to ``torch.compile`` (the backend's:
    ``mode="reduce-overhead"``, Inductor with CUDA graphs). On exit the regions are restored
    and ``torch._dynamo.reset()`` drops every compiled frame of the process: enter it with no
    other compiled code live. Raises ``RuntimeError`` on a torch that cannot partition
    Inductor's graphs at custom ops (before 2.9)."""
    import torch._inductor.config as inductor_config

    if not hasattr(inductor_config, "custom_should_partition_ops"):
        raise RuntimeError(
            f"torch {torch.__version__} cannot partition Inductor's CUDA graphs at custom ops "
            "(torch._inductor.config.custom_should_partition_ops); the torch-compile backend needs torch >= 2.9"
        )
    regions = list(model.compile_regions())
    with contextlib.ExitStack() as stack:
        stack.enter_context(torch._dynamo.config.patch(
            allow_unspec_int_on_nn_module=True, specialize_float=True,
            cache_size_limit=max(64, torch._dynamo.config.cache_size_limit),
        ))  # fmt: skip
        stack.enter_context(inductor_config.patch(
            graph_partition=True, custom_should_partition_ops=sorted(split_op_names()), emulate_precision_casts=True,
        ))  # fmt: skip
        previous = [region._compiled_call_impl for region in regions]

        def forward(input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
            torch.compiler.cudagraph_mark_step_begin()
            return model(input_ids, positions)

        try:
            for region in regions:
                region.compile(**compile_kwargs)
            yield forward
        finally:
            for region, impl in zip(regions, previous):
                region._compiled_call_impl = impl
            torch._dynamo.reset()


class RegionalCompileRunner:
    """The ``torch-compile`` backend held open: the model's regions stay compiled until
    :meth:`close`; :meth:`run` is the compiled forward. Counted like the graph backends
    (``stats``: a :class:`~breakgraph.graphs.stats.GraphStats`)."""

    backend = "torch-compile"

    def __init__(self, model: RegionalModel, **compile_kwargs: Any) -> None:
        self._stack = contextlib.ExitStack()
        self._forward = self._stack.enter_context(compiled_regions(model, **compile_kwargs))
        self.stats = GraphStats(self.backend)

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, longest: int | None = None) -> torch.Tensor:
        """Hidden states ``[n, D]`` through the compiled regions (``longest``, the batch's longest
        sequence, is not needed: every forward traces what it computes)."""
        self.stats.count_replay(input_ids.shape[0], input_ids.shape[0])
        return self._forward(input_ids, positions)

    def close(self) -> None:
        """Restore the regions (idempotent)."""
        self._stack.close()
