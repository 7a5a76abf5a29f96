"""After sampling: the one step that grows a request's output and decides whether it finished."""

from __future__ import annotations

import time
from collections.abc import Callable

from breakgraph.engine.detokenizer import DirectDecoder
from breakgraph.engine.request import Request
from breakgraph.engine.sampling import Sample


class Postprocessor:
    """Applies each new token and the finish rules, in this order: an EOS id (unless
    ``ignore_eos``) or a stop id finishes with ``stop`` and is not added to the output;
    otherwise the token (with its log-probabilities) is appended and decoded, a completed stop
    string finishes with ``stop`` (the text is cut before it), and reaching ``max_new_tokens``
    or the context length finishes with ``length``. ``finish(req, reason)`` ends a request (and
    frees its pages); ``tokenizer`` ``None`` keeps no text."""

    def __init__(self, tokenizer, eos_ids: set[int], context_length: int, finish: Callable[[Request, str], None]) -> None:
        self.tokenizer = tokenizer
        self._decoder = DirectDecoder.wrap(tokenizer) if tokenizer is not None else None
        self.eos_ids = eos_ids
        self.context_length = context_length
        self.finish = finish

    def __call__(self, reqs: list[Request], samples: list[Sample]) -> None:
        """Apply ``samples[i]`` to ``reqs[i]``."""
        now = time.monotonic()
        for req, s in zip(reqs, samples):
            if req.first_token_time is None:
                req.first_token_time = now
            p = req.params
            if not p.ignore_eos and s.token in self.eos_ids or s.token in p.stop_token_ids:
                self.finish(req, "stop")
                continue
            req.output_ids.append(s.token)
            req.output_logprobs.append(s.logprob)
            if req.top_logprobs_num:
                req.output_top_logprobs.append(s.top)
            if self._decoder is not None and req.detokenizer.append(self._decoder, req.output_ids):
                self.finish(req, "stop")
            elif len(req.output_ids) >= p.max_new_tokens or req.total_len >= self.context_length:
                self.finish(req, "length")
