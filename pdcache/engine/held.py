"""Held pages that only their holder may release.

A prefill node holds a finished request's pages while the transfer engine reads them; a
decode node while the offload manager copies them. An abort or shutdown must not free them
underneath the reader: `HeldReleaseGuard.allow(rid)` (any thread) is the holder's consent,
and `Scheduler.release_held` ignores a request without it.
"""

from __future__ import annotations

import threading


class HeldReleaseGuard:
    def __init__(self) -> None:
        self._allowed: set[str] = set()
        self._lock = threading.Lock()

    def allow(self, rid: str) -> None:
        with self._lock:
            self._allowed.add(rid)

    def take(self, rid: str) -> bool:
        """True once per `allow(rid)`."""
        with self._lock:
            if rid in self._allowed:
                self._allowed.discard(rid)
                return True
            return False
