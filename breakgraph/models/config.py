"""Model configuration read from a checkpoint's ``config.json``.

One :class:`ModelConfig` describes both GLM-5 (``glm_moe_dsa``) and DeepSeek-V3.2
(``deepseek_v32``). Everything the layers need is resolved here once (RoPE style per model
type, per-layer MLP and indexer kinds, which linears are FP8) so the layers hold no
model-type branches of their own.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

SUPPORTED_MODEL_TYPES = ("glm_moe_dsa", "deepseek_v32")


class ConfigError(ValueError):
    """A ``config.json`` field is missing or has a value the engine cannot use."""


@dataclass(frozen=True)
class RopeConfig:
    """Rotary embedding parameters.

    ``rope_type`` is ``"default"`` or ``"yarn"``. For YaRN, ``factor``,
    ``original_max_position_embeddings``, ``beta_fast``/``beta_slow`` and ``mscale``/
    ``mscale_all_dim`` follow the HF ``rope_parameters`` meaning.
    """

    theta: float
    rope_type: str = "default"
    factor: float = 1.0
    original_max_position_embeddings: int | None = None
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float = 1.0
    mscale_all_dim: float = 0.0
    attention_factor: float | None = None
    truncate: bool = True


@dataclass(frozen=True)
class Fp8Config:
    """Block-scaled FP8 weights: ``weight`` float8_e4m3fn plus ``weight_scale_inv`` fp32 per
    ``block`` (rows, cols) tile. ``excluded`` lists module names kept in high precision."""

    block: tuple[int, int] = (128, 128)
    excluded: tuple[str, ...] = ()


@dataclass(frozen=True)
class ModelConfig:
    """Every field the GLM-5 / DeepSeek-V3.2 implementation reads.

    Attributes (HF names): ``hidden_size``, ``num_hidden_layers``, ``num_attention_heads``,
    ``q_lora_rank`` / ``kv_lora_rank`` (MLA latent ranks), ``qk_nope_head_dim`` /
    ``qk_rope_head_dim`` / ``v_head_dim``, ``n_routed_experts`` / ``num_experts_per_tok`` /
    ``n_shared_experts`` / ``moe_intermediate_size`` (MoE), ``n_group`` / ``topk_group``
    (group-limited routing), ``routed_scaling_factor``, ``norm_topk_prob``,
    ``intermediate_size`` (dense MLP), ``index_n_heads`` / ``index_head_dim`` /
    ``index_topk`` (DSA indexer), ``rms_norm_eps``, ``vocab_size``.
    Derived: ``mlp_layer_types`` ("dense"/"sparse" per layer), ``indexer_types``
    ("full"/"shared" per layer), ``indexer_rope_interleaved`` (GLM-5 yes, DeepSeek-V3.2 no),
    ``fp8`` (None for bf16/fp32 checkpoints).
    """

    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    moe_intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    q_lora_rank: int
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    n_routed_experts: int
    num_experts_per_tok: int
    n_shared_experts: int
    n_group: int
    topk_group: int
    routed_scaling_factor: float
    norm_topk_prob: bool
    index_n_heads: int
    index_head_dim: int
    index_topk: int
    rms_norm_eps: float
    max_position_embeddings: int
    rope: RopeConfig
    mlp_layer_types: tuple[str, ...]
    indexer_types: tuple[str, ...]
    attention_bias: bool = False
    tie_word_embeddings: bool = False
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    torch_dtype: str = "bfloat16"
    fp8: Fp8Config | None = None
    raw: dict[str, Any] = field(default_factory=dict, repr=False, compare=False)

    # -- derived ---------------------------------------------------------------------------
    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def latent_dim(self) -> int:
        """Width of one latent cache entry ``[c ‖ k_pe]`` (576 for GLM-5)."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    @property
    def indexer_rope_interleaved(self) -> bool:
        return self.model_type == "glm_moe_dsa"

    @property
    def softmax_scale(self) -> float:
        """MLA softmax scale: ``qk_head_dim^-0.5``, times ``mscale²`` under YaRN."""
        scale = self.qk_head_dim**-0.5
        if self.rope.rope_type != "default" and self.rope.mscale_all_dim:
            m = yarn_get_mscale(self.rope.factor, self.rope.mscale_all_dim)
            scale *= m * m
        return scale

    def is_moe_layer(self, layer_id: int) -> bool:
        return self.mlp_layer_types[layer_id] == "sparse"

    def has_indexer(self, layer_id: int) -> bool:
        return self.indexer_types[layer_id] == "full"

    # -- construction ----------------------------------------------------------------------
    @classmethod
    def from_dict(cls, cfg: dict[str, Any]) -> ModelConfig:
        """Build from a parsed ``config.json``; raises :class:`ConfigError` naming the field."""
        model_type = cfg.get("model_type")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ConfigError(
                f"config.json field 'model_type' is {model_type!r}; breakgraph supports {SUPPORTED_MODEL_TYPES}"
            )
        glm = model_type == "glm_moe_dsa"
        defaults = _GLM5_DEFAULTS if glm else _DSV32_DEFAULTS

        def get(name: str, kind: type, *, positive: bool = True) -> Any:
            value = cfg.get(name, defaults.get(name))
            if value is None:
                raise ConfigError(f"config.json is missing the required field {name!r}")
            if kind is int and (isinstance(value, bool) or not isinstance(value, int)):
                raise ConfigError(f"config.json field {name!r} must be an integer, got {value!r}")
            if kind is float:
                if isinstance(value, bool) or not isinstance(value, (int, float)):
                    raise ConfigError(f"config.json field {name!r} must be a number, got {value!r}")
                value = float(value)
            if kind is bool and not isinstance(value, bool):
                raise ConfigError(f"config.json field {name!r} must be true/false, got {value!r}")
            if positive and kind in (int, float) and value <= 0:
                raise ConfigError(f"config.json field {name!r} must be > 0, got {value!r}")
            return value

        num_layers = get("num_hidden_layers", int)
        n_experts = get("n_routed_experts", int)
        n_group = get("n_group", int)
        topk_group = get("topk_group", int)
        if n_experts % n_group:
            raise ConfigError(f"config.json field 'n_group' ({n_group}) must divide n_routed_experts ({n_experts})")
        if topk_group > n_group:
            raise ConfigError(f"config.json field 'topk_group' ({topk_group}) exceeds n_group ({n_group})")
        if n_group > 1 and n_experts // n_group < 2:
            raise ConfigError("config.json: group-limited routing needs at least 2 experts per group (n_group)")
        top_k = get("num_experts_per_tok", int)
        if top_k > n_experts:
            raise ConfigError(f"config.json field 'num_experts_per_tok' ({top_k}) exceeds n_routed_experts")
        rope_dim = get("qk_rope_head_dim", int)
        if rope_dim % 2:
            raise ConfigError(f"config.json field 'qk_rope_head_dim' must be even, got {rope_dim}")
        index_head_dim = get("index_head_dim", int)
        if index_head_dim < rope_dim:
            raise ConfigError(
                f"config.json field 'index_head_dim' ({index_head_dim}) must be >= qk_rope_head_dim ({rope_dim})"
            )
        if cfg.get("q_lora_rank") is None and "q_lora_rank" in cfg:
            raise ConfigError("config.json field 'q_lora_rank' is null; the DSA indexer needs a q LoRA rank")
        act = cfg.get("hidden_act", "silu")
        if act != "silu":
            raise ConfigError(f"config.json field 'hidden_act' is {act!r}; only 'silu' is supported")

        mlp_types = cfg.get("mlp_layer_types")
        if mlp_types is None:
            n_dense = min(get("first_k_dense_replace", int, positive=False), num_layers)
            mlp_types = ["dense"] * n_dense + ["sparse"] * (num_layers - n_dense)
        _check_layer_list("mlp_layer_types", mlp_types, num_layers, ("dense", "sparse"))

        indexer_types = cfg.get("indexer_types") if glm else None
        if indexer_types is None and glm:
            pattern = cfg.get("index_topk_pattern")
            if pattern is not None:
                indexer_types = [{"F": "full", "S": "shared"}.get(c, c) for c in pattern]
            else:
                freq = max(cfg.get("index_topk_freq", 1) or 1, 1)
                offset = cfg.get("index_skip_topk_offset", 2)
                indexer_types = [
                    "full" if (max(i - offset + 1, 0) % freq) == 0 else "shared" for i in range(num_layers)
                ]
        if indexer_types is None:
            indexer_types = ["full"] * num_layers
        _check_layer_list("indexer_types", indexer_types, num_layers, ("full", "shared"))
        if indexer_types and indexer_types[0] != "full":
            raise ConfigError("config.json field 'indexer_types': the first layer must be 'full'")

        eos = cfg.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else ((eos,) if eos is not None else ())

        return cls(
            model_type=model_type,
            vocab_size=get("vocab_size", int),
            hidden_size=get("hidden_size", int),
            intermediate_size=get("intermediate_size", int),
            moe_intermediate_size=get("moe_intermediate_size", int),
            num_hidden_layers=num_layers,
            num_attention_heads=get("num_attention_heads", int),
            q_lora_rank=get("q_lora_rank", int),
            kv_lora_rank=get("kv_lora_rank", int),
            qk_nope_head_dim=get("qk_nope_head_dim", int),
            qk_rope_head_dim=rope_dim,
            v_head_dim=get("v_head_dim", int),
            n_routed_experts=n_experts,
            num_experts_per_tok=top_k,
            n_shared_experts=get("n_shared_experts", int, positive=False),
            n_group=n_group,
            topk_group=topk_group,
            routed_scaling_factor=get("routed_scaling_factor", float),
            norm_topk_prob=get("norm_topk_prob", bool),
            index_n_heads=get("index_n_heads", int),
            index_head_dim=index_head_dim,
            index_topk=get("index_topk", int),
            rms_norm_eps=get("rms_norm_eps", float),
            max_position_embeddings=get("max_position_embeddings", int),
            rope=_parse_rope(cfg, defaults),
            mlp_layer_types=tuple(mlp_types),
            indexer_types=tuple(indexer_types),
            attention_bias=bool(cfg.get("attention_bias", False)),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=eos_ids,
            torch_dtype=str(cfg.get("torch_dtype") or cfg.get("dtype") or "bfloat16"),
            fp8=_parse_fp8(cfg.get("quantization_config")),
            raw=dict(cfg),
        )

    @classmethod
    def from_pretrained(cls, path: str | Path) -> ModelConfig:
        """Read ``<path>/config.json``."""
        file = Path(path) / "config.json"
        if not file.is_file():
            raise ConfigError(f"no config.json in {path}")
        try:
            return cls.from_dict(json.loads(file.read_text()))
        except json.JSONDecodeError as exc:
            raise ConfigError(f"{file} is not valid JSON: {exc}") from exc


def yarn_get_mscale(scale: float, mscale: float = 1.0) -> float:
    """YaRN attention-magnitude correction ``0.1·mscale·ln(scale) + 1`` (1 when scale ≤ 1)."""
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _check_layer_list(name: str, values: Any, num_layers: int, allowed: tuple[str, ...]) -> None:
    if not isinstance(values, (list, tuple)) or len(values) != num_layers:
        raise ConfigError(f"config.json field {name!r} must list one entry per layer ({num_layers})")
    bad = [v for v in values if v not in allowed]
    if bad:
        raise ConfigError(f"config.json field {name!r} has {bad[0]!r}; allowed values are {allowed}")


def _parse_rope(cfg: dict[str, Any], defaults: dict[str, Any]) -> RopeConfig:
    params = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    if not isinstance(params, dict):
        raise ConfigError("config.json field 'rope_parameters' must be an object")
    theta = params.get("rope_theta", cfg.get("rope_theta", defaults["rope_theta"]))
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in ("default", "yarn"):
        raise ConfigError(f"config.json field 'rope_parameters.rope_type' is {rope_type!r}; use 'default' or 'yarn'")
    if rope_type == "default":
        return RopeConfig(theta=float(theta))
    if "factor" not in params:
        raise ConfigError("config.json field 'rope_parameters.factor' is required for YaRN")
    original = params.get("original_max_position_embeddings")
    if original is None:
        raise ConfigError("config.json field 'rope_parameters.original_max_position_embeddings' is required for YaRN")
    return RopeConfig(
        theta=float(theta),
        rope_type="yarn",
        factor=float(params["factor"]),
        original_max_position_embeddings=int(original),
        beta_fast=float(params.get("beta_fast") or 32),
        beta_slow=float(params.get("beta_slow") or 1),
        mscale=float(params.get("mscale") or 0.0),
        mscale_all_dim=float(params.get("mscale_all_dim") or 0.0),
        attention_factor=params.get("attention_factor"),
        truncate=bool(params.get("truncate", True)),
    )


def _parse_fp8(qcfg: Any) -> Fp8Config | None:
    if not qcfg:
        return None
    if not isinstance(qcfg, dict) or qcfg.get("quant_method") != "fp8":
        method = qcfg.get("quant_method") if isinstance(qcfg, dict) else qcfg
        raise ConfigError(f"config.json field 'quantization_config.quant_method' is {method!r}; only 'fp8' is supported")
    fmt = qcfg.get("fmt", "e4m3")
    if fmt != "e4m3":
        raise ConfigError(f"config.json field 'quantization_config.fmt' is {fmt!r}; only 'e4m3' is supported")
    block = qcfg.get("weight_block_size")
    if block is None or len(block) != 2:
        raise ConfigError("config.json field 'quantization_config.weight_block_size' must be [rows, cols]")
    excluded: list[str] = []
    for key in ("modules_to_not_convert", "ignored_layers", "ignore"):
        excluded.extend(qcfg.get(key) or [])
    return Fp8Config(block=(int(block[0]), int(block[1])), excluded=tuple(excluded))


_GLM5_DEFAULTS: dict[str, Any] = {
    "vocab_size": 154880, "hidden_size": 6144, "intermediate_size": 12288, "moe_intermediate_size": 2048,
    "num_hidden_layers": 78, "num_attention_heads": 64, "n_shared_experts": 1, "n_routed_experts": 256,
    "routed_scaling_factor": 2.5, "kv_lora_rank": 512, "q_lora_rank": 2048, "qk_rope_head_dim": 64,
    "v_head_dim": 256, "qk_nope_head_dim": 192, "n_group": 1, "topk_group": 1, "num_experts_per_tok": 8,
    "norm_topk_prob": True, "max_position_embeddings": 202752, "rms_norm_eps": 1e-5, "index_topk": 2048,
    "index_head_dim": 128, "index_n_heads": 32, "first_k_dense_replace": 3, "rope_theta": 10000.0,
}  # fmt: skip
_DSV32_DEFAULTS: dict[str, Any] = {
    "vocab_size": 129280, "hidden_size": 7168, "intermediate_size": 18432, "moe_intermediate_size": 2048,
    "num_hidden_layers": 61, "num_attention_heads": 128, "n_shared_experts": 1, "n_routed_experts": 256,
    "routed_scaling_factor": 2.5, "kv_lora_rank": 512, "q_lora_rank": 1536, "qk_rope_head_dim": 64,
    "v_head_dim": 128, "qk_nope_head_dim": 128, "n_group": 8, "topk_group": 4, "num_experts_per_tok": 8,
    "norm_topk_prob": True, "max_position_embeddings": 163840, "rms_norm_eps": 1e-6, "index_topk": 2048,
    "index_head_dim": 128, "index_n_heads": 64, "first_k_dense_replace": 3, "rope_theta": 10000.0,
}  # fmt: skip
