"""PagePulls: a prefill node pulls pending pages from the decode node's host staging instead of
waiting for their storage write (docs/design.md §4.10, "Pull from decode's staging").

When a prefetch meets pages a decode announced as pending (`PendingPages`), HiCache asks
`should_pull` with the awaited bytes and how long decode expects the write to take still: pull
when that is longer than the bytes at the measured pull rate plus one control round trip
(`[cache] pending_pull = "auto"`; "always" pulls whenever decode offers it, "never" waits).
Whatever the mode, nothing is pulled unless the control plane is authenticated
(`PullRequester.authenticated`) and the store MACs pages (`secure_for`): both come with the
cluster secret, and without them a forged answer could not be told from decode's.
`start` sends one `PullPages` over the transfer control plane (`PullRequester`, the node's
`KVSender`) and returns a `PullTicket` whose host pages the answers fill: each pulled object
is verified exactly like a storage read (`page_format.verify_page` under the store's
`PageSpec`: header, key, fingerprint, checksum, and the page MAC when a secret is set) before
its payload is copied in; a page that fails is a counted reject (`pull_pages_rejected`), never
served. A page decode no longer has staged is answered "not available". HiCache then treats
the ticket's verified prefix like pages read from storage and waits, as before, for the rest.

Threads: `start`, `finish` and the ticket's `close` / `ok_prefix` run on the engine thread,
`pulled` on the transfer control thread. A ticket's host pages are written only under its
lock and only while it is open, so once the engine thread closed it (done, timed out, or the
request admitted or cancelled) no late answer touches pages it may have freed. The pull rate
and round trip are measured from completed pulls (the first pull uses conservative defaults);
a timed-out pull lowers the rate to what it got in the time it took.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections.abc import Callable, Sequence
from enum import Enum
from typing import Protocol

from pdcache.offload_manager.storage.page_format import (
    HEADER_BYTES,
    HostPage,
    PageSpec,
    Verdict,
    payload_views,
    verify_page,
)
from pdcache.offload_manager.storage.stats import RateLimitedLog

log = logging.getLogger(__name__)

PULL_MODES = ("auto", "never", "always")
# Before any pull was measured: under what 8 concurrent pulls got each on this 2-core machine
# with the cluster secret pulls need (20 MB/s, MAC'd frames; docs/measured.md), so the first
# pulls happen only when the wait would clearly be longer; completed pulls replace it.
DEFAULT_PULL_RATE_BYTES_S = 15e6
DEFAULT_PULL_RTT_S = 0.002
_EWMA = 0.5  # weight of a new measurement
# the estimate never falls below this (timed-out pulls halve it each): a decode that timed
# out keeps being tried, rarely, once its writes are slow enough to make even this worth it
MIN_PULL_RATE_BYTES_S = 1e5


class PullRequester(Protocol):
    """Sends a pull to a decode link (`KVSender.request_pull`); False: that decode is gone.
    `authenticated`: the control plane MACs every frame (a cluster secret is set)."""

    authenticated: bool

    def request_pull(self, source: bytes, pull_id: int, keys: list[bytes],
                     ttl_s: float) -> bool: ...


class Fill(Enum):
    """What `PullTicket.fill` did with an answer."""

    STALE = "stale"  # not this ticket's key, or answered already
    CLOSED = "closed"  # counted as answered, but the ticket was closed: nothing copied
    COPIED = "copied"  # verified payload copied into its host page
    NONE = "none"  # answered "not available" / rejected


class PullTicket:
    """One pull of `keys` into `pages` (host pages the prefetch allocated); see the module
    docstring for who touches what."""

    def __init__(
        self,
        pull_id: int,
        source: bytes,
        keys: list[bytes],
        pages: Sequence[HostPage],
        spec: PageSpec,
        started: float,
        deadline: float,
    ) -> None:
        self.pull_id = pull_id
        self.source = source
        self.keys = keys
        self.pages = pages
        self.spec = spec
        self.started = started
        self.deadline = deadline
        self.ok = [False] * len(keys)
        self._answered = [False] * len(keys)
        self._index = {key: i for i, key in enumerate(keys)}
        self.answers = 0  # keys answered (found or not)
        self.received_bytes = 0
        self.first_answer = 0.0
        self.last_answer = 0.0
        self._lock = threading.Lock()
        self.closed = False

    @property
    def finished(self) -> bool:
        return self.answers == len(self.keys)

    def close(self) -> None:
        """No answer writes into the pages from now on (engine thread)."""
        with self._lock:
            self.closed = True

    def ok_prefix(self) -> int:
        """How many pages from the first were pulled and verified."""
        with self._lock:
            return next((i for i, ok in enumerate(self.ok) if not ok), len(self.ok))

    def wants(self, key: bytes) -> bool:
        """Whether an answer for `key` would be used: this ticket's, unanswered, open (checked
        before the object is verified, so nobody else's answer costs a MAC)."""
        with self._lock:
            index = self._index.get(key)
            return index is not None and not self._answered[index] and not self.closed

    def fill(self, key: bytes, payload: memoryview | None, now: float) -> Fill:
        """Record key's answer: its verified payload (copied into its host page) or None (not
        available, or rejected)."""
        with self._lock:
            index = self._index.get(key)
            if index is None or self._answered[index]:
                return Fill.STALE
            self._answered[index] = True
            self.answers += 1
            self.first_answer = self.first_answer or now
            self.last_answer = now
            if self.closed:
                return Fill.CLOSED
            if payload is None:
                return Fill.NONE
            offset = 0
            for view in payload_views(self.pages[index]):
                view[:] = payload[offset : offset + len(view)]
                offset += len(view)
            self.ok[index] = True
            self.received_bytes += len(payload) + HEADER_BYTES
            return Fill.COPIED


class PagePulls:
    """The node's pulls in flight, its measured pull rate and its counters; thread-safe (one
    lock for the table, the estimates and the counters)."""

    def __init__(self, mode: str = "auto", clock: Callable[[], float] = time.monotonic) -> None:
        if mode not in PULL_MODES:
            raise ValueError(f"pending_pull must be one of {PULL_MODES}, got {mode!r}")
        self.mode = mode
        self._clock = clock
        self._requester: PullRequester | None = None
        self._tickets: dict[int, PullTicket] = {}
        self._ids = itertools.count(1)
        self._lock = threading.Lock()
        self.rate_bytes_s = DEFAULT_PULL_RATE_BYTES_S
        self.rtt_s = DEFAULT_PULL_RTT_S
        self._warn = RateLimitedLog(log)
        self.counters = {
            "pulls": 0,
            "pull_timeouts": 0,  # not answered by their deadline
            "pull_abandoned": 0,  # closed unfinished before it: admitted, cancelled, landed
            "pull_send_failures": 0,
            "pull_pages_requested": 0,
            "pull_pages_received": 0,
            "pull_pages_rejected": 0,
            "pull_pages_unavailable": 0,
            "pull_answers_unexpected": 0,
        }

    def attach(self, requester: PullRequester | None) -> None:
        """Where pulls are sent (the node's `KVSender`, built after the engine)."""
        self._requester = requester

    @property
    def enabled(self) -> bool:
        """A pull may be sent: the mode allows it and the control plane is authenticated
        (without a cluster secret anyone who can register on the bootstrap port could answer
        with forged pages: no pull then, whatever the mode; `secure_for` adds the page MAC)."""
        requester = self._requester
        return (self.mode != "never" and requester is not None
                and bool(getattr(requester, "authenticated", False)))

    @staticmethod
    def secure_for(spec: PageSpec) -> bool:
        """Pulled pages of this store can be trusted: they carry the page MAC."""
        return spec.sealer is not None

    def estimate_s(self, nbytes: int) -> float:
        """What pulling `nbytes` is expected to take: at the measured rate, plus a round trip."""
        with self._lock:
            return nbytes / self.rate_bytes_s + self.rtt_s

    def should_pull(self, nbytes: int, remaining_write_s: float) -> bool:
        """The per-request rule: "always", or ("auto") decode's expected remaining write time
        is longer than the pull's estimate. An unknown remaining time (0) never pulls on auto."""
        if not self.enabled:
            return False
        if self.mode == "always":
            return True
        return remaining_write_s > self.estimate_s(nbytes)

    def start(
        self,
        source: bytes,
        keys: list[bytes],
        pages: Sequence[HostPage],
        spec: PageSpec,
        timeout_s: float,
    ) -> PullTicket | None:
        """Send a pull of `keys` (to fill `pages`) to decode link `source`; None when it could
        not be sent (the caller waits as without a pull). Engine thread."""
        if not self.enabled or not keys or not self.secure_for(spec):
            return None
        assert self._requester is not None
        now = self._clock()
        with self._lock:
            pull_id = next(self._ids)
            ticket = PullTicket(pull_id, source, keys, pages, spec, now, now + timeout_s)
            self._tickets[pull_id] = ticket
        if not self._requester.request_pull(source, pull_id, keys, timeout_s):
            with self._lock:
                self._tickets.pop(pull_id, None)
                self.counters["pull_send_failures"] += 1
            return None
        with self._lock:
            self.counters["pulls"] += 1
            self.counters["pull_pages_requested"] += len(keys)
        return ticket

    def finish(self, ticket: PullTicket) -> None:
        """The engine is done with `ticket`: close it, count it, and learn from it. A complete
        pull gives the rate and round trip; one that ran past its deadline gives an upper
        bound on the rate (what it got over the time it took, 0 when nothing came), folded in
        the same way, so a slow or unreachable decode is pulled from less. One closed
        unfinished before its deadline (the request admitted or cancelled, the pages landed)
        is counted abandoned, and nothing is learnt from it. Engine thread."""
        ticket.close()
        now = self._clock()
        with self._lock:
            self._tickets.pop(ticket.pull_id, None)
            if not ticket.finished:
                if now < ticket.deadline:
                    self.counters["pull_abandoned"] += 1
                    return
                self.counters["pull_timeouts"] += 1
                observed = ticket.received_bytes / max(now - ticket.started, 1e-6)
                self._learn_rate(min(observed, self.rate_bytes_s))
                return
            if ticket.received_bytes and ticket.last_answer > ticket.started:
                rtt = max(ticket.first_answer - ticket.started, 1e-6)
                rate = ticket.received_bytes / max(ticket.last_answer - ticket.started, 1e-6)
                self.rtt_s += _EWMA * (rtt - self.rtt_s)
                self._learn_rate(rate)

    def _learn_rate(self, rate: float) -> None:
        self.rate_bytes_s = max(MIN_PULL_RATE_BYTES_S,
                                self.rate_bytes_s + _EWMA * (rate - self.rate_bytes_s))

    def pulled(
        self,
        source: bytes,
        pull_id: int,
        keys: list[bytes],
        found: list[bool],
        object_bytes: int,
        objects: bytes,
    ) -> None:
        """A decode's answer (transfer control thread): verify each object like a storage
        read, then fill the ticket's host page; rejects and unavailable pages are counted."""
        with self._lock:
            ticket = self._tickets.get(pull_id)
        if ticket is None or ticket.source != source:
            self._add(pull_answers_unexpected=1)  # late (given up already) or not ours
            return
        raw = memoryview(objects)
        offset = 0
        rejected = unavailable = received = 0
        now = self._clock()
        for key, present in zip(keys, found):
            payload = None
            if present:
                obj = raw[offset : offset + object_bytes]
                offset += object_bytes
            if not ticket.wants(key):  # not ours, answered already or closed: never verified
                ticket.fill(key, None, now)
                continue
            if present:
                payload = self._verified(ticket.spec, key, obj)
                rejected += payload is None
            else:
                unavailable += 1
            received += ticket.fill(key, payload, now) is Fill.COPIED
        self._add(
            pull_pages_rejected=rejected,
            pull_pages_unavailable=unavailable,
            pull_pages_received=received,
        )

    def _verified(self, spec: PageSpec, key: bytes, obj: memoryview) -> memoryview | None:
        if len(obj) != spec.object_bytes:
            self._warn.warning(
                "size", "pulled page of %d bytes, the store's are %d", len(obj), spec.object_bytes
            )
            return None
        payload = obj[HEADER_BYTES:]
        verdict, _ = verify_page(spec, key, obj[:HEADER_BYTES], payload, len(obj))
        if verdict is not Verdict.OK:
            self._warn.warning(
                "verify", "pulled page %s refused: %s", key.hex()[:16], verdict.value
            )
            return None
        return payload

    def _add(self, **deltas: int) -> None:
        with self._lock:
            for name, delta in deltas.items():
                self.counters[name] += delta

    def snapshot(self) -> dict[str, float]:
        with self._lock:
            out: dict[str, float] = dict(self.counters)
            out.update(
                pulls_in_flight=len(self._tickets),
                pull_rate_bytes_s=self.rate_bytes_s,
                pull_rtt_s=self.rtt_s,
            )
        return out
