"""The answer opening that quotes each stated number with its words, and the chunked mixture."""

from __future__ import annotations

from breakgraph.demo import mixture
from breakgraph.demo.problems import Problem
from breakgraph.demo.quoting import quotes, stated_operands, with_quotes


def test_quotes_take_the_words_around_each_stated_number_within_its_clause():
    q = "Tom has 17 apples and buys 26 more. How many apples does he have?"
    assert quotes(q, "17+26 = <<17+26=43>>43") == ["Tom has 17 apples", "buys 26 more"]
    q = "Ben has 5 boxes with 12 pencils in each box. He gives away 9 pencils. How many are left?"
    assert quotes(q, "<<5*12=60>> <<60-9=51>>") == [
        "Ben has 5 boxes with 12 pencils in each box",
        "He gives away 9 pencils",
    ]


def test_number_words_match_and_each_occurrence_is_used_once_in_question_order():
    q = "Ana had 5 beads. Then she found five more, and Bo gave her 5. How many beads now?"
    assert quotes(q, "<<5+5=10>> <<10+5=15>>") == ["Ana had 5 beads", "she found five more", "Bo gave her 5"]


def test_results_of_earlier_steps_and_unstated_numbers_are_not_quoted():
    assert stated_operands("<<3*4=12>> <<12+2=14>> <<14-12=2>>") == [3, 4, 2]
    q = "Omar buys 3 notebooks at 4 dollars each. He doubles them. How many dollars?"
    assert quotes(q, "<<3*4=12>> <<12*2=24>>") == ["Omar buys 3 notebooks at 4 dollars each"]
    p = Problem("Double it twice.", "<<2*2=4>>4\n#### 4", 4, "x")
    assert with_quotes(p) is p


def test_with_quotes_opens_the_answer_and_keeps_the_rest():
    p = Problem(
        "A baker made 80 loaves and sold 3 before noon. How many are unsold?",
        "80-3 = <<80-3=77>>77\n#### 77",
        77,
        "t",
    )
    q = with_quotes(p)
    assert q.answer == "A baker made 80 loaves; sold 3 before noon.\n80-3 = <<80-3=77>>77\n#### 77"
    assert (q.question, q.final, q.template) == (p.question, p.final, p.template)


def test_mixture_answers_open_with_quotes_and_do_not_depend_on_the_worker_count(monkeypatch):
    monkeypatch.setattr(mixture, "CHUNK", 300)
    one = mixture.make_mixture(1500, seed=5)
    assert len(one) == 1500 and len({p.question for p in one}) == 1500
    opened = [p for p in one if "\n" in p.answer and "<<" not in p.answer.split("\n", 1)[0]]
    assert len(opened) > 0.9 * len(one)
    assert mixture.make_mixture(1500, seed=5, workers=2) == one


def test_overlapping_quotes_merge_even_at_the_end_of_a_sentence():
    assert quotes("Give the value of 684 / 36.", "<<684/36=19>>") == ["the value of 684 / 36"]
    assert quotes("Mo has 4. Bo has 5.", "<<4+5=9>>") == ["Mo has 4", "Bo has 5"]


def test_roughen_changes_only_case_and_question_marks():
    import random

    p = Problem("Mo has 4 pens. How many pens?", "a", 4, "t")
    seen = {mixture.roughen(p, random.Random(i), p=0.5).question for i in range(40)}
    assert seen == {p.question, p.question.lower(), "Mo has 4 pens. How many pens", "mo has 4 pens. how many pens"}


def test_the_mixture_is_generated_in_this_process_when_workers_cannot_start(monkeypatch, capsys):
    def no_processes(*args, **kwargs):
        raise OSError("no semaphores here")

    monkeypatch.setattr(mixture, "CHUNK", 300)
    want = mixture.make_mixture(900, seed=6)
    monkeypatch.setattr(mixture, "ProcessPoolExecutor", no_processes)
    assert mixture.make_mixture(900, seed=6, workers=4) == want
    assert "generating in this process" in capsys.readouterr().err
