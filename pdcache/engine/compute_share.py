"""Decode steps wait for prefill on compute that prefill and decode nodes share
(docs/design.md §4.13).

A unified engine runs a waiting prefill before its next decode step, so its TTFT does not pay
for the decodes in flight. Prefill and decode *processes* on one host (or one GPU) compete for
the same cores with no such order: the decode process keeps stepping while a prefill forward
runs, and the prefill forward, whose threads share the cores with it, takes longer. A
`ComputeShare` gives them the unified engine's order across processes.

The share is one file on a host-local filesystem, named alike by every node that shares the
compute. An engine *announces* while it has prefill work (a request queued, or a prompt still
computing) by holding a shared `flock` on it; an engine about to run a decode step *probes*
with a non-blocking exclusive `flock`, which fails while some other engine announces, and then
holds its step back (bounded by `[scheduler] decode_yield_max_ms`;
`pdcache.engine.pacer.DecodePacer.yield_to_prefill`).
`flock` locks belong to an open file description: the kernel drops a crashed process's
announcement with its last file descriptor, so a dead prefill node never holds decode back,
and two engines of one process (each with its own `open`) see each other as two processes
would. (NFS emulates `flock` with per-process POSIX locks: keep the file on a local disk or
tmpfs.)

A probe holds the exclusive lock for two system calls. An announcement that meets one is
retried a few times (`_ANNOUNCE_TRIES`), never blocks, and when it still fails is taken at the
announcing engine's next loop iteration (counted as `misses`); a probe that meets another
probe retries once before it reports an announcement. A lock call that fails otherwise
(a filesystem without `flock`) is logged once and turns the share off: the engine then runs
as if none were configured (`errors`), never stalls.
"""

from __future__ import annotations

import fcntl
import logging
import os
import time
from pathlib import Path

logger = logging.getLogger(__name__)

_ANNOUNCE_TRIES = 5  # a probe holds its lock for two syscalls: a few tries get past it
_ANNOUNCE_RETRY_S = 0.0002  # also the wait before a busy probe looks again


class ComputeShare:
    """One engine's handle on the share file: `announce` its prefill work, probe with
    `others_busy` before a decode step.

    Owns one file descriptor and this engine's lock on it; mutated only by the one engine
    thread that uses it (no lock of its own; `stats()` reads plain counters). The constructor
    opens the file (0600, its directory created) and checks that it takes `flock`; `close()`
    drops the announcement and the descriptor."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._fd: int | None = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
            self._check_flock(self._fd)
        except OSError as exc:
            raise OSError(exc.errno, f"compute share {self.path}: {exc.strerror} "
                          "([scheduler] compute_share names a file on a local filesystem "
                          "that every node sharing this compute can open and lock)") from exc
        self._announced_at: float | None = None  # monotonic; None: not announcing
        self._failed = False  # a lock call failed: the share is off from then on
        self.announcements = 0
        self.misses = 0  # announcements that met a probe on every try (retried next batch)
        self.errors = 0  # lock calls that failed (the first turned the share off)
        self.busy_s = 0.0  # time announced, summed

    @staticmethod
    def _check_flock(fd: int) -> None:
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
            fcntl.flock(fd, fcntl.LOCK_UN)
        except BlockingIOError:
            return  # a probe holds it this instant: flock works
        except OSError:
            os.close(fd)
            raise

    @property
    def announcing(self) -> bool:
        return self._announced_at is not None

    def announce(self, busy: bool) -> None:
        """Hold (True) or drop (False) this engine's announcement; a no-op when unchanged."""
        announced_at = self._announced_at
        if announced_at is not None and not busy:
            self._lock(fcntl.LOCK_UN)
            self.busy_s += time.monotonic() - announced_at
            self._announced_at = None
        elif announced_at is None and busy and not self._failed:
            self._take_shared()

    def _take_shared(self) -> None:
        for attempt in range(_ANNOUNCE_TRIES):
            if attempt:
                time.sleep(_ANNOUNCE_RETRY_S)
            taken = self._lock(fcntl.LOCK_SH | fcntl.LOCK_NB)
            if taken is None:
                return  # the share just turned off
            if taken:
                self._announced_at = time.monotonic()
                self.announcements += 1
                return
        self.misses += 1

    def others_busy(self) -> bool:
        """True while another engine announces. Drops this engine's own announcement first:
        an engine probes only before a decode step, when it computes no prefill itself."""
        self.announce(False)
        for attempt in range(2):  # a failed probe may have met another engine's probe
            if attempt:
                time.sleep(_ANNOUNCE_RETRY_S)
            taken = self._lock(fcntl.LOCK_EX | fcntl.LOCK_NB)
            if taken is None:
                return False
            if taken:
                self._lock(fcntl.LOCK_UN)
                return False
        return True

    def _lock(self, operation: int) -> bool | None:
        """`flock(operation)`: True done, False held by another (non-blocking), None failed
        (logged once; the share is off from then on, and holds nothing)."""
        if self._failed:
            return None
        try:
            fcntl.flock(self._open_fd(), operation)
        except BlockingIOError:
            return False
        except OSError as exc:
            self.errors += 1
            self._failed = True
            self._announced_at = None  # a failed lock call holds no announcement either
            logger.error("compute share %s: flock failed (%s); decode steps no longer wait "
                         "for prefill on this engine", self.path, exc)
            return None
        return True

    def stats(self) -> dict[str, float | int]:
        busy_s = self.busy_s
        if self._announced_at is not None:
            busy_s += time.monotonic() - self._announced_at
        return {"compute_share_announcements_total": self.announcements,
                "compute_share_busy_seconds_total": round(busy_s, 6),
                "compute_share_misses_total": self.misses,
                "compute_share_errors_total": self.errors}

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
