"""What the graph runners did, one dataclass for every backend, prefill and decode alike."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any


@dataclass
class BucketInfo:
    """What one bucket's capture produced (``tokens``: the bucket's token count; a decode
    bucket of ``tokens`` requests decodes one token each). ``capture_s`` is the whole time the
    bucket took, its ``warmups`` eager warm-up passes (``warmup_s``) included. ``length_bound``:
    a prefill graph captured for sequences of at most that many tokens (None: for any batch)."""

    tokens: int
    capture_s: float
    segments: int
    breaks: int
    islands: int
    kernels: int | None
    warmup_s: float = 0.0
    warmups: int = 0
    length_bound: int | None = None

    def line(self) -> str:
        k = "?" if self.kernels is None else self.kernels
        bound = f" (sequences ≤ {self.length_bound})" if self.length_bound is not None else ""
        return (
            f"bucket {self.tokens:>5}{bound}: {self.segments} segments, {self.breaks} breaks, "
            f"{self.islands} single-kernel islands, {k} kernels, captured in {self.capture_s:.2f}s "
            f"({self.warmups} warm-up(s) {self.warmup_s:.2f}s)"
        )


@dataclass
class GraphStats:
    """Counters a user can read to see what really ran (``Engine.graph_stats()``).

    ``phase`` is ``prefill`` (buckets are token counts) or ``decode`` (batch sizes)."""

    backend: str
    phase: str = "prefill"
    buckets: list[BucketInfo] = field(default_factory=list)
    capture_s: float = 0.0
    traces: int = 0  # piecewise: torch.compile traces of the body (one serves many buckets)
    graph_memory_bytes: int = 0  # reserved by the graphs' shared memory pool
    capture_memory_bytes: int = 0  # free device memory the capture took (pool + allocator cache)
    replays: int = 0
    replayed_tokens: int = 0
    padded_tokens: int = 0
    fallbacks: Counter = field(default_factory=Counter)

    def warmup_text(self) -> str:
        """``"warm-ups 3.2s: 2 of 19 buckets"``: the eager warm-up passes the capture ran."""
        warmed = [b for b in self.buckets if b.warmups]
        seconds = sum(b.warmup_s for b in self.buckets)
        several = self.phase == "decode" or any(b.length_bound is not None for b in self.buckets)
        return f"warm-ups {seconds:.1f}s: {len(warmed)} of {len(self.buckets)} {'graphs' if several else 'buckets'}"

    def count_replay(self, tokens: int, bucket: int) -> None:
        """One replay of ``bucket`` for a batch of ``tokens``."""
        self.replays += 1
        self.replayed_tokens += tokens
        self.padded_tokens += bucket - tokens

    def as_dict(self) -> dict[str, Any]:
        """The counters as JSON values; a decode report names its buckets ``batch_sizes`` and
        carries only the capture time, replays and fallbacks."""
        sizes = [b.tokens for b in self.buckets]
        capture_s, fallbacks = round(self.capture_s, 3), dict(self.fallbacks)
        if self.phase == "decode":  # a batch size may have a graph per sequence-length bound
            warmups: dict[int, int] = {}
            for b in self.buckets:
                warmups[b.tokens] = warmups.get(b.tokens, 0) + b.warmups
            return {"backend": self.backend, "batch_sizes": sorted(set(sizes)), "capture_s": capture_s,
                    "replays": self.replays, "fallbacks": fallbacks, "warmups": warmups}  # fmt: skip
        anybatch = [b for b in self.buckets if b.length_bound is None]
        bounded: dict[int, list[int]] = {}
        for b in self.buckets:
            if b.length_bound is not None:
                bounded.setdefault(b.length_bound, []).append(b.tokens)
        return {
            "backend": self.backend,
            "captured_buckets": [b.tokens for b in anybatch],
            "bounded_buckets": {bound: sorted(tokens) for bound, tokens in sorted(bounded.items())},
            "capture_s": capture_s,
            "traces": self.traces,
            "graph_memory_bytes": self.graph_memory_bytes,
            "replays": self.replays,
            "replayed_tokens": self.replayed_tokens,
            "padded_tokens": self.padded_tokens,
            "fallbacks": fallbacks,
            "segments": {b.tokens: b.segments for b in anybatch},
            "breaks": {b.tokens: b.breaks for b in anybatch},
            "islands": {b.tokens: b.islands for b in anybatch},
            "warmups": {b.tokens: sum(c.warmups for c in self.buckets if c.tokens == b.tokens) for b in anybatch},
        }


def disabled_stats() -> dict[str, Any]:
    """What ``Engine.graph_stats()`` reports for a phase without graphs."""
    return {"backend": "disabled", "replays": 0, "fallbacks": {}}
