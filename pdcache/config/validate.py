"""Cross-key checks of a parsed topology, and the role defaults it is completed with.

Each check raises a `TopologyError` naming the key and, where there is one, the fix. The
kernel backend name is checked against the kernels registry when a node is set up
(`pdcache.config.node_setup`), so that this module (and the launcher) never import torch.
"""

from __future__ import annotations

import ipaddress
import math
import re
import types
from collections.abc import Iterable
from dataclasses import fields, replace

from pdcache.config.schema import (
    PD_ROLES,
    CacheSpec,
    ErrorContext,
    ModelSpec,
    MooncakeStoreSpec,
    NodeSpec,
    StorageSpec,
    Topology,
    TransferSpec,
    split_host_port,
)
from pdcache.engine.scheduler_config import SchedulerConfig
from pdcache.offload_manager.storage.config import QUOTA_UNENFORCED_BACKENDS

# no '.': a name is one part of a dotted key (`--set node.NAME.port=...`,
# `router.tenant.NAME.max_inflight`); a node named "p.0" could not be set at all
_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_-]*$")
_LOCAL_ALIASES = {"localhost": "127.0.0.1"}
# a decode node whose steps are held longer (paced, or yielding to prefill) would look hung to
# its clients (one token a second)
MAX_DECODE_STEP_INTERVAL_MS = 1000
MAX_PENDING_TTL_S = 600.0  # bound of a pending-page mark's TTL (decode's announce, prefill's cap)
# scheduler keys whose least value is 0 (off; refuse at once); every other one's is 1
_SCHEDULER_LEAST = {"decode_step_interval_ms": 0, "max_pending_reservations": 0}
MAX_PREFETCH_RESTARTS = 8  # each restart re-reads the prompt's stored pages: a few suffice


def validate(topology: Topology, ctx: ErrorContext, standalone: bool = False) -> None:
    """Cross-key checks; each raises a TopologyError naming the key and the fix.

    `standalone`: a one-node topology built from flags; deployment-wide checks are skipped."""
    _check_model(topology.model, ctx)
    _check_cache(topology.cache, "cache", ctx)
    _check_scheduler(topology.scheduler, "scheduler", ctx)
    _check_storage(topology.storage, ctx)
    _check_transfer(topology.transfer, ctx)
    _check_nodes(topology, ctx)
    _check_router(topology, ctx)
    _check_tenant_quotas(topology, ctx)
    _check_wildcard_binds(topology, ctx)
    _check_tenants_behind_a_secret(topology, ctx)
    if standalone:
        return
    _check_multi_host_secret(topology, ctx)
    _check_shape(topology, ctx)
    _check_shared_inproc_metadata(topology, ctx)
    _check_ports(topology, ctx)


def _check_model(model: ModelSpec, ctx: ErrorContext) -> None:
    if (model.preset is None) == (model.path is None):
        raise ctx.error("model", 'expected exactly one of preset = "tiny" (or small, tiny-mla, '
                                 'small-mla) or path = "/checkpoint/dir"')


def _check_cache(cache: CacheSpec, prefix: str, ctx: ErrorContext) -> None:
    for key in ("page_size", "device_pages", "write_through_threshold", "prefetch_layers_per_read"):
        if getattr(cache, key) < 1:
            raise ctx.error(f"{prefix}.{key}", f"expected an integer >= 1, got {getattr(cache, key)}")
    given = [k for k in ("host_ratio", "host_bytes", "host_pages") if getattr(cache, k) is not None]
    if len(given) > 1:
        raise ctx.error(f"{prefix}.{given[0]}", f"give one of {' or '.join(given)}, not both")
    if cache.host_pages is not None and cache.host_pages < 0:
        raise ctx.error(f"{prefix}.host_pages", f"expected an integer >= 0, got {cache.host_pages}")
    if cache.host_ratio is not None and cache.host_ratio <= 0:
        raise ctx.error(f"{prefix}.host_ratio", f"expected a number > 0, got {cache.host_ratio}")
    if cache.session_idle_s <= 0:
        raise ctx.error(f"{prefix}.session_idle_s", f"expected a number > 0, got {cache.session_idle_s}")
    if not 0 < cache.pending_max_ttl_s <= MAX_PENDING_TTL_S:
        raise ctx.error(f"{prefix}.pending_max_ttl_s",
                        f"expected a number in (0, {MAX_PENDING_TTL_S:g}], got {cache.pending_max_ttl_s}")
    if not 0 <= cache.prefetch_restarts <= MAX_PREFETCH_RESTARTS:
        raise ctx.error(f"{prefix}.prefetch_restarts",
                        f"expected an integer within 0..{MAX_PREFETCH_RESTARTS}, got {cache.prefetch_restarts}")
    for key in ("prefetch_timeout_base_s", "prefetch_timeout_per_1k_tokens_s", "prefetch_timeout_max_s"):
        if getattr(cache, key) < 0:
            raise ctx.error(f"{prefix}.{key}", f"expected a number >= 0, got {getattr(cache, key)}")


def _check_scheduler(scheduler: SchedulerConfig, prefix: str, ctx: ErrorContext) -> None:
    for key in ("decode_step_interval_ms", "decode_yield_max_ms"):
        value, least = getattr(scheduler, key), _SCHEDULER_LEAST.get(key, 1)
        if not least <= value <= MAX_DECODE_STEP_INTERVAL_MS:
            raise ctx.error(f"{prefix}.{key}",
                            f"expected an integer within {least}..{MAX_DECODE_STEP_INTERVAL_MS}, got {value}")
    if scheduler.compute_share == "":
        raise ctx.error(f"{prefix}.compute_share", "expected a file path (leave it out to turn it off)")
    for f in fields(scheduler):
        if f.name == "compute_share":
            continue
        least = _SCHEDULER_LEAST.get(f.name, 1)
        if getattr(scheduler, f.name) < least:
            raise ctx.error(f"{prefix}.{f.name}", f"expected an integer >= {least}, got {getattr(scheduler, f.name)}")


def _check_storage(storage: StorageSpec, ctx: ErrorContext) -> None:
    # the registry, not a copied list: a backend a plugin registered is a valid value
    from pdcache.offload_manager.storage import BACKENDS

    if storage.backend != "none" and storage.backend not in BACKENDS:
        names = ", ".join(f'"{n}"' for n in ["none", *BACKENDS.names()])
        raise ctx.error("storage.backend", f'expected one of {names}, got "{storage.backend}"')
    if storage.write_delay_s < 0:
        raise ctx.error("storage.write_delay_s", f"expected a number >= 0, got {storage.write_delay_s}")
    _check_metadata_replicas(storage, ctx)
    _check_etcd(storage, ctx)
    if storage.io_engine == "usrbio" and storage.backend != "hf3fs":
        raise ctx.error("storage.io_engine", f'"usrbio" is the 3FS client; it needs backend = "hf3fs", not "{storage.backend}"')
    if storage.capacity < 1:
        raise ctx.error("storage.capacity", "expected a size > 0")
    if not 0.0 <= storage.session_protect_share <= 1.0:
        raise ctx.error("storage.session_protect_share", f"expected a share in [0, 1], got {storage.session_protect_share}")
    if storage.session_idle_s <= 0:
        raise ctx.error("storage.session_idle_s", f"expected seconds > 0, got {storage.session_idle_s}")
    if storage.fault_injection:
        _check_fault_injection(storage, ctx)
    if storage.backend == "mooncake":
        _check_mooncake_ha(storage, ctx)
        try:
            _ = storage.mooncake.master_addresses
        except ValueError as exc:
            raise ctx.error("storage.mooncake.master", f"expected HOST:PORT ({exc})") from exc


def _check_fault_injection(storage: StorageSpec, ctx: ErrorContext) -> None:
    """The chaos-only delay hook: an absolute control-file path, on a real storage backend."""
    key = "storage.fault_injection"
    if not storage.enabled:
        raise ctx.error(key, 'delays storage calls, but storage.backend = "none"')
    if not storage.fault_injection.startswith("/"):
        raise ctx.error(key, f"expected an absolute path of the chaos control file, got "
                        f'"{storage.fault_injection}" (test/chaos only: `pdcache chaos` '
                        "sets it; leave it unset in deployments)")


def _check_transfer(transfer: TransferSpec, ctx: ErrorContext) -> None:
    if transfer.engine == "zmq" and transfer.protocol == "rdma":
        raise ctx.error("transfer.protocol", '"rdma" needs engine = "mooncake" or "nixl"; the zmq engine is tcp only')
    if transfer.timeout_s <= 0:
        raise ctx.error("transfer.timeout_s", f"expected a number > 0, got {transfer.timeout_s}")
    if not transfer.lost_peer_hold_s > 0:
        raise ctx.error("transfer.lost_peer_hold_s", f"expected a number > 0, got {transfer.lost_peer_hold_s}")


def _check_nodes(topology: Topology, ctx: ErrorContext) -> None:
    seen: set[str] = set()
    names = {topology.router.name} if topology.router else set()
    for node in topology.nodes:
        key = f"node.{node.name}"
        if not _NAME_RE.match(node.name):
            raise ctx.error(f"{key}.name", "expected letters, digits, '_' or '-' (a name is one part of a dotted key)")
        if node.name in seen or node.name in names:
            raise ctx.error(f"{key}.name", f"duplicate name '{node.name}' (node and router names must be unique)")
        seen.add(node.name)
        _check_node_role_keys(node, key, ctx)
        _check_cache(node.cache, f"{key}.cache", ctx)
        _check_scheduler(node.scheduler, f"{key}.scheduler", ctx)
        _check_node_tiers(node, topology.storage, key, ctx)
        _check_node_server(node, key, ctx)
        _check_node_keys(node, topology.cache, key, ctx)
        _check_node_offload(node, topology.storage, key, ctx)


def _check_node_role_keys(node: NodeSpec, key: str, ctx: ErrorContext) -> None:
    if node.role == "prefill" and node.bootstrap_port is None:
        raise ctx.error(f"{key}.bootstrap_port", "missing required key for role prefill (expected an integer port)")
    if node.role != "prefill" and node.bootstrap_port is not None:
        raise ctx.error(f"{key}.bootstrap_port", f"only prefill nodes have a bootstrap port (role is {node.role})")
    if node.role != "decode" and node.offload is not None:
        raise ctx.error(f"{key}.offload", f"only decode nodes offload (role is {node.role})")
    if node.command is not None and not node.command:
        raise ctx.error(f"{key}.command", "expected a non-empty array of strings")
    if any(not part for part in node.launch_prefix):
        raise ctx.error(f"{key}.launch_prefix", "expected non-empty strings (argv put before the "
                        'node command, e.g. ["numactl", "-N", "0"])')
    if not node.host or any(c.isspace() for c in node.host):
        raise ctx.error(f"{key}.host", f'expected a host name or address, got "{node.host}"')


def _check_node_tiers(node: NodeSpec, storage: StorageSpec, key: str, ctx: ErrorContext) -> None:
    """A prefill node always runs HiCache; storage is reached through the host tier."""
    if not node.cache.prefix_cache and node.role == "prefill":
        raise ctx.error(f"{key}.cache.prefix_cache", "a prefill node always runs its prefix cache (only unified and "
                        "decode nodes may turn it off)")
    if node.cache.host_pages == 0 and node.role == "prefill":
        raise ctx.error(f"{key}.cache.host_pages", "a prefill node needs a host tier (expected an integer >= 1)")
    if node.cache.host_pages == 0 and node.role == "unified" and storage.enabled and node.cache.prefix_cache:
        raise ctx.error(f"{key}.cache.host_pages", "storage is reached through the host tier: expected an integer >= 1, "
                        'or storage.backend = "none"')


def _check_node_server(node: NodeSpec, key: str, ctx: ErrorContext) -> None:
    if node.request_timeout_s <= 0:
        raise ctx.error(f"{key}.request_timeout_s", f"expected a number > 0, got {node.request_timeout_s}")
    if not 0 <= node.drain_s < math.inf:
        raise ctx.error(f"{key}.drain_s", f"expected a number of seconds >= 0, got {node.drain_s}")
    if node.max_request_bytes < 1:
        raise ctx.error(f"{key}.max_request_bytes", f"expected a size >= 1 byte, got {node.max_request_bytes}")
    for name in ("offload_staging_pages", "offload_stride_pages"):
        value = getattr(node, name)
        if value is not None and node.role != "decode":
            raise ctx.error(f"{key}.{name}", f"only decode nodes offload (role is {node.role})")
        if value is not None and value < 1:
            raise ctx.error(f"{key}.{name}", f"expected an integer >= 1, got {value}")
    ttl = node.offload_pending_ttl_s
    if ttl is not None and node.role != "decode":
        raise ctx.error(f"{key}.offload_pending_ttl_s", f"only decode nodes offload (role is {node.role})")
    if ttl is not None and not 0 < ttl <= MAX_PENDING_TTL_S:
        raise ctx.error(f"{key}.offload_pending_ttl_s",
                        f"expected a number > 0 and <= {MAX_PENDING_TTL_S:g}, got {ttl}")
    if not node.kernels or any(c.isspace() for c in node.kernels):
        raise ctx.error(f"{key}.kernels", f'expected a kernel backend name or "auto", got "{node.kernels}"')


def _check_node_keys(node: NodeSpec, cache: CacheSpec, key: str, ctx: ErrorContext) -> None:
    """Nodes naming pages differently would never find each other's pages in storage."""
    for name in ("key_scheme", "key_namespace", "window_tiers"):
        if getattr(node.cache, name) != getattr(cache, name):
            raise ctx.error(f"{key}.cache.{name}", f"must equal cache.{name} "
                            f"({getattr(cache, name)!r}): every node shares one key scheme "
                            "and stored page format")


def _check_node_offload(node: NodeSpec, storage: StorageSpec, key: str, ctx: ErrorContext) -> None:
    if node.role == "decode" and node.offload and not storage.enabled:
        raise ctx.error(
            f"{key}.offload",
            'decode offload needs storage: set storage.backend = "hf3fs"|"mooncake"|"file", or offload = false',
        )


def _check_shape(topology: Topology, ctx: ErrorContext) -> None:
    roles = {n.role for n in topology.nodes}
    if "unified" in roles and roles & set(PD_ROLES):
        raise ctx.error("node", "unified nodes cannot be mixed with prefill/decode nodes in one topology")
    if roles & set(PD_ROLES) and not {"prefill", "decode"} <= roles:
        missing = "decode" if "prefill" in roles else "prefill"
        raise ctx.error("node", f"a PD topology needs at least one prefill and one decode node; no {missing} node")
    if topology.is_pd and topology.router is None:
        raise ctx.error("router", "missing [router] table: a PD topology needs a router in front of its nodes")


def _check_metadata_replicas(storage: StorageSpec, ctx: ErrorContext) -> None:
    """`storage.metadata`: "inproc", one tcp address, or (store etcd) one per replica."""
    addresses = [a.strip() for a in storage.metadata.split(",")]
    if storage.metadata != "inproc" and not all(
        re.match(r"^tcp://[^:/\s]+:\d{1,5}$", a) for a in addresses
    ):
        raise ctx.error("storage.metadata", f'expected "inproc" or "tcp://HOST:PORT", got '
                        f'"{storage.metadata}" (replicas on store "etcd": several, comma-separated)')
    service = storage.metadata_service
    if len(set(addresses)) != len(addresses):
        raise ctx.error("storage.metadata", "a replica address is listed twice")
    if len(addresses) > 1 and service.store != "etcd":
        raise ctx.error("storage.metadata", f"{len(addresses)} metadata replicas need "
                        'storage.metadata_service.store = "etcd" (SQLite is one process)')
    if service.store == "etcd" and service.lease_ttl_s < 2:
        raise ctx.error("storage.metadata_service.lease_ttl_s",
                        f"etcd grants leases of 2 s or more, got {service.lease_ttl_s}")


def _check_etcd(storage: StorageSpec, ctx: ErrorContext) -> None:
    """`[storage.etcd]`, when something keeps its state there."""
    etcd = storage.etcd
    if not storage.uses_etcd:
        return
    if not etcd.endpoints:
        user = ("storage.mooncake.ha" if storage.backend == "mooncake"
                else 'storage.metadata_service.store = "etcd"')
        raise ctx.error("storage.etcd.endpoints", f"{user} needs the etcd members' HOST:PORT "
                        '(e.g. ["127.0.0.1:2379", "127.0.0.1:2381", "127.0.0.1:2383"])')
    for endpoint in etcd.endpoints:
        if not re.match(r"^[^:/\s]+:\d{1,5}$", endpoint):
            raise ctx.error("storage.etcd.endpoints", f'expected "HOST:PORT", got "{endpoint}"')
    if not etcd.prefix.startswith("/") or etcd.prefix.rstrip("/") == "":
        raise ctx.error("storage.etcd.prefix", f'expected a key prefix like "/pdcache/metadata", '
                        f'got "{etcd.prefix}"')


def _check_mooncake_ha(storage: StorageSpec, ctx: ErrorContext) -> None:
    mooncake = storage.mooncake
    masters = mooncake.master.split(",")
    if len(masters) > 1 and not mooncake.ha:
        raise ctx.error("storage.mooncake.master", f"{len(masters)} masters need "
                        "storage.mooncake.ha = true (they elect a leader on [storage.etcd])")
    if mooncake.ha and mooncake.http_metadata_address is not None:
        raise ctx.error("storage.mooncake.metadata_server", 'with ha = true use "P2PHANDSHAKE": '
                        "an HTTP metadata server embedded in a master dies with it")
    if mooncake.ha and not re.match(r"^[A-Za-z0-9_.-]+$", mooncake.cluster_id):
        raise ctx.error("storage.mooncake.cluster_id",
                        f'expected letters, digits, "_.-", got "{mooncake.cluster_id}"')


def _check_shared_inproc_metadata(topology: Topology, ctx: ErrorContext) -> None:
    """Two processes with private in-process 3FS metadata would hand out the same slots."""
    if topology.storage.backend != "hf3fs" or topology.storage.metadata != "inproc":
        return
    users = [n.name for n in resolve_nodes(topology.nodes, topology.storage) if _uses_storage(n)]
    if len(users) > 1:
        raise ctx.error(
            "storage.metadata",
            f'"inproc" metadata cannot be shared by {len(users)} processes ({", ".join(users)}); '
            'use "tcp://HOST:PORT" (the launcher starts the metadata service)',
        )


def _uses_storage(node: NodeSpec) -> bool:
    return node.role in ("prefill", "unified") or bool(node.role == "decode" and node.offload)


def resolve_nodes(nodes: Iterable[NodeSpec], storage: StorageSpec) -> tuple[NodeSpec, ...]:
    """Fill role-dependent defaults: decode offload defaults to on when storage exists."""
    out = []
    for node in nodes:
        if node.role == "decode" and node.offload is None:
            node = replace(node, offload=storage.enabled)
        out.append(replace(node, env=types.MappingProxyType(dict(node.env))))
    return tuple(out)


def _check_ports(topology: Topology, ctx: ErrorContext) -> None:
    owners: dict[tuple[str, int], str] = {}
    for host, port, key in _listening_ports(topology):
        if not 1 <= port <= 65535:
            raise ctx.error(key, f"expected a port in 1..65535, got {port}")
        where = (_LOCAL_ALIASES.get(host, host), port)
        if where in owners:
            raise ctx.error(key, f"port clash: {host}:{port} is also used by {owners[where]}")
        owners[where] = key


def _listening_ports(topology: Topology) -> list[tuple[str, int, str]]:
    ports = []
    if topology.router is not None:
        ports.append((topology.router.host, topology.router.port, "router.port"))
    for node in topology.nodes:
        ports.append((node.host, node.port, f"node.{node.name}.port"))
        if node.bootstrap_port is not None:
            ports.append((node.host, node.bootstrap_port, f"node.{node.name}.bootstrap_port"))
    storage = topology.storage
    if storage.uses_metadata_service and storage.metadata_service.start:
        ports += [(host, port, "storage.metadata") for host, port in storage.metadata_addresses]
    if storage.uses_etcd and storage.etcd.start:
        for endpoint in storage.etcd.endpoints:
            host, port = split_host_port(endpoint)
            ports += [(host, port, "storage.etcd.endpoints"),
                      (host, port + 1, "storage.etcd.endpoints (peer port = client port + 1)")]
    if storage.backend == "mooncake" and storage.mooncake.start_master:
        ports.extend(_mooncake_ports(storage.mooncake))
    return ports


def _mooncake_ports(spec: MooncakeStoreSpec) -> list[tuple[str, int, str]]:
    ports = []
    for index, (host, port) in enumerate(spec.master_addresses):  # master i: metrics_port + i
        ports += [(host, port, "storage.mooncake.master"),
                  (host, spec.metrics_port + index, "storage.mooncake.metrics_port")]
    http = spec.http_metadata_address
    if http is not None:
        ports.append((http[0], http[1], "storage.mooncake.metadata_server"))
    return ports



# ---- security (docs/design.md §8)

WILDCARD_HOSTS = ("0.0.0.0", "::", "[::]", "*", "")
_SECRET_FIX = ("create one with `pdcache secret create PATH` (mode 0600), copy it to every "
               "host, and set [security] secret_file = \"PATH\"")


def is_wildcard(host: str) -> bool:
    """An address that binds every interface of the machine."""
    return host.strip() in WILDCARD_HOSTS


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


# the [router] numbers and their least values (positive floats: more than 0); the router
# process refused a wrong one only once launched, naming no key, and the launcher restarted
# it until it gave up; a zero health interval probed every node back to back
_ROUTER_LEAST = {"max_attempts": 1, "max_queue": 0, "max_inflight_per_node": 0,
                 "cache_aware_balance": 0, "max_node_connections": 1, "max_request_bytes": 1}
_ROUTER_POSITIVE = ("request_timeout_s", "connect_timeout_s", "health_interval_s")


def _check_router(topology: Topology, ctx: ErrorContext) -> None:
    router = topology.router
    if router is None:
        return
    for key, least in _ROUTER_LEAST.items():
        if getattr(router, key) < least:
            raise ctx.error(f"router.{key}", f"expected an integer >= {least}, got "
                            f"{getattr(router, key)}")
    for key in _ROUTER_POSITIVE:
        value = getattr(router, key)
        if not 0 < value < math.inf:
            raise ctx.error(f"router.{key}", f"expected a number of seconds > 0, got {value}")
    if not 0 <= router.drain_s < math.inf:
        raise ctx.error("router.drain_s", f"expected a number of seconds >= 0, got {router.drain_s}")
    if (router.tls_cert is None) != (router.tls_key is None):
        raise ctx.error("router.tls_key" if router.tls_key is None else "router.tls_cert",
                        "give both tls_cert and tls_key (PEM files) to serve HTTPS, or neither")
    names: set[str] = set()
    for tenant in router.tenant:
        key = f"router.tenant.{tenant.name}"
        if not _NAME_RE.match(tenant.name):
            raise ctx.error(f"{key}.name", "expected letters, digits, '_' or '-' (a name is one part of a dotted key)")
        if tenant.name in names:
            raise ctx.error(f"{key}.name", f"duplicate tenant name '{tenant.name}'")
        names.add(tenant.name)
        if tenant.max_inflight < 0:
            raise ctx.error(f"{key}.max_inflight", f"expected an integer >= 0, got {tenant.max_inflight}")
        if tenant.storage_quota is not None and tenant.storage_quota < 1:
            raise ctx.error(f"{key}.storage_quota", "expected a size > 0")
    keys = [t.api_key for t in router.tenant if t.api_key is not None]
    keys += [router.api_key] if router.api_key else []
    if len(set(keys)) != len(keys):
        raise ctx.error("router.tenant", "two tenants (or a tenant and router.api_key) share an "
                        "API key: the key is what tells tenants apart")


def _check_tenant_quotas(topology: Topology, ctx: ErrorContext) -> None:
    """A quota is a boundary between tenants: a backend that would ignore it is refused rather
    than leaving one tenant free to evict another's pages while the topology says otherwise."""
    backend = topology.storage.backend
    if topology.router is None or backend not in QUOTA_UNENFORCED_BACKENDS:
        return
    for tenant in topology.router.tenant:
        if tenant.storage_quota is not None:
            raise ctx.error(
                f"router.tenant.{tenant.name}.storage_quota",
                f"the {backend} backend does not enforce tenant storage quotas (its space is "
                f"allocated without the tenant's namespace), so one tenant could still evict "
                f"another's pages; use [storage] backend = \"file\", or remove storage_quota")


def _internal_binds(topology: Topology) -> list[tuple[str, str]]:
    """(host, key) of every internal listener: nodes (HTTP and bootstrap), metadata service."""
    # a node listens on its bind_host when set (0.0.0.0 behind an address it advertises)
    binds = [(n.bind_host, f"node.{n.name}.bind_host") if n.bind_host else
             (n.host, f"node.{n.name}.host") for n in topology.nodes]
    storage = topology.storage
    if storage.uses_metadata_service and storage.metadata_service.start:
        for host, _ in storage.metadata_addresses:
            bind = storage.metadata_service.bind_host or host
            binds.append((bind, "storage.metadata_service.bind_host"))
    return binds


def _check_wildcard_binds(topology: Topology, ctx: ErrorContext) -> None:
    """A wildcard bind puts an internal port on every network the machine is on: only with
    the cluster secret, which authenticates what those ports accept."""
    if topology.security.enabled:
        return
    for host, key in _internal_binds(topology):
        if is_wildcard(host):
            raise ctx.error(key, f"binds the wildcard address {host!r} (every interface) "
                            "without a cluster secret: anyone who can reach this machine could "
                            "drive the node. Bind the node's own address, or " + _SECRET_FIX)


def _check_tenants_behind_a_secret(topology: Topology, ctx: ErrorContext) -> None:
    """Client keys at the router protect nothing when the nodes behind it take anyone on a
    network address: a tenant could call a node directly with another's cache salt (read
    or time its pages) or close its sessions. Loopback-only nodes are reachable only from
    this machine."""
    router = topology.router
    if topology.security.enabled or router is None or not (router.tenant or router.api_key):
        return
    for host, key in _internal_binds(topology):
        if not is_loopback(host):
            raise ctx.error(key, f"binds {host!r} while the router authenticates clients "
                            "([[router.tenant]] / router.api_key) and no cluster secret "
                            "authenticates the nodes: a client could call a node directly "
                            "with another tenant's cache salt; " + _SECRET_FIX)


def deployment_hosts(topology: Topology) -> list[str]:
    """Distinct machines the topology runs on (every loopback or wildcard address is 'this
    machine')."""
    hosts = list(topology.hosts())
    storage = topology.storage
    if storage.uses_metadata_service:
        hosts += [host for host, _ in storage.metadata_addresses]
    if storage.uses_etcd:
        hosts += [split_host_port(e)[0] for e in storage.etcd.endpoints]
    if storage.backend == "mooncake":
        hosts += [host for host, _ in storage.mooncake.master_addresses]
    machines = ["local" if is_loopback(h) or is_wildcard(h) else h for h in hosts]
    return list(dict.fromkeys(machines))


def _check_multi_host_secret(topology: Topology, ctx: ErrorContext) -> None:
    machines = deployment_hosts(topology)
    if len(machines) > 1 and not topology.security.enabled:
        shown = ", ".join("loopback" if m == "local" else m for m in machines)
        raise ctx.error("security.secret_file", f"missing: this topology spans {len(machines)} "
                        f"hosts ({shown}), and without a cluster secret every node, bootstrap "
                        "and metadata port accepts anyone on the network; " + _SECRET_FIX)


def finalize(topology: Topology) -> Topology:
    """The topology with role defaults filled in (what `load_topology` returns)."""
    return replace(topology, nodes=resolve_nodes(topology.nodes, topology.storage))
