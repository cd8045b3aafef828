"""Every fault kind `pdcache chaos --faults` knows: `FAULTS`, kind -> Fault class.

The process faults (`process_faults`), the leader faults of a replicated store
(`leader_faults`), the storage faults (`storage_faults`) and the network
faults (`net_faults`) each export a table of their kinds; this joins them, refusing a kind
named twice. Whether a kind can run on this machine and topology is each fault's own
`unavailable(ctx)`, asked by the harness before the soak.
"""

from __future__ import annotations

from collections.abc import Iterable

from pdcache.chaos.faults import Fault
from pdcache.chaos.leader_faults import LEADER_FAULTS
from pdcache.chaos.net_faults import NET_FAULTS
from pdcache.chaos.process_faults import PROCESS_FAULTS
from pdcache.chaos.storage_faults import STORAGE_FAULTS


def _registry(classes: Iterable[type[Fault]]) -> dict[str, type[Fault]]:
    out: dict[str, type[Fault]] = {}
    for cls in classes:
        if cls.kind in out:
            raise ValueError(f"two faults of kind {cls.kind!r}: {out[cls.kind]} and {cls}")
        out[cls.kind] = cls
    return out


FAULTS: dict[str, type[Fault]] = _registry(
    [*PROCESS_FAULTS, *LEADER_FAULTS, *STORAGE_FAULTS.values(), *NET_FAULTS.values()]
)


def parse_fault_list(text: str) -> list[str]:
    """`--faults`: `all` or kinds separated by commas; ValueError names unknown kinds."""
    if text.strip() == "all":
        return list(FAULTS)
    kinds = [k.strip() for k in text.split(",") if k.strip()]
    unknown = [k for k in kinds if k not in FAULTS]
    if unknown or not kinds:
        raise ValueError(
            f"unknown fault kind(s) {', '.join(unknown) or '(none given)'}; "
            f"known: {', '.join(FAULTS)}"
        )
    return list(dict.fromkeys(kinds))
