"""A third word-problem generator for the demo model: each problem is a small story of quantities
and relations, and every part of its surface is drawn independently from large pools, so that no
sentence shape, question word or noun tells the model which operation to use; only what the body
of the problem says does.

:mod:`~breakgraph.demo.problems` has whole-question templates, :mod:`~breakgraph.demo.wordings`
openings and events, :mod:`~breakgraph.demo.phrasebank` interchangeable phrases per story. This
module goes further on the parts that decide whether a model reads the problem or recognises it:

- the question: assembled from a question word or imperative ("How many", "What", "Which number",
  "Find", "Give", "Say", "Tell me"...) and a target written many ways ("the number of pens Mo
  has", "Mo's pen count", "the pen total", "what is left", "one child's share"), with qualifiers
  ("now", "left", "in all", "between them", "afterwards"), asked last, first, before a colon, or
  as a bare "What is the result?"; the same pools serve every operation;
- numbers: digits or words up to twenty, inside other words ("a 7-dollar hat", "a 12 m rope",
  "a rope 12 metres long"), money with symbols or currency words;
- a lexicon of verbs per operation: gaining, losing, spending, earning, joining, leaving; and
  comparison words per direction ("more", "extra", "dearer", "pricier", "heavier", "taller",
  "older", "ahead"; "fewer", "less", "cheaper", "lighter", "shorter", "younger", "behind") and
  for differences ("difference", "gap", "margin", "how much more", "exceed");
- stories: sums of two holders or two days, gains and losses, comparisons and differences,
  multiples, equal groups, rates and prices, equal sharing, grouping and cutting, change from a
  payment, ages, what is left of a route or a book, chains of two to four steps mixing these,
  and arithmetic drills over the number ranges the stories use;
- distractors: sentences and appositions with numbers the answer does not use (an age, the
  weather, another noun the holder owns), and facts in either order where the arithmetic allows
  ("B has 4 more than A. A has 9.").

The answer keeps the demo format, one exact calculation per line then the final number::

    12+5 = <<12+5=17>>17
    #### 17

Ranges: every result is an integer in 1-1000; stated amounts are 1-100 (payments up to 500,
dividends up to 300); products have one factor 2-12; divisions have divisors 2-12 and quotients
2-25. Drills also cover two-digit products and three-digit dividends over two-digit divisors.
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass, field

from breakgraph.demo.phrasebank import NUMBER_WORDS, PEOPLE
from breakgraph.demo.problems import Problem, distinct_problems, exact_step, redrawn

MAX_RESULT = 1000

# (singular, plural) of things people count
COUNTABLES = tuple(tuple(p.split("/")) for p in (
    "apple/apples pear/pears plum/plums lemon/lemons melon/melons mango/mangoes grape/grapes "
    "carrot/carrots onion/onions potato/potatoes tomato/tomatoes pepper/peppers egg/eggs loaf/loaves "
    "bagel/bagels muffin/muffins cookie/cookies cupcake/cupcakes pie/pies tart/tarts sandwich/sandwiches "
    "pancake/pancakes sweet/sweets candy/candies walnut/walnuts acorn/acorns pebble/pebbles shell/shells "
    "stone/stones marble/marbles bead/beads button/buttons sticker/stickers stamp/stamps card/cards "
    "coin/coins badge/badges pin/pins ribbon/ribbons balloon/balloons candle/candles crayon/crayons "
    "pencil/pencils pen/pens marker/markers eraser/erasers notebook/notebooks book/books comic/comics "
    "magazine/magazines photo/photos picture/pictures poster/posters postcard/postcards letter/letters "
    "video/videos game/games puzzle/puzzles toy/toys doll/dolls robot/robots kite/kites "
    "ball/balls bat/bats glove/gloves sock/socks hat/hats scarf/scarves shirt/shirts cap/caps "
    "cup/cups mug/mugs plate/plates bowl/bowls spoon/spoons fork/forks glass/glasses jar/jars "
    "bottle/bottles can/cans brick/bricks plank/planks nail/nails screw/screws bolt/bolts tile/tiles "
    "log/logs stick/sticks rope/ropes chair/chairs table/tables bench/benches lamp/lamps "
    "flower/flowers rose/roses tulip/tulips daisy/daisies plant/plants tree/trees seed/seeds leaf/leaves "
    "feather/feathers ticket/tickets token/tokens point/points goal/goals star/stars flag/flags "
    "sheep/sheep cow/cows goat/goats hen/hens duck/ducks fish/fish horse/horses rabbit/rabbits "
    "bird/birds frog/frogs snail/snails bee/bees worm/worms tyre/tyres wheel/wheels "
    "brush/brushes towel/towels blanket/blankets pillow/pillows box/boxes parcel/parcels present/presents "
    "jigsaw/jigsaws bracelet/bracelets necklace/necklaces ring/rings key/keys lock/locks battery/batteries"
).split())  # fmt: skip
EDIBLE = set("apples pears plums lemons melons mangoes grapes carrots onions potatoes tomatoes peppers eggs loaves "
             "bagels muffins cookies cupcakes pies tarts sandwiches pancakes sweets candies walnuts".split())  # fmt: skip
# (singular, plural) of people who come, go and get shares
CROWDS = tuple(tuple(p.split("/")) for p in (
    "pupil/pupils student/students child/children passenger/passengers guest/guests "
    "visitor/visitors player/players runner/runners camper/campers worker/workers fan/fans "
    "swimmer/swimmers singer/singers dancer/dancers member/members friend/friends neighbour/neighbours "
    "volunteer/volunteers scout/scouts cousin/cousins customer/customers"
).split())  # fmt: skip
# (singular, plural) of what holds equal groups
GROUPS = tuple(tuple(p.split("/")) for p in (
    "box/boxes bag/bags crate/crates carton/cartons pack/packs packet/packets tray/trays tin/tins jar/jars "
    "basket/baskets bucket/buckets sack/sacks row/rows shelf/shelves rack/racks stack/stacks pile/piles "
    "bundle/bundles case/cases drawer/drawers table/tables team/teams bus/buses van/vans "
    "car/cars cage/cages pen/pens bed/beds pot/pots vase/vases folder/folders"
).split())  # fmt: skip
# institutions that hold things ("it")
def _pl(item: str) -> str:
    """The plural of a :data:`FOR_SALE` noun."""
    return item[:-1] + "ves" if item == "scarf" else item + "es" if item.endswith(("sh", "ch")) else item + "s"


PLACES = ("the shop", "the library", "the bakery", "the school", "the farm", "the cafe", "the club",
          "the museum", "the zoo", "the market stall", "the warehouse", "the florist", "the gym",
          "the hotel", "the garage", "the kitchen", "the toy store", "the bookshop")  # fmt: skip
# (symbol, word for one, word for many): "$7" or "7 dollars"
CURRENCIES = (("$", "dollar", "dollars"), ("£", "pound", "pounds"), ("€", "euro", "euros"),
              ("", "dollar", "dollars"), ("", "euro", "euros"), ("", "pound", "pounds"), ("", "franc", "francs"),
              ("", "rupee", "rupees"), ("", "peso", "pesos"), ("", "dinar", "dinars"), ("", "crown", "crowns"),
              ("", "yuan", "yuan"), ("", "rand", "rand"), ("", "credit", "credits"))  # fmt: skip
FOR_SALE = ("scarf", "hat", "lamp", "book", "toy", "jacket", "kettle", "clock", "mug", "ball", "game", "shirt",
            "backpack", "radio", "plant", "poster", "teapot", "wallet", "torch", "puzzle",
            "umbrella", "ticket", "pizza", "meal", "cake", "watch", "helmet", "notebook")  # fmt: skip
# (unit written out: singular, plural; short form; what is measured)
LENGTHS = (("metre", "metres", "m", ("rope", "ribbon", "cable", "pipe", "wire", "plank", "hose", "cord")),
           ("meter", "meters", "m", ("rope", "ribbon", "cable", "pipe", "board", "chain")),
           ("centimetre", "centimetres", "cm", ("ribbon", "string", "stick", "lace", "bar")),
           ("foot", "feet", "ft", ("rope", "pipe", "fence", "board")))  # fmt: skip
MASSES = (("kilogram", "kilograms", "kg", ("flour", "rice", "sand", "sugar", "soil", "potatoes", "oats")),
          ("gram", "grams", "g", ("butter", "cheese", "tea", "chocolate", "salt")))  # fmt: skip
VOLUMES = (("litre", "litres", "L", ("water", "juice", "milk", "paint", "fuel", "soup", "lemonade")),
           ("liter", "liters", "L", ("water", "juice", "milk", "oil")))  # fmt: skip
DAYS = ("Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday")
PERIODS = (("hour", "hours"), ("day", "days"), ("week", "weeks"), ("month", "months"), ("evening", "evenings"),
           ("shift", "shifts"), ("lesson", "lessons"), ("trip", "trips"))  # fmt: skip
JOBS = ("tutoring", "babysitting", "dog walking", "gardening", "washing cars", "delivering papers",
        "working at the cafe", "helping at the shop", "mowing lawns", "painting fences")  # fmt: skip
LEAD_INS = ("Here is a problem.", "Try this one.", "A quick puzzle:", "Think it through.", "Maths question:",
            "Word problem:", "Read carefully.", "One for you:", "Small puzzle.", "Solve this.", "A question:")  # fmt: skip
ADJECTIVES = ("red", "small", "big", "shiny", "old", "new", "little", "green", "tiny", "striped", "yellow", "spare",
              "wooden", "plastic", "fresh", "clean", "round", "heavy", "light", "cheap", "lovely", "odd")  # fmt: skip
TIMES = ("Then", "Later", "After that", "Next", "Afterwards", "Soon after", "In the afternoon", "By evening",
         "The next day", "On the way home", "An hour later", "That night", "After lunch", "At noon")  # fmt: skip


@dataclass
class _P:
    """A holder: a person (``sex`` ``f`` or ``m``) or a place (``sex`` ``n``, referred to as "it")."""

    name: str
    sex: str

    def he(self) -> str:
        return {"f": "she", "m": "he", "n": "it"}[self.sex]

    def him(self) -> str:
        return {"f": "her", "m": "him", "n": "it"}[self.sex]

    def his(self) -> str:
        return {"f": "her", "m": "his", "n": "its"}[self.sex]

    def pos(self) -> str:
        """The possessive of the name: ``Mo's``, ``the shop's``."""
        return f"{self.name}'" if self.name.endswith("s") else f"{self.name}'s"


@dataclass
class _S:
    """A story being written: fact sentences, calculation steps and the question."""

    facts: list[str] = field(default_factory=list)
    steps: list[tuple[str, int]] = field(default_factory=list)
    question: str = ""
    imperative: str = ""  # the question as a noun phrase for "Work out X: ..." (empty: no such form)
    value: int = 0
    events: bool = False  # facts are in time order (time words may start them)
    swappable: bool = False  # the first two facts may change places
    ages: bool = False  # the story is about ages (no age may be added as a distractor)
    question_last: bool = False  # the question must follow the facts

    def calc(self, a: int, op: str, b: int) -> int:
        v = exact_step(a, op, b)
        if not 1 <= v <= MAX_RESULT:
            raise ValueError(f"{a}{op}{b}={v} is out of range")
        self.steps.append((f"{a}{op}{b}", v))
        self.value = v
        return v


class _W:
    """Per-problem choices: people, nouns, tense, how numbers are written, and the random source."""

    def __init__(self, rng: random.Random):
        self.rng = rng
        (n1, s1), (n2, s2), (n3, s3) = rng.sample(PEOPLE, 3)
        self.a, self.b, self.c = _P(n1, s1), _P(n2, s2), _P(n3, s3)
        self.thing = rng.choice(COUNTABLES)
        self.other = rng.choice([t for t in COUNTABLES if t != self.thing])  # a noun the answer does not count
        self.crowd = rng.choice(CROWDS)
        self.group = rng.choice(GROUPS)
        self.cur = rng.choice(CURRENCIES)
        self.past = rng.random() < 0.4
        self.word_p = rng.choice((0.0, 0.2, 0.5))
        self.people: list[_P] = []  # everyone the marks refer to, by index

    def pick(self, *options):
        return self.rng.choice(options)

    def r(self, lo: int, hi: int) -> int:
        return self.rng.randint(lo, hi)

    def chance(self, p: float) -> bool:
        return self.rng.random() < p

    def n(self, k: int) -> str:
        """A number as digits or, up to twenty, sometimes as a word."""
        return NUMBER_WORDS[k] if k <= 20 and self.chance(self.word_p) else str(k)

    def v(self, present: str, past: str) -> str:
        return past if self.past else present

    def cnt(self, k: int, noun: tuple[str, str] | None = None) -> str:
        sg, pl = noun or self.thing
        return f"{self.n(k)} {sg if k == 1 else pl}"

    def money(self, k: int) -> str:
        sym, one, many = self.cur
        return f"{sym}{k}" if sym else f"{self.n(k)} {one if k == 1 else many}"

    def money_adj(self, k: int) -> str:
        """An amount before a noun: ``$7``, ``7-dollar``, ``seven-euro``."""
        sym, one, _ = self.cur
        return f"{sym}{k}" if sym and self.chance(0.6) else f"{self.n(k)}-{one}"

    def cur_word(self) -> str:
        return self.cur[2]

    def _ref(self, p: _P, role: str) -> str:
        if p not in self.people:
            self.people.append(p)
        return f"\x00{role}{self.people.index(p)}\x00"

    def who(self, p: _P) -> str:
        """``p`` as a subject: a mark that :func:`resolve` turns into the name or the pronoun."""
        return self._ref(p, "S")

    def whom(self, p: _P) -> str:
        """``p`` as an object (see :meth:`who`)."""
        return self._ref(p, "O")

    def whose(self, p: _P) -> str:
        """``p`` as a possessive (see :meth:`who`)."""
        return self._ref(p, "P")

    def holder(self) -> _P:
        """Mostly a person, sometimes a place."""
        return self.a if self.chance(0.85) else _P(self.pick(*PLACES), "n")


_MARK = re.compile("\x00([SOP])(\\d+)\x00")
_NAMESET = {n for n, _ in PEOPLE}


def resolve(w: _W, text: str) -> str:
    """Replace the people marks of ``text``: a person's first mention is the name, a later one is
    the pronoun about half the time, but only when nobody else the text names takes the same
    pronoun; then capitalise every sentence start."""
    present = {int(m[2]) for m in _MARK.finditer(text)}
    named = [q for q in (*w.people, w.a, w.b, w.c) if q.sex != "n" and re.search(rf"\b{q.name}\b", text)]
    seen: set[int] = set()

    def one(m: re.Match) -> str:
        i, role = int(m[2]), m[1]
        p = w.people[i]
        others = [w.people[j] for j in present if j != i] + [q for q in named if q is not p]
        clash = any(q.he() == p.he() for q in others)
        pron = i in seen and not clash and w.chance(0.5)
        seen.add(i)
        if role == "S":
            return p.he() if pron else p.name
        if role == "O":
            return p.him() if pron else p.name
        return p.his() if pron else p.pos()

    text = _MARK.sub(one, text)
    return re.sub(r"(^|[.?!] )([a-z])", lambda m: m[1] + m[2].upper(), text)


def _cap(s: str) -> str:
    return s[:1].upper() + s[1:]


def _does(w: _W) -> str:
    return "did" if w.past else "does"


def _has(w: _W) -> str:
    return "had" if w.past else "has"


def _is(w: _W) -> str:
    return "was" if w.past else "is"


def _are(w: _W) -> str:
    return "were" if w.past else "are"


# --------------------------------------------------------------------------------------------
# Questions: one pool for every operation


_GENERIC = ("What is the answer?", "What is the result?", "What number results?",
            "Give the number.", "What figure do you get?", "What is the final number?", "Work it out.",
            "What do you get?", "What is the final count?")  # fmt: skip
_LEFT = ("left", "remaining", "left over", "still there", "now", "afterwards", "in the end")
_TOTAL = ("in total", "altogether", "in all", "all together", "combined", "all told", "overall", "together")
_NOW = ("now", "afterwards", "in the end", "after that", "by then", "at this point", "")


def _qual(w: _W, mood: str) -> str:
    q = w.pick(*{"left": _LEFT, "total": _TOTAL, "now": _NOW}[mood])
    return f" {q}" if q else ""


def ask_count(w: _W, h: _P | None, noun: tuple[str, str], mood: str) -> tuple[str, str]:
    """A question about how many ``noun`` the holder ``h`` (None: nobody in particular) has, with
    qualifiers for ``mood`` (``left``, ``total`` or ``now``); and the same target as a noun phrase
    for "Find X: ..." forms."""
    sg, pl = noun
    q = _qual(w, mood)
    do, have = _does(w), "have"
    if h is None:
        forms = [f"How many {pl} {_are(w)} there{q}?", f"What is the number of {pl}{q}?", f"What {sg} count is that{q}?",
                 f"What is the {sg} total{q}?", f"What number of {pl} {_are(w)} there{q}?", f"How many {pl} is that{q}?",
                 f"Find the number of {pl}{q}.", f"Tell me how many {pl} there {_are(w)}{q}.",
f"So how many {pl} {_are(w)} there{q}?",
                 f"Give the {sg} count{q}."]  # fmt: skip
        if mood == "left":
            forms += [f"How many {pl} {_are(w)} left?", f"How many {pl} {'remain' if not w.past else 'remained'}?",
                      f"What number of {pl} {'stays' if not w.past else 'stayed'}?", "How many are left?",
                      f"How many {pl} {_are(w)} still there?", "What is left?", f"What count of {pl} {'remains' if not w.past else 'remained'}?"]  # fmt: skip
        nps = [f"the number of {pl}{q}", f"the {sg} count{q}", f"how many {pl} there {_are(w)}{q}"]
        return w.pick(*forms, *(_GENERIC if w.chance(0.3) else ())), w.pick(*nps)
    hn = w.who(h)
    end = "ended" if w.past else "ends"
    forms = [f"How many {pl} {do} {hn} {have}{q}?", f"What is {h.pos()} {sg} count{q}?", f"Which {sg} count {do} {hn} reach{q}?",
             f"What is {h.pos()} {sg} total{q}?", f"What number of {pl} {do} {hn} {have}{q}?",
             f"How many {pl} {do} {hn} end up with?", f"{_cap(h.name)} {_has(w)} how many {pl}{q}?",
             f"How many {pl} {_is(w)} {hn} left with?" if mood == "left" else f"How many {pl} {do} {hn} own{q}?",
             f"Find the number of {pl} {hn} {_has(w)}{q}.",
             f"Work out how many {pl} {hn} {_has(w)}{q}.", f"Say how many {pl} {hn} {_has(w)}{q}.",
             f"Tell me how many {pl} {hn} {_has(w)}{q}.", f"Calculate {w.whose(h)} {sg} count{q}.",
             f"How many {pl} belong to {h.name}{q}?", f"What does {w.whose(h)} {sg} count come to{q}?",
             f"How many {pl} {do} {hn} hold{q}?",
             f"Determine how many {pl} {hn} {end} up with.", f"What is the count of {pl} for {h.name}{q}?",
             f"Can you say how many {pl} {hn} {_has(w)}{q}?", f"With how many {pl} {do} {hn} end up?",
             f"How many {pl} {_is(w)} {hn} holding{q}?", f"What tally of {pl} {do} {hn} {have}{q}?"]  # fmt: skip
    if mood == "left":
        forms += [f"How many {pl} {do} {hn} have left?", f"How many {pl} {do} {hn} still have?",
                  f"How many {pl} {_are(w)} left?", f"What number of {pl} {'remains' if not w.past else 'remained'}?",
                  f"How many {pl} {'stay' if not w.past else 'stayed'} with {h.name}?", "How many are left?",
                  f"How many {pl} {_are(w)} still with {h.name}?", f"What {do} {hn} have left?"]  # fmt: skip
    if mood == "total":
        forms += [f"How many {pl} {do} {hn} have{q}?", f"What is the total number of {pl} {hn} {_has(w)}?"]
    nps = [f"{w.whose(h)} {sg} count{q}", f"the number of {pl} {h.name} {_has(w)}{q}", f"{w.whose(h)} {sg} total{q}",
           f"how many {pl} {h.name} {_has(w)}{q}"]  # fmt: skip
    return w.pick(*forms, *(_GENERIC if w.chance(0.25) else ())), w.pick(*nps)


def ask_money(w: _W, h: _P, mood: str) -> tuple[str, str]:
    """A question about the money ``h`` has (``mood`` as for :func:`ask_count`)."""
    q = _qual(w, mood)
    hn = h.name
    do = _does(w)
    forms = [f"How much money {do} {hn} have{q}?", f"How many {w.cur_word()} {do} {hn} have{q}?",
             f"What sum {do} {hn} have{q}?", f"What amount {do} {hn} have{q}?", f"What is {h.pos()} bank total{q}?",
             f"How much {do} {hn} have{q}?", f"What is the amount of money {h.name} {_has(w)}{q}?",
             f"What sum {_is(w)} in {w.whose(h)} wallet{q}?", f"How much {_is(w)} in {w.whose(h)} purse{q}?",
             f"Find how much money {hn} {_has(w)}{q}.", f"Work out {w.whose(h)} money{q}.", f"What {do} {hn} have{q}, in {w.cur_word()}?",
             f"How much cash {do} {hn} hold{q}?"]  # fmt: skip
    if mood == "left":
        forms += [f"How much money {do} {hn} have left?", "How much money is left?", "How much is left over?",
                  "What sum remains?", f"What amount {_is(w)} left?", f"How much {do} {hn} still have?",
                  f"What {do} {hn} have left?", "What is left?", f"How many {w.cur_word()} remain?",
                  f"What sum {'stays' if not w.past else 'stayed'} with {h.name}?"]  # fmt: skip
    nps = [f"{w.whose(h)} money{q}", f"the sum {h.name} {_has(w)}{q}", f"how much {h.name} {_has(w)}{q}",
           f"{h.pos()} cash{q}"]  # fmt: skip
    return w.pick(*forms, *(_GENERIC if w.chance(0.2) else ())), w.pick(*nps)


# --------------------------------------------------------------------------------------------
# Events on one holder's count (the subject's name is written by the caller)


def gain(w: _W, h: _P, k: int, noun: tuple[str, str] | None = None) -> str:
    """A sentence in which ``h`` ends up with ``k`` more of ``noun``."""
    sg, pl = noun or w.thing
    pl = sg if k == 1 else pl
    n, x = w.n(k), w.pick("", f" {pl}", f" {pl}", "")
    o = w.b if h is not w.b else w.c
    more = w.pick(f"{n} more{x}", f"another {n}{x}", f"an extra {n}{x}", f"{n} additional {pl}", f"a further {n}{x}",
                  f"{n} new{x}", f"{n} {pl}", f"{n} more {pl}")  # fmt: skip
    if w.chance(0.3):
        return w.pick(
            f"{_cap(w.who(o))} {w.v('gives', 'gave')} {w.whom(h)} {more}", f"{_cap(w.who(o))} {w.v('hands', 'handed')} {w.whom(h)} {more}",
            f"{_cap(w.who(o))} {w.v('sends', 'sent')} {w.whom(h)} {more}", f"{_cap(w.who(o))} {w.v('adds', 'added')} {more} to {w.whose(h)} pile",
            f"A delivery of {n} {pl} {w.v('arrives', 'arrived')} for {w.whom(h)}", f"{_cap(n)} more {pl} {w.v('are', 'were')} added",
            f"{_cap(n)} more {pl} {w.v('turn up', 'turned up')}", f"{_cap(w.who(o))} {w.v('donates', 'donated')} {more}",
            *((f"{_cap(w.whose(h))} {w.pick('aunt', 'uncle', 'friend', 'gran', 'dad', 'mum', 'neighbour')} {w.v('brings', 'brought')} {w.whom(h)} {more}",)
              if h.sex != "n" else ()),
        )  # fmt: skip
    s = w.who(h)
    verb = w.pick(
        ("buys", "bought"), ("gets", "got"), ("receives", "received"), ("collects", "collected"), ("picks up", "picked up"),
        ("finds", "found"), ("wins", "won"), ("adds", "added"), ("gains", "gained"), ("orders", "ordered"), ("makes", "made"),
        ("gathers", "gathered"), ("brings in", "brought in"), ("takes delivery of", "took delivery of"), ("acquires", "acquired"),
        ("is given", "was given"), ("is handed", "was handed"), ("is sent", "was sent"), ("borrows", "borrowed"),
        ("comes home with", "came home with"), ("trades for", "traded for"), ("picks", "picked"), ("obtains", "obtained"),
        ("puts in", "put in"), ("stocks up on", "stocked up on"), ("is gifted", "was gifted"), ("lands", "landed"),
        *((("cooks", "cooked"),) if pl in EDIBLE else ()),
    )  # fmt: skip
    return f"{_cap(s)} {w.v(*verb)} {more}"


def loss(w: _W, h: _P, k: int, noun: tuple[str, str] | None = None) -> str:
    """A sentence in which ``h`` ends up with ``k`` fewer of ``noun``."""
    sg, pl = noun or w.thing
    pl = sg if k == 1 else pl
    n = w.n(k)
    x = w.pick("", f" {pl}", f" {pl}")
    o = w.b if h is not w.b else w.c
    if w.chance(0.3):
        return w.pick(
            f"{_cap(n)} of the {pl} {w.v('break', 'broke')}", f"{_cap(n)} {pl} {w.v('go', 'went')} missing",
            f"{_cap(n)} of {w.whose(h)} {pl} {w.v('get', 'got')} lost", f"{_cap(n)}{x} {w.v('are', 'were')} sold",
            f"{_cap(n)}{x} {w.v('are', 'were')} given away", f"{_cap(w.who(o))} {w.v('takes', 'took')} {n}{x}",
            f"{_cap(w.who(o))} {w.v('borrows', 'borrowed')} {n}{x}", f"{_cap(n)} {pl} {w.v('are', 'were')} thrown out",
            f"{_cap(w.who(o))} {w.v('buys', 'bought')} {n}{x} from {w.whom(h)}", f"{_cap(n)}{x} {w.v('spoil', 'spoiled')}",
            f"{_cap(n)}{x} {w.v('are', 'were')} used up", f"{_cap(n)} {pl} {w.v('get', 'got')} damaged",
        )  # fmt: skip
    s = w.who(h)
    if w.chance(0.2):
        x = f" of {w.whose(h)} {pl}"
    verb = w.pick(
        ("sells", "sold"), ("gives away", "gave away"), ("loses", "lost"), ("drops", "dropped"), ("uses", "used"),
        ("uses up", "used up"), ("donates", "donated"), ("throws away", "threw away"), ("breaks", "broke"), ("lends out", "lent out"),
        ("hands out", "handed out"), ("trades away", "traded away"), ("returns", "returned"), ("posts off", "posted off"),
        ("ships", "shipped"), ("removes", "removed"), ("takes out", "took out"), ("gets rid of", "got rid of"),
        ("parts with", "parted with"), ("sends off", "sent off"), ("misplaces", "misplaced"), ("packs off", "packed off"),
        ("sells off", "sold off"), ("gives up", "gave up"), ("discards", "discarded"), ("recycles", "recycled"),
        *((("eats", "ate"), ("serves", "served"), ("cooks", "cooked")) if pl in EDIBLE else (("wears out", "wore out"),)),
    )  # fmt: skip
    tail = w.pick("", "", "", f" to {w.whom(o)}", " at the market", " by lunchtime", " early on", " by evening")
    if verb[0] in ("breaks", "misplaces", "loses", "drops", "uses", "uses up", "eats") or tail.startswith(" to") and verb[0] in (
        "throws away", "removes", "misplaces", "discards", "recycles", "gets rid of", "wears out", "takes out"):
        tail = ""  # fmt: skip
    return f"{_cap(s)} {w.v(*verb)} {n}{x}{tail}"


def money_gain(w: _W, h: _P, k: int) -> str:
    """A sentence in which ``h`` gets ``k`` of the problem's currency."""
    m = w.money(k)
    s = w.who(h)
    return _cap(w.pick(
        f"{s} {w.v('earns', 'earned')} {m}", f"{s} {w.v('is', 'was')} paid {m}", f"{s} {w.v('makes', 'made')} {m} {w.pick(*JOBS)}",
        f"{s} {w.v('saves', 'saved')} another {m}", f"{s} {w.v('puts', 'put')} in {m}", f"{s} {w.v('adds', 'added')} {m}",
        f"{s} {w.v('deposits', 'deposited')} {m}", f"{s} {w.v('wins', 'won')} {m}", f"{s} {w.v('gets', 'got')} {m} as a gift",
        f"{s} {w.v('receives', 'received')} {m}", f"{s} {w.v('finds', 'found')} {m}", f"{s} {w.v('collects', 'collected')} {m}",
        f"{s} {w.v('sells', 'sold')} an old {w.pick(*FOR_SALE)} for {m}", f"{s} {w.v('is', 'was')} given {m}",
        f"{s} {w.v('brings', 'brought')} in {m}", f"{s} {w.v('tops', 'topped')} it up with {m}",
    ))  # fmt: skip


def money_loss(w: _W, h: _P, k: int) -> str:
    """A sentence in which ``h`` spends or loses ``k`` of the problem's currency."""
    m, thing = w.money(k), w.pick(*FOR_SALE)
    s = w.who(h)
    a = "an" if thing[0] in "aeiou" else "a"
    return _cap(w.pick(
        f"{s} {w.v('spends', 'spent')} {m} on {a} {thing}", f"{s} {w.v('pays', 'paid')} {m} for {a} {thing}",
        f"{s} {w.v('buys', 'bought')} {a} {thing} for {m}", f"{s} {w.v('buys', 'bought')} {a} {w.money_adj(k)} {thing} {w.pick('at the fair', 'in town', 'online', 'for the house', 'as a present')}",
        f"{s} {w.v('spends', 'spent')} {m}", f"{s} {w.v('loses', 'lost')} {m}", f"{s} {w.v('withdraws', 'withdrew')} {m} to buy {a} {thing}",
        f"{s} {w.v('withdraws', 'withdrew')} {m}", f"{s} {w.v('gives', 'gave')} {m} to charity", f"{s} {w.v('donates', 'donated')} {m}",
        f"{s} {w.v('lends', 'lent')} {m} to {w.whom(w.b if h is not w.b else w.c)}", f"{s} {w.v('pays', 'paid')} a bill of {m}", f"{s} {w.v('uses', 'used')} up {m}",
        f"{s} {w.v('pays', 'paid')} out {m}", f"{s} {w.v('puts', 'put')} {m} towards {a} {thing}",
    ))  # fmt: skip


def crowd_gain(w: _W, k: int) -> str:
    """A sentence in which ``k`` more people of the problem's crowd arrive."""
    sg, pl = w.crowd
    n = w.n(k)
    return _cap(w.pick(f"{n} more {pl} {w.v('join', 'joined')}", f"{n} {pl} {w.v('get on', 'got on')}", f"{n} {pl} {w.v('arrive', 'arrived')}",
                       f"{n} {pl} {w.v('climb aboard', 'climbed aboard')}", f"another {n} {w.v('come', 'came')} in",
                       f"{n} new {pl} {w.v('sign up', 'signed up')}", f"{n} late {pl} {w.v('turn up', 'turned up')}"))  # fmt: skip


def crowd_loss(w: _W, k: int) -> str:
    """A sentence in which ``k`` people of the problem's crowd leave."""
    sg, pl = w.crowd
    n = w.n(k)
    return _cap(w.pick(f"{n} {pl} {w.v('leave', 'left')}", f"{n} {w.v('get off', 'got off')}", f"{n} {pl} {w.v('step off', 'stepped off')}",
                       f"{n} {w.v('go', 'went')} home", f"{n} of the {pl} {w.v('drop out', 'dropped out')}", f"{n} {pl} {w.v('head', 'headed')} off",
                       f"{n} {w.v('walk', 'walked')} out"))  # fmt: skip


# --------------------------------------------------------------------------------------------
# Stories


def _start(w: _W, h: _P, k: int, noun: tuple[str, str] | None = None) -> str:
    """``h`` has ``k`` of ``noun`` to begin with."""
    c = w.cnt(k, noun)
    g = w.group[0]
    s = w.who(h)
    return _cap(w.pick(
        f"{s} {_has(w)} {c}", f"{s} {_has(w)} {c}", f"{s} {w.v('owns', 'owned')} {c}", f"{s} {w.v('starts', 'started')} with {c}",
        f"{s} {w.v('keeps', 'kept')} {c} in a {g}", f"{s} {w.v('has', 'had')} a collection of {c}", f"{s} {w.v('holds', 'held')} {c}",
        f"{s} {_has(w)} {c} at first", f"{s} {w.v('begins', 'began')} with {c}", f"{s} {w.v('counts', 'counted')} {c}",
        f"{s} {w.v('stores', 'stored')} {c}", f"{s} {w.v('looks', 'looked')} after {c}", f"{s} {_has(w)} got {c}",
        f"there {_are(w) if k != 1 else _is(w)} {c} with {h.name}" if h.sex != "n" else f"there {_are(w) if k != 1 else _is(w)} {c} at {h.name}",
    ))  # fmt: skip


def story_combine(w: _W, s: _S) -> None:
    """Two amounts of one thing put together."""
    sg, pl = w.thing
    x, y = w.r(2, 100), w.r(2, 100)
    form = w.r(0, 4)
    if form == 0:
        a, b = w.a, w.b
        s.facts += [_start(w, a, x), _start(w, b, y)]
        s.swappable = True
        s.question, s.imperative = w.pick(
            (f"How many {pl} {w.v('do', 'did')} they have {w.pick(*_TOTAL, 'between them')}?", "the total of the two"),
            (f"What is their combined {sg} count?", "their combined count"),
            (f"How many {pl} {w.v('do', 'did')} {a.name} and {b.name} have together?", f"the number of {pl} they have together"),
            (f"Counting both, how many {pl} {_are(w)} there?", f"the {sg} count of both"),
            (f"How many {pl} {_are(w)} there {w.pick(*_TOTAL)}?", f"the total number of {pl}"),
            (f"Together, what {sg} count {w.v('do', 'did')} they have?", f"the {sg} count for both"),
            ask_count(w, None, w.thing, "total"),
        )  # fmt: skip
    elif form == 1:
        g, gs = w.group
        first, second = w.pick(("one", "the other"), ("one", "another"), ("the first", "the second"), ("the first", "the other"))
        s.facts.append(_cap(w.pick(
            f"{first} {g} {w.v('holds', 'held')} {w.cnt(x)} and {second} {w.v('holds', 'held')} {w.n(y)}",
            f"{first} {g} {w.v('contains', 'contained')} {w.n(x)} {pl}, {second} {w.n(y)}",
            f"there {_are(w)} {w.cnt(x)} in {first} {g} and {w.n(y)} in {second} {g}",
            f"{first} {g} {_has(w)} {w.cnt(x)}; {second} {_has(w)} {w.cnt(y)}",
        )))  # fmt: skip
        s.question, s.imperative = ask_count(w, None, w.thing, "total")
        s.question = w.pick(s.question, f"How many {pl} {_are(w)} in both {gs}?", f"Adding both {gs}, how many {pl} {_are(w)} there?",
                            f"How many {pl} do the two {gs} hold {w.pick(*_TOTAL)}?")  # fmt: skip
    elif form == 2:
        h = w.holder()
        d1, d2 = w.rng.sample(DAYS, 2)
        verb = w.pick(("collects", "collected"), ("picks", "picked"), ("sells", "sold"), ("makes", "made"), ("gets", "got"),
                      ("counts", "counted"), ("finds", "found"), ("uses", "used"), ("gives out", "gave out"))  # fmt: skip
        w.past = True
        s.facts.append(_cap(w.pick(
            f"{w.who(h)} {verb[1]} {w.cnt(x)} on {d1} and {w.n(y)} on {d2}",
            f"on {d1} {w.who(h)} {verb[1]} {w.cnt(x)}; on {d2}, {w.n(y)} more",
        )))  # fmt: skip
        s.question, s.imperative = w.pick(
            (f"How many {pl} did {h.name} {_base(verb[0])} on the two days?", "the two-day total"),
            (f"Adding the two days, how many {pl} is that?", "the total for the two days"),
            (f"How many {pl} is that across the two days?", f"the number of {pl} on both days"),
            ask_count(w, None, w.thing, "total"),
        )  # fmt: skip
    elif form == 3:
        h = w.holder()
        s.facts.append(_cap(w.pick(
            f"{w.who(h)} {_has(w)} {w.cnt(x)} and {w.cnt(y, w.other)}",
            f"{w.who(h)} {_has(w)} {w.cnt(x)} and {w.n(y)} more in a {w.group[0]}",
        )))  # fmt: skip
        if "more in a" in s.facts[-1]:
            s.question, s.imperative = ask_count(w, h, w.thing, "total")
        else:
            other = w.other
            s.question = w.pick(f"How many {pl} and {other[1]} {_does(w)} {h.name} have {w.pick(*_TOTAL)}?",
                                f"How many things {_does(w)} {h.name} have {w.pick(*_TOTAL)}?",
                                f"What is the total of {pl} and {other[1]}?")  # fmt: skip
            s.imperative = f"the total of {pl} and {other[1]}"
    else:
        unit = w.pick(*LENGTHS, *MASSES, *VOLUMES)
        stuff = w.pick(*unit[3])
        u = unit[2] if w.chance(0.4) else unit[1]
        objs = w.pick(("parcel", "parcels"), ("bag", "bags"), ("box", "boxes"), ("sack", "sacks")) if unit in MASSES else w.pick(
            ("tank", "tanks"), ("jug", "jugs"), ("bottle", "bottles"), ("barrel", "barrels"))  # fmt: skip
        if unit in LENGTHS:
            s.facts.append(_cap(w.pick(f"one {stuff} {_is(w)} {w.n(x)} {u} long and another {_is(w)} {w.n(y)} {u}",
                                       f"{w.who(w.a)} {w.v('joins', 'joined')} a {w.n(x)} {u} {stuff} to a {w.n(y)} {u} {stuff}",
                                       f"there {_is(w)} a {x}-{unit[0]} {stuff} and a {y}-{unit[0]} {stuff}")))  # fmt: skip
            s.question = w.pick(f"What is the total length in {u}?", f"How long are they end to end, in {u}?",
                                f"How many {u} is that together?", "What length do they make in all?")  # fmt: skip
            s.imperative = f"the total length in {u}"
        else:
            s.facts.append(_cap(w.pick(f"one {objs[0]} of {stuff} {w.v('weighs', 'weighed') if unit in MASSES else w.v('holds', 'held')} {w.n(x)} {u} "
                                       f"and a second {w.v('weighs', 'weighed') if unit in MASSES else w.v('holds', 'held')} {w.n(y)} {u}",
                                       f"there {_are(w)} two {objs[1]} of {stuff}, one of {x} {u}, the other of {y} {u}")))  # fmt: skip
            s.question = w.pick(f"What is the total in {u}?", f"How many {u} of {stuff} {_is(w)} there {w.pick(*_TOTAL)}?",
                                f"How much {stuff} is that {w.pick(*_TOTAL)}, in {u}?", f"What do the two {objs[1]} come to in {u}?")  # fmt: skip
            s.imperative = f"the total amount of {stuff} in {u}"
    s.calc(x, "+", y)


def _base(present: str) -> str:
    """The base form of a present-tense verb phrase: ``picks up`` → ``pick up``."""
    head, _, rest = present.partition(" ")
    head = {"has": "have", "does": "do", "is": "be"}.get(head, head[:-2] if head.endswith(("ches", "shes", "sses", "xes")) else head[:-1])
    return f"{head} {rest}".strip()


def story_changes(w: _W, s: _S) -> None:
    """A start amount and one to three gains and losses, in time order."""
    h = w.holder()
    kind = w.r(0, 5)
    if kind == 0:
        k = w.r(10, 100)
        s.facts.append(_cap(w.pick(f"{w.who(h)} {_has(w)} {w.money(k)}", f"{w.who(h)} {w.v('saves', 'saved')} {w.money(k)}",
                                   f"{w.who(h)} {w.v('starts', 'started')} the week with {w.money(k)}",
                                   f"{w.who(h)} {w.v('opens', 'opened')} an account with {w.money(k)}")))  # fmt: skip
        up, down, ask = money_gain, money_loss, (lambda mood: ask_money(w, h, mood))
    elif kind == 1 and h.sex != "n":
        k = w.r(10, 100)
        sg, pl = w.crowd
        at, vehicle = w.pick(("on", "bus"), ("on", "train"), ("on", "boat"), ("on", "tram"), ("on", "ferry"), ("in", "hall"),
                             ("in", "room"), ("at", "party"), ("in", "club"), ("in", "park"), ("at", "camp"), ("in", "pool"))  # fmt: skip
        s.facts.append(_cap(w.pick(f"there {_are(w)} {w.n(k)} {pl} {at} the {vehicle}", f"the {vehicle} {w.v('has', 'had')} {w.n(k)} {pl}",
                                   f"the {vehicle} {w.v('starts', 'started')} with {w.n(k)} {pl}", f"{w.n(k)} {pl} {_are(w)} {at} the {vehicle}")))  # fmt: skip
        up, down = (lambda w_, h_, d: crowd_gain(w_, d)), (lambda w_, h_, d: crowd_loss(w_, d))
        ask = lambda mood: (w.pick(f"How many {pl} {_are(w)} {at} the {vehicle} now?", f"What is the {sg} count {_qual(w, 'now').strip() or 'now'}?",  # noqa: E731
                                   f"How many {pl} {_are(w)} there at the end?", f"What number of {pl} {_is(w)} left?" if mood == "left" else
                                   f"How many {pl} {_are(w)} there now?", f"How many {pl} {'remain' if not w.past else 'remained'}?"),
                            f"the number of {pl} at the end")  # fmt: skip
    else:
        k = w.r(5, 100)
        s.facts.append(_start(w, h, k))
        up, down = gain, loss
        ask = lambda mood: ask_count(w, h, w.thing, mood)  # noqa: E731
    s.value = k
    mood = "now"
    for _ in range(w.pick(1, 1, 2, 2, 3)):
        if w.chance(0.5) and s.value <= MAX_RESULT - 5:
            d = w.r(1, min(100, MAX_RESULT - s.value))
            s.facts.append(up(w, h, d))
            s.calc(s.value, "+", d)
            mood = w.pick("now", "total")
        elif s.value > 2:
            d = w.r(1, min(100, s.value - 1))
            s.facts.append(down(w, h, d))
            s.calc(s.value, "-", d)
            mood = w.pick("now", "left", "left")
    if not s.steps:
        d = w.r(1, 100)
        s.facts.append(up(w, h, d))
        s.calc(s.value, "+", d)
    s.events = True
    s.question, s.imperative = ask(mood)
    if len(s.facts) > 1 and not w.past and s.question[:1] in "HW" and s.question.endswith("?") and w.chance(0.25):
        # the last event folded into the question: "If she sells 5, how many are left?"
        s.question = f"If {_decap(s.facts.pop())}, {_decap(s.question)}"
        s.imperative, s.question_last = "", True


def _more_words(w: _W, d: str, more: bool, kind: str) -> str:
    """``d`` more / fewer in the words of ``kind`` (``count``, ``money``, ``length``, ``mass``, ``age``)."""
    if kind == "money":
        return w.pick(*((f"{d} dearer", f"{d} pricier", f"{d} more expensive", f"{d} more") if more else
                        (f"{d} cheaper", f"{d} less expensive", f"{d} less", f"{d} lower in price")))  # fmt: skip
    if kind == "length":
        return w.pick(f"{d} longer", f"{d} taller", f"{d} higher") if more else w.pick(f"{d} shorter", f"{d} lower")
    if kind == "mass":
        return f"{d} heavier" if more else f"{d} lighter"
    if kind == "age":
        return f"{d} years older" if more else f"{d} years younger"
    return f"{d} more" if more else w.pick(f"{d} fewer", f"{d} less")


def story_compare_back(w: _W, s: _S) -> None:
    """A's amount is stated together with how much more or fewer it is than B's; the question
    asks for B's (or both): "Pia has 40, which is 13 more than Tom has." → 40-13."""
    a, b = w.a, w.b
    sg, pl = w.thing
    more = w.chance(0.5)
    x = w.r(5, 100)
    d = w.r(1, x - 1) if more else w.r(1, 60)
    rel = _more_words(w, w.n(d), more, "count")
    s.facts.append(_cap(w.pick(
        f"{w.who(a)} {_has(w)} {w.cnt(x)}, which {_is(w)} {rel} than {w.who(b)} {_has(w)}",
        f"{w.who(a)} {_has(w)} {w.cnt(x)}; that {_is(w)} {rel} than {w.whose(b)} {sg} count",
        f"{w.who(a)} {w.v('owns', 'owned')} {w.cnt(x)}, or {rel} than {w.whom(b)}",
        f"with {w.cnt(x)}, {w.who(a)} {_has(w)} {rel} than {w.whom(b)}",
        f"{w.who(a)} {_has(w)} {rel} {pl} than {w.whom(b)}. {w.who(a)} {_has(w)} {w.cnt(x)}",
    )))  # fmt: skip
    y = s.calc(x, "-" if more else "+", d)
    if w.chance(0.3):
        s.question = w.pick(f"How many {pl} {w.v('do', 'did')} the two have together?", f"How many {pl} {w.v('do', 'did')} {a.name} and {b.name} have in all?")
        s.imperative = "the total of both"
        s.calc(x, "+", y)
    else:
        s.question, s.imperative = ask_count(w, b, w.thing, "now")


def story_compare(w: _W, s: _S) -> None:
    """B has ``d`` more or fewer than A (in counts, prices, lengths, weights or ages); the question
    asks for B's amount or the two together."""
    a, b = w.a, w.b
    sg, pl = w.thing
    more = w.chance(0.5)
    x = w.r(5, 100)
    d = w.r(1, 60) if more else w.r(1, x - 1)
    kind = w.pick("count", "count", "count", "money", "length", "mass", "age")
    both = w.chance(0.35)
    if kind == "count":
        rel = _more_words(w, w.n(d), more, kind)
        fa = _start(w, a, x)
        fb = w.pick(
            f"{w.who(b)} {_has(w)} {rel} {pl} than {w.whom(a)}",
            f"{w.who(b)} {_has(w)} {rel} than {w.whom(a)}",
            f"{w.whose(b)} {sg} count {_is(w)} {w.n(d)} {'higher' if more else 'lower'} than {w.whose(a)}",
            f"{w.who(b)} {w.v('owns', 'owned')} {rel} {pl} than {w.who(a)} {w.v('does', 'did')}",
            f"{w.who(b)} {_is(w)} {w.n(d)} {pl} {'ahead of' if more else 'behind'} {w.whom(a)}",
            f"compared with {w.whom(a)}, {w.who(b)} {_has(w)} {rel}",
        )  # fmt: skip
        order = [fa, fb] if w.chance(0.7) else [fb, fa]  # the relation first: "B has 4 more than A. A has 9."
        s.facts += [_cap(t) for t in order]
        if both:
            s.question, s.imperative = w.pick(
                (f"How many {pl} {w.v('do', 'did')} the two have {w.pick(*_TOTAL, 'between them')}?", "the total of both"),
                (f"How many {pl} {w.v('do', 'did')} {a.name} and {b.name} have together?", f"their combined {sg} count"),
                (f"What is their combined {sg} count?", "their combined count"),
                (f"Together, how many {pl} {w.v('do', 'did')} they own?", f"the number of {pl} they own together"),
            )  # fmt: skip
        else:
            s.question, s.imperative = ask_count(w, b, w.thing, "now")
            if w.chance(0.3):
                s.question = w.pick(f"What {_does(w)} {b.name} have?",
                                    f"How many {_does(w)} {b.name} have?", f"What is {b.pos()} count?")  # fmt: skip
    else:
        if kind == "money":
            t1, t2 = w.pick(("wooden", "metal"), ("small", "large"), ("old", "new"), ("plain", "striped"), ("green", "white"))
            item = w.pick(*FOR_SALE)
            rel = _more_words(w, w.money(d), more, "money")
            s.facts.append(_cap(w.pick(f"a {t1} {item} {w.v('costs', 'cost')} {w.money(x)}", f"a {t1} {item} {w.v('sells', 'sold')} at {w.money(x)}",
                                       f"the {t1} {item} {w.v('sells', 'sold')} for {w.money(x)}")))  # fmt: skip
            s.facts.append(_cap(w.pick(f"the {t2} one {w.v('costs', 'cost')} {w.money(d)} {'more' if more else 'less'}", f"the {t2} one {_is(w)} {rel}",
                                       f"the {t2} {item} {_is(w)} dearer by {w.money(d)}" if more else f"the {t2} {item} {_is(w)} cheaper by {w.money(d)}")))  # fmt: skip
            s.question = w.pick(f"How much for the two {_pl(item)}?", "What is the price of both?", "What is the cost of the pair?") if both else w.pick(
                f"What {w.v('does', 'did')} the {t2} {item} cost?", f"How much {_is(w)} the {t2} one?", f"What is the price of the {t2} {item}?",
                f"How much money {_does(w)} the {t2} {item} cost?")  # fmt: skip
            s.imperative = "the cost of both" if both else f"the price of the {t2} {item}"
        else:
            unit = {"length": ("cm", "centimetres", "metres", "m"), "mass": ("kg", "kilograms", "grams"), "age": ("years",)}[kind]
            u = w.pick(*unit)
            rel = _more_words(w, f"{w.n(d)} {u}" if kind != "age" else w.n(d), more, kind)
            noun = {"length": w.pick("tall", "long"), "mass": "", "age": "old"}[kind]
            if kind == "age":
                s.ages = True
                s.facts += [_cap(w.pick(f"{w.who(a)} {_is(w)} {w.n(x)} years old", f"{w.who(a)} {_is(w)} {w.n(x)}")),
                            _cap(f"{w.who(b)} {_is(w)} {rel} than {w.whom(a)}")]  # fmt: skip
                s.question = w.pick(f"How old {_is(w)} {b.name}?", f"What is {b.pos()} age?", f"What age {_is(w)} {b.name}?") if not both else w.pick(
                    "What is the sum of their ages?", "What are their ages added together?", "How many years do their ages make together?")  # fmt: skip
            else:
                what = w.pick("plant", "tower", "dog", "fence", "tree", "bag", "parcel", "pumpkin", "suitcase") if kind == "mass" or noun == "tall" else w.pick("rope", "ribbon", "path", "scarf")
                s.facts += [_cap(w.pick(f"{w.whose(a)} {what} {w.v('measures', 'measured')} {w.n(x)} {u}",
                                        f"{w.who(a)} {_has(w)} a {what} of {w.n(x)} {u}")),
                            _cap(f"{w.whose(b)} {what} {_is(w)} {rel}")]  # fmt: skip
                measure = {"length": "length" if noun == "long" else "height", "mass": "weight"}[kind]
                s.question = w.pick(f"What is the {measure} of {b.pos()} {what}?", f"How {noun or 'heavy'} {_is(w)} {b.pos()} {what}, in {u}?",
                                    f"What {measure} {_is(w)} {b.pos()} {what}?") if not both else w.pick(
                    f"What is their combined {measure}?", f"What do the two {what}s {'weigh' if kind == 'mass' else 'measure'} together, in {u}?")  # fmt: skip
            s.imperative = ""
    y = s.calc(x, "+" if more else "-", d)
    if both:
        s.calc(x, "+", y)


def story_difference(w: _W, s: _S) -> None:
    """Two amounts stated; the question asks how far apart they are."""
    a, b = w.a, w.b
    sg, pl = w.thing
    x = w.r(5, 100)
    y = w.r(1, x - 1)
    kind = w.pick("count", "count", "points", "money", "length")
    if kind == "points":
        verb = w.pick(("scores", "scored"), ("gets", "got"), ("earns", "earned"))
        what = w.pick("points", "goals", "runs", "marks", "stars")
        s.facts.append(_cap(w.pick(f"{w.who(a)} {w.v(*verb)} {w.n(x)} {what}, but {w.who(b)} only {w.v(*verb)} {w.n(y)}",
                                   f"{w.who(a)} {w.v(*verb)} {w.n(x)} {what} and {w.who(b)} {w.v(*verb)} {w.n(y)}",
                                   f"in the game {w.who(a)} {w.v(*verb)} {w.n(x)} {what}; {w.who(b)} {w.v(*verb)} {w.n(y)} {what}")))  # fmt: skip
        s.question = w.pick(f"By how much {_does(w)} {a.name} beat {b.name}?", f"How many more {what} {_does(w)} {a.name} get than {b.name}?",
                            "How wide is the difference in their scores?", f"By how many {what} {_does(w)} {a.name} lead?",
                            f"How far ahead {_is(w)} {a.name}?", f"What is the difference in {what}?",
                            f"How many fewer {what} {_does(w)} {b.name} get?")  # fmt: skip
        s.imperative = "the winning margin"
    elif kind == "money":
        t1, t2 = w.pick(("metal", "wooden"), ("large", "small"), ("new", "old"))
        item = w.pick(*FOR_SALE)
        s.facts.append(_cap(w.pick(f"a {t1} {item} {w.v('costs', 'cost')} {w.money(x)} and a {t2} one {w.v('costs', 'cost')} {w.money(y)}",
                                   f"the {t1} {item} {_is(w)} {w.money(x)}; the {t2} {item} {_is(w)} {w.money(y)}")))  # fmt: skip
        s.question = w.pick(f"How much dearer {_is(w)} the {t1} {item}?", f"How much more {_does(w)} the {t1} one cost?",
                            "What is the price difference?", f"How much cheaper {_is(w)} the {t2} {item}?",
                            "By how much do the prices differ?", "What is the gap in price?")  # fmt: skip
        s.imperative = "the difference in price"
    elif kind == "length":
        u = w.pick("m", "metres", "cm", "km")
        what = w.pick("rope", "path", "river", "track", "road", "wall")
        s.facts.append(_cap(w.pick(f"the first {what} {_is(w)} {w.n(x)} {u} long and the second {_is(w)} {w.n(y)} {u}",
                                   f"one {what} {w.v('measures', 'measured')} {w.n(x)} {u}, another {w.n(y)} {u}")))  # fmt: skip
        s.question = w.pick(f"How much longer {_is(w)} the first {what}?", f"What is the difference in length, in {u}?",
                            f"By how many {u} do they differ?", f"How much shorter {_is(w)} the second {what}?")  # fmt: skip
        s.imperative = f"the difference in {u}"
    else:
        fa, fb = _start(w, a, x), _start(w, b, y)
        s.facts += [fa, fb]
        s.swappable = True
        s.question = w.pick(
            f"How many more {pl} {_does(w)} {a.name} have than {b.name}?", f"What is the difference between their {sg} counts?",
            f"By how much {_does(w)} {a.pos()} count exceed {b.pos()}?", f"How large is the difference in {pl}?",
            f"How many fewer {pl} {_does(w)} {b.name} have than {a.name}?", f"By how many {pl} {_is(w)} {b.name} behind?",
            f"How many {pl} would {b.name} need to match {a.name}?", "How far apart are their counts?",
            f"What is the difference in {pl}?", f"How many {pl} separate the two?",
        )  # fmt: skip
        s.imperative = w.pick(f"the difference in {pl}", f"how many more {pl} {a.name} {_has(w)}")
    s.calc(x, "-", y)


def story_times(w: _W, s: _S) -> None:
    """B has k times as many as A (or half as many); the question asks for B or both."""
    a, b = w.a, w.b
    sg, pl = w.thing
    k = w.r(2, 12) if w.chance(0.5) else w.pick(2, 2, 3)
    if w.chance(0.2):  # half
        x = 2 * w.r(2, 50)
        s.facts += [_start(w, a, x), _cap(w.pick(f"{w.who(b)} {_has(w)} half as many as {w.whom(a)}",
                                                 f"{w.who(b)} {_has(w)} half as many {pl}", f"{w.whose(b)} count {_is(w)} half {w.whose(a)}"))]  # fmt: skip
        s.question, s.imperative = ask_count(w, b, w.thing, "now")
        s.calc(x, "/", 2)
        return
    x = w.r(2, min(80, MAX_RESULT // (k + 1)))
    word = {2: w.pick("twice", "two times", "double"), 3: w.pick("three times", "triple", "thrice")}.get(k, f"{w.n(k)} times")
    rel = w.pick(
        f"{w.who(b)} {_has(w)} {word} as many {pl} as {w.whom(a)}" if word not in ("double", "triple") else f"{w.who(b)} {_has(w)} {word} {w.whose(a)} number",
        f"{w.whose(b)} {sg} count {_is(w)} {w.n(k)} times {w.whose(a)}",
        f"{w.who(b)} {_has(w)} {w.n(k)} times as many",
    )  # fmt: skip
    s.facts += [_start(w, a, x), _cap(rel)]
    both = w.chance(0.3)
    y = s.calc(x, "*", k) if w.chance(0.5) else s.calc(k, "*", x)
    if both:
        s.question = w.pick(f"How many {pl} {w.v('do', 'did')} they have {w.pick(*_TOTAL, 'between them')}?", f"What is their combined {sg} count?",
                            f"How many {pl} {w.v('do', 'did')} {a.name} and {b.name} have together?")  # fmt: skip
        s.imperative = f"their combined {sg} count"
        s.calc(x, "+", y)
    else:
        s.question, s.imperative = ask_count(w, b, w.thing, "now")
        if w.chance(0.3):
            s.question = w.pick(f"How many {_does(w)} {b.name} have?", f"How many {_does(w)} {b.name} keep?")


def story_groups(w: _W, s: _S) -> None:
    """Equal groups, rates and prices: a product."""
    sg, pl = w.thing
    g, gs = w.group
    h = w.holder()
    k, m = w.r(2, 12), w.r(2, 80)
    if k * m > MAX_RESULT:
        m = MAX_RESULT // k
    form = w.r(0, 3)
    if form == 0:
        s.facts.append(_cap(w.pick(
            f"{w.who(h)} {_has(w)} {w.n(k)} {gs} with {w.n(m)} {pl} in each", f"{w.who(h)} {_has(w)} {w.n(k)} {gs} of {w.n(m)} {pl}",
            f"{w.who(h)} {w.v('fills', 'filled')} {w.n(k)} {gs}, {w.n(m)} {pl} to a {g}", f"there {_are(w)} {w.n(k)} {gs}, {w.n(m)} {pl} per {g}",
            f"{w.who(h)} {w.v('packs', 'packed')} {w.cnt(m)} into each of {w.n(k)} {gs}", f"each of {w.n(k)} {gs} {w.v('holds', 'held')} {w.cnt(m)}",
            f"{w.n(k)} {gs} {w.v('contain', 'contained')} {w.n(m)} {pl} each",
            f"{w.who(h)} {w.v('buys', 'bought')} {w.n(k)} {gs}; every {g} {_has(w)} {w.cnt(m)}", f"{w.who(h)} {w.v('sets', 'set')} out {w.n(k)} {gs} of {w.n(m)}",
            f"{w.who(h)} {_has(w)} {w.n(k)} {gs}, and each {g} {_has(w)} {w.cnt(m)}",
        )))  # fmt: skip
        s.question, s.imperative = ask_count(w, h if w.chance(0.5) else None, w.thing, "total")
        s.calc(k, "*", m)
    elif form == 1:
        h = w.a
        p, ps = w.pick(*PERIODS)
        job = w.pick(*JOBS)
        s.facts.append(_cap(w.pick(
            f"{w.who(h)} {w.v('earns', 'earned')} {w.money(m)} per {p} for {w.n(k)} {ps}", f"{w.who(h)} {_is(w)} paid {w.money(m)} a {p} and {w.v('works', 'worked')} {w.n(k)} {ps}",
            f"{w.who(h)} {w.v('makes', 'made')} {w.money(m)} each {p} {job}", f"{w.who(h)} {w.v('gets', 'got')} {w.money(m)} for every {p} of {job}",
        )))  # fmt: skip
        if "each" in s.facts[-1] or "every" in s.facts[-1]:
            s.facts.append(_cap(w.pick(f"{w.who(h)} {w.v('works', 'worked')} {w.n(k)} {ps}", f"{w.who(h)} {w.v('puts', 'put')} in {w.n(k)} {ps}")))
            s.question = w.pick(f"How much {_does(w)} {h.name} earn?",
                                f"What are {h.pos()} earnings?", f"What {_does(w)} {h.name} earn {w.pick(*_TOTAL)}?", f"How much money {_is(w)} that?")  # fmt: skip
        else:
            s.question = w.pick(f"How much {_does(w)} {h.name} earn {w.pick(*_TOTAL)}?", f"What {_is(w)} {h.pos()} pay?",
                                f"What {_does(w)} {h.name} make?", f"How much money {_does(w)} {h.name} get?")  # fmt: skip
        s.imperative = f"{w.whose(h)} earnings"
        s.calc(m, "*", k)
    elif form == 2:
        m = min(m, 60)
        item = w.pick(*FOR_SALE, sg)
        items = pl if item == sg else _pl(item)
        s.facts.append(_cap(w.pick(
            f"{w.who(h)} {w.v('buys', 'bought')} {w.n(k)} {items} at {w.money(m)} each", f"one {item} {w.v('costs', 'cost')} {w.money(m)}",
            f"{w.who(h)} {w.v('orders', 'ordered')} {w.n(k)} {items} for {w.money(m)} a piece", f"{w.who(h)} {w.v('gets', 'got')} {NUMBER_WORDS[k]} {w.money_adj(m)} {items}",
            f"{w.who(h)} {w.v('picks', 'picked')} up {w.n(k)} {items}, each costing {w.money(m)}",
        )))  # fmt: skip
        if s.facts[-1].lower().startswith("one"):
            s.question = w.pick(f"How much {w.v('do', 'did')} {w.n(k)} {items} cost?", f"What {_is(w)} the price of {w.n(k)} {items}?",
                                f"What would {w.n(k)} {items} cost?", f"What {_does(w)} {h.name} pay for {w.n(k)} {items}?")  # fmt: skip
            s.imperative = f"the cost of {w.n(k)} {items}"
        else:
            s.question = w.pick(f"How much {_does(w)} {h.name} spend?", f"What {_is(w)} the bill?", f"What {_does(w)} {h.name} pay {w.pick(*_TOTAL)}?",
                                f"How much money {w.v('do', 'did')} the {items} cost?", f"What {_is(w)} the total cost?", "What is the cost?")  # fmt: skip
            s.imperative = "the total cost"
        s.calc(k, "*", m)
    else:
        h = w.a
        p, ps = w.pick(("day", "days"), ("week", "weeks"), ("evening", "evenings"), ("weekend", "weekends"))
        unit = w.pick("km", "miles", "laps", "pages", "lengths", "kilometres")
        verb = {"pages": ("reads", "read"), "laps": ("runs", "ran"), "lengths": ("swims", "swam")}.get(unit, w.pick(("jogs", "jogged"), ("walks", "walked"), ("cycles", "cycled"), ("runs", "ran")))
        s.facts.append(_cap(w.pick(
            f"{w.who(h)} {w.v(*verb)} {w.n(m)} {unit} a {p} for {w.n(k)} {ps}",
            f"for {w.n(k)} {ps}, {w.who(h)} {w.v(*verb)} {w.n(m)} {unit} every {p}", f"{w.who(h)} {w.v(*verb)} {w.n(m)} {unit} per {p}, {w.n(k)} {ps} in a row",
        )))  # fmt: skip
        s.question = w.pick(f"How many {unit} {_is(w)} that {w.pick(*_TOTAL)}?", f"How many {unit} {_does(w)} {h.name} do in all?",
                            f"How many {unit} {_does(w)} {h.name} cover {w.pick(*_TOTAL)}?", f"What distance {_does(w)} {h.name} cover?" if unit not in ("pages",)
                            else f"How many pages {_does(w)} {h.name} read?")  # fmt: skip
        s.imperative = f"the total {unit}"
        s.calc(m, "*", k)


def story_share(w: _W, s: _S) -> None:
    """Equal sharing, grouping, cutting and unit prices: a division."""
    sg, pl = w.thing
    h = w.holder()
    k, q = w.r(2, 12), w.r(2, 25)
    t = k * q
    form = w.r(0, 4)
    if form == 0:
        csg, cpl = w.crowd
        s.facts.append(_cap(w.pick(
            f"{w.who(h)} {w.v('shares', 'shared')} {w.cnt(t)} equally among {w.n(k)} {cpl}", f"{w.cnt(t)} {_are(w)} split evenly between {w.n(k)} {cpl}",
            f"{w.who(h)} {w.v('divides', 'divided')} {w.cnt(t)} fairly among {w.n(k)} {cpl}", f"{w.n(k)} {cpl} {w.v('share', 'shared')} {w.cnt(t)} so that all get the same",
            f"{w.who(h)} {w.v('hands', 'handed')} out {w.cnt(t)} to {w.n(k)} {cpl}, the same number to each", f"{w.cnt(t)} {w.v('go', 'went')} equally to {w.n(k)} {cpl}",
        )))  # fmt: skip
        s.question = w.pick(f"How many {pl} {_does(w)} each {csg} get?", f"What share goes to each {csg}?", f"What share {_does(w)} each {csg} receive?",
                            f"How many {_does(w)} each get?", f"How many {_does(w)} a single {csg} get?", f"How many {pl} {_is(w)} in each share?",
                            f"What number of {pl} {_does(w)} every {csg} get?", f"What is each {csg}'s part?")  # fmt: skip
        s.imperative = f"the share of each {csg}"
    elif form == 1:
        g, gs = w.group
        s.facts.append(_cap(w.pick(
            f"{w.who(h)} {_has(w)} {w.cnt(t)} and {w.v('puts', 'put')} {w.n(k)} in each {g}", f"{w.who(h)} {w.v('packs', 'packed')} {w.cnt(t)} into {gs} of {w.n(k)}",
            f"{w.cnt(t)} {_are(w)} sorted into {gs}, {w.n(k)} per {g}",
            f"{w.who(h)} {w.v('carries', 'carried')} {w.cnt(t)}, {w.n(k)} at a time", f"{w.who(h)} {w.v('ties', 'tied')} {w.cnt(t)} into bundles of {w.n(k)}",
        )))  # fmt: skip
        if "at a time" in s.facts[-1]:
            s.question = w.pick(f"How many trips {_does(w)} {h.name} make?", "How many trips are needed?")
        elif "bundles" in s.facts[-1]:
            s.question = w.pick("How many bundles are there?", f"What number of bundles {_does(w)} {h.name} make?")
        else:
            s.question = w.pick(f"How many {gs} {_are(w)} needed?", f"How many {gs} {_does(w)} {h.name} fill?",
                                f"How many {gs} {_is(w)} that?", f"How many full {gs} {_are(w)} there?")  # fmt: skip
        s.imperative = "the number of groups"
    elif form == 2:
        unit = w.pick(*LENGTHS)
        stuff = w.pick(*unit[3])
        u = unit[2] if w.chance(0.5) else unit[1]
        rope = w.pick(f"a {t}-{unit[0]} {stuff}", f"a {stuff} {w.n(t)} {u} long", f"{w.n(t)} {unit[1]} of {stuff}")
        s.facts.append(_cap(w.pick(f"{w.who(h)} {w.v('cuts', 'cut')} {rope} into {w.n(k)} equal pieces", f"{rope} {_is(w)} cut into {w.n(k)} equal parts",
                                   f"{w.who(h)} {w.v('cuts', 'cut')} a {w.n(t)} {u} {stuff} into {w.n(k)} pieces of equal length",
                                   f"{rope} {_is(w)} divided into {w.n(k)} pieces of the same length")))  # fmt: skip
        s.question = w.pick(f"How long {_is(w)} each piece?", f"How many {u} long {_is(w)} each part?",
                            "What is the length of each piece?", "How long is one part?")  # fmt: skip
        s.imperative = "the length of one piece"
    elif form == 3:
        q = min(q, 60)
        t = k * q
        item = w.pick(*FOR_SALE)
        items = _pl(item)
        s.facts.append(_cap(w.pick(
            f"{w.n(k)} {items} {w.v('cost', 'cost')} {w.money(t)}", f"{w.who(h)} {w.v('pays', 'paid')} {w.money(t)} for {w.n(k)} {items}",
            f"{w.n(k)} friends {w.v('share', 'shared')} a bill of {w.money(t)} equally",
        )))  # fmt: skip
        if "friends" in s.facts[-1]:
            s.question = w.pick("How much does each friend pay?", "What does each one owe?", "What is each share?")
            s.imperative = "one friend's share"
        else:
            s.question = w.pick(f"How much {_does(w)} one {item} cost?", f"What is the price of each {item}?", f"What {_is(w)} one {item}?",
                                f"How much {_is(w)} each {item}?")  # fmt: skip
            s.imperative = f"the price of one {item}"
    else:
        unit = w.pick(*VOLUMES, *MASSES)
        stuff = w.pick(*unit[3])
        u = unit[2] if w.chance(0.4) else unit[1]
        csg, cpl = w.crowd
        s.facts.append(_cap(w.pick(                                   f"{w.n(t)} {u} of {stuff} {_is(w)} shared equally by {w.n(k)} {cpl}",
                                   f"{w.who(h)} {w.v('pours', 'poured')} {w.n(t)} {u} of {stuff} equally into {w.n(k)} {w.pick('jugs', 'bottles', 'tubs', 'tins')}")))  # fmt: skip
        s.question = w.pick(f"How much {_does(w)} each one get, in {u}?", f"How many {u} {_is(w)} in each part?", f"What amount goes to each, in {u}?",
                            "How much is in each?")  # fmt: skip
        s.imperative = "the amount in each part"
    s.calc(t, "/", k)


def story_change(w: _W, s: _S) -> None:
    """Change from a payment, for one thing, two things or several at one price."""
    h = w.a
    note = w.pick(10, 20, 20, 50, 50, 100, 100, 200, 500)
    item = w.pick(*FOR_SALE)
    a = "an" if item[0] in "aeiou" else "a"
    sym, one, many = w.cur
    bill = w.pick(f"{sym}{note}" if sym else f"{note} {many}", f"a {sym}{note} bill" if sym else f"a {note}-{one} bill")
    roll = w.rng.random()
    if roll < 0.2 and note >= 20:
        c1 = w.r(1, min(60, note - 2))
        c2 = w.r(1, min(60, note - 1 - c1))
        other = w.pick(*[f for f in FOR_SALE if f != item])
        b2 = "an" if other[0] in "aeiou" else "a"
        s.facts.append(_cap(w.pick(
            f"{w.who(h)} {w.v('buys', 'bought')} {a} {item} for {w.money(c1)} and {b2} {other} for {w.money(c2)}. {w.who(h)} {w.v('pays', 'paid')} with {bill}",
            f"{a} {item} {w.v('costs', 'cost')} {w.money(c1)} and {b2} {other} {w.money(c2)}; {w.who(h)} {w.v('buys', 'bought')} both with {bill}",
        )))  # fmt: skip
        cost = s.calc(c1, "+", c2)
        s.calc(note, "-", cost)
    elif roll < 0.65:
        cost = w.r(1, min(note - 1, 100) if note > 10 else 9)
        s.facts.append(_cap(w.pick(
            f"{w.who(h)} {w.v('buys', 'bought')} {a} {item} for {w.money(cost)} and {w.v('pays', 'paid')} with {bill}",
            f"{w.who(h)} {w.v('pays', 'paid')} for {a} {item} costing {w.money(cost)} with {bill}",
            f"{a} {item} {w.v('costs', 'cost')} {w.money(cost)}. {w.who(h)} {w.v('pays', 'paid')} with {bill}",
        )))  # fmt: skip
        s.calc(note, "-", cost)
    else:
        k = w.r(2, 9)
        p = w.r(1, max(1, min(25, (note - 1) // k)))
        items = _pl(item)
        s.facts.append(_cap(w.pick(
            f"{w.who(h)} {w.v('buys', 'bought')} {w.n(k)} {items} at {w.money(p)} each and {w.v('pays', 'paid')} with {bill}",
            f"{w.who(h)} {w.v('gets', 'got')} {NUMBER_WORDS[k]} {w.money_adj(p)} {items} and {w.v('hands', 'handed')} over {bill}",
        )))  # fmt: skip
        cost = s.calc(k, "*", p)
        s.calc(note, "-", cost)
    s.question = w.pick(f"How much change {_does(w)} {h.name} get?", "How much comes back?",
                        f"How much money {_does(w)} {h.name} get back?", "What is the change?", f"How much {_is(w)} returned to {w.whom(h)}?",
                        f"What change {_is(w)} {h.name} owed?", "How much change is given?")  # fmt: skip
    s.imperative = "the change"


def story_left(w: _W, s: _S) -> None:
    """What is left of a whole: a route, a book, a tank, a job; or an age later or earlier."""
    h = w.a
    if w.chance(0.3):
        x, d = w.r(3, 70), w.r(1, 30)
        later = w.chance(0.6)
        s.ages = True
        if not later and d >= x:
            d = w.r(1, x - 1) if x > 2 else 1
        s.facts.append(_cap(w.pick(f"{w.who(h)} {_is(w)} {w.n(x)} years old", f"{w.who(h)} {_is(w)} {w.n(x)}")))
        if later:
            s.question = w.pick(f"How old will {w.who(h)} be in {w.n(d)} years?", f"What will {w.who(h)} be {w.n(d)} years on?",
                                f"In {w.n(d)} years, how old will {h.name} be?", f"What will {w.whose(h)} age be {w.n(d)} years from now?")  # fmt: skip
        else:
            s.question = w.pick(f"How old was {w.who(h)} {w.n(d)} years ago?", f"What was {w.whose(h)} age {w.n(d)} years earlier?")
        s.imperative = ""
        s.calc(x, "+" if later else "-", d)
        return
    total = w.r(10, 300)
    done = w.r(1, total - 1)
    what = w.pick("route", "book", "tank", "job", "field")
    if what == "route":
        u = w.pick("km", "miles", "kilometres")
        s.facts.append(_cap(w.pick(f"the trail {_is(w)} {total} {u} long", f"a {total}-{'mile' if u == 'miles' else 'km'} drive lies ahead of {w.whom(h)}",
                                   f"it {_is(w)} {total} {u} to the lake")))  # fmt: skip
        s.facts.append(_cap(w.pick(f"{w.who(h)} {w.v('has', 'had')} already covered {w.n(done)} {u}", f"{w.who(h)} {w.v('drives', 'drove')} {w.n(done)} {u}",
                                   f"so far {w.who(h)} {w.v('has', 'had')} gone {w.n(done)} {u}")))  # fmt: skip
        s.question = w.pick(f"How many {u} {_are(w)} left?", "What distance remains?", f"How far {_is(w)} still to go?", f"How many {u} to go?")
    elif what == "book":
        s.facts.append(_cap(w.pick(f"{w.whose(h)} book {w.v('has', 'had')} {total} pages", f"{w.who(h)} {_is(w)} reading a {total}-page book")))
        s.facts.append(_cap(w.pick(f"{w.who(h)} {w.v('has', 'had')} read {w.n(done)} pages", f"{w.who(h)} {w.v('reads', 'read')} {w.n(done)} pages so far")))
        s.question = w.pick("How many pages are left?", f"How many pages {_are(w)} unread?", "What number of pages remain?")
    elif what == "tank":
        u = w.pick("litres", "L", "gallons")
        s.facts.append(_cap(w.pick(f"a tank {w.v('holds', 'held')} {total} {u} of water", f"the tank {_is(w)} full with {total} {u}")))
        s.facts.append(_cap(w.pick(f"{w.n(done)} {u} {_are(w)} used", f"{w.who(h)} {w.v('uses', 'used')} {w.n(done)} {u}", f"{w.n(done)} {u} {w.v('leak', 'leaked')} out")))
        s.question = w.pick(f"How many {u} {_are(w)} left?", "How much water remains?", f"What is left in the tank, in {u}?")
    elif what == "job":
        sg, pl = w.thing
        s.facts.append(_cap(w.pick(f"{w.who(h)} {w.v('needs', 'needed')} to pack {w.cnt(total)}", f"{w.who(h)} {w.v('has', 'had')} to label {w.cnt(total)}")))
        s.facts.append(_cap(w.pick(f"{w.who(h)} {w.v('has', 'had')} done {w.n(done)}", f"{w.n(done)} {_are(w)} finished")))
        s.question = w.pick(f"How many {pl} {_are(w)} still to do?", "How many are left to do?", f"How many {pl} {_does(w)} {h.name} need to finish?")
    else:
        crop = w.pick("rows", "trees", "beds", "plots")
        s.facts.append(_cap(f"a farm {w.v('has', 'had')} {total} {crop} to plant"))
        s.facts.append(_cap(w.pick(f"{w.who(h)} {w.v('plants', 'planted')} {w.n(done)}", f"{w.n(done)} {_are(w)} planted by {w.whom(h)}")))
        s.question = w.pick(f"How many {crop} {_are(w)} left to plant?", f"How many {crop} still need planting?")
    s.imperative = ""
    s.calc(total, "-", done)


def story_chain(w: _W, s: _S) -> None:
    """Two to four steps: a start from a product, a sum or a comparison, then gains and losses,
    sometimes an equal share at the end."""
    sg, pl = w.thing
    h = w.holder()
    g, gs = w.group
    start = w.pick("groups", "groups", "combine", "earn", "plain", "times")
    if start == "groups":
        k, m = w.r(2, 12), w.r(2, 40)
        s.facts.append(_cap(w.pick(
            f"{w.who(h)} {_has(w)} {w.n(k)} {gs} of {w.n(m)} {pl}",
            f"each of {w.n(k)} {gs} {w.v('holds', 'held')} {w.cnt(m)}", f"{w.who(h)} {w.v('fills', 'filled')} {w.n(k)} {gs} with {w.n(m)} {pl} each",
        )))  # fmt: skip
        s.calc(k, "*", m)
    elif start == "combine":
        x, y = w.r(2, 60), w.r(2, 60)
        s.facts.append(_cap(w.pick(f"{w.who(w.a)} {w.v('brings', 'brought')} {w.cnt(x)} and {w.who(w.b)} {w.v('brings', 'brought')} {w.n(y)}",
                                   f"{w.who(w.a)} {_has(w)} {w.cnt(x)} and {w.who(w.b)} {_has(w)} {w.cnt(y)}")))  # fmt: skip
        h = None  # type: ignore[assignment]
        s.calc(x, "+", y)
    elif start == "earn":
        k, m = w.r(2, 12), w.r(2, 40)
        p, ps = w.pick(*PERIODS)
        s.facts.append(_cap(w.pick(f"{w.who(h)} {_is(w)} paid {w.money(m)} a {p}",
                                   f"{w.who(h)} {w.v('saves', 'saved')} {w.money(m)} every {p}")))  # fmt: skip
        s.facts.append(_cap(w.pick(f"{w.who(h)} {w.v('works', 'worked')} {w.n(k)} {ps}", f"this goes on for {w.n(k)} {ps}" if not w.past else f"this went on for {w.n(k)} {ps}")))
        s.calc(m, "*", k)
        s.events = True
        v = s.value
        for _ in range(w.pick(1, 1, 2)):
            if s.value > 2:
                d = w.r(1, min(100, s.value - 1))
                s.facts.append(money_loss(w, h, d))
                s.calc(s.value, "-", d)
        if s.value == v:
            s.facts.append(money_gain(w, h, d := w.r(1, 50)))
            s.calc(s.value, "+", d)
        s.question, s.imperative = ask_money(w, h, "left")
        if w.chance(0.3):
            s.question = w.pick("How much of the pay is left?", f"What sum {_does(w)} {h.name} keep?")
        return
    elif start == "times":
        x, k = w.r(2, 60), w.pick(2, 2, 3)
        word = "twice" if k == 2 else "three times"
        s.facts.append(_cap(f"{w.who(w.a)} {w.v('picks', 'picked')} {w.cnt(x)}"))
        s.facts.append(_cap(f"{w.who(w.b)} {w.v('picks', 'picked')} {word} as many"))
        y = s.calc(x, "*", k)
        s.calc(x, "+", y)
        h = None  # type: ignore[assignment]
    else:
        k = w.r(10, 100)
        s.facts.append(_start(w, h, k))
        s.value = k
    share = w.chance(0.3)
    n_events = w.pick(1, 1, 2) if not share else w.pick(0, 1)
    mood = "now"
    for _ in range(n_events):
        if len(s.steps) >= 3:
            break
        if w.chance(0.5) and s.value <= MAX_RESULT - 5:
            d = w.r(1, min(100, MAX_RESULT - s.value))
            s.facts.append(gain(w, h, d) if h is not None else _cap(w.pick(f"they {w.v('get', 'got')} {w.n(d)} more", f"{w.n(d)} more {pl} {w.v('are', 'were')} added")))
            s.calc(s.value, "+", d)
            mood = "total"
        elif s.value > 2:
            d = w.r(1, min(300, s.value - 1))
            s.facts.append(loss(w, h, d) if h is not None else _cap(w.pick(f"{w.n(d)} of them {w.v('get', 'got')} sold", f"{w.n(d)} {pl} {w.v('are', 'were')} given away",
                                                                           f"they {w.v('eat', 'ate')} {w.n(d)}" if pl in EDIBLE else f"they {w.v('lose', 'lost')} {w.n(d)}")))  # fmt: skip
            s.calc(s.value, "-", d)
            mood = "left"
    s.events = True
    if share:
        divisors = [d for d in range(2, 13) if s.value % d == 0 and 2 <= s.value // d <= 50]
        if divisors:
            k = w.pick(*divisors)
            csg, cpl = w.crowd
            s.facts.append(_cap(w.pick(f"{'they' if h is None else w.who(h)} then {w.v('share' if h is None else 'shares', 'shared')} the {pl} equally among {w.n(k)} {cpl}",
                                       f"the {pl} {_are(w)} then divided fairly among {w.n(k)} {cpl}", f"the pile {_is(w)} split evenly between {w.n(k)} {cpl}")))  # fmt: skip
            s.calc(s.value, "/", k)
            s.question = w.pick(f"How many {pl} {_does(w)} each {csg} get?", f"What share {_does(w)} one {csg} receive?", f"What share goes to each {csg}?",
                                f"How many {_does(w)} each {csg} end up with?")  # fmt: skip
            s.imperative = f"the share of each {csg}"
            return
    if not s.steps or len(s.steps) < 2:
        d = w.r(1, 50)
        if s.value + d <= MAX_RESULT:
            s.facts.append(gain(w, h, d) if h is not None else _cap(f"{w.n(d)} more {pl} {w.v('are', 'were')} added"))
            s.calc(s.value, "+", d)
            mood = "total"
    s.question, s.imperative = ask_count(w, h, w.thing, mood)


def story_drill(w: _W, s: _S) -> None:
    """Bare arithmetic over the ranges the stories use (and a little beyond), one or two operations."""
    op = w.pick("+", "-", "*", "/", "*", "/")
    if op == "+":
        a, b = w.r(1, w.pick(100, 500, 900)), w.r(1, 100)
        b = min(b, MAX_RESULT - a)
        b = max(b, 1)
    elif op == "-":
        a = w.r(2, w.pick(100, 300, 1000))
        b = w.r(1, a - 1)
    elif op == "*":
        a = w.r(2, 12) if w.chance(0.7) else w.r(10, 31)
        b = w.r(2, min(99, MAX_RESULT // a))
        a, b = (a, b) if w.chance(0.5) else (b, a)
    else:
        b = w.r(2, 12) if w.chance(0.7) else w.r(10, 40)
        q = w.r(2, min(50, MAX_RESULT // b))
        a = b * q
    s.calc(a, op, b)
    sym = {"+": ("+", " + ", " plus ", " and "), "-": ("-", " - ", " minus ", " take away "), "*": ("*", " x ", " × ", " times "),
           "/": ("/", " / ", " ÷ ", " divided by ")}[op]  # fmt: skip
    expr = f"{a}{w.pick(*sym[:3] if op != '/' else sym)}{b}"
    if op in "+-" and sym[3] == " and " and w.chance(0.3):
        expr = f"the sum of {a} and {b}" if op == "+" else f"{a} take away {b}"
    if w.chance(0.3) and s.value < MAX_RESULT - 1:
        op2 = w.pick("+", "-")
        c = w.r(1, min(100, MAX_RESULT - s.value)) if op2 == "+" else w.r(1, max(1, s.value - 1))
        if op2 == "+" or s.value > 1:
            s.calc(s.value, op2, c)
            expr = f"{expr}{w.pick(' + ', '+', ' plus ') if op2 == '+' else w.pick(' - ', '-', ' minus ')}{c}"
    s.question = w.pick(f"What is {expr}?", f"Compute {expr}.", f"{expr} = ?", f"{expr}?", f"Work out {expr}.", f"Find {expr}.",
                        f"What do you get from {expr}?", f"Evaluate {expr}.", f"What does {expr} make?", f"What number is {expr}?",
                        f"Give the value of {expr}.", f"Calculate {expr}.")  # fmt: skip


STORIES = {
    "combine": (story_combine, 0.1), "changes": (story_changes, 0.17), "compare": (story_compare, 0.1),
    "compare_back": (story_compare_back, 0.04), "difference": (story_difference, 0.07), "times": (story_times, 0.06), "groups": (story_groups, 0.11),
    "share": (story_share, 0.1), "change": (story_change, 0.06), "left": (story_left, 0.05),
    "chain": (story_chain, 0.12), "drill": (story_drill, 0.05),
}  # fmt: skip


# --------------------------------------------------------------------------------------------
# Distractors and assembly


def _distractors(w: _W, k: int, free: bool, ages: bool = True) -> list[str]:
    """``k`` different sentences with numbers the answer does not use; ``free``: they name nobody
    new; ``ages``: one may give an age."""
    o = w.other
    forms = [f"The thermometer {w.v('reads', 'read')} {w.r(5, 35)} degrees", f"The trip {w.v('takes', 'took')} {w.r(5, 90)} minutes",
             f"The shop {_is(w)} {w.n(w.r(2, 15))} km away", f"There {_are(w)} {w.r(12, 35)} pupils in the class",
             f"The clock {w.v('shows', 'showed')} {w.r(2, 11)} o'clock", f"The street {w.v('has', 'had')} {w.n(w.r(3, 19))} houses",
             f"{w.a.name} {_is(w)} {w.r(6, 70)} years old", f"{w.a.name} {_has(w)} {w.cnt(w.r(2, 40), o)} as well",
             f"{w.a.name} {w.v('lives', 'lived')} at number {w.r(2, 99)}", f"A {w.pick(*FOR_SALE)} {w.v('costs', 'cost')} {w.money(w.r(2, 60))} elsewhere"]  # fmt: skip
    if not free:
        forms += [f"{w.c.name} {_has(w)} {w.cnt(w.r(2, 50), o)}", f"{w.c.name} {_is(w)} {w.r(6, 70)} years old"]
    if not ages:
        forms = [f for f in forms if "years old" not in f]
    return w.rng.sample(forms, k)


def _appose(w: _W, text: str) -> str:
    """``Mo`` → ``Mo, who is 9,`` at the first mention of the first holder (a number not used)."""
    name = w.a.name
    age = w.r(5, 15) if w.chance(0.6) else w.r(20, 70)
    repl = w.pick(f"{name}, who is {age},", f"{age}-year-old {name}", f"{name} ({age})")
    m = re.search(rf"\b{re.escape(name)}\b", text)
    if not m or text[m.end() : m.end() + 1] == "'" or re.search(rf"\b{re.escape(name)} (is|was) \d+ years old", text):
        return text
    return text[: m.start()] + repl + text[m.end() :]


def make_problem(rng: random.Random) -> Problem:
    """One problem (see the module docstring); deterministic for the state of ``rng``."""
    kinds = list(STORIES)
    kind = rng.choices(kinds, [STORIES[k][1] for k in kinds])[0]
    w, s = _W(rng), _S()
    STORIES[kind][0](w, s)
    answer = "\n".join(f"{e} = <<{e}={v}>>{v}" for e, v in s.steps) + f"\n#### {s.steps[-1][1]}"
    final = s.steps[-1][1]
    if kind == "drill":
        return Problem(_cap(s.question), answer, final, f"varied/{kind}")
    facts = [_cap(f) for f in s.facts]
    if s.swappable and rng.random() < 0.4:
        facts[0], facts[1] = facts[1], facts[0]
    if s.events and len(facts) > 1:
        for i in range(1, len(facts)):
            if rng.random() < 0.35:
                facts[i] = f"{rng.choice(TIMES)}, {_decap(facts[i])}"
    n_free = rng.choice((0, 0, 0, 1, 1, 2))
    for t in _distractors(w, n_free, free=True, ages=not s.ages):
        facts.insert(rng.randrange(0, len(facts) + 1), t)
    if rng.random() < 0.25:
        facts.insert(0, _distractors(w, 1, free=False, ages=not s.ages)[0])
    joined: list[str] = []
    for f in facts:
        f = f.rstrip(".")
        if joined and rng.random() < 0.15 and not f.startswith(TIMES):
            joined[-1] = f"{joined[-1]}; {_decap(f)}"
        else:
            joined.append(f)
    body = " ".join(t + "." for t in joined)
    shape = rng.random()
    if s.question_last:
        text = f"{body} {s.question}"
    elif shape < 0.12 and s.imperative:
        verb = rng.choice(("Work out", "Find", "Give", "Compute", "Determine", "State", "Calculate"))
        text = f"{verb} {s.imperative}: {_decap(body)}"
    elif shape < 0.3:
        text = f"{s.question} {body}"
    else:
        text = f"{body} {s.question}"
    text = resolve(w, text)
    if rng.random() < 0.25:  # a describing word before the first count of the thing: "12 shiny pens"
        text = re.sub(rf"\b(\d+|{'|'.join(NUMBER_WORDS)}) {re.escape(w.thing[1])}\b", lambda m: f"{m[1]} {rng.choice(ADJECTIVES)} {w.thing[1]}",
                      text, count=1, flags=re.IGNORECASE)
    if rng.random() < 0.08 and ":" not in text:
        text = f"{rng.choice(LEAD_INS)} {text}"
    if shape >= 0.3 and rng.random() < 0.2 and not s.ages:
        text = _appose(w, text)
    text = re.sub(r"\b([Aa]) (?=[aeiou]|8|11 |18 )", r"\1n ", text.replace("..", "."))
    text = re.sub(r"\b([Aa])n (?=eu|one |uni)", r"\1 ", text)
    return Problem(re.sub(r"\s+", " ", text).strip(), answer, final, f"varied/{kind}")


def _decap(t: str) -> str:
    """``t`` with a lower-case first letter, unless it starts with a name or a people mark."""
    first = t.split(" ", 1)[0].rstrip(",;:'s")
    return t if t.startswith("\x00") or first in _NAMESET or first.rstrip("'") in _NAMESET else t[:1].lower() + t[1:]


def generate_varied(n: int, seed: int) -> list[Problem]:
    """``n`` distinct problems for ``seed`` (a prefix of any longer list for the same seed)."""
    return distinct_problems(redrawn(make_problem), n, seed)

