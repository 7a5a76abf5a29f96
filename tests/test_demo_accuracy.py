"""The shipped demo model really answers: zero-shot, greedy, through breakgraph's Engine (CPU,
fp32, prefill graph backend off), on the 200 fixed held-out word problems."""

from __future__ import annotations

import inspect
import json

import pytest
import torch

from breakgraph import Engine, SamplingParams
from breakgraph.demo.default_model import ASSETS, SHIPPED_NAME, default_model_path
from breakgraph.demo.problems import extract_answer, format_prompt, test_split

SHIPPED = ASSETS / SHIPPED_NAME
GATE = 0.92
MAX_MB = 25

pytestmark = pytest.mark.skipif(
    not (SHIPPED / "config.json").is_file(),
    reason=f"no shipped checkpoint in {SHIPPED} yet (train one with python -m breakgraph.demo.train)",
)


@pytest.fixture(autouse=True)
def _one_thread():
    """A model this small gains little from a second intra-op thread, and on a shared machine
    the second thread can make the run several times slower."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def _engine_kwargs() -> dict:
    """Only ask for the eager prefill when this Engine has the option (graph backends are optional)."""
    params = inspect.signature(Engine.__init__).parameters
    return {"cuda_graph_backend_prefill": "disabled"} if "cuda_graph_backend_prefill" in params else {}


def test_shipped_checkpoint_is_the_default_small_and_glm5():
    assert default_model_path() == SHIPPED
    config = json.loads((SHIPPED / "config.json").read_text())
    assert config["model_type"] == "glm_moe_dsa"
    assert "shared" in config["indexer_types"]
    size_mb = sum(f.stat().st_size for f in SHIPPED.rglob("*") if f.is_file()) / 1e6
    assert size_mb <= MAX_MB, f"{SHIPPED} is {size_mb:.1f} MB"


@pytest.mark.slow
def test_shipped_model_solves_held_out_problems_zero_shot_greedy():
    problems = test_split(200)
    prompts = [format_prompt(p.question) for p in problems]
    max_new = 128
    engine = Engine(
        SHIPPED, device="cpu", dtype="float32", page_size=16, context_length=256,
        num_pages=len(prompts) * (256 // 16) + 1, max_running_requests=len(prompts), **_engine_kwargs(),
    )  # fmt: skip
    # index_topk must really be sparse for these prompts
    lengths = [len(engine.tokenize(p)) for p in prompts]
    assert engine.config.index_topk < sum(lengths) / len(lengths)
    outs = engine.generate(prompts, SamplingParams(max_new_tokens=max_new, temperature=0.0))
    wrong = [
        (p.question, o.text, p.final) for p, o in zip(problems, outs) if extract_answer(o.text) != p.final
    ]
    accuracy = 1 - len(wrong) / len(problems)
    assert accuracy >= GATE, f"accuracy {accuracy:.3f} < {GATE}; first misses: {wrong[:3]}"
