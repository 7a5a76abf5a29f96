"""Token ids → text: a request's incremental text with its stop strings and stream hold-back
(:class:`IncrementalDetokenizer`), and the text and bytes of single tokens for log-probability
reports (:class:`TokenPieces`). The engine and the server both read text from here only."""

from __future__ import annotations

import bisect
from typing import Any


class StopMatcher:
    """Stop strings in a growing text, found in time linear in the new text.

    :meth:`find` looks only at the end positions of the new text and, at each, only at the
    distinct stop lengths (one set lookup each); :meth:`held` looks only at the last
    ``max_len - 1`` characters and, at each start, binary-searches the sorted stop strings (the
    stop strings a text begins are the ones sorted right after it).
    """

    def __init__(self, stops: list[str]) -> None:
        self._set = set(stops)
        self._sorted = sorted(self._set)
        self._lengths = sorted({len(s) for s in self._set}, reverse=True)
        self._firsts = {s[0] for s in self._set}
        self.max_len = self._lengths[0]

    def find(self, text: str, new_from: int) -> int:
        """Where the first stop string to complete in ``text[new_from:]`` starts (the one that
        ends first; of those ending together, the longest), or -1."""
        for end in range(max(new_from, 0) + 1, len(text) + 1):
            for n in self._lengths:
                if n <= end and text[end - n : end] in self._set:
                    return end - n
        return -1

    def held(self, text: str, start: int = 0) -> int:
        """The earliest ``j >= start`` such that ``text[j:]`` is a proper prefix of a stop string
        (``len(text)`` if none): text from ``j`` on may still turn out to be part of one."""
        for j in range(max(start, len(text) - self.max_len + 1), len(text)):
            if text[j] not in self._firsts:
                continue
            tail = text[j:]
            i = bisect.bisect_left(self._sorted, tail)
            i += i < len(self._sorted) and self._sorted[i] == tail  # a whole stop string is no prefix
            if i < len(self._sorted) and self._sorted[i].startswith(tail):
                return j
        return len(text)


def stable_text_end(text: str, stops: StopMatcher | None, start: int = 0) -> int:
    """How much of ``text`` a stream may send now: not a trailing U+FFFD (an incomplete UTF-8
    sequence the next token may complete) and not a tail that could begin a stop string (the
    text is cut before a stop string once it is complete); ``start``: what was sent already."""
    end = len(text)
    while end > start and text[end - 1] == "\ufffd":
        end -= 1
    if stops is None:
        return end
    return min(end, stops.held(text, start))


class DirectDecoder:
    """``decode(ids, skip_special_tokens=True)`` of a Hugging Face fast tokenizer through its Rust
    backend, without the Python wrapper around it (several times cheaper per call: the engine
    decodes two short windows per request and step). Made by :meth:`wrap` only where that gives
    the same text: the stock ``decode`` and ``_decode`` and no ``clean_up_tokenization_spaces``."""

    def __init__(self, backend: Any) -> None:
        self._decode = backend.decode

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        """The text of ``ids``."""
        return self._decode(ids, skip_special_tokens=skip_special_tokens)

    @classmethod
    def wrap(cls, tokenizer: Any) -> Any:
        """A :class:`DirectDecoder` for ``tokenizer`` where it decodes the same, else ``tokenizer``."""
        try:
            from transformers import PreTrainedTokenizerFast
        except ImportError:
            return tokenizer
        kind = type(tokenizer)
        stock = (
            isinstance(tokenizer, PreTrainedTokenizerFast)
            and kind.decode is PreTrainedTokenizerFast.decode
            and kind._decode is PreTrainedTokenizerFast._decode
            and getattr(tokenizer, "clean_up_tokenization_spaces", True) is False
        )
        return cls(tokenizer.backend_tokenizer) if stock else tokenizer


class IncrementalDetokenizer:
    """A request's output text, decoded token by token, cut before its first stop string.

    Each token decodes only a short window: the tokens since ``read_offset`` against the few
    before it, so a token that completes a multi-byte character or merges with its neighbour
    comes out right; an incomplete UTF-8 sequence (U+FFFD at the end) waits for the next token.
    :meth:`stream_delta` hands out the text a stream may show, holding back a tail that could
    still begin a stop string, so the streamed deltas add up to the final text.
    """

    def __init__(self, stop: list[str]) -> None:
        self.text = ""
        self.stops = StopMatcher(stop) if stop else None
        self._prefix_offset = 0  # output_ids[prefix_offset:read_offset] is decoded again as context
        self._read_offset = 0
        self._sent = 0  # characters of ``text`` handed out by stream_delta

    def append(self, tokenizer, output_ids: list[int]) -> bool:
        """Decode the newest of ``output_ids`` into :attr:`text`; True when a stop string
        completed (the text then ends just before it). ``tokenizer``: anything with the
        ``decode(ids, skip_special_tokens=True)`` of a Hugging Face tokenizer."""
        window = output_ids[self._prefix_offset : self._read_offset]
        prefix = tokenizer.decode(window, skip_special_tokens=True) if window else ""
        full = tokenizer.decode(output_ids[self._prefix_offset :], skip_special_tokens=True)
        if len(full) <= len(prefix) or full.endswith("\ufffd"):
            return False
        old = len(self.text)
        self.text += full[len(prefix) :]
        self._prefix_offset, self._read_offset = self._read_offset, len(output_ids)
        if self.stops is None:
            return False
        cut = self.stops.find(self.text, old)
        if cut < 0:
            return False
        self.text = self.text[:cut]
        return True

    def stream_delta(self, finished: bool) -> str:
        """The text not handed out yet that can no longer change (all of it once ``finished``)."""
        end = len(self.text) if finished else stable_text_end(self.text, self.stops, self._sent)
        delta = self.text[self._sent : end]
        self._sent = max(self._sent, end)
        return delta


def _byte_level_alphabet() -> dict[str, int]:
    """Character → byte of the byte-level BPE alphabet (printable bytes stand for themselves,
    the other bytes are shifted to code points from 256 up, in byte order)."""
    printable = {*range(33, 127), *range(161, 173), *range(174, 256)}  # '!'..'~', '¡'..'¬', '®'..'ÿ'
    table, extra = {}, 0
    for b in range(256):
        if b in printable:
            table[chr(b)] = b
        else:
            table[chr(256 + extra)] = b
            extra += 1
    return table


class TokenPieces:
    """Text and raw bytes of single tokens, for log-probability reports. With a byte-level BPE
    tokenizer the bytes are exact even when a token holds part of a UTF-8 character (its text
    then shows U+FFFD); otherwise the text is the token decoded alone. Not thread-safe."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        backend = getattr(tokenizer, "backend_tokenizer", None)
        decoder = getattr(backend, "decoder", None)
        self._alphabet = _byte_level_alphabet() if type(decoder).__name__ == "ByteLevel" else None
        self._cache: dict[int, tuple[str, bytes]] = {}

    def piece(self, token_id: int) -> tuple[str, bytes]:
        """``(text, raw bytes)`` of ``token_id`` on its own."""
        hit = self._cache.get(token_id)
        if hit is None:
            hit = self._cache[token_id] = self._piece(token_id)
        return hit

    def _piece(self, token_id: int) -> tuple[str, bytes]:
        tok = self.tokenizer
        if tok is None:
            text = f"token_id:{token_id}"
            return text, text.encode()
        if self._alphabet is not None:
            name = tok.convert_ids_to_tokens(token_id)
            if name and name not in tok.all_special_tokens and all(ch in self._alphabet for ch in name):
                raw = bytes(self._alphabet[ch] for ch in name)
                return raw.decode("utf-8", errors="replace"), raw
        text = tok.decode([token_id])
        return text, text.encode()
