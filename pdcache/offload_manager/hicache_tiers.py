"""HiCache as the scheduler's cache tiers: `HiCacheTiers` implements
`pdcache.engine.tiers.CacheTiers` over the `HiCache` controller (host pool, storage). Any node
role composes it into its `Scheduler` (`Scheduler(tiers=HiCacheTiers(...))`; built by
`pdcache.offload_manager.builder.build_tiered_engine`).

- queued: start the storage prefetch of the prompt pages past the device + host match;
- admission: wait for the prefetch per policy; restart it (`prefetch_restarts` times at most)
  when the device + host match it continues shrank meanwhile, since its pages would no longer
  join the match; then restore host hits into the tree and load host and prefetched pages
  into the request's pages (per layer, during the next forward);
- cached: back the inserted nodes up (write policy);
- every step: free host pages of abandoned prefetches whose reads ended;
- `drop` (an idle engine's `/flush_cache`): device and host tiers, storage untouched.
Hybrid models (`carries_state`): the host and prefetch hits end where a state checkpoint is
(`HiRadixTree.match_host`, `Prefetcher`), a prefetch is used only whole up to its state, and
admission restores that state into the request's slot (`HiCache.restore_state`). Window pages
(`carries_window`, a sliding-window model's sliding layers in their own device space): the same
with window tails as the checkpoints, restored into sliding pages at admission
(`HiCache.restore_window_tail`, from pages the scheduler's `alloc_window_pages` gives:
`use_window_pages`).
Engine thread only, like the scheduler itself, except `start()` (the thread calling
`Engine.start()`), `end_session()` and `stats()` (any thread).
"""

from __future__ import annotations

from collections.abc import Callable, Collection

from pdcache.engine.radix import InsertResult, MatchResult, RadixNode
from pdcache.engine.request import Req
from pdcache.engine.tiers import TierReuse
from pdcache.offload_manager.hicache import HiCache
from pdcache.offload_manager.hiradix import HostMatch
from pdcache.offload_manager.layer_loads import LayerLoad
from pdcache.offload_manager.prefetch_ops import PrefetchResult

# `Scheduler.alloc_window_pages`: (count, tree sliding pages to keep) -> pages or None
WindowAlloc = Callable[[int, Collection[int]], "list[int] | None"]


class HiCacheTiers:
    """Owns the queued requests' prefetch-restart bookkeeping; `hicache` owns the rest. Only
    HiCache's public methods are called."""

    # the scheduler refuses a hybrid model's state slots with tiers that cannot restore them
    carries_state = True
    # ... and window pages: window tails are backed up and restored as checkpoints
    carries_window = True

    def __init__(self, hicache: HiCache, page_size: int) -> None:
        self.hicache = hicache
        self.page_size = page_size
        # queued rid -> (pages its device + host match held when its prefetch started,
        # prefetch restarts left); entries leave at admission or abort
        self._queued_match: dict[str, tuple[int, int]] = {}
        # window pages: the scheduler's sliding-page allocator (evicts cache when short)
        self._alloc_window: WindowAlloc | None = None

    def use_window_pages(self, alloc: WindowAlloc) -> None:
        """Window pages: lower-tier hits restore their window tail into sliding pages from
        `alloc` (`Scheduler.alloc_window_pages`); called once when the scheduler is built."""
        if self.hicache.window_tails is None:
            raise ValueError("window pages need a HiCache built with window_tails")
        self._alloc_window = alloc

    def start(self) -> None:
        self.hicache.start()

    def stats(self) -> dict[str, int]:
        """Lower-tier counters and gauges (`HiCache.snapshot`); callable from any thread,
        e.g. the metrics scrape."""
        return self.hicache.snapshot()

    def idle(self) -> bool:
        return self.hicache.io_idle()

    def drop(self) -> tuple[int, int]:
        return self.hicache.drop_all()

    def end_session(self, session_id: str, cache_salt: str) -> bool:
        return self.hicache.end_session(session_id, cache_salt)

    def on_queued(self, req: Req) -> None:
        max_pages = self._max_pages(req)
        first = self._tier_match(req, max_pages)
        if first and self._restarts_apply:
            self._queued_match[req.rid] = (first, self.hicache.config.prefetch_restarts)
        self.hicache.start_prefetch(req.rid, req.fill_ids, req.salt, first, max_pages)

    def admission_ready(self, req: Req) -> bool:
        return self.hicache.prefetch_ready(req.rid) and not self._restarted(req)

    def on_dequeued(self, req: Req) -> None:
        self._queued_match.pop(req.rid, None)
        self.hicache.cancel_prefetch(req.rid)

    def on_step(self) -> None:
        self.hicache.reap()

    def reuse_lower_tiers(self, req: Req, match: MatchResult, own_page_ids: list[int],
                          max_pages: int) -> TierReuse:
        self._queued_match.pop(req.rid, None)
        tail_pages: list[int] = []
        if self.hicache.window_tails is not None and self._may_reuse(req, match, max_pages):
            # a whole tail's sliding pages before the host match is taken for good (making
            # room may evict); without them no lower-tier hit can be restored
            assert self._alloc_window is not None, "window pages: use_window_pages not called"
            # the match's own sliding pages stay: the request (not running yet, so no reclaim
            # keeps them otherwise) reads them whether or not a lower tier then serves it
            mine = frozenset(page for page in match.window_page_ids if page is not None)
            got = self._alloc_window(self.hicache.window_tails.geometry.num_pages, mine)
            if got is None:
                self.hicache.cancel_prefetch(req.rid)
                return TierReuse(cached=self.hicache.cached_tokens(len(match.page_ids), 0, None))
            tail_pages = got
        return self._reuse(req, match, own_page_ids, max_pages, tail_pages)

    def _reuse(self, req: Req, match: MatchResult, own_page_ids: list[int], max_pages: int,
               tail_pages: list[int]) -> TierReuse:
        host = self.hicache.tree.match_host(match, req.fill_ids, max_pages)
        first = len(match.page_ids) + host.num_pages
        prefetched = self._usable_prefetch(req.rid, first, max_pages)
        if not host.nodes and prefetched is None:
            self._free_window(tail_pages)
            return TierReuse(cached=self.hicache.cached_tokens(len(match.page_ids), 0, None))
        try:
            node, load, window_ids, unused = self._restore(req, match, host, prefetched,
                                                           own_page_ids, tail_pages)
        except BaseException:
            # nobody took them: a failed restore gives the tree none (`WindowTails.fill`
            # adopts last), and the caller never sees them
            self._free_window(tail_pages)
            raise
        self._free_window(unused)
        return TierReuse(
            window_page_ids=window_ids,
            tree_pages=host.num_pages,
            node=node,
            own_pages=len(prefetched.host_page_ids) if prefetched else 0,
            kv_load=load,
            cached=self.hicache.cached_tokens(len(match.page_ids), host.num_pages, prefetched),
        )

    def _restore(self, req: Req, match: MatchResult, host: HostMatch,
                 prefetched: PrefetchResult | None, own_page_ids: list[int],
                 tail_pages: list[int]
                 ) -> tuple[RadixNode | None, LayerLoad | None, list[int | None] | None, list[int]]:
        """Load a lower-tier hit and restore its state or window tail (from `tail_pages`):
        the deepest restored node, the load, the request's sliding page ids (None: no window
        pages) and the tail pages unused."""
        node, load = self.hicache.load(host, prefetched, own_page_ids)
        if self.hicache.states is not None:
            assert req.state_slot is not None, "a hybrid request admitted without a state slot"
            self.hicache.restore_state(req.state_slot, host, node, prefetched)
        if self.hicache.window_tails is None:
            return node, load, None, []
        window_ids, unused = self.hicache.restore_window_tail(match, host, node, prefetched,
                                                              tail_pages)
        return node, load, window_ids, unused

    def on_cached(self, req: Req, result: InsertResult) -> None:
        num_pages = sum(n.num_pages for n in result.last_node.path_from_root())
        tokens = req.fill_ids[: num_pages * self.page_size]
        self.hicache.backup(tokens, req.salt, result.last_node)

    def _may_reuse(self, req: Req, match: MatchResult, max_pages: int) -> bool:
        """A lower tier may serve `req` past `match` (a host continuation or a prefetch):
        only then are a tail's sliding pages taken (never a cache eviction for nothing)."""
        return (self.hicache.has_prefetch(req.rid)
                or bool(self.hicache.tree.match_host(match, req.fill_ids, max_pages).nodes))

    def _free_window(self, pages: list[int]) -> None:
        if pages:
            assert self.hicache.window_tails is not None
            self.hicache.window_tails.window.allocator.free(pages)

    @property
    def _restarts_apply(self) -> bool:
        """Restarts need storage to read from and a policy that waits for the read
        (`best_effort` admits at once, so a restarted read would be abandoned)."""
        config = self.hicache.config
        return (config.prefetch_restarts > 0 and self.hicache.storage is not None
                and config.prefetch_policy != "best_effort")

    def _tier_match(self, req: Req, max_pages: int) -> int:
        """Prompt pages the device and host tiers hold now, from the first."""
        device, host = self.hicache.match(req.fill_ids, req.salt, max_pages)
        return len(device.page_ids) + host.num_pages

    def _restarted(self, req: Req) -> bool:
        """Whether `req`'s prefetch was just restarted: the device + host match it was
        started after shrank while `req` waited (tier pressure evicted those pages), so its
        pages no longer continue the match and the gap, with every prefetched page after it,
        would be recomputed. The new read starts at the shorter match; `req` waits for it
        under the prefetch policy, within the old read's deadline. False (admit) when nothing
        shrank, no restart is left, the match shrank to nothing (no further shrink to watch
        for), or `HiCache.restart_prefetch` read nothing (storage holds none of the pages past
        the new match, the old read had timed out, or it waits for decode's pending pages).
        This hook acts: it may cancel and start reads (engine thread, like every hook)."""
        queued = self._queued_match.get(req.rid)
        if queued is None:
            return False
        max_pages = self._max_pages(req)
        first = self._tier_match(req, max_pages)
        queued_first, restarts_left = queued
        if first >= queued_first:
            return False
        if restarts_left > 1 and first:
            self._queued_match[req.rid] = (first, restarts_left - 1)
        else:
            del self._queued_match[req.rid]
        return self.hicache.restart_prefetch(req.rid, req.fill_ids, req.salt, first, max_pages) > 0

    def _max_pages(self, req: Req) -> int:
        # the last prompt token is always computed (its logits give the first output token),
        # and every position whose prompt logprob is wanted
        return req.max_reuse_len // self.page_size

    def _usable_prefetch(self, rid: str, first: int, max_pages: int) -> PrefetchResult | None:
        """The prefetched pages that continue the current match (the match may have grown or
        shrunk since the prefetch started); pages that don't fit are freed (once a streamed
        read ended; one of which no page fits is cancelled)."""
        op_first = self.hicache.prefetch_first_page(rid)
        result = self.hicache.take_prefetch(rid)
        if result is None or not result.host_page_ids:
            return None
        skip = first - op_first
        usable = max(0, min(len(result.host_page_ids), max_pages - op_first) - skip)
        if skip < 0 or usable == 0:
            if result.stream is not None:
                result.stream.cancelled.set()  # no page of it will be loaded: stop reading
            self.hicache.release_prefetched_state(result)
            self.hicache.release_prefetched(result, result.host_page_ids)
            return None
        if result.state_slot is not None:  # hybrid: only up to the state it read (pages the
            # match covers meanwhile are dropped: the state still ends the pages kept)
            if skip + usable < len(result.host_page_ids):
                self.hicache.release_prefetched_state(result)
                self.hicache.release_prefetched(result, result.host_page_ids)
                return None
        keep = result.host_page_ids[skip : skip + usable]
        drop = result.host_page_ids[:skip] + result.host_page_ids[skip + usable :]
        if drop:
            self.hicache.release_prefetched(result, drop)
        from_decode = result.origins[skip : skip + usable].count("decode")
        return PrefetchResult(keep, from_decode, result.origins[skip : skip + usable],
                              result.stream, result.stream_offset + skip, result.state_slot)
