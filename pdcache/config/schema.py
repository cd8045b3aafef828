"""Topology files: one TOML file describes a whole deployment (DESIGN.md §4.6).

A topology is parsed once into frozen, validated objects (`Topology` and its sections) that the
launcher, the sglang renderer and every node process use. Errors are `TopologyError`s naming the
file, the key and what was expected; the CLI exits with code 2 on them.

Node command contract
---------------------
Every pdcache process the launcher starts reads its settings from the same topology file:

    python -m pdcache serve   --config CONFIG --node NAME [--set KEY=VALUE ...]   # role unified
    python -m pdcache prefill --config CONFIG --node NAME [--set KEY=VALUE ...]   # role prefill
    python -m pdcache decode  --config CONFIG --node NAME [--set KEY=VALUE ...]   # role decode
    python -m pdcache router  --config CONFIG --node ROUTER_NAME [--set ...]      # router.name
    python -m pdcache metadata-server --host H --port P --state-dir DIR           # 3FS metadata

A node calls `load_topology(config, overrides)` with the `--set` values it was given (the
launcher forwards its own) and then `topology.node(name)` for its own `NodeSpec` (or
`topology.router` for the router); `topology.endpoints()` gives every peer's address. A node
must bind `node.host:node.port` (HTTP, serving `GET /health` with 200 once ready) and, for a
prefill node, its bootstrap endpoint on `node.host:node.bootstrap_port`. Relative paths in the
file (storage.path, state_dir) are relative to the process's working directory, which the
launcher keeps equal to its own.

`--set` overrides any key: `model.preset=tiny`, `cache.page_size=32`,
`node.p0.port=31000` (by node name) or `node.0.port=31000` (by index). Values are TOML literals
(`true`, `3`, `"x"`, `["a", "b"]`); anything that does not parse as one is taken as a string.
"""

from __future__ import annotations

import argparse
import difflib
import re
import sys
import types
from collections.abc import Iterable, Mapping
from dataclasses import MISSING, dataclass, field, fields, is_dataclass, replace
from pathlib import Path
from typing import Any, Literal, Union, get_args, get_origin, get_type_hints

if sys.version_info >= (3, 11):
    import tomllib
else:  # Python 3.10: the same parser, published as `tomli`
    import tomli as tomllib

Role = Literal["prefill", "decode", "unified"]
PD_ROLES = ("prefill", "decode")

# Keys that exclude each other: setting one (in a node's cache table or with --set) drops the other.
_EXCLUSIVE = {"host_ratio": "host_bytes", "host_bytes": "host_ratio", "preset": "path", "path": "preset"}

_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]?i?b?)\s*$", re.IGNORECASE)
_SIZE_UNITS = {"": 1, "b": 1, "k": 10**3, "kb": 10**3, "kib": 2**10, "m": 10**6, "mb": 10**6,
               "mib": 2**20, "g": 10**9, "gb": 10**9, "gib": 2**30, "t": 10**12, "tb": 10**12,
               "tib": 2**40, "ki": 2**10, "mi": 2**20, "gi": 2**30, "ti": 2**40}
_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")
_LOCAL_ALIASES = {"localhost": "127.0.0.1"}


class TopologyError(ValueError):
    """A topology file (or a --set override) is invalid; the message names file, key, expectation."""

    exit_code = 2

    def __init__(self, source: str | Path, key: str, problem: str) -> None:
        where = f"{source}: {key}: " if key else f"{source}: "
        super().__init__(where + problem)
        self.source = str(source)
        self.key = key
        self.problem = problem


def _size(**kw: Any) -> Any:
    """A byte-size field: an integer of bytes or a string such as "4GiB" or "512MB"."""
    return field(metadata={"size": True}, **kw)


def parse_size(text: str) -> int | None:
    """Bytes in "4GiB", "512MB", "64k"; None when the text is not a size."""
    match = _SIZE_RE.match(text)
    if not match or match.group(2).lower() not in _SIZE_UNITS:
        return None
    return int(float(match.group(1)) * _SIZE_UNITS[match.group(2).lower()])


# --------------------------------------------------------------------------- sections


@dataclass(frozen=True)
class ModelSpec:
    """`[model]`: a random-initialised preset (`tiny`, `small`) or a checkpoint directory."""

    preset: str | None = None
    path: str | None = None
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    seed: int = 0
    served_name: str | None = None

    @property
    def ref(self) -> str:
        """What `pdcache serve --model` takes: the preset name or the path."""
        return self.preset if self.preset is not None else str(self.path)


@dataclass(frozen=True)
class CacheSpec:
    """`[cache]` (and per-node `[node.cache]` overrides): device/host sizing and policies."""

    page_size: int = 16
    device_pages: int = 2048
    host_ratio: float | None = None  # host pool = device pool × ratio (default 2.0)
    host_bytes: int | None = _size(default=None)
    write_policy: Literal["write_through", "write_through_selective", "write_back"] = (
        "write_through"
    )
    write_through_threshold: int = 2  # hits before backup under write_through_selective
    prefetch_policy: Literal["best_effort", "wait_complete", "timeout"] = "timeout"
    prefetch_timeout_base_s: float = 2.0
    prefetch_timeout_per_1k_tokens_s: float = 0.1
    prefetch_timeout_max_s: float = 30.0
    # How stored pages are named: "pdcache", or "sglang" to share pages with SGLang servers
    # running the pdcache storage plugin (whose `key_namespace` must equal this one).
    key_scheme: Literal["pdcache", "sglang"] = "pdcache"
    key_namespace: str = ""

    @property
    def effective_host_ratio(self) -> float:
        return 2.0 if self.host_ratio is None and self.host_bytes is None else self.host_ratio or 0.0

    def prefetch_timeout_s(self, num_tokens: int) -> float:
        """The `timeout` policy's deadline for a prefetch of `num_tokens` tokens."""
        linear = self.prefetch_timeout_base_s + self.prefetch_timeout_per_1k_tokens_s * num_tokens / 1024
        return min(self.prefetch_timeout_max_s, linear)


@dataclass(frozen=True)
class MetadataServiceSpec:
    """`[storage.metadata_service]`: the shared 3FS metadata service (global KV manager)."""

    start: bool = True  # the launcher starts it; false when it runs elsewhere already
    bind_host: str | None = None  # defaults to the host of storage.metadata
    state_dir: str = "./.pdcache/metadata"


@dataclass(frozen=True)
class MooncakeStoreSpec:
    """`[storage.mooncake]`: Mooncake Store master and client settings."""

    master: str = "127.0.0.1:50051"  # rpc host:port of mooncake_master
    metadata_server: str = "http://127.0.0.1:8080/metadata"  # or "P2PHANDSHAKE"
    start_master: bool = True
    metrics_port: int = 9003
    global_segment_size: int = _size(default=512 * 2**20)
    local_buffer_size: int = _size(default=64 * 2**20)
    protocol: Literal["tcp", "rdma"] = "tcp"
    devices: tuple[str, ...] = ()

    @property
    def master_address(self) -> tuple[str, int]:
        return _split_host_port(self.master)

    @property
    def http_metadata_address(self) -> tuple[str, int] | None:
        """(host, port) of an HTTP metadata server, or None for P2PHANDSHAKE."""
        match = re.match(r"^http://([^:/]+):(\d+)(/.*)?$", self.metadata_server)
        return (match.group(1), int(match.group(2))) if match else None


@dataclass(frozen=True)
class StorageSpec:
    """`[storage]`: the shared storage tier every prefill (and offloading decode) node uses."""

    backend: Literal["hf3fs", "mooncake", "file", "none"] = "none"
    path: str = "./.pdcache/storage"
    capacity: int = _size(default=4 * 2**30)
    io_engine: Literal["posix", "usrbio"] = "posix"
    metadata: str = "inproc"  # "inproc" or "tcp://HOST:PORT" (the shared metadata service)
    namespace: str = "default"
    metadata_service: MetadataServiceSpec = field(default_factory=MetadataServiceSpec)
    mooncake: MooncakeStoreSpec = field(default_factory=MooncakeStoreSpec)

    @property
    def enabled(self) -> bool:
        return self.backend != "none"

    @property
    def metadata_address(self) -> tuple[str, int] | None:
        """(host, port) of the metadata service, or None when metadata is in-process."""
        if self.metadata == "inproc":
            return None
        return _split_host_port(self.metadata.removeprefix("tcp://"))

    @property
    def uses_metadata_service(self) -> bool:
        return self.backend == "hf3fs" and self.metadata_address is not None


@dataclass(frozen=True)
class TransferSpec:
    """`[transfer]`: how prefill pushes KV pages into decode memory."""

    engine: Literal["mooncake", "zmq", "nixl"] = "mooncake"
    protocol: Literal["tcp", "rdma"] = "tcp"
    devices: tuple[str, ...] = ()  # RDMA NICs, e.g. ["mlx5_0", "mlx5_1"]
    timeout_s: float = 30.0  # bootstrap and per-room transfer deadline


@dataclass(frozen=True)
class RouterSpec:
    """`[router]`: the OpenAI-compatible front door; absent table = no router."""

    name: str = "router"
    host: str = "127.0.0.1"
    port: int = 8000
    prefill_policy: Literal["round_robin", "least_load", "cache_aware"] = "cache_aware"
    decode_policy: Literal["round_robin", "least_load"] = "round_robin"
    api_key: str | None = None
    request_timeout_s: float = 600.0
    connect_timeout_s: float = 5.0
    health_interval_s: float = 2.0

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"


@dataclass(frozen=True)
class LaunchSpec:
    """`[launch]`: how the launcher runs and supervises processes."""

    python: str | None = None  # interpreter for nodes; default: the launcher's own
    health_timeout_s: float = 300.0
    stop_grace_s: float = 10.0
    restart_backoff_s: float = 1.0
    restart_backoff_max_s: float = 30.0
    ssh_user: str | None = None
    ssh_options: tuple[str, ...] = ("-o", "BatchMode=yes")
    remote_workdir: str | None = None  # where the repo and config live on remote hosts
    remote_python: str = "python3"


@dataclass(frozen=True)
class NodeSpec:
    """One `[[node]]`: a prefill, decode or unified server, with its effective cache settings."""

    name: str
    role: Role
    port: int
    host: str = "127.0.0.1"
    bootstrap_port: int | None = None  # prefill only: ZMQ bootstrap endpoint
    offload: bool | None = None  # decode only: write generated KV to storage (default: on)
    devices: tuple[str, ...] | None = None  # overrides transfer.devices on this node
    cache: CacheSpec = field(default_factory=CacheSpec)  # [cache] merged with [node.cache]
    command: tuple[str, ...] | None = None  # replaces the node command ({python} {config} ...)
    extra_args: tuple[str, ...] = ()
    env: Mapping[str, str] = field(default_factory=dict)
    health: Literal["http", "tcp", "none"] = "http"

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def bootstrap_address(self) -> str | None:
        return None if self.bootstrap_port is None else f"{self.host}:{self.bootstrap_port}"


@dataclass(frozen=True)
class Endpoint:
    """Where one component listens: what the router, the nodes and the launcher connect to."""

    name: str
    role: str
    host: str
    port: int
    bootstrap_port: int | None = None

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"


@dataclass(frozen=True)
class Topology:
    """A whole deployment. Built only by `load_topology` / `parse_topology`, which validate it."""

    source: Path
    overrides: tuple[str, ...]
    model: ModelSpec
    cache: CacheSpec
    storage: StorageSpec
    transfer: TransferSpec
    router: RouterSpec | None
    launch: LaunchSpec
    nodes: tuple[NodeSpec, ...]

    def node(self, name: str) -> NodeSpec:
        for node in self.nodes:
            if node.name == name:
                return node
        raise KeyError(f"{self.source}: no node named '{name}' (nodes: {self.node_names()})")

    def node_names(self) -> str:
        return ", ".join(n.name for n in self.nodes)

    def nodes_with_role(self, role: str) -> tuple[NodeSpec, ...]:
        return tuple(n for n in self.nodes if n.role == role)

    @property
    def is_pd(self) -> bool:
        return any(n.role in PD_ROLES for n in self.nodes)

    def endpoints(self) -> dict[str, Endpoint]:
        """Name → endpoint of every node and of the router (the HTTP services)."""
        out = {n.name: Endpoint(n.name, n.role, n.host, n.port, n.bootstrap_port) for n in self.nodes}
        if self.router is not None:
            out[self.router.name] = Endpoint(self.router.name, "router", self.router.host, self.router.port)
        return out

    def hosts(self) -> tuple[str, ...]:
        """Every host that runs something, in first-seen order."""
        seen: dict[str, None] = {}
        for node in self.nodes:
            seen[node.host] = None
        if self.router is not None:
            seen[self.router.host] = None
        return tuple(seen)


# --------------------------------------------------------------------------- parsing


@dataclass
class _Ctx:
    source: Path
    set_keys: frozenset[str]

    def error(self, key: str, problem: str) -> TopologyError:
        if key in self.set_keys:
            problem += " (from --set)"
        return TopologyError(self.source, key, problem)


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
    overrides = tuple(overrides)
    set_keys = apply_overrides(raw, overrides, source)
    ctx = _Ctx(source, frozenset(set_keys))
    topology = _build_topology(raw, ctx, overrides)
    _validate(topology, ctx)
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
    if last in _EXCLUSIVE:
        table.pop(_EXCLUSIVE[last], None)
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


def _build_topology(raw: dict[str, Any], ctx: _Ctx, overrides: tuple[str, ...]) -> Topology:
    _check_unknown(raw, {"model", "cache", "storage", "transfer", "router", "launch", "node"}, "", ctx)
    if "model" not in raw:
        raise ctx.error("model", "missing required table [model] (expected preset = \"tiny\"|\"small\" or path = \"/dir\")")
    cache_raw = _table(raw, "cache", "", ctx)
    nodes_raw = raw.get("node")
    if not isinstance(nodes_raw, list) or not nodes_raw:
        raise ctx.error("node", "missing [[node]] entries (expected at least one prefill + one decode, or one unified)")
    return Topology(
        source=ctx.source,
        overrides=overrides,
        model=_build(ModelSpec, _table(raw, "model", "", ctx), "model", ctx),
        cache=_build(CacheSpec, cache_raw, "cache", ctx),
        storage=_build(StorageSpec, _table(raw, "storage", "", ctx), "storage", ctx),
        transfer=_build(TransferSpec, _table(raw, "transfer", "", ctx), "transfer", ctx),
        router=_build(RouterSpec, _table(raw, "router", "", ctx), "router", ctx) if "router" in raw else None,
        launch=_build(LaunchSpec, _table(raw, "launch", "", ctx), "launch", ctx),
        nodes=tuple(_build_node(n, i, cache_raw, ctx) for i, n in enumerate(nodes_raw)),
    )


def _table(raw: Mapping[str, Any], key: str, prefix: str, ctx: _Ctx) -> dict[str, Any]:
    value = raw.get(key, {})
    if not isinstance(value, dict):
        raise ctx.error(_join(prefix, key), f"expected a table, got {_describe(value)}")
    return value


def _build_node(node_raw: Any, index: int, cache_raw: dict[str, Any], ctx: _Ctx) -> NodeSpec:
    if not isinstance(node_raw, dict):
        raise ctx.error(f"node.{index}", f"expected a table, got {_describe(node_raw)}")
    name = node_raw.get("name")
    prefix = f"node.{name}" if isinstance(name, str) else f"node.{index}"
    node_raw = dict(node_raw)
    node_cache = _table(node_raw, "cache", prefix, ctx)
    _check_unknown(node_cache, _field_names(CacheSpec), f"{prefix}.cache", ctx)
    merged = {k: v for k, v in cache_raw.items() if _EXCLUSIVE.get(k) not in node_cache}
    node_raw["cache"] = {**merged, **node_cache}
    return _build(NodeSpec, node_raw, prefix, ctx)


def _build(cls: type, table: Mapping[str, Any], prefix: str, ctx: _Ctx) -> Any:
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


def _check_unknown(table: Mapping[str, Any], known: set[str], prefix: str, ctx: _Ctx) -> None:
    for key in table:
        if key not in known:
            close = difflib.get_close_matches(key, sorted(known), n=1, cutoff=0.6)
            hint = f"; did you mean '{close[0]}'?" if close else f"; known keys: {', '.join(sorted(known))}"
            raise ctx.error(_join(prefix, key), "unknown key" + hint)


def _coerce(tp: Any, value: Any, key: str, is_size: bool, ctx: _Ctx) -> Any:
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


def _coerce_scalar(tp: Any, origin: Any, value: Any, key: str, is_size: bool, ctx: _Ctx) -> Any:
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


def _split_host_port(text: str) -> tuple[str, int]:
    host, sep, port = text.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise ValueError(f"'{text}' is not HOST:PORT")
    return host, int(port)


# --------------------------------------------------------------------------- validation


def _validate(topology: Topology, ctx: _Ctx) -> None:
    """Cross-key checks; each raises a TopologyError naming the key and the fix."""
    _check_model(topology.model, ctx)
    _check_cache(topology.cache, "cache", ctx)
    _check_storage(topology.storage, ctx)
    _check_transfer(topology.transfer, ctx)
    _check_nodes(topology, ctx)
    _check_shape(topology, ctx)
    _check_shared_inproc_metadata(topology, ctx)
    _check_ports(topology, ctx)


def _check_model(model: ModelSpec, ctx: _Ctx) -> None:
    if (model.preset is None) == (model.path is None):
        raise ctx.error("model", 'expected exactly one of preset = "tiny"|"small" or path = "/checkpoint/dir"')


def _check_cache(cache: CacheSpec, prefix: str, ctx: _Ctx) -> None:
    for key in ("page_size", "device_pages", "write_through_threshold"):
        if getattr(cache, key) < 1:
            raise ctx.error(f"{prefix}.{key}", f"expected an integer >= 1, got {getattr(cache, key)}")
    if cache.host_ratio is not None and cache.host_bytes is not None:
        raise ctx.error(f"{prefix}.host_ratio", "give host_ratio or host_bytes, not both")
    if cache.host_ratio is not None and cache.host_ratio <= 0:
        raise ctx.error(f"{prefix}.host_ratio", f"expected a number > 0, got {cache.host_ratio}")
    for key in ("prefetch_timeout_base_s", "prefetch_timeout_per_1k_tokens_s", "prefetch_timeout_max_s"):
        if getattr(cache, key) < 0:
            raise ctx.error(f"{prefix}.{key}", f"expected a number >= 0, got {getattr(cache, key)}")


def _check_storage(storage: StorageSpec, ctx: _Ctx) -> None:
    if storage.metadata != "inproc" and not re.match(r"^tcp://[^:/\s]+:\d{1,5}$", storage.metadata):
        raise ctx.error("storage.metadata", f'expected "inproc" or "tcp://HOST:PORT", got "{storage.metadata}"')
    if storage.io_engine == "usrbio" and storage.backend != "hf3fs":
        raise ctx.error("storage.io_engine", f'"usrbio" is the 3FS client; it needs backend = "hf3fs", not "{storage.backend}"')
    if storage.capacity < 1:
        raise ctx.error("storage.capacity", "expected a size > 0")
    if storage.backend == "mooncake":
        try:
            _split_host_port(storage.mooncake.master)
        except ValueError as exc:
            raise ctx.error("storage.mooncake.master", f"expected HOST:PORT ({exc})") from exc


def _check_transfer(transfer: TransferSpec, ctx: _Ctx) -> None:
    if transfer.engine == "zmq" and transfer.protocol == "rdma":
        raise ctx.error("transfer.protocol", '"rdma" needs engine = "mooncake" or "nixl"; the zmq engine is tcp only')
    if transfer.timeout_s <= 0:
        raise ctx.error("transfer.timeout_s", f"expected a number > 0, got {transfer.timeout_s}")


def _check_nodes(topology: Topology, ctx: _Ctx) -> None:
    seen: set[str] = set()
    names = {topology.router.name} if topology.router else set()
    for node in topology.nodes:
        key = f"node.{node.name}"
        if not _NAME_RE.match(node.name):
            raise ctx.error(f"{key}.name", "expected letters, digits, '_', '-' or '.'")
        if node.name in seen or node.name in names:
            raise ctx.error(f"{key}.name", f"duplicate name '{node.name}' (node and router names must be unique)")
        seen.add(node.name)
        _check_node_role_keys(node, key, ctx)
        _check_cache(node.cache, f"{key}.cache", ctx)
        _check_node_keys(node, topology.cache, key, ctx)
        _check_node_offload(node, topology.storage, key, ctx)


def _check_node_role_keys(node: NodeSpec, key: str, ctx: _Ctx) -> None:
    if node.role == "prefill" and node.bootstrap_port is None:
        raise ctx.error(f"{key}.bootstrap_port", "missing required key for role prefill (expected an integer port)")
    if node.role != "prefill" and node.bootstrap_port is not None:
        raise ctx.error(f"{key}.bootstrap_port", f"only prefill nodes have a bootstrap port (role is {node.role})")
    if node.role != "decode" and node.offload is not None:
        raise ctx.error(f"{key}.offload", f"only decode nodes offload (role is {node.role})")
    if node.command is not None and not node.command:
        raise ctx.error(f"{key}.command", "expected a non-empty array of strings")
    if not node.host or any(c.isspace() for c in node.host):
        raise ctx.error(f"{key}.host", f'expected a host name or address, got "{node.host}"')


def _check_node_keys(node: NodeSpec, cache: CacheSpec, key: str, ctx: _Ctx) -> None:
    """Nodes naming pages differently would never find each other's pages in storage."""
    for name in ("key_scheme", "key_namespace"):
        if getattr(node.cache, name) != getattr(cache, name):
            raise ctx.error(f"{key}.cache.{name}", f"must equal cache.{name} "
                            f"({getattr(cache, name)!r}): every node shares one key scheme")


def _check_node_offload(node: NodeSpec, storage: StorageSpec, key: str, ctx: _Ctx) -> None:
    if node.role == "decode" and node.offload and not storage.enabled:
        raise ctx.error(
            f"{key}.offload",
            'decode offload needs storage: set storage.backend = "hf3fs"|"mooncake"|"file", or offload = false',
        )


def _check_shape(topology: Topology, ctx: _Ctx) -> None:
    roles = {n.role for n in topology.nodes}
    if "unified" in roles and roles & set(PD_ROLES):
        raise ctx.error("node", "unified nodes cannot be mixed with prefill/decode nodes in one topology")
    if roles & set(PD_ROLES) and not {"prefill", "decode"} <= roles:
        missing = "decode" if "prefill" in roles else "prefill"
        raise ctx.error("node", f"a PD topology needs at least one prefill and one decode node; no {missing} node")
    if topology.is_pd and topology.router is None:
        raise ctx.error("router", "missing [router] table: a PD topology needs a router in front of its nodes")


def _check_shared_inproc_metadata(topology: Topology, ctx: _Ctx) -> None:
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


def _check_ports(topology: Topology, ctx: _Ctx) -> None:
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
        host, port = storage.metadata_address  # type: ignore[misc]
        ports.append((host, port, "storage.metadata"))
    if storage.backend == "mooncake" and storage.mooncake.start_master:
        ports.extend(_mooncake_ports(storage.mooncake))
    return ports


def _mooncake_ports(spec: MooncakeStoreSpec) -> list[tuple[str, int, str]]:
    host, port = spec.master_address
    ports = [(host, port, "storage.mooncake.master"), (host, spec.metrics_port, "storage.mooncake.metrics_port")]
    http = spec.http_metadata_address
    if http is not None:
        ports.append((http[0], http[1], "storage.mooncake.metadata_server"))
    return ports


# --------------------------------------------------------------------------- node side


def add_topology_arguments(parser: argparse.ArgumentParser) -> None:
    """The `--config/--node/--set` flags of the node command contract (module docstring)."""
    parser.add_argument("--config", metavar="TOPOLOGY", help="topology TOML file (see configs/)")
    parser.add_argument("--node", metavar="NAME", help="this process's [[node]] name (or router.name)")
    parser.add_argument("--set", dest="topology_overrides", action="append", default=[],
                        metavar="KEY=VALUE", help="topology override, as given to pdcache launch")


def node_from_args(args: argparse.Namespace, roles: Iterable[str]) -> tuple[Topology, NodeSpec] | None:
    """(topology, this node) when started with --config, None otherwise. Raises TopologyError.

    `roles` are the roles this command serves, e.g. ("prefill",) for `pdcache prefill`.
    """
    if not getattr(args, "config", None):
        return None
    topology = load_topology(args.config, getattr(args, "topology_overrides", ()))
    if not getattr(args, "node", None):
        raise TopologyError(topology.source, "", f"--node NAME is required with --config (nodes: {topology.node_names()})")
    try:
        node = topology.node(args.node)
    except KeyError:
        raise TopologyError(topology.source, "", f"--node {args.node}: no such node (nodes: {topology.node_names()})") from None
    roles = tuple(roles)
    if node.role not in roles:
        raise TopologyError(topology.source, f"node.{node.name}.role",
                            f"is {node.role}, but this command runs {' or '.join(roles)} nodes")
    return topology, node


def router_from_args(args: argparse.Namespace) -> tuple[Topology, RouterSpec] | None:
    """(topology, its router) when `pdcache router` was started with --config. Raises TopologyError."""
    if not getattr(args, "config", None):
        return None
    topology = load_topology(args.config, getattr(args, "topology_overrides", ()))
    if topology.router is None:
        raise TopologyError(topology.source, "router", "missing [router] table")
    if getattr(args, "node", None) not in (None, topology.router.name):
        raise TopologyError(topology.source, "router.name",
                            f"is '{topology.router.name}', not '{args.node}'")
    return topology, topology.router


def finalize(topology: Topology) -> Topology:
    """The topology with role defaults filled in (what `load_topology` returns)."""
    return replace(topology, nodes=resolve_nodes(topology.nodes, topology.storage))
