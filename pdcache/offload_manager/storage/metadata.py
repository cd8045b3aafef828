"""Key -> slot metadata of the hf3fs backend: the index core, in-process and remote clients.

Writes are two-phase: `reserve` hands out a slot (evicting the least recently used committed
page when the pool is full, never a reserved one), the writer fills the slot, then `commit`
publishes key -> slot. Readers `lookup` committed slots only. A reservation that is neither
committed nor aborted within its TTL is reclaimed, so a crashed writer leaks nothing.
A reader racing with the eviction of its slot reads another page's header or a torn payload;
the page header (key + checksum) turns that into a miss, never wrong KV.

With a `SessionLifecycle` (`[storage] eviction = "session"`, storage.lifecycle) the page a
full pool evicts is the lifecycle's instead of the least recently used: writes carry the
session (`reserve`/`commit(..., session=SID)`), closed sessions' pages go first.

Accounting invariant, per pool: free + used + reserved + retired == capacity (and, with a
lifecycle, its groups hold exactly the committed keys). A *retired* slot is one a write found
unwritable because the file system is full (hf3fs data files are sparse: a slot gets its
blocks on its first write): never handed out again while the index lives, so the pool shrinks
to what the file system holds and evicts from there (it handed the same unwritable slot out
again and again before, and stopped storing anything for good). Free slots are kept lazily: the
slots from `_fresh` on were never handed out, `_free` holds the ones given back.
"""

from __future__ import annotations

import logging
import threading
import time
from abc import ABC, abstractmethod
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from dataclasses import field as dc_field
from typing import Any, Protocol

import msgpack
import zmq

from pdcache.offload_manager.storage.lifecycle import SessionLifecycle
from pdcache.utils.message_auth import AuthError, MessageAuth, nonce_of

log = logging.getLogger(__name__)

# RemoteMetadata: the longest fail-fast window after rounds of failures (it doubles from the
# retry interval), and how long a lookup waits for another call in flight before it misses
MAX_DOWN_S = 30.0
LOOKUP_LOCK_WAIT_S = 0.5

# reserve() statuses
NEW = "new"  # write the page into the returned slot, then commit or abort
PRESENT = "present"  # already committed: skip
BUSY = "busy"  # another writer holds a reservation for this key: skip
FULL = "full"  # no slot could be freed: the write fails

Reservation = tuple[str, int]  # (status, slot or -1)


class MetadataUnavailable(RuntimeError):
    """The metadata service did not answer in time (or recently failed); callers miss."""


class MetadataAuthError(MetadataUnavailable):
    """The metadata service refused this client's credential (another cluster secret, or
    none), or answered without one. Raised by the RemoteMetadata constructor when the service
    is reachable; later calls raise it like any unavailability (a miss)."""


class StoreUnavailable(RuntimeError):
    """A replicated index store did not answer in time (every member tried once)."""


class LostLeadership(RuntimeError):
    """A fenced write failed: another metadata replica leads now (or our lease expired)."""


METADATA_KEY_PURPOSE = "metadata"  # derive_key(secret, METADATA_KEY_PURPOSE) -> auth_key
CLIENT_LABEL, SERVICE_LABEL = b"metadata-client", b"metadata-service"


def client_auth(auth_key: bytes | None) -> MessageAuth | None:
    """The client's sealer, None without a key."""
    if auth_key is None:
        return None
    return MessageAuth(auth_key, CLIENT_LABEL, SERVICE_LABEL)


class Journal(Protocol):
    """Receives every change of an index, so a service can persist it."""

    def put(self, key: bytes, slot: int) -> None: ...

    def remove(self, key: bytes) -> None: ...

    def touch(self, key: bytes) -> None: ...

    def reserved_slot(self, slot: int, key: bytes) -> None:
        """A writer holds `slot` for `key` (a replicated store keeps it across a failover)."""

    def released_slot(self, slot: int) -> None:
        """The reservation of `slot` ended (committed, aborted or expired)."""


@dataclass(frozen=True)
class StoredPool:
    """One pool as an index store hands it to a (re)starting or promoted service."""

    ns: str
    num_slots: int
    slot_bytes: int
    entries: list[tuple[bytes, int]]  # LRU (or commit) order, oldest first
    reservations: list[tuple[int, bytes]] = dc_field(default_factory=list)  # (slot, key)


class SlotIndex:
    """One pool's key -> slot map with LRU order and reservations. Not thread-safe: the owner
    holds a lock (InProcMetadata) or runs it on one thread (the metadata service)."""

    def __init__(
        self,
        num_slots: int,
        reservation_ttl_s: float = 60.0,
        journal: Journal | None = None,
        clock: Callable[[], float] = time.monotonic,
        lifecycle: SessionLifecycle | None = None,
    ) -> None:
        if num_slots <= 0:
            raise ValueError(f"a pool needs at least one slot, got {num_slots}")
        self.num_slots = num_slots
        self._ttl = reservation_ttl_s
        self._journal = journal
        self._clock = clock
        self._committed: OrderedDict[bytes, int] = OrderedDict()  # LRU first
        self._reserved: dict[int, tuple[bytes, float]] = {}  # slot -> (key, deadline)
        self._reserved_keys: dict[bytes, int] = {}
        self._free: list[int] = []  # slots given back (LIFO); beside every one from `_fresh` on
        self._fresh = 0  # slots never handed out: a billion-slot pool costs no list up front
        self.retired = 0  # slots given back unwritable (a full file system): never handed out
        self._lifecycle = lifecycle
        self.evictions = 0
        self.expired_reservations = 0

    def load(
        self,
        entries: Iterable[tuple[bytes, int]],
        reservations: Iterable[tuple[int, bytes]] = (),
    ) -> None:
        """Add committed entries (LRU first), e.g. from a persisted index or a header scan,
        and reservations (slot, key) a previous leader handed out: each is held a full TTL
        from now, so its writer can still commit and nobody else gets its slot.

        Two keys claiming one slot: the later one holds it (the slot's bytes are the last
        write's). A leader whose flush went out as several fenced transactions and lost its
        leadership between them left a new key's commit in etcd without the delete of the
        key the slot held before: that older key then read another page."""
        by_slot: dict[int, bytes] = {}
        for key, slot in entries:
            if 0 <= slot < self.num_slots and key not in self._committed:
                older = by_slot.get(slot)
                if older is not None:
                    del self._committed[older]
                self._committed[key] = slot
                by_slot[slot] = key
        taken = set(by_slot)
        if self._lifecycle is not None:
            for key in by_slot.values():
                self._lifecycle.touched(key)  # no session known after a restart
        deadline = self._clock() + self._ttl
        for slot, key in reservations:
            if 0 <= slot < self.num_slots and slot not in taken and key not in self._reserved_keys:
                self._reserved[slot] = (key, deadline)
                self._reserved_keys[key] = slot
                taken.add(slot)
        self._fresh = max(taken) + 1 if taken else 0
        self._free = [s for s in range(self._fresh - 1, -1, -1) if s not in taken]

    def lookup(self, keys: Sequence[bytes]) -> list[int | None]:
        slots = [self._committed.get(k) for k in keys]
        for key, slot in zip(keys, slots):
            if slot is not None:
                self._touch(key)
                if self._lifecycle is not None:
                    self._lifecycle.touched(key)
        return slots

    def exists_prefix(self, keys: Sequence[bytes]) -> int:
        count = 0
        for key in keys:
            if key not in self._committed:
                break
            count += 1
        return count

    def reserve(self, keys: Sequence[bytes], session: str = "") -> list[Reservation]:
        """`session`: the conversation writing them; a PRESENT key is refreshed for it."""
        return [self._reserve_one(k, session) for k in keys]

    def commit(self, keys: Sequence[bytes], slots: Sequence[int], session: str = "") -> list[bool]:
        return [self._commit_one(k, s, session) for k, s in zip(keys, slots)]

    def abort(self, keys: Sequence[bytes], slots: Sequence[int], retire: bool = False) -> None:
        """The writes of `keys` into their reserved `slots` failed: the slots are free again,
        or, with `retire` (the file system had no room for them), never handed out again."""
        for key, slot in zip(keys, slots):
            if self._reserved.get(slot, (None,))[0] == key:
                self._release_reservation(slot)
                if retire:
                    self.retired += 1
                else:
                    self._free.append(slot)

    def delete(self, keys: Sequence[bytes]) -> list[int]:
        freed = []
        for key in keys:
            slot = self._committed.pop(key, None)
            if slot is not None:
                self._free.append(slot)
                freed.append(slot)
                if self._lifecycle is not None:
                    self._lifecycle.removed(key)
                if self._journal:
                    self._journal.remove(key)
        return freed

    def clear(self) -> None:
        self.delete(list(self._committed))

    def entries(self) -> list[tuple[bytes, int]]:
        return list(self._committed.items())

    def stats(self) -> dict[str, int]:
        out = {
            "capacity_pages": self.num_slots,
            "used_pages": len(self._committed),
            "reserved_pages": len(self._reserved),
            "free_pages": self._num_free,
            "retired_pages": self.retired,
            "evictions": self.evictions,
            "expired_reservations": self.expired_reservations,
        }
        if self._lifecycle is not None:
            out.update({f"lifecycle_{k}": v for k, v in self._lifecycle.stats().items()})
        return out

    def end_session(self, session: str) -> None:
        """The conversation is over: its pages are evicted first (no-op without a lifecycle)."""
        if self._lifecycle is not None:
            self._lifecycle.end_session(session)

    # internals

    def _touch(self, key: bytes) -> None:
        self._committed.move_to_end(key)
        if self._journal:
            self._journal.touch(key)

    def _reserve_one(self, key: bytes, session: str = "") -> Reservation:
        if key in self._committed:
            self._touch(key)
            if self._lifecycle is not None:
                self._lifecycle.stored(key, session)
            return PRESENT, -1
        held = self._reserved_keys.get(key)
        if held is not None and self._reserved[held][1] > self._clock():
            return BUSY, -1
        if held is not None:
            self._expire(held)
        slot = self._take_slot()
        if slot is None:
            return FULL, -1
        self._reserved[slot] = (key, self._clock() + self._ttl)
        self._reserved_keys[key] = slot
        if self._journal:
            self._journal.reserved_slot(slot, key)
        return NEW, slot

    @property
    def _num_free(self) -> int:
        return len(self._free) + self.num_slots - self._fresh

    def _take_slot(self) -> int | None:
        if not self._num_free:
            self._reclaim_expired()
        if not self._num_free and self._committed:
            if self._lifecycle is not None:
                key = self._lifecycle.evict()
                assert key is not None, "the lifecycle lost committed pages"
                slot = self._committed.pop(key)
            else:
                key, slot = self._committed.popitem(last=False)
            self.evictions += 1
            if self._journal:
                self._journal.remove(key)
            return slot
        if self._free:
            return self._free.pop()
        if self._fresh < self.num_slots:
            self._fresh += 1
            return self._fresh - 1
        return None

    def _reclaim_expired(self) -> None:
        now = self._clock()
        for slot in [s for s, (_, deadline) in self._reserved.items() if deadline <= now]:
            self._expire(slot)

    def _expire(self, slot: int) -> None:
        self._release_reservation(slot)
        self._free.append(slot)
        self.expired_reservations += 1

    def _release_reservation(self, slot: int) -> None:
        key, _ = self._reserved.pop(slot)
        self._reserved_keys.pop(key, None)
        if self._journal:
            self._journal.released_slot(slot)

    def _commit_one(self, key: bytes, slot: int, session: str = "") -> bool:
        if self._reserved.get(slot, (None,))[0] != key:
            return False  # expired and reclaimed, or never reserved
        self._release_reservation(slot)
        self._committed[key] = slot
        if self._lifecycle is not None:
            self._lifecycle.stored(key, session)
        if self._journal:
            self._journal.put(key, slot)
        return True


class MetadataClient(ABC):
    """What the hf3fs backend needs from its metadata. Thread-safe. Remote implementations
    raise MetadataUnavailable when the service does not answer within the configured timeout."""

    num_slots: int

    @abstractmethod
    def lookup(self, keys: Sequence[bytes]) -> list[int | None]: ...

    @abstractmethod
    def exists_prefix(self, keys: Sequence[bytes]) -> int: ...

    @abstractmethod
    def reserve(self, keys: Sequence[bytes], session: str = "") -> list[Reservation]: ...

    @abstractmethod
    def commit(
        self, keys: Sequence[bytes], slots: Sequence[int], session: str = ""
    ) -> list[bool]: ...

    @abstractmethod
    def abort(self, keys: Sequence[bytes], slots: Sequence[int],
              retire: bool = False) -> None: ...

    @abstractmethod
    def delete(self, keys: Sequence[bytes]) -> list[int]: ...

    @abstractmethod
    def entries(self) -> list[tuple[bytes, int]]: ...

    @abstractmethod
    def clear(self) -> None: ...

    @abstractmethod
    def stats(self) -> dict[str, int]: ...

    def end_session(self, session: str) -> None:  # noqa: B027 - optional (plain LRU: no-op)
        """The conversation is over: its pages are evicted first (`SlotIndex.end_session`)."""

    def close(self) -> None:  # noqa: B027 - the in-process index holds no connection
        """Release connections. Idempotent."""


class InProcMetadata(MetadataClient):
    """The index in this process, behind one lock."""

    def __init__(
        self,
        num_slots: int,
        reservation_ttl_s: float = 60.0,
        lifecycle: SessionLifecycle | None = None,
    ) -> None:
        self._index = SlotIndex(num_slots, reservation_ttl_s, lifecycle=lifecycle)
        self._lock = threading.Lock()
        self.num_slots = num_slots

    def _locked(self, method: str, *args: Any) -> Any:
        with self._lock:
            return getattr(self._index, method)(*args)

    def load(self, entries: Iterable[tuple[bytes, int]]) -> None:
        self._locked("load", list(entries))

    def lookup(self, keys: Sequence[bytes]) -> list[int | None]:
        return self._locked("lookup", keys)

    def exists_prefix(self, keys: Sequence[bytes]) -> int:
        return self._locked("exists_prefix", keys)

    def reserve(self, keys: Sequence[bytes], session: str = "") -> list[Reservation]:
        return self._locked("reserve", keys, session)

    def commit(self, keys: Sequence[bytes], slots: Sequence[int], session: str = "") -> list[bool]:
        return self._locked("commit", keys, slots, session)

    def abort(self, keys: Sequence[bytes], slots: Sequence[int], retire: bool = False) -> None:
        self._locked("abort", keys, slots, retire)

    def delete(self, keys: Sequence[bytes]) -> list[int]:
        return self._locked("delete", keys)

    def entries(self) -> list[tuple[bytes, int]]:
        return self._locked("entries")

    def clear(self) -> None:
        self._locked("clear")

    def stats(self) -> dict[str, int]:
        return self._locked("stats")

    def end_session(self, session: str) -> None:
        self._locked("end_session", session)


class RemoteMetadata(MetadataClient):
    """Client of `pdcache metadata-server` (ZMQ REQ, msgpack). One request at a time per client
    (a lock); every request has a deadline of `timeout_s`. After a failure the client fails fast
    for `retry_interval_s`, then tries again, so a dead service costs callers at most one
    timeout per interval and a restarted one is picked up without any action. The interval
    doubles with every round of failures, up to `MAX_DOWN_S` (back to `retry_interval_s` on a
    success): a frozen service kept its callers blocked 5 s of every 6 (the timeout, then one
    interval of failing fast), and every node's engine with them. A lookup (the engine
    thread's) waits for another call in flight at most `LOOKUP_LOCK_WAIT_S`, then misses.

    `address` may list several replicas, comma-separated (`[storage] metadata`): a replica that
    does not lead answers `not_leader` with the leader's address and the client follows it (at
    most one hop per replica); a replica that times out sends the next call to the next one.
    While no replica leads (an election), calls raise MetadataUnavailable at once: a miss for
    readers, a skipped write for writers, never a wait."""

    def __init__(
        self,
        address: str,
        namespace: str,
        num_slots: int,
        slot_bytes: int,
        timeout_s: float = 5.0,
        retry_interval_s: float = 1.0,
        auth_key: bytes | None = None,
    ) -> None:
        """`auth_key`: derive_key(cluster secret, "metadata"); every request and reply is then
        sealed (docs/security.md). None: the service must run without a secret too."""
        self.addresses = [a.strip() for a in address.split(",") if a.strip()]
        if not self.addresses:
            raise ValueError("no metadata service address given")
        self._current = 0
        self._auth = client_auth(auth_key)
        self.namespace = namespace
        self.num_slots = num_slots
        self._slot_bytes = slot_bytes
        self._timeout_ms = max(1, int(timeout_s * 1000))
        self._retry_interval_s = retry_interval_s
        self._down_for_s = retry_interval_s  # the next fail-fast window (doubles, capped)
        self._ctx = zmq.Context.instance()
        self._sock: zmq.Socket | None = None
        self._lock = threading.Lock()
        self._down_until = 0.0
        self._timeouts_in_row = 0
        self._opened = False
        self._closed = False
        self.failures = 0
        self.redirects = 0  # not_leader answers followed to the leader
        try:
            self._call("ping")
        except MetadataAuthError:
            self.close()
            raise
        except MetadataUnavailable:
            log.warning("metadata service %s not reachable yet; will retry", address)
        except ValueError:
            self.close()
            raise

    @property
    def address(self) -> str:
        """The replica this client talks to now."""
        return self.addresses[self._current]

    def _socket(self) -> zmq.Socket:
        if self._sock is None:
            sock = self._ctx.socket(zmq.REQ)
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.RCVTIMEO, self._timeout_ms)
            sock.setsockopt(zmq.SNDTIMEO, self._timeout_ms)
            sock.connect(self.address)
            self._sock = sock
        return self._sock

    def _drop_socket(self) -> None:
        if self._sock is not None:
            self._sock.close(linger=0)
            self._sock = None

    def _switch_to(self, address: str) -> None:
        if address not in self.addresses:
            self.addresses.append(address)  # the leader advertises itself; follow it
        self._current = self.addresses.index(address)
        self._drop_socket()

    def _roundtrip(self, request: dict[str, Any]) -> dict[str, Any]:
        sock = self._socket()
        sealed = _seal(self._auth, msgpack.packb(request, use_bin_type=True))
        try:
            sock.send(sealed)
            raw = sock.recv()
        except zmq.ZMQError as exc:
            # A REQ socket that timed out cannot send again: start a fresh one next time, on
            # the next replica; once every replica failed in a row, fail fast for a while.
            failed = self.address
            self._drop_socket()
            self.failures += 1
            self._timeouts_in_row += 1
            self._current = (self._current + 1) % len(self.addresses)
            if self._timeouts_in_row >= len(self.addresses):
                self._down_until = time.monotonic() + self._down_for_s
                self._down_for_s = min(2 * self._down_for_s,
                                       max(MAX_DOWN_S, self._retry_interval_s))
            raise MetadataUnavailable(f"metadata service {failed}: {exc}") from exc
        self._timeouts_in_row = 0
        self._down_for_s = self._retry_interval_s
        return self._open_reply(raw, nonce_of(sealed) if self._auth is not None else b"")

    def _request(self, request: dict[str, Any]) -> dict[str, Any]:
        """One request, following `not_leader` answers to the leader they name."""
        for _ in range(len(self.addresses) + 1):
            asked = self.address
            reply = self._roundtrip(request)
            if reply.get("error_kind") != "not_leader":
                return reply
            leader = str(reply.get("leader") or "")
            if not leader or leader == asked:
                # an election is under way (or this replica's hint is stale): the caller
                # misses now, and its next call asks the next replica
                self._current = (self._current + 1) % len(self.addresses)
                self._drop_socket()
                break
            self.redirects += 1
            self._switch_to(leader)
        raise MetadataUnavailable(f"metadata service {asked}: {reply.get('error')}")

    def _open_reply(self, raw: bytes, request_nonce: bytes = b"") -> dict[str, Any]:
        """The reply to the request whose nonce is `request_nonce`: with a key, a reply sealed
        for any other request does not verify (MetadataAuthError)."""
        if self._auth is not None:
            try:
                raw = self._auth.open_(raw, context=request_nonce)
            except AuthError as exc:
                raise MetadataAuthError(self._refusal(raw, exc)) from None
        try:
            reply = msgpack.unpackb(raw, raw=False)
        except (msgpack.UnpackException, ValueError):
            reply = None
        if not isinstance(reply, dict):
            raise MetadataAuthError(
                f"metadata service {self.address} sent an unreadable reply "
                "(it may require the cluster secret: configure one)"
            )
        if reply.get("error_kind") == "unauthenticated":
            raise MetadataAuthError(
                f"metadata service {self.address} refused this client: "
                f"{reply.get('error')} (configure the cluster secret)"
            )
        return reply

    def _refusal(self, raw: bytes, exc: Exception) -> str:
        try:
            reply = msgpack.unpackb(raw, raw=False)
        except (msgpack.UnpackException, ValueError):
            reply = None
        if isinstance(reply, dict) and reply.get("error_kind") == "unauthenticated":
            return (
                f"metadata service {self.address} refused this client's credential "
                f"({reply.get('error')}): is this node on another cluster secret?"
            )
        return (
            f"metadata service {self.address} answered without a valid credential ({exc}): "
            "it runs without the cluster secret or with another one, or the reply was made "
            "for another request"
        )

    def _open_pool(self) -> None:
        reply = self._request(
            {
                "op": "open",
                "ns": self.namespace,
                "slots": self.num_slots,
                "slot_bytes": self._slot_bytes,
            }
        )
        if not reply.get("ok"):
            raise ValueError(f"metadata service refused pool '{self.namespace}': {reply}")
        self.num_slots = int(reply["result"])
        self._opened = True

    def _call(self, op: str, lock_wait_s: float | None = None, **args: Any) -> Any:
        """`lock_wait_s`: how long to wait for another call in flight (None: as long as it
        takes, at most its timeout); past it MetadataUnavailable."""
        if not self._lock.acquire(timeout=-1 if lock_wait_s is None else lock_wait_s):
            raise MetadataUnavailable(f"metadata service {self.address}: another call has "
                                      f"waited on it for over {lock_wait_s} s")
        try:
            if self._closed:
                raise MetadataUnavailable("metadata client is closed")
            if time.monotonic() < self._down_until:
                raise MetadataUnavailable(f"metadata service {self.address} recently failed")
            if not self._opened:
                self._open_pool()
            reply = self._request({"op": op, "ns": self.namespace, **args})
            if not reply.get("ok") and reply.get("error") == "unknown pool":
                self._open_pool()  # the service lost the pool (fresh state dir): recreate
                reply = self._request({"op": op, "ns": self.namespace, **args})
        finally:
            self._lock.release()
        if not reply.get("ok"):
            raise MetadataUnavailable(f"metadata service error on {op}: {reply.get('error')}")
        return reply.get("result")

    def lookup(self, keys: Sequence[bytes]) -> list[int | None]:
        return list(self._call("lookup", LOOKUP_LOCK_WAIT_S, keys=list(keys)))

    def exists_prefix(self, keys: Sequence[bytes]) -> int:
        return int(self._call("exists_prefix", LOOKUP_LOCK_WAIT_S, keys=list(keys)))

    def reserve(self, keys: Sequence[bytes], session: str = "") -> list[Reservation]:
        extra = {"session": session} if session else {}  # older services take no session
        reply = self._call("reserve", keys=list(keys), **extra)
        return [(str(s), int(slot)) for s, slot in reply]

    def commit(self, keys: Sequence[bytes], slots: Sequence[int], session: str = "") -> list[bool]:
        extra = {"session": session} if session else {}
        reply = self._call("commit", keys=list(keys), slots=list(slots), **extra)
        return [bool(x) for x in reply]

    def abort(self, keys: Sequence[bytes], slots: Sequence[int], retire: bool = False) -> None:
        # a service that predates `retire` ignores it: the slots are freed, as they were
        extra = {"retire": True} if retire else {}
        self._call("abort", keys=list(keys), slots=list(slots), **extra)

    def delete(self, keys: Sequence[bytes]) -> list[int]:
        return list(self._call("delete", keys=list(keys)))

    def entries(self) -> list[tuple[bytes, int]]:
        return [(bytes(k), int(s)) for k, s in self._call("entries")]

    def clear(self) -> None:
        self._call("clear")

    def stats(self) -> dict[str, int]:
        return dict(self._call("stats"))

    def end_session(self, session: str) -> None:
        self._call("end_session", session=session)

    def health(self) -> dict[str, Any]:
        """The service's own counters: requests served, refused requests by kind."""
        return dict(self._call("health"))

    def ping(self) -> bool:
        try:
            self._call("ping")
        except MetadataUnavailable:
            return False
        return True

    def close(self) -> None:
        with self._lock:
            self._closed = True
            self._drop_socket()


def _seal(auth: MessageAuth | None, body: bytes) -> bytes:
    return body if auth is None else auth.seal(body)


def _one_shot_socket(address: str, timeout_s: float) -> zmq.Socket:
    """A REQ socket to `address` for one request, every send and receive bounded."""
    sock = zmq.Context.instance().socket(zmq.REQ)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.RCVTIMEO, max(1, int(timeout_s * 1000)))
    sock.setsockopt(zmq.SNDTIMEO, max(1, int(timeout_s * 1000)))
    sock.connect(address)
    return sock


def replica_health(
    address: str, timeout_s: float = 1.0, auth_key: bytes | None = None
) -> dict[str, Any] | None:
    """One replica's `health` answer (requests, store, leading, leader, promotions), or None
    when it does not answer within `timeout_s` (or refuses the credential)."""
    auth = client_auth(auth_key)
    sock = _one_shot_socket(address, timeout_s)
    try:
        sealed = _seal(auth, msgpack.packb({"op": "health"}, use_bin_type=True))
        sock.send(sealed)
        raw = sock.recv()
        if auth is not None:
            raw = auth.open_(raw, context=nonce_of(sealed))
        reply = msgpack.unpackb(raw, raw=False)
    except (zmq.ZMQError, AuthError, ValueError, msgpack.UnpackException):
        return None
    finally:
        sock.close(linger=0)
    return reply.get("result") if isinstance(reply, dict) and reply.get("ok") else None


def leading_replica(addresses: Sequence[str | None], timeout_s: float = 1.0,
                    auth_key: bytes | None = None) -> int | None:
    """The index in `addresses` of the replica whose `health` says it leads (None: skip that
    one), or None when none does."""
    for index, address in enumerate(addresses):
        if address and (replica_health(address, timeout_s, auth_key) or {}).get("leading"):
            return index
    return None


def ping(address: str, timeout_s: float = 1.0, auth_key: bytes | None = None) -> bool:
    """True when a metadata service answers on `address` within `timeout_s` (a service that
    refuses the credential answers too: True, so readiness checks do not hang on it)."""
    auth = client_auth(auth_key)
    sock = _one_shot_socket(address, timeout_s)
    try:
        sock.send(_seal(auth, msgpack.packb({"op": "ping"}, use_bin_type=True)))
        raw = sock.recv()
        if auth is not None:
            return True  # an answer; whether it is authentic is the client's business
        reply = msgpack.unpackb(raw, raw=False)
        return reply.get("ok") is True or reply.get("error_kind") == "unauthenticated"
    except zmq.ZMQError:
        return False
    finally:
        sock.close(linger=0)
