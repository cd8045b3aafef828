"""The global KV manager: one metadata service shared by every node using an hf3fs pool.

It owns, per pool (namespace), the SlotIndex of `metadata.py` and persists it in SQLite (WAL):
pools and committed entries are written in one transaction before the reply that made them
visible, so a restart (even after SIGKILL) keeps every committed entry. LRU recency is
persisted lazily (about once a second); after a restart the order is at most that stale.
Reservations are not persisted: a writer whose reservation was lost gets False on commit.

Protocol: ZMQ ROUTER, one msgpack map per request `{"op", "ns", ...}` -> `{"ok", "result"}`
or `{"ok": false, "error"}`. The loop is single-threaded, so the index needs no lock. It
answers every request queued at once as one batch whose changes reach the store in one
transaction before any of its replies (group commit, `handle_batch`).

Stores (`IndexStore`): SQLite under `state_dir` (one process, the default) or etcd
(`etcd_store.EtcdIndexStore`: replicas elect a leader, the others answer
`{"ok": false, "error_kind": "not_leader", "leader": ADDRESS}`).

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
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Protocol

import msgpack
import zmq

from pdcache.offload_manager.storage.config import make_private_dir
from pdcache.offload_manager.storage.lifecycle import StorageEviction
from pdcache.offload_manager.storage.metadata import (
    CLIENT_LABEL,
    METADATA_KEY_PURPOSE,
    SERVICE_LABEL,
    LostLeadership,
    SlotIndex,
    StoredPool,
    StoreUnavailable,
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
# a sanity bound on one pool (the index keeps free slots lazily: its memory follows the slots
# used, not the pool's size)
MAX_POOL_SLOTS = 1 << 40


class UnknownPool(LookupError):
    """A request named a pool nobody opened (clients reopen it and retry)."""


class SqliteJournal:
    """Collects the changes of one pool; the store flushes them in one transaction."""

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

    def reserved_slot(self, slot: int, key: bytes) -> None:
        """Reservations live in the one process only (module docstring)."""

    def released_slot(self, slot: int) -> None:
        """As reserved_slot."""

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


class IndexStore(Protocol):
    """Where a MetadataService keeps its pools: SQLite on one host, or a replicated store
    with leader election (`etcd_store.EtcdIndexStore`). Used from the service loop only."""

    kind: str

    def start(self) -> None: ...

    def serving(self) -> bool:
        """May this replica answer now (it leads, its lease is valid)?"""
        ...

    def term(self) -> int | None:
        """Changes whenever this replica (re)gains the lead; None while it does not lead."""
        ...

    def leader_hint(self) -> str: ...

    def journal(self, ns: str) -> Any: ...

    def load(self) -> list[StoredPool]: ...

    def create_pool(self, ns: str, num_slots: int, slot_bytes: int, term: int | None) -> None:
        """Persist a new pool (fenced by `term` on a replicated store)."""
        ...

    def flush(self, journals: Sequence[Any], with_touches: bool, term: int | None) -> None:
        """Persist the journals' changes (fenced by `term`, the term they were made in)."""
        ...

    def close(self) -> None: ...


class SqliteIndexStore:
    """Pools and committed entries in SQLite (WAL) under `state_dir`: the one-host default.
    Always the leader; touches are written lazily (module docstring)."""

    kind = "sqlite"

    def __init__(self, state_dir: str | Path) -> None:
        make_private_dir(Path(state_dir))  # the index
        self._db = sqlite3.connect(str(Path(state_dir) / "index.sqlite3"), isolation_level=None)
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA synchronous=NORMAL")
        self._db.executescript(_SCHEMA)
        self._seq = int(self._db.execute("SELECT COALESCE(MAX(seq), 0) FROM entries").fetchone()[0])

    def start(self) -> None:
        """Nothing to start: one process, always serving."""

    def serving(self) -> bool:
        return True

    def term(self) -> int | None:
        return 1

    def leader_hint(self) -> str:
        return ""

    def _next_seq(self) -> int:
        self._seq += 1
        return self._seq

    def journal(self, ns: str) -> SqliteJournal:
        return SqliteJournal(ns, self._next_seq)

    def load(self) -> list[StoredPool]:
        pools = []
        for ns, num_slots, slot_bytes in self._db.execute(
            "SELECT ns, num_slots, slot_bytes FROM pools"
        ).fetchall():
            rows = self._db.execute(
                "SELECT key, slot FROM entries WHERE ns = ? ORDER BY seq", (ns,)
            ).fetchall()
            pools.append(StoredPool(ns, num_slots, slot_bytes, [(bytes(k), s) for k, s in rows]))
        return pools

    def create_pool(self, ns: str, num_slots: int, slot_bytes: int, term: int | None) -> None:
        with self._db:
            self._db.execute("BEGIN")
            self._db.execute("INSERT INTO pools VALUES (?, ?, ?)", (ns, num_slots, slot_bytes))

    def flush(self, journals: Sequence[SqliteJournal], with_touches: bool,
              term: int | None = None) -> None:
        if not any(j.has_durable_changes or (with_touches and j.touches) for j in journals):
            return
        with self._db:
            self._db.execute("BEGIN")
            for journal in journals:
                journal.write(self._db, with_touches)

    def close(self) -> None:
        self._db.close()


class MetadataService:
    """Pools of key -> slot indexes, kept in an IndexStore (SQLite under `state_dir` by
    default). Not thread-safe: one loop. With a replicated store only the leading replica
    answers; the others reply `not_leader` with the leader's address."""

    def __init__(
        self,
        state_dir: str | Path | None = None,
        capacity_pages: int = 0,
        reservation_ttl_s: float = 60.0,
        eviction: StorageEviction | None = None,
        store: IndexStore | None = None,
    ) -> None:
        """`eviction`: how full pools choose their victim (`[storage] eviction`; default
        LRU); each pool gets its own lifecycle, sized by its capacity. `store`: where the
        index lives (default: SQLite under `state_dir`)."""
        if store is None:
            if state_dir is None:
                raise ValueError("a metadata service needs a state_dir or a store")
            store = SqliteIndexStore(state_dir)
        self._store = store
        self._capacity_pages = capacity_pages
        self._ttl = reservation_ttl_s
        self._eviction = eviction or StorageEviction()
        self._pools: dict[str, tuple[SlotIndex, Any, int]] = {}
        self._term: int | None = None  # the store's term our pools were loaded for
        self._last_touch_flush = time.monotonic()
        self.requests = 0
        self.not_leader = 0  # requests answered `not_leader` (standby, or lost the lead)
        self.promotions = 0  # times this replica loaded the pools as the new leader
        self.rejected: dict[str, int] = {}  # refused requests by kind (unauthenticated, ...)
        if store.kind == "sqlite":
            self._reload(store.term())

    def _new_pool(self, ns: str, num_slots: int, slot_bytes: int) -> SlotIndex:
        journal = self._store.journal(ns)
        lifecycle = self._eviction.build(num_slots, slot_bytes)
        index = SlotIndex(num_slots, self._ttl, journal=journal, lifecycle=lifecycle)
        self._pools[ns] = (index, journal, slot_bytes)
        return index

    def _reload(self, term: int | None) -> None:
        self._pools.clear()
        for pool in self._store.load():
            try:
                index = self._new_pool(pool.ns, pool.num_slots, pool.slot_bytes)
            except ValueError as exc:  # a row no index can hold: the other pools still serve
                log.error("pool %s not restored: %s", pool.ns, exc)
                continue
            index.load(pool.entries, pool.reservations)
            log.info("pool %s: %d slots, %d entries, %d reservations restored", pool.ns,
                     pool.num_slots, len(pool.entries), len(pool.reservations))
        self._term = term
        self.promotions += 1

    def drop_index(self) -> None:
        """Forget the in-memory pools: the store has the truth; the next request reloads it
        (its term differs from none)."""
        self._drop()

    def _drop(self) -> None:
        self._pools.clear()
        self._term = None

    def flush(self, with_touches: bool = True) -> None:
        """Write pending changes of every pool in one transaction (fenced on a replicated
        store: raises LostLeadership when another replica leads)."""
        self._store.flush([j for _, j, _ in self._pools.values()], with_touches, self._term)
        if with_touches:
            self._last_touch_flush = time.monotonic()

    def maybe_flush_touches(self) -> None:
        if self._term is None or time.monotonic() - self._last_touch_flush < TOUCH_FLUSH_INTERVAL_S:
            return
        try:
            self.flush(with_touches=True)
        except (LostLeadership, StoreUnavailable) as exc:
            log.warning("metadata: %s; dropping the in-memory index", exc)
            self._drop()
        except Exception as exc:  # noqa: BLE001 - a busy or failing SQLite: retried later
            # (it escaped the serve loop and ended the service: "database is locked")
            self._last_touch_flush = time.monotonic()
            log.warning("metadata: recency flush failed (%r); retried in %.0f s", exc,
                        TOUCH_FLUSH_INTERVAL_S)

    def handle(self, request: dict[str, Any]) -> dict[str, Any]:
        """Apply one request; durable changes are in the store before this returns."""
        return self.handle_batch([request])[0]

    def handle_batch(self, requests: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """Apply requests in order, then write their durable changes in one store transaction
        (group commit: one etcd round trip for every request that queued meanwhile) before
        any reply; if that write fails, none of them is acknowledged."""
        replies: list[dict[str, Any] | None] = [None] * len(requests)
        applied: list[tuple[int, Any]] = []  # (index, result), changes not yet in the store
        for i, request in enumerate(requests):
            self.requests += 1
            if request.get("op") in ("ping", "health"):
                replies[i] = {"ok": True, "result": self._dispatch(request)}
                continue
            try:
                term = self._store.term()  # None once the lease may have lapsed
                if term is None or not self._store.serving():
                    replies[i] = self._not_leader()
                    continue
                if term != self._term:
                    if applied:  # their changes belong to the state a reload replaces
                        raise LostLeadership(f"term changed to {term} within a batch")
                    self._reload(term)
                applied.append((i, self._dispatch(request)))
            except UnknownPool:
                replies[i] = {"ok": False, "error": "unknown pool"}
            except (KeyError, TypeError, ValueError) as exc:
                replies[i] = {"ok": False, "error": repr(exc)}
            except (LostLeadership, StoreUnavailable) as exc:
                # the in-memory state is dropped: whatever this batch applied goes with it
                replies[i] = lost = self._lost(exc)
                for j, _ in applied:
                    replies[j] = lost
                applied = []
        if applied:
            try:
                self.flush(with_touches=False)
            except (LostLeadership, StoreUnavailable) as exc:
                lost = self._lost(exc)
                for i, _ in applied:
                    replies[i] = lost
                applied = []
        for i, result in applied:
            replies[i] = {"ok": True, "result": result}
        return [r for r in replies if r is not None]

    def _lost(self, exc: Exception) -> dict[str, Any]:
        log.warning("metadata: %s; dropping the in-memory index", exc)
        self._drop()
        return self._not_leader(str(exc))

    def _not_leader(self, why: str = "") -> dict[str, Any]:
        self.not_leader += 1
        hint = self._store.leader_hint()
        return {"ok": False, "error_kind": "not_leader", "leader": hint,
                "error": why or (f"not the leader (the leader is {hint})" if hint
                                 else "not the leader, and no leader is elected yet")}

    def health(self) -> dict[str, Any]:
        return {"requests": self.requests, "rejected": dict(self.rejected),
                "store": self._store.kind, "leading": self._store.serving(),
                "leader": self._store.leader_hint(), "promotions": self.promotions,
                "not_leader": self.not_leader}

    def _dispatch(self, req: dict[str, Any]) -> Any:
        op = req.get("op")
        if op == "ping":
            return "pong"
        if op == "health":
            return self.health()
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
            return index.abort([bytes(k) for k in req["keys"]], list(req["slots"]),
                               bool(req.get("retire", False)))
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
        if not 1 <= num_slots <= MAX_POOL_SLOTS or slot_bytes < 1:
            raise ValueError(f"pool '{ns}': {num_slots} slots of {slot_bytes} bytes (1 to "
                             f"{MAX_POOL_SLOTS} slots of at least one byte)")
        # the index first: a pool it refuses must not reach the store, where every later
        # load (a restart, a promotion) failed on it and no pool served any more
        self._new_pool(ns, num_slots, slot_bytes)
        try:
            self._store.create_pool(ns, num_slots, slot_bytes, self._term)
        except BaseException:
            del self._pools[ns]
            raise
        log.info("pool %s created: %d slots of %d bytes", ns, num_slots, slot_bytes)
        return num_slots

    def start(self) -> None:
        """Start the store (a replicated store's leadership thread)."""
        self._store.start()

    def close(self) -> None:
        try:
            if self._term is not None:
                self.flush(with_touches=True)
        except (LostLeadership, StoreUnavailable) as exc:
            log.warning("metadata: final flush skipped: %s", exc)
        finally:
            self._store.close()


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
    # anyone who reaches the port could queue frames of any size, each hashed before its MAC
    # refused it (two of 256 MiB: +800 MB, 3.8 s): libzmq drops a larger one and its sender
    sock.setsockopt(zmq.MAXMSGSIZE, MAX_REQUEST_BYTES)
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


MAX_BATCH = 256  # requests answered per group commit
# the largest request frame: a lookup of about 490k page keys (a prompt of ~7.8M tokens at 16)
MAX_REQUEST_BYTES = 16 << 20


def _answer(service: MetadataService, sock: zmq.Socket, auth: MessageAuth | None) -> None:
    """Every request queued now (up to MAX_BATCH), applied and committed together."""
    batch: list[tuple[bytes, bytes, dict[str, Any]]] = []  # (identity, request nonce, request)
    while len(batch) < MAX_BATCH:
        try:
            frames = sock.recv_multipart(zmq.NOBLOCK)
        except zmq.Again:
            break
        identity, body = frames[0], frames[-1]
        request_nonce = nonce_of(body)  # the reply's MAC covers it: bound to this request
        if auth is not None:
            try:
                body = auth.open_(body)
            except AuthError as exc:
                _refuse(service, sock, identity, exc)
                continue
        request = _unpack(body)
        if "op" not in request and "error" in request:  # not a request: say why, sealed
            _reply(sock, identity, request, auth, request_nonce)
            continue
        batch.append((identity, request_nonce, request))
    if not batch:
        return
    try:
        replies = service.handle_batch([request for _, _, request in batch])
    except Exception as exc:  # never let one batch kill the service
        log.exception("metadata requests failed")
        service.drop_index()  # its changes may be half in the store: reload before serving
        replies = [{"ok": False, "error": f"internal error: {exc!r}"}] * len(batch)
    for (identity, request_nonce, _), reply in zip(batch, replies):
        _reply(sock, identity, reply, auth, request_nonce)


def _refuse(service: MetadataService, sock: zmq.Socket, identity: bytes, exc: AuthError) -> None:
    """An unauthenticated, stale or replayed request: counted, answered unsealed (so the
    client can say why), nothing applied."""
    service.rejected[exc.kind] = service.rejected.get(exc.kind, 0) + 1
    if sum(service.rejected.values()) <= 20:
        log.warning("metadata service: refused a request: %s", exc)
    _reply(sock, identity, {"ok": False, "error_kind": "unauthenticated", "error": str(exc)}, None)


def _unpack(body: bytes) -> dict[str, Any]:
    """The request map in `body`, or an error reply (no "op") saying what is wrong with it."""
    try:
        request = msgpack.unpackb(body, raw=False)
    except (msgpack.UnpackException, ValueError) as exc:
        return {"ok": False, "error": f"bad request: {exc!r}"}
    if not isinstance(request, dict):
        return {"ok": False, "error": "request must be a map"}
    if "op" not in request:
        return {"ok": False, "error": "request has no op"}
    return request


def _reply(sock: zmq.Socket, identity: bytes, reply: dict[str, Any], auth: MessageAuth | None,
           request_nonce: bytes = b"") -> None:
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
        etcd_endpoints: str = "",
        lease_ttl_s: int = 3,
        etcd_prefix: str = "/pdcache/metadata",
    ) -> None:
        """`etcd_endpoints` (host:port,...): a replica on the etcd store instead of SQLite."""
        self.etcd_endpoints = etcd_endpoints
        self.lease_ttl_s = lease_ttl_s
        self.etcd_prefix = etcd_prefix
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
        if self.etcd_endpoints:
            argv += ["--store", "etcd", "--etcd-endpoints", self.etcd_endpoints,
                     "--lease-ttl", str(self.lease_ttl_s), "--etcd-prefix", self.etcd_prefix]
        auth_key = None
        if self.secret_file is not None:
            argv += ["--secret-file", str(self.secret_file)]
            auth_key = metadata_key(self.secret_file)
        self.state_dir.mkdir(parents=True, exist_ok=True)
        with open(self.state_dir / f"metadata-{self.port}.log", "ab") as log_file:
            self.proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=log_file)
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
            self.proc.send_signal(signal.SIGCONT)  # a frozen service cannot handle SIGTERM
            self.proc.send_signal(signal.SIGKILL if kill else signal.SIGTERM)
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(timeout=10)
        self.proc = None

    def freeze(self) -> None:
        """SIGSTOP the service (failover tests); `thaw` resumes it."""
        if self.proc is not None:
            self.proc.send_signal(signal.SIGSTOP)

    def thaw(self) -> None:
        if self.proc is not None:
            self.proc.send_signal(signal.SIGCONT)

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
