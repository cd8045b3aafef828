"""One source per setting: no setting is declared by two configuration classes.

The classes: every dataclass reachable from the topology (`Topology`, its sections and the
bases they inherit) and from the runtime configs a topology is turned into — a node's
`NodeSetup` (engine, tiers, storage, transfer, offload, server, security) and the HTTP
processes' `ServerConfig` and `RouterConfig` — following field types (`X | None`,
`tuple[X, ...]`) and base classes, so a class that moves module is still found.

The rule: a setting is declared twice when two of these classes each declare, in their own
body (an inherited field is not a declaration), a field of the same name with the same
default. Such a pair is either one setting written in two places, whose value somewhere is
copied across by hand (`SchedulerConfig(max_running_requests=spec.max_running_requests,
...)`), and whose defaults, docs and checks drift apart; or two settings that share a name
and a default by chance. The first is fixed by declaring the field once: the runtime config
is the section (`SchedulerConfig` is `[scheduler]`), or both inherit one base (`ApiSettings`,
`RouterSettings`, `TenantLimits`, `NodeAuthSettings`, `DeviceCacheSettings` and its
`PageGeometry`, `TierSettings`, `StorageSettings`, `StorageKeys`, `TransferSettings`; the
list is in `pdcache.config.schema`'s docstring) and one is built from the other with
`field_values`. The second is listed in `DISTINCT` with what tells the two apart. Pairs not
unified yet would be in `NOT_YET_ONE` with what blocks them. Both lists must stay exact: an entry that no longer
matches a pair fails too, so they only shrink. Required fields (no default) are names of
things (a node's `name`, `port`), not settings with a default, and are not compared.
"""

from __future__ import annotations

import dataclasses
import subprocess
import sys
import types
import typing
from collections.abc import Iterator

from pdcache.config.node_setup import NodeSetup
from pdcache.config.schema import Topology
from pdcache.engine.cache_settings import EvictionPolicy
from pdcache.engine.eviction import EVICTION_POLICIES
from pdcache.engine.page_keys import KEY_SCHEMES
from pdcache.offload_manager.page_pull import PULL_MODES
from pdcache.offload_manager.tier_settings import KeyScheme, PendingPull
from pdcache.router.config import RouterConfig
from pdcache.server.bridge import ServerConfig

ROOTS: tuple[type, ...] = (Topology, NodeSetup, ServerConfig, RouterConfig)

# (field, the classes declaring it): distinct settings that share a name and a default
DISTINCT: dict[tuple[str, frozenset[str]], str] = {
    ("host", frozenset({"NodeSpec", "RouterSpec"})): "where a node is reached / where the router listens",
    ("bind_host", frozenset({"NodeSpec", "MetadataServiceSpec"})):
        "a node's listen address / the metadata service's",
    ("bind_host", frozenset({"NodeSpec", "NodeSetup"})):
        "NodeSetup.bind_host is the node's own, None when set: a role default, not the spec's",
    ("devices", frozenset({"TransferSpec", "MooncakeStoreSpec"})):
        "RDMA NICs of the P->D transfer / of the Mooncake Store",
    ("protocol", frozenset({"TransferSettings", "MooncakeStoreSpec"})):
        "the P->D transfer's protocol / the Mooncake Store's",
    ("start", frozenset({"MetadataServiceSpec", "EtcdSpec"})):
        "the launcher starts the metadata service / the etcd members",
    ("namespace", frozenset({"StorageSettings", "KubernetesSpec"})):
        "the storage pool's namespace / the Kubernetes namespace",
    ("session_idle_s", frozenset({"DeviceCacheSettings", "StorageSettings"})):
        "a session's idle time in the node's tiers / in the shared storage's lifecycle",
    ("kernels", frozenset({"NodeSpec", "EngineConfig"})):
        "EngineConfig.kernels is checked against the kernels registry when a node is set up",
    ("seed", frozenset({"ModelSpec", "EngineConfig"})): "the preset's weights' seed / sampling's",
    ("dtype", frozenset({"ModelSpec", "ModelConfig"})):
        "ModelConfig's is the checkpoint's (config.json), overridden by the spec's",
    ("model_path", frozenset({"ServerConfig", "NodeSetup"})):
        "the path /server_info reports: NodeSetup holds `[model]`'s ref, ServerConfig shows it",
    ("offload", frozenset({"NodeSpec", "NodeSetup"})):
        "NodeSpec.offload is a switch; NodeSetup.offload the decode offload's OffloadSettings",
    ("bootstrap_port", frozenset({"NodeSpec", "NodeSetup"})):
        "NodeSetup's is the port a prefill node binds (0 picks one), resolved by role",
    ("bind_host", frozenset({"MetadataServiceSpec", "NodeSetup"})):
        "the metadata service's listen address / a node's",
    ("api_key", frozenset({"RouterSettings", "TenantSpec"})):
        "the router's single client key (tenant `default`) / one tenant's key",
}

# pairs still declared twice, and what blocks declaring them once (none left: a pair that
# cannot be unified yet goes here with its blocker)
NOT_YET_ONE: dict[tuple[str, frozenset[str]], str] = {}

_NO_DEFAULT = object()


def _dataclasses_in(tp: object) -> Iterator[type]:
    """The dataclasses a field annotation names: itself, or inside `X | None`, `tuple[X, ...]`."""
    if isinstance(tp, type) and dataclasses.is_dataclass(tp):
        yield tp
    if typing.get_origin(tp) is not None or isinstance(tp, types.UnionType):
        for arg in typing.get_args(tp):
            yield from _dataclasses_in(arg)


def config_classes() -> set[type]:
    """Every dataclass reachable from `ROOTS` through field types and base classes."""
    seen: set[type] = set()
    todo = list(ROOTS)
    while todo:
        cls = todo.pop()
        if cls in seen:
            continue
        seen.add(cls)
        todo += [base for base in cls.__mro__[1:] if dataclasses.is_dataclass(base)]
        for tp in typing.get_type_hints(cls).values():
            todo += list(_dataclasses_in(tp))
    return seen


def _default(field: dataclasses.Field) -> object:
    if field.default is not dataclasses.MISSING:
        return field.default
    if field.default_factory is not dataclasses.MISSING:
        return field.default_factory()
    return _NO_DEFAULT


def own_settings(cls: type) -> Iterator[tuple[str, object]]:
    """(name, default) of each field with a default that `cls` declares in its own body; not
    a field holding a section (`NodeSpec.scheduler`, `EngineConfig.scheduler`): its settings
    are the section's fields, compared where the section declares them."""
    own = vars(cls).get("__annotations__", {})
    for field in dataclasses.fields(cls):
        default = _default(field)
        if field.name not in own or default is _NO_DEFAULT or dataclasses.is_dataclass(default):
            continue
        yield field.name, default


def declared_twice() -> set[tuple[str, frozenset[str]]]:
    """(field, the two classes) for every pair of classes declaring a setting alike."""
    declarations: list[tuple[str, object, str]] = [
        (name, default, cls.__name__)
        for cls in config_classes() for name, default in own_settings(cls)]
    pairs = set()
    for i, (name, default, owner) in enumerate(declarations):
        for other_name, other_default, other in declarations[i + 1:]:
            same_default = type(default) is type(other_default) and default == other_default
            if name == other_name and same_default and owner != other:
                pairs.add((name, frozenset({owner, other})))
    return pairs


def _show(pairs: set[tuple[str, frozenset[str]]]) -> str:
    return "\n".join(f"  {name}: {' and '.join(sorted(owners))}" for name, owners in sorted(
        pairs, key=lambda p: (p[0], sorted(p[1]))))


def test_no_setting_is_declared_twice() -> None:
    twice = declared_twice()
    unexplained = twice - DISTINCT.keys() - NOT_YET_ONE.keys()
    assert not unexplained, (
        "settings declared by two configuration classes with the same default (declare the "
        "field once: embed the section, or inherit one base and build one object from the "
        "other with pdcache.config.schema.field_values; or, for two different settings, "
        f"list the pair in DISTINCT with what tells them apart):\n{_show(unexplained)}")


def test_the_exception_lists_are_exact() -> None:
    twice = declared_twice()
    stale = (DISTINCT.keys() | NOT_YET_ONE.keys()) - twice
    assert not stale, f"no longer declared twice; remove from DISTINCT / NOT_YET_ONE:\n{_show(stale)}"
    assert not DISTINCT.keys() & NOT_YET_ONE.keys()


def test_the_walk_reaches_the_runtime_configs() -> None:
    """The classes the rule is about are all walked (a refactor that hides one from the walk
    would make the rule vacuous)."""
    names = {cls.__name__ for cls in config_classes()}
    assert {"SchedulerConfig", "CacheConfig", "DeviceCacheSettings", "PageGeometry",
            "EngineConfig", "ApiSettings", "RouterSettings", "TenantLimits", "NodeAuthSettings",
            "StorageSettings", "StorageKeys", "StorageConfig", "TransferSettings",
            "TransferConfig", "TierSettings", "HiCacheConfig", "NodeSpec", "RouterSpec",
            "CacheSpec", "TransferSpec", "StorageSpec", "SecuritySpec", "SecuritySettings",
            "TenantSpec", "Tenant", "ServerConfig", "RouterConfig"} <= names


def test_schema_and_launch_import_no_torch() -> None:
    """The sections and bases the schema takes from the packages that run with them
    (`engine.scheduler_config`, `engine.cache_settings`, `offload_manager.tier_settings`,
    `offload_manager.storage.config`, `transfer.config`, whose package imports nothing) stay
    torch-free: loading a topology and `pdcache launch` import no torch."""
    code = ("import sys, pdcache.config.schema, pdcache.config.parse, pdcache.config.validate, "
            "pdcache.launch.cli; assert 'torch' not in sys.modules, 'torch imported'")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr


def test_the_eviction_policy_names_agree() -> None:
    """`[cache] device_eviction`'s type names the engine's eviction policies."""
    assert typing.get_args(EvictionPolicy) == EVICTION_POLICIES


def test_the_tier_setting_names_agree() -> None:
    """`[cache] pending_pull`'s and `key_scheme`'s types name the values the tiers' code
    takes (`HiCacheConfig` checks them against these tuples)."""
    assert typing.get_args(PendingPull) == PULL_MODES
    assert typing.get_args(KeyScheme) == KEY_SCHEMES
