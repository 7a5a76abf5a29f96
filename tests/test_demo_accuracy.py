"""The shipped demo checkpoint is the default model, small, and of the GLM-5 architecture."""

from __future__ import annotations

import json

import pytest

from breakgraph.demo.default_model import ASSETS, SHIPPED_NAME, default_model_path

SHIPPED = ASSETS / SHIPPED_NAME
MAX_MB = 25

pytestmark = pytest.mark.skipif(
    not (SHIPPED / "config.json").is_file(),
    reason=f"no shipped checkpoint in {SHIPPED} yet (train one with python -m breakgraph.demo.train)",
)


def test_shipped_checkpoint_is_the_default_small_and_glm5():
    assert default_model_path() == SHIPPED
    config = json.loads((SHIPPED / "config.json").read_text())
    assert config["model_type"] == "glm_moe_dsa"
    assert "shared" in config["indexer_types"]
    size_mb = sum(f.stat().st_size for f in SHIPPED.rglob("*") if f.is_file()) / 1e6
    assert size_mb <= MAX_MB, f"{SHIPPED} is {size_mb:.1f} MB"


# The accuracy gate itself (eager, breakable, piecewise, server) lives in test_demo_gate.py.
