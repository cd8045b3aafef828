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
    on its own thread; `reachable=False`: requests vanish (decode gone mid-pull).
    `authenticated`: the control plane's (a KVSender with the cluster secret's key)."""

    def __init__(self, pulls: PagePulls, objects: dict[bytes, bytes],
                 reachable: bool = True, authenticated: bool = True) -> None:
        self.pulls, self.objects, self.reachable = pulls, objects, reachable
        self.authenticated = authenticated
        self.requests: list[list[bytes]] = []

    def request_pull(self, source: bytes, pull_id: int, keys: list[bytes],
                     ttl_s: float = 0.0) -> bool:
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


def pending_stack(tmp_path, mode: str, mac: bool = True, clock=time.monotonic, **cfg):
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
    pending = PendingPages(pulls=pulls, clock=clock)
    st = Stack(storage, pending=pending, **{"prefetch_policy": "timeout", **cfg})
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


def prefetch_pulled_or_waited(st: Stack, storage, pending, keys: list[bytes],
                              objects: dict[bytes, bytes], decode: Decode, pulled: bool) -> None:
    """Prefetch the 2 awaited pages: pulled from `decode` when `pulled`, else waited for (the
    write lands, then is read back); either way byte-exact, counted (found, waited, pulled,
    raced) as the path taken. Closes `st`."""
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


def test_a_forged_pulled_page_is_rejected_with_the_mac(tmp_path) -> None:
    """The forger (no secret) rewraps page 2's genuine KV as another page's under page 1's
    key with a valid checksum; page 2 has a flipped payload bit. The page MAC makes both
    counted rejects and the wait falls back to storage (the genuine pages land later): the KV
    is exact."""
    st, storage, config, pending, pulls, keys, objects = pending_stack(tmp_path, "always")
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
    assert counters["pull_pages_rejected"] == 2 and counters["pull_pages_received"] == 0
    assert pages == PAGES and torch.equal(kv, st.expected(TOKENS))
    assert outcome(st) == (2, 2, 0, 0)
    st.close()


@pytest.mark.parametrize("mac, authenticated, pulled", [
    (True, True, True),  # the cluster secret: MAC'd pages over an authenticated control plane
    (False, True, False),  # no page MAC: a checksum-valid forgery could not be told apart
    (True, False, False),  # unauthenticated control plane: anyone may answer as decode
])
def test_no_pull_without_the_secret_s_protections(tmp_path, mac: bool, authenticated: bool,
                                                   pulled: bool) -> None:
    """Even on "always": without the page MAC or an authenticated control plane (no cluster
    secret) the awaited pages are waited for, never pulled (docs/security.md)."""
    st, storage, _, pending, pulls, keys, objects = pending_stack(tmp_path, "always", mac)
    decode = Decode(pulls, objects, authenticated=authenticated)
    pulls.attach(decode)
    pending.pending(keys[1:], ttl_s=30.0, source=SOURCE, pullable=True)
    prefetch_pulled_or_waited(st, storage, pending, keys, objects, decode, pulled)


def test_an_unanswered_pull_times_out_and_lowers_the_rate(tmp_path) -> None:
    """Decode never answers: the pull ends at its deadline (0.25 s), the wait takes over, and
    the rate estimate falls (nothing came), so the next pull needs a longer wait to pay."""
    st, storage, _, pending, pulls, keys, objects = pending_stack(tmp_path, "always")
    decode = Decode(pulls, objects, reachable=False)
    pulls.attach(decode)
    pending.pending(keys[1:], ttl_s=30.0, source=SOURCE, pullable=True)
    started = time.monotonic()
    assert st.cache.start_prefetch("r", TOKENS + [1], "", 0, PAGES) == PAGES
    assert not ready_within(st, 0.15)  # the pull holds the pages
    for key, blob in objects.items():  # the write lands, announced only once the pull ended
        assert storage.write_object(key, blob)
    while pulls.snapshot()["pulls_in_flight"]:
        st.cache.prefetch_ready("r")
        assert time.monotonic() - started < 2.0
        time.sleep(0.005)
    assert time.monotonic() - started >= 0.2  # its deadline
    pending.settled(keys[1:], [True, True])
    assert ready_within(st, 5)
    pages, kv = load_prefetch(st)
    assert pages == PAGES and torch.equal(kv, st.expected(TOKENS))
    assert outcome(st) == (2, 2, 0, 0)
    counters = pulls.snapshot()
    assert (counters["pull_timeouts"], counters["pull_abandoned"]) == (1, 0)
    assert counters["pull_rate_bytes_s"] == DEFAULT_PULL_RATE_BYTES_S / 2
    assert decode.requests == [keys[1:]]
    st.close()


def test_a_pull_overtaken_by_the_write_ends_at_once(tmp_path) -> None:
    """The write lands while the pull hangs: the storage read takes over at once (the pull is
    closed as abandoned, not waited out to its deadline nor counted timed out)."""
    st, storage, _, pending, pulls, keys, objects = pending_stack(tmp_path, "always")
    decode = Decode(pulls, objects, reachable=False)
    pulls.attach(decode)
    pending.pending(keys[1:], ttl_s=30.0, source=SOURCE, pullable=True)
    before = time.monotonic()
    assert st.cache.start_prefetch("r", TOKENS + [1], "", 0, PAGES) == PAGES
    for key, blob in objects.items():
        assert storage.write_object(key, blob)
    pending.settled(keys[1:], [True, True])
    assert ready_within(st, 5)
    assert time.monotonic() < before + 0.25  # did not wait for the pull's deadline
    pages, kv = load_prefetch(st)
    assert pages == PAGES and torch.equal(kv, st.expected(TOKENS))
    assert outcome(st) == (2, 2, 0, 0)
    counters = pulls.snapshot()
    assert (counters["pull_timeouts"], counters["pull_abandoned"]) == (0, 1)
    assert counters["pull_rate_bytes_s"] == DEFAULT_PULL_RATE_BYTES_S
    st.close()


def test_best_effort_never_starts_a_pull(tmp_path) -> None:
    """best_effort admits without waiting: a pull would be abandoned the moment it left."""
    st, _, _, pending, pulls, keys, objects = pending_stack(tmp_path, "always",
                                                            prefetch_policy="best_effort")
    decode = Decode(pulls, objects)
    pulls.attach(decode)
    pending.pending(keys[1:], ttl_s=30.0, source=SOURCE, pullable=True)
    st.cache.start_prefetch("r", TOKENS + [1], "", 0, PAGES)
    assert decode.requests == [] and pulls.snapshot()["pulls"] == 0
    st.cache.cancel_prefetch("r")
    st.close()


def test_answers_for_other_keys_are_not_verified_and_late_ones_copy_nothing(tmp_path) -> None:
    """An answer naming keys the ticket does not hold costs no verification (no reject is
    counted for its garbage object); one after the ticket closed copies nothing."""
    st, _, config, pending, pulls, keys, objects = pending_stack(tmp_path, "always")
    pulls.attach(Decode(pulls, {}, reachable=False))
    spec = config.page_spec()
    pages = [torch.zeros(spec.payload_bytes, dtype=torch.uint8) for _ in keys[1:]]
    ticket = pulls.start(SOURCE, keys[1:], pages, spec, timeout_s=5.0)
    assert ticket is not None
    size = spec.object_bytes
    pulls.pulled(SOURCE, ticket.pull_id, [keys[0]], [True], size, b"x" * size)
    assert pulls.snapshot()["pull_pages_rejected"] == 0 and ticket.answers == 0
    pulls.finish(ticket)  # closed unfinished, before its deadline
    assert pulls.snapshot()["pull_abandoned"] == 1 and pulls.snapshot()["pull_timeouts"] == 0
    pulls.pulled(SOURCE, ticket.pull_id, keys[1:], [True, True], size,
                 objects[keys[1]] + objects[keys[2]])
    counters = pulls.snapshot()
    assert counters["pull_pages_received"] == 0 and counters["pull_answers_unexpected"] == 1
    assert all(not page.any() for page in pages)
    st.close()


@pytest.mark.parametrize("mode, eta_s, pulled", [
    ("never", 10.0, False),  # waits whatever decode expects
    ("auto", 10.0, True),  # decode expects 10 s more: a pull of 2 small pages is faster
    # the write lands sooner than a pull's round trip (measured at 5 s below; an eta of 1 ms
    # was overdue, so pulled, whenever the lookup took longer than that on a loaded machine)
    ("auto", 1.0, False),
    ("auto", 0.0, False),  # unknown (no write measured on decode yet): wait
    ("auto", -1.0, True),  # overdue (expected 1 s ago) and still pending: the store is slow
])
def test_the_per_request_rule(tmp_path, mode: str, eta_s: float, pulled: bool) -> None:
    skew = [1.5 if eta_s < 0 else 0.0]  # the overdue case: marked 1.5 s "ago"
    st, storage, _, pending, pulls, keys, objects = pending_stack(
        tmp_path, mode, clock=lambda: time.monotonic() - skew[0])
    decode = Decode(pulls, objects)
    pulls.attach(decode)
    if eta_s == 1.0:
        pulls.rtt_s = 5.0  # a slow link's measured round trip: waiting for the write is faster
    # overdue: announced 1.5 s ago expecting the write to land 0.5 s later
    pending.pending(keys[1:], ttl_s=30.0, source=SOURCE, eta_s=0.5 if eta_s < 0 else eta_s,
                    pullable=True)
    skew[0] = 0.0
    prefetch_pulled_or_waited(st, storage, pending, keys, objects, decode, pulled)


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
