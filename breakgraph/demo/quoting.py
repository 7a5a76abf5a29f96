"""The demo model's answer opening: before any calculation the answer quotes, for each number of
the question that a calculation uses, the few words around it, so the operation is decided from
words the model has just written next to the number rather than from the shape of the sentence::

    Question: A baker made 80 loaves and sold 3 before noon. How many are still unsold?
    Answer: A baker made 80 loaves; sold 3 before noon.
    80-3 = <<80-3=77>>77
    #### 77

A quote is the number's word with up to three words before it and four after it, not crossing a
clause boundary (``. , ; : ? !`` or the words ``and``, ``but``, ``then``, ``while``, ``so``),
verbatim from the question (number words stay words); quotes that overlap or touch inside one
clause are one quote. Quotes are in question order; a number
counts as stated when an operand of a calculation (not the result of an earlier one) occurs in
the question as digits or, up to twenty, as a word, each occurrence used once.
"""

from __future__ import annotations

import re

from breakgraph.demo.phrasebank import NUMBER_WORDS
from breakgraph.demo.problems import Problem

_CALC = re.compile(r"<<\s*(\d+)\s*[-+*/]\s*(\d+)\s*=\s*(\d+)\s*>>")
_WORD = re.compile(r"\S+")
_DIGITS = re.compile(r"(?<![\d.])\d+(?![\d])")
_BREAK_WORDS = frozenset({"and", "but", "then", "while", "so"})
_BREAK_CHARS = ".,;:?!"
BEFORE, AFTER = 3, 4


def _value(word: str) -> int | None:
    """The number a word of the question states: digits inside it, or a number word up to twenty."""
    m = _DIGITS.search(word)
    if m:
        return int(m[0])
    w = re.sub(r"[^a-z]", "", word.lower())
    return NUMBER_WORDS.index(w) if w in NUMBER_WORDS else None


def _clean(word: str) -> str:
    return word.rstrip(_BREAK_CHARS + "'\"").lstrip("'\"")


def stated_operands(answer: str) -> list[int]:
    """The operands of the ``<<a op b=c>>`` calculations of ``answer`` that are not the result of
    an earlier calculation, in order."""
    out, results = [], set()
    for a, b, c in _CALC.findall(answer):
        for x in (int(a), int(b)):
            if x not in results:
                out.append(x)
        results.add(int(c))
    return out


def quotes(question: str, answer: str) -> list[str]:
    """The quotes (see the module docstring) for the stated operands of ``answer``, in question order."""
    words = _WORD.findall(question)
    values = [_value(w) for w in words]
    chosen: set[int] = set()
    for x in stated_operands(answer):
        at = next((i for i, v in enumerate(values) if v == x and i not in chosen), None)
        if at is not None:
            chosen.add(at)
    spans: list[list[int]] = []
    for i in sorted(chosen):
        lo = i
        while (
            lo > 0
            and i - lo < BEFORE
            and not _breaks_after(words[lo - 1])
            and not _is_break_word(words[lo - 1])
        ):
            lo -= 1
        hi = i
        while (
            hi + 1 < len(words)
            and hi - i < AFTER
            and not _breaks_after(words[hi])
            and not _is_break_word(words[hi + 1])
        ):
            hi += 1
        if spans and (lo <= spans[-1][1] or lo == spans[-1][1] + 1 and not _breaks_after(words[lo - 1])):
            spans[-1][1] = max(spans[-1][1], hi)  # overlapping or touching within a clause: one quote
        else:
            spans.append([lo, hi])
    return [" ".join(words[lo : hi + 1]).rstrip(_BREAK_CHARS + "'\"").lstrip("'\"") for lo, hi in spans]


def _breaks_after(word: str) -> bool:
    return word.rstrip("'\"")[-1:] in _BREAK_CHARS


def _is_break_word(word: str) -> bool:
    return _clean(word).lower() in _BREAK_WORDS


def with_quotes(problem: Problem) -> Problem:
    """``problem`` with its answer opened by its quotes (``"q1; q2.\\n"``); unchanged when the
    question states none of the operands."""
    q = quotes(problem.question, problem.answer)
    if not q:
        return problem
    return Problem(problem.question, "; ".join(q) + ".\n" + problem.answer, problem.final, problem.template)
