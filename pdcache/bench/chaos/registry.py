"""Every fault kind `pdcache bench chaos --faults` knows: `FAULTS`, kind -> Fault class.

The process faults are always here. The storage and network faults live in their own modules
(`storage_faults`, `net_faults`), each exporting a tuple of Fault classes named in
`FAULT_MODULES`; a module that is not there (not merged yet) is skipped, so the registry
works with whatever exists. A module that exists but fails to import is an error (a broken
fault must not silently vanish from a soak).
"""

from __future__ import annotations

import importlib
from collections.abc import Iterable

from pdcache.bench.chaos.faults import Fault
from pdcache.bench.chaos.process_faults import PROCESS_FAULTS

# module -> the name of its tuple of Fault classes
FAULT_MODULES: dict[str, str] = {
    "pdcache.bench.chaos.storage_faults": "STORAGE_FAULTS",
    "pdcache.bench.chaos.net_faults": "NET_FAULTS",
}


def _optional_faults(module: str, attribute: str) -> tuple[type[Fault], ...]:
    try:
        mod = importlib.import_module(module)
    except ModuleNotFoundError as exc:
        if exc.name == module:
            return ()
        raise
    return tuple(getattr(mod, attribute))


def _registry(classes: Iterable[type[Fault]]) -> dict[str, type[Fault]]:
    out: dict[str, type[Fault]] = {}
    for cls in classes:
        if cls.kind in out:
            raise ValueError(f"two faults of kind {cls.kind!r}: {out[cls.kind]} and {cls}")
        out[cls.kind] = cls
    return out


FAULTS: dict[str, type[Fault]] = _registry(
    [*PROCESS_FAULTS, *(c for m, a in FAULT_MODULES.items() for c in _optional_faults(m, a))]
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
