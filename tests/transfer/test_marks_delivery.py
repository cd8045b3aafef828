"""The delivery of decode's pending marks (docs/design.md §4.10, "Delivery"): a
`MarksDelivery` is done only once the prefill's control thread recorded the marks (a ping sent
behind them on the same link was answered), or the peer is gone, or `pending_ack_timeout_s`
passed, or the receiver closed; never earlier, never later."""

from __future__ import annotations

import hashlib
import threading
import time

import pytest
import torch

from pdcache.transfer.config import TransferConfig
from pdcache.transfer.delivery import MarksDelivery
from pdcache.transfer.receiver import KVReceiver
from pdcache.transfer.sender import KVSender
from pdcache.utils.secret import derive_key

KEYS = [hashlib.sha256(bytes([i])).digest() for i in range(5)]
HELD_S = 10.0  # bound of the gated sink's wait (the tests release it far sooner)


class GatedSink:
    """A prefill's pending-pages sink whose `pending` blocks until `release` (a prefill control
    thread that is slow to record: starved on a loaded host). `log` says what happened in
    which order across threads."""

    def __init__(self) -> None:
        self.entered = threading.Event()
        self.release = threading.Event()
        self.log: list[str] = []

    def pending(self, keys: list[bytes], ttl_s: float, source: bytes = b"",
                eta_s: float = 0.0, pullable: bool = False) -> None:
        self.entered.set()
        self.release.wait(HELD_S)
        self.log.append("recorded")

    def settled(self, keys: list[bytes], landed: list[bool]) -> None:
        pass

    def forget_source(self, source: bytes) -> int:
        return 0

    def pulled(self, *args: object) -> None:
        pass


def pair(sink: GatedSink, ack_timeout_s: float = HELD_S, secret: bytes | None = None,
         **settings: float) -> tuple[KVSender, KVReceiver]:
    config = TransferConfig(engine="zmq", bootstrap_timeout_s=5, room_timeout_s=5,
                            pending_ack_timeout_s=ack_timeout_s, **settings)
    key = derive_key(secret, "zmq-control") if secret else None
    kv = torch.zeros(2, 2, 4, 4, 2, 8)
    sender = KVSender(config, kv, on_pages=sink, control_key=key).start()
    receiver = KVReceiver(config, kv, control_key=key).start()
    receiver.connect(sender.bootstrap_addr)
    return sender, receiver


@pytest.mark.parametrize("secret", [None, b"a cluster secret for this test"], ids=["plain", "auth"])
def test_done_only_once_the_prefill_recorded_the_marks(secret: bytes | None) -> None:
    sink = GatedSink()
    sender, receiver = pair(sink, secret=secret)
    try:
        delivery = receiver.announce_pending(KEYS, 10.0)
        delivery.add_done_callback(lambda: sink.log.append("delivered"))
        assert sink.entered.wait(5)
        # the prefill's control thread is inside the sink: it cannot have answered
        assert not delivery.wait(0.2) and sink.log == []
        sink.release.set()
        assert delivery.wait(5)
        assert sink.log == ["recorded", "delivered"]
        assert not delivery.timed_out and delivery.answered_s is not None
        assert receiver.stats()["pending_marks_acked"] == 1  # counted before any caller hears
        assert receiver.stats()["pending_ack_timeouts"] == 0
    finally:
        sink.release.set()
        receiver.close()
        sender.close()


def test_a_peer_that_does_not_answer_costs_at_most_the_ack_timeout() -> None:
    sink = GatedSink()
    sender, receiver = pair(sink, ack_timeout_s=0.3)
    try:
        start = time.monotonic()
        delivery = receiver.announce_pending(KEYS, 10.0)
        assert delivery.wait(5), "the delivery outlived its timeout"
        assert time.monotonic() - start >= 0.3
        assert delivery.timed_out and sink.log == []  # given up on, not answered
        assert receiver.stats()["pending_ack_timeouts"] == 1
    finally:
        sink.release.set()
        receiver.close()
        sender.close()


def test_every_peer_answers_before_it_is_done() -> None:
    """Two prefill peers: the delivery waits for the slow one too."""
    slow, quick = GatedSink(), GatedSink()
    quick.release.set()
    sender, receiver = pair(slow)
    other = KVSender(receiver.config, torch.zeros(2, 2, 4, 4, 2, 8), on_pages=quick).start()
    try:
        receiver.connect(other.bootstrap_addr)
        delivery = receiver.announce_pending(KEYS, 10.0)
        assert slow.entered.wait(5) and quick.entered.wait(5)
        assert not delivery.wait(0.2) and quick.log == ["recorded"]
        slow.release.set()
        assert delivery.wait(5) and not delivery.timed_out
        assert delivery.answered_s is not None and slow.log == ["recorded"]
    finally:
        slow.release.set()
        receiver.close()
        other.close()
        sender.close()


def test_a_peer_declared_lost_is_not_waited_for() -> None:
    """A prefill that stops answering altogether (here: its control thread stuck in the sink)
    is declared lost after its heartbeat deadline: the answer waits that long, not the ack
    bound (HELD_S)."""
    sink = GatedSink()
    sender, receiver = pair(sink, heartbeat_interval_s=0.1, heartbeat_misses=3)
    try:
        delivery = receiver.announce_pending(KEYS, 10.0)
        assert delivery.wait(HELD_S / 2), "waited for a lost peer"
        assert not delivery.timed_out and delivery.answered_s is None and sink.log == []
        assert receiver.stats()["peers_lost"] >= 1
    finally:
        sink.release.set()
        receiver.close()
        sender.close()


def test_without_a_peer_or_once_closed_nothing_waits() -> None:
    sink = GatedSink()
    config = TransferConfig(engine="zmq", bootstrap_timeout_s=5, room_timeout_s=5,
                            pending_ack_timeout_s=HELD_S)
    receiver = KVReceiver(config, torch.zeros(2, 2, 4, 4, 2, 8)).start()
    sender = KVSender(config, torch.zeros(2, 2, 4, 4, 2, 8), on_pages=sink).start()
    try:
        try:
            alone = receiver.announce_pending(KEYS, 10.0)
            assert alone.wait(5) and alone.answered_s is None  # nobody to hear it
            assert receiver.stats()["pending_marks_acked"] == 0
            receiver.connect(sender.bootstrap_addr)
            open_one = receiver.announce_pending(KEYS, 10.0)
            assert sink.entered.wait(5) and not open_one.done
        finally:
            receiver.close()  # no answer can come after close: the delivery ends with it
        assert open_one.done and not open_one.timed_out and open_one.answered_s is None
        assert receiver.announce_pending(KEYS, 10.0).done
    finally:
        sink.release.set()
        sender.close()


def test_a_pong_answers_the_pings_before_it_on_its_own_link_only() -> None:
    delivery = MarksDelivery()
    delivery.expect(b"link-a", 7)
    delivery.expect(b"link-b", 8)
    delivery.seal()
    assert not delivery.answered(b"link-a", 6)  # an earlier heartbeat's pong
    assert not delivery.answered(b"link-c", 99)  # another link
    assert not delivery.answered(b"link-a", 9) and not delivery.done
    assert delivery.drop(b"link-b") and delivery.done  # the last one left went away
    assert delivery.answered_s is None and not delivery.timed_out


def test_callbacks_run_once_and_one_that_raises_does_not_stop_the_rest() -> None:
    delivery = MarksDelivery()
    delivery.expect(b"link", 1)
    delivery.seal()
    calls: list[str] = []

    def boom() -> None:
        calls.append("boom")
        raise RuntimeError("a caller's bug")

    delivery.add_done_callback(boom)
    delivery.add_done_callback(lambda: calls.append("next"))
    assert delivery.answered(b"link", 1)
    assert not delivery.finish(timed_out=True)  # already done: a second end changes nothing
    assert calls == ["boom", "next"] and not delivery.timed_out
    delivery.add_done_callback(lambda: calls.append("late"))  # done: runs here, at once
    assert calls == ["boom", "next", "late"]


@pytest.mark.parametrize("bad", [0, -1.0])
def test_the_ack_timeout_must_be_positive(bad: float) -> None:
    with pytest.raises(ValueError, match="pending_ack_timeout_s"):
        TransferConfig(engine="zmq", pending_ack_timeout_s=bad)
