"""The command-line side of a topology: `--config/--node/--set`, and the flags of the node
commands, which build a one-node topology when no file is given.

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

Without `--config`, `topology_from_flags` turns the flags into a topology of one node, so
both ways reach `pdcache.config.node_setup.setup_for`. The flags of `NODE_FLAG_KEYS` (request
timeout, offload pages, scheduler limits, prefix cache, kernels) also apply with `--config`
when given: they override that node's keys, as `--set node.NAME.KEY=VALUE` would. Every other
node flag given with `--config` is refused (the topology owns it: `_refuse_owned_flags`).
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Iterable
from pathlib import Path
from typing import Any, get_args

from pdcache.config.parse import load_topology, topology_from_raw
from pdcache.config.schema import (
    ReasoningParser,
    RouterSpec,
    ToolCallParser,
    Topology,
    TopologyError,
)
from pdcache.engine.scheduler_config import SchedulerConfig
from pdcache.utils.ports import port_number

# flag dest -> the node key it sets (dotted below the node). Their flags default to None, so
# only flags given on the command line override a topology's values.
NODE_FLAG_KEYS = {
    "request_timeout": "request_timeout_s",
    "drain": "drain_s",
    "tool_call_parser": "tool_call_parser",
    "reasoning_parser": "reasoning_parser",
    "offload_staging_pages": "offload_staging_pages",
    "offload_stride_pages": "offload_stride_pages",
    "kernels": "kernels",
    "max_running": "scheduler.max_running_requests",
    "max_queued": "scheduler.max_queued_requests",
    "chunked_prefill_tokens": "scheduler.chunked_prefill_tokens",
    "decode_step_interval": "scheduler.decode_step_interval_ms",
    "compute_share": "scheduler.compute_share",
    "decode_yield_max": "scheduler.decode_yield_max_ms",
    "no_prefix_cache": "cache.prefix_cache",
    "no_pending_wait": "cache.pending_wait",
    "pending_max_ttl": "cache.pending_max_ttl_s",
    "pending_pull": "cache.pending_pull",
    "offload_pending_ttl": "offload_pending_ttl_s",
    "incremental_streaming_output": "incremental_streaming_output",
}
FLAGS_SOURCE = "<command line>"
_PROCESS_FLAGS = ("log_level", "config", "node", "topology_overrides")  # not topology keys
_FLAG_SEGMENT_BYTES = 256 << 20  # Mooncake Store segment of a flags-only node (StorageConfig's)
_DEFAULT_NAMES = {"prefill": "p0", "decode": "d0", "unified": "unified"}
_DEFAULT_PORTS = {"prefill": 0, "decode": 0, "unified": 30000}


def add_topology_arguments(parser: argparse.ArgumentParser) -> None:
    """The `--config/--node/--set` flags of the node command contract (module docstring)."""
    parser.add_argument("--config", metavar="TOPOLOGY", help="topology TOML file (see configs/)")
    parser.add_argument("--node", metavar="NAME", help="this process's [[node]] name (or router.name)")
    parser.add_argument("--set", dest="topology_overrides", action="append", default=[],
                        metavar="KEY=VALUE", help="topology override, as given to pdcache launch")


def node_from_args(args: argparse.Namespace, roles: Iterable[str]) -> tuple[Topology, Any] | None:
    """(topology, this node's NodeSpec) when started with --config, None otherwise. Raises
    TopologyError. The flags of `NODE_FLAG_KEYS` that were given override this node's keys.

    `roles` are the roles this command serves, e.g. ("prefill",) for `pdcache prefill`.
    """
    if not getattr(args, "config", None):
        return None
    overrides = list(getattr(args, "topology_overrides", ()))
    topology = load_topology(args.config, overrides)
    if not getattr(args, "node", None):
        raise TopologyError(topology.source, "", f"--node NAME is required with --config (nodes: {topology.node_names()})")
    try:
        node = topology.node(args.node)
    except KeyError:
        raise TopologyError(topology.source, "", f"--node {args.node}: no such node (nodes: {topology.node_names()})") from None
    _refuse_owned_flags(args, topology)
    roles = tuple(roles)
    if node.role not in roles:
        raise TopologyError(topology.source, f"node.{node.name}.role",
                            f"is {node.role}, but this command runs {' or '.join(roles)} nodes")
    from_flags = [f"node.{node.name}.{key}={_toml(value)}" for key, value in flag_settings(args).items()]
    if from_flags:
        topology = load_topology(args.config, overrides + from_flags)
        node = topology.node(node.name)
    return topology, node


def _refuse_owned_flags(args: argparse.Namespace, topology: Topology) -> None:
    """A flag whose setting the topology file owns, given with --config (it was ignored
    without a word: `--secret-file` left the node without its secret)."""
    owned: dict[str, Any] = getattr(args, "topology_owned_flags", {})
    given = [dest for dest, default in owned.items() if getattr(args, dest, default) != default]
    if given:
        flags = ", ".join("--" + dest.replace("_", "-") for dest in given)
        raise TopologyError(topology.source, "", f"{flags}: set by the topology file with "
                            "--config (its key, or --set KEY=VALUE), not by this flag")


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


def topology_for(args: argparse.Namespace, role: str) -> tuple[Topology, str]:
    """(topology, this node's name) of a node command: its --config file, or its flags."""
    found = node_from_args(args, (role,))
    if found is not None:
        return found[0], found[1].name
    topology = topology_from_flags(args, role)
    return topology, topology.nodes[0].name


def flag_settings(args: argparse.Namespace) -> dict[str, Any]:
    """Node keys (dotted below the node) set by the `NODE_FLAG_KEYS` flags that were given."""
    out: dict[str, Any] = {}
    for dest, key in NODE_FLAG_KEYS.items():
        value = getattr(args, dest, None)
        if dest in ("no_prefix_cache", "no_pending_wait"):
            value = False if value else None
        if value is not None:
            out[key] = value
    return out


# ---- flags without a topology file ---------------------------------------------------


def topology_from_flags(args: argparse.Namespace, role: str) -> Topology:
    """The one-node topology the flags of `pdcache serve|prefill|decode` describe (added by
    `add_node_flags(parser, role)`). Raises TopologyError naming the key a bad flag sets."""
    node: dict[str, Any] = {"name": args.name, "role": role, "host": args.host, "port": args.port}
    if role == "prefill":
        node["bootstrap_port"] = args.bootstrap_port
    if role == "decode" and args.no_offload:
        node["offload"] = False
    for key, value in flag_settings(args).items():
        _put(node, key, value)
    raw: dict[str, Any] = {
        "model": {("path" if Path(args.model).is_dir() else "preset"): args.model,
                  "dtype": args.dtype, "seed": args.seed},
        "cache": _cache_table(args, role),
        "storage": _storage_table(args),
        "node": [node],
    }
    if role != "unified":
        raw["transfer"] = {"engine": args.transfer_engine, "timeout_s": args.transfer_timeout}
        if getattr(args, "lost_peer_hold", None) is not None:
            raw["transfer"]["lost_peer_hold_s"] = args.lost_peer_hold
    if getattr(args, "secret_file", None):
        raw["security"] = {"secret_file": args.secret_file}
    return topology_from_raw(raw, FLAGS_SOURCE, standalone=True)


def _cache_table(args: argparse.Namespace, role: str) -> dict[str, Any]:
    table: dict[str, Any] = {"page_size": args.page_size, "device_pages": args.device_pages,
                             "key_scheme": args.key_scheme, "key_namespace": args.key_namespace}
    if hasattr(args, "write_policy"):
        table.update(write_policy=args.write_policy, prefetch_policy=args.prefetch_policy,
                     device_eviction=args.device_eviction, host_eviction=args.host_eviction,
                     host_mode=args.host_mode, session_idle_s=args.session_idle_s,
                     prefetch_layerwise=args.prefetch_layerwise,
                     prefetch_layers_per_read=args.prefetch_layers_per_read,
                     prefetch_restarts=args.prefetch_restarts,
                     load_copy_ahead=args.load_copy_ahead)
    host_pages = getattr(args, "host_pages", 0)
    if host_pages > 0:
        table["host_pages"] = host_pages
    elif role == "unified" and args.storage_backend == "none":
        table["host_pages"] = 0  # `--host-pages 0` without storage: no host tier at all
    return table


def _storage_table(args: argparse.Namespace) -> dict[str, Any]:
    if args.storage_backend == "none":
        return {"backend": "none"}
    table = {"backend": args.storage_backend, "path": args.storage_path,
             "capacity": str(args.storage_capacity), "metadata": args.storage_metadata,
             "write_delay_s": args.storage_write_delay,
             "eviction": args.storage_eviction,
             "session_protect_share": args.storage_session_protect_share,
             "session_protect_bytes": str(args.storage_session_protect_bytes),
             "session_idle_s": args.storage_session_idle_s,
             "mooncake": {"master": args.mooncake_master, "metadata_server": args.mooncake_metadata,
                          "global_segment_size": _FLAG_SEGMENT_BYTES}}
    if args.storage_fault_injection:
        table["fault_injection"] = args.storage_fault_injection
    return table


def _put(table: dict[str, Any], dotted: str, value: Any) -> None:
    *parents, last = dotted.split(".")
    for part in parents:
        table = table.setdefault(part, {})
    table[last] = value


def _toml(value: Any) -> str:
    """`value` as a TOML literal, for a --set override."""
    if isinstance(value, bool):
        return "true" if value else "false"
    return json.dumps(value)


def add_node_flags(parser: argparse.ArgumentParser, role: str) -> None:
    """Flags of `pdcache serve|prefill|decode` (role unified|prefill|decode) when run without a
    topology file. Choices come from the registries they name."""
    from pdcache.engine.config import DTYPES, CacheConfig

    cache = CacheConfig()
    before = set(vars(parser.parse_known_args([])[0]))
    parser.add_argument("--model", default="tiny",
                        help="preset (tiny, small, tiny-mla, small-mla) or a HF model dir")
    parser.add_argument("--dtype", default="float32",
                        **({"choices": sorted(DTYPES)} if role == "unified" else {}))
    parser.add_argument("--seed", type=int, default=0, help="seed of preset weights and sampling")
    parser.add_argument("--name", default=_DEFAULT_NAMES[role], help="this node's name in responses")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=port_number, default=_DEFAULT_PORTS[role],
                        help="HTTP port; 0 picks a free one")
    parser.add_argument("--page-size", type=int, default=cache.page_size)
    parser.add_argument("--device-pages", type=int, default=cache.num_device_pages)
    parser.add_argument("--log-level", default="info", choices=["debug", "info", "warning"])
    parser.add_argument("--secret-file", default=None, metavar="PATH",
                        help="the cluster secret ([security] secret_file): endpoints other than "
                             "/health need its node credential; required to bind 0.0.0.0")
    _add_setting_flags(parser, role)
    if role != "unified":
        _add_transfer_flags(parser, role)
    _add_cache_flags(parser, hicache=role != "decode")
    # the flags a topology file owns (all but NODE_FLAG_KEYS' and the process's own): given
    # with --config, they were silently ignored (`node_from_args` refuses them)
    defaults = vars(parser.parse_known_args([])[0])
    parser.set_defaults(topology_owned_flags={
        dest: value for dest, value in defaults.items()
        if dest not in before and dest not in NODE_FLAG_KEYS and dest not in _PROCESS_FLAGS})


def _add_setting_flags(parser: argparse.ArgumentParser, role: str) -> None:
    """The flags of NODE_FLAG_KEYS: default None, so that only given ones override a topology."""
    from pdcache.kernels.dispatch import KERNEL_BACKENDS

    sched = SchedulerConfig()
    parser.add_argument("--request-timeout", type=float, default=None,
                        help="deadline of one request in seconds (default 600)")
    parser.add_argument("--drain", type=float, default=None, metavar="S",
                        help="on SIGTERM, how long requests in flight may finish (default 30)")
    parser.add_argument("--tool-call-parser", default=None, choices=list(get_args(ToolCallParser)),
                        help="how model output becomes OpenAI tool_calls, as SGLang's flag "
                             "(default hermes: <tool_call>{json}</tool_call>)")
    parser.add_argument("--reasoning-parser", default=None,
                        choices=list(get_args(ReasoningParser)),
                        help="split a thinking model's <think>...</think> off as OpenAI "
                             "reasoning_content, as SGLang's flag (default: off)")
    parser.add_argument("--kernels", default=None, choices=["auto", *KERNEL_BACKENDS.names()],
                        help="KV kernel backend (default auto: by device)")
    parser.add_argument("--incremental-streaming-output", action="store_const", const=True,
                        default=None, help="/generate streams deltas, not SGLang's default "
                        "cumulative chunks (SGLang's flag)")
    parser.add_argument("--compute-share", default=None, metavar="PATH",
                        help="a file (on a local filesystem) every node sharing this node's "
                             "cores or GPU names too: decode steps wait while a prefill node "
                             "has work, as in one unified engine (default: off)")
    if role != "prefill":
        parser.add_argument("--decode-yield-max", type=int, default=None, metavar="MS",
                            help="the longest a decode step waits for prefill on the compute "
                                 f"share (default {sched.decode_yield_max_ms})")
    if role == "unified":
        parser.add_argument("--max-running", type=int, default=None,
                            help=f"default {sched.max_running_requests}")
        parser.add_argument("--max-queued", type=int, default=None,
                            help=f"default {sched.max_queued_requests}")
        parser.add_argument("--chunked-prefill-tokens", type=int, default=None,
                            help=f"default {sched.chunked_prefill_tokens}")
        parser.add_argument("--no-prefix-cache", action="store_true", help="disable prefix reuse")
    if role == "decode":
        parser.add_argument("--offload-stride-pages", type=int, default=None,
                            help="offload every this many completed pages of a request (default 1)")
        parser.add_argument("--offload-staging-pages", type=int, default=None,
                            help="host staging pages between device and storage (full: dropped; "
                                 "default 256)")
        parser.add_argument("--offload-pending-ttl", type=float, default=None,
                            help="seconds prefill nodes may wait for a page this node announced "
                                 "as being written (default 10)")
        parser.add_argument("--no-prefix-cache", action="store_true",
                            help="keep no finished requests' pages: prefill sends every prompt "
                                 "page (default: a next turn's prompt pages this node still "
                                 "holds are not sent again)")
        parser.add_argument("--decode-step-interval", type=int, default=None, metavar="MS",
                            help="least ms from one decode step's start to the next: less CPU "
                                 "per token for a host shared with prefill, at that TPOT "
                                 "(default 0: off)")
    if role == "prefill":
        parser.add_argument("--no-pending-wait", action="store_true",
                            help="do not wait for answer pages a decode node is still writing "
                                 "(recompute them; counted as raced)")
        parser.add_argument("--pending-max-ttl", type=float, default=None,
                            help="seconds a decode's pending-page mark lives here at most, "
                                 "whatever TTL it announced (default 30)")
        parser.add_argument("--pending-pull", choices=("auto", "never", "always"), default=None,
                            help="pull pending pages from decode's host staging: when faster "
                                 "than waiting by measured costs (auto, the default), never, "
                                 "or always; only with a cluster secret (--secret-file)")


def _add_transfer_flags(parser: argparse.ArgumentParser, role: str) -> None:
    from pdcache.transfer.engines.base import ENGINES

    parser.add_argument("--transfer-engine", default="mooncake", choices=ENGINES.names())
    parser.add_argument("--transfer-timeout", type=float, default=30.0)
    if role == "prefill":
        parser.add_argument("--bootstrap-port", type=int, default=0, help="0 picks a free one")
    if role == "decode":
        parser.add_argument("--no-offload", action="store_true",
                            help="do not write generated KV back to storage")
        parser.add_argument("--lost-peer-hold", type=float, default=None,
                            help="seconds a lost prefill's pages stay fenced at most "
                                 "(transfer.lost_peer_hold_s, default 120)")


def _add_cache_flags(parser: argparse.ArgumentParser, hicache: bool = True) -> None:
    """Storage (and, for prefill/unified, host tier) flags shared by the node commands."""
    from pdcache.engine.eviction import EVICTION_POLICIES
    from pdcache.engine.page_keys import KEY_SCHEMES
    from pdcache.offload_manager.storage import BACKENDS
    from pdcache.offload_manager.tier_settings import HOST_MODES, PREFETCH_POLICIES, WRITE_POLICIES

    group = parser.add_argument_group("cache tiers (without --config)")
    if hicache:
        group.add_argument("--host-pages", type=int, default=0,
                           help="host KV pool in pages; 0 = no host tier unless storage is set")
        group.add_argument("--write-policy", default="write_through", choices=list(WRITE_POLICIES))
        group.add_argument("--prefetch-policy", default="timeout", choices=list(PREFETCH_POLICIES))
        group.add_argument("--prefetch-restarts", type=int, default=1, metavar="N",
                           help="restart a queued request's storage prefetch (at most N times) "
                                "when the device + host match it continues shrank before its "
                                "admission, instead of recomputing the gap and all after it "
                                "(0: off)")
        group.add_argument("--prefetch-layerwise", action="store_true",
                           help="read storage prefetches layer-major and start the forward "
                                "before the last layer is in (docs/design.md §4.11)")
        group.add_argument("--prefetch-layers-per-read", type=int, default=1,
                           help="with --prefetch-layerwise: layers read per page per step "
                                "(fewer, larger reads; the first step carries the header)")
        group.add_argument("--load-copy-ahead", action="store_true",
                           help="CPU pools: copy loaded layers host → device ahead of the "
                                "forward on a thread of their own, not on the engine thread "
                                "when the forward reaches them (docs/design.md §4.11)")
        group.add_argument("--device-eviction", default="lru", choices=list(EVICTION_POLICIES),
                           help="which cached pages the device evicts first; 'session': closed "
                                "sessions first, active ones expected back last next")
        group.add_argument("--host-eviction", default="lru", choices=list(EVICTION_POLICIES))
        group.add_argument("--host-mode", default="inclusive", choices=list(HOST_MODES),
                           help="'exclusive': the host keeps what the device evicts (a victim "
                                "cache) instead of mirroring it")
        group.add_argument("--session-idle-s", type=float, default=300.0,
                           help="a session without a turn for this long is closed")
    group.add_argument("--key-scheme", default="pdcache", choices=list(KEY_SCHEMES),
                       help="how stored pages are named; 'sglang' shares pages with SGLang "
                            "servers running the pdcache storage plugin")
    group.add_argument("--key-namespace", default="",
                       help="deployment-wide key salt (the SGLang plugin's key_namespace)")
    group.add_argument("--storage-backend", default="none", choices=["none", *BACKENDS.names()])
    group.add_argument("--storage-path", default="./.pdcache/storage")
    group.add_argument("--storage-capacity", default="4GiB")
    group.add_argument("--storage-eviction", default="lru", choices=["lru", "session"],
                       help="stored pages evicted first: lru, or session (closed/idle "
                            "conversations' pages first, active ones protected; docs/design.md "
                            "§4.4)")
    group.add_argument("--storage-session-protect-share", type=float, default=0.5,
                       help="session eviction: at most this share of the capacity is protected")
    group.add_argument("--storage-session-protect-bytes", default="0",
                       help="session eviction: protected bytes per session (0: no cap)")
    group.add_argument("--storage-session-idle-s", type=float, default=300.0,
                       help="session eviction: a session without a write this long is closed")
    group.add_argument("--storage-write-delay", type=float, default=0.0,
                       help="seconds every storage write waits first: emulates a slow or "
                            "distant store (storage.write_delay_s)")
    group.add_argument("--storage-metadata", default="inproc",
                       help="'inproc' or tcp://HOST:PORT of pdcache metadata-server")
    group.add_argument("--storage-fault-injection", default="", metavar="CONTROL_FILE",
                       help="chaos/test only: absolute path of a file whose number is a delay "
                            "(s) every storage call waits (storage.fault_injection)")
    group.add_argument("--mooncake-master", default="127.0.0.1:50051")
    group.add_argument("--mooncake-metadata", default="P2PHANDSHAKE")
