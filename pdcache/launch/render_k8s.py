"""`pdcache launch CONFIG --render k8s`: the topology as Kubernetes manifests (docs/kubernetes.md).

One role per process kind: `etcd` (the members of `[storage.etcd]`, when the topology starts
them), `metadata` (the hf3fs metadata service, one pod per replica), `mooncake-master`,
`prefill`, `decode`, `unified`, `router`; a role's replicas are the topology's nodes of that
kind, so the P:D ratio is the topology's by construction. Two layouts of the same roles:

- `rbg` (default): one RoleBasedGroup (`workloads.x-k8s.io/v1alpha2`, the RBG controller)
  whose roles start in dependency order (services, then nodes, then the router);
- `plain`: a StatefulSet per role, for clusters without the RBG controller.

Either way pod i of role R is `NAME-R-i`, reachable as `NAME-R-i.s-NAME-R` through the role's
headless Service `s-NAME-R` (RBG names them so; the plain layout renders them). Every process
reads the same topology file (a ConfigMap) with the same `--set` overrides that place each node
there (host = that DNS name, listening on 0.0.0.0, the role's port), the storage and secret at
their mount points; pod i of a role picks the i-th node of that kind by its index label. The
cluster secret (and tenants' API keys) come from a Secret mounted read-only, never inline.

Pure: a topology in, a list of manifests (plain dicts) out, always the same bytes for the same
input; `to_yaml` and `write_manifests` serialise them.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from pdcache.config import NodeSpec, Topology, TopologyError, load_topology
from pdcache.config.schema import split_host_port
from pdcache.launch.k8s_names import check_kubernetes_names
from pdcache.launch.launcher import ProcessSpec, build_process_specs
from pdcache.offload_manager.storage.etcd_cluster import member_argv

RBG_API = "workloads.x-k8s.io/v1alpha2"
CONFIG_DIR = "/etc/pdcache"
TOPOLOGY_FILE = f"{CONFIG_DIR}/topology.toml"
SECRET_DIR = "/etc/pdcache/secret"
SECRET_KEY = "cluster.secret"
DATA_DIR = "/var/lib/pdcache"
MODEL_DIR = "/var/lib/pdcache-model"
ETCD_DIR = "/var/lib/etcd"
PYTHON = "python"
# every pod's cluster secret: the Secret's key, mounted (a render needs no secret file of its own)
SECRET_OVERRIDE = f"security.secret_file={json.dumps(f'{SECRET_DIR}/{SECRET_KEY}')}"
TOPOLOGY_DIGEST = "checksum/topology"  # pod template annotation: sha256 of the ConfigMap's file
# the pod label carrying a pod's index within its role
INDEX_LABEL = {"rbg": "rbg.workloads.x-k8s.io/role-instance-index",
               "plain": "apps.kubernetes.io/pod-index"}
NODE_ROLES = ("prefill", "decode", "unified")
PROBE_PERIOD_S = 10
# after its drain, what a process's close may take: a decode node joins its offload (10 s)
# and closes its writer (10 s); the router closes its node connections
NODE_CLOSE_S = 30
ROUTER_CLOSE_S = 5
# pod i runs the i-th of its role's nodes: `$PDCACHE_NODES` in order, `$PDCACHE_NODE_INDEX`
# from the index label; the command follows the script as "$@"
NODE_SCRIPT = (
    'i=0; for node in $PDCACHE_NODES; do '
    'if [ "$i" = "$PDCACHE_NODE_INDEX" ]; then exec "$@" --node "$node"; fi; i=$((i + 1)); '
    'done; echo "pdcache: no node for index $PDCACHE_NODE_INDEX of: $PDCACHE_NODES" >&2; exit 1'
)
# node settings the pod template carries (the rest each pod reads from the topology, as its
# node): a role's nodes must agree on these
_TEMPLATE_FIELDS = ("env", "launch_prefix", "extra_args", "health")
# mooncake_master's listening flags: in a pod it listens on every address
_MASTER_BIND_FLAGS = ("--rpc_address=", "--metrics_host=", "--http_metadata_server_host=")


@dataclass(frozen=True)
class Role:
    """One role of the deployment: its processes' kind, pods and how each pod runs."""

    name: str
    replicas: int
    process: ProcessSpec  # pod 0's process, as the launcher would start it in the cluster
    ports: tuple[tuple[str, int], ...]
    probe: dict[str, Any]  # the readiness / liveness / startup handler
    node_names: tuple[str, ...] = ()  # node roles: pod i runs node_names[i]
    depends_on: tuple[str, ...] = ()
    needs_gpu: bool = False
    mounts_storage: bool = False
    env: dict[str, str] = field(default_factory=dict)
    image: str = ""  # the container image when not `[kubernetes] image` (etcd's own)


def render_k8s(topology: Topology, mode: str | None = None) -> list[dict[str, Any]]:
    """Every manifest of `topology` (`mode`: "rbg" or "plain"; default `[kubernetes] mode`).
    Raises TopologyError naming the key of what cannot be laid out on a cluster."""
    mode = mode or topology.kubernetes.mode
    if mode not in INDEX_LABEL:
        raise TopologyError(topology.source, "kubernetes.mode", f"'{mode}' is not rbg or plain")
    _check_renderable(topology)
    placed = load_topology(topology.source, [*topology.overrides, *cluster_overrides(topology)])
    roles = _roles(topology, placed)
    check_kubernetes_names(topology, [role.name for role in roles])
    docs: list[dict[str, Any]] = [_config_map(topology)]
    docs += [_headless_service(topology, role) for role in roles if mode == "plain"]
    docs += _client_services(topology, roles)
    if mode == "rbg":
        docs.append(_role_based_group(topology, roles))
    else:
        docs += [_stateful_set(topology, role) for role in roles]
    return docs


# ---- placement -------------------------------------------------------------------------------

def dns_name(topology: Topology, role: str, index: int) -> str:
    """Pod `index` of `role`: its stable name through the role's headless Service."""
    group = topology.kubernetes.name
    return f"{group}-{role}-{index}.s-{group}-{role}"


def cluster_overrides(topology: Topology) -> list[str]:
    """The `--set` overrides every process gets in the cluster: nodes at their pods' names
    (listening on 0.0.0.0, on the role's port), services at theirs, storage, model and the
    secret at their mount points."""
    k = topology.kubernetes
    sets = [SECRET_OVERRIDE]
    for role in NODE_ROLES:
        for index, node in enumerate(topology.nodes_with_role(role)):
            prefix = f"node.{node.name}"
            sets += [f"{prefix}.host={json.dumps(dns_name(topology, role, index))}",
                     f'{prefix}.bind_host="0.0.0.0"', f"{prefix}.port={k.port_base}"]
            if node.bootstrap_port is not None:
                sets.append(f"{prefix}.bootstrap_port={k.port_base + 1}")
    if topology.router is not None:
        sets.append('router.host="0.0.0.0"')
    sets += _storage_overrides(topology)
    if topology.model.path is not None:
        sets.append(f"model.path={json.dumps(MODEL_DIR)}")
    return sets


def _storage_overrides(topology: Topology) -> list[str]:
    storage = topology.storage
    sets = []
    if _stores_in_a_directory(topology):
        sets.append(f"storage.path={json.dumps(f'{DATA_DIR}/storage')}")
    if storage.uses_metadata_service and storage.metadata_service.start:
        # (one that runs elsewhere, `start = false`, keeps the address the topology gives)
        _, port = storage.metadata_address  # type: ignore[misc]
        address = ",".join(f"tcp://{dns_name(topology, 'metadata', i)}:{port}"
                           for i in range(len(storage.metadata_addresses)))
        sets += [f"storage.metadata={json.dumps(address)}",
                 'storage.metadata_service.bind_host="0.0.0.0"',
                 f"storage.metadata_service.state_dir={json.dumps(f'{DATA_DIR}/metadata')}"]
    if storage.uses_etcd and storage.etcd.start:
        port = split_host_port(storage.etcd.endpoints[0])[1]  # every pod: the same ports
        members = [f"{dns_name(topology, 'etcd', i)}:{port}"
                   for i in range(len(storage.etcd.endpoints))]
        sets += [f"storage.etcd.endpoints={json.dumps(members)}",
                 f"storage.etcd.data_dir={json.dumps(ETCD_DIR)}"]
    if storage.backend == "mooncake" and storage.mooncake.start_master:
        master = dns_name(topology, "mooncake-master", 0)
        _, port = storage.mooncake.master_address
        masters = ",".join(f"{dns_name(topology, 'mooncake-master', i)}:{port}"
                           for i in range(len(storage.mooncake.master_addresses)))
        sets.append(f"storage.mooncake.master={json.dumps(masters)}")
        http = storage.mooncake.http_metadata_address
        if http is not None:
            url = f"http://{master}:{http[1]}/metadata"
            sets.append(f"storage.mooncake.metadata_server={json.dumps(url)}")
    return sets


def _stores_in_a_directory(topology: Topology) -> bool:
    """hf3fs and file keep pages in a directory every node mounts (Mooncake Store does not)."""
    return topology.storage.backend in ("hf3fs", "file")


def _check_renderable(topology: Topology) -> None:
    k, source = topology.kubernetes, topology.source
    if topology.router is not None and topology.router.api_key is not None:
        raise TopologyError(source, "router.api_key", "an inline key would be readable in the "
                            "ConfigMap; give each tenant an api_key_env (a key of the Secret)")
    for tenant in topology.router.tenant if topology.router else ():
        if tenant.api_key is not None:
            raise TopologyError(source, f"router.tenant.{tenant.name}.api_key",
                                "an inline key would be readable in the ConfigMap; use "
                                "api_key_env (rendered as that Secret key)")
    if topology.router is not None and topology.router.tls_cert is not None:
        raise TopologyError(source, "router.tls_cert", "the router's certificate is not "
                            "rendered (no volume for it, plain HTTP probes): terminate TLS at "
                            "the cluster's Ingress or Service instead")
    for node in topology.nodes:
        if node.command is not None:
            raise TopologyError(source, f"node.{node.name}.command",
                                "a custom command cannot be rendered for a cluster")
    if _stores_in_a_directory(topology) and not k.storage_volume:
        raise TopologyError(source, "kubernetes.storage_volume", f"storage backend "
                            f"'{topology.storage.backend}' needs a volume every node shares: "
                            '"pvc:CLAIM" (ReadWriteMany) or "hostpath:/3fs/mount"')
    if topology.model.path is not None and not k.model_volume:
        raise TopologyError(source, "kubernetes.model_volume",
                            'a checkpoint path needs the volume holding it: "pvc:CLAIM" or '
                            '"hostpath:/DIR"')
    for role in NODE_ROLES:
        _check_alike(topology, topology.nodes_with_role(role))


def _check_alike(topology: Topology, nodes: Sequence[NodeSpec]) -> None:
    """The nodes of one role share one pod template: they must agree on what it carries
    (each pod reads every other setting of its node from the topology)."""
    for node in nodes[1:]:
        for name in _TEMPLATE_FIELDS:
            if getattr(node, name) != getattr(nodes[0], name):
                raise TopologyError(topology.source, f"node.{node.name}.{name}",
                                    f"differs from node {nodes[0].name}'s (a role's pods share "
                                    "one template)")


# ---- roles -----------------------------------------------------------------------------------

def _roles(topology: Topology, placed: Topology) -> list[Role]:
    """The roles, in start order, from the processes the launcher would start in the cluster
    (the placed topology: every host and path as the pods see them)."""
    specs = build_process_specs(placed, python=PYTHON, config_path=TOPOLOGY_FILE)
    by_role: dict[str, list[ProcessSpec]] = {}
    for spec in specs:
        by_role.setdefault(spec.role, []).append(spec)
    roles = []
    services = tuple(r for r in ("etcd", "metadata", "mooncake_master") if r in by_role)
    for name in services:
        if name == "etcd":
            roles.append(_etcd_role(placed))
        else:
            roles.append(_service_role(topology, name, by_role[name], "etcd" in by_role))
    node_roles = tuple(r for r in NODE_ROLES if r in by_role)
    for name in node_roles:
        roles.append(_node_role(topology, name, by_role[name], services))
    if "router" in by_role:
        router = by_role["router"][0]
        roles.append(Role("router", 1, router, (("http", placed.router.port),),  # type: ignore[union-attr]
                          _http_probe(placed.router.port),  # type: ignore[union-attr]
                          depends_on=tuple(_role_name(r) for r in node_roles)))
    return roles


def _role_name(process_role: str) -> str:
    return process_role.replace("_", "-")


def _etcd_role(placed: Topology) -> Role:
    """The etcd members, pod i = member i: named after its pod, listening on every address,
    advertising its DNS name; data in the pod's own volume (docs/kubernetes.md)."""
    k = placed.kubernetes
    endpoints = [split_host_port(e) for e in placed.storage.etcd.endpoints]
    names = [f"{k.name}-etcd-{i}" for i in range(len(endpoints))]
    argv = member_argv(endpoints, 0, f"{ETCD_DIR}/$(POD_NAME)", names=names,
                       own_name="$(POD_NAME)", own_host=f"$(POD_NAME).s-{k.name}-etcd",
                       listen_host="0.0.0.0", cluster_token=k.name)
    port = endpoints[0][1]
    spec = ProcessSpec("etcd", "etcd", "", tuple(argv), 0)
    return Role("etcd", len(endpoints), spec, (("client", port), ("peer", port + 1)),
                {"tcpSocket": {"port": port}}, image=k.etcd_image)


def _service_role(topology: Topology, name: str, specs: list[ProcessSpec],
                  after_etcd: bool = False) -> Role:
    spec = specs[0]
    if name == "mooncake_master":
        argv = tuple(_bind_all(arg) for arg in spec.argv)
        if topology.storage.mooncake.ha:  # a leader publishes its rpc address in etcd
            argv = tuple("--rpc_address=$(POD_IP)" if a.startswith("--rpc_address=") else a
                         for a in argv)
        spec = replace(spec, argv=argv)
    ports = tuple((f"p{i}", use.port) for i, use in enumerate(spec.ports))
    probe = {"tcpSocket": {"port": spec.health[0].port}}  # a standby master: its metrics port
    if "--advertise" in spec.argv:  # metadata replicas on etcd: each pod advertises its name
        at = spec.argv.index("--advertise") + 1
        own = f"tcp://$(POD_NAME).s-{topology.kubernetes.name}-metadata:{ports[0][1]}"
        spec = replace(spec, argv=(*spec.argv[:at], own, *spec.argv[at + 1:]))
    return Role(_role_name(name), len(specs), spec, ports, probe,
                depends_on=("etcd",) if after_etcd and name != "etcd" else (),
                mounts_storage=name == "metadata" and topology.storage.metadata_service.store
                == "sqlite")


def _bind_all(arg: str) -> str:
    for flag in _MASTER_BIND_FLAGS:
        if arg.startswith(flag):
            return flag + "0.0.0.0"
    return arg


def _node_role(topology: Topology, role: str, specs: list[ProcessSpec],
               services: tuple[str, ...]) -> Role:
    first = specs[0]
    port = topology.kubernetes.port_base
    ports = [("http", port)]
    if first.endpoints.get("bootstrap"):
        ports.append(("bootstrap", port + 1))
    names = tuple(n.name for n in topology.nodes_with_role(role))
    process = replace(first, argv=_without_node_flag(first.argv))
    return Role(role, len(specs), process, tuple(ports), _http_probe(port), names,
                tuple(_role_name(s) for s in services), needs_gpu=True,
                mounts_storage=_stores_in_a_directory(topology))


def _without_node_flag(argv: Sequence[str]) -> tuple[str, ...]:
    """The node command without its `--node NAME` (the pod's index picks the name)."""
    out, skip = [], False
    for arg in argv:
        if skip:
            skip = False
        elif arg == "--node":
            skip = True
        else:
            out.append(arg)
    return tuple(out)


def _http_probe(port: int) -> dict[str, Any]:
    return {"httpGet": {"path": "/health", "port": port}}


# ---- manifests -------------------------------------------------------------------------------

def _metadata(topology: Topology, name: str, component: str = "") -> dict[str, Any]:
    k = topology.kubernetes
    labels = {"app.kubernetes.io/name": "pdcache", "app.kubernetes.io/instance": k.name}
    if component:
        labels["app.kubernetes.io/component"] = component
    return {"name": name, "namespace": k.namespace, "labels": labels}


def _config_map(topology: Topology) -> dict[str, Any]:
    return {"apiVersion": "v1", "kind": "ConfigMap",
            "metadata": _metadata(topology, f"{topology.kubernetes.name}-topology"),
            "data": {"topology.toml": Path(topology.source).read_text()}}


def _headless_service(topology: Topology, role: Role) -> dict[str, Any]:
    """`s-NAME-ROLE`: the pods' DNS names; published before they are ready, since a node
    reaches its peers by name while it starts."""
    group = topology.kubernetes.name
    return {"apiVersion": "v1", "kind": "Service",
            "metadata": _metadata(topology, f"s-{group}-{role.name}", role.name),
            "spec": {"clusterIP": "None", "publishNotReadyAddresses": True,
                     "selector": _selector(topology, role),
                     "ports": [{"name": n, "port": p, "targetPort": p} for n, p in role.ports]}}


def _client_services(topology: Topology, roles: list[Role]) -> list[dict[str, Any]]:
    """The front door: the router's (or, without one, each unified role's) ClusterIP Service."""
    front = [r for r in roles if r.name == "router"] or [r for r in roles if r.name == "unified"]
    return [{"apiVersion": "v1", "kind": "Service",
             "metadata": _metadata(topology, f"{topology.kubernetes.name}-{role.name}",
                                   role.name),
             "spec": {"type": "ClusterIP", "selector": _selector(topology, role),
                      "ports": [{"name": "http", "port": role.ports[0][1],
                                 "targetPort": role.ports[0][1]}]}} for role in front]


def _selector(topology: Topology, role: Role) -> dict[str, str]:
    return {"app.kubernetes.io/instance": topology.kubernetes.name,
            "app.kubernetes.io/component": role.name}


def _role_based_group(topology: Topology, roles: list[Role]) -> dict[str, Any]:
    specs = []
    for role in roles:
        entry: dict[str, Any] = {"name": role.name, "replicas": role.replicas}
        if role.depends_on:
            entry["dependencies"] = list(role.depends_on)
        entry["standalonePattern"] = {"template": _pod_template(topology, role, "rbg")}
        specs.append(entry)
    return {"apiVersion": RBG_API, "kind": "RoleBasedGroup",
            "metadata": _metadata(topology, topology.kubernetes.name),
            "spec": {"roles": specs}}


def _stateful_set(topology: Topology, role: Role) -> dict[str, Any]:
    group = topology.kubernetes.name
    return {"apiVersion": "apps/v1", "kind": "StatefulSet",
            "metadata": _metadata(topology, f"{group}-{role.name}", role.name),
            "spec": {"serviceName": f"s-{group}-{role.name}", "replicas": role.replicas,
                     "podManagementPolicy": "Parallel",
                     "selector": {"matchLabels": _selector(topology, role)},
                     "template": _pod_template(topology, role, "plain")}}


def _pod_template(topology: Topology, role: Role, mode: str) -> dict[str, Any]:
    k = topology.kubernetes
    spec: dict[str, Any] = {"containers": [_container(topology, role, mode)],
                            "volumes": _volumes(topology, role)}
    if mode == "plain":  # RBG sets hostname and subdomain itself
        spec["subdomain"] = f"s-{k.name}-{role.name}"
    grace_s = _termination_grace_s(topology, role)
    if grace_s is not None:
        spec["terminationGracePeriodSeconds"] = grace_s
    if role.needs_gpu and k.rdma == "host-network":
        spec["hostNetwork"] = True
        spec["dnsPolicy"] = "ClusterFirstWithHostNet"
    metadata: dict[str, Any] = {"labels": {"app.kubernetes.io/name": "pdcache",
                                           **_selector(topology, role)}}
    if TOPOLOGY_FILE in role.process.argv:
        # the topology's digest: a changed ConfigMap rolls the pods that read it (each reads
        # it only at start); never etcd's (a replaced member comes back empty: no rejoin)
        metadata["annotations"] = {TOPOLOGY_DIGEST: _topology_digest(topology)}
    return {"metadata": metadata, "spec": spec}


def _termination_grace_s(topology: Topology, role: Role) -> int | None:
    """SIGTERM to SIGKILL for a node or the router: its `drain_s` (requests in flight
    finish) and then its close (a decode node's offload flush); None: Kubernetes' 30 s."""
    if role.node_names:
        drain_s = max(node.drain_s for node in topology.nodes_with_role(role.name))
        return math.ceil(drain_s + NODE_CLOSE_S)
    if role.name == "router" and topology.router is not None:
        return math.ceil(topology.router.drain_s + ROUTER_CLOSE_S)
    return None


def _topology_digest(topology: Topology) -> str:
    return hashlib.sha256(Path(topology.source).read_bytes()).hexdigest()


def _container(topology: Topology, role: Role, mode: str) -> dict[str, Any]:
    k = topology.kubernetes
    argv = list(role.process.argv)
    if role.node_names:
        argv = ["sh", "-c", NODE_SCRIPT, "pdcache-node", *argv]
    container: dict[str, Any] = {
        "name": role.name, "image": role.image or k.image, "imagePullPolicy": k.image_pull_policy,
        "command": argv, "env": _env(topology, role, mode),
        "ports": [{"name": n, "containerPort": p} for n, p in role.ports],
        "resources": _resources(topology, role), "volumeMounts": _mounts(topology, role),
    }
    container.update(_probes(topology, role))
    if role.needs_gpu and k.rdma == "host-network":
        container["securityContext"] = {"capabilities": {"add": ["IPC_LOCK"]}}
    return container


def _env(topology: Topology, role: Role, mode: str) -> list[dict[str, Any]]:
    env: list[dict[str, Any]] = [{"name": n, "value": v}
                                 for n, v in sorted(role.process.env.items())
                                 if n != "MC_TCP_BIND_ADDRESS"]
    if "MC_TCP_BIND_ADDRESS" in role.process.env:  # Mooncake binds to the pod's own address
        env.append({"name": "MC_TCP_BIND_ADDRESS",
                    "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}})
    if any("$(POD_NAME)" in arg for arg in role.process.argv):  # Kubernetes expands it
        env.append({"name": "POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}})
    if any("$(POD_IP)" in arg for arg in role.process.argv):
        env.append({"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}})
    if role.node_names:
        label = INDEX_LABEL[mode]
        env += [{"name": "PDCACHE_NODES", "value": " ".join(role.node_names)},
                {"name": "PDCACHE_NODE_INDEX",
                 "valueFrom": {"fieldRef": {"fieldPath": f"metadata.labels['{label}']"}}}]
    if role.name == "router" and topology.router is not None:
        env += [{"name": t.api_key_env, "valueFrom": {"secretKeyRef": {
                    "name": topology.kubernetes.secret_name, "key": f"tenant-{t.name}"}}}
                for t in topology.router.tenant if t.api_key_env]
    return env


def _resources(topology: Topology, role: Role) -> dict[str, Any]:
    k = topology.kubernetes
    requests: dict[str, Any] = ({"cpu": k.cpu, "memory": k.memory} if role.node_names
                                else {"cpu": k.service_cpu, "memory": k.service_memory})
    limits: dict[str, Any] = {}
    if role.needs_gpu and k.gpus:
        limits[k.gpu_resource] = k.gpus
    if role.needs_gpu and k.rdma == "device-plugin":
        limits[k.rdma_resource] = 1
    return {"requests": requests, **({"limits": limits} if limits else {})}


def _probes(topology: Topology, role: Role) -> dict[str, Any]:
    """Readiness and liveness on the role's health handler; a startup probe long enough for
    a node to load its model (liveness counts only after it). The router's /health is 503
    while no node can serve (nodes still loading, a role down): its readiness only; startup
    and liveness ask /liveness (the process answers), or a router waiting for its nodes
    would be restarted into a crash loop."""
    startup_s = topology.kubernetes.startup_probe_s if role.node_names else 60
    alive = role.probe
    if role.name == "router":
        alive = {"httpGet": {**role.probe["httpGet"], "path": "/liveness"}}
    return {
        "startupProbe": {**alive, "periodSeconds": PROBE_PERIOD_S,
                         "failureThreshold": max(1, math.ceil(startup_s / PROBE_PERIOD_S))},
        "readinessProbe": {**role.probe, "periodSeconds": PROBE_PERIOD_S},
        "livenessProbe": {**alive, "periodSeconds": PROBE_PERIOD_S, "failureThreshold": 6},
    }


def _volumes(topology: Topology, role: Role) -> list[dict[str, Any]]:
    k = topology.kubernetes
    volumes: list[dict[str, Any]] = [
        {"name": "topology", "configMap": {"name": f"{k.name}-topology"}},
        {"name": "cluster-secret", "secret": {"secretName": k.secret_name, "defaultMode": 0o400,
                                              "items": [{"key": SECRET_KEY, "path": SECRET_KEY}]}},
    ]
    if role.mounts_storage:
        volumes.append({"name": "storage", **_volume_source(k.storage_volume)})
    if role.name == "etcd":
        volumes.append({"name": "etcd-data", "emptyDir": {}})
    if _mounts_model(topology, role):
        volumes.append({"name": "model", **_volume_source(k.model_volume)})
    if role.needs_gpu and k.rdma == "host-network":
        volumes.append({"name": "infiniband", "hostPath": {"path": "/dev/infiniband"}})
    return volumes


def _mounts_model(topology: Topology, role: Role) -> bool:
    """A checkpoint's volume: on the nodes, and on the router (its tokenizer and config)."""
    return topology.model.path is not None and (bool(role.node_names) or role.name == "router")


def _volume_source(spec: str) -> dict[str, Any]:
    kind, _, value = spec.partition(":")
    if kind == "pvc" and value:
        return {"persistentVolumeClaim": {"claimName": value}}
    if kind == "hostpath" and value.startswith("/"):
        return {"hostPath": {"path": value, "type": "Directory"}}
    raise ValueError(f"volume {spec!r} is neither pvc:CLAIM nor hostpath:/DIR")


def _mounts(topology: Topology, role: Role) -> list[dict[str, Any]]:
    mounts = [{"name": "topology", "mountPath": CONFIG_DIR + "/topology.toml",
               "subPath": "topology.toml", "readOnly": True},
              {"name": "cluster-secret", "mountPath": SECRET_DIR, "readOnly": True}]
    if role.mounts_storage:
        mounts.append({"name": "storage", "mountPath": DATA_DIR})
    if role.name == "etcd":
        mounts.append({"name": "etcd-data", "mountPath": ETCD_DIR})
    if _mounts_model(topology, role):
        mounts.append({"name": "model", "mountPath": MODEL_DIR, "readOnly": True})
    if role.needs_gpu and topology.kubernetes.rdma == "host-network":
        mounts.append({"name": "infiniband", "mountPath": "/dev/infiniband"})
    return mounts


# ---- output ----------------------------------------------------------------------------------

def to_yaml(docs: Sequence[dict[str, Any]]) -> str:
    """The manifests as one YAML stream (`---` between documents), in a fixed order; a value
    used twice (a probe handler) is written out twice, never as a YAML alias."""
    import yaml

    class Dumper(yaml.SafeDumper):
        def ignore_aliases(self, data: Any) -> bool:
            return True

    return yaml.dump_all(docs, Dumper=Dumper, sort_keys=False, default_flow_style=False,
                         width=100)


def write_manifests(docs: Sequence[dict[str, Any]], out_dir: Path) -> list[Path]:
    """One file per manifest, `NN-kind-name.yaml`, in apply order; returns the paths."""
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = []
    for index, doc in enumerate(docs):
        path = out_dir / f"{index:02d}-{doc['kind'].lower()}-{doc['metadata']['name']}.yaml"
        path.write_text(to_yaml([doc]))
        paths.append(path)
    return paths
