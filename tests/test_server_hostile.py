"""Hostile input against a real loopback server: malformed HTTP, malformed and oversized
bodies, wrong types and out-of-range values in every field, refused features, odd paths.
Each case must get a status below 500 (the listed one where it is fixed), an error body
without internals, and leave the server healthy: a good request and /health follow each."""

from __future__ import annotations

import contextlib
import json
import socket

import httpx
import pytest

pytest.importorskip("uvicorn")  # serving extras; absent on some GPU images
pytest.importorskip("fastapi")  # serving extras; absent on some GPU images

from breakgraph import Engine
from breakgraph.server.app import ServerSettings, create_app, serve_in_thread

GOOD = {"prompt": "Hello", "max_tokens": 1, "temperature": 0}
CHAT = "/v1/chat/completions"
COMP = "/v1/completions"
USER = [{"role": "user", "content": "hi"}]


def j(obj) -> bytes:
    return json.dumps(obj).encode()


def chat(**extra) -> bytes:
    return j({"messages": USER, "max_tokens": 1, **extra})


def comp(**extra) -> bytes:
    return j({"prompt": "hi", "max_tokens": 1, **extra})


# (name, method, path, body, expected status: an int, or None for "any status below 500")
CASES = [
    ("empty body", "POST", COMP, b"", 400),
    ("null body", "POST", COMP, b"null", 400),
    ("number body", "POST", COMP, b"123", 400),
    ("string body", "POST", COMP, b'"prompt"', 400),
    ("array body", "POST", COMP, b'[{"prompt": "hi"}]', 400),
    ("truncated json", "POST", COMP, b'{"prompt": "hi", "max_tokens": ', 400),
    ("trailing garbage", "POST", COMP, b'{"prompt": "hi"} trailing', 400),
    ("NaN temperature", "POST", COMP, b'{"prompt": "hi", "temperature": NaN}', 400),
    ("Infinity max_tokens", "POST", COMP, b'{"prompt": "hi", "max_tokens": Infinity}', 400),
    ("max_tokens 10**30", "POST", COMP, comp(max_tokens=10**30), 400),
    ("negative seed", "POST", COMP, comp(seed=-1), 400),
    ("100k-deep arrays", "POST", COMP, b"[" * 100_000, 400),
    ("30k-deep objects", "POST", COMP, b'{"a":' * 30_000 + b"1" + b"}" * 30_000, 400),
    ("33-deep valid json", "POST", COMP, b'{"prompt": "hi", "x": ' + b"[" * 33 + b"]" * 33 + b"}", 400),
    ("lone surrogate prompt", "POST", COMP, b'{"prompt": "\\ud800"}', 400),
    (
        "lone low surrogate content",
        "POST",
        CHAT,
        b'{"messages": [{"role": "user", "content": "\\udc00"}]}',
        400,
    ),
    ("surrogate role", "POST", CHAT, b'{"messages": [{"role": "\\ud800", "content": "hi"}]}', 400),
    ("surrogate model", "POST", COMP, b'{"prompt": "hi", "model": "\\udbff"}', 400),
    ("surrogate stop", "POST", COMP, b'{"prompt": "hi", "stop": "\\ud800"}', 400),
    ("surrogate key", "POST", COMP, b'{"prompt": "hi", "\\ud800": 1}', 400),
    ("surrogate in prompt list", "POST", COMP, b'{"prompt": ["a", "b", "\\ud800"]}', 400),
    ("surrogate in /generate", "POST", "/generate", b'{"text": "\\ud800"}', 400),
    ("surrogate in /tokenize", "POST", "/tokenize", b'{"prompt": "\\ud800"}', 400),
    ("invalid utf-8", "POST", COMP, b'{"prompt": "\xff\xfe\xfd"}', 400),
    ("utf-8 BOM", "POST", COMP, b"\xef\xbb\xbf" + comp(), 400),
    ("utf-16 body", "POST", COMP, comp().decode().encode("utf-16"), 400),
    ("NUL characters in prompt", "POST", COMP, comp(prompt="a\u0000b"), 200),
    (
        "control characters in chat",
        "POST",
        CHAT,
        j({"messages": [{"role": "user", "content": "\x01\x02\x1b[31m"}], "max_tokens": 1}),
        200,
    ),  # fmt: skip
    ("prompt over the context", "POST", COMP, comp(prompt="7 " * 1100), 400),
    ("token ids over the context", "POST", COMP, comp(prompt=[5] * 2000), 400),
    ("generations over the queue", "POST", COMP, comp(prompt=["a"] * 20, n=128), 400),
    ("n 1000", "POST", COMP, comp(n=1000), 400),
    ("n as string", "POST", COMP, comp(n="2"), 400),
    ("logprobs 21", "POST", COMP, comp(logprobs=21), 400),
    ("top_logprobs 100", "POST", CHAT, chat(logprobs=True, top_logprobs=100), 400),
    ("100 stop strings", "POST", COMP, comp(stop=[f"s{i}" for i in range(100)]), 400),
    ("10k-char stop string", "POST", COMP, comp(stop="x" * 10_000), 400),
    ("stop as object", "POST", COMP, comp(stop={"a": 1}), 400),
    ("stop with a number", "POST", COMP, comp(stop=["a", 1]), 400),
    ("empty stop string", "POST", COMP, comp(stop=[""]), 400),
    ("stop_token_ids out of range", "POST", COMP, comp(stop_token_ids=[-5, 10**12]), 400),
    ("stop_token_ids as strings", "POST", COMP, comp(stop_token_ids=["1"]), 400),
    ("negative token id", "POST", COMP, comp(prompt=[1, -2, 3]), 400),
    ("boolean token ids", "POST", COMP, comp(prompt=[True, False]), 400),
    ("float token id", "POST", COMP, comp(prompt=[1.5]), 400),
    ("nested token lists", "POST", COMP, comp(prompt=[[[1]]]), 400),
    ("prompt object", "POST", COMP, comp(prompt={"text": "hi"}), 400),
    ("empty prompt in batch", "POST", COMP, comp(prompt=["a", ""]), 400),
    ("duplicate keys, last wrong", "POST", COMP, b'{"prompt": "hi", "prompt": 5}', 400),
    (
        "image content part",
        "POST",
        CHAT,
        j(
            {
                "messages": [
                    {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "http://x"}}]}
                ]
            }
        ),
        400,
    ),  # fmt: skip
    ("message without role", "POST", CHAT, j({"messages": [{"content": "hi"}]}), 400),
    ("message as string", "POST", CHAT, j({"messages": ["hi"]}), 400),
    ("content as number", "POST", CHAT, j({"messages": [{"role": "user", "content": 5}]}), 400),
    (
        "assistant content null",
        "POST",
        CHAT,
        j(
            {
                "messages": [
                    *USER,
                    {"role": "assistant", "content": None},
                    {"role": "user", "content": "again"},
                ],
                "max_tokens": 1,
            }
        ),
        200,
    ),  # fmt: skip
    ("many messages", "POST", CHAT, j({"messages": USER * 2000, "max_tokens": 1}), 400),
    ("tools", "POST", CHAT, chat(tools=[{"type": "function", "function": {"name": "f"}}]), 400),
    ("json_schema response_format", "POST", CHAT, chat(response_format={"type": "json_schema"}), 400),
    ("tool_choice required", "POST", CHAT, chat(tool_choice="required"), 400),
    ("unknown field", "POST", COMP, comp(frobnicate=True), 400),
    (
        "reserved template kwarg",
        "POST",
        CHAT,
        chat(chat_template_kwargs={"add_generation_prompt": False}),
        400,
    ),
    ("template kwargs as list", "POST", CHAT, chat(chat_template_kwargs=["x"]), 400),
    ("template kwarg not an identifier", "POST", CHAT, chat(chat_template_kwargs={"a b": 1}), 400),
    ("template variable", "POST", CHAT, chat(chat_template_kwargs={"enable_thinking": False}), 200),
    ("temperature as string", "POST", COMP, comp(temperature="hot"), 400),
    ("temperature 1e308", "POST", COMP, comp(temperature=1e308), 400),
    ("top_p 0", "POST", COMP, comp(top_p=0), 400),
    ("top_k -5", "POST", COMP, comp(top_k=-5), 400),
    ("best_of 3", "POST", COMP, comp(best_of=3), 400),
    ("stream_options without stream", "POST", COMP, comp(stream_options={"include_usage": True}), 400),
    ("stream as string", "POST", COMP, comp(stream="yes"), 400),
    ("max_tokens 0 without echo", "POST", COMP, comp(max_tokens=0), 400),
    ("echo with stream", "POST", COMP, comp(echo=True, stream=True), 400),
    ("echo as string", "POST", COMP, comp(echo="yes"), 400),
    ("huge model name", "POST", COMP, comp(model="m" * 100_000), 404),
    ("GET on a POST route", "GET", COMP, b"", 405),
    ("DELETE on a GET route", "DELETE", "/health", b"", 405),
    ("unknown route", "POST", "/v1/engines/davinci/completions", b"{}", 404),
    ("long junk path", "GET", "/" + "a" * 5000, b"", 404),
    ("percent-encoded surrogate path", "GET", "/v1/models/%ED%A0%80", b"", 404),
    ("path traversal", "GET", "/v1/models/../../etc/passwd", b"", 404),
    ("generate: both text and ids", "POST", "/generate", j({"text": "a", "input_ids": [1]}), 400),
    (
        "generate: unknown sampling key",
        "POST",
        "/generate",
        j({"text": "a", "sampling_params": {"regex": "."}}),
        400,
    ),
    ("generate: sampling_params list", "POST", "/generate", j({"text": "a", "sampling_params": [1]}), 400),
    ("generate: stream a batch", "POST", "/generate", j({"text": ["a", "b"], "stream": True}), 400),
    ("generate: empty text", "POST", "/generate", j({"text": ""}), 400),
    ("tokenize: number", "POST", "/tokenize", j({"prompt": 5}), 400),
    ("tokenize: unknown field", "POST", "/tokenize", j({"prompt": "a", "truncate": 3}), 400),
    ("detokenize: out of vocabulary", "POST", "/detokenize", j({"tokens": [10**9]}), 400),
    ("detokenize: strings", "POST", "/detokenize", j({"tokens": ["a"]}), 400),
    ("detokenize: ragged nesting", "POST", "/detokenize", j({"tokens": [[1], 2]}), 400),
]


pytestmark = pytest.mark.usefixtures("one_intra_op_thread")


@pytest.fixture(scope="module")
def server():
    engine = Engine(None, device="cpu", dtype="float32", max_running_requests=4)
    app = create_app(engine, ServerSettings("tiny", max_request_bytes=1 << 20, request_read_timeout_s=1.0,
                                            header_timeout_s=1.0))  # fmt: skip
    with serve_in_thread(app) as url, httpx.Client(base_url=url, timeout=60) as client:
        yield client, url


def assert_healthy(client: httpx.Client) -> None:
    assert client.post(COMP, json=GOOD).status_code == 200, "a good request after the case"
    assert client.get("/health").status_code == 200, "healthy after the case"


@pytest.mark.parametrize("name,method,path,body,status", CASES, ids=[c[0] for c in CASES])
def test_hostile_request(server, name, method, path, body, status):
    client, _ = server
    r = client.request(method, path, content=body or None, headers={"content-type": "application/json"})
    assert r.status_code < 500, (name, r.status_code, r.text[:300])
    if status is not None:
        assert r.status_code == status, (name, r.status_code, r.text[:300])
    if r.status_code >= 400:
        err = r.json()["error"]
        assert err["message"] and "Traceback" not in r.text and "Error:" not in err["message"], err
    assert_healthy(client)


def raw(url: str, data: bytes, timeout: float = 5.0) -> bytes:
    host, port = url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port))) as s:
        s.settimeout(timeout)
        s.sendall(data)
        got = b""
        with contextlib.suppress(TimeoutError, ConnectionResetError):
            while chunk := s.recv(65536):
                got += chunk
        return got


RAW = [
    ("garbage request line", b"HELLO THERE\r\n\r\n", b"HTTP/1.1 400"),
    ("binary noise", bytes(range(256)) * 4, b"HTTP/1.1 400"),
    (
        "200 KB header",
        b"GET /health HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * 200_000 + b"\r\n\r\n",
        b"HTTP/1.1 ",
    ),
    (
        "bad content-length",
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: abc\r\n\r\n",
        b"HTTP/1.1 400",
    ),
    (
        "negative content-length",
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: -5\r\n\r\n",
        b"HTTP/1.1 400",
    ),  # fmt: skip
    (
        "content-length beyond the cap",
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 99999999999\r\n\r\n",
        b"HTTP/1.1 413",
    ),  # fmt: skip
    (
        "short body",
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 500\r\n\r\n{}",
        b"HTTP/1.1 408",
    ),
    ("headers never finished", b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n", b""),
    (
        "bad chunked encoding",
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n",
        b"HTTP/1.1 400",
    ),  # fmt: skip
    ("HTTP/1.0 request", b"GET /health HTTP/1.0\r\n\r\n", b"HTTP/1.1 200"),
    (
        "expect 100-continue",
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nExpect: 100-continue\r\n"
        b"Content-Length: 2\r\nConnection: close\r\n\r\n{}",
        b"HTTP/1.1 100",
    ),  # fmt: skip
    (
        "pipelined requests",
        b"GET /health HTTP/1.1\r\nHost: x\r\n\r\nGET /health HTTP/1.1\r\nHost: x\r\n"
        b"Connection: close\r\n\r\n",
        b"HTTP/1.1 200",
    ),  # fmt: skip
]


@pytest.mark.parametrize("name,data,starts", RAW, ids=[c[0] for c in RAW])
def test_hostile_http(server, name, data, starts):
    client, url = server
    got = raw(url, data)
    assert got.startswith(starts), (name, got[:200])
    assert b"HTTP/1.1 5" not in got, (name, got[:300])
    assert_healthy(client)
