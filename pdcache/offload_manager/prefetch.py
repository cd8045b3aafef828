"""Storage prefetch: storage → host pages for queued requests (docs/design.md §4.2, §4.9–4.11).

Owns the prefetch `IoWorker` (thread `pdcache-io-prefetch`, when there is storage) and every
`PrefetchOp` (one per queued request: its keys, host pages, read batches, deadline), the ops
abandoned at admission or cancel whose reads still run, and the host pages of layer-streamed
reads that no load takes (freed once their read ended). It mutates the host pool (allocates the
prefetch's pages, commits what admission takes, frees the rest) and, through `PagePulls`, the
pulls of pending pages.

Prefetch policies decide how long a queued request waits for its storage reads: `best_effort`
(never waits: takes what has arrived), `wait_complete` (all reads finished), `timeout`
(finished, or base + per-1k-token × tokens / 1000 capped at max, elapsed).

Pages a decode node announced as being written (`PendingPages`, §4.10) extend a lookup past
storage's committed prefix: with `pending_wait` the request waits for them under its prefetch
policy (read as each lands; never past the deadline or the mark's TTL) instead of recomputing
them; without it they are only counted (`pending_raced_pages`). When decode offers it and
`pending_pull` allows (`page_pull.PagePulls.should_pull`: decode's expected remaining write time
against the awaited bytes at the measured pull rate), the awaited pages are pulled from decode's
host staging instead: verified like storage reads, they fill the prefetch's host pages; a
failed, rejected or late pull falls back to the wait.

With `layerwise_prefetch` (backends with `read_layers`) a prefetch without pending pages is one
layer-major read (`LayerStream`, §4.11): ready once its header pass ended; the load then waits
per layer (`layer_loads.LayerLoad`). A stream is cancelled when nobody will load it.

Hybrid models (docs/design.md §4.14, `host_states` set): a storage hit must end where the
linear layers' state can be restored too. The lookup probes, among the stored pages, the state
objects of their ends (`exists_states` of `geometry.object_key(page key)`, one batched call, deepest first) and reads
the pages up to the deepest one plus, into one host state slot, the first candidate state that
verifies (`get_state_into`; a missing or refused object is the backend's counted miss and the
next shallower candidate is tried). `take` cuts the hit to the state read (`state_pages`): no
state, no storage hit (the request starts from its device/host checkpoint), never pages
without their state. No layer-streamed reads for them. Decode announces the answer-end state
object it will write with the answer's pages (§4.10): with `pending_wait`, the deepest
announced state key at the end of a stored or pending page (`_pending_state`) makes the op wait
for the pending pages before it and for that state under the prefetch policy, like pending
pages; its read is submitted once its key LANDED (`_read_awaited_state`), else (GONE, deadline)
the stored candidates are read. Pulls bring pending pages, never the state: decode stages
pages, not states, and a state is one object of its own size (so the state is waited for).

Threads: every method runs on the engine thread. Read completions run on the prefetch IO
thread and only set an op's batch results and `Event`, or report to its `LayerStream` (its
own condition variable), and count through `count` (the owner's stats lock). No lock of its
own: the op tables are the engine thread's.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import torch

from pdcache.offload_manager.host_pool import HostKVPool
from pdcache.offload_manager.host_state_pool import HostStatePool
from pdcache.offload_manager.io_worker import IoKind, IoResult, IoTask, IoWorker
from pdcache.offload_manager.page_pull import PullTicket
from pdcache.offload_manager.pending import PageState, PendingPages
from pdcache.offload_manager.prefetch_ops import PrefetchOp, PrefetchResult, ReadBatch
from pdcache.offload_manager.storage.base import StorageBackend
from pdcache.offload_manager.storage.layer_reads import LayerStream

if TYPE_CHECKING:
    from pdcache.engine.radix import RadixNode
    from pdcache.engine.state_geometry import CheckpointGeometry
    from pdcache.offload_manager.backup import AllocHost, AllocHostState, Count, PageKeys
    from pdcache.offload_manager.hicache import HiCacheConfig

log = logging.getLogger(__name__)


class Prefetcher:
    """The prefetches of queued requests (module docstring). Engine thread only, except the
    read completions (prefetch IO thread)."""

    def __init__(self, host_pool: HostKVPool, storage: StorageBackend | None,
                 config: HiCacheConfig, page_size: int, num_layers: int,
                 pending: PendingPages | None, page_keys: PageKeys, alloc_host: AllocHost,
                 count: Count, host_states: HostStatePool | None = None,
                 alloc_host_state: AllocHostState | None = None) -> None:
        self.host_pool = host_pool
        self.host_states = host_states  # hybrid models: hits need their state object
        self._alloc_host_state = alloc_host_state
        self.storage = storage
        self.config = config
        self.page_size = page_size
        self.num_layers = num_layers
        self.pending = pending
        self._page_keys = page_keys
        self._alloc_host = alloc_host
        self._count = count
        self.worker = IoWorker(storage, "prefetch", config.max_queued_io) if storage else None
        self._ops: dict[str, PrefetchOp] = {}
        self._abandoned: list[PrefetchOp] = []
        # host pages of streamed prefetches that no load takes, freed once their read ended
        self._stream_frees: list[tuple[LayerStream, list[int]]] = []
        # hybrid ops waiting for an announced state object: rid -> ((pages, state key) awaited,
        # stored candidates deepest first); the read is submitted once the key settles
        self._state_waits: dict[str, tuple[tuple[int, bytes], list[tuple[int, bytes]]]] = {}

    # ---- the request's prefetch ----------------------------------------------------------
    def start(self, rid: str, token_ids: Sequence[int], salt: str, first_page: int,
              max_pages: int, keep: frozenset[RadixNode] = frozenset()) -> int:
        """Look up pages `first_page .. max_pages` of the prompt in storage and start reading
        the consecutive hits into host pages; returns the number of pages being read. Room
        on host is made without evicting `keep`'s host copies (nor dropping their host
        checkpoints): the request's own device + host match, which the read continues."""
        if self.worker is None or max_pages - first_page < self.config.prefetch_min_pages:
            return 0
        assert self.storage is not None
        start = time.perf_counter()
        keys = self._page_keys(token_ids[: max_pages * self.page_size], salt)[first_page:]
        try:
            hits = self.storage.exists_prefix(keys)
        except Exception as exc:
            log.warning("prefetch of %s: storage lookup failed: %s", rid, exc)
            self._count(storage_errors=1)
            return 0
        finally:
            self._count(prefetch_lookup_us=int((time.perf_counter() - start) * 1e6))
        if self.host_states is not None:
            return self._start_hybrid(rid, first_page, keys, hits, len(token_ids), keep)
        awaited = self._pending_after(keys, hits)
        total = hits + awaited
        if total < self.config.prefetch_min_pages:
            self._count(pending_raced_pages=awaited)
            return 0
        host_ids = self._alloc_host(total, keep)
        if host_ids is None:
            log.info("prefetch of %s stopped: no host room for %d pages", rid, total)
            self._count(pending_raced_pages=awaited)
            return 0
        op = self._submit_reads(rid, first_page, keys[:total], host_ids, len(token_ids),
                                submit=hits)
        op.awaited_first, op.awaited = hits, awaited
        if awaited and self.config.prefetch_policy != "best_effort":
            self._maybe_pull(op)  # best_effort admits at once: a pull would be abandoned
        self._ops[rid] = op
        return total

    def _start_hybrid(self, rid: str, first_page: int, keys: list[bytes], hits: int,
                      num_tokens: int, keep: frozenset[RadixNode]) -> int:
        """`start` for a hybrid model: the pages up to the deepest stored state object among
        the `hits` pages, and that state (or a shallower one) into a host state slot; or, past
        them, up to a state decode announced (awaited with its pending pages)."""
        assert self.storage is not None and self.host_states is not None
        if not self.storage.supports_states:
            return 0
        geometry = self.host_states.geometry  # a recurrent state's or a window tail's
        # (pages of the op, state key), deepest first; one batched lookup (engine thread: a
        # call per page was one metadata round trip per stored page on a remote store)
        probed = [(pages, geometry.object_key(keys[pages - 1])) for pages in range(hits, 0, -1)]
        try:
            found = self.storage.exists_states([key for _, key in probed])
            candidates = [probe for probe, present in zip(probed, found) if present]
        except Exception as exc:
            log.warning("prefetch of %s: state lookup failed: %s", rid, exc)
            self._count(storage_errors=1)
            return 0
        awaited = self._pending_state(keys, hits, candidates[0][0] if candidates else 0,
                                      geometry)
        if not candidates and awaited is None:
            self._count(prefetch_state_misses=1 if hits else 0)
            return 0
        total = awaited[0] if awaited is not None else candidates[0][0]
        if total < self.config.prefetch_min_pages:
            self._count(pending_raced_pages=max(0, total - hits) if awaited else 0)
            return 0
        assert self._alloc_host_state is not None
        slot = self._alloc_host_state(keep)
        host_ids = self._alloc_host(total, keep) if slot is not None else None
        if host_ids is None:
            if slot is not None:
                self.host_states.free(slot)
            log.info("prefetch of %s stopped: no host room for %d pages and a state", rid, total)
            self._count(pending_raced_pages=max(0, total - hits) if awaited else 0)
            return 0
        now = time.monotonic()
        op = PrefetchOp(rid, first_page, keys[:total], host_ids, [],
                        now + self.config.prefetch_timeout_s(num_tokens), submitted=0)
        self._submit_range(op, min(hits, total))
        op.state_slot, op.state_done = slot, threading.Event()
        self._ops[rid] = op
        if awaited is None:
            self._read_state(op, candidates)
            return total
        op.awaited_first, op.awaited = min(hits, total), max(0, total - hits)
        self._state_waits[rid] = (awaited, candidates)
        if op.awaited and self.config.prefetch_policy != "best_effort":
            self._maybe_pull(op)  # the pages only: the state is waited for (module docstring)
        self._read_landed(op)  # landed already (a late lookup): read it now
        return total

    def _pending_state(self, keys: list[bytes], hits: int, stored: int,
                       geometry: CheckpointGeometry
                       ) -> tuple[int, bytes] | None:
        """(pages, state key) of the deepest state object a decode announced as being written
        (pending or landed) at the end of page `stored + 1 ..` of the committed `hits` pages
        and the pending pages after them; None without one, or without `pending_wait` (the
        pending pages found are then counted raced: recomputed)."""
        if self.pending is None or not len(self.pending):
            return None  # nothing announced: no key to hash
        found = self.pending.run(keys[hits:])
        for pages in range(hits + found, stored, -1):
            key = geometry.object_key(keys[pages - 1])
            if self.pending.state(key) is PageState.GONE:
                continue
            self._count(pending_found_pages=pages - hits if pages > hits else 0)
            if not self.config.pending_wait:
                self._count(pending_raced_pages=max(0, pages - hits))
                return None
            return pages, key
        return None

    def _read_state(self, op: PrefetchOp, candidates: list[tuple[int, bytes]]) -> None:
        """Read the first of `candidates` that verifies into `op`'s host state slot (set
        with `state_done` beforehand); none: the op ends without a state."""
        assert self.worker is not None and self.host_states is not None
        assert op.state_slot is not None and op.state_done is not None
        host_states = self.host_states
        op.state_pages = [pages for pages, _ in candidates]
        tokens = [(op.first_page + pages) * self.page_size for pages, _ in candidates]
        state_done = op.state_done
        if not candidates:
            op.state_ok = -1
            state_done.set()
            return

        def done(result: IoResult) -> None:  # prefetch IO thread
            hit = next((i for i, ok in enumerate(result.ok) if ok), -1)
            op.state_ok = hit
            self._count(prefetch_state_misses=hit if hit >= 0 else len(result.ok),
                        storage_errors=1 if result.error else 0)
            state_done.set()

        task = IoTask(IoKind.READ_STATE, [key for _, key in candidates],
                      [host_states.data[op.state_slot]], done, tokens=tokens)
        if not self.worker.submit(task):
            op.state_ok = -1
            state_done.set()

    def ready(self, rid: str, now: float | None = None) -> bool:
        """Whether the queued request may be admitted now, under the prefetch policy."""
        op = self._ops.get(rid)
        if op is not None and self._awaits(op):
            self._read_landed(op)
        if op is None or self.config.prefetch_policy == "best_effort" or op.ready:
            return True
        if self.config.prefetch_policy == "wait_complete":
            # no deadline of its own, but a read that hangs (a wedged store) must not hold
            # the request for good: admitted at the cap, what arrived by then is used
            return (now or time.monotonic()) >= op.started + self.config.prefetch_timeout_max_s
        return (now or time.monotonic()) >= op.deadline

    def complete(self, rid: str) -> bool:
        """Every read of `rid`'s prefetch has ended (True when it has none)."""
        op = self._ops.get(rid)
        return op is None or op.complete

    def take(self, rid: str) -> PrefetchResult | None:
        """The ready hits of `rid`'s prefetch (host pages, now the caller's until a load
        frees them); unfinished or failed pages are released once their reads end."""
        op = self._ops.pop(rid, None)
        if op is None:
            return None
        self._stop_waiting(op)
        pages, origins = op.ready_prefix()
        state_slot = None
        if op.state_done is not None:
            pages, state_slot = self._state_cut(op, pages)
            origins = origins[:pages]
        if op.awaited:
            taken = max(0, min(pages - op.awaited_first, op.awaited))
            pulled = min(op.pulled, taken)
            self._count(pending_waited_pages=taken - pulled, pending_pulled_pages=pulled,
                        pending_raced_pages=op.awaited - taken,
                        pending_wait_us=int((time.monotonic() - op.started) * 1e6),
                        pending_wait_requests=1)
        if pages < len(op.host_page_ids):
            reason = "incomplete at admission" if not op.complete else "read failure or miss"
            log.info("prefetch of %s stopped after %d/%d pages: %s", rid, pages,
                     len(op.host_page_ids), reason)
            if op.stream is not None and pages == 0:
                op.stream.cancelled.set()  # admitted before its header pass: nothing to read
            self._abandon(op, pages)
        self.host_pool.commit(op.host_page_ids[:pages])
        self._count(prefetch_wait_us=int((time.monotonic() - op.started) * 1e6),
                    prefetch_pages=pages, prefetch_bytes=pages * self.host_pool.page_nbytes,
                    prefetch_streamed_pages=pages if op.stream is not None else 0)
        if state_slot is not None:
            assert self.host_states is not None
            self._count(prefetch_states=1, prefetch_state_bytes=self.host_states.slot_nbytes)
        return PrefetchResult(op.host_page_ids[:pages], origins.count("decode"), origins,
                              op.stream, state_slot=state_slot)

    def _state_cut(self, op: PrefetchOp, pages: int) -> tuple[int, int | None]:
        """The pages of a hybrid op that end at the state it read, and the host state slot
        now the caller's; (0, None) when no state was read by now, or its pages were not."""
        assert op.state_done is not None
        if not op.state_done.is_set() or op.state_ok < 0:
            return 0, None
        state_pages = op.state_pages[op.state_ok]
        if pages < state_pages:
            self._count(prefetch_state_misses=1)
            return 0, None
        slot, op.state_slot = op.state_slot, None
        return state_pages, slot

    def release_state(self, slot: int | None) -> None:
        """Give back the host state slot of a taken prefetch (restored, or not used)."""
        if slot is not None:
            assert self.host_states is not None
            self.host_states.free(slot)

    def has(self, rid: str) -> bool:
        """Whether `rid` has a prefetch (running or ended, not taken)."""
        return rid in self._ops

    def first_page(self, rid: str) -> int:
        """First prompt page of `rid`'s prefetch (0 when there is none)."""
        op = self._ops.get(rid)
        return op.first_page if op else 0

    def restart(self, rid: str, token_ids: Sequence[int], salt: str, first_page: int,
                max_pages: int, keep: frozenset[RadixNode] = frozenset()) -> int:
        """`HiCache.restart_prefetch`: cancel `rid`'s prefetch and start it anew from
        `first_page`, keeping the old deadline; 0 (not restarted) when the old read was still
        running at its deadline or waits for pending pages."""
        old = self._ops.get(rid)
        if old is not None and (old.awaited or (not old.complete and time.monotonic() >= old.deadline)):
            return 0
        self.cancel(rid)
        pages = self.start(rid, token_ids, salt, first_page, max_pages, keep)
        new = self._ops.get(rid)
        if new is not None and old is not None:  # the request has waited since the first
            new.deadline = min(new.deadline, old.deadline)
            new.started = min(new.started, old.started)
        if pages:
            self._count(prefetch_restarts=1)
        return pages

    def cancel(self, rid: str) -> None:
        op = self._ops.pop(rid, None)
        if op is not None:
            self._stop_waiting(op)
            if op.stream is not None:
                op.stream.cancelled.set()  # nobody will load it: stop reading
            self._abandon(op, 0)

    def release(self, prefetched: PrefetchResult, page_ids: list[int]) -> None:
        """Give back host pages of `prefetched` that will not be loaded: now, or once its
        stream (still writing into them) ended."""
        stream = prefetched.stream
        if stream is None or stream.done:
            self.host_pool.free(page_ids)
        else:
            self._stream_frees.append((stream, page_ids))

    # ---- accounting ----------------------------------------------------------------------
    def _awaits(self, op: PrefetchOp) -> bool:
        """`op` still waits for pages (or a state) a decode announced."""
        return op.submitted < len(op.keys) or op.rid in self._state_waits

    def reap(self) -> None:
        """Start the reads of announced pages that landed, for every queued op (only `ready`
        did: while the request's role kept it queued, e.g. a prefill node waiting for decode,
        landed pages were not read, and once the gate opened past the deadline the request
        was admitted without them: recomputed); free host pages of abandoned prefetches and
        of unloaded streams whose reads ended."""
        if self.pending is not None:
            for op in [op for op in self._ops.values() if self._awaits(op)]:
                self._read_landed(op)
        still = []
        for op in self._abandoned:
            if op.complete:
                self.host_pool.free(op.host_page_ids)
                if op.state_slot is not None:  # its state read ended too: nobody writes it
                    assert self.host_states is not None
                    self.host_states.free(op.state_slot)
                    op.state_slot = None
            else:
                still.append(op)
        self._abandoned = still
        waiting = []
        for stream, page_ids in self._stream_frees:
            if stream.done:
                self.host_pool.free(page_ids)
            else:
                waiting.append((stream, page_ids))
        self._stream_frees = waiting

    @property
    def reads_outstanding(self) -> bool:
        """An abandoned read still runs, or an unloaded stream's pages wait for its end."""
        return bool(self._abandoned or self._stream_frees)

    def gauges(self) -> dict[str, int]:
        """Ops waiting for admission, abandoned ops, and the host pages the abandoned ops and
        stream-deferred frees hold (any thread: the lists are copied first)."""
        return {
            "prefetch_ops_pending": len(self._ops),
            "prefetch_ops_abandoned": len(self._abandoned),
            "host_pages_abandoned_prefetch": sum(len(op.host_page_ids) for op in
                                                 list(self._abandoned)),
            "host_pages_stream_deferred": sum(len(ids) for _, ids in list(self._stream_frees)),
        }

    # ---- reads ---------------------------------------------------------------------------
    @property
    def _streams_layers(self) -> bool:
        return (self.config.layerwise_prefetch and self.host_states is None
                and bool(getattr(self.storage, "streams_layers", False)))

    def _submit_reads(self, rid: str, first_page: int, keys: list[bytes], host_ids: list[int],
                      num_tokens: int, submit: int | None = None) -> PrefetchOp:
        """A prefetch of `keys` into `host_ids` whose first `submit` pages (default: all) are
        read now; the rest wait for their pending keys to land (`_read_landed`). Without
        pending pages and with `layerwise_prefetch`, one layer-streamed read of them all."""
        now = time.monotonic()
        deadline = now + self.config.prefetch_timeout_s(num_tokens)
        if self._streams_layers and (submit is None or submit == len(keys)):
            # the load waits for the layers on the engine thread: never past the prefetch's
            # deadline (wait_complete, which admits whenever the reads end, at the cap)
            waits_until = (now + self.config.prefetch_timeout_max_s
                           if self.config.prefetch_policy == "wait_complete" else deadline)
            stream = LayerStream(len(keys), self.num_layers, self.config.layerwise_read_layers,
                                 deadline=waits_until)
            op = PrefetchOp(rid, first_page, keys, host_ids, [], deadline, stream=stream)
            return self._submit_stream(op, self.host_pool.page_bytes(host_ids))
        op = PrefetchOp(rid, first_page, keys, host_ids, [], deadline, submitted=0)
        self._submit_range(op, len(keys) if submit is None else submit)
        return op

    def _submit_range(self, op: PrefetchOp, end: int) -> None:
        """Read pages `op.submitted .. end` of `op` (in batches of `io_batch_pages`)."""
        assert self.worker is not None
        size = self.config.io_batch_pages
        pages = self.host_pool.page_bytes(op.host_page_ids[op.submitted : end])
        base = op.submitted
        for first in range(op.submitted, end, size):
            batch = ReadBatch(first, min(size, end - first))
            op.batches.append(batch)
            span = slice(batch.first, batch.first + batch.count)
            task = IoTask(IoKind.READ, op.keys[span], pages[first - base : first - base + batch.count],
                          self._read_done(batch))
            if not self.worker.submit(task):
                log.info("prefetch of %s: read queue full, %d pages not read", op.rid,
                         batch.count)
                self._count(prefetch_failed_pages=batch.count)
                batch.ok, batch.origins = [False] * batch.count, [None] * batch.count
                batch.done.set()
        op.submitted = max(op.submitted, end)

    def _submit_stream(self, op: PrefetchOp, pages: list[torch.Tensor]) -> PrefetchOp:
        """One layer-major read of all of `op`'s pages (docs/design.md §4.11)."""
        assert self.worker is not None
        stream = op.stream
        assert stream is not None

        def done(result: IoResult) -> None:  # prefetch IO thread
            self._count(prefetch_failed_pages=len(result.ok) - sum(result.ok),
                        storage_errors=1 if result.error else 0,
                        prefetch_read_us=int(result.seconds * 1e6))

        task = IoTask(IoKind.READ_LAYERS, op.keys, pages, done, stream=stream)
        if not self.worker.submit(task):
            log.info("prefetch of %s: read queue full, %d pages not read", op.rid, len(op.keys))
            self._count(prefetch_failed_pages=len(op.keys))
            stream.finish([])
        return op

    def _read_done(self, batch: ReadBatch) -> Callable[[IoResult], None]:
        def done(result: IoResult) -> None:  # prefetch IO thread
            batch.ok, batch.origins = result.ok, result.origins
            self._count(prefetch_failed_pages=len(result.ok) - sum(result.ok),
                        storage_errors=1 if result.error else 0,
                        prefetch_read_us=int(result.seconds * 1e6))
            batch.done.set()

        return done

    def _abandon(self, op: PrefetchOp, keep_pages: int) -> None:
        # a streamed read may still write into the rest: they are free once it ended
        rest = PrefetchOp(op.rid, op.first_page + keep_pages, op.keys[keep_pages:],
                          op.host_page_ids[keep_pages:], op.batches, op.deadline,
                          stream=op.stream, state_done=op.state_done, state_slot=op.state_slot)
        op.state_slot = None  # the abandoned rest frees it once its read ended
        self._count(prefetch_abandoned_pages=len(rest.host_page_ids))
        self._abandoned.append(rest)
        self.reap()

    # ---- pending pages and pulls (§4.10) -------------------------------------------------
    def _pending_after(self, keys: list[bytes], hits: int) -> int:
        """Pages right after storage's `hits` that a decode node announced as being written:
        how many this prefetch waits for (0 without `pending_wait`: they are counted raced)."""
        if self.pending is None:
            return 0
        found = self.pending.run(keys[hits:])
        if not found:
            return 0
        self._count(pending_found_pages=found)
        if not self.config.pending_wait:
            self._count(pending_raced_pages=found)
            return 0
        return found

    def _read_landed(self, op: PrefetchOp) -> None:
        """Start reading the awaited pages that landed since the last look; a page that will
        not come (failed, dropped, mark expired) ends the wait, after one storage lookup for
        the ones that landed unannounced."""
        assert self.pending is not None
        if not self._pull_settled(op):
            return  # the pull fills these pages: no storage read into them meanwhile
        end = op.submitted
        while end < len(op.keys):
            state = self.pending.state(op.keys[end])
            if state is PageState.PENDING:
                break
            if state is PageState.GONE:
                end += self._stored_prefix(op.keys[end:])
                self._submit_range(op, end)
                if end < len(op.keys):
                    self._end_state_wait(op, read_stored=True)  # the pages before it are not
                    self._stop_waiting(op)
                    return
                break
            end += 1
        if end > op.submitted:
            self._submit_range(op, end)
        if op.submitted == len(op.keys):
            self._read_awaited_state(op)

    def _read_awaited_state(self, op: PrefetchOp) -> None:
        """Every page of a hybrid op is being read: read the announced state once its key is
        no longer PENDING (landed, or stored unannounced), else the stored candidates."""
        wait = self._state_waits.get(op.rid)
        if wait is None:
            return
        assert self.pending is not None and self.storage is not None
        (pages, key), stored = wait
        state = self.pending.state(key)
        if state is PageState.PENDING:
            return
        del self._state_waits[op.rid]
        landed = state is PageState.LANDED
        if not landed:
            try:
                landed = self.storage.exists_state(key)  # written, its mark lost or expired
            except Exception as exc:
                log.warning("pending state: storage lookup failed: %s", exc)
                self._count(storage_errors=1)
        self._read_state(op, [(pages, key), *stored] if landed else stored)

    def _end_state_wait(self, op: PrefetchOp, read_stored: bool) -> None:
        """Give up on `op`'s announced state: read its stored candidates instead
        (`read_stored`), or end its state read without one."""
        wait = self._state_waits.pop(op.rid, None)
        if wait is not None:
            self._read_state(op, wait[1] if read_stored else [])

    def _stored_prefix(self, keys: list[bytes]) -> int:
        assert self.storage is not None
        try:
            return self.storage.exists_prefix(keys)
        except Exception as exc:
            log.warning("pending pages: storage lookup failed: %s", exc)
            self._count(storage_errors=1)
            return 0

    def _stop_waiting(self, op: PrefetchOp) -> None:
        """Give up on the pages of `op` not submitted yet: a finished, failed batch, so that
        the op is complete and its host pages are freed with the rest."""
        if op.pull is not None:
            self._end_pull(op)  # what it verified so far is kept (abandoned if unfinished)
        self._end_state_wait(op, read_stored=False)  # admitted or cancelled: no state read
        missing = len(op.keys) - op.submitted
        if missing <= 0:
            return
        op.batches.append(ReadBatch.finished(op.submitted, [False] * missing, [None] * missing))
        op.submitted = len(op.keys)

    def _maybe_pull(self, op: PrefetchOp) -> None:
        """Pull the awaited pages from the decode that announced them, when `pending_pull`
        and the measured costs say it beats waiting for the write (docs/design.md §4.10)."""
        pulls = self.pending.pulls if self.pending is not None else None
        spec = getattr(self.storage, "spec", None)
        if pulls is None or not pulls.enabled or spec is None or not pulls.secure_for(spec):
            return  # no pull without the page MAC (nor an authenticated control plane)
        first = op.submitted
        keys = op.keys[first : op.awaited_first + op.awaited]
        assert self.pending is not None
        source, count, lands_by = self.pending.pull_run(keys)
        if not count:
            return
        now = time.monotonic()
        nbytes = count * spec.object_bytes
        remaining = lands_by - now if lands_by else 0.0
        if lands_by and remaining <= 0:
            remaining = math.inf  # overdue and still pending: the store is slower than usual
        if not pulls.should_pull(nbytes, remaining):
            return
        # a pull that has not ended in 4x its estimate is not coming: wait as without it; nor
        # past the prefetch's deadline, nor much past when decode expects the write to land
        estimate = pulls.estimate_s(nbytes)
        expected = remaining + estimate if remaining > 0 else math.inf
        timeout = min(max(0.25, 4 * estimate), op.deadline - now, expected)
        if timeout <= 0:
            return  # the prefetch's deadline has passed already
        pages = self.host_pool.page_bytes(op.host_page_ids[first : first + count])
        op.pull = pulls.start(source, keys[:count], pages, spec, timeout)

    def _pull_settled(self, op: PrefetchOp) -> bool:
        """Whether `op` has no pull in flight now. A pull that ended (or timed out) is closed;
        its verified prefix becomes a finished batch, the rest is waited for."""
        ticket = op.pull
        if ticket is None:
            return True
        if not ticket.finished and time.monotonic() < ticket.deadline:
            if not self._pull_overtaken(ticket):
                return False
            self._end_pull(op)  # every page it still lacks is in storage (or not coming)
            return True
        self._end_pull(op)
        return True

    def _pull_overtaken(self, ticket: PullTicket) -> bool:
        """Every page the pull has not delivered yet is no longer pending (landed, or not
        coming): the storage read, or the end of the wait, takes over."""
        assert self.pending is not None
        return all(ok or self.pending.state(key) is not PageState.PENDING
                   for key, ok in zip(ticket.keys, list(ticket.ok)))

    def _end_pull(self, op: PrefetchOp) -> None:
        """Close `op`'s pull (no answer writes into its pages from now on) and keep its
        verified prefix. Unfinished before its deadline (admitted, cancelled, overtaken by
        the write) it counts as abandoned, not timed out."""
        ticket = op.pull
        assert ticket is not None and self.pending is not None and self.pending.pulls is not None
        self.pending.pulls.finish(ticket)
        op.pull = None
        got = ticket.ok_prefix()
        if got:
            op.batches.append(ReadBatch.finished(op.submitted, [True] * got, ["decode"] * got))
            op.submitted += got
            op.pulled += got
