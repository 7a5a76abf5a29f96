"""The host side of a step: the batch layout built per request and page (not per token) equals
the per-token layout, the direct detokenizer decodes what the tokenizer decodes, and the
last-token logits are the same rows of every-token logits."""

from __future__ import annotations

import random

import pytest
import torch

from breakgraph import Engine
from breakgraph.engine.detokenizer import DirectDecoder
from breakgraph.engine.model_runner import BatchEntry, ModelRunner
from breakgraph.forward_context import ForwardMode


def per_token_layout(entries: list[BatchEntry], ps: int) -> dict[str, list]:
    """The layout of a ragged batch token by token: the definition make_batch must meet."""
    out = {"input_ids": [], "positions": [], "token_req": [], "out_cache_loc": []}
    for b, e in enumerate(entries):
        for i, tok in enumerate(e.token_ids):
            pos = e.start + i
            out["input_ids"].append(tok)
            out["positions"].append(pos)
            out["token_req"].append(b)
            out["out_cache_loc"].append(e.pages[pos // ps] * ps + pos % ps)
    width = max(len(e.pages) for e in entries)
    out["page_table"] = [list(e.pages) + [0] * (width - len(e.pages)) for e in entries]
    out["seq_lens"] = [e.start + len(e.token_ids) for e in entries]
    return out


class _Cache:
    def __init__(self, page_size: int) -> None:
        self.page_size = page_size


def _runner(page_size: int) -> ModelRunner:
    runner = ModelRunner.__new__(ModelRunner)  # make_batch reads only the page size and the device
    runner.kv_cache, runner.device = _Cache(page_size), torch.device("cpu")
    return runner


@pytest.mark.parametrize("page_size", [1, 4, 16])
@pytest.mark.parametrize("decode", [True, False])
def test_make_batch_equals_the_per_token_layout(page_size, decode):
    rng = random.Random()  # fresh each run
    runner = _runner(page_size)
    for _ in range(30):
        entries = []
        for _ in range(rng.randint(1, 9)):
            n = 1 if decode else rng.randint(1, 40)
            start = rng.randint(0, 70)
            pages = rng.sample(range(1, 500), -(-(start + n) // page_size) + rng.randint(0, 2))
            entries.append(BatchEntry([rng.randrange(1000) for _ in range(n)], start, pages))
        mode = ForwardMode.DECODE if decode else ForwardMode.EXTEND
        batch = runner.make_batch(entries, mode)
        want = per_token_layout(entries, page_size)
        for name, values in want.items():
            got = getattr(batch, name)
            assert got.dtype == (torch.int32 if name in ("page_table", "seq_lens") else torch.int64), name
            assert got.tolist() == values, name
        assert batch.seq_lens_cpu == want["seq_lens"] and batch.mode is mode
        assert batch.prefix_lens_cpu == [e.start for e in entries]
        assert batch.extend_lens_cpu == [len(e.token_ids) for e in entries]


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    from breakgraph.demo.default_model import default_model_path

    return AutoTokenizer.from_pretrained(default_model_path())


def test_direct_decoder_decodes_what_the_tokenizer_decodes(tokenizer):
    direct = DirectDecoder.wrap(tokenizer)
    assert isinstance(direct, DirectDecoder), "the demo tokenizer is a stock fast tokenizer"
    rng = random.Random()
    special = list(tokenizer.all_special_ids)
    text_ids = tokenizer.encode("héllo wörld ✓ 12+7=19 \U0001f600", add_special_tokens=False)
    for _ in range(300):
        ids = [rng.choice([rng.randrange(tokenizer.vocab_size), rng.choice(special), rng.choice(text_ids)])
               for _ in range(rng.randint(0, 6))]  # fmt: skip
        assert direct.decode(ids, skip_special_tokens=True) == tokenizer.decode(ids, skip_special_tokens=True), ids


def test_direct_decoder_is_not_used_where_the_tokenizer_cleans_up_spaces(tokenizer, monkeypatch):
    monkeypatch.setattr(tokenizer, "clean_up_tokenization_spaces", True)
    assert DirectDecoder.wrap(tokenizer) is tokenizer
    slow = object()
    assert DirectDecoder.wrap(slow) is slow


def test_last_token_logits_are_the_rows_of_every_token_logits():
    from breakgraph.demo.default_model import default_model_path

    engine = Engine(default_model_path(), device="cpu", dtype="float32", page_size=4, load_format="dummy",
                    cuda_graph_backend_prefill="disabled")  # fmt: skip
    pool, runner = engine.kv_cache.pool, engine.runner
    lengths, starts = [5, 1, 9], [0, 3, 2]
    entries = [BatchEntry(list(range(7, 7 + n)), s, pool.alloc(pool.pages_for(s + n + 1))) for n, s in zip(lengths, starts)]
    batch = runner.make_batch(entries, ForwardMode.EXTEND)
    every = runner.forward(batch, all_logits=True)
    last = runner.forward(batch)
    torch.testing.assert_close(last, every[batch.logits_rows], rtol=1e-5, atol=1e-5)
    decode = runner.make_batch([BatchEntry([3], e.start + len(e.token_ids), e.pages) for e in entries], ForwardMode.DECODE)
    torch.testing.assert_close(runner.forward(decode), runner.forward(decode, all_logits=True), rtol=1e-5, atol=1e-5)
