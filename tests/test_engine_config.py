"""EngineConfig is the one home of the engine's settings: the CLI flags, keyword construction
and the environment knobs all come from its fields."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch

from breakgraph import Engine, env
from breakgraph.cli import build_parser, engine_config
from breakgraph.engine.config import EngineConfig, flag_fields, flag_name


def test_every_flagged_field_is_a_flag_with_the_fields_default():
    parser = build_parser()
    args = parser.parse_args(["generate"])
    for f in flag_fields():
        assert getattr(args, f.name) == f.default, f.name
    help_text = parser._subparsers._group_actions[0].choices["generate"].format_help()
    for f in flag_fields():
        assert f"--{flag_name(f.name)}" in help_text


def test_flags_build_the_config():
    args = build_parser().parse_args(
        ["generate", "--model-path", "/m", "--page-size", "8", "--cuda-graph-bs-prefill", "16", "64",
         "--fold-islands", "--tp-size", "2", "--dtype", "float32"]
    )  # fmt: skip
    cfg = engine_config(args)
    want = EngineConfig(model_path="/m", page_size=8, cuda_graph_bs_prefill=(16, 64), fold_islands=True, tp_size=2,
                        dtype="float32")  # fmt: skip
    assert cfg == want
    assert dataclasses.replace(cfg, page_size=16) == EngineConfig(**{**want.to_dict(), "page_size": 16})


def test_env_knobs_are_read_once_when_the_config_is_built(monkeypatch):
    monkeypatch.setenv("BREAKGRAPH_TP_TIMEOUT_S", "7.5")
    cfg = EngineConfig()
    monkeypatch.setenv("BREAKGRAPH_TP_TIMEOUT_S", "9")
    assert cfg.tp_timeout_s == 7.5 and EngineConfig().tp_timeout_s == 9
    monkeypatch.delenv("BREAKGRAPH_TP_GRACE_S", raising=False)
    assert cfg.tp_grace_s == float(env.KNOBS["BREAKGRAPH_TP_GRACE_S"].default)
    assert EngineConfig.from_dict(cfg.to_dict()) == cfg  # what a TP rank is sent round-trips


def test_paths_devices_and_dtypes_are_kept_as_plain_values():
    cfg = EngineConfig(model_path=Path("/m"), device=torch.device("cpu"), dtype=torch.bfloat16)
    assert (cfg.model_path, cfg.device, cfg.dtype) == ("/m", "cpu", "bfloat16")
    assert json.loads(json.dumps(cfg.to_dict())) == cfg.to_dict()


def test_bad_settings_name_the_flag_or_variable(monkeypatch):
    with pytest.raises(ValueError, match=r"--dtype must be one of .*got 'int8'"):
        EngineConfig(dtype="int8")
    with pytest.raises(ValueError, match=r"--cuda-graph-backend-decode must be one of"):
        EngineConfig(cuda_graph_backend_decode="sometimes")
    with pytest.raises(ValueError, match="chunked_prefill_size must be >= 1"):
        EngineConfig(chunked_prefill_size=0)
    with pytest.raises(TypeError, match="no setting 'pages'"):
        EngineConfig.from_dict({"pages": 3})
    monkeypatch.setenv("BREAKGRAPH_MOE_W8A8", "sometimes")
    with pytest.raises(ValueError, match="BREAKGRAPH_MOE_W8A8 must be one of 0, 1, got 'sometimes'"):
        env.read("BREAKGRAPH_MOE_W8A8")


def test_keywords_and_config_build_the_same_engine(hf_checkpoints):
    folder = hf_checkpoints["glm_moe_dsa"]
    kw = dict(device="cpu", dtype="float32", page_size=4, cuda_graph_backend_prefill="breakable",
              cuda_graph_bs_prefill=[16], fold_islands=True)  # fmt: skip
    by_keywords = Engine(folder, **kw)
    import breakgraph

    assert breakgraph.EngineConfig is EngineConfig  # exported at the package root
    by_config = Engine(EngineConfig(model_path=folder, **kw))
    assert by_keywords.engine_config == by_config.engine_config
    assert by_config.runner.prefill_graphs.fold_islands is True  # the setting reached the graphs
    ids = [[1, 2, 3, 4, 5]]
    assert by_keywords.prompt_logits(ids)[0].equal(by_config.prompt_logits(ids)[0])
    with pytest.raises(TypeError, match="pages"):
        Engine(folder, pages=3)
