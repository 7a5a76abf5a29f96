"""``breakgraph bench model-folder``: a servable folder for a bench preset (dummy weights).

The presets are config.json dicts without a tokenizer; ``serve`` and ``bench serve`` need one,
and it must cover the model's vocabulary: a borrowed tokenizer with fewer tokens than the
vocabulary makes most ids the (dummy-weight) model samples decode to no text, so a client's
time to first token and inter-token latency would measure the wait for a printable token, not
the engine. This command writes the preset's ``config.json`` and a byte-level BPE tokenizer
trained on the GSM8K text shipped with breakgraph to exactly the preset's ``vocab_size``
(every id decodes to at least one byte), with the config's BOS/EOS ids set to the tokenizer's.

    breakgraph bench model-folder --preset glm5-tp8-rank --out /tmp/glm5-tp8-rank
    breakgraph serve --model-path /tmp/glm5-tp8-rank --load-format dummy
    breakgraph bench serve --tokenizer /tmp/glm5-tp8-rank --num-prompts 64 --max-concurrency 16
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from breakgraph.bench.presets import PRESETS, preset_folder


def gsm8k_texts() -> list[str]:
    """Questions and answers of the GSM8K files shipped in ``breakgraph/eval/data/gsm8k``."""
    folder = Path(__file__).resolve().parents[1] / "eval" / "data" / "gsm8k"
    texts = []
    for name in ("train.jsonl", "test.jsonl"):
        for line in (folder / name).read_text().splitlines():
            if line.strip():
                row = json.loads(line)
                texts += [row["question"], row["answer"]]
    return texts


EOS = "<|endoftext|>"


def train_covering_tokenizer(vocab_size: int):
    """A byte-level BPE ``tokenizers.Tokenizer`` of exactly ``vocab_size`` tokens (``EOS`` id 0,
    the 256 bytes, then merges learnt from :func:`gsm8k_texts`). Raises ``ValueError`` if the
    corpus cannot fill the vocabulary (ids above it would decode to no text)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, min_frequency=1, special_tokens=[EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False,
    )  # fmt: skip
    tok.train_from_iterator(gsm8k_texts(), trainer=trainer)
    if tok.get_vocab_size() != vocab_size:
        raise ValueError(
            f"the tokenizer reached {tok.get_vocab_size()} tokens, not the vocab_size {vocab_size}: "
            "ids above it would decode to no text"
        )
    return tok


def write_model_folder(preset: str, out: Path) -> Path:
    """Write ``preset``'s config.json (EOS id set to the tokenizer's, no BOS) and a tokenizer
    of exactly its ``vocab_size`` (``tokenizer.json`` + ``tokenizer_config.json``, loadable by
    ``transformers.AutoTokenizer``) into ``out``; returns the folder."""
    tok = train_covering_tokenizer(PRESETS[preset]["vocab_size"])
    folder = preset_folder(preset, out)
    tok.save(str(folder / "tokenizer.json"))
    tok_config = {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": EOS, "bos_token": None,
                  "clean_up_tokenization_spaces": False, "model_max_length": PRESETS[preset]["max_position_embeddings"]}  # fmt: skip
    (folder / "tokenizer_config.json").write_text(json.dumps(tok_config, indent=2) + "\n")
    config = json.loads((folder / "config.json").read_text())
    config["eos_token_id"] = tok.token_to_id(EOS)
    config["bos_token_id"] = None
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    return folder


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--preset", default="glm5-tp8-rank", choices=sorted(PRESETS), help="bench preset to write")
    parser.add_argument("--out", type=Path, default=None,
                        help="folder to write config.json and the tokenizer into (default: ./PRESET)")


def main(args: argparse.Namespace) -> int:
    folder = write_model_folder(args.preset, args.out or Path(args.preset))
    print(f"wrote {folder}: config.json of {args.preset} and a tokenizer of {PRESETS[args.preset]['vocab_size']} tokens")
    print(f"serve it with: breakgraph serve --model-path {folder} --load-format dummy")
    return 0
