"""A word-problem generator for the demo model aimed at choosing the operation from everyday
wording: what is still left ("unsold", "remaining", "yet to", "still to go"), gaps and differences
("how far apart", "ahead by", "draw level"), change from a payment ("hands the cashier", "what comes
back"), packing a number to a page or a box (division), and rates ("is paid 9 dollars for each
hour ... puts in 6 hours", "a machine fills 14 bottles a minute").

Each story draws its facts, the question and its place (first or last), how the numbers are written
(digits or words up to twenty) and an unused number from separate lists, so the operation is told
only by the words. Answers are in the demo format, one exact calculation a line then ``#### N``
(the mixture opens them with their quotes). Ranges: stated amounts 2-100, payments up to 100,
products with one factor 2-12, divisors 2-12 with quotients 2-20, results 1-1000.
"""

from __future__ import annotations

import random
import re

from breakgraph.demo.grammar import StoryDraws
from breakgraph.demo.problems import Problem, distinct_problems, exact_step, redrawn
from breakgraph.demo.varied import FOR_SALE, JOBS, _pl

MAX_RESULT = 1000

# (what is done to things one by one: present, past, the things)
TASKS = (("reads", "read", "pages"), ("answers", "answered", "emails"), ("unpacks", "unpacked", "boxes"),
         ("lays", "laid", "tiles"), ("writes", "wrote", "cards"), ("paints", "painted", "fence posts"),
         ("plants", "planted", "bulbs"), ("sews", "sewed", "buttons"), ("labels", "labelled", "jars"))  # fmt: skip
# (maker, what it makes, its verb) for counts per period
MACHINES = (("A machine", "bottles", "fills"), ("A printer", "pages", "prints"), ("A baker", "rolls", "shapes"),
            ("A pump", "buckets", "fills"), ("A robot", "boxes", "seals"), ("A knitter", "rows", "knits"),
            ("A small press", "cans", "stamps"), ("The oven", "pizzas", "bakes"))  # fmt: skip
PERIODS = (("hour", "hours"), ("minute", "minutes"), ("day", "days"), ("shift", "shifts"), ("week", "weeks"),
           ("session", "sessions"), ("afternoon", "afternoons"))  # fmt: skip
DESTINATIONS = (
    "the pond",
    "the farm",
    "town",
    "the coast",
    "the hut",
    "the old barn",
    "the camp",
    "the mill",
)
NOTES = (5, 10, 20, 50, 100)


class _C(StoryDraws):
    """Per-problem choices: two people, a noun, a container, a currency and the number style."""

    def __init__(self, rng: random.Random):
        super().__init__(rng)
        self.word_p = rng.choice((0.0, 0.25, 0.5))
        self.facts: list[str] = []
        self.question = ""
        self.steps: list[tuple[str, int]] = []

    def note(self, k: int) -> str:
        """A note or bill of ``k``: "a 20-dollar note", "a $20 bill", or just "$20"."""
        sym, one, _ = self.cur
        self.used.add(k)
        return self.pick(
            f"a {sym}{k} bill" if sym else f"a {k}-{one} {self.pick('note', 'bill')}", self.money(k)
        )

    def he(self) -> str:
        return "she" if self.sa == "f" else "he"

    def him(self) -> str:
        return "her" if self.sa == "f" else "him"

    def his(self) -> str:
        return "her" if self.sa == "f" else "his"

    def calc(self, a: int, op: str, b: int) -> int:
        v = exact_step(a, op, b)
        if not 1 <= v <= MAX_RESULT:
            raise ValueError(f"{a}{op}{b}={v} is out of range")
        self.steps.append((f"{a}{op}{b}", v))
        return v


def story_left(c: _C) -> None:
    """A stock, one or two lots taken from it, how many are still there."""
    pl = c.thing[1]
    a = c.r(10, 100)
    c.facts.append(c.pick(
        f"{c.a} {c.pick('baked', 'packed', 'brought', 'set out', 'stocked', 'laid out', 'got ready')} {c.cnt(a)} "
        f"{c.pick('for the fair', 'on Saturday', 'at dawn', 'for the market')}",
        f"there were {c.cnt(a)} on {c.a}'s stall {c.pick('at opening time', 'first thing', '')}",
        f"{c.a}'s shop began the day with {c.cnt(a)}",
        f"{c.a} put {c.cnt(a)} up for sale",
    ))  # fmt: skip
    left = a
    for _ in range(c.pick(1, 1, 1, 2)):
        k = c.r(1, left - 1)
        left = c.calc(left, "-", k)
        c.facts.append(c.pick(
            f"{c.pick('customers bought', 'shoppers took', 'buyers carried off', 'visitors picked up')} {c.n(k)} of them",
            f"{c.n(k)} {c.pick('were sold', 'got sold', 'were snapped up', 'went home with buyers', 'found buyers')} "
            f"{c.pick('by lunchtime', 'in the first hour', 'during the morning', '')}",
            f"{c.he()} {c.pick('sold', 'parted with', 'let go of')} {c.cnt(k)}",
        ))  # fmt: skip
    c.question = c.pick(
        f"How many {pl} are not sold yet?", f"How many {pl} have not been sold?", f"How many {pl} remain unsold?",
        "How many are yet to be sold?", f"How many {pl} still wait for a buyer?", f"What number of {pl} did not sell?",
        "How many are still there?", f"How many {pl} are still unsold?", f"How many {pl} remain?",
        f"How many {pl} has {c.a} still got?", f"Count the unsold {pl}.", f"How many unsold {pl} are there?",
        f"How many {pl} are yet to find a buyer?",
    )  # fmt: skip


def story_to_go(c: _C) -> None:
    """A distance or a task, the part done so far, what is still to do."""
    if c.rng.random() < 0.5:
        unit = c.pick("km", "miles", "kilometres")
        d = c.r(10, 100)
        k = c.r(1, d - 1)
        c.facts += [c.pick(f"{c.a} is cycling {c.n(d)} {unit} to {c.pick(*DESTINATIONS)}",
                           f"the path to {c.pick(*DESTINATIONS)} measures {c.n(d)} {unit}",
                           f"{c.a} plans a {d}-{unit.rstrip('s')} walk"),
                    c.pick(f"so far {c.he()} has done {c.n(k)} {unit}", f"{c.he()} has already covered {c.n(k)} {unit}",
                           f"after {c.n(k)} {unit} {c.he()} stops for a snack")]  # fmt: skip
        c.question = c.pick(f"How many {unit} are still ahead of {c.him()}?", "How far is there still to go?",
                            "What distance is left?", f"How many more {unit} must {c.he()} go?",
                            "How much of the way remains?", f"How much farther must {c.a} travel?")  # fmt: skip
    else:
        pres, past, things = c.pick(*TASKS)
        d = c.r(10, 100)
        k = c.r(1, d - 1)
        c.facts += [c.pick(f"{c.a} has {c.n(d)} {things} to get through", f"{c.a} {pres} {c.n(d)} {things} this week",
                           f"there are {c.n(d)} {things} on {c.a}'s list"),
                    c.pick(f"{c.he()} has {past} {c.n(k)} so far", f"{c.n(k)} are done already",
                           f"by noon {c.he()} had {past} {c.n(k)}")]  # fmt: skip
        c.question = c.pick(f"How many {things} are still to do?", f"How many {things} remain?",
                            f"How many {things} has {c.he()} still to finish?", "How many are yet to be done?")  # fmt: skip
    c.calc(d, "-", k)


def story_gap(c: _C) -> None:
    """Two amounts, how far apart they are."""
    x = c.r(5, 100)
    y = c.r(1, x - 1)
    first, second = (x, y) if c.rng.random() < 0.6 else (y, x)
    big, small = (c.a, c.b) if first == x else (c.b, c.a)
    c.facts.append(c.pick(
        f"{c.a} has {c.cnt(first)} and {c.b} has {c.n(second)}",
        f"{c.a} scored {c.n(first)} points; {c.b} scored {c.n(second)}",
        f"{c.a}'s {c.group[0]} holds {c.cnt(first)}, while {c.b}'s holds {c.n(second)}",
        f"{c.a} counted {c.cnt(first)} and {c.b} counted {c.n(second)}",
    ))  # fmt: skip
    c.question = c.pick(
        f"How many more does {big} have than {small}?", f"By how many is {big} ahead?",
        "How big is the gap between their counts?", "How far apart are the two counts?",
        "By how much do the two counts differ?", f"How many fewer does {small} have?",
        f"How many would {small} need to draw level with {big}?", "What separates the two counts?",
        "Find the gap between the two numbers.", "What is the gap?", f"How much is {big} in front?",
    )  # fmt: skip
    c.calc(x, "-", y)


def story_change(c: _C) -> None:
    """A price (or a few items at a price), a note, the change."""
    item = c.pick(*FOR_SALE)
    note = c.pick(*NOTES)
    if c.rng.random() < 0.35:
        k = c.r(2, 6)
        p = c.r(1, max(1, (note - 1) // k))
        c.facts.append(c.pick(f"{c.a} buys {c.n(k)} {_pl(item)} at {c.money(p)} each",
                              f"{c.n(k)} {_pl(item)} go into {c.a}'s basket, {c.money(p)} apiece"))  # fmt: skip
        total = c.calc(k, "*", p)
    else:
        p = c.r(1, note - 1)
        c.facts.append(c.pick(f"{c.a} buys a {item} that costs {c.money(p)}", f"a {item} is marked {c.money(p)}",
                              f"{c.a} picks out a {item} whose price is {c.money(p)}"))  # fmt: skip
        total = p
    who = c.he() if c.a in c.facts[-1] else c.a
    c.facts.append(c.pick(f"{who} hands the cashier {c.note(note)}", f"{who} pays with {c.note(note)}",
                          f"{who} gives the seller {c.note(note)}", f"{who} offers {c.note(note)}"))  # fmt: skip
    c.question = c.pick("How much change is due?", f"What change does {c.he()} receive?",
                        f"How much comes back to {c.a}?", "How much does the seller give back?",
                        f"What does {c.a} get in change?", f"How much money is returned to {c.him()}?",
                        f"What is {c.his()} change?", "How much is handed back?")  # fmt: skip
    c.calc(note, "-", total)


def story_to_a(c: _C) -> None:
    """A number packed so many to a page, box or shelf: how many pages, boxes or shelves."""
    d, q = c.r(2, 12), c.r(2, 20)
    c.calc(d * q, "/", d)
    gs, gp = c.pick(c.group, ("page", "pages"), ("sheet", "sheets"), ("shelf", "shelves"))
    c.facts.append(c.pick(
        f"{c.a} has {c.cnt(d * q)} to put {c.n(d)} to a {gs}",
        f"{c.cnt(d * q)} are packed {c.n(d)} to a {gs}",
        f"{c.a} sorts {c.cnt(d * q)} into {gp} of {c.n(d)}",
        f"{c.a} sticks {c.cnt(d * q)} in, {c.n(d)} on every {gs}",
        f"{c.a} sets out {c.cnt(d * q)}, with {c.n(d)} per {gs}",
    ))  # fmt: skip
    c.question = c.pick(f"How many {gp} does {c.he()} fill?", f"How many {gp} are needed?",
                        f"How many {gp} does that take?", f"How many {gp} will be used?",
                        f"How many full {gp} are there?", f"How many {gp} get filled?")  # fmt: skip


def story_rate(c: _C) -> None:
    """Pay or output per period, a number of periods: the total."""
    k, r = c.r(2, 12), c.r(2, 50)
    ps, pp = c.pick(*PERIODS)
    if c.rng.random() < 0.55:
        job = c.pick(*JOBS)
        c.facts.append(c.pick(
            f"{c.a} is paid {c.money(r)} for each {ps} of {job}",
            f"every {ps} of {job} earns {c.a} {c.money(r)}",
            f"{job} pays {c.a} {c.money(r)} a {ps}",
            f"one {ps} spent {job} gives {c.a} {c.money(r)}",
        ))  # fmt: skip
        c.facts.append(c.pick(f"{c.he()} puts in {c.n(k)} {pp} this month", f"{c.he()} does {c.n(k)} {pp}",
                              f"this term {c.he()} works {c.n(k)} {pp}"))  # fmt: skip
        c.question = c.pick(f"How much does {c.he()} earn in all?", f"What is {c.his()} total pay?",
                            f"What do the {pp} bring {c.him()}?", "How much money does that come to?",
                            f"What does {c.he()} take home for them?")  # fmt: skip
    else:
        maker, things, verb = c.pick(*MACHINES)
        c.facts.append(c.pick(f"{maker} {verb} {c.n(r)} {things} every {ps}", f"{maker} {verb} {c.n(r)} {things} a {ps}",
                              f"{maker} {verb} {c.n(r)} {things} in one {ps}"))  # fmt: skip
        c.facts.append(c.pick(f"it keeps going for {c.n(k)} {pp}", f"it runs for {c.n(k)} {pp}",
                              f"the work lasts {c.n(k)} {pp}"))  # fmt: skip
        c.question = c.pick(f"How many {things} are done in all?", f"How many {things} come out altogether?",
                            f"What is the total number of {things}?", f"How many {things} is that?")  # fmt: skip
    c.calc(r, "*", k) if c.rng.random() < 0.5 else c.calc(k, "*", r)


STORIES = {"left": (story_left, 1.3), "to_go": (story_to_go, 0.8), "gap": (story_gap, 1.1),
           "change": (story_change, 1.0), "to_a": (story_to_a, 0.9), "rate": (story_rate, 1.0)}  # fmt: skip


def _distractor(c: _C) -> str:
    k = c.r(2, 60)
    while k in c.used:
        k = c.r(2, 60)
    return c.pick(f"{c.b} is {k} years old.", f"The radio played {k} songs.", f"It is {k} steps to the door.",
                  f"The queue had {k} people in it.", f"{c.b}'s house is number {k}.")  # fmt: skip


def _sentence(t: str) -> str:
    t = " ".join(t.split())
    return t[:1].upper() + t[1:] + ("" if t.endswith((".", "?")) else ".")


def make_problem(rng: random.Random) -> Problem:
    """One problem (see the module docstring); deterministic for the state of ``rng``."""
    kinds = list(STORIES)
    kind = rng.choices(kinds, [STORIES[k][1] for k in kinds])[0]
    c = _C(rng)
    STORIES[kind][0](c)
    facts = [_sentence(f) for f in c.facts]
    if rng.random() < 0.25:
        facts.insert(rng.randrange(0, len(facts) + 1), _distractor(c))
    body = " ".join(facts)
    text = f"{c.question} {body}" if rng.random() < 0.25 else f"{body} {c.question}"
    text = re.sub(r" +([?.,])", r"\1", " ".join(text.split()))
    answer = "\n".join(f"{e} = <<{e}={v}>>{v}" for e, v in c.steps) + f"\n#### {c.steps[-1][1]}"
    return Problem(text, answer, c.steps[-1][1], f"choices/{kind}")


def generate_choices(n: int, seed: int) -> list[Problem]:
    """``n`` distinct problems for ``seed`` (a prefix of any longer list for the same seed)."""
    return distinct_problems(redrawn(make_problem), n, seed)
