"""When faults strike: a seeded plan (`plan_faults`, pure) and the thread that carries it out
(`FaultScheduler`, owned by the soak).

The plan: arrivals of a Poisson process (exponential gaps of mean `mean_gap_s`) from
`warmup_s` to `duration_s - quiet_tail_s` (the tail lets the last faults' outages end while
traffic still runs, so each one's error window is measured). Each arrival takes a kind that is
not active then, each held a uniform time in `hold_s` (at least the kind's own minimum, e.g.
freeze-node's heartbeat deadline). Before those, a first round injects every kind once, in a
seeded order, one in each of `len(kinds)` equal slots of the span `min(window, len(kinds) *
mean_gap_s)` at a seeded point of its slot: even a short soak injects every kind. Kinds overlap freely; a kind
never overlaps itself. The same arguments give the same plan.

The scheduler injects each planned fault at its time, once the fault is `ready()` (a kill
waits until the launcher reports its target healthy again; while it waits it is `deferred`),
and heals it `hold_s` after the injection. `stop()` heals whatever is active. Every fault
call runs on the scheduler's thread; a fault that raises is recorded (`error`), never fatal.
"""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from pdcache.chaos.faults import Fault, FaultContext, Injection

READY_POLL_S = 0.5  # how often a deferred injection asks its fault again


@dataclass(frozen=True)
class PlannedFault:
    at_s: float  # seconds from the soak's start
    kind: str
    hold_s: float


@dataclass(frozen=True)
class PlanSettings:
    duration_s: float
    mean_gap_s: float = 8.0
    hold_s: tuple[float, float] = (2.0, 8.0)
    warmup_s: float = 5.0
    quiet_tail_s: float = 20.0


def plan_faults(
    kinds: Sequence[str],
    seed: int,
    settings: PlanSettings,
    min_hold_s: Mapping[str, float] | None = None,
) -> list[PlannedFault]:
    """The soak's faults, sorted by time (module docstring)."""
    rng = random.Random(f"pdcache-chaos-plan:{seed}")
    floors = min_hold_s or {}
    start, end = settings.warmup_s, settings.duration_s - settings.quiet_tail_s
    if not kinds or end <= start:
        return []
    busy_until = dict.fromkeys(kinds, float("-inf"))
    plan: list[PlannedFault] = []

    def add(t: float, kind: str) -> None:
        hold = max(rng.uniform(*settings.hold_s), floors.get(kind, 0.0))
        plan.append(PlannedFault(round(t, 3), kind, round(hold, 3)))
        busy_until[kind] = t + hold

    # first round: every kind once, in a seeded order, one per slot of the round's span
    first_round = list(kinds)
    rng.shuffle(first_round)
    span = min(end - start, len(kinds) * settings.mean_gap_s)
    for i, kind in enumerate(first_round):
        add(start + (i + rng.random()) * span / len(kinds), kind)
    t = start + span
    while True:  # then Poisson arrivals of kinds not active at the time
        t += rng.expovariate(1.0 / settings.mean_gap_s)
        free = [k for k in kinds if busy_until[k] <= t]
        if not free:
            t = min(busy_until.values())
            free = [k for k in kinds if busy_until[k] <= t]
        if t >= end:
            return plan
        add(t, rng.choice(free))


@dataclass
class FaultRecord:
    """One planned fault as it went: injected (and healed) or not, and why."""

    kind: str
    planned_at_s: float
    hold_s: float
    injected_at_s: float | None = None
    healed_at_s: float | None = None
    target: str = ""
    detail: str = ""
    error: str = ""  # inject or heal raised (text of the exception)
    deferred_s: float = 0.0  # waited this long for the fault to be ready
    overlapped: list[str] = field(default_factory=list)  # kinds active when it was injected

    def as_json(self) -> dict[str, Any]:
        return asdict(self)


class FaultScheduler:
    """Carries out a plan on its own thread. Owns the fault instances' calls (inject, heal)
    while running and the records; `clock()` is seconds since the soak's start."""

    def __init__(
        self,
        plan: Sequence[PlannedFault],
        faults: Mapping[str, Fault],
        ctx: FaultContext,
        clock: Callable[[], float],
        max_defer_s: float = 120.0,
    ) -> None:
        self.faults = faults
        self.ctx = ctx
        self.clock = clock
        self.max_defer_s = max_defer_s
        self.records = [FaultRecord(p.kind, p.at_s, p.hold_s) for p in plan]
        self._pending = list(self.records)
        self._active: dict[str, FaultRecord] = {}
        self._lock = threading.Lock()  # guards _active for readers on other threads
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="chaos-faults", daemon=True)
        self._thread.start()

    def stop(self, timeout_s: float = 60.0) -> None:
        """No more injections; heal what is active (on the scheduler's thread) and join."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout_s)

    def active_kinds(self) -> list[str]:
        with self._lock:
            return sorted(self._active)

    # ---- the thread

    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                now = self.clock()
                self._heal_due(now)
                self._inject_due(now)
                self._stop.wait(self._next_wake(self.clock()))
        finally:
            for kind in list(self._active):
                self._heal(kind)

    def _next_wake(self, now: float) -> float:
        times = [
            r.injected_at_s + r.hold_s for r in self._active.values() if r.injected_at_s is not None
        ]
        times += [r.planned_at_s for r in self._pending]
        if not times:
            return 1.0
        return min(max(min(times) - now, 0.0), READY_POLL_S)

    def _heal_due(self, now: float) -> None:
        for kind, rec in list(self._active.items()):
            if rec.injected_at_s is not None and now >= rec.injected_at_s + rec.hold_s:
                self._heal(kind)

    def _inject_due(self, now: float) -> None:
        for rec in [r for r in self._pending if r.planned_at_s <= now]:
            fault = self.faults[rec.kind]
            if rec.kind in self._active or not _ready(fault, self.ctx):
                rec.deferred_s = round(now - rec.planned_at_s, 3)
                if rec.deferred_s > self.max_defer_s:
                    rec.error = f"not ready within {self.max_defer_s:.0f}s: skipped"
                    self._pending.remove(rec)
                continue
            self._pending.remove(rec)
            self._inject(rec, fault)

    def _inject(self, rec: FaultRecord, fault: Fault) -> None:
        rec.overlapped = self.active_kinds()
        try:
            injection: Injection = fault.inject(self.ctx)
        except Exception as exc:  # noqa: BLE001 - a fault that fails is recorded, not fatal
            rec.error = f"inject: {type(exc).__name__}: {exc}"
            self.ctx.say(f"{rec.kind}: inject failed: {exc}")
            return
        rec.injected_at_s = round(self.clock(), 3)
        rec.target, rec.detail = injection.target, injection.detail
        with self._lock:
            self._active[rec.kind] = rec
        self.ctx.say(
            f"t={rec.injected_at_s:.1f}s inject {rec.kind} on {rec.target} "
            f"({rec.detail}); hold {rec.hold_s:.1f}s"
        )

    def _heal(self, kind: str) -> None:
        rec = self._active[kind]
        try:
            self.faults[kind].heal(self.ctx)
        except Exception as exc:  # noqa: BLE001
            rec.error = f"heal: {type(exc).__name__}: {exc}"
            self.ctx.say(f"{kind}: heal failed: {exc}")
        rec.healed_at_s = round(self.clock(), 3)
        with self._lock:
            del self._active[kind]
        self.ctx.say(f"t={rec.healed_at_s:.1f}s heal {kind}")


def _ready(fault: Fault, ctx: FaultContext) -> bool:
    """A fault may say it cannot strike now (`ready(ctx) -> bool`, e.g. its target is
    restarting); one without the method is always ready."""
    ready = getattr(fault, "ready", None)
    return True if ready is None else bool(ready(ctx))


def min_holds(faults: Mapping[str, Fault], ctx: FaultContext) -> dict[str, float]:
    """Each fault's own shortest hold (`min_hold_s(ctx) -> float`, optional)."""
    out = {}
    for kind, fault in faults.items():
        floor = getattr(fault, "min_hold_s", None)
        if floor is not None:
            out[kind] = float(floor(ctx))
    return out


def wall_clock(t0: float | None = None) -> Callable[[], float]:
    start = time.monotonic() if t0 is None else t0
    return lambda: time.monotonic() - start
