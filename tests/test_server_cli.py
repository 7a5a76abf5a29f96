"""``breakgraph serve`` flags: parsed by the main parser, engine flags shared, and a prefill
graph backend that the engine cannot honour is refused rather than silently dropped."""

from __future__ import annotations

import pytest

from breakgraph.cli import build_parser
from breakgraph.server.cli import _engine_extra_kwargs


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


class _OldEngine:
    def __init__(self, model_path=None, *, device=None): ...


class _NewEngine:
    def __init__(self, model_path=None, *, device=None, cuda_graph_backend_prefill="disabled"): ...


def test_prefill_graph_backend_is_passed_only_to_an_engine_that_takes_it():
    args = build_parser().parse_args(["serve", "--cuda-graph-backend-prefill", "piecewise"])
    assert _engine_extra_kwargs(args, _NewEngine) == {"cuda_graph_backend_prefill": "piecewise"}
    with pytest.raises(SystemExit, match="no prefill graph backends"):
        _engine_extra_kwargs(args, _OldEngine)
    default = build_parser().parse_args(["serve"])  # the engine picks its own default
    assert _engine_extra_kwargs(default, _OldEngine) == _engine_extra_kwargs(default, _NewEngine) == {}
    off = build_parser().parse_args(["serve", "--cuda-graph-backend-prefill", "disabled"])
    assert _engine_extra_kwargs(off, _OldEngine) == {}
