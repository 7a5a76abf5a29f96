"""The server under pressure: API keys, the bounded waiting queue, clients that disconnect
mid-stream, and an engine step that raises. One request runs at a time here, so a long
stream keeps the others waiting."""

from __future__ import annotations

import contextlib
import threading
import time

import httpx
import pytest

pytest.importorskip("uvicorn")  # serving extras; absent on some GPU images
pytest.importorskip("fastapi")  # serving extras; absent on some GPU images

from breakgraph import Engine
from breakgraph.server.app import ServerSettings, create_app, serve_in_thread

pytestmark = pytest.mark.usefixtures("one_intra_op_thread")


@pytest.fixture(scope="module")
def engine():
    return Engine(None, device="cpu", dtype="float32", max_running_requests=1)


@contextlib.contextmanager
def running(engine, **settings):
    app = create_app(engine, ServerSettings("tiny", **settings))
    with serve_in_thread(app) as url, httpx.Client(base_url=url, timeout=60) as client:
        yield client, app


def wait_for(condition, timeout: float = 30.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)


LONG = {"prompt": "Once upon a time", "max_tokens": 500, "temperature": 0, "ignore_eos": True, "stream": True}
SHORT = {"prompt": "Hello", "max_tokens": 2, "temperature": 0}


def pages_released(engine) -> bool:
    return not engine.has_unfinished() and engine.kv_cache.pool.num_used == 0


def test_api_key_is_required_on_v1_routes(engine):
    with running(engine, api_key="sesame") as (client, _):
        assert client.post("/v1/completions", json=SHORT).status_code == 401
        wrong = client.post("/v1/completions", json=SHORT, headers={"Authorization": "Bearer nope"})
        assert wrong.status_code == 401 and wrong.json()["error"]["code"] == "invalid_api_key"
        assert client.get("/v1/models").status_code == 401
        ok = client.post("/v1/completions", json=SHORT, headers={"Authorization": "Bearer sesame"})
        assert ok.status_code == 200, ok.text
        assert client.get("/health").status_code == 200, "health stays open for probes"


def test_disconnect_mid_stream_aborts_and_frees_pages(engine):
    with running(engine) as (client, app):
        with client.stream("POST", "/v1/completions", json=LONG) as r:
            seen = 0
            for line in r.iter_lines():
                seen += line.startswith("data: ")
                if seen == 3:
                    break
            assert engine.has_unfinished()
        wait_for(lambda: pages_released(engine), what="the aborted request's pages")
        assert engine.kv_cache.pool.num_used == 0
        registry = app.state.metrics.registry
        assert registry.get_sample_value("breakgraph_requests_total", {"finish_reason": "abort"}) >= 1
        assert client.post("/v1/completions", json=SHORT).status_code == 200


def test_full_waiting_queue_answers_503_and_loses_nothing(engine, monkeypatch):
    real_step = engine.step

    def slow_step():  # keep A running long enough for B to queue and C to be refused, on any machine
        time.sleep(0.02)
        return real_step()

    monkeypatch.setattr(engine, "step", slow_step)
    with running(engine, max_queued_requests=1) as (client, app):
        loop = app.state.engine_loop
        results = {}

        def queued_request():
            results["b"] = client.post("/v1/completions", json=SHORT)

        with client.stream("POST", "/v1/completions", json=LONG) as long_stream:
            lines = long_stream.iter_lines()
            assert next(line for line in lines if line.startswith("data: "))  # A runs: the only slot is taken
            waiter = threading.Thread(target=queued_request)
            waiter.start()
            wait_for(lambda: loop.num_queued == 1, what="B to wait in the queue")
            over = client.post("/v1/completions", json=SHORT)
            assert over.status_code == 503
            err = over.json()["error"]
            assert err["code"] == "queue_full" and "--max-queued-requests" in err["message"]
        # A's client left: A is aborted, B runs and completes
        waiter.join(60)
        assert results["b"].status_code == 200 and results["b"].json()["choices"][0]["finish_reason"]
        wait_for(lambda: pages_released(engine), what="all pages back")


def test_an_admitted_request_leaves_the_queue_count_before_its_first_token(engine, monkeypatch):
    """Once a client has seen a token, its request no longer holds a place in the waiting queue:
    otherwise a request sent right then is refused as if the queue were full (seen under load)."""
    with running(engine, max_queued_requests=1) as (client, app):
        loop = app.state.engine_loop
        queued_at_emit = []
        real_emit = loop._emit

        def emit(h):
            queued_at_emit.append(loop.num_queued)
            return real_emit(h)

        monkeypatch.setattr(loop, "_emit", emit)
        with client.stream("POST", "/v1/completions", json=LONG) as long_stream:
            assert next(line for line in long_stream.iter_lines() if line.startswith("data: "))
            assert queued_at_emit and queued_at_emit[0] == 0, queued_at_emit[:3]
            ok = client.post("/v1/completions", json=SHORT)  # waits in the queue's one place
            assert ok.status_code == 200, ok.text
        wait_for(lambda: pages_released(engine), what="all pages back")


def test_engine_failure_fails_in_flight_requests_with_500_and_keeps_serving(engine, monkeypatch):
    boom = threading.Event()
    real_step = engine.step

    def flaky_step():
        if boom.is_set():
            boom.clear()
            raise RuntimeError("injected failure")
        return real_step()

    monkeypatch.setattr(engine, "step", flaky_step)
    with running(engine) as (client, _app):
        boom.set()
        r = client.post("/v1/completions", json=SHORT)
        assert r.status_code == 500
        err = r.json()["error"]
        assert err["type"] == "server_error" and err["code"] == "engine_error"
        assert "injected" not in r.text and "RuntimeError" not in r.text, "no exception text reaches the client"
        assert r.headers["x-request-id"] in err["message"], "the error names the request id the log has"
        assert pages_released(engine)

        boom.set()
        with client.stream("POST", "/v1/completions", json={**SHORT, "stream": True}) as s:
            events = [line for line in s.iter_lines() if line.startswith("data: ")]
        assert '"engine_error"' in events[-2] and "injected" not in events[-2] and events[-1] == "data: [DONE]"

        assert client.get("/health").status_code == 200
        assert client.post("/v1/completions", json=SHORT).status_code == 200
        assert client.get("/health_generate").status_code == 200


def test_client_that_gives_up_on_a_non_streaming_request_aborts_it(engine):
    with running(engine) as (client, app):
        body = {**LONG, "stream": False}
        with pytest.raises(httpx.ReadTimeout):
            client.post("/v1/completions", json=body, timeout=httpx.Timeout(60, read=0.5))
        wait_for(lambda: pages_released(engine), what="the abandoned request's pages")
        registry = app.state.metrics.registry
        assert registry.get_sample_value("breakgraph_requests_total", {"finish_reason": "abort"}) >= 1


def test_dead_engine_loop_reports_unhealthy_and_refuses_work(engine, monkeypatch):
    with running(engine) as (client, app):
        loop = app.state.engine_loop

        def broken(force: bool = False) -> None:
            raise RuntimeError("loop bug")

        monkeypatch.setattr(loop, "_refresh_stats", broken)
        wait_for(lambda: not loop.alive, what="the loop to die")
        health = client.get("/health")
        assert health.status_code == 503 and health.json()["error"]["code"] == "engine_dead"
        assert "loop bug" not in health.text and health.headers["retry-after"]
        r = client.post("/v1/completions", json=SHORT)
        assert r.status_code == 503 and r.json()["error"]["code"] == "engine_unavailable"
        assert client.get("/metrics").status_code == 200
