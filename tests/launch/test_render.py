"""`pdcache launch CONFIG --render sglang`: golden files for every shipped config.

Regenerate the golden files after an intended change with
`PDCACHE_UPDATE_GOLDEN=1 python -m pytest tests/launch/test_render.py` and review the diff.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import re
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from pdcache.cli import main as pdcache_main
from pdcache.config import load_topology, parse_topology
from pdcache.launch.render_sglang import (
    KNOWN_FLAGS,
    PLUGIN_CLASS,
    PLUGIN_MODULE,
    render_sglang,
    sglang_commands,
)

REPO = Path(__file__).resolve().parents[2]
GOLDEN = Path(__file__).resolve().parents[1] / "golden"
CONFIGS = sorted((REPO / "configs").glob("*.toml"))


def _golden_path(config: Path) -> Path:
    return GOLDEN / f"sglang-{config.stem}.sh"


@pytest.mark.parametrize("config", CONFIGS, ids=[c.stem for c in CONFIGS])
def test_render_matches_golden(config: Path, capsys) -> None:
    assert pdcache_main(["launch", str(config), "--render", "sglang"]) == 0
    rendered = capsys.readouterr().out
    golden = _golden_path(config)
    if os.environ.get("PDCACHE_UPDATE_GOLDEN"):
        golden.write_text(rendered)
    assert golden.exists(), f"missing {golden}; run with PDCACHE_UPDATE_GOLDEN=1"
    assert rendered == golden.read_text()


@pytest.mark.parametrize("config", CONFIGS, ids=[c.stem for c in CONFIGS])
def test_rendered_flags_are_real_sglang_flags(config: Path) -> None:
    for command in sglang_commands(load_topology(config)):
        program = command.program[-1]
        flags = {a.split("=")[0] for a in command.args if a.startswith("--")}
        assert flags <= KNOWN_FLAGS[program], (program, flags - KNOWN_FLAGS[program])


def _flag_values(line_args: tuple[str, ...], flag: str) -> list[str]:
    return [line_args[i + 1] for i, a in enumerate(line_args) if a == flag]


def test_pd_roles_and_storage_flags() -> None:
    topology = load_topology(REPO / "configs/local-1p1d.toml")
    by_title = {c.title: c for c in sglang_commands(topology)}
    prefill, decode = by_title["prefill server p0"], by_title["decode server d0"]
    assert _flag_values(prefill.args, "--disaggregation-mode") == ["prefill"]
    assert "--enable-hierarchical-cache" in prefill.args
    assert _flag_values(prefill.args, "--hicache-storage-backend") == ["dynamic"]
    assert _flag_values(prefill.args, "--disaggregation-bootstrap-port") == ["8998"]
    assert _flag_values(decode.args, "--disaggregation-mode") == ["decode"]
    assert "--disaggregation-decode-enable-offload-kvcache" in decode.args
    assert "--enable-hierarchical-cache" not in decode.args
    assert decode.env == prefill.env == (("MC_FORCE_TCP", "1"),)  # PD transfer; storage needs none
    router = by_title["router"]
    assert "--pd-disaggregation" in router.args
    text = " ".join(router.args)
    assert "--prefill http://127.0.0.1:30001 8998" in text and "--decode http://127.0.0.1:30002" in text
    storage = {"backend": "hf3fs", "path": "./.pdcache/storage", "capacity_bytes": 4 * 2**30,
               "io_engine": "posix", "metadata": "tcp://127.0.0.1:18000", "namespace": "default"}
    plugin = {"backend_name": "pdcache", "module_path": PLUGIN_MODULE, "class_name": PLUGIN_CLASS,
              "interface_v1": 1, "storage": storage, "model_name": "$PDCACHE_MODEL_NAME"}
    extra = json.loads(_flag_values(prefill.args, "--hicache-storage-backend-extra-config")[0])
    assert extra == {**plugin, "prefetch_timeout_base": 2.0, "prefetch_timeout_per_ki_token": 0.1,
                     "prefetch_timeout_max": 30.0}
    assert _flag_values(decode.args, "--hicache-storage-backend") == ["dynamic"]
    assert "--hicache-storage-prefetch-policy" not in decode.args  # decode never prefetches
    extra = json.loads(_flag_values(decode.args, "--hicache-storage-backend-extra-config")[0])
    assert extra == {**plugin, "origin": "decode"}
    metadata = by_title["pdcache metadata service"]
    assert metadata.program == ("pdcache", "metadata-server")
    assert _flag_values(metadata.args, "--port") == ["18000"]


def test_decode_without_offload_has_no_storage() -> None:
    topology = load_topology(REPO / "configs/local-1p1d.toml", ["node.d0.offload=false"])
    decode = next(c for c in sglang_commands(topology) if c.title == "decode server d0")
    assert not any(a.startswith("--hicache") for a in decode.args)
    assert "--disaggregation-decode-enable-offload-kvcache" not in decode.args


def test_rdma_devices_and_policy_mapping() -> None:
    topology = load_topology(REPO / "configs/multinode-example.toml", [
        "transfer.protocol=rdma", 'transfer.devices=["mlx5_0","mlx5_1"]', 'node.d0.devices=["mlx5_2"]',
        "router.decode_policy=least_load", "router.api_key=sk-1",
    ])
    commands = {c.title: c for c in sglang_commands(topology)}
    assert _flag_values(commands["prefill server p0"].args, "--disaggregation-ib-device") == ["mlx5_0,mlx5_1"]
    assert _flag_values(commands["decode server d0"].args, "--disaggregation-ib-device") == ["mlx5_2"]
    assert ("MC_FORCE_TCP", "1") not in commands["prefill server p0"].env
    router = commands["router"].args
    assert _flag_values(router, "--decode-policy") == ["power_of_two"]
    assert _flag_values(router, "--api-key") == ["sk-1"]
    assert _flag_values(commands["prefill server p0"].args, "--hicache-size") == ["64"]


def test_mooncake_store_is_the_plugins_backend() -> None:
    topology = load_topology(REPO / "configs/local-mooncake-store.toml")
    commands = sglang_commands(topology)
    prefill = next(c for c in commands if c.title == "prefill server p0")
    storage = json.loads(_flag_values(prefill.args, "--hicache-storage-backend-extra-config")[0])["storage"]
    assert storage["backend"] == "mooncake" and storage["mooncake_master"] == "127.0.0.1:50051"
    assert storage["mooncake_protocol"] == "tcp"
    assert storage["mooncake_metadata"] == "http://127.0.0.1:8080/metadata"
    assert storage["mooncake_local_hostname"] == "127.0.0.1"  # the node's host (as SGLang's JSON had)
    assert not any(name.startswith("SGLANG_") for c in commands for name, _ in c.env)
    master = next(c for c in commands if c.program == ("mooncake_master",))
    assert "--rpc_port=50051" in master.args
    assert "--enable_http_metadata_server=true" in master.args


def test_zmq_transfer_is_noted_not_invented() -> None:
    topology = load_topology(REPO / "configs/local-1p1d.toml", ["transfer.engine=zmq"])
    text = render_sglang(topology)
    assert 'transfer.engine = "zmq" has no SGLang equivalent' in text
    assert re.search(r"--disaggregation-transfer-backend mooncake", text)


FILE_TOPOLOGY = """
[model]
path = "/m"
[storage]
backend = "file"
path = "/data/pages"
[[node]]
name = "u0"
role = "unified"
port = 30000
"""


def test_file_backend_is_configured_in_the_extra_config() -> None:
    topology = parse_topology(FILE_TOPOLOGY, "file.toml")
    rendered = render_sglang(topology)
    assert "SGLANG_" not in rendered and "MC_FORCE_TCP" not in rendered
    unified = sglang_commands(topology)[0]
    extra = json.loads(_flag_values(unified.args, "--hicache-storage-backend-extra-config")[0])
    assert extra["storage"]["backend"] == "file" and extra["storage"]["path"] == "/data/pages"
    assert 'MODEL_PATH="${MODEL_PATH:-/m}"' in rendered


def test_key_namespace_reaches_the_plugin_config() -> None:
    """pdcache nodes salt keys with [cache] key_namespace; the rendered plugin must too."""
    for cache, want in (("", None), ('[cache]\nkey_scheme = "sglang"\nkey_namespace = "team-a"\n',
                                    "team-a")):
        topology = parse_topology(cache + FILE_TOPOLOGY, "ns.toml")
        unified = sglang_commands(topology)[0]
        extra = json.loads(_flag_values(unified.args, "--hicache-storage-backend-extra-config")[0])
        assert extra.get("key_namespace") == want


def test_a_secured_topology_renders_its_secret_for_the_service_and_every_plugin() -> None:
    """`[security] secret_file` was dropped: the metadata service listened on the network
    without authentication and the plugins wrote unsealed pages."""
    topology = load_topology(REPO / "configs/multinode-example.toml")
    secret = topology.security.secret_file
    assert secret is not None
    commands = sglang_commands(topology)
    service = next(c for c in commands if c.program == ("pdcache", "metadata-server"))
    assert _flag_values(service.args, "--secret-file") == [secret]
    servers = [c for c in commands if "--hicache-storage-backend-extra-config" in c.args]
    assert len(servers) == len(topology.nodes)
    for server in servers:
        flag = _flag_values(server.args, "--hicache-storage-backend-extra-config")[0]
        assert json.loads(flag)["secret_file"] == secret


# ---------------------------------------------------------------------------- running the script

# Stand-ins for the programs the script starts: each records its argv (as bash expanded it) in
# $CAPTURE/<pid>. `python3 -c` (the model-name line) runs for real with this test's Python.
_SHIMS = r"""
record() { printf '%s\0' "$@" > "$CAPTURE/$BASHPID"; }
python3() { if [ "$1" = -c ]; then command "$TEST_PYTHON" "$@"; else record python3 "$@"; fi; }
pdcache() { record pdcache "$@"; }
mooncake_master() { record mooncake_master "$@"; }
etcd() { record etcd "$@"; }
"""


def run_rendered(script: str, tmp_path: Path, **env: str) -> list[list[str]]:
    """Run a rendered script under bash with recording shims; the argv of every process."""
    capture = tmp_path / "argv"
    capture.mkdir()
    (tmp_path / "deploy.sh").write_text(script)
    (tmp_path / "run.sh").write_text(_SHIMS + f"source {tmp_path / 'deploy.sh'}\n")
    full_env = {**os.environ, "CAPTURE": str(capture), "TEST_PYTHON": sys.executable, **env}
    done = subprocess.run(["bash", str(tmp_path / "run.sh")], env=full_env, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return [[a.decode() for a in f.read_bytes().split(b"\0")[:-1]] for f in sorted(capture.iterdir())]


def _servers(argvs: list[list[str]]) -> dict[str, list[str]]:
    """--disaggregation-mode (or "unified") → argv of that SGLang server."""
    out = {}
    for argv in argvs:
        if "sglang.launch_server" in argv:
            mode = _flag_values(tuple(argv), "--disaggregation-mode") or ["unified"]
            out[mode[0]] = argv
    return out


def _extra(argv: list[str]) -> dict:
    return json.loads(_flag_values(tuple(argv), "--hicache-storage-backend-extra-config")[0])


@pytest.mark.parametrize("config", CONFIGS, ids=[c.stem for c in CONFIGS])
def test_rendered_script_runs_and_extra_config_is_json(config: Path, tmp_path: Path) -> None:
    """bash -n, then the script itself (programs recorded, not started): every server's
    extra-config, as bash hands it to SGLang, is JSON that loads our plugin."""
    script = render_sglang(load_topology(config))
    (tmp_path / "syntax.sh").write_text(script)
    assert subprocess.run(["bash", "-n", str(tmp_path / "syntax.sh")]).returncode == 0
    argvs = run_rendered(script, tmp_path, MODEL_PATH="/m", PDCACHE_MODEL_NAME="ckpt:m:1")
    servers = _servers(argvs)
    assert servers
    for mode, argv in servers.items():
        extra = _extra(argv)
        assert extra["model_name"] == "ckpt:m:1"
        assert (extra["backend_name"], extra["module_path"], extra["class_name"]) == (
            "pdcache", PLUGIN_MODULE, PLUGIN_CLASS)
        assert extra["interface_v1"] == 1
        assert extra["storage"]["backend"] == load_topology(config).storage.backend
        assert extra.get("origin", "prefill") == ("decode" if mode == "decode" else "prefill")
        assert _flag_values(tuple(argv), "--hicache-storage-backend") == ["dynamic"]
        parser = _sglang_server_parser()
        if parser is not None:  # SGLang's own CLI accepts the flags and values bash passes
            args = parser.parse_args(argv[3:])
            assert args.hicache_storage_backend == "dynamic"
            assert json.loads(args.hicache_storage_backend_extra_config) == extra


@functools.lru_cache(maxsize=1)
def _sglang_server_parser():
    try:
        from sglang.srt.server_args import ServerArgs
    except ImportError:
        return None
    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
    return parser


def test_plugin_module_and_class_names_are_the_plugins() -> None:
    pytest.importorskip("torch")
    from pdcache.integrations import sglang as plugin

    assert (PLUGIN_MODULE, PLUGIN_CLASS) == (plugin.MODULE_PATH, plugin.CLASS_NAME)


def test_metadata_service_command_parses_with_pdcache_cli() -> None:
    from pdcache.offload_manager.storage import metadata_cli

    topology = load_topology(REPO / "configs/local-1p1d.toml")
    command = next(c for c in sglang_commands(topology) if c.program == ("pdcache", "metadata-server"))
    parser = argparse.ArgumentParser()
    metadata_cli.add_arguments(parser)
    args = parser.parse_args(list(command.args))
    assert (args.host, args.port, args.state_dir) == ("127.0.0.1", 18000, "./.pdcache/metadata")


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _wait_port(port: int, proc: subprocess.Popen, deadline_s: float = 30.0) -> None:
    deadline = time.monotonic() + deadline_s
    while time.monotonic() < deadline:
        assert proc.poll() is None, "pdcache metadata-server exited"
        with socket.socket() as sock:
            if sock.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.1)
    raise AssertionError(f"metadata server not listening on {port} after {deadline_s}s")


def _checkpoint_topology(tmp_path: Path, port: int):
    ckpt = tmp_path / "Llama-ckpt"
    ckpt.mkdir()
    (ckpt / "config.json").write_text(json.dumps({"model_type": "llama", "num_hidden_layers": 3}))
    text = (REPO / "configs/local-1p1d.toml").read_text()
    text = text.replace('preset = "small"', f'path = "{ckpt}"', 1)
    overrides = [f"storage.path={tmp_path / 'pages'}", "storage.capacity=4MiB",
                 f"storage.metadata=tcp://127.0.0.1:{port}",
                 f"storage.metadata_service.state_dir={tmp_path / 'meta'}"]
    return ckpt, parse_topology(text, "ckpt-1p1d.toml", overrides)


def test_rendered_servers_share_pages_through_the_plugin(tmp_path: Path) -> None:
    """The rendered deployment for real, minus the GPUs: the recorded `pdcache metadata-server`
    runs; SGLang's own backend factory builds the plugin from exactly the prefill and decode
    servers' extra-config; a page written by one is read byte-exact by the other. The model
    name is the one pdcache nodes serving the checkpoint put in their KV fingerprint."""
    hicache_storage = pytest.importorskip("sglang.srt.mem_cache.hicache_storage",
                                          reason="sglang is not installed")
    factory = pytest.importorskip("sglang.srt.mem_cache.storage.backend_factory")
    from pdcache.offload_manager.builder import model_identity
    from tests.integrations.test_sglang import PAGE, SglangLikeHostPool, indices, sglang_config

    port = _free_port()
    ckpt, topology = _checkpoint_topology(tmp_path, port)
    argvs = run_rendered(render_sglang(topology), tmp_path)  # model name computed by the script
    servers = _servers(argvs)
    identity = model_identity(topology.model.ref, topology.model.seed)  # as node_config does
    assert identity.startswith("ckpt:Llama-ckpt:")
    assert {_extra(a)["model_name"] for a in servers.values()} == {identity}
    metadata = next(a for a in argvs if a[:2] == ["pdcache", "metadata-server"])
    server = subprocess.Popen([sys.executable, "-m", "pdcache", *metadata[1:]], cwd=tmp_path,
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    stores = []
    try:
        _wait_port(port, server)
        pools = {}
        for mode in ("prefill", "decode"):
            config = sglang_config(_extra(servers[mode]), model="served-name-is-ignored")
            pools[mode] = SglangLikeHostPool("page_first", seed=7 if mode == "prefill" else None)
            store = factory.StorageBackendFactory.create_backend("dynamic", config, pools[mode])
            stores.append(store)
            assert isinstance(store, hicache_storage.HiCacheStorage)
            store.register_mem_pool_host(pools[mode])
        prefill, decode = stores
        assert prefill.fingerprint == decode.fingerprint and identity in prefill.fingerprint
        keys = [bytes([1] * 32).hex(), bytes([2] * 32).hex()]
        assert prefill.batch_set_v1(keys, indices([1, 4])) == [True, True]
        assert decode.batch_exists(keys) == 2
        assert decode.batch_get_v1(keys, indices([0, 2])) == [True, True]
        src, dst = pools["prefill"].kv_buffer, pools["decode"].kv_buffer
        for s, d in ((1, 0), (4, 2)):
            assert torch_equal(src[:, s * PAGE : (s + 1) * PAGE], dst[:, d * PAGE : (d + 1) * PAGE])
    finally:
        for store in stores:
            store.close()
        server.terminate()
        server.wait(timeout=30)


def torch_equal(a, b) -> bool:
    import torch

    return bool(torch.equal(a, b))


def test_launch_prefix_goes_before_the_rendered_server() -> None:
    topology = load_topology(REPO / "configs/local-1p1d.toml",
                             ['node.d0.launch_prefix=["numactl", "-N", "1"]'])
    commands = {c.title: c for c in sglang_commands(topology)}
    assert commands["decode server d0"].program[:3] == ("numactl", "-N", "1")
    assert commands["decode server d0"].program[3:] == commands["prefill server p0"].program
    assert "numactl -N 1 python3 -m sglang.launch_server" in render_sglang(topology)
