"""The held-out phrasing split: enough problems, right answers, and phrased unlike any training
problem (no five-word run in common, names, numbers and the generators' nouns normalised away)."""

from __future__ import annotations

import json
import random
import re

import pytest

from breakgraph.demo import choices, fillers, grammar, heldout_writer, phrasebank, problems, varied, wordings
from breakgraph.demo.heldout import HELDOUT_FILE, dev_phrasings, heldout_phrasings, must_answer
from breakgraph.demo.mixture import gsm8k_easy

RUN = 5

_NAMES = {n.lower() for n, _ in problems.NAMES + wordings.PEOPLE + phrasebank.PEOPLE + heldout_writer.PEOPLE}
_NUMBER_WORDS = set(wordings.NUMBER_WORDS) | set(heldout_writer.WORDS)
_NOUNS = sorted(
    {n for sg, pl, _ in wordings.THINGS for n in (sg, pl)}
    | {n for pair in wordings.BOXES + problems.CONTAINERS for n in pair}
    | set(problems.FOODS + problems.ITEMS + problems.GIFTS + problems.EVENTS + wordings.GIFTS),
    key=len,
    reverse=True,
)
_NOUN_RE = re.compile(r"\b(" + "|".join(re.escape(n) for n in _NOUNS) + r")\b")


def words(text: str) -> list[str]:
    """Lower-case words with names and numbers as ``#`` and the generators' nouns as ``*``."""
    out = []
    for w in re.findall(r"[a-z]+|\d+", _NOUN_RE.sub(" zznoun ", text.lower())):
        out.append("#" if w.isdigit() or w in _NAMES or w in _NUMBER_WORDS else "*" if w == "zznoun" else w)
    return out


def runs(text: str) -> set[tuple[str, ...]]:
    ws = words(text)
    return {tuple(ws[i : i + RUN]) for i in range(len(ws) - RUN + 1)}


def training_texts() -> list[str]:
    """A large sample of every training source's questions: the templates (several seeds), the
    worded generator, the phrase generator, the varied generator, the clause grammar, the
    operation-choice stories, every tenth of those problems with open-pool fillers (as the
    mixture's ``fillers`` source writes them) and the GSM8K problems the mixture can use."""
    drawn = [p for seed in (0, 1, 2) for p in problems.generate(20000, seed)]
    drawn += [p for seed in (0, 1, 2, 3) for p in wordings.generate_wordings(40000, seed)]
    drawn += [p for seed in (0, 1, 2) for p in phrasebank.generate_phrases(40000, seed)]
    drawn += [p for seed in (0, 1, 2) for p in varied.generate_varied(50000, seed)]
    drawn += [p for seed in (0, 1, 2, 3) for p in grammar.generate_grammar(50000, seed)]
    drawn += [p for seed in (0, 1, 2, 3) for p in choices.generate_choices(30000, seed)]
    rng = random.Random(0)
    texts = [p.question for p in drawn] + [fillers.fill(p, rng).question for p in drawn[::10]]
    texts += [p.question for p in gsm8k_easy()]
    return texts


@pytest.fixture(scope="module")
def heldout():
    return heldout_phrasings()


def test_the_file_has_enough_problems_with_whole_answers(heldout):
    assert len(heldout) >= 300
    assert len({p.question for p in heldout}) == len(heldout)
    assert all(1 <= p.final <= 1000 for p in heldout)
    rows = [json.loads(line) for line in HELDOUT_FILE.read_text().splitlines()]
    assert len({r["phrasing"] for r in rows}) >= 40


def test_the_file_is_what_the_writer_writes(tmp_path):
    out = tmp_path / "h.jsonl"
    heldout_writer.write(out)
    assert out.read_text() == HELDOUT_FILE.read_text()


@pytest.mark.slow
def test_no_five_word_run_of_a_heldout_question_occurs_in_training():
    seen: set[tuple[str, ...]] = set()
    for text in training_texts():
        seen |= runs(text)
    shared = {}
    for p in heldout_phrasings():
        for r in runs(p.question) & seen:
            shared.setdefault(" ".join(r), p.question)
    assert not shared, f"{len(shared)} shared runs, e.g. {list(shared.items())[:8]}"


def test_the_check_sees_a_shared_run():
    seen = set().union(*(runs(p.question) for p in problems.generate(200, 0)))
    question = problems.generate(1, 0)[0].question
    copy = re.sub(r"\d+", lambda m: str(int(m.group()) + 1), question)  # other numbers, same words
    assert copy != question and runs(copy) & seen
    assert words("Rosa has 12 apples, twelve boxes") == ["#", "has", "#", "*", "#", "*"]


def test_the_readme_and_cli_prompts_are_among_those_the_gate_checks():
    from breakgraph.cli import DEFAULT_PROMPT

    asked = [problems.format_prompt(p.question) for p in must_answer()]
    assert DEFAULT_PROMPT in asked and problems.format_prompt("2+3?") in asked


def test_the_dev_file_has_distinct_problems_with_whole_answers():
    dev = dev_phrasings()
    assert len(dev) >= 60 and len({p.question for p in dev}) == len(dev)
    assert all(1 <= p.final <= 1000 and p.template == "dev" for p in dev)
    assert not {p.question for p in dev} & {p.question for p in heldout_phrasings()}
