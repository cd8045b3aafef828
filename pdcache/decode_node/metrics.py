"""Prometheus series of the decode node's DecodeOffloadManager (`pdcache_decode_offload_*`).

Read from `DecodeOffloadManager.snapshot()` at scrape time and registered on the server's own
registry, so the engine's and server's collectors stay untouched.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator

from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    Metric,
    SummaryMetricFamily,
)
from prometheus_client.registry import Collector

from pdcache.offload_manager.decode_offload import DecodeOffloadManager

log = logging.getLogger(__name__)

PREFIX = "pdcache_decode_offload_"
# series name (without prefix) -> (snapshot key, help)
COUNTERS: dict[str, tuple[str, str]] = {
    "pages_scheduled": ("pages_scheduled", "full pages handed to the offload manager"),
    "pages_offloaded": ("pages_offloaded", "pages written to storage by this decode node"),
    "pages_skipped": ("pages_skipped", "pages already in storage (not copied)"),
    "pages_dropped": ("pages_dropped", "pages dropped: staging or queue full (backpressure)"),
    "pages_failed": ("pages_failed", "pages whose storage write failed"),
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
