"""The router's view of its nodes: one `NodeState` per configured node, kept current by an
async health-check loop and by what requests observe.

Health: every `health_interval_s` each node gets `GET /health` (deadline `health_timeout_s`);
`unhealthy_after` failures in a row mark it unhealthy, one success marks it healthy again. A
request that cannot even connect marks its node unhealthy at once (passive check), so traffic
moves to the other nodes without waiting for the next probe. A node that comes back forgets
its cache-aware prefix index (a restarted node has an empty cache).

Everything here runs on the router's event loop (no locking); the loop task logs and survives
every probe error, and `stop()` ends it within one interval. `on_checked` runs after every
round of probes (the admission queue looks again at what may now be served).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import httpx

from pdcache.router.policy import NodeState

log = logging.getLogger(__name__)

ROLES = ("prefill", "decode", "unified")


@dataclass(frozen=True)
class NodeEndpoint:
    """One configured node: its name, role, HTTP base URL, (prefill) KV bootstrap address and
    the router's in-flight limit for it (None: `RouterConfig.max_inflight_per_node`)."""

    name: str
    role: str
    url: str
    bootstrap: str | None = None
    max_inflight: int | None = None

    def __post_init__(self) -> None:
        if self.role not in ROLES:
            raise ValueError(f"node {self.name}: role must be one of {ROLES}, got {self.role!r}")


class NodeRegistry:
    """Owns the `NodeState`s; mutates health, failures and in-flight counts."""

    def __init__(
        self,
        endpoints: Sequence[NodeEndpoint],
        client: httpx.AsyncClient,
        *,
        health_interval_s: float = 2.0,
        health_timeout_s: float = 2.0,
        unhealthy_after: int = 2,
        on_recovered: Callable[[NodeState], None] | None = None,
        on_checked: Callable[[], None] | None = None,
    ) -> None:
        names = [e.name for e in endpoints]
        if len(set(names)) != len(names):
            raise ValueError(f"node names must be unique, got {names}")
        self.nodes = [NodeState(e.name, e.url.rstrip("/"), e.role, e.bootstrap) for e in endpoints]
        # prefill nodes whose bootstrap address was configured; the others' is learnt from
        # every probe (a node restarted on another bootstrap port kept its old one: every PD
        # request through it failed until the router restarted)
        self._configured_bootstrap = {e.name for e in endpoints if e.bootstrap}
        self._client = client
        self.health_interval_s = health_interval_s
        self.health_timeout_s = health_timeout_s
        self.unhealthy_after = max(1, unhealthy_after)
        self._on_recovered = on_recovered
        self._on_checked = on_checked
        self._task: asyncio.Task[None] | None = None
        self.probe_errors = 0  # probes that raised something unexpected (logged)

    # ---- queries

    def by_role(self, role: str) -> list[NodeState]:
        return [n for n in self.nodes if n.role == role]

    @property
    def is_pd(self) -> bool:
        return bool(self.by_role("prefill") or self.by_role("decode"))

    def can_serve(self) -> bool:
        """A healthy prefill + decode pair exists (PD) or a healthy unified node."""
        def healthy(role: str) -> bool:
            return any(n.healthy for n in self.by_role(role))

        if self.is_pd:
            return healthy("prefill") and healthy("decode")
        return healthy("unified")

    def describe(self) -> list[dict[str, Any]]:
        return [
            {
                "name": n.name, "role": n.role, "url": n.url, "bootstrap": n.bootstrap,
                "healthy": n.healthy, "in_flight": n.in_flight,
                "consecutive_failures": n.consecutive_failures, "last_error": n.last_error,
                "first_token_stream": n.first_token_stream,  # what its /health advertised
            }
            for n in self.nodes
        ]

    # ---- request-side accounting

    @contextlib.contextmanager
    def in_flight(self, node: NodeState) -> Iterator[None]:
        node.in_flight += 1
        try:
            yield
        finally:
            node.in_flight -= 1

    def has_other(self, role: str, exclude: set[str] | frozenset[str]) -> bool:
        """A healthy node of `role` whose name is not in `exclude` exists."""
        return any(n.healthy and n.name not in exclude for n in self.by_role(role))

    def mark_unreachable(self, node: NodeState, error: str) -> None:
        """A request could not connect: the node is down now, not after N probes."""
        node.consecutive_failures = max(node.consecutive_failures + 1, self.unhealthy_after)
        self._set_unhealthy(node, error)

    # ---- health checks

    async def check_all(self) -> None:
        await asyncio.gather(*(self.check(n) for n in self.nodes))

    async def check(self, node: NodeState) -> None:
        """One probe of `node`; never raises."""
        try:
            resp = await self._client.get(f"{node.url}/health", timeout=self.health_timeout_s)
            if resp.status_code == 200:
                self._on_success(node, resp)
            else:
                self._on_failure(node, f"GET /health answered {resp.status_code}")
        except httpx.HTTPError as exc:
            self._on_failure(node, f"GET /health failed: {type(exc).__name__}: {exc}")
        except Exception as exc:  # a probe bug must not end the loop
            self.probe_errors += 1
            log.exception("health probe of %s failed", node.name)
            self._on_failure(node, f"health probe error: {exc}")

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.create_task(self._loop(), name="router-health")

    async def stop(self) -> None:
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task

    async def _loop(self) -> None:
        while True:
            await asyncio.sleep(self.health_interval_s)  # startup() probed just before
            try:
                await self.check_all()
                if self._on_checked is not None:
                    self._on_checked()
            except Exception:  # check() never raises; this guards against future bugs
                self.probe_errors += 1
                log.exception("health loop iteration failed")

    def _on_success(self, node: NodeState, resp: httpx.Response) -> None:
        health = _health_body(resp)
        if node.role == "prefill" and node.name not in self._configured_bootstrap:
            learnt = _bootstrap_of(health)
            if learnt is not None and learnt != node.bootstrap:
                if node.bootstrap is not None:
                    log.warning("prefill node %s: bootstrap now at %s (was %s)", node.name,
                                learnt, node.bootstrap)
                node.bootstrap = learnt
        # every probe: a node replaced by an older build (a rollback) stops advertising it
        node.first_token_stream = health.get("first_token_stream") is True
        recovered = not node.healthy
        node.healthy, node.consecutive_failures, node.last_error = True, 0, None
        if recovered:
            log.warning("node %s is healthy again", node.name)
            if self._on_recovered is not None:
                self._on_recovered(node)

    def _on_failure(self, node: NodeState, error: str) -> None:
        node.consecutive_failures += 1
        node.last_error = error
        if node.consecutive_failures >= self.unhealthy_after:
            self._set_unhealthy(node, error)

    def _set_unhealthy(self, node: NodeState, error: str) -> None:
        node.last_error = error
        if node.healthy:
            log.warning("node %s marked unhealthy: %s", node.name, error)
        node.healthy = False


def _health_body(resp: httpx.Response) -> dict[str, Any]:
    """A node's /health JSON object ({} if it is not one)."""
    try:
        body = resp.json()
    except ValueError:
        return {}
    return body if isinstance(body, dict) else {}


def _bootstrap_of(health: dict[str, Any]) -> str | None:
    """`{"bootstrap": "HOST:PORT"}` of a prefill node's /health, if present."""
    value = health.get("bootstrap")
    return value if isinstance(value, str) and value else None
