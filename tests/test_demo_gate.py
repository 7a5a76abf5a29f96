"""The accuracy gate on the shipped demo model: 200 held-out problems, zero-shot, greedy.

Eager prefill must score ≥ 0.92, and the breakable and piecewise prefill backends (CPU graph
backend) — and the HTTP server — must give the very same answers; with the FP8 latent KV cache the
gate must still hold.
"""

from __future__ import annotations

import concurrent.futures

import pytest
import torch

from breakgraph import Engine, SamplingParams
from breakgraph.demo.default_model import ASSETS, SHIPPED_NAME
from breakgraph.demo.problems import extract_answer, format_prompt, test_split

SHIPPED = ASSETS / SHIPPED_NAME
GATE = 0.92
N_PROBLEMS = 200
MAX_NEW = 96
BUCKETS = [256, 512]  # prefill chunks are capped at 512 tokens under graphs

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not (SHIPPED / "config.json").is_file(), reason=f"no shipped checkpoint in {SHIPPED}"),
]


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)  # a model this small gains nothing from a second intra-op thread
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def problems():
    return test_split(N_PROBLEMS)


def run(problems, **engine_kwargs) -> tuple[list[str], Engine]:
    engine = Engine(
        SHIPPED, device="cpu", dtype="float32", page_size=16, context_length=256,
        num_pages=len(problems) * (256 // 16) + 1, max_running_requests=len(problems), **engine_kwargs,
    )  # fmt: skip
    prompts = [format_prompt(p.question) for p in problems]
    outs = engine.generate(prompts, SamplingParams(max_new_tokens=MAX_NEW))
    return [o.text for o in outs], engine


@pytest.fixture(scope="module")
def eager_answers(problems):
    texts, engine = run(problems, cuda_graph_backend_prefill="disabled")
    mean_len = sum(len(engine.tokenize(format_prompt(p.question))) for p in problems) / len(problems)
    assert engine.config.index_topk < mean_len, "the indexer's top-k must be smaller than a typical prompt"
    return texts


def test_eager_accuracy_gate(problems, eager_answers):
    wrong = [(p.question, t) for p, t in zip(problems, eager_answers) if extract_answer(t) != p.final]
    accuracy = 1 - len(wrong) / len(problems)
    assert accuracy >= GATE, f"accuracy {accuracy:.3f} < {GATE}; first misses: {wrong[:3]}"


@pytest.mark.parametrize("backend", ["breakable", "piecewise"])
def test_graph_backends_give_the_same_answers(backend, problems, eager_answers):
    texts, engine = run(problems, cuda_graph_backend_prefill=backend, cuda_graph_bs_prefill=BUCKETS)
    stats = engine.graph_stats()
    assert stats["replays"] > 0, f"{backend} was selected but prefill never replayed a graph"
    assert texts == eager_answers


def test_fp8_kv_cache_passes_the_gate(problems, eager_answers):
    """The FP8 latent KV cache (``--kv-cache-dtype fp8_e4m3``, eager prefill): the gate still holds,
    and at least 95 % of the answers are the exact cache's."""
    texts, engine = run(problems, cuda_graph_backend_prefill="disabled", kv_cache_dtype="fp8_e4m3")
    assert engine.kv_cache.fp8_latent
    accuracy = sum(extract_answer(t) == p.final for p, t in zip(problems, texts)) / len(problems)
    same = sum(a == b for a, b in zip(texts, eager_answers)) / len(problems)
    assert accuracy >= GATE, f"FP8 cache: accuracy {accuracy:.3f} < {GATE}"
    assert same >= 0.95, f"FP8 cache: {1 - same:.1%} of answers differ from the exact cache's"


def test_server_gives_the_same_answers(problems, eager_answers):
    httpx = pytest.importorskip("httpx")
    pytest.importorskip("fastapi")
    pytest.importorskip("uvicorn")
    from breakgraph.server.app import ServerSettings, create_app, serve_in_thread

    subset = problems[:48]
    engine = Engine(SHIPPED, device="cpu", dtype="float32", page_size=16, context_length=256,
                    cuda_graph_backend_prefill="breakable", cuda_graph_bs_prefill=BUCKETS)  # fmt: skip
    app = create_app(engine, ServerSettings(served_model_name="demo"))
    with serve_in_thread(app) as url, httpx.Client(base_url=url, timeout=300) as client:

        def ask(p):
            body = {"model": "demo", "prompt": format_prompt(p.question), "max_tokens": MAX_NEW, "temperature": 0}
            r = client.post("/v1/completions", json=body)
            r.raise_for_status()
            return r.json()["choices"][0]["text"]

        with concurrent.futures.ThreadPoolExecutor(16) as pool:
            texts = list(pool.map(ask, subset))
    assert texts == eager_answers[: len(subset)]
