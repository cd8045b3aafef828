"""HiCache controller: backup (device → host → storage), storage prefetch (storage → host) and
the per-layer host → device load, on top of `HiRadixTree` (docs/design.md §2, §4.2–4.4). With a
CPU device pool and `copy_ahead` (off by default) the load's copies run ahead of the forward on
a `LoadCopier` thread (load_copier.py); the forward waits per layer for its copy to have ended.

Engine-thread API (called by the scheduler): `match`, `start_prefetch`, `prefetch_ready`,
`take_prefetch`, `cancel_prefetch`, `load`, `backup`, `check`. Storage I/O runs on two
`IoWorker` threads (backup writes, prefetch reads) with bounded queues; their completions
only touch thread-safe state (the host pool's pins, an op's flags, counters under a lock).

Write policies: `write_through` backs up every inserted node; `write_through_selective` only
nodes hit at least `write_through_threshold` times; `write_back` backs up a node when the device
evicts it. A backup copies device pages to host pages, then writes them to storage (if any).
Host modes: `inclusive` (the host mirrors what the write policy backs up, device pages included);
`exclusive` (a victim cache: a page enters the host tier only when the device evicts it, and
leaves it when it is loaded back on device, so host capacity adds to device capacity; storage
writes then happen when a page enters the host tier, whatever the write policy).
Prefetch policies decide how long a queued request waits for its storage reads:
`best_effort` (never waits: takes what has arrived), `wait_complete` (all reads finished),
`timeout` (finished, or base + per-1k-token × tokens / 1000 capped at max, elapsed).
Pages a decode node announced as being written (`PendingPages`, docs/design.md §4.10) extend
a lookup past storage's committed prefix: with `pending_wait` the request waits for them
under its prefetch policy (read as each lands; never past the deadline or the mark's TTL)
instead of recomputing them; without it they are only counted (`pending_raced_pages`).
When decode offers it and `pending_pull` allows (`page_pull.PagePulls.should_pull`: decode's
expected remaining write time against the awaited bytes at the measured pull rate), the
awaited pages are pulled from decode's host staging instead: verified like storage reads, they
fill the prefetch's host pages; a failed, rejected or late pull falls back to the wait.

Layer-streamed prefetch (`layerwise_prefetch`, off by default; backends with `read_layers`:
file, hf3fs posix): the prefetch reads its pages layer-major (every page's header, then layer 0
of all pages, layer 1, ...; storage/layer_reads.py) into their host pages, which serve as the
staging buffer. A request is ready once the header pass ended (the usable prefix is known), so
its forward starts while the layers are still being read: the per-layer load of layer l waits
for layer l's reads only, and storage reads of layer l+1 overlap the load and compute of layer
l. Pages are verified (checksum or MAC of the whole page) once their last layer is in; the load
waits for that after the forward, and a page that fails marks the load `failed`. Unverified K/V
never reaches an output or a tier: after the forward the scheduler discards that request's rows
and requeues it to recompute (`Scheduler.requeue_failed_loads`); a request released before its
forward (retracted, aborted) finishes the load first and, when it failed, caches none of its
pages (`Scheduler._release`), so nothing of it is inserted into the tree or backed up to host
or storage. The engine thread never waits on a read without bound: `LayerStream.wait_layer` /
`wait_done` stop at the prefetch's deadline (`wait_complete`: at `prefetch_timeout_max_s`),
then the stream is cancelled and every page of it counts as failed (the same requeue); its
host pages are freed only once the IO thread's read has ended. A stream none of whose pages
continue the match at admission is cancelled too.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from pdcache.engine.api import CachedTokens
from pdcache.engine.eviction import EVICTION_POLICIES
from pdcache.engine.page_keys import PageKeyScheme, check_key_scheme
from pdcache.engine.radix import MatchResult, RadixNode
from pdcache.kernels import KernelSet
from pdcache.offload_manager.hiradix import HiRadixTree, HostMatch
from pdcache.offload_manager.host_pool import HostKVPool
from pdcache.offload_manager.io_worker import IoKind, IoResult, IoTask, IoWorker
from pdcache.offload_manager.load_copier import CopyJob, LoadCopier
from pdcache.offload_manager.page_pull import PULL_MODES, PullTicket
from pdcache.offload_manager.pending import PageState, PendingPages
from pdcache.offload_manager.storage.base import StorageBackend
from pdcache.offload_manager.storage.config import storage_session, tenant_namespace
from pdcache.offload_manager.storage.layer_reads import LayerStream
from pdcache.offload_manager.storage.stats import RateLimitedLog

log = logging.getLogger(__name__)

WRITE_POLICIES = ("write_through", "write_through_selective", "write_back")
PREFETCH_POLICIES = ("best_effort", "wait_complete", "timeout")
HOST_MODES = ("inclusive", "exclusive")
# Bound on the forward's wait for one layer's copy (copy_ahead): a layer is a few ms of memcpy,
# so only a wedged machine reaches it, and the request's step fails instead of hanging.
COPY_WAIT_S = 60.0


@dataclass(frozen=True)
class HiCacheConfig:
    write_policy: str = "write_through"
    write_through_threshold: int = 2
    host_mode: str = "inclusive"
    host_eviction: str = "lru"  # which host copies go first (pdcache.engine.eviction)
    prefetch_policy: str = "timeout"
    prefetch_timeout_base_s: float = 2.0
    prefetch_timeout_per_1k_tokens_s: float = 0.1
    prefetch_timeout_max_s: float = 30.0
    prefetch_min_pages: int = 1  # fewer storage hits than this: don't bother prefetching
    # times a queued request's prefetch restarts from a match that shrank under it (tier
    # pressure evicted pages it continues; `restart_prefetch`); 0: recompute the gap and after
    prefetch_restarts: int = 1
    io_batch_pages: int = 64
    max_queued_io: int = 256
    # read prefetches layer-major and start the forward before the last layer is in (module
    # docstring); backends without `read_layers` read page by page whatever this says. Off by
    # default: on the 2-core CPU here it measured slower (docs/measured.md)
    layerwise_prefetch: bool = False
    layerwise_read_layers: int = 1  # layers per read step of a page (first step: + header)
    # copy loads host → device on a thread of their own, layer l+1 while layer l is computed
    # (load_copier.py); only for CPU device pools, where the copy is a memcpy on the forward's
    # core. Off by default: on the 2-core machine here it measured no TTFT gain (the copy and
    # the attention share memory bandwidth; docs/measured.md). Off: every layer is copied on
    # the engine thread when the forward reaches it
    copy_ahead: bool = False
    # how stored pages are named (pdcache.engine.page_keys.PageKeyScheme): "pdcache", or
    # "sglang" to share pages with SGLang servers running the pdcache storage plugin
    key_scheme: str = "pdcache"
    key_namespace: str = ""  # the plugin's `key_namespace` (deployment-wide key salt)
    # wait (within the prefetch policy) for pages decode announced as being written, rather
    # than recompute them (docs/design.md §4.10); False: count them as raced and recompute
    pending_wait: bool = True
    pending_max_ttl_s: float = 30.0  # cap on a decode's pending-mark TTL (PendingPages)
    # pull awaited pages from decode's host staging: "auto" (when faster than the wait, by
    # measured costs), "never" (wait), "always" (whenever decode offers it; tests)
    pending_pull: str = "auto"

    def __post_init__(self) -> None:
        if self.write_policy not in WRITE_POLICIES:
            raise ValueError(f"write_policy must be one of {WRITE_POLICIES}")
        if self.host_eviction not in EVICTION_POLICIES:
            raise ValueError(f"host_eviction must be one of {EVICTION_POLICIES}")
        if self.host_mode not in HOST_MODES:
            raise ValueError(f"host_mode must be one of {HOST_MODES}")
        if self.prefetch_policy not in PREFETCH_POLICIES:
            raise ValueError(f"prefetch_policy must be one of {PREFETCH_POLICIES}")
        if self.pending_pull not in PULL_MODES:
            raise ValueError(f"pending_pull must be one of {PULL_MODES}")
        check_key_scheme(self.key_scheme)

    def prefetch_timeout_s(self, num_tokens: int) -> float:
        per_tokens = self.prefetch_timeout_per_1k_tokens_s * num_tokens / 1000
        return min(self.prefetch_timeout_base_s + per_tokens, self.prefetch_timeout_max_s)


@dataclass
class HiCacheStats:
    backup_host_pages: int = 0
    backup_storage_pages: int = 0
    backup_skipped_pages: int = 0  # no host room
    victim_dropped_pages: int = 0  # exclusive host: device victims ranked below all of host
    host_released_pages: int = 0  # exclusive host: host copies freed once loaded on device
    backup_failed_pages: int = 0
    prefetch_pages: int = 0
    prefetch_bytes: int = 0
    prefetch_failed_pages: int = 0
    prefetch_abandoned_pages: int = 0
    prefetch_restarts: int = 0  # prefetches restarted from a shrunk match (`restart_prefetch`)
    load_pages: int = 0
    storage_errors: int = 0
    # where a storage hit's time goes (microseconds, summed over requests)
    prefetch_lookup_us: int = 0  # key hashing + exists_prefix, on the engine thread
    prefetch_read_us: int = 0  # storage reads, on the prefetch worker
    prefetch_wait_us: int = 0  # prefetch start → taken at admission
    load_copy_us: int = 0  # host → device copies (on the copier thread with copy_ahead)
    load_copy_wait_us: int = 0  # copy_ahead: the forward waiting for the copier's copies
    # the durable next turn (docs/design.md §4.10): pages past storage's committed prefix that
    # a decode node had announced as being written, at lookup time
    pending_found_pages: int = 0
    pending_waited_pages: int = 0  # of those, read from storage after waiting for them
    pending_pulled_pages: int = 0  # of those, pulled from decode's host staging
    pending_raced_pages: int = 0  # of those, not read by admission: recomputed
    pending_wait_us: int = 0  # lookup → admission of requests that met pending pages
    pending_wait_requests: int = 0  # requests that met pending pages (waited or not)
    # layer-streamed prefetch (module docstring)
    prefetch_streamed_pages: int = 0  # pages taken from layer-streamed reads
    load_stream_wait_us: int = 0  # the forward waiting for a layer's storage reads
    load_verify_wait_us: int = 0  # after the forward, waiting for the pages' verification
    stream_failed_loads: int = 0  # loads whose pages failed verification (request requeued)
    stream_timed_out_loads: int = 0  # of those, the read had not ended by the deadline


@dataclass
class _Batch:
    first: int  # index into the op's pages
    count: int
    done: threading.Event = field(default_factory=threading.Event)
    ok: list[bool] = field(default_factory=list)
    origins: list[str | None] = field(default_factory=list)


@dataclass
class PrefetchOp:
    """Storage reads for one queued request: pages `first_page ..` of its prompt."""

    rid: str
    first_page: int
    keys: list[bytes]
    host_page_ids: list[int]
    batches: list[_Batch]
    deadline: float
    reason: str = ""
    started: float = field(default_factory=time.monotonic)
    # pages [awaited_first, awaited_first + awaited) were pending at lookup; reads are
    # submitted up to `submitted` (the rest wait for their keys to land)
    awaited_first: int = 0
    awaited: int = 0
    submitted: int = -1  # -1: every page
    stream: LayerStream | None = None  # a layer-streamed read (then `batches` is empty)
    pull: PullTicket | None = None  # pulling pages `submitted ..` from decode's staging
    pulled: int = 0  # pages taken from pulls

    def __post_init__(self) -> None:
        if self.submitted < 0:
            self.submitted = len(self.keys)

    @property
    def complete(self) -> bool:
        if self.stream is not None:
            return self.stream.done
        return self.submitted == len(self.keys) and all(b.done.is_set() for b in self.batches)

    @property
    def ready(self) -> bool:
        """Admission may take it now: every read finished, or a streamed read's header pass."""
        return self.complete or (self.stream is not None and self.stream.headers_done)

    def ready_prefix(self) -> tuple[int, list[str | None]]:
        """Pages readable now: consecutive successes from the start over finished batches (a
        streamed read: the pages whose headers are valid; their layers may still arrive)."""
        if self.stream is not None:
            pages, origins = self.stream.header_prefix()
            if self.stream.done:  # verified already: only the pages that passed
                ok = self.stream.wait_done()
                pages = next((i for i, good in enumerate(ok[:pages]) if not good), pages)
            return pages, origins[:pages]
        pages, origins = 0, []
        for batch in self.batches:
            if not batch.done.is_set():
                break
            for ok, origin in zip(batch.ok, batch.origins):
                if not ok:
                    return pages, origins
                pages += 1
                origins.append(origin)
        return pages, origins


@dataclass
class PrefetchResult:
    """Host pages holding storage hits that continue the device + host match."""

    host_page_ids: list[int]
    from_decode_pages: int
    origins: list[str | None] = field(default_factory=list)
    stream: LayerStream | None = None  # still being read into (layer-streamed prefetch)
    stream_offset: int = 0  # index of host_page_ids[0] among the stream's pages


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
    `layer` was copied; without one (or when it is not running) the copy runs in the caller's
    thread inside `wait`. The host pages stay pinned until the load is done; completion
    (`_finish`: unpin, callbacks) always runs on the caller's (engine) thread.

    With `streamed` pages, layer l is copied once the stream has read layer l of them (the
    read of layer l+1 goes on meanwhile); `finish()` then waits for their verification and sets
    `failed` when one did not verify (what was computed from them must be discarded)."""

    def __init__(self, host_pool: HostKVPool, device_kv: torch.Tensor, host_page_ids: list[int],
                 device_page_ids: list[int], on_done: Callable[[], None] | None = None,
                 on_copied: Callable[[float, float], None] | None = None,
                 kernels: KernelSet | None = None,
                 streamed: StreamedPages | None = None,
                 on_streamed: Callable[[float, float, bool], None] | None = None,
                 copier: LoadCopier | None = None) -> None:
        self.host_pool = host_pool
        self.device_kv = device_kv
        self.kernels = kernels or KernelSet()
        self.host_ids = torch.tensor(host_page_ids, dtype=torch.long)
        self.device_ids = torch.tensor(device_page_ids, dtype=torch.long)
        self.host_page_ids = host_page_ids
        self.num_layers = device_kv.shape[0]
        self.streamed = streamed
        # streamed pages that did not verify, or a copy-ahead copy that raised (known once done)
        self.failed = False
        self._next_layer = 0
        self._finished = False
        self._on_done = on_done
        self._on_copied = on_copied
        self._on_streamed = on_streamed
        self.copy_s = 0.0  # written by the copier thread; read after its last layer's event
        self.copy_wait_s = 0.0
        self.stream_wait_s = 0.0
        host_pool.pin(host_page_ids)
        # streamed pages arrive layer by layer from storage: copied inline, after each layer's
        # read (a copier thread would only wait on the stream in the engine's place)
        self._job: CopyJob | None = None
        self._copier = copier
        self._timed_out = False  # a copy outlived COPY_WAIT_S: later waits raise at once
        if copier is not None and streamed is None:
            job = CopyJob(self._copy_layer, self.num_layers)
            self._job = job if copier.submit(job) else None

    def _copy_layer(self, layer: int) -> None:
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
        ended = job.ready[layer].wait(COPY_WAIT_S)
        self.copy_wait_s += time.perf_counter() - start
        if job.error is not None:  # the copier is done with this load: release it, and mark
            self.failed = True  # its K/V unusable (recomputed, never cached: the scheduler)
            self._next_layer = self.num_layers
            self._finish()
            raise RuntimeError(f"host → device copy failed: {job.error}") from job.error
        if not ended:  # still queued or copying: its pages stay pinned and reserved
            self._timed_out = True
            if self._copier is not None:
                self._copier.mark_wedged()
            raise RuntimeError(f"host → device copy of layer {layer} did not end in "
                               f"{COPY_WAIT_S:.0f} s")

    def wait(self, layer: int) -> None:
        while self._next_layer <= layer:
            if self._job is not None:
                self._await_copied(self._next_layer)
            else:
                if self.streamed is not None:
                    start = time.perf_counter()
                    self.streamed.stream.wait_layer(self._next_layer)
                    self.stream_wait_s += time.perf_counter() - start
                self._copy_layer(self._next_layer)
            self._next_layer += 1
            if self._next_layer == self.num_layers and self.streamed is None:
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
            self.failed = not all(ok[first : first + self.streamed.count])
            if self._on_streamed is not None:
                self._on_streamed(self.stream_wait_s, verify_wait_s, self.failed)
        self.host_pool.unpin(self.host_page_ids)
        if self._on_copied is not None:
            self._on_copied(self.copy_s, self.copy_wait_s)
        if self._on_done is not None:
            self._on_done()


class HiCache:
    """The prefill node's hierarchical cache controller (see module docstring).

    `layer_load_cls` makes the per-layer loads (a subclass can instrument or pipeline them).
    `kernels` moves pages between the tiers (the engine's `EngineConfig.kernels`; default auto)."""

    layer_load_cls: type[LayerLoad] = LayerLoad

    def __init__(self, tree: HiRadixTree, device_kv: torch.Tensor, storage: StorageBackend | None,
                 config: HiCacheConfig, fingerprint: str, kernels: KernelSet | None = None,
                 pending: PendingPages | None = None) -> None:
        self.tree = tree
        self.pending = pending  # decode-announced writes (prefill nodes); None: not tracked
        self.kernels = kernels or KernelSet()
        self.host_pool = tree.host_pool
        self.device_kv = device_kv
        self.storage = storage
        self.config = config
        self.fingerprint = fingerprint
        self.page_size = tree.page_size
        self.scheme = PageKeyScheme(fingerprint, tree.page_size, config.key_scheme,
                                        config.key_namespace)
        self.stats = HiCacheStats()
        self._warn = RateLimitedLog(log)
        self._stats_lock = threading.Lock()
        self._prefetches: dict[str, PrefetchOp] = {}
        self._abandoned: list[PrefetchOp] = []
        # host pages of streamed prefetches that no load takes, freed once their read ended
        self._stream_frees: list[tuple[LayerStream, list[int]]] = []
        # Import (and, first time on a machine, compile) the copy kernels now, not inside the
        # first request's per-layer load.
        self.kernels.backend_for(device_kv.device)
        self._writer = IoWorker(storage, "backup", config.max_queued_io) if storage else None
        self._reader = IoWorker(storage, "prefetch", config.max_queued_io) if storage else None
        cpu_pool = device_kv.device.type == "cpu"
        self._copier = LoadCopier() if config.copy_ahead and cpu_pool else None
        tree.on_evict = self._on_device_evict

    # ---- matching and loading ----------------------------------------------------------
    def match(self, token_ids: Sequence[int], salt: str, max_pages: int) -> tuple[MatchResult, HostMatch]:
        device = self.tree.match_prefix(token_ids[: max_pages * self.page_size], salt)
        return device, self.tree.match_host(device, token_ids, max_pages)

    def load(self, host: HostMatch, prefetched: PrefetchResult | None,
             device_page_ids: list[int]) -> tuple[RadixNode | None, LayerLoad | None]:
        """Start loading host hits (tree nodes) and prefetched pages into `device_page_ids`
        (host hits first). Host hits are restored into the tree (tree-owned, returned node to
        lock); prefetched pages' device copies belong to the request. Returns the load to wait on
        per layer."""
        host_ids = host.host_page_ids
        node = self.tree.restore(host, device_page_ids[: len(host_ids)]) if host.nodes else None
        pref_ids = prefetched.host_page_ids if prefetched else []
        all_host = host_ids + pref_ids
        if not all_host:
            return node, None
        with self._stats_lock:
            self.stats.load_pages += len(all_host)

        def release_prefetched() -> None:
            if pref_ids:  # a timed-out stream may still be writing into them: freed later
                assert prefetched is not None
                self.release_prefetched(prefetched, pref_ids)
            if host_ids and self.config.host_mode == "exclusive":
                released = self.tree.drop_host_copies(node, host_ids)
                self._count(host_released_pages=released)

        def copied(seconds: float, waited_s: float) -> None:
            self._count(load_copy_us=int(seconds * 1e6), load_copy_wait_us=int(waited_s * 1e6))

        def streamed_done(wait_s: float, verify_s: float, failed: bool) -> None:
            timed_out = streamed is not None and streamed.stream.timed_out
            self._count(load_stream_wait_us=int(wait_s * 1e6),
                        load_verify_wait_us=int(verify_s * 1e6),
                        stream_failed_loads=int(failed), stream_timed_out_loads=int(timed_out))

        streamed = None
        if prefetched is not None and prefetched.stream is not None and pref_ids:
            streamed = StreamedPages(prefetched.stream, prefetched.stream_offset, len(pref_ids))
        return node, self.layer_load_cls(self.host_pool, self.device_kv, all_host,
                                         device_page_ids[: len(all_host)], release_prefetched,
                                         copied, self.kernels, streamed, streamed_done,
                                         self._copier)

    def release_prefetched(self, prefetched: PrefetchResult, page_ids: list[int]) -> None:
        """Give back host pages of `prefetched` that will not be loaded: now, or once its
        stream (still writing into them) ended."""
        stream = prefetched.stream
        if stream is None or stream.done:
            self.host_pool.free(page_ids)
        else:
            self._stream_frees.append((stream, page_ids))

    # ---- prefetch ----------------------------------------------------------------------
    def start_prefetch(self, rid: str, token_ids: Sequence[int], salt: str, first_page: int,
                       max_pages: int) -> int:
        """Look up pages `first_page .. max_pages` of the prompt in storage and start reading
        the consecutive hits into host pages; returns the number of pages being read."""
        if self._reader is None or max_pages - first_page < self.config.prefetch_min_pages:
            return 0
        start = time.perf_counter()
        keys = self.page_keys(token_ids[: max_pages * self.page_size], salt)[first_page:]
        try:
            hits = self.storage.exists_prefix(keys)
        except Exception as exc:
            log.warning("prefetch of %s: storage lookup failed: %s", rid, exc)
            self._count(storage_errors=1)
            return 0
        finally:
            self._count(prefetch_lookup_us=int((time.perf_counter() - start) * 1e6))
        awaited = self._pending_after(keys, hits)
        total = hits + awaited
        if total < self.config.prefetch_min_pages:
            self._count(pending_raced_pages=awaited)
            return 0
        host_ids = self._alloc_host(total)
        if host_ids is None:
            log.info("prefetch of %s stopped: no host room for %d pages", rid, total)
            self._count(pending_raced_pages=awaited)
            return 0
        op = self._submit_reads(rid, first_page, keys[:total], host_ids, len(token_ids),
                                submit=hits)
        op.awaited_first, op.awaited = hits, awaited
        if awaited and self.config.prefetch_policy != "best_effort":
            self._maybe_pull(op)  # best_effort admits at once: a pull would be abandoned
        self._prefetches[rid] = op
        return total

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
        """Engine thread: whether `op` has no pull in flight now. A pull that ended (or timed
        out) is closed; its verified prefix becomes a finished batch, the rest is waited for."""
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
            op.batches.append(_Batch(op.submitted, got, _done_event(), [True] * got,
                                     ["decode"] * got))
            op.submitted += got
            op.pulled += got

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

    def prefetch_ready(self, rid: str, now: float | None = None) -> bool:
        """Whether the queued request may be admitted now, under the prefetch policy."""
        op = self._prefetches.get(rid)
        if op is not None and op.submitted < len(op.keys):
            self._read_landed(op)
        if op is None or self.config.prefetch_policy == "best_effort" or op.ready:
            return True
        if self.config.prefetch_policy == "wait_complete":
            return False
        return (now or time.monotonic()) >= op.deadline

    def take_prefetch(self, rid: str) -> PrefetchResult | None:
        """The ready hits of `rid`'s prefetch (host pages, now the caller's until `load`
        frees them); unfinished or failed pages are released once their reads end."""
        op = self._prefetches.pop(rid, None)
        if op is None:
            return None
        self._stop_waiting(op)
        pages, origins = op.ready_prefix()
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
        with self._stats_lock:
            self.stats.prefetch_wait_us += int((time.monotonic() - op.started) * 1e6)
            self.stats.prefetch_pages += pages
            self.stats.prefetch_bytes += pages * self.host_pool.page_nbytes
            self.stats.prefetch_streamed_pages += pages if op.stream is not None else 0
        return PrefetchResult(op.host_page_ids[:pages], origins.count("decode"), origins,
                              op.stream)

    def prefetch_first_page(self, rid: str) -> int:
        """First prompt page of `rid`'s prefetch (0 when there is none)."""
        op = self._prefetches.get(rid)
        return op.first_page if op else 0

    def restart_prefetch(self, rid: str, token_ids: Sequence[int], salt: str, first_page: int,
                         max_pages: int) -> int:
        """Cancel `rid`'s prefetch (if any) and start it anew from `first_page`: the device +
        host match it continued shrank while the request waited (those tiers evicted pages
        under pressure), so its pages no longer join the match and a gap would be recomputed
        along with everything after it. Write-through put the gap's pages in storage, so the
        new read usually covers them. The new read keeps the old one's deadline: restarts
        never stretch a request's wait past its prefetch policy's budget. Not restarted (0):
        the old read was still running at its deadline (storage that slow gains nothing from
        a second read), or it waits for pages a decode node announced (their wait and its
        counters stay as they are). Returns the pages being read (`start_prefetch`)."""
        old = self._prefetches.get(rid)
        if old is not None and (old.awaited or (not old.complete and time.monotonic() >= old.deadline)):
            return 0
        self.cancel_prefetch(rid)
        pages = self.start_prefetch(rid, token_ids, salt, first_page, max_pages)
        new = self._prefetches.get(rid)
        if new is not None and old is not None:
            new.deadline = min(new.deadline, old.deadline)
        if pages:
            self._count(prefetch_restarts=1)
        return pages

    def cancel_prefetch(self, rid: str) -> None:
        op = self._prefetches.pop(rid, None)
        if op is not None:
            self._stop_waiting(op)
            if op.stream is not None:
                op.stream.cancelled.set()  # nobody will load it: stop reading
            self._abandon(op, 0)

    # ---- backup ------------------------------------------------------------------------
    def backup(self, token_ids: Sequence[int], salt: str, last_node: RadixNode | None) -> None:
        """Apply the write policy to the nodes on the path to `last_node` (just inserted or
        hit): copy them to host and write them to storage."""
        if last_node is None or self._writes_on_evict:
            return
        path = last_node.path_from_root()
        keep = frozenset(path)  # room for a child must not cost its parent's new host copy
        keys: list[bytes] | None = None
        offset = 0
        for node in path:
            if node.on_device and not node.backed_up and self._wants_backup(node):
                keys = keys or self.page_keys(token_ids, salt)
                self._backup_node(node, keys[offset : offset + node.num_pages], keep)
            offset += node.num_pages

    def page_keys(self, token_ids: Sequence[int], salt: str) -> list[bytes]:
        """Storage keys of the full pages of `token_ids` for tenant `salt` (the key scheme's)."""
        return self.scheme.keys(token_ids, salt)[0]

    # ---- accounting --------------------------------------------------------------------
    def reap(self) -> None:
        """Free host pages of abandoned prefetches whose reads have finished, and orphaned
        host copies whose storage writes have (`HiRadixTree.release_orphans`)."""
        self.tree.release_orphans()
        still = []
        for op in self._abandoned:
            if op.complete:
                self.host_pool.free(op.host_page_ids)
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

    def wait_idle(self, timeout_s: float) -> bool:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.io_idle():
                return True
            time.sleep(0.01)
        return False

    def io_idle(self) -> bool:
        """No storage task queued, no abandoned read running, no host page in flight or pinned
        (after reaping what finished). Engine thread, or any thread when the engine is idle."""
        self.reap()
        busy = [w for w in (self._writer, self._reader) if w and w.queue_depth]
        pool = self.host_pool
        return not busy and not self._abandoned and not self._stream_frees \
            and pool.num_in_flight == 0 and not pool.any_pinned

    def drop_all(self) -> tuple[int, int]:
        """Engine thread, idle engine (`io_idle`, no locked node): free every device page of
        the tree without backing any up (write_back's eviction hook is off meanwhile), then
        every host copy; storage is left as it is. Returns (device pages, host pages)."""
        tree = self.tree
        on_evict, tree.on_evict = tree.on_evict, None
        try:
            device = tree.flush()
        finally:
            tree.on_evict = on_evict
        return device, tree.evict_host(tree.host_pages)

    def end_session(self, session_id: str, cache_salt: str) -> bool:
        """Close the storage session this node's writes for (`cache_salt`, `session_id`) used
        (`storage_session`): the store evicts its pages first. Any thread: backends are
        thread-safe. False without storage; a backend error propagates."""
        if self.storage is None or not session_id:
            return False
        self.storage.end_session(storage_session(tenant_namespace(cache_salt), session_id))
        return True

    def _host_pages_outside_tree(self) -> dict[str, int]:
        """Host pages held but not by the tree's nodes, for the idle-leak check of `pdcache
        bench chaos`: `host_pages_untracked` = USED pages no node holds (orphans awaiting a
        storage write, stream-deferred frees, or a leak), `host_pages_pinned_in_tree` = node
        pages a backup or load still pins, and (already counted in those or in IN_FLIGHT)
        the pages of abandoned prefetches and stream-deferred frees. An idle node has 0 of
        each. The tree walk races the engine thread when called from a scrape: a torn walk is
        retried, then the ownership keys are left out rather than guessed."""
        out = {
            "host_pages_abandoned_prefetch": sum(len(op.host_page_ids) for op in
                                                 list(self._abandoned)),
            "host_pages_stream_deferred": sum(len(ids) for _, ids in list(self._stream_frees)),
        }
        for _ in range(3):
            used = self.host_pool.num_used
            try:
                owned, pinned = self.tree.host_ownership()
            except RuntimeError:  # a node's children changed mid-walk
                continue
            out.update(host_pages_untracked=max(used - owned, 0), host_pages_pinned_in_tree=pinned)
            break
        return out

    def check(self) -> None:
        self.tree.check()
        self.host_pool.check()

    def start(self) -> None:
        """Start the backup and prefetch IO threads and the load copier (the engine's
        `start()` does, through its scheduler); idempotent. Work queued before waits in their
        queues; loads made before it copy on the engine thread."""
        for worker in (self._writer, self._reader):
            if worker is not None:
                worker.start()
        if self._copier is not None:
            self._copier.start()

    def close(self) -> None:
        for worker in (self._writer, self._reader):
            if worker is not None:
                worker.close()
        if self._copier is not None:
            self._copier.close()

    def snapshot(self) -> dict[str, int | float]:
        """Every counter and gauge of the host and storage tiers as one flat dict, for metrics.

        Safe from any thread: controller counters are copied under their lock; host pool
        counts, queue depths and IoWorker counters are ints read without the engine thread's
        cooperation (a scrape may see them one update apart, which metrics tolerate). Storage
        counters come from the backend's thread-safe `stats()` (prefixed `storage_`); a
        backend whose stats fail (e.g. its metadata service is down) only drops those."""
        with self._stats_lock:
            out = dict(vars(self.stats))
        pool = self.host_pool
        out.update(host_pages_total=pool.capacity, host_pages_free=pool.num_free,
                   host_pages_used=pool.num_used, host_pages_in_flight=pool.num_in_flight,
                   host_evicted_pages=self.tree.num_host_evicted_pages,
                   host_orphan_pages=self.tree.num_orphan_pages,
                   prefetch_ops_pending=len(self._prefetches),
                   prefetch_ops_abandoned=len(self._abandoned))
        out.update(self._host_pages_outside_tree())
        if self.tree.sessions is not None:
            out["sessions_tracked"] = len(self.tree.sessions)
        if self.pending is not None:
            out.update(self.pending.snapshot())
        out["pending_wait_s"] = out["pending_wait_us"] / 1e6
        for worker in (self._writer, self._reader):
            if worker is not None:
                out[f"{worker.name}_queue_depth"] = worker.queue_depth
        out.update(self.io_stats())
        out.update(self._storage_stats())
        return out

    def _storage_stats(self) -> dict[str, int]:
        if self.storage is None:
            return {}
        try:
            raw = self.storage.stats()
        except Exception as exc:  # a scrape must not fail because storage is down
            self._warn.warning("stats", "storage stats unavailable: %s", exc)
            return {}
        return {f"storage_{k}": int(v) for k, v in raw.items() if isinstance(v, int | float)}

    def io_stats(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for worker in (self._writer, self._reader):
            if worker is not None:
                for name, value in vars(worker.stats).items():
                    out[f"{worker.name}_{name}"] = value
        return out

    def cached_tokens(self, device_pages: int, host_pages: int, prefetched: PrefetchResult | None) -> CachedTokens:
        storage_pages = len(prefetched.host_page_ids) if prefetched else 0
        from_decode = prefetched.from_decode_pages if prefetched else 0
        size = self.page_size
        return CachedTokens(device_pages * size, host_pages * size, storage_pages * size,
                            from_decode * size)

    # ---- internals ---------------------------------------------------------------------
    @property
    def _writes_on_evict(self) -> bool:
        return self.config.write_policy == "write_back" or self.config.host_mode == "exclusive"

    def _wants_backup(self, node: RadixNode) -> bool:
        if self.config.write_policy == "write_through_selective":
            return node.hit_count >= self.config.write_through_threshold
        return True

    def _alloc_host(self, num_pages: int,
                    keep: frozenset[RadixNode] = frozenset()) -> list[int] | None:
        """`num_pages` host pages, evicting host copies (never those of `keep`) when short."""
        page_ids = self.host_pool.alloc(num_pages)
        if page_ids is None:
            self.tree.evict_host(num_pages - self.host_pool.num_free, keep)
            page_ids = self.host_pool.alloc(num_pages)
        return page_ids

    def _backup_node(self, node: RadixNode, keys: list[bytes],
                     keep: frozenset[RadixNode] = frozenset()) -> None:
        host_ids = self._alloc_host(node.num_pages, keep)
        if host_ids is None:
            self._count(backup_skipped_pages=node.num_pages)
            return
        self.kernels.device_to_host(self.device_kv, self.host_pool.host_kv,
                               torch.tensor(node.device_page_ids, dtype=torch.long),
                               torch.tensor(host_ids, dtype=torch.long))
        self.host_pool.commit(host_ids)
        node.host_page_ids = host_ids
        self._count(backup_host_pages=len(host_ids))
        if self._writer is not None:
            self._write(keys, host_ids, tenant_namespace(node.salt), node.session_id)

    def _write(self, keys: list[bytes], host_ids: list[int], namespace: str = "",
               session: str = "") -> None:
        self.host_pool.pin(host_ids)

        def done(result: IoResult) -> None:
            self.host_pool.unpin(host_ids)
            ok = sum(result.ok)
            self._count(backup_storage_pages=ok, backup_failed_pages=len(keys) - ok,
                        storage_errors=1 if result.error else 0)

        task = IoTask(IoKind.WRITE, keys, self.host_pool.page_bytes(host_ids), done, "prefill",
                      namespace=namespace,
                      session=storage_session(namespace, session))
        if not self._writer.submit(task):
            self.host_pool.unpin(host_ids)
            self._count(backup_failed_pages=len(keys))

    def _on_device_evict(self, node: RadixNode, page_ids: list[int]) -> None:
        """write_back / exclusive host: the last chance to keep this node's KV is before its
        pages are freed. write_back never evicts host pages here; the exclusive host tier
        makes room by its host policy when the victim ranks above what it would evict."""
        if not self._writes_on_evict or node.backed_up:
            return
        if self.config.host_mode == "exclusive":
            if not self.tree.host_admits(node, len(page_ids)):
                self._count(victim_dropped_pages=len(page_ids))
                return
            host_ids = self._alloc_host(len(page_ids))
        else:
            host_ids = self.host_pool.alloc(len(page_ids))
        if host_ids is None:
            self._count(backup_skipped_pages=len(page_ids))
            return
        self.kernels.device_to_host(self.device_kv, self.host_pool.host_kv,
                               torch.tensor(page_ids, dtype=torch.long),
                               torch.tensor(host_ids, dtype=torch.long))
        self.host_pool.commit(host_ids)
        node.host_page_ids = host_ids
        self._count(backup_host_pages=len(host_ids))
        if self._writer is not None and node.key:
            keys = self._node_keys(node)
            if keys is not None:
                self._write(keys, host_ids, tenant_namespace(node.salt), node.session_id)

    def _node_keys(self, node: RadixNode) -> list[bytes] | None:
        path = node.path_from_root()
        tokens = [t for n in path for t in n.key]
        keys = self.page_keys(tokens, node.salt)
        return keys[-node.num_pages :]

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
        size = self.config.io_batch_pages
        pages = self.host_pool.page_bytes(op.host_page_ids[op.submitted : end])
        base = op.submitted
        for first in range(op.submitted, end, size):
            batch = _Batch(first, min(size, end - first))
            op.batches.append(batch)
            span = slice(batch.first, batch.first + batch.count)
            task = IoTask(IoKind.READ, op.keys[span], pages[first - base : first - base + batch.count],
                          self._read_done(batch))
            if not self._reader.submit(task):
                log.info("prefetch of %s: read queue full, %d pages not read", op.rid,
                         batch.count)
                self._count(prefetch_failed_pages=batch.count)
                batch.ok, batch.origins = [False] * batch.count, [None] * batch.count
                batch.done.set()
        op.submitted = max(op.submitted, end)

    def _read_landed(self, op: PrefetchOp) -> None:
        """Engine thread: start reading the awaited pages that landed since the last look; a
        page that will not come (failed, dropped, mark expired) ends the wait, after one
        storage lookup for the ones that landed unannounced."""
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
                self._stop_waiting(op)
                return
            end += 1
        if end > op.submitted:
            self._submit_range(op, end)

    def _stored_prefix(self, keys: list[bytes]) -> int:
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
        missing = len(op.keys) - op.submitted
        if missing <= 0:
            return
        batch = _Batch(op.submitted, missing, ok=[False] * missing, origins=[None] * missing)
        batch.done.set()
        op.batches.append(batch)
        op.submitted = len(op.keys)

    @property
    def _streams_layers(self) -> bool:
        return self.config.layerwise_prefetch and bool(getattr(self.storage, "streams_layers",
                                                                False))

    @property
    def num_layers(self) -> int:
        return self.device_kv.shape[0]

    def _submit_stream(self, op: PrefetchOp, pages: list[torch.Tensor]) -> PrefetchOp:
        """One layer-major read of all of `op`'s pages (module docstring)."""
        stream = op.stream
        assert stream is not None

        def done(result: IoResult) -> None:
            self._count(prefetch_failed_pages=len(result.ok) - sum(result.ok),
                        storage_errors=1 if result.error else 0,
                        prefetch_read_us=int(result.seconds * 1e6))

        task = IoTask(IoKind.READ_LAYERS, op.keys, pages, done, stream=stream)
        if not self._reader.submit(task):
            log.info("prefetch of %s: read queue full, %d pages not read", op.rid, len(op.keys))
            self._count(prefetch_failed_pages=len(op.keys))
            stream.finish([])
        return op

    def _read_done(self, batch: _Batch):
        def done(result: IoResult) -> None:
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
                          stream=op.stream)
        self._count(prefetch_abandoned_pages=len(rest.host_page_ids))
        self._abandoned.append(rest)
        self.reap()

    def _count(self, **deltas: int) -> None:
        with self._stats_lock:
            for name, delta in deltas.items():
                setattr(self.stats, name, getattr(self.stats, name) + delta)


def _done_event() -> threading.Event:
    event = threading.Event()
    event.set()
    return event
