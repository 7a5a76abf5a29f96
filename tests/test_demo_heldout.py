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
_NOUN_ALTERNATION = r"\b(" + "|".join(re.escape(n) for n in _NOUNS) + r")\b"  # longest first


def _trie(strings: list[str]) -> str:
    """A pattern matching exactly ``strings``, as a trie: one branch per next character, the
    longer strings tried first at each node, so at any position it matches what the
    longest-first alternation of them matches (``test_the_check_sees_a_shared_run`` compares
    the two) in a few steps instead of one per string."""
    root: dict = {}
    for s in strings:
        node = root
        for ch in s:
            node = node.setdefault(ch, {})
        node[""] = {}

    def pattern(node: dict) -> str:
        branches = [re.escape(ch) + pattern(child) for ch, child in sorted(node.items()) if ch]
        if not branches:
            return ""
        body = branches[0] if len(branches) == 1 and "" not in node else "(?:" + "|".join(branches) + ")"
        return body + "?" if "" in node else body

    return pattern(root)


_NOUN_RE = re.compile(r"\b(" + _trie(_NOUNS) + r")\b")
_TOKEN_RE = re.compile(r"[a-z]+|\d+")
_MARK = {w: "#" for w in _NAMES | _NUMBER_WORDS} | {"zznoun": "*"}


def words(text: str) -> list[str]:
    """Lower-case words with names and numbers as ``#`` and the generators' nouns as ``*``."""
    return [
        "#" if w[0].isdigit() else _MARK.get(w, w)
        for w in _TOKEN_RE.findall(_NOUN_RE.sub(" zznoun ", text.lower()))
    ]


def runs(text: str) -> set[tuple[str, ...]]:
    ws = words(text)
    return set(zip(*(ws[i:] for i in range(RUN))))


def training_texts() -> list[str]:
    """A large sample of every training source's questions: the templates (several seeds), the
    worded generator, the phrase generator, the varied generator, the clause grammar, the
    operation-choice stories, every tenth of those problems with open-pool fillers (as the
    mixture's ``fillers`` source writes them) and the GSM8K problems the mixture can use.

    The samples stay this large: each source's last seed still adds runs the earlier seeds lack
    (the share of its five-word run occurrences that are new: wordings 1.4 %, phrases 11.5 %,
    varied 17.9 %, grammar 7.1 %, choices 1.4 %, the filled templates 61 %). Only the plain
    templates saturate (seed 1 adds 1 run to seed 0's 2,355, seed 2 none), and their seeds 1
    and 2 still feed the filled sample."""
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
    heldout_runs: dict[tuple[str, ...], str] = {}  # run -> the first held-out question with it
    for p in heldout_phrasings():
        for r in runs(p.question):
            heldout_runs.setdefault(r, p.question)
    shared = {}
    for text in training_texts():
        for r in runs(text) & heldout_runs.keys():
            shared.setdefault(" ".join(r), heldout_runs[r])
    assert not shared, f"{len(shared)} shared runs, e.g. {list(shared.items())[:8]}"


def test_the_check_sees_a_shared_run():
    seen = set().union(*(runs(p.question) for p in problems.generate(200, 0)))
    question = problems.generate(1, 0)[0].question
    copy = re.sub(r"\d+", lambda m: str(int(m.group()) + 1), question)  # other numbers, same words
    assert copy != question and runs(copy) & seen
    assert words("Rosa has 12 apples, twelve boxes") == ["#", "has", "#", "*", "#", "*"]
    # the trie of the nouns marks what their longest-first alternation marks
    plain = re.compile(_NOUN_ALTERNATION)
    texts = [p.question.lower() for p in problems.generate(300, 1) + varied.generate_varied(300, 1)]
    texts += ["toy cars toy car toy robots board games", "3apples apples3 apples_ tennis  balls"]
    assert [_NOUN_RE.sub(" zznoun ", t) for t in texts] == [plain.sub(" zznoun ", t) for t in texts]


def test_the_readme_and_cli_prompts_are_among_those_the_gate_checks():
    from breakgraph.cli import DEFAULT_PROMPT

    asked = [problems.format_prompt(p.question) for p in must_answer()]
    assert DEFAULT_PROMPT in asked and problems.format_prompt("2+3?") in asked


def test_the_dev_file_has_distinct_problems_with_whole_answers():
    dev = dev_phrasings()
    assert len(dev) >= 60 and len({p.question for p in dev}) == len(dev)
    assert all(1 <= p.final <= 1000 and p.template == "dev" for p in dev)
    assert not {p.question for p in dev} & {p.question for p in heldout_phrasings()}


def test_the_phrasing_report_counts_phrasings_right_in_every_instance_and_in_none(heldout):
    from breakgraph.demo.evaluate import by_kind, by_phrasing, score

    # answer every instance of the first phrasing, none of the second, one instance of the third
    names = [p.template.split("/")[2] for p in heldout]
    first, second, third = list(dict.fromkeys(names))[:3]
    texts = []
    seen_third = False
    for p, name in zip(heldout, names):
        right = name == first or (name == third and not seen_third)
        seen_third |= name == third
        texts.append(f"#### {p.final if right else p.final + 1}")
    result = score(heldout, texts)
    phrasings = len(set(names))
    assert by_phrasing(result) == (1, phrasings - 2, phrasings)
    assert sum(n for _, n in by_kind(result).values()) == len(heldout)  # kinds still group by kind
    assert by_phrasing(score(must_answer(), ["#### 0"] * len(must_answer()))) is None
