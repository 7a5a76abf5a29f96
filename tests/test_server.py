"""The OpenAI-compatible server, end to end: a real uvicorn server on 127.0.0.1 (ephemeral
port, in a thread) over the default model, driven by a real HTTP client.

Prompts plus outputs stay short, so greedy tokens do not depend on batch composition through
near-ties in the sparse attention's top-k.
"""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest

pytest.importorskip("uvicorn")  # serving extras; absent on some GPU images
pytest.importorskip("fastapi")  # serving extras; absent on some GPU images
from prometheus_client.parser import text_string_to_metric_families

from breakgraph import Engine, SamplingParams
from breakgraph.server.app import ServerSettings, create_app, serve_in_thread
from breakgraph.server.metrics import ServerMetrics

MODEL = "tiny"


pytestmark = pytest.mark.usefixtures("one_intra_op_thread")


@pytest.fixture(scope="module")
def engine():
    # 16-token pages: the prefix-reuse test shares one full page between two short prompts
    return Engine(None, device="cpu", dtype="float32", max_running_requests=4, page_size=16)


@pytest.fixture(scope="module")
def reference():
    """A separate engine for expected outputs (no prefix reuse, everything batched together)."""
    ref = Engine(None, device="cpu", dtype="float32", max_running_requests=64)
    ref.scheduler.set_prefix_caching(False)
    return ref


@pytest.fixture(scope="module")
def server(engine):
    app = create_app(engine, ServerSettings(MODEL, max_queued_requests=1024))
    with serve_in_thread(app) as url:
        yield url, app


@pytest.fixture(scope="module")
def client(server):
    with httpx.Client(base_url=server[0], timeout=60) as c:
        yield c


def greedy(ref: Engine, prompt, max_tokens: int, **kw):
    return ref.generate(prompt, SamplingParams(max_new_tokens=max_tokens, ignore_eos=True, **kw))[0]


def chat_prompt(ref: Engine, messages) -> str:
    return ref.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)


def sse_events(lines) -> list:
    """Parsed ``data:`` payloads of an event stream; ``"[DONE]"`` kept as a string."""
    out = []
    for line in lines:
        if line.startswith("data: "):
            data = line[len("data: ") :]
            out.append(data if data == "[DONE]" else json.loads(data))
    return out


def stream(client: httpx.Client, path: str, body: dict) -> list:
    with client.stream("POST", path, json={**body, "stream": True}) as r:
        assert r.status_code == 200, r.read()
        assert r.headers["content-type"].startswith("text/event-stream")
        return sse_events(r.iter_lines())


PROMPT = "Question: Lena has 12 apples and buys 7 more. How many?\nAnswer:"


def test_models_and_health(client):
    models = client.get("/v1/models").json()
    assert [m["id"] for m in models["data"]] == [MODEL]
    assert client.get("/health").json() == {"status": "ok"}
    r = client.get("/health_generate")
    assert r.status_code == 200 and r.json()["tokens"] == 1


def test_greedy_completion_equals_engine_generate(client, reference):
    body = {
        "model": MODEL,
        "prompt": PROMPT,
        "max_tokens": 6,
        "temperature": 0,
        "ignore_eos": True,
        "logprobs": 3,
    }
    r = client.post("/v1/completions", json=body)
    assert r.status_code == 200, r.text
    out = r.json()
    ref = greedy(reference, PROMPT, 6)
    choice = out["choices"][0]
    assert choice["text"] == ref.text and choice["finish_reason"] == "length"
    assert choice["logprobs"]["token_logprobs"] == pytest.approx(ref.logprobs, abs=1e-4)
    tops = choice["logprobs"]["top_logprobs"]
    assert all(len(top) == 3 for top in tops), "the three most likely tokens at each position"
    for top, lp in zip(tops, choice["logprobs"]["token_logprobs"]):
        assert max(top.values()) == pytest.approx(lp, abs=1e-4), "greedy: the chosen token is the most likely"
    assert out["usage"] == {"prompt_tokens": ref.prompt_tokens, "completion_tokens": 6, "total_tokens": ref.prompt_tokens + 6,
                            "prompt_tokens_details": out["usage"]["prompt_tokens_details"]}  # fmt: skip
    by_ids = client.post("/v1/completions", json={**body, "prompt": reference.tokenize(PROMPT)}).json()
    assert by_ids["choices"][0]["text"] == ref.text, "token-id prompts work too"


def test_chat_completion_applies_the_chat_template(client, reference):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2 plus 3?"}]
    body = {
        "messages": messages,
        "max_tokens": 5,
        "temperature": 0,
        "ignore_eos": True,
        "logprobs": True,
        "top_logprobs": 1,
    }
    out = client.post("/v1/chat/completions", json=body).json()
    ref = greedy(reference, chat_prompt(reference, messages), 5)
    choice = out["choices"][0]
    assert choice["message"] == {"role": "assistant", "content": ref.text}
    assert [t["logprob"] for t in choice["logprobs"]["content"]] == pytest.approx(ref.logprobs, abs=1e-4)
    assert out["usage"]["completion_tokens"] == 5 and out["object"] == "chat.completion"


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_streamed_chunks_reassemble_to_the_non_streamed_text(client, path):
    chat = path.endswith("chat/completions")
    body = {"max_tokens": 8, "temperature": 0, "ignore_eos": True, "n": 2}
    body |= {"messages": [{"role": "user", "content": "Count to five."}]} if chat else {"prompt": PROMPT}
    whole = client.post(path, json=body).json()
    events = stream(client, path, {**body, "stream_options": {"include_usage": True}})
    assert events[-1] == "[DONE]"
    usage = events[-2]
    assert (
        usage["choices"] == []
        and usage["usage"]["completion_tokens"] == whole["usage"]["completion_tokens"] == 16
    )
    texts, finish = {0: "", 1: ""}, {}
    for ev in events[:-2]:
        for ch in ev["choices"]:
            texts[ch["index"]] += (ch["delta"].get("content") or "") if chat else ch["text"]
            if ch["finish_reason"]:
                finish[ch["index"]] = ch["finish_reason"]
    for ch in whole["choices"]:
        assert texts[ch["index"]] == (ch["message"]["content"] if chat else ch["text"])
        assert finish[ch["index"]] == ch["finish_reason"] == "length"


def test_stop_strings_cut_the_text_in_both_modes(client, reference):
    free = greedy(reference, PROMPT, 10)
    assert len(free.text) > 6
    stop = free.text[3:6]
    body = {
        "prompt": PROMPT,
        "max_tokens": 10,
        "temperature": 0,
        "ignore_eos": True,
        "stop": [stop, "\u00a7never"],
    }
    whole = client.post("/v1/completions", json=body).json()["choices"][0]
    cut = free.text[: free.text.find(stop)]
    assert whole["text"] == cut and whole["finish_reason"] == "stop"
    events = stream(client, "/v1/completions", body)
    assert "".join(ch["text"] for ev in events[:-1] for ch in ev["choices"]) == cut


def test_text_held_back_for_a_stop_string_prefix_is_streamed_once_it_cannot_match(client, reference):
    free = greedy(reference, PROMPT, 12)
    stops = [free.text[1:4] + "\u00a7", free.text[6:9] + "\u00a7\u00a7"]  # their prefixes show up, they never do
    for seeded in ({}, {"temperature": 1.0, "seed": 5, "n": 2}):
        body = {"prompt": PROMPT, "max_tokens": 12, "temperature": 0, "ignore_eos": True, "stop": stops, **seeded}
        whole = client.post("/v1/completions", json=body).json()["choices"]
        texts = {c["index"]: "" for c in whole}
        for ev in stream(client, "/v1/completions", body)[:-1]:
            for ch in ev["choices"]:
                texts[ch["index"]] += ch["text"]
        assert texts == {c["index"]: c["text"] for c in whole}
        if not seeded:
            assert whole[0]["text"] == free.text


def test_seeded_sampling_is_reproducible(client):
    body = {
        "prompt": PROMPT,
        "max_tokens": 6,
        "temperature": 1.0,
        "top_p": 0.9,
        "top_k": 50,
        "seed": 11,
        "n": 2,
        "ignore_eos": True,
    }
    a = client.post("/v1/completions", json=body).json()["choices"]
    b = client.post("/v1/completions", json=body).json()["choices"]
    assert [c["text"] for c in a] == [c["text"] for c in b]


SHORT = "Question: 2+3?\nAnswer:"  # the default model's answer ends in fewer than 29 tokens
# unlike any training problem, so the default model's next tokens are uncertain enough for each field to matter
UNSURE = "Question: Tell me a story about a dog.\nAnswer:"
# the default model's greedy answer repeats itself ("a story about a story about ..."), which the penalties change
REPEATS = "Question: Tell me a story about a cat.\nAnswer:"
SAMPLING_FIELDS = [  # (the fields, the fields they are compared against)
    ({"prompt": REPEATS, "presence_penalty": 2, "frequency_penalty": 2, "max_tokens": 20},
     {"prompt": REPEATS, "max_tokens": 20}),  # fmt: skip
    ({"repetition_penalty": 10}, {}),  # the default model is sure enough of its first tokens that 3 changes none
    ({"logit_bias": {"421": -100, "17": 5}}, {}),  # 421: the first token of the greedy answer to UNSURE
    ({"prompt": SHORT, "min_tokens": 29, "max_tokens": 29, "ignore_eos": False},
     {"prompt": SHORT, "max_tokens": 29, "ignore_eos": False}),  # fmt: skip
    ({"temperature": 2.0, "min_p": 0.5, "seed": 3}, {"temperature": 2.0, "seed": 3}),
]


def engine_generate(ref: Engine, body: dict):
    kw = {k: v for k, v in body.items() if k not in ("prompt", "max_tokens")}
    kw["logit_bias"] = {int(t): b for t, b in kw.get("logit_bias", {}).items()}
    return ref.generate(body["prompt"], SamplingParams(max_new_tokens=body["max_tokens"], **kw))[0]


@pytest.mark.parametrize(("fields", "base"), SAMPLING_FIELDS)
def test_sampling_fields_reach_the_sampler(client, reference, fields, base):
    """The server gives what Engine.generate gives with the same SamplingParams, streamed or
    not, and the field changes the output."""
    head = {"prompt": UNSURE, "max_tokens": 8, "temperature": 0, "ignore_eos": True}
    body = {**head, **fields}
    want = engine_generate(reference, body)
    assert want.token_ids != engine_generate(reference, {**head, **base}).token_ids, "the field changed nothing"
    got = client.post("/v1/completions", json=body).json()["choices"][0]
    assert got["text"] == want.text and got["finish_reason"] == want.finish_reason
    events = stream(client, "/v1/completions", body)
    assert "".join(ch["text"] for ev in events[:-1] for ch in ev["choices"]) == want.text


def test_logit_bias_forces_a_token(client, reference):
    tok = reference.tokenizer.encode(" 7", add_special_tokens=False)[0]
    body = {"prompt": PROMPT, "max_tokens": 4, "temperature": 0, "ignore_eos": True, "logit_bias": {str(tok): 100}}
    out = client.post("/v1/completions", json=body).json()["choices"][0]
    assert out["text"] == reference.tokenizer.decode([tok] * 4)


BAD = [
    # (path, raw body, status, param named in the error)
    ("/v1/completions", b'{"prompt": "hi", ', 400, None),  # malformed JSON
    ("/v1/completions", b'{"prompt": "\xff\xfe"}', 400, None),  # invalid UTF-8
    ("/v1/completions", b"[1, 2]", 400, None),  # not an object
    ("/v1/completions", b"", 400, None),  # empty body
    ("/v1/completions", b'{"max_tokens": 4}', 400, "prompt"),  # missing prompt
    ("/v1/completions", b'{"prompt": ""}', 400, "prompt"),  # empty prompt
    ("/v1/completions", b'{"prompt": []}', 400, "prompt"),  # empty token list
    ("/v1/completions", b'{"prompt": 5}', 400, "prompt"),  # wrong type
    ("/v1/completions", b'{"prompt": [1, 99999999]}', 400, "prompt"),  # token id outside the vocabulary
    ("/v1/completions", b'{"prompt": "hi", "seed": 18446744073709551616}', 400, "seed"),  # beyond a generator seed
    ("/v1/completions", b'{"prompt": "hi", "max_tokens": -3}', 400, "max_tokens"),
    ("/v1/completions", b'{"prompt": "hi", "max_tokens": 0}', 400, "max_tokens"),
    ("/v1/completions", b'{"prompt": "hi", "max_tokens": "ten"}', 400, "max_tokens"),
    ("/v1/completions", b'{"prompt": "hi", "max_tokens": 1000000}', 400, "max_tokens"),  # over the context
    (
        "/v1/completions",
        b'{"prompt": "hi there friend", "max_tokens": 1023}',
        400,
        "max_tokens",
    ),  # prompt + max_tokens > context
    ("/v1/completions", b'{"prompt": "hi", "temperature": "hot"}', 400, "temperature"),
    ("/v1/completions", b'{"prompt": "hi", "temperature": -1}', 400, "temperature"),
    ("/v1/completions", b'{"prompt": "hi", "top_p": 0}', 400, "top_p"),
    ("/v1/completions", b'{"prompt": "hi", "top_k": 2.5}', 400, "top_k"),
    ("/v1/completions", b'{"prompt": "hi", "n": 0}', 400, "n"),
    ("/v1/completions", b'{"prompt": "hi", "stop": 7}', 400, "stop"),
    ("/v1/completions", b'{"prompt": "hi", "logprobs": true}', 400, "logprobs"),
    ("/v1/completions", b'{"prompt": "hi", "presence_penalty": 3}', 400, "presence_penalty"),
    ("/v1/completions", b'{"prompt": "hi", "frequency_penalty": "x"}', 400, "frequency_penalty"),
    ("/v1/completions", b'{"prompt": "hi", "repetition_penalty": 0}', 400, "repetition_penalty"),
    ("/v1/completions", b'{"prompt": "hi", "logit_bias": [1]}', 400, "logit_bias"),
    ("/v1/completions", b'{"prompt": "hi", "logit_bias": {"abc": 1}}', 400, "logit_bias"),
    ("/v1/completions", b'{"prompt": "hi", "logit_bias": {"5": 200}}', 400, "logit_bias"),
    ("/v1/completions", b'{"prompt": "hi", "logit_bias": {"99999999": 1}}', 400, "logit_bias"),  # outside the vocab
    ("/v1/completions", b'{"prompt": "hi", "stop_token_ids": [99999999]}', 400, "stop_token_ids"),
    ("/v1/completions", b'{"prompt": "hi", "min_p": 1.5}', 400, "min_p"),
    ("/v1/completions", b'{"prompt": "hi", "min_tokens": -1}', 400, "min_tokens"),
    ("/v1/completions", b'{"prompt": "hi", "min_tokens": 5, "max_tokens": 2}', 400, "min_tokens"),
    ("/v1/completions", b'{"prompt": "hi", "stream": "yes"}', 400, "stream"),
    (
        "/v1/completions",
        b'{"prompt": "hi", "stream_options": {"include_usage": true}}',
        400,
        "stream_options",
    ),
    ("/v1/completions", b'{"prompt": "hi", "echo": true, "stream": true}', 400, "echo"),
    ("/v1/completions", b'{"prompt": "hi", "model": "gpt-4"}', 404, "model"),  # unknown model
    ("/v1/completions", b'{"prompt": "hi", "model": 3}', 400, "model"),
    (
        "/v1/completions",
        json.dumps({"prompt": "7 " * 1100}).encode(),
        400,
        "prompt",
    ),  # longer than the context
    ("/v1/chat/completions", b'{"messages": []}', 400, "messages"),  # empty messages
    ("/v1/chat/completions", b'{"messages": "hi"}', 400, "messages"),
    ("/v1/chat/completions", b'{"max_tokens": 3}', 400, "messages"),
    ("/v1/chat/completions", b'{"messages": [{"role": "user"}]}', 400, "messages[0].content"),
    ("/v1/chat/completions", b'{"messages": [{"role": "robot", "content": "hi"}]}', 400, "messages"),
    (
        "/v1/chat/completions",
        b'{"messages": [{"role": "user", "content": "hi"}], "top_logprobs": 2}',
        400,
        "top_logprobs",
    ),
    (
        "/v1/chat/completions",
        json.dumps({"messages": [{"role": "user", "content": "7 " * 1100}]}).encode(),
        400,
        "messages",
    ),
]


def test_every_bad_request_gets_a_4xx_naming_the_field_and_the_server_stays_up(client):
    good = {"prompt": "hi", "max_tokens": 1}
    for path, raw, status, param in BAD:
        r = client.post(path, content=raw, headers={"content-type": "application/json"})
        assert r.status_code == status, (raw[:60], r.status_code, r.text)
        err = r.json()["error"]
        assert set(err) == {"message", "type", "param", "code"} and err["message"]
        assert err["param"] == param, (raw[:60], err)
        assert client.post("/v1/completions", json=good).status_code == 200, (
            f"server unusable after {raw[:60]!r}"
        )
    assert client.get("/nope").json()["error"]["message"]
    assert client.get("/v1/completions").status_code == 405


def test_64_concurrent_requests_with_4_running_all_complete_correctly(server, reference):
    url, app = server
    prompts = [f"Question: what is {i} plus {3 * i + 1}?\nAnswer:" for i in range(64)]
    expected = reference.generate(prompts, SamplingParams(max_new_tokens=4, ignore_eos=True))

    async def one(client: httpx.AsyncClient, i: int) -> str:
        body = {"prompt": prompts[i], "max_tokens": 4, "temperature": 0, "ignore_eos": True}
        if i % 2:  # half of them stream
            text = ""
            async with client.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
                assert r.status_code == 200
                async for line in r.aiter_lines():
                    if line.startswith("data: {"):
                        text += "".join(c["text"] for c in json.loads(line[6:])["choices"])
            return text
        r = await client.post("/v1/completions", json=body)
        assert r.status_code == 200, r.text
        return r.json()["choices"][0]["text"]

    async def all_of_them() -> list[str]:
        limits = httpx.Limits(max_connections=100)
        async with httpx.AsyncClient(base_url=url, timeout=120, limits=limits) as client:
            return await asyncio.gather(*(one(client, i) for i in range(64)))

    texts = asyncio.run(all_of_them())
    assert texts == [e.text for e in expected]
    engine = app.state.engine_loop.engine
    assert engine.kv_cache.pool.num_used == 0 and not engine.has_unfinished()


def test_shared_prefix_is_reused_with_identical_output(client, reference):
    prefix = "Question: Tom reads 14 pages a day for 6 days."
    body = {"max_tokens": 5, "temperature": 0, "ignore_eos": True}
    client.post("/v1/completions", json={**body, "prompt": prefix + " How many?"})
    prompt = prefix + " How many pages?\nAnswer:"
    out = client.post("/v1/completions", json={**body, "prompt": prompt}).json()
    assert out["usage"]["prompt_tokens_details"]["cached_tokens"] >= 16, "the shared full page is reused"
    assert out["choices"][0]["text"] == greedy(reference, prompt, 5).text


def test_metrics_parse_and_count(client, server):
    client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2, "ignore_eos": True})
    r = client.get("/metrics")
    assert r.status_code == 200
    samples = {}
    for family in text_string_to_metric_families(r.text):
        for s in family.samples:
            samples.setdefault(s.name, []).append(s)
    value = {name: sum(s.value for s in ss) for name, ss in samples.items()}
    assert value["breakgraph_prompt_tokens_total"] > 0
    assert value["breakgraph_generation_tokens_total"] >= 2
    assert value["breakgraph_time_to_first_token_seconds_count"] > 0
    assert value["breakgraph_time_per_output_token_seconds_count"] > 0
    for gauge in ("breakgraph_num_running_requests", "breakgraph_num_queued_requests", "breakgraph_kv_pages_used",
                  "breakgraph_kv_pages_total", "breakgraph_prefill_graph_replays_total",
                  "breakgraph_prefill_graph_fallbacks_total"):  # fmt: skip
        assert gauge in value, gauge
    assert value["breakgraph_kv_pages_total"] > 0
    engine = server[1].state.engine_loop.engine
    assert value["breakgraph_prefill_graph_stats_available"] == (1 if hasattr(engine, "graph_stats") else 0)


def test_prefill_graph_counters_come_from_the_engine_stats():
    metrics = ServerMetrics()
    graph = {"backend": "breakable", "replays": 7, "fallbacks": {"too_many_tokens": 2, "padding": 1}}
    stats = {"graph": {**graph, "decode": {"replays": 5, "fallbacks": {}}}}
    metrics.bind(lambda: stats, lambda: 3)
    families = {f.name: f for f in text_string_to_metric_families(metrics.render().decode())}
    assert families["breakgraph_prefill_graph_replays"].samples[0].value == 7
    assert families["breakgraph_prefill_graph_fallbacks"].samples[0].value == 3
    by_reason = {
        s.labels["reason"]: s.value for s in families["breakgraph_prefill_graph_fallbacks_by_reason"].samples
    }
    assert by_reason == {"too_many_tokens": 2, "padding": 1}
    assert families["breakgraph_prefill_graph_backend"].samples[0].labels == {"backend": "breakable"}
    assert families["breakgraph_num_queued_requests"].samples[0].value == 3
    assert families["breakgraph_decode_graph_replays"].samples[0].value == 5


def test_sse_event_is_one_line_for_every_client_splitter():
    """Text with U+2028, U+2029 or U+0085 (random token ids decode to them) stays on one line
    even for clients that split like str.splitlines (httpx's iter_lines), and decodes back."""
    from breakgraph.server.sse import sse

    text = "a\u2028b\u0085c\u2029d\ne\rf\x1cg"
    event = sse({"choices": [{"text": text}]})
    lines = event.splitlines()
    assert lines[1:] == [""] and lines[0].startswith("data: ")
    assert json.loads(lines[0][len("data: ") :]) == {"choices": [{"text": text}]}
