"""A fourth word-problem generator for the demo model: clauses from a small grammar, each part of
which (holder, verb, how the number is written, its unit, the connective, the question and where
it stands) is drawn on its own, so the operation is told only by the words next to the numbers.

Stories: two amounts joined (holders, days, parts), gains and losses in time order, comparisons
("more than", "fewer than", "less", "taller", "cheaper", "older" and their reverses "which is k
more than ..."), differences ("how many more", "the difference", "by how much ... exceed"),
"k times as many", equal groups, prices and rates ("each", "per", "a day"), equal sharing and
packing ("each gets", "in bags of k"), change from a payment, and chains of two to four of these.
Numbers are digits or words up to twenty; sentences with numbers the answer does not use, and
lead-ins without numbers, are mixed in; some questions are lower-case or lack their question mark.

Answers are in the demo format, one exact calculation a line then ``#### N`` (the mixture opens
them with their quotes, :mod:`~breakgraph.demo.quoting`). Ranges as the other generators: stated
amounts 1-100 (payments up to 500), products one factor 2-12, divisors 2-12 with quotients 2-25,
every result 1-1000.
"""

from __future__ import annotations

import random
import re

from breakgraph.demo.phrasebank import NUMBER_WORDS, PEOPLE
from breakgraph.demo.problems import Problem, distinct_problems, exact_step, redrawn
from breakgraph.demo.varied import COUNTABLES, CURRENCIES, FOR_SALE, GROUPS, _pl

MAX_RESULT = 1000

# (present, past) verbs that add to what the holder has, and that take away from it
GAIN = (("gets", "got"), ("receives", "received"), ("finds", "found"), ("buys", "bought"), ("wins", "won"),
        ("picks up", "picked up"), ("collects", "collected"), ("is given", "was given"), ("gathers", "gathered"),
        ("is handed", "was handed"), ("brings home", "brought home"), ("makes", "made"), ("adds", "added"),
        ("borrows", "borrowed"), ("is sent", "was sent"), ("earns", "earned"), ("takes in", "took in"),
        ("comes back with", "came back with"), ("orders", "ordered"), ("is lent", "was lent"))  # fmt: skip
LOSS = (("gives away", "gave away"), ("sells", "sold"), ("loses", "lost"), ("uses", "used"), ("donates", "donated"),
        ("breaks", "broke"), ("drops", "dropped"), ("throws out", "threw out"), ("hands out", "handed out"),
        ("lends out", "lent out"), ("sends off", "sent off"), ("trades away", "traded away"), ("eats", "ate"),
        ("misplaces", "misplaced"), ("returns", "returned"), ("leaves behind", "left behind"), ("gives up", "gave up"),
        ("removes", "removed"), ("puts aside", "put aside"), ("hands back", "handed back"))  # fmt: skip
# what happens to some of the things, without the holder doing it
# Things that are lost without a taker (present, past): they pop, melt, leak out, fly away…
LOST_BY_THEMSELVES = (("go missing", "went missing"), ("get broken", "got broken"), ("are taken", "were taken"),
                      ("are sold", "were sold"), ("are eaten", "were eaten"), ("are lost", "were lost"),
                      ("get thrown out", "got thrown out"), ("are given away", "were given away"),
                      ("disappear", "disappeared"), ("are used up", "were used up"), ("pop", "popped"),
                      ("melt", "melted"), ("leak out", "leaked out"), ("fly away", "flew away"),
                      ("run away", "ran away"), ("spill", "spilled"), ("go bad", "went bad"), ("fall off", "fell off"),
                      ("roll away", "rolled away"), ("wear out", "wore out"))  # fmt: skip
HAVE = (("has", "had"), ("owns", "owned"), ("holds", "held"), ("keeps", "kept"), ("starts with", "started with"),
        ("begins with", "began with"), ("counts", "counted"), ("is looking after", "was looking after"))  # fmt: skip
TIMES = ("Then", "Later", "After that", "Next", "Soon", "Afterwards", "The next day", "In the evening",
         "On Monday", "By noon", "A bit later", "That week", "At lunch", "At dinner")  # fmt: skip
LEAD_INS = ("Here is one.", "Please solve.", "Think about this.", "Quick question.", "Try this.", "Help me out.",
            "A small sum.", "Easy one.", "Maths time.", "Let us count.")  # fmt: skip
CALM = ("It was a sunny day.", "Everyone was busy.", "The weather was cold.", "It was a long week.",
        "Nobody was in a hurry.", "The room was quiet.", "It rained a little.", "Everybody smiled.")  # fmt: skip
# (more word, fewer word, unit forms (singular, plural), what is asked)
MEASURES = (("taller", "shorter", ("cm", "cm"), "tall"), ("heavier", "lighter", ("kg", "kg"), "heavy"),
            ("older", "younger", ("year", "years"), "old"), ("longer", "shorter", ("metre", "metres"), "long"))  # fmt: skip
TOTAL_Q = ("altogether", "in total", "in all", "together", "combined", "all told", "between them", "overall")
LEFT_Q = ("left", "now", "remaining", "left over", "in the end", "after that", "still")


class StoryDraws:
    """The random draws a story writer shares: options, integers, chances, numbers as digits or
    words (``word_p``), counted nouns (``thing``) and money (``cur``); every number written is
    recorded in ``used``. ``__init__`` draws, in this order, two people (``a``/``sa``,
    ``b``/``sb``), the noun, a group word and the currency; a subclass draws the rest (at least
    ``word_p``) after it."""

    word_p: float

    def __init__(self, rng: random.Random):
        self.rng = rng
        (self.a, self.sa), (self.b, self.sb) = rng.sample(PEOPLE, 2)
        self.thing: tuple[str, str] = rng.choice(COUNTABLES)
        self.group = rng.choice(GROUPS)
        self.cur: tuple[str, str, str] = rng.choice(CURRENCIES)
        self.used: set[int] = set()

    def pick(self, *options):
        return self.rng.choice(options)

    def r(self, lo: int, hi: int) -> int:
        return self.rng.randint(lo, hi)

    def p(self, x: float) -> bool:
        return self.rng.random() < x

    def n(self, k: int) -> str:
        self.used.add(k)
        return NUMBER_WORDS[k] if k <= 20 and self.p(self.word_p) else str(k)

    def cnt(self, k: int) -> str:
        sg, pl = self.thing
        return f"{self.n(k)} {sg if k == 1 else pl}"

    def money(self, k: int) -> str:
        sym, one, many = self.cur
        self.used.add(k)
        return f"{sym}{k}" if sym else f"{self.n(k)} {one if k == 1 else many}"


class _G(StoryDraws):
    """Per-problem choices: two people, a noun, a currency, the tense and how numbers are written."""

    def __init__(self, rng: random.Random):
        super().__init__(rng)
        self.past = rng.random() < 0.4
        self.word_p = rng.choice((0.0, 0.25, 0.5))

    def v(self, pair: tuple[str, str]) -> str:
        return pair[1] if self.past else pair[0]

    def he(self, name: str) -> str:
        sex = self.sa if name == self.a else self.sb
        return "she" if sex == "f" else "he"

    def does(self) -> str:
        return "did" if self.past else "does"

    def has(self) -> str:
        return "had" if self.past else "has"


class _Story:
    def __init__(self) -> None:
        self.facts: list[str] = []
        self.question = ""
        self.steps: list[tuple[str, int]] = []
        self.ordered = False  # facts are events in time order

    def calc(self, a: int, op: str, b: int) -> int:
        v = exact_step(a, op, b)
        if not 1 <= v <= MAX_RESULT:
            raise ValueError(f"{a}{op}{b}={v} is out of range")
        self.steps.append((f"{a}{op}{b}", v))
        return v


def _start(g: _G, k: int) -> str:
    """The amount a story starts from: held, or first got ("Tom baked 80 loaves. He sold 3"): a
    gain verb that opens the story is the start, not a step."""
    sg, pl = g.thing
    return g.pick(
        f"{g.a} {g.v(g.pick(*HAVE))} {g.cnt(k)}",
        f"{g.a} {g.v(g.pick(*GAIN))} {g.cnt(k)}",
        f"first {g.a} {g.v(g.pick(*GAIN))} {g.cnt(k)}",
        f"{g.a}'s {g.group[0]} {g.v(('contains', 'contained'))} {g.cnt(k)}",
        f"there {g.v(('are', 'were'))} {g.cnt(k)} in {g.a}'s {g.group[0]}",
        f"at first {g.a} {g.has()} {g.cnt(k)}",
        f"{g.a} {g.v(('owns', 'owned'))} a set of {g.cnt(k)}",
    )


def _ask_count(g: _G, who: str | None, mood: tuple[str, ...]) -> str:
    sg, pl = g.thing
    q = g.pick(*mood)
    if who is None:
        return g.pick(f"How many {pl} are there {q}?", f"What is the number of {pl} {q}?", f"Find the {sg} count {q}.",
                      f"How many {pl} is that {q}?", f"Count the {pl} {q}.")  # fmt: skip
    return g.pick(
        f"How many {pl} {g.does()} {who} have {q}?", f"What is {who}'s {sg} count {q}?",
        f"Find how many {pl} {who} {g.has()} {q}.", f"How many {pl} {g.v(('are', 'were'))} with {who} {q}?",
        f"{who} {g.has()} how many {pl} {q}?", f"Tell me the number of {pl} {who} {g.has()} {q}.",
    )  # fmt: skip


def gain(g: _G, k: int) -> str:
    sg, pl = g.thing
    verb = g.v(g.pick(*GAIN))
    return g.pick(f"{g.a} {verb} {g.cnt(k)} more", f"{g.a} {verb} another {g.n(k)}", f"{g.a} {verb} {g.n(k)} extra {pl}",
                  f"{g.a} {verb} {g.n(k)} new {pl}", f"{g.a} {verb} {g.cnt(k)}", f"{g.a} {verb} {g.n(k)} more of them")  # fmt: skip


def loss(g: _G, k: int, again: bool = False) -> str:
    """A loss of ``k``. ``again``: the story lost some before, so the loss may say "k more" or
    "another k" as people write it ("sold 5 more") — "more" then still means less is left."""
    sg, pl = g.thing
    verb = g.v(g.pick(*LOSS))
    by_themselves = g.v(g.pick(*LOST_BY_THEMSELVES))
    if again and g.p(0.6):
        return g.pick(f"{g.a} {verb} {g.n(k)} more", f"{g.a} {verb} {g.n(k)} more {sg if k == 1 else pl}", f"{g.a} {verb} another {g.n(k)}",
                      f"{g.n(k)} more {by_themselves}", f"{g.a} {verb} {g.n(k)} more of them")  # fmt: skip
    return g.pick(f"{g.a} {verb} {g.cnt(k)}", f"{g.a} {verb} {g.n(k)} of them", f"{g.a} {verb} {g.n(k)} of the {pl}",
                  f"{g.n(k)} of the {pl} {by_themselves}", f"{g.a} {verb} {g.n(k)}")  # fmt: skip


def story_combine(g: _G, s: _Story) -> None:
    x, y = g.r(2, 100), g.r(2, 100)
    sg, pl = g.thing
    shape = g.r(0, 3)
    if shape == 0:
        s.facts += [f"{g.a} {g.v(g.pick(*HAVE))} {g.cnt(x)}", f"{g.b} {g.v(g.pick(*HAVE))} {g.cnt(y)}"]
        s.question = g.pick(f"How many {pl} do they have {g.pick(*TOTAL_Q)}?", f"What is the total number of {pl}?",
                            f"How many {pl} do {g.a} and {g.b} have {g.pick(*TOTAL_Q)}?", f"Find the sum of their {pl}.")  # fmt: skip
    elif shape == 1:
        d1, d2 = g.rng.sample(("Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday"), 2)
        verb = g.pick(("collected", "picked"), ("sold", "sold"), ("made", "made"), ("found", "found"), ("counted", "counted"))
        s.facts += [f"on {d1} {g.a} {verb[0]} {g.cnt(x)}", f"on {d2} {g.he(g.a)} {verb[1]} {g.n(y)}"]
        s.question = g.pick(f"How many {pl} is that over the two days?", f"How many {pl} is that {g.pick(*TOTAL_Q)}?",
                            "What was the total for both days?", f"How many {pl} over both days?")  # fmt: skip
    elif shape == 2:
        s.facts += [f"one {g.group[0]} {g.v(('holds', 'held'))} {g.cnt(x)}", f"another {g.v(('holds', 'held'))} {g.n(y)}"]
        s.question = g.pick(f"How many {pl} are in the two {g.group[1]} {g.pick(*TOTAL_Q)}?", "What is the combined count?",
                            f"How many {pl} are there {g.pick(*TOTAL_Q)}?")  # fmt: skip
    else:
        s.facts += [f"{g.a} {g.v(('spends', 'spent'))} {g.money(x)} on food",
                    f"{g.he(g.a)} also {g.v(('spends', 'spent'))} {g.money(y)} on a {g.pick(*FOR_SALE)}"]
        s.question = g.pick("How much money is that altogether?", f"What did {g.a} spend in total?",
                            f"How much {g.v(('does', 'did'))} {g.a} spend {g.pick(*TOTAL_Q)}?")  # fmt: skip
    s.calc(x, "+", y)


def _gains_and_losses(g: _G, s: _Story, v: int, count: int) -> int:
    """``count`` gains and losses of ``v`` in time order (a loss only while ``v > 3``), each a fact
    and a step of ``s``; returns the final value."""
    s.ordered = True
    lost = False
    for _ in range(count):
        if g.p(0.5) and v > 3:
            k = g.r(1, min(v - 1, 60))
            s.facts.append(loss(g, k, again=lost))
            v = s.calc(v, "-", k)
            lost = True
        else:
            k = g.r(2, 60)
            s.facts.append(gain(g, k))
            v = s.calc(v, "+", k)
    return v


def story_events(g: _G, s: _Story) -> None:
    """A start, then one to three gains and losses in time order."""
    v = g.r(10, 100)
    s.facts.append(_start(g, v))
    _gains_and_losses(g, s, v, g.pick(1, 1, 2, 2, 3))
    s.question = _ask_count(g, g.a, LEFT_Q)


def story_compare(g: _G, s: _Story) -> None:
    """B has k more / fewer than A; or A's amount is k more than B's (the reverse)."""
    sg, pl = g.thing
    x, k = g.r(10, 100), g.r(2, 40)
    more = g.p(0.5)
    if not more and k >= x:
        raise ValueError("negative")
    word = "more" if more else g.pick("fewer", "less")
    if g.p(0.6):
        s.facts += [f"{g.a} {g.v(g.pick(*HAVE))} {g.cnt(x)}", g.pick(f"{g.b} {g.has()} {g.n(k)} {word} {pl} than {g.a}",
                    f"{g.b} {g.has()} {g.n(k)} {word} than {g.a} {g.does()}", f"{g.b} {g.has()} {g.n(k)} {word} than this")]  # fmt: skip
        v = s.calc(x, "+" if more else "-", k)
    else:  # reverse: A's x is k more than B's, so B has x - k
        s.facts += [f"{g.a} {g.v(g.pick(*HAVE))} {g.cnt(x)}, which {g.v(('is', 'was'))} {g.n(k)} {word} than {g.b} {g.has()}"]
        if more and k >= x:
            raise ValueError("negative")
        v = s.calc(x, "-" if more else "+", k)
    if g.p(0.25):
        s.question = g.pick(f"How many {pl} do they have {g.pick(*TOTAL_Q)}?", f"How many {pl} do {g.a} and {g.b} have {g.pick(*TOTAL_Q)}?")
        s.calc(x, "+", v)
    else:
        s.question = _ask_count(g, g.b, ("", "", "now"))


def story_measure(g: _G, s: _Story) -> None:
    more_w, less_w, (one, many), adj = g.pick(*MEASURES)
    x, k = g.r(20, 100), g.r(2, 19)
    more = g.p(0.5)
    word = more_w if more else less_w
    unit = many if x != 1 else one
    first = f"{g.a} {g.v(('is', 'was'))} {g.n(x)} {unit} {adj}" if adj != "heavy" else f"{g.a}'s bag {g.v(('weighs', 'weighed'))} {g.n(x)} {unit}"
    who = g.b if adj != "heavy" else f"{g.b}'s bag"
    s.facts += [first, f"{who} {g.v(('is', 'was'))} {g.n(k)} {many if k != 1 else one} {word}"]
    s.calc(x, "+" if more else "-", k)
    s.question = g.pick(f"How {adj} {g.v(('is', 'was'))} {who}?", f"What {g.v(('is', 'was'))} {who}'s {dict(tall='height', heavy='weight', old='age', long='length')[adj]}?")
    if adj == "long":
        s.facts = [f"{g.a}'s rope {g.v(('is', 'was'))} {g.n(x)} {unit} long", f"{g.b}'s rope {g.v(('is', 'was'))} {g.n(k)} {many} {word}"]
        s.question = g.pick(f"How long {g.v(('is', 'was'))} {g.b}'s rope?", f"What length {g.v(('is', 'was'))} {g.b}'s rope?")


def story_difference(g: _G, s: _Story) -> None:
    sg, pl = g.thing
    x, y = g.r(20, 100), g.r(2, 90)
    if y >= x:
        x, y = y + 1, x
    if x - y < 1:
        raise ValueError("equal")
    s.facts += [f"{g.a} {g.v(g.pick(*HAVE))} {g.cnt(x)}", f"{g.b} {g.v(g.pick(*HAVE))} {g.cnt(y)}"]
    s.question = g.pick(f"How many more {pl} {g.does()} {g.a} have than {g.b}?", f"How many fewer {pl} {g.does()} {g.b} have?",
                        "What is the difference between their counts?", f"By how much {g.does()} {g.a}'s count exceed {g.b}'s?",
                        f"How many more would {g.b} need to have as many as {g.a}?")  # fmt: skip
    if g.p(0.5):
        s.facts.reverse()
    s.calc(x, "-", y)


def story_times(g: _G, s: _Story) -> None:
    sg, pl = g.thing
    x, k = g.r(2, 50), g.r(2, 12)
    s.facts += [f"{g.a} {g.v(g.pick(*HAVE))} {g.cnt(x)}",
                g.pick(f"{g.b} {g.has()} {g.n(k)} times as many", f"{g.b} {g.has()} {g.n(k)} times as many {pl} as {g.a}",
                       f"{g.b}'s count {g.v(('is', 'was'))} {g.n(k)} times {g.a}'s")]  # fmt: skip
    v = s.calc(x, "*", k)
    if g.p(0.2):
        s.question = f"How many {pl} do they have {g.pick(*TOTAL_Q)}?"
        s.calc(x, "+", v)
    else:
        s.question = _ask_count(g, g.b, ("", "", "then"))


def story_groups(g: _G, s: _Story) -> None:
    sg, pl = g.thing
    gs, gp = g.group
    n, k = g.r(2, 12), g.r(2, 50)
    s.facts.append(g.pick(f"{g.a} {g.has()} {g.n(n)} {gp} with {g.cnt(k)} in each",
                          f"each {gs} {g.v(('holds', 'held'))} {g.cnt(k)}, and {g.a} {g.has()} {g.n(n)} {gp}",
                          f"{g.a} {g.v(('fills', 'filled'))} {g.n(n)} {gp}, putting {g.n(k)} {pl} in every one",
                          f"there {g.v(('are', 'were'))} {g.n(n)} {gp} of {g.n(k)} {pl} each",
                          f"{g.n(k)} {pl} {g.v(('go', 'went'))} into each of {g.n(n)} {gp}",
                          f"{g.a} {g.has()} {g.n(n)} {gp}, {g.n(k)} {pl} to a {gs}",
                          f"{g.a} {g.has()} {g.n(n)} {gp}, {g.n(k)} {pl} per {gs}",
                          f"there {g.v(('are', 'were'))} {g.n(n)} {gp} and every {gs} {g.has()} {g.cnt(k)}"))  # fmt: skip
    s.calc(n, "*", k)
    s.question = _ask_count(g, None, TOTAL_Q)


def story_price(g: _G, s: _Story) -> None:
    item = g.pick(*FOR_SALE)
    n, k = g.r(2, 12), g.r(2, 50)
    fact, question = g.pick(
        (f"one {item} {g.v(('costs', 'cost'))} {g.money(k)}. {g.a} {g.v(('buys', 'bought'))} {g.n(n)}", "pay"),
        (f"{g.a} {g.v(('buys', 'bought'))} {g.n(n)} {_pl(item)} at {g.money(k)} each", "pay"),
        (f"{g.a} {g.v(('buys', 'bought'))} {g.n(n)} {_pl(item)} for {g.money(k)} apiece", "pay"),
        (f"{g.a} {g.v(('earns', 'earned'))} {g.money(k)} per hour and {g.v(('works', 'worked'))} {g.n(n)} hours", "earn"),
        (f"{g.a} {g.v(('gets', 'got'))} {g.money(k)} for every hour of work and {g.v(('works', 'worked'))} {g.n(n)} hours",
         "earn"),
        (f"each hour of work {g.v(('pays', 'paid'))} {g.a} {g.money(k)}, and {g.he(g.a)} {g.v(('works', 'worked'))} "
         f"{g.n(n)} hours", "earn"),
        (f"{g.a} {g.v(('saves', 'saved'))} {g.money(k)} a week for {g.n(n)} weeks", "save"),
    )  # fmt: skip
    s.facts.append(fact)
    s.calc(n, "*", k) if g.p(0.5) else s.calc(k, "*", n)
    s.question = g.pick(f"How much {g.does()} {g.a} {question} {g.pick(*TOTAL_Q)}?", "What is the total?",
                        "What does that come to?", f"How much money {g.does()} {g.a} {question}?")  # fmt: skip


def story_share(g: _G, s: _Story) -> None:
    sg, pl = g.thing
    d, q = g.r(2, 12), g.r(2, 25)
    t = d * q
    if g.p(0.55):
        s.facts.append(g.pick(f"{g.a} {g.v(('shares', 'shared'))} {g.cnt(t)} equally among {g.n(d)} friends",
                              f"{g.cnt(t)} {g.v(('are', 'were'))} split evenly between {g.n(d)} children",
                              f"{g.a} {g.v(('divides', 'divided'))} {g.cnt(t)} into {g.n(d)} equal piles",
                              f"{g.n(d)} friends {g.v(('share', 'shared'))} {g.cnt(t)} equally"))  # fmt: skip
        s.question = g.pick(f"How many {pl} does each friend get?", "How many does each one get?", "How many are in each share?",
                            "How big is a share?", f"How many {pl} go to each?")  # fmt: skip
    else:
        gs, gp = g.group
        s.facts.append(g.pick(f"{g.a} {g.v(('packs', 'packed'))} {g.cnt(t)} into {gp} of {g.n(d)}",
                              f"{g.cnt(t)} {g.v(('are', 'were'))} put {g.n(d)} to a {gs}",
                              f"{g.a} {g.has()} {g.cnt(t)} and {g.v(('puts', 'put'))} {g.n(d)} in each {gs}"))  # fmt: skip
        s.question = g.pick(f"How many {gp} {g.does()} {g.a} fill?", f"How many {gp} are needed?", f"How many full {gp} are there?")
    s.calc(t, "/", d)


def story_change(g: _G, s: _Story) -> None:
    item = g.pick(*FOR_SALE)
    pay = g.pick(10, 20, 50, 100, 200)
    if g.p(0.5):
        c = g.r(1, pay - 1)
        s.facts.append(g.pick(f"{g.a} {g.v(('pays', 'paid'))} for a {item} that {g.v(('costs', 'cost'))} {g.money(c)} with {g.money(pay)}",
                              f"{g.a} {g.v(('gives', 'gave'))} the cashier {g.money(pay)} for a {item} marked {g.money(c)}",
                              f"a {item} {g.v(('costs', 'cost'))} {g.money(c)}, and {g.a} {g.v(('pays', 'paid'))} with {g.money(pay)}"))  # fmt: skip
        s.calc(pay, "-", c)
    else:
        n, k = g.r(2, 9), g.r(2, 20)
        if n * k >= pay:
            raise ValueError("too dear")
        s.facts.append(g.pick(f"{g.a} {g.v(('buys', 'bought'))} {g.n(n)} {_pl(item)} at {g.money(k)} each and {g.v(('pays', 'paid'))} with {g.money(pay)}",
                              f"{g.a} {g.v(('gives', 'gave'))} the seller {g.money(pay)} for {g.n(n)} {_pl(item)} costing {g.money(k)} each"))  # fmt: skip
        v = s.calc(n, "*", k)
        s.calc(pay, "-", v)
    s.question = g.pick(f"How much change {g.does()} {g.a} get?", f"What change {g.does()} {g.he(g.a)} receive?",
                        "How much money comes back?", f"How much {g.v(('is', 'was'))} {g.a} given back?")  # fmt: skip


def story_chain(g: _G, s: _Story) -> None:
    """Equal groups or a start, then gains and losses, then sometimes an equal share."""
    sg, pl = g.thing
    if g.p(0.5):
        n, k = g.r(2, 9), g.r(2, 25)
        s.facts.append(f"{g.a} {g.has()} {g.n(n)} {g.group[1]} with {g.cnt(k)} in each")
        v = s.calc(n, "*", k)
    else:
        v = g.r(10, 100)
        s.facts.append(_start(g, v))
    v = _gains_and_losses(g, s, v, g.pick(1, 2))
    divisors = [d for d in range(2, 13) if v % d == 0 and 2 <= v // d <= 25]
    if divisors and g.p(0.4):
        d = g.pick(*divisors)
        s.facts.append(f"{g.he(g.a)} {g.v(('shares', 'shared'))} them equally among {g.n(d)} friends")
        s.calc(v, "/", d)
        s.question = g.pick(f"How many {pl} does each friend get?", "How many does each one get?")
    else:
        s.question = _ask_count(g, g.a, LEFT_Q)


CROWD = (("passengers", "on", "the train"), ("people", "on", "the bus"), ("guests", "at", "the party"),
         ("children", "in", "the pool"), ("players", "on", "the field"), ("visitors", "in", "the museum"))  # fmt: skip
OFF = (("get off", "got off"), ("step off", "stepped off"), ("leave", "left"), ("go home", "went home"),
       ("walk out", "walked out"))  # fmt: skip
ON = (("get on", "got on"), ("climb aboard", "climbed aboard"), ("join", "joined"), ("arrive", "arrived"),
      ("come in", "came in"), ("turn up", "turned up"))  # fmt: skip


def story_crowd(g: _G, s: _Story) -> None:
    """People on a bus or in a place: some leave, some come."""
    many, prep, place = g.pick(*CROWD)
    where = f"{prep} {place}"
    v = g.r(10, 100)
    s.facts.append(g.pick(f"there {g.v(('are', 'were'))} {g.n(v)} {many} {where}", f"{place} {g.has()} {g.n(v)} {many}"))
    s.ordered = True
    left = False
    for _ in range(g.pick(1, 2, 2)):
        if g.p(0.5) and v > 3:
            k = g.r(1, min(v - 1, 40))
            forms = [f"{g.n(k)} {g.v(g.pick(*OFF))}", f"{g.n(k)} of them {g.v(g.pick(*OFF))}", f"{g.n(k)} {many} {g.v(g.pick(*OFF))}"]
            if left:  # "3 more got off": more of them left, fewer are there
                forms += [f"{g.n(k)} more {g.v(g.pick(*OFF))}", f"another {g.n(k)} {g.v(g.pick(*OFF))}"]
            s.facts.append(g.pick(*forms))
            v = s.calc(v, "-", k)
            left = True
        else:
            k = g.r(1, 40)
            s.facts.append(g.pick(f"{g.n(k)} more {g.v(g.pick(*ON))}", f"{g.n(k)} {many} {g.v(g.pick(*ON))}",
                                  f"another {g.n(k)} {g.v(g.pick(*ON))}"))  # fmt: skip
            v = s.calc(v, "+", k)
    s.question = g.pick(f"How many {many} are {where} now?", f"How many {many} {g.v(('are', 'were'))} there in the end?",
                        f"What is the number of {many} {where} after that?", f"How many are {where} at this point?")  # fmt: skip


def story_rest(g: _G, s: _Story) -> None:
    """What is left of a trip, a book or a job, or an age some years on."""
    x, k = g.r(20, 100), g.r(2, 19)
    shape = g.r(0, 3)
    if shape == 0:
        s.facts += [f"the trip to {g.b}'s house {g.v(('is', 'was'))} {g.n(x)} km", f"{g.a} {g.v(('has', 'had'))} already driven {g.n(k)} km"]
        s.question = g.pick("How many km are left?", f"How far {g.v(('is', 'was'))} {g.a} from the end?", "What distance remains?")
    elif shape == 1:
        s.facts += [f"{g.a}'s book {g.has()} {g.n(x)} pages", f"{g.he(g.a)} {g.v(('has', 'had'))} read {g.n(k)} of them"]
        s.question = g.pick("How many pages are left to read?", f"How many pages {g.does()} {g.a} have left to read?")
    elif shape == 2:
        s.facts += [f"{g.a} {g.v(('has', 'had'))} {g.n(x)} jobs to do", f"{g.he(g.a)} {g.v(('finishes', 'finished'))} {g.n(k)}"]
        s.question = g.pick("How many jobs are still to do?", "How many jobs remain?")
    else:
        s.facts.append(f"{g.a} {g.v(('is', 'was'))} {g.n(x)} years old")
        if g.p(0.5):
            s.question = f"How old will {g.a} be in {g.n(k)} years?"
            s.calc(x, "+", k)
            return
        s.question = f"How old was {g.a} {g.n(k)} years ago?"
    s.calc(x, "-", k)


def story_half(g: _G, s: _Story) -> None:
    """Half of, twice as many, all but k, and a rate per hour."""
    sg, pl = g.thing
    shape = g.r(0, 3)
    if shape == 0:
        x = 2 * g.r(2, 50)
        s.facts.append(g.pick(f"{g.a} {g.has()} {g.cnt(x)} and {g.v(('gives', 'gave'))} half of them away",
                              f"half of {g.a}'s {g.n(x)} {pl} {g.v(('are', 'were'))} {g.pick('red', 'old', 'new', 'broken')}"))  # fmt: skip
        s.question = g.pick(f"How many {pl} {g.does()} {g.a} keep?", f"How many {pl} is that half?", "How many is that?")
        s.calc(x, "/", 2)
    elif shape == 1:
        x = g.r(2, 100)
        s.facts += [f"{g.a} {g.v(g.pick(*HAVE))} {g.cnt(x)}", f"{g.b} {g.has()} twice as many"]
        s.question = _ask_count(g, g.b, ("", "now"))
        s.calc(x, "*", 2)
    elif shape == 2:
        x, k = g.r(10, 100), g.r(1, 9)
        s.facts.append(f"{g.a} {g.v(('has', 'had'))} {g.cnt(x)} and {g.v(('uses', 'used'))} all but {g.n(k)} of them")
        s.question = g.pick(f"How many {pl} {g.v(('does', 'did'))} {g.a} use?", f"How many {pl} {g.v(('were', 'were'))} used?")
        s.calc(x, "-", k)
    else:
        d, q = g.r(2, 12), g.r(2, 25)
        s.facts.append(g.pick(f"{g.a} {g.v(('earns', 'earned'))} {g.money(d * q)} in {g.n(d)} hours",
                              f"{g.n(d)} {_pl(g.pick(*FOR_SALE))} cost {g.money(d * q)} in all"))  # fmt: skip
        s.question = g.pick("How much is that per hour?", "How much is each one?", "What is the price or pay for one?")
        if "hours" in s.facts[-1]:
            s.question = g.pick("How much is that per hour?", f"How much {g.does()} {g.a} earn each hour?")
        else:
            s.question = g.pick("How much is each one?", "What does one cost?")
        s.calc(d * q, "/", d)


STORIES = {"combine": (story_combine, 1.0), "events": (story_events, 1.6), "compare": (story_compare, 1.3),
           "measure": (story_measure, 0.6), "difference": (story_difference, 1.0), "times": (story_times, 0.7),
           "groups": (story_groups, 0.8), "price": (story_price, 0.9), "share": (story_share, 1.0),
           "change": (story_change, 1.0), "chain": (story_chain, 1.6), "crowd": (story_crowd, 0.8),
           "rest": (story_rest, 0.7), "half": (story_half, 0.6)}  # fmt: skip


def _distractor(g: _G) -> str:
    k = g.r(2, 99)
    while k in g.used:
        k = g.r(2, 99)
    return g.pick(f"{g.b} is {k} years old.", f"The trip took {k} minutes.", f"{g.a} lives at number {k}.",
                  f"The class has {k} desks.", f"It was {k} degrees outside.", f"The bus was {k} minutes late.")  # fmt: skip


def _sentence(t: str) -> str:
    t = t.strip()
    return t[:1].upper() + t[1:] + ("" if t.endswith((".", "?")) else ".")


def _decap(g: _G, t: str) -> str:
    """``t`` with a lower-case first letter, unless it starts with a name."""
    return t if t.split(" ", 1)[0].split("'")[0] in (g.a, g.b) else t[:1].lower() + t[1:]


def make_problem(rng: random.Random) -> Problem:
    """One problem (see the module docstring); deterministic for the state of ``rng``."""
    kinds = list(STORIES)
    kind = rng.choices(kinds, [STORIES[k][1] for k in kinds])[0]
    g, s = _G(rng), _Story()
    STORIES[kind][0](g, s)
    facts = [_sentence(f) for f in s.facts]
    if s.ordered:
        for i in range(1, len(facts)):
            if rng.random() < 0.35:
                facts[i] = f"{rng.choice(TIMES)}, {_decap(g, facts[i])}"
    elif len(facts) == 2 and kind in ("combine", "difference") and rng.random() < 0.3:
        facts.reverse()
    if rng.random() < 0.3:
        facts.insert(rng.randrange(0, len(facts) + 1), _distractor(g))
    if rng.random() < 0.1:
        facts.insert(rng.randrange(0, len(facts) + 1), rng.choice(CALM))
    if len(facts) >= 2 and rng.random() < 0.25 and kind != "measure":  # two facts as one sentence
        i = rng.randrange(0, len(facts) - 1)
        joint = rng.choice((", and ", "; ", ", then ", " and ")) if s.ordered else rng.choice((", and ", "; ", " and ", ", while "))
        if facts[i + 1].startswith("The "):
            joint = "; "
        facts[i : i + 2] = [facts[i].rstrip(".") + joint + _decap(g, facts[i + 1])]
    body = " ".join(facts)
    text = f"{s.question} {body}" if rng.random() < 0.3 else f"{body} {s.question}"
    if rng.random() < 0.08:
        text = f"{rng.choice(LEAD_INS)} {text}"
    if rng.random() < 0.07:
        text = text.lower()
    if rng.random() < 0.08:
        text = text.replace("?", "")
    text = re.sub(r" +([?.,])", r"\1", " ".join(text.split()))
    answer = "\n".join(f"{e} = <<{e}={v}>>{v}" for e, v in s.steps) + f"\n#### {s.steps[-1][1]}"
    return Problem(text, answer, s.steps[-1][1], f"grammar/{kind}")


def generate_grammar(n: int, seed: int) -> list[Problem]:
    """``n`` distinct problems for ``seed`` (a prefix of any longer list for the same seed)."""
    return distinct_problems(redrawn(make_problem), n, seed)

