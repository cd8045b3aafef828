"""Exact token history per session, so turn t+1's input is turn t's input ids + output ids +
the new message's tokens: no re-tokenisation drift can break the page-key chain."""

from __future__ import annotations

import time
from collections import OrderedDict
from dataclasses import dataclass, field


@dataclass
class Session:
    token_ids: list[int] = field(default_factory=list)
    turns: int = 0
    last_used: float = field(default_factory=time.monotonic)


class SessionStore:
    """LRU map session_id → Session, bounded in count and idle time.

    Used from the router's event loop only. A turn is committed only when it finished
    successfully, so a failed turn can be retried from the same history.
    """

    def __init__(self, max_sessions: int = 10_000, idle_ttl_s: float = 3600.0) -> None:
        self.max_sessions = max_sessions
        self.idle_ttl_s = idle_ttl_s
        self._sessions: OrderedDict[str, Session] = OrderedDict()

    def history(self, session_id: str) -> list[int]:
        self._expire()
        session = self._sessions.get(session_id)
        return list(session.token_ids) if session else []

    def commit(self, session_id: str, input_ids: list[int], output_ids: list[int]) -> None:
        """Record a finished turn: the session's history becomes input_ids + output_ids."""
        session = self._sessions.pop(session_id, None) or Session()
        session.token_ids = list(input_ids) + list(output_ids)
        session.turns += 1
        session.last_used = time.monotonic()
        self._sessions[session_id] = session
        while len(self._sessions) > self.max_sessions:
            self._sessions.popitem(last=False)

    def turns(self, session_id: str) -> int:
        session = self._sessions.get(session_id)
        return session.turns if session else 0

    def __len__(self) -> int:
        return len(self._sessions)

    def _expire(self) -> None:
        now = time.monotonic()
        while self._sessions:
            sid, oldest = next(iter(self._sessions.items()))
            if now - oldest.last_used <= self.idle_ttl_s:
                break
            del self._sessions[sid]
