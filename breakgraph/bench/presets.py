"""Named model shapes for benchmarks, as ``config.json`` dicts (weights are always dummy).

``glm5-tp8-rank`` is what one GPU of a tensor-parallel-8 GLM-5 deployment holds: 8 of the 64
attention heads, MoE intermediate 2048/8 = 256, dense intermediate 12288/8, all 256 experts,
all 78 layers, 1/8 of the vocabulary (vocab-parallel embedding and LM head), FP8 128×128
block weights (≈ 95 GB). The latent down-projections and the
DSA indexer are replicated across ranks, so they keep their full size.
"""

from __future__ import annotations

import atexit
import copy
import json
import shutil
import tempfile
from pathlib import Path

FP8 = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}

GLM5_TP8_RANK: dict = {
    "model_type": "glm_moe_dsa", "architectures": ["GlmMoeDsaForCausalLM"],
    "vocab_size": 154880 // 8, "hidden_size": 6144, "intermediate_size": 12288 // 8, "moe_intermediate_size": 2048 // 8,
    "num_hidden_layers": 78, "num_attention_heads": 64 // 8, "num_key_value_heads": 64 // 8,
    "n_shared_experts": 1, "n_routed_experts": 256, "num_experts_per_tok": 8, "routed_scaling_factor": 2.5,
    "kv_lora_rank": 512, "q_lora_rank": 2048, "qk_rope_head_dim": 64, "v_head_dim": 256, "qk_nope_head_dim": 192,
    "n_group": 1, "topk_group": 1, "norm_topk_prob": True, "first_k_dense_replace": 3,
    "index_topk": 2048, "index_head_dim": 128, "index_n_heads": 32,
    "max_position_embeddings": 202752, "rms_norm_eps": 1e-5,
    "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0},
    "eos_token_id": 1, "bos_token_id": 0, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
    "quantization_config": FP8,
}  # fmt: skip


def _variant(base: dict, **changes) -> dict:
    cfg = copy.deepcopy(base)
    for key, value in changes.items():
        if value is None:
            cfg.pop(key, None)
        else:
            cfg[key] = value
    return cfg


PRESETS: dict[str, dict] = {
    "glm5-tp8-rank": GLM5_TP8_RANK,
    # Same per-layer shapes, fewer layers: quick runs and the mid-size graph checks.
    "glm5-tp8-rank-12l": _variant(GLM5_TP8_RANK, num_hidden_layers=12),
    "glm5-tp8-rank-12l-bf16": _variant(GLM5_TP8_RANK, num_hidden_layers=12, quantization_config=None),
    "glm5-tp8-rank-4l-bf16": _variant(GLM5_TP8_RANK, num_hidden_layers=4, quantization_config=None),
}


def moe_shape(cfg: dict) -> tuple[int, int, int, int]:
    """``(experts, hidden, expert intermediate, top-k)`` of ``cfg``'s routed experts (per rank)."""
    return cfg["n_routed_experts"], cfg["hidden_size"], cfg["moe_intermediate_size"], cfg["num_experts_per_tok"]


def dense_linear_shapes(cfg: dict) -> list[tuple[str, int, int]]:
    """``(name, K, N)`` of every dense linear of one decoder layer of ``cfg`` (a config.json dict,
    per rank: heads and intermediate sizes as the preset holds them), as the checkpoint holds
    them. ``mlp.*`` is a dense first layer, ``shared.*`` a MoE layer's shared expert.
    ``kv_b_proj`` is absorbed into the attention after loading: the engine never runs it as a
    GEMM (listed for the kernel tests and bench, which cover it as one more FP8 shape)."""
    c = cfg
    heads, nope, rope, v = c["num_attention_heads"], c["qk_nope_head_dim"], c["qk_rope_head_dim"], c["v_head_dim"]
    d, q_lora, kv_lora = c["hidden_size"], c["q_lora_rank"], c["kv_lora_rank"]
    shared = c["moe_intermediate_size"] * c.get("n_shared_experts", 1)
    return [
        ("q_a_proj", d, q_lora),
        ("kv_a_proj_with_mqa", d, kv_lora + rope),
        ("q_b_proj", q_lora, heads * (nope + rope)),
        ("kv_b_proj", kv_lora, heads * (nope + v)),
        ("o_proj", heads * v, d),
        ("indexer.wq_b", q_lora, c["index_n_heads"] * c["index_head_dim"]),
        ("indexer.wk", d, c["index_head_dim"]),
        ("mlp.gate_up_proj", d, 2 * c["intermediate_size"]),
        ("mlp.down_proj", c["intermediate_size"], d),
        ("shared.gate_up_proj", d, 2 * shared),
        ("shared.down_proj", shared, d),
    ]


def preset_folder(name: str, root: Path | None = None) -> Path:
    """Write preset ``name``'s config.json to folder ``root`` and return it. Without ``root``, a
    fresh temp dir that is removed when the process exits (a bench or server run leaves none)."""
    if name not in PRESETS:
        raise ValueError(f"unknown preset {name!r}; choose from {sorted(PRESETS)}")
    if root is None:
        root = Path(tempfile.mkdtemp(prefix=f"breakgraph-{name}-"))
        atexit.register(shutil.rmtree, root, ignore_errors=True)
    folder = Path(root)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(PRESETS[name], indent=2))
    return folder


def weight_bytes(cfg: dict) -> int:
    """Bytes of weights the preset holds (FP8 linears 1 B/param + scales, the rest 2 B/param)."""
    from breakgraph.models.config import ModelConfig
    from breakgraph.models.loader import build_model

    model = build_model(ModelConfig.from_dict(cfg), "meta", dtype=__import__("torch").bfloat16)
    return sum(p.numel() * p.element_size() for p in model.parameters())
