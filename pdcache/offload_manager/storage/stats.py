"""Thread-safe counters shared by the storage backends (reported by `stats()`)."""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter, OrderedDict
from collections.abc import Mapping, Sequence
from types import MappingProxyType

from pdcache.offload_manager.storage.page_format import Verdict
from pdcache.offload_manager.storage.state_format import STATE_REJECT_REASONS, StateVerdict

log = logging.getLogger(__name__)

COUNTERS = (
    "pages_read",
    "pages_written",
    "pages_skipped",
    "misses",
    "corrupt_pages",
    "truncated_pages",
    "foreign_pages",
    "wrong_key_pages",
    "empty_pages",
    "read_errors",
    "write_errors",
    "full_rejects",
    "metadata_errors",
    "bytes_read",
    "bytes_written",
    "deleted_pages",
    "evictions",
    "rejected_slots",
    "replaced_rejected_pages",
)
# Why a found page was not served -> its reason label (`pdcache_storage_rejected_pages_total`):
# header (bad magic/version/header CRC), checksum (payload), mac (unauthenticated or forged,
# docs/security.md), needs_key (a sealed page without a checksum, read by a node without the
# secret), and the page-identity checks.
REJECT_REASONS: Mapping[Verdict, str] = MappingProxyType({
    Verdict.CORRUPT: "header",
    Verdict.BAD_CHECKSUM: "checksum",
    Verdict.BAD_MAC: "mac",
    Verdict.TRUNCATED: "truncated",
    Verdict.FOREIGN: "foreign",
    Verdict.NEEDS_KEY: "needs_key",
    Verdict.WRONG_KEY: "wrong_key",
    Verdict.EMPTY: "empty",
})
COUNTERS += tuple(f"rejected_{reason}_pages" for reason in REJECT_REASONS.values())
# State objects (state_format.py), counted apart from pages: `bytes_*` stay the KV pages'
# payload bytes (`kv_bytes_*` in `snapshot()`, beside `state_bytes_*`), so every tier reports
# state vs KV bytes; a refused state object counts as a state miss and by its reason.
STATE_COUNTERS = (
    "states_read",
    "states_written",
    "states_skipped",
    "state_misses",
    "state_read_errors",
    "state_write_errors",
    "state_full_rejects",
    "state_bytes_read",
    "state_bytes_written",
    "deleted_states",
    "state_evictions",
    "replaced_rejected_states",
) + tuple(f"rejected_{reason}_states" for reason in STATE_REJECT_REASONS.values())
COUNTERS += STATE_COUNTERS
_LEGACY_FINER = (Verdict.TRUNCATED, Verdict.FOREIGN, Verdict.WRONG_KEY, Verdict.EMPTY)


class StorageCounters:
    """Named integer counters behind one lock; every name in COUNTERS is always reported."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._values: Counter[str] = Counter(dict.fromkeys(COUNTERS, 0))
        self._needs_key_logged = False  # the first NEEDS_KEY page of this store is logged

    def add(self, name: str, amount: int = 1) -> None:
        with self._lock:
            self._values[name] += amount

    def add_many(self, **amounts: int) -> None:
        with self._lock:
            self._values.update(amounts)

    def record_failed_read(self, verdict: Verdict) -> None:
        """A page that was found but failed verification: a miss counted as corrupt (the total)
        and as rejected for its reason."""
        with self._lock:
            self._values["misses"] += 1
            self._values["corrupt_pages"] += 1
            self._values[f"rejected_{REJECT_REASONS[verdict]}_pages"] += 1
            if verdict in _LEGACY_FINER:  # the older finer counters, kept beside the reasons
                self._values[f"{verdict.value}_pages"] += 1
            first_needs_key = verdict is Verdict.NEEDS_KEY and not self._needs_key_logged
            if first_needs_key:
                self._needs_key_logged = True
        if first_needs_key:  # once per store: a misconfigured node, not a stream of faults
            log.warning("storage holds sealed pages without a checksum (algorithm 'none') and "
                        "this node has no page MAC key: every such page is a miss (counted as "
                        "rejected_needs_key_pages); give this node the cluster secret, or have "
                        "the writers use [storage] checksum = \"xxh3\" (docs/security.md)")

    def record_failed_state_read(self, verdict: StateVerdict) -> None:
        """A state object that was found but refused: a state miss, counted by its reason."""
        with self._lock:
            self._values["state_misses"] += 1
            self._values[f"rejected_{STATE_REJECT_REASONS[verdict]}_states"] += 1

    def snapshot(self) -> dict[str, int | float]:
        with self._lock:
            out: dict[str, int | float] = dict(self._values)
        out["kv_bytes_read"], out["kv_bytes_written"] = out["bytes_read"], out["bytes_written"]
        return out


class RejectedKeys:
    """Keys whose stored page this process read and refused (failed MAC, checksum, header...),
    so that its next `put_from` of such a key replaces the stored page instead of skipping it
    as already present (docs/security.md, "Rejected pages"). Only this process's own reads
    mark a key, and only its own writes act on the mark: a reader never deletes on its own.
    Bounded (oldest marks dropped first); thread-safe."""

    def __init__(self, limit: int = 65536) -> None:
        self._limit = limit
        self._keys: OrderedDict[bytes, None] = OrderedDict()
        self._lock = threading.Lock()

    def refuse(self, key: bytes, verdict: Verdict) -> None:
        """Marks `key` after a read refused its page for `verdict`. A `NEEDS_KEY` page is not
        marked: it is valid for the readers that hold the page MAC key, so a keyless node's
        put must not replace it (nor a keyed node's put then replace the keyless rewrite)."""
        if verdict is Verdict.NEEDS_KEY:
            return
        self.mark(key)

    def mark(self, key: bytes) -> None:
        """Marks `key` unconditionally (state objects: their reader decides, as `refuse`)."""
        with self._lock:
            self._keys[key] = None
            self._keys.move_to_end(key)
            if len(self._keys) > self._limit:
                self._keys.popitem(last=False)

    def take(self, keys: Sequence[bytes]) -> list[bytes]:
        """The marked keys among `keys` (deduplicated), unmarked: the caller replaces them."""
        with self._lock:
            if not self._keys:
                return []
            return [k for k in dict.fromkeys(keys) if self._keys.pop(k, 0) is None]


class RateLimitedLog:
    """Logs a recurring fault at WARNING at most once per `interval_s` per topic (the
    counters carry the totals), so a full disk or a dead service is visible, not a flood."""

    def __init__(self, logger: logging.Logger, interval_s: float = 30.0) -> None:
        self._log = logger
        self._interval_s = interval_s
        self._last: dict[str, float] = {}
        self._lock = threading.Lock()

    def warning(self, topic: str, msg: str, *args: object) -> None:
        now = time.monotonic()
        with self._lock:
            if now - self._last.get(topic, -self._interval_s) < self._interval_s:
                return
            self._last[topic] = now
        self._log.warning(msg, *args)
