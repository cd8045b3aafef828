"""The verdict of a soak, from what it recorded: pure functions, no I/O.

`verdict(...)` turns the attempts (`AttemptRecord`), the fault records, the oracle's report and
each node's idle accounting into the numbers of the table and JSON; `broken_invariants` names
every invariant that does not hold (the command exits 1 when there is any):

- `wrong_tokens == 0`: every successful answer equals the oracle's, token for token;
- `oracle_pending == 0` and no oracle error: every success was checked;
- `unanswered == 0`: every attempt got an answer (success or error) within its deadline;
- no `prompt_mismatch`: the stack never answered another prompt than the one sent;
- `leaked_pages == 0`, `leaked_rooms == 0` and `leaked_states == 0` (hybrid models' state
  slots) on every node once idle, each node read;
- every planned fault was injected, and each was followed by a success on its path
  (`unrecovered == 0`): the error window is the time from the injection to the completion of
  the first successful request dispatched after it on the path the fault hurt
  (`prefill:NAME`: served by that prefill node; `decode:NAME`: by that decode node;
  `net:P-D`: by both; any other target: any request).
"""

from __future__ import annotations

import statistics
from collections import Counter
from collections.abc import Mapping, Sequence
from typing import Any

from pdcache.chaos.load import PROMPT_MISMATCH, UNANSWERED, AttemptRecord
from pdcache.chaos.schedule import FaultRecord


def on_path(target: str, rec: AttemptRecord) -> bool:
    """Whether a successful request went along the path `target` names."""
    kind, _, name = target.partition(":")
    if kind == "prefill":
        return rec.prefill_node == name
    if kind == "decode":
        return rec.decode_node == name
    if kind == "net" and "-" in name:
        prefill, decode = name.split("-", 1)
        return rec.prefill_node == prefill and rec.decode_node == decode
    return True


def error_window_s(fault: FaultRecord, results: Sequence[AttemptRecord]) -> float | None:
    """Injection to the next success on the fault's path (None: no success came)."""
    if fault.injected_at_s is None:
        return None
    t0 = fault.injected_at_s
    done = [
        r.done_s
        for r in results
        if r.ok and r.dispatch_s >= t0 and on_path(fault.target, r)
    ]
    return round(min(done) - t0, 3) if done else None


def overlapped(fault: FaultRecord, window_s: float | None, faults: Sequence[FaultRecord]) -> bool:
    """Whether another fault was active at some point of `fault`'s error window (from its
    injection to its recovery, or to the end without one): that window is not its alone."""
    assert fault.injected_at_s is not None
    start = fault.injected_at_s
    end = start + window_s if window_s is not None else float("inf")
    for other in faults:
        if other is fault or other.injected_at_s is None:
            continue
        healed = other.healed_at_s if other.healed_at_s is not None else float("inf")
        if other.injected_at_s < end and healed > start:
            return True
    return False


def _median(values: Sequence[float]) -> float | None:
    return round(statistics.median(values), 3) if values else None


def fault_rows(
    faults: Sequence[FaultRecord], results: Sequence[AttemptRecord]
) -> dict[str, dict[str, Any]]:
    """Per kind: injected, failed/skipped, how many windows overlapped another fault, error
    windows (max, p50), unrecovered."""
    out: dict[str, dict[str, Any]] = {}
    for kind in dict.fromkeys(f.kind for f in faults):
        mine = [f for f in faults if f.kind == kind]
        injected = [f for f in mine if f.injected_at_s is not None]
        by_fault = [(f, error_window_s(f, results)) for f in injected]
        windows = [w for _, w in by_fault if w is not None]
        out[kind] = {
            "planned": len(mine),
            "injected": len(injected),
            "not_injected": len(mine) - len(injected),
            "errors": sum(1 for f in mine if f.error),
            "overlapped": sum(overlapped(f, w, faults) for f, w in by_fault),
            "max_error_window_s": max(windows) if windows else None,
            "p50_error_window_s": round(statistics.median(windows), 3) if windows else None,
            # the windows no other fault touched: the outage of this kind on its own
            "alone_p50_error_window_s": _median(
                [w for f, w in by_fault if w is not None and not overlapped(f, w, faults)]
            ),
            "unrecovered": len(injected) - len(windows),
        }
    return out


def verdict(
    results: Sequence[AttemptRecord],
    faults: Sequence[FaultRecord],
    oracle: Mapping[str, Any],
    accounting: Mapping[str, Mapping[str, Any]],
) -> dict[str, Any]:
    """The soak's numbers (module docstring); `accounting`: node -> {"leaked_pages",
    "leaked_rooms", ...} or {"error": why it could not be read}."""
    ok = [r for r in results if r.ok]
    failed = Counter(r.code for r in results if not r.ok)
    prompt = sum(r.prompt_tokens for r in ok)
    per_kind = fault_rows(faults, results)
    windows = [
        k["max_error_window_s"] for k in per_kind.values() if k["max_error_window_s"] is not None
    ]
    return {
        "requests_ok": len(ok),
        "requests_failed": sum(failed.values()),
        "requests_failed_by_code": dict(sorted(failed.items())),
        "unanswered": failed.get(UNANSWERED, 0),
        "wrong_tokens": int(oracle.get("wrong", 0)),
        "oracle_checked": int(oracle.get("checked", 0)),
        "oracle_pending": len(ok) - int(oracle.get("checked", 0)),
        "oracle_errors": list(oracle.get("errors", [])),
        "first_wrong": list(oracle.get("first_wrong", [])),
        "faults": per_kind,
        "faults_injected": sum(k["injected"] for k in per_kind.values()),
        "max_error_window_s": max(windows) if windows else None,
        "leaked_pages": {n: a.get("leaked_pages") for n, a in accounting.items()},
        "leaked_rooms": {n: a.get("leaked_rooms") for n, a in accounting.items()},
        "leaked_states": {n: a.get("leaked_states", 0) for n, a in accounting.items()},
        "accounting": {n: dict(a) for n, a in accounting.items()},
        "hit_rate": round(sum(r.cached_tokens for r in ok) / prompt, 4) if prompt else 0.0,
    }


def broken_invariants(v: Mapping[str, Any]) -> list[str]:
    """Every invariant of the module docstring that `v` (a `verdict`) breaks, in words."""
    broken = []
    if v["wrong_tokens"]:
        broken.append(f"wrong_tokens = {v['wrong_tokens']} (first: {v['first_wrong'][:1]})")
    if v["oracle_pending"] or v["oracle_errors"]:
        broken.append(
            f"oracle: {v['oracle_pending']} answers unchecked, errors {v['oracle_errors'][:2]}"
        )
    if v["unanswered"]:
        broken.append(f"unanswered = {v['unanswered']}")
    mismatched = v["requests_failed_by_code"].get(PROMPT_MISMATCH, 0)
    if mismatched:  # the stack answered another prompt than the one sent
        broken.append(f"prompt_mismatch = {mismatched}")
    if v["requests_ok"] == 0:
        broken.append("no request succeeded")
    for node, acct in v["accounting"].items():
        if "error" in acct:
            broken.append(f"{node}: accounting unreadable: {acct['error']}")
        elif acct.get("leaked_pages") or acct.get("leaked_rooms") or acct.get("leaked_states"):
            broken.append(
                f"{node}: leaked_pages = {acct.get('leaked_pages')}, "
                f"leaked_rooms = {acct.get('leaked_rooms')}, "
                f"leaked_states = {acct.get('leaked_states', 0)} ({acct.get('detail')})"
            )
    for kind, row in v["faults"].items():
        if row["not_injected"] or row["errors"]:
            broken.append(
                f"{kind}: {row['not_injected']} of {row['planned']} planned faults not "
                f"injected, {row['errors']} errors"
            )
        if row["unrecovered"]:
            broken.append(
                f"{kind}: {row['unrecovered']} injection(s) never followed by a "
                "success on the path they hurt"
            )
    return broken
