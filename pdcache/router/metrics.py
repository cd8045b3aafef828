"""Prometheus series of the router (prefix `pdcache_router_`), one registry per app.

Counters and histograms are updated on the router's event loop by the request handlers and
the admission queue; per-node health, in-flight and slot gauges, the queue depth and the
session count are read at scrape time (`NodeGaugeCollector`), so they are never stale.

Load series: `pdcache_router_queue_depth` (requests waiting for a slot now) and
`_queue_depth_peak` (the most since start), `pdcache_router_queue_wait_seconds{node,role}`
(time in the queue of every admitted request, per node of its route; 0 when it did not
wait), `pdcache_router_rejected_total{reason}` (queue_full, queue_timeout, no_healthy_node,
node_overloaded: a node's 503 that could not be retried elsewhere),
`pdcache_router_retries_total{reason}` (unreachable, overloaded),
`pdcache_router_node_slots_held{node,role}` and `pdcache_router_node_inflight_limit{node,role}`
(0: no limit).

SGLang's request series (`sglang:prompt_tokens_total`, `sglang:generation_tokens_total`,
`sglang:cached_tokens_total{cache_source}`, `sglang:num_requests_total`,
`sglang:e2e_request_latency_seconds`, ...; `pdcache.wire.metrics`) count the
router's finished requests with `engine_type="router"`, from the nodes' `meta`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from pdcache.engine.api import CachedTokens
from pdcache.router.admission import AdmissionObserver
from pdcache.router.policy import NodeState
from pdcache.router.route import Route
from pdcache.wire.generate_api import GenerateMeta
from pdcache.wire.metrics import LATENCY_BUCKETS, TIERS, SGLangRequestSeries

REJECT_REASONS = ("queue_full", "queue_timeout", "no_healthy_node", "node_overloaded")
RETRY_REASONS = ("unreachable", "overloaded")
WAIT_BUCKETS = (0.0, *LATENCY_BUCKETS)  # the first bucket counts requests that never waited


@dataclass(frozen=True)
class QueueView:
    """What the scrape reads from admission: depth now, peak depth, slots and limits."""

    depth: Callable[[], int]
    peak: Callable[[], int]
    held: Callable[[NodeState], int]
    limit: Callable[[NodeState], int]


def _no_queue() -> QueueView:
    return QueueView(lambda: 0, lambda: 0, lambda _n: 0, lambda _n: 0)


class NodeGaugeCollector(Collector):
    """Scrape-time gauges; reads the node states, the session count and the queue."""

    def __init__(self, nodes: Callable[[], Sequence[NodeState]], sessions: Callable[[], int],
                 queue: QueueView | None = None):
        self._nodes = nodes
        self._sessions = sessions
        self._queue = queue or _no_queue()

    def collect(self) -> Iterator[Metric]:
        healthy = GaugeMetricFamily("pdcache_router_node_healthy", "1 if the node is healthy",
                                    labels=["node", "role"])
        in_flight = GaugeMetricFamily("pdcache_router_node_in_flight",
                                      "requests the router has in flight on the node",
                                      labels=["node", "role"])
        held = GaugeMetricFamily("pdcache_router_node_slots_held",
                                 "router slots held on the node by admitted requests",
                                 labels=["node", "role"])
        limit = GaugeMetricFamily("pdcache_router_node_inflight_limit",
                                  "the router's in-flight limit of the node (0: none)",
                                  labels=["node", "role"])
        queue = self._queue
        for node in self._nodes():
            labels = [node.name, node.role]
            healthy.add_metric(labels, 1.0 if node.healthy else 0.0)
            in_flight.add_metric(labels, float(node.in_flight))
            held.add_metric(labels, float(queue.held(node)))
            limit.add_metric(labels, float(max(0, queue.limit(node))))
        yield from (healthy, in_flight, held, limit)
        yield GaugeMetricFamily("pdcache_router_queue_depth",
                                "requests waiting in the router's queue for a free slot",
                                value=float(queue.depth()))
        yield GaugeMetricFamily("pdcache_router_queue_depth_peak",
                                "the most requests that waited at once since start",
                                value=float(queue.peak()))
        yield GaugeMetricFamily("pdcache_router_sessions", "sessions with a stored history",
                                value=float(self._sessions()))


class RouterMetrics(AdmissionObserver):
    """Request, latency, per-node, load and cache series of one router; also the admission
    queue's observer."""

    def __init__(self, nodes: Callable[[], Sequence[NodeState]], sessions: Callable[[], int],
                 queue: QueueView | None = None, *, model_name: str = ""):
        self.registry = reg = CollectorRegistry(auto_describe=True)
        # SGLang's request series, engine_type="router", from the nodes' meta
        self.sglang = SGLangRequestSeries(reg, model_name, "router")
        self.requests = Counter("pdcache_router_requests", "HTTP requests by endpoint and status",
                                ["endpoint", "status"], registry=reg)
        self.latency = Histogram("pdcache_router_request_latency_seconds",
                                 "arrival to complete response, by endpoint", ["endpoint"],
                                 buckets=LATENCY_BUCKETS, registry=reg)
        self.ttft = Histogram("pdcache_router_time_to_first_token_seconds",
                              "arrival to the first streamed token (router clock)",
                              buckets=LATENCY_BUCKETS, registry=reg)
        self.node_requests = Counter("pdcache_router_node_requests",
                                     "requests sent to a node, by outcome (ok, error)",
                                     ["node", "role", "outcome"], registry=reg)
        self.retries = Counter("pdcache_router_retries",
                               "requests re-routed: their node was unreachable or answered 503",
                               ["reason"], registry=reg)
        self.rejections = Counter("pdcache_router_rejected",
                                  "requests answered 503 for load, by reason", ["reason"],
                                  registry=reg)
        self.queue_wait = Histogram("pdcache_router_queue_wait_seconds",
                                    "time admitted requests waited for a slot, per node of "
                                    "their route (0: no wait)", ["node", "role"],
                                    buckets=WAIT_BUCKETS, registry=reg)
        for reason in RETRY_REASONS:
            self.retries.labels(reason)
        for reason in REJECT_REASONS:
            self.rejections.labels(reason)
        self.prompt_tokens = Counter("pdcache_router_prompt_tokens",
                                     "prompt tokens of finished requests", registry=reg)
        self.generation_tokens = Counter("pdcache_router_generation_tokens",
                                         "tokens generated for finished requests", registry=reg)
        self.cached_tokens = Counter("pdcache_router_cached_tokens",
                                     "prompt tokens reused, by tier (from node responses)",
                                     ["tier"], registry=reg)
        self.computed_tokens = Counter("pdcache_router_computed_tokens",
                                       "prompt tokens computed (from node responses)", registry=reg)
        for tier in TIERS:
            self.cached_tokens.labels(tier)
        self.session_commits_refused = Counter(
            "pdcache_router_session_commits_refused",
            "finished session turns not committed: their session changed while they ran "
            "(another turn of it committed first, or it was closed)", registry=reg)
        reg.register(NodeGaugeCollector(nodes, sessions, queue))

    def observe_request(self, endpoint: str, status: int, seconds: float) -> None:
        self.requests.labels(endpoint, str(status)).inc()
        self.latency.labels(endpoint).observe(seconds)

    def waited(self, route: Route, seconds: float) -> None:
        for node in route.nodes:
            self.queue_wait.labels(node.name, node.role).observe(seconds)

    def rejected(self, reason: str) -> None:
        self.rejections.labels(reason).inc()

    def observe_node(self, node: NodeState, ok: bool) -> None:
        self.node_requests.labels(node.name, node.role, "ok" if ok else "error").inc()

    def observe_meta(self, meta: GenerateMeta | None, completion_tokens: int) -> None:
        """Token counts of one finished request, from the answering node's typed `meta`."""
        self.generation_tokens.inc(completion_tokens)
        if meta is None:
            return
        self.prompt_tokens.inc(max(meta.prompt_tokens, 0))
        self.computed_tokens.inc(max(meta.computed_tokens, 0))
        details = meta.cached_tokens_details.model_dump()
        for tier in TIERS:
            self.cached_tokens.labels(tier).inc(max(details.get(tier, 0), 0))

    def observe_sglang(self, meta: GenerateMeta | None, completion_tokens: int, e2e_s: float,
                       stream: bool, finish_reason: str | None) -> None:
        """One finished request in SGLang's series (tokens and cache sources from `meta`)."""
        prompt, cached = 0, CachedTokens()
        if meta is not None:
            prompt = max(meta.prompt_tokens, 0)
            cached = CachedTokens(**meta.cached_tokens_details.model_dump())
        self.sglang.observe_finished(prompt, completion_tokens, cached, e2e_s, stream=stream,
                                     aborted=finish_reason == "abort")

    def render(self) -> bytes:
        return generate_latest(self.registry)
