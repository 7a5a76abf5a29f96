"""Shared by the demo generators' tests: the calculation steps of a training answer."""

from __future__ import annotations

import re

from breakgraph.demo.problems import Problem

STEP = re.compile(r"(\d+)([-+*/])(\d+) = <<\1\2\3=(\d+)>>\4")


def steps(p: Problem) -> list[tuple[int, str, int, int]]:
    """``(a, op, b, c)`` of each ``a op b = <<a op b=c>>c`` line of ``p.answer``, after checking
    that the answer ends in ``#### final`` and that every other line is such a step (assert)."""
    lines = p.answer.split("\n")
    assert lines[-1] == f"#### {p.final}", p.answer
    out = []
    for line in lines[:-1]:
        m = STEP.fullmatch(line)
        assert m, line
        out.append((int(m[1]), m[2], int(m[3]), int(m[4])))
    return out
