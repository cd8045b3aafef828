"""Wall time of one `pdcache sim` run under cache pressure with the trees' eviction as it is
against the reference algorithms it replaced (`tests/engine/test_radix_eviction_order.py`,
`tests/offload_manager/test_hiradix_eviction_order.py`), alternating runs in one process; the
two must simulate exactly the same run (same summary, same evictions).

    .venv/bin/python -m tests.sim.eviction_bench [--repeats N] [--sessions N] [--set K=V ...]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path
from unittest import mock

from pdcache.sim import cache as sim_cache
from pdcache.sim import report
from pdcache.sim.command import add_run_arguments, build
from tests.engine.test_radix_eviction_order import ReferenceEviction
from tests.offload_manager.test_hiradix_eviction_order import ReferenceHiEviction
from tests.sim.test_simulation import PROFILE, TINY, UNIFIED


def sim_argv(sessions: int, profile: str, overrides: list[str]) -> list[str]:
    """A unified node whose device and host tiers hold a fraction of the sessions' pages."""
    return [UNIFIED, *TINY, "--set", "storage.backend=none", "--set", "cache.device_pages=3000",
            "--set", "cache.host_pages=6000", "--set", "cache.host_mode=exclusive",
            "--trace", f"synthetic:sessions={sessions},turns=5,system=256,think=1",
            "--mode", "poisson-sessions", "--rate", "40", "--concurrency", "64",
            "--profile", profile, "--no-progress",
            *[arg for item in overrides for arg in ("--set", item)]]  # last --set wins


def run_once(argv: list[str], reference: bool) -> tuple[float, dict]:
    """(wall seconds, summary) of one simulated run; `reference`: the old algorithms."""
    parser = argparse.ArgumentParser()
    add_run_arguments(parser)
    args = parser.parse_args(argv)
    with mock.patch.object(sim_cache, "RadixTree", ReferenceEviction if reference
                           else sim_cache.RadixTree), \
         mock.patch.object(sim_cache, "HiRadixTree", ReferenceHiEviction if reference
                           else sim_cache.HiRadixTree):
        sim = build(args)
        start = time.perf_counter()
        sim.run()
        wall = time.perf_counter() - start
    sim.check()
    (node,) = sim.nodes.values()
    assert isinstance(node.cache.tree, ReferenceHiEviction) == reference
    return wall, report.summarize(sim)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--sessions", type=int, default=300)
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="a `pdcache sim --set` override, e.g. cache.device_eviction=session")
    options = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        profile = Path(tmp) / "profile.toml"
        profile.write_text(PROFILE)
        argv = sim_argv(options.sessions, str(profile), options.set)
        walls: dict[bool, list[float]] = {False: [], True: []}
        summaries: dict[bool, dict] = {}
        for _ in range(options.repeats):
            for reference in (True, False):
                wall, summaries[reference] = run_once(argv, reference)
                walls[reference].append(wall)
    assert summaries[True] == summaries[False], "the reference simulated another run"
    node = summaries[False]["nodes"][0]
    old, new = statistics.median(walls[True]), statistics.median(walls[False])
    print(f"requests {summaries[False]['requests_ok']}, device evicted "
          f"{node['device_evicted_pages']} pages, hit rate {summaries[False]['hit_rate']:.3f}")
    print(f"reference (old) median {old:.2f} s {walls[True]}")
    print(f"current   (new) median {new:.2f} s {walls[False]}")
    print(f"old / new = {old / new:.2f}x")


if __name__ == "__main__":
    main()
