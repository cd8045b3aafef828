"""PrefillController without HTTP: a fake sender, a fake engine that keeps exact page books,
and the real tiny engine for the hold itself.

The fake engine models the real one's ordering: `release_held` goes to an inbox drained by
`step()` (the engine thread), after the `take_prefilled` hook that decided the hold returned.
`Ledger` fails on a double free (freeing pages nobody holds) and `check_empty` on a leak."""

from __future__ import annotations

import random
import threading
from collections import Counter
from dataclasses import dataclass, field

import pytest

from pdcache.engine.api import GenerateRequest, SamplingParams
from pdcache.engine.config import CacheConfig, EngineConfig
from pdcache.engine.loader import load_model
from pdcache.engine.scheduler_config import SchedulerConfig
from pdcache.offload_manager.builder import TierConfig, build_tiered_engine
from pdcache.offload_manager.hicache import HiCacheConfig
from pdcache.prefill_node.controller import DuplicateRoomError, PrefillController, PrefillOutcome
from pdcache.prefill_node.scheduler import PrefillRole
from pdcache.transfer.messages import PrefillReport
from pdcache.transfer.rooms import Outcome, RoomState


class Ledger:
    """Every page of a PD request: taken once, freed once."""

    def __init__(self) -> None:
        self.held: dict[str, list[int]] = {}
        self.frees: Counter[str] = Counter()

    def hold(self, rid: str, pages: list[int]) -> None:
        assert rid not in self.held, f"{rid} held twice"
        self.held[rid] = pages

    def free(self, rid: str) -> None:
        # the protection under test: a second release of the same request lands here
        assert rid in self.held, f"double free (or free of unheld pages) of {rid}"
        del self.held[rid]
        self.frees[rid] += 1

    def check_empty(self) -> None:
        assert not self.held, f"pages leaked: {sorted(self.held)}"


class FakeEngine:
    """`HeldPages` with an inbox, like `Engine.release_held`."""

    def __init__(self, ledger: Ledger) -> None:
        self.ledger = ledger
        self.inbox: list[str] = []

    def release_held(self, rid: str) -> None:
        self.inbox.append(rid)

    def wake(self) -> None:
        pass

    def step(self) -> None:
        inbox, self.inbox = self.inbox, []
        for rid in inbox:
            self.ledger.free(rid)


@dataclass
class FakeSender:
    """`Sender`: accepts a room's pages once unless the room is already over; `finish` and
    `abort` release an accepted room once (`on_release`), like KVSender."""

    controller: PrefillController
    accepted: dict[int, PrefillReport] = field(default_factory=dict)
    released: set[int] = field(default_factory=set)
    over: set[int] = field(default_factory=set)  # aborted / failed before send()
    release_inside_send: bool = False  # re-entrancy: on_release from within send()
    closed: bool = False
    decode_asked: bool = True  # decode's RoomRequest came before the handler opened the room

    def has_destination(self, room: int) -> bool:
        return self.decode_asked

    def send(self, room: int, src_page_ids, report: PrefillReport) -> bool:
        if report.prompt_tokens < 0:
            raise ValueError("a report decode cannot read")
        if room in self.over or room in self.accepted:
            return False
        self.accepted[room] = report
        if self.release_inside_send:
            self.finish(room, RoomState.FAILED)
        return True

    def abort(self, room: int, reason: str = "aborted") -> None:
        if room in self.accepted:
            self.finish(room, RoomState.FAILED)
        else:
            self.over.add(room)

    def finish(self, room: int, state: RoomState) -> bool:
        if room not in self.accepted or room in self.released:
            return False
        self.released.add(room)
        self.controller.on_release(Outcome(room, state, "", None,
                                           "" if state is RoomState.SUCCESS else "aborted"))
        return True

    def replay(self, room: int) -> None:
        """A buggy transport delivering a release twice: the controller must ignore it."""
        if room in self.released:
            self.controller.on_release(Outcome(room, RoomState.FAILED, "again", None, "aborted"))

    def close(self) -> None:
        self.closed = True
        for room in list(self.accepted):
            self.finish(room, RoomState.FAILED)


class Node:
    """Controller + fake sender + fake engine; `prefilled(rid)` is the scheduler's hook."""

    def __init__(self) -> None:
        self.ledger = Ledger()
        self.engine = FakeEngine(self.ledger)
        self.controller = PrefillController("p0")
        self.sender = FakeSender(self.controller)
        self.controller.attach(self.engine, self.sender)
        self.outcomes: dict[int, list[PrefillOutcome]] = {}
        self._next_page = 0

    def open(self, room: int) -> None:
        self.outcomes[room] = []
        self.controller.open_room(f"r{room}", room, self.outcomes[room].append)

    def prefilled(self, rid: str) -> bool:
        """What PrefillRole.hold_after_finish does, then the scheduler's own step."""
        pages = [self._next_page, self._next_page + 1]
        self._next_page += 2
        held = self.controller.take_prefilled(rid, pages, PrefillReport(7, prompt_tokens=5))
        self.ledger.hold(rid, pages)
        if not held:  # cached / freed by the scheduler at once
            self.ledger.free(rid)
        return held

    def shutdown(self) -> None:
        """PrefillRuntime.close: sender, controller, then the engine drains its inbox."""
        self.sender.close()
        self.controller.close()
        self.engine.step()


def test_transfer_done_before_the_handler_ends() -> None:
    node = Node()
    node.open(1)
    assert node.prefilled("r1")
    assert node.sender.accepted[1].prefill_node == "p0"  # the controller names the node
    node.engine.step()
    assert node.ledger.held == {"r1": [0, 1]}  # held while the transfer reads them
    node.sender.finish(1, RoomState.SUCCESS)
    node.engine.step()
    assert node.outcomes[1][0].ok and node.outcomes[1][0].room == 1
    node.controller.close_room(1)  # the handler's finally: a no-op now
    node.engine.step()
    assert node.ledger.frees == {"r1": 1} and node.controller.rooms() == {}
    node.ledger.check_empty()


def test_handler_gone_before_the_transfer_is_done_orphans_then_frees() -> None:
    node = Node()
    node.open(2)
    assert node.prefilled("r2")
    node.sender.release_inside_send = False
    node.controller.close_room(2)  # e.g. the router cancelled: abort reaches the sender
    assert 2 in node.sender.released  # the fake sender released on abort
    node.engine.step()
    assert node.outcomes[2] == []  # nobody waits any more
    node.ledger.check_empty()
    assert node.controller.rooms() == {}


def test_orphan_waits_for_a_slow_release() -> None:
    node = Node()
    node.open(3)
    assert node.prefilled("r3")
    node.sender.abort = lambda room, reason="": None  # the engine is still writing
    node.controller.close_room(3)
    node.engine.step()
    assert node.ledger.held == {"r3": [0, 1]}  # kept: the transfer still reads them
    assert node.controller.rooms() == {3: "sent"}
    node.sender.finish(3, RoomState.FAILED)
    node.engine.step()
    node.ledger.check_empty()


def test_release_inside_send_is_not_a_double_free() -> None:
    node = Node()
    node.sender.release_inside_send = True
    node.open(4)
    assert node.prefilled("r4")  # accepted, and released before take_prefilled returned
    node.engine.step()  # the release is handled after the hold: pages freed once
    assert node.ledger.frees == {"r4": 1} and not node.outcomes[4][0].ok
    node.sender.replay(4)
    node.engine.step()
    node.ledger.check_empty()


def test_a_send_that_raises_tells_decode_at_once() -> None:
    """The sender refusing the pages with an error (a report or pages it cannot send): the
    room fails here, holds nothing, and decode is told (an abort): it waited for its
    room_timeout_s before, to answer a late 504."""
    node = Node()
    node.open(8)
    assert not node.controller.take_prefilled("r8", [0, 1], PrefillReport(7, prompt_tokens=-1))
    assert 8 in node.sender.over  # the abort reached the sender: decode hears of it
    assert node.outcomes[8][0].state is RoomState.FAILED
    node.ledger.check_empty()


def test_room_over_before_prefill_holds_nothing_and_answers_at_once() -> None:
    node = Node()
    node.open(5)
    node.sender.over.add(5)  # decode aborted first: the sender refuses the pages
    assert not node.prefilled("r5")
    assert node.outcomes[5][0].state is RoomState.FAILED
    node.ledger.check_empty()


def test_handler_gone_before_prefill_aborts_the_room_and_holds_nothing() -> None:
    node = Node()
    node.open(6)
    node.controller.close_room(6, "client gone")
    assert 6 in node.sender.over  # decode's late request will be refused
    assert not node.prefilled("r6")  # not a PD request any more: cached as usual
    node.ledger.check_empty()


def test_non_pd_requests_are_not_held() -> None:
    node = Node()
    assert not node.prefilled("plain")
    node.ledger.check_empty()


def test_duplicate_room_or_rid_is_refused() -> None:
    node = Node()
    node.open(7)
    with pytest.raises(DuplicateRoomError):
        node.controller.open_room("other", 7, print)
    with pytest.raises(DuplicateRoomError):
        node.controller.open_room("r7", 8, print)


def test_shutdown_with_rooms_open_frees_everything_once() -> None:
    node = Node()
    for room in (10, 11, 12):
        node.open(room)
    assert node.prefilled("r10") and node.prefilled("r11")
    node.sender.finish = lambda room, state: False  # a closing sender that releases nothing
    node.shutdown()
    node.ledger.check_empty()
    assert node.ledger.frees == {"r10": 1, "r11": 1}
    assert [o.state for o in node.outcomes[10]] == [RoomState.FAILED]
    assert node.outcomes[12] == []  # not prefilled: its engine request ends with the engine
    with pytest.raises(RuntimeError):
        node.controller.open_room("late", 13, print)
    assert not node.prefilled("r12")  # no new holds once closed


EVENTS = ("prefilled", "transfer_done", "decode_abort", "close", "replay", "step")


def run_interleaving(seed: int) -> Node:
    rng = random.Random(seed)
    node = Node()
    node.sender.release_inside_send = rng.random() < 0.2
    rooms = list(range(rng.randint(1, 6)))
    plans = {room: ["open"] + rng.sample(EVENTS, rng.randint(1, len(EVENTS))) for room in rooms}
    while any(plans.values()):
        room = rng.choice([r for r in rooms if plans[r]])
        event = plans[room].pop(0)
        rid = f"r{room}"
        if event == "open":
            node.open(room)
        elif event == "prefilled":
            node.prefilled(rid)
        elif event == "transfer_done":
            node.sender.finish(room, RoomState.SUCCESS)
        elif event == "decode_abort":
            node.sender.abort(room)  # decode's Abort / peer lost: the room fails
        elif event == "close":
            node.controller.close_room(room)
        elif event == "replay":
            node.sender.replay(room)
        if rng.random() < 0.5:
            node.engine.step()
    node.shutdown()
    for room in rooms:  # every handler ends (its engine request was aborted at shutdown)
        node.controller.close_room(room)
    node.engine.step()
    return node


@pytest.mark.parametrize("seed", range(100))
def test_random_interleavings_free_every_page_exactly_once(seed: int) -> None:
    # With the protection off (on_release without its phase check and without forgetting the
    # room) 71 of these 100 seeds fail in Ledger.free with "double free".
    node = run_interleaving(seed)
    node.ledger.check_empty()  # a leak fails here
    assert all(count == 1 for count in node.ledger.frees.values())  # a double free fails above
    assert node.controller.rooms() == {}
    assert all(len(outcomes) <= 1 for outcomes in node.outcomes.values())


def test_the_ledger_catches_what_the_controller_prevents() -> None:
    """With the protection off — a release handled twice, or never — the books fail."""
    ledger = Ledger()
    engine = FakeEngine(ledger)
    ledger.hold("x", [1])
    engine.release_held("x")
    engine.release_held("x")  # what on_release without its phase check would do on a replay
    with pytest.raises(AssertionError, match="double free"):
        engine.step()
    ledger.hold("y", [2])
    with pytest.raises(AssertionError, match="leaked"):
        ledger.check_empty()  # what a release that never came would leave


# ---- the real engine: PrefillRole holds exactly what the controller takes -----------------------

@pytest.fixture(scope="module")
def tiny():
    return load_model("tiny", seed=0)


def real_node(tiny):
    model, tokenizer = tiny
    config = EngineConfig(model.config, CacheConfig(page_size=4, num_device_pages=64),
                          SchedulerConfig(chunked_prefill_tokens=64))
    controller = PrefillController("p0")
    tiered = build_tiered_engine(config, model, tokenizer, TierConfig(128, HiCacheConfig()),
                                 role=PrefillRole(controller))
    return controller, tiered


@pytest.mark.parametrize("inside_send", [False, True])
def test_real_engine_holds_until_release(tiny, inside_send: bool) -> None:
    controller, tiered = real_node(tiny)
    engine = tiered.engine
    sender = FakeSender(controller, release_inside_send=inside_send)
    controller.attach(engine, sender)
    engine.start()
    try:
        outcomes: list[PrefillOutcome] = []
        controller.open_room("a", 1, outcomes.append)
        engine.generate(GenerateRequest("a", list(range(3, 13)), SamplingParams(1)), 60)
        engine.generate(GenerateRequest("b", list(range(20, 30)), SamplingParams(1)), 60)
        numbers = engine.check_accounting()
        assert 1 in sender.accepted and sender.accepted[1].prompt_tokens == 10
        if not inside_send:
            assert numbers["requests"] == 3 and engine.stats()["requests_held"] == 1
            engine.abort("a")  # an abort never frees pages the transfer reads
            assert engine.check_accounting()["requests"] == 3
            sender.finish(1, RoomState.SUCCESS)
        numbers = engine.check_accounting()  # after the release was handled
        assert numbers["requests"] == 0 and numbers["used"] == numbers["tree"]
        assert len(outcomes) == 1
    finally:
        tiered.close()


def test_the_gate_holds_a_pd_request_out_of_compute_until_decode_asks(tiny) -> None:
    # Protection: PrefillRole.admission_ready asks decode_ready. Without it (return True),
    # "g" is computed at once and `num_waiting == 1`
    # fails.
    controller, tiered = real_node(tiny)
    engine = tiered.engine
    sender = FakeSender(controller, decode_asked=False)
    controller.attach(engine, sender)
    engine.start()
    try:
        waits: list[float] = []
        controller.open_room("g", 5, print, on_requested=waits.append)
        done = threading.Event()
        engine.submit(GenerateRequest("g", list(range(3, 40)), SamplingParams(1)),
                      lambda out: out.finished and done.set())
        other = engine.generate(GenerateRequest("n", list(range(50, 60)), SamplingParams(1)), 60)
        assert other[-1].finished  # a request behind the held one is not blocked
        stats = engine.stats()
        assert stats["num_waiting"] == 1 and controller.waiting_for_decode() == 1
        assert not done.is_set() and 5 not in sender.accepted  # nothing computed for "g"
        assert engine.check_accounting()["requests"] == 0  # and no page taken
        controller.decode_requested(5)  # the sender saw decode's RoomRequest
        assert done.wait(60) and 5 in sender.accepted
        assert len(waits) == 1 and waits[0] > 0 and controller.waiting_for_decode() == 0
        sender.finish(5, RoomState.SUCCESS)
        assert engine.check_accounting()["requests"] == 0
    finally:
        tiered.close()
