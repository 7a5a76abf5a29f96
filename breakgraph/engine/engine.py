"""The offline engine: tokenizer → scheduler → model runner → sampler → detokenizer.

Life of an engine, top to bottom in ``__init__``: settle the config, build the model runner
through its executor (load the model, size the paged KV cache, capture graphs: see
:mod:`breakgraph.engine.model_runner`; under tensor parallelism on every rank), then the
tokenizer and the scheduler.
``generate`` and ``prompt_logits`` drive :meth:`Engine.step` until their requests finish.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from breakgraph.engine.config import EngineConfig
from breakgraph.engine.executor import make_executor
from breakgraph.engine.model_runner import BatchEntry, ModelSpec
from breakgraph.engine.postprocess import Postprocessor
from breakgraph.engine.request import Request
from breakgraph.engine.sampling import Sampler, SamplingParams, to_device
from breakgraph.engine.scheduler import Scheduler, SchedulerStats
from breakgraph.forward_context import ForwardMode

logger = logging.getLogger(__name__)


@dataclass
class Completion:
    """The result of one prompt: generated ``text`` and ``token_ids``, why it stopped
    (``stop``/``length``/``abort``), the prompt length and per-token log-probabilities."""

    text: str
    token_ids: list[int]
    finish_reason: str
    prompt_tokens: int
    logprobs: list[float]


@dataclass(frozen=True)
class KVUsage:
    """The paged KV cache in pages: ``used`` by at least one request, ``cached`` (held only for
    prefix reuse, evicted when the pool runs short) and ``total`` (the most a request can get)."""

    used: int
    cached: int
    total: int


class Engine:
    """Offline inference on one device (or, with ``tp_size > 1``, one tensor-parallel job).

    ``Engine(config)`` takes an :class:`~breakgraph.engine.config.EngineConfig`, whose fields
    document every setting; ``Engine(model_path, device=..., ...)`` builds that config from
    keywords (``model_path=None``: the built-in default model), and ``Engine(config, **changes)``
    applies changes to one. ``engine.engine_config`` is the config it runs with; ``engine.config``
    the model's. With ``tp_size > 1`` this process is rank 0 and starts the others (or joins
    torchrun's), one GPU per rank on CUDA: call :meth:`shutdown` (or use ``with Engine(...)``)
    to stop them.

    The public surface — what the server and other callers use — is the methods and properties
    defined on this class plus the attributes ``engine_config``, ``config``, ``model_path``,
    ``context_length``, ``dtype``, ``device`` and ``tokenizer``. The other attributes
    (``scheduler``, ``kv_cache``, ``runner``, ``executor``, ``tp``, ...) are internals, reached
    only by tests and benchmarks.
    """

    def __init__(self, config: EngineConfig | str | Path | None = None, **settings: Any) -> None:
        if isinstance(config, EngineConfig):
            config = config.replace(**settings) if settings else config
        else:
            config = EngineConfig(model_path=config, **settings)
        if config.model_path is None:
            from breakgraph.demo.default_model import default_model_path

            config = config.replace(model_path=str(default_model_path()))
        self.engine_config = cfg = config
        spec = ModelSpec.resolve(cfg)
        self.model_path = Path(cfg.model_path)
        self.config = spec.model_config
        self.context_length = spec.context_length
        self.dtype = spec.dtype
        self.executor = make_executor(cfg, spec)  # under TP: starts (or joins) the other ranks first
        self.tp = self.executor.tp  # the tensor-parallel group (None at TP 1)
        self.runner = self.executor.runner
        self.device, self.model, self.kv_cache = self.runner.device, self.runner.model, self.runner.kv_cache
        try:
            self.tokenizer = _load_tokenizer(self.model_path)
            pool = self.kv_cache.pool
            self.scheduler = Scheduler(
                pool, self.context_length, cfg.max_running_requests, self.runner.max_prefill_tokens,
                watermark_pages=math.ceil(cfg.kv_watermark * pool.capacity_pages),
            )  # fmt: skip
            self.eos_ids = set(self.config.eos_token_ids)
            if self.tokenizer is not None and self.tokenizer.eos_token_id is not None:
                self.eos_ids.add(self.tokenizer.eos_token_id)
            self.sampler = Sampler(self.eos_ids)
            self.postprocess = Postprocessor(self.tokenizer, self.eos_ids, self.context_length, self.scheduler.finish)
        except BaseException:
            self.executor.shutdown()
            raise

    @property
    def chunked_prefill_size(self) -> int:
        """The most prompt tokens a prefill step takes: the config's, capped by the largest
        prefill graph bucket."""
        return self.scheduler.chunked_prefill_size

    @property
    def prefill_backend(self) -> str:
        """The prefill graph backend in use (``disabled``: eager)."""
        return self.runner.prefill_backend

    def set_prefill_backend(
        self, backend: str, buckets: list[int] | tuple[int, ...] | None = None, max_bucket: int | None = None
    ) -> None:
        """(Re)build the prefill graphs on every rank: capture ``buckets`` (default: the ladder up
        to ``max_bucket``, itself defaulting to ``min(chunked_prefill_size, 4096)``) for
        ``backend``; ``disabled`` drops them. Prefill chunks are capped at the largest bucket."""
        self.executor.set_prefill_backend(backend, buckets, max_bucket)
        self.scheduler.chunked_prefill_size = self.runner.max_prefill_tokens

    def graph_stats(self) -> dict:
        """What the prefill graphs did: backend, captured buckets, capture time, graph memory,
        replays, and eager fallbacks by reason (empty counters when graphs are disabled)."""
        return self.runner.graph_stats()

    def kv_usage(self) -> KVUsage:
        """How many KV cache pages are in use, cached for prefix reuse, and in all."""
        pool = self.kv_cache.pool
        return KVUsage(pool.num_used, pool.num_cached_idle, pool.capacity_pages)

    def stats(self) -> SchedulerStats:
        """Counts since the engine started (a copy): tokens prefilled (recomputation after a
        preemption included), prompt tokens reused from the prefix cache, requests preempted
        (their pages released when decode ran short; they resume by recomputation) and the most
        requests running at once."""
        return dataclasses.replace(self.scheduler.stats)

    @property
    def tp_failure(self) -> str | None:
        """Why the tensor-parallel group failed (the engine then refuses every step), or ``None``
        while it is healthy and for a single-process engine."""
        return self.tp.failure if self.tp is not None else None

    def set_prefix_caching(self, enabled: bool) -> None:
        """Turn reuse of cached prompt prefixes on (the default) or off; off drops every cached page."""
        self.scheduler.set_prefix_caching(enabled)

    def shutdown(self) -> None:
        """Stop the other tensor-parallel ranks (nothing to do for a single-process engine)."""
        self.executor.shutdown()

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()

    # -- requests ------------------------------------------------------------------------
    def tokenize(self, prompt: str | list[int]) -> list[int]:
        """Token ids of ``prompt`` (text without added special tokens, or ids checked against the
        vocabulary); raises ``ValueError`` for text without a tokenizer or an id out of range."""
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError(f"{self.model_path} has no tokenizer.json: pass token ids instead of text")
            return self.tokenizer.encode(prompt, add_special_tokens=False)
        ids = list(prompt)
        bad = [t for t in ids if not isinstance(t, int) or not 0 <= t < self.config.vocab_size]
        if bad:
            raise ValueError(f"token id {bad[0]!r} is outside the vocabulary [0, {self.config.vocab_size})")
        return ids

    def add_request(self, prompt: str | list[int], params: SamplingParams | None = None) -> Request:
        """Queue a request; raises ``ValueError`` if it can never fit or ``params`` name a token
        outside the vocabulary."""
        params = params or SamplingParams()
        params.check_vocab(self.config.vocab_size)
        req = Request(self.tokenize(prompt), params)
        self.scheduler.add(req)
        return req

    def check_request(self, prompt_ids: list[int], params: SamplingParams) -> None:
        """Raise ``ValueError`` if a request for ``prompt_ids`` with ``params`` could never be
        served, without queueing it: a :class:`~breakgraph.engine.sampling.SamplingParamError`
        (naming its field) for a token outside the vocabulary, a
        :class:`~breakgraph.engine.scheduler.RequestTooLongError` for an empty prompt, one that
        leaves no room in the context, or one that needs more KV pages than the cache holds."""
        params.check_vocab(self.config.vocab_size)
        self.scheduler.check(Request(prompt_ids, params))

    def abort(self, req: Request) -> None:
        """Stop ``req`` now and free its KV pages."""
        self.scheduler.finish(req, "abort")

    def has_unfinished(self) -> bool:
        """Whether any request is waiting or running."""
        return self.scheduler.num_unfinished > 0

    @property
    def num_waiting(self) -> int:
        """Requests queued, not yet admitted to a batch."""
        return len(self.scheduler.waiting)

    @property
    def num_running(self) -> int:
        """Requests admitted: in prefill or decoding."""
        return len(self.scheduler.running)

    def unfinished(self) -> list[Request]:
        """The requests waiting or running, the waiting first (a copy: aborting them is safe)."""
        return [*self.scheduler.waiting, *self.scheduler.running]

    def flush_cache(self) -> bool:
        """Drop every cached prefix page (they return to the free list). Refused (``False``,
        nothing changes) while any request is waiting or running, whose pages may be shared."""
        if self.has_unfinished():
            return False
        if self.scheduler.prefix_cache is not None:
            self.scheduler.prefix_cache.clear()
        return True

    def step(self) -> list[Request]:
        """Run one forward, sample every request that completed its prompt or decoded, and
        post-process them. Returns the requests that got a new token (or finished)."""
        plan = self.scheduler.schedule()
        if plan is None:
            return []
        entries = [
            BatchEntry(req.token_slice(req.num_computed, req.num_computed + n), req.num_computed, req.pages)
            for req, n in plan.entries
        ]
        batch = self.runner.make_batch(entries, plan.mode)
        want_all = any(req.prompt_logits is not None for req, _ in plan.entries)
        logits = self.executor.forward(batch, all_logits=want_all)
        if plan.mode is ForwardMode.DECODE and not want_all:  # every request gets its next token, rows in order
            progressed = [req for req, _ in plan.entries]
            for req in progressed:
                req.num_computed += 1
            self.postprocess(progressed, self.sampler(logits, progressed))
            return progressed
        progressed, rows, start = [], [], 0
        for b, (req, n) in enumerate(plan.entries):
            row = (start + n - 1) if want_all else b
            if req.prompt_logits is not None:  # prompt positions not collected yet (none twice after a preemption)
                lo, hi = max(req.num_prompt_logits - req.num_computed, 0), min(n, len(req.prompt_ids) - req.num_computed)
                if hi > lo:
                    req.prompt_logits.append(logits[start + lo : start + hi].cpu())
                    req.num_prompt_logits = req.num_computed + hi
            start += n
            req.num_computed += n
            if req.num_computed < req.total_len:
                continue  # more prefill chunks to go
            progressed.append(req)
            rows.append(row)
        if progressed:
            if rows != list(range(logits.shape[0])):
                logits = logits.index_select(0, to_device(rows, torch.int64, logits.device))
            self.postprocess(progressed, self.sampler(logits, progressed))
        return progressed

    # -- offline API ---------------------------------------------------------------------
    def generate(
        self,
        prompts: str | list[int] | list[str] | list[list[int]],
        sampling_params: SamplingParams | list[SamplingParams] | None = None,
    ) -> list[Completion]:
        """Generate for each prompt (text or token ids); all run batched together."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        params = sampling_params if isinstance(sampling_params, list) else [sampling_params] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"got {len(params)} sampling params for {len(prompts)} prompts")
        requests = [Request(self.tokenize(p), sp or SamplingParams()) for p, sp in zip(prompts, params)]
        for req in requests:  # every prompt is checked before any is queued
            self.check_request(req.prompt_ids, req.params)
        self._run_to_completion(requests)
        return [
            Completion(r.text, list(r.output_ids), r.finish_reason or "abort", len(r.prompt_ids), list(r.output_logprobs))
            for r in requests
        ]

    def _run_to_completion(self, requests: list[Request]) -> None:
        """Queue ``requests`` and step until all finish; on any error they are aborted (pages freed)."""
        try:
            for req in requests:
                self.scheduler.add(req)
            while any(not r.finished for r in requests):
                self.step()
        except BaseException:
            for req in requests:
                self.abort(req)
            raise

    def prompt_logits(self, input_ids: list[list[int]]) -> list[torch.Tensor]:
        """fp32 logits ``[len, vocab]`` at every prompt position, computed by the same
        batched (chunked, ragged) prefill path ``generate`` uses."""
        requests = []
        for ids in input_ids:
            req = Request(self.tokenize(ids), SamplingParams(max_new_tokens=1))
            req.prompt_logits = []
            self.scheduler.check(req)
            requests.append(req)
        self._run_to_completion(requests)
        return [torch.cat(r.prompt_logits) for r in requests]


def _load_tokenizer(folder: Path):
    if not (folder / "tokenizer.json").is_file():
        logger.warning("%s has no tokenizer.json; prompts must be token ids", folder)
        return None
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(folder)
