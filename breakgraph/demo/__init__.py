"""The built-in demo: a small GLM-5-architecture model for arithmetic word problems.

``problems`` generates its data (GSM8K answer format, fixed test split); ``tokenizer`` builds its
byte-level BPE tokenizer with single-digit tokens and chat special tokens.
"""

from __future__ import annotations

from breakgraph.demo.problems import (
    Problem,
    extract_answer,
    format_example,
    format_prompt,
    generate,
    normalise_question,
    test_split,
    train_split,
)
from breakgraph.demo.tokenizer import build_corpus, save_tokenizer, train_tokenizer

__all__ = [
    "Problem",
    "build_corpus",
    "extract_answer",
    "format_example",
    "format_prompt",
    "generate",
    "normalise_question",
    "save_tokenizer",
    "test_split",
    "train_split",
    "train_tokenizer",
]
