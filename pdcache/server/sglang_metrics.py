"""Prometheus series under SGLang 0.5.23's names and labels, beside the `pdcache_*` ones, so
SGLang's dashboards work against pdcache nodes (docs/design.md §4.7).

Two halves, as in SGLang:
- `SGLangRequestSeries` (SGLang's `TokenizerMetricsCollector`): per finished request, the
  token counters `sglang:prompt_tokens_total`, `sglang:generation_tokens_total`,
  `sglang:num_requests_total` (labels `model_name`, `engine_type`, `is_streaming`),
  `sglang:cached_tokens_total{cache_source=device|host|storage}` (a source appears once it
  counted something, as in SGLang; pdcache's `storage_from_decode` is part of `storage`),
  `sglang:num_aborted_requests_total`, and the histograms `sglang:time_to_first_token_seconds`,
  `sglang:e2e_request_latency_seconds`, `sglang:request_time_per_output_token_seconds`
  (`is_streaming` too) and `sglang:inter_token_latency_seconds`, with SGLang's default
  buckets. Updated on the event loop by `ServerMetrics` (the bridge's `finish`), and by the
  router from the nodes' `meta`.
- `SGLangEngineCollector` (SGLang's `SchedulerMetricsCollector`): gauges read from
  `engine.stats()` (and the HiCache `stats()`) at scrape time, any thread, labels
  `model_name`, `engine_type`, `tp_rank`, `pp_rank`, `moe_ep_rank`.

`engine_type` is SGLang's: `unified`, `prefill` or `decode` (the node's role); the router
exports the request half with `engine_type="router"`.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator, Mapping
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from pdcache.engine.api import CachedTokens

log = logging.getLogger(__name__)

# SGLang's default buckets (TokenizerMetricsCollector)
TTFT_BUCKETS = (0.1, 0.2, 0.4, 0.6, 0.8, 1, 2, 4, 6, 8, 10, 20, 40, 60, 80, 100, 200, 400)
E2E_BUCKETS = (0.1, 0.2, 0.4, 0.6, 0.8, 1, 2, 4, 6, 8, 10, 20, 40, 60, 80, 100, 200, 400, 600,
               1200, 1800, 2400)
ITL_BUCKETS = (0.002, 0.004, 0.006, 0.008, 0.010, 0.015, 0.020, 0.025, 0.030, 0.035, 0.040,
               0.060, 0.080, 0.100, 0.200, 0.400, 0.600, 0.800, 1.000, 2.000, 4.000, 6.000,
               8.000)
BASE_LABELS = ("model_name", "engine_type")
STREAM_LABELS = (*BASE_LABELS, "is_streaming")
SCHEDULER_LABELS = (*BASE_LABELS, "tp_rank", "pp_rank", "moe_ep_rank")


class SGLangRequestSeries:
    """SGLang's per-request series in `registry`; mutated on the event loop only."""

    def __init__(self, registry: CollectorRegistry, model_name: str, engine_type: str) -> None:
        self.base = (model_name, engine_type)
        reg = registry
        self.prompt_tokens = Counter("sglang:prompt_tokens_total",
                                     "Number of prefill tokens processed.", STREAM_LABELS,
                                     registry=reg)
        self.generation_tokens = Counter("sglang:generation_tokens_total",
                                         "Number of generation tokens processed.", STREAM_LABELS,
                                         registry=reg)
        self.cached_tokens = Counter("sglang:cached_tokens_total",
                                     "Number of cached prompt tokens by source "
                                     "(device/host/storage).", (*BASE_LABELS, "cache_source"),
                                     registry=reg)
        self.requests = Counter("sglang:num_requests_total", "Number of requests processed.",
                                STREAM_LABELS, registry=reg)
        self.aborted = Counter("sglang:num_aborted_requests_total",
                               "Number of requests aborted.", BASE_LABELS, registry=reg)
        self.ttft = Histogram("sglang:time_to_first_token_seconds",
                              "Histogram of time to first token in seconds.", STREAM_LABELS,
                              buckets=TTFT_BUCKETS, registry=reg)
        self.itl = Histogram("sglang:inter_token_latency_seconds",
                             "Histogram of inter-token latency in seconds.", BASE_LABELS,
                             buckets=ITL_BUCKETS, registry=reg)
        self.tpot = Histogram("sglang:request_time_per_output_token_seconds",
                              "Per-request TPOT in seconds: (finished_time - first_token_time) "
                              "/ (completion_tokens - 1).", STREAM_LABELS,
                              buckets=ITL_BUCKETS, registry=reg)
        self.e2e = Histogram("sglang:e2e_request_latency_seconds",
                             "Histogram of End-to-end request latency in seconds",
                             STREAM_LABELS, buckets=E2E_BUCKETS, registry=reg)

    def observe_finished(self, prompt_tokens: int, generation_tokens: int, cached: CachedTokens,
                         e2e_s: float, *, stream: bool, aborted: bool) -> None:
        """One finished request (every way it ended), as SGLang's
        `observe_one_finished_request` counts it."""
        labels = (*self.base, "true" if stream else "false")
        self.prompt_tokens.labels(*labels).inc(prompt_tokens)
        self.generation_tokens.labels(*labels).inc(generation_tokens)
        for source, count in (("device", cached.device), ("host", cached.host),
                              ("storage", cached.storage)):
            if count > 0:
                self.cached_tokens.labels(*self.base, source).inc(count)
        self.requests.labels(*labels).inc()
        self.e2e.labels(*labels).observe(e2e_s)
        if aborted:
            self.aborted.labels(*self.base).inc()

    def observe_latency(self, ttft_s: float | None, decode_s: float | None,
                        generation_tokens: int, *, stream: bool) -> None:
        """TTFT, and TPOT over the tokens after the first (when there are some)."""
        labels = (*self.base, "true" if stream else "false")
        if ttft_s is not None:
            self.ttft.labels(*labels).observe(ttft_s)
        if decode_s is not None and generation_tokens > 1:
            self.tpot.labels(*labels).observe(decode_s / (generation_tokens - 1))

    def observe_itl(self, gap_s: float, count: int) -> None:
        """`count` tokens arrived together `gap_s` after the previous ones."""
        histogram = self.itl.labels(*self.base)
        for _ in range(count):
            histogram.observe(gap_s / count)


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
