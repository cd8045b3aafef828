"""The decode controller's receiver state slots (hybrid models, docs/design.md §4.14): a PD
room holds one slot of `KVReceiver.states` from its request to prefill until its state is
handed to the engine (`start_decode`, as an owned copy) or the room ends otherwise — freed
exactly once on every path, like its pages. Driven with the fake engine and receiver of
`test_controller.py` and a real `StateArea` (a double free raises there)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from pdcache.decode_node.controller import DecodeController
from pdcache.engine.presets import PRESETS
from pdcache.engine.state_pool import StateSnapshot
from pdcache.transfer.messages import PrefillReport
from pdcache.transfer.rooms import RoomState
from pdcache.transfer.state_area import StateArea
from tests.decode_node.test_controller import Books, FakeEngine, FakeReceiver

GEOMETRY = PRESETS["tiny-qwen3-next"].state_geometry


class CountingArea(StateArea):
    """A `StateArea` that counts frees per slot (a second free raises already)."""

    def __init__(self, num_slots: int) -> None:
        assert GEOMETRY is not None
        super().__init__(GEOMETRY, num_slots)
        self.frees: dict[int, int] = {}

    def free(self, slot: int) -> None:
        super().free(slot)
        self.frees[slot] = self.frees.get(slot, 0) + 1


@dataclass
class _StateResult:
    report: PrefillReport
    state_slot: int | None
    state_bytes: int

    @property
    def state_arrived(self) -> bool:
        return self.state_bytes > 0


@dataclass
class StateReceiver(FakeReceiver):
    """`FakeReceiver` whose rooms name a state slot; `finish(SUCCESS)` writes a pattern into
    it, as prefill's transfer does (`without_state`: a success that brought none)."""

    area: CountingArea | None = None
    slots: dict[int, int | None] = field(default_factory=dict)
    without_state: set[int] = field(default_factory=set)

    def request(self, room: int, bootstrap_addr: str, dst_page_ids, num_tokens: int,
                first_page: int = 0, dst_state: int | None = None) -> None:
        super().request(room, bootstrap_addr, dst_page_ids, num_tokens, first_page)
        self.slots[room] = dst_state

    def finish(self, room: int, state: RoomState, code: str = "") -> None:
        slot = self.slots.get(room)
        if state is RoomState.SUCCESS and slot is not None and self.area is not None:
            self.area.view(slot).fill_(room % 251)
        super().finish(room, state, code)

    def wait(self, room: int, timeout_s: float | None = None) -> _StateResult:
        arrived = room not in self.without_state
        return _StateResult(PrefillReport(11, prompt_tokens=9, prefill_node="p0"),
                            self.slots.get(room), GEOMETRY.state_bytes() if arrived else 0)


class StateNode:
    def __init__(self, num_slots: int = 4) -> None:
        self.books = Books()
        self.engine = FakeEngine(self.books)
        self.controller = DecodeController()
        self.area = CountingArea(num_slots)
        self.receiver = StateReceiver(self.controller, area=self.area)
        self.controller.attach(self.engine, self.receiver, self.area)
        self.outcomes: dict[int, list] = {}
        self.admissions: dict[int, list] = {}
        self.started: dict[int, StateSnapshot | None] = {}

    def open_and_request(self, room: int) -> bool:
        self.outcomes[room], self.admissions[room] = [], []
        self.controller.open_room(f"r{room}", room, self.outcomes[room].append)
        self.controller.request_kv(room, "tcp://127.0.0.1:1", 20, self.admissions[room].append)
        return bool(self.admissions[room]) and self.admissions[room][0].ok

    def start(self, room: int) -> None:
        def submit(state: StateSnapshot | None) -> None:
            self.started[room] = state
            self.engine.submit_prefilled(f"r{room}")

        self.controller.start_decode(room, submit)

    def assert_every_slot_freed_once(self) -> None:
        assert self.area.num_free == self.area.num_slots
        assert all(count == 1 for count in self.area.frees.values()), self.area.frees


def test_success_hands_an_owned_copy_to_the_engine_and_frees_the_slot() -> None:
    node = StateNode()
    assert node.open_and_request(7)
    slot = node.receiver.slots[7]
    assert slot is not None and node.area.is_held(slot)
    node.receiver.finish(7, RoomState.SUCCESS)
    assert node.outcomes[7][0].ok and node.area.is_held(slot)  # held until decoding starts
    node.start(7)
    state = node.started[7]
    assert state is not None and state.geometry == GEOMETRY
    assert not node.area.is_held(slot)
    node.area.view(slot).zero_()  # the slot is reused: the engine's copy is its own
    assert bool((state.data == 7).all())
    node.engine.step()
    node.assert_every_slot_freed_once()


def test_a_failed_room_frees_its_slot_once_even_if_released_twice() -> None:
    node = StateNode()
    assert node.open_and_request(1)
    node.receiver.finish(1, RoomState.FAILED, "state_mismatch")
    node.receiver.replay(1)
    assert not node.outcomes[1][0].ok and node.outcomes[1][0].code == "state_mismatch"
    node.engine.step()
    assert node.books.frees == {"r1": 1}
    node.assert_every_slot_freed_once()


def test_a_success_without_the_state_is_a_failed_room() -> None:
    node = StateNode()
    assert node.open_and_request(2)
    node.receiver.without_state.add(2)
    node.receiver.finish(2, RoomState.SUCCESS)
    assert not node.outcomes[2][0].ok and node.outcomes[2][0].state is RoomState.FAILED
    node.engine.step()
    assert node.books.frees == {"r2": 1}
    node.assert_every_slot_freed_once()


def test_leaving_frees_the_slot_on_release_or_at_once_when_ready() -> None:
    node = StateNode()
    assert node.open_and_request(3) and node.open_and_request(4)
    node.controller.leave(3, "caller gone")  # awaiting K/V: freed when prefill acks
    assert node.area.is_held(node.receiver.slots[3])
    node.receiver.ack(3)
    node.receiver.finish(4, RoomState.SUCCESS)
    node.controller.leave(4, "caller gone")  # K/V ready: freed now
    node.engine.step()
    assert node.books.frees == {"r3": 1, "r4": 1}
    node.assert_every_slot_freed_once()


def test_no_free_state_slot_refuses_the_room_like_a_full_queue() -> None:
    node = StateNode(num_slots=1)
    assert node.open_and_request(5)
    assert not node.open_and_request(6)
    assert node.admissions[6][0].reason == "queue_full"
    node.engine.step()
    assert node.books.frees == {"r6": 1}  # its reservation went back
    assert node.controller.rooms() == {5: "awaiting_kv"}
    node.receiver.finish(5, RoomState.SUCCESS)
    node.start(5)
    node.engine.step()
    node.assert_every_slot_freed_once()


def test_close_frees_the_slots_of_rooms_still_held() -> None:
    node = StateNode()
    assert node.open_and_request(8) and node.open_and_request(9)
    node.receiver.finish(8, RoomState.SUCCESS)  # ready, never started
    node.receiver.close()  # 9 released as failed
    node.controller.close()
    node.engine.shutdown()
    assert node.books.frees == {"r8": 1, "r9": 1}
    node.assert_every_slot_freed_once()


def test_a_node_without_a_state_area_asks_for_no_state() -> None:
    node = StateNode()
    node.controller.attach(node.engine, node.receiver, None)
    assert node.open_and_request(10)
    assert node.receiver.slots[10] is None
    node.receiver.finish(10, RoomState.SUCCESS)
    node.start(10)
    assert node.started[10] is None
    assert torch.equal(node.area.tensor, torch.zeros_like(node.area.tensor))
