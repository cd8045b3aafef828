"""`pdcache bench tiers`: one run, every policy row; the exclusive host serves hits the
inclusive one cannot, the session policy keeps more on device than LRU (hit counts)."""

from __future__ import annotations

import json
from pathlib import Path

from pdcache.bench import tier_bench
from pdcache.bench.cli import BENCHMARKS


def test_tier_bench_rows(tmp_path: Path) -> None:
    import argparse

    assert "tiers" in BENCHMARKS
    parser = argparse.ArgumentParser()
    tier_bench.add_arguments(parser)
    out = tmp_path / "tiers.json"
    args = parser.parse_args(
        [
            "--sessions",
            "6",
            "--turns",
            "3",
            "--turn-tokens",
            "32",
            "--answer-tokens",
            "4",
            "--page-size",
            "8",
        ]
    )
    args.json_path = str(out)
    assert tier_bench.run(args) == 0
    rows = {(r["device_eviction"], r["host_mode"]): r for r in json.loads(out.read_text())["rows"]}
    assert rows[("lru", "inclusive")]["host_hit_tokens"] == 0
    assert rows[("lru", "exclusive")]["host_hit_tokens"] > 0
    assert (
        rows[("session", "inclusive")]["device_hit_tokens"]
        > rows[("lru", "inclusive")]["device_hit_tokens"]
    )
    for row in rows.values():
        assert row["of_theoretical"] <= 1.0
