"""When the engine thread's next decode step may start: decode pacing and compute-share yielding.

Pacing (`SchedulerConfig.decode_step_interval_ms`, docs/design.md §4.8): the next decode step
starts no sooner than that long after the last one started. Decode steps of small batches cost
nearly what large ones do (the weights are read either way), so a paced node spends less CPU
per token and leaves it to the processes it shares the host with (a co-located prefill node).
A request waiting for prefill ends the wait at once, so a unified node's TTFT does not pay for
it.

Yielding (`SchedulerConfig.compute_share`, `decode_yield_max_ms`, §4.13): while another engine
on the shared compute announces prefill work, the next decode step waits, at most
`decode_yield_max_ms`. This engine announces its own prefill work (`announce`) every loop
iteration.

While a step is held back the engine keeps handling its inbox (`Hold`): requests that arrive
join the held-back step, and pages freed go to queued reservations at once, as after a step.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Protocol

from pdcache.engine.compute_share import ComputeShare
from pdcache.engine.forward import ForwardMode
from pdcache.engine.scheduler import Scheduler
from pdcache.engine.scheduler_config import SchedulerConfig

POLL_S = 0.002  # how often a yielding hold looks at the share (and the engine's stalled poll)


class Hold(Protocol):
    """The engine's side of a hold (engine thread)."""

    def __call__(self, timeout: float) -> None:
        """Handle the inbox for at most `timeout` seconds, then grant queued reservations."""


class DecodePacer:
    """Asked by the engine thread before each step. Owns the compute share (opened by `open`,
    closed by `close`), the start time of the last decode step and the paced / yielded
    counters. Engine thread only (`open` runs on the thread calling `Engine.start()`, before
    the engine thread exists); `stats()` is read by the engine thread's snapshot."""

    def __init__(self, config: SchedulerConfig, scheduler: Scheduler, hold: Hold,
                 stopping: Callable[[], bool]) -> None:
        self.config = config
        self.scheduler = scheduler
        self._hold = hold
        self._stopping = stopping
        self.share: ComputeShare | None = None  # opened by open(), only for a threaded engine
        # monotonic; None: the last step was not decode
        self._last_decode_start: float | None = None
        self.paced_steps = 0  # decode steps held back by `decode_step_interval_ms`
        self.paced_s = 0.0  # and the time they were held back for
        self.yielded_steps = 0  # decode steps held back while another engine computed prefill
        self.yielded_s = 0.0  # and the time they were held back for

    # ---- lifecycle -----------------------------------------------------------------------
    def open(self, threaded: bool) -> None:
        """Open the compute share, if configured, for an engine with its own thread (a driven
        engine is never shared)."""
        if threaded and self.config.compute_share is not None:
            self.share = ComputeShare(self.config.compute_share)

    def close(self) -> None:
        """Drop the announcement (nothing of a stopped engine is announced). Idempotent."""
        if self.share is not None:
            self.share.close()

    def abandon(self) -> None:
        """`Engine.start()` failed after `open`: close and forget the share."""
        self.close()
        self.share = None

    # ---- before a step ---------------------------------------------------------------------
    def note_batch(self, mode: ForwardMode, started: float) -> None:
        """A batch of `mode` started at `started` (monotonic)."""
        self._last_decode_start = started if mode is ForwardMode.DECODE else None

    def pace(self) -> None:
        """With `decode_step_interval_ms`, hold the next decode step until that long after the
        last one started, while no request waits (one waiting for prefill ends the hold)."""
        interval_s = self.config.decode_step_interval_ms / 1000
        scheduler = self.scheduler
        if (interval_s <= 0 or self._last_decode_start is None or not scheduler.running
                or scheduler.waiting):
            return
        deadline = self._last_decode_start + interval_s
        started = time.monotonic()
        if started >= deadline:
            return
        self.paced_steps += 1
        self.paced_s += self._hold_until(deadline, lambda: not scheduler.waiting,
                                         poll_s=deadline - started)

    def yield_to_prefill(self) -> None:
        """With a compute share, hold the next decode step while another engine on it
        announces prefill work, at most `decode_yield_max_ms`. A unified engine puts its
        prefill batches between its decode steps; this gives prefill and decode processes on
        one compute that order."""
        share = self.share
        if share is None or not self._yield_worthwhile() or not share.others_busy():
            return
        deadline = time.monotonic() + self.config.decode_yield_max_ms / 1000
        self.yielded_steps += 1
        self.yielded_s += self._hold_until(
            deadline, lambda: self._yield_worthwhile() and share.others_busy(), poll_s=POLL_S)

    def announce(self) -> None:
        """Announce this engine's prefill work on the share. Queued prefill work counts too,
        not only the batch computing: a decode engine held back by it answers its reservations
        at once (while held, it grants them), so a request gated on its decode node (the
        prefill gate) does not wait for a decode step to end."""
        if self.share is not None:
            self.share.announce(self._prefill_pending())

    def stats(self) -> dict[str, float | int]:
        return {
            "paced_steps_total": self.paced_steps,
            "paced_seconds_total": round(self.paced_s, 6),
            "yielded_steps_total": self.yielded_steps,
            "yielded_seconds_total": round(self.yielded_s, 6),
            **(self.share.stats() if self.share is not None else {}),
        }

    # ---- internals -------------------------------------------------------------------------
    def _hold_until(self, deadline: float, keep_holding: Callable[[], bool],
                    poll_s: float) -> float:
        """Hold until `deadline` (monotonic), while `keep_holding()` and the engine is not
        stopping, handling the inbox at most `poll_s` apart; returns the seconds held."""
        started = now = time.monotonic()
        while now < deadline and keep_holding() and not self._stopping():
            self._hold(min(poll_s, deadline - now))
            now = time.monotonic()
        return now - started

    def _prefill_pending(self) -> bool:
        """A request waits, or runs with prompt tokens still to compute."""
        scheduler = self.scheduler
        return bool(scheduler.waiting) or any(not req.prefill_done for req in scheduler.running)

    def _yield_worthwhile(self) -> bool:
        """The next batch would be a decode step (requests run, none prefills), and no
        reservation waits for pages: those free only as decode steps finish requests, so a
        decode node with a full pool keeps stepping whatever prefill announces."""
        book = self.scheduler.reservations
        return (bool(self.scheduler.running) and not self._prefill_pending()
                and not (book is not None and book.pending))
