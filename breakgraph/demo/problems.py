"""Seeded, templated arithmetic word problems in GSM8K's answer format, for the built-in demo model.

Every problem is a short question and a worked answer whose lines carry calculator annotations
and end in the final number, exactly as GSM8K writes them::

    Question: Mia had 45 stickers. She gave 17 of them to Omar. How many stickers does Mia have left?
    Answer: Mia has 45-17 = <<45-17=28>>28 stickers left.
    #### 28

Kinds and number ranges (chosen so that a model of a few million parameters can learn them):

- ``add``: two addends 2-100 (sums up to 200).
- ``sub``: minuend up to 100, result at least 2 (never negative).
- ``mul``: one factor 2-12 (a count), the other 2-50 (products up to 600).
- ``div``: divisor 2-12, quotient 2-20, so the dividend is an exact multiple up to 240.
- ``two``: two steps mixing the four operations; every intermediate and final result is an
  integer in 2-1000.

Numbers stated in a question are at most 100, except dividends (at most 240). Every result,
intermediate or final, is an integer in ``[MIN_RESULT, MAX_RESULT]``; templates
whose sampled numbers break that are re-drawn. Results are at least 2 so that the plural nouns
of the templates always read correctly. Each kind has at least ten phrasings, and a few carry a
number the question does not need, so the model must read the text rather than pattern-match the
numbers.

Splits: ``test_split`` is fixed (seed ``TEST_SEED``); ``train_split`` drops every problem whose
normalised question (``normalise_question``: lower case, punctuation and spacing dropped) equals
one of the first ``TEST_POOL`` test questions, so any ``test_split(n)`` with ``n <= TEST_POOL`` is
disjoint from every training split.
"""

from __future__ import annotations

import ast
import random
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from fractions import Fraction
from functools import lru_cache

MIN_RESULT = 2
MAX_RESULT = 1000
TEST_SEED = 20240
TEST_POOL = 1000

# --------------------------------------------------------------------------------------------
# Slot fillers

FEMALE_NAMES = (
    "Emma", "Olivia", "Ava", "Sophia", "Mia", "Amelia", "Harper", "Lily", "Chloe", "Zoe", "Grace",
    "Nora", "Aisha", "Priya", "Mei", "Sofia", "Hana", "Fatima", "Lucia", "Ingrid", "Amara", "Rosa",
)  # fmt: skip
MALE_NAMES = (
    "Liam", "Noah", "Oliver", "Elijah", "James", "Lucas", "Mateo", "Ethan", "Leo", "Omar", "Ravi",
    "Kenji", "Diego", "Samuel", "Felix", "Hugo", "Tariq", "Kwame", "Ivan", "Marco", "Jamal", "Arjun",
)  # fmt: skip
NAMES = tuple((n, "f") for n in FEMALE_NAMES) + tuple((n, "m") for n in MALE_NAMES)

FOODS = (
    "apples", "oranges", "bananas", "pears", "peaches", "plums", "lemons", "cookies", "cupcakes",
    "muffins", "donuts", "bagels", "carrots", "potatoes", "tomatoes", "eggs", "strawberries",
    "cherries", "crackers", "pretzels",
)  # fmt: skip
ITEMS = (
    "marbles", "stickers", "pencils", "crayons", "books", "comics", "stamps", "buttons", "beads",
    "shells", "rocks", "cards", "toy cars", "balloons", "candles", "erasers", "notebooks", "markers",
    "puzzles", "ribbons", "postcards", "keychains", "badges", "paper clips", "tennis balls", "blocks",
    "feathers", "magnets", "bookmarks", "tulips",
)  # fmt: skip
CONTAINERS = (
    ("box", "boxes"), ("bag", "bags"), ("basket", "baskets"), ("crate", "crates"), ("jar", "jars"),
    ("tray", "trays"), ("pack", "packs"), ("tin", "tins"), ("carton", "cartons"), ("bucket", "buckets"),
)  # fmt: skip
GIFTS = (
    "book", "kite", "scarf", "board game", "backpack", "lamp", "watch", "toy robot", "football",
    "jacket", "puzzle", "helmet",
)  # fmt: skip
EVENTS = ("concert", "museum", "zoo", "movie", "fair", "football game", "play", "circus", "aquarium")
DISTANCES = ("kilometers", "miles", "meters")
LENGTHS = ("meters", "feet", "centimeters", "inches", "yards")
VOLUMES = ("liters", "gallons", "cups", "milliliters")
DAYS = ("Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday")
# (prefix, suffix) around an amount: "$12", "12 euros".
CURRENCIES = (
    ("$", ""), ("£", ""), ("€", ""), ("", " dollars"), ("", " euros"), ("", " pounds"),
    ("", " rupees"), ("", " pesos"), ("", " yen"), ("", " francs"),
)  # fmt: skip

_PRONOUNS = {
    "f": {"he": "she", "He": "She", "his": "her", "His": "Her", "him": "her"},
    "m": {"he": "he", "He": "He", "his": "his", "His": "His", "him": "him"},
}

# --------------------------------------------------------------------------------------------
# Templates
#
# A template is a question and one or more answer steps, all ``str.format`` strings over the slot
# fields (``{name}``, ``{he}``, ``{item}``, ...) and the sampled numbers (``{a}``, ``{b}``, ...).
# ``{m_a}`` is ``a`` written as money in the problem's currency. In a step, ``[expr]`` is a
# calculation: it renders as ``expr = <<expr=value>>value`` and binds its value to ``r1``, ``r2``,
# ... in order; ``[$expr]`` does the same with the value written as money. The last calculation is
# the final answer.

_CALC = re.compile(r"\[(\$?)([^\]]+)\]")
_NUMBER_RANGES = {
    "add": {"a": (2, 100), "b": (2, 100)},
    "sub": {"a": (5, 100), "b": (2, 98)},
    "mul": {"a": (2, 12), "b": (2, 50)},
    "div": {"d": (2, 12), "q": (2, 20), "a": "q*d"},
    "two": {},
}
_DISTRACTOR = (2, 30)


@dataclass(frozen=True)
class Problem:
    """One word problem.

    question: the question text.
    answer: worked steps with ``<<expr=value>>`` annotations, last line ``#### {final}``.
    final: the answer as an integer.
    template: which template produced it, e.g. ``"sub/3"``.
    """

    question: str
    answer: str
    final: int
    template: str = ""


@dataclass(frozen=True)
class _Calc:
    expr: str  # format string, e.g. "{a}+{b}"
    tree: ast.expr  # the same expression over variable names, e.g. a+b
    money: bool


class _Template:
    def __init__(self, kind: str, index: int, question: str, steps: tuple[str, ...], numbers: dict):
        self.kind = kind
        self.name = f"{kind}/{index}"
        self.question = question
        self.steps = steps
        self.numbers = {**_NUMBER_RANGES[kind], **numbers}
        self.calcs = [
            [_Calc(m.group(2), _parse(m.group(2).replace("{", "").replace("}", "")), m.group(1) == "$")
             for m in _CALC.finditer(step)]
            for step in steps
        ]  # fmt: skip
        if not any(self.calcs):
            raise ValueError(f"template {self.name} has no [calculation] in its steps")
        self.derived = {k: _parse(v) for k, v in self.numbers.items() if isinstance(v, str)}

    def sample(self, rng: random.Random, max_tries: int = 2000) -> Problem:
        slots = _sample_slots(rng)
        for _ in range(max_tries):
            env: dict[str, int] = {}
            for var, spec in self.numbers.items():
                env[var] = _eval(self.derived[var], env) if isinstance(spec, str) else rng.randint(*spec)
            values = self._evaluate(env)
            if values is not None:
                return self._render(slots, env, values)
        raise RuntimeError(
            f"template {self.name} found no numbers with all results in [{MIN_RESULT}, {MAX_RESULT}] "
            f"after {max_tries} draws; widen its ranges in _NUMBER_RANGES or the template"
        )

    def _evaluate(self, env: dict[str, int]) -> list[int] | None:
        values = []
        for calcs in self.calcs:
            for calc in calcs:
                v = _eval(calc.tree, env)
                if v.denominator != 1 or not MIN_RESULT <= v <= MAX_RESULT:
                    return None
                values.append(int(v))
                env[f"r{len(values)}"] = int(v)
        return values

    def _render(self, slots: dict[str, str], env: dict[str, int], values: list[int]) -> Problem:
        pre, post = slots.pop("currency")
        fields = {**slots, **env}
        fields.update({f"m_{k}": f"{pre}{v}{post}" for k, v in env.items()})
        results = iter(values)

        def calc(m: re.Match) -> str:
            expr, value = m.group(2).format(**fields), next(results)
            shown = f"<<{expr}={value}>>{value}"
            return f"{expr} = {pre}{shown}{post}" if m.group(1) else f"{expr} = {shown}"

        # Fill the calculations first: the slot values (names, objects) never contain brackets.
        lines = [_CALC.sub(calc, step).format(**fields) for step in self.steps]
        answer = "\n".join(lines) + f"\n#### {values[-1]}"
        return Problem(self.question.format(**fields), answer, values[-1], self.name)


_ALLOWED_NODES = (ast.BinOp, ast.Name, ast.Constant, ast.Add, ast.Sub, ast.Mult, ast.Div, ast.Load)


def _parse(expr: str) -> ast.expr:
    tree = ast.parse(expr, mode="eval").body
    for node in ast.walk(tree):
        if not isinstance(node, _ALLOWED_NODES):
            raise TypeError(f"calculation {expr!r} may only use + - * / on names and integers")
    return tree


def _eval(node: ast.expr, env: dict[str, int]) -> Fraction:
    if isinstance(node, ast.Constant):
        return Fraction(node.value)
    if isinstance(node, ast.Name):
        return Fraction(env[node.id])
    assert isinstance(node, ast.BinOp)
    left, right = _eval(node.left, env), _eval(node.right, env)
    if isinstance(node.op, ast.Add):
        return left + right
    if isinstance(node.op, ast.Sub):
        return left - right
    if isinstance(node.op, ast.Mult):
        return left * right
    return left / right


def _sample_slots(rng: random.Random) -> dict:
    (name, sex), (name2, sex2) = rng.sample(NAMES, 2)
    box, boxes = rng.choice(CONTAINERS)
    day = rng.randrange(len(DAYS))
    return {
        "name": name,
        **_PRONOUNS[sex],
        "name2": name2,
        **{k + "2": v for k, v in _PRONOUNS[sex2].items()},
        "food": rng.choice(FOODS),
        "item": rng.choice(ITEMS),
        "box": box,
        "boxes": boxes,
        "gift": rng.choice(GIFTS),
        "event": rng.choice(EVENTS),
        "dist": rng.choice(DISTANCES),
        "len": rng.choice(LENGTHS),
        "vol": rng.choice(VOLUMES),
        "day1": DAYS[day],
        "day2": DAYS[(day + 1) % len(DAYS)],
        "currency": rng.choice(CURRENCIES),
    }


_C = {"c": _DISTRACTOR}  # a number the question mentions but does not need


def _t(question: str, *steps: str, **numbers: tuple[int, int] | str) -> tuple:
    """One template: the question, its answer steps, and number ranges beyond its kind's defaults."""
    return question, steps, numbers


_TEMPLATES_BY_KIND: dict[str, list[tuple]] = {
    "add": [
        _t(
            "{name} has {a} {item}. {He} buys {b} more {item}. How many {item} does {name} have now?",
            "{name} now has [{a}+{b}] {item}.",
        ),
        _t(
            (
                "{name} picked {a} {food} in the morning and {b} {food} in the afternoon. "
                "How many {food} did {he} pick in all?"
            ),
            "{He} picked [{a}+{b}] {food} in all.",
        ),
        _t(
            (
                "There are {a} {item} in a {box} and {b} {item} on the table. "
                "How many {item} are there altogether?"
            ),
            "There are [{a}+{b}] {item} altogether.",
        ),
        _t(
            (
                "{name} read {a} pages on {day1} and {b} pages on {day2}. "
                "How many pages did {he} read on the two days?"
            ),
            "{He} read [{a}+{b}] pages on the two days.",
        ),
        _t(
            (
                "{name} has {m_a}. {His} grandmother gives {him} {m_b} more. "
                "How much money does {name} have now?"
            ),
            "{name} now has [${a}+{b}].",
        ),
        _t(
            (
                "{name} walked {a} {dist} on {day1}. On {day2} {he} walked {b} {dist}. "
                "How many {dist} did {he} walk in total?"
            ),
            "{He} walked [{a}+{b}] {dist} in total.",
        ),
        _t(
            (
                "{name} collected {a} {item}. {name2} collected {b} {item}. "
                "How many {item} did they collect together?"
            ),
            "Together they collected [{a}+{b}] {item}.",
        ),
        _t(
            (
                "A shop sold {a} {food} before noon and {b} {food} after noon. "
                "How many {food} did the shop sell that day?"
            ),
            "The shop sold [{a}+{b}] {food} that day.",
        ),
        _t(
            "{name} is {a} years old. {name2} is {b} years older than {name}. How old is {name2}?",
            "{name2} is [{a}+{b}] years old.",
            a=(5, 60),
            b=(2, 30),
        ),
        _t(
            (
                "A bus had {a} passengers. At the next stop, "
                "{b} more passengers got on and nobody got off. How many passengers are on the bus now?"
            ),
            "There are [{a}+{b}] passengers on the bus now.",
        ),
        _t(
            (
                "{name} scored {a} points in the first game and {b} points in the second game. "
                "How many points did {he} score in both games?"
            ),
            "{He} scored [{a}+{b}] points in both games.",
        ),
        _t(
            (
                "{name} has {a} {item} and {c} {boxes}. "
                "{He} finds {b} more {item}. How many {item} does {he} have now?"
            ),
            "{He} has [{a}+{b}] {item} now.",
            **_C,
        ),
        _t(
            (
                "A jug holds {a} {vol} of juice. {name} pours in {b} more {vol}. "
                "How many {vol} of juice are in the jug?"
            ),
            "The jug holds [{a}+{b}] {vol} of juice.",
        ),
    ],
    "sub": [
        _t(
            "{name} had {a} {item}. {He} gave {b} of them to {name2}. How many {item} does {name} have left?",
            "{name} has [{a}-{b}] {item} left.",
        ),
        _t(
            "{name} bought {a} {food}. {His} family ate {b} of them. How many {food} are left?",
            "There are [{a}-{b}] {food} left.",
        ),
        _t(
            "{name} has {m_a}. {He} spends {m_b} on a {gift}. How much money does {he} have left?",
            "{He} has [${a}-{b}] left.",
        ),
        _t(
            "A tank holds {a} {vol} of water. Then {b} {vol} leak out. How many {vol} remain in the tank?",
            "[{a}-{b}] {vol} remain in the tank.",
        ),
        _t(
            (
                "{name} is reading a book with {a} pages. "
                "{He} has already read {b} pages. How many pages are left to read?"
            ),
            "There are [{a}-{b}] pages left to read.",
        ),
        _t(
            (
                "{name} has {a} {item} and {name2} has {b} {item}. "
                "How many more {item} does {name} have than {name2}?"
            ),
            "{name} has [{a}-{b}] more {item} than {name2}.",
        ),
        _t(
            "{name} is {a} years old. {name2} is {b} years younger than {name}. How old is {name2}?",
            "{name2} is [{a}-{b}] years old.",
            a=(10, 90),
            b=(2, 40),
        ),
        _t(
            "A trip is {a} {dist} long. After traveling {b} {dist}, how many {dist} are left?",
            "[{a}-{b}] {dist} are left.",
        ),
        _t(
            (
                "There were {a} {item} on a shelf. {name} took {b} {item} away. "
                "How many {item} are on the shelf now?"
            ),
            "There are [{a}-{b}] {item} on the shelf now.",
        ),
        _t(
            (
                "{name} wants to save {m_a} for a {gift}. "
                "{He} has saved {m_b} so far. How much more money does {he} need?"
            ),
            "{He} needs [${a}-{b}] more.",
        ),
        _t(
            (
                "A bus had {a} passengers. At the next stop, "
                "{b} passengers got off and nobody got on. How many passengers are still on the bus?"
            ),
            "[{a}-{b}] passengers are still on the bus.",
        ),
        _t(
            "{name} had {a} {food} and {c} {item}. {He} ate {b} {food}. How many {food} does {he} have left?",
            "{He} has [{a}-{b}] {food} left.",
            **_C,
        ),
        _t(
            "A ribbon is {a} {len} long. {name} cuts off {b} {len}. How long is the ribbon now?",
            "The ribbon is [{a}-{b}] {len} long now.",
        ),
    ],
    "mul": [
        _t(
            "{name} buys {a} {boxes} of {food}. Each {box} has {b} {food}. How many {food} does {he} buy?",
            "{He} buys [{a}*{b}] {food}.",
        ),
        _t(
            "{name} buys {a} {item} that cost {m_b} each. How much does {he} spend?",
            "{He} spends [${a}*{b}].",
        ),
        _t(
            "There are {a} rows of chairs with {b} chairs in each row. How many chairs are there?",
            "There are [{a}*{b}] chairs.",
        ),
        _t(
            "{name} reads {b} pages every day. How many pages does {he} read in {a} days?",
            "{He} reads [{b}*{a}] pages.",
        ),
        _t(
            "{name} earns {m_b} per hour. How much does {he} earn for working {a} hours?",
            "{He} earns [${b}*{a}].",
        ),
        _t(
            "A car travels {b} {dist} every hour. How many {dist} does it travel in {a} hours?",
            "It travels [{b}*{a}] {dist}.",
        ),
        _t(
            (
                "Each of {a} students brings {b} {item} to class. "
                "How many {item} do the students bring in total?"
            ),
            "They bring [{a}*{b}] {item} in total.",
        ),
        _t(
            "{name} has {a} {boxes}. There are {b} {item} in each {box}. How many {item} does {name} have?",
            "{name} has [{a}*{b}] {item}.",
        ),
        _t(
            (
                "A farmer plants {a} rows of trees with {b} trees in each row. "
                "How many trees does the farmer plant?"
            ),
            "The farmer plants [{a}*{b}] trees.",
        ),
        _t(
            (
                "{name} has {b} {item}. {name2} has {a} times as many {item} as {name}. "
                "How many {item} does {name2} have?"
            ),
            "{name2} has [{b}*{a}] {item}.",
        ),
        _t(
            "A ticket to the {event} costs {m_b}. How much do {a} tickets cost?",
            "{a} tickets cost [${a}*{b}].",
        ),
        _t(
            "{name} is {c} years old. {He} swims {b} laps on each of {a} days. How many laps does {he} swim?",
            "{He} swims [{b}*{a}] laps.",
            **_C,
        ),
        _t(
            "{name} fills {a} bottles with {b} {vol} of water each. How many {vol} of water does {he} use?",
            "{He} uses [{a}*{b}] {vol} of water.",
        ),
    ],
    "div": [
        _t(
            (
                "{name} has {a} {food} and shares them equally among {d} friends. "
                "How many {food} does each friend get?"
            ),
            "Each friend gets [{a}/{d}] {food}.",
        ),
        _t(
            (
                "{name} packs {a} {item} into {boxes} with {d} {item} in each {box}. "
                "How many {boxes} does {he} fill?"
            ),
            "{He} fills [{a}/{d}] {boxes}.",
        ),
        _t(
            "{name} paid {m_a} for {d} {item} that all cost the same. How much did each one cost?",
            "Each one cost [${a}/{d}].",
        ),
        _t(
            "A rope {a} {len} long is cut into {d} equal pieces. How long is each piece?",
            "Each piece is [{a}/{d}] {len} long.",
        ),
        _t(
            (
                "{name} read a book of {a} pages in {d} days, "
                "reading the same number of pages each day. How many pages did {he} read each day?"
            ),
            "{He} read [{a}/{d}] pages each day.",
        ),
        _t(
            "A teacher splits {a} students into {d} equal groups. How many students are in each group?",
            "There are [{a}/{d}] students in each group.",
        ),
        _t(
            "{name} earned {m_a} for working {d} hours. How much did {he} earn per hour?",
            "{He} earned [${a}/{d}] per hour.",
        ),
        _t(
            (
                "A train traveled {a} {dist} in {d} hours at a steady speed. "
                "How many {dist} did it travel each hour?"
            ),
            "It traveled [{a}/{d}] {dist} each hour.",
        ),
        _t(
            "There are {a} chairs arranged in {d} equal rows. How many chairs are in each row?",
            "There are [{a}/{d}] chairs in each row.",
        ),
        _t(
            (
                "{name2} has {a} {item}, which is {d} times as many as {name} has. "
                "How many {item} does {name} have?"
            ),
            "{name} has [{a}/{d}] {item}.",
        ),
        _t(
            "{name} divides {m_a} equally among {d} friends. How much money does each friend get?",
            "Each friend gets [${a}/{d}].",
        ),
        _t(
            (
                "{name} has {a} {food} and {c} {item}. "
                "{He} puts the {food} into {d} {boxes} with the same number in each. How many {food} are in each {box}?"
            ),
            "There are [{a}/{d}] {food} in each {box}.",
            **_C,
        ),
        _t(
            "{name} pours {a} {vol} of water equally into {d} bottles. How many {vol} go into each bottle?",
            "Each bottle gets [{a}/{d}] {vol}.",
        ),
    ],
    "two": [
        _t(
            (
                "{name} had {a} {item}. {He} bought {b} more and then gave {c} to {name2}. "
                "How many {item} does {name} have now?"
            ),
            "After buying, {name} has [{a}+{b}] {item}.",
            "After giving some away, {he} has [{r1}-{c}] {item}.",
            a=(2, 60),
            b=(2, 40),
            c=(2, 60),
        ),
        _t(
            (
                "{name} buys {a} {boxes} of {food} with {b} {food} in each {box}. "
                "{He} already had {c} {food}. How many {food} does {he} have now?"
            ),
            "The {boxes} hold [{a}*{b}] {food}.",
            "{He} now has [{r1}+{c}] {food}.",
            a=(2, 12),
            b=(2, 30),
            c=(2, 50),
        ),
        _t(
            "{name} has {m_c}. {He} buys {a} {item} at {m_b} each. How much money does {he} have left?",
            "The {item} cost [${a}*{b}].",
            "{He} has [${c}-{r1}] left.",
            a=(2, 6),
            b=(2, 15),
            c=(10, 100),
        ),
        _t(
            "{name} buys {a} red pens and {b} blue pens. Each pen costs {m_c}. How much does {he} spend?",
            "{He} buys [{a}+{b}] pens.",
            "{He} spends [${r1}*{c}].",
            a=(2, 20),
            b=(2, 20),
            c=(2, 12),
        ),
        _t(
            (
                "{name} shares {a} {item} equally among {d} friends. "
                "One of the friends already had {c} {item}. How many {item} does that friend have now?"
            ),
            "Each friend gets [{a}/{d}] {item}.",
            "That friend now has [{r1}+{c}] {item}.",
            d=(2, 10),
            q=(2, 20),
            a="q*d",
            c=(2, 30),
        ),
        _t(
            (
                "{name} had {a} {food}. {He} ate {b} of them and split the rest equally into {d} {boxes}. "
                "How many {food} are in each {box}?"
            ),
            "{name} had [{a}-{b}] {food} left.",
            "Each {box} has [{r1}/{d}] {food}.",
            d=(2, 10),
            q=(2, 20),
            b=(2, 20),
            a="q*d+b",
        ),
        _t(
            (
                "{name} worked {a} hours on {day1} and {b} hours on {day2}. "
                "{He} earns {m_c} per hour. How much did {he} earn on the two days?"
            ),
            "{He} worked [{a}+{b}] hours.",
            "{He} earned [${r1}*{c}].",
            a=(2, 10),
            b=(2, 10),
            c=(2, 40),
        ),
        _t(
            "A crate holds {a} packs, and each pack holds {b} {item}. How many {item} are in {c} crates?",
            "One crate holds [{a}*{b}] {item}.",
            "{c} crates hold [{r1}*{c}] {item}.",
            a=(2, 8),
            b=(2, 12),
            c=(2, 10),
        ),
        _t(
            (
                "{name} has {a} {item}. {name2} has {b} more {item} than {name}. "
                "How many {item} do they have together?"
            ),
            "{name2} has [{a}+{b}] {item}.",
            "Together they have [{a}+{r1}] {item}.",
            a=(2, 60),
            b=(2, 40),
        ),
        _t(
            (
                "{name} had {a} {item}. {He} lost {b} of them but then found {c}. "
                "How many {item} does {he} have now?"
            ),
            "After losing some, {he} had [{a}-{b}] {item}.",
            "{He} now has [{r1}+{c}] {item}.",
            a=(10, 100),
            b=(2, 60),
            c=(2, 40),
        ),
        _t(
            (
                "{name} has {a} {item}. {name2} has {b} times as many {item}. "
                "How many more {item} does {name2} have than {name}?"
            ),
            "{name2} has [{a}*{b}] {item}.",
            "{name2} has [{r1}-{a}] more {item} than {name}.",
            a=(2, 50),
            b=(2, 10),
        ),
        _t(
            "{d} {item} cost {m_a}. How much do {c} {item} cost?",
            "One costs [${a}/{d}].",
            "{c} cost [${c}*{r1}].",
            d=(2, 10),
            q=(2, 20),
            a="q*d",
            c=(2, 12),
        ),
        _t(
            (
                "{name} has {a} {food} and {name2} has {b} {food}. "
                "They put them together and share them equally among {d} people. How many {food} does each person get?"
            ),
            "Together they have [{a}+{b}] {food}.",
            "Each person gets [{r1}/{d}] {food}.",
            a=(2, 50),
            b=(2, 50),
            d=(2, 10),
        ),
        _t(
            (
                "A train travels {b} {dist} per hour for {a} hours and then {c} more {dist}. "
                "How many {dist} does it travel in total?"
            ),
            "In {a} hours it travels [{b}*{a}] {dist}.",
            "In total it travels [{r1}+{c}] {dist}.",
            a=(2, 10),
            b=(2, 60),
            c=(2, 50),
        ),
        _t(
            (
                "A {gift} normally costs {m_a}. It is on sale for {m_b} less. "
                "How much do {c} of them cost on sale?"
            ),
            "On sale one costs [${a}-{b}].",
            "{c} of them cost [${c}*{r1}].",
            a=(5, 60),
            b=(2, 30),
            c=(2, 10),
        ),
    ],
}

TEMPLATES: dict[str, list[_Template]] = {
    kind: [_Template(kind, i, *entry) for i, entry in enumerate(entries)]
    for kind, entries in _TEMPLATES_BY_KIND.items()
}
# How often each kind is drawn.
KIND_WEIGHTS = {"add": 0.15, "sub": 0.15, "mul": 0.15, "div": 0.15, "two": 0.4}

# --------------------------------------------------------------------------------------------
# Generation, splits and formatting


def exact_step(a: int, op: str, b: int) -> int:
    """``a op b`` for ``op`` in ``+ - * /``; raises ``ValueError`` when a division is not exact
    (or by zero), so generators can redraw instead of writing a wrong annotation."""
    if op == "/" and (b == 0 or a % b):
        raise ValueError(f"{a}/{b} is not exact")
    return {"+": a + b, "-": a - b, "*": a * b, "/": a // b if b else 0}[op]


def normalise_question(question: str) -> str:
    """The key used to deduplicate questions: lower-case words and numbers joined by single spaces.

    Case, punctuation, currency symbols and spacing are ignored, so ``"Mia has $5."`` and
    ``"mia has 5"`` are the same question.
    """
    return " ".join(re.findall(r"[a-z0-9]+", question.lower()))


def redrawn(make_problem: Callable[[random.Random], Problem]) -> Callable[[random.Random], Problem]:
    """``make_problem`` drawing again, from the same generator, whenever it raises ``ValueError``
    (a story whose numbers left the ranges)."""

    def draw(rng: random.Random) -> Problem:
        while True:
            try:
                return make_problem(rng)
            except ValueError:
                continue

    return draw


def distinct_problems(make_problem: Callable[[random.Random], Problem], n: int, seed: int) -> list[Problem]:
    """The first ``n`` problems ``make_problem`` draws from ``random.Random(seed)`` whose questions
    differ after :func:`normalise_question` (so a prefix of any longer list for the same seed)."""
    if n < 0:
        raise ValueError(f"n must be >= 0, got {n}")
    rng = random.Random(seed)
    seen: set[str] = set()
    out: list[Problem] = []
    while len(out) < n:
        p = make_problem(rng)
        key = normalise_question(p.question)
        if key not in seen:
            seen.add(key)
            out.append(p)
    return out


def iter_problems(seed: int) -> Iterator[Problem]:
    """An endless, deterministic stream of problems for ``seed``, without repeated questions."""
    rng = random.Random(seed)
    kinds = list(KIND_WEIGHTS)
    weights = [KIND_WEIGHTS[k] for k in kinds]
    seen: set[str] = set()
    while True:
        kind = rng.choices(kinds, weights)[0]
        problem = rng.choice(TEMPLATES[kind]).sample(rng)
        key = normalise_question(problem.question)
        if key not in seen:
            seen.add(key)
            yield problem


def generate(n: int, seed: int) -> list[Problem]:
    """``n`` distinct problems drawn with ``seed``; the same arguments always give the same list, and
    ``generate(m, seed)`` is a prefix of ``generate(n, seed)`` for ``m <= n``."""
    if n < 0:
        raise ValueError(f"n must be >= 0, got {n}")
    stream = iter_problems(seed)
    return [next(stream) for _ in range(n)]


@lru_cache(maxsize=1)
def _test_pool() -> tuple[Problem, ...]:
    return tuple(generate(TEST_POOL, TEST_SEED))


@lru_cache(maxsize=1)
def _test_keys() -> frozenset[str]:
    return frozenset(normalise_question(p.question) for p in _test_pool())


def test_split(n: int = 200) -> list[Problem]:
    """The fixed held-out problems: the first ``n`` of seed ``TEST_SEED`` (``n <= TEST_POOL``)."""
    if not 0 <= n <= TEST_POOL:
        raise ValueError(f"test split size must be in [0, {TEST_POOL}], got {n}")
    return list(_test_pool()[:n])


test_split.__test__ = False  # type: ignore[attr-defined]  # not a pytest test despite the name


def train_split(n: int, seed: int = 0) -> list[Problem]:
    """``n`` distinct training problems for ``seed``, none of whose normalised question is in the test
    pool (the first ``TEST_POOL`` test problems). Pass a different ``seed`` for a fresh sample."""
    if n < 0:
        raise ValueError(f"n must be >= 0, got {n}")
    held_out = _test_keys()
    out: list[Problem] = []
    for problem in iter_problems(seed):
        if len(out) == n:
            break
        if normalise_question(problem.question) not in held_out:
            out.append(problem)
    return out


def format_prompt(question: str) -> str:
    """The zero-shot prompt the model is evaluated with: ``"Question: {q}\\nAnswer:"``."""
    return f"Question: {question}\nAnswer:"


def format_example(problem: Problem) -> str:
    """A training text: the prompt, a space, then the worked answer ending in ``#### N``.

    It has no end-of-text token; the trainer appends the tokenizer's eos after it.
    """
    return f"{format_prompt(problem.question)} {problem.answer}"


_AFTER_HASHES = re.compile(r"####\s*\$?\s*(-?\d[\d,]*)")
_NUMBER = re.compile(r"(?<![\w.])-?\d+(?:,\d{3})*(?:\.\d+)?")


def extract_answer(text: str) -> int | None:
    """The integer after the first ``####`` that has one, else the last integer in ``text``, else ``None``.

    Thousands commas are dropped (``"#### 1,200"`` gives 1200). Generated text that runs on past its
    answer (``"#### 7\\n\\nQuestion: ... #### 3"``) gives the first answer, 7. In the fallback a
    number with a decimal part is not an integer and is skipped.
    """
    m = _AFTER_HASHES.search(text)
    if m:
        return int(m.group(1).replace(",", ""))
    integers = [x for x in _NUMBER.findall(text) if "." not in x]
    return int(integers[-1].replace(",", "")) if integers else None
