"""Breakable graphs: segments, breaks, drop_empty, islands, debug check, bucket safety.

CPU tests use the CPU graph backend (same contract as CUDA graphs); tests marked ``cuda`` run
the same behaviour on real CUDA graphs.
"""

from __future__ import annotations

import warnings
import weakref
from dataclasses import dataclass

import pytest
import torch

from breakgraph.graphs import (
    BreakableGraph,
    GraphBreakError,
    GraphError,
    GraphNotCapturedError,
    GraphReplayMismatchError,
    HostSyncInGraphError,
    StaleBreakResultError,
    call_with_graph_break,
    eager_on_graph,
    force_graph_break,
    is_in_breakable_cuda_graph,
    new_graph_pool,
)


@dataclass
class ForwardContext:
    """Per-batch data that breaks read when they are called."""

    offset: float = 0.0
    flag: bool = True
    scale: float = 1.0


CTX = ForwardContext()


@eager_on_graph()
def write_plus_offset(x: torch.Tensor, out: torch.Tensor) -> None:
    out.copy_(x + CTX.offset)


@eager_on_graph()
def times_ten(x: torch.Tensor) -> torch.Tensor:
    return x * 10


@eager_on_graph()
def noop_break() -> None:
    return None


def _body_with_breaks(x: torch.Tensor, buf: torch.Tensor) -> torch.Tensor:
    h = (x * 2).sin()
    write_plus_offset(h, buf)
    y = times_ten(buf.cos())
    return y + 1


def _eager_reference(x: torch.Tensor) -> torch.Tensor:
    return (((x * 2).sin() + CTX.offset).cos() * 10) + 1


@pytest.fixture(autouse=True)
def _fresh_context():
    CTX.offset, CTX.flag, CTX.scale = 0.0, True, 1.0
    yield


def test_each_break_ends_a_segment_and_replays_as_an_eager_step():
    x, buf = torch.randn(4, 8), torch.empty(4, 8)
    g = BreakableGraph("cpu")
    g.capture(_body_with_breaks, x, buf)
    s = g.stats
    assert (s.segments, s.eager_steps, s.breaks, s.eager_calls) == (3, 2, 2, 2)
    assert s.kernels_per_segment == [2, 1, 1]
    assert s.empty_dropped == 0
    assert g.describe().splitlines() == [
        "graph  segment 0: 2 kernels",
        "eager  write_plus_offset",
        "graph  segment 1: 1 kernels",
        "eager  times_ten",
        "graph  segment 2: 1 kernels",
    ]


def test_replay_with_new_inputs_and_new_context_matches_eager():
    x, buf = torch.randn(4, 8), torch.empty(4, 8)
    g = BreakableGraph("cpu")
    out = g.capture(_body_with_breaks, x, buf)
    for step in range(3):
        x.copy_(torch.randn(4, 8))
        CTX.offset = float(step)  # read by the break at call time
        assert g.replay() is out
        torch.testing.assert_close(out, _eager_reference(x))
    assert g.stats.replays == 3


def test_is_in_breakable_cuda_graph_is_true_during_capture_and_replay():
    seen: list[bool] = []

    @eager_on_graph()
    def probe() -> None:
        seen.append(is_in_breakable_cuda_graph())

    g = BreakableGraph("cpu")
    with g.capture():
        seen.append(is_in_breakable_cuda_graph())
        probe()
    g.replay()
    assert seen == [True, True, True]
    assert not is_in_breakable_cuda_graph()
    probe()
    assert seen[-1] is False


def test_drop_empty_removes_empty_segments_and_merges_adjacent_breaks():
    x, out = torch.randn(8), torch.empty(8)

    def body():
        noop_break()  # break at the very start
        y = x * 2
        write_plus_offset(y, out)
        noop_break()  # back-to-back with the previous break
        force_graph_break()
        out.add_(1)
        noop_break()  # break at the very end

    kept = BreakableGraph("cpu", drop_empty=False)
    kept.capture(body)
    dropped = BreakableGraph("cpu")
    dropped.capture(body)

    assert kept.stats.segments == 6 and kept.stats.empty_dropped == 0
    s = dropped.stats
    assert (s.segments, s.eager_steps, s.breaks, s.empty_dropped) == (2, 3, 5, 4)
    assert dropped.describe().splitlines() == [
        "eager  noop_break",
        "graph  segment 1: 1 kernels",
        "eager  write_plus_offset, noop_break",  # merged: nothing ran between them
        "graph  segment 4: 1 kernels",
        "eager  noop_break",
    ]
    for g in (kept, dropped):
        x.copy_(torch.randn(8))
        g.replay()
        torch.testing.assert_close(out, x * 2 + 1)


def test_force_graph_break_splits_without_an_eager_step():
    x = torch.randn(8)

    def body():
        y = x + 1
        force_graph_break()
        return y * 3

    g = BreakableGraph("cpu")
    out = g.capture(body)
    assert (g.stats.segments, g.stats.eager_steps, g.stats.breaks) == (2, 0, 1)
    x.fill_(2.0)
    g.replay()
    torch.testing.assert_close(out, torch.full((8,), 9.0))


def test_nested_breaks_run_inline_inside_the_outer_break():
    calls: list[str] = []

    @eager_on_graph()
    def inner(x: torch.Tensor, out: torch.Tensor) -> None:
        calls.append("inner")
        out.copy_(x * 3)

    @eager_on_graph()
    def outer(x: torch.Tensor, out: torch.Tensor) -> None:
        calls.append("outer")
        inner(x + 1, out)

    x, out = torch.randn(4), torch.empty(4)

    def body():
        outer(x * 2, out)
        return out - 1

    g = BreakableGraph("cpu", debug=False)  # counts calls: no debug re-run
    res = g.capture(body)
    assert (g.stats.breaks, g.stats.eager_calls, g.stats.segments) == (1, 1, 2)
    calls.clear()
    x.copy_(torch.randn(4))
    g.replay()
    assert calls == ["outer", "inner"]
    torch.testing.assert_close(res, (x * 2 + 1) * 3 - 1)


def test_returned_tensors_are_kept_and_refreshed_at_replay():
    x = torch.randn(4, 4)

    def body():
        y = times_ten(x + 1)  # a fresh tensor each call; the graph keeps the capture one
        return y.relu() * 2

    g = BreakableGraph("cpu")
    out = g.capture(body)
    for _ in range(2):
        x.copy_(torch.randn(4, 4))
        g.replay()
        torch.testing.assert_close(out, ((x + 1) * 10).relu() * 2)


def test_break_returning_a_changed_python_scalar_is_refused():
    n_tokens = [3]

    @eager_on_graph()
    def count() -> int:
        return n_tokens[0]

    g = BreakableGraph("cpu")
    with g.capture():
        count()
    g.replay()
    n_tokens[0] = 5
    with pytest.raises(StaleBreakResultError, match="count"):
        g.replay()


def test_break_returning_a_new_shape_at_replay_is_refused():
    rows = [4]

    @eager_on_graph()
    def make_rows() -> torch.Tensor:
        return torch.zeros(rows[0])

    g = BreakableGraph("cpu")
    with g.capture():
        make_rows()
    rows[0] = 6
    with pytest.raises(GraphBreakError, match="make_rows"):
        g.replay()


def test_barrier_runs_before_each_break_at_capture_only():
    events: list[str] = []

    @eager_on_graph()
    def collective() -> None:
        events.append("break")

    def body():
        collective()
        force_graph_break()
        collective()

    g = BreakableGraph("cpu", barrier_fn=lambda: events.append("barrier"))
    g.capture(body)
    assert events == ["barrier", "break", "barrier", "break"]
    g.replay()
    assert events[4:] == ["break", "break"]


def test_call_with_graph_break_records_a_one_off_break():
    x, out = torch.randn(4), torch.empty(4)

    def plain_copy(src: torch.Tensor, dst: torch.Tensor) -> None:
        dst.copy_(src)

    g = BreakableGraph("cpu")
    with g.capture():
        call_with_graph_break(plain_copy, x * 2, out)
    assert g.stats.eager_calls == 1
    x.fill_(4.0)
    g.replay()
    torch.testing.assert_close(out, torch.full((4,), 8.0))
    assert "plain_copy" in g.describe()


def _capture_bucket_with_scratch(device: str, n: int, rows: int, pool=None):
    """One token bucket whose scratch buffer is referenced only by the recorded break calls."""

    @eager_on_graph()
    def fill_scratch(h: torch.Tensor, scratch: torch.Tensor) -> None:
        scratch.copy_(h + 100)

    @eager_on_graph()
    def read_scratch(scratch: torch.Tensor, out: torch.Tensor) -> None:
        out.copy_(scratch * 2)

    x = torch.zeros(rows, 32, device=device)  # static input, sized for the largest bucket
    out = torch.empty(rows, 32, device=device)
    scratch = torch.empty(rows, 32, device=device)[:n]  # sliced outside: no segment touches it
    g = BreakableGraph(device, pool=pool)
    with g.capture():
        fill_scratch(x[:n].cos(), scratch)
        read_scratch(scratch, out[:n])
        res = out[:n] - 1
    scratch_ref = weakref.ref(scratch)
    return (g, x, res), scratch_ref  # `scratch` dies here unless the graph keeps it


def _replay_all_then_check(buckets: dict) -> None:
    for _ in range(2):
        inputs = {}
        for n, (_g, x, _res) in buckets.items():  # every input first: a bucket must not clobber another
            x.copy_(torch.randn_like(x))
            inputs[n] = x.clone()
        for g, _x, _res in buckets.values():
            g.replay()
        for n, (_g, x, res) in buckets.items():
            torch.testing.assert_close(x, inputs[n])
            torch.testing.assert_close(res, (inputs[n][:n].cos() + 100) * 2 - 1)


def test_break_arguments_survive_allocator_churn_between_bucket_captures():
    # If the graph held break arguments weakly, the next bucket's static input would be allocated
    # in the dead scratch buffer and the first bucket's replay would overwrite it.
    buckets, scratch_refs = {}, []
    for n in (8, 4):  # largest first, like the runner
        buckets[n], scratch_ref = _capture_bucket_with_scratch("cpu", n, rows=8)
        scratch_refs.append(scratch_ref)
        junk = [torch.full((8, 32), -7.0) for _ in range(64)]
        del junk
    assert all(ref() is not None for ref in scratch_refs)  # held strongly by the recorded calls
    _replay_all_then_check(buckets)


def test_single_kernel_islands_are_counted_and_folding_keeps_results():
    torch.manual_seed(0)
    w = torch.randn(8, 8)
    x, buf, out = torch.randn(4, 8), torch.empty(4, 8), torch.empty(4, 8)

    @eager_on_graph()
    def stage_one(h: torch.Tensor, dst: torch.Tensor) -> None:
        dst.copy_(h)

    @eager_on_graph()
    def stage_two(h: torch.Tensor, dst: torch.Tensor) -> None:
        dst.copy_(h.tanh())

    def body():
        stage_one((x @ w).relu() + 1, buf)
        buf.mul_(2)  # the only kernel between two breaks: an island
        stage_two(buf, out)
        return out.sum(-1) * 3

    plain = BreakableGraph("cpu")
    plain_out = plain.capture(body)
    islands = plain.stats.islands
    assert plain.stats.single_kernel_islands == 1
    assert (islands[0].segment, islands[0].op) == (1, "aten.mul_.Tensor")
    assert (islands[0].after_break, islands[0].before_break) == ("stage_one", "stage_two")

    folded = BreakableGraph("cpu", fold_islands=True)
    folded_out = folded.capture(body)
    assert folded.stats.single_kernel_islands == 0 and folded.stats.folded_islands == 1
    assert (plain.stats.segments, folded.stats.segments) == (3, 2)
    assert (plain.stats.eager_steps, folded.stats.eager_steps) == (2, 1)
    assert "eager  stage_one, [folded segment 1], stage_two" in folded.describe()

    for _ in range(2):
        x.copy_(torch.randn(4, 8))
        expected = ((((x @ w).relu() + 1) * 2).tanh()).sum(-1) * 3
        plain.replay()
        torch.testing.assert_close(plain_out, expected)
        folded.replay()
        torch.testing.assert_close(folded_out, expected)


def test_host_sync_in_a_segment_names_the_op_but_a_break_may_sync():
    x = torch.randn(4)

    @eager_on_graph()
    def host_side_len(t: torch.Tensor) -> None:
        int(t.abs().sum().item())  # fine: breaks run eagerly

    def good():
        host_side_len(x + 1)

    def bad():
        return x * int(x.sum().item())

    BreakableGraph("cpu").capture(good)
    g = BreakableGraph("cpu")
    with pytest.raises(HostSyncInGraphError, match=r"Tensor\.item\(\).*segment 0.*test_graphs_breakable\.py"):
        g.capture(bad)
    assert not g.is_captured
    g.capture(good)  # a failed capture leaves the graph reusable
    assert g.is_captured


def test_debug_check_catches_a_python_branch_frozen_at_capture(monkeypatch):
    monkeypatch.setenv("BREAKGRAPH_GRAPH_DEBUG", "1")
    x, buf = torch.randn(4), torch.empty(4)

    def body():
        h = x.exp()
        write_plus_offset(h, buf)
        y = buf * 2 if CTX.flag else buf * 3  # a host-side choice: frozen by the graph
        return y + 1

    g = BreakableGraph("cpu")
    g.capture(body)
    assert g.debug
    g.replay()  # same branch: passes
    CTX.flag = False
    with pytest.raises(GraphReplayMismatchError, match="segment 1"):
        g.replay()
    assert not BreakableGraph("cpu", debug=False).debug


def test_debug_check_catches_a_stale_python_scalar_and_names_its_segment():
    x, buf = torch.randn(4), torch.empty(4)

    def body():
        h = x * CTX.scale  # Python float baked into segment 0
        write_plus_offset(h, buf)
        return buf + 1

    g = BreakableGraph("cpu", debug=True)
    g.capture(body)
    x.copy_(torch.randn(4))
    g.replay()
    CTX.scale = 2.0
    with pytest.raises(GraphReplayMismatchError, match=r"segment 0 \(before break `write_plus_offset`\)"):
        g.replay()


def test_debug_check_catches_a_branch_that_changes_the_break_sequence():
    x, buf = torch.randn(4), torch.empty(4)

    def body():
        if CTX.flag:
            write_plus_offset(x, buf)
        return buf + 1

    g = BreakableGraph("cpu", debug=True)
    g.capture(body)
    CTX.flag = False
    with pytest.raises(GraphReplayMismatchError, match="called 0 breaks where the capture recorded 1"):
        g.replay()


def test_debug_check_needs_the_function_form(monkeypatch):
    g = BreakableGraph("cpu", debug=True)
    with g.capture():
        noop_break()
    with pytest.raises(GraphError, match=r"capture\(fn, \*args\)"):
        g.replay()
    monkeypatch.setenv("BREAKGRAPH_GRAPH_DEBUG", "1")  # from the environment: warn once, replay
    g = BreakableGraph("cpu")
    with g.capture():
        noop_break()
    with pytest.warns(UserWarning, match="skipped"):
        g.replay()
    g.replay()
    assert g.stats.replays == 2


def test_lifecycle_errors_say_what_to_do():
    g = BreakableGraph("cpu")
    with pytest.raises(GraphNotCapturedError, match="capture"):
        g.replay()
    g.capture(lambda: None)
    with pytest.raises(GraphError, match="reset"):
        g.capture(lambda: None)
    g.reset()
    g.capture(lambda: None)
    inner = BreakableGraph("cpu")
    with pytest.raises(GraphError, match="another breakable graph"), BreakableGraph("cpu").capture():
        inner.capture(lambda: None)


# ----------------------------------------------------------------------------- CUDA


def _cuda_body(x: torch.Tensor, buf: torch.Tensor) -> torch.Tensor:
    return _body_with_breaks(x, buf)


@pytest.mark.cuda
def test_cuda_graph_segments_replay_new_inputs_and_count_kernels():
    x, buf = torch.randn(64, 64, device="cuda"), torch.empty(64, 64, device="cuda")
    _cuda_body(x, buf)  # warm up
    g = BreakableGraph("cuda")
    out = g.capture(_cuda_body, x, buf)
    torch.testing.assert_close(out, _eager_reference(x))  # the capture pass computes real values
    assert g.stats.kernel_count_source == "cuda graph nodes"
    assert g.stats.segments == 3 and g.stats.eager_steps == 2
    assert all(k is not None and k >= 1 for k in g.stats.kernels_per_segment)
    for step in range(3):
        x.copy_(torch.randn_like(x))
        CTX.offset = float(step)
        g.replay()
        torch.testing.assert_close(out, _eager_reference(x))


@pytest.mark.cuda
def test_cuda_drop_empty_leaves_no_empty_graph_warning():
    x, out = torch.randn(256, device="cuda"), torch.empty(256, device="cuda")

    def body():
        noop_break()
        write_plus_offset(x * 2, out)
        noop_break()
        noop_break()

    body()
    for drop_empty, expect_warning in ((True, False), (False, True)):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            g = BreakableGraph("cuda", drop_empty=drop_empty)
            g.capture(body)
            g.replay()
        empty = [w for w in caught if "The CUDA Graph is empty" in str(w.message)]
        assert bool(empty) == expect_warning
    assert g.stats.segments == 5  # the last one kept its empty graphs
    g = BreakableGraph("cuda")
    g.capture(body)
    assert (g.stats.segments, g.stats.eager_steps, g.stats.empty_dropped) == (1, 2, 4)
    x.fill_(3.0)
    g.replay()
    torch.cuda.synchronize()
    torch.testing.assert_close(out, torch.full_like(out, 6.0))


@pytest.mark.cuda
def test_cuda_side_stream_not_joined_before_a_break_names_the_break():
    x, out = torch.randn(256, device="cuda"), torch.empty(256, device="cuda")
    side = torch.cuda.Stream()

    def body():
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            y = x * 2
        write_plus_offset(y, out)  # side stream never joined

    g = BreakableGraph("cuda")
    with pytest.raises(GraphBreakError, match="write_plus_offset"):
        g.capture(body)
    assert not g.is_captured
    torch.cuda.synchronize()


@pytest.mark.cuda
def test_cuda_two_buckets_share_one_pool_and_survive_churn():
    pool = new_graph_pool("cuda")
    warm = torch.randn(512, 32, device="cuda")
    ((warm.cos() + 100) * 2 - 1).sum().item()  # load the kernels before capturing
    buckets = {}
    for n in (512, 128):
        buckets[n], _ = _capture_bucket_with_scratch("cuda", n, rows=512, pool=pool)
        junk = [torch.full((512, 32), -7.0, device="cuda") for _ in range(32)]
        del junk
    assert all(g.pool is pool for g, _, _ in buckets.values())
    _replay_all_then_check(buckets)

    graphs = {}
    for n in (256, 64):
        x, buf = torch.randn(n, 64, device="cuda"), torch.empty(n, 64, device="cuda")
        _cuda_body(x, buf)
        g = BreakableGraph("cuda", pool=pool)
        graphs[n] = (g, x, g.capture(_cuda_body, x, buf))
    for g, x, out in graphs.values():
        x.copy_(torch.randn_like(x))
        g.replay()
        torch.testing.assert_close(out, _eager_reference(x))


@pytest.mark.cuda
def test_cuda_islands_are_counted_from_graph_nodes_and_fold_keeps_results():
    x, buf, out = (torch.randn(64, 64, device="cuda") for _ in range(3))

    @eager_on_graph()
    def stage(h: torch.Tensor, dst: torch.Tensor) -> None:
        dst.copy_(h.tanh())

    def body():
        stage((x @ x).relu() + 1, buf)
        buf.mul_(2)  # the only kernel between two breaks
        stage(buf, out)
        return out.sum(-1) * 3

    body()
    plain, folded = BreakableGraph("cuda"), BreakableGraph("cuda", fold_islands=True)
    outs = [plain.capture(body), folded.capture(body)]
    assert plain.stats.single_kernel_islands == 1 and plain.stats.islands[0].segment == 1
    assert folded.stats.folded_islands == 1 and folded.stats.segments == plain.stats.segments - 1
    x.copy_(torch.randn_like(x))
    expected = (((x @ x).relu() + 1).tanh() * 2).tanh().sum(-1) * 3
    for g, o in zip((plain, folded), outs):
        g.replay()
        torch.testing.assert_close(o, expected)


@pytest.mark.cuda
def test_cuda_host_sync_in_a_segment_is_explained():
    x = torch.randn(16, device="cuda")
    g = BreakableGraph("cuda")
    with pytest.raises(GraphError, match="device='cpu'"):
        g.capture(lambda: x * x.sum().item())
    torch.cuda.synchronize()
    with pytest.raises(GraphError, match="new_graph_pool"):  # torch refuses that pool from now on
        g.capture(lambda: x * 2)
    fresh = BreakableGraph("cuda", pool=new_graph_pool("cuda"))
    out = fresh.capture(lambda: x * 2 + torch.randn_like(x) * 0)  # random ops work again
    x.fill_(3.0)
    fresh.replay()
    torch.testing.assert_close(out, torch.full_like(x, 6.0))


@eager_on_graph()
def _double_into(src: torch.Tensor, dst: torch.Tensor) -> None:
    dst.copy_(src * 2 + CTX.offset)


def _deep_body(x: torch.Tensor, layers: int) -> torch.Tensor:
    h = x
    for _ in range(layers):
        a = h * 0.5 + 1  # allocated inside a segment: lives in the graph pool
        out = torch.empty_like(a)
        _double_into(a, out)
        h = out.tanh()
    return h


def _pool_bytes(pool) -> int:
    from breakgraph.graphs.cuda_segment import pool_segments

    return sum(end - start for start, end in pool_segments(torch.device("cuda"), pool))


@pytest.mark.cuda
def test_cuda_break_arguments_in_the_pool_do_not_pin_it_and_buckets_share_it():
    """32 layers pass 4 MiB pool tensors through a break: held strongly they would pin 256 MiB
    per bucket; as non-owning aliases the pool stays a few tensors big. Two buckets share the
    pool and still replay correctly in any order."""
    layers, mib = 32, 2**20
    pool = new_graph_pool("cuda")
    inputs = {n: torch.randn(n, 1024, device="cuda") for n in (1024, 512)}
    graphs, outs = {}, {}
    CTX.offset = 0.0
    for n, x in inputs.items():  # largest first, as the prefill runner does
        _deep_body(x, layers)
        graphs[n] = BreakableGraph("cuda", pool=pool)
        outs[n] = graphs[n].capture(_deep_body, x, layers)
    assert _pool_bytes(pool) < 16 * 4 * mib
    for step, n in enumerate([512, 1024, 512, 1024, 1024]):
        inputs[n].copy_(torch.randn_like(inputs[n]))
        CTX.offset = float(step)
        graphs[n].replay()
        torch.testing.assert_close(outs[n], _deep_body(inputs[n].clone(), layers))


@pytest.mark.cuda
def test_cuda_eager_matmuls_before_a_capture_leave_the_graph_no_workspace_outside_the_pool():
    """An eager warm-up between ``open`` and ``begin`` (as the graphed training step runs one)
    makes cuBLAS cache a workspace for the capture stream outside the pool. The capture must not
    keep using it: ``close`` drops the cached workspaces, and memory handed out after that would
    be overwritten by every replay. Here it is handed to sentinel tensors, which must stay intact
    while the graph's matmuls still give the eager results."""
    from breakgraph.graphs.capture import make_capturer

    device = torch.device("cuda")
    gen = torch.Generator(device).manual_seed(0)
    # split-K shapes (long k, small m and n) and a square one: cuBLAS writes its workspace for these
    pairs = [
        (
            torch.randn(m, k, device=device, generator=gen, dtype=dtype),
            torch.randn(k, n, device=device, generator=gen, dtype=dtype),
        )
        for m, k, n, dtype in [
            (64, 32768, 64, torch.bfloat16),
            (16, 65536, 48, torch.float32),
            (1024, 1024, 1024, torch.bfloat16),
        ]
    ]
    capturer = make_capturer(device, new_graph_pool(device))
    capturer.open()
    try:
        for a, b in pairs:
            a @ b  # eager, on the capture stream
        capturer.begin("matmuls")
        outs = [a @ b for a, b in pairs]
        segment = capturer.end("end of capture")
    finally:
        capturer.close()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()  # a workspace freed by close goes back to the driver, to be handed out again
    sentinels = [torch.full((8 * 2**20,), 7.0, device=device) for _ in range(48)]  # 48 × 32 MiB
    for a, _ in pairs:
        a.copy_(torch.randn(a.shape, device=device, generator=gen, dtype=a.dtype))
    for _ in range(3):
        segment.replay()
    torch.cuda.synchronize()
    assert all(bool((s == 7.0).all()) for s in sentinels), (
        "a replay wrote into memory freed after the capture"
    )
    for (a, b), out in zip(pairs, outs):
        torch.testing.assert_close(out, a @ b, rtol=2e-2, atol=2e-2)
