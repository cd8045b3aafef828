"""Smoke test of `pdcache bench cache` (tiny preset, tiny N): every tier row is there, reused
exactly N tokens from the tier it names, produced the no-cache first tokens, and the JSON
holds the same rows plus the bandwidth table."""

from __future__ import annotations

import argparse
import json
import os

import pytest

from pdcache.bench import cache_bench

pytestmark = pytest.mark.slow


def bench_args(tmp_path, tiers: str, *extra: str, tokens: str = "32,64") -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    cache_bench.add_arguments(parser)
    parser.add_argument("--json", dest="json_path", default=None)
    return parser.parse_args([
        "--preset", "tiny", "--tokens", tokens, "--new-tokens", "8", "--repeats", "2",
        "--page-size", "4", "--tiers", tiers, "--dir", str(tmp_path),
        "--json", str(tmp_path / "out.json"), *extra,
    ])


def test_cache_bench_smoke(tmp_path, capsys) -> None:
    tiers = ["recompute", "device", "host", "hf3fs", "hf3fs-warm"]
    try:
        import mooncake.store  # noqa: F401

        tiers.append("mooncake")
        os.environ.setdefault("MC_TCP_BIND_ADDRESS", "127.0.0.1")
        os.environ.setdefault("MC_LOG_LEVEL", "ERROR")
    except ImportError:
        pass
    # one N: every tier and variant once (rows per N: test_keep_dir_reuses_the_stored_prefix)
    args = bench_args(tmp_path, ",".join(tiers), "--copy-ahead", "both",
                      "--storage-pipeline", "both", "--page-mac", "on", tokens="64")
    assert cache_bench.run(args) == 0
    printed = capsys.readouterr().out
    assert "TTFT by the tier" in printed and "storage read GB/s" in printed
    report = json.loads((tmp_path / "out.json").read_text())
    rows = {(r["N"], r["tier"]): r for r in report["rows"]}
    # --layerwise both (the default): hf3fs with the layer-streamed prefetch and without;
    # --copy-ahead both: the page-by-page rows also with the copy ahead on the copier thread;
    # --page-mac on, --storage-pipeline both: sealed pages; hf3fs-serial also pipelined
    ahead = ["hf3fs-serial-ahead"] + (["mooncake-ahead"] if "mooncake" in tiers else [])
    variants = ["hf3fs-serial", "hf3fs-serial-pipelined", *ahead]
    assert set(rows) == {(64, t) for t in [*tiers, *variants]}
    expected_tier = {"recompute": "none", "device": "device", "host": "host", "hf3fs": "storage",
                     "hf3fs-serial": "storage", "mooncake": "storage",
                     "hf3fs-serial-ahead": "storage", "mooncake-ahead": "storage",
                     "hf3fs-serial-pipelined": "storage", "hf3fs-warm": "storage"}
    for (n, tier), row in rows.items():
        assert row["hit_tier"] == expected_tier[tier], row
        assert row["reused_tokens"] == (0 if tier == "recompute" else n), row
        assert row["ttft_ms"] > 0 and row["vs_device"] > 0
        if tier != "recompute":  # a paired ratio per round: the median lies in its range
            assert row["vs_device_min"] <= row["vs_device"] <= row["vs_device_max"], row
        if tier != "recompute":
            assert row["exact"] == "yes", row
        if tier in ("hf3fs-serial", "hf3fs-serial-pipelined", "hf3fs-warm", "mooncake"):  # engine thread: no copier to wait for
            assert row["h2d_ms"] > 0 and row["copy_wait_ms"] == 0, row
        if tier.endswith("-ahead"):  # copied by the copier: the forward waited on its events
            assert row["h2d_ms"] > 0 and row["copy_wait_ms"] > 0, row
    paths = [r["path"] for r in report["bandwidth"]]
    assert paths[:2] == ["memcpy (torch copy_)", "plain file preadv"]
    assert "storage hf3fs" in paths
    assert all(r["read_GBps"] > 0 for r in report["bandwidth"])
    assert not list(tmp_path.glob("pdcache-cache-bench-*"))  # the temp dir is removed
    assert set(report["seeding"]) == {"64"}
    assert all(v.startswith("recomputed and written in ") for v in report["seeding"].values())


def test_warm_row_alone_beside_the_device_row(tmp_path) -> None:
    """`--tiers device,hf3fs-warm` (no fresh-engine tier): one device hit before each warm
    sample and one after the last, no more than the suffixes drawn for them."""
    args = bench_args(tmp_path, "device,hf3fs-warm", "--layerwise", "off", tokens="32")
    args.no_bandwidth = True
    assert cache_bench.run(args) == 0
    rows = {r["tier"]: r for r in json.loads((tmp_path / "out.json").read_text())["rows"]}
    assert rows["device"]["runs"] == 3 and rows["hf3fs-warm"]["runs"] == 2
    assert (rows["hf3fs-warm"]["hit_tier"], rows["hf3fs-warm"]["exact"]) == ("storage", "yes")


def test_keep_dir_reuses_the_stored_prefix(tmp_path) -> None:
    """`--keep-dir`: a second run finds the prefix stored (its cold run is a storage hit, so
    no recompute sample but the no-cache ones) and forgets what the first run's prompts
    wrote past the prefix, so device and storage rows reuse exactly N from their own tier."""
    keep = tmp_path / "keep"
    for run in range(2):
        args = bench_args(tmp_path / f"run{run}", "recompute,device,file")
        args.keep_dir, args.no_bandwidth = str(keep), True
        assert cache_bench.run(args) == 0
        report = json.loads((tmp_path / f"run{run}" / "out.json").read_text())
        rows = {(r["N"], r["tier"]): r for r in report["rows"]}
        for n in (32, 64):
            assert rows[(n, "recompute")]["runs"] == (2 if run == 0 else 1)
            for tier, where in (("device", "device"), ("file", "storage"),
                                ("file-serial", "storage")):
                row = rows[(n, tier)]
                assert (row["hit_tier"], row["reused_tokens"], row["exact"]) == (where, n, "yes")
        how = "recomputed and written" if run == 0 else "loaded from --keep-dir"
        assert all(v.startswith(how) for v in report["seeding"].values()), report["seeding"]
    assert (keep / "n32" / "hf3fs").is_dir()  # kept


def test_paired_ratios_divide_each_sample_by_the_device_hits_around_it() -> None:
    # d, s, d, s, d with a load step that doubles every time after the first storage sample:
    # each pair stays at 1.2x (a ratio of medians would mix load levels: 2.4 / 1.0 or 1.2 / 2.0)
    sequence = [("device", 1.0), ("hf3fs", 1.2), ("device", 1.0), ("file", 2.4),
                ("device", 2.0), ("hf3fs", 2.4), ("device", 2.0)]
    assert cache_bench.paired_ratios(sequence, "hf3fs") == pytest.approx([1.2, 1.2])
    assert cache_bench.paired_ratios(sequence, "file") == pytest.approx([2.4 / 1.5])
    # at the ends one neighbour is enough; without any device hit a sample is left out
    assert cache_bench.paired_ratios([("file", 3.0), ("device", 2.0)], "file") == [1.5]
    assert cache_bench.paired_ratios([("file", 3.0)], "file") == []
