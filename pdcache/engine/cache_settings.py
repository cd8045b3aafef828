"""`DeviceCacheSettings`: the device cache's settings that the topology's `[cache]` names and
the engine runs with, declared once; `PageGeometry`, their page size, which the router keys
cache-aware routing with too.

`pdcache.config.schema.CacheSpec` (the `[cache]` table) and the engine's
`pdcache.engine.config.CacheConfig` both inherit them, the router's
`pdcache.router.config.RouterConfig` the page size; a node's `CacheConfig` (and the router's
page size) is made from its `CacheSpec` with `field_values`. Standard library only, so the
schema stays free of torch.
"""

from __future__ import annotations

from dataclasses import KW_ONLY, dataclass
from typing import Literal

EvictionPolicy = Literal["lru", "session"]  # pdcache.engine.eviction.EVICTION_POLICIES


@dataclass(frozen=True)
class PageGeometry:
    """Tokens per KV page: every node of a deployment alike, and the router, which hashes a
    prompt's pages as the nodes do to route it where its prefix is cached. `page_size` is a
    positional field (`CacheConfig(16, 2048)`: page size, device pages)."""

    page_size: int = 16  # tokens per KV page (every node of a deployment alike)


@dataclass(frozen=True)
class DeviceCacheSettings(PageGeometry):
    """Page size (`PageGeometry`'s, the one positional field), device eviction policy and
    session idle time; the others are keyword-only, so subclasses keep their own positional
    fields."""

    _: KW_ONLY
    # tier policies (pdcache.engine.eviction, docs/design.md "Tier policies"): which pages the
    # device evicts first: lru, or session (closed sessions first, active ones expected back
    # last next); the host tier's are [cache] host_eviction and host_mode
    device_eviction: EvictionPolicy = "lru"
    session_idle_s: float = 300.0  # a session without a turn for this long is closed
