#!/usr/bin/env python3
"""Keep N CPU cores busy for D seconds, then exit by itself.

Used to check that the test suite passes on a loaded machine: run it beside
pytest, e.g. ``python scripts/cpu_hog.py --procs 2 --seconds 3600 & bash scripts/test.sh``.
Each worker is a separate process spinning a pure-Python loop (no I/O, no memory growth) at
normal priority, so it competes with the tests for every core. The parent prints what it
started and how much work each worker did; SIGINT/SIGTERM stop it early.
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import signal
import sys
import time
from multiprocessing.sharedctypes import Synchronized


def spin(deadline: float, loops_done: Synchronized) -> None:
    """Busy-loop until ``deadline`` (monotonic seconds), counting 100k-iteration loops in
    ``loops_done`` (kept current, so the count survives a terminate)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent decides when to stop
    while time.monotonic() < deadline:
        for _ in range(100_000):
            pass
        loops_done.value += 1  # only this process writes it: no lock needed


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--procs", type=int, default=os.cpu_count() or 1, help="busy processes (default: cores)"
    )
    parser.add_argument("--seconds", type=float, default=60.0, help="how long to run")
    args = parser.parse_args(argv)
    if args.procs < 1 or args.seconds <= 0:
        parser.error("--procs must be >= 1 and --seconds > 0")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    started = time.monotonic()
    deadline = started + args.seconds
    counters = [multiprocessing.Value("q", 0) for _ in range(args.procs)]
    workers = [
        multiprocessing.Process(target=spin, args=(deadline, counter), daemon=True)
        for counter in counters
    ]
    for worker in workers:
        worker.start()
    pids = ", ".join(str(worker.pid) for worker in workers)
    print(
        f"cpu_hog: pid {os.getpid()}, {args.procs} busy processes ({pids}) for {args.seconds:g} s",
        flush=True,
    )

    def stop(signum: int, _frame: object) -> None:
        for worker in workers:
            worker.terminate()

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    for worker in workers:
        worker.join()
    elapsed = time.monotonic() - started
    loops = [counter.value for counter in counters]
    print(f"cpu_hog: done after {elapsed:.1f} s, 100k-iteration loops per process: {loops}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
