"""The Prometheus series a server and the router both expose (docs/design.md §4.7): the
cache tiers and latency buckets of the `pdcache_*` request series, and SGLang 0.5.23's
per-request series under its names and labels (`SGLangRequestSeries`, SGLang's
`TokenizerMetricsCollector`), so SGLang's dashboards work against pdcache:

the token counters `sglang:prompt_tokens_total`, `sglang:generation_tokens_total`,
`sglang:num_requests_total` (labels `model_name`, `engine_type`, `is_streaming`),
`sglang:cached_tokens_total{cache_source=device|host|storage}` (a source appears once it
counted something, as in SGLang; pdcache's `storage_from_decode` is part of `storage`),
`sglang:num_aborted_requests_total`, and the histograms `sglang:time_to_first_token_seconds`,
`sglang:e2e_request_latency_seconds`, `sglang:request_time_per_output_token_seconds`
(`is_streaming` too) and `sglang:inter_token_latency_seconds`, with SGLang's default buckets.
Updated on the event loop by a server's `ServerMetrics` (the bridge's `finish`) with
`engine_type` its role (`unified`, `prefill`, `decode`), and by the router from the nodes'
`meta` with `engine_type="router"`. The scheduler gauges read from an engine are
`pdcache.server.sglang_metrics`.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram

from pdcache.engine.api import CachedTokens

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

# SGLang's default buckets (TokenizerMetricsCollector)
TTFT_BUCKETS = (0.1, 0.2, 0.4, 0.6, 0.8, 1, 2, 4, 6, 8, 10, 20, 40, 60, 80, 100, 200, 400)
E2E_BUCKETS = (0.1, 0.2, 0.4, 0.6, 0.8, 1, 2, 4, 6, 8, 10, 20, 40, 60, 80, 100, 200, 400, 600,
               1200, 1800, 2400)
ITL_BUCKETS = (0.002, 0.004, 0.006, 0.008, 0.010, 0.015, 0.020, 0.025, 0.030, 0.035, 0.040,
               0.060, 0.080, 0.100, 0.200, 0.400, 0.600, 0.800, 1.000, 2.000, 4.000, 6.000,
               8.000)
BASE_LABELS = ("model_name", "engine_type")
STREAM_LABELS = (*BASE_LABELS, "is_streaming")


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
