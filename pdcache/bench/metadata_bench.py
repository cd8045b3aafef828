"""`pdcache bench metadata`: the hf3fs metadata service on SQLite (one process) vs on a
3-member etcd cluster (two replicas, leader election, fenced writes), side by side in one run.

1. Operations: 1 and 8 clients (threads, each its own connection) reserve (allocate), then
   commit, then look up `--ops` batches of `--batch` fresh keys each (one page prefix per op,
   as a node's I/O thread sends them); per store, client count and op: ops/s and p50 / p99
   latency, each phase timed alone.
2. Failover (etcd only): a client loops reserve + commit while the leading replica is killed
   (SIGKILL) or frozen (SIGSTOP), or etcd's own leader is killed; the window from the fault
   to the client's first success, median (and max) of `--failovers` runs each.
3. Why etcd and not Redis (`--redis`, when redis-server and the `redis` package exist): one
   durable write, the primitive each store needs per metadata change — an etcd put (Raft:
   a quorum has it, fsynced) vs a Redis SET + WAIT 1 (acknowledged by one replica; the AOF
   fsynced every write). Redis Sentinel fails over asynchronously: a write acknowledged
   before the failover can be lost, which etcd rules out.
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import subprocess
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from functools import partial
from pathlib import Path
from typing import Any

from pdcache.bench.report import percentiles
from pdcache.bench.table import emit
from pdcache.offload_manager.storage.etcd_cluster import LocalEtcdCluster, free_port_pairs
from pdcache.offload_manager.storage.metadata import (
    NEW,
    MetadataUnavailable,
    RemoteMetadata,
    leading_replica,
)
from pdcache.offload_manager.storage.metadata_service import LocalMetadataService

SLOTS = 1 << 20  # large enough that no run evicts
LEASE_TTL_S = 3  # the topology default ([storage.metadata_service] lease_ttl_s)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--ops", type=int, default=300,
                        help="reserve+commit+lookup cycles per client (default 300)")
    parser.add_argument("--clients", default="1,8", help="client counts (default 1,8)")
    parser.add_argument("--batch", type=int, default=4, help="keys per operation (default 4)")
    parser.add_argument("--failovers", type=int, default=5,
                        help="runs per failover kind (default 5; 0 skips)")
    parser.add_argument("--redis", action="store_true",
                        help="also measure Redis SET+WAIT beside an etcd put (needs "
                             "redis-server and the redis package)")
    parser.add_argument("--work-dir", default=None, help="scratch directory (default: a temp dir)")


# ---- stacks -------------------------------------------------------------------------------------


@contextmanager
def sqlite_stack(base: Path) -> Iterator[tuple[str, Any]]:
    with LocalMetadataService(base / "sqlite") as service:
        yield service.address, None


@contextmanager
def etcd_stack(base: Path, replicas: int = 2) -> Iterator[tuple[str, Any]]:
    with LocalEtcdCluster(base / "etcd", members=3) as etcd:
        started = [LocalMetadataService(base / f"replica-{i}", etcd_endpoints=etcd.endpoint_list,
                                        lease_ttl_s=LEASE_TTL_S).start()
                   for i in range(replicas)]
        try:
            yield ",".join(r.address for r in started), (etcd, started)
        finally:
            for replica in started:
                replica.stop(kill=True)


# ---- 1. operations ------------------------------------------------------------------------------


PHASES = ("reserve", "commit", "lookup")


def measure_ops(store: str, address: str, clients: int, ops: int, batch: int) -> list[dict]:
    """Each client reserves `ops` batches of fresh keys, then commits them, then looks them
    up: three phases, each timed alone over every client together."""
    conns = [RemoteMetadata(address, "bench", SLOTS, 4096, timeout_s=10.0) for _ in range(clients)]
    tag = f"{store}-{clients}-{time.monotonic_ns()}"
    keys = [[[f"{tag}-{c}-{op}-{i}".encode() for i in range(batch)] for op in range(ops)]
            for c in range(clients)]
    slots: list[list[list[int]]] = [[] for _ in range(clients)]
    steps: dict[str, Callable[[int, int], Any]] = {
        "reserve": lambda c, op: slots[c].append(
            [slot for status, slot in conns[c].reserve(keys[c][op]) if status == NEW]),
        "commit": lambda c, op: conns[c].commit(keys[c][op], slots[c][op]),
        "lookup": lambda c, op: conns[c].lookup(keys[c][op]),
    }
    rows = []
    for phase in PHASES:
        latencies: list[list[float]] = [[] for _ in range(clients)]

        def loop(c: int, step: Callable[[int, int], Any] = steps[phase],
                 out: list[list[float]] = latencies) -> None:
            for op in range(ops):
                t0 = time.perf_counter()
                step(c, op)
                out[c].append(time.perf_counter() - t0)

        threads = [threading.Thread(target=loop, args=(c,)) for c in range(clients)]
        start = time.perf_counter()
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        wall = time.perf_counter() - start
        values = [v for per_client in latencies for v in per_client]
        rows.append({"store": store, "clients": clients, "op": phase, "keys_per_op": batch,
                     "ops_per_s": round(len(values) / wall, 1), **_latency_ms(values)})
    for conn in conns:
        conn.close()
    return rows


def _latency_ms(values: list[float]) -> dict[str, float]:
    """p50 and p99 of `values` (seconds) in ms, by the replay's own `percentiles`."""
    stats = percentiles(values, "lat")
    return {f"{q}_ms": round(float(stats[f"lat_{q}_s"] or 0.0) * 1e3, 2) for q in ("p50", "p99")}


# ---- 2. failover --------------------------------------------------------------------------------


def _leader(replicas: list[LocalMetadataService], timeout_s: float = 30.0) -> LocalMetadataService:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        index = leading_replica([r.address if r.proc is not None else None for r in replicas],
                                timeout_s=0.5)
        if index is not None:
            return replicas[index]
        time.sleep(0.05)
    raise TimeoutError("no metadata replica leads")


def _first_success_after(address: str, fault: Callable[[], None], limit_s: float = 60.0) -> float:
    """Seconds from `fault()` to the first reserve+commit that succeeds after it."""
    client = RemoteMetadata(address, "bench", SLOTS, 4096, timeout_s=1.0, retry_interval_s=0.05)
    serial = time.monotonic_ns()
    try:
        client.reserve([b"warm-%d" % serial])
        fault_at = time.monotonic()
        fault()
        while time.monotonic() - fault_at < limit_s:
            serial += 1
            try:
                status, slot = client.reserve([b"f-%d" % serial])[0]
                if status == NEW and client.commit([b"f-%d" % serial], [slot])[0]:
                    return time.monotonic() - fault_at
            except MetadataUnavailable:
                time.sleep(0.02)
        raise TimeoutError(f"no success within {limit_s}s of the fault")
    finally:
        client.close()


def measure_failovers(address: str, stack: Any, runs: int) -> list[dict]:
    etcd, replicas = stack
    windows: dict[str, list[float]] = {"kill metadata leader": [], "freeze metadata leader": [],
                                       "kill etcd leader": []}
    for run in range(runs):
        for kind in windows:
            leader = _leader(replicas)
            if kind == "kill etcd leader":
                victim = etcd.wait_for_leader()
                windows[kind].append(_first_success_after(address, partial(etcd.kill, victim)))
                etcd.start_member(victim)
                etcd.wait_for_leader()
                continue
            fault = partial(leader.stop, kill=True) if kind.startswith("kill") else leader.freeze
            windows[kind].append(_first_success_after(address, fault))
            if kind.startswith("freeze"):
                leader.stop(kill=True)  # thawed and gone: restarted as a standby below
            leader.start()
        print(f"failover run {run + 1}/{runs}: " + ", ".join(
            f"{k} {v[-1]:.2f}s" for k, v in windows.items()), flush=True)
    return [{"fault": kind, "runs": len(values), "median_s": round(statistics.median(values), 2),
             "max_s": round(max(values), 2), "lease_ttl_s": LEASE_TTL_S}
            for kind, values in windows.items()]


# ---- 3. etcd vs Redis ---------------------------------------------------------------------------


def measure_primitives(base: Path, writes: int = 500) -> list[dict]:
    rows = []
    with LocalEtcdCluster(base / "prim-etcd", members=3) as etcd:
        import etcd3gw

        host, port = etcd.endpoints[0]
        client = etcd3gw.Etcd3Client(host=host, port=port, timeout=5, api_path="/v3/")
        rows.append(_time_writes("etcd put (3 members, Raft quorum)", writes,
                                 lambda i: client.put(f"/bench/{i}", "x" * 64)))
    try:
        import redis
    except ImportError:
        return rows + [{"store": "redis: the redis package is not installed", "writes": 0}]
    with _redis_pair(base) as (primary, _):
        conn = redis.Redis(host="127.0.0.1", port=primary)

        def durable_set(i: int) -> None:
            conn.set(f"bench:{i}", "x" * 64)
            if conn.wait(1, 30000) < 1:
                raise RuntimeError("redis replica did not acknowledge")

        rows.append(_time_writes("redis SET + WAIT 1 (1 replica, appendfsync always)", writes,
                                 durable_set))
        conn.close()
    return rows


def _time_writes(name: str, writes: int, write: Callable[[int], Any], warmup: int = 20) -> dict:
    """`writes` timed calls of `write`, after `warmup` untimed ones (a Redis replica finishes
    its initial sync on the first WAIT)."""
    for i in range(warmup):
        write(-1 - i)
    latencies = []
    start = time.perf_counter()
    for i in range(writes):
        t0 = time.perf_counter()
        write(i)
        latencies.append(time.perf_counter() - t0)
    wall = time.perf_counter() - start
    return {"store": name, "writes": writes, "writes_per_s": round(writes / wall, 1),
            **_latency_ms(latencies)}


@contextmanager
def _redis_pair(base: Path) -> Iterator[tuple[int, int]]:
    if shutil.which("redis-server") is None:
        raise FileNotFoundError("redis-server is not installed (Debian: redis-server)")
    primary, replica = free_port_pairs(2)
    procs = []
    try:
        for port, extra in ((primary, []), (replica, ["--replicaof", "127.0.0.1", str(primary)])):
            work = base / f"redis-{port}"
            work.mkdir(parents=True, exist_ok=True)
            procs.append(subprocess.Popen(
                ["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--dir", str(work),
                 "--save", "", "--appendonly", "yes", "--appendfsync", "always", *extra],
                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
        _wait_replicated(primary)
        yield primary, replica
    finally:
        for proc in procs:
            proc.kill()
            proc.wait(timeout=10)


def _wait_replicated(port: int, timeout_s: float = 20.0) -> None:
    import redis

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            info = redis.Redis(host="127.0.0.1", port=port).info("replication")
            if int(info.get("connected_slaves", 0)) >= 1:
                return
        except redis.exceptions.ConnectionError:
            pass
        time.sleep(0.1)
    raise TimeoutError("redis replica did not connect")


# ---- run ----------------------------------------------------------------------------------------


def run(args: argparse.Namespace) -> int:
    clients = [int(c) for c in args.clients.split(",") if c.strip()]
    with tempfile.TemporaryDirectory(dir=args.work_dir) as tmp:
        base = Path(tmp)
        op_rows: list[dict] = []
        failover_rows: list[dict] = []
        for store, stack in (("sqlite", sqlite_stack), ("etcd", etcd_stack)):
            with stack(base / store) as (address, handles):
                for count in clients:
                    op_rows += measure_ops(store, address, count, args.ops, args.batch)
                    print(f"{store}, {count} client(s): done", flush=True)
                if handles is not None and args.failovers:
                    failover_rows = measure_failovers(address, handles, args.failovers)
        primitive_rows = measure_primitives(base) if args.redis else []
    _add_ratios(op_rows)
    emit("hf3fs metadata operations: SQLite (one process) vs etcd (replicated)", op_rows,
         args.json_path, extra={"failover": failover_rows, "durable_write": primitive_rows})
    if failover_rows:
        emit("Failover window: fault -> first successful reserve+commit", failover_rows)
    if primitive_rows:
        emit("One durable write: etcd put vs Redis SET + WAIT", primitive_rows)
    return 0


def _add_ratios(rows: list[dict]) -> None:
    """etcd's ops/s as a share of SQLite's, same clients and op."""
    sqlite = {(r["clients"], r["op"]): r["ops_per_s"] for r in rows if r["store"] == "sqlite"}
    for row in rows:
        base = sqlite.get((row["clients"], row["op"]))
        row["vs_sqlite"] = round(row["ops_per_s"] / base, 3) if base else None
