"""A tiny OpenAI-compatible server for client tests, run by uvicorn in a thread on 127.0.0.1.

``serve(app)`` binds an ephemeral loopback port and yields the base URL; leaving the ``with``
block stops the server. ``make_app`` answers ``GET /v1/models`` and ``POST /v1/completions``:

- non-streaming requests get ``answer(body) -> str`` as ``choices[0].text`` plus usage;
- streaming requests get ``stream_chunks`` text chunks, the first after ``first_delay`` seconds
  and the rest ``chunk_delay`` apart, then a usage chunk (when asked for) and ``[DONE]``;
- when ``fail_every`` is set, every ``fail_every``-th request (1-based) gets HTTP 500.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

MODEL_ID = "stub-model"


def make_app(
    answer: Callable[[dict[str, Any]], str] | None = None,
    stream_chunks: int = 8,
    first_delay: float = 0.05,
    chunk_delay: float = 0.02,
    fail_every: int | None = None,
) -> FastAPI:
    app = FastAPI()
    state = {"requests": 0}
    app.state.bodies = []  # every completion request body, in arrival order

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [{"id": MODEL_ID, "object": "model"}]}

    @app.post("/v1/completions")
    async def completions(request: Request) -> Any:
        body = await request.json()
        app.state.bodies.append(body)
        state["requests"] += 1
        if fail_every and state["requests"] % fail_every == 0:
            return JSONResponse({"error": {"message": "stub failure", "code": 500}}, status_code=500)
        prompt_tokens = len(str(body.get("prompt", "")).split())
        if not body.get("stream"):
            text = answer(body) if answer else "ok"
            usage = {
                "prompt_tokens": prompt_tokens,
                "completion_tokens": len(text.split()),
                "total_tokens": prompt_tokens + len(text.split()),
            }
            return {
                "id": "cmpl-stub",
                "object": "text_completion",
                "model": body.get("model"),
                "choices": [{"index": 0, "text": text, "finish_reason": "stop"}],
                "usage": usage,
            }

        include_usage = bool((body.get("stream_options") or {}).get("include_usage"))

        async def events():
            for k in range(stream_chunks):
                await asyncio.sleep(first_delay if k == 0 else chunk_delay)
                chunk = {"object": "text_completion", "choices": [{"index": 0, "text": f" t{k}"}]}
                yield f"data: {json.dumps(chunk)}\n\n"
            if include_usage:
                usage = {
                    "prompt_tokens": prompt_tokens,
                    "completion_tokens": stream_chunks,
                    "total_tokens": prompt_tokens + stream_chunks,
                }
                yield f"data: {json.dumps({'choices': [], 'usage': usage})}\n\n"
            yield "data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")

    return app


@contextlib.contextmanager
def serve(app: FastAPI, start_timeout: float = 10.0) -> Iterator[str]:
    """Run ``app`` on 127.0.0.1 at an ephemeral port in a daemon thread; yield its base URL."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="off"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + start_timeout
    while not server.started:
        if time.monotonic() > deadline or not thread.is_alive():
            raise RuntimeError("stub OpenAI server did not start")
        time.sleep(0.01)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=10)
        sock.close()
