"""Split ops and the piecewise torch.compile backend (PCG), on the CPU graph backend and CUDA."""

from __future__ import annotations

import pytest
import torch

from breakgraph.graphs import (
    BreakableGraph,
    GraphNotCapturedError,
    GraphReplayMismatchError,
    PiecewiseBackend,
    graph_break_op,
    is_split_op,
    new_graph_pool,
    register_custom_op,
    register_split_op,
    split_graph,
    split_op_names,
)


@graph_break_op(mutates_args=("out",))
def tgp_shift_rows(x: torch.Tensor, out: torch.Tensor) -> None:
    """A split op: writes its result into ``out`` (rolls rows, adds 1)."""
    out.copy_(torch.roll(x, 1, dims=0) + 1)


def _gate(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return torch.sigmoid(x @ w)


tgp_gate = register_custom_op(
    _gate, name="tgp_gate", fake_impl=lambda x, w: x.new_empty(x.shape[0], w.shape[1])
)


class ToyBlock(torch.nn.Module):
    def __init__(self, dim: int = 16) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.up = torch.nn.Linear(dim, dim)
        self.down = torch.nn.Linear(dim, dim)
        self.gate_w = torch.nn.Parameter(torch.randn(dim, dim) / dim**0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.up(x).relu()
        mixed = torch.empty_like(h)
        tgp_shift_rows(h, mixed)  # split here
        g = tgp_gate(mixed, self.gate_w)  # custom op that stays inside a piece
        return self.down(mixed * g) + x


def test_register_custom_op_returns_a_callable_torch_op():
    x, w = torch.randn(3, 4), torch.randn(4, 5)
    assert tgp_gate is torch.ops.breakgraph.tgp_gate
    torch.testing.assert_close(tgp_gate(x, w), _gate(x, w))
    assert register_custom_op(_gate, name="tgp_gate") is tgp_gate  # same fn: same op
    with pytest.raises(ValueError, match="already registered"):
        register_custom_op(lambda x, w: x, name="tgp_gate")
    with pytest.raises(ValueError, match="fake_impl"):
        register_custom_op(_gate, name="tgp_gate_nofake")


def test_split_ops_must_return_nothing():
    assert is_split_op(torch.ops.breakgraph.tgp_shift_rows)
    assert is_split_op(torch.ops.breakgraph.tgp_shift_rows.default)
    assert "breakgraph::tgp_shift_rows" in split_op_names()
    assert not is_split_op(tgp_gate)
    with pytest.raises(ValueError, match="return nothing"):
        register_split_op(tgp_gate)
    with pytest.raises(ValueError, match="register_custom_op"):
        register_split_op("tgp_does_not_exist")


def test_graph_break_op_is_a_plain_call_eagerly_and_a_break_under_bcg():
    x, out = torch.randn(4, 3), torch.empty(4, 3)
    tgp_shift_rows(x, out)
    torch.testing.assert_close(out, torch.roll(x, 1, 0) + 1)
    assert tgp_shift_rows.op is torch.ops.breakgraph.tgp_shift_rows

    g = BreakableGraph("cpu")
    with g.capture():
        tgp_shift_rows(x * 2, out)
    assert g.stats.eager_calls == 1 and "tgp_shift_rows" in g.describe()
    x.copy_(torch.randn(4, 3))
    g.replay()
    torch.testing.assert_close(out, torch.roll(x * 2, 1, 0) + 1)


def test_split_graph_cuts_at_split_ops_and_keeps_order():
    seen = {}

    def backend(gm, example_inputs):
        split, pieces = split_graph(gm)
        seen["pieces"] = pieces
        return split

    model = ToyBlock()
    compiled = torch.compile(model, backend=backend, dynamic=False)
    x = torch.randn(5, 16)
    with torch.no_grad():
        torch.testing.assert_close(compiled(x), model(x))
    pieces = seen["pieces"]
    assert [(p.index, p.is_split, p.split_op) for p in pieces] == [
        (0, False, None),
        (1, True, "breakgraph::tgp_shift_rows"),
        (2, False, None),
    ]


def test_piecewise_replays_equal_eager_on_several_inputs_and_shapes():
    model = ToyBlock()
    backend = PiecewiseBackend("cpu")
    compiled = torch.compile(model, backend=backend, dynamic=False)
    buckets = (8, 4)
    with torch.no_grad():
        for n in buckets:
            x = torch.randn(n, 16)
            torch.testing.assert_close(compiled(x), model(x))  # eager pieces (warm-up)
            with backend.capturing():
                torch.testing.assert_close(compiled(x), model(x))
        stats = backend.stats
        assert (stats.pieces, stats.split_ops) == (4, 2)  # two shapes: two FX graphs of 2 pieces
        assert stats.captures == 4 and stats.split_op_names == ["breakgraph::tgp_shift_rows"]
        for _ in range(3):
            for n in buckets:
                x = torch.randn(n, 16)
                with backend.replaying():
                    out = compiled(x)
                torch.testing.assert_close(out, model(x))
    assert stats.replays == 2 * 3 * 2


def test_piecewise_replay_of_an_uncaptured_bucket_is_an_error_not_eager():
    model = ToyBlock()
    backend = PiecewiseBackend("cpu")
    compiled = torch.compile(model, backend=backend, dynamic=False)
    with torch.no_grad():
        compiled(torch.randn(6, 16))
        with pytest.raises(GraphNotCapturedError, match="capture this bucket first"), backend.replaying():
            compiled(torch.randn(6, 16))


def test_piecewise_debug_check_passes_on_a_correct_replay():
    model = ToyBlock()
    backend = PiecewiseBackend("cpu", debug=True)
    compiled = torch.compile(model, backend=backend, dynamic=False)
    x = torch.randn(4, 16)
    with torch.no_grad():
        with backend.capturing():
            compiled(x)
        x2 = torch.randn(4, 16)
        with backend.replaying():
            torch.testing.assert_close(compiled(x2), model(x2))


@pytest.mark.cuda
def test_cuda_piecewise_graphs_share_one_pool_and_equal_eager():
    model = ToyBlock(64).cuda()
    backend = PiecewiseBackend("cuda", pool=new_graph_pool("cuda"))
    compiled = torch.compile(model, backend=backend, dynamic=False)
    with torch.no_grad():
        for n in (256, 64):
            x = torch.randn(n, 64, device="cuda")
            compiled(x)  # warm up
            with backend.capturing():
                torch.testing.assert_close(compiled(x), model(x))
        for n in (256, 64, 256):
            x = torch.randn(n, 64, device="cuda")
            with backend.replaying():
                out = compiled(x).clone()
            torch.testing.assert_close(out, model(x))
    assert backend.stats.captures == 4 and backend.stats.replays == 6


class NoisyBlock(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = torch.empty_like(x)
        tgp_shift_rows(x, out)
        return out + torch.rand_like(out)  # differs between a replay and an eager re-run


def test_piecewise_debug_check_names_the_piece_that_differs_from_eager():
    backend = PiecewiseBackend("cpu", debug=True)
    compiled = torch.compile(NoisyBlock(), backend=backend, dynamic=False)
    x = torch.randn(4, 16)
    with backend.capturing():
        compiled(x)
    with pytest.raises(GraphReplayMismatchError, match="piece 2"), backend.replaying():
        compiled(x)
