"""Prometheus metrics of the server: engine gauges and counters read from the
engine thread's latest stats snapshot at scrape time, and latency histograms
observed by the request handlers."""

from __future__ import annotations

import time

from prometheus_client import CollectorRegistry, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from ..outputs import RequestOutput

_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)


class _EngineCollector:
    def __init__(self, engine) -> None:
        self.engine = engine

    def collect(self):
        s = self.engine.stats
        gauges = {
            "pagedcore_kv_blocks_total": ("KV-cache blocks of the GPU (or CPU) pool", s.get("num_blocks", 0)),
            "pagedcore_kv_blocks_free": ("free KV-cache blocks (cached ones included)", s.get("num_free_blocks", 0)),
            "pagedcore_kv_blocks_cached": ("free blocks that still hold reusable prefixes", s.get("num_cached_blocks", 0)),
            "pagedcore_num_requests": ("unfinished requests in the engine", s.get("num_requests", 0)),
            "pagedcore_num_requests_running": ("running sequences", s.get("num_running_seqs", 0)),
            "pagedcore_num_requests_waiting": ("waiting sequences (swapped ones included)", s.get("num_waiting_seqs", 0)),
        }
        for name, (doc, value) in gauges.items():
            yield GaugeMetricFamily(name, doc, value=value)
        counters = {
            "pagedcore_preemptions": ("sequences preempted", s.get("num_preemptions", 0)),
            "pagedcore_prompt_tokens": ("prompt tokens of requests that produced their first token", s.get("num_prompt_tokens", 0)),
            "pagedcore_generation_tokens": ("generated tokens", s.get("num_generation_tokens", 0)),
            "pagedcore_prefix_cache_queries": ("prompt tokens looked up in the prefix cache", s.get("prefix_cache_queries", 0)),
            "pagedcore_prefix_cache_hits": ("prompt tokens found in the prefix cache", s.get("prefix_cache_hits", 0)),
        }
        for name, (doc, value) in counters.items():
            yield CounterMetricFamily(name, doc, value=value)


class RequestTimer:
    """Time to first token, inter-token latency and end-to-end latency of one request."""

    def __init__(self, metrics: "Metrics", arrival: float) -> None:
        self.metrics, self.arrival, self.last = metrics, arrival, None

    def observe(self, out: RequestOutput) -> None:
        tokens = sum(len(c.token_ids) for c in out.outputs)
        if tokens == 0:
            return
        now = time.monotonic()
        if self.last is None:
            self.metrics.ttft.observe(now - self.arrival)
        else:
            self.metrics.itl.observe((now - self.last) / tokens)
        self.last = now

    def done(self) -> None:
        self.metrics.e2e.observe(time.monotonic() - self.arrival)


class Metrics:
    def __init__(self, engine) -> None:
        self.registry = CollectorRegistry()
        self.registry.register(_EngineCollector(engine))
        self.ttft = Histogram("pagedcore_time_to_first_token_seconds", "time to first token", buckets=_BUCKETS,
                              registry=self.registry)
        self.itl = Histogram("pagedcore_inter_token_latency_seconds", "time between output tokens", buckets=_BUCKETS,
                             registry=self.registry)
        self.e2e = Histogram("pagedcore_e2e_request_latency_seconds", "request latency, arrival to last token",
                             buckets=_BUCKETS, registry=self.registry)

    def request_timer(self, arrival: float) -> RequestTimer:
        return RequestTimer(self, arrival)

    def render(self) -> str:
        return generate_latest(self.registry).decode()
