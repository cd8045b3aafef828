"""Configuration: the topology schema every command reads, and the setup of one node.

One TOML file describes a whole deployment (`configs/`); it is parsed once into frozen,
validated objects (`Topology` and its sections) that the launcher, the sglang renderer, the
storage command and every node process use. A node started from flags gets a one-node
topology, so every node (prefill, decode, unified) is set up by `setup_for`. Errors are
`TopologyError`s naming the file, the key and what was expected; commands exit 2 on them.

Modules: `schema` (the sections), `parse` (TOML, `--set`, coercion), `validate` (cross-key
checks), `args` (`--config/--node/--set`, node flags, `topology_from_flags`), `node_setup`
(`NodeSetup`, `setup_for`), `security` (`SecuritySettings`: the cluster secret and its derived
keys, loaded once per process), `storage_cli` (`pdcache storage`), `secret_cli`
(`pdcache secret create`).

The schema half imports no torch (the launcher stays light): of the engine only its torch-free
`scheduler_config` (the `[scheduler]` table is the engine's `SchedulerConfig`) and
`cache_settings`; the node setup names are loaded on first use.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from pdcache.config.args import (
    add_node_flags,
    add_topology_arguments,
    node_from_args,
    router_from_args,
    topology_for,
    topology_from_flags,
)
from pdcache.config.parse import load_topology, parse_override_value, parse_topology
from pdcache.config.schema import (
    PD_ROLES,
    ApiSettings,
    CacheSpec,
    Endpoint,
    EtcdSpec,
    LaunchSpec,
    MetadataServiceSpec,
    ModelSpec,
    MooncakeStoreSpec,
    NodeSpec,
    Role,
    RouterSettings,
    RouterSpec,
    SecuritySpec,
    StorageSpec,
    TenantSpec,
    Topology,
    TopologyError,
    TransferSpec,
    parse_size,
)

if TYPE_CHECKING:
    from pdcache.config.node_setup import (
        NodeSetup,
        OffloadSettings,
        process_environment,
        setup_for,
        storage_for,
    )

_NODE_SETUP = ("NodeSetup", "OffloadSettings", "process_environment", "setup_for",
               "storage_for")


def __getattr__(name: str) -> Any:
    if name in _NODE_SETUP:  # imports the engine (torch): only when a node is set up
        from pdcache.config import node_setup

        return getattr(node_setup, name)
    raise AttributeError(name)


__all__ = [
    "PD_ROLES",
    "ApiSettings",
    "CacheSpec",
    "Endpoint",
    "LaunchSpec",
    "EtcdSpec",
    "MetadataServiceSpec",
    "ModelSpec",
    "MooncakeStoreSpec",
    "NodeSetup",
    "NodeSpec",
    "OffloadSettings",
    "Role",
    "RouterSettings",
    "RouterSpec",
    "SecuritySpec",
    "StorageSpec",
    "TenantSpec",
    "Topology",
    "TopologyError",
    "TransferSpec",
    "add_node_flags",
    "add_topology_arguments",
    "load_topology",
    "node_from_args",
    "parse_override_value",
    "parse_size",
    "parse_topology",
    "process_environment",
    "router_from_args",
    "setup_for",
    "storage_for",
    "topology_for",
    "topology_from_flags",
]
