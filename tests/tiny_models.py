"""Tiny random GLM-5 / DeepSeek-V3.2 checkpoints saved with transformers' save_pretrained.

Shapes follow DESIGN's testing advice: ≥ 8 indexer heads × 32 dims, small ``index_topk`` so
sequences of ≥ 4× top-k make the attention really sparse, group routing for DeepSeek-V3.2,
shared-indexer layers for GLM-5, non-zero router correction bias.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

INDEX_TOPK = 8

COMMON = dict(
    vocab_size=128, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=4,
    num_attention_heads=4, num_key_value_heads=4, n_routed_experts=8, num_experts_per_tok=2, kv_lora_rank=32,
    q_lora_rank=48, qk_rope_head_dim=16, v_head_dim=24, qk_nope_head_dim=16, index_topk=INDEX_TOPK,
    index_head_dim=32, index_n_heads=8, first_k_dense_replace=1, max_position_embeddings=512,
    routed_scaling_factor=2.5, tie_word_embeddings=False,
)  # fmt: skip


def glm5_config():
    from transformers import GlmMoeDsaConfig

    return GlmMoeDsaConfig(
        **COMMON, n_group=1, topk_group=1, rms_norm_eps=1e-5,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        indexer_types=["full", "shared", "full", "shared"],
    )  # fmt: skip


def dsv32_config(**changes):
    from transformers import DeepseekV32Config

    return DeepseekV32Config(
        **{**COMMON, "max_position_embeddings": 2560, **changes}, n_group=4, topk_group=2, rms_norm_eps=1e-6,
        rope_parameters={
            "rope_type": "yarn", "rope_theta": 10000.0, "factor": 40.0, "original_max_position_embeddings": 64,
            "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0,
        },
    )  # fmt: skip


def make_hf_model(model_type: str, seed: int = 0):
    """A transformers model (fp32, eager attention) with random weights incl. router bias."""
    from transformers import DeepseekV32ForCausalLM, GlmMoeDsaForCausalLM

    torch.manual_seed(seed)
    if model_type == "glm_moe_dsa":
        model = GlmMoeDsaForCausalLM(glm5_config())
    else:
        model = DeepseekV32ForCausalLM(dsv32_config())
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name and name.endswith("weight"):
                p.add_(torch.randn_like(p) * 0.1)
            elif name.endswith("e_score_correction_bias"):
                p.copy_(torch.randn_like(p) * 0.1)
            elif p.dim() >= 2:
                p.normal_(0, 0.1)
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(torch.randn_like(b) * 0.1)
    model.config._attn_implementation = "eager"
    return model.eval()


def save_hf_checkpoint(model, folder: Path) -> Path:
    model.save_pretrained(folder)
    return folder


FP8_EXCLUDED = ("lm_head", "indexers_proj", "model.embed_tokens")  # as GLM-5-FP8 lists them


def write_fp8_checkpoint(src: Path, dst: Path, block: int = 128, exclusions=FP8_EXCLUDED) -> Path:
    """Quantise every projection matrix of checkpoint ``src`` to FP8 ``block``×``block`` tiles
    (GLM-5-FP8 style, ``weight_scale_inv`` beside each weight) into ``dst``. Embeddings, the LM
    head, norms, ``weights_proj``, the router and modules named in ``exclusions`` stay as they are."""
    from safetensors.torch import load_file, save_file

    from breakgraph.kernels.fp8 import block_quant

    config = json.loads((src / "config.json").read_text())
    config["quantization_config"] = {
        "quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
        "weight_block_size": [block, block], "modules_to_not_convert": list(exclusions),
    }  # fmt: skip
    dst.mkdir(parents=True, exist_ok=True)
    (dst / "config.json").write_text(json.dumps(config))
    tensors = {}
    for f in src.glob("*.safetensors"):
        tensors.update(load_file(f))
    out = {}
    for name, t in tensors.items():
        keep = any(k in name for k in ("embed_tokens", "lm_head", "norm", "weights_proj", "mlp.gate.")) or t.dim() != 2
        if keep or any(name.startswith(e + ".") for e in exclusions):
            out[name] = t
        else:
            out[name], out[name[: -len("weight")] + "weight_scale_inv"] = block_quant(t, (block, block))
    save_file(out, dst / "model.safetensors")
    return dst
