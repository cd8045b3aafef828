"""The launcher for real: processes, health waits, kill -9 → report + restart, --no-restart,
SIGTERM → nothing left running and every port released, real mooncake_master and metadata service.

Nodes are `tests/launch_stub_node.py` (an HTTP /health server with a child process) started
through the per-node `command` escape hatch, until the node CLIs accept `--config/--node`.
The multi-host test over veth/network namespaces needs the PD nodes and is not here yet.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from tests.net_support import free_ports
from tests.polling import wait_until

STUB = Path(__file__).resolve().parents[1] / "launch_stub_node.py"
PY = sys.executable

pytestmark = pytest.mark.slow


def port_is_free(port: int) -> bool:
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
            return True
        except OSError:
            return False


def alive(pid: int) -> bool:
    """Running (a zombie waiting for a reaper counts as gone)."""
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, ProcessLookupError):
        return False


def stub_node(name: str, port: int, tmp: Path, *flags: str) -> str:
    args = ", ".join(f'"{a}"' for a in flags)
    return f"""
[[node]]
name = "{name}"
role = "unified"
port = {port}
command = ["{{python}}", "{STUB}", "--port", "{{port}}", "--child-pid-file", "{tmp}/{{node}}.child"{", " + args if args else ""}]
"""


LAUNCH = """
[model]
preset = "tiny"

[launch]
health_timeout_s = {timeout}
stop_grace_s = 3.0
restart_backoff_s = 0.3
restart_backoff_max_s = 2.0
"""


class Run:
    """A `pdcache launch` subprocess and what it wrote."""

    def __init__(self, tmp: Path, config_text: str, *flags: str) -> None:
        self.tmp, self.log_dir = tmp, tmp / "logs"
        config = tmp / "topology.toml"
        config.write_text(config_text)
        self.out_path = tmp / "launcher.out"
        self.out = self.out_path.open("wb")
        env = {**os.environ, "MC_LOG_LEVEL": "ERROR"}
        self.proc = subprocess.Popen(
            [PY, "-m", "pdcache", "launch", str(config), "--log-dir", str(self.log_dir), *flags],
            stdout=self.out, stderr=subprocess.STDOUT, env=env, start_new_session=True,
        )

    def output(self) -> str:
        return self.out_path.read_text(errors="replace")

    def state(self) -> dict:
        try:
            return json.loads((self.log_dir / "processes.json").read_text())
        except (OSError, ValueError):
            return {}

    def procs(self) -> dict[str, dict]:
        return {p["name"]: p for p in self.state().get("processes", [])}

    def all_healthy(self) -> bool:
        procs = self.procs()
        return bool(procs) and all(p["state"] == "healthy" for p in procs.values())

    def child_pid(self, node: str) -> int:
        return int((self.tmp / f"{node}.child").read_text())

    def kill_all(self) -> None:
        """Test cleanup: the launcher's group and anything it left (there should be nothing)."""
        for p in self.procs().values():
            if p["pid"]:
                _killpg(p["pid"])
        _killpg(self.proc.pid)
        self.proc.wait(timeout=10)
        self.out.close()


def _killpg(pid: int) -> None:
    try:
        os.killpg(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


@pytest.fixture
def launch(tmp_path: Path) -> Iterator[Callable[..., Run]]:
    runs: list[Run] = []

    def start(config_text: str, *flags: str) -> Run:
        run = Run(tmp_path, config_text, *flags)
        runs.append(run)
        return run

    yield start
    for run in runs:
        run.kill_all()


def test_kill9_is_reported_and_restarted_then_sigterm_leaves_nothing(launch, tmp_path) -> None:
    p0, p1 = free_ports(2)
    run = launch(LAUNCH.format(timeout=30) + stub_node("u0", p0, tmp_path) + stub_node("u1", p1, tmp_path))
    wait_until(run.all_healthy, 30, "both nodes healthy")
    # the state file says healthy a moment before the launcher prints its summary
    wait_until(lambda: "up after" in run.output() and f"http://127.0.0.1:{p0}" in run.output(),
             10, "the launcher's summary with u0's endpoint")
    before = run.procs()
    old_pid, other_pid, old_child = before["u0"]["pid"], before["u1"]["pid"], run.child_pid("u0")

    os.kill(old_pid, signal.SIGKILL)
    wait_until(lambda: run.procs()["u0"]["restarts"] == 1 and run.procs()["u0"]["state"] == "healthy",
             30, "u0 restarted and healthy")
    out = run.output()
    assert f"u0 (unified, pid {old_pid}) exited with code -9" in out
    assert f"stub node on 127.0.0.1:{p0}" in out  # the tail of its log is shown
    assert "u0: healthy again (restart 1)" in out
    after = run.procs()
    assert after["u0"]["pid"] != old_pid and after["u0"]["last_exit"] == -9
    assert after["u1"]["pid"] == other_pid and after["u1"]["restarts"] == 0
    wait_until(lambda: not alive(old_child), 10, "the dead node's child to be killed with its group")
    assert (run.log_dir / "u0.log").read_text().count("=== pdcache launch: start") == 2

    pids = [after["u0"]["pid"], other_pid, run.child_pid("u0"), run.child_pid("u1")]
    run.proc.send_signal(signal.SIGTERM)
    assert run.proc.wait(timeout=20) == 0
    assert "received SIGTERM: stopping everything" in run.output()
    assert not [pid for pid in pids if alive(pid)]
    assert port_is_free(p0) and port_is_free(p1)
    assert {p["state"] for p in run.procs().values()} == {"stopped"}


def test_no_restart_stops_everything_and_exits_nonzero(launch, tmp_path) -> None:
    p0, p1 = free_ports(2)
    run = launch(LAUNCH.format(timeout=30) + stub_node("u0", p0, tmp_path) + stub_node("u1", p1, tmp_path),
                 "--no-restart")
    wait_until(run.all_healthy, 30, "both nodes healthy")
    procs = run.procs()
    survivors = [procs["u0"]["pid"], run.child_pid("u0"), run.child_pid("u1")]
    os.kill(procs["u1"]["pid"], signal.SIGKILL)
    assert run.proc.wait(timeout=20) == 1
    out = run.output()
    assert f"u1 (unified, pid {procs['u1']['pid']}) exited with code -9" in out
    assert "--no-restart: stopping everything" in out
    assert not [pid for pid in survivors if alive(pid)]
    assert port_is_free(p0) and port_is_free(p1)
    assert run.procs()["u1"]["state"] == "failed"


def test_health_deadline_fails_with_the_culprit_named(launch, tmp_path) -> None:
    (port,) = free_ports(1)
    run = launch(LAUNCH.format(timeout=2) + stub_node("u0", port, tmp_path, "--never-ready"))
    assert run.proc.wait(timeout=20) == 1
    out = run.output()
    assert f"u0: not healthy after 2s (http://127.0.0.1:{port}/health)" in out
    assert not alive(run.procs()["u0"]["pid"]) and port_is_free(port)


def _foreign_health_server(port: int) -> subprocess.Popen:
    """Another stack's service: answers GET /health with 200 on `port`."""
    code = ("import http.server as h\n"
            "class H(h.BaseHTTPRequestHandler):\n"
            "    def do_GET(self):\n"
            "        self.send_response(200); self.end_headers(); self.wfile.write(b'ok')\n"
            "    def log_message(self, *a): pass\n"
            f"h.HTTPServer(('127.0.0.1', {port}), H).serve_forever()\n")
    proc = subprocess.Popen([PY, "-c", code])
    wait_until(lambda: not port_is_free(port), 10, "the foreign server to listen")
    return proc


def test_a_taken_port_fails_the_launch_naming_port_holder_and_key(launch, tmp_path) -> None:
    """Another stack answers /health 200 on the node's port (a health check alone would call
    our node healthy): the launch stops before starting it, naming the port, the holder and
    the --set key that moves it."""
    (port,) = free_ports(1)
    other = _foreign_health_server(port)
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=5) as sock:
            sock.sendall(b"GET /health HTTP/1.0\r\n\r\n")
            assert sock.recv(64).startswith(b"HTTP/1.0 200")  # it would pass the check
        run = launch(LAUNCH.format(timeout=30) + stub_node("u0", port, tmp_path))
        assert run.proc.wait(timeout=20) == 1
        out = run.output()
        assert f"u0: port {port} on 127.0.0.1 is already in use by pid {other.pid}" in out
        assert "--set node.u0.port=" in out
        assert "healthy" not in out and "started pid" not in out
    finally:
        other.kill()
        other.wait(5)


def test_a_port_answered_by_another_process_is_not_our_node(launch, tmp_path) -> None:
    """The node started answers nothing itself; a process outside its tree serves its port
    (what a stray service looks like once our process is up): not healthy, the launch stops
    naming both pids."""
    (port,) = free_ports(1)
    run = launch(LAUNCH.format(timeout=30) + stub_node("u0", port, tmp_path, "--foreign-listener"))
    try:
        assert run.proc.wait(timeout=30) == 1
        out = run.output()
        orphan = run.child_pid("u0")
        assert f"answers, but from pid {orphan}" in out and "not from the process started" in out
        assert "u0: healthy" not in out
    finally:
        _killpg(run.child_pid("u0"))


def test_a_node_failing_every_start_stops_the_launch_with_its_log(launch, tmp_path) -> None:
    (port,) = free_ports(1)
    text = LAUNCH.format(timeout=60) + "max_failures_in_row = 3\n"  # in [launch]
    run = launch(text + stub_node("u0", port, tmp_path, "--exit-at-once"))
    assert run.proc.wait(timeout=30) == 1
    out = run.output()
    assert out.count("u0 (unified") == 3  # three deaths reported, each with its log tail
    assert "stub node: failing on start" in out
    assert "u0: failed 3 times in a row without becoming healthy" in out
    assert run.procs()["u0"]["state"] == "failed"


def test_slow_start_is_waited_for_with_progress(launch, tmp_path) -> None:
    (port,) = free_ports(1)
    run = launch(LAUNCH.format(timeout=30) + stub_node("u0", port, tmp_path, "--ready-after", "5.5"))
    wait_until(run.all_healthy, 30, "u0 healthy")
    assert "waiting for u0 (starting)" in run.output()
    run.proc.send_signal(signal.SIGINT)
    assert run.proc.wait(timeout=20) == 0


def test_missing_executable_fails_cleanly(launch, tmp_path) -> None:
    (port,) = free_ports(1)
    text = LAUNCH.format(timeout=10) + f"""
[[node]]
name = "u0"
role = "unified"
port = {port}
command = ["/nonexistent/pdcache-node"]
"""
    run = launch(text)
    assert run.proc.wait(timeout=20) == 1
    assert "u0: cannot start '/nonexistent/pdcache-node'" in run.output()


@pytest.mark.mooncake
@pytest.mark.skipif(shutil.which("mooncake_master") is None and not (Path(PY).parent / "mooncake_master").exists(),
                    reason="mooncake_master is not installed (pip install mooncake-transfer-engine-non-cuda)")
def test_real_mooncake_master_starts_first_and_is_stopped(launch, tmp_path) -> None:
    rpc, http, metrics, node = free_ports(4)
    text = LAUNCH.format(timeout=30) + f"""
[storage]
backend = "mooncake"

[storage.mooncake]
master = "127.0.0.1:{rpc}"
metadata_server = "http://127.0.0.1:{http}/metadata"
metrics_port = {metrics}
""" + stub_node("u0", node, tmp_path)
    run = launch(text)
    wait_until(run.all_healthy, 30, "mooncake_master and u0 healthy")
    procs = run.procs()
    assert list(procs) == ["mooncake_master", "u0"]
    out = run.output()
    assert out.index("mooncake_master: healthy") < out.index("u0: started")
    master_pid = procs["mooncake_master"]["pid"]
    run.proc.send_signal(signal.SIGTERM)
    assert run.proc.wait(timeout=30) == 0
    assert not alive(master_pid) and not alive(procs["u0"]["pid"])
    assert all(port_is_free(p) for p in (rpc, http, metrics, node))


@pytest.mark.skipif(importlib.util.find_spec("pdcache.offload_manager.storage.metadata_cli") is None,
                    reason="pdcache metadata-server is not in this build yet")
def test_real_metadata_service_starts_before_nodes(launch, tmp_path) -> None:
    meta, p0, p1 = free_ports(3)
    text = LAUNCH.format(timeout=60) + f"""
[storage]
backend = "hf3fs"
path = "{tmp_path}/storage"
metadata = "tcp://127.0.0.1:{meta}"

[storage.metadata_service]
state_dir = "{tmp_path}/metadata"
""" + stub_node("u0", p0, tmp_path) + stub_node("u1", p1, tmp_path)
    run = launch(text)
    wait_until(run.all_healthy, 60, "metadata service and nodes healthy")
    assert list(run.procs()) == ["metadata", "u0", "u1"]
    meta_pid = run.procs()["metadata"]["pid"]
    run.proc.send_signal(signal.SIGTERM)
    assert run.proc.wait(timeout=30) == 0
    assert not alive(meta_pid) and port_is_free(meta)


@pytest.mark.skipif(importlib.util.find_spec("pdcache.server.cli") is None,
                    reason="pdcache serve is not in this build yet")
def test_real_unified_server_serves_then_stops(launch, tmp_path) -> None:
    import httpx

    (port,) = free_ports(1)
    text = LAUNCH.format(timeout=120) + f"""
[[node]]
name = "u0"
role = "unified"
port = {port}
command = ["{{python}}", "-m", "pdcache", "serve", "--model", "{{model}}", "--host", "{{host}}",
           "--port", "{{port}}", "--page-size", "{{page_size}}", "--name", "{{node}}"]
"""
    run = launch(text)
    wait_until(run.all_healthy, 120, "pdcache serve healthy")
    body = {"input_ids": list(range(1, 40)), "sampling_params": {"max_new_tokens": 4, "temperature": 0}}
    reply = httpx.post(f"http://127.0.0.1:{port}/generate", json=body, timeout=60)
    assert reply.status_code == 200 and len(reply.json()["output_ids"]) == 4
    pid = run.procs()["u0"]["pid"]
    run.proc.send_signal(signal.SIGTERM)
    assert run.proc.wait(timeout=30) == 0
    assert not alive(pid) and port_is_free(port)


PD_MODULES = ("pdcache.prefill_node.cli", "pdcache.decode_node.cli", "pdcache.router.cli")


@pytest.mark.skipif(any(importlib.util.find_spec(m) is None for m in PD_MODULES),
                    reason="the prefill/decode node and router CLIs are not in this build yet")
def test_local_1p1d_serves_two_turns_reusing_decode_pages_then_stops_clean(launch, tmp_path) -> None:
    """The issue's main scenario: `pdcache launch configs/local-1p1d.toml --set model.preset=tiny`."""
    import httpx

    router, p0, boot, d0, meta = free_ports(5)
    config = (Path(__file__).resolve().parents[2] / "configs/local-1p1d.toml").read_text()
    sets = [f"router.port={router}", f"node.p0.port={p0}", f"node.p0.bootstrap_port={boot}",
            f"node.d0.port={d0}", f'storage.metadata="tcp://127.0.0.1:{meta}"',
            f'storage.path="{tmp_path}/storage"', f'storage.metadata_service.state_dir="{tmp_path}/meta"',
            'storage.capacity="256MiB"', "model.preset=tiny", "launch.health_timeout_s=180"]
    run = launch(config, *[x for s in sets for x in ("--set", s)])
    wait_until(run.all_healthy, 180, "metadata, p0, d0 and router healthy")
    page = 16
    prompt = [(7 * i) % 200 + 3 for i in range(100)]
    params = {"max_new_tokens": 3 * page, "temperature": 0, "ignore_eos": True}
    url = f"http://127.0.0.1:{router}/generate"
    first = httpx.post(url, json={"input_ids": prompt, "sampling_params": params}, timeout=120).json()
    answer = first["output_ids"]
    # No pause: decode writes the answer asynchronously, and pending_wait (on in this config)
    # makes the next turn wait for the pages still being written (design §4.10).
    second_ids = prompt + answer + [5, 6, 7, 8]
    second = httpx.post(url, json={"input_ids": second_ids, "sampling_params": params}, timeout=120).json()
    meta_info = second["meta_info"]
    reused = (len(prompt) + len(answer)) // page * page
    assert meta_info["cached_tokens"] >= reused - page
    assert meta_info["cached_tokens_details"]["storage_from_decode"] > 0
    pids = [p["pid"] for p in run.procs().values()]
    run.proc.send_signal(signal.SIGTERM)
    assert run.proc.wait(timeout=60) == 0
    assert not [pid for pid in pids if alive(pid)]
    assert all(port_is_free(p) for p in (router, p0, boot, d0, meta))


@pytest.mark.skipif(importlib.util.find_spec("pdcache.server.cli") is None,
                    reason="pdcache serve is not in this build yet")
def test_launched_node_gets_the_launchers_0600_secret_and_refuses_requests_without_it(
        launch, tmp_path) -> None:
    import stat

    import httpx

    from pdcache.utils.secret import derive_key, load_secret

    (port,) = free_ports(1)
    run = launch(LAUNCH.format(timeout=120) + f"""
[[node]]
name = "u0"
role = "unified"
port = {port}
""")
    wait_until(run.all_healthy, 120, "pdcache serve healthy (its /health needs no credential)")
    secret_path = run.log_dir / "cluster.secret"
    assert stat.S_IMODE(secret_path.stat().st_mode) == 0o600
    # the logs (errors may quote requests) and every command line: the owner's only
    for path in (run.log_dir / "u0.log", run.log_dir / "processes.json"):
        assert stat.S_IMODE(path.stat().st_mode) == 0o600, path
    token = derive_key(load_secret(secret_path), "node-http").hex()
    body = {"input_ids": list(range(1, 30)), "sampling_params": {"max_new_tokens": 3}}
    url = f"http://127.0.0.1:{port}/generate"
    refused = httpx.post(url, json=body, timeout=60)
    assert refused.status_code == 401 and refused.json()["error"]["type"] == "authentication_error"
    served = httpx.post(url, json=body, timeout=60, headers={"Authorization": f"Bearer {token}"})
    assert served.status_code == 200 and len(served.json()["output_ids"]) == 3
    run.proc.send_signal(signal.SIGTERM)
    assert run.proc.wait(timeout=30) == 0
