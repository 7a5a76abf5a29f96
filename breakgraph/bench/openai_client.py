"""Small helpers shared by the client tools that talk to an OpenAI-compatible server.

Both ``breakgraph eval gsm8k`` and ``breakgraph bench serve`` speak plain HTTP to
``{base_url}/v1/...``; they work against breakgraph's own server and against SGLang or vLLM.
Everything here is transport glue: URL normalisation, headers, readable errors, model discovery
and a server-sent-events line parser. No engine code is imported.
"""

from __future__ import annotations

import argparse
import json
import re
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import httpx  # imported where used: httpx comes with the bench, eval and serve extras

DEFAULT_BASE_URL = "http://127.0.0.1:30000"
_SSE_LINE_END = re.compile(r"\r\n|\n|\r")


class EndpointError(RuntimeError):
    """The server could not be reached or answered with an error; the message says which URL and,
    for an HTTP error, the status and the start of the body."""


def normalize_base_url(base_url: str) -> str:
    """Return ``base_url`` without a trailing slash or a trailing ``/v1``.

    Users paste both ``http://host:port`` and ``http://host:port/v1``; the tools always append
    ``/v1/...`` themselves. Raises ``ValueError`` when the URL has no ``http://`` or ``https://``
    scheme, because httpx's own message for that case does not name the flag.
    """
    url = base_url.strip().rstrip("/")
    url = url.removesuffix("/v1")
    if not url.startswith(("http://", "https://")):
        raise ValueError(f"--base-url must start with http:// or https://, got {base_url!r}")
    return url


def auth_headers(api_key: str | None) -> dict[str, str]:
    """Headers for a request: a bearer token when ``api_key`` is set, nothing otherwise."""
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


def http_error_message(url: str, status: int, body: str, limit: int = 2000) -> str:
    """One readable line for a non-2xx answer: URL, status and the body cut to ``limit`` chars."""
    body = body.strip()
    if len(body) > limit:
        body = body[:limit] + f"... ({len(body) - limit} more characters)"
    return f"{url} returned HTTP {status}: {body or '<empty body>'}"


def transport_error_message(url: str, exc: BaseException) -> str:
    """One readable line for a failure below HTTP (refused connection, DNS, timeout)."""
    import httpx

    if isinstance(exc, httpx.ConnectError):
        return f"cannot connect to {url} ({exc}); is the server running and is --base-url right?"
    if isinstance(exc, httpx.TimeoutException):
        return f"request to {url} timed out ({type(exc).__name__}); raise --timeout if the server is slow"
    return f"request to {url} failed: {type(exc).__name__}: {exc}"


async def fetch_model_id(client: httpx.AsyncClient, base_url: str) -> str:
    """Return the first model id listed by ``GET {base_url}/v1/models``.

    Raises ``EndpointError`` naming the URL when the server is unreachable, answers with an
    error status, or lists no models (then pass ``--model`` explicitly).
    """
    import httpx

    url = f"{base_url}/v1/models"
    try:
        resp = await client.get(url)
    except httpx.HTTPError as exc:
        raise EndpointError(transport_error_message(url, exc)) from exc
    if resp.status_code != 200:
        raise EndpointError(http_error_message(url, resp.status_code, resp.text))
    try:
        data = resp.json()["data"]
        return str(data[0]["id"])
    except (ValueError, KeyError, IndexError, TypeError) as exc:
        raise EndpointError(
            f"{url} did not list any model ({resp.text[:200]!r}); pass --model explicitly"
        ) from exc


async def sse_lines(resp: httpx.Response) -> AsyncIterator[str]:
    """The lines of a server-sent-events body as the SSE format defines them: ended by CRLF,
    LF or CR only. (``httpx``'s ``aiter_lines`` also splits at U+2028, U+0085 and the other
    ``str.splitlines`` breaks, which may stand raw inside a JSON string.)"""
    pending = ""
    async for text in resp.aiter_text():
        pending += text
        held_cr = pending.endswith("\r")  # a CRLF cut between two chunks ends one line, not two
        *lines, pending = _SSE_LINE_END.split(pending[:-1] if held_cr else pending)
        if held_cr:
            pending += "\r"
        for line in lines:
            yield line
    if pending:
        yield pending.removesuffix("\r")


def parse_sse_line(line: str) -> dict[str, Any] | None:
    """Decode one line of an OpenAI streaming answer.

    Returns the JSON object of a ``data: {...}`` line, and ``None`` for blank lines, comments,
    other SSE fields and the final ``data: [DONE]``. Raises ``ValueError`` when a data line is not
    valid JSON and ``TypeError`` when it is JSON but not an object (the caller records either as
    a failed request).
    """
    line = line.strip()
    if not line.startswith("data:"):
        return None
    payload = line[len("data:") :].strip()
    if not payload or payload == "[DONE]":
        return None
    obj = json.loads(payload)
    if not isinstance(obj, dict):
        raise TypeError(f"stream chunk is not a JSON object: {payload[:200]!r}")
    return obj


def add_endpoint_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags every client of an OpenAI-compatible endpoint takes: ``--base-url``, ``--model``,
    ``--api-key``, ``--timeout`` and ``--no-progress``."""
    parser.add_argument(
        "--base-url",
        default=DEFAULT_BASE_URL,
        help="root URL of the OpenAI-compatible server; /v1/completions is appended (default: %(default)s)",
    )
    parser.add_argument(
        "--model", default=None, help="model id to send; default: the first id listed by GET /v1/models"
    )
    parser.add_argument(
        "--api-key", default=None, help="bearer token sent as 'Authorization: Bearer ...' (default: none)"
    )
    parser.add_argument(
        "--timeout",
        type=float,
        default=600.0,
        help="seconds allowed to connect, or to wait for a response or the next streamed chunk (default: %(default)s)",
    )
    parser.add_argument("--no-progress", action="store_true", help="do not show the progress bar")
