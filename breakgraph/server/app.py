"""The OpenAI-compatible HTTP server: FastAPI routes over an :class:`EngineLoop`.

Routes: ``POST /v1/completions``, ``POST /v1/chat/completions`` (streaming as server-sent
events or not), ``GET /v1/models``, ``GET /v1/models/{id}``, ``GET /health``,
``GET /health_generate`` (generates one token), ``GET /metrics`` (Prometheus text), and
SGLang's native routes (:mod:`breakgraph.server.sglang_api`).

One API request becomes one engine request per prompt and choice (``n``), submitted as a
group. The handler waits until the engine thread has accepted the group (or refused it: then
the error is answered as JSON before any stream starts), then streams or collects the
choices. A task watches the connection; when the client goes away the request's engine
requests are aborted and their pages freed. Errors keep OpenAI's shape, see
:mod:`breakgraph.server.protocol`; what a client sees of a server error and how errors are
counted, see :mod:`breakgraph.server.errors`; size and time limits on requests, see
:mod:`breakgraph.server.limits`.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
import socket
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable, Iterator
from functools import partial
from typing import TYPE_CHECKING, Any

import jinja2
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException as StarletteHTTPException

from breakgraph.demo.default_model import model_description
from breakgraph.server.engine_loop import Accepted, EngineLoop, Event, Failed, Handle, Progress, PromptEcho
from breakgraph.server.errors import (
    DEFAULT_RETRY_AFTER_S,
    RETRY_AFTER_S,
    ErrorAccounting,
    client_error,
    reason_of,
)
from breakgraph.server.limits import guarded_h11_protocol, read_body
from breakgraph.server.metrics import ServerMetrics
from breakgraph.server.protocol import (
    APIError,
    GenerateRequest,
    check_stop_limits,
    invalid,
    parse_chat,
    parse_completion,
    parse_json_body,
)
from breakgraph.server.settings import ServerSettings
from breakgraph.server.sglang_api import add_sglang_routes
from breakgraph.server.sse import EventStream, sse

if TYPE_CHECKING:
    from breakgraph.engine.engine import Engine

logger = logging.getLogger(__name__)

_DISCONNECTED = object()  # queued by the connection watcher when the client goes away
_BACKLOG = object()  # queued when the reader has fallen too far behind


class _Choice:
    """The client-side state of one choice: what has been received."""

    def __init__(self, index: int) -> None:
        self.index = index
        self.text = ""
        self.token_ids: list[int] = []
        self.logprobs: list[float] = []
        self.token_texts: list[str] = []
        self.token_bytes: list[bytes] = []
        self.top_logprobs: list[list[tuple[str, float]]] = []
        self.finish_reason: str | None = None
        self.cached_tokens = 0
        self.prompt_tokens = 0
        self.echo: PromptEcho | None = None

    def apply(self, ev: Progress) -> str:
        """Record ``ev``; return its text delta (what may be streamed now)."""
        self.token_ids += ev.token_ids
        self.logprobs += ev.logprobs
        self.token_texts += ev.token_texts
        self.token_bytes += ev.token_bytes
        self.top_logprobs += ev.top_logprobs
        self.cached_tokens = ev.cached_tokens
        if ev.echo is not None:
            self.echo = ev.echo
        self.text += ev.text
        if ev.finish_reason is not None:
            self.finish_reason = ev.finish_reason
        return ev.text


class _Run:
    """One API request in flight: its engine handles and the asyncio queue their events
    arrive on (as ``(choice_index, event)``). The queue holds at most ``max_pending`` events
    per choice: a reader that falls further behind is cut off (:attr:`failed` with code
    ``stream_backlog``) and its requests are aborted, so their pages are freed."""

    def __init__(self, engine_loop: EngineLoop, spec: GenerateRequest, max_pending: int) -> None:
        self.engine_loop = engine_loop
        self.spec = spec
        self.loop = asyncio.get_running_loop()
        self.queue: asyncio.Queue[tuple[int, Any]] = asyncio.Queue()
        self.max_pending = max_pending * spec.n * len(spec.prompts)
        self.handles: list[Handle] = []
        self.choices: list[_Choice] = []
        for p, prompt in enumerate(spec.prompts):
            for c in range(spec.n):
                index = p * spec.n + c
                self.handles.append(
                    Handle(
                        prompt, spec.choice_sampling(c), spec.max_tokens, partial(self._sink, index),
                        prompt_field=spec.prompt_field, top_logprobs=spec.logprobs, echo=spec.echo,
                    )
                )  # fmt: skip
                self.choices.append(_Choice(index))
        self.disconnected = False
        self.failed: APIError | None = None
        self._closed = False
        self._backlogged = False
        self.request_id = "-"  # the HTTP request's, for logs and error events

    def _sink(self, index: int, ev: Event) -> None:  # engine thread
        try:
            self.loop.call_soon_threadsafe(self._put, index, ev)
        except RuntimeError:  # the event loop is closed: the server is gone
            pass

    def _put(self, index: int, ev: Event) -> None:  # event loop
        if self._backlogged:
            return
        if self.queue.qsize() >= self.max_pending and isinstance(ev, Progress):
            self._backlogged = True
            while not self.queue.empty():  # what it has not read is dropped: the error comes next
                self.queue.get_nowait()
            self.queue.put_nowait((-1, _BACKLOG))
            self.close()
            return
        self.queue.put_nowait((index, ev))

    async def start(self) -> None:
        """Submit the group and wait until the engine accepts it; raises the refusal."""
        self.engine_loop.submit(self.handles)
        for _ in self.handles:
            index, ev = await self.queue.get()
            if isinstance(ev, Failed):
                self._closed = True  # a refused group never entered the engine
                raise ev.error
            assert isinstance(ev, Accepted)
            self.choices[index].prompt_tokens = ev.prompt_tokens

    async def events(self) -> AsyncIterator[tuple[_Choice, Progress, str]]:
        """``(choice, event, text_delta)`` until every choice has finished, the client has gone
        (``disconnected``) or the engine failed (``failed``)."""
        left = len(self.handles)
        while left:
            index, ev = await self.queue.get()
            if ev is _DISCONNECTED:
                self.disconnected = True
                return
            if ev is _BACKLOG:
                self.failed = APIError(
                    503, f"the client read the stream too slowly: more than {self.max_pending} events were waiting "
                    "for it, so the request was aborted", type="server_error", code="stream_backlog",
                )  # fmt: skip
                return
            if isinstance(ev, Failed):
                self.failed = ev.error
                return
            if not isinstance(ev, Progress):
                continue
            choice = self.choices[index]
            delta = choice.apply(ev)
            if ev.finish_reason is not None:
                left -= 1
            yield choice, ev, delta

    async def wait(self, close: Callable[[], None]) -> Response | None:
        """Run a non-streaming request to its end, then ``close()`` it. Returns the response for
        a client that went away (499), raises the engine's error, else None (the caller answers
        from ``choices``)."""
        try:
            async for _ in self.events():
                pass
        finally:
            close()
        if self.disconnected:
            return Response(status_code=499)  # nobody is listening
        if self.failed is not None:
            raise self.failed
        return None

    def client_gone(self) -> None:
        self.queue.put_nowait((-1, _DISCONNECTED))

    def close(self) -> None:
        """Abort every choice that has not finished (idempotent)."""
        if self._closed:
            return
        self._closed = True
        for h, c in zip(self.handles, self.choices):
            if c.finish_reason is None:
                self.engine_loop.abort(h)

    def usage(self) -> dict[str, Any]:
        n = self.spec.n
        firsts = self.choices[::n]  # a prompt is counted once, whatever n is
        prompt = sum(c.prompt_tokens for c in firsts)
        completion = 0 if self.spec.prompt_only else sum(len(c.token_ids) for c in self.choices)
        return {
            "prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": sum(c.cached_tokens for c in firsts)},
        }  # fmt: skip


async def _watch_disconnect(request: Request, run: _Run) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            run.client_gone()
            return


def _completion_logprobs(c: _Choice, start: int, end: int, top: int, offset: int) -> dict[str, Any]:
    texts = c.token_texts[start:end]
    offsets, pos = [], offset
    for t in texts:
        offsets.append(pos)
        pos += len(t)
    tops = None
    if top > 0:
        tops = [
            dict(alts) if alts else {t: lp}
            for t, lp, alts in zip(texts, c.logprobs[start:end], c.top_logprobs[start:end])
        ]
    return {
        "tokens": texts,
        "token_logprobs": c.logprobs[start:end],
        "top_logprobs": tops,
        "text_offset": offsets,
    }


def _chat_logprobs(c: _Choice, start: int, end: int, top: int) -> dict[str, Any]:
    def entry(t: str, lp: float, raw: bytes | None = None) -> dict[str, Any]:
        return {"token": t, "logprob": lp, "bytes": list(t.encode("utf-8") if raw is None else raw)}

    content = []
    rows = zip(
        c.token_texts[start:end], c.token_bytes[start:end], c.logprobs[start:end], c.top_logprobs[start:end]
    )
    for t, raw, lp, alts in rows:
        tops = [entry(a, alp) for a, alp in alts] if alts else [entry(t, lp, raw)]
        content.append({**entry(t, lp, raw), "top_logprobs": tops[:top] if top > 0 else []})
    return {"content": content}


def _completion_choice(c: _Choice, spec: GenerateRequest) -> dict[str, Any]:
    """One ``/v1/completions`` choice; with ``echo`` the prompt (and its log-probabilities)
    comes first."""
    n_out = 0 if spec.prompt_only else len(c.token_ids)
    text = "" if spec.prompt_only else c.text
    echo = c.echo if spec.echo else None
    prefix = echo.text if echo is not None else ""
    choice: dict[str, Any] = {"index": c.index, "text": prefix + text, "finish_reason": c.finish_reason, "logprobs": None}
    if spec.logprobs is not None:
        out = _completion_logprobs(c, 0, n_out, spec.logprobs, len(prefix))
        if echo is not None:
            offsets, pos = [], 0
            for t in echo.token_texts:
                offsets.append(pos)
                pos += len(t)
            tops = None
            if out["top_logprobs"] is not None:
                tops = [None if alts is None else dict(alts) for alts in echo.top_logprobs] + out["top_logprobs"]
            out = {
                "tokens": echo.token_texts + out["tokens"], "token_logprobs": echo.logprobs + out["token_logprobs"],
                "top_logprobs": tops, "text_offset": offsets + out["text_offset"],
            }  # fmt: skip
        choice["logprobs"] = out
    return choice


def create_app(engine: Engine, settings: ServerSettings) -> FastAPI:
    """The FastAPI app serving ``engine``. Its engine thread starts with the app's lifespan;
    ``app.state.engine_loop`` and ``app.state.metrics`` are exposed for tests and tools."""
    metrics = ServerMetrics()
    engine_loop = EngineLoop(
        engine, metrics, settings.max_queued_requests,
        max_step_failures=settings.max_step_failures, stall_timeout_s=settings.stall_timeout_s,
    )  # fmt: skip
    metrics.bind(lambda: engine_loop.stats, lambda: engine_loop.num_queued)
    name = settings.served_model_name
    ctx = engine.context_length

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        engine_loop.start()
        try:
            yield
        finally:
            await asyncio.to_thread(engine_loop.stop)

    app = FastAPI(title="breakgraph", lifespan=lifespan)
    app.add_middleware(ErrorAccounting, count=metrics.count_error)
    app.state.engine_loop = engine_loop
    app.state.metrics = metrics
    app.state.settings = settings

    def request_id(request: Request) -> str:
        return request.scope.get("state", {}).get("request_id", "-")

    def answer(request: Request, exc: APIError) -> JSONResponse:
        """The JSON error answer for ``exc``; 5xx details are logged, never sent."""
        rid = request_id(request)
        metrics.count_error(reason_of(exc.status, exc.code))
        request.state.error_counted = True
        if exc.status >= 500:
            logger.warning("request %s: %d %s: %s", rid, exc.status, exc.code, exc.message)
        shown = client_error(exc, rid)
        headers = {**(shown.headers or {}), "X-Request-Id": rid}
        if shown.status == 503:
            headers.setdefault("Retry-After", str(RETRY_AFTER_S.get(shown.code or "", DEFAULT_RETRY_AFTER_S)))
        return JSONResponse(shown.body(), status_code=shown.status, headers=headers)

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError) -> JSONResponse:
        return answer(request, exc)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        err = APIError(exc.status_code, f"{request.method} {request.url.path[:200]}: {exc.detail}",
                       type="invalid_request_error" if exc.status_code < 500 else "server_error")  # fmt: skip
        return answer(request, err)

    def authorize(request: Request) -> None:
        if settings.api_key is None:
            return
        header = request.headers.get("authorization", "")
        scheme, _, token = header.partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(
            token.strip().encode(), settings.api_key.encode()
        ):
            raise APIError(
                401, "missing or wrong API key: send the header 'Authorization: Bearer <key>' with the server's --api-key",
                type="authentication_error", code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"},
            )  # fmt: skip

    async def json_body(request: Request) -> dict[str, Any]:
        raw = await read_body(request, settings.max_request_bytes, settings.request_read_timeout_s)
        return parse_json_body(raw)

    def check_model(model: str | None) -> None:
        if model is not None and model != name:
            raise APIError(404, f"the model '{model[:200]}' does not exist; this server serves '{name}' (see GET /v1/models)",
                           param="model", code="model_not_found")  # fmt: skip

    def check_spec(spec: GenerateRequest, max_tokens_field: str = "max_tokens", stop_field: str = "stop") -> None:
        check_model(spec.model)
        check_stop_limits(spec.sampling.get("stop") or [], settings.max_stop_strings, settings.max_stop_length, stop_field)
        if spec.max_tokens is not None and spec.max_tokens >= ctx:
            raise invalid(
                max_tokens_field,
                f"'{max_tokens_field}' is {spec.max_tokens} but the context length is {ctx} (prompt included)",
            )

    def render_chat(spec: GenerateRequest, rid: str) -> str:
        tok = engine.tokenizer
        if tok is None or not getattr(tok, "chat_template", None):
            raise invalid(
                "messages",
                f"the model {name} has no chat template; use /v1/completions",
                code="no_chat_template",
            )
        try:
            return tok.apply_chat_template(
                spec.messages, tokenize=False, add_generation_prompt=True, **spec.template_kwargs
            )
        except Exception as exc:
            if type(exc) is jinja2.TemplateError:  # raise_exception() in the template: written for users
                raise invalid("messages", f"the chat template rejected the messages: {str(exc)[:300]}") from exc
            logger.warning("request %s: the chat template failed: %s: %s", rid, type(exc).__name__, exc)
            raise invalid("messages", f"the chat template could not render the messages (request id {rid})") from exc

    async def open_run(request: Request, spec: GenerateRequest) -> tuple[_Run, Any]:
        """Submit ``spec``, wait until the engine accepts it; return the run and its ``close``
        (stops watching the connection, aborts what has not finished)."""
        run = _Run(engine_loop, spec, settings.max_pending_events)
        run.request_id = request_id(request)
        await run.start()
        watcher = asyncio.ensure_future(_watch_disconnect(request, run))

        def close() -> None:
            watcher.cancel()
            run.close()

        return run, close

    @app.get("/health")
    async def health() -> JSONResponse:
        why = engine_loop.health()
        if why is not None:
            raise APIError(503, _UNHEALTHY[why], type="server_error", code=f"engine_{why}")
        return JSONResponse({"status": "ok"})

    probe: asyncio.Future | None = None  # the /health_generate probe in flight, shared by concurrent callers

    async def one_probe() -> JSONResponse:
        spec = GenerateRequest(
            chat=False, model=None, prompts=["Hello" if engine.tokenizer is not None else [0]], prompt_field="prompt",
            n=1, max_tokens=1, sampling={"temperature": 0.0, "ignore_eos": True}, stream=False, include_usage=False,
            logprobs=None,
        )  # fmt: skip
        run = _Run(engine_loop, spec, settings.max_pending_events)

        async def one_token() -> None:
            await run.start()  # counts toward the queue bound like any request
            async for _ in run.events():
                pass

        try:
            await asyncio.wait_for(one_token(), settings.health_timeout_s)
        except asyncio.TimeoutError as exc:
            raise APIError(503, f"no token within {settings.health_timeout_s:g}s", type="server_error",
                           code="engine_stalled") from exc  # fmt: skip
        finally:
            run.close()
        if run.failed is not None:
            raise APIError(503, "generation failed", type="server_error", code="engine_probe_failed")
        return JSONResponse({"status": "ok", "tokens": len(run.choices[0].token_ids)})

    @app.get("/health_generate")
    async def health_generate(request: Request) -> JSONResponse:
        """Generate one token; concurrent calls share one probe, so probes take one queue slot."""
        nonlocal probe
        authorize(request)
        if probe is None or probe.done():
            probe = asyncio.ensure_future(one_probe())
        return await asyncio.shield(probe)

    @app.get("/metrics")
    async def prometheus() -> Response:
        return Response(metrics.render(), media_type=CONTENT_TYPE_LATEST)

    card = {"id": name, "object": "model", "created": 0, "owned_by": "breakgraph", "max_model_len": ctx}
    description = model_description(engine.model_path)
    if description is not None:  # the built-in default model says what it is, so nobody takes it for GLM-5
        card["description"] = description

    @app.get("/v1/models")
    async def models(request: Request) -> JSONResponse:
        authorize(request)
        return JSONResponse({"object": "list", "data": [card]})

    @app.get("/v1/models/{model_id:path}")
    async def model(request: Request, model_id: str) -> JSONResponse:
        authorize(request)
        check_model(model_id)
        return JSONResponse(card)

    async def generate(request: Request, chat: bool) -> Response:
        authorize(request)
        body = await json_body(request)
        spec = parse_chat(body) if chat else parse_completion(body)
        field = "max_completion_tokens" if chat and body.get("max_completion_tokens") is not None else "max_tokens"
        check_spec(spec, field)
        if chat:
            spec.prompts = [render_chat(spec, request_id(request))]
        run, close = await open_run(request, spec)
        rid = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex[:24]}"
        head = {
            "id": rid,
            "object": "chat.completion" if chat else "text_completion",
            "created": int(time.time()),
            "model": name,
        }
        if spec.stream:
            stream = _stream_chat(run, head) if chat else _stream_completion(run, head)
            return EventStream(stream, on_close=close)
        if (gone := await run.wait(close)) is not None:
            return gone
        choices = []
        for c in run.choices:
            if chat:
                choice: dict[str, Any] = {"index": c.index, "finish_reason": c.finish_reason, "logprobs": None,
                                          "message": {"role": "assistant", "content": c.text}}  # fmt: skip
                if spec.logprobs is not None:
                    choice["logprobs"] = _chat_logprobs(c, 0, len(c.token_ids), spec.logprobs)
            else:
                choice = _completion_choice(c, spec)
            choices.append(choice)
        return JSONResponse({**head, "choices": choices, "usage": run.usage()})

    async def _stream_completion(run: _Run, head: dict[str, Any]) -> AsyncIterator[str]:
        spec = run.spec
        async for c, ev, delta in run.events():
            n_new = len(ev.token_ids)
            end = len(c.token_ids)
            choice: dict[str, Any] = {
                "index": c.index,
                "text": delta,
                "logprobs": None,
                "finish_reason": ev.finish_reason,
            }
            if spec.logprobs is not None and n_new:
                offset = sum(len(t) for t in c.token_texts[: end - n_new])
                choice["logprobs"] = _completion_logprobs(c, end - n_new, end, spec.logprobs, offset)
            if delta or ev.finish_reason is not None or choice["logprobs"] is not None:
                yield sse({**head, "choices": [choice]})
        async for chunk in _stream_tail(run, head):
            yield chunk

    async def _stream_chat(run: _Run, head: dict[str, Any]) -> AsyncIterator[str]:
        spec = run.spec
        head = {**head, "object": "chat.completion.chunk"}
        for c in run.choices:
            first = {
                "index": c.index,
                "delta": {"role": "assistant", "content": ""},
                "logprobs": None,
                "finish_reason": None,
            }
            yield sse({**head, "choices": [first]})
        async for c, ev, delta in run.events():
            n_new = len(ev.token_ids)
            end = len(c.token_ids)
            choice: dict[str, Any] = {"index": c.index, "delta": {"content": delta} if delta else {}, "logprobs": None,
                                      "finish_reason": ev.finish_reason}  # fmt: skip
            if spec.logprobs is not None and n_new:
                choice["logprobs"] = _chat_logprobs(c, end - n_new, end, spec.logprobs)
            if delta or ev.finish_reason is not None or choice["logprobs"] is not None:
                yield sse({**head, "choices": [choice]})
        async for chunk in _stream_tail(run, head):
            yield chunk

    async def _stream_tail(run: _Run, head: dict[str, Any]) -> AsyncIterator[str]:
        if run.disconnected:
            return
        if run.failed is not None:  # the stream has started: report in band, as OpenAI does
            yield stream_error(run)
        elif run.spec.include_usage:
            yield sse({**head, "choices": [], "usage": run.usage()})
        yield "data: [DONE]\n\n"

    def stream_error(run: _Run) -> str:
        """The in-band error event of a stream that failed after it started (counted, logged)."""
        rid = run.request_id
        metrics.count_error(reason_of(run.failed.status, run.failed.code))
        logger.warning("stream %s failed: %s: %s", rid, run.failed.code, run.failed.message)
        shown = client_error(run.failed, rid)
        return sse({"error": {**shown.body()["error"], "code": shown.code or shown.status}})

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await generate(request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await generate(request, chat=True)

    add_sglang_routes(
        app, engine=engine, engine_loop=engine_loop, settings=settings, authorize=authorize, json_body=json_body,
        check_spec=check_spec, open_run=open_run, stream_error=stream_error,
    )  # fmt: skip
    return app


_UNHEALTHY = {
    "dead": "the engine loop is not running",
    "failing": "the engine's last steps all failed",
    "wedged": "the engine has made no progress while requests are waiting",
    "tp_failed": "a tensor-parallel rank failed",
}


def uvicorn_config(app: FastAPI, **kwargs: Any):
    """uvicorn's config for ``app`` with this server's transport limits (the h11 protocol with
    a header deadline, ``app.state.settings.header_timeout_s``); ``kwargs`` go to uvicorn."""
    import uvicorn

    timeout = app.state.settings.header_timeout_s
    return uvicorn.Config(app, http=guarded_h11_protocol(timeout), **kwargs)


@contextlib.contextmanager
def serve_in_thread(
    app: FastAPI, host: str = "127.0.0.1", port: int = 0, start_timeout: float = 60.0
) -> Iterator[str]:
    """Run ``app`` with uvicorn on a daemon thread (``port`` 0: an ephemeral one); yield its
    base URL; stop it on exit. For tests and embedding."""
    import uvicorn

    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn_config(app, log_level="warning", timeout_graceful_shutdown=5))
    thread = threading.Thread(
        target=server.run, kwargs={"sockets": [sock]}, name="breakgraph-http", daemon=True
    )
    thread.start()
    deadline = time.monotonic() + start_timeout
    while not server.started:
        if time.monotonic() > deadline or not thread.is_alive():
            sock.close()
            raise RuntimeError(f"the server did not start on {host}:{port}")
        time.sleep(0.01)
    try:
        yield f"http://{host}:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=30)
        sock.close()
