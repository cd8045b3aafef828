"""A hybrid model's recurrent state rides the P→D hop with its pages (control protocol 8,
docs/design.md §4.5): byte-exact on every engine, refused `state_mismatch` when the two sides
disagree (geometry, length, one side without a state), pages and state slot freed exactly
once on every failure, and a room without a state unchanged."""

from __future__ import annotations

import hashlib
import multiprocessing as mp
import threading
import time
from dataclasses import replace

import msgpack
import numpy as np
import pytest
import torch
import zmq

from pdcache.engine.state_geometry import LinearAttentionConfig, RecurrentStateGeometry
from pdcache.engine.state_pool import StateSnapshot
from pdcache.transfer.engines.base import EngineTimeout
from pdcache.transfer.errors import TransferError, TransferTimeout
from pdcache.transfer.messages import (
    Done,
    MessageError,
    PrefillReport,
    Register,
    RoomRequest,
    decode,
    encode,
    pack_pages,
)
from pdcache.transfer.receiver import KVReceiver
from pdcache.transfer.rooms import Outcome, RoomState
from pdcache.transfer.sender import KVSender
from pdcache.transfer.state_area import StateArea, StateSlotError
from tests.transfer_support import engine_params, fast_config, make_pool, scaled_limit, wait_until

SRC_PAGES, DST_PAGES = 32, 48
STATE_SLOTS = 4
# about 1 MiB (4 linear layers: bf16 conv states, fp32 SSM states) and 16 bytes
MIB = RecurrentStateGeometry((0, 1, 2, 4), LinearAttentionConfig(4, 64, 64, 4, 16), "bfloat16")
TINY = RecurrentStateGeometry((1,), LinearAttentionConfig(2, 1, 1, 1, 1), "float32")
OTHER = RecurrentStateGeometry((0, 1, 2, 4), LinearAttentionConfig(4, 64, 64, 4, 8), "bfloat16")
ALL = engine_params()
ZMQ = engine_params(("zmq",))


def _snapshot(geometry: RecurrentStateGeometry, seed: int) -> StateSnapshot:
    gen = torch.Generator().manual_seed(seed)
    data = torch.randint(0, 256, (geometry.state_bytes(),), dtype=torch.uint8, generator=gen)
    return StateSnapshot(geometry, data)


class StatePair:
    """A started sender and receiver of (possibly different) state geometries; the decode
    node's part of the contract: on FAILED it frees the room's pages and state slot (the
    StateArea raises on a second free), on SUCCESS the test frees the slot after reading."""

    def __init__(self, engine: str, send_geometry: RecurrentStateGeometry | None,
                 recv_geometry: RecurrentStateGeometry | None) -> None:
        self.config = fast_config(engine)
        self.src, self.dst = make_pool(SRC_PAGES, seed=3), make_pool(DST_PAGES, seed=None)
        self.sent: list[Outcome] = []
        self.received: list[Outcome] = []
        self.freed_pages: list[int] = []
        self.sender = KVSender(self.config, self.src, on_release=self.sent.append,
                               state_geometry=send_geometry)
        self.receiver = KVReceiver(self.config, self.dst, on_release=self._on_release,
                                   state_geometry=recv_geometry,
                                   state_slots=STATE_SLOTS if recv_geometry else 0)

    def _on_release(self, outcome: Outcome) -> None:
        self.received.append(outcome)
        if outcome.state is RoomState.FAILED:
            self.freed_pages.extend(outcome.data.dst_pages.tolist())
            if outcome.data.dst_state is not None:
                self.states.free(outcome.data.dst_state)

    @property
    def states(self) -> StateArea:
        assert self.receiver.states is not None
        return self.receiver.states

    @property
    def addr(self) -> str:
        return self.sender.bootstrap_addr

    def start(self) -> StatePair:
        self.sender.start()
        self.receiver.start()
        self.receiver.connect(self.addr)
        return self

    def assert_idle(self) -> None:
        wait_until(lambda: self.sender.rooms.active_count() == 0
                   and self.receiver.rooms.active_count() == 0, 5.0, "rooms to be released")
        for side in (self.sender.stats(), self.receiver.stats()):
            rooms = side["rooms"]
            assert rooms["active"] == 0 and rooms["busy"] == 0
            assert rooms["released"] == rooms["created"]
            assert side["control_errors"] == 0 and rooms["illegal_transitions"] == 0
        if self.receiver.states is not None:
            assert self.states.num_free == STATE_SLOTS  # every slot back, exactly once

    def close(self) -> None:
        self.receiver.close()
        self.sender.close()


@pytest.fixture
def make_pair():
    pairs: list[StatePair] = []

    def make(engine: str, send: RecurrentStateGeometry | None,
             recv: RecurrentStateGeometry | None) -> StatePair:
        pairs.append(StatePair(engine, send, recv).start())
        return pairs[-1]

    yield make
    try:
        for pair in pairs:
            pair.assert_idle()
    finally:
        for pair in pairs:
            pair.close()


def _pages(rng: np.random.Generator, n: int) -> tuple[np.ndarray, np.ndarray]:
    return rng.choice(SRC_PAGES, n, replace=False), rng.choice(DST_PAGES, n, replace=False)


# ---- the wire ---------------------------------------------------------------------------------
def test_version_8_fields_round_trip_and_stay_out_of_stateless_frames() -> None:
    limit = 1 << 16
    plain = RoomRequest(1, pack_pages([4, 5]), 40)
    with_state = RoomRequest(1, pack_pages([4, 5]), 40, state_offset=8192, state_bytes=16,
                             state_geometry=TINY.key())
    assert msgpack.unpackb(encode(plain))["v"] == 4  # an older prefill still reads it
    assert msgpack.unpackb(encode(with_state))["v"] == 8
    assert decode(encode(with_state), limit) == with_state
    register = Register("d", "zmq", b"s", 1 << 40, 4, 8, 512, 2, "kv", 1 << 41, 1 << 20)
    assert msgpack.unpackb(encode(register))["v"] == 8 and decode(encode(register), limit) == register
    assert msgpack.unpackb(encode(replace(register, state_base=0, state_area_bytes=0)))["v"] == 7
    stateless = Done(3, 512, PrefillReport(7))
    stateful = Done(3, 512, PrefillReport(7, state_bytes=16, state_geometry=TINY.key()))
    body = msgpack.unpackb(encode(stateless))
    assert body["v"] == 4 and "state_bytes" not in body["report"]  # nested fields too
    assert msgpack.unpackb(encode(stateful))["v"] == 8
    assert decode(encode(stateful), limit) == stateful


@pytest.mark.parametrize("body, why", [
    ({"state_bytes": 16, "state_geometry": ""}, "state_bytes=16"),
    ({"state_bytes": 0, "state_geometry": "g"}, "state_bytes=0"),
    ({"state_offset": 64, "state_bytes": 0, "state_geometry": ""}, "without a state"),
])
def test_a_state_announced_by_half_is_refused(body: dict, why: str) -> None:
    raw = {"v": 8, "t": "room_request", "room": 1, "dst_pages": pack_pages([1]),
           "num_tokens": 3, "first_page": 0, "state_offset": 0, **body}
    with pytest.raises(MessageError, match=why) as info:
        decode(msgpack.packb(raw, use_bin_type=True), 1 << 16)
    assert info.value.kind == "bad_field"


def test_state_area_frees_each_slot_exactly_once() -> None:
    area = StateArea(TINY, 2)
    first, second = area.alloc(), area.alloc()
    assert (first, second, area.alloc()) == (0, 1, None)
    assert area.offset(1) % 4096 == 0 and area.view(1).numel() == TINY.state_bytes()
    area.free(first)
    with pytest.raises(StateSlotError, match="double free"):
        area.free(first)
    with pytest.raises(StateSlotError, match="outside"):
        area.free(7)
    with pytest.raises(ValueError, match="another geometry"):
        area.write(second, _snapshot(MIB, 1))


# ---- end to end -------------------------------------------------------------------------------
@pytest.mark.parametrize("engine", ALL)
@pytest.mark.parametrize("geometry", [MIB, TINY], ids=["1MiB", "16B"])
def test_pages_and_state_arrive_byte_exact(make_pair, engine: str,
                                           geometry: RecurrentStateGeometry) -> None:
    """Three concurrent rooms, each with pages and its own state slot; the fourth slot and
    every page not asked for stay untouched. Counters split KV from state bytes."""
    pair = make_pair(engine, geometry, geometry)
    rng = np.random.default_rng(4)
    rooms = {}
    dst_all = rng.permutation(DST_PAGES)[:15].reshape(3, 5)  # no two rooms share a page
    for room, dst_pages in zip((11, 12, 13), dst_all):
        src_pages = rng.choice(SRC_PAGES, 5, replace=False)
        slot = pair.states.alloc()
        snapshot = _snapshot(geometry, room)
        pair.receiver.request(room, pair.addr, dst_pages, num_tokens=17, dst_state=slot)
        assert pair.sender.send(room, src_pages, PrefillReport(room), state=snapshot)
        rooms[room] = (src_pages, dst_pages, slot, snapshot)
    untouched_slot = pair.states.alloc()
    for room, (src_pages, dst_pages, slot, snapshot) in rooms.items():
        result = pair.receiver.wait(room, scaled_limit(10.0))
        assert result.state_arrived and result.state_slot == slot
        assert result.state_bytes == geometry.state_bytes() == result.report.state_bytes
        assert result.report.state_geometry == geometry.key()
        assert torch.equal(pair.states.snapshot(slot).data, snapshot.data)
        assert torch.equal(pair.dst[:, :, dst_pages], pair.src[:, :, src_pages])
        assert result.nbytes == 4 * 2 * 5 * 512  # KV bytes only
        pair.states.free(slot)  # the node restored it into its engine's pool
    assert not pair.states.view(untouched_slot).any()
    pair.states.free(untouched_slot)
    wait_until(lambda: len(pair.sent) == 3, 5.0, "sender releases")
    sent, received = pair.sender.stats(), pair.receiver.stats()
    assert sent["state_bytes_sent"] == received["state_bytes_received"] == \
        3 * geometry.state_bytes()
    assert sent["bytes_sent"] == received["bytes_received"] == 3 * 4 * 2 * 5 * 512
    assert sent["states_sent"] == received["states_received"] == 3
    # remembered after release: state, reason and code only, never the state's bytes
    assert all(pair.sender.rooms.outcome(o.room_id).data is None for o in pair.sent)


@pytest.mark.parametrize("engine", ALL)
def test_a_room_without_state_works_as_before(make_pair, engine: str) -> None:
    pair = make_pair(engine, None, None)
    src_pages, dst_pages = _pages(np.random.default_rng(2), 6)
    pair.receiver.request(5, pair.addr, dst_pages, num_tokens=20)
    assert pair.sender.send(5, src_pages, PrefillReport(9))
    result = pair.receiver.wait(5, scaled_limit(5.0))
    assert result.report == PrefillReport(9) and not result.state_arrived
    assert result.state_slot is None
    assert torch.equal(pair.dst[:, :, dst_pages], pair.src[:, :, src_pages])
    assert pair.sender.stats()["state_bytes_sent"] == 0
    assert pair.receiver.stats()["state_bytes_received"] == 0


def _expect_state_mismatch(pair: StatePair, room: int, match: str, *, sender_side: bool) -> None:
    """The room fails `state_mismatch` on decode (and on prefill when prefill refused it),
    decode frees its pages (and its slot) once, prefill releases once, nothing of the state
    counted as sent or received."""
    with pytest.raises(TransferError, match=match) as info:
        pair.receiver.wait(room, scaled_limit(5.0))
    assert info.value.code == "state_mismatch"
    wait_until(lambda: any(o.room_id == room for o in pair.received)
               and any(o.room_id == room for o in pair.sent), 5.0, "both releases")
    mine = [o for o in pair.received if o.room_id == room]
    assert [(o.state, o.code) for o in mine] == [(RoomState.FAILED, "state_mismatch")]
    assert len([o for o in pair.sent if o.room_id == room]) == 1
    counters = pair.sender.stats() if sender_side else pair.receiver.stats()
    assert counters["state_mismatches"] >= 1
    assert pair.receiver.stats()["state_bytes_received"] == 0
    if sender_side:
        assert pair.sender.stats()["state_bytes_sent"] == 0


@pytest.mark.parametrize("engine", ALL)
def test_another_geometry_is_refused_before_any_byte_moves(make_pair, engine: str) -> None:
    pair = make_pair(engine, OTHER, MIB)
    src_pages, dst_pages = _pages(np.random.default_rng(6), 4)
    slot = pair.states.alloc()
    pair.receiver.request(21, pair.addr, dst_pages, num_tokens=9, dst_state=slot)
    assert pair.sender.send(21, src_pages, PrefillReport(1), state=_snapshot(OTHER, 1))
    _expect_state_mismatch(pair, 21, "geometry mismatch", sender_side=True)
    assert sorted(pair.freed_pages) == sorted(dst_pages.tolist())
    assert not pair.dst.any() and not pair.states.view(slot).any()  # nothing was written
    assert pair.sender.stats()["bytes_sent"] == 0


@pytest.mark.parametrize("engine", ZMQ)
def test_one_side_without_a_state_is_refused_both_ways(make_pair, engine: str) -> None:
    """An older decode (protocol < 8: no state area, stateless room requests) meets a hybrid
    prefill, and a hybrid decode meets a prefill that sends no state: both refused."""
    old_decode = make_pair(engine, TINY, None)
    stateless = RoomRequest(1, pack_pages([1]), 3)
    assert msgpack.unpackb(encode(stateless))["v"] < 8  # what an old decode sends
    old_decode.receiver.request(31, old_decode.addr, [1, 2], num_tokens=5)
    assert old_decode.sender.send(31, [3, 4], PrefillReport(1), state=_snapshot(TINY, 2))
    _expect_state_mismatch(old_decode, 31, "asked for no recurrent state", sender_side=True)
    no_state = make_pair(engine, TINY, TINY)
    slot = no_state.states.alloc()
    no_state.receiver.request(32, no_state.addr, [1, 2], num_tokens=5, dst_state=slot)
    assert no_state.sender.send(32, [3, 4], PrefillReport(1))
    _expect_state_mismatch(no_state, 32, "carries none", sender_side=True)
    assert sorted(no_state.freed_pages) == [1, 2]


@pytest.mark.parametrize("engine", ZMQ)
def test_a_wrong_length_with_the_right_key_is_refused(make_pair, engine: str,
                                                      monkeypatch) -> None:
    """A decode whose request claims another length for the same geometry (a bug, or a
    forged frame) is refused by prefill: the length is checked on its own."""
    pair = make_pair(engine, MIB, MIB)
    monkeypatch.setattr(pair.states, "state_bytes", MIB.state_bytes() - 4096)
    slot = pair.states.alloc()
    pair.receiver.request(41, pair.addr, [1], num_tokens=2, dst_state=slot)
    assert pair.sender.send(41, [2], PrefillReport(1), state=_snapshot(MIB, 3))
    _expect_state_mismatch(pair, 41, "length mismatch", sender_side=True)
    assert not pair.states.view(slot).any()


@pytest.mark.parametrize("engine", ZMQ)
def test_the_protection_off_writes_a_wrong_state_that_would_be_accepted(make_pair, engine: str,
                                                                        monkeypatch) -> None:
    """What the checks prevent. Prefill's check off: a longer state (OTHER's 2x SSM into a
    MIB slot) runs past its slot into the next one, which another room holds; decode's own
    check on `Done` still refuses the room. Both off: the room succeeds, and a shorter state
    leaves the slot's tail stale — a wrong state taken for the right one."""
    assert OTHER.state_bytes() < MIB.state_bytes()
    pair = make_pair(engine, MIB, OTHER)
    monkeypatch.setattr(pair.sender, "_state_mismatch", lambda data: "")
    slot, neighbour = pair.states.alloc(), pair.states.alloc()
    assert (slot, neighbour) == (0, 1)
    pair.receiver.request(51, pair.addr, [1], num_tokens=2, dst_state=slot)
    longer = _snapshot(MIB, 5)
    assert pair.sender.send(51, [2], PrefillReport(1), state=longer)
    _expect_state_mismatch(pair, 51, "the room asked for", sender_side=False)
    spill = MIB.state_bytes() - pair.states.slot_stride
    assert spill > 0 and torch.equal(pair.states.view(neighbour)[:spill],
                                     longer.data[pair.states.slot_stride:])  # overwritten
    pair.states.free(neighbour)

    # both checks off, and a shorter state than the slot (stale tail): accepted
    short_pair = make_pair(engine, OTHER, MIB)
    monkeypatch.setattr(short_pair.sender, "_state_mismatch", lambda data: "")
    monkeypatch.setattr(short_pair.receiver, "_state_mismatch", lambda data, report: "")
    slot = short_pair.states.alloc()
    short_pair.states.view(slot).fill_(0xAB)  # a previous request's state
    short_pair.receiver.request(52, short_pair.addr, [1], num_tokens=2, dst_state=slot)
    shorter = _snapshot(OTHER, 6)
    assert short_pair.sender.send(52, [2], PrefillReport(1), state=shorter)
    result = short_pair.receiver.wait(52, scaled_limit(5.0))
    assert result.state_arrived  # accepted: a state of the wrong geometry, stale tail
    landed = short_pair.states.view(slot)
    assert torch.equal(landed[: OTHER.state_bytes()], shorter.data)
    assert (landed[OTHER.state_bytes():] == 0xAB).all()
    short_pair.states.free(slot)


@pytest.mark.parametrize("engine", ALL)
def test_abort_mid_transfer_frees_pages_and_slot_once(make_pair, engine: str) -> None:
    """Decode aborts while prefill's write (held open here) is in flight: prefill stops,
    acks once the write ended (never while it may still land), each side releases once;
    decode frees the pages and the state slot once."""
    pair = make_pair(engine, MIB, MIB)
    assert pair.sender.engine is not None
    engine_wait, gate, waiting = pair.sender.engine.wait, threading.Event(), threading.Event()

    def held_wait(ticket, timeout_s: float) -> None:
        if not gate.is_set():
            waiting.set()
            time.sleep(min(timeout_s, 0.02))
            raise EngineTimeout("held by the test")
        engine_wait(ticket, timeout_s)

    pair.sender.engine.wait = held_wait  # type: ignore[method-assign]
    slot = pair.states.alloc()
    pair.receiver.request(61, pair.addr, [1, 2, 3], num_tokens=9, dst_state=slot)
    assert pair.sender.send(61, [4, 5, 6], PrefillReport(1), state=_snapshot(MIB, 7))
    assert waiting.wait(scaled_limit(5.0)), "the write never started"
    assert pair.receiver.poll(61) in (RoomState.WAITING_FOR_INPUT, RoomState.TRANSFERRING)
    pair.receiver.abort(61, "client disconnected")
    with pytest.raises(TransferError, match="client disconnected"):
        pair.receiver.wait(61, 1.0)
    if engine != "mooncake":  # whose drain reaps the batch itself (it really has ended)
        assert not pair.received  # prefill does not ack while its write may still land
    gate.set()  # the write ends: prefill's drain of the given-up tickets sees it, then acks
    wait_until(lambda: len(pair.received) == 1 and len(pair.sent) == 1, scaled_limit(5.0),
               "both releases")
    assert [(o.state, o.code) for o in pair.received] == [(RoomState.FAILED, "aborted")]
    assert pair.sent[0].state is RoomState.FAILED
    assert sorted(pair.freed_pages) == [1, 2, 3]
    assert pair.receiver.stats()["abort_ack_timeouts"] == 0  # released on prefill's ack
    assert pair.sender.stats()["states_sent"] == 0


def test_a_hybrid_decode_meeting_a_version_7_prefill_is_told_why() -> None:
    """A version-7 prefill refuses the version-8 Register of a decode with a state area (a
    version it does not know) and never answers: decode's connect says what that means."""
    old_prefill = zmq.Context.instance().socket(zmq.ROUTER)
    old_prefill.setsockopt(zmq.LINGER, 0)
    port = old_prefill.bind_to_random_port("tcp://127.0.0.1")
    receiver = KVReceiver(fast_config("zmq"), make_pool(4, seed=None), state_geometry=TINY,
                          state_slots=1).start()
    try:
        with pytest.raises(TransferTimeout, match="older than control protocol 8"):
            receiver.connect(f"127.0.0.1:{port}", timeout_s=0.5)
        assert old_prefill.poll(2000)
        _, frame = old_prefill.recv_multipart()
        body = msgpack.unpackb(frame)
        assert body["t"] == "register" and body["v"] == 8  # dropped as `version` by a v7 node
        assert receiver.states is not None
        assert body["state_area_bytes"] == receiver.states.nbytes
    finally:
        receiver.close()
        old_prefill.close()


def test_send_refuses_a_state_the_sender_cannot_carry(make_pair) -> None:
    pair = make_pair("zmq", TINY, TINY)
    with pytest.raises(ValueError, match="another geometry"):
        pair.sender.send(71, [1], PrefillReport(1), state=_snapshot(MIB, 1))
    with pytest.raises(ValueError, match="uint8 bytes"):
        pair.sender.send(71, [1], PrefillReport(1),
                         state=StateSnapshot(TINY, torch.zeros(TINY.state_bytes())))
    with pytest.raises(ValueError, match="not a held slot"):
        pair.receiver.request(71, pair.addr, [1], num_tokens=2, dst_state=0)
    stateless = make_pair("zmq", None, None)
    with pytest.raises(ValueError, match="no state_geometry"):
        stateless.sender.send(72, [1], PrefillReport(1), state=_snapshot(TINY, 1))
    assert pair.sender.rooms.active_count() == 0 and pair.receiver.rooms.active_count() == 0


def _remote_decode_main(engine: str, addr: str, conn) -> None:
    """Child: a hybrid decode node; one room with pages and a state, digests back."""
    pool = make_pool(DST_PAGES, seed=None)
    receiver = KVReceiver(fast_config(engine), pool, state_geometry=MIB, state_slots=2).start()
    try:
        assert receiver.states is not None
        slot = receiver.states.alloc()
        receiver.request(81, addr, [3, 9, 27], num_tokens=9, dst_state=slot)
        result = receiver.wait(81, 30.0)
        state = receiver.states.snapshot(slot).data.numpy().tobytes()
        pages = pool[:, :, [3, 9, 27]].contiguous().numpy().tobytes()
        conn.send((result.state_arrived, hashlib.sha256(state).hexdigest(),
                   hashlib.sha256(pages).hexdigest()))
    finally:
        receiver.close()


@pytest.mark.slow
@pytest.mark.parametrize("engine", ALL)
def test_a_remote_decode_gets_the_exact_state(engine: str) -> None:
    """Decode in another process (its state area truly remote): the state lands byte-exact."""
    released: list[Outcome] = []
    src = make_pool(SRC_PAGES, seed=8)
    sender = KVSender(fast_config(engine), src, on_release=released.append,
                      state_geometry=MIB).start()
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "numpy", "zmq", "pdcache.transfer.receiver",
                                "tests.transfer_support"])
    parent_conn, child_conn = ctx.Pipe()
    proc = ctx.Process(target=_remote_decode_main, args=(engine, sender.bootstrap_addr,
                                                         child_conn), daemon=True)
    proc.start()
    try:
        snapshot = _snapshot(MIB, 81)
        wait_until(lambda: sender.has_destination(81), 60.0, "decode's request")
        assert sender.send(81, [1, 2, 4], PrefillReport(5), state=snapshot)
        assert parent_conn.poll(60.0), "decode did not answer"
        arrived, state_digest, pages_digest = parent_conn.recv()
        assert arrived
        assert state_digest == hashlib.sha256(snapshot.data.numpy().tobytes()).hexdigest()
        pages = src[:, :, [1, 2, 4]].contiguous().numpy().tobytes()
        assert pages_digest == hashlib.sha256(pages).hexdigest()
        wait_until(lambda: len(released) == 1, 5.0, "sender release")
        assert released[0].state is RoomState.SUCCESS
    finally:
        proc.join(30)
        if proc.is_alive():
            proc.kill()
        sender.close()
