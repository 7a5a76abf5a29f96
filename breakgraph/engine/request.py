"""One generation request and its life-cycle state."""

from __future__ import annotations

import enum
import itertools
import time
from dataclasses import dataclass, field

import torch

from breakgraph.engine.sampling import SamplingParams

_ids = itertools.count()


class RequestStatus(enum.Enum):
    WAITING = "waiting"  # queued, no pages yet
    RUNNING = "running"  # has pages; prefilling or decoding
    FINISHED = "finished"


@dataclass(eq=False)
class Request:
    """A prompt being served. ``num_computed`` tokens of ``all_ids`` have their KV in the
    cache; ``pages`` are owned by this request until it finishes or is aborted."""

    prompt_ids: list[int]
    params: SamplingParams
    rid: str = field(default_factory=lambda: f"req-{next(_ids)}")
    output_ids: list[int] = field(default_factory=list)
    output_logprobs: list[float] = field(default_factory=list)
    pages: list[int] = field(default_factory=list)
    num_computed: int = 0
    status: RequestStatus = RequestStatus.WAITING
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    text: str = ""
    arrival_time: float = field(default_factory=time.monotonic)
    first_token_time: float | None = None
    generator: torch.Generator | None = None

    def __post_init__(self) -> None:
        if self.params.seed is not None:
            self.generator = torch.Generator().manual_seed(self.params.seed)

    @property
    def all_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    @property
    def total_len(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def in_prefill(self) -> bool:
        return self.num_computed < len(self.prompt_ids)

    @property
    def finished(self) -> bool:
        return self.status is RequestStatus.FINISHED
