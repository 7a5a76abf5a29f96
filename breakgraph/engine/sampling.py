"""Sampling parameters and the batched sampler.

:class:`Sampler` picks one token for every row of a batch of logits on the logits' device —
penalties, logit bias, ``min_tokens``, temperature, ``min_p``, top-k, top-p, greedy or seeded
sampling, log-probabilities — and brings the results to the host in one copy per call.

Seeding: sampling is the Gumbel-max trick, ``argmax(filtered_logits / T + g)``, where the noise
``g`` of vocabulary entry ``v`` is a counter-based hash of ``(seed, i, v)``, ``i`` being the
index of the token being sampled (``len(output_ids)``). The host mixes ``seed`` and ``i`` into
two 32-bit keys per row (:func:`row_keys`); the device hashes them with the vocabulary index
(two rounds of the ``lowbias32`` integer mix, :func:`_mix32`) into 23 uniform bits ``u``, and
``g = -log(-log(u))``. A request's draw therefore depends only on its seed and its token index:
the same run to run and whatever else shares the batch (or after its tokens are recomputed). A
request without a seed gets a random one when it is created. The 23-bit uniform bounds the
noise, so a token whose scaled logit is more than ~19 below the best is never drawn (its
probability is below 1e-8).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Protocol

import torch

_M32 = 0xFFFFFFFF


class SamplingParamError(ValueError):
    """A sampling parameter out of range; ``field`` names it."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(message)
        self.field = field


@dataclass
class SamplingParams:
    """How to pick tokens and when to stop.

    ``temperature`` 0 means greedy. ``top_k`` 0 / ``top_p`` 1.0 / ``min_p`` 0 disable those
    filters (``min_p`` keeps the tokens whose probability is at least ``min_p`` times the
    largest). ``stop`` strings end generation (they are not included in the text);
    ``stop_token_ids`` add to the model's EOS ids unless ``ignore_eos``; none of those ids can be
    drawn before ``min_tokens`` tokens are generated. ``seed`` makes sampling reproducible per
    request. Penalties follow OpenAI/vLLM: ``presence_penalty`` is subtracted from the logit of
    every token generated so far, ``frequency_penalty`` times its count; ``repetition_penalty``
    divides the positive (multiplies the negative) logits of every token of the prompt or the
    output. ``logit_bias`` maps token id → a bias added to its logit. Penalties, bias and
    ``min_tokens`` apply to greedy decoding too; reported log-probabilities are those of the
    model's own distribution (temperature 1, nothing applied).
    """

    max_new_tokens: int = 64
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    min_tokens: int = 0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise SamplingParamError("stop", "stop strings must be non-empty strings")
        if self.max_new_tokens < 1:
            raise SamplingParamError("max_new_tokens", f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if self.temperature < 0:
            raise SamplingParamError("temperature", f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise SamplingParamError("top_p", f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise SamplingParamError("top_k", f"top_k must be >= 0, got {self.top_k}")
        if not 0 <= self.min_p <= 1:
            raise SamplingParamError("min_p", f"min_p must be in [0, 1], got {self.min_p}")
        if self.seed is not None and not 0 <= self.seed < 2**63:
            raise SamplingParamError("seed", f"seed must be in [0, 2**63), got {self.seed}")
        if not 0 <= self.min_tokens <= self.max_new_tokens:
            raise SamplingParamError("min_tokens", f"min_tokens must be in [0, max_new_tokens={self.max_new_tokens}], got {self.min_tokens}")
        for name in ("presence_penalty", "frequency_penalty"):
            if not math.isfinite(getattr(self, name)):
                raise SamplingParamError(name, f"{name} must be a finite number, got {getattr(self, name)}")
        if not (math.isfinite(self.repetition_penalty) and self.repetition_penalty > 0):
            raise SamplingParamError("repetition_penalty", f"repetition_penalty must be > 0, got {self.repetition_penalty}")
        self.logit_bias = {int(t): float(b) for t, b in self.logit_bias.items()}
        if any(not math.isfinite(b) for b in self.logit_bias.values()):
            raise SamplingParamError("logit_bias", "logit_bias values must be finite numbers")

    def check_vocab(self, vocab_size: int) -> None:
        """Raise :class:`SamplingParamError` if a token id here is outside ``[0, vocab_size)``."""
        for name, ids in (("stop_token_ids", self.stop_token_ids), ("logit_bias", self.logit_bias)):
            bad = [t for t in ids if not 0 <= t < vocab_size]
            if bad:
                raise SamplingParamError(name, f"{name}: token id {bad[0]} is outside the vocabulary [0, {vocab_size})")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0 or self.top_k == 1

    @property
    def penalized(self) -> bool:
        return self.presence_penalty != 0 or self.frequency_penalty != 0 or self.repetition_penalty != 1


class SamplingInput(Protocol):
    """What the sampler reads of a request (a :class:`~breakgraph.engine.request.Request`)."""

    params: SamplingParams
    seed: int
    prompt_ids: list[int]
    output_ids: list[int]
    top_logprobs_num: int
    sampler_state: SamplerState | None


@dataclass
class SamplerState:
    """What the sampler keeps of a request on the device, made at its first sample:
    ``bias_ids``/``bias_values`` (its logit bias), ``banned`` (the ids ``min_tokens`` holds off),
    and for a penalized request ``counts [vocab]`` (fp32) of each generated token and
    ``in_prompt [vocab]`` (bool) marking the prompt's tokens. ``None`` where not asked for."""

    bias_ids: torch.Tensor | None = None
    bias_values: torch.Tensor | None = None
    banned: torch.Tensor | None = None
    counts: torch.Tensor | None = None
    in_prompt: torch.Tensor | None = None


@dataclass
class Sample:
    """One row's result: the token, its log-probability and the ``top_logprobs_num`` most likely
    ``(token_id, logprob)`` (log-probabilities of the unprocessed distribution)."""

    token: int
    logprob: float
    top: list[tuple[int, float]]


def _mul32(x, c: int):
    """``(x * c) mod 2**32`` for 32-bit words ``x`` (ints or int64 tensors) without overflowing
    int64: ``c`` is split into 16-bit halves."""
    return (x * (c & 0xFFFF) + (((x * (c >> 16)) & 0xFFFF) << 16)) & _M32


def _mix32(x):
    """The ``lowbias32`` integer hash (a bijection of 32-bit words); ints or int64 tensors."""
    x = x ^ (x >> 16)
    x = _mul32(x, 0x7FEB352D)
    x = x ^ (x >> 15)
    x = _mul32(x, 0x846CA68B)
    return x ^ (x >> 16)


def row_keys(seed: int, index: int) -> tuple[int, int]:
    """The two 32-bit keys of the noise for token ``index`` of a request seeded ``seed``."""
    k = _mix32(_mix32(_mix32(seed & _M32) ^ (seed >> 32)) ^ (index & _M32))
    return k, _mix32(k ^ 0x9E3779B9)


def gumbel_noise(keys: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """fp32 Gumbel noise ``[B, vocab_size]`` from int64 ``keys [B, 2]`` (see the module docstring)."""
    v = torch.arange(vocab_size, device=keys.device, dtype=torch.int64)
    h = _mix32(_mix32(v[None, :] ^ keys[:, :1]) ^ keys[:, 1:])
    u = ((h >> 9).to(torch.float32) + 0.5) * 2.0**-23  # in (0, 1), exact in fp32
    return -torch.log(-torch.log(u))


def to_device(values: list, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A host list on ``device`` without waiting for the device (pinned, asynchronous copy)."""
    t = torch.tensor(values, dtype=dtype)
    if device.type == "cuda":
        return t.pin_memory().to(device, non_blocking=True)
    return t.to(device)


class Sampler:
    """Samples one token per row of a batch of fp32 logits, on the logits' device.

    Per call the host builds a few small per-row tensors (copied to the device without a
    wait) and reads the results back in one device→host copy; what a request needs across
    steps (bias, banned ids, penalty counts) stays on the device in its :class:`SamplerState`.
    Nothing is read back before the final copy, and no shape depends on device values.
    """

    def __init__(self, eos_ids: set[int]) -> None:
        self.eos_ids = eos_ids

    @torch.inference_mode()
    def __call__(self, logits: torch.Tensor, reqs: list[SamplingInput]) -> list[Sample]:
        """Sample a token for each of ``reqs`` from ``logits [len(reqs), vocab]``."""
        V = logits.shape[1]
        dev = logits.device
        logits = logits.float()
        logprobs = torch.log_softmax(logits, dim=-1)
        states = self._states(reqs, V, dev)
        processed = self._process(logits, reqs, states)
        greedy = [r.params.greedy for r in reqs]
        if all(greedy):
            tokens = processed.argmax(dim=-1)
        else:
            scores = self.filter(processed, [r.params for r in reqs]) + gumbel_noise(
                to_device([row_keys(r.seed, len(r.output_ids)) for r in reqs], torch.int64, dev), V
            )
            if any(greedy):
                scores = torch.where(to_device(greedy, torch.bool, dev)[:, None], processed, scores)
            tokens = scores.argmax(dim=-1)
        if states is not None:
            self._count(tokens, states)
        parts = [tokens[:, None].double(), logprobs.gather(1, tokens[:, None]).double()]
        k = min(max(r.top_logprobs_num for r in reqs), V)
        if k:
            values, ids = logprobs.topk(k, dim=-1)
            parts += [ids.double(), values.double()]
        rows = torch.cat(parts, dim=1).tolist()  # the one device→host copy
        if not k:
            return [Sample(int(row[0]), row[1], []) for row in rows]
        out = []
        for r, row in zip(reqs, rows):
            n = min(r.top_logprobs_num, k)
            top = [(int(t), lp) for t, lp in zip(row[2 : 2 + n], row[2 + k : 2 + k + n])]
            out.append(Sample(int(row[0]), row[1], top))
        return out

    def process(self, logits: torch.Tensor, reqs: list[SamplingInput]) -> torch.Tensor:
        """``logits [B, vocab]`` (fp32) after each row's logit bias, ``min_tokens`` ban and
        penalties, in vLLM's order; ``logits`` itself when no row asks for any. Makes the
        :class:`SamplerState` of a request that needs one and has none (counts from its
        ``output_ids``)."""
        return self._process(logits, reqs, self._states(reqs, logits.shape[1], logits.device))

    def _states(self, reqs: list[SamplingInput], V: int, dev: torch.device) -> list[SamplerState | None] | None:
        """Each row's :class:`SamplerState` (made where needed), or ``None`` when no row has one."""
        states = [self._state(r, V, dev) if r.sampler_state is None else r.sampler_state for r in reqs]
        return states if any(st is not None for st in states) else None

    def _process(
        self, logits: torch.Tensor, reqs: list[SamplingInput], states: list[SamplerState | None] | None
    ) -> torch.Tensor:
        if states is None:
            return logits
        biased = [(b, st) for b, st in enumerate(states) if st is not None and st.bias_ids is not None]
        banned = [(b, st) for b, (r, st) in enumerate(zip(reqs, states))
                  if st is not None and st.banned is not None and len(r.output_ids) < r.params.min_tokens]  # fmt: skip
        out = logits.clone() if biased or banned else logits
        for b, st in biased:
            out[b].index_add_(0, st.bias_ids, st.bias_values)
        for b, st in banned:
            out[b].index_fill_(0, st.banned, float("-inf"))
        if any(st is not None and st.counts is not None for st in states):
            out = self._penalize(out, reqs, states)
        return out

    def _state(self, r: SamplingInput, V: int, dev: torch.device) -> SamplerState | None:
        p = r.params
        if r.sampler_state is None and (p.logit_bias or p.min_tokens or p.penalized):
            st = r.sampler_state = SamplerState()
            if p.logit_bias:
                st.bias_ids = to_device(list(p.logit_bias), torch.int64, dev)
                st.bias_values = to_device(list(p.logit_bias.values()), torch.float32, dev)
            if p.min_tokens:
                st.banned = to_device(sorted(set(p.stop_token_ids) | (set() if p.ignore_eos else self.eos_ids)), torch.int64, dev)
            if p.penalized:
                st.counts = torch.zeros(V, device=dev)
                if r.output_ids:
                    st.counts.index_put_((to_device(r.output_ids, torch.int64, dev),), st.counts.new_ones(()), accumulate=True)
                st.in_prompt = torch.zeros(V, dtype=torch.bool, device=dev)
                if p.repetition_penalty != 1 and r.prompt_ids:
                    st.in_prompt[to_device(r.prompt_ids, torch.int64, dev)] = True
        return r.sampler_state

    @staticmethod
    def _penalize(logits: torch.Tensor, reqs: list[SamplingInput], states: list[SamplerState | None]) -> torch.Tensor:
        V, dev = logits.shape[1], logits.device
        no_counts = torch.zeros(V, device=dev)
        not_in_prompt = torch.zeros(V, dtype=torch.bool, device=dev)
        penalized = [st is not None and st.counts is not None for st in states]
        counts = torch.stack([st.counts if pen else no_counts for st, pen in zip(states, penalized)])
        in_prompt = torch.stack([st.in_prompt if pen else not_in_prompt for st, pen in zip(states, penalized)])
        pen = to_device(
            [[r.params.repetition_penalty, r.params.frequency_penalty, r.params.presence_penalty] for r in reqs],
            torch.float32, dev,
        )  # fmt: skip
        rep, freq, pres = pen[:, 0:1], pen[:, 1:2], pen[:, 2:3]
        seen = counts > 0
        logits = torch.where(seen | in_prompt, torch.where(logits > 0, logits / rep, logits * rep), logits)
        return logits - freq * counts - pres * seen.float()

    @staticmethod
    def _count(tokens: torch.Tensor, states: list[SamplerState | None]) -> None:
        """Add each penalized row's new token to its counts, on the device."""
        for b, st in enumerate(states):
            if st is not None and st.counts is not None:
                st.counts.index_add_(0, tokens[b : b + 1], torch.ones(1, device=tokens.device))

    @staticmethod
    def filter(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
        """``logits [B, vocab]`` divided by each row's temperature, with the tokens ``min_p``,
        top-k and top-p drop (in that order) set to -inf. Greedy rows get temperature 1 (their
        result is not sampled from)."""
        V = logits.shape[1]
        dev = logits.device
        cfg = to_device(
            [[1.0 if p.greedy else p.temperature, p.min_p, p.top_p, float(min(p.top_k, V) or V)] for p in params],
            torch.float32, dev,
        )  # fmt: skip
        scaled = logits / cfg[:, 0:1]
        if any(p.min_p > 0 for p in params):
            floor = scaled.max(dim=-1, keepdim=True).values + torch.log(cfg[:, 1:2])  # log(0) = -inf keeps all
            scaled = scaled.masked_fill(scaled < floor, float("-inf"))
        if any(p.top_k or p.top_p < 1 for p in params):
            ordered, order = torch.sort(scaled, dim=-1, descending=True)
            kth = ordered.gather(1, cfg[:, 3:4].long() - 1)
            ordered = ordered.masked_fill(ordered < kth, float("-inf"))
            probs = torch.softmax(ordered, dim=-1)
            drop = (probs.cumsum(-1) - probs > cfg[:, 2:3]) & (cfg[:, 2:3] < 1)  # keep the token crossing top_p
            scaled = torch.empty_like(scaled).scatter_(1, order, ordered.masked_fill(drop, float("-inf")))
        return scaled
