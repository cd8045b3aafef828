"""A SIGKILLed soak's leftovers are removed when the next soak on the same OUT starts
(pdcache/chaos/stale.py): its network namespaces and bridges (`pdc-<tag>-*`,
`pdc<tag>b`) and the mounts under OUT/work; another work directory's are untouched. The test
makes real ones, so it needs root, `ip` and `mount` (skipped otherwise)."""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
from pathlib import Path

import pytest

from pdcache.chaos import command
from pdcache.chaos.net_faults import NetLab
from pdcache.chaos.stale import clean_stale, mounts_under

CONFIG = Path(__file__).resolve().parents[2] / "configs" / "local-1p1d.toml"

pytestmark = pytest.mark.skipif(
    os.geteuid() != 0 or not all(shutil.which(t) for t in ("ip", "mount", "umount")),
    reason="makes real network namespaces and mounts: needs root, ip and mount",
)


def sh(*argv: str) -> None:
    subprocess.run(argv, check=True, capture_output=True, timeout=20)


def namespaces() -> list[str]:
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, timeout=20)
    return [line.split()[0] for line in out.stdout.splitlines() if line.strip()]


def link_exists(name: str) -> bool:
    return subprocess.run(["ip", "link", "show", name], capture_output=True).returncode == 0


def leave_a_soak_behind(work_dir: Path) -> tuple[str, str]:
    """What a soak killed mid-run leaves: a node namespace, the main bridge, the tmpfs with
    the bind mount inside it. Returns (namespace, bridge)."""
    work_dir.mkdir(parents=True, exist_ok=True)
    tag = NetLab.digest_of(work_dir)[:5]
    ns, bridge = f"pdc-{tag}-p0", f"pdc{tag}b"
    sh("ip", "netns", "add", ns)
    sh("ip", "link", "add", bridge, "type", "bridge")
    tmpfs, data, bound = (
        work_dir / "storage-tmpfs",
        work_dir / "storage-tmpfs" / "data",
        work_dir / "storage",
    )
    tmpfs.mkdir()
    sh("mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(tmpfs))
    data.mkdir()
    bound.mkdir()
    sh("mount", "--bind", str(data), str(bound))
    return ns, bridge


def gone(work_dir: Path, ns: str, bridge: str) -> bool:
    return ns not in namespaces() and not link_exists(bridge) and not mounts_under(work_dir)


def test_clean_stale_removes_only_this_work_dirs_leftovers(tmp_path: Path) -> None:
    ours, other = tmp_path / "a" / "work", tmp_path / "b" / "work"
    ns, bridge = leave_a_soak_behind(ours)
    other_ns, other_bridge = leave_a_soak_behind(other)
    try:
        assert len(mounts_under(ours)) == 2
        removed = clean_stale(ours)
        assert sorted(removed) == sorted(
            [
                f"network namespace {ns}",
                f"bridge {bridge}",
                f"mount {ours.resolve() / 'storage'}",
                f"mount {ours.resolve() / 'storage-tmpfs'}",
            ]
        )
        assert gone(ours, ns, bridge)
        assert other_ns in namespaces() and link_exists(other_bridge)
        assert len(mounts_under(other)) == 2
        assert clean_stale(ours) == []  # nothing left: a clean start does nothing
    finally:
        clean_stale(ours)
        clean_stale(other)
    assert gone(other, other_ns, other_bridge)


def test_a_soak_starting_on_a_killed_soaks_out_removes_its_leftovers(tmp_path: Path) -> None:
    out = tmp_path / "out"
    ns, bridge = leave_a_soak_behind(out / "work")
    parser = argparse.ArgumentParser()
    command.add_arguments(parser)
    args = parser.parse_args([str(CONFIG), "--out", str(out), "--set", "model.preset=tiny"])
    try:
        command.Soak(args, [])
        assert gone(out / "work", ns, bridge)
    finally:
        clean_stale(out / "work")
