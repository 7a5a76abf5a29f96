"""Few-shot GSM8K accuracy against any OpenAI-compatible ``/v1/completions`` endpoint.

The prompt is ``num_shots`` worked train examples followed by the test question::

    Question: {q}\\nAnswer: {a}\\n\\n   (once per shot)
    Question: {q}\\nAnswer:

Requests are greedy (temperature 0) and stop at ``Question``, ``</s>`` or ``<|im_end|>``. The
prediction is the last number in the completion (commas, ``$`` and a trailing period are
ignored); the label is the number after ``####`` in the reference answer. A completion without a
number counts as invalid and wrong.

Library use::

    from breakgraph.eval.gsm8k import GSM8KConfig, run_gsm8k
    result = run_gsm8k(GSM8KConfig(base_url="http://127.0.0.1:30000", num_questions=50))
    print(result.accuracy)

Command line: ``python -m breakgraph.eval.gsm8k --help`` (or ``breakgraph eval gsm8k``).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import re
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tqdm.auto import tqdm

from breakgraph.bench.openai_client import (
    DEFAULT_BASE_URL,
    EndpointError,
    add_endpoint_arguments,
    auth_headers,
    fetch_model_id,
    http_error_message,
    normalize_base_url,
    transport_error_message,
)

if TYPE_CHECKING:
    import httpx  # imported where used: httpx comes with the bench, eval and serve extras

DEFAULT_DATA_DIR = Path(__file__).resolve().parent / "data" / "gsm8k"
STOP = ["Question", "</s>", "<|im_end|>"]

# A number: optional minus (not glued to a preceding word, so "10-5" does not read as -5),
# optional "$" on either side of the minus, digits with thousands commas or plain digits, and an
# optional decimal part. A trailing "." is not a decimal part because it needs a digit after it.
_NUMBER = re.compile(
    r"(?<![\w.])(?P<neg>-)?\$?(?P<neg2>-)?(?P<int>\d{1,3}(?:,\d{3})+(?!\d)|\d+)(?P<frac>\.\d+)?"
)


def extract_answer(text: str) -> int | float | None:
    """The last number in ``text``, or ``None`` when it contains none (an invalid answer).

    ``"The answer is $1,234."`` gives 1234, ``"-5 apples"`` gives -5, ``"12.50"`` gives 12.5 and
    ``"3.0"`` gives 3. A non-integral value is returned as a float; it can never equal a GSM8K
    label, which is always an integer, so it scores as wrong rather than invalid.
    """
    matches = list(_NUMBER.finditer(text))
    if not matches:
        return None
    m = matches[-1]
    negative = bool(m.group("neg") or m.group("neg2"))
    integer = int(m.group("int").replace(",", ""))
    frac = m.group("frac")
    value: int | float = integer
    if frac and int(frac[1:]) != 0:
        value = float(f"{integer}{frac}")
    return -value if negative else value


def parse_label(answer: str) -> int:
    """The integer after ``####`` in a GSM8K reference answer (thousands commas removed).

    Raises ``ValueError`` naming the answer when there is no ``####`` or it is not an integer.
    """
    if "####" not in answer:
        raise ValueError(f"GSM8K answer has no '####' line: {answer[-120:]!r}")
    tail = answer.rsplit("####", 1)[1].strip().replace(",", "")
    try:
        return int(tail)
    except ValueError as exc:
        raise ValueError(f"GSM8K label after '####' is not an integer: {tail!r}") from exc


def build_fewshot_prefix(shots: list[dict[str, str]]) -> str:
    """The shots as ``Question: {q}\\nAnswer: {a}\\n\\n`` each, concatenated (``""`` for no shots)."""
    return "".join(f"Question: {s['question']}\nAnswer: {s['answer']}\n\n" for s in shots)


def build_prompt(prefix: str, question: str) -> str:
    """``prefix`` followed by ``Question: {question}\\nAnswer:`` (no trailing space)."""
    return f"{prefix}Question: {question}\nAnswer:"


def load_jsonl(path: Path) -> list[dict[str, Any]]:
    """Read one JSON object per non-blank line; raises ``FileNotFoundError`` naming the path."""
    if not path.is_file():
        raise FileNotFoundError(f"GSM8K file not found: {path} (pass --data with test.jsonl and train.jsonl)")
    with path.open(encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


@dataclass(frozen=True)
class GSM8KConfig:
    """Everything one evaluation run needs.

    base_url: server root, e.g. ``http://127.0.0.1:30000`` (``/v1`` is appended).
    model: model id sent in each request; ``None`` asks ``GET /v1/models`` and takes the first.
    num_shots: worked train examples in front of every question.
    num_questions: test questions to ask; ``-1`` means all of them.
    parallel: requests in flight at once.
    max_tokens: completion budget per question.
    data_dir: folder with ``test.jsonl`` and ``train.jsonl``.
    api_key: bearer token, if the server wants one.
    seed: ``None`` takes the first questions and shots in file order (comparable across runs and
        with other harnesses); an integer samples both at random with that seed.
    timeout: seconds allowed per HTTP request.
    """

    base_url: str = DEFAULT_BASE_URL
    model: str | None = None
    num_shots: int = 5
    num_questions: int = 200
    parallel: int = 16
    max_tokens: int = 256
    data_dir: Path = DEFAULT_DATA_DIR
    api_key: str | None = field(default=None, repr=False)
    seed: int | None = None
    timeout: float = 600.0

    def __post_init__(self) -> None:
        if self.num_shots < 0:
            raise ValueError(f"--num-shots must be >= 0, got {self.num_shots}")
        if self.num_questions == 0 or self.num_questions < -1:
            raise ValueError(
                f"--num-questions must be a positive count or -1 for all, got {self.num_questions}"
            )
        if self.parallel < 1:
            raise ValueError(f"--parallel must be >= 1, got {self.parallel}")
        if self.max_tokens < 1:
            raise ValueError(f"--max-tokens must be >= 1, got {self.max_tokens}")
        if self.timeout <= 0:
            raise ValueError(f"--timeout must be > 0 seconds, got {self.timeout}")


@dataclass
class QuestionRecord:
    """The outcome of one question; ``prediction`` is ``None`` when the completion had no number."""

    index: int
    question: str
    label: int
    completion: str
    prediction: int | float | None
    correct: bool
    invalid: bool
    latency_s: float
    completion_tokens: int | None


@dataclass
class GSM8KResult:
    """Summary and per-question records of one run; ``output_throughput`` is ``None`` when the
    server reported no ``usage.completion_tokens``."""

    model: str
    base_url: str
    num_shots: int
    num_questions: int
    num_correct: int
    num_invalid: int
    accuracy: float
    invalid_rate: float
    latency_s: float
    output_tokens: int | None
    output_throughput: float | None
    config: dict[str, Any]
    records: list[QuestionRecord]

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    def summary(self) -> str:
        n = self.num_questions
        tput = (
            f"{self.output_throughput:.1f} tok/s ({self.output_tokens} tokens)"
            if self.output_throughput is not None
            else "n/a (server reported no usage)"
        )
        return "\n".join(
            [
                f"GSM8K {self.num_shots}-shot, {n} questions, model {self.model!r} at {self.base_url}",
                f"  accuracy:      {self.accuracy:.4f} ({self.num_correct}/{n})",
                f"  invalid rate:  {self.invalid_rate:.4f} ({self.num_invalid}/{n})",
                f"  latency:       {self.latency_s:.2f} s",
                f"  output tokens: {tput}",
            ]
        )


def select_examples(
    cfg: GSM8KConfig, train: list[dict[str, str]], test: list[dict[str, str]]
) -> tuple[list[dict[str, str]], list[tuple[int, dict[str, str]]]]:
    """Pick the shots from ``train`` and the (test index, example) pairs to ask.

    Raises ``ValueError`` when ``num_shots`` exceeds the train set; ``num_questions`` larger than
    the test set is clamped to it.
    """
    if cfg.num_shots > len(train):
        raise ValueError(f"--num-shots {cfg.num_shots} exceeds the {len(train)} train examples available")
    n = len(test) if cfg.num_questions == -1 else min(cfg.num_questions, len(test))
    if cfg.seed is None:
        shots = train[: cfg.num_shots]
        indices = list(range(n))
    else:
        rng = random.Random(cfg.seed)
        shots = rng.sample(train, cfg.num_shots)
        indices = sorted(rng.sample(range(len(test)), n))
    return shots, [(i, test[i]) for i in indices]


async def _ask(
    client: httpx.AsyncClient, url: str, model: str, prompt: str, max_tokens: int
) -> tuple[str, int | None, float]:
    import httpx

    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stop": STOP}
    t0 = time.perf_counter()
    try:
        resp = await client.post(url, json=body)
    except httpx.HTTPError as exc:
        raise EndpointError(transport_error_message(url, exc)) from exc
    latency = time.perf_counter() - t0
    if resp.status_code != 200:
        raise EndpointError(http_error_message(url, resp.status_code, resp.text))
    try:
        data = resp.json()
        text = data["choices"][0]["text"]
    except (ValueError, KeyError, IndexError, TypeError) as exc:
        raise EndpointError(f"{url} answered without choices[0].text: {resp.text[:500]!r}") from exc
    usage = data.get("usage") or {}
    tokens = usage.get("completion_tokens")
    return str(text), (int(tokens) if tokens is not None else None), latency


async def run_gsm8k_async(cfg: GSM8KConfig, progress: bool = True) -> GSM8KResult:
    """Run the evaluation; see ``run_gsm8k``."""
    import httpx

    base_url = normalize_base_url(cfg.base_url)
    data_dir = Path(cfg.data_dir)
    test = load_jsonl(data_dir / "test.jsonl")
    train = load_jsonl(data_dir / "train.jsonl")
    shots, questions = select_examples(cfg, train, test)
    prefix = build_fewshot_prefix(shots)
    labels = {i: parse_label(ex["answer"]) for i, ex in questions}

    limits = httpx.Limits(max_connections=cfg.parallel, max_keepalive_connections=cfg.parallel)
    async with httpx.AsyncClient(
        headers=auth_headers(cfg.api_key), timeout=httpx.Timeout(cfg.timeout), limits=limits
    ) as client:
        model = cfg.model or await fetch_model_id(client, base_url)
        url = f"{base_url}/v1/completions"
        sem = asyncio.Semaphore(cfg.parallel)

        async def one(index: int, example: dict[str, str]) -> QuestionRecord:
            async with sem:
                text, tokens, latency = await _ask(
                    client, url, model, build_prompt(prefix, example["question"]), cfg.max_tokens
                )
            pred = extract_answer(text)
            return QuestionRecord(
                index=index,
                question=example["question"],
                label=labels[index],
                completion=text,
                prediction=pred,
                correct=pred is not None and pred == labels[index],
                invalid=pred is None,
                latency_s=latency,
                completion_tokens=tokens,
            )

        records: list[QuestionRecord] = []
        tasks = [asyncio.create_task(one(i, ex)) for i, ex in questions]
        bar = tqdm(total=len(tasks), desc="gsm8k", unit="q", disable=not progress)
        t0 = time.perf_counter()
        try:
            for fut in asyncio.as_completed(tasks):
                rec = await fut  # the first failure aborts the run: a partial score would mislead
                records.append(rec)
                bar.update(1)
                bar.set_postfix(acc=f"{sum(r.correct for r in records) / len(records):.3f}")
        finally:
            bar.close()
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
        elapsed = time.perf_counter() - t0

    records.sort(key=lambda r: r.index)
    n = len(records)
    num_correct = sum(r.correct for r in records)
    num_invalid = sum(r.invalid for r in records)
    have_usage = n > 0 and all(r.completion_tokens is not None for r in records)
    out_tokens = sum(r.completion_tokens or 0 for r in records) if have_usage else None
    config = {k: (str(v) if isinstance(v, Path) else v) for k, v in asdict(cfg).items() if k != "api_key"}
    return GSM8KResult(
        model=model,
        base_url=base_url,
        num_shots=len(shots),
        num_questions=n,
        num_correct=num_correct,
        num_invalid=num_invalid,
        accuracy=num_correct / n if n else 0.0,
        invalid_rate=num_invalid / n if n else 0.0,
        latency_s=elapsed,
        output_tokens=out_tokens,
        output_throughput=(out_tokens / elapsed if out_tokens is not None and elapsed > 0 else None),
        config=config,
        records=records,
    )


def run_gsm8k(cfg: GSM8KConfig, progress: bool = True) -> GSM8KResult:
    """Ask ``cfg.num_questions`` GSM8K questions and score the answers.

    Must be called outside a running event loop (use ``run_gsm8k_async`` inside one). Raises
    ``EndpointError`` naming the URL, with HTTP status and body where there is one, on the first
    request the server cannot answer; the run stops there rather than report a partial score.
    Raises ``FileNotFoundError`` / ``ValueError`` for missing or malformed data files.
    """
    return asyncio.run(run_gsm8k_async(cfg, progress=progress))


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the ``gsm8k`` flags to ``parser`` (used by ``breakgraph eval gsm8k`` and ``-m``)."""
    add_endpoint_arguments(parser)
    parser.add_argument(
        "--num-shots",
        type=int,
        default=5,
        help="worked examples from the train set placed before each question (default: %(default)s)",
    )
    parser.add_argument(
        "--num-questions",
        type=int,
        default=200,
        help="test questions to ask, -1 for all of them (default: %(default)s)",
    )
    parser.add_argument(
        "--parallel", type=int, default=16, help="requests in flight at once (default: %(default)s)"
    )
    parser.add_argument(
        "--max-tokens", type=int, default=256, help="max_tokens for each completion (default: %(default)s)"
    )
    parser.add_argument(
        "--data",
        type=Path,
        default=DEFAULT_DATA_DIR,
        help="folder with test.jsonl and train.jsonl ({question, answer} per line); "
        "default: the copy shipped in the package",
    )
    parser.add_argument(
        "--output",
        type=Path,
        default=None,
        help="write the summary and per-question records to this JSON file",
    )
    parser.add_argument(
        "--seed",
        type=int,
        default=None,
        help="sample questions and shots at random with this seed; default: the first questions "
        "and shots in file order",
    )


def main(args: argparse.Namespace) -> int:
    """Run from parsed flags; print the summary. Returns 0 on success, 1 when the server failed,
    2 for bad flags or data."""
    try:
        cfg = GSM8KConfig(
            base_url=args.base_url,
            model=args.model,
            num_shots=args.num_shots,
            num_questions=args.num_questions,
            parallel=args.parallel,
            max_tokens=args.max_tokens,
            data_dir=args.data,
            api_key=args.api_key,
            seed=args.seed,
            timeout=args.timeout,
        )
        normalize_base_url(cfg.base_url)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    try:
        result = run_gsm8k(cfg, progress=not args.no_progress)
    except EndpointError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    except (FileNotFoundError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(result.summary())
    if args.output is not None:
        args.output.parent.mkdir(parents=True, exist_ok=True)
        args.output.write_text(json.dumps(result.to_json(), indent=2) + "\n", encoding="utf-8")
        print(f"  wrote {args.output}")
    return 0


if __name__ == "__main__":
    _parser = argparse.ArgumentParser(
        prog="python -m breakgraph.eval.gsm8k", description=__doc__.split("\n")[0].replace("``", "")
    )
    add_arguments(_parser)
    sys.exit(main(_parser.parse_args()))
