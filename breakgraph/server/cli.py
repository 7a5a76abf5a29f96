"""``breakgraph serve``: build the engine and serve it over HTTP (OpenAI-compatible)."""

from __future__ import annotations

import argparse
import logging

logger = logging.getLogger(__name__)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from breakgraph.cli import add_engine_arguments

    s = parser.add_argument_group("server")
    s.add_argument("--host", default="127.0.0.1", help="address to listen on (default: %(default)s)")
    s.add_argument("--port", type=int, default=30000, help="port to listen on (default: %(default)s)")
    s.add_argument(
        "--api-key",
        default=None,
        help="require 'Authorization: Bearer <key>' on /v1/* (health and metrics stay open)",
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
    add_engine_arguments(parser)


def main(args: argparse.Namespace) -> int:
    import uvicorn

    from breakgraph import Engine
    from breakgraph.cli import engine_kwargs
    from breakgraph.server.app import ServerSettings, create_app

    if args.max_queued_requests < 1:
        raise SystemExit(
            f"--max-queued-requests must be >= 1 (every request waits in the queue until the next step "
            f"admits it), got {args.max_queued_requests}"
        )
    engine = Engine(args.model_path, **engine_kwargs(args))
    if args.disable_prefix_cache:
        engine.scheduler.set_prefix_caching(False)
    settings = ServerSettings(
        served_model_name=args.served_model_name or engine.model_path.name,
        api_key=args.api_key or None,
        max_queued_requests=args.max_queued_requests,
    )
    app = create_app(engine, settings)
    logger.info("serving %s on http://%s:%d (context %d tokens, %d KV pages)", settings.served_model_name,
                args.host, args.port, engine.context_length, engine.kv_cache.pool.capacity_pages)  # fmt: skip
    uvicorn.run(
        app, host=args.host, port=args.port, log_level=args.uvicorn_log_level, timeout_graceful_shutdown=10
    )
    return 0
