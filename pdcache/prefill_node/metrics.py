"""Prometheus series of the prefill node's PD admission gate (`pdcache_prefill_decode_wait_*`,
`pdcache_prefill_waiting_for_decode`): PD requests held out of the compute queue until their
decode node reserved pages and asked for the K/V (docs/pd-protocol.md, "Decode admission").

The gauge is read from `PrefillController.waiting_for_decode()` at scrape time; the wait
histogram and the timeout counter are updated by the prefill handler on the event loop. All
live on the server's own registry.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

log = logging.getLogger(__name__)

WAIT_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 30.0, 60.0, 120.0, 300.0)


class WaitingCollector(Collector):
    def __init__(self, waiting: Callable[[], int], server_name: str) -> None:
        self._waiting = waiting
        self._server = server_name

    def collect(self) -> Iterator[Metric]:
        try:
            value = self._waiting()
        except Exception:
            log.exception("waiting_for_decode() failed during a metrics scrape")
            return
        family = GaugeMetricFamily("pdcache_prefill_waiting_for_decode",
                                   "PD requests held out of compute until decode asks for their "
                                   "K/V", labels=["server"])
        family.add_metric([self._server], float(value))
        yield family


class DecodeWaitMetrics:
    def __init__(self, registry: CollectorRegistry, waiting: Callable[[], int],
                 server_name: str) -> None:
        self.wait = Histogram(
            "pdcache_prefill_decode_wait_seconds",
            "from a PD request's arrival to decode's request for its K/V (decode reserved "
            "its pages); the request is not computed before", buckets=WAIT_BUCKETS,
            registry=registry)
        self.timeouts = Counter(
            "pdcache_prefill_decode_wait_timeouts",
            "PD requests given up because decode never asked for their K/V in time",
            registry=registry)
        registry.register(WaitingCollector(waiting, server_name))
