"""The demo model's tokenizer: a small byte-level BPE trained on the arithmetic problems.

Design:

- Byte-level: every string encodes (no unknown token) and decoding gives back the exact input; no
  normaliser, no prefix space, no added spaces on decode.
- Digits are always single tokens (``Digits(individual_digits=True)`` before the byte-level
  split). A number is then read and written digit by digit, the same way at every position and
  every magnitude, which is what a tiny model needs to learn carrying; with merged digits, ``347``
  might be ``34|7`` and ``348`` a single token, and each result would be a separate fact to learn.
  The cost is a few more tokens per number. No merge ever contains a digit.
- Special tokens, first in the vocabulary: ``<|endoftext|>`` (id 0, eos; the trainer appends it
  after every example), ``<|pad|>`` (1), ``<|user|>`` (2), ``<|assistant|>`` (3), ``<|system|>`` (4).
  There is no bos token and nothing is added on encode.
- Chat template: each message is ``<|role|>\\n{content}\\n``; an assistant message ends with
  ``<|endoftext|>`` instead of the newline, the way the model ends a reply, and the generation
  prompt is ``<|assistant|>\\n``. One user question renders as
  ``<|user|>\\n{content}\\n<|assistant|>\\n``.

Build and save one (about ten seconds)::

    python -m breakgraph.demo.tokenizer OUT_DIR --gsm8k /path/to/gsm8k/train.jsonl
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Iterable, Iterator
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from breakgraph.demo.problems import format_example, train_split

EOS = "<|endoftext|>"
PAD = "<|pad|>"
USER = "<|user|>"
ASSISTANT = "<|assistant|>"
SYSTEM = "<|system|>"
SPECIAL_TOKENS = (EOS, PAD, USER, ASSISTANT, SYSTEM)

DEFAULT_VOCAB_SIZE = 2048
DEFAULT_MODEL_MAX_LENGTH = 1024

CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{%- if message['role'] not in ['system', 'user', 'assistant'] -%}"
    "{{ raise_exception('chat roles must be system, user or assistant, got ' + message['role']) }}"
    "{%- endif -%}"
    "{{ '<|' + message['role'] + '|>\\n' + message['content'] }}"
    "{%- if message['role'] == 'assistant' -%}{{ '" + EOS + "' }}{%- else -%}{{ '\\n' }}{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<|assistant|>\\n' }}{%- endif -%}"
)


def read_gsm8k_texts(path: str | Path) -> Iterator[str]:
    """GSM8K examples from a ``.jsonl`` file (``question`` and ``answer`` per line) as
    ``"Question: {q}\\nAnswer: {a}"`` texts. Raises ``FileNotFoundError`` naming the path."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"GSM8K file not found: {path} (expected a train.jsonl)")
    with path.open(encoding="utf-8") as f:
        for line in f:
            if line.strip():
                row = json.loads(line)
                yield f"Question: {row['question']}\nAnswer: {row['answer']}"


def build_corpus(
    n_problems: int = 20000,
    seed: int = 0,
    gsm8k_path: str | Path | None = None,
    worded_share: float = 0.0,
    phrased_share: float = 0.0,
    varied_share: float = 0.0,
    choices_share: float = 0.0,
    filled_share: float = 0.0,
) -> Iterator[str]:
    """Training texts for the tokenizer: ``n_problems`` formatted training problems (never test
    ones), the share ``worded_share`` of them from :mod:`breakgraph.demo.wordings`, the share
    ``phrased_share`` from :mod:`breakgraph.demo.phrasebank`, the share ``varied_share`` from
    :mod:`breakgraph.demo.varied`, the share ``choices_share`` from :mod:`breakgraph.demo.choices`,
    the share ``filled_share`` with open-pool fillers (:mod:`breakgraph.demo.fillers`, so the
    merges are learnt on the same kind of text the model is trained on) and the rest from the
    templates, then the GSM8K examples at ``gsm8k_path`` if given, so real questions encode
    compactly too."""
    from breakgraph.demo.choices import generate_choices
    from breakgraph.demo.fillers import generate_filled
    from breakgraph.demo.phrasebank import generate_phrases
    from breakgraph.demo.varied import generate_varied
    from breakgraph.demo.wordings import generate_wordings

    n_worded = int(n_problems * worded_share)
    n_phrased = int(n_problems * phrased_share)
    n_varied = int(n_problems * varied_share)
    n_choices = int(n_problems * choices_share)
    n_filled = int(n_problems * filled_share)
    for problem in train_split(n_problems - n_worded - n_phrased - n_varied - n_choices - n_filled, seed):
        yield format_example(problem)
    for problem in generate_wordings(n_worded, seed):
        yield format_example(problem)
    for problem in generate_phrases(n_phrased, seed):
        yield format_example(problem)
    for problem in generate_varied(n_varied, seed):
        yield format_example(problem)
    if n_choices:
        for problem in generate_choices(n_choices, seed):
            yield format_example(problem)
    if n_filled:
        for problem in generate_filled(n_filled, seed):
            yield format_example(problem)
    if gsm8k_path is not None:
        yield from read_gsm8k_texts(gsm8k_path)


def new_tokenizer() -> Tokenizer:
    """An untrained tokenizer with the demo's byte-level BPE pipeline (see the module docstring)."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    return tok


def train_tokenizer(texts: Iterable[str] | None = None, vocab_size: int = DEFAULT_VOCAB_SIZE) -> Tokenizer:
    """Train the BPE on ``texts`` (default: ``build_corpus()``, generated problems only).

    ``vocab_size`` counts the special tokens and the 256 byte tokens; a corpus with too few
    distinct pairs yields a smaller vocabulary. Deterministic for a given corpus and size.
    """
    if vocab_size < len(SPECIAL_TOKENS) + 256 + 1:
        raise ValueError(
            f"vocab_size must exceed {len(SPECIAL_TOKENS) + 256} (specials + bytes), got {vocab_size}"
        )
    tok = new_tokenizer()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(build_corpus() if texts is None else texts, trainer=trainer)
    return tok


def save_tokenizer(
    tok: Tokenizer, folder: str | Path, model_max_length: int = DEFAULT_MODEL_MAX_LENGTH
) -> Path:
    """Write ``tokenizer.json``, ``tokenizer_config.json`` and ``special_tokens_map.json`` into ``folder``
    (created if missing) and return it.

    The folder loads with ``transformers.AutoTokenizer.from_pretrained(folder)`` (chat template
    included) and with ``tokenizers.Tokenizer.from_file(folder / "tokenizer.json")``. Raises
    ``ValueError`` when a special token is missing from ``tok``'s vocabulary.
    """
    missing = [t for t in SPECIAL_TOKENS if tok.token_to_id(t) is None]
    if missing:
        raise ValueError(f"tokenizer lacks special tokens {missing}; train it with train_tokenizer()")
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    tok.save(str(folder / "tokenizer.json"))
    special = {"eos_token": EOS, "pad_token": PAD, "additional_special_tokens": [USER, ASSISTANT, SYSTEM]}
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": None,
        **special,
        "model_max_length": model_max_length,
        "clean_up_tokenization_spaces": False,
        "chat_template": CHAT_TEMPLATE,
    }
    (folder / "tokenizer_config.json").write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n")
    (folder / "special_tokens_map.json").write_text(json.dumps(special, indent=2) + "\n")
    return folder


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Train and save the demo model's tokenizer.")
    parser.add_argument("out", type=Path, help="folder to write tokenizer.json and its configs into")
    parser.add_argument("--vocab-size", type=int, default=DEFAULT_VOCAB_SIZE)
    parser.add_argument("--problems", type=int, default=20000, help="generated problems in the corpus")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--gsm8k", type=Path, default=None, help="GSM8K train.jsonl to add to the corpus")
    parser.add_argument("--model-max-length", type=int, default=DEFAULT_MODEL_MAX_LENGTH)
    args = parser.parse_args(argv)
    tok = train_tokenizer(build_corpus(args.problems, args.seed, args.gsm8k), args.vocab_size)
    folder = save_tokenizer(tok, args.out, args.model_max_length)
    print(f"wrote {folder} (vocab {tok.get_vocab_size()})")


if __name__ == "__main__":
    main()
