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

import torch

from breakgraph.engine.decode_graphs import DECODE_BACKENDS, DecodeGraphRunner, default_decode_buckets
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

PREFILL_BACKENDS = ("disabled", "breakable", "piecewise")
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
    """Offline inference on one device.

    Args:
        model_path: HF checkpoint folder (config.json, safetensors, tokenizer.json);
            ``None`` uses the built-in default model.
        device: ``"cuda"``/``"cpu"`` (default: CUDA when available).
        dtype: ``auto`` (bf16 on CUDA, fp32 on CPU), ``bfloat16``, ``float16`` or ``float32``.
        load_format: ``auto`` (safetensors) or ``dummy`` (random weights from config.json).
        page_size: tokens per KV page. ``num_pages``: KV pool size (default: from memory).
        context_length: longest prompt + output (default: the model's max positions).
        max_running_requests: how many requests decode together.
        chunked_prefill_size: most prompt tokens per prefill step.
        mem_fraction_static: on CUDA, the share of free memory the KV cache may take.
        seed: seed for dummy weights.
        cuda_graph_backend_prefill: ``disabled``, ``breakable`` or ``piecewise`` (default:
            ``breakable`` on CUDA, ``disabled`` on CPU; on CPU the graph backends run on the
            CPU graph backend, with CUDA-graph semantics).
        cuda_graph_bs_prefill: token buckets to capture (default: the ladder up to
            ``cuda_graph_max_bs_prefill``). ``cuda_graph_max_bs_prefill``: the largest bucket
            (default: ``min(chunked_prefill_size, 4096)``); prefill chunks never exceed it.
        fold_islands: fold single-kernel graph segments into the neighbouring eager step.
        cuda_graph_backend_decode: ``full`` (one graph per batch-size bucket) or ``disabled``
            (default: ``full`` on CUDA, ``disabled`` on CPU). ``cuda_graph_max_bs``: the largest
            decode batch captured (default: ``min(max_running_requests, 64)``).
        tp_size: tensor-parallel ranks (:mod:`breakgraph.engine.tp`): this process is rank 0
            and starts the others (or joins torchrun's); one GPU per rank on CUDA. Call
            :meth:`shutdown` (or use ``with Engine(...)``) to stop them.
    """

    def __init__(
        self,
        model_path: str | Path | None = None,
        *,
        device: str | torch.device | None = None,
        dtype: str | torch.dtype | None = "auto",
        load_format: str = "auto",
        page_size: int = 16,
        num_pages: int | None = None,
        context_length: int | None = None,
        max_running_requests: int = 64,
        chunked_prefill_size: int = 4096,
        mem_fraction_static: float = 0.85,
        seed: int = 0,
        cuda_graph_backend_prefill: str | None = None,
        cuda_graph_bs_prefill: list[int] | None = None,
        cuda_graph_max_bs_prefill: int | None = None,
        fold_islands: bool = False,
        cuda_graph_backend_decode: str | None = None,
        cuda_graph_max_bs: int | None = None,
        tp_size: int = 1,
    ) -> None:
        engine_args = {k: v for k, v in locals().items() if k not in ("self", "__class__")}  # for TP ranks
        if model_path is None:
            from breakgraph.demo.default_model import default_model_path

            model_path = default_model_path()
        self.model_path = Path(model_path)
        self.device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        self.dtype = resolve_dtype(dtype, self.device)
        self.config = ModelConfig.from_pretrained(self.model_path)
        self.context_length = min(context_length or self.config.max_position_embeddings, self.config.max_position_embeddings)
        if chunked_prefill_size < 1:
            raise ValueError(f"chunked_prefill_size must be >= 1, got {chunked_prefill_size}")
        if max_running_requests < 1:
            raise ValueError(f"max_running_requests must be >= 1, got {max_running_requests}")
        self.tp = None  # tensor parallelism: the TPGroup of this rank
        if tp_size != 1:
            from breakgraph.engine import tp

            self.tp = tp.start(self, tp_size, {**engine_args, "model_path": str(self.model_path)})

        try:
            t0 = time.perf_counter()
            self.model = load_model(
                self.model_path, config=self.config, device=self.device, dtype=self.dtype, load_format=load_format,
                max_positions=self.context_length, seed=seed, parallel=self.tp.state if self.tp else None,
            )  # fmt: skip
            logger.info("loaded %s (%s, %s) in %.1fs", self.model_path, self.config.model_type, self.dtype, time.perf_counter() - t0)
            self.tokenizer = _load_tokenizer(self.model_path) if self.tp is None or self.tp.rank == 0 else None
            if self.config.fp8 is not None and self.device.type == "cuda":
                from breakgraph.kernels.triton_fp8 import scaled_mm_blockwise_mode

                scaled_mm_blockwise_mode(self.device)  # probe now: every backend then takes the same GEMM

            if num_pages is None:
                num_pages = self._default_num_pages(page_size, max_running_requests, mem_fraction_static)
            if self.tp is not None:
                num_pages = self.tp.agree_on_num_pages(num_pages)
            self.kv_cache = KVCache(self.config, num_pages, page_size, self.dtype, self.device)
            if self.tp is None:
                self.runner = ModelRunner(self.model, self.kv_cache, self.device)
            else:
                self.runner = self.tp.make_runner(self.model, self.kv_cache, self.device)
            self.max_prefill_chunk = chunked_prefill_size  # as asked; graphs may lower the effective chunk
            self.chunked_prefill_size = chunked_prefill_size
            self.fold_islands = fold_islands
            self.set_prefill_backend(
                cuda_graph_backend_prefill or ("breakable" if self.device.type == "cuda" else "disabled"),
                cuda_graph_bs_prefill, cuda_graph_max_bs_prefill,
            )  # fmt: skip
            chunked_prefill_size = self.chunked_prefill_size
            decode_backend = cuda_graph_backend_decode or ("full" if self.device.type == "cuda" else "disabled")
            if decode_backend not in DECODE_BACKENDS:
                raise ValueError(f"--cuda-graph-backend-decode must be one of {DECODE_BACKENDS}, got {decode_backend!r}")
            if decode_backend == "full":
                max_bs = cuda_graph_max_bs or min(max_running_requests, 64)
                self.runner.decode_graphs = DecodeGraphRunner(
                    self.model, self.kv_cache, self.device, default_decode_buckets(max_bs),
                    max_pages=self.kv_cache.pool.pages_for(self.context_length),
                )  # fmt: skip
                self.runner.decode_graphs.capture()
            self.scheduler = Scheduler(self.kv_cache.pool, self.context_length, max_running_requests, chunked_prefill_size)
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
        self, backend: str, buckets: list[int] | None = None, max_bucket: int | None = None
    ) -> None:
        """(Re)build the prefill graphs: capture ``buckets`` (default: the ladder up to
        ``max_bucket``, itself defaulting to ``min(chunked_prefill_size, 4096)``) for ``backend``;
        ``disabled`` drops them. Prefill chunks are capped at the largest bucket."""
        if backend not in PREFILL_BACKENDS:
            raise ValueError(f"--cuda-graph-backend-prefill must be one of {PREFILL_BACKENDS}, got {backend!r}")
        if self.tp is not None:
            self.tp.on_set_prefill_backend(backend, buckets, max_bucket, self.fold_islands)
        self.runner.prefill_graphs = None
        self.prefill_backend = backend
        self._set_prefill_chunk(self.max_prefill_chunk)
        if backend == "disabled":
            return
        max_bucket = max_bucket or min(self.max_prefill_chunk, 4096)
        buckets = sorted(set(buckets)) if buckets else default_prefill_buckets(max_bucket)
        if self.max_prefill_chunk > buckets[-1]:
            logger.info("prefill chunks capped at the largest graph bucket: %d tokens", buckets[-1])
            self._set_prefill_chunk(buckets[-1])
        graphs = PrefillGraphRunner(
            self.model, backend=backend, device=self.device, buckets=buckets,
            capture_context=self.runner.capture_context, fold_islands=self.fold_islands,
        )  # fmt: skip
        graphs.capture()
        self.runner.prefill_graphs = graphs

    def _set_prefill_chunk(self, tokens: int) -> None:
        self.chunked_prefill_size = tokens
        if hasattr(self, "scheduler"):
            self.scheduler.chunked_prefill_size = tokens

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
