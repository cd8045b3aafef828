"""HiCache pulls pending pages from decode's staging (docs/design.md §4.10, "Pull"): the
awaited pages of a prefetch come from a pull answered with stored page objects, verified
exactly like a storage read (a forged or corrupted object is a counted reject, never KV); a
pull that is not answered (decode unreachable) falls back to the wait, bounded; "never"
waits; "auto" pulls only when decode's expected remaining write time exceeds the pull's
estimate. The decode end is the test's `Decode` (what KVReceiver + DecodeOffloadManager
answer, minus the sockets: tests/transfer/test_pull_pages.py runs those)."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from pdcache.offload_manager.page_pull import DEFAULT_PULL_RATE_BYTES_S, PagePulls
from pdcache.offload_manager.pending import PendingPages
from pdcache.offload_manager.storage import create_backend
from pdcache.offload_manager.storage.config import StorageConfig
from pdcache.offload_manager.storage.page_format import encode_object
from tests.offload_manager.test_hicache import FP, TOKENS, D, H, L, S, Stack

PAGES = len(TOKENS) // S  # 3: page 0 committed, pages 1-2 pending on "decode"
MAC_KEY = bytes(range(32))
SOURCE = b"d" * 16  # the decode link that announced the pages


class Decode:
    """Answers pulls with `objects` (key -> stored page object), as the decode node would,
    on its own thread; `reachable=False`: requests vanish (decode gone mid-pull)."""

    def __init__(self, pulls: PagePulls, objects: dict[bytes, bytes],
                 reachable: bool = True) -> None:
        self.pulls, self.objects, self.reachable = pulls, objects, reachable
        self.requests: list[list[bytes]] = []

    def request_pull(self, source: bytes, pull_id: int, keys: list[bytes]) -> bool:
        self.requests.append(keys)
        if self.reachable:
            threading.Thread(target=self._answer, args=(source, pull_id, keys)).start()
        return True

    def _answer(self, source: bytes, pull_id: int, keys: list[bytes]) -> None:
        found = [key in self.objects for key in keys]
        blob = b"".join(self.objects[key] for key in keys if key in self.objects)
        size = len(next(iter(self.objects.values()))) if self.objects else 0
        self.pulls.pulled(source, pull_id, keys, found, size, blob)


def storage_config(tmp_path, mac: bool) -> StorageConfig:
    return StorageConfig(backend="file", path=str(tmp_path / "s"), page_bytes=L * 2 * S * H * D * 4,
                         capacity_pages=64, fingerprint=FP, num_layers=L, page_size=S,
                         dtype="float32", page_mac_key=MAC_KEY if mac else None)


def pending_stack(tmp_path, mode: str, mac: bool = True, **cfg):
    """Storage holds page 0 of TOKENS; pages 1-2 were written, taken out again (their stored
    objects kept: what decode's staging would serve) and announced pending by SOURCE."""
    config = storage_config(tmp_path, mac)
    storage = create_backend(config)
    writer = Stack(storage)
    writer.prefill(TOKENS)
    writer.close()
    keys = writer.cache.page_keys(TOKENS, "")
    objects = {key: storage.read_object(key) for key in keys[1:]}
    storage.delete(keys[1:])
    pulls = PagePulls(mode)
    pending = PendingPages(pulls=pulls)
    st = Stack(storage, prefetch_policy="timeout", **cfg)
    st.cache.pending = pending
    return st, storage, config, pending, pulls, keys, objects


def ready_within(st: Stack, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while not st.cache.prefetch_ready("r"):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.002)
    return True


def load_prefetch(st: Stack) -> tuple[int, torch.Tensor]:
    result = st.cache.take_prefetch("r")
    device_pages = st.alloc.alloc(len(result.host_page_ids))
    _, load = st.cache.load(st.cache.match(TOKENS, "", 0)[1], result, device_pages)
    if load is not None:
        load.finish()
    return len(result.host_page_ids), st.device_pages(device_pages)


def outcome(st: Stack) -> tuple[int, int, int, int]:
    s = st.cache.stats
    return (s.pending_found_pages, s.pending_waited_pages, s.pending_pulled_pages,
            s.pending_raced_pages)


def test_always_pulls_the_awaited_pages_byte_exact(tmp_path) -> None:
    st, _, _, pending, pulls, keys, objects = pending_stack(tmp_path, "always")
    decode = Decode(pulls, objects)
    pulls.attach(decode)
    pending.pending(keys[1:], ttl_s=30.0, source=SOURCE, pullable=True)  # never lands
    assert st.cache.start_prefetch("r", TOKENS + [1], "", 0, PAGES) == PAGES
    assert ready_within(st, 5)
    pages, kv = load_prefetch(st)
    assert pages == PAGES and torch.equal(kv, st.expected(TOKENS))
    assert decode.requests == [keys[1:]]
    assert outcome(st) == (2, 0, 2, 0)
    counters = pulls.snapshot()
    assert (counters["pull_pages_received"], counters["pull_pages_rejected"]) == (2, 0)
    assert counters["pull_rate_bytes_s"] != DEFAULT_PULL_RATE_BYTES_S  # learnt from the pull
    st.close()


@pytest.mark.parametrize("mac", [True, False], ids=["mac_on", "mac_off"])
def test_a_forged_pulled_page_is_rejected_with_the_mac(tmp_path, mac: bool) -> None:
    """The forger (no secret) rewraps page 2's genuine KV as another page's under page 1's
    key with a valid checksum; page 2 has a flipped payload bit. With the page MAC both are
    counted rejects and the wait falls back to storage (the genuine pages land later): the KV
    is exact. Without it (protection off) the checksum-valid forgery is served."""
    st, storage, config, pending, pulls, keys, objects = pending_stack(tmp_path, "always", mac)
    forger_spec = config.replace(page_mac_key=None).page_spec()
    payload_2 = objects[keys[2]][128:]
    forged = {keys[1]: encode_object(forger_spec, keys[1], "decode", payload_2),
              keys[2]: objects[keys[2]][:-1] + bytes([objects[keys[2]][-1] ^ 1])}
    pulls.attach(Decode(pulls, forged))
    pending.pending(keys[1:], ttl_s=30.0, source=SOURCE, pullable=True)
    assert st.cache.start_prefetch("r", TOKENS + [1], "", 0, PAGES) == PAGES
    deadline = time.monotonic() + 5
    while pulls.snapshot()["pull_pages_rejected"] + pulls.snapshot()["pull_pages_received"] < 2:
        assert time.monotonic() < deadline
        time.sleep(0.002)
    st.cache.prefetch_ready("r")  # the pull's end is seen: the rest is waited for
    for key, blob in objects.items():  # decode's genuine writes land
        assert storage.write_object(key, blob)
    pending.settled(keys[1:], [True, True])
    assert ready_within(st, 5)
    pages, kv = load_prefetch(st)
    counters = pulls.snapshot()
    if mac:
        assert counters["pull_pages_rejected"] == 2 and counters["pull_pages_received"] == 0
        assert pages == PAGES and torch.equal(kv, st.expected(TOKENS))
        assert outcome(st) == (2, 2, 0, 0)
    else:  # the forgery passes a checksum-only check: page 1 holds page 2's KV
        assert counters["pull_pages_received"] == 1 and counters["pull_pages_rejected"] == 1
        assert not torch.equal(kv, st.expected(TOKENS))
    st.close()


def test_an_unanswered_pull_falls_back_to_the_wait(tmp_path) -> None:
    st, storage, _, pending, pulls, keys, objects = pending_stack(tmp_path, "always")
    decode = Decode(pulls, objects, reachable=False)
    pulls.attach(decode)
    pending.pending(keys[1:], ttl_s=30.0, source=SOURCE, pullable=True)
    started = time.monotonic()
    assert st.cache.start_prefetch("r", TOKENS + [1], "", 0, PAGES) == PAGES
    for key, blob in objects.items():  # the write lands while the pull hangs
        assert storage.write_object(key, blob)
    pending.settled(keys[1:], [True, True])
    assert ready_within(st, 5)
    assert 0.2 <= time.monotonic() - started < 2.0  # the pull's timeout (0.25 s), then reads
    pages, kv = load_prefetch(st)
    assert pages == PAGES and torch.equal(kv, st.expected(TOKENS))
    assert outcome(st) == (2, 2, 0, 0)
    assert pulls.snapshot()["pull_timeouts"] == 1 and decode.requests == [keys[1:]]
    st.close()


@pytest.mark.parametrize("mode, eta_s, pulled", [
    ("never", 10.0, False),  # waits whatever decode expects
    ("auto", 10.0, True),  # decode expects 10 s more: a pull of 2 small pages is faster
    ("auto", 0.001, False),  # the write lands sooner than a pull's round trip
    ("auto", 0.0, False),  # unknown (no write measured on decode yet): wait
])
def test_the_per_request_rule(tmp_path, mode: str, eta_s: float, pulled: bool) -> None:
    st, storage, _, pending, pulls, keys, objects = pending_stack(tmp_path, mode)
    decode = Decode(pulls, objects)
    pulls.attach(decode)
    pending.pending(keys[1:], ttl_s=30.0, source=SOURCE, eta_s=eta_s, pullable=True)
    assert st.cache.start_prefetch("r", TOKENS + [1], "", 0, PAGES) == PAGES
    assert bool(decode.requests) == pulled
    if not pulled:
        for key, blob in objects.items():
            assert storage.write_object(key, blob)
        pending.settled(keys[1:], [True, True])
    assert ready_within(st, 5)
    pages, kv = load_prefetch(st)
    assert pages == PAGES and torch.equal(kv, st.expected(TOKENS))
    assert outcome(st) == ((2, 0, 2, 0) if pulled else (2, 2, 0, 0))
    st.close()


def test_a_decode_that_does_not_offer_the_pull_is_waited_for(tmp_path) -> None:
    """A version-4 decode (no `pull` in its marks) is never asked, even with "always"."""
    st, storage, _, pending, pulls, keys, objects = pending_stack(tmp_path, "always")
    decode = Decode(pulls, objects)
    pulls.attach(decode)
    pending.pending(keys[1:], ttl_s=30.0, source=SOURCE)
    assert st.cache.start_prefetch("r", TOKENS + [1], "", 0, PAGES) == PAGES
    assert decode.requests == []
    for key, blob in objects.items():
        assert storage.write_object(key, blob)
    pending.settled(keys[1:], [True, True])
    assert ready_within(st, 5)
    assert load_prefetch(st)[0] == PAGES and outcome(st) == (2, 2, 0, 0)
    st.close()
