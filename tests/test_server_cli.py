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
