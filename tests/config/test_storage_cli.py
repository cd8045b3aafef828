"""`pdcache storage stats|clear|verify` and `pdcache metadata-server` from the command line."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from pdcache.cli import main
from pdcache.config.storage_cli import load_config
from pdcache.offload_manager.storage import create_backend

REPO = Path(__file__).resolve().parents[2]
SHIPPED = sorted((REPO / "configs").glob("*.toml"))

TOPOLOGY = """
[model]
preset = "tiny"

[storage]
backend = "{backend}"
path = "{path}"
capacity = {capacity}

[[node]]
name = "u0"
role = "unified"
port = 30000
"""


def _write_config(tmp_path: Path, backend: str) -> Path:
    """A one-node topology whose storage holds exactly 8 pages of the tiny model."""
    path = tmp_path / "topology.toml"
    path.write_text(TOPOLOGY.format(backend=backend, path=tmp_path / "data", capacity=1 << 20))
    slot_bytes = load_config(str(path), []).slot_bytes
    path.write_text(TOPOLOGY.format(backend=backend, path=tmp_path / "data",
                                    capacity=8 * slot_bytes))
    return path


@pytest.mark.parametrize("backend_name", ["hf3fs", "file"])
def test_verify_finds_the_corrupt_page_then_clear_empties(
    tmp_path: Path, backend_name: str, capsys: pytest.CaptureFixture[str]
) -> None:
    config_path = _write_config(tmp_path, backend_name)
    config = load_config(str(config_path), [])
    backend = create_backend(config)
    keys = [bytes([i]) * 32 for i in range(3)]
    pages = list(torch.ones(3, config.page_bytes, dtype=torch.uint8))
    assert backend.put_from(keys, pages) == [True] * 3
    blob = bytearray(backend.read_object(keys[1]))
    blob[3000] ^= 1
    backend.write_object(keys[1], bytes(blob))
    backend.close()

    assert main(["storage", "verify", "--config", str(config_path)]) == 1
    assert json.loads(capsys.readouterr().out) == {"pages": 3, "good": 2, "bad": 1}
    assert main(["storage", "clear", "--config", str(config_path)]) == 0
    assert json.loads(capsys.readouterr().out) == {"cleared": 3}
    assert main(["storage", "stats", "--config", str(config_path), "--set", "model.seed=0"]) == 0
    stats = json.loads(capsys.readouterr().out)
    assert stats["used_pages"] == 0 and stats["capacity_pages"] == 8


def test_bad_config_is_reported(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    config_path = _write_config(tmp_path, "file")
    assert main(["storage", "stats", "--config", str(config_path), "--set", "storage.colour=1"]) == 2
    assert "storage.colour: unknown key" in capsys.readouterr().err
    assert main(["storage", "stats", "--config", str(config_path), "--node", "p9"]) == 2
    assert "no node named 'p9'" in capsys.readouterr().err


@pytest.fixture(scope="module")
def metadata_service(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    from tests.pd_harness import MetadataService

    service = MetadataService(tmp_path_factory.mktemp("metadata"))
    yield service.address
    service.stop()


@pytest.mark.parametrize("config", SHIPPED, ids=lambda p: p.stem)
def test_storage_commands_read_every_shipped_topology(
    config: Path, tmp_path: Path, metadata_service: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """`pdcache storage stats|verify --config configs/X.toml` (docs/usage.md): the topology schema
    every other command reads, on a private storage path and a local metadata service."""
    overrides = ["model.preset=tiny", f'storage.path="{tmp_path / "storage"}"',
                 'storage.capacity="16MiB"']
    config_text = config.read_text()
    if 'backend = "mooncake"' in config_text:
        pytest.importorskip("mooncake.store")
        from pdcache.offload_manager.storage.mooncake_store import LocalMooncakeMaster

        storage = load_config(str(config), overrides)
        ha = "ha = true" in config_text  # clients find the leading master through etcd
        master = "etcd://127.0.0.1:2379;127.0.0.1:2381;127.0.0.1:2383" if ha else "127.0.0.1:50051"
        assert (storage.backend, storage.mooncake_master) == ("mooncake", master)
        assert storage.page_bytes > 0 and storage.fingerprint
        with LocalMooncakeMaster() as master:
            local = [*overrides, "storage.mooncake.ha=false",
                     f'storage.mooncake.master="{master.address}"',
                     'storage.mooncake.metadata_server="P2PHANDSHAKE"',
                     'storage.mooncake.global_segment_size="16MiB"',
                     'storage.mooncake.local_buffer_size="16MiB"']
            argv = ["storage", "stats", "--config", str(config)]
            for item in local:
                argv += ["--set", item]
            assert main(argv) == 0, capsys.readouterr().err
            assert isinstance(json.loads(capsys.readouterr().out), dict)
            assert main(["storage", "verify", *argv[2:]]) == 2  # Mooncake Store cannot list
            assert "cannot list objects" in capsys.readouterr().err
        return
    service = None
    if "[security]" in config_text:  # the cluster secret: keyed pages and metadata requests
        from pdcache.utils.secret import create_secret
        from tests.pd_harness import MetadataService

        secret = create_secret(tmp_path / "cluster.secret")
        overrides.append(f'security.secret_file="{secret}"')
        service = MetadataService(tmp_path / "metadata", str(secret))
        metadata_service = service.address
    if "tcp://" in config_text:
        overrides.append(f'storage.metadata="{metadata_service}"')
    try:
        _stats_and_verify(config, overrides, capsys)
    finally:
        if service is not None:
            service.stop()


def _stats_and_verify(config: Path, overrides: list[str],
                      capsys: pytest.CaptureFixture[str]) -> None:
    for action in ("stats", "verify"):
        argv = ["storage", action, "--config", str(config)]
        for item in overrides:
            argv += ["--set", item]
        assert main(argv) == 0, capsys.readouterr().err
        result = json.loads(capsys.readouterr().out)
        if action == "verify":
            assert result == {"pages": 0, "good": 0, "bad": 0}
        else:
            assert result["used_pages"] == 0 and result["capacity_pages"] > 0


def test_metadata_server_port_zero_announces_its_endpoint(tmp_path: Path) -> None:
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "pdcache",
            "metadata-server",
            "--port",
            "0",
            "--state-dir",
            str(tmp_path / "state"),
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        line = proc.stdout.readline()  # type: ignore[union-attr]
        assert line.startswith("pdcache metadata-server listening on tcp://127.0.0.1:")
        from pdcache.offload_manager.storage.metadata import ping

        assert ping(line.split()[-1], timeout_s=5.0)
    finally:
        proc.terminate()
        assert proc.wait(timeout=10) == 0
    assert (tmp_path / "state" / "index.sqlite3").exists()


def test_metadata_server_mistakes_are_one_line_errors(tmp_path: Path) -> None:
    """A taken port and a missing secret file were tracebacks (ZMQError, SecretError)."""
    import socket

    with socket.create_server(("127.0.0.1", 0)) as taken:
        port = taken.getsockname()[1]
        for extra, message in ((["--port", str(port)], f"cannot listen on 127.0.0.1:{port}"),
                               (["--secret-file", str(tmp_path / "missing")], "--secret-file")):
            done = subprocess.run(
                [sys.executable, "-m", "pdcache", "metadata-server", "--state-dir",
                 str(tmp_path / "state"), *extra], capture_output=True, text=True, timeout=60)
            assert done.returncode == 1 and message in done.stderr, done.stderr
            assert "Traceback" not in done.stderr


@pytest.mark.parametrize("command", [["serve"], ["router", "--prefill", "http://x:1"]])
def test_a_port_out_of_range_is_a_usage_error(command: list[str],
                                              capsys: pytest.CaptureFixture[str]) -> None:
    """It was an OverflowError traceback from bind() once the node had loaded its model."""
    with pytest.raises(SystemExit) as exited:
        main([*command, "--port", "70000"])
    assert exited.value.code == 2
    assert "port 70000 is outside 0..65535" in capsys.readouterr().err


def test_storage_bench_smoke(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "bench.json"
    args = [
        "bench",
        "storage",
        "--pages",
        "8",
        "--page-kib",
        "512",  # 2 page groups a call: the default chooses
        "--repeat",
        "1",
        "--backends",
        "hf3fs,file",
        "--dir",
        str(tmp_path),
        "--json",
        str(out),
        "--pipeline",
        "both",
    ]
    assert main(args) == 0
    result = json.loads(out.read_text())
    paths = [row["path"] for row in result["rows"]]
    assert paths == [
        "memcpy (torch copy_)",
        "plain file pwrite/preadv",
        *[f"storage {name}{mode}" for name in ("hf3fs", "file")
          for mode in ("", " +mac", " +mac pipelined")],
    ]
    assert all(row["read_GBps"] > 0 for row in result["rows"])
    mac_rows = [row for row in result["rows"] if "+mac" in row["path"]]
    assert len(mac_rows) == 4  # +mac and +mac pipelined, on both backends
    assert all(row["read_mac_ratio"] > 0 and row["write_mac_ratio"] > 0 for row in mac_rows)
    assert not any("read_mac_ratio" in row for row in result["rows"] if row not in mac_rows)
    # the default tried both ways, one call each (the warm-up round and the timed one)
    chosen = {row["path"]: row.get("pipelined_calls") for row in mac_rows}
    assert chosen == {f"storage {name}{mode}": calls for name in ("hf3fs", "file")
                      for mode, calls in ((" +mac", "reads 1/2, writes 1/2"),
                                          (" +mac pipelined", None))}
    assert all(row["write_GBps"] > 0 and "-" in row["read_spread"] for row in result["rows"][2:])
    direct = json.loads((tmp_path / "bench.direct.json").read_text())
    assert [row["path"] for row in direct["rows"]] == [
        "O_DIRECT read only",
        "O_DIRECT read + checksum verify",
        "O_DIRECT read + MAC verify",
        "O_DIRECT read + MAC verify, xxh3 kept",
        "O_DIRECT write only",
        "O_DIRECT write + checksum seal",
        "O_DIRECT write + MAC seal",
        "O_DIRECT write + MAC seal, xxh3 kept",
    ]
    assert all(row["GBps"] > 0 and row["cpu_us_per_page"] > 0 for row in direct["rows"])
    steps = {row["step"]: row for row in json.loads((tmp_path / "bench.steps.json").read_text())["rows"]}
    assert steps["verify, MAC"]["cpu_us_per_page"] > 0
    assert 0 < steps["bound: page-cache read, MAC / checksum"]["ratio"] < 2
    assert result["rows"][1]["read_vs_file"] == 1.0
    assert "read_vs_file" in capsys.readouterr().out
