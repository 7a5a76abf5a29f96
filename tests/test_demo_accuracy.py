"""The shipped demo checkpoint is the default model, small, of the GLM-5 architecture, and says
plainly what it is (not GLM-5, not a chat model) in ``/v1/models``."""

from __future__ import annotations

import json

import pytest

from breakgraph.demo.default_model import ASSETS, SHIPPED_NAME, default_model_path, model_description

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


def test_only_the_built_in_models_carry_a_description(tmp_path):
    text = model_description(SHIPPED)
    assert text and "not GLM-5" in text and "not a chat model" in text and "arithmetic" in text
    assert model_description(str(SHIPPED) + "/") == text
    assert model_description(tmp_path) is None


def test_models_route_describes_the_default_model():
    httpx = pytest.importorskip("httpx")
    pytest.importorskip("fastapi")
    pytest.importorskip("uvicorn")
    from breakgraph import Engine
    from breakgraph.server.app import ServerSettings, create_app, serve_in_thread

    engine = Engine(device="cpu", dtype="float32", page_size=16, context_length=256, num_pages=64)
    app = create_app(engine, ServerSettings(served_model_name=SHIPPED_NAME))
    with serve_in_thread(app) as url, httpx.Client(base_url=url, timeout=60) as client:
        card = client.get("/v1/models").json()["data"][0]
        assert card["id"] == SHIPPED_NAME and card["description"] == model_description(SHIPPED)
        assert client.get(f"/v1/models/{SHIPPED_NAME}").json()["description"] == card["description"]


# The accuracy gate itself (eager, breakable, piecewise, server) lives in test_demo_gate.py.
