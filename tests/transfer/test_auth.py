"""The authenticated control plane (docs/security.md): with a control key every frame between
KVSender and KVReceiver carries a keyed MAC, a timestamp and a nonce. A frame without a valid
MAC (no trailer, another secret, reflected), a replayed one and a stale one are dropped and
counted by kind, and the node keeps serving; with the key off the same intruder is answered."""

from __future__ import annotations

import time

import numpy as np
import pytest
import torch
import zmq
from prometheus_client import CollectorRegistry

from pdcache.server.metrics import TransferCollector
from pdcache.transfer.control import control_auth
from pdcache.transfer.errors import TransferError
from pdcache.transfer.messages import (
    Abort,
    Ping,
    Pong,
    PrefillReport,
    Register,
    RegisterAck,
    RoomRequest,
    decode,
    encode,
    pack_pages,
)
from pdcache.transfer.receiver import KVReceiver
from pdcache.transfer.rooms import RoomState
from pdcache.transfer.sender import KVSender
from pdcache.utils.message_auth import DEFAULT_WINDOW_S, AuthError, MessageAuth
from pdcache.utils.secret import derive_key
from tests.transfer_support import fast_config, make_pool, scaled_limit, wait_until

KEY = derive_key(b"the cluster secret of this test", "zmq-control")
OTHER_KEY = derive_key(b"a second cluster's secret......", "zmq-control")


class Pair:
    def __init__(self, sender_key: bytes | None, receiver_key: bytes | None) -> None:
        self.config = fast_config("zmq")
        self.src, self.dst = make_pool(64, seed=3), make_pool(96, seed=None)
        self.sender = KVSender(self.config, self.src, control_key=sender_key).start()
        self.receiver = KVReceiver(self.config, self.dst, control_key=receiver_key).start()

    def close(self) -> None:
        self.receiver.close()
        self.sender.close()


@pytest.fixture
def authed():
    pair = Pair(KEY, KEY)
    try:
        yield pair
    finally:
        pair.close()


LINK_ID = b"test-decode-link"  # the routing id of the test's own decode socket


def _dealer(addr: str) -> zmq.Socket:
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.ROUTING_ID, LINK_ID)
    sock.connect(addr)
    return sock


def _transfer(pair: Pair, room: int) -> None:
    pair.receiver.request(room, pair.sender.bootstrap_addr, [3, 1, 4], num_tokens=10)
    assert pair.sender.send(room, [5, 9, 2], PrefillReport(7))
    assert pair.receiver.wait(room, scaled_limit(5.0)).first_token == 7
    assert torch.equal(pair.dst[:, :, [3, 1, 4]], pair.src[:, :, [5, 9, 2]])


def test_authenticated_rooms_transfer_exactly(authed: Pair) -> None:
    _transfer(authed, 1)
    _transfer(authed, 2)
    assert authed.sender.stats()["rejected"] == {} and authed.receiver.stats()["rejected"] == {}


def test_intruders_are_dropped_counted_and_the_node_keeps_serving(authed: Pair) -> None:
    decode_side = control_auth(KEY, "decode")  # a legitimate decode's sealer (the test's own)
    other_secret = control_auth(OTHER_KEY, "decode")
    reflected = control_auth(KEY, "prefill")  # prefill's own label: a message bounced back
    past = MessageAuth(
        KEY, b"decode", b"prefill", clock=lambda: time.time_ns() - int(2 * DEFAULT_WINDOW_S * 1e9)
    )
    bound = LINK_ID + authed.sender.boot_id  # decode frames name the link and prefill's boot
    sock = _dealer(authed.sender.bootstrap_addr)
    try:
        captured = decode_side.seal(encode(Ping(5)), context=bound)
        sock.send(captured)  # genuine: answered
        assert sock.poll(3000)
        pong = sock.recv()
        assert decode(control_auth(KEY, "decode").open_(pong, context=LINK_ID), 1 << 20) == Pong(5)
        with pytest.raises(AuthError):  # the reply is MAC'd for this socket's link id only
            control_auth(KEY, "decode").open_(pong, context=b"another-decode!!")
        for frame in (
            encode(Ping(1)),  # no MAC at all
            other_secret.seal(encode(Ping(2))),
            reflected.seal(encode(Ping(3))),
            captured,  # replayed
            past.seal(encode(Ping(4)), context=bound),  # outside the window
            encode(Register("intruder", "zmq", b"x", 1 << 30, 4, 8, 4096)),
            bytes(authed.config.max_message_bytes + 100),  # refused before any hashing
        ):
            sock.send(frame)
        expected = {"unauthenticated": 4, "replayed": 1, "stale": 1, "oversized": 1}
        wait_until(
            lambda: authed.sender.stats()["rejected"] == expected,
            3.0,
            f"rejections {expected}, got {authed.sender.stats()['rejected']}",
        )
        assert not sock.poll(200)  # none of them got an answer
    finally:
        sock.close(linger=0)
    _transfer(authed, 3)  # the node still serves its real peer
    assert authed.sender.stats()["control_errors"] == 0
    registry = CollectorRegistry()  # what the prefill node's /metrics exports
    registry.register(TransferCollector(authed.sender.stats, "p0"))
    for kind, count in (("unauthenticated", 4), ("replayed", 1), ("stale", 1), ("malformed", 0)):
        labels = {"server": "p0", "kind": kind}
        assert registry.get_sample_value("pdcache_control_rejected_messages_total", labels) == count
    sent = registry.get_sample_value("pdcache_kv_transfer_bytes_total",
                                     {"server": "p0", "direction": "sent"})
    assert sent == authed.sender.stats()["bytes_sent"] > 0


@pytest.mark.parametrize("auth", [True, False], ids=["auth_on", "auth_off"])
def test_unauthenticated_peer_is_answered_only_without_auth(auth: bool) -> None:
    pair = Pair(KEY if auth else None, KEY if auth else None)
    sock = _dealer(pair.sender.bootstrap_addr)
    try:
        sock.send(encode(Ping(9)))
        answered = sock.poll(500)
        assert answered is not auth
        if not auth:
            assert decode(sock.recv(), 1 << 20) == Pong(9)
        assert pair.sender.stats()["rejected"] == ({"unauthenticated": 1} if auth else {})
    finally:
        sock.close(linger=0)
        pair.close()


def test_decode_drops_a_fake_prefill_with_another_secret(authed: Pair) -> None:
    fake = zmq.Context.instance().socket(zmq.ROUTER)
    fake.setsockopt(zmq.LINGER, 0)
    addr = f"tcp://127.0.0.1:{fake.bind_to_random_port('tcp://127.0.0.1')}"
    try:
        authed.receiver.request(8, addr, [1, 2], num_tokens=5)
        assert fake.poll(3000)
        identity, register = fake.recv_multipart()
        with pytest.raises(AuthError):  # decode's frames do not open under another secret
            control_auth(OTHER_KEY, "prefill").open_(register)
        fake.send_multipart(
            [identity, control_auth(OTHER_KEY, "prefill").seal(encode(RegisterAck("fake", "")))]
        )
        fake.send_multipart([identity, encode(RegisterAck("fake", ""))])
        wait_until(
            lambda: authed.receiver.stats()["rejected"] == {"unauthenticated": 2},
            3.0,
            f"decode rejections, got {authed.receiver.stats()['rejected']}",
        )
        assert authed.receiver.poll(8) is RoomState.BOOTSTRAPPING  # the fake ack did nothing
        authed.receiver.abort(8, "test over")
    finally:
        fake.close(linger=0)
    _transfer(authed, 9)


def test_mismatched_secrets_never_transfer() -> None:
    pair = Pair(KEY, OTHER_KEY)
    try:
        pair.receiver.request(4, pair.sender.bootstrap_addr, [1], num_tokens=2)
        wait_until(
            lambda: pair.sender.stats()["rejected"].get("unauthenticated", 0) >= 1,
            3.0,
            "prefill to drop decode's registration",
        )
        pair.sender.send(4, np.array([2]), PrefillReport(1))  # prefill has the KV ready
        with pytest.raises(TransferError):  # but the rooms never meet
            pair.receiver.wait(4, 1.0)
        assert not pair.dst.any()
    finally:
        pair.close()


def test_a_prefill_frame_sealed_for_one_decode_is_dropped_by_another() -> None:
    """Prefill frames are MAC'd for the receiving decode socket's per-boot random link id
    (its ZMQ routing id). A genuine RegisterAck sealed for decode A and replayed to decode B
    (same role, same secret) is dropped and counted by B, which stays bootstrapping; the same
    frame opens on A, the decode it was made for."""
    config = fast_config("zmq")
    fake = zmq.Context.instance().socket(zmq.ROUTER)
    fake.setsockopt(zmq.LINGER, 0)
    addr = f"tcp://127.0.0.1:{fake.bind_to_random_port('tcp://127.0.0.1')}"
    decodes = [KVReceiver(config, make_pool(16, seed=None), control_key=KEY).start()
               for _ in range(2)]
    try:
        links: list[bytes] = []
        for room, receiver in enumerate(decodes, start=1):
            receiver.request(room, addr, [1, 2], num_tokens=5)
            while len(links) < room:  # each decode sends its Register, then its RoomRequest
                assert fake.poll(3000)
                identity, frame = fake.recv_multipart()
                msg = decode(control_auth(KEY, "prefill").open_(frame, context=identity), 1 << 20)
                if msg.TYPE == "register":
                    links.append(identity)
        assert links[0] != links[1] and all(len(link) == 16 for link in links)
        ack_for_a = control_auth(KEY, "prefill").seal(
            encode(RegisterAck("p0", "", b"boot of fake p0!")), context=links[0]
        )
        fake.send_multipart([links[1], ack_for_a])  # replayed to decode B
        wait_until(
            lambda: decodes[1].stats()["rejected"] == {"unauthenticated": 1},
            3.0,
            f"decode B rejections, got {decodes[1].stats()['rejected']}",
        )
        assert decodes[1].poll(2) is RoomState.BOOTSTRAPPING
        fake.send_multipart([links[0], ack_for_a])  # to decode A, which it was sealed for
        wait_until(
            lambda: decodes[0].poll(1) is RoomState.WAITING_FOR_INPUT,
            3.0,
            "decode A to accept the ack",
        )
        assert decodes[0].stats()["rejected"] == {}
    finally:
        for receiver in decodes:
            receiver.close()
        fake.close(linger=0)


@pytest.mark.parametrize("per_boot", [True, False], ids=["boot_bound", "boot_shared"])
def test_a_decode_frame_for_one_prefill_is_dropped_by_another(
    per_boot: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Decode frames after Register are MAC'd for the link and the receiving prefill's
    per-boot id (RegisterAck.boot_id). A genuine frame captured on its way to prefill A and
    replayed to prefill B (same secret, same link id) is dropped and counted by B; a frame
    bound to the link alone opens only as a Register. With both prefills sharing one boot id
    (the binding off) the replay is answered: the boot id is what stops it."""
    config = fast_config("zmq")
    senders = [KVSender(config, make_pool(16, seed=1), control_key=KEY).start() for _ in range(2)]
    if not per_boot:
        monkeypatch.setattr(senders[1], "boot_id", senders[0].boot_id)
    decode_side = control_auth(KEY, "decode")
    socks = [_dealer(sender.bootstrap_addr) for sender in senders]
    try:
        for_a = decode_side.seal(encode(Ping(1)), context=LINK_ID + senders[0].boot_id)
        socks[0].send(for_a)
        assert socks[0].poll(3000)  # genuine for A: answered
        socks[1].send(for_a)  # the captured frame, replayed to B
        answered = socks[1].poll(500)
        assert bool(answered) is not per_boot
        link_only = decode_side.seal(encode(Ping(2)), context=LINK_ID)
        socks[0].send(link_only)  # not a Register: must carry the boot id
        expected_b = {"unauthenticated": 1} if per_boot else {}
        wait_until(
            lambda: senders[0].stats()["rejected"] == {"unauthenticated": 1}
            and senders[1].stats()["rejected"] == expected_b,
            3.0,
            f"rejections, got {[s.stats()['rejected'] for s in senders]}",
        )
        reply = control_auth(KEY, "decode").open_(socks[0].recv(), context=LINK_ID)
        assert decode(reply, 1 << 20) == Pong(1)
        assert not socks[0].poll(200)  # the link-only Ping got no answer
    finally:
        for sock in socks:
            sock.close(linger=0)
        for sender in senders:
            sender.close()


def _restart_on(port: int, config, src) -> KVSender:
    """A new prefill on `port`. close() returns once the old one's sockets are closed, but the
    kernel can still hold the listening port a moment (CI saw EADDRINUSE): retry, bounded."""
    deadline = time.monotonic() + 10.0
    while True:
        try:
            return KVSender(config, src, "127.0.0.1", port, control_key=KEY).start()
        except zmq.ZMQError as exc:
            if exc.errno != zmq.EADDRINUSE or time.monotonic() > deadline:
                raise
            time.sleep(0.05)


def test_a_fast_prefill_restart_makes_decode_register_again() -> None:
    """A prefill restarted on the same address (a new boot id) before decode noticed gets the
    decode's frames sealed for its old boot. It opens them under the boot id decode names in
    clear, counts them `stale_boot` (not `unauthenticated`) and answers a room request with
    `Abort(unregistered)`: decode registers again and the next room transfers, well before
    the peer would be declared dead."""
    config = fast_config("zmq")
    src, dst = make_pool(64, seed=3), make_pool(96, seed=None)
    sender = KVSender(config, src, control_key=KEY).start()
    receiver = KVReceiver(config, dst, control_key=KEY).start()
    restarted = None
    try:
        port = int(sender.bootstrap_addr.rsplit(":", 1)[1])
        pair = Pair.__new__(Pair)
        pair.config, pair.src, pair.dst, pair.sender, pair.receiver = config, src, dst, sender, receiver
        _transfer(pair, 1)
        old_boot = sender.boot_id
        sender.close()
        restarted = _restart_on(port, config, src)
        assert restarted.boot_id != old_boot
        pair.sender = restarted
        # decode's socket reconnected once its pings (still for the old boot) arrive; a frame
        # sent before that can go down the dead connection, lost as on any restart
        wait_until(lambda: restarted.stats()["rejected"].get("stale_boot", 0) >= 1,
                   config.peer_dead_after_s / 2, "decode's pings at the restarted prefill")
        started = time.monotonic()
        receiver.request(2, restarted.bootstrap_addr, [6, 7], num_tokens=4)
        with pytest.raises(TransferError) as failed:  # its request went to the old boot
            receiver.wait(2, config.peer_dead_after_s)
        assert failed.value.code == "unregistered"
        dst.zero_()
        _transfer(pair, 3)  # registered again: exact KV
        assert time.monotonic() - started < config.peer_dead_after_s / 2
        rejected = restarted.stats()["rejected"]
        assert rejected.get("stale_boot", 0) >= 1 and "unauthenticated" not in rejected
    finally:
        receiver.close()
        (restarted or sender).close()


def test_a_stale_boot_frame_replayed_to_another_prefill_gains_nothing() -> None:
    """A genuine RoomRequest for prefill A, replayed to prefill B with A's boot id named: B
    counts it `stale_boot` and only answers `Abort(unregistered)` sealed for the link; no room
    opens on B. A forged frame naming a boot id is `unauthenticated`, unanswered."""
    config = fast_config("zmq")
    senders = [KVSender(config, make_pool(16, seed=1), control_key=KEY).start() for _ in range(2)]
    decode_side = control_auth(KEY, "decode")
    sock = _dealer(senders[1].bootstrap_addr)
    try:
        boot_a = senders[0].boot_id
        request = RoomRequest(5, pack_pages(np.array([1, 2])), 3)
        sock.send_multipart([decode_side.seal(encode(request), context=LINK_ID + boot_a), boot_a])
        assert sock.poll(3000)
        reply = decode(control_auth(KEY, "decode").open_(sock.recv(), context=LINK_ID), 1 << 20)
        assert isinstance(reply, Abort) and (reply.room, reply.code) == (5, "unregistered")
        forged = control_auth(OTHER_KEY, "decode").seal(encode(request), context=LINK_ID + boot_a)
        sock.send_multipart([forged, boot_a])
        wait_until(
            lambda: senders[1].stats()["rejected"] == {"stale_boot": 1, "unauthenticated": 1},
            3.0,
            f"rejections, got {senders[1].stats()['rejected']}",
        )
        assert not sock.poll(200)
        assert senders[1].rooms.get(5) is None and senders[1].stats()["peers"] == 0
    finally:
        sock.close(linger=0)
        for sender in senders:
            sender.close()
