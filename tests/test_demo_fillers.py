"""The open-pool fillers (breakgraph/demo/fillers.py): a filler replaces a slot word everywhere
the same way, the numbers, calculations and answers stay, the quotes copy the fillers, the pools
are open and free of cue, number, slot and held-out words, the output is deterministic, and the
mixture takes the new sources by their shares (CPU, a few seconds)."""

from __future__ import annotations

import random
import re
from collections import Counter

import pytest

from breakgraph.demo import choices, fillers, grammar, phrasebank, problems, varied, wordings
from breakgraph.demo.mixture import check_annotations, make_mixture
from breakgraph.demo.problems import Problem
from breakgraph.demo.quoting import quotes, with_quotes

_WORD = re.compile(r"(?<![A-Za-z'])[A-Za-z]+(?![A-Za-z])")


@pytest.fixture(scope="module")
def base() -> list[Problem]:
    return (problems.train_split(300, 1) + wordings.generate_wordings(300, 1) + phrasebank.generate_phrases(300, 1)
            + varied.generate_varied(300, 1) + grammar.generate_grammar(300, 1) + choices.generate_choices(300, 1))  # fmt: skip


@pytest.fixture(scope="module")
def filled(base) -> list[tuple[Problem, Problem]]:
    rng = random.Random(7)
    return [(p, fillers.fill(p, rng)) for p in base]


def test_each_slot_word_gets_one_filler_everywhere_and_nothing_else_changes(filled):
    changed = 0
    for old, new in filled:
        a = _WORD.findall(old.question) + ["|"] + _WORD.findall(old.answer)
        b = _WORD.findall(new.question) + ["|"] + _WORD.findall(new.answer)
        assert len(a) == len(b), (old.question, new.question)
        forward: dict[str, str] = {}
        backward: dict[str, str] = {}
        for x, y in zip(a, b):
            if x == y:
                continue
            assert (
                x in fillers.NAMES
                or x.lower() in fillers.NOUNS
                or x.lower() in fillers.UNITS
                or x.lower() in fillers.HAVE
            ), x
            assert forward.setdefault(x, y) == y, (x, y, new.question)  # one filler per word
            assert backward.setdefault(y, x) == x, (x, y, new.question)  # no two words share one
        # the text between the words (numbers, symbols, punctuation) is the same
        assert _WORD.split(old.question) == _WORD.split(new.question)
        assert _WORD.split(old.answer) == _WORD.split(new.answer)
        changed += bool(forward)
    assert changed > 0.8 * len(filled)


def test_answers_and_calculations_are_unchanged_and_exact(filled):
    check_annotations([new for _, new in filled])
    for old, new in filled:
        assert new.final == old.final
        assert re.findall(r"<<[^>]*>>|#### \d+", new.answer) == re.findall(r"<<[^>]*>>|#### \d+", old.answer)
        assert new.template == f"fillers/{old.template}"


def test_the_quotes_copy_the_filled_question(filled):
    for old, new in filled:
        q = with_quotes(new)
        assert q.answer.endswith(new.answer)
        said = quotes(new.question, new.answer)
        assert said == quotes(new.question, new.answer)
        assert len(said) == len(quotes(old.question, old.answer))
        for quote in said:
            assert quote in new.question, (quote, new.question)


def test_filling_is_deterministic_per_seed():
    a = fillers.generate_filled(300, 5)
    assert a == fillers.generate_filled(300, 5)
    assert a != fillers.generate_filled(300, 6)
    assert len(a) == 300 and all(p.template.startswith("fillers/") for p in a)
    assert Counter(p.template.split("/")[1] for p in a).keys() >= {
        "wordings",
        "phrases",
        "varied",
        "grammar",
        "choices",
    }


def test_the_fillers_are_open_pseudo_and_real_words_never_cue_number_or_heldout_words(filled):
    names, nouns, verbs = fillers.gsm8k_pools()
    assert len(names) > 1000 and len(nouns) > 300 and len(verbs) > 50
    real = {w.lower() for pool in (names,) for w in pool} | {w for pair in nouns + verbs for w in pair}
    banned = fillers.NUMBER_WORDS | fillers.CUE_WORDS | fillers._eval_words() | fillers._slot_words()
    assert not real & banned
    new_words = Counter()
    for old, new in filled:
        new_words.update(set(_WORD.findall(new.question)) - set(_WORD.findall(old.question)))
    assert len(new_words) > 1000 and max(new_words.values()) < 10  # hardly any filler repeats
    assert not {w.lower() for w in new_words} & (
        fillers.NUMBER_WORDS | fillers.CUE_WORDS | fillers._eval_words()
    )
    assert any(w.lower() in real for w in new_words) and any(w.lower() not in real for w in new_words)
    rng = random.Random(0)
    pseudo = [fillers.pseudo_word(rng) for _ in range(500)]
    assert len(set(pseudo)) > 450 and all(w.isalpha() and w.islower() and 3 <= len(w) <= 9 for w in pseudo)


def test_the_mixture_takes_fillers_and_choices_by_share_whatever_the_worker_count(monkeypatch):
    from breakgraph.demo import mixture

    monkeypatch.setattr(mixture, "CHUNK", 60)
    shares = {"grammar": 0.5, "choices": 0.25, "fillers": 0.25}
    mix = make_mixture(400, 2, shares)
    source = Counter(p.template.split("/")[0] for p in mix)
    assert source == {"grammar": 200, "choices": 100, "fillers": 100}
    assert make_mixture(400, 2, shares, workers=2) == mix
    for p in mix:
        said = p.answer.split("\n")[0]
        if "<<" not in said:  # the quote line: each quote copied from the question
            assert all(q in p.question for q in said.rstrip(".").split("; ")), (p.question, said)


def test_the_tokenizer_corpus_follows_the_mixture():
    from breakgraph.demo.tokenizer import build_corpus
    from breakgraph.demo.train import tokenizer_shares

    old = tokenizer_shares({"templates": 0.1, "wordings": 0.1, "phrases": 0.2, "varied": 0.3, "grammar": 0.3})
    assert old == {"worded_share": 0.15, "phrased_share": 0.3, "varied_share": 0.35, "choices_share": 0.0,
                   "filled_share": 0.0}  # fmt: skip
    new = tokenizer_shares({"grammar": 0.4, "choices": 0.1, "fillers": 0.5})
    assert new["choices_share"] == 0.1 and new["filled_share"] == 0.5
    assert abs(new["worded_share"] + new["phrased_share"] + new["varied_share"] - 0.8 * 0.4) < 1e-9
    texts = list(build_corpus(200, 0, None, **new))
    assert len(texts) == 200 and texts == list(build_corpus(200, 0, None, **new))
    filled = {p.question for p in fillers.generate_filled(100, 0)}
    assert sum(t.split("\n")[0].removeprefix("Question: ") in filled for t in texts) == 100
