"""Dense SwiGLU MLP and the MoE block (router + routed experts + shared expert).

Tensor parallelism: the dense MLP is column-parallel (gate‖up) then row-parallel (down, one
all-reduce). The MoE keeps every expert on every rank and splits each expert's intermediate
dimension (``w13`` rows, ``w2`` columns) like the shared expert's; routed and shared partial
sums are added first and all-reduced once. The router is replicated. Both blocks take the
residual stream and return ``residual + block(x)``; on CUDA the MoE folds the shared expert and
(without tensor parallelism) the residual add into the routed experts' launches (two decode
kernels for small batches, the grouped GEMMs and their combine above).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from breakgraph.distributed import Shard, ShardingError, get_parallel_state, tp_all_reduce
from breakgraph.kernels.dispatch import use_triton_inference
from breakgraph.kernels.fp8 import FP8_DTYPE
from breakgraph.kernels.linear import exact_bf16_weight, fp32_out_operand, linear_fp32_out
from breakgraph.kernels.moe import (
    SharedExpert,
    folds_shared_expert,
    fused_moe,
    grouped_takes_fp8_input,
    route,
)
from breakgraph.layers.linear import ColumnParallelLinear, RowParallelLinear, WeightShapeError, check_shape
from breakgraph.models.config import Fp8Config, ModelConfig


class MLP(nn.Module):
    """``down(silu(gate x) ⊙ up x)`` with gate‖up merged into one column-parallel linear."""

    def __init__(
        self, hidden: int, intermediate: int, fp8: Fp8Config | None, dtype: torch.dtype, reduce_results: bool = True
    ) -> None:
        super().__init__()
        self.gate_up_proj = ColumnParallelLinear(hidden, [intermediate, intermediate], fp8=fp8, dtype=dtype)
        self.down_proj = RowParallelLinear(intermediate, hidden, fp8=fp8, dtype=dtype, reduce_results=reduce_results)

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None, x_fp8: tuple[torch.Tensor, torch.Tensor] | None = None
    ) -> torch.Tensor:
        """``down(silu(gate x) ⊙ up x)``, plus ``residual`` when given; ``x_fp8``: ``x`` quantised
        by its producer (see :meth:`takes_fp8_input`)."""
        gate_up = self.gate_up_proj(x, x_fp8)
        if use_triton_inference(gate_up) and gate_up.dim() == 2:
            from breakgraph.kernels.triton_moe import silu_mul

            out = self.down_proj(silu_mul(gate_up))  # one kernel; SiLU and product in fp32, rounded once
        else:
            gate, up = gate_up.chunk(2, dim=-1)
            out = self.down_proj(F.silu(gate) * up)
        return out if residual is None else residual + out

    def forward_deferred(
        self, x: torch.Tensor, residual: torch.Tensor, x_fp8: tuple[torch.Tensor, torch.Tensor] | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``(out, residual)``: :meth:`forward` without the residual add, which the caller leaves
        to the next norm (``out + residual``)."""
        return self(x, x_fp8=x_fp8), residual

    def takes_fp8_input(self, x: torch.Tensor) -> bool:
        """Whether the first linear reads ``x`` quantised (FP8 on a path that quantises at ``x``'s
        row count: the input is worth quantising where it is produced)."""
        return self.gate_up_proj.takes_fp8_input(x)

    def as_shared_expert(self) -> SharedExpert | None:
        """This MLP's weights in a routed expert's layout (gate‖up rows, down), or None when it
        has biases (the expert kernels take none)."""
        if self.gate_up_proj.bias is not None or self.down_proj.bias is not None:
            return None
        return SharedExpert(
            self.gate_up_proj.weight, self.down_proj.weight,
            self.gate_up_proj.weight_scale_inv, self.down_proj.weight_scale_inv,
        )  # fmt: skip


class Router(nn.Module):
    """Sigmoid router; ``weight [E, D]`` and ``e_score_correction_bias [E]`` kept in fp32.

    The logits are the fp32 product ``x · Wᵀ``; where the weight holds bf16 values (checkpoints
    that store the router in bf16) :meth:`prepare_bf16_gemm` keeps a bf16 copy, and bf16
    activations on CUDA then take the tensor-core GEMM with fp32 output
    (:func:`~breakgraph.kernels.linear.linear_fp32_out`): fp32 GEMMs cannot use the tensor
    cores, and over every layer of a long prefill the router's add up.
    """

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        e = config.n_routed_experts
        self.weight = nn.Parameter(torch.empty(e, config.hidden_size, dtype=torch.float32), requires_grad=False)
        self.e_score_correction_bias = nn.Parameter(torch.zeros(e, dtype=torch.float32), requires_grad=False)
        self.register_buffer("weight_bf16", None, persistent=False)  # set by prepare_bf16_gemm

    def prepare_bf16_gemm(self) -> bool:
        """After loading (and after any later change of ``weight``): keep the bf16 copy of the
        weight where it is exact (see :func:`~breakgraph.kernels.linear.exact_bf16_weight`), as
        a non-persistent buffer that moves with the module; returns whether it is kept."""
        self.weight_bf16 = exact_bf16_weight(self.weight)
        return self.weight_bf16 is not None

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        """``x [T, D]`` → fp32 ``[T, E]``."""
        return linear_fp32_out(x, fp32_out_operand(x, self.weight, self.weight_bf16))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        c = self.config
        return route(
            self.logits(x), self.e_score_correction_bias, c.num_experts_per_tok, c.n_group, c.topk_group,
            c.norm_topk_prob, c.routed_scaling_factor,
        )  # fmt: skip


class Experts(nn.Module):
    """Routed expert weights stacked per expert: ``w13 [E, 2I, D]`` (gate rows, then up rows)
    and ``w2 [E, D, I]``; FP8 adds ``w13_scale``/``w2_scale`` block scales. Under tensor
    parallelism ``I`` is this rank's slice of ``moe_intermediate_size``."""

    def __init__(self, config: ModelConfig, dtype: torch.dtype) -> None:
        super().__init__()
        self.tp = get_parallel_state()
        e, d = config.n_routed_experts, config.hidden_size
        i = self.tp.split(config.moe_intermediate_size, "moe_intermediate_size")
        self.intermediate = i
        fp8 = config.fp8
        self.block = fp8.block if fp8 is not None else (128, 128)
        self.quantized = fp8 is not None and config.moe_intermediate_size % fp8.block[0] == 0
        wdtype = FP8_DTYPE if self.quantized else dtype
        self.w13 = nn.Parameter(torch.empty(e, 2 * i, d, dtype=wdtype), requires_grad=False)
        self.w2 = nn.Parameter(torch.empty(e, d, i, dtype=wdtype), requires_grad=False)
        if self.quantized:
            bn, bk = self.block
            self.w13_scale = nn.Parameter(torch.empty(e, 2 * i // bn, -(-d // bk)), requires_grad=False)
            self.w2_scale = nn.Parameter(torch.empty(e, -(-d // bn), -(-i // bk)), requires_grad=False)
        else:
            self.w13_scale = self.w2_scale = None

    def keep_high_precision(self, dtype: torch.dtype) -> None:
        """Hold the experts in ``dtype`` instead of FP8 (named by the FP8 exclusion list)."""
        if not self.quantized:
            return
        self.quantized = False
        self.w13 = nn.Parameter(torch.empty_like(self.w13, dtype=dtype), requires_grad=False)
        self.w2 = nn.Parameter(torch.empty_like(self.w2, dtype=dtype), requires_grad=False)
        self.w13_scale = self.w2_scale = None

    def forward(
        self,
        x: torch.Tensor,
        topk_weights: torch.Tensor,
        topk_ids: torch.Tensor,
        shared: SharedExpert | None = None,
        residual: torch.Tensor | None = None,
        x_fp8: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """Routed experts' output (see :func:`~breakgraph.kernels.moe.fused_moe`), ``+ shared(x)``
        and ``+ residual`` when given; ``x_fp8``: ``x`` quantised by its producer (see
        :meth:`takes_fp8_input`)."""
        return fused_moe(
            x, self.w13, self.w2, topk_weights, topk_ids, self.w13_scale, self.w2_scale, self.block,
            shared=shared, residual=residual, x_fp8=x_fp8,
        )  # fmt: skip

    def takes_fp8_input(self, x: torch.Tensor) -> bool:
        """Whether :meth:`forward` would quantise ``x`` itself (W8A8 grouped GEMMs), so that the
        producer's quantised rows save it a launch."""
        return grouped_takes_fp8_input(x, self.w13, self.w2, self.w13_scale, self.w2_scale, self.block)

    def folds_shared(self, x: torch.Tensor, topk_ids: torch.Tensor, shared: SharedExpert | None) -> bool:
        """Whether :meth:`forward` runs ``shared`` (and the residual) inside the routed experts'
        launches (:func:`~breakgraph.kernels.moe.folds_shared_expert`)."""
        return folds_shared_expert(
            x, self.w13, self.w2, topk_ids, self.w13_scale, self.w2_scale, self.block, shared
        )  # fmt: skip

    def shard(self, proj: str) -> Shard | None:
        """This rank's piece of one expert's ``{proj}_proj`` tensor (weight or scale)."""
        if self.tp.tp_size == 1:
            return None
        return Shard(1 if proj == "down" else 0, self.tp.tp_rank, self.tp.tp_size)

    def check_fp8_shards(self, name: str) -> None:
        """Raise :class:`ShardingError` when this rank's slice of the intermediate dimension does
        not fall on FP8 block boundaries."""
        if not self.quantized or self.tp.tp_size == 1:
            return
        for proj, b in (("gate_proj", self.block[0]), ("down_proj", self.block[1])):
            if self.intermediate % b:
                raise ShardingError(
                    f"FP8 tensor {name}.<expert>.{proj}.weight: --tp-size {self.tp.tp_size} gives each rank "
                    f"{self.intermediate} of moe_intermediate_size, not a multiple of the {b}-wide FP8 block, so "
                    "its weight_scale_inv blocks cannot be split with it. Use a TP size that splits "
                    f"moe_intermediate_size on {b}-element block boundaries."
                )

    def load(self, name: str, tensor: torch.Tensor, proj: str, kind: str, expert: int | None) -> None:
        """Load one checkpoint tensor. ``proj`` in gate/up/down (one expert, ``tensor`` already
        this rank's shard) or gate_up/down (all experts, ``expert=None``: the full fused tensor,
        sliced here); ``kind`` is ``weight`` or ``weight_scale_inv``."""
        scale = kind == "weight_scale_inv"
        if scale and not self.quantized:
            raise WeightShapeError(f"tensor {name!r}: experts are not FP8 here")
        param = (self.w2_scale if scale else self.w2) if proj == "down" else (self.w13_scale if scale else self.w13)
        target = param.data if expert is None else param.data[expert]
        if expert is None and self.tp.tp_size > 1:
            tensor = self._shard_fused(name, tensor, proj)
        if proj in ("gate", "up"):
            rows = target.shape[-2] // 2
            target = target.narrow(-2, 0 if proj == "gate" else rows, rows)
        check_shape(name, tuple(target.shape), tuple(tensor.shape))
        target.copy_(tensor)

    def _shard_fused(self, name: str, tensor: torch.Tensor, proj: str) -> torch.Tensor:
        """This rank's rows of a fused ``gate_up [E, 2I, D]`` (from each half) or columns of a
        fused ``down [E, D, I]``."""
        shard = Shard(-1 if proj == "down" else -2, self.tp.tp_rank, self.tp.tp_size)
        if proj == "down":
            return shard.take(tensor, name)
        gate, up = tensor.chunk(2, dim=-2)
        return torch.cat([shard.take(gate, name), shard.take(up, name)], dim=-2)


class MoE(nn.Module):
    """Routed experts (top-k of ``n_routed_experts``) plus the always-on shared expert."""

    def __init__(self, config: ModelConfig, dtype: torch.dtype) -> None:
        super().__init__()
        self.gate = Router(config)
        self.experts = Experts(config, dtype)
        self.tp = get_parallel_state()
        self.shared_experts = (
            MLP(
                config.hidden_size, config.moe_intermediate_size * config.n_shared_experts, config.fp8, dtype,
                reduce_results=False,
            )
            if config.n_shared_experts
            else None
        )  # fmt: skip

    def takes_fp8_input(self, x: torch.Tensor) -> bool:
        """Whether ``x`` is worth quantising where it is produced: the routed experts' W8A8
        GEMMs read it (:meth:`Experts.takes_fp8_input`), or the shared expert runs on its own
        and its first linear does (:meth:`MLP.takes_fp8_input`)."""
        if self.experts.takes_fp8_input(x):
            return True
        if self.shared_experts is None or not self.shared_experts.takes_fp8_input(x):
            return False
        return not self.experts.folds_shared(x, None, self.shared_experts.as_shared_expert())

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None, x_fp8: tuple[torch.Tensor, torch.Tensor] | None = None
    ) -> torch.Tensor:
        """``routed(x) + shared(x)`` (all-reduced under tensor parallelism), plus ``residual``
        when given. On CUDA the shared expert runs inside the routed experts' launches, and the
        residual add too where no all-reduce comes between. ``x_fp8``: ``x`` quantised by its
        producer (see :meth:`takes_fp8_input`)."""
        out, pending = self.forward_deferred(x, residual, x_fp8)
        return out if pending is None else pending + out

    def forward_deferred(
        self, x: torch.Tensor, residual: torch.Tensor | None, x_fp8: tuple[torch.Tensor, torch.Tensor] | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """:meth:`forward` as ``(out, pending)``: the result is ``out + pending`` where
        ``pending`` is returned — the residual, when no kernel here could add it (the caller
        leaves the add to the next norm) — else ``out``."""
        topk_weights, topk_ids = self.gate(x)
        shared = self.shared_experts.as_shared_expert() if self.shared_experts is not None else None
        if not self.experts.folds_shared(x, topk_ids, shared):
            shared = None
        fold = residual is not None and self.tp.tp_size == 1 and (shared is not None or self.shared_experts is None)
        out = self.experts(x, topk_weights, topk_ids, shared, residual if fold else None, x_fp8)
        if fold:
            return out, None
        if self.shared_experts is not None and shared is None:
            out = out + self.shared_experts(x, x_fp8=x_fp8)
        if self.tp.tp_size > 1:
            out = tp_all_reduce(out.contiguous())
        return out, residual
