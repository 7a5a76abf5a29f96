"""A second word-problem generator for the demo model, composed from small interchangeable phrases.

:mod:`breakgraph.demo.wordings` writes each problem from one opening and a few events; this
module varies every part of a sentence independently, so that the model sees the *same* story in
many surface forms and learns that the operation comes from what happens (gaining, losing,
buying, sharing, grouping, comparing, paying), not from a fixed sentence shape:

- the people: a large pool of names, introduced plainly, with a role ("Mo, a baker,") or as
  someone's relative; later mentions by name or pronoun;
- what changes hands: things, money (``$7``, ``£7``, ``€7``, ``7 dollars``...), or measured
  amounts (litres, km, kg, metres) written as digits or, up to twenty, as words;
- the events: many verbs of gaining and losing in active and passive voice, with a giver or a
  receiver, joined to the previous sentence or not, sometimes folded into a relative clause
  ("Mo, who has 12 apples, buys 5 more.");
- stories: a start and one to three changes, equal groups, prices and rates, equal sharing and
  grouping, more/fewer/times comparisons, totals of several people, a transfer between two
  people, change from a payment, earning then spending, and bare arithmetic drills
  (including 2-digit x 2-digit and 3-digit / 2-digit);
- the question: many question words ("How many", "How much", "What is", "Find", "Work out",
  "Determine", "Calculate"...), placed last, first, or folded into an "If ..., ...?" sentence,
  with distractor sentences whose numbers the answer does not use.

The answer keeps the demo format, one exact calculation per line then the final number::

    12+5 = <<12+5=17>>17
    #### 17

Ranges: every result is an integer in 1-1000; start amounts 5-100; a product of word problems
has one factor 2-12 and the other 2-80 (or doubles or triples an amount); a division has a
divisor 2-12 and a quotient 2-25.
The drills go further (products of two 2-digit numbers up to 1000, 3-digit dividends over 2-digit
divisors with quotients up to 50, sums and differences of 3-digit numbers).

The held-out phrasings (:mod:`breakgraph.demo.heldout`) share no five-word run with the text
written here (``tests/test_demo_heldout.py``).
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass, field

from breakgraph.demo.problems import Problem, distinct_problems, exact_step

MAX_RESULT = 1000

NUMBER_WORDS = (
    "zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten", "eleven",
    "twelve", "thirteen", "fourteen", "fifteen", "sixteen", "seventeen", "eighteen", "nineteen", "twenty",
)  # fmt: skip

_F = (
    "Abby Ada Aisha Alba Alice Amara Amelie Ana Anya Asha Aya Bea Bella Carla Chloe Clara Dana Daria Dina "
    "Eda Edith Eva Fatima Fay Freya Gemma Gina Hanna Hazel Helen Ida Iris Isla Jade Jana Jess Joy Keiko "
    "Kim Lara Layla Lily Lina Lola Lucia Luna Mae Maria Marta Meg Mila Mina Nadia Naomi Nell Nia Nora "
    "Olga Paula Pia Quinn Rana Rhea Ria Rita Ruby Ruth Sana Selma Sofia Suki Tess Uma Vera Wanda Yara Zoe"
).split()
_M = (
    "Aaron Adam Ahmed Ali Amir Andre Arlo Arthur Bao Basil Ben Boris Cal Caleb Cody Cyrus Dev Diego Eli "
    "Enzo Eric Ethan Finn Frank Gus Hal Hari Henry Ian Igor Ivan Jai Jake Jay Joel Jose Juan Kai Karl Ken "
    "Kyle Lars Len Levi Luca Malik Marco Milo Mo Nate Ned Nico Otto Owen Paul Pete Ravi Reza Rick Rory "
    "Ryan Sami Saul Seth Tariq Tim Toby Uri Vic Wes Will Yusuf Zack Zane"
).split()
PEOPLE = tuple((n, "f") for n in _F) + tuple((n, "m") for n in _M)
_NAMES = {n for n, _ in PEOPLE}

ROLES = ("a baker", "a farmer", "a teacher", "a student", "a shopkeeper", "a collector", "a nurse",
         "a gardener", "a chef", "a painter", "a pilot", "a coach")  # fmt: skip
RELATIVES = ("sister", "brother", "cousin", "aunt", "uncle", "mum", "dad", "friend", "neighbour", "grandma")

# (singular, plural, edible)
ITEMS = (
    ("apple", "apples", True), ("plum", "plums", True), ("peach", "peaches", True), ("biscuit", "biscuits", True),
    ("donut", "donuts", True), ("cherry", "cherries", True), ("tomato", "tomatoes", True), ("potato", "potatoes", True),
    ("strawberry", "strawberries", True), ("cracker", "crackers", True), ("chocolate", "chocolates", True),
    ("sweet", "sweets", True), ("nut", "nuts", True), ("cake", "cakes", True), ("bun", "buns", True),
    ("orange", "oranges", True), ("egg", "eggs", True), ("cookie", "cookies", True), ("olive", "olives", True),
    ("pen", "pens", False), ("pencil", "pencils", False), ("marble", "marbles", False), ("sticker", "stickers", False),
    ("toy", "toys", False), ("book", "books", False), ("comic", "comics", False), ("magnet", "magnets", False),
    ("badge", "badges", False), ("key", "keys", False), ("ribbon", "ribbons", False), ("brush", "brushes", False),
    ("puzzle", "puzzles", False), ("doll", "dolls", False), ("robot", "robots", False), ("kite", "kites", False),
    ("seed", "seeds", False), ("leaf", "leaves", False), ("feather", "feathers", False), ("nail", "nails", False),
    ("screw", "screws", False), ("cup", "cups", False), ("plate", "plates", False), ("chair", "chairs", False),
    ("sock", "socks", False), ("glove", "gloves", False), ("hat", "hats", False), ("card", "cards", False),
    ("stamp", "stamps", False), ("shell", "shells", False), ("coin", "coins", False), ("block", "blocks", False),
    ("rose", "roses", False), ("tulip", "tulips", False), ("tile", "tiles", False), ("postcard", "postcards", False),
    ("towel", "towels", False), ("candle", "candles", False), ("jar", "jars", False), ("tin", "tins", False),
    ("notebook", "notebooks", False), ("eraser", "erasers", False), ("battery", "batteries", False),
    ("fish", "fish", False), ("sheep", "sheep", False), ("chicken", "chickens", False), ("duck", "ducks", False),
)  # fmt: skip
# (singular, plural) containers for equal groups
GROUPS = (
    ("box", "boxes"), ("bag", "bags"), ("packet", "packets"), ("tin", "tins"), ("case", "cases"),
    ("tray", "trays"), ("basket", "baskets"), ("row", "rows"), ("stack", "stacks"), ("bundle", "bundles"),
    ("sack", "sacks"), ("carton", "cartons"), ("drawer", "drawers"), ("shelf", "shelves"), ("bucket", "buckets"),
    ("set", "sets"), ("pack", "packs"), ("crate", "crates"), ("pot", "pots"), ("bowl", "bowls"),
)  # fmt: skip
# (prefix, suffix, word for "How many ... ?")
CURRENCIES = (
    ("$", "", "dollars"), ("$", "", "dollars"), ("£", "", "pounds"), ("€", "", "euros"), ("", " dollars", "dollars"),
    ("", " euros", "euros"), ("", " pounds", "pounds"), ("", " francs", "francs"), ("", " rupees", "rupees"),
    ("", " cents", "cents"), ("", " dinars", "dinars"), ("", " coins", "coins"),
)  # fmt: skip
# (unit, stuff, verb to use it up: present, past)
MEASURES = (
    ("litres", "water", "uses", "used"), ("liters", "juice", "drinks", "drank"), ("litres", "milk", "pours out", "poured out"),
    ("kg", "flour", "uses", "used"), ("kg", "rice", "cooks", "cooked"), ("kilograms", "sand", "moves", "moved"),
    ("metres", "rope", "cuts off", "cut off"), ("meters", "fabric", "cuts off", "cut off"), ("cm", "ribbon", "cuts off", "cut off"),
    ("ml", "paint", "uses", "used"), ("grams", "sugar", "uses", "used"), ("km", "road", "drives", "drove"),
)  # fmt: skip
ITEMS_FOR_SALE = ("lamp", "scarf", "backpack", "wallet", "watch", "radio", "jacket", "pillow", "teapot",
                  "umbrella", "helmet", "mirror", "blanket", "vase", "camera", "ticket")  # fmt: skip
PLACES = ("at the park", "on the beach", "in the garden", "at school", "at the market", "in the attic",
          "under the bed", "in the shop", "at the fair", "in the woods")  # fmt: skip
TIMES = ("Then", "After that", "Later", "Next", "Afterwards", "The next day", "That afternoon", "On Monday",
         "On Friday", "Later that day", "An hour later", "After lunch", "That evening", "The day after",
         "Soon after", "That morning", "At the weekend", "After school")  # fmt: skip


@dataclass
class _P:
    name: str
    sex: str

    def he(self) -> str:
        return "she" if self.sex == "f" else "he"

    def him(self) -> str:
        return "her" if self.sex == "f" else "him"

    def his(self) -> str:
        return "her" if self.sex == "f" else "his"


@dataclass
class _S:
    """A story being written: sentences (``(subject or None, text)``), calculation steps and
    the question."""

    facts: list[tuple[_P | None, str]] = field(default_factory=list)
    steps: list[tuple[str, int]] = field(default_factory=list)
    question: str = ""
    value: int = 0
    if_form: bool = True  # whether the story reads well as one "If ..., ...?" sentence
    hypothetical: bool = False  # the first sentence becomes "Suppose ..." and the question asks what would be

    def calc(self, a: int, op: str, b: int) -> int:
        v = exact_step(a, op, b)
        if not 1 <= v <= MAX_RESULT:
            raise ValueError(f"{a}{op}{b}={v} is out of range")
        self.steps.append((f"{a}{op}{b}", v))
        self.value = v
        return v


class _W:
    """The per-problem choices: people, what is counted, tense and number style."""

    def __init__(self, rng: random.Random):
        self.rng = rng
        self.a, self.b, self.c = (_P(n, s) for n, s in rng.sample(PEOPLE, 3))
        self.item = rng.choice(ITEMS)
        self.group = rng.choice(GROUPS)
        self.cur = rng.choice(CURRENCIES)
        self.past = rng.random() < 0.35
        self.words = rng.choice((0.0, 0.25, 0.6))
        self.named: set[str] = set()

    def pick(self, *options):
        """One of ``options``; the people a chosen sentence names count as introduced (the options
        are all written before one is chosen, so a mention is only settled here)."""
        choice = self.rng.choice(options)
        text = choice[1] if isinstance(choice, tuple) else choice
        if isinstance(text, str):
            self.mark(text)
        return choice

    def mark(self, text: str) -> None:
        for p in (self.a, self.b, self.c):
            if p.name in text:
                self.named.add(p.name)

    def r(self, lo: int, hi: int) -> int:
        return self.rng.randint(lo, hi)

    def n(self, k: int) -> str:
        return NUMBER_WORDS[k] if k <= 20 and self.rng.random() < self.words else str(k)

    def money(self, k: int) -> str:
        pre, post, _ = self.cur
        return f"{pre}{k}" if pre else f"{self.n(k)}{post}"

    def v(self, forms: str) -> str:
        """``"buys/bought"`` → the tense's form."""
        present, past = forms.split("/")
        return past if self.past else present

    def who(self, p: _P) -> str:
        """The first mention names ``p`` (sometimes with a role); later ones name or use the pronoun."""
        if p.name not in self.named:
            return self.rng.choice((p.name, p.name, p.name, f"{p.name}, {self.rng.choice(ROLES)},"))
        return p.name if self.rng.random() < 0.5 else p.he()

    def whom(self, p: _P) -> str:
        if p.name not in self.named:
            return p.name
        return p.name if self.rng.random() < 0.5 else p.him()

    def does(self) -> str:
        return "did" if self.past else "does"

    def has(self) -> str:
        return "had" if self.past else "has"


def _cap(s: str) -> str:
    return s[:1].upper() + s[1:]


def _lower(s: str) -> str:
    """``s`` with its first letter in lower case, unless it starts with a name."""
    return s if s.split(" ", 1)[0].rstrip(",").split("'")[0] in _NAMES else s[:1].lower() + s[1:]


def _count(w: _W, k: int, noun: bool = True) -> str:
    return f"{w.n(k)} {w.item[1] if k != 1 else w.item[0]}" if noun else w.n(k)


# --------------------------------------------------------------------------------------------
# Events on one holder's count


def _gain_text(w: _W, h: _P, k: int) -> tuple[_P | None, str]:
    """A sentence in which ``h`` gains ``k`` items."""
    pl = w.item[1]
    o, n = w.b if h is not w.b else w.a, w.n(k)
    x = w.pick("", f" {pl}")
    rel = w.pick(*RELATIVES)
    if w.rng.random() < 0.3:
        who_o = w.who(o)
        return (None, w.pick(
            f"{who_o} {w.v('gives/gave')} {h.him()} {n} more{x}", f"{who_o} {w.v('hands/handed')} {h.him()} {n}{x}",
            f"{who_o} {w.v('sends/sent')} {h.him()} another {n}{x}", f"{who_o} {w.v('passes/passed')} {n}{x} to {h.name}",
            f"{h.his().capitalize()} {rel} {w.v('buys/bought')} {h.him()} {n} more{x}",
            f"{n} more {pl} {w.v('are/were')} given to {h.name}", f"{n} {pl} {w.v('are/were')} added to {h.his()} pile",
            f"{who_o} {w.v('donates/donated')} {n}{x} to {h.name}", f"{who_o} {w.v('brings/brought')} {h.him()} {n} extra{x}",
        ))  # fmt: skip
    return (h, w.pick(
        f"{w.v('buys/bought')} {n} more{x}", f"{w.v('gets/got')} {n} more{x}", f"{w.v('gets/got')} another {n}{x}",
        f"{w.v('receives/received')} {n}{x} from {w.whom(o)}", f"{w.v('is/was')} given {n} more{x}",
        f"{w.v('is/was')} given {n}{x} by {w.whom(o)}", f"{w.v('gets/got')} {n}{x} as a gift",
        f"{w.v('receives/received')} {n} {pl} for {h.his()} birthday", f"{w.v('wins/won')} {n}{x} in a game",
        f"{w.v('wins/won')} {n} more{x} {w.pick(*PLACES)}", f"{w.v('finds/found')} {n} more{x} {w.pick(*PLACES)}",
        f"{w.v('finds/found')} {n}{x}", f"{w.v('picks/picked')} up {n} more{x}", f"{w.v('collects/collected')} {n} more{x}",
        f"{w.v('adds/added')} {n}{x} to {h.his()} collection", f"{w.v('purchases/purchased')} {n} additional {pl}",
        f"{w.v('gains/gained')} {n}{x}", f"{w.v('is/was')} sent {n} new{x}", f"{w.v('makes/made')} {n} more{x}",
        f"{w.v('gets/got')} hold of {n} more{x}", f"{w.v('brings/brought')} home {n} more{x}",
        f"{w.v('gets/got')} a further {n}{x}", f"{w.v('orders/ordered')} {n} extra {pl}",
        f"{w.v('is/was')} handed {n} extra{x}", f"{w.v('borrows/borrowed')} {n}{x} from {w.whom(o)}",
        f"{w.v('trades/traded')} for {n} more{x}", f"{w.v('earns/earned')} {n} more{x}",
        f"{w.v('gets/got')} {n} extra{x} from {h.his()} {rel}", f"{w.v('is/was')} gifted {n}{x}",
    ))  # fmt: skip


def _loss_text(w: _W, h: _P, k: int) -> tuple[_P | None, str]:
    """A sentence in which ``h`` loses ``k`` items."""
    pl = w.item[1]
    o, n = w.b if h is not w.b else w.a, w.n(k)
    x = w.pick("", f" {pl}", " of them", f" of {h.his()} {pl}")
    eat = (f"{w.v('eats/ate')} {n}{x}", f"{w.v('has/had')} {n}{x} for lunch") if w.item[2] else ()
    if w.rng.random() < 0.25:
        who_o = w.who(o)
        return (None, w.pick(
            f"{who_o} {w.v('takes/took')} {n}{x}", f"{who_o} {w.v('borrows/borrowed')} {n}{x}",
            f"{n} of {h.his()} {pl} {w.v('break/broke')}", f"{n} {pl} {w.v('go/went')} missing",
            f"{n}{x} {w.v('are/were')} stolen", f"{n} of the {pl} {w.v('get/got')} lost",
            f"{n}{x} {w.v('are/were')} eaten by {h.his()} dog" if w.item[2] else f"{n}{x} {w.v('are/were')} damaged",
            f"{who_o} {w.v('asks/asked')} for {n}{x} and {w.v('gets/got')} them",
        ))  # fmt: skip
    return (h, w.pick(
        f"{w.v('gives/gave')} {n}{x} to {w.whom(o)}", f"{w.v('gives/gave')} away {n}{x}", f"{w.v('gives/gave')} {w.whom(o)} {n}{x}",
        f"{w.v('loses/lost')} {n}{x}", f"{w.v('drops/dropped')} {n}{x}", f"{w.v('sells/sold')} {n}{x}",
        f"{w.v('sells/sold')} {n}{x} to {w.whom(o)}", f"{w.v('uses/used')} {n}{x}", f"{w.v('uses/used')} up {n}{x}",
        f"{w.v('lends/lent')} {n}{x} to {w.whom(o)}", f"{w.v('donates/donated')} {n}{x} to the school",
        f"{w.v('throws/threw')} out {n}{x}", f"{w.v('hands/handed')} {n}{x} over to {w.whom(o)}",
        f"{w.v('passes/passed')} {n}{x} on to {w.whom(o)}", f"{w.v('clears/cleared')} out {n}{x}",
        f"{w.v('mails/mailed')} {n}{x} to {h.his()} {w.pick(*RELATIVES)}", f"{w.v('misplaces/misplaced')} {n}{x}",
        f"{w.v('trades/traded')} away {n}{x}", f"{w.v('returns/returned')} {n}{x} to the shop",
        f"{w.v('hands/handed')} out {n}{x}", f"{w.v('loses/lost')} {n}{x} {w.pick(*PLACES)}",
        f"{w.v('puts/put')} {n}{x} in the bin", f"{w.v('leaves/left')} {n}{x} behind", *eat,
    ))  # fmt: skip


def _money_gain(w: _W, h: _P, k: int) -> tuple[_P | None, str]:
    m, o = w.money(k), w.b if h is not w.b else w.a
    if w.rng.random() < 0.25:
        return (None, w.pick(f"{w.who(o)} {w.v('gives/gave')} {h.him()} {m}", f"{h.his().capitalize()} {w.pick(*RELATIVES)} "
                             f"{w.v('sends/sent')} {h.him()} {m}", f"{w.who(o)} {w.v('pays/paid')} {h.him()} {m}"))  # fmt: skip
    return (h, w.pick(
        f"{w.v('earns/earned')} {m}", f"{w.v('earns/earned')} another {m}", f"{w.v('is/was')} paid {m}",
        f"{w.v('gets/got')} {m} for {h.his()} birthday", f"{w.v('receives/received')} {m} from {w.whom(o)}",
        f"{w.v('finds/found')} {m} {w.pick(*PLACES)}", f"{w.v('wins/won')} {m} in a contest",
        f"{w.v('sells/sold')} {h.his()} old {w.pick(*ITEMS_FOR_SALE)} for {m}", f"{w.v('saves/saved')} another {m}",
        f"{w.v('is/was')} given {m} pocket money", f"{w.v('makes/made')} {m} washing cars",
    ))  # fmt: skip


def _money_loss(w: _W, h: _P, k: int) -> tuple[_P | None, str]:
    m, o, thing = w.money(k), w.b if h is not w.b else w.a, w.pick(*ITEMS_FOR_SALE)
    return (h, w.pick(
        f"{w.v('spends/spent')} {m} on a {thing}", f"{w.v('buys/bought')} a {thing} for {m}", f"{w.v('pays/paid')} {m} for a {thing}",
        f"{w.v('spends/spent')} {m}", f"{w.v('gives/gave')} {m} to {w.whom(o)}", f"{w.v('loses/lost')} {m}",
        f"{w.v('donates/donated')} {m} to charity", f"{w.v('pays/paid')} {m} for a meal", f"{w.v('lends/lent')} {w.whom(o)} {m}",
        f"{w.v('uses/used')} {m} to buy a {thing}", f"{w.v('pays/paid')} a bill of {m}", f"{w.v('puts/put')} {m} towards a {thing}",
    ))  # fmt: skip


def _measure_gain(w: _W, h: _P, k: int, unit: str, stuff: str) -> tuple[_P | None, str]:
    n = w.n(k)
    return (h, w.pick(f"{w.v('adds/added')} {n} {unit}", f"{w.v('adds/added')} another {n} {unit} of {stuff}",
                      f"{w.v('buys/bought')} {n} more {unit}", f"{w.v('gets/got')} {n} more {unit} of {stuff}"))  # fmt: skip


def _measure_loss(w: _W, h: _P, k: int, unit: str, stuff: str, verb: str) -> tuple[_P | None, str]:
    n = w.n(k)
    if w.rng.random() < 0.3:
        return (None, f"{n} {unit} {w.v('are/were')} used")
    return (
        h,
        w.pick(
            f"{w.v(verb)} {n} {unit}",
            f"{w.v(verb)} {n} {unit} of the {stuff}",
            f"{w.v('uses/used')} {n} {unit}",
        ),
    )


# --------------------------------------------------------------------------------------------
# Questions


_NOW = ("now", "now", "in the end", "at the end", "after that", "after all this", "")


def _count_question(w: _W, h: _P, losing: bool) -> str:
    pl, hn = w.item[1], w.pick(h.name, h.he())
    now = w.pick(*_NOW)
    sp = f" {now}" if now else ""
    if w.past:
        forms = [f"How many {pl} did {hn} have{sp}?", f"How many {pl} did {hn} end up with?",
                 f"What was the number of {pl} {hn} had{sp}?", f"How many {pl} did {hn} have in the end?"]  # fmt: skip
        if losing:
            forms += [
                f"How many {pl} did {hn} have left?",
                f"How many {pl} were left?",
                f"How many {pl} remained?",
            ]
        else:
            forms += [f"How many {pl} did {hn} have altogether?", f"How many {pl} did {hn} have in total?"]
        return w.pick(*forms)
    forms = [
        f"How many {pl} does {hn} have{sp}?", f"How many {pl} has {hn} got{sp}?", f"How many {pl} does {hn} own{sp}?",
        f"What is the number of {pl} {hn} has{sp}?", f"Find the number of {pl} {hn} has{sp}.",
        f"Work out how many {pl} {hn} has{sp}.", f"Determine how many {pl} {hn} has{sp}.",
        f"Calculate how many {pl} {hn} ends up with.", f"How many {pl} does {hn} end up with?",
        f"How many does {hn} have{sp}?", f"After all this, how many {pl} does {hn} have?",
        f"What is {h.name}'s number of {pl}{sp}?", f"How many {pl} are with {h.name}{sp}?",
        f"Can you work out how many {pl} {hn} has{sp}?", f"Tell me how many {pl} {hn} has{sp}.",
    ]  # fmt: skip
    if losing:
        forms += [f"How many {pl} does {hn} have left?", f"How many {pl} are left?", f"How many {pl} remain?",
                  f"How many {pl} does {hn} still have?", f"How many {pl} stay with {h.name}?",
                  f"How many {pl} is {hn} left with?", f"What number of {pl} remains?", "Find how many are left.",
                  f"How many {pl} are left over?", "How many are still there?"]  # fmt: skip
    else:
        forms += [f"How many {pl} does {hn} have altogether?", f"How many {pl} does {hn} have in total?",
                  f"What is the total number of {pl} {hn} has?", f"How many {pl} does {hn} have in all?",
                  f"How many {pl} are there altogether?"]  # fmt: skip
    return w.pick(*forms)


def _money_question(w: _W, h: _P, losing: bool) -> str:
    hn, word = w.pick(h.name, h.he()), w.cur[2]
    if w.past:
        return w.pick(f"How much money did {hn} have {'left' if losing else 'then'}?", f"How many {word} did {hn} have in the end?",
                      f"How much did {hn} have at the end?")  # fmt: skip
    forms = [f"How much money does {hn} have now?", f"How many {word} does {hn} have now?", f"How much does {hn} have now?",
             f"What is {h.name}'s money now?", f"Find how much money {hn} has now.", f"Work out how much {hn} has in the end.",
             f"Determine the amount {hn} has now.", f"How much money is in {h.his()} wallet now?"]  # fmt: skip
    if losing:
        forms += [f"How much money does {hn} have left?", "How much money is left?", "How much is left over?",
                  "What amount remains?", f"How many {word} are left?", f"How much does {hn} still have?"]  # fmt: skip
    return w.pick(*forms)


# --------------------------------------------------------------------------------------------
# Stories: each fills ``s`` (facts, steps, question)


def _start_fact(w: _W, h: _P, k: int) -> tuple[_P | None, str]:
    g = w.group[0]
    c = _count(w, k)
    if w.rng.random() < 0.2:
        return (None, w.pick(f"There {w.v('are/were')} {c} in {h.name}'s {g}", f"{h.name}'s {g} {w.v('holds/held')} {c}",
                             f"{c} {w.v('belong/belonged')} to {h.name}", f"In {h.name}'s {g} there {w.v('are/were')} {c}"))  # fmt: skip
    return (h, w.pick(
        f"{w.has()} {c}", f"{w.has()} {c}", f"{w.v('owns/owned')} {c}", f"{w.v('starts/started')} with {c}",
        f"{w.v('keeps/kept')} {c} in a {g}", f"{w.v('has/had')} a collection of {c}", f"{w.v('is/was')} holding {c}",
        f"{w.v('has/had')} got {c}", f"{w.v('begins/began')} the day with {c}", f"{w.v('has/had')} {c} at first",
        f"{w.v('picks/picked')} {c}", f"{w.v('buys/bought')} {c}", f"{w.v('makes/made')} a batch of {c}" if w.item[2] else f"{w.v('collects/collected')} {c}",
    ))  # fmt: skip


def _story_changes(w: _W, s: _S) -> None:
    """A start amount and one to three gains, losses, doublings; sometimes an equal share at the end."""
    h = w.a
    kind = w.rng.random()
    if kind < 0.15:  # money
        k = w.r(10, 100)
        s.facts.append((h, w.pick(f"{w.has()} {w.money(k)}", f"{w.v('saves/saved')} {w.money(k)}",
                                  f"{w.has()} {w.money(k)} in {h.his()} wallet", f"{w.v('starts/started')} with {w.money(k)}")))  # fmt: skip
        gain, loss, ask = _money_gain, _money_loss, _money_question
    elif kind < 0.25:  # a measured amount
        unit, stuff, p, q = w.rng.choice(MEASURES)
        s.if_form = False
        k = w.r(10, 100)
        s.facts.append(
            (
                h,
                w.pick(
                    f"{w.has()} {w.n(k)} {unit} of {stuff}",
                    f"{w.v('buys/bought')} {w.n(k)} {unit} of {stuff}",
                ),
            )
        )
        gain = lambda w_, h_, k_: _measure_gain(w_, h_, k_, unit, stuff)  # noqa: E731
        loss = lambda w_, h_, k_: _measure_loss(w_, h_, k_, unit, stuff, f"{p}/{q}")  # noqa: E731
        ask = lambda w_, h_, losing: w_.pick(  # noqa: E731
            f"How many {unit} of {stuff} {'are' if not w_.past else 'were'} left?", f"How much {stuff} does {h_.name} have now?",
            f"How many {unit} does {h_.name} have now?", f"What amount of {stuff} remains?") if losing else w_.pick(
            f"How many {unit} of {stuff} does {h_.name} have now?", f"How much {stuff} is there in total?")  # fmt: skip
    else:
        k = w.r(5, 100)
        s.facts.append(_start_fact(w, h, k))
        gain, loss, ask = _gain_text, _loss_text, _count_question
    s.value = k
    n_events = w.pick(1, 2, 2, 3, 3, 3)
    last_losing = False
    for _ in range(n_events):
        roll = w.rng.random()
        if roll < 0.47 and s.value <= MAX_RESULT - 2:
            d = w.r(1, min(100, MAX_RESULT - s.value))
            fact = gain(w, h, d)
            prev = s.value
            s.calc(prev, "+", d)
            last_losing = False
        elif roll < 0.94 and s.value > 2:
            d = w.r(1, s.value - 1)
            fact = loss(w, h, d)
            s.calc(s.value, "-", d)
            last_losing = True
        elif gain is _gain_text and 2 * s.value <= MAX_RESULT:
            k2 = 2 if s.value * 3 > MAX_RESULT or w.rng.random() < 0.6 else 3
            word = "twice" if k2 == 2 else "three times"
            fact = (h, w.pick(f"{w.v('doubles/doubled' if k2 == 2 else 'triples/tripled')} {h.his()} {w.item[1]}",
                              f"{w.v('ends/ended')} up with {word} as many {w.item[1]}"))  # fmt: skip
            s.calc(s.value, "*", k2)
            last_losing = False
        else:
            continue
        s.facts.append(fact)
    if not s.steps:
        d = w.r(1, 50)
        s.facts.append(gain(w, h, d))
        s.calc(s.value, "+", d)
    divisors = [k for k in range(2, 13) if s.value % k == 0 and 2 <= s.value // k <= 25]
    if gain is _gain_text and len(s.steps) < 4 and divisors and w.rng.random() < 0.2:
        k = w.rng.choice(divisors)
        pl = w.item[1]
        s.facts.append((h, w.pick(f"{w.v('shares/shared')} them equally among {w.n(k)} friends",
                                  f"{w.v('splits/split')} them evenly between {w.n(k)} children",
                                  f"{w.v('divides/divided')} them into {w.n(k)} equal piles")))  # fmt: skip
        s.calc(s.value, "/", k)
        s.question = w.pick(f"How many {pl} does each one get?", f"How many {pl} {'is' if not w.past else 'was'} in each share?",
                            "How many is that for each?", f"How many {pl} per person?")  # fmt: skip
        return
    if ask is _count_question and not w.past and w.rng.random() < 0.15:  # "Suppose ..., how many would ...?"
        s.hypothetical = True
        pl = w.item[1]
        s.question = w.pick(f"How many {pl} would {h.he()} have then?", f"How many {pl} would {h.name} end up with?",
                            f"How many {pl} would be left?" if last_losing else f"How many {pl} would {h.he()} have in all?",
                            f"What would {h.name}'s total be?", f"How many would {h.he()} have?")  # fmt: skip
        return
    s.question = ask(w, h, last_losing)


def _story_groups(w: _W, s: _S) -> None:
    """Equal groups, a price per item, or a rate over time: one product, then maybe a change."""
    sg, pl, _ = w.item
    g, gs = w.group
    a, b = w.r(2, 12), w.r(2, 50)
    h = w.a
    form = w.rng.randrange(4)
    if form == 0:
        s.facts.append((h, w.pick(
            f"{w.has()} {w.n(a)} {gs} with {w.n(b)} {pl} in each", f"{w.has()} {w.n(a)} {gs} of {w.n(b)} {pl}",
            f"{w.v('buys/bought')} {w.n(a)} {gs}, each containing {w.n(b)} {pl}", f"{w.v('fills/filled')} {w.n(a)} {gs} with {w.n(b)} {pl} apiece",
            f"{w.v('packs/packed')} {w.n(b)} {pl} into each of {w.n(a)} {gs}", f"{w.v('sets/set')} out {w.n(a)} {gs} of {w.n(b)} {pl}",
        )))  # fmt: skip
        if w.rng.random() < 0.3:
            s.facts[-1] = (None, w.pick(f"Each {g} {w.v('holds/held')} {w.n(b)} {pl}", f"There {w.v('are/were')} {w.n(b)} {pl} per {g}",
                                        f"A {g} {w.v('contains/contained')} {w.n(b)} {pl}"))  # fmt: skip
            s.facts.append(
                (
                    h,
                    w.pick(
                        f"{w.has()} {w.n(a)} {gs}",
                        f"{w.v('buys/bought')} {w.n(a)} {gs}",
                        f"{w.v('gets/got')} {w.n(a)} {gs}",
                    ),
                )
            )
        s.calc(a, "*", b)
        unit = "count"
    elif form == 1:
        price = w.money(b)
        s.facts.append((h, w.pick(
            f"{w.v('buys/bought')} {w.n(a)} {pl} at {price} each", f"{w.v('buys/bought')} {w.n(a)} {pl} for {price} apiece",
            f"{w.v('pays/paid')} {price} for each of {w.n(a)} {pl}", f"{w.v('orders/ordered')} {w.n(a)} {pl} costing {price} each",
            f"{w.v('gets/got')} {w.n(a)} {pl}, each one costing {price}",
        )))  # fmt: skip
        if w.rng.random() < 0.35:
            s.facts[-1] = (None, w.pick(f"One {sg} {w.v('costs/cost')} {price}", f"{_cap(pl)} {w.v('sell/sold')} for {price} each",
                                        f"The price of a {sg} {w.v('is/was')} {price}", f"Each {sg} {w.v('costs/cost')} {price}"))  # fmt: skip
            s.facts.append((h, w.pick(f"{w.v('buys/bought')} {w.n(a)}", f"{w.v('buys/bought')} {w.n(a)} of them",
                                      f"{w.v('wants/wanted')} {w.n(a)} {pl}", f"{w.v('picks/picked')} out {w.n(a)} {pl}")))  # fmt: skip
        s.calc(a, "*", b)
        unit = "cost"
    elif form == 2:
        per = w.pick("day", "week", "hour")
        k = w.n(a)
        s.facts.append((h, w.pick(
            f"{w.v('earns/earned')} {w.money(b)} per {per} for {k} {per}s", f"{w.v('makes/made')} {w.money(b)} every {per}",
            f"{w.v('is/was')} paid {w.money(b)} a {per}", f"{w.v('saves/saved')} {w.money(b)} each {per}",
        )))  # fmt: skip
        if not s.facts[-1][1].endswith(f"{per}s"):
            s.facts.append(
                (h, w.pick(f"{w.v('works/worked')} for {k} {per}s", f"{w.v('does/did')} this for {k} {per}s"))
            )
        s.calc(b, "*", a)
        unit = "money"
    else:
        verb, noun = w.rng.choice((("reads/read", "pages"), ("runs/ran", "km"), ("walks/walked", "miles"),
                                   ("swims/swam", "laps"), ("writes/wrote", "lines"), ("plants/planted", "trees")))  # fmt: skip
        per = w.pick("day", "week", "hour")
        s.facts.append((h, w.pick(f"{w.v(verb)} {w.n(b)} {noun} a {per}", f"{w.v(verb)} {w.n(b)} {noun} every {per}",
                                  f"{w.v(verb)} {w.n(b)} {noun} each {per} for {w.n(a)} {per}s")))  # fmt: skip
        if not s.facts[-1][1].endswith(f"{per}s"):
            s.question = w.pick(f"How many {noun} {w.does()} {h.he()} cover in {w.n(a)} {per}s?",
                                f"How many {noun} in {w.n(a)} {per}s?", f"What is the total after {w.n(a)} {per}s?",
                                f"How many {noun} {w.v('is/was')} that over {w.n(a)} {per}s?")  # fmt: skip
        else:
            s.question = w.pick(f"How many {noun} is that altogether?", f"How many {noun} in total?",
                                f"Find the total number of {noun}.")  # fmt: skip
        s.calc(b, "*", a)
        return
    hn = w.pick(h.name, h.he())
    if unit == "cost" and w.rng.random() < 0.4:  # pay and get change
        total = s.value
        notes = [p for p in (10, 20, 50, 100, 200, 500) if p > total]
        if notes:
            paid = w.rng.choice(notes[:3])
            s.facts.append((h, w.pick(f"{w.v('uses/used')} a {w.money(paid)} bill to pay", f"{w.v('gives/gave')} the seller {w.money(paid)}",
                                      f"{w.v('gives/gave')} the cashier {w.money(paid)}")))  # fmt: skip
            s.calc(paid, "-", total)
            s.question = w.pick("How much change does " + hn + " get?", f"What change {'should' if not w.past else 'did'} {hn} get back?",
                                f"How much money {w.does()} {hn} get back?", "Work out the change.", "Find the change.")  # fmt: skip
            return
    if unit == "money" and w.rng.random() < 0.4 and s.value > 2:
        d = w.r(1, s.value - 1)
        s.facts.append(_money_loss(w, h, d))
        s.calc(s.value, "-", d)
        s.question = _money_question(w, h, True)
        return
    if unit == "count" and w.rng.random() < 0.5:  # then gains and losses
        losing = False
        for _ in range(w.pick(1, 2, 2, 3)):
            if w.rng.random() < 0.55 and s.value > 2:
                d = w.r(1, s.value - 1)
                s.facts.append(_loss_text(w, h, d))
                s.calc(s.value, "-", d)
                losing = True
            elif s.value <= MAX_RESULT - 2:
                d = w.r(1, min(60, MAX_RESULT - s.value))
                s.facts.append(_gain_text(w, h, d))
                s.calc(s.value, "+", d)
                losing = False
        s.question = _count_question(w, h, losing)
        return
    if unit == "count":
        s.question = w.pick(f"How many {pl} {w.does()} {hn} have in total?", f"How many {pl} are there altogether?",
                            f"How many {pl} {'are' if not w.past else 'were'} there in all?", f"Find the total number of {pl}.",
                            f"What is the total number of {pl}?", f"How many {pl} {w.does()} {hn} have?")  # fmt: skip
    elif unit == "cost":
        s.question = w.pick(f"How much {w.does()} {hn} spend?", f"How much {w.does()} {hn} pay in total?", "What is the total cost?",
                            f"How much money {w.does()} {hn} spend altogether?", "Work out the total price.",
                            f"Find how much {hn} {'pays' if not w.past else 'paid'}.", f"How much {w.does()} it cost {h.him()}?",
                            f"How many {w.cur[2]} {w.does()} {hn} pay?")  # fmt: skip
    else:
        s.question = w.pick(f"How much {w.does()} {hn} earn?", f"How much money {w.does()} {hn} make in total?",
                            f"What {w.does()} {hn} earn altogether?", f"How many {w.cur[2]} {w.does()} {hn} get?")  # fmt: skip


def _story_share(w: _W, s: _S) -> None:
    """Equal sharing, groups of a size, a unit price or a rate: one division, sometimes a change first."""
    sg, pl, _ = w.item
    g, gs = w.group
    k, q = w.r(2, 12), w.r(2, 25)
    total = k * q
    h = w.a
    people = w.pick(
        "friends", "children", "students", "kids", "people", "players", "classmates", "neighbours"
    )
    form = w.rng.randrange(5)
    if form in (0, 1) and w.rng.random() < 0.3:  # a gain or loss before the share
        if w.rng.random() < 0.5 and total > 6:
            d = w.r(1, min(60, total - 1))
            s.facts.append(_start_fact(w, h, total - d))
            s.facts.append(_gain_text(w, h, d))
            s.calc(total - d, "+", d)
        else:
            d = w.r(1, 60)
            if total + d > MAX_RESULT:
                d = 1
            s.facts.append(_start_fact(w, h, total + d))
            s.facts.append(_loss_text(w, h, d))
            s.calc(total + d, "-", d)
        shared = "the rest" if s.steps[-1][0].count("-") else "them all"
    else:
        shared = None
    n_t, n_k = w.n(total), w.n(k)
    if form == 0:
        if shared:
            s.facts.append((h, w.pick(f"{w.v('shares/shared')} {shared} equally among {n_k} {people}",
                                      f"{w.v('splits/split')} {shared} evenly between {n_k} {people}")))  # fmt: skip
        else:
            s.facts.append(w.pick(
                (h, f"{w.v('shares/shared')} {n_t} {pl} equally among {n_k} {people}"),
                (h, f"{w.v('splits/split')} {n_t} {pl} evenly between {n_k} {people}"),
                (h, f"{w.v('divides/divided')} {n_t} {pl} fairly between {n_k} {people}"),
                (None, f"{n_t} {pl} {w.v('are/were')} shared equally by {n_k} {people}"),
                (None, f"{_cap(n_k)} {people} {w.v('share/shared')} {n_t} {pl} equally"),
                (h, f"{w.v('gives/gave')} out {n_t} {pl} to {n_k} {people}, the same number to each"),
            ))  # fmt: skip
        s.question = w.pick(f"How many {pl} does each one get?", f"How many {pl} {w.does()} each of them receive?",
                            f"How many {pl} {'will' if not w.past else 'did'} each get?", "How many does each one end up with?",
                            f"How many {pl} per person?", f"Find how many {pl} each gets.", "How many does each receive?")  # fmt: skip
        s.calc(total, "/", k)
    elif form == 1:
        if shared:
            s.facts.append((h, f"{w.v('puts/put')} {shared} into {n_k} {gs} with the same number in each"))
        else:
            s.facts.append(w.pick(
                (h, f"{w.v('puts/put')} {n_t} {pl} into {n_k} {gs} with the same number in each"),
                (h, f"{w.v('packs/packed')} {n_t} {pl} equally into {n_k} {gs}"),
                (None, f"{n_t} {pl} {w.v('are/were')} placed in {n_k} equal {gs}"),
                (h, f"{w.v('arranges/arranged')} {n_t} {pl} in {n_k} equal {gs}"),
            ))  # fmt: skip
        s.question = w.pick(f"How many {pl} {'are' if not w.past else 'were'} in each {g}?", f"How many {pl} go into each {g}?",
                            f"How many {pl} does one {g} hold?", f"Find the number of {pl} per {g}.")  # fmt: skip
        s.calc(total, "/", k)
    elif form == 2:
        s.facts.append(w.pick(
            (h, f"{w.has()} {n_t} {pl} and {w.v('puts/put')} {n_k} in each {g}"),
            (h, f"{w.v('packs/packed')} {n_t} {pl} into {gs} of {n_k}"),
            (None, f"{n_t} {pl} {w.v('are/were')} put into {gs}, {n_k} to a {g}"),
            (h, f"{w.v('groups/grouped')} {n_t} {pl} in {gs} of {n_k}"),
        ))  # fmt: skip
        s.question = w.pick(f"How many {gs} {w.does()} {w.pick(h.name, h.he())} fill?", f"How many {gs} are needed?",
                            f"How many {gs} {'can' if not w.past else 'could'} be filled?", f"Find the number of {gs}.")  # fmt: skip
        s.calc(total, "/", k)
    elif form == 3:
        m = w.money(total)
        s.facts.append(w.pick(
            (h, f"{w.v('pays/paid')} {m} for {n_k} {pl}"), (None, f"{_cap(n_k)} {pl} {w.v('cost/cost')} {m}"),
            (h, f"{w.v('buys/bought')} {n_k} {pl} for {m} in total"), (None, f"A pack of {n_k} {pl} {w.v('costs/cost')} {m}"),
        ))  # fmt: skip
        s.question = w.pick(f"How much does one {sg} cost?", f"What is the price of one {sg}?", f"How much is each {sg}?",
                            f"What does a single {sg} cost?", f"Find the cost of one {sg}.")  # fmt: skip
        s.calc(total, "/", k)
    else:
        per = w.pick("day", "hour", "week")
        verb, noun = w.rng.choice(
            (
                ("earns/earned", None),
                ("reads/read", "pages"),
                ("walks/walked", "km"),
                ("decorates/decorated", "cakes"),
            )
        )
        amount = w.money(total) if noun is None else f"{n_t} {noun}"
        s.facts.append((h, f"{w.v(verb)} {amount} in {n_k} {per}s"))
        s.facts.append(
            (
                None,
                w.pick(
                    "The amount is the same each " + per, f"{_cap(h.he())} {w.v('keeps/kept')} the same pace"
                ),
            )
        )
        s.question = w.pick(
            f"How much is that per {per}?", f"How much for each {per}?", f"What is the amount per {per}?"
        )
        s.calc(total, "/", k)


def _story_compare(w: _W, s: _S) -> None:
    """More than, fewer than, times as many, how many more; sometimes the total of both."""
    pl = w.item[1]
    a, b = w.a, w.b
    x = w.r(6, 80)
    s.facts.append((a, f"{w.has()} {_count(w, x)}"))
    form = w.rng.randrange(5)
    if form == 0:
        d = w.r(1, 50)
        s.facts.append((b, w.pick(f"{w.has()} {w.n(d)} more {pl} than {a.name}", f"{w.has()} {w.n(d)} more than {a.name} {w.does()}",
                                  f"{w.v('owns/owned')} {w.n(d)} more {pl} than {a.name}")))  # fmt: skip
        s.calc(x, "+", d)
    elif form == 1:
        d = w.r(1, x - 2)
        s.facts.append((b, w.pick(f"{w.has()} {w.n(d)} fewer {pl} than {a.name}", f"{w.has()} {w.n(d)} less than {a.name}",
                                  f"{w.has()} {w.n(d)} {pl} fewer than {a.name} {w.does()}")))  # fmt: skip
        s.calc(x, "-", d)
    elif form == 2:
        k = w.pick(2, 2, 3, 4, 5)
        x = min(x, 200 // k)
        s.facts[-1] = (a, f"{w.has()} {_count(w, x)}")
        times = "twice" if k == 2 else f"{w.n(k)} times"
        s.facts.append((b, w.pick(f"{w.has()} {times} as many {pl} as {a.name}", f"{w.has()} {times} as many",
                                  f"{w.has()} {w.n(k)} times the number {a.name} {w.has()}")))  # fmt: skip
        s.calc(x, "*", k)
    elif form == 3:
        y = w.r(1, x - 1)
        s.facts.append((b, f"{w.has()} {_count(w, y)}"))
        s.calc(x, "-", y)
        s.question = w.pick(f"How many more {pl} {w.does()} {a.name} have than {b.name}?",
                            f"How many fewer {pl} {w.does()} {b.name} have than {a.name}?",
                            f"What is the difference between their numbers of {pl}?",
                            f"By how many {pl} {w.does()} {a.name} have more?", f"How many more does {a.name} have?")  # fmt: skip
        return
    else:  # totals of two or three people
        y = w.r(2, 90)
        s.facts.append((b, w.pick(f"{w.has()} {_count(w, y)}", f"{w.has()} {w.n(y)}")))
        s.calc(x, "+", y)
        if w.rng.random() < 0.4:
            z = w.r(2, 90)
            s.facts.append((w.c, w.pick(f"{w.has()} {_count(w, z)}", f"{w.has()} {w.n(z)}")))
            s.calc(s.value, "+", z)
        s.question = w.pick(f"How many {pl} do they have altogether?", f"How many {pl} do they have in total?",
                            f"How many {pl} do they have combined?", "What is their total?", f"Find the total number of {pl}.",
                            f"How many {pl} are there in all?", "How many do they have between them?")  # fmt: skip
        return
    if w.rng.random() < 0.4:
        s.calc(x, "+", s.value)
        s.question = w.pick(f"How many {pl} do they have together?", f"How many {pl} do {a.name} and {b.name} have altogether?",
                            f"How many {pl} do the two have combined?", f"What is the total number of {pl} they have?")  # fmt: skip
    else:
        s.question = w.pick(f"How many {pl} {w.does()} {b.name} have?", f"What is the number of {pl} {b.name} {w.has()}?",
                            f"Find how many {pl} {b.name} {w.has()}.", f"How many does {b.name} have?")  # fmt: skip


def _story_transfer(w: _W, s: _S) -> None:
    """Two people with their own counts; one gives the other some."""
    pl = w.item[1]
    a, b = w.a, w.b
    x, y = w.r(10, 90), w.r(5, 90)
    d = w.r(1, x - 1)
    s.facts.append((a, f"{w.has()} {_count(w, x)}"))
    s.facts.append((b, f"{w.has()} {_count(w, y)}"))
    s.facts.append((a, w.pick(f"{w.v('gives/gave')} {w.n(d)} of {a.his()} {pl} to {b.name}", f"{w.v('hands/handed')} {b.name} {w.n(d)} {pl}",
                              f"{w.v('passes/passed')} {w.n(d)} {pl} to {b.name}")))  # fmt: skip
    if w.rng.random() < 0.5:
        s.calc(y, "+", d)
        s.question = w.pick(f"How many {pl} does {b.name} have now?", f"How many {pl} does {b.name} end up with?",
                            f"What is {b.name}'s number of {pl} now?")  # fmt: skip
    else:
        s.calc(x, "-", d)
        s.question = w.pick(f"How many {pl} does {a.name} have now?", f"How many {pl} does {a.name} have left?",
                            f"How many {pl} stay with {a.name}?")  # fmt: skip


def _story_shopping(w: _W, s: _S) -> None:
    """A budget, one to three purchases (some at a price each), what is left; or change from a note."""
    h = w.a
    hn = w.pick(h.name, h.he())
    if w.rng.random() < 0.4:
        cost = w.r(2, 95)
        paid = w.rng.choice([p for p in (5, 10, 20, 50, 100) if p > cost])
        thing = w.pick(*ITEMS_FOR_SALE)
        s.facts.append(w.pick(
            (h, f"{w.v('buys/bought')} a {thing} for {w.money(cost)} and {w.v('pays/paid')} using a {w.money(paid)} bill"),
            (None, f"A {thing} {w.v('costs/cost')} {w.money(cost)}. {h.name} {w.v('pays/paid')} with {w.money(paid)}"),
            (h, f"{w.v('hands/handed')} the shopkeeper {w.money(paid)} for a {thing} labelled {w.money(cost)}"),
            (h, f"{w.v('pays/paid')} for a {w.money(cost)} {thing} with {w.money(paid)}"),
        ))  # fmt: skip
        s.calc(paid, "-", cost)
        s.question = w.pick(f"How much change does {hn} get?", "How much change is given?", f"What change {w.does()} {hn} receive?",
                            f"How much money {w.does()} {hn} get back?", "Find the change.", "Work out the change.")  # fmt: skip
        return
    budget = w.r(20, 100)
    s.facts.append((h, w.pick(f"{w.has()} {w.money(budget)}", f"{w.v('goes/went')} shopping with {w.money(budget)}",
                              f"{w.v('takes/took')} {w.money(budget)} to the market")))  # fmt: skip
    s.value = budget
    for _ in range(w.pick(1, 2, 2, 3)):
        if s.value < 4 or len(s.steps) >= 4:
            break
        if w.rng.random() < 0.35 and len(s.steps) <= 2:
            sg, pl, _ = w.item
            each = w.r(2, 12)
            count = w.r(2, 6)
            if count * each >= s.value:
                continue
            s.facts.append((h, w.pick(f"{w.v('buys/bought')} {w.n(count)} {pl} at {w.money(each)} each",
                                      f"{w.v('gets/got')} {w.n(count)} {pl} for {w.money(each)} apiece")))  # fmt: skip
            left = s.value
            s.calc(count, "*", each)
            s.calc(left, "-", count * each)
        else:
            cost = w.r(1, s.value - 1)
            s.facts.append(_money_loss(w, h, cost))
            s.calc(s.value, "-", cost)
    if not s.steps:
        cost = w.r(1, budget - 1)
        s.facts.append(_money_loss(w, h, cost))
        s.calc(budget, "-", cost)
    s.question = _money_question(w, h, True)


def _story_measure(w: _W, s: _S) -> None:
    """Lengths and distances, ages, heights: plus or minus."""
    a, b = w.a, w.b
    form = w.rng.randrange(4)
    if form == 0:
        x, d = w.r(5, 60), w.r(1, 30)
        older = w.rng.random() < 0.5
        if not older and d >= x:
            d = x - 1 if x > 1 else 1
        s.facts.append((a, f"{w.v('is/was')} {w.n(x)} years old"))
        s.facts.append((b, f"{w.v('is/was')} {w.n(d)} years {'older' if older else 'younger'} than {a.name}"))
        s.calc(x, "+" if older else "-", d)
        s.question = w.pick(
            f"How old {w.v('is/was')} {b.name}?", f"What is {b.name}'s age?", f"Find {b.name}'s age."
        )
    elif form == 1:
        total = w.r(20, 400)
        done = w.r(1, total - 1)
        s.facts.append(
            (
                None,
                w.pick(
                    f"The drive to the coast {w.v('is/was')} {w.n(total)} km",
                    f"A race {w.v('is/was')} {w.n(total)} km long",
                ),
            )
        )
        s.facts.append(
            (
                a,
                w.pick(
                    f"{w.v('has/had')} already covered {w.n(done)} km",
                    f"{w.v('drives/drove')} {w.n(done)} km",
                ),
            )
        )
        s.calc(total, "-", done)
        s.question = w.pick(
            "How many km are left?",
            f"How many km {w.v('are/were')} left for {a.name}?",
            "What distance remains?",
        )
    elif form == 2:
        x, d = w.r(90, 190), w.r(2, 40)
        taller = w.rng.random() < 0.5
        s.facts.append((a, f"{w.v('is/was')} {x} cm tall"))
        s.facts.append((b, f"{w.v('is/was')} {w.n(d)} cm {'taller' if taller else 'shorter'} than {a.name}"))
        s.calc(x, "+" if taller else "-", d)
        s.question = w.pick(
            f"How tall {w.v('is/was')} {b.name}?",
            f"What is {b.name}'s height?",
            f"Find {b.name}'s height in cm.",
        )
    else:
        x, y = w.r(10, 100), w.r(10, 100)
        unit = w.pick("kg", "litres", "metres")
        s.facts.append((None, f"One bag {w.v('weighs/weighed')} {w.n(x)} kg and another {w.v('weighs/weighed')} {w.n(y)} kg"
                        if unit == "kg" else f"One tank {w.v('holds/held')} {w.n(x)} {unit} and a second {w.v('holds/held')} {w.n(y)} {unit}"
                        if unit == "litres" else f"One rope {w.v('is/was')} {w.n(x)} metres long and another {w.v('is/was')} {w.n(y)} metres long"))  # fmt: skip
        s.calc(x, "+", y)
        s.question = w.pick(
            f"What is the total in {unit}?",
            f"How many {unit} is that combined?",
            f"How many {unit} altogether?",
        )


def _story_asked(w: _W, s: _S) -> None:
    """A price, a group size or a stock is stated; the question names how many are bought, filled
    or sharing ("One pen costs $3. How much do 4 pens cost?")."""
    sg, pl, _ = w.item
    g, gs = w.group
    h = w.a
    form = w.rng.randrange(3)
    if form == 0:
        a, b = w.r(2, 12), w.r(2, 50)
        price = w.money(b)
        s.facts.append((None, w.pick(f"One {sg} {w.v('costs/cost')} {price}", f"A {sg} {w.v('costs/cost')} {price}",
                                     f"{_cap(pl)} {w.v('are/were')} {price} each", f"Each {sg} {w.v('sells/sold')} for {price}",
                                     f"The shop {w.v('charges/charged')} {price} for one {sg}")))  # fmt: skip
        s.question = w.pick(f"How much do {w.n(a)} {pl} cost?", f"What is the cost of {w.n(a)} {pl}?",
                            f"How much would {w.n(a)} {pl} cost?", f"What do {w.n(a)} {pl} cost altogether?",
                            f"How much must {h.name} pay for {w.n(a)} {pl}?", f"Find the price of {w.n(a)} {pl}.",
                            f"How much does {h.name} spend on {w.n(a)} {pl}?")  # fmt: skip
        s.calc(a, "*", b)
    elif form == 1:
        a, b = w.r(2, 12), w.r(2, 50)
        s.facts.append((None, w.pick(f"Each {g} {w.v('holds/held')} {w.n(b)} {pl}", f"A {g} {w.v('has/had')} room for {w.n(b)} {pl}",
                                     f"There {w.v('are/were')} {w.n(b)} {pl} in every {g}", f"One {g} {w.v('takes/took')} {w.n(b)} {pl}")))  # fmt: skip
        s.question = w.pick(f"How many {pl} are in {w.n(a)} {gs}?", f"How many {pl} do {w.n(a)} {gs} hold?",
                            f"How many {pl} would fill {w.n(a)} {gs}?", f"How many {pl} are there in {w.n(a)} full {gs}?",
                            f"Find the number of {pl} in {w.n(a)} {gs}.")  # fmt: skip
        s.calc(a, "*", b)
    else:
        k, q = w.r(2, 12), w.r(2, 25)
        people = w.pick("friends", "children", "students", "kids", "people", "players")
        s.facts.append((h, w.pick(f"{w.has()} {_count(w, k * q)}", f"{w.v('makes/made')} {_count(w, k * q)}" if w.item[2]
                                  else f"{w.v('buys/bought')} {_count(w, k * q)}", f"{w.v('collects/collected')} {_count(w, k * q)}")))  # fmt: skip
        s.question = w.pick(f"If {h.he()} {'shares' if not w.past else 'shared'} them equally among {w.n(k)} {people}, how many does each get?",
                            f"How many does each of {w.n(k)} {people} get if they share the {pl} equally?",
                            f"If {w.n(k)} {people} share the {pl} fairly, how many does each one get?",
                            f"How many {gs} of {w.n(k)} can {h.he()} fill?", f"How many groups of {w.n(k)} can be made?")  # fmt: skip
        s.calc(k * q, "/", k)


_DRILL = {
    "+": ("{a}+{b}", "{a} + {b}", "{a} plus {b}", "the sum of {a} and {b}", "{a} added to {b}"),
    "-": ("{a}-{b}", "{a} - {b}", "{a} minus {b}", "{b} subtracted from {a}", "{a} take away {b}", "the difference of {a} and {b}"),
    "*": ("{a}*{b}", "{a} x {b}", "{a} × {b}", "{a} times {b}", "{a} multiplied by {b}", "the product of {a} and {b}"),
    "/": ("{a}/{b}", "{a} / {b}", "{a} ÷ {b}", "{a} divided by {b}", "the quotient of {a} and {b}"),
}  # fmt: skip


def _drill_operands(w: _W, op: str) -> tuple[int, int]:
    if op == "+":
        return w.r(1, w.pick(20, 100, 500)), w.r(1, w.pick(20, 100, 500))
    if op == "-":
        a = w.r(3, w.pick(20, 100, 1000))
        return a, w.r(1, a - 1)
    if op == "*":
        if w.rng.random() < 0.5:  # 2-digit x 2-digit
            a = w.r(10, 31)
            b = w.r(10, MAX_RESULT // a)
        else:
            a, b = w.r(2, 12), w.r(2, w.pick(12, 50, 83))
        return (a, b) if w.rng.random() < 0.5 else (b, a)
    if w.rng.random() < 0.5:  # 3-digit / 2-digit
        b = w.r(10, 50)
        q = w.r(max(2, -(-100 // b)), min(50, 999 // b))
        return b * q, b
    b = w.r(2, 12)
    return b * w.r(2, w.pick(12, 25, 50)), b


def _story_drill(w: _W, s: _S) -> None:
    """Bare arithmetic: one operation, or two applied left to right; small numbers sometimes in words."""
    op = w.rng.choice("+-*/")
    a, b = _drill_operands(w, op)
    s.calc(a, op, b)

    def num(k: int) -> str:
        return NUMBER_WORDS[k] if k <= 20 and w.rng.random() < 0.3 else str(k)

    expr = w.pick(*_DRILL[op]).format(a=num(a), b=num(b))
    if w.rng.random() < 0.25 and not expr.startswith("the "):
        op2 = w.pick("+", "-")
        c = w.r(1, 100) if op2 == "+" else w.r(1, max(1, s.value - 1))
        if (op2 == "+" and s.value + c <= MAX_RESULT) or (op2 == "-" and s.value - c >= 1):
            s.calc(s.value, op2, c)
            expr = f"{expr}{w.pick(*{'+': (' + ', '+', ' plus '), '-': (' - ', '-', ' minus ')}[op2])}{c}"
    s.question = w.pick(f"What is {expr}?", f"Calculate {expr}.", f"Work out {expr}.", f"Find {expr}.", f"{expr} = ?",
                        f"Compute {expr}.", f"What do you get for {expr}?", f"Determine {expr}.", f"{expr}?",
                        f"Please work out {expr}.", f"How much is {expr}?")  # fmt: skip


STORIES = {
    "changes": (_story_changes, 0.3), "groups": (_story_groups, 0.16), "share": (_story_share, 0.14),
    "compare": (_story_compare, 0.13), "transfer": (_story_transfer, 0.04), "shopping": (_story_shopping, 0.09),
    "measure": (_story_measure, 0.04), "drill": (_story_drill, 0.08), "asked": (_story_asked, 0.06),
}  # fmt: skip


# --------------------------------------------------------------------------------------------
# Distractors and assembly


def _distractor(w: _W) -> str:
    c = _P(*w.rng.choice([p for p in PEOPLE if p[0] not in (w.a.name, w.b.name, w.c.name)]))
    other = w.rng.choice([t for t in ITEMS if t[1] != w.item[1]])[1]
    return w.pick(
        f"{c.name} is {w.r(6, 70)} years old", f"{c.name} has {w.n(w.r(2, 30))} {other}",
        f"It takes {w.r(5, 50)} minutes to get to the shop", f"The shop opens at {w.r(7, 11)} o'clock",
        f"{w.a.name}'s {w.pick('cousin', 'friend', 'neighbour')} {c.name} looks after {w.n(w.r(2, 9))} pets", f"There are {w.r(12, 35)} students in the class",
        f"The thermometer shows {w.r(10, 35)} degrees", f"{w.a.name} lives at number {w.r(2, 99)}",
        f"The bus ride takes {w.r(10, 60)} minutes", f"{c.name} collects {other} and has {w.n(w.r(2, 15))} of them",
        f"{w.a.name} is in grade {w.r(1, 8)}", f"A {w.pick(*ITEMS_FOR_SALE)} costs {w.money(w.r(2, 60))} at another shop",
        f"{w.a.name}'s dog weighs {w.r(3, 40)} kg", f"The park is {w.n(w.r(2, 15))} km away",
        f"{c.name} scored {w.r(2, 99)} points yesterday", f"There are {w.n(w.r(2, 12))} trees on the street",
    )  # fmt: skip


def _sentences(w: _W, facts: list[tuple[_P | None, str]], events: bool) -> list[str]:
    """Sentences from facts: a fact about the same subject as the one before may be joined to it
    ("and", ", then", a relative clause); otherwise, when the facts are ``events`` in time order,
    a time word or nothing starts it."""
    out: list[str] = []
    i = 0
    while i < len(facts):
        subj, text = facts[i]
        nxt = facts[i + 1] if i + 1 < len(facts) else None
        name = w.who(subj) if subj is not None else None
        first = f"{name} {text}" if name else text
        w.mark(first)
        if nxt is not None and subj is not None and nxt[0] is subj and w.rng.random() < 0.45:
            join = w.rng.random()
            if (
                join < 0.2
                and name == subj.name
                and not text.startswith(("is ", "was ", "owns ", "owned "))
                and not nxt[1].startswith(("is ", "was "))
            ):
                out.append(f"{subj.name}, who {text}, {nxt[1]}")
            elif join < 0.6:
                out.append(f"{first} and {nxt[1]}")
            else:
                out.append(f"{first}, then {nxt[1]}")
            i += 2
            continue
        if out and events and w.rng.random() < 0.4:
            first = f"{w.pick(*TIMES)}, {_lower(first)}"
        out.append(first)
        i += 1
    return [_cap(t) for t in out]


def make_problem(rng: random.Random) -> Problem:
    """One problem (see the module docstring); deterministic for the state of ``rng``."""
    kinds = list(STORIES)
    kind = rng.choices(kinds, [STORIES[k][1] for k in kinds])[0]
    w, s = _W(rng), _S()
    STORIES[kind][0](w, s)
    answer = "\n".join(f"{e} = <<{e}={v}>>{v}" for e, v in s.steps) + f"\n#### {s.steps[-1][1]}"
    final = s.steps[-1][1]
    if kind == "drill":
        pre = rng.choice(("", "", "", "Quick sum: ", "Arithmetic: ", "Solve: "))
        return Problem(pre + _cap(s.question), answer, final, f"phrases/{kind}")
    q = s.question
    shape = rng.random()
    if_form = shape < 0.15 and s.if_form and len(s.facts) <= 3 and q.startswith("How")
    w.named = set()  # the question was written first; the sentences introduce the people in order
    sentences = _sentences(w, s.facts, kind in ("changes", "shopping", "transfer") and not if_form)
    if (
        if_form
        and kind in ("changes", "groups", "share", "compare")
        and len(sentences) <= 2
        and not any("." in t for t in sentences)
    ):
        text = f"If {' and '.join(_lower(t) for t in sentences)}, {_lower(q)}"
    else:
        if s.hypothetical:
            sentences[0] = rng.choice(("Suppose ", "Imagine that ", "Let's say ", "Say ")) + _lower(
                sentences[0]
            )
        for _ in range(rng.choice((0, 0, 0, 1, 1, 2))):
            sentences.insert(rng.randrange(not s.hypothetical, len(sentences) + 1), _distractor(w))
        facts = " ".join(t + "." for t in sentences)
        first = shape < 0.3 and kind != "asked" and not s.hypothetical
        text = f"{q} {facts}" if first else f"{facts} {q}"
    text = re.sub(r"\b([Aa]) (?=[aeiou])", r"\1n ", text.replace("..", "."))
    return Problem(text, answer, final, f"phrases/{kind}")


def generate_phrases(n: int, seed: int) -> list[Problem]:
    """``n`` distinct problems for ``seed`` (a prefix of any longer list for the same seed)."""
    return distinct_problems(make_problem, n, seed)
