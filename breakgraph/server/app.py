"""The OpenAI-compatible HTTP server: FastAPI routes over an :class:`EngineLoop`.

Routes: ``POST /v1/completions``, ``POST /v1/chat/completions`` (streaming as server-sent
events or not), ``GET /v1/models``, ``GET /health``, ``GET /health_generate`` (generates one
token), ``GET /metrics`` (Prometheus text).

One API request becomes one engine request per prompt and choice (``n``), submitted as a
group. The handler waits until the engine thread has accepted the group (or refused it: then
the error is answered as JSON before any stream starts), then streams or collects the
choices. A task watches the connection; when the client goes away the request's engine
requests are aborted and their pages freed. Errors keep OpenAI's shape, see
:mod:`breakgraph.server.protocol`.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import logging
import socket
import threading
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from functools import partial
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException as StarletteHTTPException

from breakgraph.server.engine_loop import Accepted, EngineLoop, Event, Failed, Handle, Progress
from breakgraph.server.metrics import ServerMetrics
from breakgraph.server.protocol import (
    APIError,
    GenerateRequest,
    invalid,
    parse_chat,
    parse_completion,
    parse_json_body,
)

logger = logging.getLogger(__name__)

_DISCONNECTED = object()  # queued by the connection watcher when the client goes away


@dataclass(frozen=True)
class ServerSettings:
    """``served_model_name``: the id ``/v1/models`` lists and requests may name.
    ``api_key``: when set, ``/v1/*`` needs ``Authorization: Bearer <api_key>``.
    ``max_queued_requests``: most requests accepted but not yet running (``None``: no bound).
    ``health_timeout_s``: how long ``/health_generate`` waits for its token."""

    served_model_name: str
    api_key: str | None = None
    max_queued_requests: int | None = 1024
    health_timeout_s: float = 60.0


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

    def apply(self, ev: Progress) -> str:
        """Record ``ev``; return its text delta (what may be streamed now)."""
        self.token_ids += ev.token_ids
        self.logprobs += ev.logprobs
        self.token_texts += ev.token_texts
        self.token_bytes += ev.token_bytes
        self.top_logprobs += ev.top_logprobs
        self.cached_tokens = ev.cached_tokens
        self.text += ev.text
        if ev.finish_reason is not None:
            self.finish_reason = ev.finish_reason
        return ev.text


class _Run:
    """One API request in flight: its engine handles and the asyncio queue their events
    arrive on (as ``(choice_index, event)``)."""

    def __init__(self, engine_loop: EngineLoop, spec: GenerateRequest) -> None:
        self.engine_loop = engine_loop
        self.spec = spec
        self.loop = asyncio.get_running_loop()
        self.queue: asyncio.Queue[tuple[int, Any]] = asyncio.Queue()
        self.handles: list[Handle] = []
        self.choices: list[_Choice] = []
        for p, prompt in enumerate(spec.prompts):
            for c in range(spec.n):
                index = p * spec.n + c
                self.handles.append(
                    Handle(
                        prompt, spec.choice_sampling(c), spec.max_tokens, partial(self._sink, index),
                        prompt_field=spec.prompt_field, top_logprobs=spec.logprobs,
                    )
                )  # fmt: skip
                self.choices.append(_Choice(index))
        self.disconnected = False
        self.failed: APIError | None = None
        self._closed = False

    def _sink(self, index: int, ev: Event) -> None:  # engine thread
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, (index, ev))
        except RuntimeError:  # the event loop is closed: the server is gone
            pass

    async def start(self, bounded: bool = True) -> None:
        """Submit the group and wait until the engine accepts it; raises the refusal."""
        self.engine_loop.submit(self.handles, bounded=bounded)
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
        completion = sum(len(c.token_ids) for c in self.choices)
        return {
            "prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": sum(c.cached_tokens for c in firsts)},
        }  # fmt: skip


class _EventStream(StreamingResponse):
    """A server-sent-events response that always runs ``on_close`` when it ends, whether it
    finished, failed, or the client went away (then ``send`` raises ``OSError``)."""

    def __init__(self, content: AsyncIterator[str], on_close) -> None:
        super().__init__(content, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        self._on_close = on_close

    async def __call__(self, scope, receive, send) -> None:
        try:
            await self.stream_response(send)
        except OSError:
            pass
        finally:
            await self.body_iterator.aclose()
            self._on_close()


def _sse(obj: dict[str, Any]) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


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


def create_app(engine, settings: ServerSettings) -> FastAPI:
    """The FastAPI app serving ``engine``. Its engine thread starts with the app's lifespan;
    ``app.state.engine_loop`` and ``app.state.metrics`` are exposed for tests and tools."""
    metrics = ServerMetrics()
    engine_loop = EngineLoop(engine, metrics, settings.max_queued_requests)
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
    app.state.engine_loop = engine_loop
    app.state.metrics = metrics
    app.state.settings = settings

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError) -> JSONResponse:
        if exc.status >= 400:
            metrics.rejected.labels(reason=exc.code or str(exc.status)).inc()
        return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        err = APIError(exc.status_code, f"{request.method} {request.url.path}: {exc.detail}",
                       type="invalid_request_error" if exc.status_code < 500 else "server_error")  # fmt: skip
        return JSONResponse(err.body(), status_code=exc.status_code, headers=getattr(exc, "headers", None))

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
        logger.exception("unhandled error in %s %s", request.method, request.url.path)
        err = APIError(
            500,
            f"internal server error: {type(exc).__name__}: {exc}",
            type="server_error",
            code="internal_error",
        )
        return JSONResponse(err.body(), status_code=500)

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

    def check_model(model: str | None) -> None:
        if model is not None and model != name:
            raise APIError(404, f"the model '{model}' does not exist; this server serves '{name}' (see GET /v1/models)",
                           param="model", code="model_not_found")  # fmt: skip

    def render_chat(spec: GenerateRequest) -> str:
        tok = engine.tokenizer
        if tok is None or not getattr(tok, "chat_template", None):
            raise invalid(
                "messages",
                f"the model {name} has no chat template; use /v1/completions",
                code="no_chat_template",
            )
        try:
            return tok.apply_chat_template(spec.messages, tokenize=False, add_generation_prompt=True)
        except Exception as exc:
            raise invalid("messages", f"the chat template rejected the messages: {exc}") from exc

    @app.get("/health")
    async def health() -> JSONResponse:
        if not engine_loop.alive:
            reason = f": {type(engine_loop.error).__name__}: {engine_loop.error}" if engine_loop.error else ""
            raise APIError(
                503, f"the engine loop is not running{reason}", type="server_error", code="engine_unavailable"
            )
        tp_failure = getattr(getattr(engine_loop.engine, "tp", None), "failure", None)
        if tp_failure:
            raise APIError(503, f"tensor parallelism failed: {tp_failure}", type="server_error", code="engine_unavailable")
        return JSONResponse({"status": "ok"})

    @app.get("/health_generate")
    async def health_generate() -> JSONResponse:
        spec = GenerateRequest(
            chat=False, model=None, prompts=["Hello" if engine.tokenizer is not None else [0]], prompt_field="prompt",
            n=1, max_tokens=1, sampling={"temperature": 0.0, "ignore_eos": True}, stream=False, include_usage=False,
            logprobs=None,
        )  # fmt: skip
        run = _Run(engine_loop, spec)

        async def one_token() -> None:
            await run.start(bounded=False)  # a probe is not turned away by a full queue
            async for _ in run.events():
                pass

        try:
            await asyncio.wait_for(one_token(), settings.health_timeout_s)
        except asyncio.TimeoutError as exc:
            raise APIError(
                503,
                f"no token within {settings.health_timeout_s:g}s",
                type="server_error",
                code="engine_stalled",
            ) from exc
        finally:
            run.close()
        if run.failed is not None:
            raise APIError(
                503, f"generation failed: {run.failed.message}", type="server_error", code="engine_error"
            )
        return JSONResponse({"status": "ok", "tokens": len(run.choices[0].token_ids)})

    @app.get("/metrics")
    async def prometheus() -> Response:
        return Response(metrics.render(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models(request: Request) -> JSONResponse:
        authorize(request)
        card = {"id": name, "object": "model", "created": 0, "owned_by": "breakgraph", "max_model_len": ctx}
        return JSONResponse({"object": "list", "data": [card]})

    async def generate(request: Request, chat: bool) -> Response:
        authorize(request)
        body = parse_json_body(await request.body())
        spec = parse_chat(body) if chat else parse_completion(body)
        check_model(spec.model)
        if spec.max_tokens is not None and spec.max_tokens >= ctx:
            field = (
                "max_completion_tokens"
                if chat and body.get("max_completion_tokens") is not None
                else "max_tokens"
            )
            raise invalid(
                field, f"'{field}' is {spec.max_tokens} but the context length is {ctx} (prompt included)"
            )
        if chat:
            spec.prompts = [render_chat(spec)]
        run = _Run(engine_loop, spec)
        await run.start()
        watcher = asyncio.ensure_future(_watch_disconnect(request, run))
        rid = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex[:24]}"
        head = {
            "id": rid,
            "object": "chat.completion" if chat else "text_completion",
            "created": int(time.time()),
            "model": name,
        }

        def close() -> None:
            watcher.cancel()
            run.close()

        if spec.stream:
            stream = _stream_chat(run, head) if chat else _stream_completion(run, head)
            return _EventStream(stream, on_close=close)
        try:
            async for _ in run.events():
                pass
        finally:
            close()
        if run.disconnected:
            return Response(status_code=499)  # nobody is listening
        if run.failed is not None:
            raise run.failed
        choices = []
        for c in run.choices:
            choice: dict[str, Any] = {"index": c.index, "finish_reason": c.finish_reason, "logprobs": None}
            if chat:
                choice["message"] = {"role": "assistant", "content": c.text}
                if spec.logprobs is not None:
                    choice["logprobs"] = _chat_logprobs(c, 0, len(c.token_ids), spec.logprobs)
            else:
                choice["text"] = c.text
                if spec.logprobs is not None:
                    choice["logprobs"] = _completion_logprobs(c, 0, len(c.token_ids), spec.logprobs, 0)
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
                yield _sse({**head, "choices": [choice]})
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
            yield _sse({**head, "choices": [first]})
        async for c, ev, delta in run.events():
            n_new = len(ev.token_ids)
            end = len(c.token_ids)
            choice: dict[str, Any] = {"index": c.index, "delta": {"content": delta} if delta else {}, "logprobs": None,
                                      "finish_reason": ev.finish_reason}  # fmt: skip
            if spec.logprobs is not None and n_new:
                choice["logprobs"] = _chat_logprobs(c, end - n_new, end, spec.logprobs)
            if delta or ev.finish_reason is not None or choice["logprobs"] is not None:
                yield _sse({**head, "choices": [choice]})
        async for chunk in _stream_tail(run, head):
            yield chunk

    async def _stream_tail(run: _Run, head: dict[str, Any]) -> AsyncIterator[str]:
        if run.disconnected:
            return
        if run.failed is not None:  # the stream has started: report in band, as OpenAI does
            yield _sse(
                {"error": {**run.failed.body()["error"], "code": run.failed.code or run.failed.status}}
            )
        elif run.spec.include_usage:
            yield _sse({**head, "choices": [], "usage": run.usage()})
        yield "data: [DONE]\n\n"

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await generate(request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await generate(request, chat=True)

    return app


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
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=5))
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
