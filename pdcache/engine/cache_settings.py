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
from typing import Literal, get_args

EvictionPolicy = Literal["lru", "session"]  # pdcache.engine.eviction.EVICTION_POLICIES
# where a hybrid model's recurrent state is checkpointed (docs/design.md §4.14)
StateCheckpointPolicy = Literal["hit_points", "every_page", "chunk_ends"]
STATE_CHECKPOINT_POLICIES: tuple[str, ...] = get_args(StateCheckpointPolicy)


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
    # hybrid models (linear layers): recurrent-state slots the prefix cache may hold as state
    # checkpoints, beside one slot per running request (pdcache.engine.state_cache); each is
    # `RecurrentStateGeometry.state_bytes()` of device memory (Qwen3-Next-80B: 73.7 MiB). The
    # host tier keeps twice as many host state slots (docs/design.md §4.14)
    state_checkpoint_slots: int = 32
    # hybrid models: where the scheduler checkpoints a request's state (docs/design.md §4.14):
    # hit_points (the prompt's last full page, branch points, the answer's last full page),
    # every_page (every page boundary of prompt and answer: vLLM's mamba_cache_mode "all"),
    # chunk_ends (the end of every prefill chunk, cut to its last full page, and the
    # request's end: SGLang's default no_buffer)
    state_checkpoints: StateCheckpointPolicy = "hit_points"
    # sliding-window models with window pages (gpt-oss; docs/design.md §4.14): pages of the
    # sliding layers' own device pool, allocated a prefill chunk at a time and freed as the
    # window moves; 0 = as many as the full layers' device pages. Smaller saves device memory
    # (a page of the sliding layers each) at the cost of cached windows: at least
    # max_running_requests x (2 window tails + 2) + one chunk's pages
    sliding_pages: int = 0
