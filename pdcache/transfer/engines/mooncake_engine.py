"""`mooncake` engine: Mooncake TransferEngine, one-sided batched writes into the peer's memory.

Protocol and devices come from the config: `tcp` with P2P handshakes on a laptop (no etcd),
`rdma` + NIC names on a cluster — same code. Batches are already coalesced into contiguous
runs by the caller and split to at most `max_batch_entries` entries (Mooncake's TCP lanes
reject more than ~2048 queued transfers per peer).

Mooncake's completion call (`get_batch_transfer_status`) blocks until the batch finished or
its own transfer timeout (`MC_TRANSFER_TIMEOUT`, from `room_timeout_s` unless already set) —
so `wait()` may overrun its `timeout_s` by that much, and `cancel()` cannot recall writes:
it reaps the batch, blocking until it ended, which is also what `drain()` is.
That block is per peer: one spinning status call at a time per peer session (`_spin_lock`),
never one for the whole process, so a stalled decode (SIGSTOP, a dead link) holds up only the
waits for batches to that decode, not every transfer of the prefill node.
That call also busy-spins a core until the batch ends, which on a small machine takes the core
from the engine thread that should be computing the next prompt (measured on 2 cores: the
prefill node's TTFT under load 0.20 s against 0.10 s with the zmq engine). So `wait()` first
sleeps through most of the batch's expected duration — its bytes at the rate measured over
that peer's recent batches (`_RateEstimate`), minus the time the link has been busy with it —
and spins only for the rest; a wait slice that ends before the batch is expected sleeps the
slice and raises EngineTimeout without spinning; until a rate is measured it spins at once.

Settings Mooncake reads only from the environment: its Python API (`initialize(hostname,
metadata_server, protocol, device_names)`) takes protocol and devices, but the TCP bind
address, transfer timeout, queue depth and log level are read with getenv() by the library
itself (its global config and TCP transport, at engine initialisation). `MooncakeEngine` never
writes them; `MooncakeEngine.environment(config, os.environ)` computes them from the
TransferConfig and the process entry point sets them once, before Mooncake loads:
MC_TCP_BIND_ADDRESS (`tcp_bind_address`, default the node's host: the data socket otherwise
binds every interface), MC_LOG_LEVEL (`mooncake_log_level`), MC_TRANSFER_TIMEOUT,
MC_TCP_MAX_QUEUED_TRANSFERS_PER_PEER (room for the batches our workers keep in flight).
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from pdcache.transfer.config import TransferConfig
from pdcache.transfer.engines.base import EngineError, EngineTimeout, KVTransferEngine
from pdcache.transfer.layout import WriteBatch
from pdcache.utils.registry import import_optional

_PACKAGE = "mooncake-transfer-engine-non-cuda"
logger = logging.getLogger(__name__)


def _load_engine_class():
    module = import_optional("mooncake.engine", "transfer engine 'mooncake'", _PACKAGE)
    return module.TransferEngine


@dataclass
class _Ticket:
    session: str
    batch_ids: list[int]
    nbytes: int
    done: bool = False
    submitted: float = 0.0  # time.monotonic() at submit


class _RateEstimate:
    """Bytes per second of one peer's recent batches, for how long `wait()` may sleep before
    it spins. A batch is timed from when the link was free for it (its submit, or the previous
    batch to that peer completing, whichever is later) to its completion, so a batch queued
    behind another is not taken for a slow link. Only batches of at least `MIN_BYTES` teach it
    (small ones measure the round trip, not the rate). A faster batch is believed at once and
    a slower one only a fifth of the way: an over-estimated rate makes a wait sleep too little
    and spin the rest (no latency), an under-estimated one would make it oversleep. Guarded by
    its own lock (waiters on several threads)."""

    MIN_BYTES = 256 << 10
    SLEEP_SHARE = 0.8  # of the expected time left: the rest is spun, so a jittery batch costs no latency

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._bytes_per_s = 0.0  # 0: not measured yet
        self._link_free_at = 0.0  # when the last batch to this peer completed

    def sleep_s(self, nbytes: int, submitted: float, now: float) -> float:
        """How long a wait for a batch of `nbytes` submitted at `submitted` may sleep now."""
        with self._lock:
            rate, free_at = self._bytes_per_s, self._link_free_at
        if rate <= 0.0 or nbytes < self.MIN_BYTES:
            return 0.0
        began = max(submitted, free_at)
        return max(self.SLEEP_SHARE * nbytes / rate - max(now - began, 0.0), 0.0)

    def observe(self, nbytes: int, submitted: float, completed: float) -> None:
        with self._lock:
            began = max(submitted, self._link_free_at)
            self._link_free_at = max(self._link_free_at, completed)
            duration = completed - began
            if nbytes < self.MIN_BYTES or duration <= 0.0:
                return
            measured, current = nbytes / duration, self._bytes_per_s
            if current <= 0.0 or measured > current:
                self._bytes_per_s = measured
            else:
                self._bytes_per_s = current + 0.2 * (measured - current)


class MooncakeEngine(KVTransferEngine):
    """See the module docstring. Mooncake's Python API is thread-safe for these calls."""

    name = "mooncake"

    @classmethod
    def environment(cls, config: TransferConfig, inherited: Mapping[str, str]) -> dict[str, str]:
        """What the process must set for Mooncake (module docstring); an inherited value wins,
        except a loopback bind address when this node's own address is not loopback (a
        multi-host node must not listen on 127.0.0.1)."""
        # Mooncake's TCP lanes reject more than ~2048 queued entries per peer; our workers keep
        # up to transfer_workers × 2 batches of max_batch_entries in flight per peer.
        queued = max(8192, 4 * config.transfer_workers * config.max_batch_entries)
        wanted = {"MC_LOG_LEVEL": config.mooncake_log_level,
                  "MC_TRANSFER_TIMEOUT": str(math.ceil(config.room_timeout_s)),
                  "MC_TCP_MAX_QUEUED_TRANSFERS_PER_PEER": str(queued)}
        out = {key: value for key, value in wanted.items() if key not in inherited}
        bind = config.tcp_bind_address or config.local_host
        current = inherited.get("MC_TCP_BIND_ADDRESS")
        if config.protocol == "tcp" and (
                current is None or (current.startswith("127.") and not bind.startswith("127."))):
            out["MC_TCP_BIND_ADDRESS"] = bind
        return out

    def __init__(self, config: TransferConfig) -> None:
        super().__init__(config)
        self._engine = _load_engine_class()()  # None once closed (close())
        rc = self._engine.initialize(config.local_host, config.metadata_server, config.protocol,
                                     config.device_names)
        if rc != 0:
            raise EngineError(
                f"mooncake: initialize({config.local_host!r}, {config.metadata_server!r}, "
                f"{config.protocol!r}, {config.device_names!r}) failed with {rc}")
        self._session = f"{config.local_host}:{self._engine.get_rpc_port()}"
        self._registered: list[int] = []
        self._lock = threading.Lock()
        # get_batch_transfer_status busy-spins a core until the batch ends; one spinning waiter
        # per peer at a time keeps Mooncake's own transfer threads fed on small machines. Per
        # peer, not one for the process: the call blocks until the batch ends or
        # MC_TRANSFER_TIMEOUT, so a stalled peer would hold every other peer's waits behind it.
        self._spin_locks: dict[str, threading.Lock] = {}  # per peer session, under self._lock
        self._rates: dict[str, _RateEstimate] = {}  # per peer session, under self._lock
        self._closed = False

    def _live(self) -> Any:  # mooncake.engine.TransferEngine
        engine = self._engine
        if engine is None:
            raise EngineError("mooncake: the engine is closed")
        return engine

    def _rate_of(self, session: str) -> _RateEstimate:
        with self._lock:
            return self._rates.setdefault(session, _RateEstimate())

    def _spin_lock(self, session: str) -> threading.Lock:
        """The lock a status call to peer `session` spins under (kept for the engine's life:
        a waiter may still hold the one of a removed peer)."""
        with self._lock:
            return self._spin_locks.setdefault(session, threading.Lock())

    def session(self) -> bytes:
        return self._session.encode()

    def register_target(self, addr: int, nbytes: int) -> None:
        self._register(addr, nbytes)

    def register_source(self, addr: int, nbytes: int) -> None:
        self._register(addr, nbytes)

    def _register(self, addr: int, nbytes: int) -> None:
        rc = self._live().register_memory(addr, nbytes)
        if rc != 0:
            raise EngineError(f"mooncake: register_memory({addr:#x}, {nbytes}) failed with {rc}")
        with self._lock:
            self._registered.append(addr)

    def add_peer(self, session: bytes) -> str:
        """Connects to the peer now, off the caller's thread (the sender's control thread:
        a handshake to a decode whose transfer port does not answer would stall every
        peer's control messages until it timed out). Thread: one short-lived daemon per
        peer (`pdcache-mc-connect`), ended with the handshake; not joined at close: it holds
        its own engine reference, as a straggling worker does."""
        peer = session.decode()
        threading.Thread(target=self._open_segment, args=(peer,), name="pdcache-mc-connect",
                         daemon=True).start()
        return peer

    def _open_segment(self, peer: str) -> None:
        """Connect to `peer` now (Mooncake's P2P handshake), with an empty batch. Mooncake
        connects on a peer's first write and holds its binding's one process-wide mutex
        across that handshake: a decode that stalled between its Register and its first
        write (SIGSTOP) held every other peer's submits until the handshake timed out. Here
        the peer has just registered, so it answers; on failure the first write tries again."""
        engine = self._live()
        try:
            batch_id = engine.batch_transfer_async_write(peer, [], [], [])
            if batch_id > 0:
                engine.get_batch_transfer_status([batch_id])  # empty: returns at once
        except Exception:  # noqa: BLE001 - the first write connects (and reports) instead
            logger.debug("mooncake: connecting to %s ahead of its first write failed", peer,
                         exc_info=True)

    def remove_peer(self, peer: str) -> None:
        with self._lock:
            self._rates.pop(peer, None)

    def submit(self, peer: str, batch: WriteBatch) -> _Ticket:
        batch_ids: list[int] = []
        limit = self.config.max_batch_entries
        for start in range(0, len(batch), limit):
            stop = start + limit
            batch_id = self._live().batch_transfer_async_write(
                peer, batch.srcs[start:stop].tolist(), batch.dsts[start:stop].tolist(),
                batch.lengths[start:stop].tolist())
            if batch_id <= 0:
                if batch_ids:
                    self._live().get_batch_transfer_status(batch_ids)  # reap what started
                raise EngineError(f"mooncake → {peer}: submitting a batch failed ({batch_id})")
            batch_ids.append(batch_id)
        return _Ticket(peer, batch_ids, batch.nbytes, submitted=time.monotonic())

    def wait(self, ticket: _Ticket, timeout_s: float) -> None:
        if ticket.done:
            raise EngineError("mooncake: ticket already completed")
        rate = self._rate_of(ticket.session)
        nap = rate.sleep_s(ticket.nbytes, ticket.submitted, time.monotonic())
        if nap >= timeout_s:  # still far from done: no spin this slice, the ticket stays valid
            time.sleep(max(timeout_s, 0.0))
            raise EngineTimeout(f"mooncake → {ticket.session}: batch expected in {nap:.3f}s")
        if nap > 0.0:
            time.sleep(nap)
        spin = self._spin_lock(ticket.session)
        if not spin.acquire(timeout=max(timeout_s - nap, 0.0)):
            raise EngineTimeout(f"mooncake → {ticket.session}: another wait for this peer is "
                                "in progress")
        try:
            ticket.done = True  # the status call frees Mooncake's batch descriptors either way
            rc = self._live().get_batch_transfer_status(ticket.batch_ids)
        finally:
            spin.release()
        if rc == 0:
            rate.observe(ticket.nbytes, ticket.submitted, time.monotonic())
        if rc != 0:
            raise EngineError(
                f"mooncake → {ticket.session}: batch write of {ticket.nbytes} bytes failed "
                f"({rc}); the peer may be dead or the destination unregistered")

    def cancel(self, ticket: _Ticket) -> None:
        if ticket.done:
            return
        ticket.done = True
        engine = self._engine
        if engine is None:  # closed: the batch went with the engine (a worker past close())
            return
        with self._spin_lock(ticket.session):
            engine.get_batch_transfer_status(ticket.batch_ids)

    def drain(self, ticket: _Ticket, timeout_s: float) -> bool:
        """Mooncake cannot recall a batch: reap it (`cancel`), which returns once the batch
        ended or Mooncake's own transfer timeout passed, so it may overrun `timeout_s` as
        `wait` does; the batch is over either way."""
        self.cancel(ticket)
        return True

    def close(self) -> None:
        """Unregister our memory and destroy Mooncake's TransferEngine now, on this thread.

        Its C++ destructor holds the GIL about a second per engine (measured: 1.0 s, every
        other Python thread of the process stops meanwhile). Left to the garbage collector
        (the sender and receiver sit in reference cycles) it ran at whatever allocation
        triggered the next collection: in the test suite, seconds into a later test, where
        every control thread missed its heartbeats at once. Dropping our reference here makes
        that stall part of close(), where the caller expects to wait. A worker still inside
        a Mooncake call (its wait outlived the sender's bounded join) holds its own reference:
        the destructor then runs when that call returns, and its later calls fail "closed"
        (cancel returns quietly)."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            registered, self._registered = self._registered, []
            engine, self._engine = self._engine, None
        for addr in registered:
            engine.unregister_memory(addr)
        # a straggling worker still inside a Mooncake call holds its own reference; otherwise
        # ours is the last and the destructor runs when `engine` goes with this frame
        del engine
