from __future__ import annotations

import argparse
import json
import random
import socket

import pytest

pytest.importorskip("uvicorn")  # serving extras; absent on some GPU images
pytest.importorskip("fastapi")  # serving extras; absent on some GPU images
from openai_stub import MODEL_ID, make_app, serve

from breakgraph.bench import serve as bench
from breakgraph.bench.openai_client import EndpointError, parse_sse_line
from breakgraph.bench.serve import BenchConfig, ExactPrompts, build_requests, run_bench, sample_lengths

CHUNKS, FIRST, GAP = 8, 0.05, 0.02  # stub stream: 8 text chunks, first after 50 ms, then 20 ms apart
E2E = FIRST + (CHUNKS - 1) * GAP


def _stub(**kw):
    return make_app(stream_chunks=CHUNKS, first_delay=FIRST, chunk_delay=GAP, **kw)


def test_metrics_match_known_stream_timing() -> None:
    with serve(_stub()) as url:
        cfg = BenchConfig(base_url=url, num_prompts=6, input_len=16, output_len=CHUNKS, max_concurrency=2)
        res = run_bench(cfg, progress=False)
    assert res.model == MODEL_ID
    assert res.completed == 6 and res.failed == 0 and res.first_error is None
    assert res.usage_reported == 6
    assert res.total_output_tokens == 6 * CHUNKS
    assert res.total_input_tokens == 6 * 16  # the stub counts words; prompts are 16 words
    # Timings: lower bounds are the stub's sleeps; upper bounds leave room for a loaded CI box.
    assert FIRST * 1e3 <= res.ttft_ms["mean"] <= FIRST * 1e3 + 60
    assert GAP * 1e3 * 0.9 <= res.itl_ms["median"] <= GAP * 1e3 + 20
    assert GAP * 1e3 * 0.9 <= res.tpot_ms["mean"] <= GAP * 1e3 + 20
    assert E2E * 1e3 <= res.e2e_ms["mean"] <= E2E * 1e3 + 100
    assert all(len(r.itl_s) == CHUNKS - 1 for r in res.records)
    # Two at a time, three waves: duration is at least 3 * E2E.
    assert 3 * E2E <= res.duration_s <= 3 * E2E + 0.5
    assert res.request_throughput == pytest.approx(6 / res.duration_s)
    assert res.output_throughput == pytest.approx(6 * CHUNKS / res.duration_s)
    assert 6 * CHUNKS / (3 * E2E + 0.5) <= res.output_throughput <= 6 * CHUNKS / (3 * E2E)
    assert 1.5 <= res.concurrency <= 2.0 + 1e-6


def test_server_errors_are_counted_not_fatal() -> None:
    with serve(_stub(fail_every=3)) as url:
        res = run_bench(
            BenchConfig(base_url=url, num_prompts=9, input_len=4, output_len=CHUNKS), progress=False
        )
    assert res.completed == 6 and res.failed == 3
    assert "HTTP 500" in res.first_error and "stub failure" in res.first_error
    assert sum(not r.success for r in res.records) == 3
    assert res.total_output_tokens == 6 * CHUNKS


def test_request_body_asks_for_streamed_usage_and_exact_length() -> None:
    app = _stub()
    with serve(app) as url:
        run_bench(
            BenchConfig(base_url=url, model="m", num_prompts=4, input_len=10, output_len=7, range_ratio=0.5),
            progress=False,
        )
    assert len(app.state.bodies) == 4
    for body in app.state.bodies:
        assert body["model"] == "m" and body["stream"] is True
        assert body["stream_options"] == {"include_usage": True}
        assert body["ignore_eos"] is True
        assert 3 <= body["max_tokens"] <= 7
        assert 5 <= len(body["prompt"].split()) <= 10


def test_poisson_arrivals_spread_sends_and_inf_sends_at_once() -> None:
    with serve(_stub()) as url:
        burst = run_bench(BenchConfig(base_url=url, num_prompts=8, input_len=4, output_len=2), progress=False)
        paced = run_bench(
            BenchConfig(base_url=url, num_prompts=8, input_len=4, output_len=2, request_rate=20.0),
            progress=False,
        )
    assert max(r.send_time_s for r in burst.records) < 0.1
    sends = sorted(r.send_time_s for r in paced.records)
    gaps = random.Random(BenchConfig().seed + 1)
    expected_last = sum(gaps.expovariate(20.0) for _ in range(7))
    assert sends[-1] == pytest.approx(expected_last, abs=0.05)


def test_lengths_are_uniform_in_range() -> None:
    lens = sample_lengths(random.Random(0), 500, 100, 0.25)
    assert min(lens) >= 25 and max(lens) <= 100 and len(set(lens)) > 30
    assert sample_lengths(random.Random(0), 5, 100, 1.0) == [100] * 5
    assert build_requests(BenchConfig(num_prompts=3, seed=4)) == build_requests(
        BenchConfig(num_prompts=3, seed=4)
    )


@pytest.fixture
def tokenizer_dir(tmp_path):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    corpus = [" ".join(bench.WORDS[i : i + 10]) for i in range(0, len(bench.WORDS), 3)] * 3
    tok.train_from_iterator(corpus, trainers.BpeTrainer(vocab_size=300, show_progress=False))
    tok.save(str(tmp_path / "tokenizer.json"))
    return tmp_path


def test_tokenizer_prompts_have_exact_token_length(tokenizer_dir) -> None:
    builder = ExactPrompts(tokenizer_dir)
    rng = random.Random(0)
    for n in (1, 7, 64, 300):
        text, measured = builder.make(rng, n)
        assert measured == n == len(builder.count(text))
    specs = build_requests(BenchConfig(num_prompts=3, input_len=50, tokenizer=tokenizer_dir))
    assert all(s.input_len_exact and s.input_len == 50 for s in specs)


def test_missing_tokenizer_names_the_path(tmp_path) -> None:
    with pytest.raises(FileNotFoundError, match="tokenizer.json"):
        ExactPrompts(tmp_path)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_unreachable_server() -> None:
    url = f"http://127.0.0.1:{_free_port()}"
    with pytest.raises(EndpointError, match=url):
        run_bench(BenchConfig(base_url=url, num_prompts=2), progress=False)
    res = run_bench(BenchConfig(base_url=url, model="m", num_prompts=3, input_len=4), progress=False)
    assert res.completed == 0 and res.failed == 3
    assert url in res.first_error and "cannot connect" in res.first_error
    assert res.ttft_ms["mean"] is None and res.request_throughput == 0


def _parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    bench.add_arguments(parser)
    return parser.parse_args(argv)


def test_main_prints_table_and_writes_json(tmp_path, capsys) -> None:
    out = tmp_path / "bench.json"
    with serve(_stub()) as url:
        argv = ["--base-url", url, "--num-prompts", "4", "--input-len", "8", "--output-len", "8"]
        rc = bench.main(_parse(argv + ["--output", str(out), "--no-progress"]))
    assert rc == 0
    printed = capsys.readouterr().out
    for label in ("Successful requests", "Output token throughput", "TTFT", "TPOT", "ITL", "E2E"):
        assert label in printed
    data = json.loads(out.read_text())
    assert data["completed"] == 4 and data["config"]["request_rate"] == "inf"
    assert set(data["ttft_ms"]) == {"mean", "median", "p99"}
    assert len(data["records"]) == 4 and len(data["records"][0]["itl_s"]) == CHUNKS - 1
    assert "api_key" not in data["config"]


def test_main_exit_codes(capsys) -> None:
    assert bench.main(_parse(["--range-ratio", "1.5"])) == 2
    assert "--range-ratio" in capsys.readouterr().err
    with serve(_stub(fail_every=2)) as url:
        assert (
            bench.main(_parse(["--base-url", url, "--num-prompts", "2", "--input-len", "2", "--no-progress"]))
            == 1
        )
    assert "First error" in capsys.readouterr().out


def test_sse_parser() -> None:
    assert parse_sse_line('data: {"a": 1}') == {"a": 1}
    assert parse_sse_line("data: [DONE]") is None
    assert parse_sse_line(": keep-alive") is None
    assert parse_sse_line("") is None
    with pytest.raises(ValueError):
        parse_sse_line("data: {not json")


def test_sse_lines_split_only_at_sse_line_ends() -> None:
    """Generated text may hold U+2028 or U+0085 raw inside the JSON; a line ends only at CRLF,
    LF or CR, also when a CRLF is cut between two chunks."""
    import asyncio

    import httpx

    from breakgraph.bench.openai_client import sse_lines

    chunks = [
        'data: {"t": "a\u2028b"}\r'.encode(),
        '\ndata: {"t": "c\u0085d\u2029"}\n\n'.encode(),
        b"data: [DO",
        b"NE]\r\n",
    ]

    async def body():
        for chunk in chunks:
            yield chunk

    async def read() -> list[str]:
        transport = httpx.MockTransport(lambda request: httpx.Response(200, content=body()))
        async with httpx.AsyncClient(transport=transport) as client:
            async with client.stream("GET", "http://test/") as resp:
                return [line async for line in sse_lines(resp)]

    lines = asyncio.run(read())
    assert lines == ['data: {"t": "a\u2028b"}', 'data: {"t": "c\u0085d\u2029"}', "", "data: [DONE]"]
    assert [parse_sse_line(line) for line in lines] == [{"t": "a\u2028b"}, {"t": "c\u0085d\u2029"}, None, None]
