"""Reading a topology: TOML text → `--set` overrides → typed, frozen `Topology`.

`--set` overrides any key: `model.preset=tiny`, `cache.page_size=32`,
`node.p0.port=31000` (by node name) or `node.0.port=31000` (by index). Values are TOML literals
(`true`, `3`, `"x"`, `["a", "b"]`); anything that does not parse as one is taken as a string.
Each section is built from its dataclass in `pdcache.config.schema`: unknown keys, missing keys
and wrong types are `TopologyError`s naming the key (with a close match when there is one).
"""

from __future__ import annotations

import dataclasses
import difflib
import sys
import types
from collections.abc import Iterable, Mapping
from dataclasses import MISSING, fields, is_dataclass
from pathlib import Path
from typing import Any, Literal, Union, get_args, get_origin, get_type_hints

from pdcache.config.schema import (
    CacheSpec,
    ErrorContext,
    KubernetesSpec,
    LaunchSpec,
    ModelSpec,
    NodeSpec,
    RouterSpec,
    SecuritySpec,
    StorageSpec,
    TenantSpec,
    Topology,
    TopologyError,
    TransferSpec,
    parse_size,
)
from pdcache.config.validate import finalize, validate
from pdcache.engine.scheduler_config import SchedulerConfig

if sys.version_info >= (3, 11):
    import tomllib
else:  # Python 3.10: the same parser, published as `tomli`
    import tomli as tomllib

# Keys that exclude each other: setting one (in a node's table or with --set) drops the others.
_EXCLUSIVE = {"host_ratio": ("host_bytes", "host_pages"), "host_bytes": ("host_ratio", "host_pages"),
              "host_pages": ("host_ratio", "host_bytes"), "preset": ("path",), "path": ("preset",)}
# Tables set once for the topology and overridden per node ([cache] + [node.cache], ...).
_NODE_MERGED = {"cache": CacheSpec, "scheduler": SchedulerConfig}


def load_topology(path: str | Path, overrides: Iterable[str] = ()) -> Topology:
    """Read, override and validate a topology file. Raises TopologyError."""
    source = Path(path)
    try:
        text = source.read_text()
    except OSError as exc:
        raise TopologyError(source, "", f"cannot read the file ({exc.strerror or exc})") from exc
    return parse_topology(text, source, overrides)


def parse_topology(text: str, source: str | Path = "<string>", overrides: Iterable[str] = ()) -> Topology:
    """Parse TOML text into a validated Topology; `source` names it in errors."""
    source = Path(source)
    try:
        raw = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise TopologyError(source, "", f"not valid TOML ({exc})") from exc
    return topology_from_raw(raw, source, overrides)


def topology_from_raw(raw: dict[str, Any], source: str | Path, overrides: Iterable[str] = (),
                      standalone: bool = False) -> Topology:
    """A validated Topology from a parsed TOML tree (changed in place by `overrides`).

    `standalone`: one node run on its own from command-line flags; the checks that concern a
    whole deployment (router, both PD roles, fixed ports) are skipped."""
    source = Path(source)
    overrides = tuple(overrides)
    set_keys = apply_overrides(raw, overrides, source)
    ctx = ErrorContext(source, frozenset(set_keys))
    topology = _build_topology(raw, ctx, overrides)
    validate(topology, ctx, standalone=standalone)
    return finalize(topology)


def parse_override_value(text: str) -> Any:
    """A --set value as a TOML literal (`3`, `true`, `"x"`, `[1, 2]`), else the string itself."""
    try:
        return tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        return text


def apply_overrides(raw: dict[str, Any], overrides: Iterable[str], source: Path) -> list[str]:
    """Apply `KEY=VALUE` overrides to the raw TOML tree in place; returns the canonical keys set."""
    keys = []
    for item in overrides:
        dotted, sep, value = item.partition("=")
        if not sep or not dotted.strip():
            raise TopologyError(source, item, "a --set override must look like KEY=VALUE")
        keys.append(_set_path(raw, dotted.strip().split("."), parse_override_value(value), source))
    return keys


def _set_path(raw: dict[str, Any], parts: list[str], value: Any, source: Path) -> str:
    table, canonical = raw, []
    if parts[0] == "node" and len(parts) >= 3:
        table = _override_node(raw, parts[1], ".".join(parts), source)
        canonical = ["node", str(table.get("name", parts[1]))]
        parts = parts[2:]
    for part in parts[:-1]:
        child = table.setdefault(part, {})
        if not isinstance(child, dict):
            raise TopologyError(source, ".".join(canonical + [part]), "is not a table; cannot set a key inside it")
        table, canonical = child, canonical + [part]
    last = parts[-1]
    table[last] = value
    for other in _EXCLUSIVE.get(last, ()):
        table.pop(other, None)
    return ".".join(canonical + [last])


def _override_node(raw: dict[str, Any], selector: str, key: str, source: Path) -> dict[str, Any]:
    nodes = raw.get("node", [])
    if not isinstance(nodes, list):
        raise TopologyError(source, "node", "must be an array of tables ([[node]])")
    for node in nodes:
        if isinstance(node, dict) and node.get("name") == selector:
            return node
    if selector.isdigit() and int(selector) < len(nodes):
        return nodes[int(selector)]
    names = ", ".join(str(n.get("name")) for n in nodes if isinstance(n, dict))
    raise TopologyError(source, key, f"no node named or numbered '{selector}' (nodes: {names})")


def _build_topology(raw: dict[str, Any], ctx: ErrorContext, overrides: tuple[str, ...]) -> Topology:
    _check_unknown(raw, {"model", "cache", "scheduler", "storage", "transfer", "router", "launch",
                         "node", "security", "kubernetes"}, "", ctx)
    if "model" not in raw:
        raise ctx.error("model", "missing required table [model] (expected preset = \"tiny\"|\"small\" or path = \"/dir\")")
    shared = {key: _table(raw, key, "", ctx) for key in _NODE_MERGED}
    nodes_raw = raw.get("node")
    if not isinstance(nodes_raw, list) or not nodes_raw:
        raise ctx.error("node", "missing [[node]] entries (expected at least one prefill + one decode, or one unified)")
    return Topology(
        source=ctx.source,
        overrides=overrides,
        model=_build(ModelSpec, _table(raw, "model", "", ctx), "model", ctx),
        cache=_build(CacheSpec, shared["cache"], "cache", ctx),
        scheduler=_build(SchedulerConfig, shared["scheduler"], "scheduler", ctx),
        storage=_build(StorageSpec, _table(raw, "storage", "", ctx), "storage", ctx),
        transfer=_build(TransferSpec, _table(raw, "transfer", "", ctx), "transfer", ctx),
        router=_build_router(_table(raw, "router", "", ctx), ctx) if "router" in raw else None,
        launch=_build(LaunchSpec, _table(raw, "launch", "", ctx), "launch", ctx),
        nodes=tuple(_build_node(n, i, shared, ctx) for i, n in enumerate(nodes_raw)),
        security=_build(SecuritySpec, _table(raw, "security", "", ctx), "security", ctx),
        kubernetes=_build(KubernetesSpec, _table(raw, "kubernetes", "", ctx), "kubernetes", ctx),
    )


def _build_router(table: dict[str, Any], ctx: ErrorContext) -> RouterSpec:
    """`[router]` with its `[[router.tenant]]` array of tables."""
    table = dict(table)
    tenants_raw = table.pop("tenant", [])
    if not isinstance(tenants_raw, list):
        raise ctx.error("router.tenant", "must be an array of tables ([[router.tenant]])")
    spec = _build(RouterSpec, table, "router", ctx)
    tenants = tuple(_build_tenant(t, i, ctx) for i, t in enumerate(tenants_raw))
    return dataclasses.replace(spec, tenant=tenants)


def _build_tenant(raw: Any, index: int, ctx: ErrorContext) -> TenantSpec:
    """One tenant. `api_key_env` is only named here: the router process reads it
    (`config.security.tenant_api_key`), so nodes need not hold tenants' keys."""
    if not isinstance(raw, dict):
        raise ctx.error(f"router.tenant.{index}", f"expected a table, got {_describe(raw)}")
    name = raw.get("name")
    prefix = f"router.tenant.{name}" if isinstance(name, str) else f"router.tenant.{index}"
    tenant = _build(TenantSpec, raw, prefix, ctx)
    if (tenant.api_key is None) == (tenant.api_key_env is None):
        raise ctx.error(prefix, "expected exactly one of api_key or api_key_env")
    return tenant


def _table(raw: Mapping[str, Any], key: str, prefix: str, ctx: ErrorContext) -> dict[str, Any]:
    value = raw.get(key, {})
    if not isinstance(value, dict):
        raise ctx.error(_join(prefix, key), f"expected a table, got {_describe(value)}")
    return value


def _build_node(node_raw: Any, index: int, shared: Mapping[str, dict[str, Any]],
                ctx: ErrorContext) -> NodeSpec:
    if not isinstance(node_raw, dict):
        raise ctx.error(f"node.{index}", f"expected a table, got {_describe(node_raw)}")
    name = node_raw.get("name")
    prefix = f"node.{name}" if isinstance(name, str) else f"node.{index}"
    node_raw = dict(node_raw)
    for key, cls in _NODE_MERGED.items():
        own = _table(node_raw, key, prefix, ctx)
        _check_unknown(own, _field_names(cls), f"{prefix}.{key}", ctx)
        dropped = {other for k in own for other in _EXCLUSIVE.get(k, ())}
        node_raw[key] = {**{k: v for k, v in shared[key].items() if k not in dropped}, **own}
    return _build(NodeSpec, node_raw, prefix, ctx)


def _build(cls: type, table: Mapping[str, Any], prefix: str, ctx: ErrorContext) -> Any:
    """Build dataclass `cls` from `table`, checking unknown keys, missing keys and types."""
    _check_unknown(table, _field_names(cls), prefix, ctx)
    hints = get_type_hints(cls)
    kwargs = {}
    for f in fields(cls):
        key = _join(prefix, f.name)
        if f.name in table:
            kwargs[f.name] = _coerce(hints[f.name], table[f.name], key, bool(f.metadata.get("size")), ctx)
        elif f.default is MISSING and f.default_factory is MISSING:
            raise ctx.error(key, f"missing required key (expected {_expected(hints[f.name], False)})")
    return cls(**kwargs)


def _field_names(cls: type) -> set[str]:
    return {f.name for f in fields(cls)}


def _check_unknown(table: Mapping[str, Any], known: set[str], prefix: str, ctx: ErrorContext) -> None:
    for key in table:
        if key not in known:
            close = difflib.get_close_matches(key, sorted(known), n=1, cutoff=0.6)
            hint = f"; did you mean '{close[0]}'?" if close else f"; known keys: {', '.join(sorted(known))}"
            raise ctx.error(_join(prefix, key), "unknown key" + hint)


def _coerce(tp: Any, value: Any, key: str, is_size: bool, ctx: ErrorContext) -> Any:
    origin, args = get_origin(tp), get_args(tp)
    if origin in (Union, types.UnionType):
        inner = [a for a in args if a is not type(None)]
        return _coerce(inner[0], value, key, is_size, ctx)
    if origin is Literal:
        if isinstance(value, str) and value in args:
            return value
        raise ctx.error(key, f"unknown value {_describe(value)}; expected one of: {', '.join(args)}")
    if is_dataclass(tp):
        if not isinstance(value, dict):
            raise ctx.error(key, f"expected a table, got {_describe(value)}")
        return _build(tp, value, key, ctx)
    return _coerce_scalar(tp, origin, value, key, is_size, ctx)


def _coerce_scalar(tp: Any, origin: Any, value: Any, key: str, is_size: bool, ctx: ErrorContext) -> Any:
    bad = ctx.error(key, f"expected {_expected(tp, is_size)}, got {_describe(value)}")
    if origin is tuple:
        if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
            raise bad
        return tuple(value)
    if origin in (Mapping, dict):
        if not isinstance(value, dict) or not all(isinstance(v, str) for v in value.values()):
            raise bad
        return dict(value)
    if tp is bool:
        if not isinstance(value, bool):
            raise bad
        return value
    if tp is int:
        return _coerce_int(value, is_size, bad)
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise bad
        return float(value)
    if tp is str and isinstance(value, str):
        return value
    raise bad


def _coerce_int(value: Any, is_size: bool, bad: TopologyError) -> int:
    if is_size and isinstance(value, str):
        parsed = parse_size(value)
        if parsed is not None:
            return parsed
    if isinstance(value, bool) or not isinstance(value, int):
        raise bad
    return value


def _expected(tp: Any, is_size: bool) -> str:
    origin, args = get_origin(tp), get_args(tp)
    if origin in (Union, types.UnionType):
        return _expected(next(a for a in args if a is not type(None)), is_size)
    if origin is Literal:
        return "one of: " + ", ".join(args)
    if origin is tuple:
        return "an array of strings"
    if origin in (Mapping, dict):
        return "a table of strings"
    if is_size:
        return 'a size (bytes as an integer, or a string such as "4GiB")'
    names = {bool: "true or false", int: "an integer", float: "a number", str: "a string"}
    return names.get(tp, "a table")


def _describe(value: Any) -> str:
    kinds = {bool: "boolean", int: "integer", float: "number", str: "string", list: "array", dict: "table"}
    kind = kinds.get(type(value), type(value).__name__)
    shown = f'"{value}"' if isinstance(value, str) else repr(value)
    return f"{kind} {shown}" if not isinstance(value, dict | list) else kind


def _join(prefix: str, key: str) -> str:
    return f"{prefix}.{key}" if prefix else key
