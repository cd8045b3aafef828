"""Control protocol version 4: `pages_pending` / `pages_settled` (decode → prefill, the durable
next turn, docs/design.md §4.10) round trip, are refused in older versions and when malformed,
and reach a prefill node's sink only from a registered decode peer."""

from __future__ import annotations

import hashlib
import time

import msgpack
import pytest
import torch

from pdcache.transfer.config import TransferConfig
from pdcache.transfer.messages import (
    ACCEPTED_VERSIONS,
    PROTOCOL_VERSION,
    MessageError,
    PagesPending,
    PagesSettled,
    decode,
    encode,
    pack_keys,
)
from pdcache.transfer.receiver import KVReceiver
from pdcache.transfer.sender import KVSender
from pdcache.utils.secret import derive_key

LIMIT = 1 << 20
KEYS = [hashlib.sha256(bytes([i])).digest() for i in range(5)]


def _reject_kind(body: dict) -> str:
    with pytest.raises(MessageError) as info:
        decode(msgpack.packb(body, use_bin_type=True), LIMIT)
    return info.value.kind


def test_version_4_round_trips_and_keeps_2_and_3() -> None:
    assert PROTOCOL_VERSION == 9 and ACCEPTED_VERSIONS == (2, 3, 4, 5, 6, 7, 8, 9)
    pending = decode(encode(PagesPending(pack_keys(KEYS), 2500)), LIMIT)
    assert pending.key_list() == KEYS and pending.ttl_ms == 2500
    settled = decode(encode(PagesSettled(pack_keys(KEYS), bytes([1, 0, 1, 1, 0]))), LIMIT)
    assert settled.key_list() == KEYS
    assert settled.landed_list() == [True, False, True, True, False]


def test_the_new_types_do_not_exist_before_version_4() -> None:
    body = {"t": "pages_pending", "keys": pack_keys(KEYS), "ttl_ms": 5}
    assert _reject_kind({"v": 3, **body}) == "unknown_type"
    assert decode(msgpack.packb({"v": 4, **body}, use_bin_type=True), LIMIT).ttl_ms == 5


@pytest.mark.parametrize("body", [
    {"t": "pages_pending", "keys": KEYS[0][:31], "ttl_ms": 5},  # not whole keys
    {"t": "pages_pending", "keys": b"", "ttl_ms": 5},  # no key
    {"t": "pages_pending", "keys": pack_keys(KEYS), "ttl_ms": 0},  # a mark that never lives
    {"t": "pages_settled", "keys": pack_keys(KEYS), "landed": bytes([1] * 4)},  # one short
    {"t": "pages_settled", "keys": pack_keys(KEYS[:1]), "landed": bytes([2])},  # not 0/1
    {"t": "pages_pending", "keys": b"\x00" * 32 * 4097, "ttl_ms": 5},  # over 4096 keys
])
def test_malformed_page_messages_are_bad_fields(body: dict) -> None:
    assert _reject_kind({"v": 4, **body}) == "bad_field"


def test_pack_keys_refuses_other_lengths() -> None:
    with pytest.raises(ValueError):
        pack_keys([b"short"])


@pytest.mark.parametrize("secret", [None, b"a cluster secret for this test"], ids=["plain", "auth"])
def test_announcements_reach_a_registered_prefill_peer(secret: bytes | None) -> None:
    """Plain and authenticated (sealed per peer for its link and boot: control.seal)."""
    control_key = derive_key(secret, "zmq-control") if secret else None
    got: dict[str, list] = {"pending": [], "settled": []}

    class Collect:
        def pending(self, keys: list[bytes], ttl_s: float, source: bytes = b"",
                    eta_s: float = 0.0, pullable: bool = False) -> None:
            got["pending"].append((keys, ttl_s))
            got.setdefault("sources", []).append(source)

        def forget_source(self, source: bytes) -> int:
            return 0

        def settled(self, keys: list[bytes], landed: list[bool]) -> None:
            got["settled"].append((keys, landed))

        def pulled(self, *args: object) -> None:
            got.setdefault("pulled", []).append(args)

    config = TransferConfig(engine="zmq", bootstrap_timeout_s=5, room_timeout_s=5)
    kv = torch.zeros(2, 2, 4, 4, 2, 8)
    sender = KVSender(config, kv, on_pages=Collect(), control_key=control_key).start()
    receiver = KVReceiver(config, kv, control_key=control_key).start()
    try:
        receiver.announce_pending(KEYS[:2], 1.5)  # no peer yet: nobody hears it
        receiver.connect(sender.bootstrap_addr)
        receiver.announce_pending(KEYS, 1.5)
        receiver.announce_settled(KEYS[:3], [True, False, True])
        deadline = time.monotonic() + 5
        while len(got["settled"]) < 1 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert got["pending"] == [(KEYS, 1.5)]
        assert [len(source) for source in got["sources"]] == [16]  # the decode's link id
        assert got["settled"] == [(KEYS[:3], [True, False, True])]
        stats = receiver.stats()
        assert stats["pending_pages_announced"] == 5 and stats["settled_pages_announced"] == 3
        assert sender.stats()["rejected"] == {}
    finally:
        receiver.close()
        sender.close()


def test_a_lost_decode_peer_s_pending_marks_are_dropped() -> None:
    """A decode that announced writes and then went silent will never settle them: when the
    prefill declares it lost, its pending marks go (no lookup waits out their TTL for it)."""
    from pdcache.offload_manager.pending import PageState, PendingPages

    marks = PendingPages()
    config = TransferConfig(engine="zmq", bootstrap_timeout_s=5, room_timeout_s=5,
                            heartbeat_interval_s=0.25, heartbeat_misses=4)
    kv = torch.zeros(2, 2, 4, 4, 2, 8)
    sender = KVSender(config, kv, on_pages=marks).start()
    receiver = KVReceiver(config, kv).start()
    try:
        receiver.connect(sender.bootstrap_addr)
        receiver.announce_pending(KEYS, 60.0)
        deadline = time.monotonic() + 5
        while marks.run(KEYS) < len(KEYS) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert marks.run(KEYS) == len(KEYS)
        receiver.close()  # silent from now on
        deadline = time.monotonic() + config.peer_dead_after_s + 5
        while sender.stats()["peers_lost"] < 1 and time.monotonic() < deadline:
            time.sleep(0.02)
        assert sender.stats()["peers_lost"] == 1
        assert [marks.state(key) for key in KEYS] == [PageState.GONE] * len(KEYS)
        assert marks.snapshot()["pending_keys_forgotten"] == len(KEYS)
    finally:
        receiver.close()
        sender.close()
