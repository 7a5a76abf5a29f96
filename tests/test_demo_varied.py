"""The varied story generator (breakgraph/demo/varied.py): exact steps in range, operands the
question states, the operation each story kind implies, the surface forms it is for, pronouns
that point at one person only, and determinism (CPU, a few seconds)."""

from __future__ import annotations

import re
from collections import Counter

import pytest
from demo_answers import steps

from breakgraph.demo import varied
from breakgraph.demo.evaluate import annotation_correct, annotations
from breakgraph.demo.mixture import check_annotations
from breakgraph.demo.problems import Problem

_WORDS = {w: i for i, w in enumerate(varied.NUMBER_WORDS)}


@pytest.fixture(scope="module")
def sample() -> list[Problem]:
    return varied.generate_varied(6000, seed=5)


def test_every_step_is_exact_in_range_and_the_last_is_the_answer(sample):
    for p in sample:
        got = steps(p)
        assert 1 <= len(got) <= 4 and got[-1][3] == p.final
        for a, op, b, c in got:
            assert {"+": a + b, "-": a - b, "*": a * b, "/": a / b}[op] == c and 1 <= c <= 1000, p.answer
            if p.template != "varied/drill" and op == "*":
                assert min(a, b) <= 12, p.answer
            if p.template != "varied/drill" and op == "/":
                assert b <= 12, p.answer
        assert all(annotation_correct(body) for body in annotations(p.answer))
    check_annotations(sample)


def test_the_annotation_check_refuses_an_inexact_step():
    bad = Problem("What is 7*8?", "7*8 = <<7*8=54>>54\n#### 54", 54, "varied/drill")
    with pytest.raises(ValueError, match="not exact"):
        check_annotations([bad])
    with pytest.raises(ValueError, match="not exact"):
        check_annotations([Problem("What is 7/2?", "7/2 = <<7/2=3>>3\n#### 3", 3, "varied/drill")])


def test_operands_are_stated_numbers_or_earlier_results(sample):
    """Every operand is a number the question states (digits, also inside "7-dollar", or a word up
    to twenty), an earlier result, or the 2 or 3 of "twice", "double", "half", "three times"..."""
    for p in sample:
        known = {int(x) for x in re.findall(r"\d+", p.question)}
        known |= {_WORDS[w] for w in re.findall(r"[a-z]+", p.question.lower()) if w in _WORDS}
        if re.search(r"twice|doubl|half|two times", p.question):
            known.add(2)
        if re.search(r"three times|tripl|thrice", p.question):
            known.add(3)
        for a, _, b, c in steps(p):
            assert {a, b} <= known, (p.question, p.answer)
            known.add(c)


def test_each_story_kind_uses_its_operation(sample):
    """Sums add, differences and change subtract last, groups multiply, shares divide."""
    last = {"combine": "+", "difference": "-", "change": "-", "share": "/"}
    for p in sample:
        kind = p.template.split("/")[1]
        ops = [op for _, op, _, _ in steps(p)]
        if kind in last:
            assert ops[-1] == last[kind], (p.question, p.answer)
        if kind == "groups":
            assert ops == ["*"], (p.question, p.answer)
        if kind == "change":
            assert steps(p)[-1][0] in {10, 20, 50, 100, 200, 500}, p.question


def test_the_surface_forms_it_is_for_all_occur(sample):
    texts = [p.question for p in sample]
    kinds = Counter(p.template for p in sample)
    assert set(kinds) == {f"varied/{k}" for k in varied.STORIES}
    for pattern in (
        r"\b\d+-(dollar|euro|pound|franc|rupee|peso|metre|meter|centimetre|foot)\b",  # a number inside a word
        r"\b(one|two|three|four|five|six|seven|eight|nine|ten|eleven|twelve)\b",  # number words
        r"dearer|pricier", r"cheaper", r"heavier|lighter", r"older|younger", r"difference|by how much|how far apart",
        r"\b(count|total|tally)\b", r"^(Work out|Find|Give|Compute|Determine|State|Calculate) [^?]*: ",  # question before a colon
        r"^(How|What)[^.]*\? [A-Z]",  # question first
        r"degrees|o'clock|lives at number|years old|minutes",  # distractors
        r"\b(she|he|her|his|him|it|its)\b",  # pronouns
        r"\d+ ?(m|cm|km|kg|g|L|ft)\b",  # short units
    ):
        assert any(re.search(pattern, t) for t in texts), pattern


def test_a_pronoun_appears_only_with_one_person_of_its_kind(sample):
    for p in sample:
        assert "\x00" not in p.question
        named = [n for n, _ in varied.PEOPLE if re.search(rf"\b{n}\b", p.question)]
        sexes = Counter(dict(varied.PEOPLE)[n] for n in named)
        if re.search(r"\b([Ss]he|[Hh]er)\b", p.question):
            assert sexes["f"] == 1, p.question
        if re.search(r"\b([Hh]e|[Hh]is|[Hh]im)\b", p.question):
            assert sexes["m"] == 1, p.question


def test_generation_is_deterministic_and_prefix_stable():
    a = varied.generate_varied(300, seed=2)
    assert a == varied.generate_varied(300, seed=2)
    assert varied.generate_varied(100, seed=2) == a[:100]
    assert a != varied.generate_varied(300, seed=3)
    assert len({p.question for p in a}) == 300
