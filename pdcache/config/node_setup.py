"""From a topology to the frozen objects one node process runs with: engine sizing, HiCache
tiers and storage, transfer settings, server and offload settings, the shared KV fingerprint.

`setup_for(topology, node_name, model)` is the one way there, for every role; a node started
with flags instead of a file gets a one-node topology first (`pdcache.config.args`).

Every prefill, decode and unified node computes the fingerprint the same way
(`pdcache.offload_manager.builder.fingerprint_for`), so pages written by any node are found
by any other that serves the same model with the same page size and dtype. They also name
pages with one key scheme (`[cache] key_scheme` / `--key-scheme`, with `key_namespace`):
"sglang" makes them share pages with SGLang servers running the pdcache storage plugin.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from pdcache.config.schema import (
    ApiSettings,
    NodeSpec,
    StorageSpec,
    Topology,
    TopologyError,
    TransferSpec,
    field_values,
)
from pdcache.config.security import SecuritySettings, security_for, tenant_quotas
from pdcache.engine.cache_settings import DeviceCacheSettings
from pdcache.engine.config import CacheConfig, EngineConfig, ModelConfig
from pdcache.offload_manager.builder import (
    TierConfig,
    fingerprint_for,
    model_identity,
    storage_config_for,
)
from pdcache.offload_manager.hicache import HiCacheConfig
from pdcache.offload_manager.host_pool import host_pages_for
from pdcache.offload_manager.storage.config import (
    StorageConfig,
    StorageKeys,
    storage_keys_from_spec,
)
from pdcache.offload_manager.tier_settings import TierSettings
from pdcache.transfer.config import TransferConfig, TransferSettings


@dataclass(frozen=True)
class OffloadSettings:
    """A decode node's DecodeOffloadManager (`NodeSetup.offload`; None there = no offload)."""

    staging_pages: int = 256  # host staging pages between device and storage (full: dropped)
    stride_pages: int = 1  # offload every this many completed pages of a request
    pending_ttl_s: float = 10.0  # prefill nodes wait at most this long for an announced write

    def __post_init__(self) -> None:
        if self.staging_pages < 1 or self.stride_pages < 1:
            raise ValueError(f"offload staging pages ({self.staging_pages}) and stride pages "
                             f"({self.stride_pages}) must be >= 1")


@dataclass(frozen=True)
class NodeSetup:
    """Everything a node process is configured with, besides the model weights."""

    name: str
    role: str
    host: str
    port: int
    engine: EngineConfig
    tiers: TierConfig | None  # None: device-only cache
    fingerprint: str
    storage: StorageConfig | None
    transfer: TransferConfig | None = None  # None on unified nodes
    bootstrap_port: int | None = None  # prefill only (0 picks a free port)
    offload: OffloadSettings | None = None  # decode only; None: generated KV is not stored
    server: ApiSettings = ApiSettings()  # the HTTP side: this part of the node's NodeSpec
    # this part of the node's `[cache]`: its tiers' policies and how stored pages are named
    # (every node alike), which a decode node's offload names its pages with too
    cache_tiers: TierSettings = TierSettings()
    model_path: str = ""  # `[model]`'s preset name or checkpoint path (/server_info reports it)
    # The cluster secret and its derived keys (`[security]`), loaded once by setup_for: the
    # node HTTP credential, and the keys of stored pages, the control plane and the metadata
    # service. Without a secret every key is None.
    security: SecuritySettings = SecuritySettings()
    bind_host: str | None = None  # where it listens when not `host` (NodeSpec.bind_host)

    @property
    def listen_host(self) -> str:
        return self.bind_host or self.host

    @property
    def key_scheme(self) -> str:
        """How stored pages are named (`PageKeyScheme`): `[cache] key_scheme`."""
        return self.cache_tiers.key_scheme

    @property
    def key_namespace(self) -> str:
        """The deployment-wide page-key salt: `[cache] key_namespace`."""
        return self.cache_tiers.key_namespace


def setup_for(topology: Topology, node_name: str, model: ModelConfig) -> NodeSetup:
    """The setup of node `node_name` of `topology` serving `model`. Raises TopologyError for
    an unknown kernel backend, KeyError for an unknown node."""
    node = topology.node(node_name)
    cache = node.cache
    identity = model_identity(topology.model.ref, topology.model.seed)
    fingerprint = fingerprint_for(model, identity, cache.page_size, cache.window_tiers)
    security = security_for(topology.security, topology.source)
    storage = with_keys(storage_from_spec(topology.storage, model, cache.page_size, fingerprint,
                                          node.host, cache.window_tiers), security)
    quotas = tenant_quotas(topology)
    if storage is not None and quotas:
        storage = storage.replace(namespace_quotas=quotas)
    transfer = transfer_from_spec(topology.transfer, node) if node.role != "unified" else None
    return NodeSetup(node.name, node.role, node.host, node.port, engine_for(topology, node, model),
                     tiers_for(node, model, storage), fingerprint, storage, transfer,
                     node.bootstrap_port, offload_for(node),
                     ApiSettings(**field_values(node, ApiSettings)),
                     TierSettings(**field_values(cache, TierSettings)), topology.model.ref,
                     security, node.bind_host)


def with_keys(storage: StorageConfig | None, security: SecuritySettings) -> StorageConfig | None:
    """`storage` with the page MAC and metadata-service keys of the cluster secret."""
    if storage is None or not security.enabled:
        return storage
    return storage.replace(**field_values(security, StorageKeys))


def engine_for(topology: Topology, node: NodeSpec, model: ModelConfig) -> EngineConfig:
    # on decode, the prefix tree keeps finished requests' pages (the prompt prefill wrote and
    # the answer decode computed), so a next turn's request needs only the pages after them
    # from prefill (docs/design.md §4.12)
    prefix_cache = node.cache.prefix_cache
    return EngineConfig(
        model=model,
        cache=CacheConfig(num_device_pages=node.cache.device_pages,
                          enable_prefix_cache=prefix_cache,
                          **field_values(node.cache, DeviceCacheSettings)),
        scheduler=node.scheduler,  # the topology's [scheduler] section is the engine's config
        seed=topology.model.seed, kernels=_kernels(topology, node))


def tiers_for(node: NodeSpec, model: ModelConfig, storage: StorageConfig | None) -> TierConfig | None:
    """Host pool and HiCache of a prefill or unified node; None: device-only (decode nodes, no
    prefix cache, or `host_pages = 0` without storage)."""
    cache = node.cache
    if node.role == "decode" or not cache.prefix_cache:
        return None
    if cache.host_pages == 0 and storage is None:
        return None
    host_pages = cache.host_pages or host_pages_for(
        model, cache.page_size, cache.device_pages, cache.effective_host_ratio, cache.host_bytes or 0)
    # the layer-streamed prefetch's and copies ahead's `[cache]` keys have other names in
    # HiCacheConfig (the tiers' code's); every other policy is TierSettings'
    hicache = HiCacheConfig(
        layerwise_prefetch=cache.prefetch_layerwise,
        layerwise_read_layers=cache.prefetch_layers_per_read,
        copy_ahead=cache.load_copy_ahead,
        **field_values(cache, TierSettings),
    )
    return TierConfig(host_pages, hicache, storage)


def offload_for(node: NodeSpec) -> OffloadSettings | None:
    if node.role != "decode" or not node.offload:
        return None
    default = OffloadSettings()
    return OffloadSettings(
        staging_pages=node.offload_staging_pages or default.staging_pages,
        stride_pages=node.offload_stride_pages or default.stride_pages,
        pending_ttl_s=node.offload_pending_ttl_s or default.pending_ttl_s)


def storage_from_spec(spec: StorageSpec, model: ModelConfig, page_size: int,
                      fingerprint: str, host: str = "127.0.0.1",
                      window_tiers: bool = False) -> StorageConfig | None:
    """`host`: the node's address, which a Mooncake Store client advertises to its peers;
    `window_tiers`: `[cache] window_tiers` (the stored format of a sliding-window model)."""
    if not spec.enabled:
        return None
    keys = storage_keys_from_spec(spec)
    if spec.backend == "mooncake":
        keys["mooncake_local_hostname"] = host
    return storage_config_for(model, page_size, fingerprint, window_tiers, **keys)


def storage_for(topology: Topology, model: ModelConfig, node_name: str | None = None) -> StorageConfig:
    """The StorageConfig node `node_name` (default: the first that uses storage) opens: what
    `pdcache storage` inspects. Raises TopologyError when the topology has no storage."""
    if not topology.storage.enabled:
        raise TopologyError(topology.source, "storage.backend", 'is "none": there is no storage to open')
    if node_name is None:
        users = [n for n in topology.nodes if n.role != "decode" or n.offload] or list(topology.nodes)
        node_name = users[0].name
    node = topology.node(node_name)
    identity = model_identity(topology.model.ref, topology.model.seed)
    fingerprint = fingerprint_for(model, identity, node.cache.page_size, node.cache.window_tiers)
    storage = storage_from_spec(topology.storage, model, node.cache.page_size, fingerprint,
                                node.host, node.cache.window_tiers)
    assert storage is not None  # storage.enabled
    # `pdcache storage` verifies pages as the nodes do: with the secret's keys
    keyed = with_keys(storage, security_for(topology.security, topology.source))
    assert keyed is not None
    return keyed


def transfer_from_spec(spec: TransferSpec, node: NodeSpec) -> TransferConfig:
    devices = node.devices if node.devices is not None else spec.devices
    return TransferConfig(device_names=",".join(devices), local_host=node.host,
                          bootstrap_timeout_s=spec.timeout_s,
                          room_timeout_s=4 * spec.timeout_s,
                          **field_values(spec, TransferSettings))


def process_environment(setup: NodeSetup, inherited: Mapping[str, str]) -> dict[str, str]:
    """Environment variables this node's libraries read only from the environment (Mooncake's
    transfer engine: its TCP bind address, transfer timeout, queue depth, log level; UCX for
    NIXL), from the setup. The process entry point applies them once, before any engine
    loads; `inherited` (the current environment) decides which explicit settings are kept."""
    if setup.transfer is None:
        return {}
    from pdcache.transfer.engines.base import ENGINES

    return ENGINES.get(setup.transfer.engine).environment(setup.transfer, inherited)


def _kernels(topology: Topology, node: NodeSpec) -> str:
    from pdcache.kernels.dispatch import KERNEL_BACKENDS

    if node.kernels != "auto" and node.kernels not in KERNEL_BACKENDS:
        raise TopologyError(topology.source, f"node.{node.name}.kernels",
                            f'unknown kernel backend "{node.kernels}"; expected one of: auto, '
                            f"{', '.join(KERNEL_BACKENDS.names())}")
    return node.kernels
