"""What a client sees of an error, and how errors are counted.

Every HTTP request gets a request id (``X-Request-Id`` on the response). A 5xx body carries a
fixed message and that id; what went wrong is logged server-side under the same id, never
sent. Every 4xx/5xx answer is counted in ``breakgraph_errors_total{reason}``, whose label
values are the closed set :data:`REASONS`; every 503 carries ``Retry-After``.
"""

from __future__ import annotations

import json
import logging
import uuid
from collections.abc import Callable

from breakgraph.server.protocol import APIError

logger = logging.getLogger(__name__)

# The label values of breakgraph_errors_total: how a request failed.
REASONS = (
    "invalid_request",  # 400: a field is missing, of the wrong type or out of range
    "malformed_body",  # 400: not UTF-8, not JSON, too deep, lone surrogates
    "unsupported_parameter",  # 400: a field this server does not implement
    "context_length_exceeded",  # 400: prompt (+ max_tokens) does not fit
    "unauthorized",  # 401
    "not_found",  # 404: no such route or model
    "method_not_allowed",  # 405
    "request_timeout",  # 408: the body did not arrive in time
    "payload_too_large",  # 413
    "queue_full",  # 503: the waiting queue is full
    "engine_unavailable",  # 503: the engine is dead, failing, wedged or shutting down
    "stream_backlog",  # a streaming reader fell too far behind and was cut off
    "engine_error",  # 500: an engine step failed while serving the request
    "internal_error",  # 500: anything else
    "other",  # any other 4xx/5xx status
)

_BY_CODE = {
    "invalid_json": "malformed_body", "invalid_encoding": "malformed_body", "client_disconnected": "malformed_body",
    "unsupported_parameter": "unsupported_parameter", "context_length_exceeded": "context_length_exceeded",
    "queue_full": "queue_full", "stream_backlog": "stream_backlog", "engine_error": "engine_error",
}  # fmt: skip
_BY_STATUS = {
    400: "invalid_request", 401: "unauthorized", 404: "not_found", 405: "method_not_allowed", 408: "request_timeout",
    413: "payload_too_large", 422: "invalid_request", 500: "internal_error", 503: "engine_unavailable",
}  # fmt: skip

RETRY_AFTER_S = {"queue_full": 1}  # seconds, by error code; other 503s say DEFAULT_RETRY_AFTER_S
DEFAULT_RETRY_AFTER_S = 5


def reason_of(status: int, code: str | None) -> str:
    """The :data:`REASONS` value of an error answered as ``status`` with ``code``."""
    return _BY_CODE.get(code or "") or _BY_STATUS.get(status, "other")


def new_request_id() -> str:
    return uuid.uuid4().hex[:16]


# 5xx codes whose message the server composes from fixed text and its own settings only
PUBLIC_MESSAGE_CODES = frozenset({
    "queue_full", "stream_backlog", "shutting_down", "engine_unavailable", "engine_dead", "engine_failing",
    "engine_wedged", "engine_tp_failed", "engine_stalled", "engine_probe_failed",
})  # fmt: skip


def client_error(exc: APIError, request_id: str) -> APIError:
    """``exc`` as the client may see it: a 5xx names ``request_id`` and, unless its code is in
    :data:`PUBLIC_MESSAGE_CODES`, says only a fixed message."""
    if exc.status < 500:
        return exc
    if exc.code in PUBLIC_MESSAGE_CODES:
        message = exc.message
    elif exc.code == "engine_error":
        message = "the engine failed while serving this request"
    else:
        message = "the server could not serve this request"
    return APIError(exc.status, f"{message} (request id {request_id})", type=exc.type, code=exc.code,
                    headers=exc.headers)  # fmt: skip


class ErrorAccounting:
    """ASGI middleware: assigns the request id (``scope["state"]["request_id"]``), adds
    ``X-Request-Id`` to every response and ``Retry-After`` to every 503 that lack them, and
    counts with ``count(reason)`` every 4xx/5xx that its handler has not counted (the handler
    sets ``scope["state"]["error_counted"]``; the reason then follows from the status). An
    exception no handler took becomes a 500 with a fixed message (logged with the request id);
    answered here, inside Starlette's outermost error middleware, the connection stays usable."""

    def __init__(self, app, count: Callable[[str], None]) -> None:
        self.app = app
        self.count = count

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        state = scope.setdefault("state", {})
        request_id = state["request_id"] = new_request_id()

        async def send_counted(message) -> None:
            if message["type"] == "http.response.start":
                status = message["status"]
                headers = list(message.get("headers", []))
                names = {k.lower() for k, _ in headers}
                if b"x-request-id" not in names:
                    headers.append((b"x-request-id", request_id.encode()))
                if status >= 400 and not state.get("error_counted"):
                    self.count(reason_of(status, None))
                if status == 503 and b"retry-after" not in names:
                    headers.append((b"retry-after", str(DEFAULT_RETRY_AFTER_S).encode()))
                message = {**message, "headers": headers}
            await send(message)

        started = False

        async def send_tracked(message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send_counted(message)

        try:
            await self.app(scope, receive, send_tracked)
        except Exception:
            logger.exception(
                "request %s: unhandled error in %s %s", request_id, scope.get("method"), scope.get("path")
            )
            if started:
                raise  # a stream broke mid-way: the server closes the connection
            err = client_error(
                APIError(500, "unhandled", type="server_error", code="internal_error"), request_id
            )
            body = json.dumps(err.body()).encode()
            headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
            await send_counted({"type": "http.response.start", "status": 500, "headers": headers})
            await send({"type": "http.response.body", "body": body})
