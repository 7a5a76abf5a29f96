"""A word-problem generator for the demo model aimed at choosing the operation from everyday
wording: what is still left ("unsold", "remaining", "yet to", "still to go"), gaps and differences
("how far apart", "ahead by", "draw level"), change from a payment ("hands the cashier", "what comes
back", several items at a price), packing a number to a page or a box (division), rates ("is paid
9 dollars for each hour ... puts in 6 hours", "a machine fills 14 bottles a minute"), a stock plus
packs bought ("already had 18 ... 9 bundles of 7"), one kind asked about beside another ("57
pencils and 5 erasers ... 19 extra pencils"), "exceeds Y's by k" and "k higher than Y's", "for
every one Y has, X has k", a group that shares a total (the group named first), ages later or
earlier, counted things with their own weights ("two suitcases of 39 and 9 kg": the "two" is no
operand), half / a third / a quarter of, "k of the n done", "all but k", "n people each bring k",
several items at a price plus one more (what is spent), and two- and three-step chains: things
pooled then shared ((x + y) / n), pay per period less what is spent (r·h − s), weekly savings plus a
gift split equally ((r·w + g) / n), "twice as many" then some given away (x + m·x − s), and put in,
added, taken out (x + y − z); and every fact inside the one question ("How big is the gap from X's 52 songs
to Y's 36?", "What does X earn for 6 hours at $18 an hour?", change and equal shares too). A rate's
number of periods or a trip's distance done may also be told in the question ("How much does she
earn for 9 such hours?", "With 12 km done, how many km remain?"). In
some problems the first name carries an aside with a number that is no operand (", aged 9,"), and
half of the change stories that start with the buyer name the note first ("With $100 in hand, ...").
A count may also be held until some are lost ("had 40 stamps until 6 of them were swapped away") or
before more come ("had 30 shells before her uncle gave her 12 more").

Each story draws its facts, the question and its place (first or last), how the numbers are written
(digits or words up to twenty) and an unused number from separate lists, so the operation is told
only by the words. Answers are in the demo format, one exact calculation a line then ``#### N``
(the mixture opens them with their quotes). Ranges: stated amounts 1-100 (a total shared or
split in parts up to 300), payments up to 100, products with one factor 2-12, divisors 2-12 with
quotients 2-40, results 1-1000.
"""

from __future__ import annotations

import random
import re

from breakgraph.demo.grammar import StoryDraws
from breakgraph.demo.phrasebank import NUMBER_WORDS
from breakgraph.demo.problems import Problem, distinct_problems, exact_step, redrawn
from breakgraph.demo.varied import FOR_SALE, JOBS, _pl

MAX_RESULT = 1000

# (what is done to things one by one: present, past, past participle, the things)
TASKS = (("reads", "read", "read", "pages"), ("answers", "answered", "answered", "emails"),
         ("unpacks", "unpacked", "unpacked", "boxes"), ("lays", "laid", "laid", "tiles"),
         ("writes", "wrote", "written", "cards"), ("paints", "painted", "painted", "fence posts"),
         ("plants", "planted", "planted", "bulbs"), ("sews", "sewed", "sewn", "buttons"),
         ("labels", "labelled", "labelled", "jars"))  # fmt: skip
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


def _a(text: str) -> str:
    """``text`` after its indefinite article: "a hat", "an umbrella", "an hour", "an 80-km walk"."""
    head = re.split(r"[\s-]", text, maxsplit=1)[0].lower()
    vowel = head.startswith("8") or head in ("11", "18") if head.isdigit() else head.startswith(("a", "e", "i", "o", "u", "hour"))
    return ("an " if vowel else "a ") + text


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

    def named_b(self) -> tuple[str, ...]:
        """``(b,)`` where the second person's pronoun differs from the first's, else ``()``: a
        sentence naming the second person then never makes "she" or "he" in the question ambiguous."""
        return (self.b,) if self.sb != self.sa else ()

    def calc_either(self, a: int, op: str, b: int, as_told: float) -> int:
        """:meth:`calc` of ``a op b`` with probability ``as_told``, else of ``b op a`` (``+`` and
        ``*`` only: the operands in either order)."""
        return self.calc(a, op, b) if self.rng.random() < as_told else self.calc(b, op, a)


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
        walk = _a(f"{d}-{unit.rstrip('s')} walk")
        c.facts.append(c.pick(f"{c.a} is cycling {c.n(d)} {unit} to {c.pick(*DESTINATIONS)}",
                              f"the path to {c.pick(*DESTINATIONS)} measures {c.n(d)} {unit}",
                              f"{c.a} plans {walk}"))  # fmt: skip
        if c.rng.random() < 0.35:  # the part done told in the question
            c.question = c.pick(f"Once {c.n(k)} {unit} are behind {c.him()}, how far is there still to go?",
                                f"With {c.n(k)} {unit} done, how many {unit} remain?",
                                f"If {c.he()} has covered {c.n(k)} {unit}, what distance is left?")  # fmt: skip
        else:
            c.facts.append(c.pick(f"so far {c.he()} has done {c.n(k)} {unit}", f"{c.he()} has already covered {c.n(k)} {unit}",
                                  f"after {c.n(k)} {unit} {c.he()} stops for a snack"))  # fmt: skip
            c.question = c.pick(f"How many {unit} are still ahead of {c.him()}?", "How far is there still to go?",
                                "What distance is left?", f"How many more {unit} must {c.he()} go?",
                                "How much of the way remains?", f"How much farther must {c.a} travel?")  # fmt: skip
    else:
        pres, _, done, things = c.pick(*TASKS)
        d = c.r(10, 100)
        k = c.r(1, d - 1)
        c.facts += [c.pick(f"{c.a} has {c.n(d)} {things} to get through", f"{c.a} {pres} {c.n(d)} {things} this week",
                           f"there are {c.n(d)} {things} on {c.a}'s list"),
                    c.pick(f"{c.he()} has {done} {c.n(k)} so far", f"{c.n(k)} are done already",
                           f"by noon {c.he()} had {done} {c.n(k)}")]  # fmt: skip
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
    if c.rng.random() < 0.6:
        note = c.pick(20, 50, 100, 100)
        k = c.r(2, 9)
        p = c.r(1, max(1, (note - 1) // k))
        c.facts.append(c.pick(f"{c.a} buys {c.n(k)} {_pl(item)} at {c.money(p)} each",
                              f"{c.n(k)} {_pl(item)} go into {c.a}'s basket, {c.money(p)} apiece",
                              f"{c.a} gets {c.n(k)} {_pl(item)} costing {c.money(p)} each",
                              f"{c.a} takes {c.n(k)} {_pl(item)}; each one is {c.money(p)}",
                              f"{c.a} chooses {c.n(k)} {_pl(item)}, every one marked {c.money(p)}",
                              f"{c.a} purchases {c.n(k)} {_pl(item)} that sell at {c.money(p)} each",
                              f"{c.a} orders {c.n(k)} {_pl(item)} at {c.money(p)} per item"))  # fmt: skip
        total = c.calc(k, "*", p)
    else:
        p = c.r(1, note - 1)
        c.facts.append(c.pick(f"{c.a} buys {_a(item)} that costs {c.money(p)}", f"{_a(item)} is marked {c.money(p)}",
                              f"{c.a} picks out {_a(item)} whose price is {c.money(p)}"))  # fmt: skip
        total = p
    if c.facts[0].startswith(c.a) and c.rng.random() < 0.5:  # the note first: "With $100 in hand, Kim buys ..."
        c.facts[0] = c.pick(f"with {c.note(note)} in hand, {c.facts[0]}", f"taking {c.note(note)} to the till, {c.facts[0]}",
                            f"{c.a} has {c.note(note)} and {c.he()}{c.facts[0][len(c.a):]}",
                            f"using {c.note(note)}, {c.facts[0]}", f"paying with {c.note(note)}, {c.facts[0]}")  # fmt: skip
    else:
        who = c.he() if c.a in c.facts[-1] else c.a
        c.facts.append(c.pick(f"{who} hands the cashier {c.note(note)}", f"{who} pays with {c.note(note)}",
                              f"{who} gives the seller {c.note(note)}", f"{who} offers {c.note(note)}"))  # fmt: skip
    c.question = c.pick("How much change is due?", f"What change does {c.he()} receive?",
                        f"How much comes back to {c.a}?", "How much does the seller give back?",
                        f"What does {c.a} get in change?", f"How much money is returned to {c.him()}?",
                        f"What is {c.his()} change?", "How much is handed back?",
                        "How much should come back?", f"How much is {c.he()} owed in change?")  # fmt: skip
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
            f"{job} pays {c.a} {c.money(r)} {_a(ps)}",
            f"one {ps} spent {job} gives {c.a} {c.money(r)}",
            f"{_a(ps)} of {job} earns {c.a} {c.money(r)}",
            f"{c.a} gets {c.money(r)} for {_a(ps)} of {job}",
        ))  # fmt: skip
        if c.rng.random() < 0.35:  # the number of periods told in the question
            c.question = c.pick(f"How much does {c.he()} earn for {c.n(k)} such {pp}?",
                                f"What will {c.n(k)} {pp} of it pay {c.him()}?",
                                f"How much is {c.his()} pay after {c.n(k)} of these {pp}?",
                                f"How much will {c.he()} make in {c.n(k)} {pp}?",
                                f"What do {c.n(k)} {pp} of that bring in?")  # fmt: skip
        else:
            c.facts.append(c.pick(f"{c.he()} puts in {c.n(k)} {pp} this month", f"{c.he()} does {c.n(k)} {pp}",
                                  f"this term {c.he()} works {c.n(k)} {pp}"))  # fmt: skip
            c.question = c.pick(f"How much does {c.he()} earn in all?", f"What is {c.his()} total pay?",
                                f"What do the {pp} bring {c.him()}?", "How much money does that come to?",
                                f"What does {c.he()} take home for them?")  # fmt: skip
    else:
        maker, things, verb = c.pick(*MACHINES)
        c.facts.append(c.pick(f"{maker} {verb} {c.n(r)} {things} every {ps}", f"{maker} {verb} {c.n(r)} {things} {_a(ps)}",
                              f"{maker} {verb} {c.n(r)} {things} in one {ps}"))  # fmt: skip
        c.facts.append(c.pick(f"it keeps going for {c.n(k)} {pp}", f"it runs for {c.n(k)} {pp}",
                              f"the work lasts {c.n(k)} {pp}"))  # fmt: skip
        c.question = c.pick(f"How many {things} are done in all?", f"How many {things} come out altogether?",
                            f"What is the total number of {things}?", f"How many {things} is that?")  # fmt: skip
    c.calc_either(r, "*", k, 0.5)


# pairs of things (plural) one person may keep side by side (one is asked about, the other is a distractor)
SIDE_BY_SIDE = (("cats", "dogs"), ("roses", "tulips"), ("stamps", "coins"), ("comics", "novels"), ("goats", "sheep"),
                ("pencils", "erasers"), ("shirts", "socks"), ("fish", "turtles"), ("apple trees", "pear trees"),
                ("red beads", "blue beads"), ("hens", "ducks"), ("stickers", "badges"), ("cups", "plates"),
                ("cars", "bikes"))  # fmt: skip
ANIMALS = {"cats", "dogs", "goats", "sheep", "fish", "turtles", "hens", "ducks"}
# (things weighed or measured, unit, what the total is called)
MEASURED = (("boxes", "kg", "weight"), ("bags", "kg", "weight"), ("suitcases", "kg", "weight"),
            ("sacks", "kg", "weight"), ("crates", "pounds", "weight"), ("ropes", "metres", "length"),
            ("planks", "metres", "length"), ("ribbons", "cm", "length"), ("walks", "km", "distance"),
            ("runs", "miles", "distance"), ("jugs", "litres", "volume"), ("tanks", "litres", "volume"))  # fmt: skip
COUNT_WORDS = {2: "two", 3: "three"}
# what a person's count may be called when compared ("Rosa's pile is 5 bigger than Ivy's")
HOLDINGS = (("collection", "larger", "smaller"), ("pile", "bigger", "smaller"), ("score", "higher", "lower"),
            ("savings", "greater", "smaller"), ("stack", "taller", "shorter"), ("total", "bigger", "smaller"),
            ("tally", "higher", "lower"), ("haul", "bigger", "smaller"))  # fmt: skip


def story_stock_plus_packs(c: _C) -> None:
    """Some at hand already, then packs of k bought or given: the total (a product, then a sum)."""
    pl = c.thing[1]
    m, k, e = c.r(2, 60), c.r(2, 12), c.r(2, 20)
    pack = c.pick("bags", "boxes", "packs", "tins", "crates", "jars", "bundles", "cartons", "nets", "trays")
    had = c.pick(
        f"{c.a} already had {c.cnt(m)} {c.pick('in the cupboard', 'on the shelf', 'in a drawer', 'in the shed', '')}",
        f"{c.a} kept {c.cnt(m)} from last week", f"there were {c.cnt(m)} in {c.a}'s kitchen to begin with",
        f"{c.a} started out with {c.cnt(m)}", f"{c.a} had {c.cnt(m)} from before",
    )  # fmt: skip
    bought = c.pick(
        f"{c.he()} {c.pick('bought', 'picked up', 'was given', 'ordered', 'brought back')} {c.n(k)} {pack} "
        f"{c.pick('filled with', 'with', 'of', 'containing')} {c.cnt(e)} {c.pick('each', 'apiece', 'in every one', '')}",
        f"{c.n(k)} {pack} of {c.n(e)} {c.pick('arrived', 'came in the post', 'were added', 'were delivered')}",
    )  # fmt: skip
    if c.rng.random() < 0.6:
        c.facts += [had, bought]
    else:  # the purchase first: it names the person
        c.facts += [re.sub(rf"^{c.he()} ", f"{c.a} ", bought), re.sub(rf"^{c.a} ", c.he() + " ", had)]
    got = c.calc_either(k, "*", e, 0.7)
    c.calc_either(got, "+", m, 0.6)
    c.question = c.pick(f"How many {pl} does {c.he()} have now?", f"How many {pl} are there in all?",
                        f"What is {c.his()} {c.thing[0]} total?", f"Find the total number of {pl}.",
                        f"How many {pl} does {c.a} own altogether?", f"How many {pl} is that in total?",
                        f"Count all of {c.his()} {pl}.")  # fmt: skip


def story_two_kinds(c: _C) -> None:
    """Two kinds of thing held side by side; more (or fewer) of one kind: how many of that kind."""
    ones, others = c.pick(*SIDE_BY_SIDE)
    if c.rng.random() < 0.5:
        ones, others = others, ones
    animals = ones in ANIMALS
    a, b = c.r(2, 60), c.r(2, 60)  # both plural
    c.facts.append(c.pick(f"{c.a} has {c.n(a)} {ones} and {c.n(b)} {others}",
                          f"{c.a} looks after {c.n(a)} {ones} and {c.n(b)} {others}",
                          f"at {c.a}'s place there are {c.n(a)} {ones} and {c.n(b)} {others}",
                          f"{c.a} keeps {c.n(b)} {others} and {c.n(a)} {ones}"))  # fmt: skip
    if c.rng.random() < 0.6:
        k = c.r(2, 30)
        verbs = ("adds", "gets", "buys", "takes in", "is given", "wins") + (("rescues",) if animals else ())
        c.facts.append(c.pick(
            f"{c.he()} {c.pick(*verbs)} "
            f"{c.n(k)} {c.pick('more', 'extra', 'additional', 'new')} {ones}",
            f"{c.n(k)} new {ones} join them", f"{c.he()} brings home {c.n(k)} extra {ones}",
            f"another {c.n(k)} {ones} {c.pick('arrive', 'are added', 'come along')}",
        ))  # fmt: skip
        c.calc(a, "+", k)
    else:
        k = c.r(1, a - 1)
        c.facts.append(c.pick(f"{c.he()} {c.pick('gives away', 'sells', 'loses', 'parts with')} {c.n(k)} of the {ones}",
                              f"{c.n(k)} of the {ones} {c.pick('are sold', 'go to a neighbour', 'are given away')}"))  # fmt: skip
        c.calc(a, "-", k)
    c.question = c.pick(f"How many {ones} does {c.he()} have now?", f"What number of {ones} are there now?",
                        f"How many {ones} are there?", f"How many {ones} does {c.a} look after now?",
                        f"Count the {ones}.", f"How many {ones} is that?",
                        f"How many {ones} does {c.he()} {'care for' if animals else 'keep'} now?",
                        f"What is the number of {ones} now?")  # fmt: skip


def story_by_amount(c: _C) -> None:
    """One person's count is larger (or smaller) than another's by k; the other's is given."""
    what, up, down = c.pick(*HOLDINGS)
    m, k = c.r(2, 80), c.r(1, 50)
    larger = c.rng.random() < 0.6 or m <= k
    comp = up if larger else down
    c.facts.append(c.pick(
        f"{c.a}'s {what} is {c.n(k)} {comp} than {c.b}'s",
        f"{c.a}'s {what} {'exceeds' if larger else 'falls short of'} {c.b}'s by {c.n(k)}",
        f"{c.b}'s {what} is {c.n(k)} {down if larger else up} than {c.a}'s",
        f"{c.a}'s {what} {'beats' if larger else 'trails'} {c.b}'s by {c.n(k)}",
        f"{c.a} {'is ahead of' if larger else 'is behind'} {c.b} by {c.n(k)}",
    ))  # fmt: skip
    c.facts.append(c.pick(f"{c.b}'s {what} is {c.n(m)}", f"{c.b} has {c.n(m)}", f"{c.b} stands at {c.n(m)}",
                          f"{c.b}'s {what} comes to {c.n(m)}"))  # fmt: skip
    if c.rng.random() < 0.3:
        c.facts.reverse()
    c.calc(m, "+" if larger else "-", k)
    c.question = c.pick(f"What is {c.a}'s {what}?", f"How large is {c.a}'s {what} then?", f"How much does {c.a} have?",
                        f"Find {c.a}'s {what}.", f"What does {c.a}'s {what} come to?")  # fmt: skip


def story_for_every(c: _C) -> None:
    """k of one person's for every one of another's; the other's count is given: a product."""
    pl = c.thing[1]
    k, m = c.r(2, 12), c.r(2, 50)
    c.facts.append(c.pick(
        f"for every {c.thing[0]} {c.b} has, {c.a} has {c.n(k)}",
        f"{c.a} has {c.n(k)} {pl} for each one {c.b} has",
        f"{c.a} keeps {c.n(k)} times as many {pl} as {c.b}",
        f"{c.a}'s count of {pl} is {c.n(k)} times {c.b}'s",
        f"for each of {c.b}'s {pl}, {c.a} has {c.n(k)}",
    ))  # fmt: skip
    c.facts.append(c.pick(f"{c.b} has {c.cnt(m)}", f"{c.b} holds {c.n(m)}", f"{c.b}'s count is {c.n(m)}"))
    if c.rng.random() < 0.3:
        c.facts.reverse()
    c.calc(m, "*", k)
    c.question = c.pick(f"How many {pl} does {c.a} have?", f"What number does {c.a} have?", f"How many does {c.a} have?",
                        f"Find {c.a}'s count.", f"How many {pl} are {c.a}'s?")  # fmt: skip


def story_share(c: _C) -> None:
    """A group of n shares a total equally, the group named first: the total divided by n."""
    n, q = c.r(2, 12), c.r(2, 25)
    t = n * q
    group = c.pick(
        "friends", "children", "players", "cousins", "workers", "students", "campers", "neighbours"
    )
    unit, noun = c.pick(("", c.thing[1]), ("kg", "of rice"), ("litres", "of juice"), ("", "marbles"),
                        ("metres", "of cloth"), ("", "sweets"), ("km", "of road to clean"))  # fmt: skip
    amount = f"{c.n(t)} {unit} {noun}".replace("  ", " ")
    c.facts.append(c.pick(
        f"{c.n(n)} {group} share {amount} {c.pick('equally', 'in equal portions', 'evenly', 'fairly')}",
        f"a team of {c.n(n)} {group} splits {amount} {c.pick('equally', 'evenly', 'so that all get the same')}",
        f"{c.n(n)} {group} divide {amount} between them {c.pick('equally', 'evenly', 'fairly')}",
        f"{c.a} hands out {amount} to {c.n(n)} {group} in equal shares",
    ))  # fmt: skip
    c.calc(t, "/", n)
    one = group[:-1] if group != "children" else "child"
    c.question = c.pick(f"How much does each {one} get?", f"How much does a single {one} end up with?",
                        f"How much does one {one} carry?", "What does each of them receive?",
                        f"How much is that per {one}?", "What is each share?")  # fmt: skip


def story_age(c: _C) -> None:
    """An age now; some years (or birthdays) later or earlier."""
    a, k = c.r(2, 70), c.r(2, 30)  # k ≥ 2: "years", "birthdays"
    later = c.rng.random() < 0.65 or k >= a
    c.facts.append(c.pick(f"{c.a} is {c.n(a)} years old", f"{c.a} turns {c.n(a)} today", f"{c.a} is {c.n(a)} now",
                          f"this year {c.a} turned {c.n(a)}", f"{c.a} celebrated turning {c.n(a)} last week"))  # fmt: skip
    if later:
        c.question = c.pick(f"How old will {c.he()} be in {c.n(k)} years?",
                            f"What age is {c.he()} going to be {c.n(k)} years from now?",
                            f"How old is {c.he()} after {c.n(k)} more birthdays?",
                            f"What will {c.his()} age be once {c.n(k)} more years pass?")  # fmt: skip
        c.calc(a, "+", k)
    else:
        c.question = c.pick(f"How old was {c.he()} {c.n(k)} years ago?",
                            f"What was {c.his()} age {c.n(k)} years back?",
                            f"How old was {c.a} {c.n(k)} birthdays ago?")  # fmt: skip
        c.calc(a, "-", k)


def story_measured(c: _C) -> None:
    """Two or three things, counted in words, each with its own weight or length: the total."""
    things, unit, total = c.pick(*MEASURED)
    parts = [c.r(2, 90) for _ in range(c.pick(2, 2, 3))]
    count = COUNT_WORDS[len(parts)] if c.rng.random() < 0.8 else str(len(parts))
    if unit == "kg" or c.rng.random() < 0.3:  # "5 and 7 kg", "5, 7 and 9 kg"
        listed = ", ".join(c.n(x) for x in parts[:-1]) + f" and {c.n(parts[-1])} {unit}"
    else:
        listed = ", ".join(f"{c.n(x)} {unit}" for x in parts[:-1]) + f" and {c.n(parts[-1])} {unit}"
    c.facts.append(c.pick(f"{c.a} has {count} {things} of {listed}", f"the {count} {things} measure {listed}",
                          f"{count} {things} come to {listed}", f"{c.a} loads {count} {things}: {listed}"))  # fmt: skip
    run = parts[0]
    for x in parts[1:]:
        run = c.calc(run, "+", x)
    c.question = c.pick(f"What is their total {total}?", f"How much is their combined {total}?",
                        f"How much do the {things} come to together?", f"What {total} is that in all?",
                        f"Find the {total} of {'both' if len(parts) == 2 else 'all three'} {things}.")  # fmt: skip


def story_part_of(c: _C) -> None:
    """Half (a third, a quarter) of a number of things: a division by 2, 3 or 4."""
    pl = c.thing[1]
    d = c.pick(2, 2, 3, 4)
    t = d * c.r(2, 40)
    part = {2: "half", 3: "a third", 4: "a quarter"}[d]
    c.facts.append(c.pick(f"{c.a} has {c.cnt(t)}", f"there are {c.cnt(t)} in {c.a}'s room",
                          f"{c.a} counted {c.cnt(t)} this morning"))  # fmt: skip
    c.facts.append(c.pick(f"{part} of them are {c.pick('new', 'broken', 'red', 'borrowed', 'old')}",
                          f"{c.he()} gives {part} of them to {c.b}", f"{part} of them go in a drawer"))  # fmt: skip
    c.question = c.pick(f"How many {pl} is {part} of them?", f"How many {pl} is that part?",
                        f"How many {pl} does that make?", f"What number is {part} of the {pl}?")  # fmt: skip
    c.calc(t, "/", d)


def story_done_of(c: _C) -> None:
    """k of n done (read, used, painted): how many are left to do; the smaller number comes first."""
    _, past, _, things = c.pick(*TASKS)
    n = c.r(10, 100)
    k = c.r(1, n - 1)
    c.facts.append(c.pick(
        f"{c.a} {past} {c.n(k)} of the {c.n(n)} {things}",
        f"{c.n(k)} of {c.a}'s {c.n(n)} {things} are done already",
        f"so far {c.a} {past} {c.n(k)} out of {c.n(n)} {things}",
    ))  # fmt: skip
    c.question = c.pick(f"How many {things} has {c.he()} still to go?", f"How many {things} are not done yet?",
                        f"How many {things} remain for {c.him()}?", "How many are left to do?")  # fmt: skip
    c.calc(n, "-", k)


def story_all_but(c: _C) -> None:
    """All but k of n used, sold or given: n − k."""
    pl = c.thing[1]
    n = c.r(10, 100)
    k = c.r(1, n - 1)
    verb = c.pick("used", "sold", "gave away", "planted", "packed", "ate", "shared")
    c.facts.append(c.pick(f"{c.a} had {c.cnt(n)}", f"{c.a} bought {c.cnt(n)}", f"a box held {c.cnt(n)}"))
    c.facts.append(c.pick(f"{c.he() if c.a in c.facts[-1] else c.a} {verb} all but {c.n(k)} of them",
                          f"all except {c.n(k)} were {verb if verb not in ('gave away', 'ate') else 'taken'}"))  # fmt: skip
    c.question = c.pick(f"How many {pl} were {verb if verb not in ('gave away', 'ate') else 'taken'}?",
                        f"How many {pl} does that come to?", "How many went?")  # fmt: skip
    c.calc(n, "-", k)


def story_each_bring(c: _C) -> None:
    """n people each bring k things; sometimes m of them are used: n·k (then − m)."""
    pl = c.thing[1]
    n, k = c.r(2, 12), c.r(2, 12)
    group = c.pick("children", "guests", "friends", "players", "neighbours", "pupils")
    c.facts.append(c.pick(f"{c.n(n)} {group} each bring {c.cnt(k)}", f"each of {c.n(n)} {group} brings {c.cnt(k)}",
                          f"{c.n(n)} {group} come, {c.n(k)} {pl} each"))  # fmt: skip
    total = c.calc_either(n, "*", k, 0.7)
    if c.rng.random() < 0.5:
        m = c.r(1, total - 1)
        c.facts.append(c.pick(f"they use {c.n(m)} of them", f"{c.n(m)} {pl} {c.pick('are used', 'get lost', 'are put away')}",
                              f"{c.n(m)} are given to a teacher"))  # fmt: skip
        c.calc(total, "-", m)
        c.question = c.pick(f"How many {pl} are left?", f"How many {pl} remain?", "How many are still there?")
    else:
        c.question = c.pick(f"How many {pl} are brought in all?", f"How many {pl} is that?",
                            f"How many {pl} do they bring together?")  # fmt: skip


def story_spend(c: _C) -> None:
    """Several items at a price each and one more at its own price: what is spent in all."""
    item, other = c.rng.sample(FOR_SALE, 2)
    k, p, q = c.r(2, 9), c.r(1, 30), c.r(1, 60)
    c.facts.append(c.pick(
        f"{c.a} buys {c.n(k)} {_pl(item)} at {c.money(p)} each and {_a(other)} for {c.money(q)}",
        f"{c.a} picks up {c.n(k)} {_pl(item)} costing {c.money(p)} apiece, plus one {other} at {c.money(q)}",
        f"{c.a} gets {_a(other)} for {c.money(q)} and {c.n(k)} {_pl(item)} at {c.money(p)} each",
    ))  # fmt: skip
    cost = c.calc(k, "*", p)
    c.calc_either(cost, "+", q, 0.6)
    c.question = c.pick(f"How much does {c.he()} spend?", "What is the bill?", f"How much does {c.a} pay in all?",
                        "What does it all cost?", f"How much money does {c.he()} spend altogether?")  # fmt: skip


def story_pool_share(c: _C) -> None:
    """Two people put their things together, then share them equally: (x + y) / n."""
    pl = c.thing[1]
    n, q = c.r(2, 10), c.r(2, 20)
    total = n * q
    if total < 4:
        raise ValueError("too few to pool")
    x = c.r(1, total - 1)
    group = c.pick("friends", "children", "classmates", "teams", "baskets", "tables")
    c.facts.append(c.pick(
        f"{c.a} brings {c.cnt(x)} and {c.b} brings {c.n(total - x)}",
        f"{c.a} and {c.b} put together {c.n(x)} and {c.cnt(total - x)}",
        f"{c.a} has {c.cnt(x)}; {c.b} adds {c.n(total - x)} to the heap",
    ))  # fmt: skip
    c.facts.append(c.pick(f"they split them equally among {c.n(n)} {group}",
                          f"the lot is shared out evenly between {c.n(n)} {group}",
                          f"all of them go to {c.n(n)} {group}, the same number each"))  # fmt: skip
    c.calc(x, "+", total - x)
    c.calc(total, "/", n)
    c.question = c.pick(f"How many {pl} does each of the {group} get?", "How many is that each?",
                        f"How many {pl} go to every one of the {group}?", "How many does one of them get?")  # fmt: skip


def story_earn_spend(c: _C) -> None:
    """Pay per period times periods, then some of it spent: r·h − s."""
    r, h = c.r(2, 30), c.r(2, 10)
    s = c.r(1, r * h - 1)
    ps, pp = c.pick(*PERIODS[:3])
    job = c.pick(*JOBS)
    c.facts.append(c.pick(f"{c.a} makes {c.money(r)} for every {ps} of {job}",
                          f"{job} earns {c.a} {c.money(r)} each {ps}", f"{c.a} gets {c.money(r)} {_a(ps)} for {job}"))  # fmt: skip
    c.facts.append(c.pick(f"{c.he()} works {c.n(h)} {pp}", f"this week {c.he()} puts in {c.n(h)} {pp}",
                          f"{c.he()} does it for {c.n(h)} {pp}"))  # fmt: skip
    c.facts.append(c.pick(f"then {c.he()} spends {c.money(s)} on a new {c.pick(*FOR_SALE)}",
                          f"{c.he()} uses {c.money(s)} of the pay for a new {c.pick(*FOR_SALE)}",
                          f"afterwards {c.money(s)} goes on a new {c.pick(*FOR_SALE)}"))  # fmt: skip
    c.calc_either(r, "*", h, 0.6)
    c.calc(r * h, "-", s)
    c.question = c.pick(f"How much money does {c.he()} have left?", f"How much of the pay does {c.he()} keep?",
                        "What is left of the earnings?", f"How much remains for {c.him()}?")  # fmt: skip


def story_save_split(c: _C) -> None:
    """A saving per week for some weeks, a gift on top, the sum split equally: (r·w + g) / n."""
    r, w, n = c.r(2, 20), c.r(2, 10), c.r(2, 6)
    g = n - (r * w) % n + n * c.r(0, 6)
    total = r * w + g
    c.facts.append(c.pick(f"{c.a} saves {c.money(r)} a week for {c.n(w)} weeks",
                          f"for {c.n(w)} weeks {c.a} sets aside {c.money(r)} each week",
                          f"{c.a} puts {c.money(r)} away every week, {c.n(w)} weeks in a row"))  # fmt: skip
    c.facts.append(c.pick(f"an uncle adds {c.money(g)}", f"{c.he()} also gets {c.money(g)} as a gift",
                          f"{c.b} gives {c.him()} {c.money(g)} more"))  # fmt: skip
    c.facts.append(c.pick(f"the whole sum is split equally among {c.n(n)} {c.pick('jars', 'causes', 'friends', 'envelopes')}",
                          f"{c.he()} shares all of it evenly between {c.n(n)} {c.pick('cousins', 'charities', 'boxes')}"))  # fmt: skip
    c.calc_either(r, "*", w, 0.6)
    c.calc(r * w, "+", g)
    c.calc(total, "/", n)
    c.question = c.pick("How much is each part?", "How much goes into each one?", "What does each one receive?",
                        "How much is one share?")  # fmt: skip


def story_multiple_then(c: _C) -> None:
    """One person has x, another twice (three times) that, then some given away: x·m, x + x·m, − s."""
    pl = c.thing[1]
    m = c.pick(2, 2, 3, 4)
    x = c.r(2, 40)
    s = c.r(1, x + x * m - 1)
    times = {2: "twice", 3: "three times", 4: "four times"}[m]
    c.facts.append(c.pick(f"{c.a} {c.pick('picks', 'collects', 'finds', 'makes')} {c.cnt(x)}",
                          f"{c.a} starts with {c.cnt(x)}"))  # fmt: skip
    c.facts.append(c.pick(f"{c.b} {c.pick('gets', 'collects', 'has')} {times} as many",
                          f"{c.b}'s number is {times} {c.a}'s" if m > 2 else f"{c.b} has double {c.a}'s number"))  # fmt: skip
    c.facts.append(c.pick(f"together they {c.pick('sell', 'give away', 'use')} {c.n(s)} of them",
                          f"then {c.n(s)} of all those {pl} are {c.pick('sold', 'given away', 'used up')}"))  # fmt: skip
    c.calc(x, "*", m)
    c.calc(x, "+", x * m)
    c.calc(x + x * m, "-", s)
    c.question = c.pick(f"How many {pl} do they have left?", f"How many {pl} remain with them?",
                        "How many are still theirs?", f"What number of {pl} is left?")  # fmt: skip


def story_in_and_out(c: _C) -> None:
    """Put in, added, taken out: x + y − z."""
    x, y = c.r(2, 60), c.r(2, 60)
    z = c.r(1, x + y - 1)
    place = c.pick("jar", "tin", "money box", "drawer", "box", "till")
    money = c.rng.random() < 0.6
    amt = c.money if money else c.cnt
    goes, is_ = ("goes", "is") if money else ("go", "are")
    c.facts.append(c.pick(f"{c.a} puts {amt(x)} in a {place}", f"{c.a} drops {amt(x)} into a {place}",
                          f"there {is_} {amt(x)} in a {place}"))  # fmt: skip
    c.facts.append(
        c.pick(f"later {c.he()} adds {amt(y)}", f"then {amt(y)} more {goes} in", f"{c.b} adds {amt(y)}")
    )
    c.facts.append(c.pick(f"after that {c.he()} takes {amt(z)} out", f"{amt(z)} {is_} taken out for a trip",
                          f"{c.he()} removes {amt(z)}"))  # fmt: skip
    c.calc(x, "+", y)
    c.calc(x + y, "-", z)
    c.question = c.pick(f"How much is in the {place} now?" if money else f"How many {c.thing[1]} are in the {place} now?",
                        f"What is left in the {place}?", f"What does the {place} hold at the end?")  # fmt: skip


def story_until(c: _C) -> None:
    """A count held until some were lost ("had 40 stamps until 6 of them were swapped away"), or held
    before more came ("had 30 shells before her uncle gave her 12 more"): x − k or x + k."""
    pl = c.thing[1]
    x = c.r(10, 100)
    other = c.named_b()
    if c.rng.random() < 0.5:
        k = c.r(2, x - 1)
        keep = c.pick("had", "kept", "held on to", "was keeping")
        gone = c.pick("were lost", "were swapped away", "were given to a cousin", "went missing",
                      "were sold at the fair", *(f"went to {b}" for b in other))  # fmt: skip
        c.facts.append(f"{c.a} {keep} {c.cnt(x)} until {c.n(k)} of them {gone}")
        c.calc(x, "-", k)
        c.question = c.pick(f"How many {pl} does {c.he()} have now?", f"How many {pl} stayed with {c.a}?",
                            f"How many {pl} are left?", f"What number of {pl} remain with {c.him()}?")  # fmt: skip
    else:
        k = c.r(2, 60)
        keep = c.pick("had", "already had")
        giver = c.pick(*other, "a friend", "her uncle" if c.sa == "f" else "his uncle", "a neighbour", "the teacher")
        came = c.pick(f"{giver} gave {c.him()} {c.n(k)} more", f"{giver} sent {c.n(k)} extra",
                      f"{c.n(k)} more arrived from {giver}", f"{giver} added {c.n(k)}")  # fmt: skip
        c.facts.append(c.pick(f"{c.a} {keep} {c.cnt(x)} before {came}", f"before {came}, {c.a} {keep} {c.cnt(x)}"))
        c.calc_either(x, "+", k, 0.8)
        c.question = c.pick(f"How many {pl} does {c.he()} have now?", f"How many {pl} does {c.a} have after that?",
                            f"How many {pl} has {c.he()} got now?", f"How many {pl} are there in all?")  # fmt: skip


def story_in_question(c: _C) -> None:
    """Every fact inside the one question ("How big is the gap from X's 52 songs to Y's 36?",
    "What does X earn for 6 hours at $18 an hour?"): a gap, a sum, pay for periods, change for
    several items, an equal share."""
    pl = c.thing[1]
    form = c.pick("gap", "gap", "sum", "pay", "change", "share")
    if form == "gap":
        x = c.r(5, 100)
        y = c.r(2, x - 1)
        first, second = (x, y) if c.rng.random() < 0.6 else (y, x)  # the gap either way round
        c.question = c.pick(
            f"How big is the gap from {c.a}'s {c.n(first)} {pl} to {c.b}'s {c.n(second)} {pl}?",
            f"How far apart are {c.a}'s {c.n(first)} {pl} and {c.b}'s {c.n(second)}?",
            f"What is the difference between {c.n(first)} {pl} for {c.a} and {c.n(second)} for {c.b}?",
            f"By how many {pl} do {c.a}'s {c.n(first)} and {c.b}'s {c.n(second)} differ?",
        )  # fmt: skip
        c.calc(x, "-", y)
    elif form == "sum":
        x, y = c.r(2, 100), c.r(2, 100)
        c.question = c.pick(
            f"What do {c.a}'s {c.n(x)} {pl} and {c.b}'s {c.n(y)} {pl} come to together?",
            f"How many {pl} are {c.a}'s {c.n(x)} and {c.b}'s {c.n(y)} in all?",
            f"What is the total of {c.n(x)} {pl} from {c.a} and {c.n(y)} from {c.b}?",
        )  # fmt: skip
        c.calc_either(x, "+", y, 0.7)
    elif form == "pay":
        k, r = c.r(2, 12), c.r(2, 50)
        ps, pp = c.pick(*PERIODS)
        job = c.pick(*JOBS)
        c.question = c.pick(
            f"What does {c.a} earn for {c.n(k)} {pp} of {job} at {c.money(r)} {_a(ps)}?",
            f"At {c.money(r)} for each {ps} of {job}, what do {c.n(k)} {pp} bring {c.a}?",
            f"If one {ps} of {job} earns {c.a} {c.money(r)}, how much do {c.n(k)} {pp} earn?",
        )  # fmt: skip
        c.calc_either(r, "*", k, 0.5)
    elif form == "change":
        item = c.pick(*FOR_SALE)
        note = c.pick(20, 50, 100, 100)
        k = c.r(2, 9)
        p = c.r(1, max(1, (note - 1) // k))
        c.question = c.pick(
            f"How much change does {c.a} get from {c.note(note)} for {c.n(k)} {_pl(item)} at {c.money(p)} each?",
            f"Paying with {c.note(note)} for {c.n(k)} {_pl(item)} that cost {c.money(p)} apiece, how much change is due to {c.a}?",
            f"What comes back from {c.note(note)} when {c.a} buys {c.n(k)} {_pl(item)} costing {c.money(p)} each?",
        )  # fmt: skip
        c.calc(note, "-", c.calc(k, "*", p))
    else:
        n, q = c.r(2, 12), c.r(2, 25)
        group = c.pick("friends", "children", "players", "cousins", "campers", "neighbours")
        c.question = c.pick(
            f"How many {pl} does each of {c.n(n)} {group} get when {c.n(n * q)} {pl} are shared equally?",
            f"If {c.n(n * q)} {pl} are split evenly among {c.n(n)} {group}, how many does one get?",
        )  # fmt: skip
        c.calc(n * q, "/", n)


STORIES = {"left": (story_left, 1.3), "to_go": (story_to_go, 0.8), "gap": (story_gap, 1.1),
           "change": (story_change, 1.0), "to_a": (story_to_a, 0.9), "rate": (story_rate, 1.0),
           "stock_plus_packs": (story_stock_plus_packs, 0.9), "two_kinds": (story_two_kinds, 0.9),
           "by_amount": (story_by_amount, 1.0), "for_every": (story_for_every, 0.8), "share": (story_share, 0.9),
           "age": (story_age, 0.6), "measured": (story_measured, 0.8), "part_of": (story_part_of, 0.6),
           "done_of": (story_done_of, 0.7), "all_but": (story_all_but, 0.6), "each_bring": (story_each_bring, 0.8),
           "spend": (story_spend, 0.8), "pool_share": (story_pool_share, 0.6), "earn_spend": (story_earn_spend, 0.7),
           "save_split": (story_save_split, 0.6), "multiple_then": (story_multiple_then, 0.6),
           "in_and_out": (story_in_and_out, 0.7), "in_question": (story_in_question, 0.9),
           "until": (story_until, 0.7)}  # fmt: skip


def _distractor(c: _C) -> str:
    k = c.r(2, 60)
    while k in c.used:
        k = c.r(2, 60)
    named = [s for b in c.named_b() for s in (f"{b} is {k} years old.", f"{b}'s house is number {k}.")]
    return c.pick(*named, f"The radio played {k} songs.", f"It is {k} steps to the door.",
                  f"The queue had {k} people in it.")  # fmt: skip


def _aside(c: _C) -> str:
    """A number beside the first name that is neither an operand nor a result: ", aged 9," or ",
    from flat 7,"; 5-15 and written nowhere else in the problem (not "half", "twice" or "four times"
    either). Not in the age stories, whose first fact is an age."""
    told = " ".join([*c.facts, c.question]).lower()
    taken = c.used | {v for _, v in c.steps}  # no operand, no result
    free = [k for k in range(5, 16) if k not in taken and not re.search(rf"\b({k}|{NUMBER_WORDS[k]})\b", told)]
    if not free:
        return ""
    k = c.pick(*free)
    return c.pick(f", aged {c.n(k)},", f", who is {c.n(k)},", f" ({c.n(k)} years old)", f", {c.n(k)} years old,",
                  f", from flat {k},")  # fmt: skip


def _sentence(t: str) -> str:
    t = " ".join(t.split())
    return t[:1].upper() + t[1:] + ("" if t.endswith((".", "?")) else ".")


def make_problem(rng: random.Random) -> Problem:
    """One problem (see the module docstring); deterministic for the state of ``rng``."""
    kinds = list(STORIES)
    kind = rng.choices(kinds, [STORIES[k][1] for k in kinds])[0]
    c = _C(rng)
    STORIES[kind][0](c)
    if kind != "age" and c.facts and c.facts[0].startswith(c.a + " ") and rng.random() < 0.15:
        c.facts[0] = c.a + _aside(c) + c.facts[0][len(c.a) :]
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
