"""The hf3fs metadata on etcd: a replicated index store with leader election and fencing.

Several `pdcache metadata-server` replicas share one etcd cluster (`[storage.etcd]`). One of
them is the leader: it holds `<prefix>/leader` on an etcd lease it keeps alive, loads every
pool from etcd when it is promoted, answers from its in-memory `SlotIndex`es, and writes each
request's durable changes (committed entries, evictions, reservations) to etcd in a
transaction *fenced* by its leadership — the transaction applies only while the leader key
still has the create revision it won — before the reply. The others answer `not_leader` with
the leader's address, so clients follow it.

Why this is safe across a failover (docs/design.md §4.4 "A metadata service without a single
point of failure"):
- an acknowledged commit is in etcd (Raft: a quorum has it) before its reply, so the next
  leader loads it: no acknowledged entry is lost;
- a reservation is in etcd before the slot reaches the writer, and a promoted leader keeps
  every stored reservation for a full TTL from its promotion: no slot is given to two pages;
- a leader that lost its lease (killed, frozen by SIGSTOP, cut off) cannot write: its next
  fenced transaction fails, it drops its state and answers `not_leader`; it also stops
  answering reads once its lease may have expired (measured from the send time of its last
  successful keep-alive, so its own view is never later than etcd's).
LRU recency is not replicated (a write per lookup would cost more than it saves): a promoted
leader orders each pool by commit order (etcd mod revision).

Layout under `prefix` (default `/pdcache/metadata`): `leader` -> advertised address (on the
lease), `pools/<ns>` -> msgpack [num_slots, slot_bytes], `entries/<ns>/<key hex>` -> slot,
`reserved/<ns>/<slot>` -> key.

Client: etcd3gw (the etcd v3 gRPC-gateway JSON API over `requests`; pure Python, maintained by
OpenStack). It speaks to one member; `EtcdEndpoints` rotates over the members on connection
errors and timeouts, so a killed or frozen etcd member costs one timeout.
"""

from __future__ import annotations

import base64
import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

import msgpack

from pdcache.offload_manager.storage.metadata import LostLeadership, StoredPool, StoreUnavailable

log = logging.getLogger(__name__)

T = TypeVar("T")
MAX_TXN_OPS = 120  # etcd's default --max-txn-ops is 128; one compare plus the puts/deletes
RANGE_PAGE = 2000  # keys per range request when a promoted leader loads a pool


def _etcd3gw() -> Any:
    try:
        import etcd3gw
    except ImportError as exc:  # pragma: no cover - exercised only without the extra
        raise ImportError(
            "the etcd metadata store needs the 'etcd3gw' package: pip install 'pdcache[ha]'"
        ) from exc
    return etcd3gw


def b64(data: bytes | str) -> str:
    raw = data.encode() if isinstance(data, str) else data
    return base64.b64encode(raw).decode("ascii")


def unb64(text: str) -> bytes:
    return base64.b64decode(text)


def prefix_end(prefix: bytes) -> bytes:
    """The range end that selects every key starting with `prefix`."""
    return prefix[:-1] + bytes([prefix[-1] + 1])


def parse_endpoints(text: str | Sequence[str]) -> tuple[tuple[str, int], ...]:
    """`"h1:2379,h2:2379"` (or a list) -> ((h1, 2379), (h2, 2379)); `http://` is accepted."""
    items = text.split(",") if isinstance(text, str) else list(text)
    out = []
    for item in (i.strip().removeprefix("http://") for i in items):
        if not item:
            continue
        host, sep, port = item.rpartition(":")
        if not sep or not port.isdigit():
            raise ValueError(f"etcd endpoint {item!r}: expected HOST:PORT")
        out.append((host, int(port)))
    if not out:
        raise ValueError("no etcd endpoints given")
    return tuple(out)


class UncertainWrite(StoreUnavailable):
    """A write was sent but its answer never came (a timeout, a reset connection): it may
    have applied, or may still apply later. The writer must not go on under the same term."""


# A connection that was never established sent nothing: the request may go to another member.
_NOT_SENT = ("Connection refused", "NewConnectionError", "Failed to establish")


class EtcdEndpoints:
    """One etcd3gw client per member; `call` tries the current one, then the others.

    Not shared between threads: each thread that talks to etcd owns one (requests sessions
    are not thread-safe). `timeout_s` bounds every HTTP request. The etcd API path is
    discovered per member (`/v3/` on etcd 3.4+, `/v3beta/` on 3.3)."""

    def __init__(self, endpoints: Sequence[tuple[str, int]], timeout_s: float = 2.0) -> None:
        etcd3gw = _etcd3gw()
        import requests

        self._unanswered = (etcd3gw.exceptions.ConnectionFailedError,
                            etcd3gw.exceptions.ConnectionTimeoutError,
                            etcd3gw.exceptions.InternalServerError,
                            requests.RequestException, ValueError, KeyError)
        self._refusal = etcd3gw.exceptions.Etcd3Exception  # any other answer: not retried
        self.clients = [etcd3gw.Etcd3Client(host=h, port=p, timeout=timeout_s)
                        for h, p in endpoints]
        self._current = 0

    def call(self, op: Callable[[Any], T], resend: bool = True) -> T:
        """`op` on the current member, then on the others until one answers. With
        `resend=False` (a fenced write) a request that may have reached a member is never
        sent again: UncertainWrite instead (only a refused connection moves it on)."""
        last: Exception | None = None
        for _ in range(len(self.clients)):
            client = self.clients[self._current]
            try:
                return op(client)
            except self._refusal as exc:
                if not isinstance(exc, self._unanswered):
                    raise StoreUnavailable(f"etcd refused the request: {exc}") from exc
                last = exc
            except self._unanswered as exc:
                last = exc
            self._current = (self._current + 1) % len(self.clients)
            if not resend and not any(marker in str(last) for marker in _NOT_SENT):
                raise UncertainWrite(f"etcd did not answer a write: {last}") from last
        raise StoreUnavailable(f"no etcd member answered: {last}")

    def post(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        return self.call(lambda c: c.post(c.get_url(path), json=body))

    def txn(self, body: dict[str, Any], resend: bool = True) -> dict[str, Any]:
        return self.call(lambda c: c.post(c.get_url("/kv/txn"), json=body), resend)

    def range_prefix(self, prefix: bytes) -> list[tuple[bytes, bytes, int]]:
        """Every (key, value, mod_revision) under `prefix`, in pages, key order."""
        out: list[tuple[bytes, bytes, int]] = []
        start, end = prefix, prefix_end(prefix)
        while True:
            reply = self.post("/kv/range", {"key": b64(start), "range_end": b64(end),
                                            "limit": RANGE_PAGE})
            kvs = reply.get("kvs", [])
            out += [(unb64(kv["key"]), unb64(kv.get("value", "")), int(kv["mod_revision"]))
                    for kv in kvs]
            if not reply.get("more") or not kvs:
                return out
            start = out[-1][0] + b"\x00"

    def close(self) -> None:
        for client in self.clients:
            client.session.close()


class EtcdLeadership:
    """Campaigns for `<prefix>/leader` on a lease and keeps the lease alive.

    Owner: the metadata-server process (`EtcdIndexStore`). Its one thread starts in `start()`
    and stops in `close()`, which revokes the lease so a standby takes over at once. State
    (`_term`, `_valid_until`, `_hint`) is guarded by `_lock`; readers call `serving()`,
    `term()` and `leader_hint()` from the service loop."""

    def __init__(self, endpoints: Sequence[tuple[str, int]], prefix: bytes, advertise: str,
                 ttl_s: int = 3, timeout_s: float = 1.0) -> None:
        if ttl_s < 2:
            raise ValueError(f"lease_ttl_s = {ttl_s}: etcd grants leases of 2 s or more")
        self.key = prefix + b"/leader"
        self.advertise = advertise
        self.ttl_s = ttl_s
        self._etcd = EtcdEndpoints(endpoints, timeout_s=min(timeout_s, ttl_s / 3))
        self._lock = threading.Lock()
        self._lease_id = 0
        self._valid_until = 0.0  # monotonic: our lease may expire from here on
        self._term: int | None = None  # create revision of our leader key while we lead
        self._hint = ""
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self, background: bool = True) -> None:
        """The first campaign now (a lone replica leads at once), then the thread; without
        `background` only that campaign (tests hold a deposed leader still with it)."""
        self._tick()
        if background:
            self._thread = threading.Thread(target=self._run, name="etcd-leadership",
                                            daemon=True)
            self._thread.start()

    def serving(self) -> bool:
        """True while we lead and our lease cannot have expired yet."""
        with self._lock:
            return self._term is not None and time.monotonic() < self._valid_until

    def term(self) -> int | None:
        with self._lock:
            return self._term if time.monotonic() < self._valid_until else None

    def leader_hint(self) -> str:
        with self._lock:
            return self._hint

    def fence(self, term: int | None) -> dict[str, Any]:
        """The compare of a transaction fenced by `term`, the term the writer's state was
        loaded in (LostLeadership when this replica does not lead in that term now)."""
        if term is None or self.term() != term:
            raise LostLeadership(f"this replica does not lead in term {term}")
        return {"key": b64(self.key), "target": "CREATE", "result": "EQUAL",
                "create_revision": str(term)}

    def step_down(self, term: int | None = None) -> None:
        """Stop leading (only `term`, when given: a later term won meanwhile stays)."""
        with self._lock:
            if term is None or self._term == term:
                self._term = None

    def abdicate(self, term: int | None) -> int:
        """Step down from `term` for good: returns the lease to revoke (0: none), so that a
        write of that term still in flight can never pass its fence."""
        with self._lock:
            if term is None or self._term != term:
                return 0
            self._term, lease, self._lease_id = None, self._lease_id, 0
            self._valid_until = 0.0
            return lease

    def _run(self) -> None:
        while not self._stop.wait(self.ttl_s / 4):
            try:
                self._tick()
            except Exception:  # the thread must outlive any reply etcd may send
                log.exception("metadata: leadership tick failed")

    def _tick(self) -> None:
        try:
            self._keep_lease()
            if self.term() is None:
                self._campaign()
        except StoreUnavailable as exc:
            log.warning("metadata: etcd unreachable (%s)", exc)

    def _keep_lease(self) -> None:
        sent = time.monotonic()
        with self._lock:
            lease = self._lease_id
        if lease:
            reply = self._etcd.post("/lease/keepalive", {"ID": str(lease)})
            if "result" not in reply:  # an error streamed by the gateway (an etcd election)
                raise StoreUnavailable(f"lease keep-alive: {reply.get('error', reply)}")
            ttl = int(reply["result"].get("TTL", 0))  # 0 (omitted): the lease expired
            with self._lock:
                current = self._lease_id == lease  # else abdicated meanwhile: a new lease
                if current and ttl > 0:
                    self._valid_until = sent + ttl
                    return
                if current:
                    self._term, self._lease_id = None, 0
            if ttl <= 0:
                log.warning("metadata: lease %x expired", lease)
        reply = self._etcd.post("/lease/grant", {"TTL": self.ttl_s, "ID": 0})
        with self._lock:
            self._lease_id = int(reply["ID"])
            self._valid_until = sent + int(reply["TTL"])

    def _campaign(self) -> None:
        with self._lock:
            lease = self._lease_id
        if not lease:  # never a leader key without a lease: it would outlive this process
            return
        key = b64(self.key)
        reply = self._etcd.txn({
            "compare": [{"key": key, "target": "CREATE", "result": "EQUAL",
                         "create_revision": "0"}],
            "success": [{"request_put": {"key": key, "value": b64(self.advertise),
                                         "lease": str(lease)}}],
            "failure": [{"request_range": {"key": key}}],
        })
        if reply.get("succeeded"):
            with self._lock:
                if self._lease_id != lease:  # abdicated meanwhile: that lease is revoked
                    return
                self._term = int(reply["header"]["revision"])
                self._hint = self.advertise
            log.warning("metadata: %s leads (term %d)", self.advertise, self._term)
            return
        kvs = reply["responses"][0]["response_range"].get("kvs", [])
        holder = kvs[0] if kvs else {}
        with self._lock:
            self._hint = unb64(holder.get("value", "")).decode() if holder else ""
            if holder and int(holder.get("lease", 0)) == lease == self._lease_id:
                # our own key: an earlier campaign won but its answer was lost (a resend)
                self._term = int(holder["create_revision"])
                self._hint = self.advertise

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=10)
        lease = self.abdicate(self.term()) or self._lease_id
        if lease and (self._thread is None or not self._thread.is_alive()):
            try:  # hand over now instead of after the TTL
                self._etcd.post("/kv/lease/revoke", {"ID": str(lease)})
            except StoreUnavailable:
                pass
        self.step_down()
        self._etcd.close()


@dataclass
class EtcdJournal:
    """The durable changes of one pool since the last flush (a `metadata.Journal`)."""

    ns: str
    entries: dict[bytes, int | None] = field(default_factory=dict)  # key -> slot, None: delete
    reserved: dict[int, bytes | None] = field(default_factory=dict)  # slot -> key, None: delete

    def put(self, key: bytes, slot: int) -> None:
        self.entries[key] = slot

    def remove(self, key: bytes) -> None:
        self.entries[key] = None

    def touch(self, key: bytes) -> None:
        """Recency is not replicated (module docstring)."""

    def reserved_slot(self, slot: int, key: bytes) -> None:
        self.reserved[slot] = key

    def released_slot(self, slot: int) -> None:
        self.reserved[slot] = None

    @property
    def has_durable_changes(self) -> bool:
        return bool(self.entries or self.reserved)

    def ops(self, prefix: bytes) -> list[dict[str, Any]]:
        ns = self.ns.encode()
        out = [_put_or_delete(prefix + b"/entries/" + ns + b"/" + key.hex().encode(),
                              None if slot is None else msgpack.packb(slot))
               for key, slot in self.entries.items()]
        out += [_put_or_delete(prefix + b"/reserved/" + ns + b"/" + str(slot).encode(), key)
                for slot, key in self.reserved.items()]
        self.entries.clear()
        self.reserved.clear()
        return out


def _put_or_delete(key: bytes, value: bytes | None) -> dict[str, Any]:
    if value is None:
        return {"request_delete_range": {"key": b64(key)}}
    return {"request_put": {"key": b64(key), "value": b64(value)}}


class EtcdIndexStore:
    """The metadata service's durable store on etcd (see the module docstring).

    Owner: the metadata-server process; used from its one service loop thread, except the
    leadership thread it starts in `start()` and stops in `close()`."""

    kind = "etcd"

    def __init__(self, endpoints: Sequence[tuple[str, int]], advertise: str,
                 prefix: str = "/pdcache/metadata", lease_ttl_s: int = 3,
                 timeout_s: float = 2.0) -> None:
        self.prefix = prefix.rstrip("/").encode()
        self.leadership = EtcdLeadership(endpoints, self.prefix, advertise, lease_ttl_s,
                                         timeout_s)
        self._etcd = EtcdEndpoints(endpoints, timeout_s=timeout_s)
        self.rejected_writes = 0  # fenced writes refused: another replica had taken over

    def start(self) -> None:
        self.leadership.start()

    def serving(self) -> bool:
        return self.leadership.serving()

    def term(self) -> int | None:
        return self.leadership.term()

    def leader_hint(self) -> str:
        return self.leadership.leader_hint()

    def journal(self, ns: str) -> EtcdJournal:
        return EtcdJournal(ns)

    def load(self) -> list[StoredPool]:
        pools = []
        for key, value, _ in self._etcd.range_prefix(self.prefix + b"/pools/"):
            ns = key.rsplit(b"/", 1)[1].decode()
            num_slots, slot_bytes = msgpack.unpackb(value)
            pools.append(StoredPool(ns, int(num_slots), int(slot_bytes), *self._load_pool(ns)))
        return pools

    def _load_pool(self, ns: str) -> tuple[list[tuple[bytes, int]], list[tuple[int, bytes]]]:
        base = self.prefix + b"/%s/" + ns.encode() + b"/"
        rows = self._etcd.range_prefix(base % b"entries")
        rows.sort(key=lambda row: row[2])  # commit order: the LRU order a new leader starts from
        entries = [(bytes.fromhex(k.rsplit(b"/", 1)[1].decode()), int(msgpack.unpackb(v)))
                   for k, v, _ in rows]
        reserved = [(int(k.rsplit(b"/", 1)[1]), v)
                    for k, v, _ in self._etcd.range_prefix(base % b"reserved")]
        return entries, reserved

    def create_pool(self, ns: str, num_slots: int, slot_bytes: int, term: int | None) -> None:
        key = self.prefix + b"/pools/" + ns.encode()
        self._fenced([_put_or_delete(key, msgpack.packb([num_slots, slot_bytes]))], term)

    def flush(self, journals: Sequence[EtcdJournal], with_touches: bool = False,
              term: int | None = None) -> None:
        """Write every journal's changes, fenced by `term` (the term the caller's state was
        loaded in); raises LostLeadership or StoreUnavailable, and the caller then drops its
        state: what reached etcd is what the next leader sees."""
        ops = [op for journal in journals for op in journal.ops(self.prefix)]
        for start in range(0, len(ops), MAX_TXN_OPS):
            self._fenced(ops[start:start + MAX_TXN_OPS], term)

    def _fenced(self, ops: list[dict[str, Any]], term: int | None) -> None:
        if not ops:
            return
        body = {"compare": [self.leadership.fence(term)], "success": ops, "failure": []}
        try:
            reply = self._etcd.txn(body, resend=False)
        except UncertainWrite:
            self._give_up(term)  # a late copy of this write must fail its fence
            raise
        if not reply.get("succeeded"):
            self.rejected_writes += 1
            self.leadership.step_down(term)
            raise LostLeadership("another metadata replica leads now")

    def _give_up(self, term: int | None) -> None:
        lease = self.leadership.abdicate(term)
        if lease:
            try:  # deletes the leader key; if etcd is unreachable the lease expires instead
                self._etcd.post("/kv/lease/revoke", {"ID": str(lease)})
            except StoreUnavailable as exc:
                log.warning("metadata: could not revoke lease %x (%s); it expires", lease, exc)

    def close(self) -> None:
        self.leadership.close()
        self._etcd.close()
