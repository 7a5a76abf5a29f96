"""Prometheus metrics of the server, on a registry of its own (``GET /metrics``).

Counters and histograms are updated by the engine thread as requests progress; the gauges
and the prefill-graph counters are read at scrape time from the engine loop's latest stats
snapshot (refreshed by the engine thread, so a scrape never touches the engine itself).

Prefill-graph counters come from ``engine.graph_stats()`` when the engine has it (a dict
``{"backend": str, "replays": int, "fallbacks": {reason: int}, "decode": {...}}``); otherwise
they are exported as zeros and ``breakgraph_prefill_graph_stats_available`` is 0. Decode-graph
counters are exported when that dict has a ``decode`` entry.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from breakgraph.server.errors import REASONS

LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 2.5, 5.0,
                   10.0, 20.0, 40.0, 80.0)  # fmt: skip


class ServerMetrics:
    def count_error(self, reason: str) -> None:
        """Count one error answer; ``reason`` must be one of ``REASONS``."""
        self.errors.labels(reason=reason if reason in REASONS else "other").inc()

    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        self.prompt_tokens = Counter(
            "breakgraph_prompt_tokens", "Prompt tokens of accepted requests", registry=r
        )
        self.generation_tokens = Counter("breakgraph_generation_tokens", "Generated tokens", registry=r)
        self.cached_tokens = Counter(
            "breakgraph_prefix_cache_hit_tokens",
            "Prompt tokens whose KV was reused from the prefix cache",
            registry=r,
        )
        self.requests = Counter(
            "breakgraph_requests",
            "Finished requests by finish reason (stop, length, abort)",
            ["finish_reason"],
            registry=r,
        )
        self.errors = Counter(
            "breakgraph_errors",
            "HTTP requests answered with a 4xx/5xx status (or cut off mid-stream), by reason "
            "(breakgraph.server.errors.REASONS)",
            ["reason"],
            registry=r,
        )
        for reason in REASONS:  # a closed set, exported from the start
            self.errors.labels(reason=reason)
        self.engine_errors = Counter("breakgraph_engine_errors", "Engine steps that raised", registry=r)
        self.ttft = Histogram(
            "breakgraph_time_to_first_token_seconds", "Time from arrival to the first generated token",
            buckets=LATENCY_BUCKETS, registry=r,
        )  # fmt: skip
        self.tpot = Histogram(
            "breakgraph_time_per_output_token_seconds", "Mean time between generated tokens, per request",
            buckets=LATENCY_BUCKETS, registry=r,
        )  # fmt: skip
        self.e2e = Histogram(
            "breakgraph_e2e_request_latency_seconds", "Time from arrival to the end of a request",
            buckets=LATENCY_BUCKETS, registry=r,
        )  # fmt: skip

    def bind(self, stats: Callable[[], dict[str, Any]], queued: Callable[[], int]) -> None:
        """Export the engine gauges from ``stats()`` (see ``EngineLoop.stats``) and the
        number of accepted-but-not-running requests from ``queued()``."""
        self.registry.register(_EngineCollector(stats, queued))

    def render(self) -> bytes:
        return generate_latest(self.registry)


class _EngineCollector:
    def __init__(self, stats: Callable[[], dict[str, Any]], queued: Callable[[], int]) -> None:
        self._stats = stats
        self._queued = queued

    def collect(self) -> Iterator[Metric]:
        s = self._stats() or {}

        def gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
            return GaugeMetricFamily(name, doc, value=value)

        yield gauge(
            "breakgraph_num_running_requests",
            "Requests holding KV pages (prefilling or decoding)",
            s.get("running", 0),
        )
        yield gauge("breakgraph_num_queued_requests", "Requests accepted but not yet running", self._queued())
        yield gauge("breakgraph_kv_pages_used", "KV pages referenced by requests", s.get("pages_used", 0))
        yield gauge(
            "breakgraph_kv_pages_cached",
            "Unreferenced KV pages kept for prefix reuse",
            s.get("pages_cached", 0),
        )
        yield gauge("breakgraph_kv_pages_total", "KV pages in the pool", s.get("pages_total", 0))
        yield CounterMetricFamily(
            "breakgraph_preemptions", "Running requests preempted when decode ran out of KV pages (recomputed later)",
            value=s.get("preemptions", 0),
        )  # fmt: skip
        graph = s.get("graph")
        replays, fallbacks = 0, {}
        if isinstance(graph, dict):
            replays = int(graph.get("replays", 0) or 0)
            fallbacks = {str(k): int(v) for k, v in (graph.get("fallbacks") or {}).items()}
        info = GaugeMetricFamily(
            "breakgraph_prefill_graph_backend",
            "The prefill graph backend in use (value 1)",
            labels=["backend"],
        )
        info.add_metric([str(graph.get("backend", "unknown")) if isinstance(graph, dict) else "unknown"], 1)
        yield info
        yield gauge(
            "breakgraph_prefill_graph_stats_available", "1 when the engine reports prefill graph statistics",
            1 if isinstance(graph, dict) else 0,
        )  # fmt: skip
        yield CounterMetricFamily(
            "breakgraph_prefill_graph_replays", "Prefill forwards replayed from a graph", value=replays
        )
        yield CounterMetricFamily(
            "breakgraph_prefill_graph_fallbacks", "Prefill forwards run eagerly instead of from a graph (all reasons)",
            value=sum(fallbacks.values()),
        )  # fmt: skip
        by_reason = CounterMetricFamily(
            "breakgraph_prefill_graph_fallbacks_by_reason",
            "Prefill forwards run eagerly, by reason",
            labels=["reason"],
        )
        for reason, count in sorted(fallbacks.items()):
            by_reason.add_metric([reason], count)
        yield by_reason
        decode = graph.get("decode") if isinstance(graph, dict) else None
        if isinstance(decode, dict):  # decode graphs, when the engine reports them
            yield CounterMetricFamily(
                "breakgraph_decode_graph_replays", "Decode forwards replayed from a graph",
                value=int(decode.get("replays", 0) or 0),
            )  # fmt: skip
            yield CounterMetricFamily(
                "breakgraph_decode_graph_fallbacks", "Decode forwards run eagerly instead of from a graph",
                value=sum(int(v) for v in (decode.get("fallbacks") or {}).values()),
            )  # fmt: skip
