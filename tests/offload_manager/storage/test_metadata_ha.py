"""The hf3fs metadata without a single point of failure (docs/design.md §4.4): metadata-server
replicas on a real 3-member etcd cluster, writers reserving and committing pages while the
leading replica or etcd's own leader is killed (SIGKILL) or frozen (SIGSTOP).

Across every failover: no acknowledged entry is lost (same key, same slot), no slot is handed
to two pages, the outage is a bounded window of retryable MetadataUnavailable, and lookups hit
again after it. The unit tests below show what each protection prevents when it is off."""

from __future__ import annotations

import shutil
import threading
import time
from collections import Counter
from dataclasses import dataclass, field

import pytest

from pdcache.offload_manager.storage.etcd_cluster import LocalEtcdCluster
from pdcache.offload_manager.storage.etcd_store import (
    EtcdEndpoints,
    EtcdIndexStore,
    b64,
    parse_endpoints,
)
from pdcache.offload_manager.storage.metadata import (
    NEW,
    LostLeadership,
    MetadataUnavailable,
    RemoteMetadata,
    SlotIndex,
    leading_replica,
    replica_health,
)
from pdcache.offload_manager.storage.metadata_service import LocalMetadataService, MetadataService
from tests.polling import scaled_limit, wait_until

LEASE_TTL_S = 2
LONG_TTL_S = 30  # a deposed leader that must still believe it leads while the test runs
NUM_SLOTS = 1 << 18  # no eviction in these tests (asserted): a slot is handed out at most once


@pytest.fixture
def etcd(tmp_path):
    pytest.importorskip("etcd3gw")
    if shutil.which("etcd") is None:
        pytest.skip("etcd not installed (scripts/setup.sh installs etcd-server)")
    with LocalEtcdCluster(tmp_path / "etcd", members=3) as cluster:
        yield cluster


@pytest.fixture
def replicas(etcd, tmp_path):
    started = [LocalMetadataService(tmp_path / f"replica-{i}", etcd_endpoints=etcd.endpoint_list,
                                    lease_ttl_s=LEASE_TTL_S).start() for i in range(2)]
    yield started
    for replica in started:
        replica.stop(kill=True)


def _leader(replicas: list[LocalMetadataService]) -> LocalMetadataService:
    def leading() -> LocalMetadataService | None:  # wait_until wants a truthy answer
        index = leading_replica([r.address for r in replicas], timeout_s=0.5)
        return None if index is None else replicas[index]
    return wait_until(leading, LEASE_TTL_S * 5, "a leading metadata replica")


@dataclass
class Writers:
    """Threads reserving and committing fresh keys through their own clients."""

    address: str
    threads: int = 3
    handed: list[tuple[bytes, int]] = field(default_factory=list)  # every NEW reservation
    acked: dict[bytes, int] = field(default_factory=dict)  # commits answered True
    failures: list[float] = field(default_factory=list)  # monotonic times of unavailability
    successes: list[float] = field(default_factory=list)
    stop: threading.Event = field(default_factory=threading.Event)

    def __post_init__(self) -> None:
        self._lock = threading.Lock()
        self._workers = [threading.Thread(target=self._run, args=(i,), daemon=True)
                         for i in range(self.threads)]

    def start(self) -> Writers:
        for worker in self._workers:
            worker.start()
        return self

    def finish(self) -> None:
        self.stop.set()
        for worker in self._workers:
            worker.join(timeout=30)

    def _run(self, index: int) -> None:
        client = RemoteMetadata(self.address, "pool", NUM_SLOTS, 4096, timeout_s=1.0,
                                retry_interval_s=0.1)
        serial = 0
        try:
            while not self.stop.is_set():
                key = f"w{index}-{serial}".encode()
                serial += 1
                try:
                    status, slot = client.reserve([key])[0]
                    if status == NEW:
                        with self._lock:
                            self.handed.append((key, slot))
                        if client.commit([key], [slot])[0]:
                            with self._lock:
                                self.acked[key] = slot
                    self.successes.append(time.monotonic())
                except MetadataUnavailable:
                    self.failures.append(time.monotonic())
                    time.sleep(0.05)
        finally:
            client.close()

    def succeeded_after(self, moment: float) -> bool:
        return any(t > moment for t in self.successes)


def _check_index(address: str, writers: Writers) -> None:
    client = RemoteMetadata(address, "pool", NUM_SLOTS, 4096, timeout_s=scaled_limit(2.0))
    entries = dict(wait_until(lambda: _entries(client), 20, "the index after the failover"))
    assert client.stats()["evictions"] == 0  # so no slot may have been handed out twice
    client.close()
    lost = {k: s for k, s in writers.acked.items() if entries.get(k) != s}
    assert not lost, f"{len(lost)} acknowledged entries lost or moved: {list(lost.items())[:5]}"
    slots = Counter(entries.values())
    assert max(slots.values()) == 1, "a slot is indexed for two keys"
    handed = Counter(slot for _, slot in writers.handed)
    twice = [slot for slot, n in handed.items() if n > 1]
    assert not twice, f"slots handed to two pages: {twice[:10]}"


def _entries(client: RemoteMetadata):
    try:
        return client.entries() or None
    except MetadataUnavailable:
        return None


def _outage(writers: Writers, fault_at: float) -> float:
    """The longest gap between two successes from the fault on (the last one before it
    included): how long the writers could not write."""
    times = sorted(writers.successes)
    start = max([t for t in times if t <= fault_at], default=fault_at)
    later = [start, *(t for t in times if t > fault_at)]
    return max(b - a for a, b in zip(later, later[1:]))


@pytest.mark.parametrize("fault", ["kill", "freeze"])
def test_metadata_leader_fails_over(replicas, fault) -> None:
    address = ",".join(r.address for r in replicas)
    writers = Writers(address).start()
    wait_until(lambda: len(writers.acked) >= 30, 20, "commits before the fault")
    leader = _leader(replicas)
    standby = next(r for r in replicas if r is not leader)
    fault_at = time.monotonic()
    if fault == "kill":
        leader.stop(kill=True)
    else:
        leader.freeze()
    acked_before = len(writers.acked)
    wait_until(lambda: writers.succeeded_after(fault_at + 0.2) and len(writers.acked)
               > acked_before + 30, LEASE_TTL_S * 10, "commits on the new leader")
    assert _leader([standby]) is standby
    if fault == "freeze":
        leader.thaw()  # the old leader wakes up believing it leads: it must not serve
        wait_until(lambda: (replica_health(leader.address, 1.0) or {}).get("leading") is False,
                   LEASE_TTL_S * 5, "the thawed leader to step down")
        more = len(writers.acked)
        wait_until(lambda: len(writers.acked) > more + 30, 20, "commits after the thaw")
    writers.finish()
    outage_s = _outage(writers, fault_at)
    assert outage_s < scaled_limit(LEASE_TTL_S + 3.0), f"outage {outage_s:.1f}s"
    _check_index(standby.address, writers)
    client = RemoteMetadata(address, "pool", NUM_SLOTS, 4096, timeout_s=2.0)
    keys = list(writers.acked)[:50]
    assert client.lookup(keys) == [writers.acked[k] for k in keys]  # hits after the failover
    client.close()


@pytest.mark.parametrize("fault", ["kill", "freeze"])
def test_etcd_leader_fails_over(etcd, replicas, fault) -> None:
    address = ",".join(r.address for r in replicas)
    writers = Writers(address).start()
    wait_until(lambda: len(writers.acked) >= 30, 20, "commits before the fault")
    victim = etcd.leader_index()
    fault_at = time.monotonic()
    (etcd.kill if fault == "kill" else etcd.freeze)(victim)
    wait_until(lambda: etcd.leader_index() not in (None, victim), 20, "a new etcd leader")
    acked_before = len(writers.acked)
    wait_until(lambda: len(writers.acked) > acked_before + 30, LEASE_TTL_S * 10,
               "commits with the new etcd leader")
    if fault == "freeze":
        etcd.thaw(victim)
    writers.finish()
    assert _outage(writers, fault_at) < scaled_limit(LEASE_TTL_S + 5.0)
    _check_index(_leader(replicas).address, writers)


def test_clean_stop_hands_over_at_once(etcd, tmp_path) -> None:
    """A stopped leader revokes its lease: with a 16 s lease the standby leads at its next
    campaign (every 4 s), long before the lease would have ended."""
    started = [LocalMetadataService(tmp_path / f"long-{i}", etcd_endpoints=etcd.endpoint_list,
                                    lease_ttl_s=16).start() for i in range(2)]
    try:
        leader = _leader(started)
        standby = next(r for r in started if r is not leader)
        stopped_at = time.monotonic()
        leader.stop()
        wait_until(lambda: (replica_health(standby.address, 0.5) or {}).get("leading"), 30,
                   "the standby to lead")
        assert time.monotonic() - stopped_at < 12  # before the 16 s lease would end
    finally:
        for replica in started:
            replica.stop(kill=True)


def test_standby_redirects_to_the_leader(replicas) -> None:
    leader = _leader(replicas)
    standby = next(r for r in replicas if r is not leader)
    client = RemoteMetadata(standby.address, "redirect", 16, 4096, timeout_s=2.0)
    assert client.reserve([b"k"])[0][0] == NEW
    assert client.redirects == 1 and client.address == leader.address
    client.close()


def _revoke_leader_lease(raw: EtcdEndpoints, prefix: bytes) -> None:
    """End the lease the leader key of `prefix` is on (as its expiry would)."""
    kvs = raw.post("/kv/range", {"key": b64(prefix + b"/leader")}).get("kvs", [])
    raw.post("/kv/lease/revoke", {"ID": kvs[0]["lease"]})


# ---- the protections, off and on -------------------------------------------------------------


def test_fenced_write_of_a_deposed_leader_is_refused(etcd) -> None:
    """A leader whose lease is gone cannot write, even before it notices; the same write
    without the fence lands (what the fence prevents)."""
    endpoints = parse_endpoints(etcd.endpoint_list)
    old = EtcdIndexStore(endpoints, "tcp://old:1", prefix="/fence", lease_ttl_s=LONG_TTL_S)
    old.leadership.start(background=False)  # no thread: it cannot notice or campaign again
    assert old.serving()
    term = old.term()
    old.create_pool("pool", 4, 4096, term)
    journal = old.journal("pool")
    journal.put(b"a", 1)
    old.flush([journal], term=term)
    raw = EtcdEndpoints(endpoints)
    _revoke_leader_lease(raw, b"/fence")  # as if the old leader's lease had expired
    new = EtcdIndexStore(endpoints, "tcp://new:1", prefix="/fence", lease_ttl_s=LEASE_TTL_S)
    new.start()
    assert new.serving()
    stale = old.journal("pool")
    stale.put(b"b", 1)  # the old leader, still believing it leads, hands slot 1 again
    with pytest.raises(LostLeadership):
        old.flush([stale], term=term)
    assert not old.serving()
    assert [e for p in new.load() for e in p.entries] == [(b"a", 1)]
    stale.put(b"b", 1)
    unfenced = {"compare": [], "success": stale.ops(b"/fence"), "failure": []}
    assert raw.txn(unfenced).get("succeeded")  # without the compare the stale write lands
    assert (b"b", 1) in [e for p in new.load() for e in p.entries]
    for store in (old, new):
        store.close()
    raw.close()


def test_promoted_leader_keeps_the_old_reservations() -> None:
    """A new leader that loaded the reservations does not hand their slots out again; one
    that loads only the committed entries does (what persisting reservations prevents)."""
    old = SlotIndex(4)
    handed = [slot for _, slot in old.reserve([b"a", b"b"])]
    committed = [(b"a", handed[0])]
    old.commit([b"a"], [handed[0]])
    reservations = [(handed[1], b"b")]  # b's writer is still writing slot handed[1]
    with_them, without = SlotIndex(4), SlotIndex(4)
    with_them.load(committed, reservations)
    without.load(committed)
    fresh = [slot for _, slot in with_them.reserve([b"c", b"d", b"e"])]
    assert handed[1] not in fresh
    assert with_them.commit([b"b"], [handed[1]]) == [True]  # b's writer still commits
    assert handed[1] in [slot for _, slot in without.reserve([b"c", b"d", b"e"])]


def test_of_two_keys_claiming_one_slot_the_later_commit_holds_it() -> None:
    """A flush of more than one transaction that lost its leadership half-way can leave a
    new key's commit without the delete of the key the slot held before (both in etcd, in
    commit order). The older key used to win the slot and read the newer key's page."""
    index = SlotIndex(4)
    index.load([(b"old", 2), (b"kept", 1), (b"new", 2)])
    assert index.lookup([b"old", b"new", b"kept"]) == [None, 2, 1]
    assert sorted(slot for _, slot in index.reserve([b"x", b"y"])) == [0, 3]


def test_a_batch_whose_group_commit_fails_is_not_acknowledged(etcd) -> None:
    """handle_batch answers nothing `ok` unless the batch's one transaction landed: a deposed
    leader's batch is all `not_leader`, and the new leader sees none of it."""
    endpoints = parse_endpoints(etcd.endpoint_list)
    old_store = EtcdIndexStore(endpoints, "tcp://old:1", prefix="/group",
                               lease_ttl_s=LONG_TTL_S)
    old = MetadataService(store=old_store)
    old_store.leadership.start(background=False)  # it will not notice it was deposed
    opened = {"op": "open", "ns": "pool", "slots": 8, "slot_bytes": 4096}
    first = old.handle_batch([opened, {"op": "reserve", "ns": "pool", "keys": [b"a", b"b"]}])
    assert [r["ok"] for r in first] == [True, True]
    slots = [slot for _, slot in first[1]["result"]]
    raw = EtcdEndpoints(endpoints)
    _revoke_leader_lease(raw, b"/group")
    new_store = EtcdIndexStore(endpoints, "tcp://new:1", prefix="/group",
                               lease_ttl_s=LEASE_TTL_S)
    new_store.start()
    commits = [{"op": "commit", "ns": "pool", "keys": [key], "slots": [slot]}
               for key, slot in zip([b"a", b"b"], slots)]
    assert old_store.serving()  # it still believes it leads: only the fence stops it
    replies = old.handle_batch(commits)
    assert [r.get("error_kind") for r in replies] == ["not_leader", "not_leader"]
    assert old_store.rejected_writes == 1
    (pool,) = new_store.load()
    assert pool.entries == [] and sorted(pool.reservations) == sorted(zip(slots, [b"a", b"b"]))
    old.close()
    new_store.close()
    raw.close()
