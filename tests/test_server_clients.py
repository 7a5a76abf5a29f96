"""The clients people point at a server, on a real loopback server: lm-evaluation-harness's
loglikelihood requests (``echo`` + ``logprobs``), SGLang's native routes, ``/v1/models/{id}``,
and the ``openai`` package (where installed). Every case is followed by a good request and
/health."""

from __future__ import annotations

import json
import types

import httpx
import pytest

pytest.importorskip("uvicorn")  # serving extras; absent on some GPU images
pytest.importorskip("fastapi")  # serving extras; absent on some GPU images
import torch

from breakgraph import Engine, SamplingParams
from breakgraph.server.app import ServerSettings, create_app, serve_in_thread

MODEL = "tiny"
GOOD = {"prompt": "Hello", "max_tokens": 1, "temperature": 0}
PROMPT = "Question: Lena has 12 apples and buys 7 more. How many?\nAnswer:"


pytestmark = pytest.mark.usefixtures("one_intra_op_thread")


@pytest.fixture(scope="module")
def engine():
    # 16-token pages: the short test prompt fills a page the prefix cache can keep
    return Engine(None, device="cpu", dtype="float32", max_running_requests=4, page_size=16)


@pytest.fixture(scope="module")
def reference():
    ref = Engine(None, device="cpu", dtype="float32", max_running_requests=8)
    ref.scheduler.set_prefix_caching(False)
    return ref


@pytest.fixture(scope="module")
def server(engine):
    app = create_app(engine, ServerSettings(MODEL, api_key="k"))
    with serve_in_thread(app) as url:
        yield url, app


@pytest.fixture()
def client(server):
    with httpx.Client(base_url=server[0], timeout=60, headers={"Authorization": "Bearer k"}) as c:
        yield c
        assert c.post("/v1/completions", json=GOOD).status_code == 200, "a good request after the case"
        assert c.get("/health").status_code == 200, "healthy after the case"


def prompt_logprobs(ref: Engine, ids: list[int]) -> list[float]:
    """log p(ids[i] | ids[:i]) for i >= 1, from ``Engine.prompt_logits``."""
    logits = ref.prompt_logits([ids])[0]
    logprobs = torch.log_softmax(logits.float(), -1)
    return [float(logprobs[i - 1, ids[i]]) for i in range(1, len(ids))]


def test_echo_with_logprobs_gives_the_prompt_tokens_logprobs(client, reference):
    ids = reference.tokenize(PROMPT)
    r = client.post("/v1/completions", json={"prompt": PROMPT, "echo": True, "logprobs": 2, "max_tokens": 1,
                                             "temperature": 0})  # fmt: skip
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    lp = choice["logprobs"]
    assert (
        len(lp["tokens"]) == len(ids) + 1
        and lp["token_logprobs"][0] is None
        and lp["top_logprobs"][0] is None
    )
    assert lp["token_logprobs"][1 : len(ids)] == pytest.approx(prompt_logprobs(reference, ids), abs=1e-4)
    first = reference.generate(PROMPT, SamplingParams(max_new_tokens=1, ignore_eos=True))[0]
    assert choice["text"] == PROMPT + first.text
    assert lp["token_logprobs"][-1] == pytest.approx(first.logprobs[0], abs=1e-4)
    for token_lp, top in zip(lp["token_logprobs"][1:], lp["top_logprobs"][1:]):
        assert len(top) <= 2 and max(top.values()) >= token_lp - 1e-6
    assert lp["text_offset"][:3] == [0, len(lp["tokens"][0]), len(lp["tokens"][0]) + len(lp["tokens"][1])]
    assert r.json()["usage"]["prompt_tokens"] == len(ids) and r.json()["usage"]["completion_tokens"] == 1


def test_echo_with_max_tokens_0_returns_only_the_prompt(client, reference):
    ids = reference.tokenize(PROMPT)
    r = client.post("/v1/completions", json={"prompt": ids, "echo": True, "logprobs": 0, "max_tokens": 0})
    assert r.status_code == 200, r.text
    body = r.json()
    choice = body["choices"][0]
    assert choice["text"] == reference.tokenizer.decode(ids) and body["usage"]["completion_tokens"] == 0
    assert (
        len(choice["logprobs"]["token_logprobs"]) == len(ids) and choice["logprobs"]["top_logprobs"] is None
    )
    assert choice["logprobs"]["token_logprobs"][1:] == pytest.approx(
        prompt_logprobs(reference, ids), abs=1e-4
    )
    without_echo = client.post("/v1/completions", json={"prompt": ids, "max_tokens": 0})
    assert without_echo.status_code == 400 and without_echo.json()["error"]["param"] == "max_tokens"


def lm_eval_loglikelihood(body: dict, ctxlens: list[int]) -> list[tuple[float, bool]]:
    """lm-evaluation-harness's ``LocalCompletionsAPI.parse_logprobs`` (0.4.x), verbatim in effect:
    the continuation's summed logprob and whether it is the greedy continuation."""
    res = []
    for choice, ctxlen in zip(sorted(body["choices"], key=lambda c: c["index"]), ctxlens):
        lps = choice["logprobs"]["token_logprobs"][ctxlen:-1]
        tops = choice["logprobs"]["top_logprobs"][ctxlen:-1]
        res.append((sum(lps), all(tok == max(top.values()) for tok, top in zip(lps, tops))))
    return res


def test_lm_eval_local_completions_loglikelihood_request(client, reference):
    """The exact body lm-eval's ``local-completions`` sends for loglikelihood (token ids,
    batched), parsed as it parses it."""
    context = reference.tokenize("Question: what is 2 plus 2?\nAnswer:")
    continuations = [reference.tokenize(" 4"), reference.tokenize(" five hundred")]
    prompts = [context + cont for cont in continuations]
    body = {"model": MODEL, "prompt": prompts, "temperature": 0, "max_tokens": 1, "logprobs": 1, "seed": 1234,
            "echo": True}  # fmt: skip
    r = client.post("/v1/completions", json=body)
    assert r.status_code == 200, r.text
    got = lm_eval_loglikelihood(r.json(), [len(context)] * 2)
    for (total, greedy), ids, cont in zip(got, prompts, continuations):
        expected = prompt_logprobs(reference, ids)[len(context) - 1 :]
        assert total == pytest.approx(sum(expected), abs=1e-3)
        logits = reference.prompt_logits([ids])[0]
        argmax = [int(logits[i - 1].argmax()) for i in range(len(context), len(ids))]
        assert greedy == (argmax == cont)


def test_lm_eval_parses_the_answer_with_its_own_code(client, reference):
    completions = pytest.importorskip("lm_eval.models.openai_completions")
    context = reference.tokenize("The sky is")
    prompts = [context + reference.tokenize(" blue"), context + reference.tokenize(" green")]
    this = types.SimpleNamespace(model=MODEL)
    body = completions.LocalCompletionsAPI._create_payload(this, prompts, generate=False)  # its request body
    r = client.post("/v1/completions", json=body)
    assert r.status_code == 200, r.text
    parsed = completions.LocalCompletionsAPI.parse_logprobs(r.json(), prompts, [len(context)] * 2)
    assert parsed == lm_eval_loglikelihood(r.json(), [len(context)] * 2)


def test_sglang_generate_matches_the_engine(client, reference):
    want = reference.generate(PROMPT, SamplingParams(max_new_tokens=6, ignore_eos=True))[0]
    r = client.post("/generate", json={"text": PROMPT, "sampling_params": {"max_new_tokens": 6, "temperature": 0,
                                                                          "ignore_eos": True}})  # fmt: skip
    assert r.status_code == 200, r.text
    out = r.json()
    assert out["text"] == want.text and out["output_ids"] == want.token_ids
    meta = out["meta_info"]
    assert meta["finish_reason"] == {"type": "length", "length": 6}
    assert meta["prompt_tokens"] == want.prompt_tokens and meta["completion_tokens"] == 6
    batch = client.post("/generate", json={"input_ids": [reference.tokenize(PROMPT), [5, 6, 7]],
                                           "sampling_params": {"max_new_tokens": 2, "temperature": 0}})  # fmt: skip
    assert isinstance(batch.json(), list) and len(batch.json()) == 2
    assert batch.json()[0]["text"] == want.text[: len(batch.json()[0]["text"])]


def test_sglang_generate_streams_the_text_so_far(client):
    body = {"text": PROMPT, "stream": True, "sampling_params": {"max_new_tokens": 6, "temperature": 0,
                                                                "ignore_eos": True}}  # fmt: skip
    with client.stream("POST", "/generate", json=body) as r:
        lines = [line for line in r.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "data: [DONE]"
    events = [json.loads(line[6:]) for line in lines[:-1]]
    texts = [e["text"] for e in events]
    assert all(b.startswith(a) for a, b in zip(texts, texts[1:])), "each event holds the whole text so far"
    whole = client.post("/generate", json={**body, "stream": False}).json()
    assert texts[-1] == whole["text"] and events[-1]["meta_info"]["finish_reason"]["type"] == "length"


@pytest.mark.parametrize(
    "body,param",
    [({"sampling_params": {"max_new_tokens": 2}}, "text"),
     ({"text": "a", "input_ids": [1], "sampling_params": {}}, "text"),
     ({"text": "a", "sampling_params": {"max_new_tokens": -1}}, "sampling_params.max_new_tokens"),
     ({"text": "a", "sampling_params": {"temperature": "hot"}}, "sampling_params.temperature"),
     ({"text": "a", "sampling_params": {"json_schema": "{}"}}, "sampling_params.json_schema"),
     ({"text": "a", "sampling_params": {"stop": ["x"] * 100}}, "sampling_params.stop"),
     ({"text": "a", "sampling_params": []}, "sampling_params"),
     ({"text": "a", "return_logprob": True}, "return_logprob"),
     ({"text": "a", "lora_path": "x"}, "lora_path"),
     ({"input_ids": [1, 999999999]}, "input_ids")],
)  # fmt: skip
def test_sglang_generate_errors_name_sglang_fields(client, body, param):
    r = client.post("/generate", json=body)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param


def test_sglang_info_routes(client, server):
    info = client.get("/get_model_info").json()
    assert info["model_path"] == MODEL and info["is_generation"] is True
    server_info = client.get("/get_server_info")
    assert server_info.status_code == 200 and server_info.json()["served_model_name"] == MODEL
    assert "api_key" not in server_info.text
    with httpx.Client(base_url=server[0], timeout=10) as anonymous:
        assert anonymous.get("/get_model_info").status_code == 401, "SGLang's routes take the API key too"
        assert anonymous.post("/flush_cache").status_code == 401


def test_flush_cache_drops_cached_prefixes(client):
    body = {"prompt": PROMPT, "max_tokens": 1, "temperature": 0}
    client.post("/v1/completions", json=body)
    assert (
        client.post("/v1/completions", json=body).json()["usage"]["prompt_tokens_details"]["cached_tokens"]
        > 0
    )
    r = client.post("/flush_cache")
    assert r.status_code == 200 and r.text.startswith("Cache flushed.")
    assert client.get("/flush_cache").status_code == 200, "GET works too, as in SGLang"
    assert (
        client.post("/v1/completions", json=body).json()["usage"]["prompt_tokens_details"]["cached_tokens"]
        == 0
    )


def test_tokenize_and_detokenize_round_trip(client, reference):
    r = client.post("/tokenize", json={"prompt": PROMPT})
    assert r.json() == {"tokens": reference.tokenize(PROMPT), "count": len(reference.tokenize(PROMPT)),
                        "max_model_len": reference.context_length}  # fmt: skip
    batch = client.post("/tokenize", json={"prompt": ["a b", "c"], "add_special_tokens": False}).json()
    assert batch["count"] == [len(t) for t in batch["tokens"]]
    back = client.post("/detokenize", json={"tokens": reference.tokenize(PROMPT)}).json()
    assert back == {"text": PROMPT}
    assert client.post("/detokenize", json={"tokens": [[5, 6], [7]]}).json()["text"] == [
        reference.tokenizer.decode([5, 6], skip_special_tokens=True), reference.tokenizer.decode([7], skip_special_tokens=True)
    ]  # fmt: skip
    assert client.post("/detokenize", json={"tokens": [-1]}).status_code == 400
    assert client.post("/tokenize", json={"prompt": 5}).status_code == 400


def test_model_card_by_id(client):
    card = client.get(f"/v1/models/{MODEL}")
    assert card.status_code == 200 and card.json()["id"] == MODEL and card.json()["object"] == "model"
    missing = client.get("/v1/models/gpt-4")
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "model_not_found"
    assert client.get("/v1/models/org/name").status_code == 404, "ids with a slash are looked up, not 405"


def test_the_openai_package_against_the_server(server, client):
    openai = pytest.importorskip("openai")
    oai = openai.OpenAI(base_url=server[0] + "/v1", api_key="k", max_retries=0)
    out = oai.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=4, temperature=0, echo=True, logprobs=1
    )
    assert out.choices[0].text.startswith(PROMPT) and out.choices[0].logprobs.token_logprobs[0] is None
    chat = oai.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=3
    )
    assert chat.choices[0].message.role == "assistant"
    chunks = list(oai.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}],
                                              max_tokens=3, stream=True))  # fmt: skip
    assert chunks and chunks[0].choices[0].delta.role == "assistant"
    assert oai.models.retrieve(MODEL).id == MODEL
    with pytest.raises(openai.NotFoundError):
        oai.models.retrieve("nope")
    with pytest.raises(openai.BadRequestError) as err:
        oai.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}],
                                    response_format={"type": "json_object"})  # fmt: skip
    assert "response_format" in str(err.value)
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=server[0] + "/v1", api_key="wrong", max_retries=0).models.list()
