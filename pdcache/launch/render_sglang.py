"""Render a topology as the equivalent SGLang deployment: a bash script plus its JSON files.

Every flag below is one SGLang really has; where they were checked:
- server flags: sgl-project/sglang `python/sglang/srt/server_args.py` (`--model-path`, `--host`,
  `--port`, `--dtype`, `--random-seed`, `--page-size`, `--max-total-tokens`, `--api-key`,
  `--enable-cache-report`, `--enable-metrics`, `--enable-hierarchical-cache`, `--hicache-ratio`,
  `--hicache-size` (GB), `--hicache-write-policy`, `--hicache-mem-layout`,
  `--hicache-storage-backend`, `--hicache-storage-prefetch-policy`,
  `--hicache-storage-backend-extra-config`, `--disaggregation-mode`,
  `--disaggregation-transfer-backend`, `--disaggregation-bootstrap-port`,
  `--disaggregation-ib-device`, `--disaggregation-decode-enable-offload-kvcache`), and
  `/work/shared/reference/sglang-hicache-pd-notes.md` §1.3, §1.8, §1.9, §2.7, §3.
- router flags: `sgl-router/py_src/sglang_router/router_args.py` (`--pd-disaggregation`,
  `--prefill URL BOOTSTRAP_PORT`, `--decode URL`, `--worker-urls`, `--policy`,
  `--prefill-policy`, `--decode-policy` with choices random|round_robin|cache_aware|power_of_two,
  `--api-key`, `--request-timeout-secs`, `--host`, `--port`).
- 3FS JSON (`SGLANG_HICACHE_HF3FS_CONFIG_PATH`): file_path_prefix, file_size, numjobs, entries,
  metadata_server_url; metadata server module `sglang.srt.mem_cache.storage.hf3fs.
  mini_3fs_metadata_server --host --port --persistence-path FILE` (notes §1.8).
- Mooncake JSON (`SGLANG_HICACHE_MOONCAKE_CONFIG_PATH`): local_hostname, metadata_server,
  master_server_address, protocol, device_name, global_segment_size, local_buffer_size
  (notes §1.9; SGLang's HiCache Mooncake docs).
- File backend directory: `SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR` (sglang `environ.py`).
- Mooncake transfer over TCP instead of RDMA: `MC_FORCE_TCP=1` (Mooncake TransferEngine env).
The output is deterministic (golden-file tested) and uses only paths given in the topology.
"""

from __future__ import annotations

import json
import math
import shlex
import textwrap
from dataclasses import dataclass

from pdcache.launch.launcher import mooncake_master_argv
from pdcache.launch.topology import CacheSpec, NodeSpec, Topology

SERVER = ("python3", "-m", "sglang.launch_server")
ROUTER = ("python3", "-m", "sglang_router.launch_router")
METADATA_SERVER = ("python3", "-m", "sglang.srt.mem_cache.storage.hf3fs.mini_3fs_metadata_server")
# SGLang's router has no least-load policy; power_of_two picks the less loaded of two workers.
ROUTER_POLICY = {"round_robin": "round_robin", "cache_aware": "cache_aware", "least_load": "power_of_two"}
HF3FS_JSON = "hf3fs.json"

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
    "sglang.srt.mem_cache.storage.hf3fs.mini_3fs_metadata_server": frozenset({
        "--host", "--port", "--persistence-path",
    }),
    "mooncake_master": frozenset({
        "--rpc_address", "--rpc_port", "--metrics_host", "--metrics_port",
        "--enable_http_metadata_server", "--http_metadata_server_host", "--http_metadata_server_port",
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
    """Shell-quote, but let "$VAR..." expand (double quotes)."""
    return f'"{text}"' if text.startswith("$") else shlex.quote(text)


# --------------------------------------------------------------------------- the script


def render_sglang(topology: Topology) -> str:
    """The whole deployment as a bash script: notes, JSON files, one command per process."""
    parts = [_header(topology), *(_file_block(name, body) for name, body in sglang_files(topology).items())]
    parts += [cmd.render() for cmd in sglang_commands(topology)]
    parts.append("wait")
    return "\n\n".join(parts) + "\n"


def _header(topology: Topology) -> str:
    lines = [
        "#!/usr/bin/env bash",
        f"# SGLang deployment equivalent to the pdcache topology {topology.source.name}",
        "# (rendered by `pdcache launch CONFIG --render sglang`). Run each command on the host",
        "# named above it; the JSON files must exist on every host that uses them.",
    ]
    if topology.overrides:
        lines.append("# overrides: " + " ".join(f"--set {o}" for o in topology.overrides))
    for note in _notes(topology):
        lines += textwrap.wrap(note, 96, initial_indent="# NOTE: ", subsequent_indent="#       ")
    lines += ["set -euo pipefail", _model_line(topology), 'CONFIG_DIR="${CONFIG_DIR:-./sglang-configs}"',
              'mkdir -p "$CONFIG_DIR"']
    return "\n".join(lines)


def _model_line(topology: Topology) -> str:
    if topology.model.path is not None:
        return f'MODEL_PATH="${{MODEL_PATH:-{topology.model.path}}}"'
    return (f'MODEL_PATH="${{MODEL_PATH:?preset {topology.model.preset!r} exists only in pdcache;'
            ' set MODEL_PATH to a Llama-family checkpoint}"')


def _notes(topology: Topology) -> list[str]:
    notes, storage, transfer = [], topology.storage, topology.transfer
    if topology.model.preset is not None:
        notes.append(f"model.preset = {topology.model.preset!r} has random weights in pdcache; SGLang needs"
                     " a checkpoint: MODEL_PATH.")
    if storage.backend == "hf3fs" and storage.io_engine == "posix":
        notes.append("SGLang's hf3fs backend reads and writes through the 3FS usrbio client: storage.path"
                     " must be a 3FS mount there (a plain directory works with the file backend).")
    if topology.is_pd and transfer.engine == "zmq":
        notes.append("transfer.engine = \"zmq\" has no SGLang equivalent; rendered with mooncake.")
    if any(n.cache.write_policy == "write_through_selective" and n.cache.write_through_threshold != 2
           for n in topology.nodes):
        notes.append("SGLang fixes the write_through_selective threshold at 2 hits; ours differs.")
    if storage.namespace != "default" and storage.backend == "hf3fs":
        notes.append("SGLang's hf3fs keys carry no namespace: use one storage path per tenant.")
    return notes


def _file_block(name: str, body: str) -> str:
    return f"cat > \"$CONFIG_DIR/{name}\" <<'EOF'\n{body}EOF"


# --------------------------------------------------------------------------- JSON files


def sglang_files(topology: Topology) -> dict[str, str]:
    """File name (under $CONFIG_DIR) → content, for the storage backend's JSON config."""
    storage = topology.storage
    if storage.backend == "hf3fs":
        return {HF3FS_JSON: _json(_hf3fs_config(topology))}
    if storage.backend == "mooncake":
        return {_mooncake_file(n): _json(_mooncake_config(topology, n))
                for n in topology.nodes if _node_uses_storage(n)}
    return {}


def _json(data: dict[str, object]) -> str:
    return json.dumps(data, indent=2) + "\n"


def _hf3fs_config(topology: Topology) -> dict[str, object]:
    storage = topology.storage
    config: dict[str, object] = {
        "file_path_prefix": f"{storage.path.rstrip('/')}/hicache",
        "file_size": storage.capacity,
        "numjobs": 16,
        "entries": 8,
    }
    if storage.metadata_address is not None:
        host, port = storage.metadata_address
        config["metadata_server_url"] = f"http://{host}:{port}"
    return config


def _mooncake_file(node: NodeSpec) -> str:
    return f"mooncake-{node.name}.json"


def _mooncake_config(topology: Topology, node: NodeSpec) -> dict[str, object]:
    spec = topology.storage.mooncake
    return {
        "local_hostname": node.host,
        "metadata_server": spec.metadata_server,
        "master_server_address": spec.master,
        "protocol": spec.protocol,
        "device_name": ",".join(spec.devices),
        "global_segment_size": spec.global_segment_size,
        "local_buffer_size": spec.local_buffer_size,
    }


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
    if storage.uses_metadata_service and storage.metadata_service.start:
        host, port = storage.metadata_address  # type: ignore[misc]
        bind = storage.metadata_service.bind_host or host
        state = f"{storage.metadata_service.state_dir.rstrip('/')}/sglang-3fs-metadata.json"
        args = ("--host", bind, "--port", str(port), "--persistence-path", state)
        out.append(Command("3FS metadata service", host, METADATA_SERVER, args))
    if storage.backend == "mooncake" and storage.mooncake.start_master:
        host, _ = storage.mooncake.master_address
        argv = mooncake_master_argv(topology)
        out.append(Command("Mooncake Store master", host, argv[:1], argv[1:]))
    return out


def _server_command(topology: Topology, node: NodeSpec) -> Command:
    args = ["--model-path", "$MODEL_PATH", "--host", node.host, "--port", str(node.port),
            *_model_args(topology, node.cache), *_role_args(topology, node)]
    if topology.router is not None and topology.router.api_key:
        args += ["--api-key", topology.router.api_key]
    return Command(f"{node.role} server {node.name}", node.host, SERVER, tuple(args),
                   _server_env(topology, node))


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
                *_hicache_args(topology, node.cache)]
    if node.role == "decode":
        args = ["--disaggregation-mode", "decode", *_transfer_args(topology, node)]
        if node.offload:
            # Decode needs no --enable-hierarchical-cache: the offload manager has its own host pool.
            # Decode never prefetches, so only the backend (and its JSON file) is passed.
            args += ["--disaggregation-decode-enable-offload-kvcache", *_host_pool_args(node.cache),
                     "--hicache-storage-backend", topology.storage.backend]
        return args
    return _hicache_args(topology, node.cache)


def _transfer_args(topology: Topology, node: NodeSpec) -> list[str]:
    engine = "nixl" if topology.transfer.engine == "nixl" else "mooncake"
    args = ["--disaggregation-transfer-backend", engine]
    devices = node.devices if node.devices is not None else topology.transfer.devices
    if devices and topology.transfer.protocol == "rdma":
        args += ["--disaggregation-ib-device", ",".join(devices)]
    return args


def _hicache_args(topology: Topology, cache: CacheSpec) -> list[str]:
    args = ["--enable-hierarchical-cache", *_host_pool_args(cache),
            "--hicache-write-policy", cache.write_policy, "--hicache-mem-layout", "page_first"]
    return args + _storage_args(topology, cache)


def _host_pool_args(cache: CacheSpec) -> list[str]:
    if cache.host_bytes is not None:
        return ["--hicache-size", str(max(1, math.ceil(cache.host_bytes / 2**30)))]  # whole GB
    return ["--hicache-ratio", _num(cache.effective_host_ratio)]


def _storage_args(topology: Topology, cache: CacheSpec) -> list[str]:
    if not topology.storage.enabled:
        return []
    args = ["--hicache-storage-backend", topology.storage.backend,
            "--hicache-storage-prefetch-policy", cache.prefetch_policy]
    extra = _extra_config(cache)
    if extra:
        args += ["--hicache-storage-backend-extra-config", json.dumps(extra, separators=(",", ":"))]
    return args


def _extra_config(cache: CacheSpec) -> dict[str, float]:
    """Generic HiCache extra-config keys for the timeout prefetch policy (notes §1.3)."""
    if cache.prefetch_policy != "timeout":
        return {}
    return {"prefetch_timeout_base": cache.prefetch_timeout_base_s,
            "prefetch_timeout_per_ki_token": cache.prefetch_timeout_per_1k_tokens_s,
            "prefetch_timeout_max": cache.prefetch_timeout_max_s}


def _node_uses_storage(node: NodeSpec) -> bool:
    return node.role in ("prefill", "unified") or bool(node.role == "decode" and node.offload)


def _server_env(topology: Topology, node: NodeSpec) -> tuple[tuple[str, str], ...]:
    env: list[tuple[str, str]] = []
    backend = topology.storage.backend
    if _node_uses_storage(node):
        if backend == "hf3fs":
            env.append(("SGLANG_HICACHE_HF3FS_CONFIG_PATH", f"$CONFIG_DIR/{HF3FS_JSON}"))
        elif backend == "mooncake":
            env.append(("SGLANG_HICACHE_MOONCAKE_CONFIG_PATH", f"$CONFIG_DIR/{_mooncake_file(node)}"))
        elif backend == "file":
            env.append(("SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR", topology.storage.path))
    if node.role in ("prefill", "decode") and topology.transfer.protocol == "tcp":
        env.append(("MC_FORCE_TCP", "1"))
    return tuple(env)


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
