"""SGLang 0.5.23's scheduler gauges beside the `pdcache_*` series, so SGLang's dashboards
work against pdcache nodes (docs/design.md §4.7): `SGLangEngineCollector` (SGLang's
`SchedulerMetricsCollector`) reads `engine.stats()` (and the HiCache `stats()`) at scrape
time, any thread, labels `model_name`, `engine_type`, `tp_rank`, `pp_rank`, `moe_ep_rank`.
`engine_type` is SGLang's: `unified`, `prefill` or `decode` (the node's role).

The per-request half (`SGLangRequestSeries`, SGLang's `TokenizerMetricsCollector`), which
the router exports too, is `pdcache.wire.metrics`.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator, Mapping
from typing import Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from pdcache.wire.metrics import BASE_LABELS

log = logging.getLogger(__name__)

SCHEDULER_LABELS = (*BASE_LABELS, "tp_rank", "pp_rank", "moe_ep_rank")


# metric name -> (kind, help, value from (engine stats, page size)); None: not exported
EngineValue = Callable[[Mapping[str, Any], int], float | None]


def _get(key: str, scale: bool = False) -> EngineValue:
    def value(stats: Mapping[str, Any], page_size: int) -> float | None:
        raw = stats.get(key)
        if not isinstance(raw, int | float) or isinstance(raw, bool):
            return None
        return float(raw * page_size if scale else raw)

    return value


def _used_pages(stats: Mapping[str, Any]) -> int | None:
    """SGLang's "used": held by requests, not free and not evictable cache."""
    try:
        return int(stats["pages_total"]) - int(stats["pages_free"]) - int(stats["pages_evictable"])
    except (KeyError, TypeError, ValueError):
        return None


def _used_tokens(stats: Mapping[str, Any], page_size: int) -> float | None:
    used = _used_pages(stats)
    return None if used is None else float(used * page_size)


def _token_usage(stats: Mapping[str, Any], page_size: int) -> float | None:
    used, total = _used_pages(stats), stats.get("pages_total")
    return round(used / total, 2) if used is not None and total else None


ENGINE_SERIES: dict[str, tuple[str, str, EngineValue]] = {
    "sglang:num_running_reqs": ("gauge", "The number of running requests.", _get("num_running")),
    "sglang:num_queue_reqs": ("gauge", "The number of requests in the waiting queue.",
                              _get("queued")),
    "sglang:token_usage": ("gauge", "The token usage.", _token_usage),
    "sglang:num_used_tokens": ("gauge", "The number of used tokens.", _used_tokens),
    "sglang:kv_used_tokens": ("gauge", "Number of actively used token slots in the KV cache "
                              "pool.", _used_tokens),
    "sglang:kv_available_tokens": ("gauge", "Number of free token slots in the KV cache pool.",
                                   _get("pages_free", scale=True)),
    "sglang:kv_evictable_tokens": ("gauge", "Number of evictable (radix-cached) token slots "
                                   "in the KV cache pool.", _get("pages_evictable", scale=True)),
    "sglang:num_retracted_requests_total": ("counter", "Total number of retracted requests.",
                                            _get("requests_retracted_total")),
    "sglang:evicted_tokens_total": ("counter", "The number of device KV token slots freed by "
                                    "eviction.", _get("pages_evicted_total", scale=True)),
}
# PD queues, by role: prefill's requests whose KV is being sent (held pages), decode's
# reservations waiting for pages (the admission queue, SGLang's prealloc queue)
ROLE_SERIES: dict[str, dict[str, tuple[str, str, EngineValue]]] = {
    "prefill": {"sglang:num_prefill_inflight_queue_reqs": (
        "gauge", "The number of requests in the prefill inflight queue.",
        _get("requests_held"))},
    "decode": {"sglang:num_decode_prealloc_queue_reqs": (
        "gauge", "The number of requests in the decode prealloc queue.",
        _get("reservations_pending"))},
}
TIER_SERIES: dict[str, tuple[str, str, EngineValue]] = {
    "sglang:hicache_host_used_tokens": ("gauge", "Number of tokens currently used in the host "
                                        "KV cache.", _get("host_pages_used", scale=True)),
    "sglang:hicache_host_total_tokens": ("gauge", "Total capacity of the host KV cache in "
                                         "tokens.", _get("host_pages_total", scale=True)),
}


class SGLangEngineCollector(Collector):
    """SGLang's scheduler gauges, read at scrape time (any thread) from `stats()` and, with
    HiCache, `tier_stats()`; a failing read yields nothing, never a failed scrape."""

    def __init__(self, stats: Callable[[], Mapping[str, Any]],
                 tier_stats: Callable[[], Mapping[str, Any]] | None, model_name: str,
                 engine_type: str) -> None:
        self._stats = stats
        self._tier_stats = tier_stats
        self._labels = [model_name, engine_type, "0", "0", "0"]
        self._engine_series = {**ENGINE_SERIES, **ROLE_SERIES.get(engine_type, {})}

    def collect(self) -> Iterator[Metric]:
        stats = self._read(self._stats)
        if stats is None:
            return
        page_size = int(stats.get("page_size") or 1)
        yield from self._families(self._engine_series, stats, page_size)
        if self._tier_stats is not None:
            tiers = self._read(self._tier_stats)
            if tiers is not None:
                yield from self._families(TIER_SERIES, tiers, page_size)

    def _read(self, read: Callable[[], Mapping[str, Any]]) -> Mapping[str, Any] | None:
        try:
            return read()
        except Exception:
            log.exception("stats() failed during a metrics scrape (sglang series)")
            return None

    def _families(self, table: dict[str, tuple[str, str, EngineValue]],
                  stats: Mapping[str, Any], page_size: int) -> Iterator[Metric]:
        for name, (kind, help_text, read) in table.items():
            value = read(stats, page_size)
            if value is None:
                continue
            if kind == "counter":
                family: Metric = CounterMetricFamily(name.removesuffix("_total"), help_text,
                                                     labels=SCHEDULER_LABELS)
            else:
                family = GaugeMetricFamily(name, help_text, labels=SCHEDULER_LABELS)
            family.add_metric(self._labels, value)
            yield family
