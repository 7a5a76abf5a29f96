"""Chat requests without ``max_tokens`` on a small KV pool, through a real server on loopback:
many run at once (the running gauge shows it), decode preempts when the pool runs out (the
preemption counter shows it), every request completes, and each answer — streamed or not,
greedy or seeded sampling — equals the request run alone."""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import pytest

pytest.importorskip("uvicorn")  # serving extras; absent on some GPU images
pytest.importorskip("fastapi")  # serving extras; absent on some GPU images
from prometheus_client.parser import text_string_to_metric_families

from breakgraph import Engine, SamplingParams
from breakgraph.server.app import ServerSettings, create_app, serve_in_thread

pytestmark = pytest.mark.usefixtures("one_intra_op_thread")

N = 10


def metric(text: str, name: str) -> float:
    return sum(s.value for f in text_string_to_metric_families(text) for s in f.samples if s.name == name)


def test_chat_requests_without_max_tokens_share_a_small_pool():
    # the demo model (context 512, pages of 16) over 32 usable pages: a budget of 32 pages each,
    # so reserving whole budgets would run one request at a time
    engine = Engine(None, device="cpu", dtype="float32", num_pages=33, page_size=16)
    budget_pages = engine.kv_cache.pool.pages_for(engine.context_length)
    assert engine.kv_usage().total // budget_pages == 1
    # three-step problems: the demo model answers each in ~50-70 tokens, so N of them outgrow the pool
    messages = [[{"role": "user", "content": f"Ben has {i + 3} boxes with 12 pencils in each box. He buys {i + 5} more "
                  "pencils and gives away 9. How many pencils does he have left?"}] for i in range(N)]  # fmt: skip
    seeds = [7 + i if i % 4 == 3 else None for i in range(N)]
    bodies = [{"messages": m, "temperature": 0.8 if s is not None else 0, **({"seed": s} if s is not None else {})}
              for m, s in zip(messages, seeds)]  # fmt: skip

    async def one(client: httpx.AsyncClient, i: int) -> str:
        if i % 2:  # half of them stream: the deltas must add up to the answer, nothing sent twice
            text = ""
            async with client.stream("POST", "/v1/chat/completions", json={**bodies[i], "stream": True}) as r:
                assert r.status_code == 200
                async for line in r.aiter_lines():
                    if line.startswith("data: {"):
                        for c in json.loads(line[6:])["choices"]:
                            text += c["delta"].get("content") or ""
                            assert c["finish_reason"] in (None, "stop")
            return text
        r = await client.post("/v1/chat/completions", json=bodies[i])
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["finish_reason"] == "stop"
        return r.json()["choices"][0]["message"]["content"]

    async def scrape(client: httpx.AsyncClient, done: asyncio.Event) -> float:
        peak = 0.0
        while not done.is_set():
            peak = max(peak, metric((await client.get("/metrics")).text, "breakgraph_num_running_requests"))
            await asyncio.sleep(0.02)
        return peak

    async def run(url: str) -> tuple[list[str], float]:
        async with httpx.AsyncClient(base_url=url, timeout=300, limits=httpx.Limits(max_connections=64)) as client:
            done = asyncio.Event()
            watcher = asyncio.ensure_future(scrape(client, done))
            texts = await asyncio.gather(*(one(client, i) for i in range(N)))
            done.set()
            return list(texts), await watcher

    app = create_app(engine, ServerSettings("tiny", max_queued_requests=64))
    with serve_in_thread(app) as url:
        texts, peak_gauge = asyncio.run(run(url))
        stats = engine.stats()
        with httpx.Client(base_url=url, timeout=60) as client:
            deadline = time.monotonic() + 10  # the gauges are a snapshot the engine thread refreshes
            while metric(client.get("/metrics").text, "breakgraph_preemptions_total") != stats.preemptions:
                assert time.monotonic() < deadline, "/metrics never showed the engine's preemptions"
                time.sleep(0.05)
            assert client.get("/health").status_code == 200
    assert stats.preemptions > 0
    assert stats.peak_running > 4 and peak_gauge > 4, (stats.peak_running, peak_gauge)
    assert engine.kv_cache.pool.num_used == 0 and not engine.has_unfinished()

    expected = []
    for m, s in zip(messages, seeds):
        prompt = engine.tokenizer.apply_chat_template(m, tokenize=False, add_generation_prompt=True)
        max_new = engine.context_length - len(engine.tokenize(prompt))
        params = SamplingParams(max_new_tokens=max_new, temperature=0.8 if s is not None else 0, seed=s)
        expected.append(engine.generate([prompt], [params])[0].text)  # alone
    assert texts == expected
