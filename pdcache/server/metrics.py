"""Prometheus collectors of an HTTP server (prefix `pdcache_`), one registry per app.

`ServerMetrics` owns its `CollectorRegistry` (never the global default one), so several apps
in one process (tests, a launcher) never share or clash on series. Counters are updated by the
request handlers on the event loop; engine gauges (queue depth, pages) are read from
`engine.stats()` at scrape time by `EngineStatsCollector`.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator, Mapping
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from pdcache.engine.api import CachedTokens

log = logging.getLogger(__name__)

TIERS = ("device", "host", "storage", "storage_from_decode")
LATENCY_BUCKETS = (
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
    30.0,
    60.0,
)

# metric name -> (engine.stats() keys, first present wins; help). Absent keys are skipped.
ENGINE_GAUGES: dict[str, tuple[tuple[str, ...], str]] = {
    "pdcache_queue_depth": (("queued",), "requests submitted and not yet running"),
    "pdcache_running_requests": (("num_running", "running"), "requests prefilling or decoding"),
    "pdcache_device_pages_total": (("pages_total", "pages_capacity"), "device KV pool pages"),
    "pdcache_device_pages_free": (("pages_free",), "free device KV pages"),
    "pdcache_device_pages_used": (("pages_used",), "device pages held by requests or the cache"),
    "pdcache_device_pages_cached": (("cached_pages", "pages_cached"), "pages in the prefix tree"),
}
ENGINE_COUNTERS: dict[str, tuple[tuple[str, ...], str]] = {
    "pdcache_device_pages_evicted": (("pages_evicted_total",), "prefix-cache pages evicted"),
    "pdcache_requests_retracted": (("requests_retracted_total",), "requests preempted"),
    "pdcache_engine_step_errors": (("step_errors_total",), "engine steps that raised"),
    "pdcache_engine_callback_errors": (("callback_errors_total",), "callbacks that raised"),
}


class EngineStatsCollector(Collector):
    """Reads `stats()` at scrape time; a failing engine yields no gauges, never a failed scrape."""

    def __init__(self, stats: Callable[[], Mapping[str, Any]], server_name: str) -> None:
        self._stats = stats
        self._server_name = server_name

    def collect(self) -> Iterator[Metric]:
        try:
            stats = self._stats()
        except Exception:  # a scrape must not take the server down; the error is logged
            log.exception("engine.stats() failed during a metrics scrape")
            return
        for kind, table in (
            (GaugeMetricFamily, ENGINE_GAUGES),
            (CounterMetricFamily, ENGINE_COUNTERS),
        ):
            for name, (keys, help_text) in table.items():
                value = next((stats[k] for k in keys if k in stats), None)
                if isinstance(value, int | float) and not isinstance(value, bool):
                    family = kind(name, help_text, labels=["server"])
                    family.add_metric([self._server_name], float(value))
                    yield family


class ServerMetrics:
    """Request, token and latency series of one server."""

    def __init__(self, server_name: str, stats: Callable[[], Mapping[str, Any]] | None = None):
        self.registry = CollectorRegistry(auto_describe=True)
        reg = self.registry
        self.requests = Counter(
            "pdcache_requests",
            "HTTP requests by endpoint and status code",
            ["endpoint", "status"],
            registry=reg,
        )
        self.finished = Counter(
            "pdcache_requests_finished",
            "generations by finish reason (stop, length, abort)",
            ["reason"],
            registry=reg,
        )
        self.prompt_tokens = Counter(
            "pdcache_prompt_tokens", "prompt tokens of finished requests", registry=reg
        )
        self.generation_tokens = Counter(
            "pdcache_generation_tokens", "generated tokens", registry=reg
        )
        self.cached_tokens = Counter(
            "pdcache_cached_tokens",
            "prompt tokens reused from cache, by tier",
            ["tier"],
            registry=reg,
        )
        self.computed_tokens = Counter(
            "pdcache_computed_tokens", "prompt tokens computed (not reused)", registry=reg
        )
        self.ttft = Histogram(
            "pdcache_time_to_first_token_seconds",
            "arrival to first token",
            buckets=LATENCY_BUCKETS,
            registry=reg,
        )
        self.itl = Histogram(
            "pdcache_inter_token_latency_seconds",
            "time between consecutive tokens",
            buckets=LATENCY_BUCKETS,
            registry=reg,
        )
        self.e2e = Histogram(
            "pdcache_e2e_request_latency_seconds",
            "arrival to last token",
            buckets=LATENCY_BUCKETS,
            registry=reg,
        )
        for tier in TIERS:  # export every tier from the start, at 0
            self.cached_tokens.labels(tier)
        if stats is not None:
            reg.register(EngineStatsCollector(stats, server_name))

    def observe_request(self, endpoint: str, status: int) -> None:
        self.requests.labels(endpoint, str(status)).inc()

    def observe_prompt(self, prompt_tokens: int, cached: CachedTokens, computed: int) -> None:
        self.prompt_tokens.inc(prompt_tokens)
        for tier, count in cached.as_dict().items():
            self.cached_tokens.labels(tier).inc(count)
        self.computed_tokens.inc(computed)

    def observe_tokens(self, count: int, gap_s: float | None) -> None:
        """`count` new tokens arrived `gap_s` after the previous ones (None: the first ones)."""
        self.generation_tokens.inc(count)
        if gap_s is not None and count > 0:
            for _ in range(count):
                self.itl.observe(gap_s / count)

    def render(self) -> bytes:
        return generate_latest(self.registry)
