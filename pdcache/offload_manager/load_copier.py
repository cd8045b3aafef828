"""Host → device loads copied ahead of the forward, on a thread of their own (CPU pools).

A `LayerLoad` copies layer l of its pages when the forward asks for it (`wait(l)`), on the
engine thread. With a CPU device pool that copy is a memcpy on the core that then computes the
layer, so a 16k-token storage hit spent ~24 ms copying plus the cost of the lines it dirtied
inside its forward. `LoadCopier` is the CPU's copy engine: the load hands it every layer at
creation, it copies them in order on its own thread (torch's copy releases the GIL), and
`wait(l)` only waits for layer l's copy to have ended, so layer l+1 is copied while layer l
is computed. CUDA pools keep the engine-thread copy (their copies are stream-ordered kernels).
Off by default (`HiCacheConfig.copy_ahead`): on the 2-core machine here the copy, moved off the
engine thread, ran 16-50 % slower beside the forward and the TTFT did not improve beyond noise
(docs/measured.md); it is for hosts with spare cores and memory bandwidth.

Owner: `HiCache` (started in `HiCache.start()`, stopped in `HiCache.close()`). The thread only
copies pages and sets the loads' per-layer events; everything that touches the tree, the host
pool's pins or the stats stays on the engine thread (`LayerLoad._finish`). A load's host pages
are pinned and its device pages reserved for its request before it is submitted, and neither
is released until the engine thread has seen its last layer's event, so the thread never
copies into or out of a page that someone else owns.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass, field

log = logging.getLogger(__name__)

CopyLayer = Callable[[int], None]


@dataclass(eq=False)
class CopyJob:
    """The layers of one load: `copy_layer(l)` for l in 0..num_layers-1, in order. `ready[l]`
    is set once layer l was copied (or the job failed: `error` then says why)."""

    copy_layer: CopyLayer
    num_layers: int
    ready: list[threading.Event] = field(init=False)
    next_layer: int = 0  # next layer to copy (copier thread only)
    error: BaseException | None = None

    def __post_init__(self) -> None:
        self.ready = [threading.Event() for _ in range(self.num_layers)]

    def fail(self, error: BaseException) -> None:
        # no traceback: its frames would hold this job, its load and the pools it references
        self.error = error.with_traceback(None)
        for event in self.ready:
            event.set()


class LoadCopier:
    """One thread that copies submitted jobs layer-major: of all pending jobs, the one with the
    lowest next layer goes first (ties: submission order), because the forward consumes layer
    0 of every load in its batch before layer 1 of any.

    Lock: `_cond` guards `_jobs` and `_stopping`; the copies run outside it."""

    def __init__(self, name: str = "pdcache-h2d") -> None:
        self.name = name
        self._cond = threading.Condition()
        self._jobs: list[CopyJob] = []
        self._stopping = False
        self._wedged = False  # a waiter gave up on a copy (`mark_wedged`): take no more jobs
        self._thread: threading.Thread | None = None

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and not self._stopping

    def start(self) -> LoadCopier:
        """Start the thread; idempotent."""
        with self._cond:
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name=self.name, daemon=True)
                self._thread.start()
        return self

    def submit(self, job: CopyJob) -> bool:
        """Queue `job`; False (nothing queued) when the copier is not running, so the caller
        copies on its own thread instead."""
        with self._cond:
            if self._thread is None or self._stopping or self._wedged:
                return False
            self._jobs.append(job)
            self._cond.notify()
        return True

    def mark_wedged(self) -> None:
        """A copy did not end within its waiter's bound: later loads copy on the engine
        thread instead of queueing behind it."""
        with self._cond:
            self._wedged = True

    def close(self, timeout_s: float = 5.0) -> None:
        """Stop after the layer being copied, then fail the jobs still queued (their waiters
        raise). Only once the thread has ended: a job's layer in flight is never reported done
        (or failed) before its copy has, so no waiter frees pages that are still written. If
        the thread does not end in `timeout_s`, the queued jobs are left for their waiters'
        own bound."""
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
        if self._thread is not None:
            self._thread.join(timeout_s)
            if self._thread.is_alive():
                log.warning("the host → device copier did not stop in %.0f s", timeout_s)
                return
        with self._cond:
            left, self._jobs = self._jobs, []
        for job in left:
            job.fail(RuntimeError("the host → device copier was closed"))

    def _next(self) -> tuple[CopyJob, int] | None:
        with self._cond:
            while not self._jobs and not self._stopping:
                self._cond.wait()
            if self._stopping:
                return None
            job = min(self._jobs, key=lambda j: j.next_layer)  # min() keeps the first of ties
            layer = job.next_layer
            job.next_layer += 1
            if job.next_layer == job.num_layers:
                self._jobs.remove(job)
            return job, layer

    def _run(self) -> None:
        while (item := self._next()) is not None:
            self._copy(*item)
            item = None  # keep no job (nor the load and pools it references) while idle

    def _copy(self, job: CopyJob, layer: int) -> None:
        try:
            job.copy_layer(layer)
        except BaseException as exc:  # noqa: BLE001 - handed to the waiting engine thread
            log.exception("host → device copy of layer %d failed", layer)
            with self._cond:
                if job in self._jobs:
                    self._jobs.remove(job)
            job.fail(exc)
            return
        job.ready[layer].set()
