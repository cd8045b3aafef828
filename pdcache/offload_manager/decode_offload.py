"""DecodeOffloadManager: the decode node writes the KV it holds (prompt + answer) to storage.

In PD serving the answer's KV exists only on the decode node. This manager watches running
requests and, every `stride_pages` completed pages, schedules those pages for offload:

  decode loop ──(enqueue, never blocks)──► copy thread: exists_prefix → skip stored pages,
      device → host staging copy, release device pages when asked ──► IoWorker: staging →
      storage (origin = decode), then staging pages freed

Keys continue the prompt's chain (docs/design.md §4.2), computed from token ids alone, so the next
turn's prefill finds prompt and answer pages under the keys it computes itself (with the same
key scheme, `pdcache.engine.page_keys.PageKeyScheme`: "pdcache" or "sglang"). Prompt pages
that prefill did not store are written too (only missing pages are copied), so the chain to the
answer is never broken.

Ownership: a request's device pages stay owned by the engine; after `finish`/`abort`, the
engine must not free them until `on_released` is called (on the copy thread), which happens
only after every copy that reads them has finished. Host staging pages are freed only after
their write finished. When staging or the queue is full, pages are dropped and counted —
decode is never blocked and nothing leaks; the request's later pages and answer state are
dropped too (`_broken`: a lookup finds only a chain's prefix).

Announcements (the durable next turn, docs/design.md §4.10): with an `announcer` (the node's
`KVReceiver`), the keys of every scheduled batch are announced as pending when they are
scheduled (decode loop, before the request's final output leaves the engine), and settled
when their fate is known (copy thread or writer: already stored, written, or dropped/failed),
so the next turn's prefill can wait for them instead of recomputing. Each pending mark carries
the expected time until the batch lands (`write_eta_s`: the writes queued ahead of it and
itself, times the mean measured write latency; 0 before the first write is measured).

Hybrid models (docs/design.md §4.14): `finish(..., state=AnswerState)` also writes the
answer's end state — the recurrent state after the request's last full page, which the
scheduler's `DecodeRole` hands over — as a stored state object under
`state_key(key of that page, geometry key)`, origin "decode", after the request's last pages
(same writer, same order), so turn t+1 on a prefill node restores the state decode produced.
A sliding-window model whose tiers store window tails (docs/design.md §4.14) writes its
answer's window tail the same way (`AnswerState` of a `WindowTailGeometry` snapshot, under
`window_page_key`), its pages staged from the full layers' pool only (`geometry`: the full
layers, `window` None).
Only that one checkpoint: it is the point the next turn's prompt reaches. Its key is announced
with the last batch's page keys (the next turn's prefill waits for it as for pending pages)
and settled when its write ends; it is never staged, so a pull never serves it.

Pulls (docs/design.md §4.10): from the end of a batch's device → staging copy until its write
ends, `staged_objects(keys)` serves its pages as stored page objects (`page_format`, sealed
with the store's page MAC key), for `KVReceiver.serve_pulls`. A page being sent is pinned: the
write's end does not free it until the sender unpinned it (`_staged`, `_pins`,
`_free_unpinned`, all under `self._lock`).
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from pdcache.engine.config import dtype_name
from pdcache.engine.kv_geometry import KVGeometry
from pdcache.engine.page_keys import PageKeyScheme
from pdcache.engine.state_pool import StateSnapshot
from pdcache.engine.window_pages import WindowPages
from pdcache.kernels import KernelSet
from pdcache.offload_manager.host_pool import HostKVPool
from pdcache.offload_manager.io_worker import IoKind, IoResult, IoTask, IoWorker
from pdcache.offload_manager.storage.base import StorageBackend
from pdcache.offload_manager.storage.config import storage_session, tenant_namespace
from pdcache.offload_manager.storage.page_format import encode_object, payload_views

log = logging.getLogger(__name__)


class MarksDelivered(Protocol):
    """Whether an announcement reached its listeners (`pdcache.transfer.delivery.MarksDelivery`):
    `add_done_callback(fn)` runs `fn` once it did, or once waiting for it stopped (bounded)."""

    def add_done_callback(self, fn: Callable[[], None]) -> None: ...


class PageAnnouncer(Protocol):
    """Who hears about the keys offload writes (`KVReceiver`: every registered prefill peer).
    Called from the decode loop, the copy thread and the writer: thread-safe, non-blocking.
    `announce_pending` may return how to learn that the marks arrived (None: nothing to
    wait for)."""

    def announce_pending(self, keys: list[bytes], ttl_s: float,
                         eta_s: float = 0.0) -> MarksDelivered | None: ...

    def announce_settled(self, keys: list[bytes], landed: list[bool]) -> None: ...


@dataclass
class OffloadStats:
    pages_scheduled: int = 0
    pages_offloaded: int = 0  # written to storage by this node
    pages_skipped: int = 0  # already in storage
    pages_dropped: int = 0  # backpressure: staging or queue full
    pages_failed: int = 0  # storage write failed
    # window pages: prompt pages whose sliding layers never came here (prefill stores them)
    pages_left_to_prefill: int = 0
    write_seconds_total: float = 0.0
    writes: int = 0
    states_offloaded: int = 0  # hybrid models: answer-end states written as state objects
    states_failed: int = 0  # their write failed (or its pages' copy did)
    # not written: some of their pages were dropped (staging short), so no later request
    # could hit them; a state is one whole object (73.7 MiB on Qwen3-Next-80B)
    states_dropped: int = 0
    state_bytes_offloaded: int = 0


@dataclass(frozen=True)
class AnswerState:
    """A hybrid request's recurrent state after its first `tokens` tokens (a whole number of
    pages, the last full page of its K/V), as an owned host snapshot."""

    tokens: int
    snapshot: StateSnapshot


@dataclass
class _Tracked:
    tenant: str
    session: str = ""  # the request's session_id (storage lifecycle)
    chain: bytes | None = None  # key scheme's chain state after the last page scheduled
    last_key: bytes | None = None  # the key of the last page scheduled
    scheduled_pages: int = 0
    delivery: MarksDelivered | None = None  # of the last announcement of its pages


@dataclass
class _CopyTask:
    rid: str
    keys: list[bytes]
    device_page_ids: list[int]
    on_released: Callable[[], None] | None = None  # set on the request's last task
    namespace: str = ""  # the request's tenant namespace (storage quotas)
    session: str = ""  # the request's session_id (storage lifecycle)
    state: tuple[bytes, AnswerState] | None = None  # written after the pages: (key, state)
    # window pages: the sliding layers' page of each device page (None: not on this node)
    window_page_ids: list[int | None] | None = None
    end_page: int = 0  # the request's leading pages this task and those before it cover

    def state_keys(self) -> list[bytes]:
        """The announced state key of this task, if it writes one (to settle it)."""
        return [self.state[0]] if self.state is not None else []


class DecodeOffloadManager:
    """Asynchronous device → host → storage offload of decode requests' full pages.

    Thread model: `track`, `on_step`, `finish`, `abort` are called by the decode loop (one
    thread); the copy thread (started by `start()`, not by the constructor) and the IoWorker
    thread own staging pages while they use them.
    `self._lock` guards the stats and the in-flight counters. `key_scheme` / `key_namespace`
    name the stored pages (`PageKeyScheme`; the prefill nodes' HiCacheConfig must agree).
    """

    def __init__(
        self,
        device_kv: torch.Tensor,
        storage: StorageBackend,
        fingerprint: str,
        staging_pages: int,
        stride_pages: int = 1,
        max_queued_pages: int = 4096,
        max_queued_writes: int = 256,
        key_scheme: str = "pdcache",
        key_namespace: str = "",
        kernels: KernelSet | None = None,
        pending_ttl_s: float = 10.0,
        window: WindowPages | None = None,
        geometry: KVGeometry | None = None,
    ) -> None:
        """`device_kv` is the engine's pool; with `window` (a sliding-window model's window
        pages) it holds the full layers only and `window.pool` the sliding ones, and
        `geometry` (the model's, every layer) is what pages are staged and stored as."""
        if geometry is None:
            geometry = KVGeometry.from_device_shape(tuple(device_kv.shape),
                                                    dtype_name(device_kv.dtype))
        page_size = device_kv.shape[3]
        self.device_kv = device_kv
        self.window = window
        self.geometry = geometry
        self.kernels = kernels or KernelSet()  # the node's EngineConfig.kernels (default auto)
        self.page_size = page_size
        self.fingerprint = fingerprint
        self.scheme = PageKeyScheme(fingerprint, page_size, key_scheme, key_namespace)
        self.stride_pages = max(1, stride_pages)
        self.staging = HostKVPool(staging_pages, geometry, page_size)
        self._max_queued_writes = max_queued_writes
        self.writer: IoWorker | None = None  # started with the copy thread
        self.max_queued_pages = max_queued_pages
        self.storage = storage
        self.stats = OffloadStats()
        self._requests: dict[str, _Tracked] = {}
        self._tasks: queue.Queue[_CopyTask | None] = queue.Queue()
        # re-entrant: `_enqueue` unschedules the keys it drops while holding it
        self._lock = threading.RLock()
        self._staged_changed = threading.Condition(self._lock)  # a copy task ended
        self._queued_pages = 0
        self._pending_writes = 0
        self._pending_copies = 0
        self._thread: threading.Thread | None = None
        self.pending_ttl_s = pending_ttl_s  # how long an announced write may take
        self._announcer: PageAnnouncer | None = None
        # staged pages servable to a pull (under self._lock): key -> staging page, from the
        # end of its copy to the end of its write; pins of pages being sent, and the pages
        # whose write ended while pinned (freed by the last unpin)
        self._staged: dict[bytes, int] = {}
        # keys scheduled (announced) whose copy to staging has not ended: a pull waits for them
        self._scheduled: dict[bytes, int] = {}  # key -> batches scheduling it
        self._pins: dict[int, int] = {}
        self._free_unpinned: set[int] = set()
        # requests a page of which was dropped (queue, staging or writer full): a lookup finds
        # only a chain's prefix, so their later pages and answer state are dropped too (they
        # were written, unreachable, the state's 73.7 MiB on Qwen3-Next-80B included); until
        # their last task
        self._broken: set[str] = set()
        # rid -> its leading pages whose copies ended (window pages: the engine frees sliding
        # pages out of the window only below it, `copied_pages`)
        self._copied: dict[str, int] = {}
        self.pull_pages_served = 0

    def announce_to(self, announcer: PageAnnouncer | None) -> None:
        """Announce scheduled and settled keys to `announcer` (set before `start()`)."""
        self._announcer = announcer

    def start(self) -> DecodeOffloadManager:
        """Start the copy thread and the storage writer's (the node's runtime does, with its
        other threads)."""
        if self._thread is not None:
            raise RuntimeError("decode offload manager already started")
        self.writer = IoWorker(self.storage, "decode-offload",
                               max_queued=self._max_queued_writes).start()
        self._thread = threading.Thread(target=self._copy_loop, name="pdcache-offload-copy",
                                        daemon=True)
        self._thread.start()
        return self

    # ---- decode-loop side --------------------------------------------------------------
    def end_session(self, session_id: str, cache_salt: str) -> bool:
        """Close the storage session this node's offload writes for (`cache_salt`,
        `session_id`) used (`storage_session`). Any thread: backends are thread-safe."""
        if not session_id:
            return False
        self.storage.end_session(storage_session(tenant_namespace(cache_salt), session_id))
        return True

    def track(self, rid: str, cache_salt: str = "", session_id: str = "") -> None:
        self._requests[rid] = _Tracked(cache_salt, session_id)

    def due(self, rid: str, kv_len: int) -> bool:
        """Cheap check before `on_step`: has `rid` completed `stride_pages` new pages?"""
        tracked = self._requests.get(rid)
        return tracked is not None and (
            kv_len // self.page_size - tracked.scheduled_pages >= self.stride_pages)

    def on_step(self, rid: str, kv_token_ids: Sequence[int], device_page_ids: Sequence[int],
                window_page_ids: Sequence[int | None] | None = None) -> None:
        """`kv_token_ids`: every token of the request whose KV is in `device_page_ids` now
        (and, with window pages, whose sliding layers are in `window_page_ids`)."""
        tracked = self._requests.get(rid)
        if tracked is None:
            return
        full_pages = len(kv_token_ids) // self.page_size
        if full_pages - tracked.scheduled_pages >= self.stride_pages:
            self._schedule(rid, tracked, kv_token_ids, device_page_ids, full_pages, None,
                           window_page_ids=window_page_ids)

    def tracking(self, rid: str) -> bool:
        """Whether `rid` is being offloaded (decode loop's thread)."""
        return rid in self._requests

    def copies_done(self, rid: str) -> bool:
        """No copy of `rid` scheduled so far still reads its pages (decode loop's thread,
        which alone schedules them): its pages may go now (a retraction)."""
        tracked = self._requests.get(rid)
        return tracked is None or self.copied_pages(rid) >= tracked.scheduled_pages

    def copied_pages(self, rid: str) -> int:
        """How many leading pages of `rid` no queued copy reads any more (any thread): the
        engine may free their sliding pages as the window moves (window pages)."""
        with self._lock:
            return self._copied.get(rid, 0)

    def finish(self, rid: str, kv_token_ids: Sequence[int], device_page_ids: Sequence[int],
               on_released: Callable[[], None], state: AnswerState | None = None,
               window_page_ids: Sequence[int | None] | None = None
               ) -> MarksDelivered | None:
        """Offload the remaining full pages; `on_released` fires once the device pages are free
        to reuse (on the copy thread). Returns the delivery of the request's last pending
        marks (None: none announced): its answer should go out only once it is done, so that
        the next turn's prefill knows the pages are coming (docs/design.md §4.10). `state`:
        a hybrid model's state after the last full page, written after the pages (ignored
        unless it is the state there)."""
        tracked = self._requests.pop(rid, None)
        if tracked is None:
            on_released()
            return None
        full_pages = len(kv_token_ids) // self.page_size
        self._schedule(rid, tracked, kv_token_ids, device_page_ids, full_pages, on_released,
                       state if state is not None and state.tokens == full_pages * self.page_size
                       else None, window_page_ids)
        # one link's frames are handled in order: the last delivery covers the earlier marks
        return tracked.delivery

    def abort(self, rid: str, on_released: Callable[[], None]) -> None:
        """Stop offloading `rid`; already queued copies finish first, then `on_released`."""
        self._requests.pop(rid, None)
        self._enqueue(_CopyTask(rid, [], [], on_released))

    # ---- observability -----------------------------------------------------------------
    @property
    def idle(self) -> bool:
        """No copy or write in flight, and no staging page held by a pull's send (a pinned
        page whose write ended is freed only at its unpin)."""
        with self._lock:
            return (self._pending_copies == 0 and self._pending_writes == 0
                    and not self._pins and not self._free_unpinned)

    def wait_idle(self, timeout_s: float) -> bool:
        deadline = time.monotonic() + timeout_s
        while not self.idle:
            if time.monotonic() > deadline:
                return False
            time.sleep(0.005)
        return True

    def snapshot(self) -> dict[str, float]:
        """The counters and what is in flight now (any thread; metrics read this)."""
        with self._lock:
            stats = dict(vars(self.stats))
            stats.update(pending_copies=self._pending_copies,
                         pending_writes=self._pending_writes, queued_pages=self._queued_pages)
            stats["pull_pages_served"] = self.pull_pages_served
        stats["staging_pages_total"] = self.staging.capacity
        stats["staging_pages_used"] = self.staging.capacity - self.staging.num_free
        return stats

    def check(self) -> None:
        """Accounting: when idle, no staging page is in use and no request page is held."""
        self.staging.check()
        if self.idle:
            assert self.staging.num_free == self.staging.capacity, "staging pages leaked"

    def close(self, timeout_s: float = 10.0) -> None:
        """Finish the queued copies (their release callbacks run), then stop both threads."""
        if self._thread is not None:
            self._tasks.put(None)
            self._thread.join(timeout_s)
        if self.writer is not None:
            self.writer.close(timeout_s)

    # ---- internals ---------------------------------------------------------------------
    def _schedule(self, rid: str, tracked: _Tracked, kv_token_ids: Sequence[int],
                  device_page_ids: Sequence[int], full_pages: int,
                  on_released: Callable[[], None] | None,
                  state: AnswerState | None = None,
                  window_page_ids: Sequence[int | None] | None = None) -> None:
        first = tracked.scheduled_pages
        new_tokens = kv_token_ids[first * self.page_size : full_pages * self.page_size]
        keys, tracked.chain = self.scheme.keys(new_tokens, tracked.tenant, tracked.chain)
        tracked.scheduled_pages = full_pages
        tracked.last_key = keys[-1] if keys else tracked.last_key
        state_entry = None
        if state is not None and tracked.last_key is not None:
            state_entry = (state.snapshot.geometry.object_key(tracked.last_key), state)
        window = None
        if self.window is not None:
            assert window_page_ids is not None, "window pages: the sliding pages are needed"
            window = list(window_page_ids[first:full_pages])
        task = _CopyTask(rid, keys, list(device_page_ids[first:full_pages]), on_released,
                         tenant_namespace(tracked.tenant), tracked.session, state_entry,
                         window, full_pages)
        # the answer-end state is announced with its pages (the next turn waits for both)
        # and settled when its own write ends; never pulled: pulls serve staged pages only
        announced = keys + ([state_entry[0]] if state_entry is not None else [])
        if announced and self._announcer is not None:
            with self._lock:
                for key in keys:
                    self._scheduled[key] = self._scheduled.get(key, 0) + 1
            tracked.delivery = self._announcer.announce_pending(announced, self.pending_ttl_s,
                                                                self.write_eta_s())
        self._enqueue(task)

    def write_eta_s(self) -> float:
        """How long a batch scheduled now is expected to take to land: the copies and writes
        ahead of it and itself, one writer, at the mean measured write latency (0: no write
        measured yet)."""
        with self._lock:
            if not self.stats.writes:
                return 0.0
            mean_s = self.stats.write_seconds_total / self.stats.writes
            return (self._pending_copies + self._pending_writes + 1) * mean_s

    # ---- pulls (transfer control plane, docs/design.md §4.10) ----------------------------
    @property
    def object_bytes(self) -> int:
        return self.storage.spec.object_bytes

    @property
    def sealed(self) -> bool:
        """The objects `staged_objects` gives carry the store's page MAC."""
        return self.storage.spec.sealer is not None

    def staged_objects(self, keys: list[bytes], until: float = 0.0) -> list[bytes | None]:
        """The stored page object of each key still in staging (its write has not ended), or
        None; any thread. A key scheduled whose copy to staging has not ended yet (a pull
        right behind the announcement) is waited for, until `until` (time.monotonic) at the
        latest. The pages are pinned while they are encoded (the copy)."""
        with self._lock:
            while any(k in self._scheduled and k not in self._staged for k in keys):
                left_s = until - time.monotonic()
                if left_s <= 0:
                    break
                self._staged_changed.wait(left_s)
            ids = [self._staged.get(key) for key in keys]
            for page in ids:
                if page is not None:
                    self._pins[page] = self._pins.get(page, 0) + 1
        try:
            spec = self.storage.spec
            pages = self.staging.page_bytes([p for p in ids if p is not None])
            objects: list[bytes | None] = []
            it = iter(pages)
            for key, page in zip(keys, ids):
                objects.append(None if page is None else
                               encode_object(spec, key, "decode", payload_views(next(it))))
            with self._lock:  # counted before the unpin: `idle` implies final counters
                self.pull_pages_served += sum(obj is not None for obj in objects)
        finally:
            self._unpin([p for p in ids if p is not None])
        return objects

    def _unpin(self, pages: list[int]) -> None:
        free = []
        with self._lock:
            for page in pages:
                left = self._pins[page] - 1
                if left:
                    self._pins[page] = left
                    continue
                del self._pins[page]
                if page in self._free_unpinned:
                    self._free_unpinned.discard(page)
                    free.append(page)
        if free:
            self.staging.free(free)

    def _unstage(self, keys: list[bytes], staging_ids: list[int]) -> None:
        """The write of these pages ended: no more pulls of them; free those not being sent."""
        with self._lock:
            for key in keys:
                self._staged.pop(key, None)
            free = [p for p in staging_ids if p not in self._pins]
            self._free_unpinned.update(p for p in staging_ids if p in self._pins)
        if free:
            self.staging.free(free)

    def _enqueue(self, task: _CopyTask) -> None:
        """Queue a copy; beyond `max_queued_pages` the pages are dropped (counted) but a release
        marker is still queued, so the device pages are released in order and never leak."""
        with self._lock:
            self.stats.pages_scheduled += len(task.keys)
            if self._queued_pages + len(task.keys) > self.max_queued_pages:
                self.stats.pages_dropped += len(task.keys)
                self.stats.states_dropped += len(task.state_keys())
                self._broken.add(task.rid)
                self._settle(task.keys + task.state_keys(), False)
                self._unschedule(task.keys)
                # its pages dropped (so is its state), but queued in order as a marker: the
                # copies before it end, then the request's copied mark passes its pages
                # (`copies_done`: nothing stays unretractable for a copy that never runs)
                task = _CopyTask(task.rid, [], [], task.on_released, task.namespace,
                                 task.session, end_page=task.end_page)
            self._queued_pages += len(task.keys)
            self._pending_copies += 1
        self._tasks.put(task)  # unbounded queue of small records: never blocks the decode loop

    def _copy_loop(self) -> None:
        while True:
            task = self._tasks.get()
            if task is None:
                return
            state_queued = False
            try:
                whole = self._copy(task)
                if task.state is not None and not whole:
                    self._settle(task.state_keys(), False)
                    with self._lock:
                        self.stats.states_dropped += 1
                elif task.state is not None:
                    state_queued = True  # settled by its write from here on
                    self._write_state(task.state[0], task.state[1], task.namespace,
                                      task.session)
            except Exception:
                log.exception("decode offload: copy of %s failed", task.rid)
                self._settle(task.keys + ([] if state_queued else task.state_keys()), False)
            finally:
                self._unschedule(task.keys)  # staged by now, or never will be
                with self._lock:
                    if task.on_released is not None:  # the request's last task
                        self._broken.discard(task.rid)
                        self._copied.pop(task.rid, None)
                    elif task.end_page:
                        self._copied[task.rid] = task.end_page
                if task.on_released is not None:
                    self._release(task)
                with self._lock:
                    self._pending_copies -= 1
                    self._queued_pages -= len(task.keys)

    def _release(self, task: _CopyTask) -> None:
        try:
            task.on_released()
        except Exception:
            log.exception("decode offload: release callback of %s failed", task.rid)

    def _copy(self, task: _CopyTask) -> bool:
        """Stage `task`'s pages not stored yet and submit their write. True when every page
        is stored or on its way: only then can the state at their end be hit."""
        if not task.keys:
            return task.rid not in self._broken
        if task.rid in self._broken:  # a page before these was dropped: unreachable
            self._drop(task.keys)
            return False
        stored = self._stored_prefix(task.keys)
        todo = list(range(stored, len(task.keys)))
        with self._lock:
            self.stats.pages_skipped += stored
        self._settle(task.keys[:stored], True)
        todo = self._without_absent_windows(task, todo)
        if not todo:
            return True
        # Short of staging: keep the chain's head (only a prefix of a chain is ever found),
        # drop the tail. Only this thread allocates, so the free count can only grow here.
        fits = min(len(todo), self.staging.num_free)
        staging_ids = self.staging.alloc(fits) if fits else None
        kept = len(staging_ids) if staging_ids else 0
        self._drop([task.keys[i] for i in todo[kept:]])
        if kept < len(todo):
            self._break_chain(task.rid)
        if not staging_ids:
            return False
        todo = todo[: len(staging_ids)]
        self._stage(task, todo, staging_ids)
        if not self._write([task.keys[i] for i in todo], staging_ids, task.namespace,
                           task.session):
            self._break_chain(task.rid)
        return task.rid not in self._broken

    def _without_absent_windows(self, task: _CopyTask, todo: list[int]) -> list[int]:
        """Window pages: a prompt page whose sliding layers this node never received (only
        the prompt's window tail comes from prefill) cannot be stored from here; prefill,
        which computed it, stores it (its write may still be on its way: settled as not
        landed here, not a break of the chain decode writes after it)."""
        if task.window_page_ids is None:
            return todo
        absent = [i for i in todo if task.window_page_ids[i] is None]
        if absent:
            self._settle([task.keys[i] for i in absent], False)
            with self._lock:
                self.stats.pages_left_to_prefill += len(absent)
        return [i for i in todo if task.window_page_ids[i] is not None]

    def _stage(self, task: _CopyTask, todo: list[int], staging_ids: list[int]) -> None:
        """Copy pages `todo` of `task` into staging pages `staging_ids`, as stored pages (every
        KV layer). With window pages the full layers come from the engine's pool and the
        sliding ones from the window pool, each layer into its row of the staged page."""
        host_ids = torch.tensor(staging_ids, dtype=torch.long)
        device_ids = torch.tensor([task.device_page_ids[i] for i in todo], dtype=torch.long)
        window = self.window
        if window is None:
            self.kernels.device_to_host(self.device_kv, self.staging.host_kv, device_ids,
                                        host_ids)
            return
        assert task.window_page_ids is not None
        window_ids = torch.tensor([task.window_page_ids[i] for i in todo], dtype=torch.long)
        host_kv = self.staging.host_kv  # [P, L, K, S, H, D]
        for rows, pool, ids in ((window.full_rows, self.device_kv, device_ids),
                                (window.sliding_rows, window.pool.device_kv, window_ids)):
            for layer, row in rows.items():  # pool [L', K, P, S, H, D] -> staged [n, K, S, H, D]
                pages = pool[row].index_select(1, ids.to(pool.device)).transpose(0, 1)
                host_kv[host_ids, self.geometry.kv_layer_index(layer)] = pages.to(host_kv.device)

    def _break_chain(self, rid: str) -> None:
        """A page of `rid` was dropped: its later pages and state are not written (`_broken`)."""
        with self._lock:
            self._broken.add(rid)

    def _drop(self, keys: list[bytes]) -> None:
        """Pages not written (counted dropped): their pending marks settle as not landed."""
        if not keys:
            return
        with self._lock:
            self.stats.pages_dropped += len(keys)
        self._settle(keys, False)

    def _stored_prefix(self, keys: list[bytes]) -> int:
        try:
            return self.storage.exists_prefix(keys)
        except Exception as exc:  # storage down: try writing everything, the writer counts it
            log.warning("decode offload: exists_prefix failed: %s", exc)
            return 0

    def _write(self, keys: list[bytes], staging_ids: list[int], namespace: str = "",
               session: str = "") -> bool:
        """Submit the write of staged pages; False when the writer refused it (full or
        closed: the pages are dropped, their staging freed)."""
        with self._lock:
            self._pending_writes += 1

        with self._lock:
            self._staged.update(zip(keys, staging_ids))  # copied: a pull may take them

        def done(result: IoResult) -> None:
            self._settle(keys, result.ok)
            self._unstage(keys, staging_ids)
            with self._lock:
                self._pending_writes -= 1
                ok = sum(result.ok)
                self.stats.pages_offloaded += ok
                self.stats.pages_failed += len(keys) - ok
                self.stats.write_seconds_total += result.seconds
                self.stats.writes += 1

        task = IoTask(IoKind.WRITE, keys, self.staging.page_bytes(staging_ids), done, "decode",
                      namespace=namespace,
                      session=storage_session(namespace, session))
        assert self.writer is not None, "start() the manager first"
        if not self.writer.submit(task):
            self._settle(keys, False)
            self._unstage(keys, staging_ids)
            with self._lock:
                self._pending_writes -= 1
                self.stats.pages_dropped += len(keys)
            return False
        return True

    def _write_state(self, key: bytes, state: AnswerState, namespace: str,
                     session: str) -> None:
        """Queue the answer's end state behind its pages (copy thread); the snapshot is the
        manager's own host copy, read by the writer until its write ends."""
        with self._lock:
            self._pending_writes += 1
        nbytes = state.snapshot.nbytes

        def done(result: IoResult) -> None:  # writer thread
            ok = sum(result.ok)
            self._settle([key], result.ok)
            with self._lock:
                self._pending_writes -= 1
                self.stats.states_offloaded += ok
                self.stats.states_failed += 1 - ok
                self.stats.state_bytes_offloaded += ok * nbytes

        task = IoTask(IoKind.WRITE_STATE, [key], [state.snapshot.data], done, "decode",
                      namespace=namespace, session=storage_session(namespace, session),
                      tokens=[state.tokens])
        assert self.writer is not None, "start() the manager first"
        if not self.writer.submit(task):
            self._settle([key], False)
            with self._lock:
                self._pending_writes -= 1
                self.stats.states_failed += 1

    def _unschedule(self, keys: list[bytes]) -> None:
        """These keys' copy task ended (staged, or settled without a copy): wake waiting
        pulls."""
        if not keys:
            return
        with self._lock:
            for key in keys:
                left = self._scheduled.get(key, 0) - 1
                if left > 0:
                    self._scheduled[key] = left
                else:
                    self._scheduled.pop(key, None)
            self._staged_changed.notify_all()

    def _settle(self, keys: list[bytes], landed: bool | list[bool]) -> None:
        """Tell the announcer how the write of `keys` ended (never raises)."""
        if not keys or self._announcer is None:
            return
        flags = [landed] * len(keys) if isinstance(landed, bool) else list(landed)
        try:
            self._announcer.announce_settled(keys, flags)
        except Exception:
            log.exception("decode offload: announcing settled pages failed")
