"""The request lifecycle after sampling: stop strings found and held back in linear time,
incremental text, the finish rules, and streamed deltas that add up to the final text."""

from __future__ import annotations

import random
import time

import pytest
import torch

from breakgraph import Engine, SamplingParams
from breakgraph.engine.detokenizer import IncrementalDetokenizer, StopMatcher, stable_text_end


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    from breakgraph.demo.default_model import default_model_path

    return AutoTokenizer.from_pretrained(default_model_path())


def brute_find(text: str, new_from: int, stops: list[str]) -> int:
    """Start of the stop string that ends first after ``new_from`` (longest on a tie), or -1."""
    for end in range(new_from + 1, len(text) + 1):
        starts = [end - len(s) for s in stops if end - len(s) >= 0 and text[end - len(s) : end] == s]
        if starts:
            return min(starts)
    return -1


def brute_held(text: str, stops: list[str]) -> int:
    tails = [j for j in range(len(text)) if any(s.startswith(text[j:]) and s != text[j:] for s in stops)]
    return min(tails, default=len(text))


def test_stop_matcher_equals_brute_force_on_random_text():
    rng = random.Random()  # fresh each run
    for _ in range(300):
        stops = ["".join(rng.choices("ab", k=rng.randint(1, 5))) for _ in range(rng.randint(1, 4))]
        text = "".join(rng.choices("abc", k=rng.randint(0, 14)))
        new_from = rng.randint(0, len(text))
        m = StopMatcher(stops)
        assert m.find(text, new_from) == brute_find(text, new_from, stops), (text, new_from, stops)
        assert m.held(text) == brute_held(text, stops), (text, stops)


def test_stream_holds_back_incomplete_characters_and_stop_prefixes():
    assert stable_text_end("abc\ufffd", None) == 3
    assert stable_text_end("hello wo", StopMatcher(["world"])) == len("hello ")
    assert stable_text_end("hello", StopMatcher(["xyz"])) == 5
    assert stable_text_end("hello wo", StopMatcher(["world"]), start=7) == 8  # "w" was sent already


def stream_all(tokenizer, ids: list[int], stops: list[str]) -> tuple[str, str, bool]:
    detok = IncrementalDetokenizer(stops)
    streamed, stopped = "", False
    for i in range(1, len(ids) + 1):
        stopped = detok.append(tokenizer, ids[:i])
        streamed += detok.stream_delta(finished=stopped or i == len(ids))
        if stopped:
            break
    return detok.text, streamed, stopped


def test_streamed_deltas_add_up_to_the_cut_text(tokenizer):
    rng = random.Random()
    for _ in range(40):
        ids = [rng.randrange(len(tokenizer)) for _ in range(30)]
        full = tokenizer.decode(ids, skip_special_tokens=True)
        whole, streamed, _ = stream_all(tokenizer, ids, [])
        assert streamed == whole
        if full.endswith("\ufffd"):  # an incomplete last character never shows
            assert full.startswith(whole)
            continue
        assert whole == full
        if len(full) < 8:
            continue
        a = rng.randrange(len(full) - 4)
        stops = [full[a : a + rng.randint(1, 4)], full[a : a + 2] + "\u00a7\u00a7", "\u00a7never"]
        text, streamed, stopped = stream_all(tokenizer, ids, stops)
        assert streamed == text and stopped
        assert text == full[: brute_find(full, 0, stops)]


def test_twenty_thousand_long_stop_strings_are_checked_in_linear_time(tokenizer):
    """The case that stalled the server for a minute: every token re-scanned every stop string
    at every length."""
    rng = random.Random()
    stops = ["".join(rng.choices("abcdefgh ", k=400)) for _ in range(20_000)]
    ids = tokenizer.encode("a b c d e f g h " * 40)[:200]
    t0 = time.perf_counter()
    text, streamed, stopped = stream_all(tokenizer, ids, stops)
    elapsed = time.perf_counter() - t0
    assert not stopped and streamed == text == tokenizer.decode(ids)
    assert elapsed < 5, f"{elapsed:.1f}s for 200 tokens"


def test_engine_cuts_at_the_first_stop_string_and_streams_equal_text():
    engine = Engine(None, device="cpu", dtype="float32")
    prompt = "Question: 3 plus 4?\nAnswer:"
    free = engine.generate([prompt], SamplingParams(max_new_tokens=12, ignore_eos=True))[0]
    stops = [free.text[4:7], free.text[2:4] + "\u00a7", "".join(random.choices("xyz", k=400))]
    req = engine.add_request(prompt, SamplingParams(max_new_tokens=12, ignore_eos=True, stop=stops))
    streamed = ""
    while not req.finished:
        engine.step()
        streamed += req.detokenizer.stream_delta(req.finished)
        assert req.text.startswith(streamed)
    assert req.finish_reason == "stop" and streamed == req.text == free.text[: brute_find(free.text, 0, stops)]


def test_min_tokens_holds_off_eos_then_lets_it_finish(hf_checkpoints):
    engine = Engine(hf_checkpoints["glm_moe_dsa"], device="cpu", dtype="float32", page_size=4)
    prompt = torch.randint(0, 128, (8,)).tolist()
    free = engine.generate([prompt], SamplingParams(max_new_tokens=10, ignore_eos=True))[0].token_ids
    stop_id = free[1]
    early = engine.generate([prompt], SamplingParams(max_new_tokens=10, stop_token_ids=[stop_id]))[0]
    assert early.finish_reason == "stop" and len(early.token_ids) == free.index(stop_id)
    held = engine.generate([prompt], SamplingParams(max_new_tokens=10, stop_token_ids=[stop_id], min_tokens=4))[0]
    assert len(held.token_ids) >= 4 and stop_id not in held.token_ids
    assert held.finish_reason == ("length" if len(held.token_ids) == 10 else "stop")
