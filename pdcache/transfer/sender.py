"""Prefill side: `KVSender` serves the bootstrap endpoint and pushes rooms' KV to decode.

Usage by the prefill node::

    sender = KVSender(config, device_kv, "127.0.0.1", port, on_release=free_pages)
    sender.start()                       # bootstrap ROUTER at sender.bootstrap_addr
    sender.send(room, src_page_ids, report)   # PrefillReport, when the room's prefill is done
    sender.send(room, src_page_ids, report, state=snapshot)   # a hybrid model's StateSnapshot
    sender.poll(room); sender.abort(room, "client gone"); sender.close()

A room meets its two halves in either order: decode's `RoomRequest` (destination pages) and
the node's `send()` (source pages, first token). When both are there, a transfer worker
writes every layer's K and V pages with the engine, then `Done` (with the node's
`PrefillReport`) goes to decode. A hybrid model's sender (`state_geometry`) also writes the
room's recurrent state (`send(..., state=)`, a `StateSnapshot`) into the state slot decode's
request names, staged through the worker's slot of a registered `StateArea`; the two sides
must agree on the state (both or neither, same geometry key and length), otherwise the room
fails `state_mismatch` before anything is written (docs/design.md §4.5).

Threads and what they mutate:
- control thread (ControlLoop): the ROUTER socket, `_peers` (under `_peers_lock`), room
  transitions caused by decode messages, heartbeat/deadline checks; sends every message.
- transfer workers: engine submit/wait; room TRANSFERRING → SUCCESS | FAILED and `busy`. A
  room given up on (abort, deadline, engine error, lost peer) turns idle only once its
  worker drained the tickets still out (`_drain`): its release tells decode it may free the
  pages, so no byte of it may land after that (docs/design.md §4.5).
- caller threads (`send`, `abort`, `poll`, `stats`): room creation/transitions via RoomTable.
`counters` are bumped by the control thread and every worker: only through `_count` (under
`_counters_lock`); `stats()` copies them under the same lock.
`on_requested(room)` runs (control thread) when decode's `RoomRequest` for a room arrived, so a
node that holds a PD request out of its compute queue until then can let it go;
`has_destination(room)` asks the same for a room the node learns about later.
`on_release(outcome)` runs once per room that `send()` accepted — on the control thread, a
worker, or the caller of abort/send — when the engine no longer reads its pages:
SUCCESS or FAILED, the node frees (or keeps in its cache) the source pages then.
"""

from __future__ import annotations

import logging
import os
import queue
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Protocol

import numpy as np
import torch
import zmq

from pdcache.engine.state_geometry import RecurrentStateGeometry
from pdcache.engine.state_pool import StateSnapshot
from pdcache.transfer.config import TransferConfig
from pdcache.transfer.control import (
    LINK_ID_BYTES,
    ControlLoop,
    RejectCounter,
    StaleBoot,
    control_auth,
    parse_from_decode,
    seal,
)
from pdcache.transfer.engines.base import EngineError, EngineTimeout, create_engine
from pdcache.transfer.layout import (
    KVLayout,
    WriteBatch,
    layer_copy_batch,
    page_copy_batch,
    window_tail_copy_batch,
)
from pdcache.transfer.messages import (
    MAX_KEYS_PER_MESSAGE,
    MAX_ROOM_ID,
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
    check_report,
    encode,
    pack_keys,
)
from pdcache.transfer.rooms import Outcome, ReleaseCallback, Room, RoomState, RoomTable
from pdcache.transfer.state_area import StateArea, check_snapshot

logger = logging.getLogger(__name__)
_WAIT_SLICE_S = 0.05  # engine waits are sliced so cancellation is seen quickly
_WINDOW = 2  # engine batches in flight per room


@dataclass
class _Peer:
    """A registered decode endpoint (one per decode process and prefill)."""

    identity: bytes
    decode_id: str
    layout: KVLayout
    engine_peer: Any
    last_seen: float = field(default_factory=time.monotonic)
    state_base: int = 0  # decode's registered state area (Register v8; 0: none)
    state_area_bytes: int = 0
    # decode's sliding layers' own pool (Register v9, window pages): `layout` then holds
    # its full layers only, and rooms write the sliding layers of their window tail here
    window_layout: KVLayout | None = None


@dataclass
class _SendRoom:
    """Prefill-side room payload (RoomTable.data)."""

    peer: bytes | None = None  # ROUTER identity of the decode peer, once it asked
    dst_pages: np.ndarray | None = None
    num_tokens: int = 0
    first_page: int = 0  # decode has the source's pages before it: they are not sent
    src_pages: np.ndarray | None = None
    report: PrefillReport = field(default_factory=lambda: PrefillReport(first_token=-1))
    state: StateSnapshot | None = None  # send()'s recurrent state, read until release
    dst_state_offset: int = 0  # decode's request: where its state goes in its state area,
    dst_state_bytes: int = 0  # how long (0: decode wants no state) and of which geometry
    dst_state_geometry: str = ""
    dst_window_pages: np.ndarray | None = None  # decode's window pool: the tail's pages,
    window_first_page: int = 0  # holding the prompt's pages from this one on
    # send()'s sliding page of each source page (-1: freed) when prefill keeps window pages
    src_window_pages: np.ndarray | None = None
    accepted: bool = False  # send() took the pages: on_release owes the node a call
    cancel: threading.Event = field(default_factory=threading.Event)
    notify_peer: str = ""  # at release: "" | "abort" | "ack"
    unsettled: bool = False  # a write was given up on without knowing it ended (_drain)
    code: str = "aborted"
    nbytes: int = 0


class PendingPagesSink(Protocol):
    """Where the pages decode announces go (the node's `PendingPages`, docs/design.md
    §4.10); called on the control thread, so it must be thread-safe and quick. `source` is
    the announcing decode link (its ROUTER identity); the sink clamps `ttl_s` to its own cap.
    `eta_s` is decode's expected time until the write lands (0: unknown), `pullable` whether
    that decode serves `request_pull` for the keys; `pulled` gets its answers to a pull."""

    def pending(self, keys: list[bytes], ttl_s: float, source: bytes = b"",
                eta_s: float = 0.0, pullable: bool = False) -> None: ...

    def pulled(self, source: bytes, pull_id: int, keys: list[bytes], found: list[bool],
               object_bytes: int, objects: bytes) -> None: ...

    def settled(self, keys: list[bytes], landed: list[bool]) -> None: ...

    def forget_source(self, source: bytes) -> int: ...


class KVSender:
    """The prefill node's end of the KV transfer; see the module docstring."""

    def __init__(self, config: TransferConfig, device_kv: torch.Tensor,
                 bind_host: str = "127.0.0.1", port: int = 0,
                 on_release: ReleaseCallback | None = None, prefill_id: str = "",
                 on_requested: Callable[[int], None] | None = None,
                 control_key: bytes | None = None,
                 on_pages: PendingPagesSink | None = None, kv_geometry: str = "",
                 state_geometry: RecurrentStateGeometry | None = None,
                 layer_kinds: tuple[str, ...] = (),
                 window_kv: torch.Tensor | None = None) -> None:
        """`control_key`: derive_key(cluster secret, "zmq-control") authenticates every
        control message (docs/security.md); None: unauthenticated (no secret). `on_pages`
        gets registered decode peers' `pages_pending` / `pages_settled` (None: ignored).
        `kv_geometry`: the pool's `KVGeometry.layout_key`; a decode that registers another
        is refused (one that sends none, an older peer, is checked by its byte counts).
        `state_geometry`: a hybrid model's recurrent state, which `send(..., state=)` then
        carries (one registered staging slot per transfer worker); None: no state.
        `layer_kinds`: the kind of each row of the pool (`KVGeometry.layer_kinds` of a
        model without linear layers); with full and sliding ones, a decode with window pages
        (its own sliding pool, Register v9) gets the full layers of every page and the
        sliding layers of each room's window tail only (docs/design.md §4.14). `window_kv`:
        this prefill keeps window pages too (`device_kv` then holds the full layers only,
        `window_kv` the sliding ones): each `send` names its pages' sliding pages
        (`window_page_ids`) and only a decode with window pages is served."""
        self.config = config
        self.kv_geometry = kv_geometry
        self.layer_kinds = tuple(layer_kinds)
        self.state_geometry = state_geometry
        self._staging: StateArea | None = None  # start(): worker i stages its room's state
        self._on_pages = on_pages
        self._auth = control_auth(control_key, "prefill")
        self._on_requested = on_requested
        self.layout = KVLayout.from_tensor(device_kv)
        self._kv = device_kv  # keeps the pool alive while the engine reads it
        # window pages here too: the sliding layers' own pool (the tails are read from it)
        self.window_layout = None if window_kv is None else KVLayout.from_tensor(window_kv)
        self._window_kv = window_kv
        self._bind_host, self._port = bind_host, port
        self.prefill_id = prefill_id or f"prefill-{uuid.uuid4().hex[:8]}"
        # New per boot: decodes bind their frames to it (RegisterAck.boot_id, control.py), so
        # a frame captured on its way to another prefill, or to this one before a restart,
        # does not open here.
        self.boot_id = os.urandom(LINK_ID_BYTES)
        self._user_release = on_release
        self.rooms = RoomTable("prefill", config.finished_rooms_kept, self._released,
                               slim=_forget_payload)
        self._peers: dict[bytes, _Peer] = {}
        self._peers_lock = threading.Lock()
        self.rejects = RejectCounter(f"prefill {self.prefill_id}")
        self.counters = {"bytes_sent": 0, "transfers": 0, "engine_errors": 0, "peers_lost": 0,
                         "messages_in": 0, "unexpected_messages": 0, "oversized_done": 0,
                         "pull_requests": 0,
                         "pages_sent": 0, "pages_decode_had": 0,  # decode's prefix cache
                         # recurrent states (`bytes_sent` counts KV bytes only), and rooms
                         # refused because the two sides disagreed on the state
                         "state_bytes_sent": 0, "states_sent": 0, "state_mismatches": 0,
                         # window pages: the sliding pages of window tails sent
                         "window_pages_sent": 0,
                         # rooms given up on before their writes were known to be over, and
                         # decode's Aborts of them left unanswered (`_drain`)
                         "unsettled_rooms": 0, "unsettled_aborts_unanswered": 0}
        self._counters_lock = threading.Lock()  # workers and the control thread count
        self._jobs: queue.Queue[int | None] = queue.Queue()
        self._workers: list[threading.Thread] = []
        self._loop = ControlLoop("prefill-bootstrap", _tick_s(config), self._tick)
        self._router: zmq.Socket | None = None
        self.engine = None
        self.bootstrap_addr = ""

    # ---- lifecycle -----------------------------------------------------------------------
    def start(self) -> KVSender:
        self.engine = create_engine(self.config)
        self.engine.register_source(self.layout.base_addr, self.layout.nbytes)
        if self.window_layout is not None:
            self.engine.register_source(self.window_layout.base_addr, self.window_layout.nbytes)
        if self.state_geometry is not None:
            self._staging = StateArea(self.state_geometry, self.config.transfer_workers)
            self.engine.register_source(self._staging.base_addr, self._staging.nbytes)
        router = self._loop.ctx.socket(zmq.ROUTER)
        router.setsockopt(zmq.LINGER, 0)
        router.setsockopt(zmq.MAXMSGSIZE, 16 * self.config.max_message_bytes)
        if self._port:
            router.bind(f"tcp://{self._bind_host}:{self._port}")
        else:
            self._port = router.bind_to_random_port(f"tcp://{self._bind_host}")
        self.bootstrap_addr = f"tcp://{self._bind_host}:{self._port}"
        self._router = router
        self._loop.add_socket(router, self._on_readable)
        self._loop.start()
        for i in range(self.config.transfer_workers):
            if self._staging is not None:
                self._staging.alloc()  # slot i, worker i's staging slot for good
            worker = threading.Thread(target=self._work, args=(i,), name=f"pdcache-kv-send-{i}",
                                      daemon=True)
            worker.start()
            self._workers.append(worker)
        return self

    def close(self) -> None:
        """Fail every active room (decode is told), stop threads, release the engine."""
        for room_id in self.rooms.select(lambda r: not r.state.terminal):
            self._fail(room_id, "prefill node shutting down", code="aborted")
        for _ in self._workers:
            self._jobs.put(None)
        for worker in self._workers:
            worker.join(timeout=5.0)
            if worker.is_alive():  # inside an engine wait bounded by the engine's own timeout
                logger.warning("prefill: transfer worker %s did not stop within 5 s",
                               worker.name)
        self._loop.stop()
        if self.engine is not None:
            self.engine.close()

    # ---- node API (any thread) -----------------------------------------------------------
    def send(self, room: int, src_page_ids: Any, report: PrefillReport,
             state: StateSnapshot | None = None,
             window_page_ids: Sequence[int | None] | None = None) -> bool:
        """Hand the room's KV (and a hybrid model's recurrent state at the end of its prefill)
        to the transfer layer; False if the room already finished.

        When True, `on_release` will run for this room once; the pages and `state.data` must
        stay untouched until then. `report` travels to decode in `Done`, its `state_bytes` /
        `state_geometry` set by the sender to the state it wrote. Raises ValueError for page
        ids outside this node's pool, a report the wire format refuses, or a state that is
        not a host snapshot of this sender's `state_geometry`. `window_page_ids` (a sender
        with `window_kv`, required then): the sliding page of each source page (None: freed;
        the window tail decode asks for must be there).
        """
        src = np.asarray(src_page_ids, dtype=np.int64).reshape(-1)
        self.layout.check_pages(src, "source")
        if src.size == 0 or not 0 <= room <= MAX_ROOM_ID:
            raise ValueError(f"send(room={room}) needs a 63-bit room id and at least one page")
        check_report(report)
        if state is not None:
            if self.state_geometry is None:
                raise ValueError("this sender carries no recurrent state (no state_geometry)")
            check_snapshot(state, self.state_geometry)
        payload = {"src_pages": src, "report": report, "state": state,
                   "src_window_pages": self._window_sources(src, window_page_ids)}
        room_state = self._attach_source(room, payload)
        if room_state is None:
            return False
        if room_state is RoomState.WAITING_FOR_INPUT:
            self._begin(room)
        return True

    def poll(self, room: int) -> RoomState:
        return self.rooms.state(room)

    def has_destination(self, room: int) -> bool:
        """Whether decode's request (its destination pages) for `room` is here."""
        current = self.rooms.get(room)
        return current is not None and current.data.dst_pages is not None

    def abort(self, room: int, reason: str = "aborted by prefill") -> None:
        """Fail the room (decode is told once the engine stopped); unknown rooms are
        remembered so decode's late request is refused."""
        if self.rooms.get(room) is None:
            self.rooms.tombstone(room, reason)
            return
        self._fail(room, reason, code="aborted")

    @property
    def authenticated(self) -> bool:
        """Every control frame is MAC'd with the cluster secret's key (pulls need it)."""
        return self._auth is not None

    def request_pull(self, source: bytes, pull_id: int, keys: list[bytes],
                     ttl_s: float) -> bool:
        """Ask decode link `source` for the staged page objects of `keys` (`PullPages`; any
        thread, never blocks), answered within `ttl_s` or not at all; False when that decode
        is not registered here. Its answers go to the sink's `pulled`. docs/design.md §4.10."""
        if self._peer(source) is None or not keys:
            return False
        ttl_ms = max(1, int(ttl_s * 1000))
        for start in range(0, len(keys), MAX_KEYS_PER_MESSAGE):
            chunk = pack_keys(keys[start : start + MAX_KEYS_PER_MESSAGE])
            self._send(source, PullPages(pull_id, chunk, ttl_ms))
        self._count("pull_requests")
        return True

    def stats(self) -> dict[str, Any]:
        with self._peers_lock:
            peers = len(self._peers)
        with self._counters_lock:
            counters = dict(self.counters)
        return {"rooms": self.rooms.snapshot(), "rejected": self.rejects.snapshot(),
                "peers": peers, "control_errors": self._loop.errors, **counters}

    def _count(self, name: str, amount: int = 1) -> None:
        with self._counters_lock:
            self.counters[name] += amount

    # ---- room assembly ---------------------------------------------------------------------
    def _attach_source(self, room: int, payload: dict) -> RoomState | None:
        """Record the source half; returns the room's state then, None if it finished."""
        def fill(r) -> RoomState | None:
            if r.data.accepted:
                return None
            r.data.src_pages = payload["src_pages"]
            r.data.report = payload["report"]
            r.data.state = payload["state"]
            r.data.src_window_pages = payload["src_window_pages"]
            r.data.accepted = True
            return r.state

        if self.rooms.get(room) is None and self.rooms.outcome(room) is None:
            data = _SendRoom(accepted=True, **payload)
            try:
                self.rooms.create(room, RoomState.BOOTSTRAPPING,
                                  self.config.bootstrap_timeout_s, data)
                return RoomState.BOOTSTRAPPING
            except ValueError:
                pass  # decode's request created it meanwhile
        return self.rooms.mutate(room, fill)

    def _begin(self, room: int) -> None:
        """Both halves present: go TRANSFERRING (busy) and queue the write."""
        def arm(r) -> None:
            r.deadline = time.monotonic() + self.config.room_timeout_s

        try:
            self.rooms.advance(room, RoomState.TRANSFERRING, busy=True, update=arm)
        except (KeyError, RuntimeError):
            return  # failed or started meanwhile
        self._jobs.put(room)

    def _fail(self, room: int, reason: str, code: str, notify: str = "abort") -> None:
        current = self.rooms.get(room)
        if current is None:
            return
        current.data.notify_peer = current.data.notify_peer or notify
        current.data.code = code
        current.data.cancel.set()
        self.rooms.finish(room, RoomState.FAILED, reason, code=code)

    def _released(self, outcome: Outcome) -> None:
        """Runs once per room when the engine is done with it: tell decode, then the node."""
        data: _SendRoom = outcome.data
        if outcome.state is RoomState.FAILED and data.peer is not None and not data.unsettled:
            if data.notify_peer == "ack":
                self._send(data.peer, AbortAck(outcome.room_id))
            elif data.notify_peer == "abort":
                self._send(data.peer, Abort(outcome.room_id, outcome.reason, data.code))
        if data.accepted and self._user_release is not None:
            self._user_release(outcome)

    # ---- transfer workers ------------------------------------------------------------------
    def _work(self, worker: int) -> None:
        while True:
            room = self._jobs.get()
            if room is None:
                return
            try:
                self._transfer(room, worker)
            except Exception as exc:  # never lose a room: fail it and keep the worker alive
                logger.exception("prefill: transfer of room %d crashed", room)
                self._fail(room, f"transfer crashed: {exc}", code="engine")
            finally:
                self.rooms.set_idle(room)

    def _transfer(self, room: int, worker: int) -> None:
        current = self.rooms.get(room)
        if current is None or current.state is not RoomState.TRANSFERRING:
            return
        data: _SendRoom = current.data
        peer = self._peer(data.peer)
        if peer is None:
            self._fail(room, "decode peer unregistered before the transfer", code="unregistered")
            return
        try:
            if data.first_page >= len(data.src_pages):
                raise ValueError(f"decode holds pages up to {data.first_page}, the prompt has "
                                 f"{len(data.src_pages)}: the last one always comes new")
            batch = self._page_batch(data, peer)
        except ValueError as exc:
            self._fail(room, f"invalid transfer: {exc}", code="invalid")
            return
        mismatch = self._state_mismatch(data)
        if mismatch:  # before any byte moves: never a silent wrong state
            self._count("state_mismatches")
            self._fail(room, mismatch, code="state_mismatch")
            return
        parts = batch.split(self.config.max_batch_entries, self.config.max_batch_bytes)
        state_batch = self._stage_state(data, peer, worker)
        if state_batch is not None:
            parts.append(state_batch)
        self._send(peer.identity, Started(room))
        error = self._write(peer, parts, current)
        if error:
            if error.startswith("engine"):
                self._count("engine_errors")
            self._fail(room, error, code="engine")
            return
        state_bytes = state_batch.nbytes if state_batch is not None else 0
        self._count("bytes_sent", batch.nbytes)
        self._count("state_bytes_sent", state_bytes)
        self._count("states_sent", int(state_batch is not None))
        self._count("pages_sent", len(data.dst_pages))
        if data.dst_window_pages is not None:
            self._count("window_pages_sent", len(data.dst_window_pages))
        self._count("pages_decode_had", data.first_page)
        self._count("transfers")
        data.nbytes = batch.nbytes
        report = replace(data.report, state_bytes=state_bytes,
                         state_geometry=data.state.geometry.key() if data.state else "")
        done = Done(room, batch.nbytes, report)
        size = len(encode(done))
        if size > self.config.max_message_bytes:  # decode would drop it and wait in vain
            self._count("oversized_done")
            self._fail(room, f"the Done message ({size} bytes, its prompt logprobs) exceeds "
                             f"the {self.config.max_message_bytes}-byte message limit",
                       code="logprobs_too_large")
            return
        self._send(peer.identity, done)
        self.rooms.finish(room, RoomState.SUCCESS, busy=False)

    def _page_batch(self, data: _SendRoom, peer: _Peer) -> WriteBatch:
        """The room's page writes: every layer of each page sent, or for a decode with
        window pages the full layers of each page and the sliding layers of its window tail
        (which must end at the prompt's last page). ValueError for pages that do not fit."""
        src = data.src_pages[data.first_page:]
        if peer.window_layout is None:
            if self.window_layout is not None:
                raise ValueError("this prefill keeps window pages: decode must too")
            return page_copy_batch(self.layout, peer.layout, src, data.dst_pages)
        window = data.dst_window_pages
        if window is None or not len(window):
            raise ValueError("decode keeps window pages and sent no window tail")
        start = data.window_first_page - data.first_page
        if start < 0 or data.window_first_page + len(window) != len(data.src_pages):
            raise ValueError(f"window tail of {len(window)} pages from page "
                             f"{data.window_first_page} does not end the prompt's "
                             f"{len(data.src_pages)} pages after decode's {data.first_page}")
        if self.window_layout is not None:
            return self._split_batch(data, peer, src, window)
        return window_tail_copy_batch(self.layout, peer.layout, peer.window_layout,
                                      self.layer_kinds, src, data.dst_pages,
                                      range(start, start + len(window)), window)

    def _split_batch(self, data: _SendRoom, peer: _Peer, src: np.ndarray,
                     window: np.ndarray) -> WriteBatch:
        """Window pages on both sides: the full layers of each page sent from this pool,
        the sliding layers of the tail from this window pool (its pages must be there)."""
        assert self.window_layout is not None and peer.window_layout is not None
        assert data.src_window_pages is not None  # send() requires them with window_kv
        tail = data.src_window_pages[data.window_first_page:]
        if (tail < 0).any():
            raise ValueError(f"the window tail from page {data.window_first_page} has freed "
                             f"sliding pages on prefill")
        full = page_copy_batch(self.layout, peer.layout, src, data.dst_pages)
        rows = range(self.window_layout.num_layers)
        sliding = layer_copy_batch(self.window_layout, rows, peer.window_layout, rows, tail,
                                   window)
        return WriteBatch(np.concatenate((full.srcs, sliding.srcs)),
                          np.concatenate((full.dsts, sliding.dsts)),
                          np.concatenate((full.lengths, sliding.lengths)))

    def _window_sources(self, src: np.ndarray,
                        window_page_ids: Sequence[int | None] | None) -> np.ndarray | None:
        """`send`'s sliding pages as an array (-1: freed); None without window pages.
        ValueError for a count that is not the pages' or pages outside the window pool."""
        if self.window_layout is None:
            if window_page_ids is not None:
                raise ValueError("this sender keeps no window pages (no window_kv)")
            return None
        if window_page_ids is None or len(window_page_ids) != src.size:
            raise ValueError("window pages: send() needs the sliding page of each page")
        ids = np.array([-1 if page is None else page for page in window_page_ids],
                       dtype=np.int64)
        self.window_layout.check_pages(ids[ids >= 0], "source window")
        return ids

    def _state_mismatch(self, data: _SendRoom) -> str:
        """Why the room's two halves disagree on its recurrent state ('' when they agree):
        decode's request (a destination of some geometry key and length, or none) against
        send()'s state. A room of a hybrid model that an older decode (protocol < 8, which
        cannot ask for a state) requested is refused here too."""
        state = data.state
        if state is None and not data.dst_state_bytes:
            return ""
        if state is None:
            return (f"decode expects a recurrent state ({data.dst_state_bytes} bytes of "
                    f"{data.dst_state_geometry!r}), this room carries none")
        key = state.geometry.key()
        if not data.dst_state_bytes:
            return (f"decode asked for no recurrent state, this room carries {state.nbytes} "
                    f"bytes of {key!r} (a decode without a state area, or older than "
                    "control protocol 8)")
        if data.dst_state_geometry != key:
            return (f"recurrent state geometry mismatch: decode {data.dst_state_geometry!r}, "
                    f"prefill {key!r}")
        if data.dst_state_bytes != state.nbytes:
            return (f"recurrent state length mismatch: decode's buffer takes "
                    f"{data.dst_state_bytes} bytes, the state is {state.nbytes}")
        return ""

    def _stage_state(self, data: _SendRoom, peer: _Peer, worker: int) -> WriteBatch | None:
        """Copy the room's state into worker `worker`'s registered staging slot and return
        the one-entry write of it to decode's state slot (None: the room has no state)."""
        if data.state is None:
            return None
        assert self._staging is not None  # send() accepts a state only with a geometry
        self._staging.write(worker, data.state)
        src = self._staging.base_addr + self._staging.offset(worker)
        dst = peer.state_base + data.dst_state_offset
        return WriteBatch(np.array([src], dtype=np.int64), np.array([dst], dtype=np.int64),
                          np.array([data.state.nbytes], dtype=np.int64))

    def _write(self, peer: _Peer, parts: list, room) -> str:
        """Submit parts with a small window; '' on success, else why it stopped. Stopped,
        the tickets still out are drained first (`_drain`): the room is released, and decode
        told it may free the pages, only once none of their bytes can land any more."""
        assert self.engine is not None
        pending: list[Any] = []
        error = ""
        try:
            for part in parts:
                if room.data.cancel.is_set():
                    break
                pending.append(self.engine.submit(peer.engine_peer, part))
                while len(pending) >= _WINDOW:
                    self._await(pending, room)
            while pending:
                self._await(pending, room)
        except _Cancelled as exc:
            error = str(exc)
        except EngineError as exc:
            error = f"engine: {exc}"
        if pending:
            self._drain(pending, room)
        return error or ("cancelled" if room.data.cancel.is_set() else "")

    def _await(self, pending: list[Any], room) -> None:
        """Wait for the oldest ticket and drop it from `pending` once it is finished (landed,
        or failed: EngineError); one still running stays there (_Cancelled)."""
        assert self.engine is not None
        while True:
            try:
                self.engine.wait(pending[0], _WAIT_SLICE_S)
            except EngineTimeout:
                if room.data.cancel.is_set() or time.monotonic() > room.deadline:
                    raise _Cancelled("cancelled" if room.data.cancel.is_set()
                                     else "transfer deadline passed") from None
                continue
            except EngineError:
                if not self.engine.write_over(pending.pop(0)):
                    self._unsettled(room)  # failed, yet its bytes may still land
                raise
            pending.pop(0)
            return

    def _drain(self, pending: list[Any], room) -> None:
        """Give up on the room's tickets still out once their writes are over (zmq: libzmq
        still delivers frames it queued, and the target copies them in), within half of
        decode's `abort_ack_timeout_s` (decode's own bound on an answer to its abort). A
        ticket not known to be over by then leaves the room *unsettled*: its release tells
        decode nothing (no Abort or AbortAck: decode's abort-ack and lost-peer rules then
        decide) and a later Abort of it is not acked (counted `unsettled_rooms`)."""
        assert self.engine is not None
        deadline = time.monotonic() + self.config.abort_ack_timeout_s / 2
        settled = [self.engine.drain(ticket, max(deadline - time.monotonic(), 0.0))
                   for ticket in pending]
        if not all(settled):
            self._unsettled(room)

    def _unsettled(self, room) -> None:
        if room.data.unsettled:
            return
        room.data.unsettled = True
        self._count("unsettled_rooms")
        logger.warning("prefill: room %d was given up on before its writes were known to be "
                       "over; decode is not told it may free the pages", room.room_id)

    # ---- control thread ------------------------------------------------------------------
    def _send(self, identity: bytes, msg: Message) -> None:
        frame = seal(msg, self._auth, link_id=identity)  # bound to that decode's socket

        def push() -> None:
            assert self._router is not None
            try:
                self._router.send_multipart([identity, frame], zmq.NOBLOCK)
            except zmq.Again:
                logger.warning("prefill: control queue to a decode peer is full; dropped %s",
                               msg.TYPE)

        self._loop.call_soon(push)

    def _on_readable(self, sock: zmq.Socket) -> None:
        frames = sock.recv_multipart()
        identity = frames[0]
        # [frame], or authenticated [sealed frame, the boot id decode sealed for]
        if len(frames) != 2 and not (len(frames) == 3 and self._auth is not None):
            self.rejects.record(MessageError("malformed", f"{len(frames) - 1} frames"), "decode")
            return
        claimed_boot = frames[2] if len(frames) == 3 else None
        msg = parse_from_decode(frames[1], self.config.max_message_bytes, self.rejects,
                                self._auth, identity, self.boot_id, claimed_boot)
        if msg is None:
            return
        if isinstance(msg, StaleBoot):
            self._on_stale_boot(identity, msg.msg)
            return
        self._count("messages_in")
        self._touch(identity)
        handler = self._HANDLERS.get(type(msg))
        if handler is None:
            self._count("unexpected_messages")
            self.rejects.record(MessageError("unknown_type", f"{msg.TYPE} not for prefill"),
                                "decode")
            return
        handler(self, identity, msg)

    def _touch(self, identity: bytes) -> None:
        with self._peers_lock:
            peer = self._peers.get(identity)
            if peer is not None:
                peer.last_seen = time.monotonic()

    def _peer(self, identity: bytes | None) -> _Peer | None:
        with self._peers_lock:
            return self._peers.get(identity) if identity is not None else None

    def _on_register(self, identity: bytes, msg: Register) -> None:
        error = self._check_register(msg)
        if not error:
            assert self.engine is not None
            try:
                engine_peer = self.engine.add_peer(msg.session)
            except EngineError as exc:
                error = str(exc)
        if not error:
            layout = KVLayout(msg.base_addr, msg.num_layers, msg.num_pages, msg.page_bytes,
                              msg.num_slabs)
            window = (KVLayout(msg.window_base, msg.window_num_layers, msg.window_num_pages,
                               msg.page_bytes, msg.num_slabs) if msg.window_base else None)
            with self._peers_lock:
                self._peers[identity] = _Peer(identity, msg.decode_id, layout, engine_peer,
                                              state_base=msg.state_base,
                                              state_area_bytes=msg.state_area_bytes,
                                              window_layout=window)
        self._send(identity, RegisterAck(self.prefill_id, error, self.boot_id))

    def _check_register(self, msg: Register) -> str:
        if msg.engine != self.config.engine:
            return f"engine mismatch: decode uses {msg.engine!r}, prefill {self.config.engine!r}"
        layers = self.layout.num_layers + (self.window_layout.num_layers
                                           if self.window_layout is not None else 0)
        ours = (layers, self.layout.num_slabs, self.layout.page_bytes)
        if self.window_layout is not None and not msg.window_base:
            return ("this prefill keeps window pages (its sliding layers' windows only): "
                    "decode must keep them too (control protocol 9)")
        if msg.window_base:
            window_error = self._check_window_register(msg)
            if window_error:
                return window_error
        if (msg.num_layers + msg.window_num_layers, msg.num_slabs, msg.page_bytes) != ours:
            return (f"KV layout mismatch: decode {msg.num_layers} layers × {msg.num_slabs} "
                    f"slabs × {msg.page_bytes} B, prefill {ours[0]} × {ours[1]} × {ours[2]} B")
        if msg.kv_geometry and self.kv_geometry and msg.kv_geometry != self.kv_geometry:
            return (f"KV geometry mismatch: decode {msg.kv_geometry!r}, "
                    f"prefill {self.kv_geometry!r}")
        if msg.num_pages < 1 or msg.base_addr == 0:
            return "decode pool is empty"
        return ""

    def _check_window_register(self, msg: Register) -> str:
        """Why a decode with a window pool cannot be served ('' when it can): its pools
        must split this pool's rows into the full and the sliding layers."""
        kinds = self.layer_kinds
        full, sliding = kinds.count("full"), kinds.count("sliding")
        if not full or not sliding or full + sliding != len(kinds):
            return ("decode keeps window pages, this prefill's layers are not full and "
                    f"sliding ones ({''.join(k[0].upper() for k in kinds) or 'unknown'})")
        if (msg.num_layers, msg.window_num_layers) != (full, sliding):
            return (f"window pages mismatch: decode {msg.num_layers} full + "
                    f"{msg.window_num_layers} sliding layers, prefill {full} + {sliding}")
        return ""

    def _on_room_request(self, identity: bytes, msg: RoomRequest) -> None:
        peer = self._peer(identity)
        if peer is None:
            self._send(identity, Abort(msg.room, "decode peer is not registered", "unregistered"))
            return
        dst = msg.page_ids()
        if dst.max() >= peer.layout.num_pages:
            self._send(identity, Abort(msg.room, "destination page out of range", "invalid"))
            return
        window = peer.window_layout
        if msg.window_pages and (window is None
                                 or msg.window_page_ids().max() >= window.num_pages):
            self._send(identity, Abort(msg.room, "window pages outside decode's registered "
                                                 "window pool", "invalid"))
            return
        if msg.state_bytes and msg.state_offset + msg.state_bytes > peer.state_area_bytes:
            self._send(identity, Abort(msg.room, "destination state buffer outside decode's "
                                                 "registered state area", "invalid"))
            return
        finished = self.rooms.outcome(msg.room)
        if finished is not None:
            self._send(identity, Abort(msg.room, f"room already {finished.state.name}: "
                                                 f"{finished.reason}", "aborted"))
            return
        self._attach_destination(identity, msg, dst)

    def _attach_destination(self, identity: bytes, msg: RoomRequest, dst: np.ndarray) -> None:
        """Record the destination half; start the transfer if the source is already there."""
        if self.rooms.get(msg.room) is None:
            data = _SendRoom(peer=identity, dst_pages=dst, num_tokens=msg.num_tokens,
                             first_page=msg.first_page)
            _set_state_destination(data, msg)
            _set_window_destination(data, msg)
            try:
                self.rooms.create(msg.room, RoomState.WAITING_FOR_INPUT,
                                  self.config.room_timeout_s, data)
                self._requested(msg.room)
                return
            except ValueError:
                pass  # send() created it meanwhile
        ready: list[bool] = []

        def fill(r) -> None:
            if r.data.dst_pages is not None:
                raise ValueError("duplicate request")
            r.data.peer, r.data.dst_pages, r.data.num_tokens = identity, dst, msg.num_tokens
            r.data.first_page = msg.first_page
            _set_state_destination(r.data, msg)
            _set_window_destination(r.data, msg)
            ready.append(r.data.accepted)

        try:
            self.rooms.advance(msg.room, RoomState.WAITING_FOR_INPUT, update=fill)
        except (KeyError, ValueError, RuntimeError):
            self.rejects.record(MessageError("bad_field", f"unexpected request for room "
                                                          f"{msg.room}"), "decode")
            return
        if ready and ready[0]:
            self._begin(msg.room)
        else:
            self._requested(msg.room)

    def _requested(self, room: int) -> None:
        if self._on_requested is None:
            return
        try:
            self._on_requested(room)
        except Exception:  # the node's callback must not break the control thread
            logger.exception("prefill: on_requested of room %d raised", room)

    def _on_abort(self, identity: bytes, msg: Abort) -> None:
        current = self.rooms.get(msg.room)
        if current is None or current.data.peer not in (None, identity):
            finished = self.rooms.outcome(msg.room)
            # slimmed once its release returned; a room still in its release is whole
            if finished is not None and (finished.data == _UNSETTLED or (
                    isinstance(finished.data, _SendRoom) and finished.data.unsettled)):
                self._count("unsettled_aborts_unanswered")  # its writes may still land
                return
            self.rooms.tombstone(msg.room, f"aborted by decode: {msg.reason}")
            self._send(identity, AbortAck(msg.room))
            return
        current.data.peer = identity
        if current.state.terminal:
            if not self.rooms.inspect(msg.room, _ack_at_release):
                self._send(identity, AbortAck(msg.room))  # released, or Done sent: no write
            return
        self._fail(msg.room, f"aborted by decode: {msg.reason}", code=msg.code, notify="ack")

    def _on_stale_boot(self, identity: bytes, msg: Message) -> None:
        """A genuine frame for an earlier boot (counted `stale_boot` by parse_from_decode):
        the decode does not know this process. Answer a room request as from an unregistered
        peer, so the decode registers again; sealed for the link, it tells a replayer nothing
        it can use. Everything else is dropped."""
        if isinstance(msg, RoomRequest):
            self._send(identity, Abort(msg.room, "decode peer is not registered (its frames "
                                                 "are for another prefill boot)", "unregistered"))

    def _on_ping(self, identity: bytes, msg: Ping) -> None:
        self._send(identity, Pong(msg.seq))

    def _on_pages_pending(self, identity: bytes, msg: PagesPending) -> None:
        peer = self._peer(identity)
        if peer is None or self._on_pages is None:
            self._count("unexpected_messages")
            return
        self._on_pages.pending(msg.key_list(), msg.ttl_ms / 1000, source=identity,
                               eta_s=msg.eta_ms / 1000, pullable=bool(msg.pull))

    def _on_pages_settled(self, identity: bytes, msg: PagesSettled) -> None:
        peer = self._peer(identity)
        if peer is None or self._on_pages is None:
            self._count("unexpected_messages")
            return
        self._on_pages.settled(msg.key_list(), msg.landed_list())

    def _on_pages_pulled(self, identity: bytes, msg: PagesPulled) -> None:
        peer = self._peer(identity)
        if peer is None or self._on_pages is None:
            self._count("unexpected_messages")
            return
        self._on_pages.pulled(identity, msg.pull_id, msg.key_list(), msg.found_list(),
                              msg.object_bytes, msg.objects)

    _HANDLERS = {Register: _on_register, RoomRequest: _on_room_request, Abort: _on_abort,
                 Ping: _on_ping, PagesPending: _on_pages_pending,
                 PagesSettled: _on_pages_settled, PagesPulled: _on_pages_pulled}

    def _tick(self) -> None:
        now = time.monotonic()
        self._drop_silent_peers(now)
        for room in self.rooms.select(lambda r: not r.state.terminal and r.deadline < now):
            current = self.rooms.get(room)
            state = current.state.name if current else "?"
            self._fail(room, f"timed out in {state}", code="timeout")

    def _drop_silent_peers(self, now: float) -> None:
        limit = self.config.peer_dead_after_s
        with self._peers_lock:
            dead = [p for p in self._peers.values() if now - p.last_seen > limit]
            for peer in dead:
                del self._peers[peer.identity]
        for peer in dead:
            self._count("peers_lost")
            logger.warning("prefill: decode peer %s lost (silent for %.1fs)", peer.decode_id,
                           now - peer.last_seen)
            for room in self.rooms.select(lambda r, i=peer.identity: r.data.peer == i
                                          and not r.state.terminal):
                self._fail(room, f"decode peer {peer.decode_id} lost (no heartbeat for "
                                 f"{limit:.1f}s)", code="peer_lost")  # heard if it lives
            if self.engine is not None:  # after the rooms' workers were told to stop
                self.engine.remove_peer(peer.engine_peer)
            if self._on_pages is not None:  # its writes will not be announced as settled
                self._on_pages.forget_source(peer.identity)


class _Cancelled(Exception):
    pass


_UNSETTLED = "unsettled"  # a remembered outcome's payload: its writes' end is not known


def _forget_payload(data: _SendRoom | None) -> tuple[str | None, int]:
    """A released prefill room's remembered outcome keeps its state, reason and code, and
    whether it is unsettled (`_drain`), only (`RoomTable` slim): a late RoomRequest, Abort
    or poll needs no more, and its pages, report and recurrent state would otherwise stay
    for `finished_rooms_kept` rooms."""
    return (_UNSETTLED if data is not None and data.unsettled else None), 0


def _ack_at_release(room: Room) -> bool:
    """Under the table's lock: a failed room whose writes are not over yet (its worker is
    draining them) answers decode's Abort at its release, never before (an AbortAck frees
    decode's pages). True when the release will answer."""
    if not room.busy or room.state is not RoomState.FAILED:
        return False
    room.data.notify_peer = room.data.notify_peer or "ack"
    return True


def _set_state_destination(data: _SendRoom, msg: RoomRequest) -> None:
    data.dst_state_offset, data.dst_state_bytes = msg.state_offset, msg.state_bytes
    data.dst_state_geometry = msg.state_geometry


def _set_window_destination(data: _SendRoom, msg: RoomRequest) -> None:
    """The window tail's sliding pages decode asked for (window pages; none: every layer)."""
    if msg.window_pages:
        data.dst_window_pages = msg.window_page_ids()
        data.window_first_page = msg.window_first_page


def _tick_s(config: TransferConfig) -> float:
    return min(0.25, max(0.01, config.heartbeat_interval_s / 4))
