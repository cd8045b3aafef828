"""The decode node's PD rooms and the pages they reserve or hold: the one place that decides
when a decode page of a PD request is freed.

A room's life (docs/pd-protocol.md), with the thread that drives each step:

    open_room(rid, room, notify)                event loop the handler owns the room
    request_kv(room, bootstrap, n, on_admitted) event loop reserve pages for the prompt (now,
                                                           or queued until pages free) ...
      -> on_admitted(Admitted)                  engine     ... then ask prefill to write its
                                                           K/V there; tell the handler
    on_release(outcome)                         transfer   nothing writes the pages any more:
                                                           success -> KV ready (the handler
                                                           decodes), failure -> reservation
                                                           freed; the handler is told
    start_decode(room, start)                   event loop the engine adopts the reservation
    leave(room, reason)                         event loop the caller is gone / gave up: abort
                                                           the room (freed on its release) or
                                                           free a ready reservation now
    close()                                     closing    after the receiver closed: free the
                                                           rest

A room waiting for pages sits in the engine's admission queue (`Engine.reserve_when_free`);
`leave` takes it out (`Engine.cancel_reservation`). The engine answers each queued rid exactly
once — granted, cancelled, queue full, shutdown — and the answer's thread (the engine's)
decides: a grant for a caller who left is freed at once, a refusal forgets the room.

Reserved pages are freed exactly once, by `Engine.abort(rid)` (which releases the reservation
on the engine thread), and only once nothing writes them: after the room's `on_release`
(the receiver's contract: prefill acked the abort, was declared dead, or the ack timed out),
or, for a room that never reached the receiver, at once. From `start_decode` on the engine
owns them (a failed start frees them the same way).

The offload hold: a decode request that finishes (or is aborted while running) with the
DecodeOffloadManager on keeps its pages until the manager's copies that read them are done.
The scheduler's `DecodeRole` asks `hold_for_offload(rid)` for the callback it hands the
manager; that callback (copy thread) frees the pages once with `Engine.release_held(rid)`.

A hybrid model's recurrent state (`attach(..., states=KVReceiver.states)`): each room also
holds a slot of the receiver's state area, allocated once its pages are reserved (none free:
the room is refused "queue_full", a 503 the router retries) and named in its request as
`dst_state`. It is freed exactly once (`_free_state_slot` clears `state_slot` under the lock)
wherever the room's reservation is, and on success by `start_decode`, which hands the engine
an owned copy of the state and frees the slot at once. A success whose state did not arrive
in its slot is a failed room; prefill's `state_mismatch` fails it like any transfer error.

Ownership rule: the thread that removes a room from `_rooms` (under the lock) frees its
reservation — except `on_release` on success, which keeps the room (KV_READY) for the handler,
and `start_decode`, which hands the pages to the engine.

Locking: `_lock` (a plain Lock) guards `_rooms`, `_room_of`, `_held` and each `_Room`'s
fields. Methods decide under the lock and act — reserve, request, abort, free, notify —
outside it, so a receiver calling `on_release` back on the calling thread (inside `abort()`)
re-enters nothing held.
"""

from __future__ import annotations

import enum
import functools
import logging
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

from pdcache.engine.state_pool import StateSnapshot
from pdcache.transfer.errors import TransferError
from pdcache.transfer.messages import PrefillReport
from pdcache.transfer.rooms import Outcome, RoomState

log = logging.getLogger(__name__)

T = TypeVar("T")


class Receiver(Protocol):
    """The transfer side (`pdcache.transfer.receiver.KVReceiver`)."""

    def request(self, room: int, bootstrap_addr: str, dst_page_ids: Any,
                num_tokens: int, first_page: int = 0, dst_state: int | None = None,
                dst_window_pages: Any = None, window_first_page: int = 0) -> None: ...

    def wait(self, room: int, timeout_s: float | None = None) -> Any: ...

    def abort(self, room: int, reason: str = ...) -> None: ...


class DecodeEngine(Protocol):
    """The engine side (`pdcache.engine.engine.Engine`)."""

    def reserve_when_free(self, rid: str, num_tokens: int, on_done: Callable[[Any], None],
                          max_new_tokens: int = 0, prefix_ids: Sequence[int] = (),
                          salt: str = "") -> None: ...

    def cancel_reservation(self, rid: str) -> None: ...

    def abort(self, rid: str) -> None: ...

    def release_held(self, rid: str) -> None: ...

    def in_flight(self, rid: str) -> bool: ...


class StateSlots(Protocol):
    """A hybrid model's receiver state area (`pdcache.transfer.state_area.StateArea`): the
    host slots prefill writes a room's recurrent state into. Locked: any thread."""

    def alloc(self) -> int | None: ...

    def free(self, slot: int) -> None: ...

    def snapshot(self, slot: int) -> StateSnapshot: ...


class DuplicateRoomError(ValueError):
    """The room id (or the request id) is already in use on this node; `code` says which."""

    def __init__(self, message: str, code: str = "duplicate_room") -> None:
        super().__init__(message)
        self.code = code


class BadRoomError(ValueError):
    """The receiver refused the room's request (bad bootstrap address, pages, room id)."""


class RoomCancelledError(RuntimeError):
    """The caller left while the pages were being reserved; they are freed again."""


@dataclass(frozen=True)
class DecodeOutcome:
    """What the handler waiting for a room's K/V learns. On success `report` is prefill's."""

    room: int
    state: RoomState
    reason: str = ""
    code: str = ""
    report: PrefillReport | None = None

    @property
    def ok(self) -> bool:
        return self.state is RoomState.SUCCESS and self.report is not None


Notify = Callable[[DecodeOutcome], None]


@dataclass(frozen=True)
class Admitted:
    """`request_kv`'s answer: `ok` (pages reserved, the request is with prefill) or refused
    with `reason` ("queue_full", "bad_room", "shutdown"); `queued`/`waited_s`: whether and
    how long it waited in the admission queue; `cached_pages`: the prompt's leading pages
    this node's prefix cache had, which prefill does not send."""

    ok: bool
    reason: str = ""
    message: str = ""
    waited_s: float = 0.0
    queued: bool = False
    cached_pages: int = 0


class Phase(enum.Enum):
    STARTING = "starting"  # open_room: reserving pages, sending the request
    AWAITING_KV = "awaiting_kv"  # the receiver has the room: one on_release will come
    KV_READY = "kv_ready"  # released with success: the pages hold the prompt's K/V


@dataclass
class _Room:
    rid: str
    notify: Notify
    phase: Phase = Phase.STARTING
    requesting: bool = False  # request_kv runs (STARTING): it cleans up after a leave()
    caller_gone: bool = False  # leave() came: nobody waits, free as soon as allowed
    state_slot: int | None = None  # the receiver's state slot (hybrid), freed with the pages


class DecodeController:
    """Owns the decode node's rooms, the rid <-> room maps, the decision to free reserved
    pages and the offload holds; see the module docstring for the threads and the lock.

    Built before the engine (its scheduler calls `hold_for_offload`) and the receiver (which
    calls `on_release`); `attach(engine, receiver)` supplies them before `start`."""

    def __init__(self) -> None:
        self._engine: DecodeEngine | None = None
        self._receiver: Receiver | None = None
        self._states: StateSlots | None = None
        self._lock = threading.Lock()
        self._rooms: dict[int, _Room] = {}
        self._room_of: dict[str, int] = {}
        self._held: set[str] = set()  # rids whose pages offload copies may still read
        self._closed = False

    def attach(self, engine: DecodeEngine, receiver: Receiver,
               states: StateSlots | None = None) -> None:
        """`states`: a hybrid model's receiver state area (`KVReceiver.states`): each room
        then holds one of its slots from its request to prefill until its state is handed to
        the engine (`start_decode`) or the room fails, freed exactly once."""
        self._engine, self._receiver, self._states = engine, receiver, states

    # ---- event loop, then a worker thread (blocking) -------------------------------------------
    def open_room(self, rid: str, room: int, notify: Notify) -> None:
        """Register the handler of `room` (request `rid`): from here on it owns the room until
        `start_decode` or `leave`. `notify(outcome)` runs once (transfer thread) when the room
        is released, unless the caller left first. Raises DuplicateRoomError, or RuntimeError
        when the node is closing."""
        with self._lock:
            if self._closed:
                raise RuntimeError("the decode node is shutting down")
            if room in self._rooms:
                raise DuplicateRoomError(f"room {room} is already in use")
            if rid in self._room_of:
                raise DuplicateRoomError(
                    f"request {rid!r} already has room {self._room_of[rid]}", "duplicate_rid")
            # a request of that id decoding here: freeing this room's pages later aborts by rid,
            # which would end that request (a client retrying with its rid; SGLang's router
            # passes the client's rid through)
            if self._engine is not None and self._engine.in_flight(rid):
                raise DuplicateRoomError(f"request {rid!r} is already in flight on this node",
                                         "duplicate_rid")
            self._rooms[room], self._room_of[rid] = _Room(rid, notify), room

    def request_kv(self, room: int, bootstrap: str, num_tokens: int,
                   on_admitted: Callable[[Admitted], None], max_new_tokens: int = 0,
                   prefix_ids: Sequence[int] = (), salt: str = "") -> None:
        """Reserve pages for the `num_tokens` prompt tokens of the opened `room` — at once, or
        once running requests free them (the engine's admission queue, in arrival order) —
        then ask the prefill node at `bootstrap` to write their K/V. Does not block. With the
        prompt's `prefix_ids` (tenant `salt`), the leading pages the engine's prefix tree
        holds are reused and prefill writes only the pages after them.

        Raises at once, with nothing reserved and the room forgotten: ValueError (the request
        can never fit this node's pool), EngineNotRunningError, RoomCancelledError (the room
        is not open). Otherwise `on_admitted(Admitted)` runs exactly once (engine thread),
        unless the caller left first: admitted (the request went out to prefill; a release
        follows) or refused ("queue_full", "bad_room", "shutdown"; nothing stays reserved).
        A caller that gives up while queued calls `leave`, which takes it out of the queue."""
        with self._lock:
            entry = self._rooms.get(room)
            if entry is None or entry.phase is not Phase.STARTING or entry.requesting:
                raise RoomCancelledError(f"room {room} is not open")
            entry.requesting = True
        done = functools.partial(self._on_reserved, room, entry, bootstrap, num_tokens,
                                 on_admitted)
        try:
            self._require_engine().reserve_when_free(entry.rid, num_tokens, done,
                                                     max_new_tokens=max_new_tokens,
                                                     prefix_ids=prefix_ids, salt=salt)
        except BaseException:
            with self._lock:
                self._forget(room, entry)
            raise

    def _on_reserved(self, room: int, entry: _Room, bootstrap: str, num_tokens: int,
                     on_admitted: Callable[[Admitted], None], admission: Any) -> None:
        """The engine's answer (engine thread): send the request to prefill, or give up."""
        if not admission.ok:
            with self._lock:
                self._forget(room, entry)
                gone = entry.caller_gone
            if not gone:
                self._admitted(on_admitted, Admitted(False, admission.reason,
                                                     waited_s=admission.waited_s))
            return
        if self._drop_if_gone(room, entry):
            return
        if not self._hold_state_slot(room, entry):  # every state slot is in flight: 503
            self._free_reservation(entry.rid)
            self._admitted(on_admitted, Admitted(False, "queue_full", "no free state slot",
                                                 admission.waited_s))
            return
        try:
            self._require_receiver().request(room, bootstrap, admission.page_ids, num_tokens,
                                             first_page=admission.cached_pages,
                                             **self._state_destination(entry),
                                             **_window_destination(admission))
        except Exception as exc:  # noqa: BLE001 - any failure: the room must not stay open
            refused = isinstance(exc, ValueError | TransferError)  # else a bug: 503, logged
            if not refused:
                log.exception("decode: room %d: the K/V request failed", room)
            with self._lock:
                self._forget(room, entry)
            self._free_state_slot(entry)
            self._free_reservation(entry.rid)
            self._admitted(on_admitted, Admitted(False, "bad_room" if refused else "error",
                                                 f"room {room}: {exc}", admission.waited_s))
            return
        self._requested(room, entry)
        self._admitted(on_admitted, Admitted(True, waited_s=admission.waited_s,
                                             queued=admission.queued,
                                             cached_pages=admission.cached_pages))

    def _hold_state_slot(self, room: int, entry: _Room) -> bool:
        """A hybrid room's state slot (always True without a state area); False, the room
        forgotten, when every slot is held by a room in flight."""
        if self._states is None:
            return True
        slot = self._states.alloc()
        with self._lock:
            entry.state_slot = slot
            if slot is None:
                self._forget(room, entry)
        return slot is not None

    @staticmethod
    def _state_destination(entry: _Room) -> dict[str, int]:
        return {} if entry.state_slot is None else {"dst_state": entry.state_slot}

    def _free_state_slot(self, entry: _Room) -> None:
        """Give the room's state slot back, exactly once (the slot is cleared under the lock
        by whoever frees it); call only once nothing writes it (as for the pages)."""
        with self._lock:
            slot, entry.state_slot = entry.state_slot, None
        if slot is not None and self._states is not None:
            try:
                self._states.free(slot)
            except Exception:
                log.exception("decode: freeing state slot %d failed", slot)

    def _take_state(self, entry: _Room) -> StateSnapshot | None:
        """The room's arrived state as an owned host copy, its slot freed (start_decode)."""
        with self._lock:
            slot = entry.state_slot
        if slot is None or self._states is None:
            return None
        try:
            view = self._states.snapshot(slot)
            return StateSnapshot(view.geometry, view.data.clone())  # the slot is reused at once
        finally:  # copied or not, the slot goes back exactly once
            self._free_state_slot(entry)

    @staticmethod
    def _admitted(on_admitted: Callable[[Admitted], None], result: Admitted) -> None:
        try:
            on_admitted(result)
        except Exception:  # the handler's adapter must not break the engine thread
            log.exception("decode: telling the handler about its admission failed")

    def _drop_if_gone(self, room: int, entry: _Room) -> bool:
        """After reserving: a caller that left meanwhile (or a closing node) gets nothing."""
        with self._lock:
            drop = entry.caller_gone or self._closed
            if drop:
                self._forget(room, entry)
        if drop:
            self._free_reservation(entry.rid)
        return drop

    def _requested(self, room: int, entry: _Room) -> None:
        with self._lock:
            if entry.phase is not Phase.STARTING:
                return  # on_release came already
            closed = self._closed  # close() left this room to us: no release will come
            if not closed:
                entry.phase = Phase.AWAITING_KV
            abort = entry.caller_gone and not closed
        if closed:
            self._free_state_slot(entry)
            self._free_reservation(entry.rid)
        elif abort:  # left while the request was going out: abort now that the room exists
            self._receiver_abort(room, "decode request ended before the KV arrived")

    # ---- transfer threads ---------------------------------------------------------------------
    def on_release(self, outcome: Outcome) -> None:
        """Nothing writes the room's pages any more: on success they hold the prompt's K/V
        (the handler decodes from them), otherwise the reservation is freed."""
        result = self._result(outcome) if outcome.state is RoomState.SUCCESS else None
        with self._lock:
            entry = self._rooms.get(outcome.room_id)
            if entry is None or entry.phase is Phase.KV_READY:
                return  # not ours, or released already
            report = self._usable_report(entry, result)
            keep = report is not None and not entry.caller_gone
            if keep:
                entry.phase = Phase.KV_READY
            else:
                self._forget(outcome.room_id, entry)
            gone = entry.caller_gone
        if not keep:
            self._free_state_slot(entry)
            self._free_reservation(entry.rid)
        if not gone:
            unreadable = outcome.state is RoomState.SUCCESS and report is None
            state = RoomState.FAILED if unreadable else outcome.state
            reason = ("prefill's report (or the room's state) could not be read" if unreadable
                      else outcome.reason)
            self._notify(entry, DecodeOutcome(outcome.room_id, state, reason, outcome.code,
                                              report))

    def _result(self, outcome: Outcome) -> Any:
        try:  # the room is released: wait() returns its result at once
            return self._require_receiver().wait(outcome.room_id, 0.0)
        except Exception:
            log.exception("decode: no report for room %d", outcome.room_id)
            return None

    @staticmethod
    def _usable_report(entry: _Room, result: Any) -> PrefillReport | None:
        """Under `_lock`: prefill's report, when the room has everything decoding needs — a
        hybrid room also its state, in its slot (the receiver checked its geometry)."""
        if result is None or result.report is None:
            return None
        if entry.state_slot is not None and not (
                getattr(result, "state_arrived", False)
                and getattr(result, "state_slot", None) == entry.state_slot):
            log.error("decode: room of %s succeeded without its recurrent state", entry.rid)
            return None
        return result.report

    # ---- event loop ---------------------------------------------------------------------------
    def start_decode(self, room: int, start: Callable[[StateSnapshot | None], T]) -> T:
        """Hand the room's filled pages to the engine: `start(state)` submits the prefilled
        request (`Engine.submit_prefilled` adopts the reservation; a hybrid model's `state`
        is the room's recurrent state, an owned copy — its receiver slot is freed here — and
        None otherwise). If the room is no longer ready (RoomCancelledError) or `start`
        raises, the reservation is freed."""
        with self._lock:
            entry = self._rooms.get(room)
            ready = entry is not None and entry.phase is Phase.KV_READY and not entry.caller_gone
            if ready:
                self._forget(room, entry)
        if not ready:
            raise RoomCancelledError(f"room {room} has no K/V ready")
        try:
            return start(self._take_state(entry))
        except BaseException:
            self._free_reservation(entry.rid)
            raise

    def leave(self, room: int, reason: str) -> None:
        """The caller is gone or gave up on `room`: abort it at the receiver (its reservation
        is freed on release), or free a reservation whose K/V already arrived."""
        with self._lock:
            entry = self._rooms.get(room)
            if entry is None or entry.caller_gone:
                return
            entry.caller_gone = True
            phase = entry.phase  # STARTING while requesting: its engine answer cleans up
            queued = phase is Phase.STARTING and entry.requesting
            if phase is Phase.KV_READY or (phase is Phase.STARTING and not entry.requesting):
                self._forget(room, entry)  # (nothing reserved yet in the second case)
        if phase is Phase.AWAITING_KV:
            self._receiver_abort(room, reason)
        elif phase is Phase.KV_READY:
            self._free_state_slot(entry)
            self._free_reservation(entry.rid)
        elif queued:  # waiting for pages: leave the queue ("cancelled" comes back), or, if
            # they were granted meanwhile, the grant's answer sees caller_gone and frees them
            self._cancel_reservation(entry.rid)

    # ---- engine thread: the offload hold --------------------------------------------------------
    def hold_for_offload(self, rid: str) -> Callable[[], None]:
        """`rid` is being held while offload copies read its pages; the returned callback
        (copy thread, once the copies are done) frees them, once."""
        with self._lock:
            if rid in self._held:
                log.error("decode: request %s is already held for offload", rid)
            self._held.add(rid)
        return functools.partial(self._offload_done, rid)

    def _offload_done(self, rid: str) -> None:
        with self._lock:
            if rid not in self._held:
                return  # freed already (shutdown): never twice
            self._held.discard(rid)
        self._require_engine().release_held(rid)

    # ---- shutdown -----------------------------------------------------------------------------
    def close(self) -> None:
        """After the receiver and the offload manager closed: refuse new rooms and free what
        is still reserved or held — nothing writes or reads those pages any more."""
        with self._lock:
            self._closed = True
            reserved = [e for e in self._rooms.values() if e.phase is not Phase.STARTING]
            self._rooms.clear()  # STARTING rooms: request_kv frees what it reserved
            self._room_of.clear()
            held, self._held = list(self._held), set()
        for entry in reserved:
            self._free_state_slot(entry)
            self._free_reservation(entry.rid)
        for rid in held:
            self._require_engine().release_held(rid)

    # ---- introspection -----------------------------------------------------------------------
    def rooms(self) -> dict[int, str]:
        """Open rooms by room id -> phase name; any thread."""
        with self._lock:
            return {room: entry.phase.value for room, entry in self._rooms.items()}

    def held(self) -> list[str]:
        with self._lock:
            return sorted(self._held)

    # ---- internals ---------------------------------------------------------------------------
    def _forget(self, room: int, entry: _Room) -> None:
        """Under `_lock`: drop the room and its rid mapping."""
        if self._rooms.get(room) is entry:
            del self._rooms[room]
        if self._room_of.get(entry.rid) == room:
            del self._room_of[entry.rid]

    def _free_reservation(self, rid: str) -> None:
        try:
            self._require_engine().abort(rid)  # releases the reservation on the engine thread
        except Exception:
            log.exception("decode: freeing the reservation of %s failed", rid)

    def _cancel_reservation(self, rid: str) -> None:
        try:
            self._require_engine().cancel_reservation(rid)
        except Exception:
            log.exception("decode: cancelling the queued reservation of %s failed", rid)

    def _receiver_abort(self, room: int, reason: str) -> None:
        try:
            self._require_receiver().abort(room, reason)
        except Exception:
            log.exception("decode: abort of room %d failed", room)

    def _require_engine(self) -> DecodeEngine:
        assert self._engine is not None, "attach() the engine first"
        return self._engine

    def _require_receiver(self) -> Receiver:
        assert self._receiver is not None, "attach() the receiver first"
        return self._receiver

    @staticmethod
    def _notify(entry: _Room, outcome: DecodeOutcome) -> None:
        try:
            entry.notify(outcome)
        except Exception:  # the handler's adapter must not break a transfer thread
            log.exception("decode: notifying the handler of room %d failed", outcome.room)


def _window_destination(admission: Any) -> dict[str, Any]:
    """The receiver's window-tail arguments of a grant (none without window pages)."""
    window = getattr(admission, "window_page_ids", None)
    if not window:
        return {}
    return {"dst_window_pages": window, "window_first_page": admission.window_first_page}
