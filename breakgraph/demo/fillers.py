"""Open-vocabulary fillers for the demo mixture: a generated problem with its names, counted
nouns, units and (before a number) its verbs of having replaced by words from a large open pool,
so that the model learns to copy whatever the question says rather than a fixed pool of words::

    Mia had 45 stickers. She gave 17 of them to Omar. How many stickers does Mia have left?
    Drelu had 45 albums. She gave 17 of them to Kosh. How many albums does Drelu have left?

How it works: :func:`fill` reads the words of a problem's question and answer and looks each up in
the lexicon of slot words that the generators draw from (:data:`NAMES`; :data:`NOUNS` and
:data:`UNITS` by singular and plural; :data:`HAVE` by present and past). Each distinct slot word of
a problem is replaced, with a chance per kind, by one filler everywhere it occurs, the singular and
the plural of a noun by the filler's singular and plural, so question and answer stay consistent;
the numbers, the currency symbols, the other words and the answer's calculations are untouched
(:func:`fill` checks that the numbers are the same). The quote line is written afterwards from the
filled question (:func:`~breakgraph.demo.quoting.with_quotes`), so it copies the fillers exactly.

The fillers are of two kinds, half each:

- pronounceable pseudo-words made of two or three random syllables (capitalised for names), so
  the model cannot memorise them;
- real English words of GSM8K's *train* split (``breakgraph/eval/data/gsm8k/train.jsonl``, MIT;
  the test split is never read): names are capitalised words it never writes in lower case, nouns
  are plurals it writes right after a number ("3 albums") together with their singular, verbs are
  regular verbs it writes in their base, ``-s`` and ``-ed`` forms. Words that tell an operation
  ("more", "left", "each", "times", "adds", ...), number words, the quote step's clause breaks, the
  generators' own slot words and every word of the held-out and dev questions are never fillers
  (so those splits still measure copying of words the model never saw). Without the file only
  pseudo-words are used.

:func:`generate_filled` draws problems from the mixture's generators (:data:`BASE_SHARES`) and fills
them; it is the mixture's ``fillers`` source (:mod:`~breakgraph.demo.mixture`).
"""

from __future__ import annotations

import json
import random
import re
from functools import lru_cache
from pathlib import Path

from breakgraph.demo import grammar, phrasebank, problems, varied, wordings
from breakgraph.demo.problems import Problem, _test_keys, normalise_question

GSM8K_TRAIN = Path(__file__).resolve().parent.parent / "eval" / "data" / "gsm8k" / "train.jsonl"

# --------------------------------------------------------------------------------------------
# The generators' slot words

_WEEKDAYS = ("Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday")
# names that are also common words at the start of a sentence
_NOT_NAMES = {"Will", "May", "Joy", "Grace"}
NAMES = (
    frozenset({n for n, _ in problems.NAMES + wordings.PEOPLE + phrasebank.PEOPLE} | set(_WEEKDAYS))
    - _NOT_NAMES
)

# nouns that are also verbs or function words in the generators' sentences
_NOT_NOUNS = {"can", "cans", "present", "presents", "set", "sets", "case", "cases", "point", "points", "pack",
              "packs", "plant", "plants", "watch", "leaf", "leaves", "stick", "sticks", "light", "sweet",
              "sweets", "change", "order", "orders", "ring", "rings", "lock", "locks"}  # fmt: skip


def _plural(word: str) -> str:
    if word.endswith(("s", "x", "z", "sh", "ch")):
        return word + "es"
    if word.endswith("y") and word[-2:-1] not in "aeiou":
        return word[:-1] + "ies"
    return word + "s"


def _singular(plural: str) -> str:
    if plural.endswith("ies"):
        return plural[:-3] + "y"
    if plural.endswith(("shes", "ches", "xes", "sses")):
        return plural[:-2]
    return plural[:-1] if plural.endswith("s") else plural


def _noun_pairs() -> list[tuple[str, str]]:
    pairs = [(sg, pl) for sg, pl, _ in wordings.THINGS + phrasebank.ITEMS]
    pairs += list(
        wordings.BOXES + problems.CONTAINERS + phrasebank.GROUPS + varied.COUNTABLES + varied.GROUPS
    )
    pairs += list(varied.CROWDS + wordings.PERIODS + varied.PERIODS)
    pairs += [
        (w, _plural(w)) for w in wordings.GIFTS + phrasebank.ITEMS_FOR_SALE + problems.GIFTS + problems.EVENTS
    ]
    pairs += [(w, varied._pl(w)) for w in varied.FOR_SALE]
    pairs += [(w, _plural(w)) for w in phrasebank.RELATIVES] + [
        (r.split()[-1], _plural(r.split()[-1])) for r in phrasebank.ROLES
    ]
    pairs += [(_singular(w), w) for w in problems.FOODS + problems.ITEMS]
    pairs += [("year", "years")]
    return pairs


def _unit_pairs() -> list[tuple[str, str]]:
    pairs = [(one, many) for _, one, many in varied.CURRENCIES]
    pairs += [(_singular(w), w) for _, _, w in phrasebank.CURRENCIES]
    pairs += [(_singular(s.strip()), s.strip()) for _, s in wordings.CURRENCIES + problems.CURRENCIES if s]
    for table in (varied.LENGTHS, varied.MASSES, varied.VOLUMES):
        pairs += [(one, many) for one, many, _, _ in table]
    pairs += [(_singular(u), u) for u in problems.DISTANCES + problems.LENGTHS + problems.VOLUMES]
    pairs += [(_singular(u), u) for u, _, _, _ in phrasebank.MEASURES]
    pairs += [("cm", "cm"), ("kg", "kg"), ("km", "km"), ("ml", "ml"), ("ft", "ft"), ("cent", "cents")]
    return pairs


def _lexicon(pairs: list[tuple[str, str]], skip: set[str]) -> dict[str, tuple[tuple[str, str], int]]:
    """word -> (its (singular, plural) pair, 0 for the singular or 1 for the plural); one-word
    entries only, the first pair of a word wins."""
    out: dict[str, tuple[tuple[str, str], int]] = {}
    for sg, pl in pairs:
        if " " in sg or " " in pl or sg in skip or pl in skip:
            continue
        for i, w in enumerate((sg, pl)):
            out.setdefault(w, ((sg, pl), i))
    return out


UNITS = _lexicon(_unit_pairs(), set())
NOUNS = {w: v for w, v in _lexicon(_noun_pairs(), _NOT_NOUNS).items() if w not in UNITS}
# verbs of having, (present, past): replaced only right before a number ("has 12", "held $5")
HAVE = {"has": (("has", "had"), 0), "had": (("has", "had"), 1), "owns": (("owns", "owned"), 0),
        "owned": (("owns", "owned"), 1), "holds": (("holds", "held"), 0), "held": (("holds", "held"), 1),
        "keeps": (("keeps", "kept"), 0), "kept": (("keeps", "kept"), 1)}  # fmt: skip

# --------------------------------------------------------------------------------------------
# The open pools

NUMBER_WORDS = frozenset(wordings.NUMBER_WORDS) | {
    "thirty", "forty", "fifty", "sixty", "seventy", "eighty", "ninety", "hundred", "hundreds", "thousand",
    "thousands", "million", "dozen", "dozens", "half", "halves", "third", "thirds", "quarter", "quarters",
    "twice", "once", "double", "triple", "pair", "pairs", "score", "scores", "percent", "fraction", "fractions",
}  # fmt: skip
# words that tell an operation or a quantity; never a filler
CUE_WORDS = frozenset(
    """and but then while so or if of the a an each every per left more less fewer most least times time total
    totals sum sums difference differences change changes remain remains remainder rest share shares split
    splits group groups equal equally add adds added subtract subtracts multiply divide divides lose loses
    gain gains earn earns earned spend spends save saves saved pay pays paid cost costs price prices sell sells
    buy buys give gives take takes use uses remove removes removed return returns returned donate donates
    borrow borrows lend lends owe owes deposit deposits withdraw collect collects collected receive receives
    received deliver delivers delivered trade trades traded drop drops dropped increase increases increased
    decrease decreases decreased reduce reduces reduced exceed exceeds exceeded discount discounts discounted
    count counts counted double doubles doubled triple triples tripled eat eats drink drinks waste wastes
    wasted burn burns burned miss misses missed break breaks order orders ordered fill fills filled empty
    amount amounts number numbers many much all both some none other another again extra still now rate
    rates week weeks day days hour hours minute minutes month months year years""".split()
)
_BREAKS = {"and", "but", "then", "while", "so"}
_ONSETS = ("b", "d", "f", "g", "h", "k", "l", "m", "n", "p", "r", "s", "t", "v", "w", "z", "br", "dr", "fl",
           "gr", "kl", "pl", "pr", "sk", "sl", "st", "tr", "sh", "ch", "th", "j", "y")  # fmt: skip
_VOWELS = ("a", "e", "i", "o", "u", "a", "e", "o", "ai", "ee", "oo", "ou", "ea", "io")
_CODAS = ("", "", "", "", "", "n", "m", "l", "r", "k", "t", "st", "nd", "sh", "x", "ng")


def pseudo_word(rng: random.Random, syllables: int | None = None) -> str:
    """A pronounceable lower-case pseudo-word of ``syllables`` (default: two, sometimes one or three)
    random syllables, never a number word, a cue word, a slot word or a held-out word."""
    while True:
        k = syllables or rng.choice((1, 2, 2, 2, 2, 3))
        w = "".join(rng.choice(_ONSETS) + rng.choice(_VOWELS) + rng.choice(_CODAS) for _ in range(k))
        if 3 <= len(w) <= 9 and w not in _banned():
            return w


_WORD = re.compile(r"(?<![A-Za-z'])[A-Za-z]+(?![A-Za-z])")


def _slot_words() -> set[str]:
    """The generators' own slot words, lower case: a filler is always a word from outside them."""
    return {w.lower() for w in NAMES} | set(NOUNS) | set(UNITS) | set(HAVE)


@lru_cache(maxsize=1)
def _banned() -> frozenset[str]:
    """Words no filler may be (lower case)."""
    return NUMBER_WORDS | CUE_WORDS | frozenset(_BREAKS) | _slot_words() | _eval_words()


@lru_cache(maxsize=1)
def _eval_words() -> frozenset[str]:
    """The words of the held-out and dev questions (:mod:`~breakgraph.demo.heldout`), lower case.
    They are left out of the real-word pools, so that those splits keep measuring how the model
    copies words it never saw in training, and no five-word run of a held-out question comes
    about by a filler (``tests/test_demo_heldout.py``)."""
    from breakgraph.demo.heldout import dev_phrasings, heldout_phrasings

    return frozenset(
        w.lower() for p in heldout_phrasings() + dev_phrasings() for w in _WORD.findall(p.question)
    )


@lru_cache(maxsize=2)
def gsm8k_pools(
    path: str = str(GSM8K_TRAIN),
) -> tuple[tuple[str, ...], tuple[tuple[str, str], ...], tuple[tuple[str, str], ...]]:
    """``(names, nouns, verbs)`` from the questions of GSM8K's train file at ``path`` (empty when it
    is absent): capitalised words never written in lower case and met at least once inside a
    sentence; (singular, plural) nouns whose plural follows a number; (``-s``, ``-ed``) forms of
    regular verbs. Sorted, so the pools do not depend on the file's order; no cue or number words."""
    if not Path(path).is_file():
        return (), (), ()
    lower: set[str] = set()
    inside: set[str] = set()
    plurals: set[str] = set()
    with open(path, encoding="utf-8") as f:
        for line in f:
            if not line.strip():
                continue
            q = json.loads(line)["question"]
            for m in _WORD.finditer(q):
                w = m.group()
                if w.islower():
                    lower.add(w)
                elif (
                    w[0].isupper()
                    and w[1:].islower()
                    and not re.search(r"(^|[.?!:]\s*|\"\s*)$", q[: m.start()])
                ):
                    inside.add(w)
            plurals.update(re.findall(r"\d (?:[a-z]+ )?([a-z]{3,}s)\b", q))
    bad = _banned()
    names = sorted(w for w in inside if w.lower() not in lower and 3 <= len(w) <= 10 and w.lower() not in bad)
    nouns = []
    for pl in sorted(plurals):
        sg = _singular(pl)
        verb_like = sg + "ed" in lower or sg + "d" in lower or sg + "ing" in lower
        if sg in lower and not verb_like and sg not in bad and pl not in bad and len(sg) >= 3:
            nouns.append((sg, pl))
    verbs = sorted(
        (w + "s", w + "ed") for w in lower
        if len(w) >= 3 and w + "s" in lower and w + "ed" in lower and w not in bad and w + "s" not in bad
        and w + "ed" not in bad and w + "s" not in plurals and not w.endswith(("e", "s", "y"))
    )  # fmt: skip
    return tuple(names), tuple(nouns), tuple(verbs)


# --------------------------------------------------------------------------------------------
# Filling one problem

# chance that a problem's slot words of each kind are filled, then that each distinct word is
P_KIND = {"name": 0.85, "noun": 0.85, "unit": 0.6, "verb": 0.4}
P_WORD = 0.85
P_PSEUDO = 0.5
_NUMBER_NEXT = re.compile(r"\s+(?:[$£€]?\d|(?:" + "|".join(wordings.NUMBER_WORDS) + r")\b)", re.IGNORECASE)
_DIGITS = re.compile(r"\d+")


def _draw(kind: str, rng: random.Random, taken: set[str]) -> tuple[str, str]:
    """A fresh filler of ``kind`` as a (singular, plural) or (present, past) pair, neither word in
    ``taken`` (lower case)."""
    names, nouns, verbs = gsm8k_pools()
    for _ in range(100):
        real = rng.random() >= P_PSEUDO
        if kind == "name":
            w = rng.choice(names) if real and names else pseudo_word(rng).capitalize()
            pair = (w, w)
        elif kind == "verb":
            if real and verbs:
                pair = rng.choice(verbs)
            else:
                w = pseudo_word(rng)
                pair = (_plural(w), w + ("d" if w.endswith("e") else "ed"))
        else:
            if real and nouns:
                pair = rng.choice(nouns)
            else:
                w = pseudo_word(rng, 1 if kind == "unit" and rng.random() < 0.5 else None)
                pair = (w, _plural(w))
        words = {pair[0].lower(), pair[1].lower()}
        if not words & taken and not words & _banned():
            return pair
    raise RuntimeError(f"no fresh {kind} filler in 100 draws")


def fill(problem: Problem, rng: random.Random) -> Problem:
    """``problem`` with its slot words replaced by fillers (see the module docstring); the same
    filler for a word everywhere in the question and the answer, the numbers unchanged.
    Deterministic for the state of ``rng``."""
    kinds = {k for k, p in P_KIND.items() if rng.random() < p}
    taken = {w.lower() for w in _WORD.findall(problem.question + " " + problem.answer)}
    chosen: dict[tuple[str, tuple[str, str]], tuple[str, str] | None] = {}

    def sub(m: re.Match) -> str:
        w = m.group()
        if w in NAMES:
            kind, key, i, cap = "name", (w, w), 0, False
        else:
            lw = w.lower()
            if w != lw and w != lw.capitalize():
                return w
            hit = next(
                ((k, t[lw]) for k, t in (("noun", NOUNS), ("unit", UNITS), ("verb", HAVE)) if lw in t), None
            )
            if hit is None or (hit[0] == "verb" and not _NUMBER_NEXT.match(m.string, m.end())):
                return w
            kind, (key, i), cap = hit[0], hit[1], w != lw
        if kind not in kinds:
            return w
        if (kind, key) not in chosen:
            chosen[(kind, key)] = _draw(kind, rng, taken) if rng.random() < P_WORD else None
            if chosen[(kind, key)]:
                taken.update(x.lower() for x in chosen[(kind, key)])
        new = chosen[(kind, key)]
        if new is None:
            return w
        out = new[i]
        return out[:1].upper() + out[1:] if cap else out

    question = _WORD.sub(sub, problem.question)
    answer = _WORD.sub(sub, problem.answer)
    same = _DIGITS.findall(question) == _DIGITS.findall(problem.question)
    if not same or _DIGITS.findall(answer) != _DIGITS.findall(problem.answer):
        raise AssertionError(f"filling changed the numbers of {problem.question!r}")
    tag = problem.template if problem.template.startswith("fillers/") else f"fillers/{problem.template}"
    return Problem(question, answer, problem.final, tag)


# --------------------------------------------------------------------------------------------
# The mixture source

# generators the filled problems are drawn from, by share
BASE_SHARES = {
    "templates": 0.1,
    "wordings": 0.1,
    "phrases": 0.2,
    "varied": 0.2,
    "grammar": 0.25,
    "choices": 0.15,
}


def _base_generators() -> dict:
    from breakgraph.demo.choices import generate_choices

    return {"templates": problems.train_split, "wordings": wordings.generate_wordings,
            "phrases": phrasebank.generate_phrases, "varied": varied.generate_varied,
            "grammar": grammar.generate_grammar, "choices": generate_choices}  # fmt: skip


def generate_filled(n: int, seed: int) -> list[Problem]:
    """``n`` problems of the generators in :data:`BASE_SHARES` (none in the template test pool),
    each filled (:func:`fill`), shuffled; deterministic for ``seed``."""
    rng = random.Random(seed)
    gens = _base_generators()
    counts = {s: int(n * share / sum(BASE_SHARES.values())) for s, share in BASE_SHARES.items()}
    counts["grammar"] += n - sum(counts.values())
    held = _test_keys()
    out: list[Problem] = []
    for source, k in counts.items():
        sub_seed = rng.randrange(1 << 30)
        if k:
            pool = gens[source](k + k // 10 + 5, sub_seed)
            out += [p for p in pool if normalise_question(p.question) not in held][:k]
    out = [fill(p, rng) for p in out]
    rng.shuffle(out)
    return out
