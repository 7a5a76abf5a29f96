"""The demo model's accuracy gate on a GPU: bf16, real CUDA graphs (``pytest -m cuda``)."""

from __future__ import annotations

import pytest

from breakgraph import Engine, SamplingParams
from breakgraph.demo.default_model import ASSETS, SHIPPED_NAME
from breakgraph.demo.problems import extract_answer, format_prompt, test_split

SHIPPED = ASSETS / SHIPPED_NAME
pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not (SHIPPED / "config.json").is_file(), reason=f"no shipped checkpoint in {SHIPPED}"),
]


def answers(backend: str, problems) -> list[str]:
    engine = Engine(SHIPPED, device="cuda", dtype="bfloat16", page_size=16, context_length=256,
                    num_pages=len(problems) * 16 + 1, max_running_requests=len(problems),
                    cuda_graph_backend_prefill=backend, cuda_graph_bs_prefill=[256, 512, 1024],
                    cuda_graph_backend_decode="full", cuda_graph_max_bs=64)  # fmt: skip
    outs = engine.generate([format_prompt(p.question) for p in problems], SamplingParams(max_new_tokens=96))
    if backend != "disabled":
        assert engine.graph_stats()["replays"] > 0
    return [o.text for o in outs]


def test_bf16_gate_with_real_cuda_graphs():
    problems = test_split(200)
    by_backend = {b: answers(b, problems) for b in ("disabled", "breakable", "piecewise")}
    for backend, texts in by_backend.items():
        accuracy = sum(extract_answer(t) == p.final for p, t in zip(problems, texts)) / len(problems)
        print(f"H200 bf16 {backend}: accuracy {accuracy:.3f}")
        assert accuracy >= 0.92, f"{backend}: accuracy {accuracy:.3f}"
    for backend in ("breakable", "piecewise"):
        same = sum(a == b for a, b in zip(by_backend[backend], by_backend["disabled"])) / len(problems)
        assert same >= 0.98, f"{backend} answers differ from eager on {1 - same:.1%} of problems"
