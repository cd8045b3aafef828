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
from pdcache.transfer import KVReceiver, KVSender, TransferConfig
from pdcache.transfer.messages import (
    MessageError,
    PagesPending,
    PagesPulled,
    PullPages,
    decode,
    encode,
    pack_keys,
)
from pdcache.utils.secret import derive_key

LIMIT = 1 << 20
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


@pytest.mark.parametrize("body, kind", [
    ({"v": 4, "t": "pull_pages", "pull_id": 1, "keys": pack_keys(KEYS)}, "unknown_type"),
    ({"v": 5, "t": "pages_pending", "keys": pack_keys(KEYS), "ttl_ms": 5, "eta_ms": 1,
      "pull": 2}, "bad_field"),
    ({"v": 5, "t": "pull_pages", "pull_id": 1, "keys": b""}, "bad_field"),
    ({"v": 5, "t": "pages_pulled", "pull_id": 1, "keys": pack_keys(KEYS),
      "found": bytes([1, 1]), "object_bytes": 2, "objects": b"abcd"}, "bad_field"),
    ({"v": 5, "t": "pages_pulled", "pull_id": 1, "keys": pack_keys(KEYS),
      "found": bytes([1, 0, 1]), "object_bytes": 2, "objects": b"abc"}, "bad_field"),
])
def test_malformed_or_too_new_pull_messages_are_refused(body: dict, kind: str) -> None:
    with pytest.raises(MessageError) as info:
        decode(msgpack.packb(body, use_bin_type=True), LIMIT)
    assert info.value.kind == kind


def storage_config(tmp_path, mac_key: bytes | None, delay_s: float) -> StorageConfig:
    return StorageConfig(backend="file", path=str(tmp_path / "s"), page_bytes=PAGE_BYTES,
                         capacity_pages=64, fingerprint=FP, num_layers=LAYERS, page_size=PAGE,
                         dtype="float32", page_mac_key=mac_key, write_delay_s=delay_s)


def wait_for(cond, timeout_s: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while not cond():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.005)
    return True


class Pair:
    """A decode (offload manager over slow file storage, KVReceiver serving its staging) and
    a prefill (KVSender feeding PendingPages + PagePulls), registered with each other."""

    def __init__(self, tmp_path, secret: bytes | None, decode_page_key: bytes | None,
                 prefill_page_key: bytes | None, max_message_bytes: int = LIMIT) -> None:
        control_key = derive_key(secret, "zmq-control") if secret else None
        config = TransferConfig(engine="zmq", bootstrap_timeout_s=5, room_timeout_s=5,
                                max_message_bytes=max_message_bytes)
        gen = torch.Generator().manual_seed(0)
        self.kv = torch.randn(LAYERS, 2, PAGES, PAGE, HEADS, DIM, generator=gen)
        self.storage = create_backend(storage_config(tmp_path, decode_page_key, 1.0))
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
        self.spec = storage_config(tmp_path, prefill_page_key, 0.0).page_spec()
        self.offload.start()
        self.sender.start()
        self.receiver.start()
        self.receiver.connect(self.sender.bootstrap_addr)

    def write_answer(self, pages: int) -> list[bytes]:
        """Decode finishes a request of `pages` pages: announced, copied to staging, its
        (slow) write under way. Returns the keys."""
        tokens = list(range(pages * PAGE + 1))
        keys = chain_page_keys(tokens, PAGE, make_salt(FP))
        released = threading.Event()
        self.offload.track("r")
        self.offload.finish("r", tokens, list(range(pages)), released.set)
        assert released.wait(30)  # copied (the first copy may build the kernels): staged now
        assert wait_for(lambda: self.pending.pull_run(keys)[1] == pages, 30)
        self.source = self.pending.pull_run(keys)[0]  # the decode's link
        return keys

    def pull(self, keys: list[bytes]):
        pages = [torch.zeros(PAGE_BYTES, dtype=torch.uint8) for _ in keys]
        ticket = self.pulls.start(self.source, keys, pages, self.spec, timeout_s=5.0)
        assert ticket is not None
        assert wait_for(lambda: ticket.finished, 30)
        self.pulls.finish(ticket)
        return ticket, pages

    def expected(self, page: int) -> torch.Tensor:
        return self.kv[:, :, page].contiguous().view(-1).view(torch.uint8)

    def close(self) -> None:
        self.receiver.close()
        self.sender.close()
        assert self.offload.wait_idle(10)
        self.offload.check()  # every staging page freed, none leaked by a pin
        self.offload.close()


@pytest.mark.parametrize("secret", [None, b"a cluster secret for this test"], ids=["plain", "auth"])
def test_staged_pages_are_pulled_byte_exact_in_bounded_answers(tmp_path, secret) -> None:
    page_key = derive_key(secret, "page-mac") if secret else None
    # 3 pages of 1 KiB + 128 B a frame of 2.5 KiB: each answer carries at most 1 page
    pair = Pair(tmp_path, secret, page_key, page_key, max_message_bytes=2560)
    try:
        keys = pair.write_answer(3)
        ticket, pages = pair.pull(keys)
        assert ticket.ok == [True] * 3 and ticket.ok_prefix() == 3
        for i, page in enumerate(pages):
            assert torch.equal(page, pair.expected(i))
        counters = pair.pulls.snapshot()
        assert (counters["pull_pages_received"], counters["pull_pages_rejected"]) == (3, 0)
        stats = pair.receiver.stats()
        assert stats["pull_requests"] == 1 and stats["pull_pages_served"] == 3
        assert pair.sender.stats()["rejected"] == {} and pair.receiver.stats()["rejected"] == {}
        assert pair.offload.wait_idle(5)  # the write landed: nothing staged to pull any more
        late, _ = pair.pull(keys)
        assert late.ok == [False] * 3
        assert pair.pulls.snapshot()["pull_pages_unavailable"] == 3
    finally:
        pair.close()


def test_pages_of_another_page_key_are_rejected_and_counted(tmp_path) -> None:
    """A decode whose store is keyed with another secret's page key: its pulled pages fail
    the prefill's MAC check like a storage read of them would; none is served."""
    pair = Pair(tmp_path, None, derive_key(b"another secret", "page-mac"),
                derive_key(b"this secret", "page-mac"))
    try:
        keys = pair.write_answer(2)
        ticket, pages = pair.pull(keys)
        assert ticket.ok == [False, False]
        assert all(not page.any() for page in pages)  # nothing copied in
        counters = pair.pulls.snapshot()
        assert (counters["pull_pages_rejected"], counters["pull_pages_received"]) == (2, 0)
    finally:
        pair.close()


def test_a_pull_from_a_decode_gone_mid_pull_is_never_answered_and_times_out(tmp_path) -> None:
    """Decode exits after announcing: the pull leaves (its link is still registered) but no
    answer comes; the ticket ends at its deadline (HiCache then waits as before:
    tests/offload_manager/test_pending_pull.py), and a late answer would find it closed."""
    pair = Pair(tmp_path, None, None, None)
    try:
        keys = pair.write_answer(2)
        pair.receiver.close()
        pages = [torch.zeros(PAGE_BYTES, dtype=torch.uint8) for _ in keys]
        started = time.monotonic()
        ticket = pair.pulls.start(pair.source, keys, pages, pair.spec, timeout_s=0.3)
        assert ticket is not None
        assert not wait_for(lambda: ticket.finished, 0.5)
        pair.pulls.finish(ticket)
        assert time.monotonic() - started < 5
        assert pair.pulls.snapshot()["pull_timeouts"] == 1 and ticket.ok == [False, False]
        assert all(not page.any() for page in pages)
    finally:
        pair.sender.close()
        assert pair.offload.wait_idle(10)
        pair.offload.close()
