"""The launcher's cluster secret: created mode 0600 in its state directory when the topology has
none, reused on the next launch, refused when others may read it, passed to every process it
starts (nodes and router by `--set security.secret_file=...`, the metadata service by
`--secret-file`, custom commands by `{secret_file}`), and sent by its health checks."""

from __future__ import annotations

import argparse
import os
import shlex
import stat
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from pdcache.cli import main as pdcache_main
from pdcache.config import load_topology
from pdcache.launch.cli import with_cluster_secret
from pdcache.launch.launcher import HealthCheck, build_process_specs, check_health
from pdcache.utils.secret import SecretError, derive_key, load_secret

REPO = Path(__file__).resolve().parents[2]
PY = "/usr/bin/python3"


def args_for(log_dir: Path, dry_run: bool = False) -> argparse.Namespace:
    return argparse.Namespace(log_dir=str(log_dir), dry_run=dry_run)


def test_launcher_creates_a_0600_secret_and_passes_it_to_every_process(tmp_path) -> None:
    topology = load_topology(REPO / "configs/local-1p1d.toml")
    assert not topology.security.enabled
    secured = with_cluster_secret(topology, args_for(tmp_path / "logs"))
    path = tmp_path / "logs" / "cluster.secret"
    assert secured.security.secret_file == str(path.resolve())
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    secret = load_secret(path)
    specs = {s.name: s for s in build_process_specs(secured, python=PY)}
    override = f'security.secret_file="{path.resolve()}"'
    for name in ("p0", "d0", "router"):
        argv = specs[name].argv
        assert argv[argv.index(override) - 1] == "--set", shlex.join(argv)
    meta = specs["metadata"].argv
    assert meta[meta.index("--secret-file") + 1] == str(path.resolve())
    token = derive_key(secret, "node-http").hex()
    assert specs["p0"].health[0].token == token and specs["d0"].health[0].token == token
    assert token not in repr(specs["p0"].health[0])  # never printed
    # the next launch reuses it: pages stored under its keys stay valid
    again = with_cluster_secret(topology, args_for(tmp_path / "logs"))
    assert again.security.secret_file == secured.security.secret_file
    assert load_secret(path) == secret


def test_an_existing_secret_others_can_read_is_refused(tmp_path, capsys) -> None:
    log_dir = tmp_path / "logs"
    with_cluster_secret(load_topology(REPO / "configs/unified.toml"), args_for(log_dir))
    os.chmod(log_dir / "cluster.secret", 0o640)
    with pytest.raises(SecretError, match="accessible by other users"):
        with_cluster_secret(load_topology(REPO / "configs/unified.toml"), args_for(log_dir))
    code = pdcache_main(["launch", str(REPO / "configs/unified.toml"), "--log-dir", str(log_dir)])
    assert code == 2 and "chmod 600" in capsys.readouterr().err


def test_dry_run_creates_nothing_but_shows_the_path(tmp_path, capsys) -> None:
    log_dir = tmp_path / "logs"
    assert pdcache_main(["launch", str(REPO / "configs/local-1p1d.toml"), "--log-dir",
                         str(log_dir), "--dry-run"]) == 0
    assert not (log_dir / "cluster.secret").exists()
    assert f"security.secret_file={log_dir.resolve()}/cluster.secret" in \
        capsys.readouterr().out.replace('"', "").replace("'", "")


def test_a_given_secret_is_used_as_is(tmp_path) -> None:
    topology = load_topology(REPO / "configs/multinode-example.toml")
    assert with_cluster_secret(topology, args_for(tmp_path)) is topology
    assert not (tmp_path / "cluster.secret").exists()


def test_custom_commands_get_the_secret_placeholder(tmp_path) -> None:
    text = f"""
[security]
secret_file = "{tmp_path}/s"

[model]
preset = "tiny"

[[node]]
name = "u0"
role = "unified"
port = 30123
command = ["{{python}}", "my_node.py", "--secret", "{{secret_file}}"]
"""
    config = tmp_path / "t.toml"
    config.write_text(text)
    (spec,) = build_process_specs(load_topology(config), python=PY)
    assert spec.argv[-2:] == ("--secret", f"{tmp_path}/s")


class _TokenHealth(BaseHTTPRequestHandler):
    token = "t0k3n"

    def do_GET(self) -> None:  # noqa: N802 - http.server's name
        ok = self.headers.get("Authorization") == f"Bearer {self.token}"
        self.send_response(200 if ok else 401)
        self.end_headers()

    def log_message(self, *args: object) -> None:
        pass


def test_health_checks_send_the_node_credential() -> None:
    server = ThreadingHTTPServer(("127.0.0.1", 0), _TokenHealth)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        port = server.server_address[1]
        assert check_health(HealthCheck("http", "127.0.0.1", port, token="t0k3n"), 5.0)
        assert not check_health(HealthCheck("http", "127.0.0.1", port), 5.0)  # without it
    finally:
        server.shutdown()
        server.server_close()
