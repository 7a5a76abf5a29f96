"""Bad input gets a 4xx, always and fast, on a real server (uvicorn on 127.0.0.1, an ephemeral
port) driven by real clients (httpx, raw sockets): size and time limits, deep JSON, lone
surrogates, stop-string caps, refused fields, slow readers, error bodies without internals,
errors counted by reason, Retry-After, and /health and /health_generate under faults. Every
case is followed by a good request and /health."""

from __future__ import annotations

import asyncio
import contextlib
import json
import select
import socket
import threading
import time

import httpx
import pytest

pytest.importorskip("uvicorn")  # serving extras; absent on some GPU images
pytest.importorskip("fastapi")  # serving extras; absent on some GPU images

from breakgraph import Engine, SamplingParams
from breakgraph.server.app import ServerSettings, create_app, serve_in_thread
from breakgraph.server.errors import REASONS

GOOD = {"prompt": "Hello", "max_tokens": 1, "temperature": 0}
LIMITS = dict(max_request_bytes=200_000, request_read_timeout_s=0.5, header_timeout_s=0.5, max_stop_strings=4,
              max_stop_length=16)  # fmt: skip


pytestmark = pytest.mark.usefixtures("one_intra_op_thread")


@pytest.fixture(scope="module")
def engine():
    return Engine(None, device="cpu", dtype="float32", max_running_requests=4)


@pytest.fixture(scope="module")
def own_engine():
    """A second engine for tests that start a server of their own: two engine loops must never
    step one engine, and the module's shared server keeps its loop on ``engine``."""
    return Engine(None, device="cpu", dtype="float32", max_running_requests=4)


@contextlib.contextmanager
def running(engine, **settings):
    app = create_app(engine, ServerSettings("tiny", **{**LIMITS, **settings}))
    with serve_in_thread(app) as url, httpx.Client(base_url=url, timeout=60) as client:
        yield client, app


@pytest.fixture(scope="module")
def server(engine):
    with running(engine) as (client, app):
        yield client, app


@pytest.fixture()
def client(server):
    client, _ = server
    yield client
    assert client.post("/v1/completions", json=GOOD).status_code == 200, "a good request after the case"
    assert client.get("/health").status_code == 200, "healthy after the case"


def errors(app) -> dict[str, float]:
    registry = app.state.metrics.registry
    return {r: registry.get_sample_value("breakgraph_errors_total", {"reason": r}) for r in REASONS}


def wait_for(condition, timeout: float = 30.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)


def raw_exchange(url: str, data: bytes, wait_s: float = 5.0) -> tuple[bytes, float]:
    """Send ``data`` on a fresh connection and read until the server closes it; returns what
    came back and how long the server took to close."""
    host, port = url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port))) as s:
        s.settimeout(wait_s)
        start = time.monotonic()
        s.sendall(data)
        got = b""
        with contextlib.suppress(TimeoutError, ConnectionResetError):
            while chunk := s.recv(65536):
                got += chunk
        return got, time.monotonic() - start


def test_body_over_the_size_cap_is_413_by_length_and_by_stream(client, server):
    _, app = server
    before = errors(app)["payload_too_large"]
    url = str(client.base_url).rstrip("/")
    head = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
    got, took = raw_exchange(url, head + b"Content-Length: 1000000000\r\n\r\n")
    assert got.startswith(b"HTTP/1.1 413") and b"request_too_large" in got and took < 3, (
        "refused before reading"
    )
    assert b"--max-request-bytes" in got
    chunk = b"x" * 21_000  # no Content-Length: the cap holds on the bytes as they arrive
    chunked = b"".join(b"%x\r\n%s\r\n" % (len(chunk), chunk) for _ in range(10))
    got, _ = raw_exchange(url, head + b"Transfer-Encoding: chunked\r\n\r\n" + chunked)
    assert got.startswith(b"HTTP/1.1 413")
    assert errors(app)["payload_too_large"] == before + 2
    fits = client.post("/v1/completions", json={**GOOD, "user": "u" * 150_000})
    assert fits.status_code == 200, "a body under the cap is served"


def test_slow_headers_are_cut_off(client, server):
    got, took = raw_exchange(
        client.base_url.__str__().rstrip("/"), b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n"
    )
    assert got == b"" and took < 3, "the connection is closed once the header deadline passes"


def test_slowloris_headers_one_byte_at_a_time_are_cut_off(client):
    host, port = str(client.base_url).rstrip("/").removeprefix("http://").split(":")
    with socket.create_connection((host, int(port))) as s:
        start = time.monotonic()
        closed = False
        for byte in b"GET /health HTTP/1.1\r\nHost: x\r\nX-Pad: " + b"a" * 100:
            try:
                s.sendall(bytes([byte]))
            except OSError:
                closed = True
                break
            time.sleep(0.05)
            if time.monotonic() - start > 4:
                break
        if not closed:
            s.settimeout(2)
            with contextlib.suppress(ConnectionResetError):
                closed = s.recv(100) == b""
        assert closed and time.monotonic() - start < 4, (
            "a trickle of header bytes does not hold the connection"
        )


def test_short_body_under_a_large_content_length_gets_408(client, server):
    _, app = server
    before = errors(app)["request_timeout"]
    head = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: 1000\r\n\r\n"
    got, took = raw_exchange(str(client.base_url).rstrip("/"), head + b'{"prompt": "hi"')
    assert got.startswith(b"HTTP/1.1 408") and b"connection: close" in got.lower() and took < 3
    assert b"request_timeout" in got
    assert errors(app)["request_timeout"] == before + 1


def test_body_trickled_slowly_gets_408(client):
    host, port = str(client.base_url).rstrip("/").removeprefix("http://").split(":")
    body = json.dumps(GOOD).encode()
    head = f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: {len(body)}\r\n\r\n".encode()
    with socket.create_connection((host, int(port))) as s:
        s.settimeout(3)
        s.sendall(head)
        got = b""
        for byte in body:
            if select.select([s], [], [], 0.1)[0]:  # the answer has come: stop sending
                break
            s.sendall(bytes([byte]))
        with contextlib.suppress(TimeoutError, ConnectionResetError):
            while chunk := s.recv(65536):
                got += chunk
    assert got.startswith(b"HTTP/1.1 408"), got[:100]


@pytest.mark.parametrize("raw", [b"[" * 100_000, b'{"a":' * 30_000, json.dumps({"prompt": "hi", "x": [[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[1]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]}).encode()])  # fmt: skip
def test_deeply_nested_json_is_400(client, raw):
    start = time.monotonic()
    r = client.post("/v1/completions", content=raw, headers={"content-type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_json", r.text[:200]
    assert time.monotonic() - start < 5


SURROGATES = [
    ("/v1/completions", '{"prompt": "a\\ud800b"}', "prompt"),
    ("/v1/completions", '{"prompt": ["fine", "\\udfff"]}', "prompt[1]"),
    ("/v1/completions", '{"prompt": "hi", "model": "\\ud83d"}', "model"),
    ("/v1/completions", '{"prompt": "hi", "stop": ["ok", "\\ud800"]}', "stop[1]"),
    ("/v1/chat/completions", '{"messages": [{"role": "user", "content": "\\ud800"}]}', "messages[0].content"),
    ("/v1/chat/completions", '{"messages": [{"role": "\\udc00", "content": "hi"}]}', "messages[0].role"),
    ("/v1/chat/completions", '{"messages": [{"role": "user", "content": [{"type": "text", "text": "\\ud800"}]}]}',
     "messages[0].content[0].text"),
    ("/v1/completions", '{"prompt": "hi", "\\ud800": 1}', "<key>"),
]  # fmt: skip


@pytest.mark.parametrize("path,raw,field", SURROGATES)
def test_lone_surrogates_are_400_naming_the_field(client, path, raw, field):
    r = client.post(path, content=raw.encode(), headers={"content-type": "application/json"})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == field and err["code"] == "invalid_encoding" and field in err["message"]


def test_a_valid_surrogate_pair_is_an_ordinary_character(client):
    r = client.post("/v1/completions", content=b'{"prompt": "smile \\ud83d\\ude00", "max_tokens": 1}')
    assert r.status_code == 200, r.text


def test_stop_strings_are_capped_in_count_and_length(client):
    r = client.post("/v1/completions", json={**GOOD, "stop": ["a", "b", "c", "d", "e"]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "stop" and "at most 4" in r.text
    r = client.post(
        "/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}], "stop": "x" * 17}
    )
    assert r.status_code == 400 and r.json()["error"]["param"] == "stop" and "at most 16" in r.text
    assert client.post("/v1/completions", json={**GOOD, "stop": ["a", "b", "c", "x" * 16]}).status_code == 200


def test_many_long_stop_strings_are_refused_quickly_under_default_limits(own_engine):
    with running(own_engine, max_request_bytes=16 << 20, max_stop_strings=32, max_stop_length=256) as (
        client,
        _,
    ):
        body = {**GOOD, "stop": ["s" * 400] * 20_000, "stream": True}  # the 8 MB stop list
        start = time.monotonic()
        r = client.post("/v1/completions", json=body)
        assert r.status_code == 400 and time.monotonic() - start < 10
        assert client.get("/health").status_code == 200


UNSUPPORTED = [
    ("/v1/chat/completions", {"response_format": {"type": "json_object"}}, "response_format"),
    ("/v1/chat/completions", {"tools": [{"type": "function", "function": {"name": "f"}}]}, "tools"),
    ("/v1/chat/completions", {"tool_choice": "required"}, "tool_choice"),
    ("/v1/chat/completions", {"functions": [{"name": "f"}]}, "functions"),
    ("/v1/chat/completions", {"function_call": "auto"}, "function_call"),
    ("/v1/chat/completions", {"chat_template_kwargs": {"tokenize": True}}, "chat_template_kwargs.tokenize"),
    ("/v1/chat/completions", {"audio": {"voice": "x"}}, "audio"),
    ("/v1/chat/completions", {"reasoning_effort": "high"}, "reasoning_effort"),
    ("/v1/completions", {"suffix": "tail"}, "suffix"),
    ("/v1/completions", {"guided_json": {}}, "guided_json"),
    ("/v1/completions", {"messages": []}, "messages"),
    ("/v1/chat/completions", {"echo": True}, "echo"),
]  # fmt: skip


@pytest.mark.parametrize("path,extra,field", UNSUPPORTED)
def test_unsupported_fields_are_refused_naming_the_field(client, path, extra, field):
    base = (
        {"messages": [{"role": "user", "content": "hi"}]}
        if path.endswith("chat/completions")
        else {"prompt": "hi"}
    )
    r = client.post(path, json={**base, "max_tokens": 1, **extra})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == field and err["code"] in ("unsupported_parameter", "invalid_value"), err


def test_neutral_values_of_unsupported_fields_are_accepted(client):
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1, "response_format": {"type": "text"},
            "tool_choice": "none", "tools": [], "chat_template_kwargs": {"enable_thinking": False}, "user": "u1"}  # fmt: skip
    r = client.post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text


def test_server_errors_carry_a_request_id_and_no_exception_text(own_engine, monkeypatch):
    real = own_engine.step

    def broken():
        raise RuntimeError("secret internal detail /opt/weights")

    with running(own_engine) as (client, app):
        monkeypatch.setattr(own_engine, "step", broken)
        r = client.post("/v1/completions", json=GOOD)
        monkeypatch.setattr(own_engine, "step", real)
        assert r.status_code == 500
        assert "secret" not in r.text and "RuntimeError" not in r.text and "Traceback" not in r.text
        rid = r.headers["x-request-id"]
        assert r.json()["error"]["message"].endswith(f"(request id {rid})")
        assert errors(app)["engine_error"] == 1
        assert client.post("/v1/completions", json=GOOD).status_code == 200


def test_an_unexpected_exception_is_a_500_with_a_request_id_counted(own_engine, monkeypatch):
    with running(own_engine) as (client, app):

        def bug() -> None:
            raise KeyError("internal table name")

        monkeypatch.setattr(app.state.engine_loop, "health", bug)
        r = client.get("/health")
        assert r.status_code == 500 and "internal table" not in r.text and "KeyError" not in r.text
        assert r.json()["error"]["message"].endswith(f"(request id {r.headers['x-request-id']})")
        assert errors(app)["internal_error"] == 1
        monkeypatch.undo()
        assert client.post("/v1/completions", json=GOOD).status_code == 200
        assert client.get("/health").status_code == 200


def test_every_error_is_counted_under_a_closed_set_of_reasons(own_engine):
    with running(own_engine, api_key="k") as (client, app):
        auth = {"Authorization": "Bearer k"}
        client.post("/v1/completions", json=GOOD)  # 401
        client.get("/nope", headers=auth)  # 404
        client.get("/v1/completions", headers=auth)  # 405
        client.post("/v1/completions", json={"prompt": "hi", "max_tokens": "x"}, headers=auth)  # 400
        client.post("/v1/completions", content=b"{", headers=auth)  # 400 malformed
        client.post(
            "/v1/completions", json={"prompt": "hi", "logit_bias_x": 1}, headers=auth
        )  # 400 unsupported
        client.post("/v1/completions", json={"prompt": "7 " * 1100}, headers=auth)  # context
        counted = errors(app)
        assert set(counted) == set(REASONS)
        for reason in ("unauthorized", "not_found", "method_not_allowed", "invalid_request", "malformed_body",
                       "unsupported_parameter", "context_length_exceeded"):  # fmt: skip
            assert counted[reason] == 1, (reason, counted)
        text = client.get("/metrics").text
        labels = {
            line.split('"')[1] for line in text.splitlines() if line.startswith("breakgraph_errors_total{")
        }
        assert labels == set(REASONS), "the label values are the closed set, present from the start"


def test_every_503_carries_retry_after(own_engine, monkeypatch):
    gate = threading.Event()
    real = own_engine.step

    def held():
        gate.wait(30)
        return real()

    monkeypatch.setattr(own_engine, "step", held)
    with running(own_engine, max_queued_requests=1, stall_timeout_s=0.3) as (client, _):
        results = {}
        waiter = threading.Thread(
            target=lambda: results.setdefault("a", client.post("/v1/completions", json=GOOD))
        )
        waiter.start()
        try:
            wait_for(
                lambda: client.get("/health").status_code == 503, what="the held step to count as wedged"
            )
            wedged = client.get("/health")
            assert (
                wedged.json()["error"]["code"] == "engine_wedged" and int(wedged.headers["retry-after"]) > 0
            )
            full = client.post("/v1/completions", json=GOOD)  # A holds the one slot until its step returns
        finally:
            gate.set()
            waiter.join(30)
    assert full.json()["error"]["code"] == "queue_full" and full.headers["retry-after"] == "1"
    assert results["a"].status_code == 200


def test_health_is_503_after_consecutive_failed_steps_until_a_step_succeeds(own_engine, monkeypatch):
    real = own_engine.step
    failing = {"on": True}

    def flaky():
        if failing["on"]:
            raise RuntimeError("boom")
        return real()

    monkeypatch.setattr(own_engine, "step", flaky)
    with running(own_engine, max_step_failures=2) as (client, _):
        assert client.post("/v1/completions", json=GOOD).status_code == 500
        assert client.get("/health").status_code == 200, "one failure is not yet unhealthy"
        assert client.post("/v1/completions", json=GOOD).status_code == 500
        health = client.get("/health")
        assert health.status_code == 503 and health.json()["error"]["code"] == "engine_failing"
        assert health.headers["retry-after"] and "boom" not in health.text
        failing["on"] = False
        assert client.post("/v1/completions", json=GOOD).status_code == 200
        assert client.get("/health").status_code == 200, "a step that succeeds makes it healthy again"


def test_health_is_503_while_a_step_hangs_and_recovers(own_engine, monkeypatch):
    gate = threading.Event()
    real = own_engine.step

    def hung():
        gate.wait(30)
        return real()

    monkeypatch.setattr(own_engine, "step", hung)
    with running(own_engine, stall_timeout_s=0.3) as (client, _):
        assert client.get("/health").status_code == 200, "idle is not wedged"
        results = {}
        t = threading.Thread(
            target=lambda: results.setdefault("r", client.post("/v1/completions", json=GOOD))
        )
        t.start()
        wait_for(lambda: client.get("/health").status_code == 503, what="/health to report the hang")
        assert client.get("/health").json()["error"]["code"] == "engine_wedged"
        gate.set()
        t.join(30)
        assert results["r"].status_code == 200
        assert client.get("/health").status_code == 200


def test_health_generate_needs_the_api_key_and_respects_the_queue(own_engine, monkeypatch):
    with running(own_engine, api_key="k", max_queued_requests=1) as (client, app):
        assert client.get("/health_generate").status_code == 401
        auth = {"Authorization": "Bearer k"}
        assert client.get("/health_generate", headers=auth).json() == {"status": "ok", "tokens": 1}
        assert client.get("/health").status_code == 200, "/health stays open for probes"

        calls = []
        real_submit = app.state.engine_loop.submit

        def counting_submit(handles):
            calls.append(len(handles))
            time.sleep(0.2)  # keep the probe in flight while the others arrive
            return real_submit(handles)

        monkeypatch.setattr(app.state.engine_loop, "submit", counting_submit)

        async def many() -> list[int]:
            async with httpx.AsyncClient(base_url=str(client.base_url), timeout=60, headers=auth) as c:
                return [
                    r.status_code
                    for r in await asyncio.gather(*(c.get("/health_generate") for _ in range(8)))
                ]

        assert asyncio.run(many()) == [200] * 8
        assert calls == [1], "eight concurrent probes share one generation, which takes one queue slot"


@contextlib.contextmanager
def small_send_buffer_server(app):
    """``app`` on uvicorn whose connections have a 4 KiB kernel send buffer (inherited from the
    listening socket), so that a client that does not read blocks the server's writes soon."""
    import uvicorn

    from breakgraph.server.app import uvicorn_config

    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn_config(app, log_level="warning"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    wait_for(lambda: server.started, what="the server to start")
    try:
        yield sock.getsockname()
    finally:
        server.should_exit = True
        thread.join(30)
        sock.close()


def test_a_reader_that_falls_behind_is_cut_off_and_its_pages_freed(own_engine):
    app = create_app(own_engine, ServerSettings("tiny", max_pending_events=2))
    with small_send_buffer_server(app) as (host, port):
        body = json.dumps({"prompt": "Once upon a time", "max_tokens": 480, "temperature": 0, "ignore_eos": True,
                           "stream": True, "logprobs": 20}).encode()  # fmt: skip
        registry = app.state.metrics.registry

        def finished(reason: str) -> float:
            return registry.get_sample_value("breakgraph_requests_total", {"finish_reason": reason}) or 0

        s = socket.socket()
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # a reader that does not read
        s.connect((host, port))
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  + f"Content-Length: {len(body)}\r\n\r\n".encode() + body)  # fmt: skip
        wait_for(lambda: finished("abort") + finished("length") > 0, what="the request to end")
        assert finished("abort") == 1, "aborted, not run to its length"
        wait_for(
            lambda: own_engine.kv_cache.pool.num_used == 0 and not own_engine.has_unfinished(),
            what="pages back",
        )
        s.settimeout(10)
        got = b""
        with contextlib.suppress(TimeoutError):
            while b"data: [DONE]" not in got and (chunk := s.recv(65536)):
                got += chunk
        s.close()
        events = [line for line in got.split(b"\n") if line.startswith(b"data: ")]
        assert b"stream_backlog" in events[-2] and events[-1] == b"data: [DONE]"
        assert len(events) < 480, "the stream was cut off, not run to the end"
        assert registry.get_sample_value("breakgraph_errors_total", {"reason": "stream_backlog"}) == 1
        with httpx.Client(base_url=f"http://{host}:{port}", timeout=60) as client:
            assert client.post("/v1/completions", json=GOOD).status_code == 200
            assert client.get("/health").status_code == 200


def test_engine_events_carry_text_deltas_not_the_whole_text(own_engine):
    from breakgraph.server.engine_loop import Accepted, EngineLoop, Handle, Progress

    loop = EngineLoop(own_engine).start()
    events, done = [], threading.Event()

    def sink(ev) -> None:
        events.append(ev)
        if isinstance(ev, Progress) and ev.finish_reason is not None:
            done.set()

    try:
        loop.submit([Handle("Once upon a time", {"temperature": 0.0, "ignore_eos": True}, 40, sink)])
        assert done.wait(60)
    finally:
        loop.stop()
    assert isinstance(events[0], Accepted)
    progress = [ev for ev in events if isinstance(ev, Progress)]
    text = "".join(ev.text for ev in progress)
    assert text == own_engine.generate("Once upon a time", SamplingParams(max_new_tokens=40, ignore_eos=True))[0].text
    assert max(len(ev.text) for ev in progress) < len(text), "no event carries the whole text"
