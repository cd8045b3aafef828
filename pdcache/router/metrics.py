"""Prometheus series of the router (prefix `pdcache_router_`), one registry per app.

Counters and histograms are updated on the router's event loop by the request handlers;
per-node health and in-flight gauges and the session count are read at scrape time from the
registry (`NodeGaugeCollector`), so they are never stale.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from pdcache.router.policy import NodeState
from pdcache.server.metrics import LATENCY_BUCKETS, TIERS


class NodeGaugeCollector(Collector):
    def __init__(self, nodes: Callable[[], Sequence[NodeState]], sessions: Callable[[], int]):
        self._nodes = nodes
        self._sessions = sessions

    def collect(self) -> Iterator[Metric]:
        healthy = GaugeMetricFamily("pdcache_router_node_healthy", "1 if the node is healthy",
                                    labels=["node", "role"])
        in_flight = GaugeMetricFamily("pdcache_router_node_in_flight",
                                      "requests the router has in flight on the node",
                                      labels=["node", "role"])
        for node in self._nodes():
            healthy.add_metric([node.name, node.role], 1.0 if node.healthy else 0.0)
            in_flight.add_metric([node.name, node.role], float(node.in_flight))
        yield healthy
        yield in_flight
        yield GaugeMetricFamily("pdcache_router_sessions", "sessions with a stored history",
                                value=float(self._sessions()))


class RouterMetrics:
    """Request, latency, per-node and cache series of one router."""

    def __init__(self, nodes: Callable[[], Sequence[NodeState]], sessions: Callable[[], int]):
        self.registry = reg = CollectorRegistry(auto_describe=True)
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
                               "requests re-routed after a node was unreachable", registry=reg)
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
        reg.register(NodeGaugeCollector(nodes, sessions))

    def observe_request(self, endpoint: str, status: int, seconds: float) -> None:
        self.requests.labels(endpoint, str(status)).inc()
        self.latency.labels(endpoint).observe(seconds)

    def observe_node(self, node: NodeState, ok: bool) -> None:
        self.node_requests.labels(node.name, node.role, "ok" if ok else "error").inc()

    def observe_meta(self, meta: Mapping[str, Any], completion_tokens: int) -> None:
        """Token counts of one finished request, from the answering node's `meta`."""
        self.prompt_tokens.inc(_count(meta.get("prompt_tokens")))
        self.generation_tokens.inc(completion_tokens)
        self.computed_tokens.inc(_count(meta.get("computed_tokens")))
        details = meta.get("cached_tokens_details")
        if isinstance(details, Mapping):
            for tier in TIERS:
                self.cached_tokens.labels(tier).inc(_count(details.get(tier)))

    def render(self) -> bytes:
        return generate_latest(self.registry)


def _count(value: Any) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else 0
