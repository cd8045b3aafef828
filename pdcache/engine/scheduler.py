"""Continuous batching with chunked prefill over the paged device pool and the radix tree.

Each `schedule()` admits waiting requests (FIFO) and returns one batch: an EXTEND batch of
prefill chunks under the token budget `SchedulerConfig.chunked_prefill_tokens`, or a DECODE
batch of one token per running request (the two alternate when both have work, so a long
prefill does not stall streaming). `commit()` applies the sampled tokens and finishes
requests.

Memory: admission reuses the longest cached device prefix (never the whole fill, so at least
one token is computed and yields logits), locks it, and allocates the pages of the rest of
the fill up front, evicting LRU cache pages when short; a request that does not fit waits
(FIFO: nothing behind it is admitted). Decode allocates one page when a request crosses a
page boundary; when even eviction cannot provide it, the newest running request is retracted:
its computed full pages go into the tree, the rest is freed, and it waits at the head of the
queue to re-prefill (mostly from cache).

Every page the scheduler touches is owned by exactly one of: the allocator (free), the tree,
one running request (`Req.own_page_ids`), or the reservation book. Engine thread only;
nothing here locks.

Composition, not subclassing: the node that builds the scheduler gives it
- `tiers` (`pdcache.engine.tiers.CacheTiers`): the cache tiers below the device tree, asked
  when a request is queued (`on_queued`: start a prefetch), before admission
  (`admission_ready`), at admission (`reuse_lower_tiers`: fill the pages after the device
  match with K/V from elsewhere), when pages enter the tree (`on_cached`: back them up), when
  a waiting request leaves (`on_dequeued`) and once per `schedule()` (`on_step`). Default
  `DeviceOnly`; HiCache's is `pdcache.offload_manager.hicache_tiers.HiCacheTiers`.
- `role` (`pdcache.engine.roles.RolePolicy`): the node role's decisions: an admission gate,
  `can_retract`, which finished or aborted requests keep their pages (`hold_after_finish`,
  `hold_on_abort`, `abort_releases_held`, until `release_held`), what happens around a
  prefilled start and a commit, and whether the scheduler keeps a reservation book
  (`pdcache.engine.reservations.ReservationBook`, `reservations`). Default `Unified`;
  prefill's is `pdcache.prefill_node.scheduler.PrefillRole`, decode's
  `pdcache.decode_node.scheduler.DecodeRole`.
- `states` (`pdcache.engine.state_cache.StateSlots`): hybrid models only (Qwen3-Next), the
  recurrent-state slots: a request holds one while running (allocated at admission,
  initialised from the checkpoint of its prefix hit, freed exactly once when it finishes, is
  aborted or retracted: a retracted request drops its state and recomputes from its deepest
  checkpoint, which its retraction may just have added); the scheduler ends prefill chunks at
  the request's checkpoint points and hands checkpoints to the tree (see `state_cache`).
  Lower tiers must carry the state (`carries_state`: HiCache's back checkpoints up with their
  pages and restore the state of a lower-tier hit into the request's slot at admission);
  other tiers are refused with `states`. A checkpoint taken after its pages were cached is
  shown to the tiers again (`on_cached` of its node), so they back it up too.
- `window` (`pdcache.engine.window_pages.WindowPages`): sliding-window models on a
  device-only engine: the sliding layers' own page space. Each request also holds one
  sliding page per page (`Req.window_page_ids`), allocated with its full pages, and frees
  those no window of it needs after every forward (tombstones go to the tree with its
  pages); the tree serves hits only where the window's sliding pages are there. A
  prefilled start (decode) holds sliding pages of its prompt's window tail only, reserved
  with its pages (`ReservationBook`). Lower tiers must carry window tails as checkpoints
  (`carries_window`: HiCache's, on a unified or prefill node); others are refused.
Any role may have any tiers. The node's controller (`pdcache.prefill_node.controller`,
`pdcache.decode_node.controller`) makes the PD decisions those policies relay.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Collection
from dataclasses import dataclass, field

from pdcache.engine.api import CachedTokens, TokenLogprob
from pdcache.engine.config import CacheConfig
from pdcache.engine.forward import ForwardMode
from pdcache.engine.kv_pool import DeviceKVPool
from pdcache.engine.radix import InsertResult, MatchResult, RadixNode, RadixTree
from pdcache.engine.request import KVLoad, Req, ReqStatus, pages_for
from pdcache.engine.reservations import ReservationBook
from pdcache.engine.roles import RolePolicy, Unified
from pdcache.engine.scheduler_config import SchedulerConfig
from pdcache.engine.state_cache import StateSlots
from pdcache.engine.state_pool import StateSnapshot
from pdcache.engine.tiers import CacheTiers, DeviceOnly, TierReuse
from pdcache.engine.window_pages import WindowPages

# `add_prefilled` of a hybrid model without the recurrent state prefill sent with its pages
NO_STATE_TRANSFER = "a hybrid model's prefilled request needs its recurrent state from prefill"
NO_STATE_TIERS = "these host/storage tiers do not carry recurrent state"
# window pages (a sliding-window model's sliding layers in their own page space)
NO_WINDOW_TIERS = "these host/storage tiers do not carry sliding-window pages"
# ... and on a node taking reservations (decode) with tiers: its tiers are device-only
NO_WINDOW_ROLE = "window pages with host/storage tiers run on unified and prefill nodes only"

logger = logging.getLogger(__name__)


@dataclass
class ScheduledBatch:
    """What to run: `reqs[b]` computes `extend_lens[b]` new tokens; `sample_rows` are the
    rows whose logits yield a token (requests whose fill is complete after this batch);
    `kv_loads` are every pending load (of any running request), finished by this forward.
    `logprob_spans` are `(row, first, end)`: request `reqs[row]` also needs the logits of its
    positions `[first, end)` (prompt logprobs, `Req.input_logprob_positions`); the runner
    returns them after the sample rows' logits, in this order."""

    mode: ForwardMode
    reqs: list[Req]
    extend_lens: list[int]
    sample_rows: list[int] = field(default_factory=list)
    kv_loads: list[KVLoad] = field(default_factory=list)  # to complete layer by layer
    logprob_spans: list[tuple[int, int, int]] = field(default_factory=list)


@dataclass
class SchedulerCounters:
    admitted: int = 0
    retracted: int = 0
    finished: int = 0
    aborted: int = 0
    cached_tokens: int = 0  # prompt tokens reused at first admission, over finished requests
    computed_tokens: int = 0  # tokens run through extend forwards


class Scheduler:
    """Waiting queue, running set, held requests and their memory; with a role that takes
    reservations, the reservation book too. Composed with `tiers` and `role` (see the module
    docstring); engine thread only, except `end_session` (any thread)."""

    def __init__(
        self,
        config: SchedulerConfig,
        cache: CacheConfig,
        pool: DeviceKVPool,
        tree: RadixTree | None,
        max_context: int,
        eos_token_ids: tuple[int, ...],
        *,
        tiers: CacheTiers | None = None,
        role: RolePolicy | None = None,
        states: StateSlots | None = None,
        window: WindowPages | None = None,
    ) -> None:
        self.config = config
        self.page_size = cache.page_size
        self.pool = pool
        self.allocator = pool.allocator
        self.tree = tree
        self.max_context = max_context
        self.eos_token_ids = frozenset(eos_token_ids)
        self.tiers: CacheTiers = tiers if tiers is not None else DeviceOnly(tree)
        self.role: RolePolicy = role if role is not None else Unified()
        if (states is not None and not isinstance(self.tiers, DeviceOnly)
                and not getattr(self.tiers, "carries_state", False)):
            raise ValueError(f"{NO_STATE_TIERS}: a hybrid model ({states.pool.describe()}) "
                             f"runs with device-only caching (no host/storage tiers)")
        self.states = states
        # where states are checkpointed: [cache] state_checkpoints (docs/design.md §4.14)
        self.checkpoint_policy = cache.state_checkpoints
        if window is not None and not isinstance(self.tiers, DeviceOnly):
            self._check_window_tiers()
        # window pages (pdcache.engine.window_pages): each request also holds the sliding
        # layers' pages, freeing those out of its windows after every forward
        self.window = window
        # window tails are checkpoints of the lower tiers: taken at node ends (`commit`)
        self._tiers_carry_window = (window is not None and tree is not None
                                    and not isinstance(self.tiers, DeviceOnly))
        self.waiting: deque[Req] = deque()
        self.running: list[Req] = []
        self.counters = SchedulerCounters()
        self.reservations: ReservationBook | None = (
            ReservationBook(config, self.page_size, max_context, self)
            if self.role.takes_reservations else None)
        self.held: dict[str, Req] = {}  # finished requests whose pages are kept
        self._admit_seq = 0
        self._last_mode: ForwardMode | None = None

    def _check_window_tiers(self) -> None:
        """Window pages over lower tiers: they must carry window tails (`carries_window`)
        and the node be unified or prefill; the tiers then take the sliding-page allocator."""
        if not getattr(self.tiers, "carries_window", False):
            raise ValueError(f"{NO_WINDOW_TIERS}: a model whose sliding layers keep only "
                             f"their window runs with device-only caching")
        if self.role.takes_reservations and type(self.role) is not Unified:  # decode
            raise ValueError(f"{NO_WINDOW_ROLE} (not {type(self.role).__name__})")
        self.tiers.use_window_pages(self.alloc_window_pages)  # type: ignore[attr-defined]

    # ---- queue -------------------------------------------------------------------------
    def add(self, req: Req) -> None:
        self.waiting.append(req)
        self.tiers.on_queued(req)

    def end_session(self, session_id: str, cache_salt: str) -> bool:
        """The client closed conversation `session_id` (of tenant salt `cache_salt`): the
        tiers' and the role's storage sessions close it. Any thread (only thread-safe storage
        backends are called). True when one closed it."""
        closed = self.tiers.end_session(session_id, cache_salt)
        return self.role.end_session(session_id, cache_salt) or closed

    # ---- disaggregation primitives -----------------------------------------------------
    def release_reservation(self, rid: str) -> bool:
        """Free the pages reserved for `rid`; False if there were none (or no book)."""
        return self.reservations is not None and self.reservations.release(rid)

    def add_prefilled(self, req: Req, first_token: int,
                      first_logprob: TokenLogprob | None = None,
                      state: StateSnapshot | None = None) -> None:
        """Start decoding `req` on its reserved pages, which hold its prompt's K/V; a hybrid
        model's `state` is its recurrent state after the last prompt token (prefill's, P→D),
        restored into the request's state slot (its reservation was granted only with one
        left for it). Raises ValueError when the reservation does not fit it
        (`ReservationBook.take`), or for a hybrid model without a state of this pool's
        geometry (or, defensively, no free request slot), nothing taken."""
        if self.reservations is None:
            raise ValueError(f"request {req.rid!r}: this node takes no reservations")
        state_slot = self._prefilled_state_slot(req, state)
        try:
            page_ids, prefix, window_ids = self.reservations.take(req)
        except BaseException:
            if state_slot is not None:
                self.states.free_request(state_slot)  # type: ignore[union-attr]
            raise
        req.state_slot = state_slot
        self.role.on_prefilled(req)
        # the request now holds the prefix's lock (its release unlocks `last_node`)
        req.admit_prefilled(page_ids, first_token, self._admit_seq, first_logprob,
                            num_tree_pages=len(prefix.page_ids), last_node=prefix.last_node,
                            window_page_ids=window_ids)
        if self.tree is not None:  # a turn of its session arrived (nodes learn it on release)
            self.tree.note_session(None, req.session_id, new_turn=True)
        self._admit_seq += 1
        self.running.append(req)
        self._maybe_finish(req, first_token)

    def _prefilled_state_slot(self, req: Req, state: StateSnapshot | None) -> int | None:
        """A hybrid model's request slot holding prefill's `state` (None: not hybrid)."""
        if self.states is None:
            if state is not None:
                raise ValueError(f"request {req.rid!r}: a recurrent state for a model without one")
            return None
        if state is None:
            raise ValueError(f"request {req.rid!r}: {NO_STATE_TRANSFER}")
        if state.geometry != self.states.pool.geometry:
            raise ValueError(f"request {req.rid!r}: recurrent state of another geometry "
                             f"({state.geometry.key()} != {self.states.pool.geometry.key()})")
        slot = self.states.alloc_request()
        if slot is None:
            raise ValueError(f"request {req.rid!r}: no free recurrent-state slot")
        try:
            self.states.pool.restore(slot, state)  # ValueError: wrong length, nothing written
        except BaseException:
            self.states.free_request(slot)
            raise
        return slot

    def release_held(self, rid: str) -> bool:
        """Cache and free the pages of a held request (see `RolePolicy.hold_after_finish`)."""
        req = self.held.pop(rid, None)
        if req is not None:
            req.holding_pages = False
            self.allocator.free(req.deferred_free_page_ids)  # no reader left
            req.deferred_free_page_ids = []
            self._release(req, cache=True)
        return req is not None

    def pending_loads(self) -> list[KVLoad]:
        """Loads the next forward must complete (it may read their pages via the tree)."""
        return [r.kv_load for r in self.running if r.kv_load is not None and not r.kv_load.done]

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def find(self, rid: str) -> Req | None:
        for req in self.running:
            if req.rid == rid:
                return req
        return next((req for req in self.waiting if req.rid == rid), None)

    def abort(self, req: Req, reason: str = "abort", error: str | None = None) -> None:
        """Finish `req` now, freeing all its pages (nothing of it is cached), unless
        the role's `hold_on_abort` keeps them."""
        hold = False
        if req.status is ReqStatus.RUNNING:
            self.running.remove(req)
            hold = self.role.hold_on_abort(req)
            if not hold:
                self._release(req, cache=False)
        elif req.status is ReqStatus.WAITING:
            self.waiting.remove(req)
            self.tiers.on_dequeued(req)
            self.role.on_dropped(req)
        req.status, req.finish_reason, req.error = ReqStatus.FINISHED, reason, error
        self.counters.aborted += 1
        if hold:
            self._hold(req)

    def abort_held(self, rid: str) -> bool:
        """An abort reached held request `rid`: free it if the role's `abort_releases_held`
        says so."""
        req = self.held.get(rid)
        if req is None or not self.role.abort_releases_held(req):
            return False
        return self.release_held(rid)

    # ---- scheduling --------------------------------------------------------------------
    def schedule(self) -> ScheduledBatch | None:
        """Admit what fits, then pick the next batch (None: nothing runnable)."""
        self.tiers.on_step()
        if self.tree is not None and self.tree.has_suspects:  # left by a step that failed
            self.tree.drop_suspects()
        self._admit_waiting()
        prefilling = [r for r in self.running if not r.prefill_done]
        want_decode = any(r.prefill_done for r in self.running)
        if prefilling and not (want_decode and self._last_mode is ForwardMode.EXTEND):
            batch = self._extend_batch(prefilling)
            if batch is None and want_decode:  # no prefill can go on (a chunk short of
                batch = self._decode_batch()  # sliding pages): decoding frees them
        elif want_decode:
            batch = self._decode_batch()
        else:
            batch = None
        if batch is None and prefilling:
            batch = self._extend_batch([r for r in self.running if not r.prefill_done])
        self._last_mode = batch.mode if batch else None
        if batch is not None:
            batch.kv_loads = self.pending_loads()
        return batch

    def commit(self, batch: ScheduledBatch, tokens: list[int],
               logprobs: list[TokenLogprob | None] | None = None) -> list[Req]:
        """Apply a finished forward: advance K/V lengths, append `tokens` (one per
        `batch.sample_rows` entry, with its `logprobs` entry when given) and finish requests.
        Returns the requests with new tokens or a finish (FINISHED ones are already
        released). A request no longer RUNNING (aborted meanwhile) is skipped."""
        sampled = dict(zip(batch.sample_rows, tokens))
        sampled_logprobs = dict(zip(batch.sample_rows, logprobs or []))
        touched: list[Req] = []
        for row, (req, length) in enumerate(zip(batch.reqs, batch.extend_lens)):
            if req.status is not ReqStatus.RUNNING:
                continue  # aborted while the batch ran
            if req.kv_load is not None and req.kv_load.done:
                req.kv_load = None
            req.kv_len += length
            if self.window is not None:
                self._drop_out_of_window(req)
            if batch.mode is ForwardMode.EXTEND:
                req.computed_tokens += length
                self.counters.computed_tokens += length
            if row in sampled:
                prefilled_now = not req.prefill_done
                req.prefill_done = True
                req.append_token(sampled[row], sampled_logprobs.get(row))
                if prefilled_now and self._tiers_carry_window:
                    # the prompt's last full page ends a node: its window tail is backed up
                    # there (a repeated prompt's, another sample's, the next turn's hit)
                    self.cache_prompt(req)
            if self.states is not None:  # after the token (caching pages checks `req`)
                self._after_forward(req, batch.mode)
            elif req.checkpoint_at and req.kv_len == req.checkpoint_at[0]:  # window tails
                req.checkpoint_at.pop(0)
                self._cache_pages(req, req.kv_len // self.page_size)
            if row in sampled:
                self._maybe_finish(req, sampled[row])
                touched.append(req)
            req.check()
        self.role.after_commit(batch.reqs)
        return touched

    def requeue_failed_loads(self, batch: ScheduledBatch) -> list[int] | None:
        """After `batch`'s forward (which finished every pending load): running requests whose
        reused K/V failed verification once the forward had read it (a load's `failed`, e.g.
        HiCache's layer-streamed prefetch) keep nothing of it. Their pages are freed, not
        cached, and they go back to the head of the queue without a new prefetch, so they
        recompute what no tier holds verified; their tier split is recorded anew at the next
        admission. Returns the logits rows of `batch` still to use (its sample rows, then
        its logprob spans' positions, minus those of the requeued requests) with
        `batch.sample_rows` and `batch.logprob_spans` cut to match, or None when none failed."""
        failed = [r for r in self.running
                  if r.kv_load is not None and r.kv_load.done and getattr(r.kv_load, "failed", False)]
        readers = self._suspect_readers(failed)
        if not failed and not readers:
            return None
        reader_ids = {id(r) for r in readers}
        for req in failed + readers:
            copy_error = getattr(req.kv_load, "copy_error", None) if req.kv_load else None
            logger.warning("request %s: %s; recomputing", req.rid,
                           "read K/V a failed copy left" if id(req) in reader_ids else
                           "reused K/V failed verification" if copy_error is None else
                           f"the copy of its reused K/V failed ({copy_error!r})")
            req.skip_lower_tiers = req.skip_lower_tiers or copy_error is not None
            self._release(req, cache=False)
            self.running.remove(req)
            req.status = ReqStatus.WAITING
            req.cached_len, req.cached = None, None
            self.waiting.appendleft(req)
        if self.tree is not None:
            self.tree.drop_suspects()
        failed += readers
        gone = {id(r) for r in failed}
        samples = [i for i, row in enumerate(batch.sample_rows) if id(batch.reqs[row]) not in gone]
        rows, offset, spans = list(samples), len(batch.sample_rows), []
        for span in batch.logprob_spans:
            width = span[2] - span[1]
            if id(batch.reqs[span[0]]) not in gone:
                rows += range(offset, offset + width)
                spans.append(span)
            offset += width
        batch.sample_rows = [batch.sample_rows[i] for i in samples]
        batch.logprob_spans = spans
        return rows

    def _suspect_readers(self, failed: list[Req]) -> list[Req]:
        """Running requests (besides `failed`) whose locked path runs through a node a failed
        load left suspect: they read its junk in this forward (admitted beside the load)."""
        if self.tree is None or not self.tree.has_suspects:
            return []
        known = {id(r) for r in failed}
        return [r for r in self.running if id(r) not in known and r.last_node is not None
                and self.tree.on_suspect_path(r.last_node)]

    # ---- admission ---------------------------------------------------------------------
    def _admit_waiting(self) -> None:
        """FIFO admission; a request whose lower tiers are not ready is skipped, one that does
        not fit in memory stops admission (so big requests are not starved)."""
        pending = sum(r.fill_len - r.kv_len for r in self.running if not r.prefill_done)
        for req in list(self.waiting):
            if len(self.running) >= self.config.max_running_requests:
                break
            if pending >= self.config.chunked_prefill_tokens:
                break
            if not self._admission_ready(req) or not self._leader_ready(req):
                continue
            if not self._try_admit(req):
                break
            self.waiting.remove(req)
            self.running.append(req)
            pending += req.fill_len - req.kv_len

    def _admission_ready(self, req: Req) -> bool:
        """The role's gate first: a request it cannot take yet costs the tiers nothing (no
        restarted prefetch)."""
        return self.role.admission_ready(req) and self.tiers.admission_ready(req)

    def _try_admit(self, req: Req) -> bool:
        match = self._match(req)
        self.lock(match.last_node)
        need = pages_for(req.fill_len, self.page_size) - len(match.page_ids)
        headroom = sum(1 for r in self.running if r.prefill_done)  # a page each for decode
        own = self.alloc_pages(need, reserve=headroom)
        if own is None:
            self.unlock(match.last_node)
            return False
        # window pages: the sliding pages come a chunk at a time (`_chunk_window`)
        if self.states is not None and not self._admit_state(req, match):
            self.allocator.free(own)
            self.unlock(match.last_node)
            return False
        max_pages = req.max_reuse_len // self.page_size
        reuse = TierReuse() if req.skip_lower_tiers else \
            self.tiers.reuse_lower_tiers(req, match, own, max_pages)
        node = match.last_node
        if reuse.tree_pages:
            self.lock(reuse.node)  # the restored nodes hang below the device match
            self.unlock(match.last_node)
            node = reuse.node
        if self.tree is not None:
            # a turn arrives once: not again when a retracted request comes back, nor for the
            # other samples (n > 1) of the same prompt
            first = req.cached_len is None and req.prefill_leader is None
            self.tree.note_session(node, req.session_id, new_turn=first)
            if first and node is not None and not node.is_root:
                self.tree.count_hit(node)
        num_tree_pages = len(match.page_ids) + reuse.tree_pages
        reused_len = (num_tree_pages + reuse.own_pages) * self.page_size
        cached = reuse.cached or CachedTokens(device=match.cached_len)
        window_ids = None
        if self.window is not None:  # a lower tier's hit brings its window tail's pages
            window_ids = (match.window_page_ids if reuse.window_page_ids is None
                          else reuse.window_page_ids)
        req.admit(match.page_ids + own, num_tree_pages, node, reused_len, self._admit_seq,
                  cached, reuse.kv_load, window_ids)
        if self.states is not None:  # a lower tier's hit went past some checkpoint points
            req.checkpoint_at = [n for n in req.checkpoint_at if n > req.kv_len]
        elif self._tiers_carry_window:
            req.checkpoint_at = self._window_branch_point(req, match)
        self._admit_seq += 1
        self.counters.admitted += 1
        if self.tree is not None:
            self.tree.count_match(match)
        return True

    def _match(self, req: Req) -> MatchResult:
        if self.tree is None:
            return MatchResult([], 0, None)
        # leave at least one token to compute (its logits give the next token), and every
        # position whose prompt logprob is wanted
        return self.tree.match_prefix(req.fill_ids[: req.max_reuse_len], req.salt)

    # ---- n > 1: followers share the leader's prompt pages ---------------------------------
    def _leader_ready(self, req: Req) -> bool:
        """A follower (`req.prefill_leader` set) waits until its leader's prompt pages are in
        the tree (cached now if the leader finished its prefill and still runs) or the leader
        is gone (finished: its pages were cached; failed: nothing to share)."""
        if req.prefill_leader is None or self.tree is None:
            return True
        held = self.held.get(req.prefill_leader)
        if held is not None:  # finished, its pages kept (a prefill node's KV transfer reads them)
            if held.prefill_done:  # not one aborted mid-prefill
                self.cache_prompt(held)
            return True
        leader = next((r for r in self.running if r.rid == req.prefill_leader), None)
        if leader is None:
            return all(r.rid != req.prefill_leader for r in self.waiting)
        if not leader.prefill_done:
            return False
        self.cache_prompt(leader)
        return True

    def cache_prompt(self, req: Req) -> None:
        """Insert the full prompt pages of prefilled `req` (running, or finished and held)
        into the tree now (not when it releases its pages), so other requests match them
        while it decodes or its pages are read. Pages the tree already held
        are swapped for the tree's copies (same tokens, same K/V) and freed; `req` then
        borrows all of them from the tree, locking the new last node."""
        assert self.tree is not None and req.prefill_done, req.rid
        self._cache_pages(req, min(len(req.prompt_ids), req.kv_len) // self.page_size)

    def _cache_pages(self, req: Req, num_full: int) -> None:
        """Insert the first `num_full` pages of `req` (computed) into the tree; `req` then
        borrows them (see `cache_prompt`). No-op when the tree has them from `req` already."""
        assert self.tree is not None
        if num_full <= req.num_tree_pages:
            return
        tokens = req.fill_slice(0, num_full * self.page_size)
        result = self.tree.insert(tokens, req.page_ids[:num_full], req.salt,
                                  self._window_of(req, num_full))
        self.tree.note_session(result.last_node, req.session_id, new_turn=False)
        match = self.tree.match_pages(tokens, req.salt)
        assert match.cached_len == len(tokens), (match.cached_len, len(tokens))
        self.lock(match.last_node)
        self.unlock(req.last_node)
        # the pages went to a reader (a held request's KV transfer; a running decode request's
        # offload copies, queued with these page ids, when the role lets none of its pages go
        # early): freed when the request's pages are (they were freed at once, and a copy
        # then read whatever the page held next: served by pulls, written to storage)
        if req.holding_pages or not self.role.can_retract(req):
            req.deferred_free_page_ids += result.duplicate_page_ids
        else:
            self.allocator.free(result.duplicate_page_ids)
        req.page_ids[:num_full] = match.page_ids
        if self.window is not None:  # the tree's sliding pages, its tombstones included
            self.free_window_pages(result.duplicate_window_page_ids)
            req.window_page_ids[:num_full] = match.window_page_ids
        req.num_tree_pages, req.last_node = num_full, match.last_node
        req.check()
        self.tiers.on_cached(req, result)

    # ---- memory (also the reservation book's `PageSource`) -----------------------------
    def lock(self, node: RadixNode | None) -> None:
        if self.tree is not None:
            self.tree.lock(node)

    def unlock(self, node: RadixNode | None) -> None:
        if self.tree is not None:
            self.tree.unlock(node)

    def free_pages(self, page_ids: list[int]) -> None:
        self.allocator.free(page_ids)

    def alloc_pages(self, num_pages: int, reserve: int = 0) -> list[int] | None:
        """`num_pages` pages, evicting cache when short, leaving `reserve` more obtainable."""
        short = num_pages + reserve - self.allocator.num_free
        if short > 0 and self.tree is not None:
            self.tree.evict(short)
        if self.allocator.num_free < num_pages + reserve:
            return None
        return self.allocator.alloc(num_pages)

    # ---- batches -----------------------------------------------------------------------
    def _extend_batch(self, prefilling: list[Req]) -> ScheduledBatch | None:
        budget = self.config.chunked_prefill_tokens
        batch = ScheduledBatch(ForwardMode.EXTEND, [], [])
        for req in prefilling:
            chunk = min(req.fill_len - req.kv_len, budget)
            if req.checkpoint_at:  # end the chunk where a state checkpoint is taken
                chunk = min(chunk, req.checkpoint_at[0] - req.kv_len)
            chunk = self._chunk_for_policy(req, chunk)
            if chunk <= 0 or req.status is not ReqStatus.RUNNING:
                break  # (a request retracted for a chunk's sliding pages ends the batch too)
            if not self._chunk_window(req, chunk, batch.reqs):
                break  # in order: the requests behind it wait too
            if req.kv_len + chunk == req.fill_len:
                batch.sample_rows.append(len(batch.reqs))
            first, end = req.input_logprob_positions(req.kv_len, req.kv_len + chunk)
            if end > first:
                batch.logprob_spans.append((len(batch.reqs), first, end))
            batch.reqs.append(req)
            batch.extend_lens.append(chunk)
            budget -= chunk
        return batch if batch.reqs else None

    def _decode_batch(self) -> ScheduledBatch | None:
        """One token per decoding request, giving each a new page when it needs one."""
        decoding = sorted((r for r in self.running if r.prefill_done), key=lambda r: r.admit_seq)
        batch: list[Req] = []
        for req in decoding:
            if req.status is ReqStatus.RUNNING and self._ensure_decode_page(req, batch):
                batch.append(req)
        if not batch:
            return None
        return ScheduledBatch(ForwardMode.DECODE, batch, [1] * len(batch), list(range(len(batch))))

    def _ensure_decode_page(self, req: Req, batched: list[Req]) -> bool:
        """Make room for the K/V of position `req.kv_len` by retracting the newest retractable
        request not in `batched`; False if `req` got retracted or must wait a step."""
        if req.kv_len < len(req.page_ids) * self.page_size:
            return True
        while True:
            page = self.alloc_pages(1)
            window_page = [] if self.window is None or page is None else self.alloc_window_pages(1)
            if page is not None and window_page is not None:
                req.page_ids.extend(page)
                if self.window is not None:
                    req.window_page_ids.extend(window_page)
                return True
            if page is not None:  # no sliding page for it
                self.allocator.free(page)
            victims = [r for r in self.running if r not in batched and self.role.can_retract(r)]
            if not victims:
                return False  # nothing may give way now: `req` skips this step
            victim = max(victims, key=lambda r: r.admit_seq)
            self._retract(victim)
            if victim is req:
                return False

    def _retract(self, req: Req) -> None:
        logger.info("retracting %s (kv_len=%d) to free device pages", req.rid, req.kv_len)
        self._release(req, cache=True)
        self.running.remove(req)
        req.status = ReqStatus.WAITING
        req.num_retractions += 1
        self.waiting.appendleft(req)
        self.counters.retracted += 1

    # ---- finishing ---------------------------------------------------------------------
    def _maybe_finish(self, req: Req, token: int) -> None:
        try:
            reason = self._finish_reason(req, token)
        except Exception as exc:  # noqa: BLE001 - a constraint's is_terminated: its request
            # alone ends (raised out of commit, it failed every request of the step)
            logger.exception("constraint of %s failed", req.rid)
            req.error, reason = f"constraint failed: {exc}", "abort"
        if reason is None:
            return
        self.running.remove(req)
        req.status, req.finish_reason = ReqStatus.FINISHED, reason
        self.counters.finished += 1
        self.counters.cached_tokens += req.cached_len or 0
        if self.role.hold_after_finish(req):
            self._hold(req)
        else:
            self._release(req, cache=True)

    def _hold(self, req: Req) -> None:
        # the held pages go to a reader; the state goes nowhere, but the pending decode
        # checkpoint stays with them: `release_held` gives the tree both (`_release`)
        self._free_request_slot(req)
        req.holding_pages = True
        self.held[req.rid] = req

    def _finish_reason(self, req: Req, token: int) -> str | None:
        params = req.sampling
        if token in self.eos_token_ids and not params.ignore_eos:
            return "stop"
        if token in params.stop_token_ids:
            return "stop"
        if req.constraint is not None and req.constraint.is_terminated():
            return "stop"
        if len(req.output_ids) >= params.max_new_tokens or req.fill_len >= self.max_context:
            return "length"
        return None

    def _release(self, req: Req, cache: bool) -> None:
        """Give back every page of `req`: with `cache`, its computed full pages go to the tree
        (the tree keeps one copy; duplicates are freed), everything else is freed. A pending
        load is finished first; one that then reports `failed` (K/V that did not verify, e.g.
        a retraction before `requeue_failed_loads` saw it) caches nothing."""
        if req.kv_load is not None:
            req.kv_load.finish()  # its pages are about to be cached or freed
            if getattr(req.kv_load, "failed", False):
                # the reused K/V did not verify (or its read timed out): nothing computed on
                # it may enter the tree, where a backup would re-write it with a fresh MAC
                cache = False
                req.cached_len, req.cached = None, None  # its tier split is recorded anew
        to_free = req.own_page_ids
        window_free = req.own_window_page_ids
        num_full = req.kv_len // self.page_size
        result = None
        if cache and self.tree is not None and num_full > req.num_tree_pages:
            tokens = req.fill_ids[: num_full * self.page_size]
            result = self.tree.insert(tokens, req.page_ids[:num_full], req.salt,
                                      self._window_of(req, num_full))
            self.tree.note_session(result.last_node, req.session_id, new_turn=False)
            to_free = result.duplicate_page_ids + req.page_ids[num_full:]
            window_free = result.duplicate_window_page_ids + [
                page for page in req.window_page_ids[num_full:] if page is not None]
        attached = None  # a node that got `req`'s pending decode checkpoint
        if cache and self.states is not None:
            attached = self._attach_pending_checkpoint(req, num_full)
        hit = None  # a whole-prompt hit inserts nothing: the tiers still see what it read
        if result is None and attached is None and cache and self.tree is not None:
            hit = self._hit_node(req)
        self._free_state(req)
        self.allocator.free(to_free + req.deferred_free_page_ids)  # none held: no reader left
        req.deferred_free_page_ids = []
        self.free_window_pages(window_free)
        self.unlock(req.last_node)
        req.release_pages()
        if result is not None:
            self.tiers.on_cached(req, result)
        elif attached is not None:  # a checkpoint on pages cached before: the tiers see it
            self.tiers.on_cached(req, InsertResult([], attached, 0))
        elif hit is not None:
            # the write policy applies to a hit too (write_through_selective backs a node up
            # once it was hit enough; a backup skipped for room is tried again): a prompt
            # repeated exactly (a prefill node's every request: one token) was never backed up
            self.tiers.on_cached(req, InsertResult([], hit, 0))

    def _hit_node(self, req: Req) -> RadixNode | None:
        """The tree node ending exactly where `req`'s tree pages end (None when that is
        inside a node: its other pages are not this request's tokens)."""
        if not req.num_tree_pages or self.tree is None:
            return None
        tokens = req.fill_ids[: req.num_tree_pages * self.page_size]
        return self.tree.node_at(tokens, req.salt)

    # ---- window pages (sliding layers' own pages; pdcache.engine.window_pages) ---------
    def alloc_window_pages(self, num_pages: int, keep: Collection[int] = ()
                           ) -> list[int] | None:
        """`num_pages` sliding pages (none without window pages), evicting cache when short
        (never the tree sliding pages in `keep`: an admitting request's match); None when
        even that leaves too few."""
        if self.window is None:
            return []
        allocator = self.window.allocator
        while allocator.num_free < num_pages and self.tree is not None and self.tree.evict(1):
            pass  # whole nodes go, each with its sliding pages
        if allocator.num_free < num_pages and self.tree is not None:
            self._reclaim_window_pages(num_pages - allocator.num_free, keep)
        return allocator.alloc(num_pages)

    def _reclaim_window_pages(self, wanted: int, spare: Collection[int] = ()) -> None:
        """Free locked tree sliding pages nothing reads any more: a running request reads
        its tree pages from its window on (`first_needed_page(kv_len)`; those behind it
        never again: kv_len only grows, a retracted request matches anew), a held request
        or a reservation's prefix may still read all of theirs. Without this, a multi-turn
        hit locked every earlier turn's window tails on its path and a small sliding pool
        stalled the request that held them for good. The running requests' copies of the
        freed pages become tombstones too, so that caching them later adopts nothing."""
        assert self.window is not None and self.tree is not None
        window = self.window
        keep = set(spare)
        keep.update(page for req in self.held.values()
                    for page in req.window_page_ids[: req.num_tree_pages] if page is not None)
        if self.reservations is not None:
            keep.update(self.reservations.prefix_window_pages())
        for req in self.running:
            first = window.first_needed_page(req.kv_len)
            read_from = self.role.pages_read_from(req)  # decode offload's queued copies
            if read_from is not None:
                first = min(first, read_from)
            keep.update(page for page in req.window_page_ids[first : req.num_tree_pages]
                        if page is not None)
        freed = set(self.tree.reclaim_window_pages(keep, wanted))
        if not freed:
            return
        for req in self.running:
            ids = req.window_page_ids
            for index in range(min(req.num_tree_pages, len(ids))):
                if ids[index] in freed:
                    ids[index] = None
        window.reclaimed_from_tree += len(freed)

    def _chunk_window(self, req: Req, chunk: int, batched: list[Req]) -> bool:
        """Give `req` the sliding pages its next `chunk` tokens write (window pages come a
        chunk at a time, so the sliding pool can be smaller than the full one): evicting
        cache, then retracting the newest request admitted after it and not in `batched`
        (the floor `min_sliding_pages` keeps that rare). False: `req` waits a step."""
        if self.window is None:
            return True
        missing = pages_for(req.kv_len + chunk, self.page_size) - len(req.window_page_ids)
        while missing > 0:
            pages = self.alloc_window_pages(missing)
            if pages is not None:
                req.window_page_ids.extend(pages)
                return True
            victims = [r for r in self.running if r not in batched
                       and r.admit_seq > req.admit_seq and self.role.can_retract(r)]
            if not victims:
                return False
            self._retract(max(victims, key=lambda r: r.admit_seq))
        return True

    def free_window_pages(self, page_ids: list[int]) -> None:
        if self.window is not None and page_ids:
            self.window.allocator.free(page_ids)

    def _window_of(self, req: Req, num_pages: int) -> list[int | None] | None:
        """The sliding pages of `req`'s first `num_pages` pages (None without window pages)."""
        return None if self.window is None else req.window_page_ids[:num_pages]

    def _drop_out_of_window(self, req: Req) -> None:
        """Free `req`'s own sliding pages that no window of it needs any more (see
        `WindowPages.droppable`), leaving tombstones."""
        assert self.window is not None
        drop = self.window.droppable(req.window_page_ids, req.num_tree_pages, req.kv_len,
                                     len(req.prompt_ids), self.role.pages_read_from(req))
        if not drop:
            return
        self.window.allocator.free([req.window_page_ids[i] for i in drop])
        for index in drop:
            req.window_page_ids[index] = None
        self.window.freed_by_window += len(drop)

    # ---- recurrent state (hybrid models; pdcache.engine.state_cache) -------------------
    def _admit_state(self, req: Req, match: MatchResult) -> bool:
        """Give admitted `req` a state slot holding the state after the hit (`match` is
        restorable: its end carries a checkpoint) and its checkpoint points; False when no
        request slot is free."""
        assert self.states is not None
        book = self.reservations
        if book is not None and self.states.free_request_slots <= len(book.reserved):
            return False  # the slots left are the reserved requests' (`ReservationBook`)
        slot = self.states.alloc_request()
        if slot is None:
            return False
        req.state_slot = slot
        if match.cached_len > 0:
            node = match.last_node
            assert node is not None and node.state_slot is not None, "hit without a state"
            self.states.pool.copy_slot(node.state_slot, slot)
            self.states.counters.checkpoints_restored += 1
        req.checkpoint_at = self._checkpoint_points(req, match) if self.tree is not None else []
        return True

    def _checkpoint_points(self, req: Req, match: MatchResult) -> list[int]:
        """Page-aligned fill lengths past the hit where `req`'s prefill stops for a
        checkpoint, by `checkpoint_policy`: hit_points, the branch point its page match
        reached beyond its deepest checkpoint and its prompt's last full page; every_page,
        every page boundary of its fill; chunk_ends, its prompt's last full page (the other
        chunk ends are taken as they come, `_after_forward`). Not where the tree has one."""
        assert self.tree is not None
        prompt_end = len(req.prompt_ids) // self.page_size * self.page_size
        if self.checkpoint_policy == "every_page":
            points = list(range(self.page_size, req.fill_len + 1, self.page_size))
        elif self.checkpoint_policy == "chunk_ends":
            points = [prompt_end]
        else:
            points = sorted({match.matched_len, prompt_end})
        return [n for n in points if match.cached_len < n <= req.fill_len
                and not self._has_checkpoint(req, n)]

    def _window_branch_point(self, req: Req, match: MatchResult) -> list[int]:
        """Window tails on lower tiers: where the admission's device page match went deeper
        than its hit (the window rule cut it) and the reused K/V (a lower tier's included)
        ends before that point, `req`'s prefill stops there once and caches its pages, so
        that the point gets its tail on device again (backed up with its node). That one
        point only: no other node end of the prompt (a host node's, a divergence inside a
        node) gets a tail here. The prompt's last full page is cached at its prefill's end
        (`commit`)."""
        prompt_end = len(req.prompt_ids) // self.page_size * self.page_size
        return [n for n in (match.matched_len,) if req.kv_len < n < prompt_end]

    def _has_checkpoint(self, req: Req, num_tokens: int) -> bool:
        assert self.tree is not None
        node = self.tree.node_at(req.fill_slice(0, num_tokens), req.salt)
        return node is not None and node.state_slot is not None

    def _after_forward(self, req: Req, mode: ForwardMode) -> None:
        """`req`'s slot now holds the state after `kv_len` tokens (its sampled token, if
        any, appended): a prefill chunk that ended at a checkpoint point (chunk_ends: at any
        page boundary) gives the tree a checkpoint; a decode step that filled a page renews
        the pending decode checkpoint (every_page: gives the tree one)."""
        if self.tree is None:
            return
        aligned = req.kv_len % self.page_size == 0
        if req.checkpoint_at and req.kv_len == req.checkpoint_at[0]:
            req.checkpoint_at.pop(0)
            self._checkpoint_now(req)
        elif (mode is ForwardMode.EXTEND and aligned and not req.prefill_done
              and self.checkpoint_policy == "chunk_ends"):
            self._checkpoint_now(req)  # a chunk's end (`_chunk_for_policy` aligned it)
        elif mode is ForwardMode.DECODE and aligned:
            if self.checkpoint_policy == "every_page":
                self._checkpoint_now(req)  # every page of the answer goes to the tree
            else:
                self._renew_pending_checkpoint(req)

    def _chunk_for_policy(self, req: Req, chunk: int) -> int:
        """`chunk` cut to its last full page under chunk_ends when the prefill goes on after
        it (vLLM's `align`: one state per chunk, at its last full block), so the state at
        its end can be checkpointed; unchanged otherwise, or when no page boundary is in it."""
        end = req.kv_len + chunk
        if (self.states is None or self.checkpoint_policy != "chunk_ends"
                or end >= req.fill_len):
            return chunk
        aligned = end // self.page_size * self.page_size - req.kv_len
        return aligned if aligned > 0 else chunk

    def _checkpoint_now(self, req: Req) -> None:
        """Cache `req`'s pages up to `kv_len` (page-aligned) and give their last node a copy
        of its state."""
        assert self.tree is not None and self.states is not None
        assert req.state_slot is not None and req.kv_len % self.page_size == 0
        self._cache_pages(req, req.kv_len // self.page_size)
        node = self.tree.node_at(req.fill_slice(0, req.kv_len), req.salt)
        if node is None or node.state_slot is not None:
            return
        slot = self._checkpoint_slot()
        if slot is None:
            return
        self.states.pool.copy_slot(req.state_slot, slot)
        self.tree.set_checkpoint(node, slot)
        # its pages reached the tiers before the checkpoint did: show them the node again
        self.tiers.on_cached(req, InsertResult([], node, 0))

    def _renew_pending_checkpoint(self, req: Req) -> None:
        assert self.states is not None and req.state_slot is not None
        if req.pending_checkpoint is None:
            req.pending_checkpoint = self._pending_checkpoint_slot()
            if req.pending_checkpoint is None:
                return
        else:
            self.states.counters.checkpoints_taken += 1  # the previous copy is overwritten
        self.states.pool.copy_slot(req.state_slot, req.pending_checkpoint)
        req.pending_checkpoint_len = req.kv_len

    def _pending_checkpoint_slot(self) -> int | None:
        """A slot for a decoding request's pending answer-end checkpoint: at most half the
        checkpoint share goes to pending ones, and none is taken from the tree (with many
        requests decoding, pending copies would otherwise push out every prompt and branch
        checkpoint the next requests hit); None (counted) when that half is used up."""
        assert self.states is not None
        holders = [*self.running, *self.held.values()]
        pending = sum(r.pending_checkpoint is not None for r in holders)
        slot = None
        if pending < max(1, self.states.checkpoint_slots // 2):
            slot = self.states.alloc_checkpoint()
        return self._counted_checkpoint(slot)

    def _checkpoint_slot(self) -> int | None:
        """A checkpoint slot, dropping the least recently used checkpoint when the share is
        used up; None (counted) when there is none to drop."""
        assert self.states is not None and self.tree is not None
        slot = self.states.alloc_checkpoint()
        if slot is None and self.tree.drop_lru_checkpoint():
            slot = self.states.alloc_checkpoint()
        return self._counted_checkpoint(slot)

    def _counted_checkpoint(self, slot: int | None) -> int | None:
        """`slot`, counted as a checkpoint taken (or, None, skipped)."""
        assert self.states is not None
        if slot is None:
            self.states.counters.checkpoints_skipped += 1
        else:
            self.states.counters.checkpoints_taken += 1
        return slot

    def _attach_pending_checkpoint(self, req: Req, num_full: int) -> RadixNode | None:
        """`req`'s pages are in the tree up to `num_full` pages: its pending decode
        checkpoint, when it is the state there, goes to that node (returned; else it is
        freed)."""
        slot, length = req.pending_checkpoint, req.pending_checkpoint_len
        if slot is None or self.tree is None or length != num_full * self.page_size:
            return None
        node = self.tree.node_at(req.fill_slice(0, length), req.salt)
        if node is not None and self.tree.set_checkpoint(node, slot):
            req.pending_checkpoint = None
            return node
        return None

    def _free_state(self, req: Req) -> None:
        """Free `req`'s state slot and pending checkpoint (exactly once: both are cleared)."""
        if self.states is None:
            return
        if req.pending_checkpoint is not None:
            self.states.free_checkpoint(req.pending_checkpoint)
        req.pending_checkpoint, req.pending_checkpoint_len = None, 0
        self._free_request_slot(req)

    def _free_request_slot(self, req: Req) -> None:
        """Free `req`'s state slot (exactly once: it is cleared); its pending checkpoint stays."""
        if self.states is None:
            return
        if req.state_slot is not None:
            self.states.free_request(req.state_slot)
        req.state_slot = None
        req.checkpoint_at = []
