"""Offline validation of rendered Kubernetes manifests.

- Built-in kinds (ConfigMap, Service, StatefulSet, and every RBG role's pod template as a
  PodTemplate) against Kubernetes' own JSON schemas, bundled by `kubernetes-validate`, in its
  strict mode (unknown fields are errors).
- The RoleBasedGroup against the `openAPIV3Schema` of RBG's published CRD (vendored under
  tests/fixtures/k8s, version and source named there) with `jsonschema`, made strict the way
  the API server prunes: an object with `properties` and no `x-kubernetes-preserve-unknown-
  fields` accepts no other field (the API server would drop it silently: a typo'd key must
  fail here instead).
- Our own policy: every container has startup, readiness and liveness probes; the cluster
  secret comes from a Secret volume mounted read-only; no ConfigMap holds a key.
"""

from __future__ import annotations

import copy
import functools
import gzip
import json
import sys
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate

if sys.version_info >= (3, 11):
    import tomllib
else:  # Python 3.10: the same parser, published as `tomli`
    import tomli as tomllib

K8S_VERSION = "1.33.0"
RBG_SCHEMA = (Path(__file__).resolve().parents[1] / "fixtures" / "k8s"
              / "rbg-v1alpha2-rolebasedgroup.schema.json.gz")


class ManifestError(AssertionError):
    """A rendered manifest failed a schema or the policy; the message names where."""


def validate_all(docs: list[dict[str, Any]]) -> None:
    for doc in docs:
        if doc["kind"] == "RoleBasedGroup":
            validate_rbg(doc)
        else:
            validate_builtin(doc)
    check_policy(docs)


def validate_builtin(doc: dict[str, Any]) -> None:
    try:
        kubernetes_validate.validate(doc, K8S_VERSION, strict=True)
    except kubernetes_validate.ValidationError as exc:
        raise ManifestError(f"{doc['kind']}/{doc['metadata']['name']}: {exc}") from exc


def validate_rbg(doc: dict[str, Any]) -> None:
    errors = sorted(_rbg_validator().iter_errors(doc), key=lambda e: list(e.absolute_path))
    if errors:
        where = "/".join(str(p) for p in errors[0].absolute_path)
        raise ManifestError(f"RoleBasedGroup/{doc['metadata']['name']}: {where}: "
                            f"{errors[0].message} ({len(errors)} errors)")
    for role in doc["spec"]["roles"]:
        template = role["standalonePattern"]["template"]
        validate_builtin({"apiVersion": "v1", "kind": "PodTemplate",
                          "metadata": {"name": role["name"]}, "template": template})


@functools.lru_cache(maxsize=1)
def _rbg_validator() -> jsonschema.Draft7Validator:
    schema = json.loads(gzip.decompress(RBG_SCHEMA.read_bytes()))
    return jsonschema.Draft7Validator(strict_schema(schema))


def strict_schema(schema: Any) -> Any:
    """An openAPIV3Schema as JSON Schema: int-or-string, nullable, and no unknown fields."""
    schema = copy.deepcopy(schema)
    _strict(schema)
    return schema


def _strict(node: Any) -> None:
    if isinstance(node, list):
        for item in node:
            _strict(item)
        return
    if not isinstance(node, dict):
        return
    for value in node.values():
        _strict(value)
    if node.pop("x-kubernetes-int-or-string", False):
        node.pop("type", None)
        node["anyOf"] = [{"type": "integer"}, {"type": "string"}]
    if node.pop("nullable", False) and "type" in node:
        node["type"] = [node["type"], "null"]
    preserve = node.get("x-kubernetes-preserve-unknown-fields", False)
    if "properties" in node and "additionalProperties" not in node and not preserve:
        node["additionalProperties"] = False


def check_policy(docs: list[dict[str, Any]]) -> None:
    for doc in docs:
        if doc["kind"] == "ConfigMap" and _inline_keys(doc):
            raise ManifestError(f"ConfigMap/{doc['metadata']['name']}: holds an API key")
        for name, pod in _pod_specs(doc):
            _check_pod(name, pod)


def _inline_keys(config_map: dict[str, Any]) -> list[str]:
    """API keys written into a ConfigMap's topology (they belong in the Secret)."""
    router = tomllib.loads(config_map["data"]["topology.toml"]).get("router", {})
    keys = [router.get("api_key")] + [t.get("api_key") for t in router.get("tenant", [])]
    return [k for k in keys if k]


def _pod_specs(doc: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    if doc["kind"] == "StatefulSet":
        return [(doc["metadata"]["name"], doc["spec"]["template"]["spec"])]
    if doc["kind"] == "RoleBasedGroup":
        return [(r["name"], r["standalonePattern"]["template"]["spec"])
                for r in doc["spec"]["roles"]]
    return []


def _check_pod(name: str, pod: dict[str, Any]) -> None:
    for container in pod["containers"]:
        for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
            if probe not in container:
                raise ManifestError(f"{name}/{container['name']}: no {probe}")
    secrets = [v for v in pod.get("volumes", []) if "secret" in v]
    if not secrets:
        raise ManifestError(f"{name}: the cluster secret is not mounted from a Secret")
    for container in pod["containers"]:
        for mount in container.get("volumeMounts", []):
            if mount["name"] in {v["name"] for v in secrets} and not mount.get("readOnly"):
                raise ManifestError(f"{name}/{container['name']}: secret mounted writable")
