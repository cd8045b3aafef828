"""Process faults of `pdcache chaos`: SIGKILL of a node or service (the launcher restarts
it) and SIGSTOP of a node past the transfer heartbeat deadline (SIGCONT in `heal`).

Targets are found in the launcher's `processes.json` (in `FaultContext.state_dir`): the pid of
every process, its role and its state. A process is a target only while the launcher calls it
`healthy`; `ready()` says whether one is (the scheduler holds an injection back until then, so
a kill never hits a process that is still restarting). Every choice among targets comes from
`ctx.rng`, over targets sorted by name, so a seed names the same victims.
"""

from __future__ import annotations

import json
import os
import signal
from dataclasses import dataclass
from typing import Any, ClassVar

from pdcache.chaos.faults import Fault, FaultContext, Injection
from pdcache.config.node_setup import transfer_from_spec

PROCESSES_FILE = "processes.json"
FREEZE_MARGIN_S = 3.0  # a frozen node stays stopped this long past its peers' heartbeat deadline


@dataclass(frozen=True)
class Target:
    """One process of the launcher's table."""

    name: str
    role: str
    pid: int


def healthy_targets(ctx: FaultContext, roles: tuple[str, ...]) -> list[Target]:
    """The launcher's healthy processes of `roles`, sorted by name ([] before launch)."""
    try:
        table: dict[str, Any] = json.loads((ctx.state_dir / PROCESSES_FILE).read_text())
    except (OSError, ValueError):  # not written yet, or being replaced
        return []
    found = [
        Target(p["name"], p["role"], int(p["pid"]))
        for p in table.get("processes", [])
        if p.get("role") in roles and p.get("state") == "healthy" and p.get("pid")
    ]
    return sorted(found, key=lambda t: t.name)


def target_label(target: Target) -> str:
    """`Injection.target` of a process: `prefill:p0`, `decode:d0`, or the service's role."""
    return f"{target.role}:{target.name}" if target.role in ("prefill", "decode") else target.role


class KillProcess(Fault):
    """SIGKILL one healthy process of `roles`; it heals by the launcher's restart."""

    roles: ClassVar[tuple[str, ...]]

    def unavailable(self, ctx: FaultContext) -> str | None:
        if not self.runs_in(ctx):
            return f"the topology starts no {'/'.join(self.roles)} process"
        return None

    def runs_in(self, ctx: FaultContext) -> bool:
        return any(n.role in self.roles for n in ctx.topology.nodes)

    def ready(self, ctx: FaultContext) -> bool:
        return bool(healthy_targets(ctx, self.roles))

    def inject(self, ctx: FaultContext) -> Injection:
        targets = healthy_targets(ctx, self.roles)
        if not targets:
            raise RuntimeError(f"no healthy {'/'.join(self.roles)} process to kill")
        victim = ctx.rng.choice(targets)
        os.kill(victim.pid, signal.SIGKILL)
        return Injection(self.kind, target_label(victim), f"SIGKILL {victim.name} pid {victim.pid}")

    def heal(self, ctx: FaultContext) -> None:
        return None  # the launcher restarts the process


class KillPrefill(KillProcess):
    kind = "kill-prefill"
    roles = ("prefill",)


class KillDecode(KillProcess):
    kind = "kill-decode"
    roles = ("decode",)


class KillMetadata(KillProcess):
    kind = "kill-metadata"
    roles = ("metadata",)

    def runs_in(self, ctx: FaultContext) -> bool:
        storage = ctx.topology.storage
        return storage.uses_metadata_service and storage.metadata_service.start


class KillMooncakeMaster(KillProcess):
    kind = "kill-mooncake-master"
    roles = ("mooncake_master",)

    def runs_in(self, ctx: FaultContext) -> bool:
        storage = ctx.topology.storage
        return storage.backend == "mooncake" and storage.mooncake.start_master


class FreezeNode(Fault):
    """SIGSTOP one prefill or decode node's process group for `min_hold_s` (its peers' heartbeat
    deadline + FREEZE_MARGIN_S) or the scheduler's longer hold; SIGCONT in `heal`."""

    kind = "freeze-node"
    roles = ("prefill", "decode")

    def __init__(self) -> None:
        self._frozen: Target | None = None

    def unavailable(self, ctx: FaultContext) -> str | None:
        if not any(n.role in self.roles for n in ctx.topology.nodes):
            return "the topology has no prefill or decode node"
        return None

    def min_hold_s(self, ctx: FaultContext) -> float:
        """The longest heartbeat deadline of the topology's PD nodes + FREEZE_MARGIN_S: peers
        declare the frozen node dead before it wakes."""
        deadlines = [
            transfer_from_spec(ctx.topology.transfer, n).peer_dead_after_s
            for n in ctx.topology.nodes
            if n.role in self.roles
        ]
        return max(deadlines, default=0.0) + FREEZE_MARGIN_S

    def ready(self, ctx: FaultContext) -> bool:
        return bool(healthy_targets(ctx, self.roles))

    def inject(self, ctx: FaultContext) -> Injection:
        targets = healthy_targets(ctx, self.roles)
        if not targets:
            raise RuntimeError("no healthy prefill/decode node to freeze")
        victim = ctx.rng.choice(targets)
        os.killpg(victim.pid, signal.SIGSTOP)  # the launcher starts each node as a group leader
        self._frozen = victim
        return Injection(self.kind, target_label(victim), f"SIGSTOP {victim.name} pid {victim.pid}")

    def heal(self, ctx: FaultContext) -> None:
        victim, self._frozen = self._frozen, None
        if victim is not None:
            _continue(victim)

    def cleanup(self, ctx: FaultContext) -> None:
        self.heal(ctx)  # never leave a stopped process behind


def _continue(target: Target) -> None:
    try:
        os.killpg(target.pid, signal.SIGCONT)
    except ProcessLookupError:
        pass  # killed meanwhile (a kill fault, or the launcher's stop)


PROCESS_FAULTS: tuple[type[Fault], ...] = (
    KillPrefill,
    KillDecode,
    KillMetadata,
    KillMooncakeMaster,
    FreezeNode,
)
