"""Checkpoint and config errors name the thing that is wrong."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from breakgraph.layers.linear import WeightShapeError
from breakgraph.models.config import ConfigError, ModelConfig
from breakgraph.models.loader import CheckpointError, load_model


def single_file_copy(src, dst):
    tensors = {}
    for f in src.glob("*.safetensors"):
        tensors.update(load_file(f))
    shutil.copy(src / "config.json", dst / "config.json")
    return tensors


def test_missing_tensor_is_named(hf_checkpoints, tmp_path):
    tensors = single_file_copy(hf_checkpoints["glm_moe_dsa"], tmp_path)
    del tensors["model.layers.2.self_attn.indexer.wk.weight"]
    save_file(tensors, tmp_path / "model.safetensors")
    with pytest.raises(CheckpointError, match=r"missing 1 tensor.*layers\.2\.self_attn\.indexer\.wk\.weight"):
        load_model(tmp_path, dtype=torch.float32)


def test_misshaped_tensor_names_tensor_and_shapes(hf_checkpoints, tmp_path):
    tensors = single_file_copy(hf_checkpoints["glm_moe_dsa"], tmp_path)
    name = "model.layers.1.mlp.experts.3.up_proj.weight"
    tensors[name] = tensors[name][:, :-1].contiguous()
    save_file(tensors, tmp_path / "model.safetensors")
    with pytest.raises(WeightShapeError, match=r"experts\.3\.up_proj\.weight.*\(32, 63\), expected \(32, 64\)"):
        load_model(tmp_path, dtype=torch.float32)


def test_unexpected_tensor_is_named_but_mtp_layers_are_skipped(hf_checkpoints, tmp_path):
    tensors = single_file_copy(hf_checkpoints["glm_moe_dsa"], tmp_path)
    tensors["model.layers.9.eh_proj.weight"] = torch.zeros(2, 2)  # a multi-token-prediction layer: ignored
    save_file(tensors, tmp_path / "model.safetensors")
    load_model(tmp_path, dtype=torch.float32)
    tensors["model.layers.0.self_attn.rogue.weight"] = torch.zeros(2, 2)
    save_file(tensors, tmp_path / "model.safetensors")
    with pytest.raises(CheckpointError, match=r"does not use.*self_attn\.rogue\.weight"):
        load_model(tmp_path, dtype=torch.float32)


def test_sharded_index_is_followed(hf_checkpoints):
    folder = hf_checkpoints["glm_moe_dsa"]
    assert (folder / "model.safetensors.index.json").is_file() and len(list(folder.glob("*.safetensors"))) > 1
    model = load_model(folder, dtype=torch.float32)
    assert model.model.layers[3].mlp.experts.w13.abs().sum() > 0


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("model_type", "llama", "model_type"),
        ("n_group", 3, "n_group"),
        ("num_experts_per_tok", 99, "num_experts_per_tok"),
        ("indexer_types", ["shared", "full", "full", "shared"], "indexer_types"),
        ("hidden_size", "wide", "hidden_size"),
        ("rope_parameters", {"rope_type": "longrope", "rope_theta": 1.0}, "rope_type"),
    ],
)
def test_bad_config_field_is_named(hf_checkpoints, field, value, message):
    cfg = json.loads((hf_checkpoints["glm_moe_dsa"] / "config.json").read_text())
    cfg[field] = value
    with pytest.raises(ConfigError, match=message):
        ModelConfig.from_dict(cfg)


def test_dummy_weights_for_full_glm5_config_on_meta():
    cfg = ModelConfig.from_dict({"model_type": "glm_moe_dsa", "rope_parameters": {"rope_theta": 1e6}})
    model = load_model(None, config=cfg, device="meta", load_format="dummy")
    n = sum(p.numel() for p in model.parameters())
    assert cfg.num_hidden_layers == 78 and cfg.latent_dim == 576
    assert 7.0e11 < n < 8.0e11, n  # GLM-5 is ~744B parameters without the MTP layer


def test_dummy_weights_are_seeded_and_finite(hf_checkpoints):
    a = load_model(hf_checkpoints["deepseek_v32"], dtype=torch.float32, load_format="dummy", seed=3)
    b = load_model(hf_checkpoints["deepseek_v32"], dtype=torch.float32, load_format="dummy", seed=3)
    for (n, p), (_, q) in zip(a.named_parameters(), b.named_parameters()):
        assert torch.equal(p, q), n
        assert torch.isfinite(p.float()).all(), n
