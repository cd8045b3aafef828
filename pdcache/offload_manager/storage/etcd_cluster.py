"""Local etcd members as child processes: what `pdcache launch` starts for `[storage.etcd]`
with `start = true`, and what the tests and `pdcache bench metadata` run a 3-member cluster on.

`member_argv` is the one place an etcd command line is spelled. Member i of a cluster listens
for clients on its endpoint and for peers on `peer_port` (the client port + 1 by default, the
convention `[storage.etcd]` documents).
"""

from __future__ import annotations

import json
import random
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from pathlib import Path

HEARTBEAT_MS = 100  # etcd's defaults, spelled out: a dead etcd leader is replaced in ~1-2 s
ELECTION_MS = 1000
COMPACTION_RETENTION = "10m"  # history etcd keeps (the index needs none: it reads the latest)


def member_name(index: int) -> str:
    return f"pdcache-etcd-{index}"


def member_argv(
    endpoints: Sequence[tuple[str, int]],
    index: int,
    data_dir: str | Path,
    executable: str = "etcd",
    *,
    names: Sequence[str] = (),
    own_name: str = "",
    own_host: str = "",
    listen_host: str = "",
    peer_offset: int = 1,
    cluster_token: str = "pdcache",
) -> list[str]:
    """etcd's command line for member `index` of the cluster on `endpoints` (client host:port;
    peers on port + `peer_offset`). `names`: the members' names (default pdcache-etcd-I);
    `own_name` / `own_host` / `listen_host` override member `index`'s name, advertised host
    and listening address (a Kubernetes pod: `$(POD_NAME)`, its DNS name, 0.0.0.0)."""
    names = list(names) or [member_name(i) for i in range(len(endpoints))]
    host, port = endpoints[index]
    advertised = own_host or host
    listen = listen_host or host
    cluster = ",".join(f"{names[i]}=http://{h}:{p + peer_offset}"
                       for i, (h, p) in enumerate(endpoints))
    return [
        executable, "--name", own_name or names[index], "--data-dir", str(data_dir),
        "--listen-client-urls", f"http://{listen}:{port}",
        "--advertise-client-urls", f"http://{advertised}:{port}",
        "--listen-peer-urls", f"http://{listen}:{port + peer_offset}",
        "--initial-advertise-peer-urls", f"http://{advertised}:{port + peer_offset}",
        "--initial-cluster", cluster, "--initial-cluster-state", "new",
        "--initial-cluster-token", cluster_token,
        "--heartbeat-interval", str(HEARTBEAT_MS), "--election-timeout", str(ELECTION_MS),
        # every reserve and commit is a revision: without compaction the backend reaches its
        # quota (2 GiB) and refuses all writes (NOSPACE) after hours of traffic
        "--auto-compaction-mode", "periodic", "--auto-compaction-retention", COMPACTION_RETENTION,
        "--log-level", "error",
    ]


def member_status(host: str, port: int, timeout_s: float = 1.0) -> dict[str, str] | None:
    """{member_id, leader} of one member, or None when it does not answer."""
    request = urllib.request.Request(f"http://{host}:{port}/v3/maintenance/status", data=b"{}",
                                     method="POST")
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as reply:
            body = json.load(reply)
    except (OSError, urllib.error.URLError, ValueError):
        return None
    return {"member_id": str(body.get("header", {}).get("member_id", "")),
            "leader": str(body.get("leader", ""))}


def leading_member(endpoints: Sequence[tuple[str, int] | None],
                   timeout_s: float = 1.0) -> int | None:
    """The index in `endpoints` of the member that leads the cluster now, asking every member
    given (None: skip it); None when no member answering names a leader among them."""
    ids: dict[str, int] = {}
    leader = ""
    for index, endpoint in enumerate(endpoints):
        status = member_status(*endpoint, timeout_s=timeout_s) if endpoint else None
        if status is not None:
            ids[status["member_id"]] = index
            leader = status["leader"] if status["leader"] not in ("", "0") else leader
    return ids.get(leader)


class LocalEtcdCluster:
    """`members` etcd processes on 127.0.0.1 (free ports), data under `base_dir`.

    Owner: the test, benchmark or chaos run that made it; `start()` starts every member and
    waits until they agree on a leader, `stop()` kills and reaps them (idempotent). `kill`,
    `freeze` (SIGSTOP) and `thaw` act on one member, for failover tests."""

    def __init__(self, base_dir: str | Path, members: int = 3, executable: str = "etcd") -> None:
        self.base_dir = Path(base_dir)
        self.executable = executable
        self.endpoints = [("127.0.0.1", port) for port in free_port_pairs(members)]
        self.procs: list[subprocess.Popen[bytes] | None] = [None] * members

    @property
    def endpoint_list(self) -> str:
        """`host:port,host:port,...`, as `--etcd-endpoints` and `[storage.etcd]` take it."""
        return ",".join(f"{h}:{p}" for h, p in self.endpoints)

    def start(self, timeout_s: float = 30.0) -> LocalEtcdCluster:
        for index in range(len(self.endpoints)):
            self.start_member(index)
        self.wait_for_leader(timeout_s)
        return self

    def start_member(self, index: int) -> None:
        data_dir = self.base_dir / member_name(index)
        self.base_dir.mkdir(parents=True, exist_ok=True)
        with open(self.base_dir / f"{member_name(index)}.log", "ab") as log:
            self.procs[index] = subprocess.Popen(
                member_argv(self.endpoints, index, data_dir, self.executable),
                stdout=log, stderr=log)

    def wait_for_leader(self, timeout_s: float = 30.0) -> int:
        """The index of the member that leads, once a live member reports one."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            leader = self.leader_index()
            if leader is not None:
                return leader
            for index, proc in enumerate(self.procs):
                if proc is not None and proc.poll() not in (None, -signal.SIGKILL):
                    raise RuntimeError(f"etcd member {index} exited with {proc.returncode}: "
                                       f"see {self.base_dir / member_name(index)}.log")
            time.sleep(0.1)
        raise TimeoutError(f"etcd cluster {self.endpoint_list} elected no leader in {timeout_s}s")

    def leader_index(self) -> int | None:
        alive = [endpoint if proc is not None and proc.poll() is None else None
                 for endpoint, proc in zip(self.endpoints, self.procs)]
        return leading_member(alive, timeout_s=0.5)

    def kill(self, index: int) -> None:
        proc = self.procs[index]
        if proc is not None and proc.poll() is None:
            proc.kill()
            proc.wait(timeout=10)

    def freeze(self, index: int) -> None:
        proc = self.procs[index]
        if proc is not None:
            proc.send_signal(signal.SIGSTOP)

    def thaw(self, index: int) -> None:
        proc = self.procs[index]
        if proc is not None:
            proc.send_signal(signal.SIGCONT)

    def stop(self) -> None:
        for index, proc in enumerate(self.procs):
            if proc is None:
                continue
            if proc.poll() is None:
                proc.send_signal(signal.SIGCONT)
                proc.kill()
            proc.wait(timeout=10)
            self.procs[index] = None

    def __enter__(self) -> LocalEtcdCluster:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def free_port_pairs(count: int, seed: int | None = None) -> list[int]:
    """`count` free loopback ports p whose p + 1 is free too (a member's client and peer
    ports), none adjacent to another, all below the kernel's ephemeral range: a member that
    is killed and restarted must get its ports back, and peers reconnecting to a dead
    member's port from an ephemeral port can land on that very port (TCP self-connect) and
    hold it while it is in the ephemeral range."""
    low = _ephemeral_low()
    rng = random.Random(seed)
    ports: list[int] = []
    for _ in range(2000):
        if len(ports) == count:
            return ports
        port = rng.randrange(max(1024, low // 2), low - 2)
        if all(abs(port - p) > 2 for p in ports) and _free(port) and _free(port + 1):
            ports.append(port)
    raise RuntimeError(f"no free port pairs below {low} for etcd members")


def _ephemeral_low() -> int:
    """The first port of the kernel's ephemeral range (32768 when it cannot be read)."""
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def _free(port: int) -> bool:
    with socket.socket() as probe:
        try:
            probe.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True

