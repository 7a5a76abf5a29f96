"""GLM-5 (``glm_moe_dsa``) and DeepSeek-V3.2 (``deepseek_v32``): one implementation.

The differences between the two live in :class:`~breakgraph.models.config.ModelConfig`
(indexer RoPE style, YaRN, shared-indexer layers, group routing); this file assembles the
layers. Parameter names follow the HF checkpoints so loading is a name lookup, except for
stacked parameters (gate‖up, per-expert tensors) which :meth:`DsaForCausalLM.checkpoint_targets`
maps explicitly.

Tensor parallelism (``tp_size`` ranks, each building the model inside
:func:`~breakgraph.distributed.parallel_state`): MLA heads split (``q_b_proj``, ``kv_b_proj``
column-parallel, so ``w_kc``/``w_vc`` hold this rank's heads; ``o_proj`` row-parallel);
``q_a``/``kv_a`` projections, their norms and the whole DSA indexer replicated (every rank
computes the same top-k); dense MLP and MoE experts split over their intermediate dimension;
embedding and LM head split over the vocabulary. :func:`check_tensor_parallel` names the
config field that does not divide.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from breakgraph.distributed import Shard, ShardingError, get_parallel_state
from breakgraph.kernels.dispatch import SPLIT_SELECT_MIN_KEYS
from breakgraph.layers.attention import MLAttention
from breakgraph.layers.linear import (
    LinearBase,
    ParallelLMHead,
    VocabParallelEmbedding,
    check_fp8_shards,
    check_shape,
)
from breakgraph.layers.mlp import MLP, Experts, MoE
from breakgraph.layers.norm import RMSNorm
from breakgraph.layers.rotary import RotaryEmbedding
from breakgraph.models.config import Fp8Config, ModelConfig


def fp8_excluded(module_name: str, fp8: Fp8Config) -> bool:
    """Whether the checkpoint's FP8 exclusion list names ``module_name`` (or a parent of it).
    GLM-5-FP8 spells the indexer's head projection ``indexers_proj``."""
    for entry in fp8.excluded:
        entry = entry.replace("indexers_proj", "indexer.weights_proj").removesuffix(".weight")
        if module_name == entry or module_name.startswith(entry + ".") or module_name.endswith("." + entry):
            return True
    return False


class DecoderLayer(nn.Module):
    """Pre-norm block: ``h += attn(norm(h)); h += mlp(norm(h))`` (MLP dense or MoE). Where the
    block after a norm starts with FP8 linears, the norm may quantise its output for them
    (:meth:`~breakgraph.layers.norm.RMSNorm.forward_fp8`; ``BREAKGRAPH_NORM_FP8=0`` turns it off); where the MLP does not add the
    residual in its own kernels, the next norm does (the layer returns the two parts)."""

    def __init__(self, config: ModelConfig, layer_id: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)
        self.self_attn = MLAttention(config, layer_id, dtype)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)
        self.mlp = MoE(config, dtype) if config.is_moe_layer(layer_id) else MLP(
            config.hidden_size, config.intermediate_size, config.fp8, dtype
        )

    def process_weights_after_loading(self) -> None:
        """This layer's part of :meth:`DsaForCausalLM.process_weights_after_loading`."""
        self.self_attn.absorb_kv_b()
        self.self_attn.kv_b_proj = None
        self.self_attn.merge_a_projections()
        self.self_attn.merge_b_projections()
        if self.self_attn.indexer is not None:
            self.self_attn.indexer.prepare_bf16_gemm()
        if isinstance(self.mlp, MoE):
            self.mlp.gate.prepare_bf16_gemm()

    def forward(
        self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, prev_topk: torch.Tensor | None,
        residual: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
        """``(h, residual, topk)``: the layer's output is ``h + residual`` where ``residual`` is
        returned (the add is left to the next norm, which fuses it), else ``h``; the input is
        ``h (+ residual)`` the same way."""
        normed, h_sum, x_fp8 = self.input_layernorm.forward_fp8(h, residual, quantize=self.self_attn.takes_fp8_input(h))
        h = h if residual is None else h_sum
        attn, topk = self.self_attn(normed, cos, sin, prev_topk, x_fp8)
        normed, h, x_fp8 = self.post_attention_layernorm.forward_fp8(attn, h, quantize=self.mlp.takes_fp8_input(attn))
        out, residual = self.mlp.forward_deferred(normed, h, x_fp8)
        return out, residual, topk


class Backbone(nn.Module):
    """Embedding, decoder layers and final norm (HF prefix ``model.``)."""

    def __init__(self, config: ModelConfig, dtype: torch.dtype, max_positions: int) -> None:
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size, dtype=dtype)
        self.layers = nn.ModuleList(DecoderLayer(config, i, dtype) for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)
        self.rotary = RotaryEmbedding(config.rope, config.qk_rope_head_dim, max_positions)


@dataclass(frozen=True)
class Target:
    """Where one checkpoint tensor goes: ``load(tensor)``, the dtype it is stored in, and the
    piece of it this tensor-parallel rank holds (None: all of it)."""

    load: Callable[[torch.Tensor], None]
    dtype: torch.dtype
    shard: Shard | None = None


def check_tensor_parallel(config: ModelConfig, tp_size: int) -> None:
    """Raise :class:`~breakgraph.distributed.ShardingError` naming the first config field that
    ``tp_size`` ranks cannot split evenly."""
    if tp_size < 1:
        raise ShardingError(f"--tp-size must be >= 1, got {tp_size}")
    c = config
    fields = [("num_attention_heads", c.num_attention_heads), ("vocab_size", c.vocab_size)]
    if any(not c.is_moe_layer(i) for i in range(c.num_hidden_layers)):
        fields.append(("intermediate_size", c.intermediate_size))
    if any(c.is_moe_layer(i) for i in range(c.num_hidden_layers)):
        fields.append(("moe_intermediate_size", c.moe_intermediate_size))
    for field, value in fields:
        if value % tp_size:
            raise ShardingError(
                f"config.json field {field!r} = {value} is not divisible by --tp-size {tp_size}; "
                f"tensor parallelism splits it evenly across ranks"
            )


class DsaForCausalLM(nn.Module):
    """The causal LM. ``forward`` is the decoder body (what graphs capture); the LM head
    runs separately in :meth:`compute_logits` on the rows that need logits."""

    def __init__(self, config: ModelConfig, dtype: torch.dtype = torch.bfloat16, max_positions: int | None = None) -> None:
        super().__init__()
        self.config = config
        self.dtype = dtype
        self.tp = get_parallel_state()
        if self.tp.tp_size > 1:
            check_tensor_parallel(config, self.tp.tp_size)
        self.model = Backbone(config, dtype, max_positions or config.max_position_embeddings)
        self.lm_head = ParallelLMHead(config.hidden_size, config.vocab_size, dtype=dtype)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        for name, module in self.named_modules():
            if isinstance(module, (LinearBase, Experts)) and config.fp8 is not None and fp8_excluded(name, config.fp8):
                module.keep_high_precision(dtype)
            if isinstance(module, LinearBase):
                check_fp8_shards(name, module)
            elif isinstance(module, Experts):
                module.check_fp8_shards(name)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Decoder body: ``input_ids [T]``, ``positions [T]`` int64 → final-norm hidden ``[T, D]``.

        Reads the batch layout (pages, slots, per-request lengths) from the current forward
        batch inside its breaks; everything else is static-shape tensor work.
        """
        h = self.model.embed_tokens(input_ids)
        cos, sin = self.model.rotary.lookup(positions, h.dtype)
        topk = residual = None
        for layer in self.model.layers:
            h, residual, topk = layer(h, cos, sin, topk, residual)
        return self.model.norm(h) if residual is None else self.model.norm.forward_with_residual(h, residual)[0]

    def host_length_bounds(self) -> tuple[int, ...]:
        """Sequence lengths at which the body's host-side choices change: up to ``index_topk``
        the DSA indexer's top-k is every causal key (no scores, no head weights; the attention
        makes the rows: :func:`~breakgraph.layers.dsa.indexer_rows_are_causal`), and past
        :data:`~breakgraph.kernels.dispatch.SPLIT_SELECT_MIN_KEYS` keys its top-k select takes
        its split kernels. Decode graphs are worth capturing per bound (see
        :class:`~breakgraph.graphs.decode_runner.DecodeGraphRunner`)."""
        return tuple(sorted({self.config.index_topk, SPLIT_SELECT_MIN_KEYS}))

    def prefill_length_bounds(self) -> tuple[int, ...]:
        """Sequence lengths below which a prefill graph's segments compute less: up to
        ``index_topk`` the layers need no indexer queries or head weights
        (:func:`~breakgraph.layers.dsa.indexer_rows_are_causal`). Breakable prefill graphs are
        worth capturing per bound (see :class:`~breakgraph.graphs.prefill_runner.PrefillGraphRunner`)."""
        return (self.config.index_topk,)

    def compile_regions(self) -> list[nn.Module]:
        """The regions regional ``torch.compile`` compiles one by one: the decoder layers."""
        return list(self.model.layers)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """``hidden [N, D]`` → fp32 logits ``[N, vocab]`` (under tensor parallelism: on rank 0,
        gathered from every rank's vocabulary slice; None on the other ranks)."""
        return self.lm_head(hidden)

    def process_weights_after_loading(self) -> None:
        """Derive absorbed-MLA weights and drop ``kv_b_proj`` (its halves now live in w_kc/w_vc);
        merge each layer's three projections of the normed input (q_a, indexer wk, kv_a) into one
        linear, and its two of ``q_resid`` (q_b, indexer wq_b) into another, where their layouts
        allow (:meth:`MLAttention.merge_a_projections`, :meth:`MLAttention.merge_b_projections`); give the fp32 router and indexer head-weight projections their bf16 tensor-core copies
        where those are exact."""
        for layer in self.model.layers:
            layer.process_weights_after_loading()

    # -- checkpoint name mapping -------------------------------------------------------------
    def checkpoint_targets(self) -> tuple[dict[str, Target], dict[str, tuple[Target, list[str]]]]:
        """Map every checkpoint tensor name this model needs to its :class:`Target`.

        Returns ``(required, aliases)``: ``required`` uses the on-disk HF names (per-expert
        ``mlp.experts.{e}.{gate,up,down}_proj.weight``); ``aliases`` maps alternative names
        (transformers' fused ``mlp.experts.gate_up_proj`` / ``down_proj``) to a target and
        the required names they stand for.
        """
        required: dict[str, Target] = {}
        aliases: dict[str, tuple[Target, list[str]]] = {}
        for mod_name, module in self.named_modules():
            if isinstance(module, LinearBase):
                parts = ["gate_proj", "up_proj"] if len(module.output_sizes) == 2 else [None]
                base = mod_name.rsplit(".", 1)[0] if parts[0] else mod_name
                kinds = [("weight", module.weight.dtype), ("bias", module.weight.dtype)]
                if module.quantized:
                    kinds.append(("weight_scale_inv", torch.float32))
                for part, pname in enumerate(parts):
                    prefix = f"{base}.{pname}" if pname else mod_name
                    for kind, dt in kinds:
                        if getattr(module, kind) is None:
                            continue
                        required[f"{prefix}.{kind}"] = Target(
                            lambda t, m=module, n=f"{prefix}.{kind}", k=kind, p=part: m.load(n, t, k, p), dt,
                            module.shard(kind),
                        )
            elif mod_name.endswith("mlp.experts"):
                self._expert_targets(mod_name, module, required, aliases)
        for name, param in self.named_parameters(remove_duplicate=False):
            owner = name.rsplit(".", 1)[0]
            if isinstance(self.get_submodule(owner), LinearBase) or ".experts." in f"{name}.":
                continue
            if name == "lm_head.weight" and self.config.tie_word_embeddings:
                continue
            owner_module = self.get_submodule(owner)
            vocab_split = isinstance(owner_module, (VocabParallelEmbedding, ParallelLMHead))
            shard = owner_module.shard("weight") if vocab_split else None
            required[name] = Target(lambda t, p=param, n=name: _copy_param(n, p, t), param.dtype, shard)
        # kv_b_proj is consumed by absorb_kv_b; no other buffers come from the checkpoint.
        return required, aliases

    def _expert_targets(self, prefix: str, experts: nn.Module, required: dict, aliases: dict) -> None:
        e_count = experts.w13.shape[0]
        wdt = experts.w13.dtype
        kinds = [("weight", wdt)] + ([("weight_scale_inv", torch.float32)] if experts.quantized else [])
        for kind, dt in kinds:
            for e in range(e_count):
                for proj in ("gate", "up", "down"):
                    name = f"{prefix}.{e}.{proj}_proj.{kind}"
                    required[name] = Target(
                        lambda t, n=name, p=proj, k=kind, e=e: experts.load(n, t, p, k, e), dt, experts.shard(proj)
                    )
        for proj in ("gate_up", "down"):
            name = f"{prefix}.{proj}_proj"
            covered = [f"{prefix}.{e}.{p}_proj.weight" for e in range(e_count) for p in proj.split("_")]
            aliases[name] = (Target(lambda t, n=name, p=proj: experts.load(n, t, p, "weight", None), wdt), covered)


def _copy_param(name: str, param: torch.Tensor, tensor: torch.Tensor) -> None:
    check_shape(name, tuple(param.shape), tuple(tensor.shape))
    param.data.copy_(tensor.to(param.dtype))
