"""Per-room state machine, shared by the prefill sender and the decode receiver.

    BOOTSTRAPPING → WAITING_FOR_INPUT → TRANSFERRING → SUCCESS
          └───────────────┴──────────────────┴──────→ FAILED

A room is *released* exactly once, when it is terminal and no engine write is in flight for
it (`busy` is false): it leaves the active table, its outcome is remembered (bounded) for
`state()`, and `on_release(room, outcome)` runs — outside the lock, on the thread that made
the room releasable — so the node can free or keep the room's pages. Once the callback
returned, the remembered outcome keeps only what the side's `slim` hook keeps of its payload
(pages and reports would otherwise stay for `keep_finished` rooms: GBs over a long run), and
the payloads kept stay under `keep_bytes` in all, the oldest dropped first.

Thread-safety: a RoomTable is mutated by the owner's control thread, its transfer workers and
the node's API calls; one internal lock guards everything, callbacks run without it.
"""

from __future__ import annotations

import enum
import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

logger = logging.getLogger(__name__)


class RoomState(enum.IntEnum):
    BOOTSTRAPPING = 1
    WAITING_FOR_INPUT = 2
    TRANSFERRING = 3
    SUCCESS = 4
    FAILED = 5

    @property
    def terminal(self) -> bool:
        return self in (RoomState.SUCCESS, RoomState.FAILED)


_ALLOWED: dict[RoomState, frozenset[RoomState]] = {
    RoomState.BOOTSTRAPPING: frozenset({RoomState.WAITING_FOR_INPUT, RoomState.FAILED}),
    RoomState.WAITING_FOR_INPUT: frozenset({RoomState.TRANSFERRING, RoomState.FAILED}),
    RoomState.TRANSFERRING: frozenset({RoomState.SUCCESS, RoomState.FAILED}),
    RoomState.SUCCESS: frozenset(),
    RoomState.FAILED: frozenset(),
}


class IllegalTransition(RuntimeError):
    def __init__(self, room: int, old: RoomState, new: RoomState) -> None:
        super().__init__(f"room {room}: illegal transition {old.name} → {new.name}")
        self.room, self.old, self.new = room, old, new


class UnknownRoom(KeyError):
    pass


class DuplicateRoom(ValueError):
    pass


def check_transition(room: int, old: RoomState, new: RoomState) -> None:
    if new not in _ALLOWED[old]:
        raise IllegalTransition(room, old, new)


@dataclass
class Room:
    """One room's bookkeeping. `data` holds the side-specific payload (pages, result, ...)."""

    room_id: int
    state: RoomState
    deadline: float  # time.monotonic() by which the room must be terminal
    data: Any = None
    reason: str = ""
    code: str = ""  # machine-readable failure cause, see Outcome
    busy: bool = False  # an engine write for this room may be in flight
    created_at: float = field(default_factory=time.monotonic)


@dataclass(frozen=True)
class Outcome:
    """What a released room ended as. On FAILED, `code` is one of FAILURE_CODES."""

    room_id: int
    state: RoomState
    reason: str
    data: Any
    code: str = ""


# Why a room failed: deadline passed | aborted by either node | peer declared dead by
# heartbeats | the data engine failed | bad pages or layouts | the peer refused registration |
# the two sides disagree on the request's recurrent state (one expects a state the other does
# not send, or another geometry or length: never a silent wrong state, docs/design.md §4.5).
FAILURE_CODES = ("timeout", "aborted", "peer_lost", "engine", "invalid", "refused",
                 "unregistered", "state_mismatch")


ReleaseCallback = Callable[[Outcome], None]
# What a released room's outcome keeps of its payload once `on_release` returned, and how many
# bytes that keeps (counted against the table's `keep_bytes`).
SlimPayload = Callable[[Any], tuple[Any, int]]


class RoomTable:
    """Active rooms of one side, their transitions, release and counters."""

    def __init__(self, side: str, keep_finished: int,
                 on_release: ReleaseCallback | None = None,
                 slim: SlimPayload | None = None, keep_bytes: int = 0) -> None:
        """`keep_finished`: outcomes remembered after release (oldest forgotten first).
        `slim(data) -> (kept, nbytes)`: what an outcome keeps of its payload once its
        `on_release` returned (None: all of it, uncounted); the kept payloads' `nbytes` stay
        under `keep_bytes` in all, the oldest replaced by None first."""
        self.side = side
        self._lock = threading.Lock()
        self._rooms: dict[int, Room] = {}
        self._finished: OrderedDict[int, Outcome] = OrderedDict()
        self._keep_finished = keep_finished
        self._on_release = on_release
        self._slim = slim
        self._keep_bytes = keep_bytes
        self._kept_bytes: OrderedDict[int, int] = OrderedDict()  # room → its payload's bytes
        self._kept_total = 0
        self.counters = {"created": 0, "succeeded": 0, "failed": 0, "released": 0,
                         "illegal_transitions": 0, "callback_errors": 0}

    # ---- queries -------------------------------------------------------------------------
    def get(self, room_id: int) -> Room | None:
        with self._lock:
            return self._rooms.get(room_id)

    def state(self, room_id: int) -> RoomState:
        """State of an active or recently released room; UnknownRoom otherwise."""
        with self._lock:
            room = self._rooms.get(room_id)
            if room is not None:
                return room.state
            outcome = self._finished.get(room_id)
        if outcome is None:
            raise UnknownRoom(f"{self.side}: unknown room {room_id}")
        return outcome.state

    def outcome(self, room_id: int) -> Outcome | None:
        """The remembered outcome of a released room (its payload slimmed once `on_release`
        returned); None for an active or unknown room."""
        with self._lock:
            return self._finished.get(room_id)

    def kept_payload_bytes(self) -> int:
        """Bytes the remembered outcomes' payloads keep, as their `slim` counted them."""
        with self._lock:
            return self._kept_total

    def active_count(self) -> int:
        with self._lock:
            return len(self._rooms)

    def select(self, pred: Callable[[Room], bool]) -> list[int]:
        with self._lock:
            return [r.room_id for r in self._rooms.values() if pred(r)]

    def snapshot(self) -> dict[str, int]:
        with self._lock:
            out = dict(self.counters)
            out["active"] = len(self._rooms)
            out["busy"] = sum(r.busy for r in self._rooms.values())
            return out

    # ---- mutations -----------------------------------------------------------------------
    def create(self, room_id: int, state: RoomState, timeout_s: float, data: Any = None) -> Room:
        with self._lock:
            if room_id in self._rooms or room_id in self._finished:
                raise DuplicateRoom(f"{self.side}: room {room_id} already exists")
            room = Room(room_id, state, time.monotonic() + timeout_s, data)
            self._rooms[room_id] = room
            self.counters["created"] += 1
            return room

    def mutate(self, room_id: int, fn: Callable[[Room], Any]) -> Any:
        """Run `fn(room)` under the lock if the room is active and not terminal, else None."""
        with self._lock:
            room = self._rooms.get(room_id)
            if room is None or room.state.terminal:
                return None
            return fn(room)

    def inspect(self, room_id: int, fn: Callable[[Room], Any]) -> Any:
        """Run `fn(room)` under the lock if the room is active, terminal or not (a terminal
        room is active until released), else None."""
        with self._lock:
            room = self._rooms.get(room_id)
            return None if room is None else fn(room)

    def tombstone(self, room_id: int, reason: str) -> None:
        """Remember `room_id` as FAILED without it ever being active (abort before creation)."""
        with self._lock:
            if room_id not in self._rooms and room_id not in self._finished:
                self._remember(Outcome(room_id, RoomState.FAILED, reason, None, "aborted"))

    def advance(self, room_id: int, new: RoomState, busy: bool | None = None,
                update: Callable[[Room], None] | None = None) -> Room:
        """Move a non-terminal room to `new` (IllegalTransition / UnknownRoom otherwise).

        `update` runs under the lock before the transition, to change `data` atomically with it.
        Terminal states go through `finish`, which also releases.
        """
        if new.terminal:
            raise ValueError("use finish() for terminal states")
        with self._lock:
            room = self._active(room_id)
            self._check(room, new)
            if update is not None:
                update(room)
            room.state = new
            if busy is not None:
                room.busy = busy
            return room

    def advance_unless_ended(self, room_id: int, new: RoomState) -> bool:
        """`advance` for a peer's message that may race a local end (an abort, a lost peer):
        False, and nothing counted, when the room is gone or already terminal; a transition a
        live room may not take still raises IllegalTransition (and is counted)."""
        with self._lock:
            room = self._rooms.get(room_id)
            if room is None or room.state.terminal:
                return False
            self._check(room, new)
            room.state = new
            return True

    def finish(self, room_id: int, new: RoomState, reason: str = "",
               busy: bool | None = None, code: str = "") -> bool:
        """Make the room terminal; False if it already was (or is unknown). Releases if idle."""
        with self._lock:
            room = self._rooms.get(room_id)
            if room is None or room.state.terminal:
                if room is not None and busy is not None:
                    room.busy = busy
                released = self._pop_if_releasable(room_id)
                changed = False
            else:
                self._check(room, new)
                room.state, room.reason, room.code = new, reason, code
                if busy is not None:
                    room.busy = busy
                self.counters["succeeded" if new is RoomState.SUCCESS else "failed"] += 1
                released = self._pop_if_releasable(room_id)
                changed = True
        self._notify(released)
        return changed

    def set_idle(self, room_id: int) -> None:
        """The engine is done with the room's memory; release it if terminal."""
        with self._lock:
            room = self._rooms.get(room_id)
            if room is None:
                return
            room.busy = False
            released = self._pop_if_releasable(room_id)
        self._notify(released)

    # ---- internals -----------------------------------------------------------------------
    def _active(self, room_id: int) -> Room:
        room = self._rooms.get(room_id)
        if room is None:
            raise UnknownRoom(f"{self.side}: unknown room {room_id}")
        return room

    def _check(self, room: Room, new: RoomState) -> None:
        try:
            check_transition(room.room_id, room.state, new)
        except IllegalTransition:
            self.counters["illegal_transitions"] += 1
            raise

    def _pop_if_releasable(self, room_id: int) -> Outcome | None:
        room = self._rooms.get(room_id)
        if room is None or not room.state.terminal or room.busy:
            return None
        del self._rooms[room_id]
        outcome = Outcome(room_id, room.state, room.reason, room.data, room.code)
        self._remember(outcome)
        self.counters["released"] += 1
        return outcome

    def _remember(self, outcome: Outcome) -> None:
        self._finished[outcome.room_id] = outcome
        while len(self._finished) > self._keep_finished:
            room_id, _ = self._finished.popitem(last=False)
            self._kept_total -= self._kept_bytes.pop(room_id, 0)

    def _notify(self, outcome: Outcome | None) -> None:
        if outcome is None:
            return
        try:
            if self._on_release is not None:
                self._on_release(outcome)
        except Exception:  # a node bug must not kill the transfer threads
            logger.exception("on_release callback failed for room %d",
                                                  outcome.room_id)
            with self._lock:
                self.counters["callback_errors"] += 1
        finally:  # delivered (the decode node reads `wait(room)` inside on_release): slim it
            self._settle(outcome)

    def _settle(self, outcome: Outcome) -> None:
        """Keep what `slim` keeps of a delivered outcome's payload, within `keep_bytes`."""
        if self._slim is None:
            return
        kept, nbytes = self._slim(outcome.data)
        with self._lock:
            if self._finished.get(outcome.room_id) is not outcome:
                return  # forgotten meanwhile (keep_finished)
            self._finished[outcome.room_id] = replace(outcome, data=kept)
            if nbytes:
                self._kept_bytes[outcome.room_id] = nbytes
                self._kept_total += nbytes
            while self._kept_total > self._keep_bytes and self._kept_bytes:
                oldest, size = self._kept_bytes.popitem(last=False)
                self._kept_total -= size
                self._finished[oldest] = replace(self._finished[oldest], data=None)
