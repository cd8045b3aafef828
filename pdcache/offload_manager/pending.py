"""PendingPages: the stored-page keys decode nodes announced as being written (docs/design.md
§4.10, "A durable next turn").

A decode node's offload manager writes the answer's pages to storage asynchronously; the next
turn's prefill may look them up before the write commits. Decode announces each batch of keys
when it schedules the write (`pending(keys, ttl_s)`) and again when the write ends
(`settled(keys, landed)`); the prefill node's `KVSender` feeds both here (control thread), and
`HiCache` asks (engine thread) which keys of a lookup are still on their way.

An entry is PENDING until settled: then LANDED (readable from storage) or forgotten (it will
not come). Every entry expires `ttl_s` after it was announced (a landed one `ttl_s` after it
landed), so a decode node that dies mid-write never makes a prefill wait past the TTL. At
most `max_keys` entries are kept (the oldest go first). Thread-safe: one lock, O(1) per key.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from enum import Enum


class PageState(Enum):
    PENDING = "pending"  # announced, the write has not ended
    LANDED = "landed"  # committed in storage: read it
    GONE = "gone"  # never announced, failed, dropped, or expired: do not wait


@dataclass
class _Entry:
    expires: float
    ttl_s: float
    landed: bool = False


class PendingPages:
    """Decode-announced page keys and their write state; see the module docstring."""

    def __init__(self, max_keys: int = 1 << 18,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.max_keys = max_keys
        self._clock = clock
        self._entries: OrderedDict[bytes, _Entry] = OrderedDict()
        self._lock = threading.Lock()
        self.marked = 0  # keys announced pending, ever
        self.landed = 0  # keys settled as committed
        self.failed = 0  # keys settled as not coming

    # ---- fed by the transfer control thread ------------------------------------------------
    def pending(self, keys: Sequence[bytes], ttl_s: float) -> None:
        expires = self._clock() + ttl_s
        with self._lock:
            for key in keys:
                entry = self._entries.get(key)
                if entry is not None and entry.landed:
                    continue  # already in storage: a late duplicate mark changes nothing
                self._entries[key] = _Entry(expires, ttl_s)
                self._entries.move_to_end(key)
            self.marked += len(keys)
            while len(self._entries) > self.max_keys:
                self._entries.popitem(last=False)

    def settled(self, keys: Sequence[bytes], landed: Sequence[bool]) -> None:
        now = self._clock()
        with self._lock:
            for key, ok in zip(keys, landed):
                entry = self._entries.get(key)
                if not ok:
                    self._entries.pop(key, None)
                    self.failed += 1
                    continue
                self.landed += 1
                if entry is None:
                    continue  # expired or never seen: storage's exists_prefix finds it
                # a landed entry lives one more TTL, for the lookups already waiting on it
                entry.expires = now + entry.ttl_s
                entry.landed = True

    # ---- asked by HiCache (engine thread) --------------------------------------------------
    def state(self, key: bytes) -> PageState:
        now = self._clock()
        with self._lock:
            entry = self._entries.get(key)
            if entry is None:
                return PageState.GONE
            if entry.expires <= now:
                del self._entries[key]
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

    def snapshot(self) -> dict[str, int]:
        with self._lock:
            return {"pending_keys_tracked": len(self._entries),
                    "pending_keys_marked": self.marked, "pending_keys_landed": self.landed,
                    "pending_keys_failed": self.failed}
