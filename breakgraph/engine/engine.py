"""The offline engine: tokenizer → scheduler → model runner → sampler → detokenizer.

Life of an engine, top to bottom in ``__init__``: read the config, load the model, size the
paged KV cache, set up the scheduler (and, with a graph backend, capture prefill graphs).
``generate`` and ``prompt_logits`` drive :meth:`Engine.step` until their requests finish.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from breakgraph.engine.config import PREFILL_BACKENDS, EngineConfig
from breakgraph.engine.decode_graphs import DecodeGraphRunner, default_decode_buckets
from breakgraph.engine.kv_cache import KVCache
from breakgraph.engine.model_runner import BatchEntry, ModelRunner
from breakgraph.engine.request import Request
from breakgraph.engine.sampling import SamplingParams, sample
from breakgraph.engine.scheduler import Scheduler
from breakgraph.forward_context import ForwardMode
from breakgraph.graphs.prefill_runner import PrefillGraphRunner, default_prefill_buckets
from breakgraph.models.config import ModelConfig
from breakgraph.models.loader import load_model

logger = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class Completion:
    """The result of one prompt: generated ``text`` and ``token_ids``, why it stopped
    (``stop``/``length``/``abort``), the prompt length and per-token log-probabilities."""

    text: str
    token_ids: list[int]
    finish_reason: str
    prompt_tokens: int
    logprobs: list[float]


def resolve_dtype(dtype: str | torch.dtype | None, device: torch.device) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype in (None, "auto"):
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if dtype not in DTYPES:
        raise ValueError(f"--dtype must be one of {['auto', *DTYPES]}, got {dtype!r}")
    return DTYPES[dtype]


class Engine:
    """Offline inference on one device (or, with ``tp_size > 1``, one tensor-parallel job).

    ``Engine(config)`` takes an :class:`~breakgraph.engine.config.EngineConfig`, whose fields
    document every setting; ``Engine(model_path, device=..., ...)`` builds that config from
    keywords (``model_path=None``: the built-in default model), and ``Engine(config, **changes)``
    applies changes to one. ``engine.engine_config`` is the config it runs with; ``engine.config``
    the model's. With ``tp_size > 1`` this process is rank 0 and starts the others (or joins
    torchrun's), one GPU per rank on CUDA: call :meth:`shutdown` (or use ``with Engine(...)``)
    to stop them.
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
        self.model_path = Path(cfg.model_path)
        self.device = torch.device(cfg.device or ("cuda" if torch.cuda.is_available() else "cpu"))
        self.dtype = resolve_dtype(cfg.dtype, self.device)
        self.config = ModelConfig.from_pretrained(self.model_path)
        self.context_length = min(cfg.context_length or self.config.max_position_embeddings, self.config.max_position_embeddings)
        self.tp = None  # tensor parallelism: the TPGroup of this rank
        if cfg.tp_size != 1:
            from breakgraph.engine import tp

            self.tp = tp.start(self, cfg)

        try:
            t0 = time.perf_counter()
            self.model = load_model(
                self.model_path, config=self.config, device=self.device, dtype=self.dtype, load_format=cfg.load_format,
                max_positions=self.context_length, seed=cfg.seed, parallel=self.tp.state if self.tp else None,
            )  # fmt: skip
            logger.info("loaded %s (%s, %s) in %.1fs", self.model_path, self.config.model_type, self.dtype, time.perf_counter() - t0)
            self.tokenizer = _load_tokenizer(self.model_path) if self.tp is None or self.tp.rank == 0 else None
            if self.config.fp8 is not None and self.device.type == "cuda":
                from breakgraph.kernels.triton_fp8 import scaled_mm_blockwise_mode

                scaled_mm_blockwise_mode(self.device)  # probe now: every backend then takes the same GEMM

            num_pages = cfg.num_pages
            if num_pages is None:
                num_pages = self._default_num_pages(cfg.page_size, cfg.max_running_requests, cfg.mem_fraction_static)
            if self.tp is not None:
                num_pages = self.tp.agree_on_num_pages(num_pages)
            self.kv_cache = KVCache(self.config, num_pages, cfg.page_size, self.dtype, self.device)
            if self.tp is None:
                self.runner = ModelRunner(self.model, self.kv_cache, self.device)
            else:
                self.runner = self.tp.make_runner(self.model, self.kv_cache, self.device)
            self.scheduler = Scheduler(
                self.kv_cache.pool, self.context_length, cfg.max_running_requests, cfg.chunked_prefill_size
            )
            self.set_prefill_backend(
                cfg.cuda_graph_backend_prefill or ("breakable" if self.device.type == "cuda" else "disabled"),
                cfg.cuda_graph_bs_prefill, cfg.cuda_graph_max_bs_prefill,
            )  # fmt: skip
            decode_backend = cfg.cuda_graph_backend_decode or ("full" if self.device.type == "cuda" else "disabled")
            if decode_backend == "full":
                max_bs = cfg.cuda_graph_max_bs or min(cfg.max_running_requests, 64)
                self.runner.decode_graphs = DecodeGraphRunner(
                    self.model, self.kv_cache, self.device, default_decode_buckets(max_bs),
                    max_pages=self.kv_cache.pool.pages_for(self.context_length),
                )  # fmt: skip
                self.runner.decode_graphs.capture()
            self.eos_ids = set(self.config.eos_token_ids)
            if self.tokenizer is not None and self.tokenizer.eos_token_id is not None:
                self.eos_ids.add(self.tokenizer.eos_token_id)
            if self.tp is not None:
                self.tp.ready(self)  # ranks > 0 serve rank 0's steps from here on and never return
        except BaseException:
            if self.tp is not None and self.tp.rank == 0:
                self.tp._abandon()  # do not leave the other ranks waiting for a collective
            raise

    def _default_num_pages(self, page_size: int, max_running: int, mem_fraction: float) -> int:
        per_page = KVCache.bytes_per_page(self.config, page_size, self.dtype)
        if self.device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(self.device)
            budget = int(free * mem_fraction)
        else:
            want = -(-self.context_length // page_size) * min(max_running, 8) + 1
            budget = min(want * per_page, 2 << 30)
        return max(2, budget // per_page)

    def set_prefill_backend(
        self, backend: str, buckets: list[int] | tuple[int, ...] | None = None, max_bucket: int | None = None
    ) -> None:
        """(Re)build the prefill graphs: capture ``buckets`` (default: the ladder up to
        ``max_bucket``, itself defaulting to ``min(chunked_prefill_size, 4096)``) for ``backend``;
        ``disabled`` drops them. Prefill chunks are capped at the largest bucket."""
        if backend not in PREFILL_BACKENDS:
            raise ValueError(f"--cuda-graph-backend-prefill must be one of {PREFILL_BACKENDS}, got {backend!r}")
        if self.tp is not None:
            self.tp.on_set_prefill_backend(backend, buckets, max_bucket)
        self.runner.prefill_graphs = None
        self.prefill_backend = backend
        asked = self.engine_config.chunked_prefill_size  # graphs may lower the effective chunk
        self.scheduler.chunked_prefill_size = asked
        if backend == "disabled":
            return
        max_bucket = max_bucket or min(asked, 4096)
        buckets = sorted(set(buckets)) if buckets else default_prefill_buckets(max_bucket)
        if asked > buckets[-1]:
            logger.info("prefill chunks capped at the largest graph bucket: %d tokens", buckets[-1])
            self.scheduler.chunked_prefill_size = buckets[-1]
        graphs = PrefillGraphRunner(
            self.model, backend=backend, device=self.device, buckets=buckets,
            capture_context=self.runner.capture_context, fold_islands=self.engine_config.fold_islands,
        )  # fmt: skip
        graphs.capture()
        self.runner.prefill_graphs = graphs

    def graph_stats(self) -> dict:
        """What the prefill graphs did: backend, captured buckets, capture time, graph memory,
        replays, and eager fallbacks by reason (empty counters when graphs are disabled)."""
        graphs = self.runner.prefill_graphs
        stats = graphs.stats.as_dict() if graphs is not None else {"backend": "disabled", "replays": 0, "fallbacks": {}}
        decode = self.runner.decode_graphs
        stats["decode"] = (
            {"backend": "full", "batch_sizes": decode.stats.buckets, "capture_s": round(decode.stats.capture_s, 3),
             "replays": decode.stats.replays, "fallbacks": dict(decode.stats.fallbacks)}
            if decode is not None else {"backend": "disabled", "replays": 0, "fallbacks": {}}
        )  # fmt: skip
        return stats

    def shutdown(self) -> None:
        """Stop the other tensor-parallel ranks (nothing to do for a single-process engine)."""
        if self.tp is not None:
            self.tp.shutdown()

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()

    # -- requests ------------------------------------------------------------------------
    def tokenize(self, prompt: str | list[int]) -> list[int]:
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
        """Queue a request; raises ``ValueError`` if it can never fit."""
        req = Request(self.tokenize(prompt), params or SamplingParams())
        self.scheduler.add(req)
        return req

    def abort(self, req: Request) -> None:
        """Stop ``req`` now and free its KV pages."""
        self.scheduler.finish(req, "abort")

    def has_unfinished(self) -> bool:
        return self.scheduler.num_unfinished > 0

    def step(self) -> list[Request]:
        """Run one forward. Returns the requests that got a new token (or finished)."""
        plan = self.scheduler.schedule()
        if plan is None:
            return []
        entries = []
        for req, n in plan.entries:
            tokens = req.token_slice(req.num_computed, req.num_computed + n)
            entries.append(BatchEntry(tokens, req.num_computed, req.pages))
        batch = self.runner.make_batch(entries, plan.mode)
        want_all = any(req.prompt_logits is not None for req, _ in plan.entries)
        logits = self.runner.forward(batch, all_logits=want_all)
        progressed, start = [], 0
        for b, (req, n) in enumerate(plan.entries):
            row = (start + n - 1) if want_all else b
            if req.prompt_logits is not None:
                req.prompt_logits.append(logits[start : start + n].cpu())
            start += n
            req.num_computed += n
            if plan.mode is ForwardMode.EXTEND and req.in_prefill:
                continue  # more prompt chunks to go
            self._append_token(req, logits[row])
            progressed.append(req)
        return progressed

    def _append_token(self, req: Request, logits: torch.Tensor) -> None:
        tok, logprob = sample(logits, req.params, req.generator)
        if req.first_token_time is None:
            req.first_token_time = time.monotonic()
        p = req.params
        if not p.ignore_eos and tok in self.eos_ids or tok in p.stop_token_ids:
            self.scheduler.finish(req, "stop")
            return
        req.output_ids.append(tok)
        req.output_logprobs.append(logprob)
        if req.top_logprobs_num:
            values, ids = torch.log_softmax(logits.float(), -1).topk(req.top_logprobs_num)
            req.output_top_logprobs.append(list(zip(ids.tolist(), values.tolist())))
        if self.tokenizer is not None:
            self._detokenize(req)
            if p.stop:
                # A stop string can only end inside the new text (or straddle its start).
                window = max(len(s) for s in p.stop) - 1
                search_from = max(0, len(req.text) - len(req.new_text) - window)
                cut = min((i for s in p.stop if (i := req.text.find(s, search_from)) >= 0), default=-1)
                if cut >= 0:
                    req.text = req.text[:cut]
                    self.scheduler.finish(req, "stop")
                    return
        if len(req.output_ids) >= p.max_new_tokens or req.total_len >= self.context_length:
            self.scheduler.finish(req, "length")

    def _detokenize(self, req: Request) -> None:
        """Append the text of ``req``'s newest token to ``req.text`` (``req.new_text``), decoding
        only a short window: the tokens since ``read_offset`` against the few before it, so a
        token that completes a multi-byte character or merges with its neighbour comes out right.
        An incomplete UTF-8 sequence (U+FFFD at the end) waits for the next token."""
        decode = self.tokenizer.decode
        ids = req.output_ids
        prefix = decode(ids[req.prefix_offset : req.read_offset], skip_special_tokens=True)
        full = decode(ids[req.prefix_offset :], skip_special_tokens=True)
        req.new_text = ""
        if len(full) > len(prefix) and not full.endswith("\ufffd"):
            req.new_text = full[len(prefix) :]
            req.text += req.new_text
            req.prefix_offset, req.read_offset = req.read_offset, len(ids)

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
            self.scheduler.check(req)
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
