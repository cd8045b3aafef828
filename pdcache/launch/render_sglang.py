"""Render a topology as the equivalent SGLang deployment: one bash script.

The SGLang servers keep their KV pages in pdcache's storage through the pdcache HiCache plugin
(`pdcache.integrations.sglang`, loaded by `--hicache-storage-backend dynamic`), configured from
the topology's `[storage]` table with the same mapping pdcache nodes use
(`storage_keys_from_spec`), so SGLang and pdcache nodes open the same storage. No storage JSON
files and no SGLANG_HICACHE_* variables are needed: the plugin runs pdcache's own hf3fs, file
and Mooncake Store clients; the shared metadata service is `pdcache metadata-server`.

Every flag below is one SGLang really has; where they were checked:
- server flags: sgl-project/sglang `python/sglang/srt/server_args.py` (`--model-path`, `--host`,
  `--port`, `--dtype`, `--random-seed`, `--page-size`, `--max-total-tokens`, `--api-key`,
  `--enable-cache-report`, `--enable-metrics`, `--enable-hierarchical-cache`, `--hicache-ratio`,
  `--hicache-size` (GB), `--hicache-write-policy`, `--hicache-mem-layout`,
  `--hicache-storage-backend` (choices include `dynamic`), `--hicache-storage-prefetch-policy`,
  `--hicache-storage-backend-extra-config` (inline JSON; decode offload parses it too),
  `--disaggregation-mode`, `--disaggregation-transfer-backend`,
  `--disaggregation-bootstrap-port`, `--disaggregation-ib-device`,
  `--disaggregation-decode-enable-offload-kvcache` (needs `--hicache-storage-backend`)); the
  flags and keys pdcache relies on are listed in docs/sglang.md.
- dynamic backend keys (`StorageBackendFactory._create_dynamic_backend`): backend_name,
  module_path, class_name, interface_v1; the rest of the object is the plugin's
  (`PluginSettings.from_extra_config`) and HiCache's prefetch keys (docs/sglang.md, "Extra-config keys").
- router flags: `sgl-router/py_src/sglang_router/router_args.py` (`--pd-disaggregation`,
  `--prefill URL BOOTSTRAP_PORT`, `--decode URL`, `--worker-urls`, `--policy`,
  `--prefill-policy`, `--decode-policy` with choices random|round_robin|cache_aware|power_of_two,
  `--api-key`, `--request-timeout-secs`, `--host`, `--port`).
- Mooncake transfer over TCP instead of RDMA: `MC_FORCE_TCP=1` (Mooncake TransferEngine env).
- `pdcache metadata-server` and `mooncake_master` flags: pdcache's own CLI and the launcher's.
The output is deterministic (golden-file tested) and uses only paths given in the topology.
"""

from __future__ import annotations

import json
import math
import re
import shlex
import textwrap
from dataclasses import dataclass
from typing import Any

from pdcache.config import CacheSpec, NodeSpec, Topology
from pdcache.launch.launcher import etcd_specs, metadata_server_args, mooncake_master_argv
from pdcache.offload_manager.storage.config import storage_keys_from_spec

SERVER = ("python3", "-m", "sglang.launch_server")
ROUTER = ("python3", "-m", "sglang_router.launch_router")
METADATA_SERVER = ("pdcache", "metadata-server")
# SGLang's router has no least-load policy; power_of_two picks the less loaded of two workers.
ROUTER_POLICY = {"round_robin": "round_robin", "cache_aware": "cache_aware", "least_load": "power_of_two"}
# The plugin SGLang loads (pdcache.integrations.sglang.MODULE_PATH / CLASS_NAME; not imported
# here: the plugin module needs torch, the renderer does not).
PLUGIN_MODULE = "pdcache.integrations.sglang"
PLUGIN_CLASS = "PdcacheHiCacheStorage"
# Shell variables the script defines; inside arguments they are expanded, everything else is
# quoted literally.
MODEL_NAME_VAR = "$PDCACHE_MODEL_NAME"
_SHELL_VARS = re.compile(r"(\$MODEL_PATH|\$PDCACHE_MODEL_NAME)")
# pdcache's name for the weights at MODEL_PATH in its KV fingerprint (the function pdcache nodes
# use), computed on the host that runs the command.
_MODEL_IDENTITY_PY = ("import sys; from pdcache.offload_manager.builder import model_identity; "
                      "print(model_identity(sys.argv[1], int(sys.argv[2])))")

# Every flag the renderer may emit, per program, as checked in the sources named above.
KNOWN_FLAGS = {
    "sglang.launch_server": frozenset({
        "--model-path", "--host", "--port", "--dtype", "--random-seed", "--page-size",
        "--max-total-tokens", "--served-model-name", "--api-key", "--enable-cache-report",
        "--enable-metrics", "--enable-hierarchical-cache", "--hicache-ratio", "--hicache-size",
        "--hicache-write-policy", "--hicache-mem-layout", "--hicache-storage-backend",
        "--hicache-storage-prefetch-policy", "--hicache-storage-backend-extra-config",
        "--disaggregation-mode", "--disaggregation-transfer-backend",
        "--disaggregation-bootstrap-port", "--disaggregation-ib-device",
        "--disaggregation-decode-enable-offload-kvcache",
    }),
    "sglang_router.launch_router": frozenset({
        "--host", "--port", "--pd-disaggregation", "--prefill", "--decode", "--worker-urls",
        "--policy", "--prefill-policy", "--decode-policy", "--request-timeout-secs", "--api-key",
    }),
    "metadata-server": frozenset({"--host", "--port", "--state-dir", "--eviction",  # pdcache's
                                  "--session-protect-share", "--session-protect-bytes",
                                  "--session-idle-s", "--store", "--etcd-endpoints",
                                  "--etcd-prefix", "--lease-ttl", "--advertise", "--secret-file"}),
    # etcd 3.4+ (`etcd --help`; the members of [storage.etcd], etcd_cluster.member_argv)
    "etcd": frozenset({
        "--name", "--data-dir", "--listen-client-urls", "--advertise-client-urls",
        "--listen-peer-urls", "--initial-advertise-peer-urls", "--initial-cluster",
        "--initial-cluster-state", "--initial-cluster-token", "--heartbeat-interval",
        "--election-timeout", "--log-level", "--auto-compaction-mode",
        "--auto-compaction-retention",
    }),
    "mooncake_master": frozenset({
        "--rpc_address", "--rpc_port", "--metrics_host", "--metrics_port",
        "--enable_http_metadata_server", "--http_metadata_server_host", "--http_metadata_server_port",
        "--enable_ha", "--ha_backend_type", "--etcd_endpoints", "--enable_oplog", "--cluster_id",
    }),
}


@dataclass(frozen=True)
class Command:
    """One process of the rendered deployment: program, its flags, extra environment."""

    title: str
    host: str
    program: tuple[str, ...]
    args: tuple[str, ...]
    env: tuple[tuple[str, str], ...] = ()

    def render(self) -> str:
        head = [f"{k}={_quote(v)}" for k, v in self.env] + [_quote(a) for a in self.program]
        body = _flag_lines(self.args)
        lines = [f"# --- {self.title} (on {self.host})", " ".join(head) + (" \\" if body else " &")]
        lines += [f"    {line} \\" for line in body[:-1]] + ([f"    {body[-1]} &"] if body else [])
        return "\n".join(lines)


def _flag_lines(args: tuple[str, ...]) -> list[str]:
    """One line per flag with its values (`--prefill URL PORT` stays together)."""
    lines: list[list[str]] = []
    for arg in args:
        if arg.startswith("--") or not lines:
            lines.append([arg])
        else:
            lines[-1].append(arg)
    return [" ".join(_quote(a) for a in line) for line in lines]


def _quote(text: str) -> str:
    """Shell-quote literally, except the script's own variables, which expand ("$VAR")."""
    parts = [p for p in _SHELL_VARS.split(text) if p]
    return "".join(f'"{p}"' if _SHELL_VARS.fullmatch(p) else shlex.quote(p) for p in parts) or "''"


# --------------------------------------------------------------------------- the script


def render_sglang(topology: Topology) -> str:
    """The whole deployment as a bash script: notes, variables, one command per process."""
    parts = [_header(topology), *(cmd.render() for cmd in sglang_commands(topology)), "wait"]
    return "\n\n".join(parts) + "\n"


def _header(topology: Topology) -> str:
    lines = [
        "#!/usr/bin/env bash",
        f"# SGLang deployment equivalent to the pdcache topology {topology.source.name}",
        "# (rendered by `pdcache launch CONFIG --render sglang`). Run each command on the host",
        "# named above it. SGLang keeps KV pages in pdcache storage through the pdcache plugin:",
        "# every host needs `pip install sglang==0.5.23 pdcache` (see docs/sglang.md).",
    ]
    if topology.overrides:
        lines.append("# overrides: " + " ".join(f"--set {o}" for o in topology.overrides))
    for note in _notes(topology):
        lines += textwrap.wrap(note, 96, initial_indent="# NOTE: ", subsequent_indent="#       ")
    lines += ["set -euo pipefail", _model_line(topology)]
    if topology.storage.enabled:
        lines += _model_name_lines(topology)
    return "\n".join(lines)


def _model_line(topology: Topology) -> str:
    if topology.model.path is not None:
        return f'MODEL_PATH="${{MODEL_PATH:-{topology.model.path}}}"'
    return (f'MODEL_PATH="${{MODEL_PATH:?preset {topology.model.preset!r} exists only in pdcache;'
            ' set MODEL_PATH to a Llama-family checkpoint}"')


def _model_name_lines(topology: Topology) -> list[str]:
    """PDCACHE_MODEL_NAME: the plugin's `model_name`, i.e. the model name pdcache nodes serving
    the weights at MODEL_PATH put in their KV fingerprint, so both share pages."""
    command = f"python3 -c {shlex.quote(_MODEL_IDENTITY_PY)} \"$MODEL_PATH\" {topology.model.seed}"
    return [
        "# The model name in pdcache's KV fingerprint for the weights at MODEL_PATH (what pdcache",
        "# nodes serving that checkpoint use): pages are shared only where it is equal.",
        f'PDCACHE_MODEL_NAME="${{PDCACHE_MODEL_NAME:-$({command})}}"',
    ]


def _notes(topology: Topology) -> list[str]:
    notes, transfer = [], topology.transfer
    if topology.model.preset is not None:
        notes.append(f"model.preset = {topology.model.preset!r} has random weights in pdcache; SGLang needs"
                     " a checkpoint: MODEL_PATH. Its pages are not shared with pdcache nodes running"
                     " the preset (other weights, other model name).")
    if topology.is_pd and transfer.engine == "zmq":
        notes.append("transfer.engine = \"zmq\" has no SGLang equivalent; rendered with mooncake.")
    if any(n.cache.write_policy == "write_through_selective" and n.cache.write_through_threshold != 2
           for n in topology.nodes):
        notes.append("SGLang fixes the write_through_selective threshold at 2 hits; ours differs.")
    return notes


# --------------------------------------------------------------------------- commands


def sglang_commands(topology: Topology) -> list[Command]:
    """Services, then servers, then the router: the same order pdcache launch uses."""
    commands = _service_commands(topology)
    commands += [_server_command(topology, node) for node in topology.nodes]
    if topology.router is not None:
        commands.append(_router_command(topology))
    return commands


def _service_commands(topology: Topology) -> list[Command]:
    storage, out = topology.storage, []
    if storage.uses_etcd and storage.etcd.start:
        for spec in etcd_specs(topology):
            out.append(Command(f"etcd member {spec.name}", spec.host, spec.argv[:1], spec.argv[1:]))
    if storage.uses_metadata_service and storage.metadata_service.start:
        replicas = storage.metadata_addresses
        for index, (host, port) in enumerate(replicas):
            what = "pdcache metadata service" + (f" replica {index}" if len(replicas) > 1 else "")
            out.append(Command(what, host, METADATA_SERVER, metadata_server_args(topology, host, port)))
    if storage.backend == "mooncake" and storage.mooncake.start_master:
        masters = storage.mooncake.master_addresses
        for index, (host, _) in enumerate(masters):
            argv = mooncake_master_argv(topology, index=index)
            what = "Mooncake Store master" + (f" {index}" if len(masters) > 1 else "")
            out.append(Command(what, host, argv[:1], argv[1:]))
    return out


def _server_command(topology: Topology, node: NodeSpec) -> Command:
    args = ["--model-path", "$MODEL_PATH", "--host", node.host, "--port", str(node.port),
            *_model_args(topology, node.cache), *_role_args(topology, node)]
    if topology.router is not None and topology.router.api_key:
        args += ["--api-key", topology.router.api_key]
    return Command(f"{node.role} server {node.name}", node.host,
                   (*node.launch_prefix, *SERVER), tuple(args), _server_env(node, topology))


def _model_args(topology: Topology, cache: CacheSpec) -> list[str]:
    model = topology.model
    args = ["--dtype", model.dtype, "--random-seed", str(model.seed), "--page-size", str(cache.page_size),
            "--max-total-tokens", str(cache.device_pages * cache.page_size)]
    if model.served_name:
        args += ["--served-model-name", model.served_name]
    return args + ["--enable-cache-report", "--enable-metrics"]


def _role_args(topology: Topology, node: NodeSpec) -> list[str]:
    if node.role == "prefill":
        return ["--disaggregation-mode", "prefill", *_transfer_args(topology, node),
                "--disaggregation-bootstrap-port", str(node.bootstrap_port),
                *_hicache_args(topology, node)]
    if node.role == "decode":
        args = ["--disaggregation-mode", "decode", *_transfer_args(topology, node)]
        if node.offload and topology.storage.enabled:
            # Decode needs no --enable-hierarchical-cache: the offload manager has its own host
            # pool. It never prefetches: no prefetch policy, no prefetch keys.
            args += ["--disaggregation-decode-enable-offload-kvcache", *_host_pool_args(node.cache),
                     *_plugin_args(plugin_extra_config(topology, node, "decode"))]
        return args
    return _hicache_args(topology, node)


def _transfer_args(topology: Topology, node: NodeSpec) -> list[str]:
    engine = "nixl" if topology.transfer.engine == "nixl" else "mooncake"
    args = ["--disaggregation-transfer-backend", engine]
    devices = node.devices if node.devices is not None else topology.transfer.devices
    if devices and topology.transfer.protocol == "rdma":
        args += ["--disaggregation-ib-device", ",".join(devices)]
    return args


def _hicache_args(topology: Topology, node: NodeSpec) -> list[str]:
    cache = node.cache
    args = ["--enable-hierarchical-cache", *_host_pool_args(cache),
            "--hicache-write-policy", cache.write_policy, "--hicache-mem-layout", "page_first"]
    return args + _storage_args(topology, node)


def _host_pool_args(cache: CacheSpec) -> list[str]:
    if cache.host_bytes is not None:
        return ["--hicache-size", str(max(1, math.ceil(cache.host_bytes / 2**30)))]  # whole GB
    return ["--hicache-ratio", _num(cache.effective_host_ratio)]


def _storage_args(topology: Topology, node: NodeSpec) -> list[str]:
    if not topology.storage.enabled:
        return []
    extra = {**plugin_extra_config(topology, node, "prefill"), **_prefetch_config(node.cache)}
    return ["--hicache-storage-prefetch-policy", node.cache.prefetch_policy, *_plugin_args(extra)]


def _plugin_args(extra: dict[str, Any]) -> list[str]:
    return ["--hicache-storage-backend", "dynamic",
            "--hicache-storage-backend-extra-config", json.dumps(extra, separators=(",", ":"))]


def plugin_extra_config(topology: Topology, node: NodeSpec, origin: str) -> dict[str, Any]:
    """The extra-config object that makes SGLang load the pdcache plugin on this storage.

    `model_name` is the shell variable PDCACHE_MODEL_NAME (see `_model_name_lines`); `origin`
    is recorded in page headers ("decode" on offloading decode servers).
    """
    storage = storage_keys_from_spec(topology.storage)
    if topology.storage.backend == "mooncake":  # the address this node's store client serves on
        storage["mooncake_local_hostname"] = node.host
    extra: dict[str, Any] = {
        "backend_name": "pdcache", "module_path": PLUGIN_MODULE, "class_name": PLUGIN_CLASS,
        "interface_v1": 1, "storage": storage, "model_name": MODEL_NAME_VAR,
    }
    if origin != "prefill":
        extra["origin"] = origin
    if topology.cache.key_namespace:  # pdcache nodes salt their keys with it: so must SGLang
        extra["key_namespace"] = topology.cache.key_namespace
    if topology.security.secret_file is not None:  # sealed pages, authenticated metadata
        extra["secret_file"] = topology.security.secret_file
    return extra


def _prefetch_config(cache: CacheSpec) -> dict[str, float]:
    """Generic HiCache extra-config keys for the timeout prefetch policy (docs/sglang.md, "Extra-config keys")."""
    if cache.prefetch_policy != "timeout":
        return {}
    return {"prefetch_timeout_base": cache.prefetch_timeout_base_s,
            "prefetch_timeout_per_ki_token": cache.prefetch_timeout_per_1k_tokens_s,
            "prefetch_timeout_max": cache.prefetch_timeout_max_s}


def _server_env(node: NodeSpec, topology: Topology) -> tuple[tuple[str, str], ...]:
    # The PD transfer (Mooncake TransferEngine) over TCP; storage needs no variables.
    if node.role in ("prefill", "decode") and topology.transfer.protocol == "tcp":
        return (("MC_FORCE_TCP", "1"),)
    return ()


def _router_command(topology: Topology) -> Command:
    router = topology.router
    assert router is not None
    argv = ["--host", router.host, "--port", str(router.port)]
    if topology.is_pd:
        argv.append("--pd-disaggregation")
        for node in topology.nodes_with_role("prefill"):
            argv += ["--prefill", node.url, str(node.bootstrap_port)]
        for node in topology.nodes_with_role("decode"):
            argv += ["--decode", node.url]
        argv += ["--prefill-policy", ROUTER_POLICY[router.prefill_policy],
                 "--decode-policy", ROUTER_POLICY[router.decode_policy]]
    else:
        argv += ["--worker-urls", *(n.url for n in topology.nodes),
                 "--policy", ROUTER_POLICY[router.prefill_policy]]
    argv += ["--request-timeout-secs", str(math.ceil(router.request_timeout_s))]
    if router.api_key:
        argv += ["--api-key", router.api_key]
    return Command("router", router.host, ROUTER, tuple(argv))


def _num(value: float) -> str:
    return str(int(value)) if float(value).is_integer() else repr(value)
