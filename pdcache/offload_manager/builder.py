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
from pdcache.engine.kv_pool import DeviceKVPool
from pdcache.engine.radix import StateCheckpointRule
from pdcache.engine.roles import RolePolicy
from pdcache.engine.scheduler import Scheduler
from pdcache.engine.state_cache import StateSlots
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


def fingerprint_for(model: ModelConfig, identity: str, page_size: int) -> str:
    """The KV fingerprint of this model's pages (its KV geometry's, under `identity`)."""
    return model.kv_geometry.fingerprint(identity, page_size)


def storage_config_for(model: ModelConfig, page_size: int, fingerprint: str,
                       **settings: Any) -> StorageConfig:
    """A StorageConfig whose page geometry matches this model's host pages (a page has the
    KV layers only: `num_kv_layers`) and, for a hybrid model, whose state objects are this
    model's recurrent states (`state_geometry`, `state_bytes`)."""
    geometry = model.kv_geometry
    state = model.state_geometry
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
                        pending: PendingPages | None = None) -> TieredEngine:
    """An Engine (not started) whose scheduler has `HiCacheTiers` over `tiers` and `role`'s
    policy (default: unified); `pending`: the decode-announced writes HiCache may wait for
    (a prefill node's, docs/design.md §4.10)."""
    if not config.cache.enable_prefix_cache:
        raise ValueError("the hierarchical cache needs the prefix cache enabled")
    page_size = config.cache.page_size
    host_pool = HostKVPool.for_model(config.model, tiers.host_pages, page_size)
    storage = create_backend(tiers.storage) if tiers.storage is not None else None
    fingerprint = tiers.storage.fingerprint if tiers.storage else ""
    kernels = KernelSet(config.kernels)
    built: dict[str, HiCache] = {}

    sessions = config.cache.make_sessions()  # shared by the device and host policies
    device_policy = make_policy(config.cache.device_eviction, sessions)
    host_policy = make_policy(tiers.hicache.host_eviction, sessions)

    def make_tree(pool: DeviceKVPool, states: StateSlots | None = None) -> HiRadixTree:
        if states is None:
            return HiRadixTree(pool.page_size, pool.allocator, host_pool, policy=device_policy,
                               host_policy=host_policy, sessions=sessions)
        slots = tiers.host_state_slots or max(1, 2 * config.cache.state_checkpoint_slots)
        return HiRadixTree(pool.page_size, pool.allocator, host_pool, policy=device_policy,
                           host_policy=host_policy, sessions=sessions,
                           restore_rules=(StateCheckpointRule(),), checkpoints=states,
                           host_states=HostStatePool(states.pool.geometry, slots))

    def make_scheduler(**kwargs: Any) -> Scheduler:
        hicache = HiCache(kwargs["tree"], kwargs["pool"].device_kv, storage, tiers.hicache,
                          fingerprint, kernels, pending, states=kwargs.get("states"))
        built["hicache"] = hicache
        return Scheduler(**kwargs, tiers=HiCacheTiers(hicache, page_size), role=role)

    engine = Engine(config, model, tokenizer, make_tree=make_tree, make_scheduler=make_scheduler)
    return TieredEngine(engine, built["hicache"], storage)
