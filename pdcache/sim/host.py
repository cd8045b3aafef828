"""Work on the simulated hosts: a fixed delay on compute of its own, or a processor-shared
host whose cores every job running on it divides.

A local topology runs every node, the router and the client on one machine's cores. Work
there is a *job* of `work_s` seconds at full speed: a node's step, a request's trip through
the router, the decode side's handoff, the router's and the client's relay of streamed
tokens. While n jobs run on a host of S slots (its cores over the threads a node computes
with), each progresses at min(1, S / n) of full speed, re-shared at every start and end
(processor sharing): a step that starts alone and is joined by two others slows down from
then on, and speeds up again when they end. On a host with compute of its own (S = 0, the
nodes of a planned cluster) a job takes exactly its `work_s`.

Deterministic: jobs are ordered by start sequence, the next completion is the one event a
host keeps pending (stale ones are dropped by generation), nothing reads the wall clock.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass

from pdcache.sim.events import EventLoop

Action = Callable[[], None]

# remaining work below this counts as done (float error of the rate arithmetic)
_DONE_EPS_S = 1e-12


@dataclass
class _Job:
    remaining_s: float
    done: Action | None


class SharedHost:
    """`slots` cores shared by the jobs running on them (processor sharing); owns its jobs
    and keeps at most one completion event pending on `loop`."""

    def __init__(self, loop: EventLoop, slots: int) -> None:
        if slots < 1:
            raise ValueError(f"a shared host needs at least one slot, got {slots}")
        self.loop = loop
        self.slots = slots
        self._jobs: dict[int, _Job] = {}
        self._seq = itertools.count()
        self._since = 0.0  # when the jobs' remaining work was last brought up to date
        self._generation = 0  # the pending completion event's; older ones are stale
        self.busy_s = 0.0  # time with at least one job running
        self.work_s = 0.0  # work done (full-speed seconds), every job's

    @property
    def running(self) -> int:
        return len(self._jobs)

    def rate(self) -> float:
        """The speed each running job progresses at now (1 = full speed)."""
        return min(1.0, self.slots / len(self._jobs)) if self._jobs else 1.0

    def run(self, work_s: float, done: Action | None = None) -> None:
        """Start a job of `work_s` full-speed seconds now; `done()` runs when it completes
        (a job of no work completes at once, after the events of this instant)."""
        self._advance()
        self._jobs[next(self._seq)] = _Job(max(work_s, 0.0), done)
        self._schedule()

    def _advance(self) -> None:
        """Charge the time since `_since` to every running job at the rate that held."""
        now = self.loop.now
        elapsed = now - self._since
        self._since = now
        if elapsed <= 0 or not self._jobs:
            return
        progress = elapsed * self.rate()
        self.busy_s += elapsed
        for job in self._jobs.values():
            step = min(progress, job.remaining_s)
            job.remaining_s -= step
            self.work_s += step

    def _schedule(self) -> None:
        self._generation += 1
        if not self._jobs:
            return
        generation = self._generation
        soonest = min(job.remaining_s for job in self._jobs.values())
        self.loop.at(self.loop.now + soonest / self.rate(), lambda: self._complete(generation))

    def _complete(self, generation: int) -> None:
        if generation != self._generation:
            return  # the set of jobs changed since: a newer event is pending
        self._advance()
        now, rate = self.loop.now, self.rate()
        # done: no work left, or so little that its end is `now` at this clock's float
        # resolution (past ~16,000 s of simulated time a leftover of 1e-12 s never ended:
        # its completion event landed on `now` again and again, for good)
        finished = [key for key, job in self._jobs.items()
                    if job.remaining_s <= _DONE_EPS_S or now + job.remaining_s / rate <= now]
        actions = [self._jobs.pop(key).done for key in finished]
        self._schedule()
        for action in actions:
            if action is not None:
                action()


class OwnCompute:
    """A host whose every job runs at full speed: `work_s` later, whatever else runs."""

    def __init__(self, loop: EventLoop) -> None:
        self.loop = loop

    def run(self, work_s: float, done: Action | None = None) -> None:
        if done is not None:
            self.loop.after(max(work_s, 0.0), done)
