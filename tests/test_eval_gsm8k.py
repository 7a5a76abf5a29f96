from __future__ import annotations

import argparse
import json
import re
import socket

import pytest

pytest.importorskip("uvicorn")  # serving extras; absent on some GPU images
pytest.importorskip("fastapi")  # serving extras; absent on some GPU images
from openai_stub import MODEL_ID, make_app, serve

from breakgraph.bench.openai_client import EndpointError
from breakgraph.eval import gsm8k
from breakgraph.eval.gsm8k import (
    DEFAULT_DATA_DIR,
    GSM8KConfig,
    build_fewshot_prefix,
    build_prompt,
    extract_answer,
    load_jsonl,
    parse_label,
    run_gsm8k,
)


@pytest.mark.parametrize(
    "text, expected",
    [
        ("The answer is $1,234.", 1234),
        ("-5 apples", -5),
        ("She has 3 cats and 12 dogs. #### 15", 15),
        ("It costs -$7 in the end.", -7),
        ("Total: 1,000,000 dollars", 1000000),
        ("16-3-4=<<16-3-4=9>>9 eggs", 9),
        ("The result is 12.00.", 12),
        ("About 2.5 hours", 2.5),
        ("10-5", 5),
        ("The answer is 42\n", 42),
    ],
)
def test_extract_answer_takes_last_number(text: str, expected: float) -> None:
    got = extract_answer(text)
    assert got == expected
    if isinstance(expected, int):
        assert isinstance(got, int)


@pytest.mark.parametrize("text", ["", "I do not know.", "no digits here, only words"])
def test_extract_answer_without_number_is_invalid(text: str) -> None:
    assert extract_answer(text) is None


def test_parse_label_reads_number_after_hashes() -> None:
    assert parse_label("He pays 2 * 3 = <<2*3=6>>6.\n#### 6") == 6
    assert parse_label("...\n#### 1,450,000") == 1450000
    assert parse_label("#### -3") == -3
    with pytest.raises(ValueError, match="####"):
        parse_label("no marker")


def test_prompt_format_is_exact() -> None:
    shots = [{"question": "Q1?", "answer": "A1\n#### 1"}, {"question": "Q2?", "answer": "#### 2"}]
    prefix = build_fewshot_prefix(shots)
    assert prefix == "Question: Q1?\nAnswer: A1\n#### 1\n\nQuestion: Q2?\nAnswer: #### 2\n\n"
    assert build_prompt(prefix, "Q3?") == prefix + "Question: Q3?\nAnswer:"
    assert build_prompt(build_fewshot_prefix([]), "Q?") == "Question: Q?\nAnswer:"


def test_shipped_data_is_complete() -> None:
    test = load_jsonl(DEFAULT_DATA_DIR / "test.jsonl")
    train = load_jsonl(DEFAULT_DATA_DIR / "train.jsonl")
    assert len(test) == 1319 and len(train) >= 100
    assert (DEFAULT_DATA_DIR / "LICENSE").is_file()
    assert all(isinstance(parse_label(ex["answer"]), int) for ex in test)


def _graded_answer(labels: dict[str, int]):
    """A stub that answers question k (in test-file order) right, wrong or without a number
    depending on k % 4: 0 and 3 right, 1 wrong, 2 invalid."""
    order = {q: k for k, q in enumerate(labels)}

    def answer(body: dict) -> str:
        question = re.findall(r"Question: (.*?)\nAnswer:", body["prompt"], flags=re.DOTALL)[-1]
        label, k = labels[question], order[question]
        return [
            f" Adding up, the answer is ${label:,}.",
            f" So it is {label + 1}.",
            " I cannot tell.",
            f" 2 + 2 = 4\n#### {label}",
        ][k % 4]

    return answer


def test_eval_against_stub_reports_known_accuracy(tmp_path) -> None:
    test = load_jsonl(DEFAULT_DATA_DIR / "test.jsonl")[:20]
    labels = {ex["question"]: parse_label(ex["answer"]) for ex in test}
    app = make_app(answer=_graded_answer(labels))
    with serve(app) as url:
        result = run_gsm8k(
            GSM8KConfig(base_url=url + "/v1/", num_questions=20, num_shots=3, parallel=4, max_tokens=64),
            progress=False,
        )
    assert result.model == MODEL_ID
    assert result.num_questions == 20
    assert result.num_correct == 10 and result.accuracy == pytest.approx(0.5)
    assert result.num_invalid == 5 and result.invalid_rate == pytest.approx(0.25)
    assert result.output_tokens is not None and result.output_tokens > 0
    assert [r.index for r in result.records] == list(range(20))
    assert result.records[1].prediction == result.records[1].label + 1 and not result.records[1].correct
    assert result.records[2].invalid and result.records[2].prediction is None

    body = app.state.bodies[0]
    assert body["model"] == MODEL_ID
    assert body["temperature"] == 0 and body["max_tokens"] == 64
    assert body["stop"] == ["Question", "</s>", "<|im_end|>"]
    train = load_jsonl(DEFAULT_DATA_DIR / "train.jsonl")
    assert body["prompt"].startswith(build_fewshot_prefix(train[:3]))
    assert body["prompt"].count("Question: ") == 4


def _parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    gsm8k.add_arguments(parser)
    return parser.parse_args(argv)


def test_main_writes_json_with_records(tmp_path, capsys) -> None:
    test = load_jsonl(DEFAULT_DATA_DIR / "test.jsonl")[:8]
    labels = {ex["question"]: parse_label(ex["answer"]) for ex in test}
    out = tmp_path / "res" / "gsm8k.json"
    with serve(make_app(answer=_graded_answer(labels))) as url:
        argv = ["--base-url", url, "--num-questions", "8", "--output", str(out), "--no-progress"]
        rc = gsm8k.main(_parse(argv))
    assert rc == 0
    printed = capsys.readouterr().out
    assert "accuracy:      0.5000 (4/8)" in printed
    data = json.loads(out.read_text())
    assert data["accuracy"] == 0.5 and data["num_invalid"] == 2
    assert len(data["records"]) == 8
    assert set(data["records"][0]) >= {
        "question",
        "label",
        "completion",
        "prediction",
        "correct",
        "latency_s",
    }
    assert "api_key" not in data["config"]


def test_seed_samples_questions_reproducibly(tmp_path) -> None:
    cfg = GSM8KConfig(num_questions=5, num_shots=2, seed=7)
    test = load_jsonl(DEFAULT_DATA_DIR / "test.jsonl")
    train = load_jsonl(DEFAULT_DATA_DIR / "train.jsonl")[:50]
    a = gsm8k.select_examples(cfg, train, test)
    b = gsm8k.select_examples(cfg, train, test)
    assert a == b and [i for i, _ in a[1]] != list(range(5))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_unreachable_endpoint_names_the_url(capsys) -> None:
    url = f"http://127.0.0.1:{_free_port()}"
    with pytest.raises(EndpointError, match=re.escape(url)):
        run_gsm8k(GSM8KConfig(base_url=url, num_questions=2), progress=False)
    rc = gsm8k.main(_parse(["--base-url", url, "--num-questions", "2", "--no-progress"]))
    assert rc == 1
    assert url in capsys.readouterr().err


def test_server_error_prints_status_and_body(capsys) -> None:
    with serve(make_app(answer=lambda body: "1", fail_every=1)) as url:
        rc = gsm8k.main(_parse(["--base-url", url, "--model", "m", "--num-questions", "3", "--no-progress"]))
    err = capsys.readouterr().err
    assert rc == 1
    assert "HTTP 500" in err and "stub failure" in err and f"{url}/v1/completions" in err


def test_bad_flag_value_names_the_flag(capsys) -> None:
    assert gsm8k.main(_parse(["--parallel", "0"])) == 2
    assert "--parallel" in capsys.readouterr().err


def test_readme_eval_example_fits_the_default_model() -> None:
    """README's ``eval gsm8k`` command against a server of the default model: every prompt it sends
    plus its ``max_tokens`` fits the model's context (else the server answers 400 and the run
    stops at the first question)."""
    import shlex
    from pathlib import Path

    from breakgraph import Engine

    readme = (Path(__file__).parents[1] / "README.md").read_text()
    line = next(ln for ln in readme.splitlines() if ln.startswith("breakgraph eval gsm8k"))
    args = _parse(shlex.split(line.split("#")[0])[3:])
    cfg = GSM8KConfig(num_shots=args.num_shots, num_questions=args.num_questions, max_tokens=args.max_tokens,
                      data_dir=args.data, seed=args.seed)  # fmt: skip
    shots, questions = gsm8k.select_examples(
        cfg, load_jsonl(DEFAULT_DATA_DIR / "train.jsonl"), load_jsonl(DEFAULT_DATA_DIR / "test.jsonl")
    )
    engine = Engine(None, device="cpu")
    prefix = build_fewshot_prefix(shots)
    longest = max(len(engine.tokenize(build_prompt(prefix, ex["question"]))) for _, ex in questions)
    assert longest + cfg.max_tokens <= engine.context_length, (longest, cfg.max_tokens, engine.context_length)
