"""`pdcache storage stats|clear|verify` and `pdcache metadata-server` from the command line."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from pdcache.cli import main
from pdcache.offload_manager.storage import create_backend
from pdcache.offload_manager.storage.cli import load_config


def _write_config(tmp_path: Path, backend: str) -> Path:
    path = tmp_path / "storage.toml"
    path.write_text(
        f'[storage]\nbackend = "{backend}"\npath = "{tmp_path / "data"}"\npage_bytes = 4096\n'
        'capacity_pages = 8\nfingerprint = "fp"\n'
    )
    return path


@pytest.mark.parametrize("backend_name", ["hf3fs", "file"])
def test_verify_finds_the_corrupt_page_then_clear_empties(
    tmp_path: Path, backend_name: str, capsys: pytest.CaptureFixture[str]
) -> None:
    config_path = _write_config(tmp_path, backend_name)
    backend = create_backend(load_config(str(config_path), []))
    keys = [bytes([i]) * 32 for i in range(3)]
    assert backend.put_from(keys, list(torch.ones(3, 4096, dtype=torch.uint8))) == [True] * 3
    blob = bytearray(backend.read_object(keys[1]))
    blob[3000] ^= 1
    backend.write_object(keys[1], bytes(blob))
    backend.close()

    assert main(["storage", "verify", "--config", str(config_path)]) == 1
    assert json.loads(capsys.readouterr().out) == {"pages": 3, "good": 2, "bad": 1}
    assert main(["storage", "clear", "--config", str(config_path)]) == 0
    assert json.loads(capsys.readouterr().out) == {"cleared": 3}
    assert main(["storage", "stats", "--config", str(config_path), "--set", "io_threads=2"]) == 0
    stats = json.loads(capsys.readouterr().out)
    assert stats["used_pages"] == 0 and stats["capacity_pages"] == 8


def test_bad_config_is_reported(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    config_path = _write_config(tmp_path, "file")
    assert main(["storage", "stats", "--config", str(config_path), "--set", "colour=1"]) == 2
    assert "unknown storage keys" in capsys.readouterr().err


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


def test_storage_bench_smoke(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "bench.json"
    args = [
        "bench",
        "storage",
        "--pages",
        "8",
        "--page-kib",
        "16",
        "--repeat",
        "1",
        "--backends",
        "hf3fs,file",
        "--dir",
        str(tmp_path),
        "--json",
        str(out),
    ]
    assert main(args) == 0
    result = json.loads(out.read_text())
    paths = [row["path"] for row in result["rows"]]
    assert paths == [
        "memcpy (torch copy_)",
        "plain file pwrite/preadv",
        "storage hf3fs",
        "storage file",
    ]
    assert all(row["read_GBps"] > 0 for row in result["rows"])
    assert result["rows"][1]["read_vs_file"] == 1.0
    assert "read_vs_file" in capsys.readouterr().out
