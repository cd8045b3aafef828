"""`RouterConfig`: the settings of one router process (docs/design.md §4.1).

Built once at start-up (`pdcache.router.cli.build_config`: topology and/or flags), frozen, and
read by the routing core (`pdcache.router.core`) and the HTTP app (`pdcache.router.app`) on the
router's event loop. Holds no state and does no I/O.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from pdcache.config.schema import RouterSettings
from pdcache.engine.cache_settings import PageGeometry
from pdcache.router.nodes import NodeEndpoint
from pdcache.router.tenants import DEFAULT_TENANT, Tenant


@dataclass(frozen=True, kw_only=True)
class RouterConfig(RouterSettings, PageGeometry):
    """Settings of one router process: the `[router]` keys it runs with (`RouterSettings`,
    declared once, in the topology schema), the nodes' page size its cache-aware routing keys
    prompts with (`[cache]`'s `PageGeometry`) and what the process adds (its nodes, model,
    tenants, node credential, health probing and session limits)."""

    nodes: tuple[NodeEndpoint, ...]
    model: str = "tiny"  # tokenizer + model config: a preset name or a checkpoint directory
    model_seed: int = 0  # presets: the seed is part of the model's name
    served_model_name: str | None = None
    health_timeout_s: float = 2.0
    unhealthy_after: int = 2  # failed probes in a row before a node is taken out
    max_sessions: int = 10_000
    session_ttl_s: float = 3600.0
    tenants: tuple[Tenant, ...] = ()  # with any (or api_key), every request needs its key
    node_token: str | None = field(default=None, repr=False)  # cluster secret's node credential

    def __post_init__(self) -> None:
        if (self.max_attempts < 1 or self.max_queue < 0 or self.max_inflight_per_node < 0
                or self.max_node_connections < 1):
            raise ValueError("max_attempts and max_node_connections must be >= 1, max_queue "
                             "and max_inflight_per_node >= 0")
        names = [t.name for t in self.all_tenants()]
        keys = [t.api_key for t in self.all_tenants()]
        if len(set(names)) != len(names) or len(set(keys)) != len(keys):
            raise ValueError("tenant names and API keys must be unique (the single api_key is "
                             f"the tenant {DEFAULT_TENANT!r})")
        if (self.tls_cert is None) != (self.tls_key is None):
            raise ValueError("give both tls_cert and tls_key, or neither")

    def all_tenants(self) -> tuple[Tenant, ...]:
        """The tenants, with the single `api_key` as the tenant `default`."""
        if not self.api_key:
            return self.tenants
        return (*self.tenants, Tenant(DEFAULT_TENANT, self.api_key))

    def node_headers(self) -> dict[str, str]:
        """Headers of every call to a node: the node credential, when there is one."""
        return {"Authorization": f"Bearer {self.node_token}"} if self.node_token else {}

    def inflight_limit(self, node: NodeEndpoint) -> int:
        """The router's in-flight limit of `node` (0: none)."""
        own = node.max_inflight
        return self.max_inflight_per_node if own is None else max(0, own)
