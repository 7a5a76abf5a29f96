"""The demo model's held-out phrasing split, its everyday-wording dev split and the prompts it
must answer.

``data/heldout_phrasings.jsonl`` holds word problems phrased in ways the training generators do
not produce (written by :mod:`breakgraph.demo.heldout_writer`, checked by
``tests/test_demo_heldout.py``); it is never used for training. ``data/dev_phrasings.jsonl``
holds 64 problems written by hand in plain everyday wording (dialogue, lists, several sentences),
to measure how the model does on ordinary text; it is not checked for shared runs with the
training text and is never used for training either. ``MUST_ANSWER`` lists the prompts the
README and the project's issue tracker show, each with its answer.
"""

from __future__ import annotations

import json
from pathlib import Path

from breakgraph.demo.problems import Problem

HELDOUT_FILE = Path(__file__).parent / "data" / "heldout_phrasings.jsonl"
DEV_FILE = Path(__file__).parent / "data" / "dev_phrasings.jsonl"

# (question, answer): asked as format_prompt(question), i.e. "Question: {q}\nAnswer:".
# The README's Python example, the issue tracker's examples (the second is also the default prompt
# of ``breakgraph generate``) and the prompts the README's demo section shows it answering.
MUST_ANSWER: tuple[tuple[str, int], ...] = (
    ("2+3?", 5),
    ("Tom has 17 apples and buys 26 more. How many apples does he have?", 43),
    ("Tom has 17 apples and buys 26 more. How many apples does he have now?", 43),
    ("Ben has 5 boxes with 12 pencils in each box. He gives away 9 pencils. How many pencils does he have left?", 51),
    ("Sara had 20 euros and spent 8 euros on lunch. How much money does she have left?", 12),
    ("What is 48 divided by 6?", 8),
)


def heldout_phrasings() -> list[Problem]:
    """The held-out phrasing problems (``answer`` empty, ``final`` the expected integer,
    ``template`` ``"heldout/{kind}/{phrasing}"``: the problem's kind and the number of the writer's
    phrasing it is an instance of). Raises ``FileNotFoundError`` naming the file."""
    if not HELDOUT_FILE.is_file():
        raise FileNotFoundError(f"held-out phrasing file missing: {HELDOUT_FILE}")
    out = []
    for line in HELDOUT_FILE.read_text(encoding="utf-8").splitlines():
        if line.strip():
            row = json.loads(line)
            out.append(Problem(row["question"], "", int(row["answer"]), f"heldout/{row['kind']}/{row['phrasing']}"))
    return out


def dev_phrasings() -> list[Problem]:
    """The hand-written dev problems (``answer`` empty, ``final`` the expected integer, ``template``
    ``"dev"``). Raises ``FileNotFoundError`` naming the file."""
    if not DEV_FILE.is_file():
        raise FileNotFoundError(f"dev phrasing file missing: {DEV_FILE}")
    rows = [json.loads(line) for line in DEV_FILE.read_text(encoding="utf-8").splitlines() if line.strip()]
    return [Problem(r["question"], "", int(r["answer"]), "dev") for r in rows]


def must_answer() -> list[Problem]:
    """``MUST_ANSWER`` as problems."""
    return [Problem(q, "", a, "example") for q, a in MUST_ANSWER]
