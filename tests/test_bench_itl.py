"""``bench itl`` on CPU (the demo model's shape): running streams keep decoding while a
context-length prompt prefills, and the command reports it per stream and records itself."""

from __future__ import annotations

import json
import shlex

import pytest

from breakgraph.cli import build_parser, main

pytestmark = pytest.mark.usefixtures("one_intra_op_thread")


def test_streams_decode_while_a_context_length_prompt_prefills(tmp_path, capsys):
    out = tmp_path / "itl"
    argv = ["bench", "itl", "--device", "cpu", "--chunked-prefill-size", "64", "--before-steps", "4",
            "--output", str(out)]  # fmt: skip
    assert main(argv) == 0
    data = json.loads(out.with_suffix(".json").read_text())
    assert data["context_length"] == 512 and data["input_len"] == 511 and data["chunk"] == 64
    assert data["streams_cut_short"] == 0 and len(data["rows"]) == 8
    ttft_ms = 1e3 * data["ttft_s"]
    chunks = -(-data["input_len"] // data["chunk"])  # 8
    for row in data["rows"]:
        before, during = row["before"], row["during"]
        assert before["n"] == 3 and 0 < before["median_ms"] <= before["p99_ms"] <= before["worst_ms"]
        assert during["n"] >= 1 and 0 < during["median_ms"] <= during["p99_ms"] <= during["worst_ms"]
        # a decode step between every two chunks: the stream moved while the prompt prefilled,
        # waiting about one chunk per token, not the whole prefill
        assert row["tokens_during"] >= chunks - 2, row
        assert during["worst_ms"] < 0.5 * ttft_ms, (during, ttft_ms)
    assert data["worst_itl_during_ms"] == max(r["during"]["worst_ms"] for r in data["rows"])
    printed = capsys.readouterr().out
    assert f"TTFT {data['ttft_s']:.3f} s" in printed and "| 7 |" in printed
    recorded = build_parser().parse_args(shlex.split(data["command"])[1:])
    assert recorded.chunked_prefill_size == 64 and recorded.before_steps == 4 and recorded.streams == 8
