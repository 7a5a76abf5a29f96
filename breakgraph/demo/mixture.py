"""The demo model's training mixture: the whole-question templates (:mod:`~breakgraph.demo.problems`),
the worded generator (:mod:`~breakgraph.demo.wordings`), the phrase generator
(:mod:`~breakgraph.demo.phrasebank`), the varied story generator (:mod:`~breakgraph.demo.varied`),
the clause grammar (:mod:`~breakgraph.demo.grammar`), the operation-choice stories
(:mod:`~breakgraph.demo.choices`), problems of all of these with open-pool fillers for their names,
nouns, units and verbs (:mod:`~breakgraph.demo.fillers`, source ``fillers``) and, on request, GSM8K's
easiest train problems. Every ``<<a op b=c>>`` of a drawn mixture is checked to be exact
(:func:`check_annotations`).

The default mixture has no GSM8K share: problems far beyond the model taught it to answer an
unfamiliar question with invented GSM8K-style prose instead of calculations on the question's
own numbers. GSM8K (MIT licence, ``breakgraph/eval/data/gsm8k/``) can still be mixed in
(``{"gsm8k": share}``); only problems whose
every calculation is one ``a op b`` on whole numbers up to 1000, at most four of them, whose stated
numbers are at most 1000 and whose question is under 300 characters are used (about 2,400 of its
7,473 train problems); the GSM8K test split is never read here.
"""

from __future__ import annotations

import json
import multiprocessing
import random
import re
import sys
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from functools import lru_cache
from pathlib import Path

from breakgraph.demo.choices import generate_choices
from breakgraph.demo.fillers import generate_filled
from breakgraph.demo.grammar import generate_grammar
from breakgraph.demo.phrasebank import generate_phrases
from breakgraph.demo.problems import Problem, _test_keys, normalise_question, train_split
from breakgraph.demo.quoting import with_quotes
from breakgraph.demo.varied import generate_varied
from breakgraph.demo.wordings import generate_wordings

GSM8K_TRAIN = Path(__file__).resolve().parent.parent / "eval" / "data" / "gsm8k" / "train.jsonl"
SOURCES = ("templates", "wordings", "phrases", "varied", "grammar", "choices", "fillers", "gsm8k")
# Shares of the mixture by source.
DEFAULT_SHARES = {"templates": 0.1, "wordings": 0.1, "phrases": 0.2, "varied": 0.3, "grammar": 0.3}

_ANNOTATION = re.compile(r"<<([^=<>]+)=([^<>]+)>>")
_BINARY = re.compile(r"(\d+)([-+*/])(\d+)")
_OPS = {"+": lambda x, y: x + y, "-": lambda x, y: x - y, "*": lambda x, y: x * y, "/": lambda x, y: x / y}


def _easy(question: str, answer: str) -> bool:
    calcs = _ANNOTATION.findall(answer)
    if not 1 <= len(calcs) <= 4 or len(question) >= 300:
        return False
    for expr, value in calcs:
        m = _BINARY.fullmatch(expr.strip())
        if not m or not value.strip().isdigit():
            return False
        x, op, y, v = int(m[1]), m[2], int(m[3]), int(value)
        if max(x, y, v) > 1000 or (op == "/" and y == 0) or _OPS[op](x, y) != v:
            return False
    stated = [float(n) for n in re.findall(r"\d+(?:\.\d+)?", question.replace(",", ""))]
    return bool(stated) and max(stated) <= 1000


@lru_cache(maxsize=1)
def _gsm8k_easy(path: str) -> tuple[Problem, ...]:
    out = []
    with open(path, encoding="utf-8") as f:
        for line in f:
            if line.strip():
                row = json.loads(line)
                if _easy(row["question"], row["answer"]):
                    final = int(row["answer"].rsplit("####", 1)[1].strip().replace(",", ""))
                    out.append(Problem(row["question"], row["answer"], final, "gsm8k"))
    return tuple(out)


def gsm8k_easy(path: str | Path = GSM8K_TRAIN) -> list[Problem]:
    """GSM8K train problems that pass the filter above (empty when the file is absent)."""
    return list(_gsm8k_easy(str(path))) if Path(path).is_file() else []


CHUNK = 20_000  # generated problems per chunk; chunks have their own seeds and run in parallel
_GENERATORS = {"templates": (train_split, 5), "wordings": (generate_wordings, 11),
               "phrases": (generate_phrases, 23), "varied": (generate_varied, 37),
               "grammar": (generate_grammar, 41), "choices": (generate_choices, 43),
               "fillers": (generate_filled, 47)}  # fmt: skip


def _chunk(source: str, count: int, seed: int, index: int) -> list[Problem]:
    """Chunk ``index`` of a source: ``count`` problems of its own seed, none in the template test
    pool, a few roughened (:func:`roughen`), each answer opened by its quotes
    (:func:`~breakgraph.demo.quoting.with_quotes`)."""
    generate, salt = _GENERATORS[source]
    chunk_seed = (seed * 7919 + salt) * 1009 + index
    held = _test_keys()
    pool = generate(count * 21 // 20 + 10, chunk_seed)
    rng = random.Random(chunk_seed)
    return [with_quotes(roughen(p, rng)) for p in pool if normalise_question(p.question) not in held][:count]


def roughen(problem: Problem, rng: random.Random, p: float = 0.04) -> Problem:
    """``problem`` as people sometimes type it: with chance ``p`` each, all lower case and without
    its question marks (the words and the answer stay)."""
    q = problem.question
    if rng.random() < p:
        q = q.lower()
    if rng.random() < p:
        q = q.replace("?", "")
    return problem if q == problem.question else Problem(q, problem.answer, problem.final, problem.template)


def _run_chunks(jobs: list[tuple], workers: int) -> list[list[Problem]]:
    """:func:`_chunk` of every job, in ``workers`` spawned processes; in this process when
    ``workers`` is 1, there is one job, or the processes cannot be had (then says so on stderr)."""
    if workers > 1 and len(jobs) > 1:
        try:
            ctx = multiprocessing.get_context("spawn")
            with ProcessPoolExecutor(min(workers, len(jobs)), mp_context=ctx) as pool:
                return list(pool.map(_chunk, *zip(*jobs)))
        except (OSError, BrokenProcessPool) as e:
            print(f"data workers failed ({e!r}); generating in this process", file=sys.stderr)
    return [_chunk(*job) for job in jobs]


def _generated(counts: dict[str, int], seed: int, workers: int) -> list[Problem]:
    """``counts[source]`` distinct problems of each generated source, from chunks of ``CHUNK``
    (the same problems for every ``workers``), the chunks run in ``workers`` processes."""
    out: dict[str, list[Problem]] = {s: [] for s in counts}
    seen: dict[str, set[str]] = {s: set() for s in counts}
    first = dict.fromkeys(counts, 0)  # the next chunk index of each source
    while any(len(out[s]) < counts[s] for s in counts):
        jobs = []
        for s in counts:
            need = counts[s] - len(out[s])
            jobs += [(s, min(CHUNK, need - i * CHUNK), seed, first[s] + i) for i in range(-(-need // CHUNK))]
        parts = _run_chunks(jobs, workers)
        for (s, _, _, index), part in zip(jobs, parts):
            first[s] = max(first[s], index + 1)
            for p in part:
                key = normalise_question(p.question)
                if key not in seen[s] and len(out[s]) < counts[s]:
                    seen[s].add(key)
                    out[s].append(p)
    return [p for s in counts for p in out[s]]


def make_mixture(n: int, seed: int, shares: dict[str, float] | None = None, workers: int = 1) -> list[Problem]:
    """``n`` training problems drawn by ``shares`` (default ``DEFAULT_SHARES``) and shuffled with
    ``seed``; generated answers open with their quotes (:mod:`~breakgraph.demo.quoting`).
    Generated problems are distinct within a source; the ~2,400 GSM8K ones repeat when their share
    asks for more. No question equals one of the template test pool's (``problems.train_split``).
    ``workers`` processes generate the chunks; the result does not depend on it."""
    shares = DEFAULT_SHARES if shares is None else shares
    unknown = set(shares) - set(SOURCES)
    if unknown:
        raise ValueError(f"unknown mixture sources {sorted(unknown)}; use {sorted(SOURCES)}")
    total = sum(shares.values())
    counts = {k: int(round(n * v / total)) for k, v in shares.items()}
    counts[max(counts, key=counts.get)] += n - sum(counts.values())
    out = _generated({s: counts[s] for s in _GENERATORS if counts.get(s)}, seed, workers)
    if counts.get("gsm8k"):
        easy = gsm8k_easy()
        out += [easy[i % len(easy)] for i in range(counts["gsm8k"])] if easy else []
    check_annotations(out)
    random.Random(seed).shuffle(out)
    return out


def check_annotations(problems: list[Problem]) -> None:
    """Raise ``ValueError`` naming the first problem whose answer has a ``<<a op b=c>>`` with ``c``
    not exactly ``a op b`` (whole numbers; GSM8K's annotations of other shapes are skipped)."""
    for p in problems:
        if p.template == "gsm8k":  # already exact: _easy keeps only such problems
            continue
        for expr, value in _ANNOTATION.findall(p.answer):
            m = _BINARY.fullmatch(expr.strip())
            if m is None or not value.strip().isdigit():
                raise ValueError(f"annotation <<{expr}={value}>> of {p.question!r} is not a op b on whole numbers")
            x, op, y = int(m[1]), m[2], int(m[3])
            if (op == "/" and (y == 0 or x % y)) or _OPS[op](x, y) != int(value):
                raise ValueError(f"annotation <<{expr}={value}>> of {p.question!r} is not exact")
