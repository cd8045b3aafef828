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

from pdcache.config.schema import NodeSpec, StorageSpec, Topology, TopologyError, TransferSpec
from pdcache.config.security import SecuritySettings, security_for, tenant_quotas
from pdcache.engine.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from pdcache.offload_manager.builder import (
    TierConfig,
    fingerprint_for,
    model_identity,
    storage_config_for,
)
from pdcache.offload_manager.hicache import HiCacheConfig
from pdcache.offload_manager.host_pool import host_pages_for
from pdcache.offload_manager.storage.config import StorageConfig, storage_keys_from_spec
from pdcache.transfer.config import TransferConfig


@dataclass(frozen=True)
class ServerSettings:
    """The HTTP side of one node process."""

    request_timeout_s: float = 600.0  # deadline of every wait on the engine, per request
    tool_call_parser: str = "hermes"  # pdcache.server.tool_calls.TOOL_CALL_PARSERS
    reasoning_parser: str | None = None  # pdcache.server.reasoning.REASONING_PARSERS; None: off
    incremental_streaming_output: bool = False  # /generate streams deltas, not cumulative


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
    server: ServerSettings = ServerSettings()
    key_scheme: str = "pdcache"  # how stored pages are named (PageKeyScheme), every node alike
    key_namespace: str = ""
    model_path: str = ""  # `[model]`'s preset name or checkpoint path (/server_info reports it)
    # The cluster secret and its derived keys (`[security]`), loaded once by setup_for: the
    # node HTTP credential, and the keys of stored pages, the control plane and the metadata
    # service. Without a secret every key is None.
    security: SecuritySettings = SecuritySettings()
    bind_host: str | None = None  # where it listens when not `host` (NodeSpec.bind_host)

    @property
    def listen_host(self) -> str:
        return self.bind_host or self.host


def setup_for(topology: Topology, node_name: str, model: ModelConfig) -> NodeSetup:
    """The setup of node `node_name` of `topology` serving `model`. Raises TopologyError for
    an unknown kernel backend, KeyError for an unknown node."""
    node = topology.node(node_name)
    cache = node.cache
    identity = model_identity(topology.model.ref, topology.model.seed)
    fingerprint = fingerprint_for(model, identity, cache.page_size)
    security = security_for(topology.security, topology.source)
    storage = with_keys(storage_from_spec(topology.storage, model, cache.page_size, fingerprint,
                                          node.host), security)
    quotas = tenant_quotas(topology)
    if storage is not None and quotas:
        storage = storage.replace(namespace_quotas=quotas)
    transfer = transfer_from_spec(topology.transfer, node) if node.role != "unified" else None
    return NodeSetup(node.name, node.role, node.host, node.port, engine_for(topology, node, model),
                     tiers_for(node, model, storage), fingerprint, storage, transfer,
                     node.bootstrap_port, offload_for(node),
                     ServerSettings(node.request_timeout_s, tool_call_parser=node.tool_call_parser,
                                    reasoning_parser=node.reasoning_parser,
                                    incremental_streaming_output=node.incremental_streaming_output),
                     cache.key_scheme, cache.key_namespace, topology.model.ref, security,
                     node.bind_host)


def with_keys(storage: StorageConfig | None, security: SecuritySettings) -> StorageConfig | None:
    """`storage` with the page MAC and metadata-service keys of the cluster secret."""
    if storage is None or not security.enabled:
        return storage
    return storage.replace(page_mac_key=security.page_mac_key, metadata_key=security.metadata_key)


def engine_for(topology: Topology, node: NodeSpec, model: ModelConfig) -> EngineConfig:
    # on decode, the prefix tree keeps finished requests' pages (the prompt prefill wrote and
    # the answer decode computed), so a next turn's request needs only the pages after them
    # from prefill (docs/design.md §4.12)
    prefix_cache = node.cache.prefix_cache
    sched = node.scheduler
    return EngineConfig(
        model=model,
        cache=CacheConfig(node.cache.page_size, node.cache.device_pages,
                          enable_prefix_cache=prefix_cache,
                          device_eviction=node.cache.device_eviction,
                          session_idle_s=node.cache.session_idle_s),
        scheduler=SchedulerConfig(max_running_requests=sched.max_running_requests,
                                  chunked_prefill_tokens=sched.chunked_prefill_tokens,
                                  max_queued_requests=sched.max_queued_requests,
                                  max_pending_reservations=sched.max_pending_reservations,
                                  decode_reserve_tokens=sched.decode_reserve_tokens,
                                  decode_step_interval_ms=sched.decode_step_interval_ms,
                                  compute_share=sched.compute_share,
                                  decode_yield_max_ms=sched.decode_yield_max_ms),
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
    hicache = HiCacheConfig(
        write_policy=cache.write_policy, write_through_threshold=cache.write_through_threshold,
        prefetch_policy=cache.prefetch_policy,
        prefetch_timeout_base_s=cache.prefetch_timeout_base_s,
        prefetch_timeout_per_1k_tokens_s=cache.prefetch_timeout_per_1k_tokens_s,
        prefetch_timeout_max_s=cache.prefetch_timeout_max_s,
        prefetch_restarts=cache.prefetch_restarts,
        layerwise_prefetch=cache.prefetch_layerwise,
        layerwise_read_layers=cache.prefetch_layers_per_read,
        copy_ahead=cache.load_copy_ahead,
        key_scheme=cache.key_scheme, key_namespace=cache.key_namespace,
        host_mode=cache.host_mode, host_eviction=cache.host_eviction,
        pending_wait=cache.pending_wait, pending_max_ttl_s=cache.pending_max_ttl_s,
        pending_pull=cache.pending_pull,
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
                      fingerprint: str, host: str = "127.0.0.1") -> StorageConfig | None:
    """`host`: the node's address, which a Mooncake Store client advertises to its peers."""
    if not spec.enabled:
        return None
    keys = storage_keys_from_spec(spec)
    if spec.backend == "mooncake":
        keys["mooncake_local_hostname"] = host
    return storage_config_for(model, page_size, fingerprint, **keys)


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
    fingerprint = fingerprint_for(model, identity, node.cache.page_size)
    storage = storage_from_spec(topology.storage, model, node.cache.page_size, fingerprint, node.host)
    assert storage is not None  # storage.enabled
    # `pdcache storage` verifies pages as the nodes do: with the secret's keys
    keyed = with_keys(storage, security_for(topology.security, topology.source))
    assert keyed is not None
    return keyed


def transfer_from_spec(spec: TransferSpec, node: NodeSpec) -> TransferConfig:
    devices = node.devices if node.devices is not None else spec.devices
    return TransferConfig(engine=spec.engine, protocol=spec.protocol,
                          device_names=",".join(devices), local_host=node.host,
                          bootstrap_timeout_s=spec.timeout_s,
                          room_timeout_s=4 * spec.timeout_s,
                          prefill_waits_for_decode=spec.prefill_waits_for_decode,
                          lost_peer_hold_s=spec.lost_peer_hold_s)


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
