"""What the Kubernetes API server would refuse in `[kubernetes]`, refused before rendering.

The offline schema check of the rendered manifests (docs/kubernetes.md) validates their shape,
not the formats the API server checks on top: object names (RFC 1123 / RFC 1035 labels and
subdomains, and the lengths the objects derived from them need), resource quantities and
resource names. `pdcache launch --render k8s` used to write manifests the cluster then
refused one by one (`name = "PD_Cache"`, `memory = "8 GB"`); each is a `TopologyError`
naming its key now. Pure functions, no state.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

from pdcache.config import Topology, TopologyError

# RFC 1123 label (namespaces, most object names) and RFC 1035 label (Services: starts with a
# letter), as the API server's validation spells them
DNS1123_LABEL = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?")
DNS1035_LABEL = re.compile(r"[a-z]([-a-z0-9]*[a-z0-9])?")
DNS1123_SUBDOMAIN = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*")
LABEL_MAX = 63
SUBDOMAIN_MAX = 253
# a StatefulSet's pods carry `controller-revision-hash: NAME-<10-char hash>` (a label value,
# at most 63 characters): the API server refuses none, the controller then creates no pod
STATEFULSET_NAME_MAX = 52
# resource.Quantity's serialised form: a decimal number and an optional suffix
QUANTITY = re.compile(r"[+]?([0-9]+(\.[0-9]*)?|\.[0-9]+)"
                      r"(Ki|Mi|Gi|Ti|Pi|Ei|m|k|M|G|T|P|E|[eE][+-]?[0-9]+)?")
# an extended resource name: an optional DNS subdomain prefix and a qualified name
RESOURCE_NAME = re.compile(r"([a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*/)?"
                           r"[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?")


def check_kubernetes_names(topology: Topology, role_names: Sequence[str]) -> None:
    """Raise TopologyError for the first `[kubernetes]` value the API server (or the
    StatefulSet controller) would refuse in the manifests of roles `role_names`."""
    k, source = topology.kubernetes, topology.source
    _check_group_name(topology, role_names)
    if not _is_label(k.namespace, DNS1123_LABEL):
        raise TopologyError(source, "kubernetes.namespace", f"{k.namespace!r} is not a "
                            f"namespace name (lowercase letters, digits and '-', at most "
                            f"{LABEL_MAX} characters)")
    if not _is_subdomain(k.secret_name):
        raise TopologyError(source, "kubernetes.secret_name", f"{k.secret_name!r} is not a "
                            "Secret name (a lowercase DNS subdomain)")
    for key in ("storage_volume", "model_volume"):
        _check_volume(topology, key, getattr(k, key))
    for key in ("cpu", "memory", "service_cpu", "service_memory"):
        value = getattr(k, key)
        if not QUANTITY.fullmatch(value):
            raise TopologyError(source, f"kubernetes.{key}", f"{value!r} is not a Kubernetes "
                                'quantity (e.g. "2", "500m", "8Gi")')
    for key in ("gpu_resource", "rdma_resource"):
        value = getattr(k, key)
        if not RESOURCE_NAME.fullmatch(value) or len(value) > SUBDOMAIN_MAX:
            raise TopologyError(source, f"kubernetes.{key}", f"{value!r} is not a resource "
                                'name (e.g. "nvidia.com/gpu")')
    _check_numbers(topology)


def _check_group_name(topology: Topology, role_names: Sequence[str]) -> None:
    """Every object is named after `[kubernetes] name`: Services `s-NAME-ROLE` (RFC 1035
    labels), StatefulSets / role pods `NAME-ROLE(-i)`, the ConfigMap `NAME-topology`."""
    name, source = topology.kubernetes.name, topology.source
    if not _is_label(name, DNS1035_LABEL):
        raise TopologyError(source, "kubernetes.name", f"{name!r} is not a valid name: "
                            "lowercase letters, digits and '-', starting with a letter and "
                            "ending with a letter or digit")
    longest = max(role_names, key=len, default="")
    room = min(LABEL_MAX - len("s--"), STATEFULSET_NAME_MAX - len("-")) - len(longest)
    if len(name) > room:
        raise TopologyError(source, "kubernetes.name", f"{name!r} is {len(name)} characters: "
                            f"at most {room} here (the objects of role '{longest}' are named "
                            f"s-{name}-{longest} and {name}-{longest}, limited to "
                            f"{LABEL_MAX} and {STATEFULSET_NAME_MAX} characters)")


def _check_volume(topology: Topology, key: str, spec: str) -> None:
    if not spec:
        return
    kind, _, value = spec.partition(":")
    if kind == "pvc" and _is_subdomain(value):
        return
    if kind == "hostpath" and value.startswith("/"):
        return
    raise TopologyError(topology.source, f"kubernetes.{key}", f"{spec!r} is neither "
                        '"pvc:CLAIM" (a claim name: a lowercase DNS subdomain) nor '
                        '"hostpath:/DIR"')


def _check_numbers(topology: Topology) -> None:
    k, source = topology.kubernetes, topology.source
    if k.gpus < 0:
        raise TopologyError(source, "kubernetes.gpus", f"{k.gpus} GPUs per pod")
    if k.startup_probe_s < 1:
        raise TopologyError(source, "kubernetes.startup_probe_s", f"{k.startup_probe_s} s: "
                            "a node needs at least a second to load its model")


def _is_label(value: str, pattern: re.Pattern[str]) -> bool:
    return len(value) <= LABEL_MAX and pattern.fullmatch(value) is not None


def _is_subdomain(value: str) -> bool:
    return len(value) <= SUBDOMAIN_MAX and DNS1123_SUBDOMAIN.fullmatch(value) is not None
