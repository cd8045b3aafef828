"""Eviction policies of the cache tiers: which unlocked leaf of a prefix tree goes first.

A policy turns a node into a sort key (lower = evicted first); the device tree
(`RadixTree.evict`) and the host tier (`HiRadixTree.evict_host`) pop leaves in key order.
`EvictionPolicy.key_fn()` is called once per eviction pass, so a policy may snapshot the
time once and rank every candidate against the same instant; a policy with `stable_keys` (a
key that only the node's own fields decide: `lru`) lets the device tree keep its ranked leaves
across passes instead (same order, ranked once per leaf).

- `lru`: least recently used first (the tree's logical access clock); the default.
- `session`: uses what the node learns from the requests it serves (`session_id` and turn
  arrivals, `SessionTracker`). Pages of closed sessions go first (LRU among them), then pages
  of no known session (LRU), then pages of active sessions, the one whose next turn is
  *farthest* from now first. A session's expected return is its last turn plus its mean
  inter-turn gap, measured in turns served by this node (a logical clock: deterministic, and
  independent of how fast the node runs); one overdue by d turns counts as d turns away, so a
  conversation that ended without saying so sinks as its turns fail to come. A session is
  closed after `idle_s` seconds without a turn, or by `end`.

Threading: policies and the tracker are engine-thread only, like the trees that call them.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from pdcache.engine.radix import RadixNode

EVICTION_POLICIES = ("lru", "session")

EvictKey = tuple[float, ...]


class EvictionPolicy(Protocol):
    """Ranks evictable nodes; lower keys are evicted first."""

    name: str
    # a node's key changes only when the tree touches the node (its own fields): a tree may
    # then keep its ranked leaves across passes instead of ranking all of them per pass
    stable_keys: bool

    def key_fn(self) -> Callable[[RadixNode], EvictKey]: ...


class LruPolicy:
    """Least recently used first (`RadixNode.last_access`, the tree's logical clock)."""

    name = "lru"
    stable_keys = True  # `last_access` only

    def key_fn(self) -> Callable[[RadixNode], EvictKey]:
        return lambda node: (float(node.last_access),)


@dataclass
class _Session:
    last_turn: int  # the tracker's turn clock at this session's last turn
    last_seen_s: float  # the wall clock (tracker's `clock`) at that turn
    gaps: int = 0  # turn gaps observed
    gap_sum: int = 0
    ended: bool = False

    def mean_gap(self) -> float | None:
        return self.gap_sum / self.gaps if self.gaps else None


class SessionTracker:
    """What a node knows of its conversations: per `session_id`, when its turns arrived (in
    turns served by this node, and in seconds for the idle timeout) and whether it ended.

    Bounded: at most `max_sessions` are remembered; the least recently seen are forgotten
    first (a forgotten session's pages rank like pages of no session)."""

    def __init__(
        self,
        idle_s: float = 300.0,
        max_sessions: int = 65536,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if idle_s <= 0:
            raise ValueError("session idle timeout must be > 0")
        self.idle_s = idle_s
        self.max_sessions = max_sessions
        self.clock = clock
        self.turns = 0  # turns observed, all sessions (the logical clock)
        self._sessions: OrderedDict[str, _Session] = OrderedDict()
        self._gap_sum = 0
        self._gaps = 0

    def __len__(self) -> int:
        return len(self._sessions)

    def observe_turn(self, session_id: str) -> None:
        """A turn of `session_id` arrived (a request of it was admitted)."""
        if not session_id:
            return
        self.turns += 1
        now_s = self.clock()
        session = self._sessions.get(session_id)
        if session is None:
            self._sessions[session_id] = _Session(self.turns, now_s)
            while len(self._sessions) > self.max_sessions:
                self._sessions.popitem(last=False)
            return
        gap = self.turns - session.last_turn
        session.gaps, session.gap_sum = session.gaps + 1, session.gap_sum + gap
        self._gaps, self._gap_sum = self._gaps + 1, self._gap_sum + gap
        session.last_turn, session.last_seen_s, session.ended = self.turns, now_s, False
        self._sessions.move_to_end(session_id)

    def num_turns(self, session_id: str) -> int:
        """Turns of `session_id` this node has served (0: unknown or forgotten)."""
        session = self._sessions.get(session_id)
        return session.gaps + 1 if session is not None else 0

    def end(self, session_id: str) -> None:
        """The client said the conversation is over: its pages go first from now on."""
        session = self._sessions.get(session_id)
        if session is not None:
            session.ended = True

    def is_active(self, session_id: str, now_s: float | None = None) -> bool:
        session = self._sessions.get(session_id)
        if session is None or session.ended:
            return False
        now_s = self.clock() if now_s is None else now_s
        return now_s - session.last_seen_s < self.idle_s

    def expected_return(self, session_id: str) -> float:
        """Turn clock at which the session's next turn is expected: its last turn plus its mean
        gap (or the mean gap of all sessions while it has only one turn)."""
        session = self._sessions[session_id]
        gap = session.mean_gap()
        if gap is None:
            gap = self._gap_sum / self._gaps if self._gaps else 0.0
        return session.last_turn + gap


class SessionPolicy:
    """Closed sessions first, then no session, then active sessions whose next turn is farthest
    from now (ahead, or overdue)."""

    name = "session"
    stable_keys = False  # the tracker's clock and sessions move every key

    def __init__(self, tracker: SessionTracker) -> None:
        self.tracker = tracker

    def key_fn(self) -> Callable[[RadixNode], EvictKey]:
        tracker = self.tracker
        now_s, now_turn = tracker.clock(), tracker.turns

        def key(node: RadixNode) -> EvictKey:
            sid = node.session_id
            if not sid:
                return (1.0, 0.0, float(node.last_access))
            if not tracker.is_active(sid, now_s):
                return (0.0, 0.0, float(node.last_access))
            # how far the next turn is from now, either way: a session overdue by d turns
            # ranks as one expected back d turns ahead, so one that stopped without saying so
            # (a finished conversation) sinks below the live ones as its turns fail to come,
            # instead of being kept longest for having been due first
            distance = abs(tracker.expected_return(sid) - now_turn)
            return (2.0, -distance, float(node.last_access))

        return key


def make_policy(name: str, tracker: SessionTracker | None = None) -> EvictionPolicy:
    """The policy called `name` (one of `EVICTION_POLICIES`); `session` needs the tracker
    shared by the node's tiers."""
    if name == "lru":
        return LruPolicy()
    if name == "session":
        if tracker is None:
            raise ValueError("the session eviction policy needs a SessionTracker")
        return SessionPolicy(tracker)
    raise ValueError(f"eviction policy must be one of {EVICTION_POLICIES}, not {name!r}")
