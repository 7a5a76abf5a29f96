"""Writes the held-out phrasing split, ``data/heldout_phrasings.jsonl``: word problems phrased in
ways no training generator produces, to measure whether the demo model reads a problem or only
recognises its own templates.

This is a separate generator with its own sentences, names and objects; nothing here is used
for training, and ``tests/test_demo_heldout.py`` checks that no run of five words of a held-out
question (names, numbers and the generators' nouns normalised away) occurs in the training
problems. The numbers stay inside the ranges the training data covers (amounts up to 100, one
factor of a product 2-12 and the other up to 50, divisors 2-12 with exact quotients up to 25,
every result 1-1000). Each phrasing gets a few draws of names and numbers; the answer is
computed here from the drawn numbers.

Rewrite the file (deterministic)::

    python -m breakgraph.demo.heldout_writer
"""

from __future__ import annotations

import argparse
import json
import random
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from breakgraph.demo.heldout import HELDOUT_FILE

SEED = 31337
PER_PHRASING = 8

PEOPLE = (
    ("Rosa", "f"), ("Felix", "m"), ("Ivy", "f"), ("Oscar", "m"), ("Hana", "f"), ("Ari", "m"),
    ("Lena", "f"), ("Theo", "m"), ("Mira", "f"), ("Kofi", "m"), ("Noor", "f"), ("Emil", "m"),
    ("Tara", "f"), ("Jonas", "m"), ("Wen", "f"), ("Bruno", "m"), ("Elif", "f"), ("Viktor", "m"),
)  # fmt: skip
WORDS = (
    "zero one two three four five six seven eight nine ten eleven twelve thirteen fourteen fifteen "
    "sixteen seventeen eighteen nineteen twenty"
).split()
MONEY = (("$", ""), ("€", ""), ("", " dollars"), ("", " euros"), ("", " francs"), ("£", ""))


@dataclass(frozen=True)
class Phrasing:
    """A question with slots ``{A}``, ``{B}`` (names), ``{he}``/``{his}``/``{him}`` (of A),
    ``{a}``.. (numbers, digits or words), ``{ma}``.. (money); ``draw`` samples the numbers and
    returns them or None to redraw; ``solve`` gives the answer."""

    kind: str
    text: str
    draw: Callable[[random.Random], dict | None]
    solve: Callable[..., int]


def _n(**ranges: tuple[int, int]) -> Callable[[random.Random], dict]:
    return lambda rng: {k: rng.randint(*r) for k, r in ranges.items()}


def _div(extra: dict | None = None, dmax: int = 12, qmax: int = 25) -> Callable[[random.Random], dict]:
    def draw(rng: random.Random) -> dict:
        d, q = rng.randint(2, dmax), rng.randint(2, qmax)
        out = {"d": d, "a": d * q}
        out.update({k: rng.randint(*r) for k, r in (extra or {}).items()})
        return out

    return draw


def _pooled_pair(rng: random.Random) -> dict:
    """Two amounts whose sum splits exactly into ``d`` shares."""
    d, q = rng.randint(2, 10), rng.randint(2, 25)
    a = rng.randint(1, d * q - 1)
    return {"a": a, "b": d * q - a, "d": d}


P = Phrasing
PHRASINGS: tuple[Phrasing, ...] = (
    # sums
    P("add", "Suppose {A}, who owns {a} marbles, is given {b} extra as a present. What would {his} marble count be?",
      _n(a=(2, 90), b=(2, 60)), lambda a, b: a + b),
    P("add", "Count the fish: one tank contains {a} of them and the other contains {b}. What number do you get?",
      _n(a=(2, 90), b=(2, 90)), lambda a, b: a + b),
    P("add", "{A}'s school collected {ma} on Friday, followed by {mb} on Saturday. What amount came in over both days?",
      _n(a=(5, 100), b=(5, 100)), lambda a, b: a + b),
    P("add", "A farmer counted {a} sheep in one field and {b} sheep in another. Combined, what was her count?",
      _n(a=(5, 100), b=(5, 100)), lambda a, b: a + b),
    P("add", "What is the combined weight of two parcels weighing {a} kg and {b} kg?",
      _n(a=(2, 90), b=(2, 90)), lambda a, b: a + b),
    P("add", "Today {A} turns {a}. What age will {he} reach after {b} more birthdays?",
      _n(a=(3, 60), b=(2, 30)), lambda a, b: a + b),
    # differences
    P("sub", "{A}'s album held {a} stamps until {b} were traded to a friend. What number stayed in the album?",
      _n(a=(10, 100), b=(2, 9)), lambda a, b: a - b),
    P("sub", "A baker made {a} loaves this morning and sold {b} before noon. What quantity is still unsold?",
      _n(a=(20, 100), b=(2, 19)), lambda a, b: a - b),
    P("sub", "{A} kept {ma} in a piggy bank, then took out {mb} for a comic. What sum stays in the piggy bank?",
      _n(a=(20, 100), b=(2, 19)), lambda a, b: a - b),
    P("sub", "{A} scored {a} points while {B} scored {b}. By what margin did {A} win?",
      _n(a=(30, 100), b=(2, 29)), lambda a, b: a - b),
    P("sub", "The road to the lake is {a} km. After riding {b} km, what distance does {A} still have to ride?",
      _n(a=(30, 100), b=(2, 29)), lambda a, b: a - b),
    P("sub", "{A} stands {a} cm tall, and {B} measures {b} cm less. What height is {B}, in cm?",
      _n(a=(90, 100), b=(2, 40)), lambda a, b: a - b),
    P("sub", "What is the gap between {A}'s {a} songs and {B}'s {b} songs?",
      _n(a=(40, 100), b=(2, 39)), lambda a, b: a - b),
    # products
    P("mul", "Work out the egg total: the fridge stores {a} cartons holding {b} eggs apiece.",
      _n(a=(2, 12), b=(2, 30)), lambda a, b: a * b),
    P("mul", "A ticket for the show is {mb}. What must {A} pay to get {a} of these tickets?",
      _n(a=(2, 12), b=(2, 50)), lambda a, b: a * b),
    P("mul", "{A} jogs {b} km on each of {a} mornings. What is {his} distance over those mornings?",
      _n(a=(2, 12), b=(2, 20)), lambda a, b: a * b),
    P("mul", "The hall has {a} rows, {b} seats to a row. What seat count does the hall have?",
      _n(a=(2, 12), b=(2, 50)), lambda a, b: a * b),
    P("mul", "An hour of tutoring brings {A} {mb}. What does {he} make from {a} such hours?",
      _n(a=(2, 12), b=(2, 50)), lambda a, b: a * b),
    # equal shares
    P("div", "{a} stickers get split fairly between {d} children. What does every child end up with?",
      _div(), lambda a, d: a // d),
    P("div", "A {a} m rope is chopped into {d} equal-length pieces. What length is one piece, in m?",
      _div(), lambda a, d: a // d),
    P("div", "{A} wants to put {a} photos into an album, {d} to a page. What number of pages gets used?",
      _div(), lambda a, d: a // d),
    P("div", "The bill of {ma} is split evenly by {d} friends. What is one friend's part?",
      _div(), lambda a, d: a // d),
    P("div", "A group of {d} hikers carries {a} litres of water in equal parts. What does one hiker carry, in litres?",
      _div(), lambda a, d: a // d),
    # change from a payment
    P("change", "{A} hands over {ma} to pay for a {b}-dollar scarf. What should {he} get back?",
      lambda rng: (lambda a: {"a": a, "b": rng.randint(2, a - 1)})(rng.choice((10, 20, 50, 100))),
      lambda a, b: a - b),
    P("change", "With a {ma} note, {A} pays for {c} pens priced at {mb} apiece. What change comes back?",
      lambda rng: (lambda b, c: {"a": 100, "b": b, "c": c})(rng.randint(2, 12), rng.randint(2, 8)),
      lambda a, b, c: a - b * c),
    # comparisons
    P("more", "{B}'s shell collection is larger than {A}'s by {b}, and {A} has collected {a} shells. How big is {B}'s collection?",
      _n(a=(2, 80), b=(2, 50)), lambda a, b: a + b),
    P("fewer", "{A} baked {a} pies; {B} baked {b} fewer than that. What did {B} bake?",
      _n(a=(30, 90), b=(2, 29)), lambda a, b: a - b),
    P("times", "For every book {A} owns, {B} owns {c}. {A} owns {a}. What does {B} own?",
      _n(a=(2, 50), c=(2, 10)), lambda a, c: a * c),
    P("more", "A red kite is priced at {ma}; a blue kite is {mb} dearer. Together, what do both kites cost?",
      _n(a=(5, 60), b=(2, 30)), lambda a, b: a + a + b),
    # chains of two to four steps
    P("chain", "When the week began, {A}'s deck held {a} cards. Monday's game added {b} to it, and on Tuesday {c} went missing. "
      "What is {his} card count at the end?",
      lambda rng: (lambda a, b: {"a": a, "b": b, "c": rng.randint(2, a + b - 2)})(rng.randint(5, 60), rng.randint(2, 40)),
      lambda a, b, c: a + b - c),
    P("chain", "What is {A}'s balance now? {He} put {ma} into a savings jar, added {mb}, then took {mc} out for a game.",
      lambda rng: (lambda a, b: {"a": a, "b": b, "c": rng.randint(2, a + b - 2)})(rng.randint(5, 60), rng.randint(2, 40)),
      lambda a, b, c: a + b - c),
    P("chain", "On a bus with {a} riders, {b} step off at the first stop and {c} climb aboard at the second. "
      "What is the rider count afterwards?",
      lambda rng: (lambda a: {"a": a, "b": rng.randint(2, a - 2), "c": rng.randint(2, 40)})(rng.randint(10, 80)),
      lambda a, b, c: a - b + c),
    P("chain", "{A} bought {a} bags holding {b} oranges apiece and already had {c} oranges at home. "
      "Find {his} orange total.",
      _n(a=(2, 12), b=(2, 20), c=(2, 50)), lambda a, b, c: a * b + c),
    P("chain", "Each of {a} classes sends {b} pupils on a trip; {c} pupils are ill and stay behind. "
      "What number actually goes?",
      lambda rng: (lambda a, b: {"a": a, "b": b, "c": rng.randint(1, a * b - 1)})(rng.randint(2, 10), rng.randint(5, 30)),
      lambda a, b, c: a * b - c),
    P("chain", "{A} and {B} pooled {a} and {b} grapes, then divided the pile fairly among {d} kids. "
      "What share does one kid receive?",
      _pooled_pair, lambda a, b, d: (a + b) // d),
    P("chain", "{A} gets {mb} per babysitting hour. {He} babysat {a} hours and then bought a book with {mc} of it. "
      "What is left from the earnings?",
      lambda rng: (lambda a, b: {"a": a, "b": b, "c": rng.randint(1, a * b - 1)})(rng.randint(2, 10), rng.randint(2, 20)),
      lambda a, b, c: a * b - c),
    P("chain", "A shop had {a} umbrellas. It sold {b} in the morning, got a delivery of {c}, and sold {e} more "
      "by evening. What stock of umbrellas remained?",
      lambda rng: (lambda a, b, c: {"a": a, "b": b, "c": c, "e": rng.randint(1, a - b + c - 1)})(
          *(lambda a: (a, rng.randint(2, a - 2), rng.randint(2, 50)))(rng.randint(10, 100))),
      lambda a, b, c, e: a - b + c - e),
    P("chain", "Over {a} weeks {A} puts aside {mb} weekly, a grandparent chips in {mc}, and the money goes equally "
      "to {d} charities. What amount does each charity get?",
      lambda rng: _pool(rng), lambda a, b, c, d: (a * b + c) // d),
    P("chain", "A class of {a} pupils splits into teams of {d}. Each team needs {c} balls. What ball total is needed?",
      _div({"c": (2, 6)}, dmax=8, qmax=12), lambda a, d, c: (a // d) * c),
    P("chain", "{A} harvested {a} tomatoes, {B} harvested twice that number, and they sold {c} of them all. "
      "What quantity of tomatoes did they keep?",
      lambda rng: (lambda a: {"a": a, "c": rng.randint(1, 3 * a - 1)})(rng.randint(2, 50)),
      lambda a, c: 3 * a - c),
    # with a number that is not needed
    P("distract", "{A}, aged {c}, owned {a} crayons before {his} aunt sent {b} new ones. What is the crayon count now?",
      _n(a=(2, 80), b=(2, 40), c=(5, 15)), lambda a, b, c: a + b),
    P("distract", "It is {c} degrees outside. {A} carries {a} logs to the fire, {d} at a time per trip. "
      "What number of trips does {he} make?",
      _div({"c": (5, 30)}), lambda a, d, c: a // d),
    P("distract", "{A} has {a} pets and {c} plants. {He} adopts {b} extra pets. What number of pets does {he} care for?",
      _n(a=(2, 20), b=(2, 10), c=(2, 30)), lambda a, b, c: a + b),
)  # fmt: skip


def _pool(rng: random.Random) -> dict:
    while True:
        a, b, c, d = rng.randint(2, 8), rng.randint(2, 20), rng.randint(2, 40), rng.randint(2, 10)
        if (a * b + c) % d == 0 and (a * b + c) // d >= 2:
            return {"a": a, "b": b, "c": c, "d": d}


def _render(ph: Phrasing, rng: random.Random) -> tuple[str, int]:
    nums = None
    while nums is None:
        nums = ph.draw(rng)
    (a_name, sex), (b_name, _) = rng.sample(PEOPLE, 2)
    pre, post = rng.choice(MONEY)
    word_p = rng.choice((0.0, 0.4))

    def num(v: int) -> str:
        return WORDS[v] if v <= 20 and rng.random() < word_p else str(v)

    fields = {"A": a_name, "B": b_name, "he": "she" if sex == "f" else "he", "He": "She" if sex == "f" else "He",
              "his": "her" if sex == "f" else "his", "him": "her" if sex == "f" else "him"}  # fmt: skip
    for k, v in nums.items():
        fields[k] = num(v)
        fields["m" + k] = f"{pre}{v}{post}"
    question = ph.text.format(**fields)
    question = question[:1].upper() + question[1:]
    return question, ph.solve(**nums)


def write(path: Path = HELDOUT_FILE, seed: int = SEED, per: int = PER_PHRASING) -> int:
    """Write ``per`` draws of every phrasing to ``path`` as JSON lines ``{question, answer, kind,
    phrasing}``; returns the number written. Duplicate questions are drawn again."""
    rng = random.Random(seed)
    rows, seen = [], set()
    for i, ph in enumerate(PHRASINGS):
        got = 0
        while got < per:
            q, answer = _render(ph, rng)
            if q in seen:
                continue
            if not 1 <= answer <= 1000:
                raise ValueError(f"phrasing {i} drew answer {answer}")
            seen.add(q)
            rows.append({"question": q, "answer": answer, "kind": ph.kind, "phrasing": i})
            got += 1
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows), encoding="utf-8")
    return len(rows)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description="Rewrite the demo model's held-out phrasing split.")
    p.add_argument("--out", type=Path, default=HELDOUT_FILE, help="JSON-lines file to write")
    args = p.parse_args(argv)
    print(f"wrote {write(args.out)} problems ({len(PHRASINGS)} phrasings) to {args.out}")


if __name__ == "__main__":
    main()
