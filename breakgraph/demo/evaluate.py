"""Accuracy of a demo checkpoint: final answers on the template split, the held-out phrasing
split and the example prompts, and separately the arithmetic of its own calculator annotations.

Final-answer accuracy: :func:`~breakgraph.demo.problems.extract_answer` of the greedy completion
of ``format_prompt(question)`` equals the expected integer. Annotation accuracy: over every
``<<a op b=c>>`` the model writes (``op`` one of ``+ - * /``, whole numbers), the share with
``c == a op b`` exactly; annotations of any other shape count as wrong.

Run (about a minute on a CPU core for the default model)::

    python -m breakgraph.demo.evaluate --model breakgraph/demo/assets/glm5-tiny-arith
"""

from __future__ import annotations

import argparse
import json
import re
import time
from dataclasses import dataclass, field
from fractions import Fraction
from pathlib import Path

from tokenizers import Tokenizer

from breakgraph.demo.heldout import dev_phrasings, heldout_phrasings, must_answer
from breakgraph.demo.problems import Problem, extract_answer, format_prompt, test_split

_ANNOTATION = re.compile(r"<<([^<>]*)>>")
_BINARY = re.compile(r"\s*(\d+)\s*([-+*/])\s*(\d+)\s*=\s*(\d+)\s*")


def annotation_correct(body: str) -> bool:
    """Whether ``body`` (the text between ``<<`` and ``>>``) is ``a op b=c`` with ``c`` exact."""
    m = _BINARY.fullmatch(body)
    if not m:
        return False
    a, op, b, c = int(m[1]), m[2], int(m[3]), int(m[4])
    if op == "/" and b == 0:
        return False
    value = {"+": Fraction(a + b), "-": Fraction(a - b), "*": Fraction(a * b), "/": Fraction(a, b or 1)}[op]
    return value == c


def annotations(text: str) -> list[str]:
    """The bodies of the ``<<...>>`` annotations in ``text``, in order."""
    return _ANNOTATION.findall(text)


@dataclass
class EvalResult:
    """Final-answer accuracy over ``total`` problems and annotation accuracy over the
    ``annotations`` written; ``samples`` holds ``(question, completion, expected)``."""

    accuracy: float
    correct: int
    total: int
    seconds: float
    annotations: int = 0
    annotations_correct: int = 0
    samples: list[tuple[str, str, int]] = field(default_factory=list, repr=False)
    kinds: list[str] = field(default_factory=list, repr=False)

    @property
    def annotation_accuracy(self) -> float:
        """Share of the written annotations that are exact; NaN when none was written."""
        return self.annotations_correct / self.annotations if self.annotations else float("nan")

    def misses(self) -> list[tuple[str, str, int]]:
        return [s for s in self.samples if extract_answer(s[1]) != s[2]]


def score(problems: list[Problem], texts: list[str], seconds: float = 0.0) -> EvalResult:
    """Score completions ``texts`` against ``problems`` (same order)."""
    samples = [(p.question, t, p.final) for p, t in zip(problems, texts, strict=True)]
    correct = sum(extract_answer(t) == final for _, t, final in samples)
    bodies = [b for t in texts for b in annotations(t)]
    return EvalResult(
        correct / max(len(problems), 1), correct, len(problems), seconds,
        len(bodies), sum(map(annotation_correct, bodies)), samples, [p.template for p in problems],
    )  # fmt: skip


def complete(
    folder: Path, questions: list[str], device: str = "cpu", max_new_tokens: int = 128, dtype: str = "float32"
) -> list[str]:
    """Greedy completions of ``format_prompt(q)`` for every question, through breakgraph's
    ``Engine`` in ``dtype``, all in one ``generate`` call."""
    from breakgraph import Engine, SamplingParams

    prompts = [format_prompt(q) for q in questions]
    page_size = 16
    per_req = -(-(256 + max_new_tokens) // page_size)
    engine = Engine(
        folder, device=device, dtype=dtype, page_size=page_size, num_pages=len(prompts) * per_req + 1,
        context_length=256 + max_new_tokens, max_running_requests=len(prompts), cuda_graph_backend_prefill="disabled",
    )  # fmt: skip
    outs = engine.generate(prompts, SamplingParams(max_new_tokens=max_new_tokens, temperature=0.0))
    return [o.text for o in outs]


def evaluate(
    folder: Path, problems: list[Problem], device: str = "cpu", max_new_tokens: int = 128, dtype: str = "float32"
) -> EvalResult:
    """Zero-shot greedy accuracy (and annotation accuracy) of the checkpoint in ``folder``."""
    t0 = time.perf_counter()
    texts = complete(folder, [p.question for p in problems], device, max_new_tokens, dtype)
    return score(problems, texts, time.perf_counter() - t0)


def by_kind(result: EvalResult) -> dict[str, tuple[int, int]]:
    """``(correct, total)`` per problem kind of ``result`` (the ``kind`` of the held-out file, or
    the template family before its ``/``), in order of first appearance."""
    out: dict[str, list[int]] = {}
    for (_, text, want), kind in zip(result.samples, result.kinds, strict=True):
        c = out.setdefault(kind.removeprefix("heldout/").split("/")[0], [0, 0])
        c[0] += extract_answer(text) == want
        c[1] += 1
    return {k: (c, n) for k, (c, n) in out.items()}


def by_phrasing(result: EvalResult) -> tuple[int, int, int] | None:
    """Over the held-out phrasing problems of ``result`` (template ``heldout/{kind}/{phrasing}``):
    ``(phrasings answered right in every instance, in none, phrasings)``; None without any. Each
    phrasing is asked several times with other names and numbers: the counts tell a phrasing the
    model does not read from misses on some numbers of it."""
    per: dict[str, list[int]] = {}
    for (_, text, want), kind in zip(result.samples, result.kinds, strict=True):
        parts = kind.split("/")
        if parts[0] == "heldout" and len(parts) == 3:
            c = per.setdefault(parts[2], [0, 0])
            c[0] += extract_answer(text) == want
            c[1] += 1
    if not per:
        return None
    return sum(c == n for c, n in per.values()), sum(c == 0 for c, _ in per.values()), len(per)


SPLITS = ("templates", "phrasings", "dev", "examples")


def split_problems(name: str, n_templates: int = 200) -> list[Problem]:
    """The problems of a named split: ``templates`` (``test_split(n_templates)``), ``phrasings``
    (the held-out phrasing file), ``dev`` (the hand-written dev file) or ``examples`` (the
    README's and the issue's prompts)."""
    if name == "templates":
        return test_split(n_templates)
    if name == "phrasings":
        return heldout_phrasings()
    if name == "dev":
        return dev_phrasings()
    if name == "examples":
        return must_answer()
    raise ValueError(f"unknown split {name!r}; choose from {', '.join(SPLITS)}")


def evaluate_splits(
    folder: Path, splits: tuple[str, ...] = SPLITS, device: str = "cpu", n_templates: int = 200, log=print,
    dtype: str = "float32",
) -> dict[str, EvalResult]:
    """Evaluate every split in one engine run and ``log`` one line per split plus the annotation
    accuracy over all of them; returns the results by split name (and ``"all"``)."""
    t0 = time.perf_counter()
    by_split = {s: split_problems(s, n_templates) for s in splits}
    everything = [p for s in splits for p in by_split[s]]
    texts = complete(folder, [p.question for p in everything], device, dtype=dtype)
    seconds = time.perf_counter() - t0
    results, i = {}, 0
    for s in splits:
        n = len(by_split[s])
        results[s] = score(by_split[s], texts[i : i + n], seconds)
        i += n
    results["all"] = score(everything, texts, seconds)
    tok = Tokenizer.from_file(str(Path(folder) / "tokenizer.json"))
    topk = json.loads((Path(folder) / "config.json").read_text()).get("index_topk")
    labels = {"templates": f"held-out template accuracy (test_split({n_templates}))",
              "phrasings": "held-out phrasing accuracy (data/heldout_phrasings.jsonl)",
              "dev": "dev phrasing accuracy (data/dev_phrasings.jsonl)",
              "examples": "example prompts (README and issue)"}  # fmt: skip
    for s in splits:
        r = results[s]
        mean_len = sum(len(tok.encode(format_prompt(p.question)).ids) for p in by_split[s]) / max(r.total, 1)
        log(f"{labels[s]}: {r.accuracy:.3f} ({r.correct}/{r.total}) | mean prompt {mean_len:.0f} tokens, index_topk {topk}")
    for s in splits:
        kinds = by_kind(results[s])
        if len(kinds) > 1:
            log(f"  {s} by kind: " + ", ".join(f"{k} {c}/{n}" for k, (c, n) in kinds.items()))
        phrasings = by_phrasing(results[s])
        if phrasings is not None:
            log(f"  {s}: {phrasings[0]} of {phrasings[2]} phrasings right in every instance, {phrasings[1]} in none")
    a = results["all"]
    log(
        f"annotation accuracy (<<a op b=c>> with c exact, all splits): {a.annotation_accuracy:.4f} "
        f"({a.annotations_correct}/{a.annotations}) | Engine greedy {dtype} on {device}, {seconds:.0f}s"
    )
    return results


def main(argv: list[str] | None = None) -> dict[str, EvalResult]:
    p = argparse.ArgumentParser(description="Accuracy of a demo checkpoint on its held-out splits.")
    p.add_argument("--model", type=Path, required=True, help="checkpoint folder")
    p.add_argument("--device", default="cpu", help="device to run the engine on")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"], help="engine dtype")
    p.add_argument("--splits", default=",".join(SPLITS), help=f"comma-separated, from {', '.join(SPLITS)}")
    p.add_argument("--template-problems", type=int, default=200, help="size of the template split")
    p.add_argument("--show-misses", type=int, default=0, help="print this many wrong answers per split")
    args = p.parse_args(argv)
    splits = tuple(s for s in args.splits.split(",") if s)
    for s in splits:
        if s not in SPLITS:
            p.error(f"--splits: unknown split {s!r}; choose from {', '.join(SPLITS)}")
    results = evaluate_splits(args.model, splits, args.device, args.template_problems, dtype=args.dtype)
    for s in splits:
        for q, text, want in results[s].misses()[: args.show_misses]:
            print(f"[{s}] Q: {q}\n  A: {text!r} (expected {want})")
    return results


if __name__ == "__main__":
    main()
