"""Prometheus metrics of the server: engine gauges and counters read from the
engine thread's latest stats snapshot at scrape time, latency histograms
observed by the request handlers, and two that tell where a stream's long
inter-token gaps come from: the engine's step times (steps with a prefill
apart) and the lag of the HTTP side's event loop."""

from __future__ import annotations

import asyncio
import os
import time

from prometheus_client import CollectorRegistry, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

from ..outputs import RequestOutput

LOOP_LAG_INTERVAL_S = 0.01
_LAG_BUCKETS = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)
_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)


def _gc_families(prefix: str, where: str, snapshot) -> list:
    """Counters of a GcTimes snapshot: collections and seconds per generation."""
    counts, seconds = snapshot
    count_family = CounterMetricFamily(
        f"pagedcore_{prefix}_gc_collections", f"collections of Python's garbage collector in {where} "
        "(each stops its threads)", labels=["generation"])
    seconds_family = CounterMetricFamily(f"pagedcore_{prefix}_gc_seconds", "time spent in those collections",
                                         labels=["generation"])
    for generation, (count, spent) in enumerate(zip(counts, seconds)):
        count_family.add_metric([str(generation)], count)
        seconds_family.add_metric([str(generation)], spent)
    return [count_family, seconds_family]


class _EngineCollector:
    def __init__(self, engine) -> None:
        self.engine = engine
        from .async_engine import gc_times

        self.http_gc = gc_times()

    def collect(self):
        # (the scraped HTTP process's own collections; with the engine as a thread, the same
        # process's as pagedcore_engine_gc_*)
        yield from _gc_families("http", "the scraped HTTP process", self.http_gc.snapshot())
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
        if s.get("gc"):
            yield from _gc_families("engine", "the engine's process", s["gc"])
        steps = s.get("step_seconds")
        if steps:
            from .async_engine import STEP_BUCKETS

            family = HistogramMetricFamily(
                "pagedcore_engine_step_seconds", "wall time of engine steps; kind=prefill: prompt tokens ran in "
                "the step (or, pipelined, in the step it waited for)", labels=["kind"])
            for kind, (counts, total) in steps.items():
                cumulative, buckets = 0, []
                for bound, count in zip((*map(str, STEP_BUCKETS), "+Inf"), counts):
                    cumulative += count
                    buckets.append((bound, cumulative))
                family.add_metric([kind], buckets, sum_value=total)
            yield family


class _StallCollector:
    """The loop-stall sampler's counts (loop_stalls.py) of this HTTP process."""

    def __init__(self, metrics: "Metrics") -> None:
        self.metrics = metrics

    def collect(self):
        sampler = self.metrics.stall_sampler
        if sampler is None:
            return
        family = CounterMetricFamily(
            "pagedcore_http_loop_stall_samples", "samples of what the HTTP side's event loop ran while it was "
            "late by more than a few ms (PAGEDCORE_LOOP_STALLS=1)", labels=["where"])
        for where, count in list(sampler.counts.items()):
            family.add_metric([where], count)
        yield family


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
        # NOTE: with several HTTP processes (api_servers.py) PROMETHEUS_MULTIPROC_DIR is
        # set before prometheus_client is imported: each process's histograms live in
        # files there, and a scrape of any process renders all of them, summed.
        self._render_registry = self.registry
        if os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
            from prometheus_client.multiprocess import MultiProcessCollector

            self._render_registry = CollectorRegistry()
            MultiProcessCollector(self._render_registry)
            self._render_registry.register(_EngineCollector(engine))
        self.ttft = Histogram("pagedcore_time_to_first_token_seconds", "time to first token", buckets=_BUCKETS,
                              registry=self.registry)
        self.itl = Histogram("pagedcore_inter_token_latency_seconds", "time between output tokens", buckets=_BUCKETS,
                             registry=self.registry)
        self.e2e = Histogram("pagedcore_e2e_request_latency_seconds", "request latency, arrival to last token",
                             buckets=_BUCKETS, registry=self.registry)
        self.stall_sampler = None  # (started by watch_loop_lag, where loop_stalls.enabled())
        self._render_registry.register(_StallCollector(self))
        self.loop_lag = Histogram("pagedcore_event_loop_lag_seconds",
                                  f"how late the HTTP side's event loop ran a callback due every "
                                  f"{LOOP_LAG_INTERVAL_S * 1e3:g} ms (a stall delays every stream's writes)",
                                  buckets=_LAG_BUCKETS, registry=self.registry)

    async def watch_loop_lag(self) -> None:
        """Runs until cancelled: sleeps LOOP_LAG_INTERVAL_S at a time and records how
        much later than due each wake-up came; with loop_stalls.enabled(), a
        sampler thread records what the loop runs while a wake-up is overdue."""
        from . import loop_stalls

        loop = asyncio.get_running_loop()
        sampler = None
        if loop_stalls.enabled():
            sampler = self.stall_sampler = loop_stalls.LoopStallSampler(LOOP_LAG_INTERVAL_S)
            sampler.start()
        try:
            while True:
                due = loop.time() + LOOP_LAG_INTERVAL_S
                await asyncio.sleep(LOOP_LAG_INTERVAL_S)
                self.loop_lag.observe(max(0.0, loop.time() - due))
                if sampler is not None:
                    sampler.beat()
        finally:
            if sampler is not None:
                sampler.stop()

    def request_timer(self, arrival: float) -> RequestTimer:
        return RequestTimer(self, arrival)

    def render(self) -> str:
        return generate_latest(self._render_registry).decode()
