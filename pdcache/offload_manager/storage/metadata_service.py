"""The global KV manager: one metadata service shared by every node using an hf3fs pool.

It owns, per pool (namespace), the SlotIndex of `metadata.py` and persists it in SQLite (WAL):
pools and committed entries are written in one transaction before the reply that made them
visible, so a restart (even after SIGKILL) keeps every committed entry. LRU recency is
persisted lazily (about once a second); after a restart the order is at most that stale.
Reservations are not persisted: a writer whose reservation was lost gets False on commit.

Protocol: ZMQ ROUTER, one msgpack map per request `{"op", "ns", ...}` -> `{"ok", "result"}`
or `{"ok": false, "error"}`. The loop is single-threaded, so the index needs no lock.

Authentication (docs/security.md): with an `auth_key` (derive_key(cluster secret,
"metadata")) every request must be sealed by `pdcache.utils.message_auth.MessageAuth` (keyed
BLAKE3 MAC, timestamp, nonce) and every reply is sealed with the request's nonce as MAC
context (`message_auth.nonce_of`), so a reply answers only the request it was made for. A
request that is unauthenticated,
stale or replayed is refused with an unsealed `{"ok": false, "error_kind":
"unauthenticated"}` (so the client can say why), counted in `MetadataService.rejected`, and
changes nothing. The `health` op reports requests served and those counts.
"""

from __future__ import annotations

import logging
import signal
import socket
import sqlite3
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgpack
import zmq

from pdcache.offload_manager.storage.lifecycle import StorageEviction
from pdcache.offload_manager.storage.metadata import (
    CLIENT_LABEL,
    METADATA_KEY_PURPOSE,
    SERVICE_LABEL,
    SlotIndex,
    ping,
)
from pdcache.utils.message_auth import AuthError, MessageAuth, nonce_of

log = logging.getLogger(__name__)

_SCHEMA = """
CREATE TABLE IF NOT EXISTS pools (ns TEXT PRIMARY KEY, num_slots INTEGER, slot_bytes INTEGER);
CREATE TABLE IF NOT EXISTS entries (
    ns TEXT, key BLOB, slot INTEGER, seq INTEGER, PRIMARY KEY (ns, key));
"""
TOUCH_FLUSH_INTERVAL_S = 1.0


class UnknownPool(LookupError):
    """A request named a pool nobody opened (clients reopen it and retry)."""


class SqliteJournal:
    """Collects the changes of one pool; the service flushes them in one transaction."""

    def __init__(self, ns: str, next_seq: Callable[[], int]) -> None:
        self.ns = ns
        self._next_seq = next_seq
        self.upserts: dict[bytes, tuple[int, int]] = {}  # key -> (slot, seq)
        self.removals: set[bytes] = set()
        self.touches: dict[bytes, int] = {}  # key -> seq

    def put(self, key: bytes, slot: int) -> None:
        self.removals.discard(key)
        self.touches.pop(key, None)
        self.upserts[key] = (slot, self._next_seq())

    def remove(self, key: bytes) -> None:
        self.upserts.pop(key, None)
        self.touches.pop(key, None)
        self.removals.add(key)

    def touch(self, key: bytes) -> None:
        self.touches[key] = self._next_seq()

    @property
    def has_durable_changes(self) -> bool:
        return bool(self.upserts or self.removals)

    def write(self, conn: sqlite3.Connection, with_touches: bool) -> None:
        conn.executemany(
            "DELETE FROM entries WHERE ns = ? AND key = ?", [(self.ns, k) for k in self.removals]
        )
        conn.executemany(
            "INSERT OR REPLACE INTO entries (ns, key, slot, seq) VALUES (?, ?, ?, ?)",
            [(self.ns, k, slot, seq) for k, (slot, seq) in self.upserts.items()],
        )
        if with_touches:
            conn.executemany(
                "UPDATE entries SET seq = ? WHERE ns = ? AND key = ?",
                [(seq, self.ns, k) for k, seq in self.touches.items()],
            )
            self.touches.clear()
        self.upserts.clear()
        self.removals.clear()


class MetadataService:
    """Pools of key -> slot indexes, persisted under `state_dir`. Not thread-safe: one loop."""

    def __init__(
        self,
        state_dir: str | Path,
        capacity_pages: int = 0,
        reservation_ttl_s: float = 60.0,
        eviction: StorageEviction | None = None,
    ) -> None:
        """`eviction`: how full pools choose their victim (`[storage] eviction`; default
        LRU); each pool gets its own lifecycle, sized by its capacity."""
        Path(state_dir).mkdir(parents=True, exist_ok=True)
        self._db = sqlite3.connect(str(Path(state_dir) / "index.sqlite3"), isolation_level=None)
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA synchronous=NORMAL")
        self._db.executescript(_SCHEMA)
        self._capacity_pages = capacity_pages
        self._ttl = reservation_ttl_s
        self._eviction = eviction or StorageEviction()
        self._seq = int(self._db.execute("SELECT COALESCE(MAX(seq), 0) FROM entries").fetchone()[0])
        self._pools: dict[str, tuple[SlotIndex, SqliteJournal, int]] = {}
        self._last_touch_flush = time.monotonic()
        self.requests = 0
        self.rejected: dict[str, int] = {}  # refused requests by kind (unauthenticated, ...)
        self._load()

    def _next_seq(self) -> int:
        self._seq += 1
        return self._seq

    def _new_pool(self, ns: str, num_slots: int, slot_bytes: int) -> SlotIndex:
        journal = SqliteJournal(ns, self._next_seq)
        lifecycle = self._eviction.build(num_slots, slot_bytes)
        index = SlotIndex(num_slots, self._ttl, journal=journal, lifecycle=lifecycle)
        self._pools[ns] = (index, journal, slot_bytes)
        return index

    def _load(self) -> None:
        pools = self._db.execute("SELECT ns, num_slots, slot_bytes FROM pools").fetchall()
        for ns, num_slots, slot_bytes in pools:
            rows = self._db.execute(
                "SELECT key, slot FROM entries WHERE ns = ? ORDER BY seq", (ns,)
            ).fetchall()
            self._new_pool(ns, num_slots, slot_bytes).load((bytes(k), s) for k, s in rows)
            log.info("pool %s: %d slots, %d entries restored", ns, num_slots, len(rows))

    def flush(self, with_touches: bool = True) -> None:
        """Write pending changes of every pool in one transaction."""
        journals = [j for _, j, _ in self._pools.values()]
        if not any(j.has_durable_changes or (with_touches and j.touches) for j in journals):
            return
        with self._db:
            self._db.execute("BEGIN")
            for journal in journals:
                journal.write(self._db, with_touches)
        if with_touches:
            self._last_touch_flush = time.monotonic()

    def maybe_flush_touches(self) -> None:
        if time.monotonic() - self._last_touch_flush >= TOUCH_FLUSH_INTERVAL_S:
            self.flush(with_touches=True)

    def handle(self, request: dict[str, Any]) -> dict[str, Any]:
        """Apply one request; durable changes are on disk before this returns."""
        self.requests += 1
        try:
            result = self._dispatch(request)
        except UnknownPool:
            return {"ok": False, "error": "unknown pool"}
        except (KeyError, TypeError, ValueError) as exc:
            return {"ok": False, "error": repr(exc)}
        self.flush(with_touches=False)
        return {"ok": True, "result": result}

    def _dispatch(self, req: dict[str, Any]) -> Any:
        op = req.get("op")
        if op == "ping":
            return "pong"
        if op == "health":
            return {"requests": self.requests, "rejected": dict(self.rejected)}
        if op == "open":
            return self._open(str(req["ns"]), int(req["slots"]), int(req["slot_bytes"]))
        index = self._index(req.get("ns"))
        if op in ("lookup", "exists_prefix", "delete"):
            return getattr(index, op)([bytes(k) for k in req["keys"]])
        if op == "reserve":
            return index.reserve([bytes(k) for k in req["keys"]], str(req.get("session", "")))
        if op == "commit":
            keys, slots = [bytes(k) for k in req["keys"]], list(req["slots"])
            return index.commit(keys, slots, str(req.get("session", "")))
        if op == "abort":
            return index.abort([bytes(k) for k in req["keys"]], list(req["slots"]))
        if op == "end_session":
            return index.end_session(str(req["session"]))
        if op in ("entries", "stats", "clear"):
            return getattr(index, op)()
        raise ValueError(f"unknown op {op!r}")

    def _index(self, ns: Any) -> SlotIndex:
        pool = self._pools.get(str(ns))
        if pool is None:
            raise UnknownPool(str(ns))
        return pool[0]

    def _open(self, ns: str, slots: int, slot_bytes: int) -> int:
        existing = self._pools.get(ns)
        if existing is not None:
            index, _, known_bytes = existing
            if known_bytes != slot_bytes:
                raise ValueError(
                    f"pool '{ns}' has {known_bytes}-byte slots, the client uses {slot_bytes}"
                )
            return index.num_slots
        num_slots = min(slots, self._capacity_pages) if self._capacity_pages else slots
        self._new_pool(ns, num_slots, slot_bytes)
        with self._db:
            self._db.execute("BEGIN")
            self._db.execute("INSERT INTO pools VALUES (?, ?, ?)", (ns, num_slots, slot_bytes))
        log.info("pool %s created: %d slots of %d bytes", ns, num_slots, slot_bytes)
        return num_slots

    def close(self) -> None:
        try:
            self.flush(with_touches=True)
        finally:
            self._db.close()


def serve(
    service: MetadataService,
    address: str,
    stop: threading.Event,
    on_ready: Callable[[str], None] | None = None,
    auth_key: bytes | None = None,
) -> None:
    """Answer requests on `address` (a ZMQ ROUTER) until `stop` is set; with `auth_key` only
    authenticated ones (module docstring)."""
    auth = None if auth_key is None else MessageAuth(auth_key, SERVICE_LABEL, CLIENT_LABEL)
    ctx = zmq.Context.instance()
    sock = ctx.socket(zmq.ROUTER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.bind(address)
    bound = sock.getsockopt_string(zmq.LAST_ENDPOINT)
    if on_ready:
        on_ready(bound)
    try:
        while not stop.is_set():
            if sock.poll(200, zmq.POLLIN):
                _answer(service, sock, auth)
            service.maybe_flush_touches()
    finally:
        sock.close(linger=0)


def _answer(service: MetadataService, sock: zmq.Socket, auth: MessageAuth | None) -> None:
    frames = sock.recv_multipart()
    identity, body = frames[0], frames[-1]
    request_nonce = nonce_of(body)  # the reply's MAC covers it: bound to this request
    if auth is not None:
        try:
            body = auth.open_(body)
        except AuthError as exc:
            service.rejected[exc.kind] = service.rejected.get(exc.kind, 0) + 1
            if sum(service.rejected.values()) <= 20:
                log.warning("metadata service: refused a request: %s", exc)
            refusal = {"ok": False, "error_kind": "unauthenticated", "error": str(exc)}
            sock.send_multipart([identity, b"", msgpack.packb(refusal, use_bin_type=True)])
            return
    try:
        request = msgpack.unpackb(body, raw=False)
        reply = (
            service.handle(request)
            if isinstance(request, dict)
            else {"ok": False, "error": "request must be a map"}
        )
    except (msgpack.UnpackException, ValueError) as exc:
        reply = {"ok": False, "error": f"bad request: {exc!r}"}
    except Exception as exc:  # never let one request kill the service
        log.exception("metadata request failed")
        reply = {"ok": False, "error": f"internal error: {exc!r}"}
    packed = msgpack.packb(reply, use_bin_type=True)
    sealed = packed if auth is None else auth.seal(packed, context=request_nonce)
    sock.send_multipart([identity, b"", sealed])


class LocalMetadataService:
    """`pdcache metadata-server` as a child process on loopback (tests, benchmarks, launchers).

    stop() sends SIGTERM (a clean shutdown) or, with kill=True, SIGKILL; it always reaps.
    start() after stop() restarts it on the same port and state directory.
    """

    def __init__(
        self,
        state_dir: str | Path,
        port: int = 0,
        capacity_pages: int = 0,
        secret_file: str | Path | None = None,
        eviction: StorageEviction | None = None,
    ) -> None:
        self.state_dir = Path(state_dir)
        self.eviction = eviction or StorageEviction()
        self.secret_file = secret_file
        self.port = port or _free_port()
        self.capacity_pages = capacity_pages
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def address(self) -> str:
        return f"tcp://127.0.0.1:{self.port}"

    def start(self, timeout_s: float = 20.0) -> LocalMetadataService:
        argv = [
            sys.executable,
            "-m",
            "pdcache",
            "metadata-server",
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            "--state-dir",
            str(self.state_dir),
            "--capacity-pages",
            str(self.capacity_pages),
            "--log-level",
            "WARNING",
            *self.eviction.server_argv(),
        ]
        auth_key = None
        if self.secret_file is not None:
            argv += ["--secret-file", str(self.secret_file)]
            auth_key = metadata_key(self.secret_file)
        self.proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"metadata-server exited with {self.proc.returncode}")
            if ping(self.address, timeout_s=0.2, auth_key=auth_key):
                return self
        self.stop(kill=True)
        raise TimeoutError(f"metadata-server not ready on {self.address} after {timeout_s}s")

    def stop(self, kill: bool = False) -> None:
        if self.proc is None:
            return
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL if kill else signal.SIGTERM)
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(timeout=10)
        self.proc = None

    def __enter__(self) -> LocalMetadataService:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def metadata_key(secret_file: str | Path) -> bytes:
    """The metadata service's key from a cluster secret file."""
    from pdcache.utils.secret import derive_key, load_secret

    return derive_key(load_secret(secret_file), METADATA_KEY_PURPOSE)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]
