"""Conversation-scoped storage lifecycle: which stored page a full store evicts first.

`[storage] eviction = "session"` (docs/design.md §4.4). A page written for a session
(`put_from(..., session=SID)`: the request's `session_id`) belongs to it while the session is
active, and is *protected* if the bound allows it when it is written: at most
`protect_pages` pages of all active sessions together (`session_protect_share` of the
capacity) and at most `session_cap_pages` per session (0: no per-session cap). Eviction order:

1. pages of *closed* sessions (ended by `end_session`, or no write for `idle_s` seconds),
   least recently used first;
2. unprotected pages (no session, pages found at open, pages over the bound), LRU;
3. protected pages, LRU (only when nothing else is left).

A session's activity is its writes: every turn writes new pages (prefill its prompt's new
pages, decode the answer's). Reads never carry a session; a read of a closed session's page
(another conversation shares that prefix) moves it to the unprotected group. Protection is
decided when a page is written (a page is never promoted later), and released when its session
closes. `eviction = "lru"` keeps the backend's plain LRU and does not use this class.

Accounting: every known page is in exactly one group; `len()` equals the owner's index size.
Not thread-safe: the owner holds its index lock (file backend, in-process hf3fs metadata) or
runs it on one thread (the metadata service).
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field

from pdcache.offload_manager.storage.config import STORAGE_EVICTIONS

PROTECTED, UNPROTECTED, CLOSED = "protected", "unprotected", "closed"


@dataclass(frozen=True)
class LifecycleConfig:
    """The `[storage]` keys of the session lifecycle, in pages of the store."""

    protect_pages: int  # all active sessions' protected pages together
    session_cap_pages: int = 0  # per session; 0: only the total bound
    idle_s: float = 300.0

    def __post_init__(self) -> None:
        if self.protect_pages < 0 or self.session_cap_pages < 0:
            raise ValueError("storage session protection bounds must be >= 0")
        if self.idle_s <= 0:
            raise ValueError("storage.session_idle_s must be > 0")


@dataclass
class _Session:
    last_write_s: float
    # its pages, protected or not, in write order (its closure moves them in that order)
    keys: OrderedDict[bytes, None] = field(default_factory=OrderedDict)
    protected: int = 0


class SessionLifecycle:
    """The eviction order of one store's pages by conversation (module docstring)."""

    def __init__(
        self, config: LifecycleConfig, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.config = config
        self.clock = clock
        self._groups: dict[str, OrderedDict[bytes, None]] = {
            g: OrderedDict() for g in (PROTECTED, UNPROTECTED, CLOSED)
        }
        self._where: dict[bytes, tuple[str, str]] = {}  # key -> (group, session or "")
        self._sessions: OrderedDict[str, _Session] = OrderedDict()  # least recent write first
        self.evicted = dict.fromkeys(self._groups, 0)  # victims taken from each group
        self.sessions_closed = 0

    def __len__(self) -> int:
        return len(self._where)

    def __contains__(self, key: bytes) -> bool:
        return key in self._where

    # ---- events from the owner's index -----------------------------------------------------

    def stored(self, key: bytes, session: str = "") -> None:
        """`key` was written (or found present by a write) for `session` ("" = none)."""
        self.expire()
        where = self._where.get(key)
        if session:
            owner = self._session(session)
            if where is None or where[0] != PROTECTED:
                if where is not None:
                    self._drop(key)
                group = PROTECTED if self._may_protect(owner) else UNPROTECTED
                self._place(key, group, session)
                owner.keys[key] = None
                owner.protected += group == PROTECTED
                return
        if where is None:
            self._place(key, UNPROTECTED, "")
        else:
            self._groups[where[0]].move_to_end(key)

    def touched(self, key: bytes) -> None:
        """`key` was read (or its page refreshed without a session): LRU refresh; a closed
        session's page that is still read moves to the unprotected group."""
        where = self._where.get(key)
        if where is None:
            self._place(key, UNPROTECTED, "")
        elif where[0] == CLOSED:
            self._drop(key)
            self._place(key, UNPROTECTED, "")
        else:
            self._groups[where[0]].move_to_end(key)

    def removed(self, key: bytes) -> None:
        """`key` left the store (deleted, evicted by the owner, replaced)."""
        if key in self._where:
            self._drop(key)

    def victim(self) -> bytes | None:
        """The page to evict next (not removed: the owner evicts it and calls `removed`)."""
        self.expire()
        for group in (CLOSED, UNPROTECTED, PROTECTED):
            pages = self._groups[group]
            if pages:
                return next(iter(pages))
        return None

    def evict(self) -> bytes | None:
        """`victim()`, removed here and counted by group; None when empty."""
        key = self.victim()
        if key is not None:
            self.evicted[self._where[key][0]] += 1
            self._drop(key)
        return key

    def end_session(self, session: str) -> None:
        """The conversation is over: its pages go first from now on."""
        owner = self._sessions.pop(session, None)
        if owner is not None:
            self._close(session, owner)

    def expire(self, now_s: float | None = None) -> None:
        """Close every session without a write for `idle_s` seconds."""
        now_s = self.clock() if now_s is None else now_s
        while self._sessions:
            sid, owner = next(iter(self._sessions.items()))
            if now_s - owner.last_write_s < self.config.idle_s:
                return
            del self._sessions[sid]
            self._close(sid, owner)

    def stats(self) -> dict[str, int]:
        out = {f"{g}_pages": len(pages) for g, pages in self._groups.items()}
        out.update({f"evicted_{g}_pages": n for g, n in self.evicted.items()})
        out.update(active_sessions=len(self._sessions), closed_sessions=self.sessions_closed)
        return out

    def check(self) -> None:
        """Accounting: groups partition the keys; per-session protected counts add up."""
        assert sum(len(p) for p in self._groups.values()) == len(self._where)
        for key, (group, _) in self._where.items():
            assert key in self._groups[group], "a page is missing from its group"
        protected = sum(s.protected for s in self._sessions.values())
        assert protected == len(self._groups[PROTECTED]), "protected count drifted"
        assert protected <= self.config.protect_pages, "protection bound exceeded"

    # ---- internals ---------------------------------------------------------------------

    def _session(self, session: str) -> _Session:
        owner = self._sessions.get(session)
        if owner is None:
            owner = self._sessions[session] = _Session(self.clock())
        owner.last_write_s = self.clock()
        self._sessions.move_to_end(session)
        return owner

    def _may_protect(self, owner: _Session) -> bool:
        cap = self.config.session_cap_pages
        within_total = len(self._groups[PROTECTED]) < self.config.protect_pages
        return within_total and (cap == 0 or owner.protected < cap)

    def _place(self, key: bytes, group: str, session: str) -> None:
        self._groups[group][key] = None
        self._where[key] = (group, session)

    def _drop(self, key: bytes) -> None:
        group, session = self._where.pop(key)
        del self._groups[group][key]
        owner = self._sessions.get(session) if session else None
        if owner is not None:
            owner.keys.pop(key, None)
            owner.protected -= group == PROTECTED

    def _close(self, session: str, owner: _Session) -> None:
        self.sessions_closed += 1
        for key in owner.keys:  # oldest write first: its oldest pages go first
            group, _ = self._where[key]
            del self._groups[group][key]
            self._place(key, CLOSED, session)


@dataclass(frozen=True)
class StorageEviction:
    """The `[storage]` eviction keys, independent of a store's size: `build` makes the
    lifecycle of one store (a file directory, an hf3fs pool) from its capacity."""

    eviction: str = "lru"
    protect_share: float = 0.5  # storage.session_protect_share
    protect_bytes: int = 0  # storage.session_protect_bytes (per session; 0: no cap)
    idle_s: float = 300.0  # storage.session_idle_s

    def __post_init__(self) -> None:
        if self.eviction not in STORAGE_EVICTIONS:
            raise ValueError(
                f"storage.eviction must be one of {STORAGE_EVICTIONS}, not {self.eviction!r}"
            )
        if not 0.0 <= self.protect_share <= 1.0:
            raise ValueError(f"storage.session_protect_share = {self.protect_share}: not in [0, 1]")
        if self.protect_bytes < 0 or self.idle_s <= 0:
            raise ValueError("storage.session_protect_bytes must be >= 0, session_idle_s > 0")

    def server_argv(self) -> list[str]:
        """`pdcache metadata-server` flags of these keys (none for the defaults, so a plain
        LRU command line stays as it was)."""
        if self == StorageEviction():
            return []
        return [
            "--eviction",
            self.eviction,
            "--session-protect-share",
            repr(self.protect_share),
            "--session-protect-bytes",
            str(self.protect_bytes),
            "--session-idle-s",
            repr(self.idle_s),
        ]

    def build(
        self, capacity_pages: int, slot_bytes: int, clock: Callable[[], float] = time.monotonic
    ) -> SessionLifecycle | None:
        """The lifecycle of a store of `capacity_pages` slots of `slot_bytes` bytes; None
        for "lru". A per-session byte cap below one slot still protects one page."""
        if self.eviction == "lru":
            return None
        cap_pages = max(1, self.protect_bytes // slot_bytes) if self.protect_bytes else 0
        protect = int(capacity_pages * self.protect_share)
        return SessionLifecycle(LifecycleConfig(protect, cap_pages, self.idle_s), clock)
