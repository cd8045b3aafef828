"""What a benchmark (or the chaos soak) starts and measures: `StackProcess`, one `python -m
pdcache COMMAND ...` child, and `launched`, a whole topology through `pdcache launch`.

`StackProcess` starts the child (in its own session when asked, so that its process group is
signalled as one: the launcher tears its nodes down that way), pumps its output into a bounded
buffer and a log file, waits for readiness — a marker on its output (`wait_for`), every HTTP
endpoint's `/health` (`wait_healthy`) or a TCP port accepting (`wait_port`) — and stops it:
SIGTERM, then SIGKILL once the timeout passed.

`launched` is the topology form every launching bench shares (`bench compare`, `bench goodput`,
`pdcache demo`, `pdcache chaos`): CONFIG `[LABEL=]PATH[+KEY=VALUE...]` (`ConfigRun`), its
endpoints from the topology file, a refusal when a port is already taken, `pdcache launch`
with logs under the run's directory, healthy within `--startup-timeout`, stopped on exit.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import http.client
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any


def healthy(url: str) -> bool:
    """`GET {url}/health` answers 200 within 2 s."""
    try:
        with urllib.request.urlopen(f"{url}/health", timeout=2) as resp:
            return resp.status == 200
    except (OSError, http.client.HTTPException):  # not up, or not HTTP (another listener)
        return False


def port_in_use(url: str) -> bool:
    host, port = url.removeprefix("http://").rsplit(":", 1)
    with socket.socket() as s:
        s.settimeout(1.0)
        return s.connect_ex((host, int(port))) == 0


def accepts(host: str, port: int) -> bool:
    try:
        socket.create_connection((host, port), timeout=0.5).close()
        return True
    except OSError:
        return False


class StackProcess:
    """One `python -m pdcache ARGV` child until `stop()`.

    Owns the child (`proc`), the daemon thread that pumps its output into `lines` (the last
    200) and the log file, and `found` (marker -> the rest of the first output line holding
    it). The pump thread is the only writer of `lines`, `found` and the log; `_changed` (a
    Condition) guards `lines` and `found` and wakes `wait_for`."""

    def __init__(
        self,
        argv: Sequence[str],
        *,
        watch: Sequence[str] = (),
        env: Mapping[str, str] | None = None,
        log_path: Path | None = None,
        own_group: bool = False,
        quiet: bool = False,
    ) -> None:
        self.argv = [sys.executable, "-m", "pdcache", *argv]
        self.own_group = own_group
        self.lines: collections.deque[str] = collections.deque(maxlen=200)
        self.found: dict[str, str] = {}
        self._watch = tuple(watch)
        self._changed = threading.Condition()
        self._pumped = False
        output: Any = subprocess.DEVNULL if quiet else subprocess.PIPE
        log: IO[str] | None = None
        if log_path is not None:
            log_path.parent.mkdir(parents=True, exist_ok=True)
            log = log_path.open("w")
        self.proc = subprocess.Popen(
            self.argv, stdout=output, stderr=subprocess.DEVNULL if quiet else subprocess.STDOUT,
            text=True, errors="replace", env={**os.environ, **(env or {})}, start_new_session=own_group)
        if quiet:
            self._pumped = True
            if log is not None:
                log.close()
        else:
            threading.Thread(target=self._pump, args=(log,), daemon=True).start()

    def _pump(self, log: IO[str] | None) -> None:
        assert self.proc.stdout is not None
        try:
            for line in self.proc.stdout:
                with self._changed:
                    self.lines.append(line)
                if log is not None:
                    log.write(line)
                    log.flush()
                self._match(line)
        finally:
            if log is not None:
                log.close()
            with self._changed:
                self._pumped = True  # the output ended: the child exited (or closed it)
                self._changed.notify_all()

    def _match(self, line: str) -> None:
        for marker in self._watch:
            if marker in line and marker not in self.found:
                with self._changed:
                    self.found[marker] = line.split(marker, 1)[1].strip()
                    self._changed.notify_all()

    @property
    def name(self) -> str:
        """The pdcache command it runs (`serve`, `launch`, ...)."""
        return self.argv[3]

    def tail(self, lines: int = 40) -> str:
        with self._changed:
            return "".join(list(self.lines)[-lines:])

    def wait_for(self, marker: str, timeout_s: float) -> str:
        """The rest of the first output line that holds `marker` (one of `watch`), once it
        came. RuntimeError with the output's tail when the child ended or timed out first."""
        with self._changed:
            self._changed.wait_for(lambda: marker in self.found or self._pumped, timeout_s)
            if marker in self.found:
                return self.found[marker]
        self.stop()
        raise RuntimeError(f"pdcache {self.name} did not start:\n" + self.tail())

    def wait_healthy(self, urls: Sequence[str], timeout_s: float) -> None:
        """Every URL's `/health` answers 200. RuntimeError if the child exits first,
        TimeoutError after `timeout_s`."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(
                    f"launcher exited with {self.proc.returncode} before the stack was up")
            if all(healthy(u) for u in urls):
                return
            time.sleep(0.5)
        raise TimeoutError(f"not healthy after {timeout_s:.0f}s: {', '.join(urls)}")

    def wait_port(self, host: str, port: int, timeout_s: float) -> None:
        """The child accepts TCP connections on host:port; RuntimeError (child stopped) if it
        exits or does not within `timeout_s`."""
        deadline = time.monotonic() + timeout_s
        while not accepts(host, port):
            if time.monotonic() > deadline or self.proc.poll() is not None:
                self.stop()
                raise RuntimeError(f"pdcache {self.name} did not start")
            time.sleep(0.1)

    def stop(self, timeout_s: float = 15.0) -> None:
        """SIGTERM (to the whole process group when the child has its own), SIGKILL after
        `timeout_s`."""
        if self.proc.poll() is not None:
            return
        self._signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self._signal(signal.SIGKILL)
            self.proc.wait(10)

    def _signal(self, signum: int) -> None:
        if self.own_group:
            os.killpg(self.proc.pid, signum)
        else:
            self.proc.send_signal(signum)


# ---- a whole topology -------------------------------------------------------------------------


@dataclass(frozen=True)
class ConfigRun:
    """One topology to launch: a label, its file and its `--set` overrides."""

    label: str
    path: Path
    overrides: tuple[str, ...]


def parse_config_arg(text: str, common: Sequence[str]) -> ConfigRun:
    """CONFIG `[LABEL=]PATH[+KEY=VALUE...]`, `common` overrides first."""
    head, *own = text.split("+")
    label, sep, path = head.partition("=")
    if not sep:
        label, path = Path(head).stem, head
    return ConfigRun(label, Path(path), (*common, *own))


def endpoints_of(run: ConfigRun) -> tuple[str, list[str]]:
    """(front door URL, every HTTP endpoint URL) of the topology."""
    from pdcache.config import load_topology

    topology = load_topology(run.path, run.overrides)
    urls = [n.url for n in topology.nodes if n.health == "http"]
    front = topology.router.url if topology.router is not None else topology.nodes[0].url
    return front, sorted({*urls, front})


def add_launch_options(parser: argparse.ArgumentParser, startup_timeout_s: float = 600.0,
                       set_help: str = "override for every config (repeatable)") -> None:
    """The options of every command that launches topologies (`launched`): `--set` overrides
    (args.overrides), `--startup-timeout`, `--stop-timeout`."""
    parser.add_argument("--set", dest="overrides", action="append", default=[],
                        metavar="KEY=VALUE", help=set_help)
    parser.add_argument("--startup-timeout", type=float, default=startup_timeout_s,
                        help="seconds for a topology to become healthy")
    parser.add_argument("--stop-timeout", type=float, default=60.0,
                        help="seconds for the launcher to stop the topology")


class LaunchError(Exception):
    """A topology could not be started (bad file, ports taken, not healthy in time)."""


@dataclass(frozen=True)
class LaunchedStack:
    """A running topology: its front door, every HTTP endpoint and the launcher process."""

    front: str
    urls: list[str]
    launcher: StackProcess

    def wait_healthy(self, timeout_s: float) -> None:
        self.launcher.wait_healthy(self.urls, timeout_s)


def start_topology(run: ConfigRun, run_dir: Path, restart: bool = False) -> StackProcess:
    """`pdcache launch` of `run` in its own process group (its output in RUN_DIR/launch.log,
    the nodes' logs and processes.json in RUN_DIR/logs). Without `restart` a process that
    dies stops the stack (a benchmark must not measure a restart); `pdcache chaos` kills
    processes on purpose and wants them back."""
    argv = ["launch", str(run.path), *([] if restart else ["--no-restart"]),
            "--log-dir", str(run_dir / "logs")]
    for item in run.overrides:
        argv += ["--set", item]
    env = {"MC_TCP_BIND_ADDRESS": os.environ.get("MC_TCP_BIND_ADDRESS", "127.0.0.1"),
           "MC_LOG_LEVEL": os.environ.get("MC_LOG_LEVEL", "ERROR")}
    return StackProcess(argv, env=env, log_path=run_dir / "launch.log", own_group=True)


SIGTERM_EXIT_CODE = 128 + signal.SIGTERM


@contextlib.contextmanager
def sigterm_raises_exit() -> Iterator[None]:
    """While inside: SIGTERM raises SystemExit(143) in the main thread, so the `finally`
    blocks on the way out run — a stack started in its own process group (`StackProcess`,
    `own_group`) would otherwise outlive a `timeout` or a supervisor stopping its owner.
    Does nothing off the main thread (Python delivers signals there) or when a handler of
    the caller's own is installed; the default comes back on exit (unless the body installed
    a handler of its own). Only the first SIGTERM raises: later ones are ignored until the
    exit, so they cannot cut the stop short."""
    if threading.current_thread() is not threading.main_thread() \
            or signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL:
        yield
        return

    def exit_now(signum: int, _frame: Any) -> None:
        # once: a second SIGTERM (a supervisor repeating itself) must not interrupt the
        # stop the first one started — it would skip stopping the stack's group
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, exit_now)
    try:
        yield
    finally:
        if signal.getsignal(signal.SIGTERM) in (exit_now, signal.SIG_IGN):
            signal.signal(signal.SIGTERM, signal.SIG_DFL)


@contextlib.contextmanager
def launched(run: ConfigRun, run_dir: Path, startup_timeout_s: float, stop_timeout_s: float,
             restart: bool = False, announce: bool = True) -> Iterator[LaunchedStack]:
    """Start `run`'s topology (logs under `run_dir`), wait until every HTTP endpoint is
    healthy, yield it, and stop it on exit — a SIGTERM to this process included
    (`sigterm_raises_exit`). LaunchError names the problem (and the logs) when it cannot
    start. `announce`: say on stderr that it is starting."""
    with sigterm_raises_exit():
        with _launched(run, run_dir, startup_timeout_s, stop_timeout_s, restart,
                       announce) as stack:
            yield stack


@contextlib.contextmanager
def _launched(run: ConfigRun, run_dir: Path, startup_timeout_s: float, stop_timeout_s: float,
              restart: bool, announce: bool) -> Iterator[LaunchedStack]:
    try:
        front, urls = endpoints_of(run)
    except ValueError as exc:  # TopologyError names file, key and problem
        raise LaunchError(str(exc)) from exc
    busy = [u for u in urls if port_in_use(u)]
    if busy:
        raise LaunchError(f"already in use before launch (another stack?): {', '.join(busy)}")
    launcher = start_topology(run, run_dir, restart)
    try:
        if announce:
            print(f"[compare] {run.label}: starting {run.path} ...", file=sys.stderr, flush=True)
        try:
            launcher.wait_healthy(urls, startup_timeout_s)
        except (RuntimeError, TimeoutError, OSError) as exc:
            raise LaunchError(f"{exc} (logs: {run_dir / 'logs'})") from exc
        yield LaunchedStack(front, urls, launcher)
    finally:
        launcher.stop(stop_timeout_s)
