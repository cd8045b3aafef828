"""DecodeOffloadManager's announcements (docs/design.md §4.10): every scheduled key is
announced pending before its copy, and settled once its fate is known — landed when already
stored or written, not coming when dropped. Fed straight into a prefill's `PendingPages` (the
nodes put the control plane in between: tests/transfer/test_pending_messages.py)."""

from __future__ import annotations

import threading
import time

from pdcache.engine.page_keys import chain_page_keys, make_salt
from pdcache.offload_manager.decode_offload import DecodeOffloadManager
from pdcache.offload_manager.pending import PageState, PendingPages
from pdcache.transfer.delivery import MarksDelivery
from tests.offload_manager.test_decode_offload import FP, PAGE, device_kv
from tests.storage_doubles import DictBackend


class IntoPendingPages:
    """What KVReceiver + KVSender do, minus the sockets: announcements reach PendingPages
    (`pullable`: as a decode that offers the pull)."""

    def __init__(self, pages: PendingPages, pullable: bool = False) -> None:
        self.pages = pages
        self.pullable = pullable
        self.ttls: list[float] = []
        self.etas: list[float] = []

        self.deliveries: list[MarksDelivery] = []

    def announce_pending(self, keys: list[bytes], ttl_s: float,
                         eta_s: float = 0.0) -> MarksDelivery:
        self.ttls.append(ttl_s)
        self.etas.append(eta_s)
        self.pages.pending(keys, ttl_s, eta_s=eta_s, pullable=self.pullable)
        delivery = MarksDelivery()  # done when the test answers it
        delivery.expect(b"prefill", len(self.deliveries))
        delivery.seal()
        self.deliveries.append(delivery)
        return delivery

    def announce_settled(self, keys: list[bytes], landed: list[bool]) -> None:
        self.pages.settled(keys, landed)


def test_scheduled_keys_are_pending_until_written_then_landed() -> None:
    kv, storage, pages = device_kv(), DictBackend(), PendingPages()
    tokens = list(range(3 * PAGE + 1))
    keys = chain_page_keys(tokens, PAGE, make_salt(FP))
    storage.pages[keys[0]] = b"prefill-wrote-this"  # skipped: settled landed at once
    storage.origin[keys[0]] = "prefill"
    mgr = DecodeOffloadManager(kv, storage, FP, staging_pages=8, pending_ttl_s=7.0)
    announcer = IntoPendingPages(pages)
    mgr.announce_to(announcer)
    mgr.start()
    storage.gate.clear()  # the write stalls: its keys stay pending
    mgr.track("r")
    released = threading.Event()
    mgr.finish("r", tokens, [0, 1, 2, 3], released.set)
    assert released.wait(10)  # device pages go once copied; the write is still stalled
    assert [pages.state(k) for k in keys] == [PageState.LANDED, PageState.PENDING,
                                              PageState.PENDING]
    assert announcer.ttls == [7.0]
    storage.gate.set()
    assert mgr.wait_idle(10)
    assert [pages.state(k) for k in keys] == [PageState.LANDED] * 3
    assert storage.origin[keys[1]] == "decode"
    mgr.close()


def test_dropped_pages_are_settled_as_not_coming() -> None:
    kv, storage, pages = device_kv(), DictBackend(), PendingPages()
    tokens = list(range(4 * PAGE))
    keys = chain_page_keys(tokens, PAGE, make_salt(FP))
    mgr = DecodeOffloadManager(kv, storage, FP, staging_pages=2)  # room for 2 of 4 pages
    mgr.announce_to(IntoPendingPages(pages))
    mgr.start()
    mgr.track("r")
    released = threading.Event()
    mgr.finish("r", tokens, [0, 1, 2, 3], released.set)
    assert released.wait(10) and mgr.wait_idle(10)
    assert [pages.state(k) for k in keys] == [PageState.LANDED, PageState.LANDED,
                                              PageState.GONE, PageState.GONE]
    assert mgr.stats.pages_dropped == 2 and pages.failed == 2
    mgr.close()


def test_marks_carry_the_expected_write_time_measured_on_decode() -> None:
    """0 before any write was measured; then (writes queued ahead + 1) x the mean latency."""
    kv, storage, pages = device_kv(), DictBackend(), PendingPages()
    mgr = DecodeOffloadManager(kv, storage, FP, staging_pages=8)
    announcer = IntoPendingPages(pages, pullable=True)
    mgr.announce_to(announcer)
    mgr.start()

    def request(rid: str, first: int) -> None:
        tokens = list(range(first, first + PAGE))
        released = threading.Event()
        mgr.track(rid)
        mgr.finish(rid, tokens, [first // PAGE], released.set)
        assert released.wait(10)

    request("a", 0)
    assert mgr.wait_idle(10)
    mean_s = mgr.stats.write_seconds_total / mgr.stats.writes
    storage.gate.clear()  # b's write stalls: c queues behind it
    before = time.monotonic()
    request("b", PAGE)
    after = time.monotonic()
    request("c", 2 * PAGE)
    assert announcer.etas == [0.0, mean_s, 2 * mean_s]
    # prefill's mark of b's page expects it to land mean_s after the announcement
    key_b = chain_page_keys(list(range(PAGE, 2 * PAGE)), PAGE, make_salt(FP))[0]
    _, count, lands_by = pages.pull_run([key_b])
    assert count == 1 and before + mean_s <= lands_by <= after + mean_s
    storage.gate.set()
    assert mgr.wait_idle(10)
    mgr.close()


def test_finish_gives_the_delivery_of_the_request_s_last_marks() -> None:
    """The answer waits for it (Req.output_gate): the finish's own marks, or, when the finish
    schedules no new page, the last stride's (one link's frames arrive in order)."""
    kv, storage, pages = device_kv(), DictBackend(), PendingPages()
    mgr = DecodeOffloadManager(kv, storage, FP, staging_pages=8, stride_pages=2)
    announcer = IntoPendingPages(pages)
    mgr.announce_to(announcer)
    mgr.start()
    tokens = list(range(2 * PAGE + 3))
    mgr.track("r")
    mgr.on_step("r", tokens, [0, 1, 2])  # two full pages: one stride
    released = threading.Event()
    last = mgr.finish("r", tokens, [0, 1, 2], released.set)  # no new full page
    assert last is announcer.deliveries[0] and len(announcer.deliveries) == 1
    mgr.track("s")
    tokens = list(range(100, 100 + 3 * PAGE))
    mgr.on_step("s", tokens[: 2 * PAGE], [3, 4])
    other = mgr.finish("s", tokens, [3, 4, 5], released.set)
    assert other is announcer.deliveries[2] and len(announcer.deliveries) == 3
    mgr.track("t")
    assert mgr.finish("t", list(range(PAGE - 1)), [6], released.set) is None  # no full page
    assert mgr.wait_idle(10)
    mgr.close()
