"""`pdcache launch CONFIG --render sglang`: golden files for every shipped config.

Regenerate the golden files after an intended change with
`PDCACHE_UPDATE_GOLDEN=1 python -m pytest tests/test_launch_render.py` and review the diff.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from pdcache.cli import main as pdcache_main
from pdcache.launch.render_sglang import KNOWN_FLAGS, render_sglang, sglang_commands, sglang_files
from pdcache.launch.topology import load_topology, parse_topology

REPO = Path(__file__).resolve().parents[1]
GOLDEN = Path(__file__).resolve().parent / "golden"
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


@pytest.mark.parametrize("config", CONFIGS, ids=[c.stem for c in CONFIGS])
def test_rendered_files_are_json_and_script_parses(config: Path, tmp_path: Path) -> None:
    topology = load_topology(config)
    for body in sglang_files(topology).values():
        json.loads(body)
    if shutil.which("bash"):
        script = tmp_path / "deploy.sh"
        script.write_text(render_sglang(topology))
        assert subprocess.run(["bash", "-n", str(script)], capture_output=True).returncode == 0


def _flag_values(line_args: tuple[str, ...], flag: str) -> list[str]:
    return [line_args[i + 1] for i, a in enumerate(line_args) if a == flag]


def test_pd_roles_and_storage_flags() -> None:
    topology = load_topology(REPO / "configs/local-1p1d.toml")
    by_title = {c.title: c for c in sglang_commands(topology)}
    prefill, decode = by_title["prefill server p0"], by_title["decode server d0"]
    assert _flag_values(prefill.args, "--disaggregation-mode") == ["prefill"]
    assert "--enable-hierarchical-cache" in prefill.args
    assert _flag_values(prefill.args, "--hicache-storage-backend") == ["hf3fs"]
    assert _flag_values(prefill.args, "--disaggregation-bootstrap-port") == ["8998"]
    assert _flag_values(decode.args, "--disaggregation-mode") == ["decode"]
    assert "--disaggregation-decode-enable-offload-kvcache" in decode.args
    assert "--enable-hierarchical-cache" not in decode.args
    assert ("SGLANG_HICACHE_HF3FS_CONFIG_PATH", "$CONFIG_DIR/hf3fs.json") in decode.env
    assert ("MC_FORCE_TCP", "1") in prefill.env
    router = by_title["router"]
    assert "--pd-disaggregation" in router.args
    text = " ".join(router.args)
    assert "--prefill http://127.0.0.1:30001 8998" in text and "--decode http://127.0.0.1:30002" in text
    extra = json.loads(_flag_values(prefill.args, "--hicache-storage-backend-extra-config")[0])
    assert extra == {"prefetch_timeout_base": 2.0, "prefetch_timeout_per_ki_token": 0.1,
                     "prefetch_timeout_max": 30.0}
    hf3fs = json.loads(sglang_files(topology)["hf3fs.json"])
    assert hf3fs["metadata_server_url"] == "http://127.0.0.1:18000"
    assert hf3fs["file_size"] == 4 * 2**30


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


def test_mooncake_store_files_per_node() -> None:
    topology = load_topology(REPO / "configs/local-mooncake-store.toml")
    files = sglang_files(topology)
    assert set(files) == {"mooncake-p0.json", "mooncake-d0.json"}
    config = json.loads(files["mooncake-p0.json"])
    assert config["master_server_address"] == "127.0.0.1:50051" and config["protocol"] == "tcp"
    master = next(c for c in sglang_commands(topology) if c.program == ("mooncake_master",))
    assert "--rpc_port=50051" in master.args


def test_zmq_transfer_is_noted_not_invented() -> None:
    topology = load_topology(REPO / "configs/local-1p1d.toml", ["transfer.engine=zmq"])
    text = render_sglang(topology)
    assert 'transfer.engine = "zmq" has no SGLang equivalent' in text
    assert re.search(r"--disaggregation-transfer-backend mooncake", text)


def test_file_backend_uses_its_directory_variable() -> None:
    text = """
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
    rendered = render_sglang(parse_topology(text, "file.toml"))
    assert "SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR=/data/pages" in rendered
    assert "--hicache-storage-backend file" in rendered
    assert 'MODEL_PATH="${MODEL_PATH:-/m}"' in rendered
