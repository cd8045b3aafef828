"""From a topology (or command-line flags) to the frozen objects one node process runs with:
engine sizing, HiCache tiers and storage, transfer settings, the shared KV fingerprint.

Every prefill, decode and unified node computes the fingerprint the same way
(`pdcache.offload_manager.builder.fingerprint_for`), so pages written by any node are found
by any other that serves the same model with the same page size and dtype. They also name
pages with one key scheme (`[cache] key_scheme` / `--key-scheme`, with `key_namespace`):
"sglang" makes them share pages with SGLang servers running the pdcache storage plugin.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass

from pdcache.engine.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from pdcache.engine.page_keys import KEY_SCHEMES
from pdcache.launch.topology import NodeSpec, StorageSpec, Topology, TransferSpec, parse_size
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
    transfer: TransferConfig | None = None
    bootstrap_port: int | None = None
    offload: bool = False
    key_scheme: str = "pdcache"  # how stored pages are named (PageKeyScheme), every node alike
    key_namespace: str = ""


def storage_from_spec(spec: StorageSpec, model: ModelConfig, page_size: int,
                      fingerprint: str, host: str = "127.0.0.1") -> StorageConfig | None:
    """`host`: the node's address, which a Mooncake Store client advertises to its peers."""
    if not spec.enabled:
        return None
    keys = storage_keys_from_spec(spec)
    if spec.backend == "mooncake":
        keys["mooncake_local_hostname"] = host
    return storage_config_for(model, page_size, fingerprint, **keys)


def transfer_from_spec(spec: TransferSpec, node: NodeSpec) -> TransferConfig:
    devices = node.devices if node.devices is not None else spec.devices
    return TransferConfig(engine=spec.engine, protocol=spec.protocol,
                          device_names=",".join(devices), local_host=node.host,
                          bootstrap_timeout_s=spec.timeout_s,
                          room_timeout_s=max(spec.timeout_s, 4 * spec.timeout_s))


def setup_from_topology(topology: Topology, node: NodeSpec, model: ModelConfig) -> NodeSetup:
    cache = node.cache
    identity = model_identity(topology.model.ref, topology.model.seed)
    fingerprint = fingerprint_for(model, identity, cache.page_size)
    storage = storage_from_spec(topology.storage, model, cache.page_size, fingerprint, node.host)
    # decode nodes are handed their prompts' K/V: a prefix cache there would only hold memory
    engine = EngineConfig(model=model,
                          cache=CacheConfig(cache.page_size, cache.device_pages,
                                            enable_prefix_cache=node.role != "decode"),
                          scheduler=SchedulerConfig(), seed=topology.model.seed)
    tiers = None
    if node.role != "decode":
        host_pages = host_pages_for(model, cache.page_size, cache.device_pages,
                                    cache.effective_host_ratio, cache.host_bytes or 0)
        hicache = HiCacheConfig(
            write_policy=cache.write_policy, write_through_threshold=cache.write_through_threshold,
            prefetch_policy=cache.prefetch_policy,
            prefetch_timeout_base_s=cache.prefetch_timeout_base_s,
            prefetch_timeout_per_1k_tokens_s=cache.prefetch_timeout_per_1k_tokens_s,
            prefetch_timeout_max_s=cache.prefetch_timeout_max_s,
            key_scheme=cache.key_scheme, key_namespace=cache.key_namespace,
        )
        tiers = TierConfig(host_pages, hicache, storage)
    transfer = transfer_from_spec(topology.transfer, node) if node.role != "unified" else None
    return NodeSetup(node.name, node.role, node.host, node.port, engine, tiers, fingerprint,
                     storage, transfer, node.bootstrap_port, bool(node.offload),
                     cache.key_scheme, cache.key_namespace)


# ---- the same from flags, for ad-hoc runs without a topology file ---------------------

def add_cache_flags(parser: argparse.ArgumentParser, hicache: bool = True) -> None:
    """Storage (and, for prefill/unified, host tier) flags shared by the node commands."""
    group = parser.add_argument_group("cache tiers (without --config)")
    if hicache:
        group.add_argument("--host-pages", type=int, default=0,
                           help="host KV pool in pages; 0 = no host tier unless storage is set")
        group.add_argument("--write-policy", default="write_through",
                           choices=["write_through", "write_through_selective", "write_back"])
        group.add_argument("--prefetch-policy", default="timeout",
                           choices=["best_effort", "wait_complete", "timeout"])
    group.add_argument("--key-scheme", default="pdcache", choices=list(KEY_SCHEMES),
                       help="how stored pages are named; 'sglang' shares pages with SGLang "
                            "servers running the pdcache storage plugin")
    group.add_argument("--key-namespace", default="",
                       help="deployment-wide key salt (the SGLang plugin's key_namespace)")
    group.add_argument("--storage-backend", default="none",
                       choices=["none", "hf3fs", "file", "mooncake"])
    group.add_argument("--storage-path", default="./.pdcache/storage")
    group.add_argument("--storage-capacity", default="4GiB")
    group.add_argument("--storage-metadata", default="inproc",
                       help="'inproc' or tcp://HOST:PORT of pdcache metadata-server")
    group.add_argument("--mooncake-master", default="127.0.0.1:50051")
    group.add_argument("--mooncake-metadata", default="P2PHANDSHAKE")


def tiers_from_flags(args: argparse.Namespace, model: ModelConfig, page_size: int,
                     device_pages: int, fingerprint: str) -> tuple[TierConfig | None, StorageConfig | None]:
    storage = None
    if args.storage_backend != "none":
        capacity = parse_size(str(args.storage_capacity))
        if capacity is None:
            raise ValueError(f"--storage-capacity {args.storage_capacity!r} is not a size")
        storage = storage_config_for(
            model, page_size, fingerprint, backend=args.storage_backend, path=args.storage_path,
            capacity_bytes=capacity, metadata=args.storage_metadata,
            mooncake_master=args.mooncake_master, mooncake_metadata=args.mooncake_metadata)
    host_pages = getattr(args, "host_pages", 0)
    if host_pages <= 0 and storage is None or not hasattr(args, "host_pages"):
        return None, storage
    host_pages = host_pages or 2 * device_pages
    hicache = HiCacheConfig(write_policy=args.write_policy, prefetch_policy=args.prefetch_policy,
                            **key_settings(args))
    return TierConfig(host_pages, hicache, storage), storage


def key_settings(args: argparse.Namespace) -> dict[str, str]:
    """key_scheme / key_namespace from the flags (defaults when a command has none)."""
    return {"key_scheme": getattr(args, "key_scheme", "pdcache"),
            "key_namespace": getattr(args, "key_namespace", "")}


def add_node_flags(parser: argparse.ArgumentParser, role: str) -> None:
    """Flags of `pdcache prefill|decode` when run without a topology file."""
    cache = CacheConfig()
    parser.add_argument("--model", default="tiny", help="preset (tiny, small) or a HF model dir")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--name", default=role[0] + "0", help="this node's name in responses")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=0, help="HTTP port; 0 picks a free one")
    parser.add_argument("--page-size", type=int, default=cache.page_size)
    parser.add_argument("--device-pages", type=int, default=cache.num_device_pages)
    parser.add_argument("--transfer-engine", default="mooncake", choices=["mooncake", "zmq", "nixl"])
    parser.add_argument("--transfer-timeout", type=float, default=30.0)
    parser.add_argument("--log-level", default="info", choices=["debug", "info", "warning"])
    if role == "prefill":
        parser.add_argument("--bootstrap-port", type=int, default=0, help="0 picks a free one")
    if role == "decode":
        parser.add_argument("--no-offload", action="store_true",
                            help="do not write generated KV back to storage")
    add_cache_flags(parser, hicache=role != "decode")


def setup_from_flags(args: argparse.Namespace, role: str, model: ModelConfig) -> NodeSetup:
    fingerprint = fingerprint_for(model, model_identity(args.model, args.seed), args.page_size)
    engine = EngineConfig(model=model,
                          cache=CacheConfig(args.page_size, args.device_pages,
                                            enable_prefix_cache=role != "decode"),
                          scheduler=SchedulerConfig(), seed=args.seed)
    tiers, storage = tiers_from_flags(args, model, args.page_size, args.device_pages, fingerprint)
    if role == "prefill" and tiers is None:  # the prefill scheduler always runs HiCache
        tiers = TierConfig(2 * args.device_pages, HiCacheConfig(**key_settings(args)), storage)
    transfer = TransferConfig(engine=args.transfer_engine, local_host=args.host,
                              bootstrap_timeout_s=args.transfer_timeout,
                              room_timeout_s=4 * args.transfer_timeout)
    offload = role == "decode" and not args.no_offload and storage is not None
    keys = key_settings(args)
    return NodeSetup(args.name, role, args.host, args.port, engine, tiers, fingerprint, storage,
                     transfer, getattr(args, "bootstrap_port", None), offload,
                     keys["key_scheme"], keys["key_namespace"])
