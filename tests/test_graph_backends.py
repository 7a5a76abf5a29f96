"""The graph backend registry, the shared stats and the shared static batch (CPU)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from breakgraph import Engine
from breakgraph.engine.config import flag_fields
from breakgraph.forward_context import ForwardBatch, ForwardMode
from breakgraph.graphs import backends
from breakgraph.graphs.static_batch import StaticBatch
from breakgraph.graphs.stats import BucketInfo, GraphStats

PREFILL_KEYS = {
    "backend", "captured_buckets", "capture_s", "traces", "graph_memory_bytes", "replays", "replayed_tokens",
    "padded_tokens", "fallbacks", "segments", "breaks", "islands", "warmups", "bounded_buckets",
}  # fmt: skip
DECODE_KEYS = {"backend", "batch_sizes", "capture_s", "replays", "fallbacks", "warmups"}


def test_flag_choices_are_the_registry():
    choices = {f.name: f.metadata["choices"] for f in flag_fields("graphs") if f.metadata["choices"]}
    assert choices["cuda_graph_backend_prefill"] == tuple(backends.BACKENDS["prefill"])
    assert choices["cuda_graph_backend_decode"] == tuple(backends.BACKENDS["decode"])
    with pytest.raises(ValueError, match=r"--cuda-graph-backend-decode must be one of \('disabled', 'full'\), got 'x'"):
        backends.lookup("decode", "x")


class CountingRunner:
    """A bucketed prefill backend that runs the model eagerly and counts its runs."""

    def __init__(self, setup: backends.GraphSetup) -> None:
        self.model, self.buckets, self.stats = setup.model, setup.buckets, GraphStats("counting")
        self.closed = False

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, longest: int | None = None) -> torch.Tensor:
        self.stats.count_replay(input_ids.shape[0], self.buckets[-1])
        return self.model(input_ids, positions)

    def close(self) -> None:
        self.closed = True


def test_a_backend_registered_in_the_registry_runs_through_the_model_runner(hf_checkpoints, monkeypatch):
    """Nothing outside graphs/backends.py names a backend: one entry reaches the runner's
    dispatch, its chunk cap and graph_stats()."""
    entry = backends.Backend("counting", "prefill", CountingRunner)
    monkeypatch.setitem(backends.BACKENDS["prefill"], "counting", entry)
    engine = Engine(hf_checkpoints["glm_moe_dsa"], device="cpu", dtype="float32", page_size=4)
    want = engine.prompt_logits([[3, 1, 4, 1, 5]])
    runner = engine.runner
    runner.set_prefill_backend("counting", [8, 32])
    counting = runner.prefill_graphs
    assert isinstance(counting, CountingRunner) and runner.max_prefill_tokens == 32
    torch.testing.assert_close(engine.prompt_logits([[3, 1, 4, 1, 5]])[0], want[0])
    stats = engine.graph_stats()
    assert stats["backend"] == "counting" and stats["replays"] == 1 and stats["padded_tokens"] == 27
    assert set(stats) == PREFILL_KEYS | {"decode"} and stats["decode"] == {"backend": "disabled", "replays": 0, "fallbacks": {}}
    runner.set_prefill_backend("disabled")
    assert counting.closed and engine.graph_stats()["backend"] == "disabled"


def test_stats_report_the_keys_of_each_phase():
    prefill = GraphStats("breakable", buckets=[BucketInfo(16, 0.1, 3, 2, 1, None)])
    prefill.count_replay(10, 16)
    prefill.fallbacks["padding_over_limit"] += 1
    d = prefill.as_dict()
    assert set(d) == PREFILL_KEYS
    assert (d["replays"], d["replayed_tokens"], d["padded_tokens"]) == (1, 10, 6)
    assert d["segments"] == {16: 3} and d["fallbacks"] == {"padding_over_limit": 1}
    assert d["captured_buckets"] == [16] and d["bounded_buckets"] == {}
    # a second graph of a bucket, for short sequences: listed under its bound, its warm-up summed
    prefill.buckets.append(BucketInfo(16, 0.1, 2, 2, 0, None, 0.5, 1, length_bound=8))
    d = prefill.as_dict()
    assert d["captured_buckets"] == [16] and d["bounded_buckets"] == {8: [16]}
    assert d["segments"] == {16: 3} and d["warmups"] == {16: 1}
    decode = GraphStats("full", phase="decode", buckets=[BucketInfo(b, 0.0, 1, 0, 0, None, 0.0, b // 2) for b in (1, 2)])
    decode.count_replay(1, 2)
    assert decode.as_dict() == {
        "backend": "full", "batch_sizes": [1, 2], "capture_s": 0.0, "replays": 1, "fallbacks": {}, "warmups": {1: 0, 2: 1}
    }  # fmt: skip
    assert decode.warmup_text() == "warm-ups 0.0s: 1 of 2 graphs"
    # a batch size with a graph per sequence-length bound is reported once, its warm-ups summed
    decode.buckets.append(BucketInfo(2, 0.0, 1, 0, 0, None, 0.0, 1))
    assert decode.as_dict()["batch_sizes"] == [1, 2] and decode.as_dict()["warmups"] == {1: 0, 2: 2}


def _decode_batch(rows: list[tuple[int, int, list[int]]]) -> ForwardBatch:
    """Decode requests of (token, position, pages), one token each, writing at the last position."""
    width = max(len(p) for _, _, p in rows)
    t = torch.tensor
    return ForwardBatch(
        mode=ForwardMode.DECODE, input_ids=t([r[0] for r in rows]), positions=t([r[1] for r in rows]),
        token_req=t(list(range(len(rows)))), out_cache_loc=t([r[2][-1] * 4 + r[1] % 4 for r in rows]),
        page_table=t([p + [0] * (width - len(p)) for _, _, p in rows], dtype=torch.int32),
        seq_lens=t([r[1] + 1 for r in rows], dtype=torch.int32), seq_lens_cpu=[r[1] + 1 for r in rows],
        prefix_lens_cpu=[r[1] for r in rows], extend_lens_cpu=[1] * len(rows), kv_cache=None,
    )  # fmt: skip


def test_static_batch_pads_decode_rows_onto_page_zero():
    static = StaticBatch.allocate(4, torch.device("cpu"), max_pages=3)
    for t in (static.input_ids, static.positions, static.out_cache_loc, static.page_table, static.seq_lens):
        t.fill_(7)  # what an earlier, larger batch left behind
    static.load(_decode_batch([(11, 5, [2, 3]), (12, 1, [4])]), 4)
    assert static.input_ids.tolist() == [11, 12, 0, 0] and static.positions.tolist() == [5, 1, 0, 0]
    assert static.out_cache_loc.tolist() == [13, 17, 0, 0] and static.seq_lens.tolist() == [6, 2, 1, 1]
    assert static.page_table.tolist() == [[2, 3, 0], [4, 0, 0], [0, 0, 0], [0, 0, 0]]
    with pytest.raises(ValueError, match="4 pages wide; graphs were captured for 3"):
        static.load(_decode_batch([(1, 14, [1, 2, 3, 4])]), 1)
    view = static.batch(2, SimpleNamespace(page_size=4))
    assert view.seq_lens_cpu == [12, 12] and view.prefix_lens_cpu == [11, 11] and view.extend_lens_cpu == [1, 1]
    assert view.page_table.data_ptr() == static.page_table.data_ptr() and view.batch_size == 2


def test_static_batch_for_prefill_holds_tokens_only():
    static = StaticBatch.allocate(8, torch.device("cpu"))
    assert static.page_table is None and static.token_req is None
    static.input_ids.fill_(7)
    static.positions.fill_(7)
    static.load_tokens(torch.tensor([5, 6, 7]), torch.tensor([0, 1, 2]), 6)
    ids, pos = static.tokens(6)
    assert ids.tolist() == [5, 6, 7, 0, 0, 0] and pos.tolist() == [0, 1, 2, 0, 0, 0]
    assert static.input_ids[6:].tolist() == [7, 7], "rows past the bucket are not touched"


def test_compile_guard_raises_only_for_a_miss_inside_a_capture(monkeypatch):
    """The Triton guard (graphs/jit_guard.py) against a stand-in for triton.knobs.runtime: a
    kernel-cache miss raises CompileInCapture while the stream captures, else goes on to the
    hook installed before (restored on exit)."""
    import types

    from breakgraph.graphs import jit_guard

    seen = []
    runtime = types.SimpleNamespace(jit_cache_hook=lambda **kw: seen.append(kw["fn"].name))
    before = runtime.jit_cache_hook
    monkeypatch.setattr(jit_guard, "_runtime_knobs", lambda: runtime)
    capturing = {"now": False}
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: capturing["now"])
    fn = types.SimpleNamespace(name="_fp8_gemm_kernel")
    with jit_guard.compile_guard() as active:
        assert active
        runtime.jit_cache_hook(fn=fn, key="k")  # not capturing: compiles as usual
        assert seen == ["_fp8_gemm_kernel"]
        capturing["now"] = True
        with pytest.raises(jit_guard.CompileInCapture, match="_fp8_gemm_kernel"):
            runtime.jit_cache_hook(fn=fn, key="k")
        assert seen == ["_fp8_gemm_kernel"]
    assert runtime.jit_cache_hook is before
    monkeypatch.setattr(jit_guard, "_runtime_knobs", lambda: None)
    with jit_guard.compile_guard() as active:
        assert not active, "no Triton hook: the caller warms up every capture"
