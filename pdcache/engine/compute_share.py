"""Prefill first on compute that prefill and decode nodes share (docs/design.md §4.13).

A unified engine runs a waiting prefill before its next decode step, so its TTFT does not pay
for the decodes in flight. Prefill and decode *processes* on one host (or one GPU) compete for
the same cores with no such order: the decode process keeps stepping while a prefill forward
runs, and the prefill forward, whose threads share the cores with it, takes longer. A
`ComputeShare` gives them the unified engine's order across processes.

The share is one file, named alike by every node on the host that shares the compute. An
engine *announces* while it computes prefill batches by holding a shared `flock` on it; an
engine about to run a decode step *probes* with a non-blocking exclusive `flock`, which fails
exactly while some other engine announces, and then holds its step back (bounded by
`[scheduler] decode_yield_max_ms`; `Engine._yield_decode`). `flock` locks belong to an open
file description: the kernel drops a crashed process's announcement with its last file
descriptor, so a dead prefill node never holds decode back, and two engines of one process
(each with its own `open`) see each other as two processes would.

A probe holds the exclusive lock for two system calls; an announcement that meets one is
retried a few times (`_ANNOUNCE_TRIES`), never blocks, and when it still fails is retried at
the announcing engine's next batch (counted as `misses`).

Ownership: one engine thread uses one `ComputeShare` (no lock); `Engine.start` opens it (so a
path that cannot be opened fails the node's start), and the engine thread closes it on exit.
"""

from __future__ import annotations

import fcntl
import os
import time
from pathlib import Path

_ANNOUNCE_TRIES = 5  # a probe holds its lock for two syscalls: a few tries get past it
_ANNOUNCE_RETRY_S = 0.0002


class ComputeShare:
    """One engine's handle on the host's share file: `announce` and `others_busy`."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._fd: int | None = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        except OSError as exc:
            raise OSError(exc.errno, f"compute share {self.path}: {exc.strerror} "
                          "([scheduler] compute_share names a file every node on this host "
                          "that shares the compute can open)") from exc
        self._announced_at: float | None = None  # monotonic; None: not announcing
        self.announcements = 0
        self.misses = 0  # announcements that met a probe on every try (retried next batch)
        self.busy_s = 0.0  # time announced, summed

    @property
    def announcing(self) -> bool:
        return self._announced_at is not None

    def announce(self, busy: bool) -> None:
        """Hold (True) or drop (False) this engine's announcement; a no-op when unchanged."""
        announced_at = self._announced_at
        if announced_at is not None and not busy:
            fcntl.flock(self._open_fd(), fcntl.LOCK_UN)
            self.busy_s += time.monotonic() - announced_at
            self._announced_at = None
        elif announced_at is None and busy:
            self._take_shared(self._open_fd())

    def _take_shared(self, fd: int) -> None:
        for attempt in range(_ANNOUNCE_TRIES):
            try:
                fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
            except BlockingIOError:
                if attempt + 1 < _ANNOUNCE_TRIES:
                    time.sleep(_ANNOUNCE_RETRY_S)
                continue
            self._announced_at = time.monotonic()
            self.announcements += 1
            return
        self.misses += 1

    def others_busy(self) -> bool:
        """True while another engine announces. Drops this engine's own announcement first:
        an engine probes only before a decode step, when it computes no prefill itself."""
        self.announce(False)
        fd = self._open_fd()
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return True
        fcntl.flock(fd, fcntl.LOCK_UN)
        return False

    def stats(self) -> dict[str, float | int]:
        busy_s = self.busy_s
        if self._announced_at is not None:
            busy_s += time.monotonic() - self._announced_at
        return {"compute_share_announcements_total": self.announcements,
                "compute_share_busy_seconds_total": round(busy_s, 6),
                "compute_share_misses_total": self.misses}

    def close(self) -> None:
        """Drop the announcement and the file descriptor. Idempotent."""
        if self._fd is None:
            return
        self.announce(False)
        os.close(self._fd)
        self._fd = None

    def _open_fd(self) -> int:
        if self._fd is None:
            raise RuntimeError(f"compute share {self.path} is closed")
        return self._fd
