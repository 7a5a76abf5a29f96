"""Word problems in many surface forms, assembled from small parts, for training the demo model.

Where :mod:`breakgraph.demo.problems` has fixed whole-question templates, this generator builds
each problem from an opening (a start amount, groups of equal size, a price, a rate, a share, a
comparison, a list of parts, a payment, or bare arithmetic) followed by zero to three events
(gains, losses, doubling), with independent choices for every clause: present or past tense,
name or pronoun, numbers up to twenty as digits or words, money as ``$7``, ``7 euros``, ``£7``...,
units, sentence joins, the question first or last, and distractor sentences with numbers the
answer does not use. A problem has one to four steps.

The answer is GSM8K's format with one calculation per line and the final number::

    17+26 = <<17+26=43>>43
    43-5 = <<43-5=38>>38
    #### 38

Number ranges (every result, intermediate or final, is an integer in 1-1000): sums of word
problems start from amounts up to 100; a product has one factor 2-12 and the other 2-50 (or doubles
an amount up to 500); a division has a divisor 2-12 and an exact quotient 2-25 (or halves an even
amount up to 80). Bare arithmetic goes further: addends up to
500, minuends up to 1000, products up to 12 x 83, quotients up to 50.

The held-out phrasings (:mod:`breakgraph.demo.heldout`) are written separately and share no
five-word run with the phrases here (``tests/test_demo_heldout.py``).
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

from breakgraph.demo.problems import Problem, distinct_problems, exact_step

MAX_RESULT = 1000

NUMBER_WORDS = (
    "zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten", "eleven",
    "twelve", "thirteen", "fourteen", "fifteen", "sixteen", "seventeen", "eighteen", "nineteen", "twenty",
)  # fmt: skip

PEOPLE = (
    ("Tom", "m"), ("Anna", "f"), ("Ben", "m"), ("Sara", "f"), ("Jack", "m"), ("Lucy", "f"), ("Sam", "m"),
    ("Kate", "f"), ("Max", "m"), ("Ella", "f"), ("Dan", "m"), ("Maya", "f"), ("Alex", "m"), ("Nina", "f"),
    ("Raj", "m"), ("Yuki", "f"), ("Carlos", "m"), ("Leila", "f"), ("Pablo", "m"), ("Zara", "f"),
    ("Emma", "f"), ("Liam", "m"), ("Noah", "m"), ("Olivia", "f"), ("Mia", "f"), ("Leo", "m"),
    ("Omar", "m"), ("Priya", "f"), ("Hugo", "m"), ("Grace", "f"), ("John", "m"), ("Mary", "f"),
    ("Peter", "m"), ("Julia", "f"), ("Chen", "m"), ("Amy", "f"), ("Luis", "m"), ("Ines", "f"),
)  # fmt: skip

# (singular, plural, edible)
THINGS = (
    ("apple", "apples", True), ("orange", "oranges", True), ("banana", "bananas", True),
    ("cookie", "cookies", True), ("cupcake", "cupcakes", True), ("egg", "eggs", True),
    ("muffin", "muffins", True), ("candy", "candies", True), ("pear", "pears", True),
    ("sandwich", "sandwiches", True), ("grape", "grapes", True), ("carrot", "carrots", True),
    ("pie", "pies", True), ("lemon", "lemons", True), ("pancake", "pancakes", True),
    ("marble", "marbles", False), ("sticker", "stickers", False), ("pencil", "pencils", False),
    ("book", "books", False), ("card", "cards", False), ("stamp", "stamps", False),
    ("shell", "shells", False), ("toy car", "toy cars", False), ("balloon", "balloons", False),
    ("coin", "coins", False), ("flower", "flowers", False), ("crayon", "crayons", False),
    ("bead", "beads", False), ("rock", "rocks", False), ("pen", "pens", False), ("ball", "balls", False),
    ("shirt", "shirts", False), ("plant", "plants", False), ("brick", "bricks", False),
    ("ticket", "tickets", False), ("bottle", "bottles", False), ("candle", "candles", False),
    ("photo", "photos", False), ("game", "games", False), ("button", "buttons", False),
)  # fmt: skip
BOXES = (
    ("box", "boxes"), ("bag", "bags"), ("basket", "baskets"), ("jar", "jars"), ("pack", "packs"),
    ("crate", "crates"), ("tray", "trays"), ("bowl", "bowls"), ("shelf", "shelves"), ("row", "rows"),
    ("pile", "piles"), ("carton", "cartons"),
)  # fmt: skip
GIFTS = ("toy", "hat", "kite", "book", "game", "lamp", "bag", "ball", "cake", "clock", "shirt", "mug")
# (prefix, suffix) around an amount
CURRENCIES = (
    ("$", ""), ("$", ""), ("£", ""), ("€", ""), ("", " dollars"), ("", " euros"), ("", " pounds"),
    ("", " rupees"), ("", " pesos"), ("", " yen"), ("", " coins"),
)  # fmt: skip
# (unit, verb: base, present, past)
RATES = (
    ("pages", "read", "reads", "read"), ("miles", "walk", "walks", "walked"), ("kilometers", "run", "runs", "ran"),
    ("laps", "swim", "swims", "swam"), ("cookies", "bake", "bakes", "baked"), ("words", "write", "writes", "wrote"),
    ("photos", "take", "takes", "took"), ("boxes", "pack", "packs", "packed"), ("bottles", "fill", "fills", "filled"),
)  # fmt: skip
PERIODS = (("day", "days"), ("hour", "hours"), ("week", "weeks"), ("minute", "minutes"), ("month", "months"))
COLOURS = ("red", "blue", "green", "yellow", "white", "black", "pink", "small", "big", "old", "new")
WEEKDAYS = ("Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday")


@dataclass
class _Person:
    name: str
    sex: str

    def pron(self, case: str) -> str:
        """``case``: ``he`` (subject), ``him`` (object) or ``his`` (possessive)."""
        return {"he": ("he", "she"), "him": ("him", "her"), "his": ("his", "her")}[case][self.sex == "f"]


@dataclass
class _Draft:
    """A problem being written: fact sentences, calculation steps ``(expr, value)``, the current
    quantity and what it counts (``unit``: a plural noun, or ``money``)."""

    facts: list[str] = field(default_factory=list)
    steps: list[tuple[str, int]] = field(default_factory=list)
    value: int = 0
    unit: str = ""
    holder: _Person | None = None
    question: str = ""

    def calc(self, a: int, op: str, b: int) -> int:
        v = exact_step(a, op, b)
        self.steps.append((f"{a}{op}{b}", v))
        self.value = v
        return v


class _Writer:
    """Per-problem choices: people, noun, currency, tense, and how numbers are written."""

    def __init__(self, rng: random.Random):
        self.rng = rng
        (n1, s1), (n2, s2), (n3, s3) = rng.sample(PEOPLE, 3)
        self.s, self.o, self.x = _Person(n1, s1), _Person(n2, s2), _Person(n3, s3)
        self.thing = rng.choice(THINGS)
        self.box = rng.choice(BOXES)
        self.cur = rng.choice(CURRENCIES)
        self.past = rng.random() < 0.4
        self.word_p = rng.choice((0.0, 0.3, 0.6))

    def num(self, n: int) -> str:
        return NUMBER_WORDS[n] if n <= 20 and self.rng.random() < self.word_p else str(n)

    def money(self, n: int) -> str:
        pre, post = self.cur
        return f"{pre}{n}{post}" if pre else f"{self.num(n)}{post}"

    def v(self, present: str, past: str) -> str:
        return past if self.past else present

    def pick(self, *options):
        return self.rng.choice(options)

    def who(self, p: _Person, first: bool = False) -> str:
        """The name, or (after the first mention) sometimes the pronoun."""
        return p.name if first or self.rng.random() < 0.5 else p.pron("he")


def _cap(s: str) -> str:
    return s[:1].upper() + s[1:]


_NAMES = {n for n, _ in PEOPLE}


def _uncap(s: str) -> str:
    """``s`` with its first letter in lower case, unless it starts with a name."""
    return s if s.split(" ", 1)[0].split("'")[0] in _NAMES else s[:1].lower() + s[1:]


def _r(rng: random.Random, lo: int, hi: int) -> int:
    return rng.randint(lo, hi)


# --------------------------------------------------------------------------------------------
# Openings: each writes the first facts and steps and leaves a current quantity


def _open_start(w: _Writer, d: _Draft) -> None:
    """A start amount; the steps come from the events that follow."""
    sg, pl, _ = w.thing
    n = _r(w.rng, 5, 100)
    s = w.s.name
    d.facts.append(w.pick(
        f"{s} {w.v('has', 'had')} {w.num(n)} {pl}",
        f"{s} {w.v('owns', 'owned')} {w.num(n)} {pl}",
        f"{s} {w.v('starts', 'started')} with {w.num(n)} {pl}",
        f"{s} {w.v('keeps', 'kept')} {w.num(n)} {pl} in a {w.box[0]}",
        f"{s} {w.v('collects', 'collected')} {w.num(n)} {pl}",
        f"There {w.v('are', 'were')} {w.num(n)} {pl} in {s}'s {w.box[0]}",
        f"At first, {s} {w.v('has', 'had')} {w.num(n)} {pl}",
    ))  # fmt: skip
    d.value, d.unit, d.holder = n, pl, w.s


def _open_money(w: _Writer, d: _Draft) -> None:
    n = _r(w.rng, 10, 100)
    s = w.s.name
    d.facts.append(w.pick(
        f"{s} {w.v('has', 'had')} {w.money(n)}",
        f"{s} {w.v('has', 'had')} {w.money(n)} in {w.s.pron('his')} wallet",
        f"{s} {w.v('saves', 'saved')} {w.money(n)}",
        f"{s}'s purse {w.v('holds', 'held')} {w.money(n)}",
    ))  # fmt: skip
    d.value, d.unit, d.holder = n, "money", w.s


def _open_groups(w: _Writer, d: _Draft) -> None:
    sg, pl, _ = w.thing
    box, boxes = w.box
    a, b = _r(w.rng, 2, 12), _r(w.rng, 2, 50)
    s = w.s.name
    d.facts.extend(w.pick(
        [f"{s} {w.v('buys', 'bought')} {w.num(a)} {boxes} of {pl}", f"Each {box} {w.v('has', 'had')} {w.num(b)} {pl}"],
        [f"{s} {w.v('has', 'had')} {w.num(a)} {boxes} with {w.num(b)} {pl} in each {box}"],
        [f"{s} {w.v('has', 'had')} {w.num(a)} {boxes}, and each one {w.v('holds', 'held')} {w.num(b)} {pl}"],
        [f"There {w.v('are', 'were')} {w.num(b)} {pl} per {box}", f"{s} {w.v('has', 'had')} {w.num(a)} {boxes}"],
        [f"{s} {w.v('puts', 'put')} {w.num(b)} {pl} into each of {w.num(a)} {boxes}"],
        [f"{s} {w.v('fills', 'filled')} {w.num(a)} {boxes} with {w.num(b)} {pl} each"],
    ))  # fmt: skip
    d.calc(a, "*", b) if w.rng.random() < 0.7 else d.calc(b, "*", a)
    d.unit, d.holder = pl, w.s


def _open_price(w: _Writer, d: _Draft) -> None:
    sg, pl, _ = w.thing
    a, b = _r(w.rng, 2, 12), _r(w.rng, 2, 50)
    s = w.s.name
    d.facts.extend(w.pick(
        [f"{s} {w.v('buys', 'bought')} {w.num(a)} {pl} at {w.money(b)} each"],
        [f"One {sg} {w.v('costs', 'cost')} {w.money(b)}", f"{s} {w.v('buys', 'bought')} {w.num(a)} {pl}"],
        [f"{_cap(pl)} {w.v('cost', 'cost')} {w.money(b)} each", f"{s} {w.v('wants', 'wanted')} {w.num(a)} of them"],
        [f"{s} {w.v('pays', 'paid')} {w.money(b)} for each of {w.num(a)} {pl}"],
        [f"A {sg} {w.v('sells', 'sold')} for {w.money(b)}", f"{s} {w.v('gets', 'got')} {w.num(a)}"],
        [f"{s} {w.v('orders', 'ordered')} {w.num(a)} {pl} for {w.money(b)} each"],
        [f"{_cap(pl)} {w.v('are', 'were')} {w.money(b)} a piece", f"{s} {w.v('takes', 'took')} {w.num(a)}"],
    ))  # fmt: skip
    d.calc(a, "*", b)
    d.unit, d.holder = "cost", w.s


def _open_rate(w: _Writer, d: _Draft) -> None:
    unit, base, pres, past = w.rng.choice(RATES)
    per, pers = w.rng.choice(PERIODS)
    a, b = _r(w.rng, 2, 12), _r(w.rng, 2, 50)
    s = w.s.name
    verb = w.v(pres, past)
    every = w.pick(f"every {per}", f"each {per}", f"a {per}", f"per {per}")
    d.facts.append(w.pick(
        f"{s} {verb} {w.num(b)} {unit} {every} for {w.num(a)} {pers}",
        f"For {w.num(a)} {pers}, {s} {verb} {w.num(b)} {unit} {every}",
        f"{s} {verb} {w.num(b)} {unit} {every}. {_cap(w.who(w.s))} {w.v('does', 'did')} this for {w.num(a)} {pers}",
    ))  # fmt: skip
    d.calc(b, "*", a)
    h, does = w.who(w.s), w.v("does", "did")
    d.question = w.pick(f"How many {unit} {does} {h} {base} in total?", f"How many {unit} {does} {h} {base} altogether?",
                        f"How many {unit} {does} {h} {base} in all?")  # fmt: skip
    d.unit, d.holder = "", None


def _open_wage(w: _Writer, d: _Draft) -> None:
    per, pers = w.rng.choice(PERIODS[:3])
    a, b = _r(w.rng, 2, 12), _r(w.rng, 2, 50)
    s = w.s.name
    d.facts.extend(w.pick(
        [f"{s} {w.v('earns', 'earned')} {w.money(b)} per {per}", f"{_cap(w.who(w.s))} {w.v('works', 'worked')} {w.num(a)} {pers}"],
        [f"{s} {w.v('makes', 'made')} {w.money(b)} an {per}" if per == "hour" else f"{s} {w.v('makes', 'made')} {w.money(b)} a {per}",
         f"{_cap(w.who(w.s))} {w.v('works', 'worked')} for {w.num(a)} {pers}"],
        [f"{s} {w.v('saves', 'saved')} {w.money(b)} every {per} for {w.num(a)} {pers}"],
    ))  # fmt: skip
    d.calc(b, "*", a)
    d.unit, d.holder = "money", w.s


def _open_share(w: _Writer, d: _Draft) -> None:
    sg, pl, _ = w.thing
    box, boxes = w.box
    dv, q = _r(w.rng, 2, 12), _r(w.rng, 2, 25)
    a = dv * q
    s = w.s.name
    form = w.rng.randrange(4)
    if form == 0:
        d.facts.append(w.pick(
            f"{s} {w.v('shares', 'shared')} {w.num(a)} {pl} equally among {w.num(dv)} friends",
            f"{s} {w.v('has', 'had')} {w.num(a)} {pl} and {w.v('splits', 'split')} them evenly between {w.num(dv)} friends",
            f"{w.num(a)} {pl} {w.v('are', 'were')} shared equally by {w.num(dv)} friends",
        ))  # fmt: skip
        d.question = w.pick(f"How many {pl} does each friend get?", f"How many {pl} does each friend receive?",
                            f"How many {pl} will each friend have?")  # fmt: skip
    elif form == 1:
        d.facts.append(w.pick(
            f"{s} {w.v('puts', 'put')} {w.num(a)} {pl} into {w.num(dv)} {boxes} with the same number in each",
            f"{s} {w.v('divides', 'divided')} {w.num(a)} {pl} equally into {w.num(dv)} {boxes}",
        ))  # fmt: skip
        d.question = w.pick(f"How many {pl} are in each {box}?", f"How many {pl} go in each {box}?")
    elif form == 2:
        d.facts.append(w.pick(
            f"{s} {w.v('packs', 'packed')} {w.num(a)} {pl} into {boxes} of {w.num(dv)}",
            f"{s} {w.v('has', 'had')} {w.num(a)} {pl}. {_cap(w.who(w.s))} {w.v('puts', 'put')} {w.num(dv)} in each {box}",
        ))  # fmt: skip
        d.question = w.pick(f"How many {boxes} does {w.who(w.s)} fill?", f"How many {boxes} are needed?")
    else:
        d.facts.append(w.pick(
            f"{s} {w.v('pays', 'paid')} {w.money(a)} for {w.num(dv)} {pl}, all the same price",
            f"{w.num(dv)} {pl} {w.v('cost', 'cost')} {w.money(a)} in total",
        ))  # fmt: skip
        d.question = w.pick(f"How much does one {sg} cost?", f"What is the price of each {sg}?",
                            f"How much is each {sg}?")  # fmt: skip
    d.calc(a, "/", dv)
    d.unit, d.holder = "", None


def _open_compare(w: _Writer, d: _Draft) -> None:
    sg, pl, _ = w.thing
    s, o = w.s.name, w.o.name
    a = _r(w.rng, 4, 80)
    d.facts.append(f"{s} {w.v('has', 'had')} {w.num(a)} {pl}")
    form = w.rng.randrange(5)
    if form == 0:
        b = _r(w.rng, 2, 50)
        d.facts.append(w.pick(f"{o} {w.v('has', 'had')} {w.num(b)} more {pl} than {s}",
                              f"{o} {w.v('has', 'had')} {w.num(b)} more than {w.who(w.s)} {w.v('does', 'did')}"))  # fmt: skip
        d.calc(a, "+", b)
    elif form == 1:
        b = _r(w.rng, 1, a - 2)
        d.facts.append(w.pick(f"{o} {w.v('has', 'had')} {w.num(b)} fewer {pl} than {s}", f"{o} {w.v('has', 'had')} {w.num(b)} fewer than {s}",
                              f"{o} {w.v('has', 'had')} {w.num(b)} less than {w.who(w.s)} {w.v('does', 'did')}"))  # fmt: skip
        d.calc(a, "-", b)
    elif form == 2:
        k = _r(w.rng, 2, 10)
        a = min(a, 50)
        d.facts[-1] = f"{s} {w.v('has', 'had')} {w.num(a)} {pl}"
        times = w.pick(f"{w.num(k)} times as many", "twice as many" if k == 2 else f"{w.num(k)} times as many")
        d.facts.append(f"{o} {w.v('has', 'had')} {times} {pl} as {s}")
        d.calc(a, "*", k)
    elif form == 3:
        a = 2 * _r(w.rng, 2, 40)
        d.facts[-1] = f"{s} {w.v('has', 'had')} {w.num(a)} {pl}"
        d.facts.append(f"{o} {w.v('has', 'had')} half as many {pl} as {s}")
        d.calc(a, "/", 2)
    else:
        b = _r(w.rng, 2, a - 1)
        d.facts.append(f"{o} {w.v('has', 'had')} {w.num(b)} {pl}")
        d.calc(a, "-", b)
        d.question = w.pick(f"How many more {pl} does {s} have than {o}?",
                            f"How many fewer {pl} does {o} have than {s}?",
                            f"What is the difference between the number of {pl} {s} and {o} have?")  # fmt: skip
        d.unit, d.holder = "", None
        return
    if w.rng.random() < 0.4:
        first = d.steps[0][1]
        d.calc(a, "+", first)
        d.question = w.pick(f"How many {pl} do they have together?", f"How many {pl} do {s} and {o} have in all?",
                            f"How many {pl} do the two of them have altogether?")  # fmt: skip
        d.unit, d.holder = "", None
    else:
        d.unit, d.holder = pl, w.o


def _open_parts(w: _Writer, d: _Draft) -> None:
    sg, pl, _ = w.thing
    k = w.rng.choice((2, 2, 3, 3, 4))
    parts = [_r(w.rng, 2, 60) for _ in range(k)]
    s = w.s.name
    if w.rng.random() < 0.5:
        colours = w.rng.sample(COLOURS, k)
        listed = [f"{w.num(n)} {c} {pl}" for n, c in zip(parts, colours)]
        joined = ", ".join(listed[:-1]) + f"{w.pick(' and', ', and')} {listed[-1]}"
        d.facts.append(f"{s} {w.v('has', 'had')} {joined}")
    else:
        day = w.rng.randrange(7)
        verb = w.v(w.pick("collects", "buys", "picks", "finds"), w.pick("collected", "bought", "picked", "found"))
        d.facts.append(f"On {WEEKDAYS[day]} {s} {verb} {w.num(parts[0])} {pl}")
        for i, n in enumerate(parts[1:], 1):
            d.facts.append(w.pick(f"On {WEEKDAYS[(day + i) % 7]} {w.who(w.s)} {verb} {w.num(n)}",
                                  f"On {WEEKDAYS[(day + i) % 7]}, {w.who(w.s)} {verb} {w.num(n)} more"))  # fmt: skip
    total = parts[0]
    for n in parts[1:]:
        total = d.calc(total, "+", n)
    d.question = w.pick(f"How many {pl} does {s} have in total?", f"How many {pl} are there altogether?",
                        f"How many {pl} is that in all?", f"How many {pl} does {s} have altogether?")  # fmt: skip
    d.unit, d.holder = "", None


def _open_change(w: _Writer, d: _Draft) -> None:
    s = w.s.name
    gift = w.rng.choice(GIFTS)
    if w.rng.random() < 0.5:
        cost = _r(w.rng, 2, 95)
        paid = w.rng.choice([p for p in (5, 10, 20, 50, 100) if p > cost] or [100])
        d.facts.append(w.pick(
            f"{s} {w.v('buys', 'bought')} a {gift} for {w.money(cost)} and {w.v('pays', 'paid')} with {w.money(paid)}",
            f"A {gift} {w.v('costs', 'cost')} {w.money(cost)}. {s} {w.v('pays', 'paid')} with {w.money(paid)}",
            f"{s} {w.v('gives', 'gave')} the cashier {w.money(paid)} for a {gift} that {w.v('costs', 'cost')} {w.money(cost)}",
        ))  # fmt: skip
        d.calc(paid, "-", cost)
    else:
        sg, pl, _ = w.thing
        a, b = _r(w.rng, 2, 6), _r(w.rng, 2, 15)
        paid = w.rng.choice([p for p in (20, 50, 100) if p > a * b])
        d.facts.append(f"{s} {w.v('buys', 'bought')} {w.num(a)} {pl} at {w.money(b)} each")
        d.facts.append(f"{_cap(w.who(w.s))} {w.v('pays', 'paid')} with {w.money(paid)}")
        d.calc(a, "*", b)
        d.calc(paid, "-", d.value)
    d.question = w.pick(f"How much change does {w.who(w.s)} get?", f"How much change should {s} get back?",
                        "What is the change?", f"How much change does {s} receive?")  # fmt: skip
    d.unit, d.holder = "", None


def _open_vehicle(w: _Writer, d: _Draft) -> None:
    """Riders getting on and off, one to three stops."""
    vehicle = w.pick("bus", "train", "boat", "tram")
    riders = w.pick("passengers", "people", "riders")
    n = _r(w.rng, 10, 80)
    d.facts.append(w.pick(f"A {vehicle} {w.v('has', 'had')} {w.num(n)} {riders} on board",
                          f"There {w.v('are', 'were')} {w.num(n)} {riders} on a {vehicle}",
                          f"{w.num(n)} {riders} {w.v('are', 'were')} riding a {vehicle}"))  # fmt: skip
    d.value = n
    stops = ("At the first stop, ", "At the next stop, ", "Then ", "At the last stop, ", "Later, ")
    for i in range(w.rng.choice((1, 1, 2, 3))):
        if w.rng.random() < 0.5 and d.value > 3:
            k = _r(w.rng, 1, d.value - 1)
            verb = w.pick(w.v("get off", "got off"), w.v("leave", "left"))
            d.calc(d.value, "-", k)
        else:
            k = _r(w.rng, 1, 40)
            verb = w.pick(w.v("get on", "got on"), w.v("board", "boarded"), w.v("join", "joined"))
            d.calc(d.value, "+", k)
        d.facts.append(f"{stops[min(i, 4) if i else w.rng.randrange(2)]}{w.num(k)} {w.pick(riders, '')}".rstrip() + f" {verb}")
    d.question = w.pick(f"How many {riders} are on the {vehicle} now?", f"How many {riders} are still on the {vehicle}?",
                        f"What is the number of {riders} on the {vehicle} at the end?")  # fmt: skip
    d.unit, d.holder = "", None


_UNITS = {"length": ("meters", "cm", "feet", "inches"), "weight": ("kg", "grams", "pounds"),
          "volume": ("liters", "cups", "gallons")}  # fmt: skip


def _open_measure(w: _Writer, d: _Draft) -> None:
    """Lengths, weights and volumes: cut off, join, pour out, compare heights, distance left."""
    s = w.s.name
    form = w.rng.randrange(5)
    unit = w.rng.choice(_UNITS[("length", "weight", "volume", "length", "length")[form]])
    a, b = _r(w.rng, 10, 100), 0
    if form == 0:
        b = _r(w.rng, 1, a - 1)
        thing = w.pick("rope", "ribbon", "board", "pipe", "string")
        d.facts.append(f"A {thing} {w.v('is', 'was')} {w.num(a)} {unit} long")
        d.facts.append(f"{s} {w.v('cuts', 'cut')} off {w.num(b)} {unit}")
        d.calc(a, "-", b)
        d.question = w.pick(f"How long is the {thing} now?", f"How many {unit} of {thing} are left?",
                            f"What length of {thing} remains?")  # fmt: skip
    elif form == 1:
        b = _r(w.rng, 1, 100)
        d.facts.append(f"One parcel {w.v('weighs', 'weighed')} {w.num(a)} {unit} and another {w.v('weighs', 'weighed')} {w.num(b)} {unit}")
        d.calc(a, "+", b)
        d.question = w.pick("What is the total weight?", f"How many {unit} do they weigh together?",
                            "How heavy are the two parcels altogether?")  # fmt: skip
    elif form == 2:
        b = _r(w.rng, 1, a - 1)
        d.facts.append(f"A tank {w.v('holds', 'held')} {w.num(a)} {unit} of water")
        d.facts.append(f"{s} {w.v('pours', 'poured')} out {w.num(b)} {unit}")
        d.calc(a, "-", b)
        d.question = w.pick(f"How many {unit} of water are left in the tank?", "How much water is left?",
                            "How much water remains in the tank?")  # fmt: skip
    elif form == 3:
        a = _r(w.rng, 90, 190)
        b = _r(w.rng, 2, 40)
        tall = w.rng.random() < 0.5
        d.facts.append(f"{s} {w.v('is', 'was')} {a} cm tall")
        d.facts.append(f"{w.o.name} {w.v('is', 'was')} {w.num(b)} cm {'taller' if tall else 'shorter'} than {s}")
        d.calc(a, "+" if tall else "-", b)
        d.question = w.pick(f"How tall is {w.o.name}?", f"What is {w.o.name}'s height in cm?",
                            f"How many cm tall is {w.o.name}?")  # fmt: skip
    else:
        b = _r(w.rng, 1, a - 1)
        d.facts.append(w.pick(f"A trip {w.v('is', 'was')} {w.num(a)} km long", f"The road to the city {w.v('is', 'was')} {w.num(a)} km"))
        d.facts.append(f"{s} {w.v('has', 'had')} already driven {w.num(b)} km")
        d.calc(a, "-", b)
        d.question = w.pick("How many km are left?", f"How far is left for {w.who(w.s)} to go?",
                            "What distance is left to drive?")  # fmt: skip
    d.unit, d.holder = "", None


def _open_price_compare(w: _Writer, d: _Draft) -> None:
    g1, g2 = w.rng.sample(GIFTS, 2)
    a, b = _r(w.rng, 10, 80), _r(w.rng, 2, 9)
    more = w.rng.random() < 0.5
    word = w.pick("more", "more expensive") if more else w.pick("less", "cheaper")
    d.facts.append(f"A {g1} {w.v('costs', 'cost')} {w.money(a)}")
    d.facts.append(w.pick(f"A {g2} {w.v('costs', 'cost')} {w.money(b)} {word} than the {g1}",
                          f"A {g2} {w.v('is', 'was')} {w.money(b)} {word}"))  # fmt: skip
    v = d.calc(a, "+" if more else "-", b)
    if w.rng.random() < 0.5:
        d.calc(a, "+", v)
        d.question = w.pick(f"How much do the {g1} and the {g2} cost together?", "What do both cost in total?",
                            f"How much does {w.s.name} pay for one of each?")  # fmt: skip
    else:
        d.question = w.pick(f"How much does the {g2} cost?", f"What is the price of the {g2}?")
    d.unit, d.holder = "", None


def _open_pool(w: _Writer, d: _Draft) -> None:
    """Two people put their things together, then share them equally."""
    sg, pl, _ = w.thing
    dv, q = _r(w.rng, 2, 10), _r(w.rng, 2, 25)
    a = _r(w.rng, 1, dv * q - 1)
    b = dv * q - a
    s, o = w.s.name, w.o.name
    d.facts.append(w.pick(f"{s} {w.v('has', 'had')} {w.num(a)} {pl} and {o} {w.v('has', 'had')} {w.num(b)} {pl}",
                          f"{s} {w.v('brings', 'brought')} {w.num(a)} {pl} and {o} {w.v('brings', 'brought')} {w.num(b)}"))  # fmt: skip
    d.facts.append(w.pick(f"They {w.v('put', 'put')} them together and {w.v('share', 'shared')} them equally among {w.num(dv)} children",
                          f"They {w.v('combine', 'combined')} them and {w.v('split', 'split')} the lot evenly between {w.num(dv)} kids"))  # fmt: skip
    d.calc(a, "+", b)
    d.calc(dv * q, "/", dv)
    d.question = w.pick(f"How many {pl} does each child get?", f"How many {pl} does each one receive?",
                        "What is each share?")  # fmt: skip
    d.unit, d.holder = "", None


def _open_teams(w: _Writer, d: _Draft) -> None:
    """Equal groups, then something per group."""
    dv, q, c = _r(w.rng, 2, 8), _r(w.rng, 2, 12), _r(w.rng, 2, 6)
    a = dv * q
    group = w.pick("team", "group", "table")
    need = w.pick("balls", "maps", "pencils", "cups", "bottles of water")
    d.facts.append(w.pick(f"{w.num(a)} students {w.v('are', 'were')} split into {group}s of {w.num(dv)}",
                          f"A class of {w.num(a)} {w.v('forms', 'formed')} {group}s with {w.num(dv)} students in each"))  # fmt: skip
    d.facts.append(f"Every {group} {w.v('needs', 'needed')} {w.num(c)} {need}")
    d.calc(a, "/", dv)
    d.calc(q, "*", c)
    d.question = w.pick(f"How many {need} are needed?", f"How many {need} do they need in total?")
    d.unit, d.holder = "", None


OPENINGS = {
    "start": (_open_start, 0.22), "money": (_open_money, 0.1), "groups": (_open_groups, 0.1),
    "price": (_open_price, 0.08), "rate": (_open_rate, 0.07), "wage": (_open_wage, 0.06),
    "share": (_open_share, 0.12), "compare": (_open_compare, 0.1), "parts": (_open_parts, 0.07),
    "change": (_open_change, 0.06), "arith": (None, 0.04), "vehicle": (_open_vehicle, 0.04),
    "measure": (_open_measure, 0.06), "price_compare": (_open_price_compare, 0.03), "pool": (_open_pool, 0.03),
    "teams": (_open_teams, 0.02),
}  # fmt: skip


# --------------------------------------------------------------------------------------------
# Events that change the holder's quantity, and the questions about it

_JOIN = ("Then ", "After that, ", "Later, ", "Next, ", "", "", "The next day, ", "Then ")


def _event(w: _Writer, d: _Draft) -> bool:
    """Append one gain, loss or doubling to ``d`` (False when none fits the current value)."""
    h = w.who(d.holder)
    o = w.o.name if d.holder is not w.o else w.s.name
    him = d.holder.pron("him")
    money = d.unit in ("money", "cost")
    if d.unit == "cost":
        return False
    roll = w.rng.random()
    if roll < 0.45 and d.value < MAX_RESULT - 2:
        n = _r(w.rng, 2, min(100, MAX_RESULT - d.value))
        if money:
            amt = w.money(n)
            text = w.pick(
                f"{h} {w.v('earns', 'earned')} {amt}", f"{h} {w.v('gets', 'got')} {amt} from {o}",
                f"{o} {w.v('gives', 'gave')} {him} {amt}", f"{h} {w.v('finds', 'found')} {amt}",
                f"{h} {w.v('is', 'was')} paid {amt}", f"{h} {w.v('adds', 'added')} {amt} to it",
                f"{o} {w.v('chips', 'chipped')} in {amt}", f"{h} {w.v('sells', 'sold')} a {w.rng.choice(GIFTS)} for {amt}",
            )  # fmt: skip
        else:
            x = w.pick("", f" {d.unit}")
            text = w.pick(
                f"{h} {w.v('buys', 'bought')} {w.num(n)} more{x}", f"{h} {w.v('gets', 'got')} {w.num(n)} more{x}",
                f"{h} {w.v('finds', 'found')} {w.num(n)} more{x}", f"{o} {w.v('gives', 'gave')} {him} {w.num(n)} more{x}",
                f"{h} {w.v('receives', 'received')} {w.num(n)}{x} from {o}", f"{h} {w.v('adds', 'added')} {w.num(n)}{x}",
                f"{h} {w.v('picks', 'picked')} {w.num(n)} more{x}", f"{h} {w.v('wins', 'won')} {w.num(n)} more{x}",
                f"{h} {w.v('is', 'was')} handed {w.num(n)} extra{x}", f"{h} {w.v('gathers', 'gathered')} another {w.num(n)}{x}",
                f"{o} {w.v('sends', 'sent')} {him} {w.num(n)} new{x}", f"{h} {w.v('makes', 'made')} {w.num(n)} more{x}",
                f"{w.num(n)} more{x} {w.v('are', 'were')} added", f"{h} {w.v('trades', 'traded')} for {w.num(n)} more{x}",
            )  # fmt: skip
        d.calc(d.value, "+", n)
    elif roll < 0.9 and d.value > 3:
        n = _r(w.rng, 1, d.value - 1)
        if money:
            amt = w.money(n)
            text = w.pick(
                f"{h} {w.v('spends', 'spent')} {amt} on a {w.rng.choice(GIFTS)}", f"{h} {w.v('pays', 'paid')} {amt} for lunch",
                f"{h} {w.v('gives', 'gave')} {amt} to {o}", f"{h} {w.v('loses', 'lost')} {amt}",
                f"{h} {w.v('buys', 'bought')} a {w.rng.choice(GIFTS)} for {amt}",
                f"{h} {w.v('withdraws', 'withdrew')} {amt}",
            )  # fmt: skip
        else:
            x = w.pick("", f" {d.unit}", " of them")
            eat = (f"{h} {w.v('eats', 'ate')} {w.num(n)}{x}",) if w.thing[2] else ()
            text = w.pick(
                f"{h} {w.v('gives', 'gave')} {w.num(n)}{x} to {o}", f"{h} {w.v('gives', 'gave')} away {w.num(n)}{x}",
                f"{h} {w.v('loses', 'lost')} {w.num(n)}{x}", f"{h} {w.v('sells', 'sold')} {w.num(n)}{x}",
                f"{h} {w.v('uses', 'used')} {w.num(n)}{x}", f"{o} {w.v('takes', 'took')} {w.num(n)}{x}",
                f"{h} {w.v('trades', 'traded')} {w.num(n)}{x} to {o}", 
                f"{h} {w.v('throws', 'threw')} away {w.num(n)}{x}", f"{h} {w.v('donates', 'donated')} {w.num(n)}{x}",
                f"{h} {w.v('hands', 'handed')} out {w.num(n)}{x}", f"{w.num(n)}{x} {w.v('break', 'broke')}",
                f"{h} {w.v('loses', 'lost')} {w.num(n)}{x} on the way home", *eat,
            )  # fmt: skip
        d.calc(d.value, "-", n)
    elif d.value * 2 <= MAX_RESULT and not money:
        text = w.pick(f"{h} {w.v('doubles', 'doubled')} {d.holder.pron('his')} {d.unit}",
                      f"{h} {w.v('ends', 'ended')} up with twice as many {d.unit}")  # fmt: skip
        d.calc(d.value, "*", 2)
    else:
        return False
    d.facts.append(w.rng.choice(_JOIN) + text)
    return True


def _holder_question(w: _Writer, d: _Draft, losing: bool) -> str:
    h, u = w.who(d.holder), d.unit
    if d.unit == "cost":
        return w.pick(f"How much does {h} spend?", f"How much does {h} pay in total?", "What is the total cost?",
                      f"How much money does {h} spend altogether?", f"What does {h} pay?", "Find the total price.",
                      "What is the cost of all of them?", f"How much must {h} pay?")  # fmt: skip
    if d.unit == "money":
        left = (f"How much money does {h} have left?", "How much money is left?", "How much is left over?",
                "What amount of money remains?") if losing else ()  # fmt: skip
        return w.pick(f"How much money does {h} have now?", f"How much money does {h} have in the end?",
                      f"What is {d.holder.name}'s money now?", f"How much does {h} have after that?", *left)  # fmt: skip
    left = (f"How many {u} does {h} have left?", f"How many {u} are left?", f"How many {u} remain?",
            f"How many {u} are still there?", f"What number of {u} is left?", f"How many {u} stay?") if losing else ()  # fmt: skip
    return w.pick(
        f"How many {u} does {h} have now?", f"How many {u} does {h} end up with?", f"How many {u} does {h} have in total?",
        f"How many {u} does {h} have in the end?", f"What is the number of {u} {h} has now?",
        f"Find the number of {u} {h} has.", f"Work out how many {u} {h} has now.",
        f"How many {u} are there now?", f"What is the count of {u} now?", *left,
    )  # fmt: skip


def _distractor(w: _Writer) -> str:
    x = w.x.name
    return w.pick(
        f"{x} is {_r(w.rng, 6, 60)} years old",
        f"{x} has {w.num(_r(w.rng, 2, 30))} {w.rng.choice(THINGS)[1]}",
        f"It takes {_r(w.rng, 5, 40)} minutes to walk to the shop",
        f"The shop is open {w.num(_r(w.rng, 5, 12))} hours a day",
        f"{w.s.name}'s {w.pick('sister', 'brother', 'friend', 'cousin')} {x} has {w.num(_r(w.rng, 2, 20))} pets",
        f"There are {_r(w.rng, 2, 30)} people in the room",
        f"The weather is warm on {w.rng.choice(WEEKDAYS)}",
        f"A {w.rng.choice(GIFTS)} costs {w.money(_r(w.rng, 2, 40))} at the shop",
        f"The temperature is {_r(w.rng, 5, 35)} degrees",
        f"{w.s.name} lives {w.num(_r(w.rng, 2, 15))} {w.pick('km', 'miles', 'blocks')} from school",
        f"{x}, who is {_r(w.rng, 6, 15)}, watches",
        f"The {w.pick('bus', 'train', 'class')} leaves at {_r(w.rng, 1, 12)} o'clock",
    )  # fmt: skip


_ARITH_ONE = {
    "+": ("{a}+{b}?", "What is {a} + {b}?", "What is {a} plus {b}?", "{a} + {b} = ?", "Add {a} and {b}.",
          "Calculate {a}+{b}.", "What do you get when you add {a} and {b}?", "Find the sum of {a} and {b}.", "{a} plus {b}"),
    "-": ("{a}-{b}?", "What is {a} - {b}?", "What is {a} minus {b}?", "{a} - {b} = ?", "Subtract {b} from {a}.",
          "Calculate {a}-{b}.", "Take {b} away from {a}.", "Find the difference of {a} and {b}.", "{a} minus {b}"),
    "*": ("{a}*{b}?", "What is {a} x {b}?", "What is {a} times {b}?", "{a} × {b} = ?", "Multiply {a} by {b}.",
          "Calculate {a}*{b}.", "What is {a} multiplied by {b}?", "Find the product of {a} and {b}.", "{a} times {b}"),
    "/": ("{a}/{b}?", "What is {a} / {b}?", "What is {a} divided by {b}?", "{a} ÷ {b} = ?", "Divide {a} by {b}.",
          "Calculate {a}/{b}.", "How much is {a} divided by {b}?", "{a} divided by {b}"),
}  # fmt: skip
_SYMBOL = {"+": ("+", " + ", " plus "), "-": ("-", " - ", " minus "), "*": ("*", " x ", " times "), "/": ("/", " / ")}


def _operands(rng: random.Random, op: str) -> tuple[int, int]:
    if op == "+":
        return _r(rng, 1, rng.choice((20, 100, 500))), _r(rng, 1, rng.choice((20, 100, 500)))
    if op == "-":
        a = _r(rng, 3, rng.choice((20, 100, 1000)))
        return a, _r(rng, 1, a - 1)
    if op == "*":
        a, b = _r(rng, 2, 12), _r(rng, 2, rng.choice((12, 50, 83)))
        return (a, b) if rng.random() < 0.5 else (b, a)
    dv, q = _r(rng, 2, 12), _r(rng, 2, rng.choice((12, 25, 50)))
    return dv * q, dv


def _arith(w: _Writer, d: _Draft) -> str:
    """Bare arithmetic: one operation, or two applied left to right."""
    op = w.rng.choice("+-*/")
    a, b = _operands(w.rng, op)
    v = d.calc(a, op, b)
    if w.rng.random() < 0.7:
        return w.rng.choice(_ARITH_ONE[op]).format(a=a, b=b)
    op2 = w.rng.choice("+-")
    c = _r(w.rng, 1, 100) if op2 == "+" else _r(w.rng, 1, max(1, v - 1))
    if v - c < 1 and op2 == "-" or v + c > MAX_RESULT:
        return w.rng.choice(_ARITH_ONE[op]).format(a=a, b=b)
    d.calc(v, op2, c)
    # Left to right is also the precedence order: the first operation may be * or /, the second + or -.
    expr = f"{a}{w.rng.choice(_SYMBOL[op])}{b}{w.rng.choice(_SYMBOL[op2])}{c}"
    return w.pick(f"What is {expr}?", f"{expr} = ?", f"Calculate {expr}.", f"{expr}?")


# --------------------------------------------------------------------------------------------
# Assembly


def _answer(steps: list[tuple[str, int]]) -> str:
    return "\n".join(f"{e} = <<{e}={v}>>{v}" for e, v in steps) + f"\n#### {steps[-1][1]}"


def make_problem(rng: random.Random) -> Problem:
    """One problem (see the module docstring); deterministic for the state of ``rng``."""
    kinds = list(OPENINGS)
    kind = rng.choices(kinds, [OPENINGS[k][1] for k in kinds])[0]
    w, d = _Writer(rng), _Draft()
    if kind == "arith":
        q = _arith(w, d)
        return Problem(q, _answer(d.steps), d.steps[-1][1], f"wordings/{kind}")
    OPENINGS[kind][0](w, d)
    losing = False
    if d.holder is not None:
        for _ in range(rng.choice((0, 1, 2, 2, 3, 3)) if len(d.steps) <= 1 else rng.choice((0, 1, 2, 2))):
            if len(d.steps) >= 4:
                break
            before = d.value
            if _event(w, d):
                losing = d.value < before
        if not d.steps:  # a start amount with no event: add one
            while not _event(w, d):
                pass
            losing = d.steps[-1][0].count("-") > 0
        sg, pl, _ = w.thing
        divisors = [k for k in range(2, 13) if d.value % k == 0 and 2 <= d.value // k <= 25]
        if d.unit == pl and len(d.steps) < 4 and divisors and rng.random() < 0.15:
            k = rng.choice(divisors)
            d.facts.append(rng.choice(_JOIN) + w.pick(
                f"{w.who(d.holder)} {w.v('shares', 'shared')} them equally among {w.num(k)} friends",
                f"{w.who(d.holder)} {w.v('puts', 'put')} them into {w.num(k)} {w.box[1]} with the same number in each"))  # fmt: skip
            d.calc(d.value, "/", k)
            d.question = w.pick(f"How many {pl} does each friend get?", f"How many {pl} is each share?") if "friends" in d.facts[-1] \
                else f"How many {pl} are in each {w.box[0]}?"
        else:
            d.question = _holder_question(w, d, losing)
        if len(d.facts) == 2 and "." not in d.facts[0] + d.facts[1] and rng.random() < 0.3:
            first, second, q = (_uncap(t) for t in (d.facts[0], d.facts[1], d.question))
            d.facts = [f"If {first} and {second}, {q[:-1]}"]
            d.question = ""
    if rng.random() < 0.3:
        d.facts.insert(rng.randrange(1, len(d.facts) + 1), _distractor(w))
    if not d.question:  # the if-form: one sentence that ends in the question
        return Problem(_cap(d.facts[0]) + "?", _answer(d.steps), d.steps[-1][1], f"wordings/{kind}")
    facts = " ".join(_cap(f) + "." for f in d.facts)
    question = f"{d.question} {facts}" if rng.random() < 0.2 else f"{facts} {d.question}"
    return Problem(question, _answer(d.steps), d.steps[-1][1], f"wordings/{kind}")


def generate_wordings(n: int, seed: int) -> list[Problem]:
    """``n`` distinct problems for ``seed`` (a prefix of any longer list for the same seed)."""
    return distinct_problems(make_problem, n, seed)
