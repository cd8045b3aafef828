"""The simulator's own parts: the clock, the bandwidth pipes, the store's contents."""

from __future__ import annotations

import pytest

from pdcache.sim.events import EventLoop
from pdcache.sim.io import Pipe, StorageIO
from pdcache.sim.profile import StorageCost
from pdcache.sim.store import SimStore


def test_events_run_in_time_then_schedule_order() -> None:
    loop, seen = EventLoop(), []
    loop.at(2.0, lambda: seen.append("b"))
    loop.at(1.0, lambda: (seen.append("a"), loop.after(1.0, lambda: seen.append("c"))))
    loop.at(2.0, lambda: seen.append("b2"))
    loop.run()
    assert seen == ["a", "b", "b2", "c"] and loop.now == 2.0 and loop.events_run == 4


def test_pipe_is_fifo_at_its_bandwidth() -> None:
    pipe = Pipe(100.0)
    assert pipe.occupy(0.0, 100) == 1.0
    assert pipe.occupy(0.5, 50) == 1.5  # queued behind the first
    assert pipe.occupy(3.0, 100) == 4.0  # idle meanwhile
    assert pipe.busy_s == 2.5


def test_storage_io_shares_the_store_and_limits_each_link() -> None:
    cost = StorageCost(read_bandwidth_Bps=1000.0, write_bandwidth_Bps=1000.0,
                       node_nic_Bps=100.0, op_latency_s=0.5, metadata_op_s=0.25)
    io = StorageIO(cost, bucket_s=1.0)
    # two nodes in parallel: each limited by its own link, not by the store
    assert io.transfer(0.0, "a", 100, "read") == pytest.approx(1.75)
    assert io.transfer(0.0, "b", 100, "read") == pytest.approx(1.75)
    # the same node again queues on its link
    assert io.transfer(0.0, "a", 100, "read") == pytest.approx(2.75)
    assert io.totals["read"] == 300 and io.operations == 3
    rows = io.timeline.rows(("read",))
    # spread over the time each moved at its link's 100 B/s: a and b in [0, 1], a again in
    # [1, 2] (by completion time, 200 B/s landed in [1, 2): a peak above what ran)
    assert [r["read_Bps"] for r in rows] == pytest.approx([200.0, 100.0])


def test_a_read_of_pages_still_being_written_does_not_stall_the_store() -> None:
    """A read waiting for a write was queued at the write's end: the FIFO pipes made every
    later-booked operation, another node's read due at once included, wait behind it."""
    cost = StorageCost(read_bandwidth_Bps=1000.0, write_bandwidth_Bps=1000.0,
                       node_nic_Bps=1000.0, op_latency_s=0.0, metadata_op_s=0.0)
    io = StorageIO(cost, bucket_s=1.0)
    # node a reads 100 B of pages that land at t=5: it ends 0.1 s after they do
    assert io.transfer(0.0, "a", 100, "read", not_before=5.0) == pytest.approx(5.1)
    # node b's read of stored pages, due now, waits for a's bytes at most, not for t=5
    assert io.transfer(0.0, "b", 100, "read") == pytest.approx(0.2)


def test_store_lookup_pending_writes_origin_and_lru() -> None:
    store = SimStore(capacity_pages=3)
    store.begin_write([1, 2], "prefill", 1.0)
    store.begin_write([3], "decode", 2.0)
    run = store.lookup([1, 2, 3, 4], 0, 4, now=0.5)
    assert (run.count, run.decode_flags, run.ready_s) == (3, (False, False, True), 2.0)
    assert store.lookup([1, 2, 3], 0, 3, now=0.5, pending=False).count == 0
    assert store.to_write([2, 3, 4]) == [4]
    store.end_write([1, 2], "prefill")
    store.end_write([3], "decode")
    store.touch([1])
    store.begin_write([4], "decode", 3.0)
    store.end_write([4], "decode")  # full: 2, the least recently used, goes
    assert store.lookup([1, 2], 0, 2, now=5.0).count == 1 and store.evicted_pages == 1
    assert store.written_pages == {"prefill": 2, "decode": 2}
