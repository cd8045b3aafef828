"""The launcher's restart accounting and ownership checks, driven through its API (no
`pdcache launch` subprocess): processes are small shell/Python commands."""

from __future__ import annotations

import contextlib
import io
import os
import signal
import socket
import sys
import threading
import time

from pdcache.launch.launcher import STAGE_NODES, HealthCheck, Launcher, ProcessSpec
from tests.polling import scaled_limit


def _run_until(launcher: Launcher, out: io.StringIO, done: str, times: int,
               limit_s: float) -> int:
    """Run `launcher` (main thread: it installs signal handlers) until `done` appeared
    `times` times in its output, then stop it as a SIGTERM would."""
    def watch() -> None:
        deadline = time.monotonic() + scaled_limit(limit_s)
        while out.getvalue().count(done) < times and time.monotonic() < deadline:
            time.sleep(0.05)
        launcher.stop_signal = 15

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    code = launcher.run()
    watcher.join(5)
    return code


def test_a_process_without_checks_that_ran_a_while_is_restarted_every_time(tmp_path) -> None:
    """A `health = "none"` process is healthy once started; crashes far apart (each after
    longer than the longest backoff) were counted as failures in a row: the third stopped
    the whole deployment. Each is a fresh first failure now."""
    crash = (sys.executable, "-c", "import time; time.sleep(0.5); raise SystemExit(3)")
    out = io.StringIO()
    launcher = Launcher([ProcessSpec("n0", "unified", "127.0.0.1", crash, STAGE_NODES, ())],
                        tmp_path / "logs", backoff_s=0.05, backoff_max_s=0.2, out=out,
                        poll_s=0.05, max_failures_in_row=3)
    code = _run_until(launcher, out, "restarting in", 4, limit_s=30)
    assert "times in a row" not in out.getvalue()
    assert out.getvalue().count("restarting in") >= 4 and code == 0


def test_an_ssh_part_is_healthy_though_its_servers_are_not_its_children(tmp_path) -> None:
    """An ssh part's servers run under the remote sshd, never in the local ssh client's
    tree; with the launch run from one of the topology's hosts the ownership check saw
    them (or anything on that port number) as another process's and failed the launch."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    pid_file = tmp_path / "server.pid"
    # the ssh client is the launcher's child; the server it leads to is not (reparented)
    command = (f"({sys.executable} -m http.server {port} --bind 127.0.0.1 >/dev/null 2>&1 & "
               f"echo $! > {pid_file}); sleep 30")
    spec = ProcessSpec("ssh-127.0.0.1", "ssh", "127.0.0.1", ("sh", "-c", command), 0,
                       (HealthCheck("tcp", "127.0.0.1", port),))
    out = io.StringIO()
    launcher = Launcher([spec], tmp_path / "logs", out=out, poll_s=0.1, health_timeout_s=20,
                        stop_grace_s=2)
    try:
        code = _run_until(launcher, out, "ssh-127.0.0.1: healthy", 1, limit_s=20)
    finally:
        if pid_file.exists():  # gone already when the launcher stopped its group
            with contextlib.suppress(ProcessLookupError):
                os.kill(int(pid_file.read_text()), signal.SIGTERM)
    assert "not from the process started" not in out.getvalue()
    assert "ssh-127.0.0.1: healthy" in out.getvalue() and code == 0
