"""The simulator's clock: a heap of timed callbacks, run in time order.

Deterministic by construction: events at the same instant run in the order they were
scheduled (a sequence number breaks ties), nothing reads the wall clock, nothing runs on
another thread.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable

Action = Callable[[], None]


class EventLoop:
    """Owns the simulated time `now` and the pending events; `run` pops them in order."""

    def __init__(self) -> None:
        self.now = 0.0
        self._heap: list[tuple[float, int, Action]] = []
        self._order = itertools.count()
        self.events_run = 0

    def at(self, when: float, action: Action) -> None:
        """Run `action` at simulated time `when` (never before now)."""
        heapq.heappush(self._heap, (max(when, self.now), next(self._order), action))

    def after(self, delay_s: float, action: Action) -> None:
        self.at(self.now + delay_s, action)

    def clock(self) -> float:
        """The simulated time, as a clock callable (the session tracker's)."""
        return self.now

    def run(self, on_event: Callable[[], None] | None = None) -> None:
        """Run every event, including those the events schedule, until none is left."""
        while self._heap:
            when, _, action = heapq.heappop(self._heap)
            self.now = when
            action()
            self.events_run += 1
            if on_event is not None:
                on_event()
