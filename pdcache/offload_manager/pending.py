"""PendingPages: the stored-page keys decode nodes announced as being written (docs/design.md
§4.10, "A durable next turn").

A decode node's offload manager writes the answer's pages to storage asynchronously; the next
turn's prefill may look them up before the write commits. Decode announces each batch of keys
when it schedules the write (`pending(keys, ttl_s)`) and again when the write ends
(`settled(keys, landed)`); the prefill node's `KVSender` feeds both here (control thread), and
`HiCache` asks (engine thread) which keys of a lookup are still on their way.

An entry is PENDING until settled: then LANDED (readable from storage) or forgotten (it will
not come). Every entry expires `ttl_s` after it was announced (a landed one `ttl_s` after it
landed), so a decode node that dies mid-write never makes a prefill wait past the TTL. The
TTL is the announcing peer's, clamped to this node's `max_ttl_s` (`[cache] pending_max_ttl_s`),
so a peer cannot make prefill wait longer than prefill allows. Each mark remembers its
`source` (the announcing decode link); `forget_source` drops that peer's still-pending marks
when the prefill loses it. At most `max_keys` entries are kept (the oldest go first).
A mark may also say when decode expects the write to land (`eta_s`, measured on decode) and
that decode serves a pull of the still-staged page (`pullable`): `pull_run` gives HiCache what
it needs to decide whether to pull (`page_pull.PagePulls`, which `pulls` holds and `pulled`
feeds). Thread-safe: one lock, O(1) per key.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from enum import Enum
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pdcache.offload_manager.page_pull import PagePulls


class PageState(Enum):
    PENDING = "pending"  # announced, the write has not ended
    LANDED = "landed"  # committed in storage: read it
    GONE = "gone"  # never announced, failed, dropped, or expired: do not wait


@dataclass
class _Entry:
    expires: float
    ttl_s: float
    source: bytes = b""
    landed: bool = False
    lands_by: float = 0.0  # when decode expects the write to land (this clock; 0: unknown)
    pullable: bool = False  # decode serves a pull of this page while it is staged


DEFAULT_MAX_TTL_S = 30.0  # `[cache] pending_max_ttl_s`: the prefetch policy's default cap


class PendingPages:
    """Decode-announced page keys and their write state; see the module docstring."""

    def __init__(self, max_keys: int = 1 << 18,
                 clock: Callable[[], float] = time.monotonic,
                 max_ttl_s: float = DEFAULT_MAX_TTL_S,
                 pulls: PagePulls | None = None) -> None:
        """`pulls`: the node's pulls of staged pages (answers reach it through `pulled`);
        None: this node never pulls."""
        if not max_ttl_s > 0:
            raise ValueError(f"max_ttl_s must be > 0, got {max_ttl_s}")
        self.max_keys = max_keys
        self.max_ttl_s = max_ttl_s
        self._clock = clock
        self._entries: OrderedDict[bytes, _Entry] = OrderedDict()
        self._by_source: dict[bytes, set[bytes]] = {}  # source -> its unlanded keys
        self._lock = threading.Lock()
        self.marked = 0  # keys announced pending, ever
        self.landed = 0  # keys settled as committed
        self.failed = 0  # keys settled as not coming
        self.forgotten = 0  # pending keys dropped because their decode peer was lost
        self.pulls = pulls

    # ---- fed by the transfer control thread ------------------------------------------------
    def pending(self, keys: Sequence[bytes], ttl_s: float, source: bytes = b"",
                eta_s: float = 0.0, pullable: bool = False) -> None:
        ttl_s = min(ttl_s, self.max_ttl_s)  # the peer's TTL, never past this node's cap
        now = self._clock()
        expires = now + ttl_s
        lands_by = now + min(eta_s, ttl_s) if eta_s > 0 else 0.0
        with self._lock:
            for key in keys:
                entry = self._entries.get(key)
                if entry is not None and entry.landed:
                    continue  # already in storage: a late duplicate mark changes nothing
                if entry is not None:
                    self._unlink(key, entry)
                self._entries[key] = _Entry(expires, ttl_s, source, False, lands_by, pullable)
                self._entries.move_to_end(key)
                self._by_source.setdefault(source, set()).add(key)
            self.marked += len(keys)
            while len(self._entries) > self.max_keys:
                self._unlink(*self._entries.popitem(last=False))

    def pulled(self, source: bytes, pull_id: int, keys: list[bytes], found: list[bool],
               object_bytes: int, objects: bytes) -> None:
        """A decode's answer to a pull (transfer control thread): to `pulls`, if any."""
        if self.pulls is not None:
            self.pulls.pulled(source, pull_id, keys, found, object_bytes, objects)

    def pull_run(self, keys: Sequence[bytes]) -> tuple[bytes, int, float]:
        """(source, count, lands_by) of the pullable run at the head of `keys`: the first
        `count` keys are still PENDING, announced by one decode `source` that serves pulls;
        `lands_by` is the latest time decode expects their writes to land (0: unknown for one
        of them). count 0: nothing to pull."""
        now = self._clock()
        source, count, lands_by = b"", 0, 0.0
        with self._lock:
            for key in keys:
                entry = self._entries.get(key)
                if entry is None or entry.landed or entry.expires <= now or not entry.pullable:
                    break
                if count and entry.source != source:
                    break
                if not count:
                    source, lands_by = entry.source, entry.lands_by
                elif lands_by and entry.lands_by:
                    lands_by = max(lands_by, entry.lands_by)
                else:
                    lands_by = 0.0
                count += 1
        return source, count, lands_by

    def forget_source(self, source: bytes) -> int:
        """Drop the still-pending marks `source` announced (the prefill lost that decode peer:
        its writes are not coming, or not announced as settled); returns how many."""
        with self._lock:
            keys = self._by_source.pop(source, set())
            for key in keys:
                self._entries.pop(key, None)
            self.forgotten += len(keys)
            return len(keys)

    def _unlink(self, key: bytes, entry: _Entry) -> None:
        """Under the lock: `key` leaves its source's set (entry dropped, replaced or landed)."""
        keys = self._by_source.get(entry.source)
        if keys is not None:
            keys.discard(key)
            if not keys:
                del self._by_source[entry.source]

    def settled(self, keys: Sequence[bytes], landed: Sequence[bool]) -> None:
        now = self._clock()
        with self._lock:
            for key, ok in zip(keys, landed):
                entry = self._entries.get(key)
                if not ok:
                    if entry is not None:
                        self._unlink(key, self._entries.pop(key))
                    self.failed += 1
                    continue
                self.landed += 1
                if entry is None:
                    continue  # expired or never seen: storage's exists_prefix finds it
                # a landed entry lives one more TTL, for the lookups already waiting on it
                entry.expires = now + entry.ttl_s
                entry.landed = True
                self._unlink(key, entry)  # in storage now: losing its peer changes nothing

    # ---- asked by HiCache (engine thread) --------------------------------------------------
    def state(self, key: bytes) -> PageState:
        now = self._clock()
        with self._lock:
            entry = self._entries.get(key)
            if entry is None:
                return PageState.GONE
            if entry.expires <= now:
                self._unlink(key, self._entries.pop(key))
                return PageState.GONE
            return PageState.LANDED if entry.landed else PageState.PENDING

    def run(self, keys: Sequence[bytes]) -> int:
        """How many keys from the first are announced (pending or landed) and unexpired."""
        count = 0
        for key in keys:
            if self.state(key) is PageState.GONE:
                break
            count += 1
        return count

    def __len__(self) -> int:
        with self._lock:
            return len(self._entries)

    def snapshot(self) -> dict[str, float]:
        with self._lock:
            out: dict[str, float] = {
                "pending_keys_tracked": len(self._entries), "pending_keys_marked": self.marked,
                "pending_keys_landed": self.landed, "pending_keys_failed": self.failed,
                "pending_keys_forgotten": self.forgotten}
        if self.pulls is not None:
            out.update(self.pulls.snapshot())
        return out
