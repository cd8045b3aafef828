"""Local launcher: turns a Topology into processes, starts them in order, supervises, stops them.

`build_process_specs` is pure (a topology in, a list of `ProcessSpec`s out, in dependency order:
metadata service and `mooncake_master`, then the nodes, then the router), so `--dry-run`,
`--host` and `--ssh` are tested by looking at the specs. `Launcher` owns the child processes:
each runs in its own session (process group) with its own log file; it waits for every stage to
answer its health check before starting the next, restarts dead processes with exponential
backoff (or stops everything with `restart=False`), writes `processes.json` on every change, and
on SIGINT/SIGTERM/SIGHUP stops every group it started (SIGTERM, then SIGKILL after a grace
period). The launcher is single-threaded: all state lives in the main loop.
"""

from __future__ import annotations

import ctypes
import errno
import http.client
import ipaddress
import json
import os
import shlex
import signal
import socket
import ssl
import subprocess
import sys
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, BinaryIO, Literal

import psutil

from pdcache.config import NodeSpec, Topology, TopologyError
from pdcache.config.schema import split_host_port
from pdcache.offload_manager.storage.etcd_cluster import member_argv, member_name
from pdcache.offload_manager.storage.lifecycle import StorageEviction

NODE_SUBCOMMANDS = {"prefill": "prefill", "decode": "decode", "unified": "serve"}
STAGE_SERVICES, STAGE_NODES, STAGE_ROUTER = 0, 1, 2
_PLACEHOLDERS = ("python", "config", "node", "host", "port", "bootstrap_port", "model", "page_size",
                 "secret_file")
SECRET_FILE_NAME = "cluster.secret"


@dataclass(frozen=True)
class HealthCheck:
    """Ready when an HTTP GET of `path` answers 200 (kind http) or a TCP connect succeeds."""

    kind: Literal["http", "tcp"]
    host: str
    port: int
    path: str = "/health"
    token: str | None = field(default=None, repr=False)  # node credential (cluster secret)
    tls: bool = False  # https (a router serving TLS; its certificate is not verified here)

    def describe(self) -> str:
        if self.kind == "http":
            return f"{'https' if self.tls else 'http'}://{self.host}:{self.port}{self.path}"
        return f"tcp://{self.host}:{self.port}"


@dataclass(frozen=True)
class PortUse:
    """A port a process listens on, and the topology key (for `--set`) that moves it."""

    host: str
    port: int
    key: str


@dataclass(frozen=True)
class ProcessSpec:
    """One process to run: command, where it runs, how to tell it is up, what it serves."""

    name: str
    role: str  # etcd | metadata | mooncake_master | prefill | decode | unified | router | ssh
    host: str
    argv: tuple[str, ...]
    stage: int
    health: tuple[HealthCheck, ...] = ()
    endpoints: Mapping[str, str] = field(default_factory=dict)
    env: Mapping[str, str] = field(default_factory=dict)  # added to the launcher's environment
    ports: tuple[PortUse, ...] = ()  # checked free before a local start

    def shell_line(self) -> str:
        env = " ".join(f"{k}={shlex.quote(v)}" for k, v in self.env.items())
        return (env + " " if env else "") + shlex.join(self.argv)


# --------------------------------------------------------------------------- specs



# Logs and processes.json hold what processes print (errors may quote requests) and every
# command line: the owner's only
LOG_DIR_MODE = 0o700
LOG_FILE_MODE = 0o600


def _private_append(path: Path) -> BinaryIO:
    """`path` opened for appending, created with LOG_FILE_MODE (an existing file keeps its mode)."""
    return os.fdopen(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, LOG_FILE_MODE), "ab")


def build_process_specs(
    topology: Topology, python: str | None = None, config_path: str | None = None
) -> list[ProcessSpec]:
    """Every process of the topology, in start order. Raises TopologyError on a bad command."""
    python = python or topology.launch.python or sys.executable
    config = config_path or str(topology.source.resolve())
    specs = _service_specs(topology, python)
    specs += [_node_spec(topology, node, python, config) for node in topology.nodes]
    if topology.router is not None:
        specs.append(_router_spec(topology, python, config))
    return specs


def _service_specs(topology: Topology, python: str) -> list[ProcessSpec]:
    storage, specs = topology.storage, []
    if storage.uses_etcd and storage.etcd.start:
        specs += etcd_specs(topology)
    if storage.uses_metadata_service and storage.metadata_service.start:
        replicas = storage.metadata_addresses
        for index, (host, port) in enumerate(replicas):
            name = "metadata" if len(replicas) == 1 else f"metadata-{index}"
            specs.append(_metadata_spec(topology, python, name, host, port))
    if storage.backend == "mooncake" and storage.mooncake.start_master:
        specs += _mooncake_master_specs(topology, python)
    return specs


def _metadata_spec(topology: Topology, python: str, name: str, host: str, port: int) -> ProcessSpec:
    """One `pdcache metadata-server` (a replica, with store etcd)."""
    bind = topology.storage.metadata_service.bind_host or host
    argv = (python, "-m", "pdcache", "metadata-server", *metadata_server_args(topology, host, port))
    return ProcessSpec(name, "metadata", host, argv, STAGE_SERVICES, (HealthCheck("tcp", host, port),),
                       {"metadata": f"tcp://{host}:{port}"},
                       ports=(PortUse(bind, port, "storage.metadata"),))


def metadata_server_args(topology: Topology, host: str, port: int) -> tuple[str, ...]:
    """`pdcache metadata-server` flags of the replica at host:port, its secret file included
    (`--render sglang` rendered none: a network-reachable service without authentication)."""
    storage, service = topology.storage, topology.storage.metadata_service
    args: tuple[str, ...] = ("--host", service.bind_host or host, "--port", str(port),
                             "--state-dir", service.state_dir)
    if service.store == "etcd":
        args += ("--store", "etcd", "--etcd-endpoints", ",".join(storage.etcd.endpoints),
                 "--etcd-prefix", storage.etcd.prefix, "--lease-ttl", str(service.lease_ttl_s),
                 "--advertise", f"tcp://{host}:{port}")
    if topology.security.secret_file is not None:
        args += ("--secret-file", topology.security.secret_file)
    return args + tuple(StorageEviction(
        storage.eviction, storage.session_protect_share, storage.session_protect_bytes,
        storage.session_idle_s).server_argv())


def etcd_specs(topology: Topology) -> list[ProcessSpec]:
    """One etcd member per `[storage.etcd] endpoints` entry (peer port = client port + 1)."""
    etcd = topology.storage.etcd
    endpoints = [split_host_port(e) for e in etcd.endpoints]
    specs = []
    for index, (host, port) in enumerate(endpoints):
        # etcd listens on addresses only: a member named by a host name listens on all
        listen = host if _is_ip(host) else "0.0.0.0"
        argv = member_argv(endpoints, index, f"{etcd.data_dir}/{member_name(index)}",
                           listen_host=listen)
        specs.append(ProcessSpec(f"etcd-{index}", "etcd", host, tuple(argv), STAGE_SERVICES,
                                 (HealthCheck("tcp", host, port),), {"client": f"{host}:{port}"},
                                 ports=(PortUse(host, port, "storage.etcd.endpoints"),
                                        PortUse(host, port + 1, "storage.etcd.endpoints"))))
    return specs


def _is_ip(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return False
    return True


def mooncake_master_argv(topology: Topology, executable: str = "mooncake_master",
                         index: int = 0) -> tuple[str, ...]:
    """Master `index`'s flags (its gflags: rpc_address/rpc_port, embedded HTTP metadata server;
    with ha, leader election and the op-log on [storage.etcd]; master i's metrics port is
    metrics_port + i)."""
    spec = topology.storage.mooncake
    host, port = spec.master_addresses[index]
    argv = [executable, f"--rpc_address={host}", f"--rpc_port={port}",
            f"--metrics_host={host}", f"--metrics_port={spec.metrics_port + index}"]
    http = spec.http_metadata_address
    if http is not None:
        argv += ["--enable_http_metadata_server=true", f"--http_metadata_server_host={http[0]}",
                 f"--http_metadata_server_port={http[1]}"]
    if spec.ha:
        argv += ["--enable_ha=true", "--ha_backend_type=etcd",
                 f"--etcd_endpoints={';'.join(topology.storage.etcd.endpoints)}",
                 "--enable_oplog=true", f"--cluster_id={spec.cluster_id}"]
    return tuple(argv)


def _mooncake_master_specs(topology: Topology, python: str) -> list[ProcessSpec]:
    spec = topology.storage.mooncake
    beside_python = Path(python).parent / "mooncake_master"
    executable = str(beside_python) if beside_python.exists() else "mooncake_master"
    masters = spec.master_addresses
    out = []
    for index, (host, port) in enumerate(masters):
        # a standby master (ha) opens its rpc port only once it leads: ready = its metrics port
        metrics = spec.metrics_port + index
        checks = [HealthCheck("tcp", host, metrics if spec.ha else port)]
        ports = [PortUse(host, port, "storage.mooncake.master"),
                 PortUse(host, metrics, "storage.mooncake.metrics_port")]
        if spec.http_metadata_address is not None:
            checks.append(HealthCheck("tcp", *spec.http_metadata_address))
            ports.append(PortUse(*spec.http_metadata_address, "storage.mooncake.metadata_server"))
        endpoints = {"rpc": f"{host}:{port}", "metadata": spec.metadata_server}
        name = "mooncake_master" if len(masters) == 1 else f"mooncake_master-{index}"
        out.append(ProcessSpec(name, "mooncake_master", host,
                               mooncake_master_argv(topology, executable, index), STAGE_SERVICES,
                               tuple(checks), endpoints, {"MC_TCP_BIND_ADDRESS": host},
                               tuple(ports)))
    return out


def _pdcache_argv(python: str, sub: str, config: str, name: str, topology: Topology) -> list[str]:
    argv = [python, "-m", "pdcache", sub, "--config", config, "--node", name]
    for item in topology.overrides:
        argv += ["--set", item]
    return argv


def _node_spec(topology: Topology, node: NodeSpec, python: str, config: str) -> ProcessSpec:
    if node.command is not None:
        argv = [_fill(arg, topology, node, python, config) for arg in node.command]
    else:
        argv = _pdcache_argv(python, NODE_SUBCOMMANDS[node.role], config, node.name, topology)
    argv = [*node.launch_prefix, *argv, *node.extra_args]
    token = node_token(topology)
    checks = () if node.health == "none" else (HealthCheck(node.health, node.host, node.port,  # type: ignore[arg-type]
                                                           token=token),)
    endpoints = {"http": node.url}
    if node.bootstrap_address:
        endpoints["bootstrap"] = node.bootstrap_address
    env = {"MC_TCP_BIND_ADDRESS": node.host, **node.env}
    ports = [PortUse(node.host, node.port, f"node.{node.name}.port")]
    if node.bootstrap_port:
        ports.append(PortUse(node.host, node.bootstrap_port, f"node.{node.name}.bootstrap_port"))
    return ProcessSpec(node.name, node.role, node.host, tuple(argv), STAGE_NODES, checks,
                       endpoints, env, tuple(ports))


def _fill(arg: str, topology: Topology, node: NodeSpec, python: str, config: str) -> str:
    values = {"python": python, "config": config, "node": node.name, "host": node.host,
              "port": node.port, "bootstrap_port": node.bootstrap_port or "",
              "model": topology.model.ref, "page_size": node.cache.page_size,
              "secret_file": topology.security.secret_file or ""}
    try:
        return arg.format_map(values)
    except (KeyError, ValueError, IndexError) as exc:
        raise TopologyError(topology.source, f"node.{node.name}.command",
                            f"bad placeholder in {arg!r} ({exc}); known: "
                            + ", ".join("{" + p + "}" for p in _PLACEHOLDERS)) from exc


def _router_spec(topology: Topology, python: str, config: str) -> ProcessSpec:
    router = topology.router
    assert router is not None
    argv = _pdcache_argv(python, "router", config, router.name, topology)
    check = HealthCheck("http", router.host, router.port, tls=router.tls_cert is not None)
    return ProcessSpec(router.name, "router", router.host, tuple(argv), STAGE_ROUTER,
                       (check,), {"http": router.url},
                       ports=(PortUse(router.host, router.port, "router.port"),))


def node_token(topology: Topology) -> str | None:
    """The node credential the launcher's health checks send (None without a secret). The
    secret file is read only when it exists here: a remote host's copy is that host's."""
    path = topology.security.secret_file
    if path is None or not Path(path).exists():
        return None
    from pdcache.config.security import security_for

    return security_for(topology.security, topology.source).node_http_token


def ensure_secret(log_dir: Path) -> Path:
    """The launcher's cluster secret in its state directory: created (0600) on first launch,
    reused afterwards (pages stored under its keys stay valid across restarts). Raises
    SecretError when an existing file is unusable (e.g. readable by others)."""
    from pdcache.utils.secret import create_secret, load_secret

    path = (log_dir / SECRET_FILE_NAME).resolve()
    if path.exists():
        load_secret(path)  # refuses group/other-readable files
        return path
    return create_secret(path)


def select_host(specs: Iterable[ProcessSpec], host: str) -> list[ProcessSpec]:
    """The processes that run on `host` (what `pdcache launch --host NAME` starts)."""
    wanted = _canonical_host(host)
    return [s for s in specs if _canonical_host(s.host) == wanted]


def _canonical_host(host: str) -> str:
    return "127.0.0.1" if host == "localhost" else host


def ssh_specs(topology: Topology, specs: list[ProcessSpec], config_arg: str,
              launch_args: Iterable[str] = ()) -> list[ProcessSpec]:
    """One `ssh HOST pdcache launch CONFIG --host HOST` per host, ready when that host's part is.

    The parts start together, one stage: a host's part waits for its own stages (services,
    nodes, router), and its router's health needs the other hosts' nodes, so a part started
    only once the one before it was healthy waited for good (the shipped multi-host example:
    the router's host first, its decode's host never). They start in the order of their
    earliest process (hosts with the shared services first), and a node that finds a
    service not up yet is restarted by its host's launcher.

    `-tt` gives the remote launcher a terminal, so closing the ssh connection hangs it up
    (SIGHUP) and it stops its processes: the hosts are torn down together.
    """
    launch = topology.launch
    out = []
    first_stage = {host: min(s.stage for s in specs if s.host == host)
                   for host in dict.fromkeys(s.host for s in specs)}
    for host in sorted(first_stage, key=lambda h: first_stage[h]):  # stable: topology order
        remote = [launch.remote_python, "-m", "pdcache", "launch", config_arg, "--host", host]
        for item in topology.overrides:
            remote += ["--set", item]
        remote += list(launch_args)
        command = shlex.join(remote)
        if launch.remote_workdir:
            command = f"cd {shlex.quote(launch.remote_workdir)} && exec {command}"
        target = f"{launch.ssh_user}@{host}" if launch.ssh_user else host
        argv = ("ssh", *launch.ssh_options, "-tt", target, command)
        part = [s for s in specs if s.host == host]
        checks = tuple(c for s in part for c in s.health)
        endpoints = {s.name: next(iter(s.endpoints.values()), "") for s in part}
        out.append(ProcessSpec(f"ssh-{host}", "ssh", host, argv, 0, checks, endpoints))
    return out


# --------------------------------------------------------------------------- health


def check_health(check: HealthCheck, timeout_s: float = 1.0) -> bool:
    """One probe; never raises."""
    try:
        if check.kind == "tcp":
            with socket.create_connection((check.host, check.port), timeout=timeout_s):
                return True
        if check.tls:  # our own router's certificate may be self-signed: liveness only
            conn: http.client.HTTPConnection = http.client.HTTPSConnection(
                check.host, check.port, timeout=timeout_s,
                context=ssl._create_unverified_context())  # noqa: S323
        else:
            conn = http.client.HTTPConnection(check.host, check.port, timeout=timeout_s)
        headers = {"Authorization": f"Bearer {check.token}"} if check.token else {}
        try:
            conn.request("GET", check.path, headers=headers)
            return conn.getresponse().status == 200
        finally:
            conn.close()
    except (OSError, http.client.HTTPException):
        return False


# --------------------------------------------------------------------------- ports


def port_taken(use: PortUse) -> bool:
    """Another socket listens on `use` here (a bind fails with EADDRINUSE). False when the
    port is free, and when `use.host` is not an address of this host (nothing to check)."""
    family = socket.AF_INET6 if ":" in use.host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        # as the servers bind: a connection of an earlier run in TIME_WAIT owns nothing
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((use.host, use.port))
        except OSError as exc:
            return exc.errno == errno.EADDRINUSE
    return False


def listener_pids(port: int) -> set[int]:
    """Pids of the processes listening on TCP `port` on this host, as far as this user may see
    (empty where none can be told)."""
    try:
        connections = psutil.net_connections(kind="tcp")
    except (psutil.Error, OSError):
        return set()
    return {c.pid for c in connections
            if c.status == psutil.CONN_LISTEN and c.laddr and c.laddr.port == port and c.pid}


def process_tree(pid: int) -> set[int]:
    """`pid` and every process below it (a node's own children may hold its ports)."""
    try:
        return {pid, *(child.pid for child in psutil.Process(pid).children(recursive=True))}
    except psutil.Error:
        return {pid}


def describe_pids(pids: set[int]) -> str:
    """'pid 123 (python -m pdcache ...)' for each, for messages."""
    parts = []
    for pid in sorted(pids):
        try:
            command = shlex.join(psutil.Process(pid).cmdline())[:100]
        except psutil.Error:
            command = "?"
        parts.append(f"pid {pid} ({command})")
    return ", ".join(parts) or "another process"


# --------------------------------------------------------------------------- processes


def _die_with_parent() -> None:
    """Runs in the child before exec: it gets SIGTERM if the launcher dies (Linux)."""
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except OSError:
        pass


def tail(path: Path, lines: int = 20) -> str:
    """The last `lines` lines of a log file ('' if unreadable)."""
    try:
        with path.open("rb") as fh:
            fh.seek(0, os.SEEK_END)
            fh.seek(max(0, fh.tell() - 16384))
            text = fh.read().decode("utf-8", "replace")
    except OSError:
        return ""
    return "\n".join(text.splitlines()[-lines:])


@dataclass
class Managed:
    """Launcher-side state of one process. Mutated only by the Launcher's main loop."""

    spec: ProcessSpec
    log_path: Path
    popen: subprocess.Popen | None = None
    state: str = "pending"  # pending | starting | healthy | backoff | failed | stopped
    restarts: int = 0
    failures_in_row: int = 0
    next_start_at: float = 0.0
    last_exit: int | None = None
    started_at: float = 0.0  # time.monotonic() of its last start

    @property
    def pid(self) -> int | None:
        return self.popen.pid if self.popen else None

    def alive(self) -> bool:
        return self.popen is not None and self.popen.poll() is None


class Launcher:
    """Starts `specs` stage by stage, supervises them and stops them all on exit.

    Owns the child processes and the files under `log_dir` (`NAME.log`, `processes.json`).
    `run()` returns 0 after a requested shutdown (signal), 1 after a failure (a process that
    would not come up before the deadline, or died with `restart=False`).
    """

    def __init__(self, specs: list[ProcessSpec], log_dir: Path, *, restart: bool = True,
                 health_timeout_s: float = 300.0, stop_grace_s: float = 60.0,
                 backoff_s: float = 1.0, backoff_max_s: float = 30.0,
                 out: IO[str] | None = None, poll_s: float = 0.2, config: str = "",
                 max_failures_in_row: int = 5) -> None:
        self.log_dir = Path(log_dir)
        self.procs = [Managed(s, self.log_dir / f"{s.name}.log") for s in specs]
        self.restart, self.health_timeout_s, self.stop_grace_s = restart, health_timeout_s, stop_grace_s
        self.backoff_s, self.backoff_max_s, self.poll_s = backoff_s, backoff_max_s, poll_s
        self.max_failures_in_row = max_failures_in_row
        self.out = out or sys.stderr
        self.config = config
        self.stop_signal: int | None = None
        self.failed = False
        self._force = False
        self._t0 = time.monotonic()

    # ---- public

    def run(self) -> int:
        previous = self._install_signals()
        try:
            self.log_dir.mkdir(mode=LOG_DIR_MODE, parents=True, exist_ok=True)
            if not self.start_all():
                return 0 if self.stop_signal is not None else 1
            self.print_endpoints()
            return self.supervise()
        finally:
            self.stop_all()
            self._restore_signals(previous)

    def start_all(self) -> bool:
        """Start stage by stage, each waited healthy; False on failure, deadline or signal, or
        when a port a process of the stage is to listen on is taken already."""
        for stage in sorted({p.spec.stage for p in self.procs}):
            group = [p for p in self.procs if p.spec.stage == stage]
            if not self._ports_free(group):
                return False
            for proc in group:
                self._spawn(proc)
            if not self._wait_healthy(group):
                return False
        return True

    def supervise(self) -> int:
        """Watch until a signal (returns 0) or an unrecoverable death (returns 1)."""
        while self.stop_signal is None and not self.failed:
            self._tick()
            time.sleep(self.poll_s)
        return 0 if self.stop_signal is not None and not self.failed else 1

    def stop_all(self) -> None:
        """Stop every started process group, last stage first: SIGTERM, grace, SIGKILL."""
        for stage in sorted({p.spec.stage for p in self.procs}, reverse=True):
            group = [p for p in self.procs if p.spec.stage == stage and p.popen is not None]
            for proc in group:
                self._signal_group(proc, signal.SIGTERM)
            self._reap(group, time.monotonic() + self.stop_grace_s)
            for proc in group:
                self._signal_group(proc, signal.SIGKILL)  # stragglers in the group, if any
            self._reap(group, time.monotonic() + 5.0)
            for proc in group:
                if proc.state != "failed":
                    proc.state = "stopped"
        started = [p for p in self.procs if p.popen is not None]
        left = [p.spec.name for p in started if p.alive()]
        if started:
            self._say(f"stopped {len(started) - len(left)} of {len(started)} processes"
                      + (f"; still running: {', '.join(left)}" if left else ""))
        self._write_state()

    # ---- starting and health

    def _ports_free(self, group: list[Managed]) -> bool:
        """Every port the group will listen on is free here; else the launch fails, naming the
        port, who holds it and the key that moves it (a taken port is never waited on: its
        holder would answer our health checks while our process dies on bind)."""
        for proc in group:
            for use in proc.spec.ports:
                if port_taken(use):
                    holder = describe_pids(listener_pids(use.port))
                    self._say(f"{proc.spec.name}: port {use.port} on {use.host} is already in "
                              f"use by {holder}; stop it or move this one with "
                              f"--set {use.key}=...")
                    self.failed = True
        return not self.failed

    def _identified(self, proc: Managed) -> bool:
        """The listeners on the process's health-checked ports are its own process tree (where
        this host can tell). A port held by another process fails the launch. Not for an ssh
        part: what it starts runs under the remote sshd, never in the ssh client's tree (and
        a local listener on the same port number is not its, even on one of its hosts)."""
        if proc.spec.role == "ssh":
            return True
        ours = process_tree(proc.pid) if proc.pid is not None else set()
        for check in proc.spec.health:
            holders = listener_pids(check.port)
            if holders and not holders & ours:
                self._say(f"{proc.spec.name}: {check.describe()} answers, but from "
                          f"{describe_pids(holders)}, not from the process started (pid "
                          f"{proc.pid}); stopping")
                proc.state, self.failed = "failed", True
                return False
        return True

    def _spawn(self, proc: Managed) -> None:
        spec = proc.spec
        self.log_dir.mkdir(mode=LOG_DIR_MODE, parents=True, exist_ok=True)
        with _private_append(proc.log_path) as log:
            log.write(f"=== pdcache launch: start #{proc.restarts} at {time.strftime('%Y-%m-%d %H:%M:%S')}:"
                      f" {spec.shell_line()}\n".encode())
            log.flush()
            try:
                proc.popen = subprocess.Popen(
                    spec.argv, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                    env={**os.environ, "PYTHONUNBUFFERED": "1", **spec.env},
                    start_new_session=True, preexec_fn=_die_with_parent,
                )
            except OSError as exc:
                proc.popen, proc.state = None, "failed"
                self.failed = True
                self._say(f"{spec.name}: cannot start {spec.argv[0]!r}: {exc}")
                return
        proc.state = "starting" if spec.health else "healthy"
        proc.started_at = time.monotonic()
        self._say(f"{spec.name}: started pid {proc.pid} ({spec.role} on {spec.host}, log {proc.log_path})")
        self._write_state()

    def _wait_healthy(self, group: list[Managed]) -> bool:
        deadline = time.monotonic() + self.health_timeout_s
        next_progress = time.monotonic() + 5.0
        while self.stop_signal is None and not self.failed:
            self._tick()
            waiting = [p for p in group if p.state != "healthy"]
            if not waiting:
                return True
            now = time.monotonic()
            if now >= deadline:
                self._report_deadline(waiting)
                return False
            if now >= next_progress:
                self._say("waiting for " + ", ".join(f"{p.spec.name} ({p.state})" for p in waiting)
                          + f"; {deadline - now:.0f}s left")
                next_progress = now + 5.0
            time.sleep(self.poll_s)
        return False

    def _report_deadline(self, waiting: list[Managed]) -> None:
        self.failed = True
        for proc in waiting:
            checks = ", ".join(c.describe() for c in proc.spec.health)
            self._say(f"{proc.spec.name}: not healthy after {self.health_timeout_s:.0f}s ({checks});"
                      f" last lines of {proc.log_path}:\n{_indent(tail(proc.log_path))}")

    def _tick(self) -> None:
        """One supervision step: notice deaths, restart due processes, promote healthy ones."""
        now = time.monotonic()
        for proc in self.procs:
            if proc.state in ("starting", "healthy") and proc.popen is not None and not proc.alive():
                self._on_death(proc, now)
            elif proc.state == "backoff" and now >= proc.next_start_at:
                proc.restarts += 1
                self._spawn(proc)
            elif (proc.state == "starting" and all(check_health(c) for c in proc.spec.health)
                  and self._identified(proc)):
                self._on_healthy(proc)

    def _on_healthy(self, proc: Managed) -> None:
        proc.state, proc.failures_in_row = "healthy", 0
        again = f" again (restart {proc.restarts})" if proc.restarts else ""
        self._say(f"{proc.spec.name}: healthy{again} after {time.monotonic() - self._t0:.1f}s")
        self._write_state()

    def _on_death(self, proc: Managed, now: float) -> None:
        assert proc.popen is not None
        proc.last_exit = proc.popen.returncode
        self._signal_group(proc, signal.SIGKILL)  # its children must not keep ports bound
        self._say(f"{proc.spec.name} ({proc.spec.role}, pid {proc.pid}) exited with code "
                  f"{proc.last_exit}; last lines of {proc.log_path}:\n{_indent(tail(proc.log_path))}")
        if not proc.spec.health and now - proc.started_at >= self.backoff_max_s:
            # no check to pass: one that stayed up longer than the longest backoff ran fine
            # (its crashes days apart were counted in a row, and stopped everything)
            proc.failures_in_row = 0
        if not self.restart:
            proc.state, self.failed = "failed", True
            self._say("--no-restart: stopping everything")
        elif proc.failures_in_row + 1 >= self.max_failures_in_row:
            proc.state, self.failed = "failed", True
            self._say(f"{proc.spec.name}: failed {proc.failures_in_row + 1} times in a row "
                      f"without becoming healthy; stopping everything (its log: "
                      f"{proc.log_path})")
        else:
            delay = min(self.backoff_max_s, self.backoff_s * 2**proc.failures_in_row)
            proc.failures_in_row += 1
            proc.state, proc.next_start_at = "backoff", now + delay
            self._say(f"{proc.spec.name}: restarting in {delay:.1f}s")
        self._write_state()

    # ---- stopping

    def _signal_group(self, proc: Managed, sig: int) -> None:
        if proc.popen is None:
            return
        try:
            os.killpg(proc.popen.pid, sig)
        except (ProcessLookupError, PermissionError):
            pass

    def _reap(self, group: list[Managed], deadline: float) -> None:
        """Wait for the group leaders to exit, until the deadline or a second stop signal."""
        while time.monotonic() < deadline and not self._force:
            if all(p.popen is None or p.popen.poll() is not None for p in group):
                return
            time.sleep(0.05)

    # ---- signals, state file, output

    def _install_signals(self) -> dict[int, object]:
        previous = {}
        for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
            previous[sig] = signal.signal(sig, self._on_signal)
        return previous

    def _restore_signals(self, previous: dict[int, object]) -> None:
        for sig, handler in previous.items():
            signal.signal(sig, handler)  # type: ignore[arg-type]

    def _on_signal(self, signum: int, _frame: object) -> None:
        if self.stop_signal is None:
            self._say(f"received {signal.Signals(signum).name}: stopping everything"
                      " (again to kill at once)")
        else:
            self._force = True  # a second Ctrl-C: skip the grace period
        self.stop_signal = signum

    def state(self) -> dict[str, object]:
        """What processes.json holds."""
        return {
            "config": self.config,
            "launcher_pid": os.getpid(),
            "processes": [
                {"name": p.spec.name, "role": p.spec.role, "host": p.spec.host, "pid": p.pid,
                 "state": p.state, "restarts": p.restarts, "last_exit": p.last_exit,
                 "endpoints": dict(p.spec.endpoints), "log": str(p.log_path),
                 "argv": list(p.spec.argv)}
                for p in self.procs
            ],
        }

    def _write_state(self) -> None:
        path = self.log_dir / "processes.json"
        tmp = path.with_suffix(".json.tmp")
        try:
            with os.fdopen(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, LOG_FILE_MODE),
                           "w") as out:
                out.write(json.dumps(self.state(), indent=2) + "\n")
            os.replace(tmp, path)
        except OSError as exc:
            self._say(f"cannot write {path}: {exc}")

    def print_endpoints(self) -> None:
        self._say(f"up after {time.monotonic() - self._t0:.1f}s:")
        for proc in self.procs:
            where = "  ".join(f"{k} {v}" for k, v in proc.spec.endpoints.items())
            self._say(f"  {proc.spec.name:<16} {proc.spec.role:<15} {where}")
        self._say(f"  logs and processes.json in {self.log_dir}; Ctrl-C stops everything")

    def _say(self, text: str) -> None:
        print(f"[pdcache launch] {text}", file=self.out, flush=True)


def _indent(text: str) -> str:
    return "\n".join("    | " + line for line in text.splitlines()) or "    | (empty log)"


def launcher_for(topology: Topology, specs: list[ProcessSpec], log_dir: Path, *,
                 restart: bool, out: IO[str] | None = None) -> Launcher:
    """A Launcher with the timeouts of the topology's [launch] table."""
    launch = topology.launch
    return Launcher(specs, log_dir, restart=restart, health_timeout_s=launch.health_timeout_s,
                    max_failures_in_row=launch.max_failures_in_row,
                    stop_grace_s=launch.stop_grace_s, backoff_s=launch.restart_backoff_s,
                    backoff_max_s=launch.restart_backoff_max_s, out=out, config=str(topology.source))
