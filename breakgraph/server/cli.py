"""``breakgraph serve``: build the engine and serve it over HTTP (OpenAI-compatible)."""

from __future__ import annotations

import argparse
import logging

logger = logging.getLogger(__name__)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from breakgraph.cli import add_engine_arguments
    from breakgraph.server.settings import ServerSettings

    s = parser.add_argument_group("server")
    s.add_argument("--host", default="127.0.0.1", help="address to listen on (default: %(default)s)")
    s.add_argument("--port", type=int, default=30000, help="port to listen on (default: %(default)s)")
    s.add_argument(
        "--api-key",
        default=None,
        help="require 'Authorization: Bearer <key>' on every route but /health and /metrics",
    )
    s.add_argument(
        "--served-model-name",
        default=None,
        help="model id listed by /v1/models and accepted in requests (default: the model folder's name)",
    )
    s.add_argument(
        "--max-queued-requests",
        type=int,
        default=1024,
        help="most requests waiting for a running slot; more are refused with 503 (default: %(default)s)",
    )
    s.add_argument(
        "--disable-prefix-cache",
        action="store_true",
        help="do not reuse the KV pages of prompt prefixes shared between requests",
    )
    s.add_argument("--uvicorn-log-level", default="info", help="uvicorn's log level (default: %(default)s)")
    lim = parser.add_argument_group("server limits")
    d = ServerSettings("")
    lim.add_argument("--max-request-bytes", type=int, default=d.max_request_bytes,
                     help="largest request body; larger ones get 413 (default: %(default)s)")
    lim.add_argument("--request-read-timeout", type=float, default=d.request_read_timeout_s,
                     help="seconds a client may take to send a request body; slower ones get 408 (default: %(default)s)")
    lim.add_argument("--header-timeout", type=float, default=d.header_timeout_s,
                     help="seconds a client may take to send a request's headers before the connection is closed "
                          "(default: %(default)s)")
    lim.add_argument("--max-stop-strings", type=int, default=d.max_stop_strings,
                     help="most stop strings per request (default: %(default)s)")
    lim.add_argument("--max-stop-length", type=int, default=d.max_stop_length,
                     help="longest stop string, in characters (default: %(default)s)")
    lim.add_argument("--max-pending-events", type=int, default=d.max_pending_events,
                     help="most undelivered stream events per choice; a client that reads slower is cut off with an "
                          "error and its request aborted (default: %(default)s)")
    lim.add_argument("--health-max-step-failures", type=int, default=d.max_step_failures,
                     help="consecutive failed engine steps after which /health answers 503, until a step succeeds; "
                          "0: never (default: %(default)s)")
    lim.add_argument("--health-stall-timeout", type=float, default=d.stall_timeout_s,
                     help="seconds the engine may stay in one step while requests wait before /health answers 503 "
                          "(default: %(default)s)")  # fmt: skip
    add_engine_arguments(parser)


def main(args: argparse.Namespace) -> int:
    import uvicorn

    from breakgraph import Engine
    from breakgraph.cli import engine_kwargs
    from breakgraph.server.app import create_app, uvicorn_config
    from breakgraph.server.settings import ServerSettings

    for flag in ("max_request_bytes", "max_stop_strings", "max_stop_length", "max_pending_events"):
        if getattr(args, flag) < 1:
            raise SystemExit(f"--{flag.replace('_', '-')} must be >= 1, got {getattr(args, flag)}")
    for flag in ("request_read_timeout", "header_timeout", "health_stall_timeout"):
        if not getattr(args, flag) > 0:
            raise SystemExit(f"--{flag.replace('_', '-')} must be > 0, got {getattr(args, flag)}")
    if args.max_queued_requests < 1:
        raise SystemExit(
            f"--max-queued-requests must be >= 1 (every request waits in the queue until the next step "
            f"admits it), got {args.max_queued_requests}"
        )
    engine = Engine(args.model_path, **engine_kwargs(args))
    if args.disable_prefix_cache:
        engine.set_prefix_caching(False)
    settings = ServerSettings(
        served_model_name=args.served_model_name or engine.model_path.name,
        api_key=args.api_key or None,
        max_queued_requests=args.max_queued_requests,
        max_request_bytes=args.max_request_bytes,
        request_read_timeout_s=args.request_read_timeout,
        header_timeout_s=args.header_timeout,
        max_stop_strings=args.max_stop_strings,
        max_stop_length=args.max_stop_length,
        max_pending_events=args.max_pending_events,
        max_step_failures=args.health_max_step_failures,
        stall_timeout_s=args.health_stall_timeout,
    )
    app = create_app(engine, settings)
    logger.info("serving %s on http://%s:%d (context %d tokens, %d KV pages)", settings.served_model_name,
                args.host, args.port, engine.context_length, engine.kv_usage().total)  # fmt: skip
    config = uvicorn_config(
        app, host=args.host, port=args.port, log_level=args.uvicorn_log_level, timeout_graceful_shutdown=10
    )
    uvicorn.Server(config).run()
    return 0
