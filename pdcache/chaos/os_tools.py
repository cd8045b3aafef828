"""What the storage and network faults share: running `mount`/`ip`/`tc`, reading overrides.

The faults change the machine for real (mounts, network namespaces), so each tool call is
bounded by a timeout and a failure raises `FaultSetupError` with the tool's own message.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from pdcache.chaos.faults import FaultContext
from pdcache.config import parse_override_value

TOOL_TIMEOUT_S = 20.0


class FaultSetupError(RuntimeError):
    """A system tool refused (the message is its stderr): the fault cannot be applied."""


def run_tool(
    argv: Sequence[str], check: bool = True, timeout_s: float = TOOL_TIMEOUT_S
) -> subprocess.CompletedProcess[str]:
    """Run one system command; with `check`, a non-zero exit raises FaultSetupError."""
    try:
        done = subprocess.run(list(argv), capture_output=True, text=True, timeout=timeout_s)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise FaultSetupError(f"`{' '.join(argv)}`: {exc}") from exc
    if check and done.returncode != 0:
        raise FaultSetupError(
            f"`{' '.join(argv)}` exited {done.returncode}: {(done.stderr or done.stdout).strip()}"
        )
    return done


def missing_privilege(*tools: str) -> str | None:
    """Why this process cannot change mounts or networks: not root, or a tool is missing."""
    if os.geteuid() != 0:
        return "needs root (CAP_SYS_ADMIN / CAP_NET_ADMIN): run the soak as root"
    for tool in tools:
        if shutil.which(tool) is None:
            return f"`{tool}` is not installed (apt-get install -y util-linux iproute2)"
    return None


def override(ctx: FaultContext, key: str, default: Any) -> Any:
    """The value `--set KEY=...` gives `key` in this soak (parsed as --set parses it), else
    `default` (the topology's own value)."""
    if key in ctx.overrides:
        return parse_override_value(ctx.overrides[key])
    return default


def storage_root(ctx: FaultContext) -> Path:
    """The storage directory the nodes use, absolute (nodes run in the launcher's cwd)."""
    return Path(override(ctx, "storage.path", ctx.topology.storage.path)).resolve()
