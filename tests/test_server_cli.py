"""``breakgraph serve`` flags: parsed by the main parser, engine flags shared, and a prefill
graph backend that the engine cannot honour is refused rather than silently dropped."""

from __future__ import annotations

import pytest

from breakgraph.cli import build_parser


def test_serve_flags_parse():
    args = build_parser().parse_args(
        ["serve", "--port", "31000", "--api-key", "k", "--served-model-name", "glm", "--max-queued-requests", "8",
         "--max-running-requests", "4", "--dtype", "float32", "--cuda-graph-backend-prefill", "breakable"]
    )  # fmt: skip
    assert (args.port, args.api_key, args.served_model_name, args.max_queued_requests) == (
        31000,
        "k",
        "glm",
        8,
    )
    assert args.max_running_requests == 4 and args.cuda_graph_backend_prefill == "breakable"
    assert build_parser().parse_args(["serve"]).port == 30000


def test_graph_flags_reach_the_engine():
    from breakgraph.cli import engine_kwargs

    args = build_parser().parse_args(
        ["serve", "--cuda-graph-backend-prefill", "piecewise", "--cuda-graph-bs-prefill", "16", "64",
         "--cuda-graph-backend-decode", "full", "--cuda-graph-max-bs", "8"]
    )  # fmt: skip
    kw = engine_kwargs(args)
    assert kw["cuda_graph_backend_prefill"] == "piecewise" and kw["cuda_graph_bs_prefill"] == [16, 64]
    assert kw["cuda_graph_backend_decode"] == "full" and kw["cuda_graph_max_bs"] == 8
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--cuda-graph-backend-prefill", "sometimes"])


def test_server_limit_flags_parse_with_the_settings_defaults():
    from breakgraph.server.settings import ServerSettings

    d = ServerSettings("x")
    args = build_parser().parse_args(["serve"])
    assert (args.max_request_bytes, args.request_read_timeout, args.header_timeout) == (
        d.max_request_bytes, d.request_read_timeout_s, d.header_timeout_s,
    )  # fmt: skip
    assert (args.max_stop_strings, args.max_stop_length, args.max_pending_events) == (
        d.max_stop_strings, d.max_stop_length, d.max_pending_events,
    )  # fmt: skip
    assert (args.health_max_step_failures, args.health_stall_timeout) == (d.max_step_failures, d.stall_timeout_s)
    args = build_parser().parse_args(
        ["serve", "--max-request-bytes", "1000", "--request-read-timeout", "2.5", "--header-timeout", "3",
         "--max-stop-strings", "2", "--max-stop-length", "9", "--max-pending-events", "7",
         "--health-max-step-failures", "0", "--health-stall-timeout", "11"]
    )  # fmt: skip
    assert (args.max_request_bytes, args.request_read_timeout, args.header_timeout, args.max_stop_strings,
            args.max_stop_length, args.max_pending_events, args.health_max_step_failures,
            args.health_stall_timeout) == (1000, 2.5, 3.0, 2, 9, 7, 0, 11.0)  # fmt: skip


def test_serve_help_states_every_limit_default(capsys):
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    for flag in ("--max-request-bytes", "--request-read-timeout", "--header-timeout", "--max-stop-strings",
                 "--max-stop-length", "--max-pending-events", "--health-max-step-failures",
                 "--health-stall-timeout"):  # fmt: skip
        after = text.split(flag, 2)[-1]
        assert "(default: " in after.split("--", 1)[0], flag
