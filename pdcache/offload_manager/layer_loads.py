"""Host → device loads, one layer at a time, inside the forward (docs/design.md §4.2, §4.11).

Owns `LayerLoad`: the copy of a request's host hits and prefetched pages into its device
pages, layer l when the forward asks for it (`wait(l)`, called by the model runner right before
layer l's attention). It mutates only the device pages its request owns and the host pool's pins
of its host pages (pinned at creation, unpinned when it is done); it takes no lock of its own.

Threads: the engine thread creates, waits on and finishes a load; completion (`_finish`: unpin,
the owner's callbacks) always runs there. With a `LoadCopier` (CPU device pools, `copy_ahead`)
the per-layer copies run on the copier's thread (`pdcache-h2d`), which only copies and sets the
job's per-layer events; `wait(l)` then waits for layer l's event, at most `copy_timeout_s`.

Layer-streamed loads (`StreamedPages`, `layerwise_prefetch`): the load's last pages are still
being read from storage layer-major by the prefetch IO thread into their host pages, which
serve as the staging buffer. `wait(l)` first waits for layer l of those reads only
(`LayerStream.wait_layer`, never past the stream's deadline), so the read of layer l+1 overlaps
the load and compute of layer l. `finish()` waits for the pages' verification (checksum or MAC
of the whole page) after the forward; a page that failed (or a stream that timed out) marks the
load `failed`, and the scheduler discards what was computed from it and recomputes the request
(`Scheduler.requeue_failed_loads`; a request released before its forward caches none of its
pages, `Scheduler._release`). A copy that raises fails the load the same way (`copy_error`),
not the forward: the owner's `on_done` sees it (HiCache marks the nodes it restored suspect).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from pdcache.kernels import KernelSet
from pdcache.offload_manager.host_pool import HostKVPool
from pdcache.offload_manager.load_copier import CopyJob, LoadCopier
from pdcache.offload_manager.storage.layer_reads import LayerStream

log = logging.getLogger(__name__)

# Bound on the forward's wait for one layer's copy (copy_ahead): a layer is a few ms of memcpy,
# so only a wedged machine reaches it, and the request's step fails instead of hanging.
COPY_WAIT_S = 60.0


@dataclass(frozen=True)
class StreamedPages:
    """The part of a load whose pages a layer-streamed prefetch is still reading: `stream`'s
    pages `offset .. offset + count`, which are the load's last `count` pages."""

    stream: LayerStream
    offset: int
    count: int


class LayerLoad:
    """Host → device copy of some pages, one layer at a time, as the forward pass asks for
    them (`wait(layer)`). With a `copier` (CPU pools, `copy_ahead`) every layer is handed to
    it at creation and copied on its thread in order, and `wait(layer)` waits until layer
    `layer` was copied (at most `copy_timeout_s`); without one (or when it is not running) the
    copy runs in the caller's thread inside `wait`. The host pages stay pinned until the load
    is done; completion (`_finish`: unpin, callbacks) always runs on the caller's (engine)
    thread. `copy_layer` is the copy of one layer (a subclass may instrument it).

    With `streamed` pages, layer l is copied once the stream has read layer l of them (the
    read of layer l+1 goes on meanwhile); `finish()` then waits for their verification and sets
    `failed` when one did not verify (what was computed from them must be discarded)."""

    def __init__(self, host_pool: HostKVPool, device_kv: torch.Tensor, host_page_ids: list[int],
                 device_page_ids: list[int], on_done: Callable[[], None] | None = None,
                 on_copied: Callable[[float, float], None] | None = None,
                 kernels: KernelSet | None = None,
                 streamed: StreamedPages | None = None,
                 on_streamed: Callable[[float, float, bool], None] | None = None,
                 copier: LoadCopier | None = None, copy_timeout_s: float = COPY_WAIT_S) -> None:
        self.host_pool = host_pool
        self.device_kv = device_kv
        self.kernels = kernels or KernelSet()
        self.host_ids = torch.tensor(host_page_ids, dtype=torch.long)
        self.device_ids = torch.tensor(device_page_ids, dtype=torch.long)
        self.host_page_ids = host_page_ids
        self.num_layers = device_kv.shape[0]
        self.streamed = streamed
        # streamed pages that did not verify, or a copy that raised (known once done)
        self.failed = False
        self.copy_error: BaseException | None = None  # the copy that raised (its pages hold junk)
        self._next_layer = 0
        self._finished = False
        self._on_done = on_done
        self._on_copied = on_copied
        self._on_streamed = on_streamed
        self.copy_s = 0.0  # written by the copier thread; read after its last layer's event
        self.copy_wait_s = 0.0
        self.stream_wait_s = 0.0
        self._copy_timeout_s = copy_timeout_s
        host_pool.pin(host_page_ids)
        # streamed pages arrive layer by layer from storage: copied inline, after each layer's
        # read (a copier thread would only wait on the stream in the engine's place)
        self._job: CopyJob | None = None
        self._copier = copier
        self._timed_out = False  # a copy outlived copy_timeout_s: later waits raise at once
        if copier is not None and streamed is None:
            job = CopyJob(self.copy_layer, self.num_layers)
            self._job = job if copier.submit(job) else None

    @property
    def layers_loaded(self) -> int:
        """Layers copied (or handed to the copier and waited for) so far, from layer 0."""
        return self._next_layer

    def copy_layer(self, layer: int) -> None:
        """Copy layer `layer` of every page host → device (the copier's or the caller's
        thread)."""
        start = time.perf_counter()
        self.kernels.host_to_device(self.host_pool.host_kv, self.device_kv, self.host_ids,
                                    self.device_ids, layer=layer)
        self.copy_s += time.perf_counter() - start

    def _await_copied(self, layer: int) -> None:
        job = self._job
        assert job is not None
        if self._timed_out:
            raise RuntimeError(f"host → device copy of layer {layer} timed out earlier")
        start = time.perf_counter()
        ended = job.ready[layer].wait(self._copy_timeout_s)
        self.copy_wait_s += time.perf_counter() - start
        if job.error is not None:  # the copier is done with this load
            self._copy_failed(layer, job.error)
            return
        if not ended:  # still queued or copying: its pages stay pinned and reserved
            self._timed_out = True
            if self._copier is not None:
                self._copier.mark_wedged()
            raise RuntimeError(f"host → device copy of layer {layer} did not end in "
                               f"{self._copy_timeout_s:.0f} s")

    def wait(self, layer: int) -> None:
        """Layers up to `layer` are on device, or the load failed (`failed`: the forward goes
        on over junk, and the scheduler recomputes whoever read it)."""
        while self._next_layer <= layer and not self._finished:
            if self._job is not None:
                self._await_copied(self._next_layer)
            else:
                if self.streamed is not None:
                    start = time.perf_counter()
                    self.streamed.stream.wait_layer(self._next_layer)
                    self.stream_wait_s += time.perf_counter() - start
                try:
                    self.copy_layer(self._next_layer)
                except Exception as exc:  # noqa: BLE001 - the load fails, not the step
                    self._copy_failed(self._next_layer, exc)
            if self._finished:  # the copy failed
                return
            self._next_layer += 1
            if self._next_layer == self.num_layers and self.streamed is None:
                self._finish()

    def _copy_failed(self, layer: int, error: BaseException) -> None:
        """A copy raised: the device pages hold junk from `layer` on. The load ends failed
        (host pages unpinned, the owner told through its callbacks: HiCache marks the
        restored nodes suspect); the scheduler requeues every request that read them
        (`Scheduler.requeue_failed_loads`) instead of the whole step failing."""
        log.error("host → device copy of layer %d failed: %r", layer, error)
        self.copy_error = error.with_traceback(None)
        self.failed = True
        self._next_layer = self.num_layers
        self._finish()

    def finish(self) -> None:
        """Load every remaining layer (e.g. when the batch was cancelled) and, for streamed
        pages, wait for their verification."""
        if self._next_layer < self.num_layers:
            self.wait(self.num_layers - 1)
        if not self._finished:
            self._finish()

    @property
    def done(self) -> bool:
        return self._finished

    def _finish(self) -> None:
        self._finished = True
        # the job's copy_layer is a bound method of this load: drop the cycle, so the pools it
        # references go with the engine, not with the next cyclic garbage collection
        self._job = self._copier = None
        if self.streamed is not None:
            start = time.perf_counter()
            ok = self.streamed.stream.wait_done()
            verify_wait_s = time.perf_counter() - start
            first = self.streamed.offset
            self.failed = self.failed or not all(ok[first : first + self.streamed.count])
            if self._on_streamed is not None:
                self._on_streamed(self.stream_wait_s, verify_wait_s, self.failed)
        self.host_pool.unpin(self.host_page_ids)
        if self._on_copied is not None:
            self._on_copied(self.copy_s, self.copy_wait_s)
        if self._on_done is not None:
            self._on_done()
