"""Mooncake Store with its master in HA mode (`[storage.mooncake] ha = true`): two real
`mooncake_master`s, started with the launcher's own command lines, elect a leader on a real
etcd; a pdcache storage client (a child process, configured from the topology exactly as a
node is) stores pages, the leading master is killed, and the same client reads the pages back
byte-exact once the standby leads. With the masters' op-log off (the protection the topology
turns on) the standby takes over knowing none of them: every read misses."""

from __future__ import annotations

import json
import os
import select
import shutil
import socket
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from pdcache.config import load_topology
from pdcache.launch.launcher import mooncake_master_argv
from pdcache.offload_manager.storage.etcd_cluster import LocalEtcdCluster, free_port_pairs
from tests.net_support import free_ports
from tests.polling import scaled_limit, wait_until

pytest.importorskip("mooncake.store")
pytestmark = [pytest.mark.slow, pytest.mark.skipif(
    shutil.which("etcd") is None, reason="etcd not installed (scripts/setup.sh installs it)")]

ROOT = Path(__file__).resolve().parents[3]
CONFIG = ROOT / "configs" / "local-mooncake-ha.toml"
PAGES = 8
READ_WINDOW_S = 3.0  # reads once the new leader serves (scaled for the machine's load)

# The child: a storage client built from the topology like a node's; stores PAGES pages,
# waits for "go" (the leader was killed and the standby serves), then reads the pages until
# they are all back or READ_WINDOW_S passed. (No probe writes: a promoted master refused
# them as "insufficient space", and the backend then evicted its own oldest pages to make
# room.) It leaves with os._exit: a Mooncake client in HA mode takes ~30 s to
# close, and the test needs nothing from that.
CHILD = r"""
import hashlib, json, os, sys, time
import torch
from pdcache.config import load_topology
from pdcache.offload_manager.storage import create_backend
from pdcache.offload_manager.storage.config import StorageConfig, storage_keys_from_spec

config, overrides, deadline_s = sys.argv[1], json.loads(sys.argv[2]), float(sys.argv[3])
count, read_window_s = int(sys.argv[4]), float(sys.argv[5])
keys = storage_keys_from_spec(load_topology(config, overrides).storage)
keys.update(mooncake_segment_bytes=32 << 20, mooncake_local_buffer_bytes=16 << 20)
cfg = StorageConfig(page_bytes=8192, capacity_pages=64, fingerprint="ha-test", num_layers=2,
                    page_size=4, timeout_s=2.0, retry_interval_s=0.2, **keys)
backend = create_backend(cfg)
gen = torch.Generator().manual_seed(7)
pages = torch.randint(0, 256, (count, 8192), dtype=torch.uint8, generator=gen)
names = [hashlib.sha256(b"ha-page-" + bytes([i])).digest() for i in range(count)]
print(json.dumps({"stored": backend.put_from(names, list(pages))}), flush=True)
sys.stdin.readline()  # the new leader serves now
start = time.monotonic()
out = torch.zeros_like(pages)  # one buffer: the client registers it once
while True:
    got = backend.get_into(names, list(out))
    if all(got) or time.monotonic() - start > read_window_s:
        break
    time.sleep(0.25)
print(json.dumps({"read": got, "exact": bool(all(got) and torch.equal(out, pages)),
                  "seconds": round(time.monotonic() - start, 2)}), flush=True)
os._exit(0)
"""


def _listening(port: int) -> bool:
    with socket.socket() as probe:
        probe.settimeout(0.2)
        return probe.connect_ex(("127.0.0.1", port)) == 0


@pytest.mark.parametrize("oplog", [True, False], ids=["oplog", "protection-off"])
def test_pages_outlive_the_leading_master(tmp_path: Path, oplog: bool) -> None:
    rpc = free_ports(2)
    metrics = free_port_pairs(1)[0]  # master i's metrics port is metrics_port + i
    with LocalEtcdCluster(tmp_path / "etcd", members=1) as etcd:
        overrides = [f'storage.mooncake.master="127.0.0.1:{rpc[0]},127.0.0.1:{rpc[1]}"',
                     f"storage.mooncake.metrics_port={metrics}",
                     f"storage.etcd.endpoints={json.dumps([etcd.endpoint_list])}",
                     f'storage.mooncake.cluster_id="t{uuid.uuid4().hex[:10]}"']
        topology = load_topology(CONFIG, overrides)
        env = {**os.environ, "MC_TCP_BIND_ADDRESS": "127.0.0.1", "MC_LOG_LEVEL": "ERROR"}
        masters = []
        for index in range(2):
            argv = [a for a in mooncake_master_argv(topology, _master_binary(), index)
                    if oplog or a != "--enable_oplog=true"]
            with open(tmp_path / f"master-{index}.log", "wb") as log:
                masters.append(subprocess.Popen(argv, env=env, stdout=log, stderr=log))
        child = None
        try:
            leader = _leader(rpc)
            # a promoted master takes puts during its 5 s warm-up without op-logging them:
            # write only once it serves (its log says so; Mooncake exports no metric of it)
            wait_until(lambda: _serving(tmp_path / f"master-{leader}.log"), 40,
                       "the leading master to serve")
            deadline_s = scaled_limit(40.0)
            child = subprocess.Popen(
                [sys.executable, "-c", CHILD, str(CONFIG), json.dumps(overrides), str(deadline_s),
                 str(PAGES), str(scaled_limit(READ_WINDOW_S))],
                env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd=ROOT)
            stored = json.loads(_line(child, scaled_limit(60.0)))
            assert stored["stored"] == [True] * PAGES
            if oplog:  # the leader batches its op-log after acking puts: kill it once it landed
                settled = _OplogSettled(etcd, topology.storage.mooncake.cluster_id)
                wait_until(settled, 30, "the leader's op-log in etcd")
            masters[leader].kill()
            masters[leader].wait(timeout=10)
            wait_until(lambda: _serving(tmp_path / f"master-{1 - leader}.log"), 40,
                       "the standby to serve")
            child.stdin.write("go\n")
            child.stdin.flush()
            result = json.loads(_line(child, scaled_limit(60.0) + READ_WINDOW_S * 4))
        finally:
            if child is not None:
                child.kill()
                child.wait(timeout=10)
            for master in masters:
                master.kill()
                master.wait(timeout=10)
    if oplog:
        assert result["exact"], result  # every page back, byte for byte, from the new leader
    else:
        assert result["read"] == [False] * PAGES, result  # the new leader lost them all


def _leader(rpc: list[int]) -> int:
    """The master that opened its rpc port (only the leader does)."""
    return wait_until(lambda: next((i + 1 for i in range(2) if _listening(rpc[i])), 0),
                      30, "a leading master") - 1


def _line(child: subprocess.Popen, timeout_s: float) -> str:
    """The child's next line of output, within `timeout_s` (its stderr is in the test log)."""
    ready, _, _ = select.select([child.stdout], [], [], timeout_s)
    if not ready:
        pytest.fail(f"the storage client printed nothing for {timeout_s:.0f}s")
    return child.stdout.readline()


def _serving(log: Path) -> bool:
    return log.read_bytes().count(b"state -> serving, role=leader") > 0


class _OplogSettled:
    """True once the leader's op-log batches in etcd (`/oplog/CLUSTER/batches/`) exist and
    their count held still for a second (Mooncake's ha_oplog_* metrics stay 0 in batch mode)."""

    def __init__(self, etcd: LocalEtcdCluster, cluster_id: str) -> None:
        self.etcd, self.prefix = etcd, f"/oplog/{cluster_id}/batches/".encode()
        self.last = -1

    def __call__(self) -> bool:
        from pdcache.offload_manager.storage.etcd_store import EtcdEndpoints

        time.sleep(1.0)
        client = EtcdEndpoints(self.etcd.endpoints)
        try:
            count = len(client.range_prefix(self.prefix))
        finally:
            client.close()
        settled, self.last = count > 0 and count == self.last, count
        return settled


def _master_binary() -> str:
    from pdcache.offload_manager.storage.mooncake_store import find_master_binary

    return find_master_binary()
