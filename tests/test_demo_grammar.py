"""The clause grammar generator (breakgraph/demo/grammar.py): exact steps in range, operands the
question states and the quotes name, the operation each story kind implies, every story kind
and the surface variations drawn, and determinism (CPU, a few seconds)."""

from __future__ import annotations

import re
from collections import Counter

import pytest
from demo_answers import steps

from breakgraph.demo import grammar
from breakgraph.demo.mixture import check_annotations
from breakgraph.demo.problems import Problem
from breakgraph.demo.quoting import quotes, stated_operands

_WORDS = {w: i for i, w in enumerate(grammar.NUMBER_WORDS)}


@pytest.fixture(scope="module")
def sample() -> list[Problem]:
    return grammar.generate_grammar(5000, seed=3)


def test_every_step_is_exact_in_range_and_the_last_is_the_answer(sample):
    check_annotations(sample)
    for p in sample:
        got = steps(p)
        assert 1 <= len(got) <= 4 and got[-1][3] == p.final
        assert all(1 <= c <= grammar.MAX_RESULT for *_, c in got)


def test_operands_are_stated_numbers_or_earlier_results_and_each_is_quoted(sample):
    for p in sample:
        known = {int(x) for x in re.findall(r"\d+", p.question)}
        known |= {_WORDS[w] for w in re.findall(r"[a-z]+", p.question.lower()) if w in _WORDS}
        stated = set(known)
        if re.search(r"\b(twice|half)\b", p.question, re.IGNORECASE):
            known.add(2)
        for a, _, b, c in steps(p):
            assert {a, b} <= known, (p.question, p.answer)
            known.add(c)
        said = " ".join(quotes(p.question, p.answer)).lower()
        for x in set(stated_operands(p.answer)) & stated:
            assert str(x) in said or grammar.NUMBER_WORDS[min(x, 20)] in said.split(), (p.question, said)


def test_each_story_kind_uses_its_operation(sample):
    last = {"combine": "+", "difference": "-", "change": "-", "share": "/", "groups": "*", "price": "*"}
    for p in sample:
        kind = p.template.split("/")[1]
        ops = [op for _, op, _, _ in steps(p)]
        if kind in last:
            assert ops[-1] == last[kind], (p.question, p.answer)
        if kind == "times":
            assert ops[0] == "*", (p.question, p.answer)


def test_every_kind_and_the_surface_variations_occur(sample):
    kinds = Counter(p.template.split("/")[1] for p in sample)
    assert set(kinds) == set(grammar.STORIES) and min(kinds.values()) > 100, kinds
    texts = [p.question for p in sample]
    assert sum(t.islower() for t in texts) > 100
    assert sum(t.split(".")[0].endswith("?") or t.startswith(("How", "What", "Find")) for t in texts) > 500
    assert sum(bool(re.search(r"\b(" + "|".join(grammar.NUMBER_WORDS[1:]) + r")\b", t)) for t in texts) > 500


def test_generation_is_deterministic_and_prefix_stable():
    assert grammar.generate_grammar(300, 9) == grammar.generate_grammar(600, 9)[:300]
    assert grammar.generate_grammar(50, 1) != grammar.generate_grammar(50, 2)


def test_a_loss_after_a_loss_may_say_more_and_still_subtracts(sample):
    """"sold 5 more" / "another 5 left": the number after "more" or "another" is taken away."""
    taken_more = 0
    for p in sample:
        for _, op, b in re.findall(r"<<(\d+)([-+*/])(\d+)=", p.answer):
            said_more = re.search(rf"\b(another {b}|{b} more)\b(?! than)", p.question)
            if said_more and op == "-" and "than" not in p.question:
                taken_more += 1
    assert taken_more > 50, taken_more
