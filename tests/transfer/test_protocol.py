"""KVSender ↔ KVReceiver over real loopback sockets: data, concurrency, hostile input, aborts,
deadlines. Sender and receiver use separate pools (remote memory: tests/transfer/test_multiprocess.py)."""

from __future__ import annotations

import threading
import time

import msgpack
import numpy as np
import pytest
import torch
import zmq

from pdcache.engine.api import CachedTokens
from pdcache.transfer.errors import TransferError, TransferTimeout
from pdcache.transfer.messages import (
    PROTOCOL_VERSION,
    Abort,
    AbortAck,
    Done,
    Ping,
    Pong,
    PrefillReport,
    Register,
    RegisterAck,
    RoomRequest,
    Started,
    decode,
    encode,
    pack_pages,
)
from pdcache.transfer.receiver import KVReceiver
from pdcache.transfer.rooms import Outcome, RoomState
from pdcache.transfer.sender import KVSender
from tests.transfer_support import (
    dump_threads,
    engine_params,
    fast_config,
    make_pool,
    scaled_limit,
    wait_until,
)

REPORT = PrefillReport(1234, prompt_tokens=65, computed_tokens=33, cached=CachedTokens(device=32),
                       prefill_node="p0")

SRC_PAGES, DST_PAGES = 64, 96


class Pair:
    """A started sender and receiver with their pools and release logs."""

    def __init__(self, engine: str, **overrides) -> None:
        self.config = fast_config(engine, **overrides)
        self.src, self.dst = make_pool(SRC_PAGES, seed=3), make_pool(DST_PAGES, seed=None)
        self.sent: list[Outcome] = []
        self.received: list[Outcome] = []
        self.sender = KVSender(self.config, self.src, on_release=self.sent.append)
        self.receiver = KVReceiver(self.config, self.dst, on_release=self.received.append)

    def start(self) -> Pair:
        self.sender.start()
        self.receiver.start()
        return self

    @property
    def addr(self) -> str:
        return self.sender.bootstrap_addr

    def assert_idle(self) -> None:
        """No room left allocated on either side, every release reported."""
        wait_until(lambda: self.sender.rooms.active_count() == 0
                   and self.receiver.rooms.active_count() == 0, 5.0, "rooms to be released")
        for side in (self.sender.stats(), self.receiver.stats()):
            rooms = side["rooms"]
            assert rooms["active"] == 0 and rooms["busy"] == 0
            assert rooms["released"] == rooms["created"]
            assert side["control_errors"] == 0 and rooms["illegal_transitions"] == 0

    def close(self) -> None:
        self.receiver.close()
        self.sender.close()


@pytest.fixture
def pair(request):
    engine, overrides = request.param if isinstance(request.param, tuple) else (request.param, {})
    p = Pair(engine, **overrides).start()
    try:
        yield p
        p.assert_idle()
    finally:
        p.close()


ALL = engine_params()
ZMQ = engine_params(("zmq",))


def _pages(rng: np.random.Generator, n: int) -> tuple[np.ndarray, np.ndarray]:
    return rng.choice(SRC_PAGES, n, replace=False), rng.choice(DST_PAGES, n, replace=False)


@pytest.mark.parametrize("pair", ALL, indirect=True)
def test_rooms_transfer_byte_identical_kv_in_either_order(pair: Pair) -> None:
    rng = np.random.default_rng(11)
    pair.receiver.connect(pair.addr)
    for room, decode_first in ((1 << 62, True), (5, False), ((1 << 63) - 1, True)):
        src_pages, dst_pages = _pages(rng, 17)
        pair.dst.zero_()
        if decode_first:
            pair.receiver.request(room, pair.addr, dst_pages, num_tokens=65)
            time.sleep(0.02)
            assert pair.sender.send(room, src_pages, REPORT)
        else:
            assert pair.sender.send(room, src_pages, REPORT)
            pair.receiver.request(room, pair.addr, dst_pages, num_tokens=65)
        result = pair.receiver.wait(room, scaled_limit(5.0))
        assert (result.first_token, result.report) == (1234, REPORT)
        assert result.nbytes == 4 * 2 * 17 * 512
        assert torch.equal(pair.dst[:, :, dst_pages], pair.src[:, :, src_pages])
        untouched = np.setdiff1d(np.arange(DST_PAGES), dst_pages)
        assert not pair.dst[:, :, untouched].any()
        wait_until(lambda r=room: pair.sender.poll(r) is RoomState.SUCCESS, 2.0, "success")
        assert pair.receiver.poll(room) is RoomState.SUCCESS
    assert [o.state for o in pair.sent] == [RoomState.SUCCESS] * 3
    assert [o.state for o in pair.received] == [RoomState.SUCCESS] * 3


@pytest.mark.parametrize("pair", ALL, indirect=True)
def test_first_page_sends_only_the_pages_after_decode_s_prefix(pair: Pair) -> None:
    """Decode's prefix cache (docs/design.md §4.12): with `first_page` = k, the sender writes
    source pages k.. into the destination and nothing else; k at or past the source's page
    count fails the room `invalid` (the prompt's last page always comes new)."""
    rng = np.random.default_rng(5)
    pair.receiver.connect(pair.addr)
    src_pages, dst_all = _pages(rng, 17)
    pair.dst.zero_()
    pair.receiver.request(3, pair.addr, dst_all[6:], num_tokens=65, first_page=6)
    assert pair.sender.send(3, src_pages, REPORT)
    result = pair.receiver.wait(3, scaled_limit(5.0))
    assert result.nbytes == 4 * 2 * 11 * 512
    assert torch.equal(pair.dst[:, :, dst_all[6:]], pair.src[:, :, src_pages[6:]])
    assert not pair.dst[:, :, dst_all[:6]].any()
    stats = pair.sender.stats()
    assert (stats["pages_sent"], stats["pages_decode_had"]) == (11, 6)
    pair.receiver.request(4, pair.addr, dst_all[:1], num_tokens=65, first_page=17)
    assert pair.sender.send(4, src_pages, REPORT)
    with pytest.raises(TransferError, match="the last one always comes new"):
        pair.receiver.wait(4, scaled_limit(5.0))
    with pytest.raises(ValueError, match="not a page index"):
        pair.receiver.request(5, pair.addr, dst_all[:1], num_tokens=65, first_page=-1)


@pytest.mark.parametrize("pair", ALL, indirect=True)
def test_32_concurrent_rooms_all_succeed(pair: Pair) -> None:
    rng = np.random.default_rng(12)
    # 32 rooms × 3 pages use 96 distinct destination pages: any cross-talk shows.
    dst_all = rng.permutation(DST_PAGES).reshape(32, 3)
    src_all = [rng.choice(SRC_PAGES, 3, replace=False) for _ in range(32)]
    rooms = [int(x) for x in rng.integers(1, 1 << 63, size=32)]
    errors: list[BaseException] = []

    def decode_side(i: int) -> None:
        try:
            pair.receiver.request(rooms[i], pair.addr, dst_all[i], num_tokens=12)
            assert pair.receiver.wait(rooms[i], scaled_limit(10.0)).first_token == i
        except BaseException as exc:  # surfaced below
            errors.append(exc)

    threads = [threading.Thread(target=decode_side, args=(i,)) for i in range(32)]
    for t in threads:
        t.start()
    for i in reversed(range(32)):
        assert pair.sender.send(rooms[i], src_all[i], PrefillReport(i, prompt_tokens=i))
    for t in threads:
        t.join(15.0)
    assert not errors, errors[:3]
    for i in range(32):
        assert torch.equal(pair.dst[:, :, dst_all[i]], pair.src[:, :, src_all[i]])
    wait_until(lambda: len(pair.sent) == 32, 5.0, "32 sender releases")
    assert pair.sender.stats()["rooms"]["succeeded"] == 32
    assert pair.receiver.stats()["rooms"]["succeeded"] == 32


def _raw_dealer(addr: str) -> zmq.Socket:
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(addr)
    return sock


def _recv(sock: zmq.Socket, timeout_s: float = 3.0):
    assert sock.poll(int(timeout_s * 1000)), "no reply from the bootstrap socket"
    return decode(sock.recv(), 1 << 20)


@pytest.mark.parametrize("pair", ALL, indirect=True)
def test_hostile_control_messages_are_rejected_counted_and_node_keeps_serving(pair) -> None:
    limit = pair.config.max_message_bytes
    sock = _raw_dealer(pair.addr)
    try:
        hostile = [
            [b"\xc1\xc1 not msgpack"],
            [msgpack.packb([1, 2, 3])],
            [msgpack.packb({"v": PROTOCOL_VERSION + 7, "t": "ping", "seq": 1})],
            [msgpack.packb({"v": PROTOCOL_VERSION, "t": "format_disk", "seq": 1})],
            [msgpack.packb({"v": PROTOCOL_VERSION, "t": "ping", "seq": "one"})],
            [msgpack.packb({"v": PROTOCOL_VERSION, "t": "ping"})],
            [encode(Ping(1)), b"second frame"],
            [encode(Abort(1, "x" * limit, "aborted"))],  # oversized
            [encode(Pong(1))],  # well-formed, but not a message prefill accepts
        ]
        for frames in hostile:
            sock.send_multipart(frames)
        expected = {"malformed": 3, "version": 1, "unknown_type": 2, "bad_field": 2,
                    "oversized": 1}
        wait_until(lambda: pair.sender.stats()["rejected"] == expected, 3.0,
                   f"rejections {expected}, got {pair.sender.stats()['rejected']}")
        # The same socket still gets answers, and registration checks the KV geometry.
        sock.send(encode(Ping(77)))
        assert _recv(sock) == Pong(77)
        sock.send(encode(Register("intruder", pair.config.engine, b"x", 1 << 30, 4, 8, 4096)))
        ack = _recv(sock)
        assert isinstance(ack, RegisterAck) and "layout mismatch" in ack.error
        sock.send(encode(RoomRequest(9, pack_pages([1]), 4)))  # not registered
        refused = _recv(sock)
        assert isinstance(refused, Abort) and refused.code == "unregistered"
    finally:
        sock.close(linger=0)
    # A real room still goes through after all that.
    pair.receiver.request(42, pair.addr, [3, 1, 4], num_tokens=10)
    assert pair.sender.send(42, [5, 9, 2], PrefillReport(7))
    pair.receiver.wait(42, scaled_limit(5.0))
    assert torch.equal(pair.dst[:, :, [3, 1, 4]], pair.src[:, :, [5, 9, 2]])
    assert pair.sender.stats()["control_errors"] == 0


def _next_non_ping(router: zmq.Socket):
    while True:
        assert router.poll(3000), "decode sent nothing"
        msg = decode(router.recv_multipart()[1], 1 << 20)
        if not isinstance(msg, Ping):
            return msg


@pytest.mark.parametrize("pair", ZMQ, indirect=True)
def test_receiver_rejects_hostile_replies_from_a_fake_prefill(pair: Pair) -> None:
    fake = zmq.Context.instance().socket(zmq.ROUTER)
    fake.setsockopt(zmq.LINGER, 0)
    port = fake.bind_to_random_port("tcp://127.0.0.1")
    addr = f"tcp://127.0.0.1:{port}"
    try:
        pair.receiver.request(8, addr, [1, 2], num_tokens=5)
        assert fake.poll(3000)
        identity, register = fake.recv_multipart()
        assert isinstance(decode(register, 1 << 20), Register)
        fake.send_multipart([identity, b"\x00garbage"])
        fake.send_multipart([identity, msgpack.packb({"v": 99, "t": "done"})])
        fake.send_multipart([identity, encode(RegisterAck("fake", ""))])
        wait_until(lambda: pair.receiver.poll(8) is RoomState.WAITING_FOR_INPUT, 3.0,
                   "room to wait for input")
        assert pair.receiver.stats()["rejected"] == {"malformed": 1, "version": 1}
        assert isinstance(_next_non_ping(fake), RoomRequest)
        pair.receiver.abort(8, "test over")
        assert _next_non_ping(fake) == Abort(8, "test over", "aborted")
        # Decode keeps the pages until the (fake) prefill acknowledges the abort.
        assert pair.received == []
        fake.send_multipart([identity, encode(AbortAck(8))])
        wait_until(lambda: len(pair.received) == 1, 3.0, "release after the ack")
    finally:
        fake.close(linger=0)


@pytest.mark.parametrize("pair", ALL, indirect=True)
def test_abort_from_decode_reaches_prefill(pair: Pair) -> None:
    pair.receiver.request(100, pair.addr, [1, 2, 3], num_tokens=9)
    wait_until(lambda: pair.sender.rooms.get(100) is not None, 3.0, "prefill to see the room")
    pair.receiver.abort(100, "client disconnected")
    with pytest.raises(TransferError, match="client disconnected") as info:
        pair.receiver.wait(100, 1.0)
    assert info.value.code == "aborted"
    wait_until(lambda: pair.sender.poll(100) is RoomState.FAILED, 3.0, "prefill to fail room")
    assert "client disconnected" in pair.sender.rooms.outcome(100).reason
    late = PrefillReport(1)
    assert not pair.sender.send(100, [4, 5, 6], late)  # late KV is refused, the node keeps pages
    wait_until(lambda: [(o.state, o.code) for o in pair.received] == [
        (RoomState.FAILED, "aborted")], 3.0, "decode release after prefill's ack")
    assert pair.sender.rooms.outcome(100).code == "aborted"
    assert pair.receiver.stats()["abort_ack_timeouts"] == 0


@pytest.mark.parametrize("pair", ALL, indirect=True)
def test_abort_from_prefill_reaches_decode(pair: Pair) -> None:
    pair.receiver.request(200, pair.addr, [7, 8], num_tokens=5)
    assert pair.sender.send(200, [1, 2], PrefillReport(3))
    pair.receiver.wait(200, scaled_limit(5.0))  # a first room works
    pair.receiver.request(201, pair.addr, [9, 10], num_tokens=5)
    wait_until(lambda: pair.sender.rooms.get(201) is not None, 3.0, "prefill to see the room")
    pair.sender.abort(201, "prefill out of memory")
    start = time.monotonic()
    with pytest.raises(TransferError, match="prefill out of memory"):
        pair.receiver.wait(201, 5.0)
    assert time.monotonic() - start < scaled_limit(2.0)
    # Aborting before decode asked: decode's later request is refused at once.
    pair.sender.abort(202, "request rejected by prefill")
    pair.receiver.request(202, pair.addr, [11], num_tokens=1)
    with pytest.raises(TransferError, match="rejected by prefill"):
        pair.receiver.wait(202, 5.0)


@pytest.mark.parametrize("pair", ZMQ, indirect=True)
def test_decode_wait_timeout_aborts_room_on_both_sides(pair: Pair) -> None:
    pair.receiver.request(300, pair.addr, [1], num_tokens=3)
    start = time.monotonic()
    with pytest.raises(TransferTimeout) as info:
        pair.receiver.wait(300, 0.3)
    assert time.monotonic() - start < scaled_limit(1.0) and info.value.code == "timeout"
    wait_until(lambda: pair.sender.poll(300) is RoomState.FAILED, 3.0, "prefill to fail room")
    assert pair.receiver.poll(300) is RoomState.FAILED
    assert pair.sender.rooms.outcome(300).code == "timeout"  # decode's code reached prefill


@pytest.mark.parametrize("pair", [("zmq", {"bootstrap_timeout_s": 0.3})], indirect=True)
def test_prefill_room_without_decode_request_times_out_and_is_released(pair: Pair) -> None:
    assert pair.sender.send(400, [1, 2], PrefillReport(5))
    wait_until(lambda: len(pair.sent) == 1, 3.0, "sender release")
    assert pair.sent[0].state is RoomState.FAILED and "timed out" in pair.sent[0].reason
    assert pair.sent[0].code == "timeout"


@pytest.mark.parametrize("pair", ZMQ, indirect=True)
def test_prefill_shutdown_fails_decode_rooms_with_a_clear_error(pair: Pair) -> None:
    pair.receiver.request(500, pair.addr, [1, 2], num_tokens=5)
    wait_until(lambda: pair.sender.rooms.get(500) is not None, 3.0, "prefill to see the room")
    pair.sender.close()
    with pytest.raises(TransferError, match="shutting down|lost"):
        pair.receiver.wait(500, pair.config.peer_dead_after_s + 3.0)


@pytest.mark.parametrize("pair", ZMQ, indirect=True)
def test_decode_shutdown_aborts_its_rooms_and_says_it_is_closing(pair: Pair) -> None:
    """What the decode app maps to 503 `unavailable` (docs/pd-protocol.md error table): a
    room `close()` ended is failed with code `aborted` while `closing` is set; before the
    close a node is not closing."""
    pair.receiver.request(550, pair.addr, [1, 2], num_tokens=5)
    wait_until(lambda: pair.sender.rooms.get(550) is not None, 3.0, "prefill to see the room")
    assert not pair.receiver.closing
    pair.receiver.close()
    assert pair.receiver.closing
    outcome = pair.receiver.rooms.outcome(550)
    assert outcome is not None and outcome.state is RoomState.FAILED
    assert (outcome.code, outcome.reason) == ("aborted", "decode node shutting down")


@pytest.mark.parametrize("pair", ZMQ, indirect=True)
def test_unreachable_prefill_fails_rooms_after_missed_heartbeats(pair: Pair) -> None:
    nobody = zmq.Context.instance().socket(zmq.ROUTER)
    port = nobody.bind_to_random_port("tcp://127.0.0.1")
    nobody.close(linger=0)  # a free port with no listener
    addr = f"tcp://127.0.0.1:{port}"
    pair.receiver.request(600, addr, [1], num_tokens=2)
    start = time.monotonic()
    with pytest.raises(TransferError, match="lost") as info:
        pair.receiver.wait(600, pair.config.peer_dead_after_s + 3.0)
    assert info.value.code == "peer_lost"
    elapsed = time.monotonic() - start
    assert elapsed < pair.config.peer_dead_after_s + 1.0
    with pytest.raises(TransferError):
        pair.receiver.connect(addr, timeout_s=0.3)


class _SilentPrefill:
    """A fake prefill bootstrap endpoint (unauthenticated): it registers decodes with a boot
    id the test picks, says Started for a room, then answers nothing (a stopped process)."""

    def __init__(self) -> None:
        self.sock = zmq.Context.instance().socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.addr = f"tcp://127.0.0.1:{self.sock.bind_to_random_port('tcp://127.0.0.1')}"

    def next_of(self, msg_type: type) -> tuple[bytes, object]:
        deadline = time.monotonic() + scaled_limit(5.0)
        while time.monotonic() < deadline:
            if self.sock.poll(100):
                identity, frame = self.sock.recv_multipart()
                msg = decode(frame, 1 << 20)
                if isinstance(msg, msg_type):
                    return identity, msg
        dump_threads()
        raise AssertionError(f"no {msg_type.__name__} from decode")

    def register(self, boot: bytes) -> bytes:
        identity, _ = self.next_of(Register)
        self.sock.send_multipart([identity, encode(RegisterAck("fake-p0", "", boot))])
        return identity

    def send(self, identity: bytes, msg) -> None:
        self.sock.send_multipart([identity, encode(msg)])


@pytest.mark.parametrize("release", ["abort_ack", "late_done", "rebooted", "same_boot", "closed",
                                     "hold_cap"])
def test_a_lost_prefill_s_pages_stay_fenced_until_it_answers_reboots_or_the_cap(
    release: str,
) -> None:
    """Silent is not dead: a stalled prefill (SIGSTOP) resumes the write it was in, so decode
    fails a lost peer's room at once but keeps its pages busy past abort_ack_timeout_s (the
    old 10 s timer let `pdcache bench chaos` freeze-node corrupt another request's answer):
    until that link's AbortAck, the address re-registering with another boot id (the old
    process is gone; the same boot id is the same process: still fenced), the prefill closing
    the connection (it exited; a stopped process keeps it), or lost_peer_hold_s. Exactly one release, and the room/busy accounting returns to zero."""
    hold_s = 1.5 if release == "hold_cap" else 60.0
    config = fast_config("zmq", heartbeat_misses=8, abort_ack_timeout_s=0.3,
                         lost_peer_hold_s=hold_s)
    released: list[Outcome] = []
    receiver = KVReceiver(config, make_pool(DST_PAGES, seed=None),
                          on_release=released.append).start()
    fake = _SilentPrefill()
    try:
        receiver.request(650, fake.addr, [1, 2], num_tokens=5)
        old_link = fake.register(b"boot-of-p0-one!!")
        fake.next_of(RoomRequest)
        fake.send(old_link, Started(650))
        with pytest.raises(TransferError, match="lost") as info:
            receiver.wait(650, config.peer_dead_after_s + 3.0)
        failed_at = time.monotonic()
        assert info.value.code == "peer_lost"
        time.sleep(config.abort_ack_timeout_s + 0.7)  # past the abort-ack timer
        rooms = receiver.stats()["rooms"]
        assert released == [] and rooms["busy"] == 1 and rooms["active"] == 1, rooms
        if release == "abort_ack":
            fake.next_of(Abort)  # decode's best-effort abort, on the lost link
            fake.send(old_link, AbortAck(650))
        elif release == "late_done":  # the stalled prefill resumed and finished its write
            fake.send(old_link, Done(650, 4096, REPORT))
        elif release in ("rebooted", "same_boot"):
            # decode registers again by itself (a probe, on a new link), no request needed
            boot = b"boot-of-p0-two!!" if release == "rebooted" else b"boot-of-p0-one!!"
            assert fake.register(boot) != old_link
        elif release == "closed":
            fake.sock.close(linger=0)  # what the kernel does to a killed process's sockets
        if release == "same_boot":
            time.sleep(1.0)  # the same process (it only stalled) might still write: no release
            assert released == [] and receiver.stats()["rooms"]["busy"] == 1
            return
        wait_until(lambda: len(released) == 1, hold_s + 3.0, "the fenced pages' release")
        assert released[0].room_id == 650 and released[0].code == "peer_lost"
        with pytest.raises(TransferError):  # failed stays failed, even after a late Done
            receiver.wait(650, 0.1)
        stats = receiver.stats()
        if release == "hold_cap":
            # the cap released the pages, neither early nor (the wait above allows a loaded
            # machine more) much after the cap
            assert hold_s - 0.3 <= time.monotonic() - failed_at < hold_s + 3.0
            assert stats["lost_peer_hold_timeouts"] == 1
        assert stats["lost_peer_rebooted"] == (1 if release == "rebooted" else 0)
        assert stats["lost_peer_closed"] == (1 if release == "closed" else 0)
        assert stats["abort_ack_timeouts"] == 0
        assert stats["rooms"]["busy"] == 0 and stats["rooms"]["active"] == 0
        assert stats["rooms"]["released"] == stats["rooms"]["created"] == 1
    finally:
        receiver.close()
        fake.sock.close(linger=0)


def test_lost_peer_hold_is_validated() -> None:
    with pytest.raises(ValueError, match="lost_peer_hold_s"):
        fast_config("zmq", lost_peer_hold_s=0)


@pytest.mark.parametrize("pair", ZMQ, indirect=True)
def test_register_refused_on_layout_mismatch(pair: Pair) -> None:
    other = KVSender(pair.config, make_pool(8, seed=1, layers=2))
    other.start()
    try:
        with pytest.raises(TransferError, match="layout mismatch"):
            pair.receiver.connect(other.bootstrap_addr, timeout_s=scaled_limit(3.0))
        pair.receiver.request(700, other.bootstrap_addr, [1], num_tokens=2)
        with pytest.raises(TransferError, match="layout mismatch|not registered") as info:
            pair.receiver.wait(700, scaled_limit(3.0))
        assert info.value.code in ("refused", "unregistered")
    finally:
        other.close()


@pytest.mark.parametrize("pair", ZMQ, indirect=True)
def test_bad_arguments_raise_before_any_state_changes(pair: Pair) -> None:
    with pytest.raises(ValueError):
        pair.receiver.request(1, pair.addr, [DST_PAGES], num_tokens=1)
    with pytest.raises(ValueError):
        pair.receiver.request(1, pair.addr, [1, 1], num_tokens=1)
    with pytest.raises(ValueError):
        pair.receiver.request(1 << 63, pair.addr, [1], num_tokens=1)
    with pytest.raises(ValueError):
        pair.sender.send(1, [SRC_PAGES], PrefillReport(0))
    with pytest.raises(ValueError):
        pair.sender.send(1, [], PrefillReport(0))
    with pytest.raises(ValueError):
        pair.sender.send(1 << 63, [1], PrefillReport(0))
    with pytest.raises(ValueError, match="report"):
        pair.sender.send(1, [1], {"tensor": object()})
    with pytest.raises(ValueError, match="out of range"):
        pair.sender.send(1, [1], PrefillReport(0, cached=CachedTokens(host=-3)))
    assert pair.receiver.stats()["rooms"]["created"] == 0
    assert pair.sender.stats()["rooms"]["created"] == 0
