"""What a SIGKILLed soak left behind, removed before the next soak on the same work directory.

The storage and network faults undo their mounts and namespaces in `cleanup` (a `finally`),
which a SIGKILL of the harness skips. A soak's names all derive from its work directory
(OUT/work): the network namespaces `pdc-<tag>-<node>` and the bridges `pdc<tag>b` /
`pdc<tag>q` (`NetLab`), and the mounts under the work directory (`StorageMount`). At start,
`pdcache chaos` removes any of those that exist: only this work directory's, so another
soak running beside it (another OUT, another tag) is untouched. Without root, or without the
tools, there is nothing it could have made, and nothing is done.
"""

from __future__ import annotations

import os
import shutil
import signal
from pathlib import Path

from pdcache.chaos.net_faults import NetLab
from pdcache.chaos.os_tools import run_tool


def clean_stale(work_dir: Path) -> list[str]:
    """Remove the leftover namespaces, bridges and mounts of a soak on `work_dir`; what was
    removed, one line each."""
    if os.geteuid() != 0:
        return []
    removed: list[str] = []
    if shutil.which("ip") is not None:
        removed += _remove_network(NetLab.digest_of(work_dir)[:5])
    if shutil.which("umount") is not None:
        removed += _remove_mounts(work_dir.resolve())
    return removed


def _remove_network(tag: str) -> list[str]:
    removed = []
    listed = run_tool(["ip", "netns", "list"], check=False).stdout.split()
    for ns in (n for n in listed if n.startswith(f"pdc-{tag}-")):
        for pid in run_tool(["ip", "netns", "pids", ns], check=False).stdout.split():
            try:  # a node process of the killed soak, still in its namespace
                os.kill(int(pid), signal.SIGKILL)
            except (ProcessLookupError, ValueError):
                pass
        if run_tool(["ip", "netns", "del", ns], check=False).returncode == 0:
            removed.append(f"network namespace {ns}")
    for bridge in (f"pdc{tag}b", f"pdc{tag}q"):
        if run_tool(["ip", "link", "show", bridge], check=False).returncode != 0:
            continue
        if run_tool(["ip", "link", "del", bridge], check=False).returncode == 0:
            removed.append(f"bridge {bridge}")
    return removed


def mounts_under(root: Path) -> list[Path]:
    """Mount points strictly under `root` (from /proc/self/mounts), deepest first."""
    found = []
    for line in Path("/proc/self/mounts").read_text().splitlines():
        fields = line.split()
        if len(fields) < 2:
            continue
        point = Path(_unescape(fields[1]))
        if root in point.parents:
            found.append(point)
    return sorted(set(found), key=lambda p: len(p.parts), reverse=True)


def _remove_mounts(root: Path) -> list[str]:
    removed = []
    for point in mounts_under(root):
        if run_tool(["umount", str(point)], check=False).returncode != 0:
            run_tool(["umount", "-l", str(point)], check=False)  # a straggler holds it open
        if not os.path.ismount(point):
            removed.append(f"mount {point}")
    return removed


def _unescape(field: str) -> str:
    """/proc/self/mounts writes space, tab, newline and backslash as octal escapes."""
    for code, char in (("\\040", " "), ("\\011", "\t"), ("\\012", "\n"), ("\\134", "\\")):
        field = field.replace(code, char)
    return field
