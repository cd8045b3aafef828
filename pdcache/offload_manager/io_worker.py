"""Background storage I/O with bounded queues: used by the HiCache controller (backup and
prefetch) and by the DecodeOffloadManager (writes of generated KV).

A task is a batch of page keys plus the host pages they map to; the worker calls the storage
backend and hands the per-page results to the task's `on_done` callback (on the worker thread).
A backend exception fails that task (all pages False), is logged and counted; the worker keeps
running. Submitting to a full queue returns False at once: callers apply backpressure (drop or
retry later), they never block the scheduling loop.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from enum import Enum

import torch

from pdcache.offload_manager.storage.base import StorageBackend
from pdcache.offload_manager.storage.layer_reads import LayerStream

log = logging.getLogger(__name__)


class IoKind(Enum):
    READ = "read"
    WRITE = "write"
    READ_LAYERS = "read_layers"  # layer-major read reported to `IoTask.stream` (layer_reads.py)
    # recurrent-state objects (hybrid models; storage `put_state` / `get_state_into`): one host
    # state slot (`host_pages[0]`); `keys[i]` is the state after `tokens[i]` tokens
    WRITE_STATE = "write_state"  # every key stored from the one slot
    READ_STATE = "read_state"  # candidates, deepest first: the first that verifies is read


@dataclass
class IoResult:
    ok: list[bool]
    origins: list[str | None]
    seconds: float
    error: str | None = None


@dataclass
class IoTask:
    kind: IoKind
    keys: list[bytes]
    host_pages: Sequence[torch.Tensor]
    on_done: Callable[[IoResult], None]
    origin: str = "prefill"
    cancelled: threading.Event = field(default_factory=threading.Event)
    namespace: str = ""  # writes: the pages' tenant namespace (storage quotas)
    session: str = ""  # writes: the conversation that wrote them (storage lifecycle)
    stream: LayerStream | None = None  # READ_LAYERS: where the read reports its progress
    tokens: list[int] = field(default_factory=list)  # *_STATE: each key's token position


@dataclass
class IoStats:
    tasks_done: int = 0
    tasks_failed: int = 0
    tasks_rejected: int = 0
    pages_read: int = 0
    pages_written: int = 0
    pages_failed: int = 0
    states_read: int = 0
    states_written: int = 0
    state_read_errors: int = 0  # a candidate state whose read raised (the next was tried)
    callback_errors: int = 0


class IoWorker:
    """One thread draining one bounded queue of I/O tasks against one backend.

    The thread starts in `start()` (tasks submitted before wait in the queue) and stops in
    `close()`, after the tasks queued before it."""

    def __init__(self, backend: StorageBackend, name: str, max_queued: int = 256) -> None:
        self.backend = backend
        self.name = name
        self.stats = IoStats()
        self._queue: queue.Queue[IoTask | None] = queue.Queue(maxsize=max_queued)
        self._thread = threading.Thread(target=self._loop, name=f"pdcache-io-{name}", daemon=True)
        self._stats_lock = threading.Lock()
        self._started = False

    def start(self) -> IoWorker:
        """Start the worker thread (once; later calls do nothing)."""
        if not self._started:
            self._started = True
            self._thread.start()
        return self

    @property
    def queue_depth(self) -> int:
        return self._queue.qsize()

    def submit(self, task: IoTask) -> bool:
        """Queue `task`; False (and counted) when the queue is full."""
        try:
            self._queue.put_nowait(task)
            return True
        except queue.Full:
            self._count(tasks_rejected=1)
            return False

    def close(self, timeout_s: float = 5.0) -> None:
        """Stop after the queued tasks; bounded wait. A worker never started has no thread."""
        if not self._started:
            return
        deadline = time.monotonic() + timeout_s
        while self._thread.is_alive() and time.monotonic() < deadline:
            try:
                self._queue.put(None, timeout=0.1)
                break
            except queue.Full:
                continue
        self._thread.join(max(0.0, deadline - time.monotonic()))

    def _loop(self) -> None:
        while True:
            task = self._queue.get()
            if task is None:
                return
            result = self._run(task)
            try:
                task.on_done(result)
            except Exception:  # a broken callback must not kill the worker
                log.exception("io worker %s: completion callback failed", self.name)
                self._count(callback_errors=1)

    def _run(self, task: IoTask) -> IoResult:
        start = time.perf_counter()
        n = len(task.keys)
        if task.cancelled.is_set():
            if task.stream is not None:
                task.stream.finish([])
            return IoResult([False] * n, [None] * n, 0.0, "cancelled")
        origins: list[str | None] = [None] * n
        try:
            if task.kind is IoKind.READ:
                ok = self.backend.get_into(task.keys, task.host_pages, origins)
            elif task.kind in (IoKind.WRITE_STATE, IoKind.READ_STATE):
                ok = self._run_state(task, origins)
            elif task.kind is IoKind.READ_LAYERS:
                assert task.stream is not None, "a READ_LAYERS task needs its stream"
                ok = self.backend.read_layers(task.keys, task.host_pages, task.stream,  # type: ignore[attr-defined]
                                              origins)
            else:
                ok = self.backend.put_from(task.keys, task.host_pages, task.origin,
                                           task.namespace, session=task.session)
        except Exception as exc:  # storage down or broken: count, log, survive
            log.warning("io worker %s: %s of %d pages failed: %s", self.name, task.kind.value, n, exc)
            if task.stream is not None:
                task.stream.finish([])  # wakes whoever waits on a layer
            self._count(tasks_failed=1, pages_failed=n)
            return IoResult([False] * n, origins, time.perf_counter() - start, str(exc))
        done = sum(ok)
        key = "pages_written" if task.kind is IoKind.WRITE else "pages_read"
        if task.kind in (IoKind.WRITE_STATE, IoKind.READ_STATE):
            key = "states_written" if task.kind is IoKind.WRITE_STATE else "states_read"
            self._count(tasks_done=1, **{key: done})
        else:
            self._count(tasks_done=1, pages_failed=n - done, **{key: done})
        return IoResult(list(ok), origins, time.perf_counter() - start)

    def _run_state(self, task: IoTask, origins: list[str | None]) -> list[bool]:
        """A state task: write every key from the slot, or read the first candidate that
        verifies (a refused or missing one is the backend's counted miss; try the next)."""
        slot = task.host_pages[0]
        ok = [False] * len(task.keys)
        for i, (key, tokens) in enumerate(zip(task.keys, task.tokens, strict=True)):
            if task.kind is IoKind.WRITE_STATE:
                ok[i] = self.backend.put_state(key, slot, tokens, task.origin, task.namespace,
                                               task.session)
                continue
            try:
                origin = self.backend.get_state_into(key, slot, tokens)
            except Exception as exc:  # a fault on one candidate: the next may still serve
                log.warning("io worker %s: reading state %s failed: %s", self.name,
                            key.hex()[:16], exc)
                self._count(state_read_errors=1)
                continue
            if origin is not None:
                ok[i], origins[i] = True, origin
                break
        return ok

    def _count(self, **deltas: int) -> None:
        with self._stats_lock:
            for name, delta in deltas.items():
                setattr(self.stats, name, getattr(self.stats, name) + delta)
