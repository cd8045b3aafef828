"""The one poll-until helper of the tests: wait for a condition, bounded, scaled to the load.

- `wait_until(predicate, timeout_s, what)`: the condition must come; it fails the test (with
  every thread's stack) once it has waited `scaled_limit(timeout_s)`, and returns the
  predicate's (truthy) value.
- `poll(predicate, timeout_s)`: whether the condition came within `timeout_s` (unscaled unless
  asked: a wait expected to time out takes its bound as given).
"""

from __future__ import annotations

import faulthandler
import os
import sys
import time
from collections.abc import Callable
from typing import Any

import pytest

# A wait's own bound holds on a quiet machine; its failing limit is that many times it, more
# when the run queue is deeper than the cores: the 2-core CI machine under the whole suite has
# stalled a process past a 3 s wait that takes ~10 ms when quiet. The polls return as soon as
# their condition holds, so the slack costs a passing wait nothing (a wait expected to time
# out takes its bound unscaled). The same goes for a timeout handed to the code under test
# where the test expects success (`receiver.wait(room, scaled_limit(5.0))`): beside a CPU hog
# on both cores a Register went unanswered for 3 s. Capped below pytest-timeout's 300 s, so a
# wait that never ends fails with its own message, not a stack dump.
WAIT_SLACK = 3.0
WAIT_CAP_S = 250.0


def scaled_limit(timeout_s: float) -> float:
    """`timeout_s` scaled for this machine's load now (see WAIT_SLACK), at most WAIT_CAP_S."""
    cores = len(os.sched_getaffinity(0)) or 1  # the cores this process may run on
    load_per_core = os.getloadavg()[0] / cores
    return min(timeout_s * WAIT_SLACK * max(1.0, load_per_core), max(timeout_s, WAIT_CAP_S))


def wait_until(predicate: Callable[[], Any], timeout_s: float = 20.0,
               what: str = "the condition", interval_s: float = 0.005) -> Any:
    """Poll `predicate` until it returns something truthy, and return that; fail the test
    once `scaled_limit(timeout_s)` has passed."""
    start, limit_s = time.monotonic(), scaled_limit(timeout_s)
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() - start > limit_s:
            dump_threads()
            pytest.fail(f"timed out after {limit_s:.1f}s (bound {timeout_s}s) waiting for {what}")
        time.sleep(interval_s)


def poll(predicate: Callable[[], Any], timeout_s: float = 30.0, interval_s: float = 0.01,
         scaled: bool = False) -> bool:
    """True as soon as `predicate()` holds, False once `timeout_s` (load-scaled when `scaled`)
    passed without it."""
    deadline = time.monotonic() + (scaled_limit(timeout_s) if scaled else timeout_s)
    while not predicate():
        if time.monotonic() > deadline:
            return False
        time.sleep(interval_s)
    return True


def dump_threads() -> None:
    """Every thread's stack to stderr (the test's captured output), for a wait that failed:
    one CI run saw every control thread of the process stall at once on an idle machine, so
    the thread holding them up is what the report needs."""
    sys.stderr.flush()
    faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
