"""Leader faults of `pdcache chaos` for a replicated metadata store (`[storage.etcd]`,
docs/design.md §4.4): the leader of the etcd cluster, or the leading metadata-server replica,
is killed (SIGKILL; the launcher restarts it) or frozen (SIGSTOP past its lease; SIGCONT in
`heal`). Each finds its victim by asking the members who leads now — etcd's
`/maintenance/status`, the replicas' authenticated `health` — among the launcher's healthy
processes, so a seed names the same kind of victim whichever process happens to lead.
"""

from __future__ import annotations

import os
import signal
from typing import ClassVar

from pdcache.chaos.faults import Fault, FaultContext, Injection
from pdcache.chaos.process_faults import Target, healthy_targets
from pdcache.config.schema import split_host_port
from pdcache.offload_manager.storage.etcd_cluster import ELECTION_MS, leading_member
from pdcache.offload_manager.storage.metadata import leading_replica

FREEZE_MARGIN_S = 3.0  # a frozen leader stays stopped this long past the point it lost the lead


def etcd_leader(ctx: FaultContext) -> Target | None:
    """The launcher's healthy etcd member that leads the cluster now, or None."""
    targets = {t.name: t for t in healthy_targets(ctx, ("etcd",))}
    members = [targets.get(f"etcd-{i}") for i in range(len(ctx.topology.storage.etcd.endpoints))]
    index = leading_member([split_host_port(e) if member else None
                            for e, member in zip(ctx.topology.storage.etcd.endpoints, members)])
    return None if index is None else members[index]


def metadata_leader(ctx: FaultContext) -> Target | None:
    """The launcher's healthy metadata replica whose `health` says it leads, or None."""
    from pdcache.offload_manager.storage.metadata_service import metadata_key

    secret = ctx.topology.security.secret_file
    auth_key = metadata_key(secret) if secret else None
    addresses = ctx.topology.storage.metadata_addresses
    targets = {t.name: t for t in healthy_targets(ctx, ("metadata",))}
    members = [targets.get("metadata" if len(addresses) == 1 else f"metadata-{i}")
               for i in range(len(addresses))]
    index = leading_replica([f"tcp://{host}:{port}" if member else None
                             for (host, port), member in zip(addresses, members)], 1.0, auth_key)
    return None if index is None else members[index]


class LeaderFault(Fault):
    """Kill or freeze whichever process leads (`_leader`); the base of the four kinds."""

    freeze: ClassVar[bool]
    what: ClassVar[str]

    def __init__(self) -> None:
        self._frozen: Target | None = None

    def unavailable(self, ctx: FaultContext) -> str | None:
        storage = ctx.topology.storage
        if self.what == "etcd" and not (storage.uses_etcd and storage.etcd.start):
            return "the topology starts no etcd members ([storage.etcd] start = true)"
        if self.what == "metadata" and not (storage.uses_etcd and storage.uses_metadata_service
                                            and storage.metadata_service.start):
            return ("the topology starts no replicated hf3fs metadata "
                    "([storage.metadata_service] store = \"etcd\")")
        return None

    def _leader(self, ctx: FaultContext) -> Target | None:
        return etcd_leader(ctx) if self.what == "etcd" else metadata_leader(ctx)

    def ready(self, ctx: FaultContext) -> bool:
        return self._leader(ctx) is not None

    def inject(self, ctx: FaultContext) -> Injection:
        victim = self._leader(ctx)
        if victim is None:
            raise RuntimeError(f"no healthy {self.what} leader to {self.kind.split('-')[0]}")
        if self.freeze:
            os.killpg(victim.pid, signal.SIGSTOP)  # the launcher starts each as a group leader
            self._frozen = victim
        else:
            os.kill(victim.pid, signal.SIGKILL)
        verb = "SIGSTOP" if self.freeze else "SIGKILL"
        return Injection(self.kind, "metadata", f"{verb} {victim.name} pid {victim.pid}")

    def heal(self, ctx: FaultContext) -> None:
        victim, self._frozen = self._frozen, None
        if victim is not None:
            try:
                os.killpg(victim.pid, signal.SIGCONT)
            except ProcessLookupError:
                pass  # killed meanwhile

    def cleanup(self, ctx: FaultContext) -> None:
        self.heal(ctx)  # never leave a stopped process behind


class KillStoreLeader(LeaderFault):
    kind = "kill-store-leader"
    freeze, what = False, "etcd"


class FreezeStoreLeader(LeaderFault):
    kind = "freeze-store-leader"
    freeze, what = True, "etcd"

    def min_hold_s(self, ctx: FaultContext) -> float:
        """Past etcd's election: the other members elect a leader before it wakes."""
        return 3 * ELECTION_MS / 1000 + FREEZE_MARGIN_S


class KillMetadataLeader(LeaderFault):
    kind = "kill-metadata-leader"
    freeze, what = False, "metadata"


class FreezeMetadataLeader(LeaderFault):
    kind = "freeze-metadata-leader"
    freeze, what = True, "metadata"

    def min_hold_s(self, ctx: FaultContext) -> float:
        """Past its lease: a standby leads before it wakes (and it must step down)."""
        return ctx.topology.storage.metadata_service.lease_ttl_s + FREEZE_MARGIN_S


LEADER_FAULTS: tuple[type[Fault], ...] = (
    KillStoreLeader, FreezeStoreLeader, KillMetadataLeader, FreezeMetadataLeader)
