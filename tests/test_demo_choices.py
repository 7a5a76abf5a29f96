"""The operation-choice generator (breakgraph/demo/choices.py): exact steps in range, operands
the question states and the quotes name, the operation each story kind implies, every kind drawn,
and determinism (CPU, a second)."""

from __future__ import annotations

import re
from collections import Counter

import pytest
from demo_answers import steps

from breakgraph.demo import choices, phrasebank
from breakgraph.demo.mixture import check_annotations
from breakgraph.demo.problems import Problem
from breakgraph.demo.quoting import quotes, stated_operands

_NUMBERS = {w: i for i, w in enumerate(phrasebank.NUMBER_WORDS)}
_IMPLIED = {"half": 2, "third": 3, "quarter": 4, "twice": 2, "double": 2}  # words that carry a number


@pytest.fixture(scope="module")
def sample() -> list[Problem]:
    return choices.generate_choices(3000, seed=4)


def test_choices_steps_are_exact_stated_and_quoted(sample):
    check_annotations(sample)
    for p in sample:
        got = steps(p)
        assert 1 <= len(got) <= 3 and all(1 <= c <= choices.MAX_RESULT for *_, c in got)
        known = {int(x) for x in re.findall(r"\d+", p.question)}
        known |= {_NUMBERS[w] for w in re.findall(r"[a-z]+", p.question.lower()) if w in _NUMBERS}
        stated = set(known)
        known |= {d for word, d in _IMPLIED.items() if word in p.question.lower()}
        for a, _, b, c in got:
            assert {a, b} <= known, (p.question, p.answer)
            known.add(c)
        said = " ".join(quotes(p.question, p.answer)).lower()
        for x in set(stated_operands(p.answer)) & stated:
            assert str(x) in said or phrasebank.NUMBER_WORDS[min(x, 20)] in said.split(), (p.question, said)


def test_each_choices_kind_uses_its_operation_and_all_occur(sample):
    last = {"left": "-", "to_go": "-", "gap": "-", "change": "-", "to_a": "/", "rate": "*", "stock_plus_packs": "+",
            "two_kinds": "+-", "by_amount": "+-", "for_every": "*", "share": "/", "age": "+-", "measured": "+", "part_of": "/", "done_of": "-",
            "all_but": "-", "each_bring": "*-", "spend": "+", "pool_share": "/", "earn_spend": "-",
            "save_split": "/", "multiple_then": "-", "in_and_out": "-", "in_question": "-+*/", "until": "+-"}  # fmt: skip  (in_question: the next test)
    kinds = Counter(p.template.split("/")[1] for p in sample)
    assert set(kinds) == set(last) and min(kinds.values()) > 50
    for p in sample:
        assert steps(p)[-1][1] in last[p.template.split("/")[1]], (p.question, p.answer)


def _number(word: str) -> int:
    return int(word) if word.isdigit() else _NUMBERS[word.lower()]


def test_counted_things_and_the_other_kind_are_not_operands(sample):
    """Two boxes "of 5 and 7 kg" add 5 and 7, never the two; "12 cats and 30 dogs ... 4 more
    cats" starts from the 12 cats, never from the dogs."""
    things = "|".join(t for t, _, _ in choices.MEASURED)
    seen = Counter()
    for p in sample:
        kind, got = p.template.split("/")[1], steps(p)
        if kind == "measured":
            count = re.search(rf"\b(two|three|2|3|both|all three) ({things})\b", p.question, re.I)
            parts = {"two": 2, "both": 2, "three": 3, "all three": 3}.get(count[1].lower()) or int(count[1])
            assert parts == len(got) + 1 and {op for _, op, _, _ in got} == {"+"}, (p.question, p.answer)
            seen[kind] += 1
        if kind == "two_kinds":
            plurals = {pl for pair in choices.SIDE_BY_SIDE for pl in pair}
            question = [
                s for s in re.split(r"(?<=[.?]) ", p.question) if "?" in s or s.startswith(("How", "Count"))
            ]
            asked = max((pl for pl in plurals if re.search(rf"\b{pl}\b", question[0])), key=len)
            held = re.search(rf"\b(\w+) {asked} and|and (\w+) {asked}\b", p.question)
            assert got[0][0] == _number(held[1] or held[2]), (p.question, p.answer)
            seen[kind] += 1
    assert min(seen.values()) > 100 and len(seen) == 2


def test_choices_are_deterministic_and_prefix_stable():
    assert choices.generate_choices(200, 9) == choices.generate_choices(400, 9)[:200]
    assert choices.generate_choices(50, 9) != choices.generate_choices(50, 10)


def test_a_number_in_an_aside_beside_the_name_is_neither_operand_nor_result(sample):
    """", aged 9," or ", from flat 7," after the first name adds a number no step uses or gives;
    never in an age story (whose first fact is an age) nor before a possessive."""
    aside = re.compile(r"^\w+(?:, aged (\w+),|, who is (\w+),| \((\w+) years old\)|, (\w+) years old,|, from flat (\d+),)")
    seen = 0
    for p in sample:
        body = [s for s in re.split(r"(?<=[.?]) ", p.question) if "?" not in s]
        hit = next((m for s in body if (m := aside.match(s))), None)
        if hit is None:
            continue
        k = _number(next(g for g in hit.groups() if g))
        assert k not in {x for a, _, b, c in steps(p) for x in (a, b, c)}, (p.question, p.answer)
        assert p.template != "choices/age" and not p.question[hit.end() :].startswith("'s"), p.question
        seen += 1
    assert seen > 100


def test_questions_that_hold_every_fact_use_the_operation_their_words_name(sample):
    ops = {"change": "-", "comes back": "-", "gap": "-", "apart": "-", "differ": "-", "total": "+", "together": "+",
           "in all": "+", "earn": "*", "bring": "*", "shared": "/", "split": "/"}  # fmt: skip
    seen = 0
    for p in sample:
        if p.template == "choices/in_question":
            question = next(s for s in re.split(r"(?<=[.?]) ", p.question) if "?" in s)
            named = {op for word, op in ops.items() if word in question}
            assert named == {steps(p)[-1][1]}, (p.question, p.answer)
            seen += 1
    assert seen > 100
