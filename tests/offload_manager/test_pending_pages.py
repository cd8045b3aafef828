"""PendingPages and HiCache's wait for decode-announced writes (docs/design.md §4.10): pages
past storage's committed prefix that a decode node is still writing are waited for under the
prefetch policy and read as they land; a failed write, an expired mark (decode died) or the
policy's deadline ends the wait (counted raced); `pending_wait = False` recomputes them."""

from __future__ import annotations

import time

import pytest
import torch

from pdcache.offload_manager.pending import PageState, PendingPages
from tests.offload_manager.test_hicache import TOKENS, S, Stack
from tests.storage_doubles import DictBackend

PAGES = len(TOKENS) // S  # 3


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_marks_settle_expire_and_stay_bounded() -> None:
    clock = Clock()
    pages = PendingPages(max_keys=3, clock=clock)
    pages.pending([b"a", b"b", b"c"], ttl_s=5.0)
    assert pages.run([b"a", b"b", b"x", b"c"]) == 2
    clock.now += 2.0
    pages.settled([b"a", b"b"], [True, False])
    assert pages.state(b"a") is PageState.LANDED and pages.state(b"b") is PageState.GONE
    clock.now += 2.0
    assert pages.state(b"c") is PageState.PENDING
    clock.now += 1.0  # c's TTL is over: a decode that died never makes anyone wait longer
    assert pages.state(b"c") is PageState.GONE
    assert pages.state(b"a") is PageState.LANDED  # landed at t=102: kept one TTL from then
    clock.now += 2.0
    assert pages.state(b"a") is PageState.GONE
    pages.pending([b"c"], ttl_s=5.0)
    pages.settled([b"c"], [True])
    pages.pending([b"c"], ttl_s=5.0)  # a late duplicate mark does not un-land a page
    assert pages.state(b"c") is PageState.LANDED
    pages.pending([b"d", b"e", b"f", b"g"], ttl_s=5.0)
    assert len(pages) == 3 and pages.state(b"d") is PageState.GONE  # oldest went first
    assert pages.snapshot()["pending_keys_marked"] == 9


def committed_and_pending(policy: str, **cfg):
    """Storage holds page 0 of TOKENS; pages 1-2 are announced pending by 'decode'."""
    storage = DictBackend()
    writer = Stack(storage)
    writer.prefill(TOKENS)
    writer.close()
    keys = writer.cache.page_keys(TOKENS, "")
    stored = {key: storage.pages.pop(key) for key in keys[1:]}
    pending = PendingPages()
    st = Stack(storage, pending=pending, prefetch_policy=policy, **cfg)
    return st, storage, pending, keys, stored


def land(storage: DictBackend, pending: PendingPages, stored: dict[bytes, bytes]) -> None:
    storage.pages.update(stored)
    for key in stored:
        storage.origin[key] = "decode"
    pending.settled(list(stored), [True] * len(stored))


def ready_within(st: Stack, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while not st.cache.prefetch_ready("r"):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.005)
    return True


@pytest.mark.parametrize("policy", ["wait_complete", "timeout"])
def test_pending_pages_are_waited_for_and_read_once_landed(policy: str) -> None:
    st, storage, pending, keys, stored = committed_and_pending(policy)
    pending.pending(keys[1:], ttl_s=30.0)
    assert st.cache.start_prefetch("r", TOKENS + [1], "", 0, PAGES) == PAGES
    assert not ready_within(st, 0.1)  # decode is still writing pages 1-2
    land(storage, pending, stored)
    assert ready_within(st, 10)
    result = st.cache.take_prefetch("r")
    assert len(result.host_page_ids) == PAGES and result.from_decode_pages == 2
    device_pages = st.alloc.alloc(PAGES)
    _, load = st.cache.load(st.cache.match(TOKENS, "", 0)[1], result, device_pages)
    load.finish()
    assert torch.equal(st.device_kv[0, 0, device_pages], st.expected(TOKENS))  # byte-exact KV
    stats = st.cache.stats
    assert (stats.pending_found_pages, stats.pending_waited_pages,
            stats.pending_raced_pages) == (2, 2, 0)
    st.close()


def test_an_expired_mark_ends_the_wait_of_wait_complete() -> None:
    """Decode died mid-write: its mark's TTL bounds even a policy without a deadline."""
    st, _, pending, keys, _ = committed_and_pending("wait_complete")
    pending.pending(keys[1:], ttl_s=0.3)  # never settled
    started = time.monotonic()
    assert st.cache.start_prefetch("r", TOKENS + [1], "", 0, PAGES) == PAGES
    assert ready_within(st, 10)
    assert time.monotonic() - started >= 0.25
    assert len(st.cache.take_prefetch("r").host_page_ids) == 1  # the committed page
    assert (st.cache.stats.pending_waited_pages, st.cache.stats.pending_raced_pages) == (0, 2)
    st.close()


def test_the_timeout_deadline_ends_the_wait_before_the_mark_expires() -> None:
    st, _, pending, keys, _ = committed_and_pending(
        "timeout", prefetch_timeout_base_s=0.2, prefetch_timeout_per_1k_tokens_s=0.0)
    pending.pending(keys[1:], ttl_s=60.0)
    assert st.cache.start_prefetch("r", TOKENS + [1], "", 0, PAGES) == PAGES
    assert not ready_within(st, 0.1)
    assert ready_within(st, 10)
    assert len(st.cache.take_prefetch("r").host_page_ids) == 1
    assert st.cache.stats.pending_raced_pages == 2
    st.close()


def test_a_failed_write_ends_the_wait_at_once() -> None:
    st, storage, pending, keys, stored = committed_and_pending("wait_complete")
    pending.pending(keys[1:], ttl_s=60.0)
    assert st.cache.start_prefetch("r", TOKENS + [1], "", 0, PAGES) == PAGES
    storage.pages[keys[1]] = stored[keys[1]]
    storage.origin[keys[1]] = "decode"
    pending.settled(keys[1:], [True, False])  # page 2 was dropped by decode's backpressure
    assert ready_within(st, 10)
    assert len(st.cache.take_prefetch("r").host_page_ids) == 2
    stats = st.cache.stats
    assert (stats.pending_waited_pages, stats.pending_raced_pages) == (1, 1)
    st.close()


def test_without_pending_wait_they_are_counted_raced_and_recomputed() -> None:
    st, _, pending, keys, _ = committed_and_pending("wait_complete", pending_wait=False)
    pending.pending(keys[1:], ttl_s=60.0)
    assert st.cache.start_prefetch("r", TOKENS + [1], "", 0, PAGES) == 1  # committed only
    assert ready_within(st, 10)
    assert len(st.cache.take_prefetch("r").host_page_ids) == 1
    stats = st.cache.stats
    assert (stats.pending_found_pages, stats.pending_waited_pages,
            stats.pending_raced_pages) == (2, 0, 2)
    st.close()


def test_a_request_that_leaves_while_waiting_frees_its_host_pages() -> None:
    st, _, pending, keys, _ = committed_and_pending("wait_complete")
    pending.pending(keys[1:], ttl_s=60.0)
    assert st.cache.start_prefetch("r", TOKENS + [1], "", 0, PAGES) == PAGES
    st.cache.cancel_prefetch("r")
    assert st.cache.wait_idle(10)
    assert st.host.num_in_flight == 0 and not st.host.any_pinned
    st.close()


def test_a_peer_ttl_is_clamped_to_the_prefill_cap() -> None:
    """A decode announcing a huge TTL cannot make prefill wait past its own cap: the mark
    expires `max_ttl_s` after it was announced (and a landed one a cap after it landed)."""
    clock = Clock()
    pages = PendingPages(clock=clock, max_ttl_s=2.0)
    pages.pending([b"a", b"b"], ttl_s=3600.0, source=b"d0")
    clock.now += 1.9
    assert pages.run([b"a", b"b"]) == 2
    pages.settled([b"b"], [True])
    clock.now += 0.2  # a: 2.1 s after its mark, past the cap
    assert pages.state(b"a") is PageState.GONE
    assert pages.state(b"b") is PageState.LANDED  # landed at +1.9: kept one capped TTL
    clock.now += 1.9
    assert pages.state(b"b") is PageState.GONE
    pages.pending([b"c"], ttl_s=0.5)  # a shorter peer TTL stays as announced
    clock.now += 0.6
    assert pages.state(b"c") is PageState.GONE
    with pytest.raises(ValueError, match="max_ttl_s"):
        PendingPages(max_ttl_s=0.0)


def test_losing_a_decode_peer_drops_only_its_pending_marks() -> None:
    clock = Clock()
    pages = PendingPages(clock=clock)
    pages.pending([b"a", b"b", b"c"], ttl_s=10.0, source=b"link-d0")
    pages.pending([b"x", b"c"], ttl_s=10.0, source=b"link-d1")  # c: re-announced by d1
    pages.settled([b"b"], [True])  # landed: stays readable whoever announced it
    assert pages.forget_source(b"link-d0") == 1  # a (b landed, c now d1's)
    assert [pages.state(k) for k in (b"a", b"b", b"c", b"x")] == [
        PageState.GONE, PageState.LANDED, PageState.PENDING, PageState.PENDING]
    assert pages.forget_source(b"link-d0") == 0
    assert pages.forget_source(b"link-d1") == 2
    assert len(pages) == 1 and pages.snapshot()["pending_keys_forgotten"] == 3


def test_landed_pages_are_read_while_the_role_keeps_the_request_queued() -> None:
    """Only `prefetch_ready` started the reads of announced pages that landed, and a role
    (a prefill node waiting for decode) keeps the tiers from being asked: the reads began
    when the gate opened and, past the deadline, the request was admitted without them
    (recomputed). Every engine step (`reap`) starts them now."""
    st, storage, pending, keys, stored = committed_and_pending(
        "timeout", prefetch_timeout_base_s=0.3, prefetch_timeout_per_1k_tokens_s=0.0)
    pending.pending(keys[1:], ttl_s=60.0)
    started = time.monotonic()
    assert st.cache.start_prefetch("r", TOKENS + [1], "", 0, PAGES) == PAGES
    land(storage, pending, stored)
    st.cache.reap()  # an engine step; the role still holds the request back
    deadline = time.monotonic() + 10
    while not st.cache.prefetches.complete("r") and time.monotonic() < deadline:
        time.sleep(0.005)
    while time.monotonic() < started + 0.4:  # the gate opens past the prefetch deadline
        time.sleep(0.01)
    assert st.cache.prefetch_ready("r")
    assert len(st.cache.take_prefetch("r").host_page_ids) == PAGES  # every page, none raced
    assert st.cache.stats.pending_raced_pages == 0
    st.close()
