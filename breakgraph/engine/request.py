"""One generation request and its life-cycle state."""

from __future__ import annotations

import enum
import itertools
import random
from dataclasses import dataclass, field

import torch

from breakgraph.engine.detokenizer import IncrementalDetokenizer
from breakgraph.engine.sampling import SamplerState, SamplingParams

_ids = itertools.count()


class RequestStatus(enum.Enum):
    WAITING = "waiting"  # queued (or preempted), no pages
    RUNNING = "running"  # has pages; prefilling or decoding
    FINISHED = "finished"


@dataclass(eq=False)
class Request:
    """A prompt being served. ``num_computed`` tokens of ``all_ids`` have their KV in the
    cache; ``pages`` are referenced by this request until it finishes, is aborted or is
    preempted (its leading pages may be shared with other requests: they came from the prefix
    cache; ``num_cached_tokens`` prompt tokens did at its first admission). A preempted
    request keeps its output; its prompt and output are recomputed on re-admission
    (``num_preemptions`` counts how often that happened). ``page_keys`` are the prefix-cache keys of the leading full
    pages, computed lazily by the prefix cache. ``prompt_logits``, when a list, collects the
    logits of every prompt position (such a request never reuses a cached prefix;
    ``num_prompt_logits`` positions are collected, so a recomputation adds none twice).
    ``top_logprobs_num`` asks for the most likely alternatives at each generated position;
    the post-processing step appends ``[(token_id, logprob), ...]`` to ``output_top_logprobs``.
    ``seed`` seeds the sampler's noise (``params.seed``, else a random one); ``detokenizer``
    holds the output text; ``sampler_state`` what the sampler keeps of it on the device."""

    prompt_ids: list[int]
    params: SamplingParams
    rid: str = field(default_factory=lambda: f"req-{next(_ids)}")
    output_ids: list[int] = field(default_factory=list)
    output_logprobs: list[float] = field(default_factory=list)
    pages: list[int] = field(default_factory=list)
    num_computed: int = 0
    status: RequestStatus = RequestStatus.WAITING
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    first_token_time: float | None = None
    num_cached_tokens: int = 0  # prompt tokens whose KV came from the prefix cache
    page_keys: list[bytes] = field(default_factory=list)
    num_committed_pages: int = 0  # leading full pages already offered to the prefix cache
    prompt_logits: list[torch.Tensor] | None = None
    num_prompt_logits: int = 0
    num_preemptions: int = 0
    top_logprobs_num: int = 0
    output_top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)
    seed: int = -1
    detokenizer: IncrementalDetokenizer = field(init=False)
    sampler_state: SamplerState | None = None

    def __post_init__(self) -> None:
        if self.seed < 0:
            self.seed = self.params.seed if self.params.seed is not None else random.getrandbits(63)
        self.detokenizer = IncrementalDetokenizer(self.params.stop)

    @property
    def text(self) -> str:
        """The output text so far (cut before a stop string)."""
        return self.detokenizer.text

    @property
    def all_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    def token_slice(self, start: int, end: int) -> list[int]:
        """``all_ids[start:end]`` without building ``all_ids``."""
        n = len(self.prompt_ids)
        if end <= n:
            return self.prompt_ids[start:end]
        if start >= n:
            return self.output_ids[start - n : end - n]
        return self.prompt_ids[start:] + self.output_ids[: end - n]

    @property
    def total_len(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def in_prefill(self) -> bool:
        """Whether the next forward is an extend: the prompt is not all computed, or (after a
        preemption) more than the last token is left to recompute."""
        return self.num_computed < len(self.prompt_ids) or self.total_len - self.num_computed > 1

    @property
    def finished(self) -> bool:
        return self.status is RequestStatus.FINISHED
