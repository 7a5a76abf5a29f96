"""The demo model's data generator and tokenizer (CPU, a few seconds)."""

from __future__ import annotations

import ast
import json
import operator
import re
from fractions import Fraction

import pytest

from breakgraph.demo import problems as P
from breakgraph.demo.tokenizer import (
    ASSISTANT,
    EOS,
    PAD,
    SPECIAL_TOKENS,
    SYSTEM,
    USER,
    build_corpus,
    save_tokenizer,
    train_tokenizer,
)

_ANNOTATION = re.compile(r"(\S+) = (\S*?)<<([^=<>]+)=([^<>]+)>>(\d+)")
_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv}


def _calc(expr: str) -> Fraction:
    """Evaluate a calculator annotation independently of the generator: integers and + - * / only."""

    def ev(node: ast.expr) -> Fraction:
        if isinstance(node, ast.Constant) and isinstance(node.value, int):
            return Fraction(node.value)
        if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
            return _OPS[type(node.op)](ev(node.left), ev(node.right))
        raise AssertionError(f"unexpected syntax in annotation {expr!r}")

    return ev(ast.parse(expr, mode="eval").body)


@pytest.fixture(scope="module")
def sample() -> list[P.Problem]:
    return P.train_split(3000, seed=1) + P.test_split()


# ------------------------------------------------------------------------------------- problems


def test_every_annotation_evaluates_to_its_value_and_the_final_line_matches(sample):
    for p in sample:
        lines = p.answer.split("\n")
        assert lines[-1] == f"#### {p.final}", p.answer
        values = []
        for line in lines[:-1]:
            found = _ANNOTATION.findall(line)
            assert len(found) == 1, line
            shown, _currency, expr, value, after = found[0]
            assert shown == expr and value == after, line
            result = _calc(expr)
            assert result == int(value), f"{expr} = {result}, annotated {value}"
            values.append(int(value))
        assert values[-1] == p.final
        assert all(P.MIN_RESULT <= v <= P.MAX_RESULT for v in values), p.answer


def test_numbers_stay_small_and_results_are_whole_and_positive(sample):
    for p in sample:
        stated = [int(x) for x in re.findall(r"\d+", p.question)]
        assert stated and max(stated) <= 240, p.question  # operands <= 100, dividends <= 240
        assert 2 <= p.final <= 1000
        assert "-" not in p.answer.split("####")[1] and "." not in p.answer.split("####")[1]


def test_one_step_kinds_have_one_line_and_two_step_kinds_two(sample):
    for p in sample:
        steps = p.answer.count("<<")
        assert steps == (2 if p.template.startswith("two/") else 1), p.template


def test_test_split_is_fixed_across_calls_and_pinned():
    a, b = P.test_split(), P.test_split()
    assert a == b and len(a) == 200
    assert P.test_split(50) == a[:50]
    # Pinned so that an edit to the templates or the sampler cannot silently move the test set.
    assert a[0].question == (
        "A crate holds 3 packs, and each pack holds 11 keychains. How many keychains are in 10 crates?"
    )
    assert a[0].final == 330
    assert len({P.normalise_question(p.question) for p in a}) == 200


@pytest.mark.parametrize("seed", [0, P.TEST_SEED])
def test_train_split_never_contains_a_test_question(seed):
    test_keys = {P.normalise_question(p.question) for p in P.test_split(P.TEST_POOL)}
    train = P.train_split(3000, seed)
    keys = [P.normalise_question(p.question) for p in train]
    assert len(train) == 3000 and len(set(keys)) == 3000
    assert not test_keys & set(keys)


def test_normalise_question_ignores_case_punctuation_currency_and_spacing():
    assert P.normalise_question("Mia has $5.  How many?") == P.normalise_question("mia has 5 how many")
    assert P.normalise_question("Mia has 5") != P.normalise_question("Mia has 6")


def test_generate_is_deterministic_per_seed_and_prefix_stable():
    assert P.generate(100, 7) == P.generate(100, 7)
    assert P.generate(40, 7) == P.generate(100, 7)[:40]
    assert P.generate(100, 7) != P.generate(100, 8)
    with pytest.raises(ValueError, match="n must be"):
        P.generate(-1, 0)


def test_every_kind_has_ten_templates_and_all_of_them_appear(sample):
    for kind in ("add", "sub", "mul", "div", "two"):
        assert len(P.TEMPLATES[kind]) >= 10, kind
    all_names = {t.name for ts in P.TEMPLATES.values() for t in ts}
    assert {p.template for p in sample} == all_names


def test_names_objects_and_currencies_vary(sample):
    text = " ".join(p.question for p in sample)
    names = {n for n, _ in P.NAMES if re.search(rf"\b{n}\b", text)}
    objects = {o for o in P.FOODS + P.ITEMS if o in text}
    assert len(P.NAMES) >= 40 and len(names) >= 40
    assert len(P.FOODS + P.ITEMS) >= 40 and len(objects) >= 40
    assert all(c in text for c in ("$", "£", "€", "euros", "rupees", "yen"))


def test_pronouns_agree_with_the_name():
    wrong = {"f": r"\b([Hh]e|[Hh]is|him)\b", "m": r"\b([Ss]he|[Hh]er)\b"}
    checked = 0
    for p in P.generate(1000, 3):
        named = [(n, sex) for n, sex in P.NAMES if re.search(rf"\b{n}\b", p.question + p.answer)]
        if len(named) == 1:
            checked += 1
            assert not re.search(wrong[named[0][1]], p.question + p.answer), p.question
    assert checked > 300


def test_training_text_continues_the_eval_prompt():
    p = P.test_split(1)[0]
    text = P.format_example(p)
    assert text.startswith(P.format_prompt(p.question) + " ")
    assert P.format_prompt("Q?") == "Question: Q?\nAnswer:"
    assert text.endswith(f"#### {p.final}")


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("She has 3+4 = <<3+4=7>>7 apples.\n#### 7", 7),
        ("#### 1,200", 1200),
        ("####-5", -5),
        ("#### $42.", 42),
        ("#### 7\n\nQuestion: Tom has 9 pens.\nAnswer: 9\n#### 9", 7),
        ("The answer is 12 and then 15.", 15),
        ("It costs 3,456 dollars", 3456),
        ("about 12.5 or 7", 7),
        ("no numbers here", None),
        ("####", None),
        ("", None),
    ],
)
def test_extract_answer_on_known_strings(text, expected):
    assert P.extract_answer(text) == expected


def test_extract_answer_reads_every_generated_answer(sample):
    assert all(P.extract_answer(p.answer) == p.final for p in sample)


# ------------------------------------------------------------------------------------ tokenizer


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory):
    tok = train_tokenizer(build_corpus(2000, seed=0), vocab_size=700)
    return save_tokenizer(tok, tmp_path_factory.mktemp("demo_tok"), model_max_length=512)


@pytest.fixture(scope="module")
def raw_tok(tok_dir):
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(tok_dir / "tokenizer.json"))


@pytest.fixture(scope="module")
def hf_tok(tok_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(tok_dir))


_ODD_TEXTS = [
    "  two leading spaces, trailing  ",
    "tabs\tand\nnew\n\nlines\r\n",
    "€12,345.67 £3 ¥9 — naïve café 😀 漢字",
    "<<3*4=12>>12\n#### 12",
    "",
]


def test_tokenizer_round_trips_text_exactly(raw_tok, hf_tok):
    texts = [P.format_example(p) for p in P.test_split(20)] + _ODD_TEXTS
    for text in texts:
        ids = raw_tok.encode(text).ids
        assert raw_tok.decode(ids) == text
        assert hf_tok.encode(text) == ids
        assert hf_tok.decode(ids) == text


def test_digits_are_always_single_tokens(raw_tok):
    for token in raw_tok.get_vocab():
        digits = sum(ch.isdigit() for ch in token)
        assert digits == 0 or len(token) == 1, token
    enc = raw_tok.encode("He has 1234 apples")
    assert [t for t in enc.tokens if t.isdigit()] == ["1", "2", "3", "4"]


def test_prompt_tokens_are_a_prefix_of_the_training_text_tokens(raw_tok):
    for p in P.test_split(20):
        prompt = raw_tok.encode(P.format_prompt(p.question)).ids
        full = raw_tok.encode(P.format_example(p)).ids
        assert full[: len(prompt)] == prompt


def test_special_tokens_have_fixed_ids_and_are_single_tokens(raw_tok, hf_tok):
    assert [raw_tok.token_to_id(t) for t in SPECIAL_TOKENS] == [0, 1, 2, 3, 4]
    assert raw_tok.encode(f"hi{EOS}").ids[-1] == 0
    assert hf_tok.eos_token == EOS and hf_tok.eos_token_id == 0
    assert hf_tok.pad_token == PAD and hf_tok.pad_token_id == 1
    assert hf_tok.bos_token is None
    assert hf_tok.model_max_length == 512
    assert hf_tok.convert_tokens_to_ids([USER, ASSISTANT, SYSTEM]) == [2, 3, 4]
    assert len(hf_tok) <= 700


def test_tokenizer_training_is_deterministic(raw_tok):
    again = train_tokenizer(build_corpus(2000, seed=0), vocab_size=700)
    assert again.get_vocab() == raw_tok.get_vocab()


def test_chat_template_renders_user_turn_with_generation_prompt(hf_tok):
    msgs = [{"role": "user", "content": "What is 2+3?"}]
    text = hf_tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    assert text == "<|user|>\nWhat is 2+3?\n<|assistant|>\n"
    convo = [
        {"role": "system", "content": "Be brief."},
        *msgs,
        {"role": "assistant", "content": "2+3 = <<2+3=5>>5\n#### 5"},
    ]
    text = hf_tok.apply_chat_template(convo, tokenize=False)
    assert text == (
        "<|system|>\nBe brief.\n<|user|>\nWhat is 2+3?\n<|assistant|>\n2+3 = <<2+3=5>>5\n#### 5<|endoftext|>"
    )
    ids = hf_tok.apply_chat_template(msgs, tokenize=True, add_generation_prompt=True, return_dict=False)
    assert ids[0] == 2 and ids[-2:] == [3, hf_tok.encode("\n")[0]]
    with pytest.raises(Exception, match="chat roles"):
        hf_tok.apply_chat_template([{"role": "tool", "content": "x"}], tokenize=False)


def test_saved_configs_name_the_special_tokens(tok_dir):
    config = json.loads((tok_dir / "tokenizer_config.json").read_text())
    assert config["eos_token"] == EOS and config["pad_token"] == PAD and config["bos_token"] is None
    assert config["model_max_length"] == 512 and "<|assistant|>" in config["chat_template"]
    special = json.loads((tok_dir / "special_tokens_map.json").read_text())
    assert special["eos_token"] == EOS and special["pad_token"] == PAD
