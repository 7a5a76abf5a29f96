"""The worded problem generators, the training mixture and the evaluation's scoring (CPU, seconds)."""

from __future__ import annotations

import math
import re
from collections import Counter

import pytest
import torch

from breakgraph.demo import mixture, phrasebank, problems, wordings
from breakgraph.demo.evaluate import annotation_correct, annotations, score
from breakgraph.demo.train import length_grouped_order

_STEP = re.compile(r"^(\d+)([-+*/])(\d+) = <<\1\2\3=(\d+)>>\4$")


@pytest.fixture(scope="module")
def sample() -> list[problems.Problem]:
    return wordings.generate_wordings(6000, seed=4)


def test_every_step_is_exact_and_in_range_and_the_last_is_the_answer(sample):
    for p in sample:
        *steps, last = p.answer.split("\n")
        assert 1 <= len(steps) <= 4 and last == f"#### {p.final}", p.answer
        for line in steps:
            m = _STEP.match(line)
            assert m, line
            a, op, b, c = int(m[1]), m[2], int(m[3]), int(m[4])
            assert {"+": a + b, "-": a - b, "*": a * b, "/": a / b}[op] == c, line
            assert 1 <= c <= wordings.MAX_RESULT, line
            if op == "*":
                assert min(a, b) <= 12 and (max(a, b) <= 83 or min(a, b) == 2), line
            if op == "/":
                assert b <= 12 and c <= 50, line
        assert int(steps[-1].rsplit(">>", 1)[1]) == p.final


def test_the_surface_forms_people_use_all_occur(sample):
    text = " ".join(p.question for p in sample).lower()
    for phrase in ("left", "remain", "altogether", "in total", "each", "per ", "change", "more than",
                   "fewer than", "times as many", "half as many", "how much", "what is", "if "):  # fmt: skip
        assert phrase in text, phrase
    assert all(w in text.split() for w in ("seven", "twelve", "nineteen", "twenty"))
    assert all(c in text for c in ("$", "£", "€", "euros", "rupees", "yen", "kg", "cm", "liters"))
    first = sum(p.question.startswith(("How", "What")) and len(p.question.split("?")[1]) > 3 for p in sample)
    assert first > 0.1 * len(sample), "about a fifth of the questions come first"
    steps = Counter(p.answer.count("<<") for p in sample)
    assert all(steps[k] > 0.04 * len(sample) for k in (1, 2, 3, 4)), steps
    ops = Counter(op for p in sample for op in re.findall(r"<<\d+([-+*/])", p.answer))
    assert all(ops[o] > 0.08 * sum(ops.values()) for o in "+-*/"), ops


def test_distractor_numbers_are_stated_but_not_used(sample):
    unused = 0
    for p in sample:
        stated = {int(x) for x in re.findall(r"\d+", p.question)}
        used = {int(x) for x in re.findall(r"\d+", p.answer)}
        unused += bool(stated - used)
    assert unused > 0.15 * len(sample)


def test_generation_is_deterministic_and_prefix_stable():
    assert wordings.generate_wordings(300, 9) == wordings.generate_wordings(300, 9)
    assert wordings.generate_wordings(100, 9) == wordings.generate_wordings(300, 9)[:100]
    assert wordings.generate_wordings(100, 9) != wordings.generate_wordings(100, 10)
    with pytest.raises(ValueError, match="n must be"):
        wordings.generate_wordings(-1, 0)


def test_pronouns_agree_with_the_only_person_named():
    wrong = {"f": r"\b([Hh]e|[Hh]is|him)\b", "m": r"\b([Ss]he|[Hh]er)\b"}
    checked = 0
    for p in wordings.generate_wordings(3000, 2):
        named = [(n, sex) for n, sex in wordings.PEOPLE if re.search(rf"\b{n}\b", p.question)]
        if len(named) == 1:
            checked += 1
            assert not re.search(wrong[named[0][1]], p.question), p.question
    assert checked > 500


# ------------------------------------------------------------------------------------- phrasebank


@pytest.fixture(scope="module")
def phrased() -> list[problems.Problem]:
    return phrasebank.generate_phrases(8000, seed=4)


def _check_steps(p: problems.Problem) -> list[tuple[int, str, int, int]]:
    """The answer's steps ``(a, op, b, c)`` after checking the format, the arithmetic and the range."""
    *lines, last = p.answer.split("\n")
    assert 1 <= len(lines) <= 4 and last == f"#### {p.final}", p.answer
    out = []
    for line in lines:
        m = _STEP.match(line)
        assert m, line
        a, op, b, c = int(m[1]), m[2], int(m[3]), int(m[4])
        assert {"+": a + b, "-": a - b, "*": a * b, "/": a / b}[op] == c and 1 <= c <= 1000, line
        out.append((a, op, b, c))
    assert out[-1][3] == p.final
    return out


def test_phrases_steps_are_exact_in_range_and_end_in_the_answer(phrased):
    for p in phrased:
        for a, op, b, c in _check_steps(p):
            if p.template != "phrases/drill" and op == "*":
                assert (min(a, b) <= 12 and max(a, b) <= 80) or min(a, b) in (2, 3), p.answer
            if p.template != "phrases/drill" and op == "/":
                assert b <= 12 and c <= 25, p.answer


def test_phrases_use_the_numbers_they_state():
    """Every operand of a word problem is a number the question states (as digits or a word), an
    earlier result, or the 2 or 3 of "twice"/"double"/"three times"/"triple"."""
    words = {w: i for i, w in enumerate(phrasebank.NUMBER_WORDS)}
    for p in phrasebank.generate_phrases(3000, seed=8):
        stated = {int(x) for x in re.findall(r"\d+", p.question)}
        stated |= {words[w] for w in re.findall(r"[a-z]+", p.question.lower()) if w in words}
        known = set(stated)
        for a, _, b, c in _check_steps(p):
            implied = {2} if re.search(r"twice|doubl", p.question) else set()
            implied |= {3} if re.search(r"three times|tripl", p.question) else set()
            assert {a, b} <= known | implied, (p.question, p.answer)
            known.add(c)


def test_phrases_stories_and_solutions_are_right_on_examples():
    """Hand-checked semantics: gaining adds, losing subtracts, groups multiply, sharing divides,
    change is the payment minus the cost, more/fewer than compares."""
    seen = set()
    for p in phrasebank.generate_phrases(4000, seed=12):
        q, ops = p.question, "".join(op for _, op, _, _ in _check_steps(p))
        if p.template == "phrases/share":
            assert ops[-1] == "/", (q, p.answer)
        if p.template == "phrases/shopping" and "change" in q.lower():
            a, op, b, _ = _check_steps(p)[-1]
            assert op == "-" and a in (5, 10, 20, 50, 100), q
        if p.template == "phrases/transfer":
            assert ops in ("+", "-"), q
        seen.add(p.template)
    assert seen == {f"phrases/{k}" for k in phrasebank.STORIES}


def test_phrases_cover_the_surface_forms(phrased):
    text = " ".join(p.question for p in phrased)
    low = text.lower()
    for phrase in ("left", "remain", "altogether", "in total", "each", "per ", "apiece", "change", "more than",
                   "fewer than", "times as many", "combined", "how much", "how many", "what is", "find ", "work out",
                   "determine", "calculate", "if ", " who ", "is given", "are shared", "as a gift", "stay"):  # fmt: skip
        assert phrase in low, phrase
    assert all(w in low.split() for w in ("seven", "twelve", "nineteen", "twenty"))
    assert all(c in text for c in ("$", "£", "€", "dollars", "litres", "km", "kg"))
    first = sum(
        p.question.startswith(("How", "What", "Find", "Work", "Determine")) and "?" not in p.question[-2:]
        for p in phrased
    )
    assert first > 0.08 * len(phrased), "a share of the questions come first"
    steps = Counter(p.answer.count("<<") for p in phrased)
    assert all(steps[k] > 0.02 * len(phrased) for k in (1, 2, 3, 4)), steps
    ops = Counter(op for p in phrased for op in re.findall(r"<<\d+([-+*/])", p.answer))
    assert all(ops[o] > 0.08 * sum(ops.values()) for o in "+-*/"), ops


def test_phrase_drills_cover_two_digit_products_and_three_digit_quotients(phrased):
    drills = [s for p in phrased if p.template == "phrases/drill" for s in _check_steps(p)]
    assert any(op == "*" and min(a, b) >= 10 for a, op, b, _ in drills)
    assert any(op == "/" and a >= 100 and b >= 10 for a, op, b, _ in drills)


def test_phrase_pronouns_agree_with_the_only_person_named():
    wrong = {"f": r"\b([Hh]e|[Hh]is|him)\b", "m": r"\b([Ss]he|[Hh]er)\b"}
    checked = 0
    for p in phrasebank.generate_phrases(3000, 2):
        named = [(n, sex) for n, sex in phrasebank.PEOPLE if re.search(rf"\b{n}\b", p.question)]
        if len(named) == 1:
            checked += 1
            assert not re.search(wrong[named[0][1]], p.question), p.question
    assert checked > 500


def test_phrase_generation_is_deterministic_and_prefix_stable():
    assert phrasebank.generate_phrases(300, 9) == phrasebank.generate_phrases(300, 9)
    assert phrasebank.generate_phrases(100, 9) == phrasebank.generate_phrases(300, 9)[:100]
    assert phrasebank.generate_phrases(100, 9) != phrasebank.generate_phrases(100, 10)
    with pytest.raises(ValueError, match="n must be"):
        phrasebank.generate_phrases(-1, 0)


# ------------------------------------------------------------------------------------- mixture


def test_gsm8k_filter_keeps_only_small_exact_single_operation_steps():
    easy = mixture.gsm8k_easy()
    assert 1500 < len(easy) < 4000
    for p in easy:
        bodies = annotations(p.answer)
        assert 1 <= len(bodies) <= 4 and all(annotation_correct(b) for b in bodies), p.answer


def test_mixture_draws_each_source_by_its_share_and_never_a_template_test_question():
    mix = mixture.make_mixture(4000, seed=3)
    assert len(mix) == 4000
    kind = lambda t: t if t == "gsm8k" else t.split("/")[0] if t.startswith(("wordings/", "phrases/", "varied/", "grammar/")) else "templates"  # noqa: E731
    source = Counter(kind(p.template) for p in mix)
    want = {k: 4000 * v for k, v in mixture.DEFAULT_SHARES.items()}
    assert all(abs(source[k] - n) <= 1 for k, n in want.items()) and not source["gsm8k"], source
    test_keys = {problems.normalise_question(p.question) for p in problems.test_split(problems.TEST_POOL)}
    assert not test_keys & {problems.normalise_question(p.question) for p in mix}
    assert mixture.make_mixture(4000, seed=3) == mix
    with_gsm8k = mixture.make_mixture(1000, 3, {"templates": 0.5, "gsm8k": 0.5})
    assert Counter(p.template == "gsm8k" for p in with_gsm8k)[True] == 500
    with pytest.raises(ValueError, match="unknown mixture sources"):
        mixture.make_mixture(10, 0, {"web": 1.0})


def test_length_grouped_order_is_a_permutation_that_pads_less():
    gen = torch.Generator().manual_seed(0)
    lengths = torch.randint(20, 300, (1000,))
    order = length_grouped_order(lengths, 10, gen, group=8)
    assert sorted(order.tolist()) == list(range(1000))
    pad = lambda o: sum(int(lengths[o[i : i + 10]].max()) for i in range(0, 1000, 10))  # noqa: E731
    assert pad(order) < 0.8 * pad(torch.randperm(1000, generator=gen))


# ------------------------------------------------------------------------------------- scoring


@pytest.mark.parametrize(
    ("body", "ok"),
    [("17+26=43", True), ("17+26=44", False), ("418/11=38", True), ("418/11=48", False), ("7*8=56", True),
     ("9-12=-3", False), ("5/0=0", False), ("3/2=1", False), ("2+3+4=9", False), ("x=4", False), (" 4 * 5 = 20 ", True)],
)  # fmt: skip
def test_annotation_correct(body, ok):
    assert annotation_correct(body) is ok


def test_score_separates_final_answers_from_annotation_arithmetic():
    probs = [problems.Problem("a", "", 43), problems.Problem("b", "", 5)]
    texts = [" 17+26 = <<17+26=43>>43\n#### 43", " 2+2 = <<2+2=5>>5\n#### 5"]
    r = score(probs, texts)
    assert (r.correct, r.total, r.annotations, r.annotations_correct) == (2, 2, 2, 1)
    assert r.annotation_accuracy == 0.5 and r.misses() == []
    r = score(probs, [" #### 42", " <<2+3=5>>5 #### 5"])
    assert r.correct == 1 and r.misses()[0][2] == 43 and r.annotation_accuracy == 1.0
    assert math.isnan(score(probs[:1], [" 43"]).annotation_accuracy)
