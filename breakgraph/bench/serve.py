"""Serving load test against any OpenAI-compatible ``/v1/completions`` endpoint.

Sends ``num_prompts`` streaming completion requests with synthetic prompts, arriving as a Poisson
process at ``request_rate`` per second (``inf``: all at once) with at most ``max_concurrency`` in
flight, and measures per request:

- TTFT: send to first chunk that carries text;
- ITL: gaps between consecutive text chunks (a chunk may carry more than one token when the
  server batches its stream output, so ITL is per chunk, as in sglang.bench_serving);
- TPOT: (E2E - TTFT) / (output tokens - 1), for requests with more than one output token;
- E2E: send to end of stream.

Prompts are random common words, about one token each; with ``tokenizer`` (a folder holding
``tokenizer.json``, or the file itself) they are built and checked to the exact token length.
Token counts come from the server's streamed ``usage`` when it sends one, else from the
tokenizer (input) and the number of text chunks (output).

Library use::

    from breakgraph.bench.serve import BenchConfig, run_bench
    result = run_bench(BenchConfig(base_url="http://127.0.0.1:30000", num_prompts=100))
    print(result.format_report())

Command line: ``python -m breakgraph.bench.serve --help`` (or ``breakgraph bench serve``).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import random
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
from tqdm.auto import tqdm

from breakgraph.bench.openai_client import (
    DEFAULT_BASE_URL,
    EndpointError,
    add_endpoint_arguments,
    auth_headers,
    fetch_model_id,
    http_error_message,
    normalize_base_url,
    parse_sse_line,
    sse_lines,
    transport_error_message,
)

if TYPE_CHECKING:
    import httpx  # imported where used: httpx comes with the bench, eval and serve extras

# Common English words; with a leading space nearly every BPE vocabulary holds each as one token.
_WORD_TEXT = (
    "the of and to in is was for that on with as by at from his her they this which you are be "
    "had not but have one all were when there can more she their time will would who been people "
    "into has could some them other than then now only its also after first two new made over "
    "many year way may like water day long little very just most make good could work world life "
    "back still city house light name great place small every found under right old story number "
    "country before point line school answer room young music river paper table green open river "
    "white stone field horse market garden window family morning simple north south letter summer"
)
WORDS: tuple[str, ...] = tuple(dict.fromkeys(_WORD_TEXT.split()))  # drop repeats, keep order


@dataclass(frozen=True)
class BenchConfig:
    """Everything one load test needs.

    base_url: server root, e.g. ``http://127.0.0.1:30000`` (``/v1`` is appended).
    model: model id sent in each request; ``None`` asks ``GET /v1/models`` and takes the first.
    num_prompts: requests to send.
    input_len / output_len: prompt tokens and ``max_tokens`` per request (upper bounds when
        ``range_ratio < 1``: each request draws uniformly from ``[len * range_ratio, len]``).
    max_concurrency: requests in flight at once; ``None`` means no limit.
    request_rate: mean arrivals per second of a Poisson process; ``inf`` sends all at once.
    seed: seeds prompts, lengths and arrival gaps.
    tokenizer: folder with ``tokenizer.json`` (or the file) for exact-length prompts.
    ignore_eos: send ``ignore_eos: true`` so each request generates exactly ``max_tokens``
        (SGLang, vLLM and breakgraph accept it; turn off for servers that reject unknown fields).
    timeout: seconds allowed per HTTP operation (connect, or the wait for the next chunk).
    """

    base_url: str = DEFAULT_BASE_URL
    model: str | None = None
    num_prompts: int = 200
    input_len: int = 1024
    output_len: int = 128
    range_ratio: float = 1.0
    max_concurrency: int | None = None
    request_rate: float = math.inf
    seed: int = 1
    api_key: str | None = field(default=None, repr=False)
    tokenizer: Path | None = None
    ignore_eos: bool = True
    timeout: float = 600.0

    def __post_init__(self) -> None:
        if self.num_prompts < 1:
            raise ValueError(f"--num-prompts must be >= 1, got {self.num_prompts}")
        if self.input_len < 1 or self.output_len < 1:
            raise ValueError(
                f"--input-len and --output-len must be >= 1, got {self.input_len} and {self.output_len}"
            )
        if not 0.0 <= self.range_ratio <= 1.0:
            raise ValueError(f"--range-ratio must be in [0, 1], got {self.range_ratio}")
        if self.max_concurrency is not None and self.max_concurrency < 1:
            raise ValueError(
                f"--max-concurrency must be >= 1 (or omitted for no limit), got {self.max_concurrency}"
            )
        if not self.request_rate > 0:
            raise ValueError(f"--request-rate must be > 0 or inf, got {self.request_rate}")
        if self.timeout <= 0:
            raise ValueError(f"--timeout must be > 0 seconds, got {self.timeout}")


@dataclass
class RequestSpec:
    """One synthetic request: the prompt, its token count when a tokenizer measured it, and
    ``max_tokens``."""

    prompt: str
    input_len: int
    input_len_exact: bool
    output_len: int


@dataclass
class RequestRecord:
    """What happened to one request; times in seconds. ``error`` is ``None`` on success."""

    index: int
    input_len: int
    output_len: int
    success: bool = False
    error: str | None = None
    send_time_s: float = 0.0
    ttft_s: float | None = None
    latency_s: float | None = None
    itl_s: list[float] = field(default_factory=list)
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    text_chunks: int = 0
    usage_reported: bool = False

    @property
    def tpot_s(self) -> float | None:
        out = self.completion_tokens
        if not self.success or out is None or out < 2 or self.ttft_s is None or self.latency_s is None:
            return None
        return (self.latency_s - self.ttft_s) / (out - 1)

    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        d["tpot_s"] = self.tpot_s
        return d


# ----------------------------------------------------------------------------------------------
# Prompts


def sample_lengths(rng: random.Random, n: int, length: int, range_ratio: float) -> list[int]:
    """``n`` integers uniform in ``[max(1, floor(length * range_ratio)), length]``."""
    low = max(1, int(length * range_ratio))
    return [rng.randint(low, length) for _ in range(n)]


class ExactPrompts:
    """Builds prompts whose encoding (without special tokens) is exactly ``n`` tokens long.

    Loads ``tokenizer.json`` with the ``tokenizers`` library. Raises ``FileNotFoundError`` naming
    the path when there is none. ``make`` adjusts the word count up to a few times and returns the
    measured length when it still misses (rare; only with tokenizers that merge across spaces).
    """

    def __init__(self, path: Path) -> None:
        from tokenizers import Tokenizer

        path = Path(path)
        file = path / "tokenizer.json" if path.is_dir() else path
        if not file.is_file():
            raise FileNotFoundError(f"--tokenizer: no tokenizer.json at {file}")
        self.tok = Tokenizer.from_file(str(file))
        single = [w for w in WORDS if len(self.count(" " + w)) == 1]
        self.words = single or list(WORDS)

    def count(self, text: str) -> list[int]:
        return self.tok.encode(text, add_special_tokens=False).ids

    def make(self, rng: random.Random, n: int) -> tuple[str, int]:
        words = [rng.choice(self.words) for _ in range(n)]
        got = n
        for _ in range(8):
            got = len(self.count("".join(" " + w for w in words)))
            if got == n:
                break
            if got > n:
                del words[max(1, len(words) - (got - n)) :]
            else:
                words.extend(rng.choice(self.words) for _ in range(n - got))
        text = "".join(" " + w for w in words)
        return text, len(self.count(text))


def build_requests(cfg: BenchConfig) -> list[RequestSpec]:
    """The ``num_prompts`` requests of a run, reproducible from ``cfg.seed``."""
    rng = random.Random(cfg.seed)
    in_lens = sample_lengths(rng, cfg.num_prompts, cfg.input_len, cfg.range_ratio)
    out_lens = sample_lengths(rng, cfg.num_prompts, cfg.output_len, cfg.range_ratio)
    builder = ExactPrompts(cfg.tokenizer) if cfg.tokenizer is not None else None
    specs = []
    for n_in, n_out in zip(in_lens, out_lens):
        if builder is not None:
            prompt, measured = builder.make(rng, n_in)
            specs.append(RequestSpec(prompt, measured, True, n_out))
        else:
            prompt = " ".join(rng.choice(WORDS) for _ in range(n_in))
            specs.append(RequestSpec(prompt, n_in, False, n_out))
    return specs


# ----------------------------------------------------------------------------------------------
# Requests


async def send_request(
    client: httpx.AsyncClient, url: str, model: str, spec: RequestSpec, index: int, ignore_eos: bool
) -> RequestRecord:
    """Send one streaming completion and time it. Never raises for server or transport
    failures: they come back as ``success=False`` with ``error`` set."""
    import httpx

    rec = RequestRecord(index=index, input_len=spec.input_len, output_len=spec.output_len)
    body: dict[str, Any] = {
        "model": model,
        "prompt": spec.prompt,
        "max_tokens": spec.output_len,
        "temperature": 0.0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if ignore_eos:
        body["ignore_eos"] = True
    start = time.perf_counter()
    rec.send_time_s = start
    last = start
    try:
        async with client.stream("POST", url, json=body) as resp:
            if resp.status_code != 200:
                raw = await resp.aread()
                rec.error = http_error_message(url, resp.status_code, raw.decode(errors="replace"), limit=500)
                return rec
            async for line in sse_lines(resp):
                obj = parse_sse_line(line)
                if obj is None:
                    continue
                if obj.get("error"):
                    rec.error = f"{url} sent an error in the stream: {json.dumps(obj['error'])[:500]}"
                    return rec
                now = time.perf_counter()
                text = "".join((c.get("text") or "") for c in obj.get("choices") or [])
                if text:
                    if rec.ttft_s is None:
                        rec.ttft_s = now - start
                    else:
                        rec.itl_s.append(now - last)
                    last = now
                    rec.text_chunks += 1
                usage = obj.get("usage")
                if usage:
                    rec.usage_reported = True
                    rec.prompt_tokens = usage.get("prompt_tokens")
                    rec.completion_tokens = usage.get("completion_tokens")
    except httpx.HTTPError as exc:
        rec.error = transport_error_message(url, exc)
        return rec
    except (ValueError, TypeError) as exc:
        rec.error = f"{url} sent a malformed stream chunk: {exc}"
        return rec
    rec.latency_s = time.perf_counter() - start
    if rec.ttft_s is None:
        rec.ttft_s = rec.latency_s  # no text at all: the first (and only) answer is the end
    if rec.completion_tokens is None:
        rec.completion_tokens = rec.text_chunks
    if rec.prompt_tokens is None:
        rec.prompt_tokens = spec.input_len
    rec.success = True
    return rec


# ----------------------------------------------------------------------------------------------
# Results


def _stats(values: list[float], scale: float = 1000.0) -> dict[str, float | None]:
    if not values:
        return {"mean": None, "median": None, "p99": None}
    a = np.asarray(values, dtype=np.float64) * scale
    return {"mean": float(a.mean()), "median": float(np.median(a)), "p99": float(np.percentile(a, 99))}


@dataclass
class BenchResult:
    """Summary of one load test plus its per-request records.

    Latency statistics are in milliseconds (``{"mean", "median", "p99"}``, ``None`` when no request
    produced the quantity). Throughputs divide by ``duration_s``, the wall time from the first send
    to the last finished request. ``concurrency`` is the mean number of requests in flight.
    """

    config: dict[str, Any]
    model: str
    base_url: str
    duration_s: float
    completed: int
    failed: int
    first_error: str | None
    total_input_tokens: int
    total_output_tokens: int
    usage_reported: int
    request_throughput: float
    input_throughput: float
    output_throughput: float
    total_throughput: float
    concurrency: float
    ttft_ms: dict[str, float | None]
    tpot_ms: dict[str, float | None]
    itl_ms: dict[str, float | None]
    e2e_ms: dict[str, float | None]
    records: list[RequestRecord]

    def to_json(self) -> dict[str, Any]:
        """Plain JSON types; an infinite ``request_rate`` is written as the string ``"inf"``."""
        d = {k: v for k, v in asdict(self).items() if k != "records"}
        d["config"] = {k: ("inf" if v == math.inf else v) for k, v in d["config"].items()}
        d["records"] = [r.to_json() for r in self.records]
        return d

    def format_report(self) -> str:
        cfg = self.config
        rate = cfg["request_rate"]
        rows = [
            ("Base URL", self.base_url),
            ("Model", self.model),
            ("Request rate (req/s)", "inf" if rate == math.inf else f"{rate:g}"),
            ("Max concurrency", cfg["max_concurrency"] or "unlimited"),
            ("Successful requests", self.completed),
            ("Failed requests", self.failed),
            ("Benchmark duration (s)", f"{self.duration_s:.2f}"),
            ("Total input tokens", self.total_input_tokens),
            ("Total output tokens", self.total_output_tokens),
            ("Token counts from server usage", f"{self.usage_reported}/{self.completed} requests"),
            ("Request throughput (req/s)", f"{self.request_throughput:.2f}"),
            ("Input token throughput (tok/s)", f"{self.input_throughput:.2f}"),
            ("Output token throughput (tok/s)", f"{self.output_throughput:.2f}"),
            ("Total token throughput (tok/s)", f"{self.total_throughput:.2f}"),
            ("Mean concurrency", f"{self.concurrency:.2f}"),
        ]
        lines = ["{:=^60}".format(" Serving Benchmark Result ")]
        lines += [f"{k + ':':<40}{v!s:>20}" for k, v in rows]
        lines.append(f"{'latency (ms)':<18}{'mean':>14}{'median':>14}{'p99':>14}")
        lines.append("-" * 60)

        def fmt(x: float | None) -> str:
            return "n/a" if x is None else f"{x:.2f}"

        for name, s in (
            ("TTFT", self.ttft_ms),
            ("TPOT", self.tpot_ms),
            ("ITL", self.itl_ms),
            ("E2E", self.e2e_ms),
        ):
            lines.append(f"{name:<18}{fmt(s['mean']):>14}{fmt(s['median']):>14}{fmt(s['p99']):>14}")
        lines.append("=" * 60)
        if self.first_error:
            lines.append(f"First error: {self.first_error}")
        return "\n".join(lines)


def summarize(
    cfg: BenchConfig, model: str, base_url: str, records: list[RequestRecord], duration_s: float
) -> BenchResult:
    """Aggregate per-request records into a ``BenchResult``."""
    ok = [r for r in records if r.success]
    failed = [r for r in records if not r.success]
    first_error = min(failed, key=lambda r: r.index).error if failed else None
    total_in = sum(r.prompt_tokens or 0 for r in ok)
    total_out = sum(r.completion_tokens or 0 for r in ok)
    dur = max(duration_s, 1e-9)
    config = {k: (str(v) if isinstance(v, Path) else v) for k, v in asdict(cfg).items() if k != "api_key"}
    return BenchResult(
        config=config,
        model=model,
        base_url=base_url,
        duration_s=duration_s,
        completed=len(ok),
        failed=len(failed),
        first_error=first_error,
        total_input_tokens=total_in,
        total_output_tokens=total_out,
        usage_reported=sum(r.usage_reported for r in ok),
        request_throughput=len(ok) / dur,
        input_throughput=total_in / dur,
        output_throughput=total_out / dur,
        total_throughput=(total_in + total_out) / dur,
        concurrency=sum(r.latency_s or 0.0 for r in ok) / dur,
        ttft_ms=_stats([r.ttft_s for r in ok if r.ttft_s is not None]),
        tpot_ms=_stats([t for r in ok if (t := r.tpot_s) is not None]),
        itl_ms=_stats([g for r in ok for g in r.itl_s]),
        e2e_ms=_stats([r.latency_s for r in ok if r.latency_s is not None]),
        records=sorted(records, key=lambda r: r.index),
    )


# ----------------------------------------------------------------------------------------------
# Driver


async def run_bench_async(cfg: BenchConfig, progress: bool = True) -> BenchResult:
    """Run the load test; see ``run_bench``."""
    import httpx

    base_url = normalize_base_url(cfg.base_url)
    specs = build_requests(cfg)
    arrivals = random.Random(cfg.seed + 1)
    limits = httpx.Limits(max_connections=cfg.max_concurrency, max_keepalive_connections=cfg.max_concurrency)
    async with httpx.AsyncClient(
        headers=auth_headers(cfg.api_key), timeout=httpx.Timeout(cfg.timeout), limits=limits
    ) as client:
        model = cfg.model or await fetch_model_id(client, base_url)
        url = f"{base_url}/v1/completions"
        sem = asyncio.Semaphore(cfg.max_concurrency) if cfg.max_concurrency else None
        bar = tqdm(total=len(specs), desc="bench serve", unit="req", disable=not progress)
        records: list[RequestRecord] = []

        async def one(i: int, spec: RequestSpec) -> None:
            if sem is None:
                rec = await send_request(client, url, model, spec, i, cfg.ignore_eos)
            else:
                async with sem:
                    rec = await send_request(client, url, model, spec, i, cfg.ignore_eos)
            records.append(rec)
            bar.update(1)
            if not rec.success:
                bar.set_postfix(failed=sum(not r.success for r in records))

        tasks: list[asyncio.Task[None]] = []
        t0 = time.perf_counter()
        try:
            for i, spec in enumerate(specs):
                tasks.append(asyncio.create_task(one(i, spec)))
                if cfg.request_rate != math.inf and i + 1 < len(specs):
                    await asyncio.sleep(arrivals.expovariate(cfg.request_rate))
            await asyncio.gather(*tasks)
        finally:
            for t in tasks:
                t.cancel()
            bar.close()
        duration = time.perf_counter() - t0
    for r in records:
        r.send_time_s -= t0
    return summarize(cfg, model, base_url, records, duration)


def run_bench(cfg: BenchConfig, progress: bool = True) -> BenchResult:
    """Send ``cfg.num_prompts`` streaming requests and aggregate their timings.

    Must be called outside a running event loop (use ``run_bench_async`` inside one). Failed
    requests (HTTP errors, refused connections, timeouts, malformed streams) are counted in
    ``failed`` with the lowest-index one's message in ``first_error``; they do not stop the run.
    Raises ``EndpointError`` only when ``model`` is unset and ``GET /v1/models`` fails, and
    ``FileNotFoundError`` for a missing tokenizer.
    """
    return asyncio.run(run_bench_async(cfg, progress=progress))


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the ``bench serve`` flags to ``parser`` (used by ``breakgraph bench serve`` and ``-m``)."""
    add_endpoint_arguments(parser)
    parser.add_argument(
        "--num-prompts", type=int, default=200, help="requests to send (default: %(default)s)"
    )
    parser.add_argument(
        "--input-len",
        type=int,
        default=1024,
        help="prompt length in tokens, the upper bound with --range-ratio (default: %(default)s)",
    )
    parser.add_argument(
        "--output-len",
        type=int,
        default=128,
        help="max_tokens per request, the upper bound with --range-ratio (default: %(default)s)",
    )
    parser.add_argument(
        "--range-ratio",
        type=float,
        default=1.0,
        help="draw each input/output length uniformly from [len*ratio, len]; 1.0 = fixed lengths "
        "(default: %(default)s)",
    )
    parser.add_argument(
        "--max-concurrency",
        type=int,
        default=None,
        help="most requests in flight at once; default: no limit",
    )
    parser.add_argument(
        "--request-rate",
        type=float,
        default=math.inf,
        help="mean request arrivals per second (Poisson process); inf sends all at once (default: inf)",
    )
    parser.add_argument(
        "--seed",
        type=int,
        default=1,
        help="seed for prompts, lengths and arrival gaps (default: %(default)s)",
    )
    parser.add_argument(
        "--output",
        type=Path,
        default=None,
        help="write the summary and per-request records to this JSON file",
    )
    parser.add_argument(
        "--tokenizer",
        type=Path,
        default=None,
        help="folder with tokenizer.json (or the file) to build prompts of exactly --input-len tokens; "
        "default: random words, about one token each, counted by the server's usage",
    )
    parser.add_argument(
        "--no-ignore-eos",
        action="store_true",
        help="do not send ignore_eos=true (for servers that reject unknown fields); outputs may then "
        "stop before --output-len",
    )


def main(args: argparse.Namespace) -> int:
    """Run from parsed flags and print the report. Returns 0 when every request completed,
    1 when any failed or the server could not be reached, 2 for bad flags."""
    try:
        cfg = BenchConfig(
            base_url=args.base_url,
            model=args.model,
            num_prompts=args.num_prompts,
            input_len=args.input_len,
            output_len=args.output_len,
            range_ratio=args.range_ratio,
            max_concurrency=args.max_concurrency,
            request_rate=args.request_rate,
            seed=args.seed,
            api_key=args.api_key,
            tokenizer=args.tokenizer,
            ignore_eos=not args.no_ignore_eos,
            timeout=args.timeout,
        )
        normalize_base_url(cfg.base_url)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    try:
        result = run_bench(cfg, progress=not args.no_progress)
    except EndpointError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    except FileNotFoundError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(result.format_report())
    if args.output is not None:
        args.output.parent.mkdir(parents=True, exist_ok=True)
        args.output.write_text(
            json.dumps(result.to_json(), indent=2, allow_nan=False) + "\n", encoding="utf-8"
        )
        print(f"wrote {args.output}")
    return 0 if result.failed == 0 else 1


if __name__ == "__main__":
    _parser = argparse.ArgumentParser(
        prog="python -m breakgraph.bench.serve", description=__doc__.split("\n")[0].replace("``", "")
    )
    add_arguments(_parser)
    sys.exit(main(_parser.parse_args()))
