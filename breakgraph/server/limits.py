"""Transport limits: how long a client may take to send a request, and how big it may be.

uvicorn arms no timer until a connection's first response and disarms its keep-alive timer on
any byte, so a client that sends headers one byte at a time holds a connection forever.
:func:`guarded_h11_protocol` closes a connection whose request headers are not complete within
``header_timeout_s`` of its opening (or of the previous response). :func:`read_body` bounds the
body: its declared and actual size (413) and the time to receive all of it (408); both answers
close the connection, since the rest of the body is never read.
"""

from __future__ import annotations

import asyncio

from starlette.requests import ClientDisconnect, Request
from uvicorn.protocols.http.h11_impl import H11Protocol

from breakgraph.server.protocol import APIError

CLOSE = {"Connection": "close"}


def guarded_h11_protocol(header_timeout_s: float) -> type[H11Protocol]:
    """uvicorn's h11 protocol with a deadline for each request's headers (pass as ``http=``)."""

    class GuardedH11Protocol(H11Protocol):
        _deadline: asyncio.TimerHandle | None = None

        def connection_made(self, transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            self._arm()

        def _arm(self) -> None:
            self._disarm()
            self._deadline = self.loop.call_later(header_timeout_s, self._expire)

        def _disarm(self) -> None:
            if self._deadline is not None:
                self._deadline.cancel()
                self._deadline = None

        def _expire(self) -> None:
            self._deadline = None
            if not self.transport.is_closing():
                self.transport.close()

        def handle_events(self) -> None:
            cycle = self.cycle
            super().handle_events()
            if self.cycle is not cycle:  # a request's headers arrived
                self._disarm()

        def on_response_complete(self) -> None:
            self._arm()  # for the next request on this connection (a pipelined one disarms it)
            super().on_response_complete()

        def connection_lost(self, exc: Exception | None) -> None:
            self._disarm()
            super().connection_lost(exc)

    return GuardedH11Protocol


async def read_body(request: Request, max_bytes: int, timeout_s: float) -> bytes:
    """The request body, at most ``max_bytes`` (else 413) received within ``timeout_s`` seconds
    (else 408)."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > max_bytes:
        raise _too_large(max_bytes)

    async def collect() -> bytes:
        chunks, size = [], 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > max_bytes:
                raise _too_large(max_bytes)
            chunks.append(chunk)
        return b"".join(chunks)

    try:
        return await asyncio.wait_for(collect(), timeout_s)
    except asyncio.TimeoutError as exc:
        raise APIError(
            408,
            f"the request body did not arrive within {timeout_s:g}s",
            code="request_timeout",
            headers=CLOSE,
        ) from exc
    except ClientDisconnect as exc:
        raise APIError(400, "the client closed the connection before the body was complete",
                       code="client_disconnected", headers=CLOSE) from exc  # fmt: skip


def _too_large(max_bytes: int) -> APIError:
    return APIError(
        413,
        f"the request body is larger than {max_bytes} bytes (serve --max-request-bytes)",
        code="request_too_large",
        headers=CLOSE,
    )
