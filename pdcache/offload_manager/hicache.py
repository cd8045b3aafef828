"""HiCache: the prefill node's hierarchical cache controller over `HiRadixTree`
(docs/design.md §2, §4.2–4.4, §4.9–4.11), composing its three jobs:

- `backup.Backup`: the write policy, device → host → storage (backup IO thread);
- `prefetch.Prefetcher`: storage → host for queued requests, pending pages and pulls
  (prefetch IO thread);
- `layer_loads.LayerLoad`: host → device per layer inside the forward (optionally copied ahead
  on a `LoadCopier` thread), layer-streamed from an unfinished prefetch.

Engine-thread API (called by the scheduler): `match`, `start_prefetch`, `prefetch_ready`,
`take_prefetch`, `cancel_prefetch`, `load`, `restore_state`, `backup`, `check`; `snapshot`
from any thread.
The IO threads' completions only touch thread-safe state (the host pool's pins, an op's flags,
the counters under `_stats_lock`).

Hybrid models (Qwen3-Next, docs/design.md §4.14): with the engine's `StateSlots` (`states`) and
the tree's host state pool, state checkpoints travel with their pages (`backup`: device → host
state slot → storage state object; `prefetch`: the state object with the pages) and a hit from
a lower tier is served only where the state is restored with it (`restore_state`: host state
slot → the request's device slot). The counters split each tier's bytes into KV and state.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from pdcache.engine.api import CachedTokens
from pdcache.engine.eviction import EVICTION_POLICIES
from pdcache.engine.page_keys import PageKeyScheme, check_key_scheme
from pdcache.engine.radix import MatchResult, RadixNode
from pdcache.engine.state_cache import StateSlots
from pdcache.engine.window_pages import WindowTails
from pdcache.kernels import KernelSet
from pdcache.offload_manager.backup import Backup
from pdcache.offload_manager.hiradix import HiRadixTree, HostMatch
from pdcache.offload_manager.io_worker import IoWorker
from pdcache.offload_manager.layer_loads import LayerLoad, StreamedPages
from pdcache.offload_manager.load_copier import LoadCopier
from pdcache.offload_manager.page_pull import PULL_MODES
from pdcache.offload_manager.pending import PendingPages
from pdcache.offload_manager.prefetch import Prefetcher
from pdcache.offload_manager.prefetch_ops import PrefetchResult
from pdcache.offload_manager.storage.base import StorageBackend
from pdcache.offload_manager.storage.config import storage_session, tenant_namespace
from pdcache.offload_manager.storage.stats import RateLimitedLog
from pdcache.offload_manager.tier_settings import (
    HOST_MODES,
    PREFETCH_POLICIES,
    WRITE_POLICIES,
    TierSettings,
)

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class HiCacheConfig(TierSettings):
    """The settings of one node's HiCache: the `[cache]` tier policies (`TierSettings`,
    declared once beside `CacheSpec`) and what only the tiers' code tunes (batching, the
    layer-streamed prefetch, copies ahead). Frozen; checks its values when built."""

    prefetch_min_pages: int = 1  # fewer storage hits than this: don't bother prefetching
    io_batch_pages: int = 64
    max_queued_io: int = 256
    # read prefetches layer-major and start the forward before the last layer is in (prefetch.py,
    # layer_loads.py); backends without `read_layers` read page by page whatever this says. Off by
    # default: on the 2-core CPU here it measured slower (docs/measured.md)
    layerwise_prefetch: bool = False
    layerwise_read_layers: int = 1  # layers per read step of a page (first step: + header)
    # copy loads host → device on a thread of their own, layer l+1 while layer l is computed
    # (load_copier.py); only for CPU device pools, where the copy is a memcpy on the forward's
    # core. Off by default: on the 2-core machine here it measured no TTFT gain (the copy and
    # the attention share memory bandwidth; docs/measured.md). Off: every layer is copied on
    # the engine thread when the forward reaches it
    copy_ahead: bool = False

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
    load_failed_copies: int = 0  # host → device loads whose copy raised (requests recomputed)
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
    # layer-streamed prefetch (prefetch.py, layer_loads.py)
    prefetch_streamed_pages: int = 0  # pages taken from layer-streamed reads
    load_stream_wait_us: int = 0  # the forward waiting for a layer's storage reads
    load_verify_wait_us: int = 0  # after the forward, waiting for the pages' verification
    stream_failed_loads: int = 0  # loads whose pages failed verification (request requeued)
    stream_timed_out_loads: int = 0  # of those, the read had not ended by the deadline
    # bytes per tier, KV pages vs recurrent states (hybrid models; states are 0 otherwise)
    backup_host_kv_bytes: int = 0  # device → host
    backup_storage_kv_bytes: int = 0  # host → storage (written)
    load_host_kv_bytes: int = 0  # host → device (host hits and prefetched pages)
    backup_host_states: int = 0  # device checkpoints copied into host state slots
    backup_host_state_bytes: int = 0
    backup_skipped_states: int = 0  # no host state slot: the state stayed on device only
    backup_storage_states: int = 0  # state objects written
    backup_storage_state_bytes: int = 0
    backup_failed_states: int = 0
    prefetch_states: int = 0  # state objects read with a storage hit
    prefetch_state_bytes: int = 0
    prefetch_state_misses: int = 0  # missing / refused state objects: the hit was shortened
    load_host_states: int = 0  # admissions whose state came from a host checkpoint
    load_storage_states: int = 0  # ... from a state object read from storage
    load_state_bytes: int = 0  # host state slot → device state slot


class HiCache:
    """The prefill node's hierarchical cache controller (see module docstring).

    Owns the backup (`backups`) and prefetch (`prefetches`) parts, the load copier and the
    counters (`stats`, under `_stats_lock`, written by the engine and IO threads); the tree,
    host pool and storage are shared with the engine that built it. `layer_load_cls` makes the
    per-layer loads (a subclass can instrument or pipeline them). `kernels` moves pages between
    the tiers (the engine's `EngineConfig.kernels`; default auto)."""

    layer_load_cls: type[LayerLoad] = LayerLoad

    def __init__(self, tree: HiRadixTree, device_kv: torch.Tensor, storage: StorageBackend | None,
                 config: HiCacheConfig, fingerprint: str, kernels: KernelSet | None = None,
                 pending: PendingPages | None = None, states: StateSlots | None = None,
                 window_tails: WindowTails | None = None) -> None:
        checkpoints = states if states is not None else window_tails
        if checkpoints is not None and tree.host_states is None:
            raise ValueError("a hybrid or window-pages model's HiCache needs a host state pool "
                             "in its tree")
        self.tree = tree
        self.states = states
        # window pages (docs/design.md §4.14): window tails are the checkpoints
        self.window_tails = window_tails
        self.host_states = tree.host_states if checkpoints is not None else None
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
        # Import (and, first time on a machine, compile) the copy kernels now, not inside the
        # first request's per-layer load.
        self.kernels.backend_for(device_kv.device)
        self.backups = Backup(tree, device_kv, self.kernels, storage, config.write_policy,
                              config.write_through_threshold, config.host_mode,
                              config.max_queued_io, self.page_keys, self._alloc_host, self._count,
                              checkpoints, self._alloc_host_state)
        self.prefetches = Prefetcher(self.host_pool, storage, config, self.page_size,
                                     self.num_layers, pending, self.page_keys, self._alloc_host,
                                     self._count, self.host_states, self._alloc_host_state)
        cpu_pool = device_kv.device.type == "cpu"
        self._copier = LoadCopier() if config.copy_ahead and cpu_pool else None
        tree.on_evict = self.backups.on_device_evict
        tree.on_checkpoint_drop = self.backups.on_checkpoint_drop

    @property
    def num_layers(self) -> int:
        return self.device_kv.shape[0]

    @property
    def pending(self) -> PendingPages | None:
        """Decode-announced writes the prefetches wait for or pull (prefill nodes); None: not
        tracked."""
        return self.prefetches.pending

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
        # one restored node per host match entry (a split restores its upper part), ending at
        # `node`: suspect if the copy into their pages fails
        restored = node.path_from_root()[-len(host.nodes):] if node is not None else []
        pref_ids = prefetched.host_page_ids if prefetched else []
        all_host = host_ids + pref_ids
        if not all_host:
            return node, None
        self._count(load_pages=len(all_host),
                    load_host_kv_bytes=len(all_host) * self.host_pool.page_nbytes)

        def release_prefetched() -> None:
            copy_failed = load.copy_error is not None
            if copy_failed:  # their host copies stay: intact, and no longer on device
                self.tree.mark_suspect(restored)
                self._count(load_failed_copies=1)
            if pref_ids:  # a timed-out stream may still be writing into them: freed later
                assert prefetched is not None
                self.release_prefetched(prefetched, pref_ids)
            if host_ids and self.config.host_mode == "exclusive" and not copy_failed:
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
        load = self.layer_load_cls(self.host_pool, self.device_kv, all_host,
                                   device_page_ids[: len(all_host)], release_prefetched, copied,
                                   self.kernels, streamed, streamed_done, self._copier)
        return node, load

    def restore_state(self, request_slot: int, host: HostMatch, node: RadixNode | None,
                      prefetched: PrefetchResult | None) -> None:
        """Hybrid models, at admission after `load`: the request's device state slot gets the
        state after its lower-tier hit: the prefetch's state object (its pages end the hit)
        or else the host checkpoint of the deepest host node (`node`, restored on device now,
        which also gets a device checkpoint when a slot is free, for the next hit). Frees the
        prefetch's host state slot. Nothing without a lower-tier hit: the device checkpoint
        the scheduler restored stays."""
        assert self.states is not None and self.host_states is not None
        from_storage = prefetched is not None and bool(prefetched.host_page_ids)
        if from_storage or host.nodes:
            slot = self._hit_checkpoint(node, prefetched, "state")
            self.states.pool.restore(request_slot, self.host_states.snapshot(slot))
            if not from_storage:
                assert node is not None
                self._checkpoint_restored(node, request_slot)
        if prefetched is not None:
            self.release_prefetched_state(prefetched)

    def _hit_checkpoint(self, node: RadixNode | None, prefetched: PrefetchResult | None,
                        what: str) -> int:
        """The host state slot holding the checkpoint a lower-tier hit ends at — the
        prefetch's object (its pages end the hit), else the deepest host node's — counted as
        loaded. Recurrent states and window tails alike (`what` the assertions name)."""
        assert self.host_states is not None
        nbytes = self.host_states.slot_nbytes
        if prefetched is not None and prefetched.host_page_ids:
            assert prefetched.state_slot is not None, f"a storage hit without its {what}"
            self._count(load_storage_states=1, load_state_bytes=nbytes)
            return prefetched.state_slot
        assert node is not None and node.host_state_slot is not None, f"host hit, no {what}"
        self._count(load_host_states=1, load_state_bytes=nbytes)
        return node.host_state_slot

    def restore_window_tail(self, match: MatchResult, host: HostMatch, node: RadixNode | None,
                            prefetched: PrefetchResult | None, pages: list[int]
                            ) -> tuple[list[int | None], list[int]]:
        """Window pages, at admission after `load`: the sliding pages of a lower-tier hit.
        Its window tail (the prefetch's object, else the deepest host node's host tail) is
        written into the tombstones of the restored tree nodes and into request-owned pages
        after them, taken from `pages` (`WindowTails.geometry.num_pages` free sliding pages).
        Returns the request's sliding page ids of every reused page and the pages unused.
        Frees the prefetch's host state slot."""
        tails, host_states = self.window_tails, self.host_states
        assert tails is not None and host_states is not None
        slot = self._hit_checkpoint(node, prefetched, "tail")
        num_tree = len(match.page_ids) + host.num_pages
        own = len(prefetched.host_page_ids) if prefetched is not None else 0
        deepest = node if node is not None else match.last_node
        path = deepest.path_from_root() if deepest is not None else []
        ids, spare = tails.fill(host_states.slot_bytes(slot), self.tree, path, num_tree,
                                num_tree + own, pages)
        if prefetched is not None:
            self.release_prefetched_state(prefetched)
        return ids, spare

    def _checkpoint_restored(self, node: RadixNode, request_slot: int) -> None:
        """A node restored from host gets its state back on device too, so the next request
        hits it there: with the checkpoint share used up, the least recently used checkpoint
        gives way, as for one the scheduler takes (without a device checkpoint the node,
        now on device, was served by neither the device rule nor the host match)."""
        assert self.states is not None
        if node.state_slot is not None:
            return
        slot = self.states.alloc_checkpoint()
        if slot is None and self.tree.drop_lru_checkpoint():
            slot = self.states.alloc_checkpoint()
        if slot is None:
            self.states.counters.checkpoints_skipped += 1
            return
        self.states.pool.copy_slot(request_slot, slot)
        self.tree.set_checkpoint(node, slot)
        self.states.counters.checkpoints_taken += 1

    def release_prefetched_state(self, prefetched: PrefetchResult) -> None:
        """Give back the host state slot of a prefetch that will not be restored."""
        self.prefetches.release_state(prefetched.state_slot)
        prefetched.state_slot = None

    def release_prefetched(self, prefetched: PrefetchResult, page_ids: list[int]) -> None:
        """Give back host pages of `prefetched` that will not be loaded: now, or once its
        stream (still writing into them) ended."""
        self.prefetches.release(prefetched, page_ids)

    # ---- prefetch (prefetch.py) --------------------------------------------------------
    def start_prefetch(self, rid: str, token_ids: Sequence[int], salt: str, first_page: int,
                       max_pages: int) -> int:
        """Look up pages `first_page .. max_pages` of the prompt in storage and start reading
        the consecutive hits into host pages; returns the number of pages being read. The
        read makes room on host without evicting the request's own match before
        `first_page` (it would cut the hit the read continues)."""
        return self.prefetches.start(rid, token_ids, salt, first_page, max_pages,
                                     self._path_nodes(token_ids, salt, first_page))

    def prefetch_ready(self, rid: str, now: float | None = None) -> bool:
        """Whether the queued request may be admitted now, under the prefetch policy."""
        return self.prefetches.ready(rid, now)

    def take_prefetch(self, rid: str) -> PrefetchResult | None:
        """The ready hits of `rid`'s prefetch (host pages, now the caller's until `load`
        frees them); unfinished or failed pages are released once their reads end."""
        return self.prefetches.take(rid)

    def has_prefetch(self, rid: str) -> bool:
        """Whether `rid` has a prefetch not taken yet."""
        return self.prefetches.has(rid)

    def prefetch_first_page(self, rid: str) -> int:
        """First prompt page of `rid`'s prefetch (0 when there is none)."""
        return self.prefetches.first_page(rid)

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
        return self.prefetches.restart(rid, token_ids, salt, first_page, max_pages,
                                       self._path_nodes(token_ids, salt, first_page))

    def _path_nodes(self, token_ids: Sequence[int], salt: str,
                    num_pages: int) -> frozenset[RadixNode]:
        """The tree's nodes holding the first `num_pages` pages of `token_ids` (any tier)."""
        prefix = token_ids[: num_pages * self.tree.page_size]
        return frozenset(node for node, _ in self.tree.walk(prefix, salt))

    def cancel_prefetch(self, rid: str) -> None:
        self.prefetches.cancel(rid)

    # ---- backup (backup.py) ------------------------------------------------------------
    def backup(self, token_ids: Sequence[int], salt: str, last_node: RadixNode | None) -> None:
        """Apply the write policy to the nodes on the path to `last_node` (just inserted or
        hit): copy them to host and write them to storage."""
        self.backups.backup(token_ids, salt, last_node)

    def page_keys(self, token_ids: Sequence[int], salt: str) -> list[bytes]:
        """Storage keys of the full pages of `token_ids` for tenant `salt` (the key scheme's)."""
        return self.scheme.keys(token_ids, salt)[0]

    # ---- accounting --------------------------------------------------------------------
    def reap(self) -> None:
        """Free host pages of abandoned prefetches whose reads have finished, and orphaned
        host copies whose storage writes have (`HiRadixTree.release_orphans`)."""
        self.tree.release_orphans()
        self.prefetches.reap()

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
        busy = [w for w in self._workers if w.queue_depth]
        pool = self.host_pool
        states_pinned = (self.host_states is not None
                         and self.host_states.stats()["host_state_slots_pinned"] > 0)
        return not busy and not self.prefetches.reads_outstanding \
            and pool.num_in_flight == 0 and not pool.any_pinned and not states_pinned

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
        host = tree.evict_host(tree.host_pages)
        tree.release_orphans()
        return device, host

    def end_session(self, session_id: str, cache_salt: str) -> bool:
        """Close the storage session this node's writes for (`cache_salt`, `session_id`) used
        (`storage_session`): the store evicts its pages first. Any thread: backends are
        thread-safe. False without storage; a backend error propagates."""
        if self.storage is None or not session_id:
            return False
        self.storage.end_session(storage_session(tenant_namespace(cache_salt), session_id))
        return True

    def check(self) -> None:
        """Every tier's accounting: the tree (device pages and checkpoints, host pages and
        host checkpoints), the host pool and the host state pool."""
        self.tree.check()
        self.host_pool.check()
        if self.host_states is not None:
            self.host_states.check()

    def host_states_untracked(self) -> int:
        """Host state slots held but not by the tree (prefetches in flight, orphans awaiting
        a storage write, or a leak): 0 on an idle node."""
        if self.host_states is None:
            return 0
        return self.host_states.num_used - self.tree.host_checkpoints()

    def start(self) -> None:
        """Start the backup and prefetch IO threads and the load copier (the engine's
        `start()` does, through its scheduler); idempotent. Work queued before waits in their
        queues; loads made before it copy on the engine thread."""
        for worker in self._workers:
            worker.start()
        if self._copier is not None:
            self._copier.start()

    def close(self) -> None:
        for worker in self._workers:
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
        prefetch = self.prefetches.gauges()
        out.update(host_pages_total=pool.capacity, host_pages_free=pool.num_free,
                   host_pages_used=pool.num_used, host_pages_in_flight=pool.num_in_flight,
                   host_evicted_pages=self.tree.num_host_evicted_pages,
                   host_orphan_pages=self.tree.num_orphan_pages,
                   prefetch_ops_pending=prefetch["prefetch_ops_pending"],
                   prefetch_ops_abandoned=prefetch["prefetch_ops_abandoned"])
        out.update(self._host_pages_outside_tree(prefetch))
        if self.host_states is not None:
            out.update(self.host_states.stats())
            out["host_state_orphans"] = self.tree.num_orphan_states
            out["host_states_evicted"] = self.tree.num_host_evicted_states
            for _ in range(3):  # a scrape's tree walk races the engine thread: retried
                try:
                    out["host_state_slots_untracked"] = self.host_states_untracked()
                    break
                except RuntimeError:
                    continue
        if self.tree.sessions is not None:
            out["sessions_tracked"] = len(self.tree.sessions)
        if self.pending is not None:
            out.update(self.pending.snapshot())
        out["pending_wait_s"] = out["pending_wait_us"] / 1e6
        for worker in self._workers:
            out[f"{worker.name}_queue_depth"] = worker.queue_depth
        out.update(self.io_stats())
        out.update(self._storage_stats())
        return out

    def _host_pages_outside_tree(self, prefetch: dict[str, int]) -> dict[str, int]:
        """Host pages held but not by the tree's nodes, for the idle-leak check of `pdcache
        chaos`: `host_pages_untracked` = USED pages no node holds (orphans awaiting a
        storage write, stream-deferred frees, or a leak), `host_pages_pinned_in_tree` = node
        pages a backup or load still pins, and (already counted in those or in IN_FLIGHT)
        the pages of abandoned prefetches and stream-deferred frees (`prefetch`: the
        prefetcher's gauges). An idle node has 0 of each. The tree walk races the engine
        thread when called from a scrape: a torn walk is retried, then the ownership keys are
        left out rather than guessed."""
        out = {
            "host_pages_abandoned_prefetch": prefetch["host_pages_abandoned_prefetch"],
            "host_pages_stream_deferred": prefetch["host_pages_stream_deferred"],
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
        for worker in self._workers:
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
    def _workers(self) -> list[IoWorker]:
        """The storage IO workers (backup, then prefetch); none without storage."""
        return [w for w in (self.backups.worker, self.prefetches.worker) if w is not None]

    def _alloc_host(self, num_pages: int,
                    keep: frozenset[RadixNode] = frozenset()) -> list[int] | None:
        """`num_pages` host pages, evicting host copies (never those of `keep`) when short."""
        page_ids = self.host_pool.alloc(num_pages)
        if page_ids is None:
            self.tree.evict_host(num_pages - self.host_pool.num_free, keep)
            page_ids = self.host_pool.alloc(num_pages)
        return page_ids

    def _alloc_host_state(self, keep: frozenset[RadixNode] = frozenset()) -> int | None:
        """A host state slot, dropping the least recently used host checkpoint (never one of
        `keep`) when the pool is full; None when none can be had."""
        assert self.host_states is not None
        slot = self.host_states.alloc()
        if slot is None and self.tree.drop_lru_host_checkpoint(keep):
            slot = self.host_states.alloc()
        return slot

    def _count(self, **deltas: int) -> None:
        with self._stats_lock:
            for name, delta in deltas.items():
                setattr(self.stats, name, getattr(self.stats, name) + delta)
