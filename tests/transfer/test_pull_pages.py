"""Control protocol version 5: a prefill pulls pending pages from decode's host staging
(docs/design.md §4.10). Messages round trip, are refused before version 5 and when
malformed, and old frames stay readable by version-4 peers; over real sockets (plain and
authenticated) a decode's `DecodeOffloadManager` serves the staged page objects of a write that
has not landed, split into answers of at most `max_message_bytes`, the prefill's `PagePulls`
verifies them into its host pages byte-exact; once the write ended the pages are "not
available"; a decode with another page key's pages are rejected and counted."""

from __future__ import annotations

import hashlib
import threading
import time

import msgpack
import pytest
import torch

from pdcache.engine.page_keys import chain_page_keys, make_salt
from pdcache.offload_manager.decode_offload import DecodeOffloadManager
from pdcache.offload_manager.page_pull import PagePulls
from pdcache.offload_manager.pending import PendingPages
from pdcache.offload_manager.storage import create_backend
from pdcache.offload_manager.storage.config import StorageConfig
from pdcache.transfer.config import TransferConfig
from pdcache.transfer.messages import (
    Abort,
    AbortAck,
    Done,
    MessageError,
    PagesPending,
    PagesPulled,
    PagesSettled,
    Ping,
    Pong,
    PrefillReport,
    PullPages,
    Register,
    RegisterAck,
    RoomRequest,
    Started,
    decode,
    encode,
    pack_keys,
    pack_pages,
)
from pdcache.transfer.receiver import KVReceiver
from pdcache.transfer.sender import KVSender
from pdcache.utils.secret import derive_key
from tests.polling import poll
from tests.transfer_support import scaled_limit

LIMIT = 1 << 20
SECRET = b"a cluster secret for this test"
KEYS = [hashlib.sha256(bytes([i])).digest() for i in range(3)]
LAYERS, PAGES, PAGE, HEADS, DIM = 2, 16, 4, 2, 8
PAGE_BYTES = LAYERS * 2 * PAGE * HEADS * DIM * 4
FP = "pull-test"


def _version(msg) -> int:
    return msgpack.unpackb(encode(msg), raw=False)["v"]


def test_version_5_messages_round_trip_and_old_frames_stay_version_4() -> None:
    pull = decode(encode(PullPages(7, pack_keys(KEYS))), LIMIT)
    assert pull.pull_id == 7 and pull.key_list() == KEYS
    answer = PagesPulled(7, pack_keys(KEYS), bytes([1, 0, 1]), 5, b"abcde" * 2)
    assert decode(encode(answer), LIMIT) == answer
    pending = PagesPending(pack_keys(KEYS), 100, eta_ms=40, pull=1)
    assert decode(encode(pending), LIMIT) == pending
    # a version-4 peer reads every frame without the new fields or types
    assert _version(PagesPending(pack_keys(KEYS), 100)) == 4 and _version(pending) == 5
    assert _version(pull) == 5
    old = {"v": 4, "t": "pages_pending", "keys": pack_keys(KEYS), "ttl_ms": 5}
    assert decode(msgpack.packb(old, use_bin_type=True), LIMIT).pull == 0


# What a version-4 decoder (b97f7aa) accepts, frozen: the fields of each type, exactly.
V4_FIELDS = {
    "register": {"decode_id", "engine", "session", "base_addr", "num_layers", "num_pages",
                 "page_bytes"},
    "register_ack": {"prefill_id", "error", "boot_id"}, "room_request":
        {"room", "dst_pages", "num_tokens"}, "started": {"room"},
    "done": {"room", "nbytes", "report"}, "abort": {"room", "reason", "code"},
    "abort_ack": {"room"}, "ping": {"seq"}, "pong": {"seq"},
    "pages_pending": {"keys", "ttl_ms"}, "pages_settled": {"keys", "landed"},
}


def test_a_version_4_peer_reads_every_frame_that_offers_no_pull() -> None:
    """Frames written in version 4 carry exactly the version-4 fields (a v4 decoder refuses
    any other: `bad_field`), the pending marks of a decode that offers no pull included."""
    frames = [Register("d", "zmq", b"s", 1, 2, 3, 4), RegisterAck("p", "", b"b" * 8),
              RoomRequest(1, pack_pages([0]), 1), Started(1),
              Done(1, 2, PrefillReport(5)), Abort(1, "x"), AbortAck(1), Ping(1), Pong(1),
              PagesPending(pack_keys(KEYS), 100), PagesSettled(pack_keys(KEYS), bytes(3))]
    for msg in frames:
        body = msgpack.unpackb(encode(msg), raw=False)
        assert body.pop("v") == 4 and set(body) - {"t"} == V4_FIELDS[body["t"]], msg.TYPE


@pytest.mark.parametrize("body, kind", [
    ({"v": 4, "t": "pull_pages", "pull_id": 1, "keys": pack_keys(KEYS)}, "unknown_type"),
    ({"v": 5, "t": "pages_pending", "keys": pack_keys(KEYS), "ttl_ms": 5, "eta_ms": 1,
      "pull": 2}, "bad_field"),
    ({"v": 5, "t": "pull_pages", "pull_id": 1, "keys": b"", "ttl_ms": 5}, "bad_field"),
    ({"v": 5, "t": "pull_pages", "pull_id": 1, "keys": pack_keys(KEYS), "ttl_ms": 0},
     "bad_field"),
    ({"v": 5, "t": "pages_pulled", "pull_id": 1, "keys": pack_keys(KEYS),
      "found": bytes([1, 1]), "object_bytes": 2, "objects": b"abcd"}, "bad_field"),
    ({"v": 5, "t": "pages_pulled", "pull_id": 1, "keys": pack_keys(KEYS),
      "found": bytes([1, 0, 1]), "object_bytes": 2, "objects": b"abc"}, "bad_field"),
])
def test_malformed_or_too_new_pull_messages_are_refused(body: dict, kind: str) -> None:
    with pytest.raises(MessageError) as info:
        decode(msgpack.packb(body, use_bin_type=True), LIMIT)
    assert info.value.kind == kind


def storage_config(tmp_path, mac_key: bytes | None) -> StorageConfig:
    return StorageConfig(backend="file", path=str(tmp_path / "s"), page_bytes=PAGE_BYTES,
                         capacity_pages=64, fingerprint=FP, num_layers=LAYERS, page_size=PAGE,
                         dtype="float32", page_mac_key=mac_key)


class Pair:
    """A decode (offload manager over slow file storage, KVReceiver serving its staging) and
    a prefill (KVSender feeding PendingPages + PagePulls), registered with each other."""

    def __init__(self, tmp_path, secret: bytes | None, decode_page_key: bytes | None,
                 prefill_page_key: bytes | None, max_message_bytes: int = LIMIT,
                 gate: threading.Event | None = None) -> None:
        """`gate`: decode's copies to staging wait for it (their storage lookup does)."""
        control_key = derive_key(secret, "zmq-control") if secret else None
        config = TransferConfig(engine="zmq", bootstrap_timeout_s=5, room_timeout_s=5,
                                max_message_bytes=max_message_bytes)
        gen = torch.Generator().manual_seed(0)
        self.kv = torch.randn(LAYERS, 2, PAGES, PAGE, HEADS, DIM, generator=gen)
        self.storage = create_backend(storage_config(tmp_path, decode_page_key))
        # decode's storage writes wait for land_writes(): staged pages stay pullable however
        # slowly a loaded machine runs the test (a fixed write delay lost that race)
        self.writes_land = threading.Event()
        put_from = self.storage.put_from

        def held_put_from(*args, **kwargs) -> list[bool]:
            if not self.writes_land.wait(scaled_limit(60)):  # a failed write, counted
                raise TimeoutError("the test never let decode's writes land")
            return put_from(*args, **kwargs)

        self.storage.put_from = held_put_from
        if gate is not None:
            lookup = self.storage.exists_prefix
            self.storage.exists_prefix = lambda keys: gate.wait(30) and lookup(keys)
        self.offload = DecodeOffloadManager(self.kv, self.storage, FP, staging_pages=8,
                                            stride_pages=64)
        self.receiver = KVReceiver(config, self.kv, control_key=control_key)
        self.offload.announce_to(self.receiver)
        self.receiver.serve_pulls(self.offload)
        self.pulls = PagePulls("always")
        self.pending = PendingPages(pulls=self.pulls)
        self.sender = KVSender(config, torch.zeros_like(self.kv), on_pages=self.pending,
                               control_key=control_key)
        self.pulls.attach(self.sender)
        self.spec = storage_config(tmp_path, prefill_page_key).page_spec()
        self.offload.start()
        self.sender.start()
        self.receiver.start()
        self.receiver.connect(self.sender.bootstrap_addr)

    def write_answer(self, pages: int, copied: bool = True) -> list[bytes]:
        """Decode finishes a request of `pages` pages: announced, copied to staging (unless
        not `copied`: the gate holds the copy), its (slow) write under way. Returns the keys."""
        tokens = list(range(pages * PAGE + 1))
        keys = chain_page_keys(tokens, PAGE, make_salt(FP))
        self.released = threading.Event()
        self.offload.track("r")
        self.offload.finish("r", tokens, list(range(pages)), self.released.set)
        if copied:  # (the first copy may build the kernels): staged now
            assert self.released.wait(30)
        assert poll(lambda: len(self.pending) == pages, 30, scaled=True)  # the marks arrived
        self.source = next(iter(self.sender._peers))  # the decode's link
        return keys

    def pull(self, keys: list[bytes], timeout_s: float = 5.0):
        pages = [torch.zeros(PAGE_BYTES, dtype=torch.uint8) for _ in keys]
        ticket = self.pulls.start(self.source, keys, pages, self.spec, timeout_s=timeout_s)
        assert ticket is not None
        assert poll(lambda: ticket.finished, 30, scaled=True)
        self.pulls.finish(ticket)
        return ticket, pages

    def expected(self, page: int) -> torch.Tensor:
        return self.kv[:, :, page].contiguous().view(-1).view(torch.uint8)

    def land_writes(self) -> None:
        """Let decode's held storage writes proceed (staged pages free once they land)."""
        self.writes_land.set()

    def close(self) -> None:
        self.land_writes()
        self.receiver.close()
        self.sender.close()
        assert self.offload.wait_idle(10)
        self.offload.check()  # every staging page freed, none leaked by a pin
        self.offload.close()


def test_staged_pages_are_pulled_byte_exact_in_bounded_answers(tmp_path) -> None:
    page_key = derive_key(SECRET, "page-mac")
    # 3 pages of 1 KiB + 128 B a frame of 2.5 KiB: each answer carries at most 1 page
    pair = Pair(tmp_path, SECRET, page_key, page_key, max_message_bytes=2560)
    try:
        keys = pair.write_answer(3)
        assert pair.pending.pull_run(keys)[1] == 3  # offered
        ticket, pages = pair.pull(keys)
        assert ticket.ok == [True] * 3 and ticket.ok_prefix() == 3
        for i, page in enumerate(pages):
            assert torch.equal(page, pair.expected(i))
        counters = pair.pulls.snapshot()
        assert (counters["pull_pages_received"], counters["pull_pages_rejected"]) == (3, 0)
        stats = pair.receiver.stats()
        assert stats["pull_requests"] == 1 and stats["pull_pages_served"] == 3
        assert pair.sender.stats()["rejected"] == {} and pair.receiver.stats()["rejected"] == {}
        pair.land_writes()
        assert pair.offload.wait_idle(scaled_limit(5))  # the write landed: nothing staged now
        late, _ = pair.pull(keys)
        assert late.ok == [False] * 3
        assert pair.pulls.snapshot()["pull_pages_unavailable"] == 3
    finally:
        pair.close()


@pytest.mark.parametrize("secret, page_key, frame, why", [
    (None, None, LIMIT, "no cluster secret"),
    (SECRET, None, LIMIT, "pages without the MAC"),
    (SECRET, derive_key(SECRET, "page-mac"), 2048, "a page larger than a frame"),
])
def test_a_decode_that_cannot_serve_a_pull_safely_does_not_offer_it(
        tmp_path, secret, page_key, frame: int, why: str) -> None:
    """No pull offered (the marks say `pull` 0, as version-4 frames, no eta); a pull sent
    anyway is answered "not available" for every key in one frame; prefill never pulls
    without an authenticated control plane either."""
    pair = Pair(tmp_path, secret, page_key, page_key, max_message_bytes=frame)
    try:
        assert not pair.receiver.pull_offered, why
        keys = pair.write_answer(3)
        assert pair.pending.pull_run(keys)[1] == 0  # waited for, never pulled
        assert pair.pulls.enabled == (secret is not None)
        if secret is not None and page_key is not None:
            ticket, pages = pair.pull(keys)
            assert ticket.ok == [False] * 3 and all(not page.any() for page in pages)
            stats = pair.receiver.stats()
            assert (stats["pull_pages_refused"], stats["pull_pages_served"]) == (3, 0)
    finally:
        pair.close()


def test_pages_of_another_page_key_are_rejected_and_counted(tmp_path) -> None:
    """A decode whose store is keyed with another secret's page key: its pulled pages fail
    the prefill's MAC check like a storage read of them would; none is served."""
    pair = Pair(tmp_path, SECRET, derive_key(b"another secret", "page-mac"),
                derive_key(SECRET, "page-mac"))
    try:
        keys = pair.write_answer(2)
        ticket, pages = pair.pull(keys)
        assert ticket.ok == [False, False]
        assert all(not page.any() for page in pages)  # nothing copied in
        counters = pair.pulls.snapshot()
        assert (counters["pull_pages_rejected"], counters["pull_pages_received"]) == (2, 0)
    finally:
        pair.close()


def test_a_pull_right_behind_the_mark_waits_for_the_copy_and_late_answers_copy_nothing(
        tmp_path) -> None:
    """Pulls reach decode before its copy to staging ended (the gate holds it): decode holds
    them until the pages are staged, within each pull's ttl. Pull A is given up by prefill
    meanwhile: its answer, served once the copy ended, is late (counted, its pages untouched);
    pull B, whose ttl runs out while it queues behind A, is dropped by decode, unanswered;
    pull D names a page twice (and no ticket of prefill's): served once each; pull C, sent
    once the copy ended, gets the pages byte-exact."""
    page_key = derive_key(SECRET, "page-mac")
    gate = threading.Event()
    pair = Pair(tmp_path, SECRET, page_key, page_key, gate=gate)
    try:
        keys = pair.write_answer(2, copied=False)
        pair.source = pair.pending.pull_run(keys)[0]
        pages_a = [torch.zeros(PAGE_BYTES, dtype=torch.uint8) for _ in keys]
        a = pair.pulls.start(pair.source, keys, pages_a, pair.spec, timeout_s=10.0)
        b = pair.pulls.start(pair.source, keys, [torch.zeros(PAGE_BYTES, dtype=torch.uint8)
                                                  for _ in keys], pair.spec, timeout_s=0.05)
        assert a is not None and b is not None
        assert pair.sender.request_pull(pair.source, 10**6, keys + keys[:1], 10.0)  # D
        assert poll(lambda: pair.receiver.stats()["pull_requests"] == 3, 5.0, scaled=True)
        pair.pulls.finish(a)  # prefill gave A up (admitted, cancelled) before any answer
        assert poll(lambda: time.monotonic() > b.deadline, 5.0, scaled=True)
        pair.pulls.finish(b)
        gate.set()
        assert pair.released.wait(30)
        assert poll(lambda: pair.pulls.snapshot()["pull_answers_unexpected"] == 2, 5.0, scaled=True)  # A, D
        assert all(not page.any() for page in pages_a)
        stats = pair.receiver.stats()
        assert (stats["pull_pages_served"], stats["pull_pages_expired"]) == (2 + 2, 2)
        counters = pair.pulls.snapshot()
        assert (counters["pull_abandoned"], counters["pull_timeouts"]) == (1, 1)
        c, pages_c = pair.pull(keys)
        assert c.ok == [True, True]
        assert all(torch.equal(page, pair.expected(i)) for i, page in enumerate(pages_c))
        assert pair.pulls.snapshot()["pull_answers_unexpected"] == 2  # B was never answered
    finally:
        gate.set()
        pair.close()


def test_a_pull_from_a_decode_gone_mid_pull_is_never_answered(tmp_path) -> None:
    """Decode exits after announcing: the pull leaves (its link is still registered) but no
    answer comes; the ticket is still open at its deadline, nothing written into its pages
    (HiCache's handling of that deadline: tests/offload_manager/test_pending_pull.py)."""
    page_key = derive_key(SECRET, "page-mac")
    pair = Pair(tmp_path, SECRET, page_key, page_key)
    try:
        keys = pair.write_answer(2)
        pair.source = pair.pending.pull_run(keys)[0]
        pair.receiver.close()
        pages = [torch.zeros(PAGE_BYTES, dtype=torch.uint8) for _ in keys]
        ticket = pair.pulls.start(pair.source, keys, pages, pair.spec, timeout_s=0.3)
        assert ticket is not None
        assert not poll(lambda: ticket.finished, 0.5)
        pair.pulls.finish(ticket)
        assert pair.pulls.snapshot()["pull_timeouts"] == 1 and ticket.ok == [False, False]
        assert all(not page.any() for page in pages)
    finally:
        pair.land_writes()
        pair.sender.close()
        assert pair.offload.wait_idle(10)
        pair.offload.close()


def test_serve_pulls_after_start_is_refused() -> None:
    """The pull worker starts with the receiver: a source set later would accept pulls that
    nobody answers."""
    config = TransferConfig(engine="zmq", bootstrap_timeout_s=5, room_timeout_s=5)
    kv = torch.zeros(LAYERS, 2, PAGES, PAGE, HEADS, DIM)
    receiver = KVReceiver(config, kv, control_key=derive_key(SECRET, "zmq-control")).start()
    try:
        with pytest.raises(RuntimeError, match="before start"):
            receiver.serve_pulls(None)
    finally:
        receiver.close()
