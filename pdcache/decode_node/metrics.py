"""Prometheus series of the decode node: its DecodeOffloadManager (`pdcache_decode_offload_*`)
and its admission queue (`pdcache_decode_admission_*`).

Offload series are read from `DecodeOffloadManager.snapshot()` at scrape time; admission
gauges from `engine.stats()` at scrape time, its counters and wait histogram are updated by
the decode handler on the event loop. All live on the server's own registry, so the engine's
and server's collectors stay untouched.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator, Mapping
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    Metric,
    SummaryMetricFamily,
)
from prometheus_client.registry import Collector

from pdcache.offload_manager.decode_offload import DecodeOffloadManager
from pdcache.server.metrics import EngineStatsCollector

log = logging.getLogger(__name__)

PREFIX = "pdcache_decode_offload_"
# series name (without prefix) -> (snapshot key, help)
COUNTERS: dict[str, tuple[str, str]] = {
    "pages_scheduled": ("pages_scheduled", "full pages handed to the offload manager"),
    "pages_offloaded": ("pages_offloaded", "pages written to storage by this decode node"),
    "pages_skipped": ("pages_skipped", "pages already in storage (not copied)"),
    "pages_dropped": ("pages_dropped", "pages dropped: staging or queue full (backpressure)"),
    "pages_failed": ("pages_failed", "pages whose storage write failed"),
    "pages_left_to_prefill": ("pages_left_to_prefill", "window pages: prompt pages whose "
                              "sliding layers never came here (only the window tail does); "
                              "prefill stores them"),
    "pages_pulled": ("pull_pages_served", "staged pages sent to prefill pulls before their "
                                          "write landed (docs/design.md §4.10)"),
    # hybrid models: the answer-end recurrent state, one object per request
    "states_offloaded": ("states_offloaded", "answer-end states written as state objects"),
    "states_failed": ("states_failed", "answer-end states whose write failed"),
    "states_dropped": ("states_dropped", "answer-end states not written: pages of theirs "
                                         "were dropped (staging short), none could be hit"),
    "state_bytes_offloaded": ("state_bytes_offloaded", "bytes of the states written"),
}
GAUGES: dict[str, tuple[str, str]] = {
    "staging_pages_used": ("staging_pages_used", "host staging pages in use"),
    "staging_pages_total": ("staging_pages_total", "host staging capacity in pages"),
    "pending_copies": ("pending_copies", "device->staging copy tasks queued or running"),
    "pending_writes": ("pending_writes", "staging->storage writes queued or running"),
}


class OffloadStatsCollector(Collector):
    """Exposes one manager's counters; a failing snapshot yields nothing, never a failed
    scrape."""

    def __init__(self, manager: DecodeOffloadManager, server_name: str) -> None:
        self._manager = manager
        self._server = server_name

    def collect(self) -> Iterator[Metric]:
        try:
            stats = self._manager.snapshot()
        except Exception:
            log.exception("decode offload snapshot failed during a metrics scrape")
            return
        for table, kind in ((COUNTERS, CounterMetricFamily), (GAUGES, GaugeMetricFamily)):
            for name, (key, help_text) in table.items():
                family = kind(PREFIX + name, help_text, labels=["server"])
                family.add_metric([self._server], float(stats[key]))
                yield family
        latency = SummaryMetricFamily(PREFIX + "write_latency_seconds",
                                      "latency of one batched storage write", labels=["server"])
        latency.add_metric([self._server], count_value=float(stats["writes"]),
                           sum_value=float(stats["write_seconds_total"]))
        yield latency


# ---- decode admission (the engine's queue of PD requests waiting for pages) -----------------

ADMISSION_PREFIX = "pdcache_decode_admission_"
REJECT_REASONS = ("never_fits", "queue_full", "deadline")
WAIT_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 30.0, 60.0, 120.0, 300.0)


# read from `engine.stats()` at scrape time (the engine thread's last snapshot)
ADMISSION_GAUGES = {
    ADMISSION_PREFIX + "queue_depth": (("reservations_pending",),
                                       "PD requests waiting for decode pages (admission queue)"),
    ADMISSION_PREFIX + "queue_pages": (("reservations_pending_pages",),
                                       "prompt pages the queued PD requests wait for"),
}


class AdmissionMetrics:
    """Wait time, admissions and rejections of decode admission; updated by the decode handler
    on the event loop, on the server's own registry."""

    def __init__(self, registry: CollectorRegistry, stats: Callable[[], Mapping[str, Any]],
                 server_name: str) -> None:
        self.wait = Histogram(
            ADMISSION_PREFIX + "wait_seconds",
            "time a PD request waited for its decode pages (0 when reserved at once)",
            buckets=WAIT_BUCKETS, registry=registry)
        self.admitted = Counter(
            ADMISSION_PREFIX + "admitted", "PD requests whose decode pages were reserved, by "
            "whether they waited in the queue", ["queued"], registry=registry)
        self.rejected = Counter(
            ADMISSION_PREFIX + "rejected", "PD requests refused by decode admission, by reason "
            "(never_fits: 400; queue_full, deadline: 503)", ["reason"], registry=registry)
        self.prompt_tokens = Counter(
            ADMISSION_PREFIX + "prompt_tokens", "prompt tokens of admitted PD requests, by "
            "where their K/V came from (cache: this node's prefix cache, transfer: prefill)",
            ["source"], registry=registry)
        for reason in REJECT_REASONS:
            self.rejected.labels(reason)
        for queued in ("true", "false"):
            self.admitted.labels(queued)
        registry.register(EngineStatsCollector(stats, server_name, gauges=ADMISSION_GAUGES,
                                               counters={}))

    def observe_admitted(self, waited_s: float, queued: bool, num_tokens: int = 0,
                         cached_tokens: int = 0) -> None:
        self.wait.observe(max(waited_s, 0.0))
        self.admitted.labels("true" if queued else "false").inc()
        self.prompt_tokens.labels("cache").inc(cached_tokens)
        self.prompt_tokens.labels("transfer").inc(max(num_tokens - cached_tokens, 0))

    def observe_rejected(self, reason: str) -> None:
        self.rejected.labels(reason).inc()
