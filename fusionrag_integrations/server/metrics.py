"""Prometheus metrics of one server (the official client library, one registry per server).

Requests and errors by endpoint and status; TTFT and latency histograms; prompt tokens by where
their K/V came from (reused, recomputed, prefilled, prefix-cached) and completion tokens; chunk
cache hits and bytes per tier; the queue (running, waiting). Read at `GET /metrics`.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from fusionrag_core.engine import Generation

_LATENCY_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
TOKEN_KINDS = ("reused", "recomputed", "prefilled", "prefix_cached")


class Metrics:
    """The counters a server updates per request; `render()` is the `/metrics` body."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
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


__all__ = ["TOKEN_KINDS", "Metrics"]
