"""The checkpoint average (``python -m breakgraph.demo.average``) on small random checkpoints."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file, save_file

from breakgraph.demo.average import average_checkpoints, main


def _checkpoint(folder, state, tokenizer=b'{"model": "bpe"}', extra=True):
    folder.mkdir(parents=True)
    save_file(state, folder / "model.safetensors")
    (folder / "config.json").write_text('{"model_type": "glm_moe_dsa"}')
    (folder / "tokenizer.json").write_bytes(tokenizer)
    if extra:
        (folder / "generation_config.json").write_text('{"eos_token_id": 2}')
        (folder / "training.json").write_text('{"steps": 1}')
    return folder


def _state(seed):
    g = torch.Generator().manual_seed(seed)
    return {
        "w": torch.randn(4, 6, generator=g).bfloat16(),
        "norm": torch.rand(6, generator=g) + 0.5,
        "ids": torch.arange(5),
    }


def test_the_average_is_the_fp32_mean_rounded_to_each_dtype(tmp_path):
    states = [_state(1), _state(2), _state(3)]
    folders = [_checkpoint(tmp_path / f"m{i}", s) for i, s in enumerate(states)]
    out = average_checkpoints(folders, tmp_path / "avg")
    got = load_file(out / "model.safetensors")
    for key in ("w", "norm"):
        want = (sum(s[key].float() for s in states) / 3).to(states[0][key].dtype)
        assert got[key].dtype == states[0][key].dtype and torch.equal(got[key], want)
        assert not torch.equal(got[key], states[0][key])
    assert torch.equal(got["ids"], states[0]["ids"])
    names = {p.name for p in out.iterdir()}
    assert names == {"model.safetensors", "config.json", "tokenizer.json", "generation_config.json"}


def test_the_output_may_be_one_of_the_inputs(tmp_path):
    a, b = _state(4), _state(5)
    fa, fb = _checkpoint(tmp_path / "a", a), _checkpoint(tmp_path / "b", b)
    main(["--models", str(fa), str(fb), "--output", str(fa)])
    got = load_file(fa / "model.safetensors")
    assert torch.equal(got["norm"], (a["norm"] + b["norm"]) / 2)
    assert not (fa / "training.json").exists()  # it described stage a alone


def test_checkpoints_that_do_not_match_are_refused_by_name(tmp_path):
    base = _checkpoint(tmp_path / "base", _state(6))
    wide = _state(7)
    wide["w"] = torch.zeros(4, 7, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="tensor 'w'.*\\(4, 7\\)"):
        average_checkpoints([base, _checkpoint(tmp_path / "wide", wide)], tmp_path / "out")
    ids = _state(8)
    ids["ids"] = torch.arange(5) + 1
    with pytest.raises(ValueError, match="tensor 'ids'.*cannot be averaged"):
        average_checkpoints([base, _checkpoint(tmp_path / "ids", ids)], tmp_path / "out")
    fewer = _state(9)
    del fewer["norm"]
    with pytest.raises(ValueError, match="different tensors.*'norm'"):
        average_checkpoints([base, _checkpoint(tmp_path / "fewer", fewer)], tmp_path / "out")
    other_tok = _checkpoint(tmp_path / "tok", _state(10), tokenizer=b"{}")
    with pytest.raises(ValueError, match="tokenizer.json differs"):
        average_checkpoints([base, other_tok], tmp_path / "out")
    fp8 = {"w": torch.randn(4, 6).to(torch.float8_e4m3fn)}
    with pytest.raises(ValueError, match="tensor 'w' is torch.float8_e4m3fn"):
        average_checkpoints([_checkpoint(tmp_path / "f1", fp8), _checkpoint(tmp_path / "f2", fp8)], tmp_path / "out")
    with pytest.raises(ValueError, match="at least two"):
        average_checkpoints([base], tmp_path / "out")
    with pytest.raises(ValueError, match="not a demo checkpoint: no model.safetensors"):
        average_checkpoints([base, tmp_path], tmp_path / "out")
    assert not (tmp_path / "out").exists()  # nothing written for a refused average
