"""Prometheus collectors of an HTTP server (prefix `pdcache_`, and SGLang's `sglang:` names
from `pdcache.wire.metrics` and `pdcache.server.sglang_metrics`), one registry per app.

`ServerMetrics` owns its `CollectorRegistry` (never the global default one), so several apps
in one process (tests, a launcher) never share or clash on series. Counters are updated by the
request handlers on the event loop; engine gauges (queue depth, pages) are read from
`engine.stats()` at scrape time by `EngineStatsCollector`, and lower-tier series (host pool,
storage I/O, storage backend) from the scheduler's `stats()` by `TierStatsCollector`.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator, Mapping
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from pdcache.engine.api import CachedTokens
from pdcache.server.sglang_metrics import SGLangEngineCollector
from pdcache.wire.metrics import LATENCY_BUCKETS, TIERS, SGLangRequestSeries

log = logging.getLogger(__name__)

# metric name -> (engine.stats() keys, first present wins; help). Absent keys are skipped.
ENGINE_GAUGES: dict[str, tuple[tuple[str, ...], str]] = {
    "pdcache_queue_depth": (("queued",), "requests submitted and not yet running"),
    "pdcache_running_requests": (("num_running", "running"), "requests prefilling or decoding"),
    "pdcache_device_pages_total": (("pages_total", "pages_capacity"), "device KV pool pages"),
    "pdcache_device_pages_free": (("pages_free",), "free device KV pages"),
    "pdcache_device_pages_used": (("pages_used",), "device pages held by requests or the cache"),
    "pdcache_device_pages_cached": (("cached_pages", "pages_cached"), "pages in the prefix tree"),
    # hybrid models (recurrent state, docs/design.md §4.14); absent for other models
    "pdcache_state_slots_total": (("state_slots_total",),
                                  "device recurrent-state slots (requests' and checkpoints')"),
    "pdcache_state_slots_free": (("state_slots_free",), "free device recurrent-state slots"),
    "pdcache_state_slot_bytes": (("state_slot_bytes",), "bytes of one recurrent state"),
    "pdcache_state_checkpoints": (("state_checkpoints",),
                                  "state checkpoints the device prefix tree holds"),
    # sliding-window models with window pages (docs/design.md §4.14); absent otherwise
    "pdcache_window_pages_total": (("window_pages_total",),
                                   "device pages of the sliding layers' own pool"),
    "pdcache_window_pages_free": (("window_pages_free",), "free sliding-layer pages"),
    "pdcache_window_pages_cached": (("window_pages_cached",),
                                    "sliding-layer pages the prefix tree holds"),
}
ENGINE_COUNTERS: dict[str, tuple[tuple[str, ...], str]] = {
    "pdcache_device_pages_evicted": (("pages_evicted_total",), "prefix-cache pages evicted"),
    "pdcache_device_suspect_pages_dropped": (("suspect_pages_dropped_total",),
                                             "prefix-cache pages dropped because a host → "
                                             "device copy into them failed"),
    "pdcache_requests_retracted": (("requests_retracted_total",), "requests preempted"),
    "pdcache_engine_step_errors": (("step_errors_total",), "engine steps that raised"),
    "pdcache_engine_callback_errors": (("callback_errors_total",), "callbacks that raised"),
    "pdcache_decode_paced_steps": (("paced_steps_total",),
                                   "decode steps held back by [scheduler] decode_step_interval_ms"),
    "pdcache_decode_paced_seconds": (("paced_seconds_total",),
                                     "time decode steps were held back for"),
    "pdcache_decode_yielded_steps": (("yielded_steps_total",),
                                     "decode steps held back while another engine on the "
                                     "compute share computed prefill"),
    "pdcache_decode_yielded_seconds": (("yielded_seconds_total",),
                                       "time decode steps were held back for by the compute share"),
    "pdcache_compute_share_busy_seconds": (("compute_share_busy_seconds_total",),
                                           "time this engine announced prefill work on the "
                                           "compute share"),
    "pdcache_compute_share_errors": (("compute_share_errors_total",),
                                     "compute share lock calls that failed (the first turns "
                                     "the share off for this engine)"),
    "pdcache_state_checkpoints_taken": (("state_checkpoints_taken_total",),
                                        "state checkpoints copied on device ([cache] "
                                        "state_checkpoints; a renewed decode one each time)"),
    "pdcache_state_checkpoints_skipped": (("state_checkpoints_skipped_total",),
                                          "state checkpoints not taken: no checkpoint slot"),
    "pdcache_state_checkpoints_restored": (("state_checkpoints_restored_total",),
                                           "admissions whose state came from a device "
                                           "checkpoint"),
    "pdcache_state_checkpoints_evicted": (("state_checkpoints_evicted_total",),
                                          "state checkpoints freed with their node's pages"),
    "pdcache_state_checkpoints_dropped": (("state_checkpoints_dropped_total",),
                                          "state checkpoints dropped alone (LRU) to make "
                                          "room for a newer one"),
    "pdcache_state_checkpoint_bytes": (("state_checkpoint_bytes_total",),
                                       "device bytes copied into state checkpoints"),
    "pdcache_state_limited_hits": (("prefix_hits_limited_by_state_total",),
                                   "admissions whose page match was cut to an earlier point "
                                   "because no state checkpoint was at its end"),
    "pdcache_state_limited_tokens": (("tokens_limited_by_state_total",),
                                     "matched tokens not reused for want of a state checkpoint"),
    "pdcache_window_pages_freed": (("window_pages_freed_total",),
                                   "sliding-layer pages freed as requests' windows moved"),
    "pdcache_window_pages_reclaimed": (("window_pages_reclaimed_total",),
                                       "the prefix tree's sliding-layer pages on locked paths "
                                       "freed for a request short of them (no reader left)"),
    "pdcache_window_limited_hits": (("prefix_hits_limited_by_window_total",),
                                    "admissions whose page match was cut to an earlier point "
                                    "because the sliding pages before it were freed"),
    "pdcache_window_limited_tokens": (("tokens_limited_by_window_total",),
                                      "matched tokens not reused for want of sliding pages"),
}


# Lower tiers (HiCache: host pool, IoWorkers, storage backend), read from the scheduler's
# `stats()` when it has one. metric name -> (kind, label name, {label value: stats key}, help).
# A series whose key is absent (e.g. no storage configured) is not exported.
TIER_SERIES: dict[str, tuple[str, str, dict[str, str], str]] = {
    "pdcache_prefetch_pages": ("counter", "", {"": "prefetch_pages"},
                               "pages read from storage into host and used by a request"),
    "pdcache_prefetch_bytes": ("counter", "", {"": "prefetch_bytes"},
                               "bytes of those prefetched pages"),
    "pdcache_prefetch_failed_pages": ("counter", "", {"": "prefetch_failed_pages"},
                                      "storage reads that missed, failed or were not queued"),
    "pdcache_prefetch_abandoned_pages": ("counter", "", {"": "prefetch_abandoned_pages"},
                                         "prefetched pages not used (late, or after a gap)"),
    "pdcache_prefetch_restarts": ("counter", "", {"": "prefetch_restarts"},
                                  "prefetches restarted because the match they continue "
                                  "shrank while the request waited (cache.prefetch_restarts)"),
    "pdcache_prefetch_streamed_pages": ("counter", "", {"": "prefetch_streamed_pages"},
                                        "prefetched pages read layer-major while the forward "
                                        "ran (cache.prefetch_layerwise)"),
    "pdcache_prefetch_stream_failed_loads": ("counter", "", {"": "stream_failed_loads"},
                                             "layer-streamed loads whose pages failed "
                                             "verification after use (request recomputed)"),
    "pdcache_prefetch_stream_timed_out_loads": ("counter", "", {"": "stream_timed_out_loads"},
                                                "of those, loads whose read had not ended by "
                                                "the prefetch deadline (read cancelled)"),
    "pdcache_backup_pages": ("counter", "tier", {"host": "backup_host_pages",
                                                 "storage": "backup_storage_pages"},
                             "pages backed up, by destination tier"),
    "pdcache_backup_failed_pages": ("counter", "reason", {"no_host_room": "backup_skipped_pages",
                                                          "storage": "backup_failed_pages",
                                                          "victim_ranked_out":
                                                              "victim_dropped_pages"},
                                    "pages not backed up"),
    "pdcache_load_pages": ("counter", "", {"": "load_pages"},
                           "host pages loaded to device (host hits and prefetched pages)"),
    "pdcache_load_failed_copies": ("counter", "", {"": "load_failed_copies"},
                                   "host → device loads whose copy raised (their requests "
                                   "recomputed)"),
    "pdcache_host_evicted_pages": ("counter", "", {"": "host_evicted_pages"},
                                   "host copies dropped by host eviction (host_eviction policy)"),
    "pdcache_host_released_pages": ("counter", "", {"": "host_released_pages"},
                                    "exclusive host: host copies freed once loaded (or recomputed) on device"),
    "pdcache_pending_pages": ("counter", "outcome", {"found": "pending_found_pages",
                                                     "waited": "pending_waited_pages",
                                                     "pulled": "pending_pulled_pages",
                                                     "raced": "pending_raced_pages"},
                              "pages a decode node was still writing when a lookup needed "
                              "them (found), then read after waiting (waited), pulled from "
                              "decode's host staging (pulled) or recomputed (raced)"),
    "pdcache_pending_pull_pages": ("counter", "outcome", {
        "requested": "pull_pages_requested", "received": "pull_pages_received",
        "rejected": "pull_pages_rejected", "unavailable": "pull_pages_unavailable"},
        "pages this prefill pulled from decode staging: asked for, received verified, refused "
        "by verification (bad MAC/checksum/header), not staged any more"),
    "pdcache_pending_pulls": ("counter", "outcome", {"sent": "pulls",
                                                     "timed_out": "pull_timeouts",
                                                     "abandoned": "pull_abandoned"},
                              "pulls of pending pages sent, those not answered in time, and "
                              "those closed unfinished before it (request admitted or "
                              "cancelled, or the pages landed in storage first)"),
    "pdcache_pending_pull_rate_bytes_per_second": (
        "gauge", "", {"": "pull_rate_bytes_s"},
        "the pull rate the pull rule estimates with (measured from completed pulls)"),
    "pdcache_pending_wait_seconds": ("counter", "", {"": "pending_wait_s"},
                                     "lookup to admission of the requests that waited for "
                                     "pending pages, summed"),
    "pdcache_pending_wait_requests": ("counter", "", {"": "pending_wait_requests"},
                                      "requests that waited for pending pages"),
    "pdcache_pending_keys": ("gauge", "", {"": "pending_keys_tracked"},
                             "decode-announced page writes this node tracks (pending or landed)"),
    "pdcache_sessions_tracked": ("gauge", "", {"": "sessions_tracked"},
                                 "conversations the eviction policies know of"),
    "pdcache_storage_errors": ("counter", "kind", {
        "read": "storage_read_errors", "write": "storage_write_errors",
        "metadata": "storage_metadata_errors", "full": "storage_full_rejects",
        "io_task": "storage_errors"}, "storage failures (each a miss or a skipped write)"),
    "pdcache_storage_corrupt_pages": ("counter", "", {"": "storage_corrupt_pages"},
                                      "stored pages that failed header/checksum checks (misses)"),
    "pdcache_storage_rejected_pages": ("counter", "reason", {
        reason: f"storage_rejected_{reason}_pages"
        for reason in ("header", "checksum", "mac", "truncated", "foreign", "needs_key",
                       "wrong_key")},
        "stored pages found but not served, by reason (mac: unauthenticated or forged)"),
    "pdcache_storage_replaced_pages": ("counter", "", {"": "storage_replaced_rejected_pages"},
                                       "refused stored pages replaced by this node's write"),
    "pdcache_storage_evicted_pages": ("counter", "", {"": "storage_evictions"},
                                      "pages evicted by the storage tier's LRU"),
    "pdcache_storage_read_bytes": ("counter", "", {"": "storage_bytes_read"},
                                   "bytes read from storage by this node"),
    "pdcache_storage_written_bytes": ("counter", "", {"": "storage_bytes_written"},
                                      "bytes written to storage by this node"),
    "pdcache_storage_mac_pipeline_calls": ("counter", "call", {
        f"{op}_{way}": f"storage_pipeline_{op}_{way}_calls"
        for op in ("read", "write") for way in ("pipelined", "inline", "busy")},
        "hf3fs and file batches of sealed pages moved with the MAC beside the I/O (pipelined) "
        "or page by page (inline), as the adaptive default chose from their measured speed; "
        "busy: chose the pipeline, found its helper taken by another batch, went page by page"),
    "pdcache_io_queue_depth": ("gauge", "queue", {"backup": "backup_queue_depth",
                                                  "prefetch": "prefetch_queue_depth"},
                               "storage I/O tasks waiting in each worker queue"),
    "pdcache_io_tasks_rejected": ("counter", "queue", {"backup": "backup_tasks_rejected",
                                                       "prefetch": "prefetch_tasks_rejected"},
                                  "I/O tasks refused because the queue was full"),
    "pdcache_host_pages": ("gauge", "state", {"free": "host_pages_free",
                                              "used": "host_pages_used",
                                              "in_flight": "host_pages_in_flight"},
                           "host KV pool pages by state"),
    "pdcache_host_pages_total": ("gauge", "", {"": "host_pages_total"}, "host KV pool pages"),
    "pdcache_host_pages_outside_tree": ("gauge", "held", {
        "untracked": "host_pages_untracked",
        "pinned_in_tree": "host_pages_pinned_in_tree",
        "abandoned_prefetch": "host_pages_abandoned_prefetch",
        "stream_deferred": "host_pages_stream_deferred"},
        "host pages not (only) owned by the radix tree: USED pages no node holds, node pages "
        "still pinned, pages of abandoned prefetches and of stream-deferred frees (0 when idle)"),
    "pdcache_storage_pages": ("gauge", "state", {"used": "storage_used_pages",
                                                 "free": "storage_free_pages",
                                                 "reserved": "storage_reserved_pages",
                                                 "retired": "storage_retired_pages"},
                              "storage slots by state (as seen by this node; retired: slots "
                              "a full file system had no room for)"),
    "pdcache_storage_pages_total": ("gauge", "", {"": "storage_capacity_pages"},
                                    "storage capacity in pages"),
    # hybrid models: each tier hop's bytes, KV pages beside recurrent states (state series
    # are 0 for other models); path: device_to_host, host_to_storage (backups, written),
    # storage_to_host (prefetched, read), host_to_device (loads)
    "pdcache_kv_bytes": ("counter", "path", {"device_to_host": "backup_host_kv_bytes",
                                             "host_to_storage": "backup_storage_kv_bytes",
                                             "storage_to_host": "prefetch_bytes",
                                             "host_to_device": "load_host_kv_bytes"},
                         "KV page bytes moved between the tiers, by path"),
    "pdcache_state_bytes": ("counter", "path", {"device_to_host": "backup_host_state_bytes",
                                                "host_to_storage": "backup_storage_state_bytes",
                                                "storage_to_host": "prefetch_state_bytes",
                                                "host_to_device": "load_state_bytes"},
                            "recurrent-state checkpoint bytes moved between the tiers, by path"),
    "pdcache_state_tier_checkpoints": ("counter", "event", {
        "host_backup": "backup_host_states", "host_skipped": "backup_skipped_states",
        "host_evicted": "host_states_evicted", "storage_written": "backup_storage_states",
        "storage_failed": "backup_failed_states", "storage_read": "prefetch_states",
        "storage_missed": "prefetch_state_misses", "loaded_from_host": "load_host_states",
        "loaded_from_storage": "load_storage_states"},
        "state checkpoints on the host and storage tiers: backed up to host, skipped (no host "
        "state slot), dropped by host eviction, written to / failed on storage, read from "
        "storage, missing or refused there (hit shortened), restored to device from host or "
        "storage"),
    "pdcache_state_host_slots": ("gauge", "state", {"used": "host_state_slots_used",
                                                    "pinned": "host_state_slots_pinned"},
                                 "host state pool slots in use, and those pinned by a write"),
    "pdcache_state_host_slots_total": ("gauge", "", {"": "host_state_slots"},
                                       "host state pool slots"),
    "pdcache_state_host_bytes_used": ("gauge", "", {"": "host_state_bytes_used"},
                                      "host memory held by state checkpoints"),
}


class TierStatsCollector(Collector):
    """Reads the scheduler's lower-tier `stats()` at scrape time (any thread: the values are
    ints read racily from counters the engine and I/O threads update, which is fine for
    metrics). A failing read yields no tier series, never a failed scrape."""

    def __init__(self, stats: Callable[[], Mapping[str, Any]], server_name: str) -> None:
        self._stats = stats
        self._server_name = server_name

    def collect(self) -> Iterator[Metric]:
        try:
            stats = self._stats()
        except Exception:
            log.exception("tier stats() failed during a metrics scrape")
            return
        for name, (kind, label, keys, help_text) in TIER_SERIES.items():
            present = {value: stats[key] for value, key in keys.items() if key in stats}
            if not present:
                continue
            labels = ["server", label] if label else ["server"]
            cls = CounterMetricFamily if kind == "counter" else GaugeMetricFamily
            family = cls(name, help_text, labels=labels)
            for value, number in present.items():
                family.add_metric([self._server_name, value] if label else [self._server_name],
                                  float(number))
            yield family


class TransferCollector(Collector):
    """A KVSender's / KVReceiver's `stats()` at scrape time:
    `pdcache_control_rejected_messages_total{kind}`, control messages it dropped (malformed, ...,
    unauthenticated, stale, replayed, stale_boot: docs/security.md; every kind, zeros
    included), and `pdcache_kv_transfer_bytes_total{direction}`, the KV bytes it pushed
    (`sent`, prefill) or received (`received`, decode) through the transfer engine; with a
    hybrid model's states, `pdcache_state_transfer_bytes_total{direction}` beside it (a
    sibling, not a `kind` label: the KV series keeps its meaning and its sums)."""

    def __init__(self, stats: Callable[[], Mapping[str, Any]], server_name: str) -> None:
        self._stats = stats
        self._server_name = server_name

    def collect(self) -> Iterator[Metric]:
        from pdcache.transfer.messages import REJECT_KINDS

        try:
            stats = self._stats()
            counts = dict(stats.get("rejected", {}))
        except Exception:
            log.exception("transfer stats() failed during a metrics scrape")
            return
        family = CounterMetricFamily("pdcache_control_rejected_messages",
                                     "control-plane messages dropped, by kind",
                                     labels=["server", "kind"])
        for kind in REJECT_KINDS:
            family.add_metric([self._server_name, kind], float(counts.get(kind, 0)))
        yield family
        moved = CounterMetricFamily("pdcache_kv_transfer_bytes",
                                    "KV bytes moved P->D by the transfer engine",
                                    labels=["server", "direction"])
        for direction in ("sent", "received"):
            if f"bytes_{direction}" in stats:
                moved.add_metric([self._server_name, direction],
                                 float(stats[f"bytes_{direction}"]))
        yield moved
        states = CounterMetricFamily("pdcache_state_transfer_bytes",
                                     "recurrent-state bytes moved P->D with their pages",
                                     labels=["server", "direction"])
        for direction in ("sent", "received"):
            if f"state_bytes_{direction}" in stats:
                states.add_metric([self._server_name, direction],
                                  float(stats[f"state_bytes_{direction}"]))
        yield states


class EngineStatsCollector(Collector):
    """Reads `stats()` at scrape time; a failing engine yields no gauges, never a failed scrape.
    `gauges` / `counters`: metric name -> (stats keys, first present wins; help); a node adds
    its own series from the same stats with a second collector and its own tables."""

    def __init__(self, stats: Callable[[], Mapping[str, Any]], server_name: str, *,
                 gauges: Mapping[str, tuple[tuple[str, ...], str]] = ENGINE_GAUGES,
                 counters: Mapping[str, tuple[tuple[str, ...], str]] = ENGINE_COUNTERS) -> None:
        self._stats = stats
        self._server_name = server_name
        self._tables = ((GaugeMetricFamily, gauges), (CounterMetricFamily, counters))

    def collect(self) -> Iterator[Metric]:
        try:
            stats = self._stats()
        except Exception:  # a scrape must not take the server down; the error is logged
            log.exception("engine.stats() failed during a metrics scrape")
            return
        for kind, table in self._tables:
            for name, (keys, help_text) in table.items():
                value = next((stats[k] for k in keys if k in stats), None)
                if isinstance(value, int | float) and not isinstance(value, bool):
                    family = kind(name, help_text, labels=["server"])
                    family.add_metric([self._server_name], float(value))
                    yield family


class ServerMetrics:
    """Request, token and latency series of one server: `pdcache_*`, and SGLang's names
    (`self.sglang`: `pdcache.wire.metrics`; `SGLangEngineCollector`:
    `pdcache.server.sglang_metrics`) with the
    labels `model_name` and `engine_type` (the node's role)."""

    def __init__(self, server_name: str, stats: Callable[[], Mapping[str, Any]] | None = None,
                 tier_stats: Callable[[], Mapping[str, Any]] | None = None, *,
                 model_name: str = "", engine_type: str = "unified"):
        self.registry = CollectorRegistry(auto_describe=True)
        reg = self.registry
        self.sglang = SGLangRequestSeries(reg, model_name, engine_type)
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
        if tier_stats is not None:
            reg.register(TierStatsCollector(tier_stats, server_name))
        if stats is not None:
            reg.register(SGLangEngineCollector(stats, tier_stats, model_name, engine_type))

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
            self.sglang.observe_itl(gap_s, count)

    def render(self) -> bytes:
        return generate_latest(self.registry)
