"""`zmq` engine: the bytes travel over a ZeroMQ socket and the target copies them into place.

Needs no dependency beyond pyzmq. Target side: a ROUTER bound on `config.local_host` (random
port) served by one thread, which checks every destination range against the registered
regions, copies each frame with memmove and acks the batch. Initiator side: one DEALER per
peer; source pages are sent zero-copy (libzmq reads them until the ack, which is why the
room's pages stay busy until wait() returns).

Limit: a cancelled ticket cannot be recalled — libzmq still delivers frames it queued (the
socket is shared by every room of that peer), and the target copies them in and acks them.
So a sender that gives up on a room `drain`s its tickets (waits for their acks, bounded)
before it tells decode the room is over: an ack means the target's memmove is done, and no
later byte of that batch comes. A ticket whose peer socket was closed (`remove_peer`, a
lost peer) is not known to be over: frames already handed to the kernel may still arrive.
"""

from __future__ import annotations

import ctypes
import itertools
import logging
import threading
import time
from dataclasses import dataclass, field

import msgpack
import numpy as np
import zmq

from pdcache.transfer.config import TransferConfig
from pdcache.transfer.engines.base import EngineError, EngineTimeout, KVTransferEngine
from pdcache.transfer.layout import WriteBatch

logger = logging.getLogger(__name__)
_POLL_MS = 100


@dataclass
class _Peer:
    address: str
    socket: zmq.Socket
    lock: threading.Lock = field(default_factory=threading.Lock)
    results: dict[int, str] = field(default_factory=dict)  # batch id → "" or error
    abandoned: set[int] = field(default_factory=set)
    closed: bool = False  # remove_peer closed the socket: unacked batches have no known end


@dataclass(frozen=True)
class _Ticket:
    peer: _Peer
    batch_id: int


class ZmqEngine(KVTransferEngine):
    """See the module docstring. Thread-safe: each peer socket is used under its own lock."""

    name = "zmq"

    def __init__(self, config: TransferConfig) -> None:
        super().__init__(config)
        self._ctx = zmq.Context.instance()
        self._regions: list[tuple[int, int]] = []
        self._server: zmq.Socket | None = None
        self._address = ""
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self._ids = itertools.count(1)
        self._peers: list[_Peer] = []
        self.counters = {"batches_served": 0, "bytes_served": 0, "batches_rejected": 0}

    # ---- target side -----------------------------------------------------------------------
    def session(self) -> bytes:
        if not self._address:
            raise EngineError("zmq engine: register_target() before session()")
        return self._address.encode()

    def register_target(self, addr: int, nbytes: int) -> None:
        self._regions.append((addr, addr + nbytes))
        if self._server is None:
            self._start_server()

    def register_source(self, addr: int, nbytes: int) -> None:
        pass  # libzmq reads any readable memory; nothing to pin on CPU

    def _start_server(self) -> None:
        sock = self._ctx.socket(zmq.ROUTER)
        sock.setsockopt(zmq.LINGER, 0)
        port = sock.bind_to_random_port(f"tcp://{self.config.local_host}")
        self._server, self._address = sock, f"tcp://{self.config.local_host}:{port}"
        self._thread = threading.Thread(target=self._serve, name="zmq-engine-target",
                                        daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        assert self._server is not None
        while not self._stop.is_set():
            try:
                if self._server.poll(_POLL_MS):
                    self._serve_one(self._server.recv_multipart(copy=False))
            except zmq.ContextTerminated:
                return
            except Exception:  # keep serving: one bad batch must not stop the engine
                logger.exception("zmq engine: serving a batch failed")

    def _serve_one(self, frames: list[zmq.Frame]) -> None:
        assert self._server is not None
        identity, header, payload = frames[0], frames[1], frames[2:]
        batch_id, error = -1, ""
        try:
            head = msgpack.unpackb(header.bytes, raw=False)
            batch_id = int(head["b"])
            dsts = np.frombuffer(head["d"], dtype="<i8")
            self._copy_in(dsts, payload)
            self.counters["batches_served"] += 1
        except Exception as exc:
            error = f"target rejected batch: {exc}"
            self.counters["batches_rejected"] += 1
        self._server.send_multipart([identity.bytes, msgpack.packb({"b": batch_id, "e": error})])

    def _copy_in(self, dsts: np.ndarray, payload: list[zmq.Frame]) -> None:
        if len(dsts) != len(payload):
            raise ValueError(f"{len(dsts)} destinations for {len(payload)} frames")
        sizes = [len(f.buffer) for f in payload]
        for dst, size in zip(dsts.tolist(), sizes):
            self._check_range(dst, size)
        for dst, frame, size in zip(dsts.tolist(), payload, sizes):
            src = np.frombuffer(frame.buffer, dtype=np.uint8)
            ctypes.memmove(dst, src.ctypes.data, size)
        self.counters["bytes_served"] += sum(sizes)

    def _check_range(self, addr: int, size: int) -> None:
        if not any(lo <= addr and addr + size <= hi for lo, hi in self._regions):
            raise ValueError(f"range [{addr:#x}, +{size}) is outside every registered region")

    # ---- initiator side ----------------------------------------------------------------------
    def add_peer(self, session: bytes) -> _Peer:
        address = session.decode()
        if not address.startswith("tcp://"):
            raise EngineError(f"zmq engine: bad peer session {address!r}")
        peer = _Peer(address, self._connect(address))
        self._peers.append(peer)
        return peer

    def remove_peer(self, peer: _Peer) -> None:
        with peer.lock:
            peer.closed = True
            peer.socket.close(linger=0)
        if peer in self._peers:
            self._peers.remove(peer)

    def _connect(self, address: str) -> zmq.Socket:
        sock = self._ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(address)
        return sock

    def submit(self, peer: _Peer, batch: WriteBatch) -> _Ticket:
        batch_id = next(self._ids)
        header = msgpack.packb({"b": batch_id, "d": batch.dsts.astype("<i8").tobytes()})
        frames: list[object] = [header]
        for src, length in zip(batch.srcs.tolist(), batch.lengths.tolist()):
            frames.append((ctypes.c_char * length).from_address(src))
        with peer.lock:
            try:
                peer.socket.send_multipart(frames, copy=False)
            except zmq.ZMQError as exc:
                raise EngineError(f"zmq engine → {peer.address}: send failed ({exc})") from exc
        return _Ticket(peer, batch_id)

    def wait(self, ticket: _Ticket, timeout_s: float) -> None:
        peer, deadline = ticket.peer, time.monotonic() + timeout_s
        while True:
            with peer.lock:
                if ticket.batch_id in peer.results:
                    error = peer.results.pop(ticket.batch_id)
                    if error:
                        raise EngineError(f"zmq engine → {peer.address}: {error}")
                    return
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise EngineTimeout(f"zmq engine → {peer.address}: no ack in {timeout_s:.3g}s")
                try:
                    self._drain_acks(peer, min(remaining, 0.05))
                except zmq.ZMQError as exc:
                    raise EngineError(f"zmq engine → {peer.address}: {exc}") from exc

    def _drain_acks(self, peer: _Peer, timeout_s: float) -> None:
        """Called with peer.lock held."""
        if not peer.socket.poll(int(timeout_s * 1000) + 1):
            return
        while True:
            try:
                raw = peer.socket.recv(zmq.NOBLOCK)
            except zmq.Again:
                return
            ack = msgpack.unpackb(raw, raw=False)
            if ack["b"] in peer.abandoned:
                peer.abandoned.discard(ack["b"])
            else:
                peer.results[ack["b"]] = ack["e"]

    def write_over(self, ticket: _Ticket) -> bool:
        """A target's rejection is the end of the batch (it copies nothing of it then); a
        closed socket is not: its frames in the kernel's buffers may still arrive."""
        return not ticket.peer.closed

    def cancel(self, ticket: _Ticket) -> None:
        peer = ticket.peer
        with peer.lock:
            if peer.results.pop(ticket.batch_id, None) is None:
                peer.abandoned.add(ticket.batch_id)  # its late ack is dropped

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=2.0)
            self._thread = None
        if self._server is not None:
            self._server.close(linger=0)
            self._server = None
        for peer in list(self._peers):
            self.remove_peer(peer)
