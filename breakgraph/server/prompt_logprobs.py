"""Log-probabilities of a prompt's own tokens (``echo`` with ``logprobs`` on
``/v1/completions``, as loglikelihood evaluations ask), from the engine's prefill.

The engine appends the logits of each prefill chunk to ``Request.prompt_logits`` (the path
``Engine.prompt_logits`` uses; such a request never reuses a cached prefix, so every position
is computed). :class:`PromptLogprobs` stands in for that list and reduces each chunk as it
arrives to what a client is sent — the log-probability of each next prompt token and the
top-k alternatives — so a long prompt holds ``O(len × k)`` numbers, not ``O(len × vocab)``.
"""

from __future__ import annotations

import torch


class PromptLogprobs:
    """Collects, for prompt positions ``1..len-1``, the log-probability of the prompt token
    there given the tokens before it (``logprobs``) and the ``top`` most likely tokens with
    theirs (``top_logprobs``, ``[(token_id, logprob), ...]``; empty lists when ``top`` is 0).
    Both come from one log-softmax, so a token that is the most likely has exactly the top
    value."""

    def __init__(self, prompt_ids: list[int], top: int) -> None:
        self.prompt_ids = prompt_ids
        self.top = top
        self.logprobs: list[float] = []
        self.top_logprobs: list[list[tuple[int, float]]] = []
        self._pos = 0  # prompt position of the next chunk's first row

    def append(self, logits: torch.Tensor) -> None:
        """Take the logits ``[n, vocab]`` of the next ``n`` prompt positions; row ``j``
        predicts the token at position ``pos + j + 1`` (the last row of the prompt predicts
        the first generated token, which is not a prompt token)."""
        n = logits.shape[0]
        targets = self.prompt_ids[self._pos + 1 : self._pos + n + 1]
        self._pos += n
        if not targets:
            return
        logprobs = torch.log_softmax(logits[: len(targets)].float(), dim=-1)
        rows = torch.arange(len(targets))
        self.logprobs += logprobs[rows, torch.tensor(targets)].tolist()
        if self.top:
            values, ids = logprobs.topk(self.top, dim=-1)
            self.top_logprobs += [list(zip(i, v)) for i, v in zip(ids.tolist(), values.tolist())]
        else:
            self.top_logprobs += [[] for _ in targets]
