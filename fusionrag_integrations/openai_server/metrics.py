"""Prometheus metrics of one server (the official client library, one registry per server).

Requests and errors by endpoint and status; TTFT and latency histograms; prompt tokens by where
their K/V came from (reused, recomputed, prefilled, prefix-cached) and completion tokens; chunk
cache hits and bytes per tier; the queue (running, waiting); and the engine's own totals
(`FusionEngine.stats()`: its prefix cache, scheduler and healing), read when scraped. Read at `GET /metrics`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from fusionrag_core.engine import Generation

_LATENCY_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
TOKEN_KINDS = ("reused", "recomputed", "prefilled", "prefix_cached")
# `FusionEngine.stats()` key -> (metric name, help, whether it is a lifetime total)
ENGINE_STATS: dict[str, tuple[str, str, bool]] = {
    "prefix_hits": ("fusionrag_prefix_cache_hits", "Prompts continued from a kept request's K/V", True),
    "prefix_misses": ("fusionrag_prefix_cache_misses", "Prompts that continued no kept request", True),
    "prefix_hit_tokens": ("fusionrag_prefix_cache_hit_tokens", "Prompt tokens continued from kept K/V", True),
    "prefix_evictions": ("fusionrag_prefix_cache_evictions", "Kept requests dropped for the byte budgets", True),
    "prefix_entries": ("fusionrag_prefix_cache_entries", "Kept requests held on the device now", False),
    "prefix_bytes": ("fusionrag_prefix_cache_bytes", "K/V bytes of the kept requests held on the device now", False),
    "prefix_demotions": ("fusionrag_prefix_cache_demotions", "Kept requests moved to the host tier", True),
    "prefix_promotions": ("fusionrag_prefix_cache_promotions", "Kept requests copied back from the host tier",
                          True),
    "prefix_host_entries": ("fusionrag_prefix_cache_host_entries", "Kept requests in the host tier now", False),
    "prefix_host_bytes": ("fusionrag_prefix_cache_host_bytes", "K/V bytes of the host tier's kept requests now",
                          False),
    "decode_steps": ("fusionrag_decode_steps", "Batched decode steps the engine ran", True),
    "decode_rows": ("fusionrag_decode_rows", "Requests over all decode steps (/ steps: the mean batch)", True),
    "sparse_passes": ("fusionrag_sparse_passes", "Last passes (recompute + question) the engine ran, packed or not",
                      True),
    "sparse_pass_requests": ("fusionrag_sparse_pass_requests",
                             "Requests over all sparse passes (/ passes: the mean pack)", True),
    "running": ("fusionrag_engine_running", "Requests in the engine's running batch now", False),
    "waiting": ("fusionrag_engine_waiting", "Requests waiting for the engine's batch now", False),
    "running_kv_bytes": ("fusionrag_engine_running_kv_bytes", "K/V bytes the running requests hold now", False),
    "heals": ("fusionrag_heals", "Kept requests healed whole (their K/V made exact while idle)", True),
    "heal_pieces": ("fusionrag_heal_pieces", "Pieces of healing run", True),
    "healed_tokens": ("fusionrag_healed_tokens", "Kept tokens healing made exact", True),
    "heal_preempted": ("fusionrag_heal_preempted", "Heals paused mid-entry for an arriving request", True),
    "heal_failures": ("fusionrag_heal_failures", "Pieces of healing that failed (their entry stays approximate)",
                      True),
    "heal_ms": ("fusionrag_heal_milliseconds", "Time the pieces of healing took", True),
    "answer_heals": ("fusionrag_answer_heals", "Answers whose K/V healing caught up with in flight", True),
    "answer_heal_pieces": ("fusionrag_answer_heal_pieces", "Pieces of answer healing run", True),
    "answer_healed_tokens": ("fusionrag_answer_healed_tokens", "Tokens answer healing made exact", True),
    "answer_heal_failures": ("fusionrag_answer_heal_failures",
                             "Pieces of answer healing that failed (the answer stays approximate)", True),
    "answer_heal_ms": ("fusionrag_answer_heal_milliseconds", "Time the pieces of answer healing took", True),
}


class EngineCollector(Collector):
    """`FusionEngine.stats()` as metrics, read at every scrape (the engine keeps the totals)."""

    def __init__(self, stats: Callable[[], Mapping[str, int]]) -> None:
        self.stats = stats

    def collect(self) -> Iterator[Metric]:
        for key, value in self.stats().items():
            if key not in ENGINE_STATS:
                continue  # NOTE: a statistic added to the engine later shows once it is named here
            name, doc, total = ENGINE_STATS[key]
            yield CounterMetricFamily(name, doc, value=value) if total else GaugeMetricFamily(name, doc, value=value)


class Metrics:
    """The counters a server updates per request; `render()` is the `/metrics` body."""

    def __init__(self, engine_stats: Callable[[], Mapping[str, int]] | None = None) -> None:
        """Args:
            engine_stats: the engine's `stats` (exported at every scrape), or None.
        """
        self.registry = CollectorRegistry()
        r = self.registry
        if engine_stats is not None:
            r.register(EngineCollector(engine_stats))
        self.requests = Counter("fusionrag_requests", "Requests answered", ["endpoint", "status"], registry=r)
        self.errors = Counter("fusionrag_errors", "Requests that ended in an error", ["endpoint", "kind"], registry=r)
        self.ttft = Histogram("fusionrag_ttft_seconds", "Time to first token", buckets=_LATENCY_BUCKETS, registry=r)
        self.latency = Histogram("fusionrag_request_seconds", "Whole generation time", buckets=_LATENCY_BUCKETS,
                                 registry=r)
        self.prompt_tokens = Counter("fusionrag_prompt_tokens", "Prompt tokens by where their K/V came from",
                                     ["kind"], registry=r)
        self.completion_tokens = Counter("fusionrag_completion_tokens", "Generated tokens", registry=r)
        self.cache_hits = Counter("fusionrag_kv_cache_hits", "Chunk cache loads by tier", ["tier"], registry=r)
        self.cache_bytes = Counter("fusionrag_kv_cache_bytes", "Chunk cache bytes loaded by tier", ["tier"], registry=r)
        self.running = Gauge("fusionrag_requests_running", "Requests generating now", registry=r)
        self.waiting = Gauge("fusionrag_queue_depth", "Requests waiting for a slot", registry=r)

    def record(self, generation: Generation) -> None:
        """Count one finished generation."""
        self.ttft.observe(generation.ttft_s)
        self.latency.observe(generation.total_s)
        for kind, count in generation.token_partition().items():
            self.prompt_tokens.labels(kind.removesuffix("_tokens")).inc(count)
        self.completion_tokens.inc(len(generation.token_ids))
        for key, value in generation.kv_tiers.items():
            tier, _, what = key.rpartition("_")
            (self.cache_hits if what == "hits" else self.cache_bytes).labels(tier).inc(value)

    def render(self, running: int, waiting: int) -> bytes:
        """The Prometheus text exposition, with the queue's gauges as of now."""
        self.running.set(running)
        self.waiting.set(waiting)
        return generate_latest(self.registry)


__all__ = ["ENGINE_STATS", "TOKEN_KINDS", "EngineCollector", "Metrics"]
