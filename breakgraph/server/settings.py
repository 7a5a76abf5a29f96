"""The HTTP server's settings (``breakgraph serve`` flags); importable without the serving
extras, so the command line can state their defaults."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ServerSettings:
    """``served_model_name``: the id ``/v1/models`` lists and requests may name.
    ``api_key``: when set, every route but ``/health`` and ``/metrics`` needs
    ``Authorization: Bearer <api_key>``.
    ``max_queued_requests``: most requests accepted but not yet running (``None``: no bound).
    ``health_timeout_s``: how long ``/health_generate`` waits for its token.
    ``max_request_bytes``: largest request body (413 beyond). ``request_read_timeout_s``: most
    time to receive a body (408 beyond); ``header_timeout_s``: to receive a request's headers
    (the connection is closed beyond).
    ``max_stop_strings``/``max_stop_length``: most stop strings per request, longest one.
    ``max_pending_events``: most undelivered events per choice before a slow reader is cut off.
    ``max_step_failures``: consecutive failed engine steps that make ``/health`` answer 503 (0:
    never); ``stall_timeout_s``: how long the engine may stay in one step while requests wait
    before ``/health`` calls it wedged."""

    served_model_name: str
    api_key: str | None = None
    max_queued_requests: int | None = 1024
    health_timeout_s: float = 60.0
    max_request_bytes: int = 8 << 20
    request_read_timeout_s: float = 30.0
    header_timeout_s: float = 10.0
    max_stop_strings: int = 32
    max_stop_length: int = 256
    max_pending_events: int = 1024
    max_step_failures: int = 3
    stall_timeout_s: float = 60.0
