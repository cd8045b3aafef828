"""What `pdcache launch` would start: process specs, order, --host, --ssh, --dry-run."""

from __future__ import annotations

import shlex
from pathlib import Path

import pytest

from pdcache.cli import main as pdcache_main
from pdcache.config import TopologyError, load_topology, parse_topology
from pdcache.launch.launcher import (
    STAGE_NODES,
    STAGE_ROUTER,
    STAGE_SERVICES,
    build_process_specs,
    select_host,
    ssh_specs,
)

REPO = Path(__file__).resolve().parents[2]
PY = "/usr/bin/python3"


def test_local_1p1d_order_commands_and_health() -> None:
    topology = load_topology(REPO / "configs/local-1p1d.toml", ["model.preset=tiny"])
    specs = build_process_specs(topology, python=PY, config_path="cfg.toml")
    assert [(s.name, s.role, s.stage) for s in specs] == [
        ("metadata", "metadata", STAGE_SERVICES), ("p0", "prefill", STAGE_NODES),
        ("d0", "decode", STAGE_NODES), ("router", "router", STAGE_ROUTER),
    ]
    by_name = {s.name: s for s in specs}
    assert by_name["metadata"].argv == (PY, "-m", "pdcache", "metadata-server", "--host", "127.0.0.1",
                                        "--port", "18000", "--state-dir", "./.pdcache/metadata")
    assert by_name["p0"].argv == (PY, "-m", "pdcache", "prefill", "--config", "cfg.toml", "--node", "p0",
                                  "--set", "model.preset=tiny")
    assert by_name["d0"].argv[3] == "decode" and by_name["router"].argv[3:8] == (
        "router", "--config", "cfg.toml", "--node", "router")
    assert [c.describe() for c in by_name["metadata"].health] == ["tcp://127.0.0.1:18000"]
    assert [c.describe() for c in by_name["p0"].health] == ["http://127.0.0.1:30001/health"]
    assert by_name["p0"].endpoints == {"http": "http://127.0.0.1:30001", "bootstrap": "127.0.0.1:8998"}
    assert by_name["p0"].env["MC_TCP_BIND_ADDRESS"] == "127.0.0.1"


def test_unified_uses_serve_and_inproc_metadata_starts_no_service() -> None:
    specs = build_process_specs(load_topology(REPO / "configs/unified.toml"), python=PY, config_path="c")
    assert [s.name for s in specs] == ["u0", "router"]
    assert specs[0].argv[3] == "serve"


def test_mooncake_store_starts_master_first() -> None:
    specs = build_process_specs(load_topology(REPO / "configs/local-mooncake-store.toml"), python=PY)
    master = specs[0]
    assert master.role == "mooncake_master" and master.stage == STAGE_SERVICES
    assert master.argv[1:] == ("--rpc_address=127.0.0.1", "--rpc_port=50051", "--metrics_host=127.0.0.1",
                               "--metrics_port=9003", "--enable_http_metadata_server=true",
                               "--http_metadata_server_host=127.0.0.1", "--http_metadata_server_port=8080")
    assert [c.describe() for c in master.health] == ["tcp://127.0.0.1:50051", "tcp://127.0.0.1:8080"]


def test_host_selection() -> None:
    specs = build_process_specs(load_topology(REPO / "configs/multinode-example.toml"), python=PY)
    assert [s.name for s in select_host(specs, "10.0.0.1")] == ["metadata", "p0", "router"]
    assert [s.name for s in select_host(specs, "10.0.0.2")] == ["d0"]
    assert select_host(specs, "10.9.9.9") == []


def test_unknown_host_is_exit_2(capsys) -> None:
    code = pdcache_main(["launch", str(REPO / "configs/multinode-example.toml"), "--host", "10.9.9.9", "--dry-run"])
    assert code == 2
    assert "--host 10.9.9.9: nothing runs there (hosts: 10.0.0.1, 10.0.0.2)" in capsys.readouterr().err


def test_ssh_commands_render() -> None:
    topology = load_topology(REPO / "configs/multinode-example.toml", ["launch.ssh_user=serve"])
    specs = build_process_specs(topology, python=PY, config_path="configs/multinode-example.toml")
    remote = ssh_specs(topology, specs, "configs/multinode-example.toml", ["--no-restart"])
    assert [s.name for s in remote] == ["ssh-10.0.0.1", "ssh-10.0.0.2"]
    # one stage: 10.0.0.1's router is healthy only once 10.0.0.2's decode is (started after
    # 10.0.0.1's part was healthy, never)
    assert {s.stage for s in remote} == {0}
    first = remote[0].argv
    assert first[:5] == ("ssh", "-o", "BatchMode=yes", "-tt", "serve@10.0.0.1")
    assert shlex.split(first[5]) == [
        "cd", "/opt/pdcache", "&&", "exec", "python3", "-m", "pdcache", "launch",
        "configs/multinode-example.toml", "--host", "10.0.0.1", "--set", "launch.ssh_user=serve",
        "--no-restart",
    ]
    # The local side waits for each remote part to be healthy, all started together.
    assert [c.describe() for c in remote[1].health] == ["http://10.0.0.2:30002/health"]


def test_ssh_dry_run_prints_commands(capsys) -> None:
    config = str(REPO / "configs/multinode-example.toml")
    assert pdcache_main(["launch", config, "--ssh", "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "ssh -o BatchMode=yes -tt 10.0.0.2 'cd /opt/pdcache && exec python3 -m pdcache launch" in out
    assert "--host 10.0.0.2 --log-dir ./.pdcache/logs'" in out


def test_dry_run_prints_every_command(capsys) -> None:
    assert pdcache_main(["launch", str(REPO / "configs/local-2p2d.toml"), "--dry-run"]) == 0
    out = capsys.readouterr().out
    for name in ("metadata", "p0", "p1", "d0", "d1", "router"):
        assert f"# {name} (" in out
    assert out.index("# metadata") < out.index("# p0") < out.index("# router")


NODE_WITH_COMMAND = """
[model]
preset = "tiny"
[cache]
page_size = 8
[[node]]
name = "u0"
role = "unified"
port = 30123
command = ["{python}", "-m", "pdcache", "serve", "--model", "{model}", "--port", "{port}",
           "--page-size", "{page_size}", "--name", "{node}"]
extra_args = ["--log-level", "warning"]
env = { EXTRA = "1" }
"""


def test_command_escape_hatch_fills_placeholders() -> None:
    spec = build_process_specs(parse_topology(NODE_WITH_COMMAND, "x.toml"), python=PY)[0]
    assert spec.argv == (PY, "-m", "pdcache", "serve", "--model", "tiny", "--port", "30123",
                         "--page-size", "8", "--name", "u0", "--log-level", "warning")
    assert spec.env["EXTRA"] == "1"


def test_bad_placeholder_names_the_key() -> None:
    topology = parse_topology(NODE_WITH_COMMAND.replace("{model}", "{modle}"), "x.toml")
    with pytest.raises(TopologyError, match=r"x.toml: node.u0.command: bad placeholder in '\{modle\}'"):
        build_process_specs(topology, python=PY)


def test_launch_prefix_goes_before_the_node_command_only() -> None:
    topology = load_topology(REPO / "configs/local-1p1d.toml", [
        'node.p0.launch_prefix=["numactl", "-N", "0"]', "node.d0.extra_args=[\"--log-level\", \"debug\"]"])
    by_name = {s.name: s for s in build_process_specs(topology, python=PY, config_path="c")}
    assert by_name["p0"].argv[:5] == ("numactl", "-N", "0", PY, "-m")
    assert by_name["d0"].argv[0] == PY and by_name["d0"].argv[-2:] == ("--log-level", "debug")
    assert by_name["metadata"].argv[0] == PY and by_name["router"].argv[0] == PY


def test_namespace_hosts_launch_locally_with_their_prefix(tmp_path, capsys) -> None:
    """Nodes on network-namespace addresses are a multi-host topology (so a secret is needed),
    but without --ssh the launcher starts them here, each behind its launch_prefix."""
    secret = tmp_path / "cluster.secret"
    assert pdcache_main(["secret", "create", str(secret)]) == 0
    overrides = [f'security.secret_file="{secret}"']
    for name, addr in (("p0", "10.231.0.1"), ("d0", "10.231.0.2")):
        overrides += [f'node.{name}.host="{addr}"',
                      f'node.{name}.launch_prefix=["nsenter", "--net=/run/netns/ns-{name}", "--"]']
    code = pdcache_main(["launch", str(REPO / "configs/local-1p1d.toml"), "--dry-run",
                         *[a for o in overrides for a in ("--set", o)]])
    assert code == 0
    out = capsys.readouterr().out
    assert "ssh" not in out
    lines = [line for line in out.splitlines() if not line.startswith("#")]
    p0 = next(line for line in lines if "prefill" in line)
    assert shlex.split(p0.split("MC_TCP_BIND_ADDRESS=10.231.0.1 ", 1)[1])[:3] == [
        "nsenter", "--net=/run/netns/ns-p0", "--"]
