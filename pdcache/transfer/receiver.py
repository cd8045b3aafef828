"""Decode side: `KVReceiver` registers decode's KV pool with prefill peers and waits for rooms.

Usage by the decode node::

    receiver = KVReceiver(config, device_kv, on_release=on_room_released).start()
    receiver.connect(bootstrap_addr)                 # optional: request() connects lazily
    receiver.request(room, bootstrap_addr, dst_page_ids, num_tokens)
    result = receiver.wait(room, timeout_s)          # TransferResult, or raises TransferError
                                                     # (after the release too: `expired` once
                                                     # past finished_report_bytes)
    receiver.abort(room, "client disconnected"); receiver.close()

A hybrid model's receiver (`state_geometry`, `state_slots`) owns `receiver.states`, a
registered host `StateArea`; the node holds a slot per room like its pages::

    slot = receiver.states.alloc()                   # None: all held (wait, as for pages)
    receiver.request(room, addr, dst_page_ids, num_tokens, dst_state=slot)
    result = receiver.wait(room)                     # result.state_arrived
    state_pool.restore(engine_slot, receiver.states.snapshot(slot)); receiver.states.free(slot)

On FAILED, `on_release(outcome)` frees `outcome.data.dst_state` with the pages.

Per prefill peer there is one DEALER socket: `Register` (engine session, base address and
page geometry of the pool) goes first, then every room's `RoomRequest`; ZeroMQ keeps their
order. Pings go out every heartbeat interval; a peer silent for `peer_dead_after_s` is
declared dead and its rooms fail.

Release rule (pages and the state slot are never reused while prefill may still write them):
a room released on SUCCESS or on prefill's Abort is released at once; a room decode fails
itself (abort, timeout) is released when prefill acks the abort or after
`abort_ack_timeout_s` (counted).
A room of a peer declared lost (silent for `peer_dead_after_s`) is a fence: released only on
that link's AbortAck/Abort, when the address re-registers with another boot id (decode
registers again there at once, as a probe), when the prefill's end closed the control
connection (the process exited: a stopped one keeps it), or after `lost_peer_hold_s` (counted). `on_release(outcome)` runs then; on FAILED the node frees
the room's pages, on SUCCESS it owns the filled pages.

Threads and what they mutate:
- control thread: the DEALER sockets and `_peers`; room transitions caused by prefill
  messages, heartbeats and deadlines.
- caller threads (`request`, `wait`, `abort`, `connect`): room creation and local failure via
  RoomTable (locked); they reach sockets only through `ControlLoop.call_soon`.
- pull worker (`serve_pulls`, docs/design.md §4.10): the `PullServer` (pull_server.py) answers
  prefill's `PullPages` with the staged page objects of the node's `StagedPageSource`, off the
  control thread (it copies and MACs pages); its frames leave through `call_soon`.
`counters` are written by the control thread only, the `pull_pages_served`/`_unavailable`/
`_expired` ones by the pull worker only (`stats()` copies them).
"""

from __future__ import annotations

import itertools
import logging
import os
import threading
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
import zmq

from pdcache.engine.state_geometry import RecurrentStateGeometry
from pdcache.transfer.config import TransferConfig
from pdcache.transfer.control import (
    LINK_ID_BYTES,
    ControlLoop,
    RejectCounter,
    control_auth,
    parse,
    seal,
)
from pdcache.transfer.delivery import MarksDelivery
from pdcache.transfer.engines.base import create_engine
from pdcache.transfer.errors import TransferError, TransferTimeout
from pdcache.transfer.layout import KVLayout
from pdcache.transfer.messages import (
    MAX_KEYS_PER_MESSAGE,
    PAGE_KEY_BYTES,
    Abort,
    AbortAck,
    Done,
    Message,
    MessageError,
    PagesPending,
    PagesPulled,
    PagesSettled,
    Ping,
    Pong,
    PrefillReport,
    PullPages,
    Register,
    RegisterAck,
    RoomRequest,
    Started,
    pack_keys,
    pack_pages,
)
from pdcache.transfer.pull_server import (
    PULL_FRAMES_PER_LINK,
    PullLink,
    PullServer,
    StagedPageSource,
    unavailable,
)
from pdcache.transfer.rooms import (
    FAILURE_CODES,
    IllegalTransition,
    Outcome,
    ReleaseCallback,
    RoomState,
    RoomTable,
    UnknownRoom,
)
from pdcache.transfer.state_area import StateArea

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class TransferResult:
    """What prefill reported with `done`: its report and how many KV bytes landed; with a
    state requested, `state_slot` (the request's `dst_state`) holds the `state_bytes` of the
    recurrent state that landed with them (checked against the request: geometry and
    length)."""

    room: int
    report: PrefillReport
    nbytes: int
    elapsed_s: float
    state_slot: int | None = None
    state_bytes: int = 0

    @property
    def first_token(self) -> int:
        return self.report.first_token

    @property
    def state_arrived(self) -> bool:
        return self.state_bytes > 0


@dataclass
class _RecvRoom:
    """Decode-side room payload (RoomTable.data)."""

    peer_addr: str
    dst_pages: np.ndarray
    num_tokens: int
    dst_state: int | None = None  # the node's slot of `KVReceiver.states` for the state
    done: threading.Event = field(default_factory=threading.Event)
    result: TransferResult | None = None
    failed_at: float = 0.0  # when decode failed it while prefill might still write
    timed_out: bool = False
    request_sent: bool = False  # set on the control thread once the RoomRequest left
    # Link id of a lost peer whose late write these pages are fenced against ("" = none):
    # released only on that peer's AbortAck/Abort, its address re-registering with another
    # boot id, or lost_peer_hold_s (`KVReceiver._peer_lost`).
    held_for: bytes = b""


@dataclass(frozen=True)
class _Settled:
    """What a released decode room's remembered outcome keeps once `on_release` returned
    (`RoomTable` slim): the result a later `wait` returns, or how it failed; never the
    pages. A result's report counts its logprob bytes against `finished_report_bytes`."""

    result: TransferResult | None
    timed_out: bool


def _settled(data: _RecvRoom | None) -> tuple[_Settled | None, int]:
    if data is None:
        return None, 0
    report = data.result.report if data.result is not None else None
    nbytes = len(report.input_logprobs) + len(report.first_logprob) if report else 0
    return _Settled(data.result, data.timed_out), nbytes


@dataclass
class _Peer:
    """A prefill bootstrap endpoint; owned by the control thread."""

    addr: str
    socket: zmq.Socket
    link_id: bytes  # this socket's random routing id: prefill's frames are MAC'd for it
    ready: threading.Event = field(default_factory=threading.Event)
    # The prefill's per-boot id from its RegisterAck: with authentication every frame after
    # Register is MAC'd for link_id + prefill_boot, so frames wait in `held` until it came.
    prefill_boot: bytes | None = None
    held: list[Message] = field(default_factory=list)
    error: str = ""
    prefill_id: str = ""
    last_seen: float = field(default_factory=time.monotonic)
    last_ping: float = 0.0
    # The socket's monitor (EVENT_DISCONNECTED): the prefill's end closed the connection. A
    # stopped (SIGSTOP) or stalled process keeps its connections; one that exited does not.
    monitor: zmq.Socket | None = None
    closed_by_peer: bool = False
    # pull answer frames handed to the control thread and not sent yet (the pull worker takes
    # one before it queues a frame, `_send_pulled` gives it back; pull_server.PullLink)
    pull_credit: threading.Semaphore = field(
        default_factory=lambda: threading.Semaphore(PULL_FRAMES_PER_LINK))


_INT32_MAX = (1 << 31) - 1  # page indices travel as int32


class KVReceiver:
    """The decode node's end of the KV transfer; see the module docstring."""

    def __init__(self, config: TransferConfig, device_kv: torch.Tensor,
                 on_release: ReleaseCallback | None = None, decode_id: str = "",
                 control_key: bytes | None = None, kv_geometry: str = "",
                 state_geometry: RecurrentStateGeometry | None = None,
                 state_slots: int = 0, window_kv: torch.Tensor | None = None) -> None:
        """`control_key`: derive_key(cluster secret, "zmq-control") authenticates every
        control message (docs/security.md); None: unauthenticated (no secret). `kv_geometry`:
        the pool's `KVGeometry.layout_key`, sent at registration (prefill refuses another).
        `state_geometry` and `state_slots` > 0: a hybrid model's receiver owns `states`, a
        host `StateArea` of that many recurrent-state slots registered with the engine, which
        requests name as `dst_state` (its Register then needs a protocol-8 prefill).
        `window_kv`: the sliding layers' own pool of a sliding-window model with window pages
        (`device_kv` then holds its full layers only, `kv_geometry` names the model's
        geometry): registered too, requests name the window tail's pages in it
        (`dst_window_pages`; its Register then needs a protocol-9 prefill, docs/design.md
        §4.14)."""
        self.config = config
        self.kv_geometry = kv_geometry
        self.states: StateArea | None = (
            StateArea(state_geometry, state_slots)
            if state_geometry is not None and state_slots > 0 else None)
        self._auth = control_auth(control_key, "decode")
        self.layout = KVLayout.from_tensor(device_kv)
        self._kv = device_kv
        self.window_layout = None if window_kv is None else KVLayout.from_tensor(window_kv)
        self._window_kv = window_kv  # kept alive while the engine writes it
        self.decode_id = decode_id or f"decode-{uuid.uuid4().hex[:8]}"
        self._user_release = on_release
        self.rooms = RoomTable("decode", config.finished_rooms_kept, self._released,
                               slim=_settled, keep_bytes=config.finished_report_bytes)
        self._peers: dict[str, _Peer] = {}  # control thread only
        # Peers declared lost whose rooms still fence pages, by link id; their sockets stay
        # open so a late AbortAck / Abort from a prefill that only stalled still arrives.
        self._lost: dict[bytes, _Peer] = {}  # control thread only
        self.rejects = RejectCounter(f"decode {self.decode_id}")
        self.counters = {"bytes_received": 0, "peers_lost": 0, "abort_ack_timeouts": 0,
                         # recurrent states (`bytes_received` counts KV bytes only), and
                         # rooms whose Done reported another state than their request's
                         "state_bytes_received": 0, "states_received": 0,
                         "state_mismatches": 0,
                         "messages_in": 0, "unexpected_messages": 0,
                         "lost_peer_hold_timeouts": 0, "lost_peer_rebooted": 0,
                         "lost_peer_closed": 0,
                         "pending_pages_announced": 0, "settled_pages_announced": 0,
                         "pull_requests": 0, "pull_pages_refused": 0,  # control thread
                         "pull_pages_served": 0, "pull_pages_unavailable": 0,  # pull worker
                         "pull_pages_expired": 0,  # pull worker: past the pull's ttl
                         # marks deliveries (control thread): answered by every peer, or
                         # given up at pending_ack_timeout_s, and the answered ones' wait
                         "pending_marks_acked": 0, "pending_ack_timeouts": 0,
                         "pending_ack_seconds_total": 0.0, "pending_marks_dropped": 0}
        self._seq = itertools.count(1)
        self._pulls = PullServer(config.max_message_bytes, self._queue_pulled, self.counters)
        self._closing = threading.Event()  # close() began: pulls are refused
        # announcements whose delivery is not done (`MarksDelivery`); close() ends them all
        self._deliveries: set[MarksDelivery] = set()
        self._deliveries_lock = threading.Lock()
        self._deliveries_closed = False
        self._loop = ControlLoop("decode-transfer", _tick_s(config), self._tick)
        self.engine = None

    # ---- lifecycle -----------------------------------------------------------------------
    def start(self) -> KVReceiver:
        self.engine = create_engine(self.config)
        self.engine.register_target(self.layout.base_addr, self.layout.nbytes)
        if self.states is not None:  # before session(): NIXL's metadata lists the regions
            self.engine.register_target(self.states.base_addr, self.states.nbytes)
        if self.window_layout is not None:
            self.engine.register_target(self.window_layout.base_addr, self.window_layout.nbytes)
        self._session = self.engine.session()
        self._loop.start()
        self._pulls.start()  # the pull worker (when pulls are offered); serve_pulls is refused now
        return self

    def serve_pulls(self, source: StagedPageSource | None) -> None:
        """Answer prefill peers' `PullPages` from `source` (before `start()`, which starts the
        pull worker; RuntimeError after). Pending marks offer the pull (`PagesPending.pull`)
        only when it can be served safely: the control plane is authenticated and `source`'s
        pages carry the page MAC (both keyed by the cluster secret; without them a forged
        answer could not be told from decode's), and one page object fits in an answer frame
        (`max_message_bytes`). Otherwise every pull is answered "not available" in one frame.
        docs/design.md §4.10."""
        self._pulls.serve(source, authenticated=self._auth is not None)

    @property
    def pull_offered(self) -> bool:
        """Pending marks offer the pull (`serve_pulls`)."""
        return self._pulls.offered

    @property
    def closing(self) -> bool:
        """`close()` began: a room it aborted (code `aborted`) failed because this node is
        shutting down (the decode app answers 503 `unavailable` for it)."""
        return self._closing.is_set()

    def close(self) -> None:
        """Abort every active room (prefill is told), stop the thread, release the engine."""
        self._closing.set()  # from here `_on_pull_pages` answers "not available"
        for room in self.rooms.select(lambda r: not r.state.terminal):
            self.abort(room, "decode node shutting down")
        self._loop.call_soon(self._release_all_busy)
        self._pulls.close()  # queued pulls dropped: their prefill falls back to waiting
        self._loop.stop()
        with self._deliveries_lock:  # no answer can come now: nothing waits for one
            self._deliveries_closed = True
            left, self._deliveries = list(self._deliveries), set()
        for delivery in left:
            delivery.finish()
        if self.engine is not None:
            self.engine.close()

    # ---- node API (any thread) -----------------------------------------------------------
    def connect(self, bootstrap_addr: str, timeout_s: float | None = None) -> None:
        """Register with a prefill peer and wait for its answer (TransferError on refusal)."""
        bootstrap_addr = normalize_bootstrap(bootstrap_addr)
        timeout_s = self.config.bootstrap_timeout_s if timeout_s is None else timeout_s
        deadline = time.monotonic() + timeout_s
        created = threading.Event()
        holder: list[_Peer] = []

        def ensure() -> None:
            holder.append(self._ensure_peer(bootstrap_addr))
            created.set()

        self._loop.call_soon(ensure)
        if not created.wait(timeout_s) or not holder[0].ready.wait(deadline - time.monotonic()):
            raise TransferTimeout(-1, f"prefill {bootstrap_addr} did not answer in "
                                      f"{timeout_s}s{self._old_prefill_hint()}")
        if holder[0].error:
            raise TransferError(-1, f"prefill {bootstrap_addr} refused: {holder[0].error}")

    def request(self, room: int, bootstrap_addr: str, dst_page_ids: Any,
                num_tokens: int, first_page: int = 0, dst_state: int | None = None,
                dst_window_pages: Any = None, window_first_page: int = 0) -> None:
        """Ask the prefill peer to write this room's KV into `dst_page_ids` (non-blocking):
        the prompt's pages `first_page`, `first_page + 1`, ... (the ones before are in this
        node's prefix cache already). `dst_state`: a slot of `states` the caller holds, where
        the request's recurrent state at the end of its prefill lands (None: no state; a
        hybrid prefill then refuses the room, `state_mismatch`). `dst_window_pages` (with
        `window_kv`, required then): pages of the window pool for the sliding layers of the
        prompt's pages `window_first_page`, ... to its last (the window tail).

        From here on `on_release` will run once for the room. ValueError on bad arguments,
        DuplicateRoom if the room id is in use.
        """
        bootstrap_addr = normalize_bootstrap(bootstrap_addr)
        dst = np.asarray(dst_page_ids, dtype=np.int64).reshape(-1)
        self.layout.check_pages(dst, "destination")
        if dst.size == 0 or num_tokens < 1 or not 0 <= room < (1 << 63):
            raise ValueError(f"room {room}: need pages, tokens >= 1 and a 63-bit room id")
        if len(np.unique(dst)) != dst.size:
            raise ValueError(f"room {room}: destination pages repeat")
        if isinstance(first_page, bool) or not 0 <= first_page <= _INT32_MAX:
            raise ValueError(f"room {room}: first page {first_page!r} is not a page index")
        state_fields = self._state_destination(room, dst_state)
        window = self._window_destination(room, dst_window_pages, first_page,
                                          window_first_page, len(dst))
        data = _RecvRoom(bootstrap_addr, dst, int(num_tokens), dst_state)
        self.rooms.create(room, RoomState.BOOTSTRAPPING, self.config.room_timeout_s, data)
        request = RoomRequest(room, pack_pages(dst), int(num_tokens), int(first_page),
                              *state_fields, window, int(window_first_page) if window else 0)
        self._loop.call_soon(lambda: self._send_request(room, bootstrap_addr, request))

    def _window_destination(self, room: int, pages: Any, first_page: int,
                            window_first_page: int, num_pages: int) -> bytes:
        """The RoomRequest's `window_pages` (b"" without a window pool); ValueError for a
        window tail that does not end the prompt's pages or lies outside the pool."""
        if self.window_layout is None:
            if pages is not None:
                raise ValueError(f"room {room}: window pages without a window pool")
            return b""
        window = np.asarray([] if pages is None else pages, dtype=np.int64).reshape(-1)
        if window.size == 0:
            raise ValueError(f"room {room}: a window pool needs the window tail's pages")
        self.window_layout.check_pages(window, "window")
        if len(np.unique(window)) != window.size:
            raise ValueError(f"room {room}: window pages repeat")
        if (isinstance(window_first_page, bool) or window_first_page < first_page
                or window_first_page + window.size != first_page + num_pages):
            raise ValueError(f"room {room}: a window tail of {window.size} pages from page "
                             f"{window_first_page!r} does not end the prompt's pages")
        return pack_pages(window)

    def _old_prefill_hint(self) -> str:
        """What an unanswered Register may mean for a decode with a state area."""
        if self.states is None:
            return ""
        return (" (a prefill older than control protocol 8 drops the Register of a decode "
                "with a state area: upgrade prefill nodes first)")

    def _state_destination(self, room: int, slot: int | None) -> tuple[int, int, str]:
        """The RoomRequest's (state_offset, state_bytes, state_geometry) for `slot`."""
        if slot is None:
            return 0, 0, ""
        if self.states is None or not self.states.is_held(slot):
            raise ValueError(f"room {room}: dst_state {slot!r} is not a held slot of this "
                             "receiver's state area")
        return self.states.offset(slot), self.states.state_bytes, self.states.geometry_key

    def wait(self, room: int, timeout_s: float | None = None) -> TransferResult:
        """Block until the room's KV has landed. On failure raise TransferError; on timeout
        abort the room (prefill is told) and raise TransferTimeout."""
        current = self.rooms.get(room)
        if current is None:
            return self._finished_result(room)
        timeout_s = self.config.room_timeout_s if timeout_s is None else timeout_s
        if not current.data.done.wait(timeout_s):
            self._fail_local(room, f"no KV within {timeout_s:.3g}s", code="timeout")
            if current.data.result is None:  # else `done` won the race: the KV is there
                raise TransferTimeout(room, f"no KV within {timeout_s:.3g}s", "timeout")
        return self._result_of(room, current.data)

    def poll(self, room: int) -> RoomState:
        return self.rooms.state(room)

    def abort(self, room: int, reason: str = "aborted by decode") -> None:
        self._fail_local(room, reason, code="aborted")

    def announce_pending(self, keys: list[bytes], ttl_s: float,
                         eta_s: float = 0.0) -> MarksDelivery:
        """Tell every registered prefill peer that decode's offload will write these page
        keys to storage within `ttl_s`, expectedly in `eta_s` (0: unknown) (`PagesPending`;
        any thread, never blocks: the frames leave from the control thread). The returned
        delivery is done once each of those peers recorded the marks (a `Ping` right behind
        them was answered), was lost, or `pending_ack_timeout_s` passed. Docs: design.md
        §4.10."""
        ttl_ms = max(1, int(ttl_s * 1000))
        pull = int(self.pull_offered)
        # the expected write time only serves the pull rule: sent with the offer, so a mark
        # without one stays a version-4 frame (`wire_version`)
        eta_ms = max(1, round(eta_s * 1000)) if eta_s > 0 and pull else 0
        marks = [PagesPending(pack_keys(keys[start : start + MAX_KEYS_PER_MESSAGE]), ttl_ms,
                              eta_ms, pull)
                 for start in range(0, len(keys), MAX_KEYS_PER_MESSAGE)]
        delivery = MarksDelivery()
        with self._deliveries_lock:
            if self._deliveries_closed:
                return MarksDelivery.completed()
            self._deliveries.add(delivery)
        # first callback: counted before the answer it gates goes out
        delivery.add_done_callback(lambda: self._settle_delivery(delivery))
        self._broadcast(marks, "pending_pages_announced", len(keys), delivery)
        return delivery

    def announce_settled(self, keys: list[bytes], landed: list[bool]) -> None:
        """Tell every registered prefill peer how the write of these keys ended
        (`PagesSettled`: committed in storage, or not coming); any thread."""
        settled = []
        for start in range(0, len(keys), MAX_KEYS_PER_MESSAGE):
            chunk = keys[start : start + MAX_KEYS_PER_MESSAGE]
            flags = bytes(1 if ok else 0 for ok in landed[start : start + len(chunk)])
            settled.append(PagesSettled(pack_keys(chunk), flags))
        self._broadcast(settled, "settled_pages_announced", len(keys))

    def _broadcast(self, msgs: list[PagesPending] | list[PagesSettled], counter: str,
                   pages: int, delivery: MarksDelivery | None = None) -> None:
        def send() -> None:  # control thread: the only one touching `_peers` and sockets
            peers = [p for p in self._peers.values() if p.ready.is_set() and not p.error]
            for peer in peers:
                # sealed per peer (its own link and boot); every mark, even after a drop
                sent = [self._send_frame(peer, msg) for msg in msgs]
                if delivery is None:
                    continue
                if not all(sent):  # a mark dropped (queue full): no answer would bring it
                    self.counters["pending_marks_dropped"] += 1
                    continue
                seq = next(self._seq)  # answered once the prefill handled the marks
                delivery.expect(peer.link_id, seq)
                self._send_frame(peer, Ping(seq))
            if peers:
                self.counters[counter] += pages
            if delivery is not None:
                delivery.seal()

        self._loop.call_soon(send)

    def _settle_delivery(self, delivery: MarksDelivery) -> None:
        """A delivery is done (its first callback): forget it and count how it ended. Runs on
        the control thread, except for the deliveries close() ends, which it no longer
        holds (not counted: the counters are the control thread's)."""
        with self._deliveries_lock:
            if delivery not in self._deliveries:
                return
            self._deliveries.discard(delivery)
        if delivery.timed_out:
            self.counters["pending_ack_timeouts"] += 1
        elif delivery.answered_s is not None:
            self.counters["pending_marks_acked"] += 1
            self.counters["pending_ack_seconds_total"] += delivery.answered_s

    def _open_deliveries(self) -> list[MarksDelivery]:
        with self._deliveries_lock:
            return list(self._deliveries)

    def stats(self) -> dict[str, Any]:
        return {"rooms": self.rooms.snapshot(), "rejected": self.rejects.snapshot(),
                "peers": len(self._peers), "control_errors": self._loop.errors,
                **dict(self.counters)}

    # ---- room outcomes ---------------------------------------------------------------------
    def _result_of(self, room: int, data: _RecvRoom | _Settled) -> TransferResult:
        if data.result is not None:
            return data.result
        outcome = self.rooms.outcome(room)
        current = self.rooms.get(room)
        source = outcome or current
        reason = source.reason if source else "failed"
        code = source.code if source else ""
        if data.timed_out:
            raise TransferTimeout(room, reason, code or "timeout")
        raise TransferError(room, reason, code)

    def _finished_result(self, room: int) -> TransferResult:
        outcome = self.rooms.outcome(room)
        if outcome is None:
            raise UnknownRoom(f"decode: unknown room {room}")
        if outcome.data is not None:
            return self._result_of(room, outcome.data)
        if outcome.state is RoomState.SUCCESS:  # its report went past finished_report_bytes
            raise TransferError(room, "released earlier; its report is no longer kept",
                                "expired")
        raise TransferError(room, outcome.reason, outcome.code)

    def _finish(self, room: int, state: RoomState, reason: str = "",
                busy: bool = False, code: str = "") -> bool:
        current = self.rooms.get(room)
        changed = self.rooms.finish(room, state, reason, busy=busy, code=code)
        if current is not None:
            current.data.done.set()
        return changed

    def _fail_local(self, room: int, reason: str, code: str) -> None:
        """Decode gives up on the room: tell prefill and keep the pages until it acks."""
        current = self.rooms.get(room)
        if current is None or current.state.terminal:
            return
        current.data.failed_at = time.monotonic()
        current.data.timed_out = code == "timeout"
        if not self._finish(room, RoomState.FAILED, reason, busy=True, code=code):
            return
        abort = Abort(room, reason, code)
        self._loop.call_soon(lambda: self._send_abort(room, current.data.peer_addr, abort))

    def _released(self, outcome: Outcome) -> None:
        if self._user_release is not None:
            self._user_release(outcome)

    # ---- control thread ------------------------------------------------------------------
    def _ensure_peer(self, addr: str) -> _Peer:
        peer = self._peers.get(addr)
        if peer is not None:
            return peer
        sock = self._loop.ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.MAXMSGSIZE, 16 * self.config.max_message_bytes)
        # New per boot and per peer (control.seal); ZMQ reserves ids starting with a zero byte.
        link_id = b"d" + os.urandom(LINK_ID_BYTES - 1)
        sock.setsockopt(zmq.ROUTING_ID, link_id)
        sock.connect(addr)
        peer = _Peer(addr, sock, link_id)
        self._peers[addr] = peer
        self._loop.add_socket(sock, lambda s, p=peer: self._on_readable(p))
        peer.monitor = sock.get_monitor_socket(zmq.EVENT_CONNECTED | zmq.EVENT_DISCONNECTED)
        self._loop.add_socket(peer.monitor, lambda s, p=peer: self._on_monitor(p))
        assert self.engine is not None
        states = self.states
        register = Register(self.decode_id, self.config.engine, self._session,
                            self.layout.base_addr, self.layout.num_layers, self.layout.num_pages,
                            self.layout.page_bytes, self.layout.num_slabs, self.kv_geometry,
                            states.base_addr if states else 0, states.nbytes if states else 0,
                            *self._window_register())
        sock.send(seal(register, self._auth, link_id), zmq.NOBLOCK)
        return peer

    def _window_register(self) -> tuple[int, int, int]:
        """Register's (window_base, window_num_layers, window_num_pages); zeros: none."""
        window = self.window_layout
        if window is None:
            return 0, 0, 0
        return window.base_addr, window.num_layers, window.num_pages

    def _send_request(self, room: int, addr: str, request: RoomRequest) -> None:
        current = self.rooms.get(room)
        if current is None or current.state.terminal:
            return  # aborted before it left
        peer = self._ensure_peer(addr)
        self._send_frame(peer, request)
        current.data.request_sent = True
        if peer.ready.is_set() and not peer.error:
            self._advance(room, RoomState.WAITING_FOR_INPUT)

    def _send_abort(self, room: int, addr: str, abort: Abort) -> None:
        peer = self._peers.get(addr)
        if peer is None:
            self.rooms.set_idle(room)  # no live peer can write into the pages
            return
        self._send_frame(peer, abort)

    def _send_frame(self, peer: _Peer, msg: Message) -> bool:
        """Seal and send `msg`; authenticated, hold it until the prefill's boot id is known
        (pings are dropped instead: the RegisterAck itself shows the peer is alive). False
        when it was dropped (the socket's queue is full) or held."""
        if self._auth is not None and peer.prefill_boot is None:
            if not isinstance(msg, Ping):
                peer.held.append(msg)
            return False
        frame = seal(msg, self._auth, peer.link_id + (peer.prefill_boot or b""))
        # With auth, the boot id sealed for goes along in clear: a restarted prefill at this
        # address tells a genuine stale frame from a forgery and answers "unregistered".
        frames = [frame] if self._auth is None else [frame, peer.prefill_boot or b""]
        try:
            peer.socket.send_multipart(frames, zmq.NOBLOCK)
        except zmq.Again:
            logger.warning("decode: control queue to %s is full; message dropped", peer.addr)
            return False
        return True

    def _advance(self, room: int, new: RoomState) -> None:
        # a room failed here meanwhile (abort, lost peer) is not advanced and not counted:
        # prefill's Started or RegisterAck crossing decode's Abort is an expected race
        try:
            self.rooms.advance_unless_ended(room, new)
        except IllegalTransition:
            pass  # counted: a live room told to go back (a repeated or hostile message)

    def _on_readable(self, peer: _Peer) -> None:
        frames = peer.socket.recv_multipart()
        if len(frames) != 1:
            self.rejects.record(MessageError("malformed", f"{len(frames)} frames"), peer.addr)
            return
        msg = parse(frames[0], self.config.max_message_bytes, self.rejects, peer.addr,
                    self._auth, peer.link_id)
        if msg is None:
            return
        peer.last_seen = time.monotonic()
        self.counters["messages_in"] += 1
        handler = self._HANDLERS.get(type(msg))
        if handler is None:
            self.counters["unexpected_messages"] += 1
            self.rejects.record(MessageError("unknown_type", f"{msg.TYPE} not for decode"),
                                peer.addr)
            return
        handler(self, peer, msg)

    def _owned(self, peer: _Peer, room: int) -> _RecvRoom | None:
        current = self.rooms.get(room)
        if current is None or current.data.peer_addr != peer.addr:
            return None
        if current.data.held_for and current.data.held_for != peer.link_id:
            return None  # fenced against the lost link: only that link's answer counts
        return current.data

    def _on_register_ack(self, peer: _Peer, msg: RegisterAck) -> None:
        peer.prefill_id, peer.error = msg.prefill_id, msg.error
        if self._auth is not None and not msg.boot_id and not msg.error:
            peer.error = "prefill sent no boot id (protocol < 4): cannot authenticate to it"
        peer.prefill_boot = msg.boot_id
        self._release_rebooted(peer)
        held, peer.held = peer.held, []
        if not peer.error:
            for waiting in held:
                self._send_frame(peer, waiting)
        peer.ready.set()
        # Rooms whose request has not left yet advance when it does (`_send_request`).
        mine = self.rooms.select(lambda r: r.data.peer_addr == peer.addr
                                 and r.state is RoomState.BOOTSTRAPPING and r.data.request_sent)
        for room in mine:
            if peer.error:
                self._finish(room, RoomState.FAILED, f"prefill {peer.addr} refused: {peer.error}",
                             code="refused")
            else:
                self._advance(room, RoomState.WAITING_FOR_INPUT)
        if peer.error:
            self._drop_peer(peer)

    def _on_started(self, peer: _Peer, msg: Started) -> None:
        if self._owned(peer, msg.room) is not None:
            self._advance(msg.room, RoomState.TRANSFERRING)

    def _on_done(self, peer: _Peer, msg: Done) -> None:
        data = self._owned(peer, msg.room)
        if data is None:
            return
        current = self.rooms.get(msg.room)
        assert current is not None
        if current.state.terminal:  # failed here first (abort, lost peer): no result, but
            self.rooms.set_idle(msg.room)  # prefill's write is over, so the pages are free
            return
        if current.state is RoomState.WAITING_FOR_INPUT:
            self._advance(msg.room, RoomState.TRANSFERRING)
        mismatch = self._state_mismatch(data, msg.report)
        if mismatch:  # prefill's write is over: the pages and the slot are free at once
            self.counters["state_mismatches"] += 1
            self._finish(msg.room, RoomState.FAILED, mismatch, code="state_mismatch")
            return
        state_bytes = msg.report.state_bytes
        data.result = TransferResult(msg.room, msg.report, msg.nbytes,
                                     time.monotonic() - current.created_at,
                                     data.dst_state, state_bytes)
        if self._finish(msg.room, RoomState.SUCCESS):
            self.counters["bytes_received"] += msg.nbytes
            self.counters["state_bytes_received"] += state_bytes
            self.counters["states_received"] += int(state_bytes > 0)

    def _state_mismatch(self, data: _RecvRoom, report: PrefillReport) -> str:
        """Why the state `Done` reports is not the one the room asked for ('' when it is):
        decode's own check, behind prefill's (which refuses before writing)."""
        if data.dst_state is None:
            if report.state_bytes:
                return (f"prefill reports a recurrent state ({report.state_bytes} bytes) the "
                        "room did not ask for")
            return ""
        assert self.states is not None  # request() accepts dst_state only with an area
        wanted = (self.states.state_bytes, self.states.geometry_key)
        if (report.state_bytes, report.state_geometry) != wanted:
            return (f"prefill reports a recurrent state of {report.state_bytes} bytes of "
                    f"{report.state_geometry!r}; the room asked for {wanted[0]} bytes of "
                    f"{wanted[1]!r}")
        return ""

    def _on_abort(self, peer: _Peer, msg: Abort) -> None:
        if self._owned(peer, msg.room) is None:
            return
        # Prefill sends Abort only once its engine stopped writing: release at once.
        code = msg.code if msg.code in FAILURE_CODES else "aborted"
        if not self._finish(msg.room, RoomState.FAILED, f"aborted by prefill: {msg.reason}",
                            code=code):
            self.rooms.set_idle(msg.room)
        if msg.code == "unregistered":
            self._drop_peer(peer)  # prefill restarted: register again on the next request

    def _on_abort_ack(self, peer: _Peer, msg: AbortAck) -> None:
        if self._owned(peer, msg.room) is not None:
            self.rooms.set_idle(msg.room)

    def _on_pong(self, peer: _Peer, msg: Pong) -> None:
        # last_seen already refreshed; the pong answers every ping before it on this link
        for delivery in self._open_deliveries():
            delivery.answered(peer.link_id, msg.seq)

    def _forget_link(self, link_id: bytes) -> None:
        """A peer is dropped or lost: no delivery waits for its answer any more."""
        for delivery in self._open_deliveries():
            delivery.drop(link_id)

    def _on_pull_pages(self, peer: _Peer, msg: PullPages) -> None:
        """A registered prefill asks for staged pages: the pull worker answers (control
        thread: queue it, never block). Refused — every key "not available", one frame — when
        no pull is offered, the node is closing, or the queue is full."""
        if not peer.ready.is_set() or peer.error:
            return
        self.counters["pull_requests"] += 1
        deadline = time.monotonic() + msg.ttl_ms / 1000
        if self._closing.is_set() or not self._pulls.submit(peer, msg, deadline):
            self.counters["pull_pages_refused"] += len(msg.keys) // PAGE_KEY_BYTES
            self._send_frame(peer, unavailable(msg.pull_id, msg.key_list()))

    _HANDLERS = {RegisterAck: _on_register_ack, Started: _on_started, Done: _on_done,
                 Abort: _on_abort, AbortAck: _on_abort_ack, Pong: _on_pong,
                 PullPages: _on_pull_pages}

    # ---- pull answers --------------------------------------------------------------------
    def _queue_pulled(self, link: PullLink, answer: PagesPulled) -> None:
        """The pull worker's answer: sent from the control thread (`_send_pulled`)."""
        assert isinstance(link, _Peer)  # the only links `_on_pull_pages` submits
        self._loop.call_soon(lambda: self._send_pulled(link, answer))

    def _send_pulled(self, peer: _Peer, answer: PagesPulled) -> None:
        peer.pull_credit.release()
        if self._peers.get(peer.addr) is peer:  # control thread: still this link
            self._send_frame(peer, answer)

    def _drop_peer(self, peer: _Peer, linger_ms: int = 0) -> None:
        self._forget_link(peer.link_id)
        if self._peers.get(peer.addr) is peer:
            del self._peers[peer.addr]
            self._close_sockets(peer, linger_ms)
        peer.ready.set()

    def _close_sockets(self, peer: _Peer, linger_ms: int) -> None:
        if peer.monitor is not None:
            peer.socket.disable_monitor()
            self._loop.remove_socket(peer.monitor, 0)
            peer.monitor = None
        self._loop.remove_socket(peer.socket, linger_ms)

    def _on_monitor(self, peer: _Peer) -> None:
        from zmq.utils.monitor import recv_monitor_message

        assert peer.monitor is not None
        event = recv_monitor_message(peer.monitor, zmq.NOBLOCK)
        if event["event"] == zmq.EVENT_CONNECTED:  # (re)connected: whoever listens now
            peer.closed_by_peer = False
            return
        if event["event"] != zmq.EVENT_DISCONNECTED:
            return
        peer.closed_by_peer = True
        if peer.link_id in self._lost:
            self._release_fence(peer, "lost_peer_closed")

    def _release_fence(self, lost: _Peer, counter: str) -> None:
        """The process behind lost link `lost` is gone: its fenced pages can be reused."""
        for room in self.rooms.select(lambda r, link=lost.link_id: r.busy
                                      and r.data.held_for == link):
            self.counters[counter] += 1
            self.rooms.set_idle(room)

    def _tick(self) -> None:
        now = time.monotonic()
        # first: the only bound on an answer held for a peer that does not answer
        for delivery in self._open_deliveries():
            if now - delivery.created > self.config.pending_ack_timeout_s:
                delivery.finish(timed_out=True)
        for peer in list(self._peers.values()):
            if now - peer.last_seen > self.config.peer_dead_after_s:
                self._peer_lost(peer, now)
            elif now - peer.last_ping >= self.config.heartbeat_interval_s:
                peer.last_ping = now
                self._send_frame(peer, Ping(next(self._seq)))
        for room in self.rooms.select(lambda r: not r.state.terminal and r.deadline < now):
            self._fail_local(room, "room deadline passed", code="timeout")
        ack_limit = self.config.abort_ack_timeout_s
        for room in self.rooms.select(lambda r: r.busy and r.state.terminal
                                      and not r.data.held_for
                                      and now - r.data.failed_at > ack_limit):
            self.counters["abort_ack_timeouts"] += 1
            self.rooms.set_idle(room)
        hold_limit = self.config.lost_peer_hold_s
        for room in self.rooms.select(lambda r: r.busy and bool(r.data.held_for)
                                      and now - r.data.failed_at > hold_limit):
            self.counters["lost_peer_hold_timeouts"] += 1
            self.rooms.set_idle(room)
        self._close_unfenced_lost_peers()
        # Register again where fenced pages wait (a probe, not waiting for the next request
        # there): a RegisterAck with another boot id lifts the fence at once (`_release_rebooted`)
        for addr in {lost.addr for lost in self._lost.values()} - self._peers.keys():
            self._ensure_peer(addr)

    def _peer_lost(self, peer: _Peer, now: float) -> None:
        self.counters["peers_lost"] += 1
        self._forget_link(peer.link_id)
        silent = now - peer.last_seen
        logger.warning("decode: prefill peer %s lost (silent for %.1fs)", peer.addr, silent)
        reason = f"prefill peer {peer.addr} lost (no heartbeat for {silent:.1f}s)"
        if not peer.ready.is_set():
            peer.error = f"no answer for {silent:.1f}s{self._old_prefill_hint()}"
            reason += self._old_prefill_hint()
        mine = self.rooms.select(lambda r: r.data.peer_addr == peer.addr
                                 and not r.data.held_for)
        for room in mine:  # best effort: a peer that only stalled stops writing these pages
            self._send_frame(peer, Abort(room, reason, "timeout"))
        # Silent is not dead: a stalled prefill (SIGSTOP, a long GC or swap pause) resumes
        # the write it was in the middle of (`pdcache chaos` freeze-node found a decode
        # answer corrupted by exactly that). So the rooms fail now (their requests end) but
        # their pages stay busy — a fence — until this link's AbortAck/Abort arrives, the
        # address re-registers with another boot id (the old process is gone), or
        # lost_peer_hold_s passes. The socket stays open meanwhile to hear that answer.
        # A request that never left, or went to a peer that never answered our Register (an
        # address nobody serves; a prefill acks a Register before it can start any room of
        # ours), let no write start: such a room is released at once.
        reached = peer.ready.is_set() and not peer.error and peer.prefill_boot is not None
        fenced = False
        for room in mine:
            current = self.rooms.get(room)
            if current is None:
                continue  # released meanwhile
            fence = reached and (current.busy or current.data.request_sent)
            if fence:
                current.data.held_for = peer.link_id
                fenced = True
            if not current.state.terminal:
                current.data.failed_at = time.monotonic()
                self._finish(room, RoomState.FAILED, reason, busy=fence, code="peer_lost")
            elif current.busy and not fence:
                self.rooms.set_idle(room)  # aborted, but no write can have started
        if self._peers.get(peer.addr) is peer:
            del self._peers[peer.addr]
        peer.ready.set()
        if fenced:
            self._lost[peer.link_id] = peer
            if peer.closed_by_peer:  # it closed the connection: exited, not stalled
                self._release_fence(peer, "lost_peer_closed")
        else:
            self._close_sockets(peer, 100)

    def _release_rebooted(self, peer: _Peer) -> None:
        """`peer` registered with boot id B: a lost peer at the same address that had another
        boot id is a process that is gone; its fenced pages can be reused."""
        for lost in list(self._lost.values()):
            if lost.addr != peer.addr or lost.prefill_boot in (None, peer.prefill_boot):
                continue  # unknown boot, or the same process (it only stalled): keep the fence
            self._release_fence(lost, "lost_peer_rebooted")
        self._close_unfenced_lost_peers()

    def _close_unfenced_lost_peers(self) -> None:
        if not self._lost:
            return
        fencing = {r.data.held_for for r in (self.rooms.get(room) for room in self.rooms.select(
            lambda r: r.busy and bool(r.data.held_for))) if r is not None}
        for link_id in [link for link in self._lost if link not in fencing]:
            self._close_sockets(self._lost.pop(link_id), 0)

    def _release_all_busy(self) -> None:
        for room in self.rooms.select(lambda r: r.busy):
            self.rooms.set_idle(room)


def _tick_s(config: TransferConfig) -> float:
    return min(0.25, max(0.01, config.heartbeat_interval_s / 4))


def normalize_bootstrap(addr: str) -> str:
    """'host:port' or 'tcp://host:port' -> 'tcp://host:port'; ValueError for anything else."""
    bare = addr[len("tcp://"):] if addr.startswith("tcp://") else addr
    host, _, port = bare.rpartition(":")
    if not host or not port.isdigit() or not 0 < int(port) < 65536 or "/" in bare:
        raise ValueError(f"bootstrap address must be HOST:PORT, got {addr!r}")
    return f"tcp://{bare}"
