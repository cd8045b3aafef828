"""Building an engine with the hierarchical cache (host pool, storage, HiCache tiers), and
the KV fingerprint every node of a deployment must agree on to share pages."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pdcache.engine.config import EngineConfig, ModelConfig
from pdcache.engine.engine import Engine
from pdcache.engine.eviction import make_policy
from pdcache.engine.kv_geometry import KVGeometry
from pdcache.engine.kv_pool import DeviceKVPool
from pdcache.engine.radix import SlidingWindowRule, StateCheckpointRule
from pdcache.engine.roles import RolePolicy
from pdcache.engine.scheduler import Scheduler
from pdcache.engine.state_cache import StateSlots
from pdcache.engine.window_pages import (
    WindowPages,
    WindowTailGeometry,
    WindowTails,
    can_split,
    split_geometry,
)
from pdcache.kernels import KernelSet
from pdcache.offload_manager.hicache import HiCache, HiCacheConfig
from pdcache.offload_manager.hicache_tiers import HiCacheTiers
from pdcache.offload_manager.hiradix import HiRadixTree
from pdcache.offload_manager.host_pool import HostKVPool
from pdcache.offload_manager.host_state_pool import HostStatePool
from pdcache.offload_manager.pending import PendingPages
from pdcache.offload_manager.storage import create_backend
from pdcache.offload_manager.storage.base import StorageBackend
from pdcache.offload_manager.storage.config import StorageConfig


def model_identity(model_ref: str, seed: int) -> str:
    """What names the weights: a preset and its seed, or a checkpoint's directory name plus a
    digest of its config.json (two different checkpoints never share pages)."""
    path = Path(model_ref)
    if (path / "config.json").is_file():
        digest = hashlib.sha256((path / "config.json").read_bytes()).hexdigest()[:16]
        return f"ckpt:{path.resolve().name}:{digest}"
    return f"preset:{model_ref}:seed={seed}"


def stored_geometry(model: ModelConfig, window_pages: bool = False) -> KVGeometry:
    """What a host / stored page of this model holds: every KV layer, or with window pages
    (a model mixing full and sliding layers, `build_tiered_engine(window_pages=True)`) its
    full layers only (the sliding ones travel as window tails)."""
    geometry = model.kv_geometry
    return split_geometry(geometry, "full") if uses_window_tails(model, window_pages) \
        else geometry


def uses_window_tails(model: ModelConfig, window_pages: bool) -> bool:
    """Window pages asked for and possible: the tiers then carry window tails."""
    return window_pages and can_split(model.kv_geometry)


def fingerprint_for(model: ModelConfig, identity: str, page_size: int,
                    window_pages: bool = False) -> str:
    """The KV fingerprint of this model's pages (its KV geometry's, under `identity`; with
    window pages the full layers' geometry's and the window: pages of another layer set or
    window never match)."""
    fingerprint = stored_geometry(model, window_pages).fingerprint(identity, page_size)
    if uses_window_tails(model, window_pages):
        # a full layer's K/V depends on the sliding layers below it, so on the window, which
        # the full layers' geometry lacks (`split_geometry` leaves it 0)
        fingerprint += f";sliding_window={model.kv_geometry.sliding_window}"
    return fingerprint


def storage_config_for(model: ModelConfig, page_size: int, fingerprint: str,
                       window_pages: bool = False, **settings: Any) -> StorageConfig:
    """A StorageConfig whose page geometry matches this model's host pages (a page has the
    KV layers only: `num_kv_layers`; with window pages the full layers only) and, for a
    hybrid model, whose state objects are this model's recurrent states (`state_geometry`,
    `state_bytes`), with window pages its window tails (`WindowTailGeometry`)."""
    geometry = stored_geometry(model, window_pages)
    state = (WindowTailGeometry.of(model.kv_geometry, page_size)
             if uses_window_tails(model, window_pages) else model.state_geometry)
    if state is not None:
        settings = {"state_geometry": state.key(), "state_bytes": state.state_bytes(),
                    **settings}
        if settings.get("backend", "hf3fs") == "hf3fs" and not settings.get("state_capacity"):
            settings["state_capacity"] = _default_state_capacity(
                settings, geometry.page_bytes(page_size), state.state_bytes())
    return StorageConfig(page_bytes=geometry.page_bytes(page_size), fingerprint=fingerprint,
                         num_layers=geometry.num_kv_layers, page_size=page_size,
                         dtype=model.dtype, **settings)


def _default_state_capacity(settings: dict[str, Any], page_bytes: int, state_bytes: int) -> int:
    """hf3fs keeps states in a slot pool of its own, which needs a size: unset, it gets a
    quarter of the pages' bytes (on top of them), at least one state."""
    pages_bytes = settings.get("capacity_bytes") or settings.get("capacity_pages", 0) * page_bytes
    return max(1, pages_bytes // 4 // state_bytes)


@dataclass(frozen=True)
class TierConfig:
    """The lower tiers of one engine: host pool size, HiCache policies, optional storage."""

    host_pages: int
    hicache: HiCacheConfig
    storage: StorageConfig | None = None
    # hybrid models: host state slots (one checkpoint each, beside the host pages); 0: twice
    # the device's checkpoint share (`CacheConfig.state_checkpoint_slots`), at least 1
    host_state_slots: int = 0


@dataclass
class TieredEngine:
    """An engine and the lower tiers it owns; `close()` stops all of them."""

    engine: Engine
    hicache: HiCache
    storage: StorageBackend | None

    def close(self, timeout_s: float = 10.0) -> None:
        self.engine.shutdown(timeout_s)
        self.hicache.close()
        if self.storage is not None:
            self.storage.close()


def build_tiered_engine(config: EngineConfig, model: Any, tokenizer: Any, tiers: TierConfig,
                        role: RolePolicy | None = None,
                        pending: PendingPages | None = None,
                        window_pages: bool = False) -> TieredEngine:
    """An Engine (not started) whose scheduler has `HiCacheTiers` over `tiers` and `role`'s
    policy (default: unified); `pending`: the decode-announced writes HiCache may wait for
    (a prefill node's, docs/design.md §4.10). `window_pages` (a unified node of a model
    mixing full and sliding layers): the sliding layers keep only their windows on device
    and the tiers carry full-layer pages plus window tails (docs/design.md §4.14; its
    storage config from `storage_config_for(..., window_pages=True)`)."""
    if not config.cache.enable_prefix_cache:
        raise ValueError("the hierarchical cache needs the prefix cache enabled")
    page_size = config.cache.page_size
    windowed = uses_window_tails(config.model, window_pages)
    host_pool = HostKVPool(tiers.host_pages, stored_geometry(config.model, windowed),
                           page_size)
    storage = create_backend(tiers.storage) if tiers.storage is not None else None
    fingerprint = tiers.storage.fingerprint if tiers.storage else ""
    kernels = KernelSet(config.kernels)
    built: dict[str, HiCache] = {}

    sessions = config.cache.make_sessions()  # shared by the device and host policies
    device_policy = make_policy(config.cache.device_eviction, sessions)
    host_policy = make_policy(tiers.hicache.host_eviction, sessions)

    slots = tiers.host_state_slots or max(1, 2 * config.cache.state_checkpoint_slots)

    def make_tree(pool: DeviceKVPool, states: StateSlots | None = None,
                  window: WindowPages | None = None) -> HiRadixTree:
        if window is not None:  # window tails are the host checkpoints
            return HiRadixTree(pool.page_size, pool.allocator, host_pool, policy=device_policy,
                               host_policy=host_policy, sessions=sessions,
                               restore_rules=(SlidingWindowRule(window.window, page_size),),
                               host_states=HostStatePool(WindowTails(window).geometry, slots),
                               window_allocator=window.allocator)
        if states is None:
            return HiRadixTree(pool.page_size, pool.allocator, host_pool, policy=device_policy,
                               host_policy=host_policy, sessions=sessions)
        return HiRadixTree(pool.page_size, pool.allocator, host_pool, policy=device_policy,
                           host_policy=host_policy, sessions=sessions,
                           restore_rules=(StateCheckpointRule(),), checkpoints=states,
                           host_states=HostStatePool(states.pool.geometry, slots))

    def make_scheduler(**kwargs: Any) -> Scheduler:
        window = kwargs.get("window")
        hicache = HiCache(kwargs["tree"], kwargs["pool"].device_kv, storage, tiers.hicache,
                          fingerprint, kernels, pending, states=kwargs.get("states"),
                          window_tails=WindowTails(window) if window is not None else None)
        built["hicache"] = hicache
        return Scheduler(**kwargs, tiers=HiCacheTiers(hicache, page_size), role=role)

    engine = Engine(config, model, tokenizer, make_tree=make_tree, make_scheduler=make_scheduler,
                    window_pages=windowed)
    return TieredEngine(engine, built["hicache"], storage)
