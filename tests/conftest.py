"""Suite-wide hooks: what the machine was doing when a test failed.

Many tests bound their waits (scaled from measured baselines); when one fails on a loaded CI
machine the traceback alone cannot tell a real bug from a starved one. A failed test's report
gets a `machine state` section: the load average, this process's threads that used CPU in the
last half second (a leaked native progress thread spins there), and the other processes on the
machine using CPU (a stray server left by an earlier test).
"""

from __future__ import annotations

import os
import time
from collections.abc import Generator
from pathlib import Path

import pytest

SAMPLE_S = 0.5
BUSY_SHARE = 0.2  # of one core over the sample: worth naming


def _task_ticks(task_dir: Path) -> dict[str, tuple[str, int]]:
    """tid -> (name, utime + stime ticks) of the tasks under `task_dir`."""
    ticks: dict[str, tuple[str, int]] = {}
    for entry in task_dir.iterdir():
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue  # ended meanwhile
        name = stat[stat.index("(") + 1 : stat.rindex(")")]
        fields = stat[stat.rindex(")") + 2 :].split()
        ticks[entry.name] = (name, int(fields[11]) + int(fields[12]))
    return ticks


def _busy(before: dict[str, tuple[str, int]], after: dict[str, tuple[str, int]],
          hz: int, elapsed_s: float) -> list[str]:
    busy = []
    for key, (name, used) in after.items():
        share = (used - before[key][1]) / hz / elapsed_s if key in before else 0.0
        if share >= BUSY_SHARE:
            busy.append(f"{key} {name} {100 * share:.0f}% of a core")
    return busy


def _processes() -> dict[str, tuple[str, int]]:
    """pid -> (command line, CPU ticks) of every process but this one."""
    found: dict[str, tuple[str, int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            stat = (entry / "stat").read_text()
            args = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2 :].split()
        found[entry.name] = (args[:160] or stat[: stat.rindex(")") + 1],
                             int(fields[11]) + int(fields[12]))
    return found


def machine_state() -> str:
    """The load average, and the threads here and processes elsewhere busy over SAMPLE_S."""
    hz = os.sysconf("SC_CLK_TCK")
    own = Path(f"/proc/{os.getpid()}/task")
    threads, processes, started = _task_ticks(own), _processes(), time.monotonic()
    time.sleep(SAMPLE_S)
    threads_after, processes_after = _task_ticks(own), _processes()
    elapsed_s = time.monotonic() - started  # longer than SAMPLE_S on a starved machine
    lines = [f"load average: {' '.join(Path('/proc/loadavg').read_text().split()[:3])}; "
             f"a {SAMPLE_S} s sample took {elapsed_s:.2f} s",
             f"threads here: {len(threads_after)}"]
    lines += [f"busy thread here: {line}" for line in _busy(threads, threads_after, hz, elapsed_s)]
    lines += [f"busy process: {line}"
              for line in _busy(processes, processes_after, hz, elapsed_s)]
    return "\n".join(lines)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo
                              ) -> Generator[None, None, None]:
    outcome = yield
    report = outcome.get_result()
    if report.failed and Path("/proc/self/task").is_dir():
        report.sections.append(("machine state", machine_state()))
