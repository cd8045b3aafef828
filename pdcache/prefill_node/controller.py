"""The prefill node's PD rooms and the pages they hold: the one place that decides when a
prefill page handed to a decode node is freed.

A room's life (docs/pd-protocol.md), with the thread that drives each step:

    open_room(rid, room, notify, ...)   event loop   the handler will wait for the room
    decode_requested(room)              control      decode's RoomRequest arrived: its
                                                     pages are reserved, so the request may
                                                     now be computed (`decode_ready`)
    take_prefilled(rid, pages, report)  engine       prompt K/V complete: hand the pages to
                                                     the sender; True = the engine holds them
    on_release(outcome)                 transfer     the sender no longer reads the pages:
                                                     free them (once), tell the handler
    close_room(room, reason)            event loop   the handler is done; a room still being
                                                     sent is aborted and becomes an orphan,
                                                     freed when its release comes
    close()                             closing      after the sender closed: free the rest

Pages are freed exactly once, by `Engine.release_held(rid)` (queued to the engine thread, so a
release decided while the engine is still holding the request — even from inside
`take_prefilled` — finds it held). They are freed by `on_release` for every room whose
`send()` was accepted (the sender's contract: one release per accepted room), or by `close()`
for an accepted room the closed sender never released. A room that was never accepted holds
nothing: `take_prefilled` returns False and the scheduler caches/frees its pages at once.

The admission gate (docs/pd-protocol.md, "Decode admission"): with `wait_for_decode`, the
scheduler's `admission_ready` asks `decode_ready(rid)` (engine thread), which is False for a
PD request whose decode has not asked for its K/V yet, so no prefill compute (and no prefill
page) is spent on a request the decode node cannot take yet. The sender reports each
`RoomRequest` (`on_requested` -> `decode_requested`); a room opened after its request came
asks the sender (`has_destination`). The handler's deadline ends a wait that never ends.

Locking: `_lock` (a plain Lock) guards `_rooms`, `_room_of` and each `_Room`'s fields. Every
method decides under the lock and acts — `send`, `abort`, `release_held`, `notify` — outside
it, so a sender that calls `on_release` back on the calling thread (inside `send()` or
`abort()`) re-enters nothing held; the room's `phase` says what the re-entrant call may do.
"""

from __future__ import annotations

import dataclasses
import enum
import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

from pdcache.engine.state_pool import StateSnapshot
from pdcache.transfer.messages import PrefillReport
from pdcache.transfer.rooms import Outcome, RoomState

log = logging.getLogger(__name__)


class Sender(Protocol):
    """The transfer side (`pdcache.transfer.sender.KVSender`)."""

    def send(self, room: int, src_page_ids: Sequence[int], report: PrefillReport,
             state: StateSnapshot | None = None,
             window_page_ids: Sequence[int | None] | None = None) -> bool: ...

    def has_destination(self, room: int) -> bool: ...

    def abort(self, room: int, reason: str = ...) -> None: ...


class HeldPages(Protocol):
    """The engine side (`pdcache.engine.engine.Engine`): frees a held request's pages on the
    engine thread, after everything queued before."""

    def release_held(self, rid: str) -> None: ...

    def wake(self) -> None: ...


class DuplicateRoomError(ValueError):
    """The room id (or the request id) is already in use on this node."""


@dataclass(frozen=True)
class PrefillOutcome:
    """What the handler waiting for a room learns: the room's end and its timings.

    `push_s`: from the prompt's K/V being handed to the sender to the room's release."""

    room: int
    state: RoomState
    reason: str = ""
    code: str = ""
    nbytes: int = 0
    push_s: float = 0.0

    @property
    def ok(self) -> bool:
        return self.state is RoomState.SUCCESS


Notify = Callable[[PrefillOutcome], None]


class Phase(enum.Enum):
    OPEN = "open"  # the handler waits; the prompt is not prefilled yet
    SENDING = "sending"  # take_prefilled is inside send()
    SENT = "sent"  # the sender accepted the pages: one on_release will come
    RELEASED = "released"  # on_release came (maybe while SENDING): pages freed


@dataclass
class _Room:
    rid: str
    notify: Notify
    phase: Phase = Phase.OPEN
    handler_gone: bool = False  # close_room came first: nobody waits, abort when sent
    sent_at: float = 0.0
    opened_at: float = 0.0
    requested: bool = False  # decode's RoomRequest is at the sender: it may be computed
    on_requested: Callable[[float], None] | None = None


class PrefillController:
    """Owns the prefill node's rooms, the rid <-> room maps and the decision to free the pages
    of PD requests; see the module docstring for the threads and the lock.

    Built before the engine and the sender (the engine's scheduler calls `take_prefilled`,
    the sender calls `on_release`); `attach(engine, sender)` supplies them before `start`."""

    def __init__(self, node_name: str, wait_for_decode: bool = True) -> None:
        self.node_name = node_name
        self.wait_for_decode = wait_for_decode
        self._engine: HeldPages | None = None
        self._sender: Sender | None = None
        self._lock = threading.Lock()
        self._rooms: dict[int, _Room] = {}
        self._room_of: dict[str, int] = {}
        self._closed = False

    def attach(self, engine: HeldPages, sender: Sender) -> None:
        self._engine, self._sender = engine, sender

    # ---- event loop --------------------------------------------------------------------------
    def open_room(self, rid: str, room: int, notify: Notify,
                  on_requested: Callable[[float], None] | None = None) -> None:
        """Register the handler of `room` (request `rid`); `notify(outcome)` runs once, on a
        transfer thread, when the room ends — unless the handler closed the room first.
        `on_requested(waited_s)` runs once (any thread) when decode asked for the room's K/V
        (maybe before this returns)."""
        with self._lock:
            if self._closed:
                raise RuntimeError("the prefill node is shutting down")
            if room in self._rooms:
                raise DuplicateRoomError(f"room {room} is already in use")
            if rid in self._room_of:
                raise DuplicateRoomError(f"request {rid!r} already has room {self._room_of[rid]}")
            self._rooms[room] = _Room(rid, notify, opened_at=time.monotonic(),
                                      on_requested=on_requested)
            self._room_of[rid] = room
        if self._require_sender().has_destination(room):  # decode asked before we opened
            self.decode_requested(room)

    # ---- control thread (the sender's on_requested), or the event loop --------------------------
    def decode_requested(self, room: int) -> None:
        """Decode's RoomRequest for `room` is at the sender: its request may be computed."""
        with self._lock:
            entry = self._rooms.get(room)
            if entry is None or entry.requested:
                return
            entry.requested = True
            waited, callback = time.monotonic() - entry.opened_at, entry.on_requested
        if self.wait_for_decode and self._engine is not None:
            self._engine.wake()  # the gate opened: schedule now
        if callback is not None:
            try:
                callback(waited)
            except Exception:
                log.exception("prefill: on_requested of room %d raised", room)

    # ---- engine thread: the admission gate ------------------------------------------------------
    def decode_ready(self, rid: str) -> bool:
        """May `rid` be computed now? False only for the request of an open PD room whose
        decode has not asked for its K/V yet (and only with `wait_for_decode`)."""
        if not self.wait_for_decode:
            return True
        with self._lock:
            room = self._room_of.get(rid)
            entry = self._rooms.get(room) if room is not None else None
            return entry is None or entry.requested or entry.phase is not Phase.OPEN

    def waiting_for_decode(self) -> int:
        """Open PD rooms whose decode has not asked yet; any thread."""
        with self._lock:
            return sum(1 for e in self._rooms.values()
                       if e.phase is Phase.OPEN and not e.requested and not e.handler_gone)

    def close_room(self, room: int, reason: str = "prefill request ended early") -> None:
        """The handler is done with `room` (answered, failed or gone). A room not released yet
        is aborted at the sender (decode is told); one whose pages the sender holds stays as an
        orphan until its `on_release` frees them."""
        with self._lock:
            entry = self._rooms.get(room)
            if entry is None or entry.handler_gone:
                return  # released already (or closed twice)
            entry.handler_gone = True
            if entry.phase is Phase.OPEN:  # not prefilled: nothing is held, forget it
                self._forget(room, entry)
            abort = entry.phase is not Phase.SENDING  # SENDING: take_prefilled aborts
        if abort:
            self._sender_abort(room, reason)

    # ---- engine thread -----------------------------------------------------------------------
    def take_prefilled(self, rid: str, page_ids: Sequence[int], report: PrefillReport,
                       state: StateSnapshot | None = None,
                       window_page_ids: Sequence[int | None] | None = None) -> bool:
        """The prompt K/V of `rid` is complete in `page_ids` (and a hybrid model's recurrent
        `state` after the prompt, a host snapshot the sender reads until the room's release;
        with window pages, `window_page_ids`: the sliding page of each page, None: freed).
        True: the sender took them and the engine must hold the pages until
        `release_held(rid)`; False: not a PD request, or its room is over — the engine
        caches/frees the pages as usual."""
        with self._lock:
            room = self._room_of.get(rid)
            entry = self._rooms.get(room) if room is not None else None
            if entry is None or entry.phase is not Phase.OPEN or self._closed:
                return False
            entry.phase, entry.sent_at = Phase.SENDING, time.monotonic()
        report = dataclasses.replace(report, prefill_node=self.node_name)
        try:
            sender = self._require_sender()
            extra: dict[str, object] = {}
            if state is not None:
                extra["state"] = state
            if window_page_ids is not None:
                extra["window_page_ids"] = window_page_ids
            accepted = sender.send(room, page_ids, report, **extra)  # type: ignore[arg-type]
        except Exception:  # a bad report or pages: fail the room, never the engine thread
            log.exception("prefill: send of room %d failed", room)
            # decode hears of it now (else its room waits for room_timeout_s: a late 504)
            self._sender_abort(room, "prefill could not send the K/V")
            accepted = False
        return self._after_send(room, entry, accepted)

    def _after_send(self, room: int, entry: _Room, accepted: bool) -> bool:
        notify: PrefillOutcome | None = None
        with self._lock:
            released = entry.phase is Phase.RELEASED  # on_release came during send()
            if not accepted:
                self._forget(room, entry)
                if not entry.handler_gone:
                    notify = PrefillOutcome(room, RoomState.FAILED, "the room was already over",
                                            "aborted")
            elif not released:
                entry.phase = Phase.SENT
            abort = accepted and not released and entry.handler_gone
            free_now = accepted and not released and self._closed
            if free_now:
                self._forget(room, entry)
                entry.phase = Phase.RELEASED
        if notify is not None:
            self._notify(entry, notify)
        if abort:
            self._sender_abort(room, "prefill request ended early")
        if free_now:  # the sender is closed: no release will come
            self._release(entry.rid)
        return accepted

    # ---- transfer threads --------------------------------------------------------------------
    def on_release(self, outcome: Outcome) -> None:
        """The sender no longer reads the room's pages: free them and tell the handler."""
        with self._lock:
            entry = self._rooms.get(outcome.room_id)
            if entry is None or entry.phase not in (Phase.SENDING, Phase.SENT):
                return  # not ours, or released already: nothing to free twice
            entry.phase = Phase.RELEASED
            self._forget(outcome.room_id, entry)
            gone = entry.handler_gone
        self._release(entry.rid)
        if not gone:
            nbytes = getattr(outcome.data, "nbytes", 0) if outcome.data is not None else 0
            self._notify(entry, PrefillOutcome(
                outcome.room_id, outcome.state, outcome.reason, outcome.code, int(nbytes),
                max(time.monotonic() - entry.sent_at, 0.0)))

    # ---- shutdown ----------------------------------------------------------------------------
    def close(self) -> None:
        """After the sender closed (it released what it could): refuse new rooms and holds,
        and free the pages of every room still held — nothing reads them any more."""
        with self._lock:
            self._closed = True
            held = [(room, e) for room, e in self._rooms.items() if e.phase is Phase.SENT]
            for room, entry in held:
                entry.phase = Phase.RELEASED
                self._forget(room, entry)
        for room, entry in held:
            self._release(entry.rid)
            if not entry.handler_gone:
                self._notify(entry, PrefillOutcome(room, RoomState.FAILED,
                                                   "prefill node shutting down", "aborted"))

    # ---- introspection -----------------------------------------------------------------------
    def rooms(self) -> dict[int, str]:
        """Open rooms (handled or orphaned) by room id -> phase name; any thread."""
        with self._lock:
            return {room: entry.phase.value for room, entry in self._rooms.items()}

    # ---- internals ---------------------------------------------------------------------------
    def _forget(self, room: int, entry: _Room) -> None:
        """Under `_lock`: drop the room and its rid mapping."""
        if self._rooms.get(room) is entry:
            del self._rooms[room]
        if self._room_of.get(entry.rid) == room:
            del self._room_of[entry.rid]

    def _release(self, rid: str) -> None:
        assert self._engine is not None, "attach() the engine first"
        self._engine.release_held(rid)

    def _sender_abort(self, room: int, reason: str) -> None:
        try:
            self._require_sender().abort(room, reason)
        except Exception:
            log.exception("prefill: abort of room %d failed", room)

    def _require_sender(self) -> Sender:
        assert self._sender is not None, "attach() the sender first"
        return self._sender

    @staticmethod
    def _notify(entry: _Room, outcome: PrefillOutcome) -> None:
        try:
            entry.notify(outcome)
        except Exception:  # the handler's adapter must not break a transfer thread
            log.exception("prefill: notifying the handler of room %d failed", outcome.room)
