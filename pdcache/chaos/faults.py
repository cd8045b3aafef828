"""The contract every injectable fault of `pdcache chaos` implements.

A fault is one kind of trouble (`kill-prefill`, `storage-full`, ...). The harness owns one
instance per kind for the whole soak, on its scheduler thread: `prepare` runs once before the
topology is launched (mounts, namespaces, extra config), `inject`/`heal` pair up any number of
times while traffic runs (faults of different kinds may overlap; one kind never overlaps
itself), and `cleanup` runs once after the stack has stopped, whatever happened before.
"""

from __future__ import annotations

import random
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import ClassVar

from pdcache.config.schema import Topology


@dataclass
class FaultContext:
    """What a fault may touch. Built by the harness; faults read it and never replace it."""

    topology: Topology  # the topology as launched (after --set overrides)
    state_dir: Path  # the launcher's state directory (processes.json, logs, secret)
    work_dir: Path  # scratch space of this soak (mount points, control files)
    rng: random.Random  # seeded by --seed: every random choice of a fault comes from here
    say: Callable[[str], None]  # one progress line for the soak's log
    overrides: dict[str, str] = field(default_factory=dict)  # --set KEY=VALUE applied at launch


@dataclass(frozen=True)
class Injection:
    """One injected fault: which path it hurts, so the harness can time the outage on it."""

    kind: str
    target: str  # e.g. "prefill:p0", "decode:d0", "storage", "metadata", "net:p0-d0"
    detail: str = ""  # free text for the log (pid, bytes flipped, ...)


class Fault(ABC):
    """One kind of fault. Subclasses set `kind` and implement `inject` and `heal`."""

    kind: ClassVar[str]

    def unavailable(self, ctx: FaultContext) -> str | None:
        """Why this fault cannot run on this machine (no root, no netns, ...), or None."""
        return None

    def prepare(self, ctx: FaultContext) -> dict[str, str]:
        """Before launch: set up what the fault needs; returns extra `--set` overrides."""
        return {}

    @abstractmethod
    def inject(self, ctx: FaultContext) -> Injection:
        """Start the fault now; return what it hurts."""

    @abstractmethod
    def heal(self, ctx: FaultContext) -> None:
        """End the fault this instance injected last (a no-op for faults that heal by restart)."""

    def cleanup(self, ctx: FaultContext) -> None:
        """After the stack stopped: undo everything `prepare` did (unmount, delete namespaces)."""
        return None
