"""Simulated nodes: a prefill, decode or unified server as one compute resource that runs one
step at a time, over its real cache (`pdcache.sim.cache.NodeCache`).

- Prefill work (prefill and unified nodes): at arrival the prompt's device + host prefix is
  looked up and the rest is looked up in the store (pages stored, or still being written:
  `pending_wait`); the stored run is read (shared store bandwidth, the node's link) and the
  request waits for it as `[cache] prefetch_policy` says (`wait_complete`: until read;
  `timeout`: at most `prefetch_timeout_s(tokens)`, else without the pages; `best_effort`:
  not at all, the pages count only if read by admission); a read whose device + host match
  shrank while the request waited restarts at the shorter match (`_restarted`). The page
  accounting is the engine's (pdcache/engine/scheduler.py; each method cites its engine
  twin): FIFO admission at every step's forming takes device pages for the fill (evicting by
  the device policy; head-of-line when none free) while keeping a page obtainable per
  decoding request, restores host pages, and charges the host -> device load of host and
  stored pages to its first chunk. Each step fills `[scheduler] chunked_prefill_tokens` with
  chunks of the admitted requests in order (at most `max_running_requests` at once). Pages
  enter the tree (the write policy backs them up) when the request releases them: a prefill
  node's after the K/V push, a unified node's at finish or retraction.
- Decode work (decode and unified nodes): each step generates one token for up to
  `max_running_requests` running requests, giving a request crossing a page boundary one more
  page; on a unified node, when none can be had, the newest running request is retracted
  (its full pages cached, re-prefilled later). A decode node reserves device pages for the
  prompt when it reads the routed request, at its next step boundary (its own prefix tree
  reused: only the pages it lacks are pushed), keeping every reserved and running request's
  answer growth obtainable (`ReservationBook`); a finished request's prompt + answer pages
  are written back to the store (origin decode) through the node's link and kept in its tree.
- Unified nodes alternate a prefill step and a decode step while both have work, as the
  engine's scheduler does.
- Every step also costs the profile's `[serving] step_s` (the engine's step loop), and a
  node's first step its warm-up (`warmup_s`; `prefill_warmup_s`, `decode_warmup_s` on
  prefill and decode nodes). A PD prompt is
  computed only once its decode node reserved its pages and asked for the K/V
  (`open_gate`): the decode node reads that request at its next step boundary
  (`at_step_boundary`), the ask reaches the prefill node `handoff_s` later.
- With `Cluster.shared_host_slots` = S > 0, every node runs on the one host the profile was
  measured on (`host.SharedHost`): S jobs run at once at full speed (its cores / the threads
  a node uses), more share the cores (processor sharing, re-shared at every start and end).
  The jobs: the nodes' steps, each request's trip to the router (`request_s`) and the
  handoff (`handoff_s`), and the router's and the client's relay of the streamed tokens
  (`relay_token_s` each).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from pdcache.config.schema import NodeSpec
from pdcache.sim.cache import Hold, NodeCache
from pdcache.sim.events import EventLoop
from pdcache.sim.host import OwnCompute, SharedHost
from pdcache.sim.io import Pipe, StorageIO
from pdcache.sim.profile import Profile
from pdcache.sim.request import SimRequest
from pdcache.sim.store import SimStore

Hook = Callable[[SimRequest], None]


@dataclass
class Cluster:
    """What every node shares: the clock, the costs, the store and the hooks back to the
    driver (`prefill_done`, `finished`, `released`: the named node let go of pages or
    slots)."""

    loop: EventLoop
    profile: Profile
    page_bytes: int
    store: SimStore | None
    io: StorageIO | None
    prefill_done: Hook
    finished: Hook
    released: Callable[[str], None]
    # every node on one host (the local topologies): how many nodes may compute at once at
    # full speed there (cores / threads per node); 0: each node has compute of its own
    shared_host_slots: int = 0
    host: SharedHost | OwnCompute = field(init=False)

    def __post_init__(self) -> None:
        self.host = (SharedHost(self.loop, self.shared_host_slots) if self.shared_host_slots
                     else OwnCompute(self.loop))

    def step_work(self, compute_s: float, first_s: float, tokens: int) -> float:
        """A step's work at full speed: its modelled compute, the step loop's cost, the
        output path of the `tokens` it streams (`[serving] token_s` each: the node's own
        process does it, between its steps) and `first_s` (the node's warm-up, on its first
        step)."""
        serving = self.profile.serving
        return compute_s + serving.step_s + tokens * serving.token_s + first_s

    def run(self, work_s: float, done: Callable[[], None] | None) -> None:
        """Run `work_s` of work on the nodes' host: shared with whatever else runs there on a
        shared host, at full speed on compute of its own."""
        self.host.run(work_s, done)

    def relay(self, tokens: int) -> None:
        """The router's and the client's work for `tokens` streamed tokens
        (`[serving] relay_token_s` each): on a shared host it takes cores from the steps;
        elsewhere the router and the clients have machines of their own."""
        if tokens and isinstance(self.host, SharedHost):
            self.host.run(tokens * self.profile.serving.relay_token_s)

    def write_pages(self, node: str, pages: list[int], origin: str) -> float:
        """Write the pages not stored yet from `node` (after their device -> host copy);
        returns when the write completes (now, when nothing needs writing)."""
        assert self.store is not None and self.io is not None
        todo = self.store.to_write(pages)
        now = self.loop.now
        if not todo:
            return now
        nbytes = len(todo) * self.page_bytes
        copied = now + nbytes / self.profile.host.d2h_bandwidth_Bps
        kind = "write_decode" if origin == "decode" else "write_prefill"
        done = self.io.transfer(now, node, nbytes, kind, not_before=copied)
        store = self.store
        store.begin_write(todo, origin, done)
        self.loop.at(done, lambda: store.end_write(todo, origin))
        return done


class SimNode:
    """One node: its cache, its queues and its compute; owns all of them."""

    def __init__(self, spec: NodeSpec, cache: NodeCache, cluster: Cluster) -> None:
        self.spec = spec
        self.name = spec.name
        self.role = spec.role
        self.cache = cache
        self.cluster = cluster
        self.loop = cluster.loop
        self.scheduler = spec.scheduler
        self.offload = spec.role == "decode" and spec.offload is not False \
            and cluster.store is not None
        self.ready: deque[SimRequest] = deque()  # prefill work, prefetched, not admitted
        self.prefilling: list[SimRequest] = []
        self.decoding: list[SimRequest] = []
        self.reserving: deque[SimRequest] = deque()  # decode: waiting for device pages
        self.parked: list[SimRequest] = []  # prefill: prefetched, waiting for decode's gate
        self.reserved: list[SimRequest] = []  # decode: pages reserved, K/V not here yet
        self.retracted = 0  # unified: requests retracted for a decode page
        self._admit_seq = 0  # admission order (retraction takes the newest)
        self._at_boundary: list[Callable[[], None]] = []  # inbox items for the next step edge
        self.push = Pipe(cluster.profile.transfer.bandwidth_Bps)  # prefill -> decode KV
        self.busy = False
        self.busy_s = 0.0
        self.prefill_steps = self.decode_steps = self.prefill_tokens = 0
        self.write_back_peak_s = 0.0  # decode: the longest a finished request's write took
        self._kick_pending = False  # a step start is scheduled for this instant (`kick`)
        self._last_was_prefill = False  # unified: the step order alternates (`_start_step`)

    # ---- prefill side -------------------------------------------------------------------
    def submit_prefill(self, req: SimRequest, gated: bool = False) -> None:
        """A routed prompt arrives: look its pages up, prefetch the stored run, queue it.
        `gated` (PD): it is computed only once `open_gate` says its decode node asked for
        the K/V, as the real prefill scheduler's decode-admission gate does."""
        req.gated = gated
        cluster, now = self.cluster, self.loop.now
        ready = now
        if cluster.store is not None and self.cache.hierarchical:
            ready = self._prefetch(req, now) + cluster.profile.storage.metadata_op_s
        req.ready_s = ready
        self.loop.at(ready, lambda: self._queue(req))

    def _queue(self, req: SimRequest) -> None:
        if req.gated:
            self.parked.append(req)  # prefetched; waits for its decode node's K/V request
            return
        self.ready.append(req)
        self.kick()

    def open_gate(self, req: SimRequest) -> None:
        """Its decode node reserved pages and asked for the K/V: the prompt may compute."""
        req.gated = False
        if req in self.parked:
            self.parked.remove(req)
            self.ready.append(req)
            self.kick()

    def _prefetch(self, req: SimRequest, now: float) -> float:
        """Start reading the stored run after the cached prefix; returns when the request
        may be scheduled under the prefetch policy."""
        cluster, cache = self.cluster, self.cache
        assert cluster.store is not None and cluster.io is not None
        cap = req.reuse_cap
        match = cache.tree.match_prefix(req.pages)
        start = len(match.page_ids)
        if cache.hierarchical and start < cap:
            start += cache.tree.match_host(match, req.pages, cap).num_pages  # type: ignore[attr-defined]
        policy = self.spec.cache.prefetch_policy
        start = min(start, cap)
        if start and policy != "best_effort" and self.spec.cache.prefetch_restarts > 0:
            req.queued_first, req.restarts_left = start, self.spec.cache.prefetch_restarts
        return self._read_stored(req, start, now, first_read=True)

    def _read_stored(self, req: SimRequest, start: int, now: float, first_read: bool) -> float:
        """Read the stored run after page `start`; returns when the request may be scheduled
        under the prefetch policy (a restarted read keeps the first read's deadline)."""
        cluster, cap = self.cluster, req.reuse_cap
        assert cluster.store is not None and cluster.io is not None
        run = cluster.store.lookup(req.pages, start, cap, now,
                                   pending=self.spec.cache.pending_wait)
        req.stored_start = req.stored_end = run.start
        if run.count == 0:
            return now
        done = cluster.io.transfer(now, self.name, run.count * cluster.page_bytes, "read",
                                   not_before=run.ready_s)
        cluster.store.touch(req.pages[run.start: run.start + run.count])
        policy = self.spec.cache.prefetch_policy
        if first_read or req.prefetch_deadline_s == float("inf"):
            req.prefetch_deadline_s = now + self.spec.cache.prefetch_timeout_s(
                run.count * req.page_size)
        deadline = req.prefetch_deadline_s
        if policy == "timeout" and done > deadline:
            req.prefetch_late = True
            return deadline  # scheduled without the pages
        req.stored_end = run.start + run.count
        req.stored_decode_flags = run.decode_flags
        if policy == "best_effort":
            req.prefetch_done_s = done
            return now
        return done

    def _next_seq(self) -> int:
        self._admit_seq += 1
        return self._admit_seq

    def _admit(self, req: SimRequest) -> bool:
        """Device pages for the prompt (its prefix locked), keeping a page free for each
        decoding request (engine `Scheduler._try_admit`: `alloc_pages(need,
        reserve=headroom)`, headroom = running requests past prefill); False when the pool
        cannot make room. A retracted request re-prefills its whole fill (`_readmit`)."""
        if req.retractions:
            return self._readmit(req)
        got = self.cache.reserve(req.pages, req.total_prompt_pages, req.reuse_cap,
                                 req.session.session_id, headroom=len(self.decoding))
        if got is None:
            return False
        hold, reuse = got
        req.prefill_hold = hold
        req.admit_seq = self._next_seq()
        covered = reuse.device + reuse.host
        stored = self._stored_pages(req, covered)
        ps, rec = req.page_size, req.rec
        rec.cached_device, rec.cached_host = reuse.device * ps, reuse.host * ps
        rec.cached_storage = stored * ps
        if stored:
            first = covered - req.stored_start
            rec.cached_storage_from_decode = ps * sum(req.stored_decode_flags[first:first + stored])
        rec.cached_tokens = (reuse.device + reuse.host + stored) * ps
        req.to_compute = req.prompt_len - rec.cached_tokens
        rec.computed_tokens = req.to_compute
        rec.prefill_node = self.name
        req.load_s = (reuse.host + stored) * self.cluster.page_bytes \
            / self.cluster.profile.host.h2d_bandwidth_Bps
        return True

    def _readmit(self, req: SimRequest) -> bool:
        """A retracted request back at the head of the queue: its fill (prompt + answer so
        far) from the tree where its retraction cached the full pages, the rest recomputed
        (engine `_try_admit` on `fill_ids[:max_reuse_len]`; its record keeps the first
        admission's cache split, as `Req.cached_len` does)."""
        ps, fill = req.page_size, req.fill_len
        cap = (fill - 1) // ps
        got = self.cache.reserve(req.answer_pages[:cap], -(-fill // ps), cap,
                                 req.session.session_id, headroom=len(self.decoding),
                                 new_turn=False)
        if got is None:
            return False
        hold, reuse = got
        req.prefill_hold = hold
        req.admit_seq = self._next_seq()
        req.to_compute = fill - (reuse.device + reuse.host) * ps
        req.computed = 0
        req.load_s = reuse.host * self.cluster.page_bytes \
            / self.cluster.profile.host.h2d_bandwidth_Bps
        return True

    def _stored_pages(self, req: SimRequest, covered: int) -> int:
        """Stored pages the request uses: those its prefetch read, right after what device
        and host cover (a gap, when tiers lost pages since, leaves the rest computed)."""
        if req.prefetch_done_s is not None and req.prefetch_done_s > self.loop.now:
            return 0  # best_effort: the read has not ended yet
        if covered < req.stored_start:
            return 0
        return max(0, min(req.stored_end, req.reuse_cap) - covered)

    def _admit_ready(self) -> None:
        """FIFO admission at every step's forming (engine `Scheduler._admit_waiting`): stops
        at `max_running_requests` running, at a chunk budget's worth of prefill pending, or
        at the first request that does not fit; skips one whose (restarted) prefetch is not
        ready."""
        limit = self.scheduler.max_running_requests
        pending = sum(req.to_compute - req.computed for req in self.prefilling)
        now = self.loop.now
        for req in list(self.ready):
            if len(self.prefilling) + len(self.decoding) >= limit:
                break
            if pending >= self.scheduler.chunked_prefill_tokens:
                break
            if req.ready_s > now:
                continue
            if self._restarted(req):
                self.loop.at(req.ready_s, self.kick)
                continue
            if not self._admit(req):
                break
            self.ready.remove(req)
            self.prefilling.append(req)
            pending += req.to_compute

    def _restarted(self, req: SimRequest) -> bool:
        """HiCache's prefetch restart (`HiCacheTiers._restarted`,
        `HiCache.restart_prefetch`): the device + host match the read was started after
        shrank while the request waited, so the read starts anew at the shorter match
        (within the first read's deadline); False (admit) when nothing shrank, no restart is
        left, the first read was late, or the new read finds nothing stored."""
        if req.restarts_left == 0 or req.retractions or not self.cache.hierarchical:
            return False
        tree, cap = self.cache.tree, req.reuse_cap
        match = tree.match_prefix(req.pages)
        first = min(len(match.page_ids), cap)
        if first < cap:
            first += tree.match_host(match, req.pages, cap).num_pages  # type: ignore[attr-defined]
        first = min(first, cap)
        if first >= req.queued_first:
            return False
        if req.restarts_left > 1 and first:
            req.queued_first, req.restarts_left = first, req.restarts_left - 1
        else:
            req.restarts_left = 0
        if req.prefetch_late:
            return False
        now = self.loop.now
        req.prefetch_done_s = None
        req.ready_s = self._read_stored(req, first, now, first_read=False)
        return req.stored_end > req.stored_start or req.ready_s > now

    def _prefill_step(self) -> tuple[float, list[tuple[SimRequest, int]]] | None:
        budget = self.scheduler.chunked_prefill_tokens
        chunks: list[tuple[SimRequest, int]] = []
        for req in self.prefilling:
            if budget <= 0:
                break
            chunk = min(req.to_compute - req.computed, budget)
            chunks.append((req, chunk))
            budget -= chunk
        if not chunks:
            return None
        tokens = sum(chunk for _, chunk in chunks)
        token_context = sum(chunk * (req.fill_len - req.to_compute + req.computed + chunk)
                            for req, chunk in chunks)
        loads = sum(req.load_s for req, _ in chunks if req.computed == 0)
        return self.cluster.profile.prefill.step_s(tokens, token_context) + loads, chunks

    def _after_prefill_step(self, chunks: list[tuple[SimRequest, int]]) -> None:
        self.prefill_steps += 1
        for req, chunk in chunks:
            req.computed += chunk
            self.prefill_tokens += chunk
            if req.computed < req.to_compute:
                continue
            self.prefilling.remove(req)
            # its pages enter the tree when it releases them (engine `_release(cache=True)`:
            # a unified node's at finish or retraction, a prefill node's after the K/V push)
            if req.generated:  # a retracted request re-prefilled: one more token sampled
                req.generated += 1
                self._continue_decode(req)
                continue
            req.prefill_done_s = self.loop.now
            self.cluster.prefill_done(req)
            if self.role == "unified":
                self.start_decode(req)

    # ---- decode side --------------------------------------------------------------------
    def at_step_boundary(self, action: Callable[[], None]) -> None:
        """Run `action` when the node's loop next reads its inbox: now when idle, else when
        the step in progress ends (before the next step forms)."""
        if self.busy:
            self._at_boundary.append(action)
        else:
            action()

    def reserve(self, req: SimRequest) -> bool:
        """Decode node: device pages for prompt + answer (its tree's prefix reused); False
        queues the request until pages free."""
        if not self.reserving and self._reserve(req):
            return True
        self.reserving.append(req)
        return False

    def _growth_pages(self, req: SimRequest) -> int:
        """Pages past the prompt's that min(max_new, `decode_reserve_tokens`) answer tokens
        need (engine `Engine.reserve_when_free`'s `growth_pages`; no context cap)."""
        answer = min(req.max_new, self.scheduler.decode_reserve_tokens)
        return -(-(req.prompt_len + answer) // req.page_size) - req.total_prompt_pages

    def _growth_headroom(self) -> int:
        """`ReservationBook.growth_headroom`: the reserved requests' growth pages and the
        pages the running ones still lack for their reserved answer tokens."""
        need = sum(self._growth_pages(req) for req in self.reserved)
        for req in self.decoding:
            assert req.decode_hold is not None
            answer = min(req.max_new, self.scheduler.decode_reserve_tokens)
            target = -(-(req.prompt_len + answer) // req.page_size)
            need += max(0, target - len(req.decode_hold.page_ids))
        return need

    def _reserve(self, req: SimRequest) -> bool:
        """The prompt's pages (its cached prefix reused), keeping every reserved and running
        request's answer growth obtainable (engine `ReservationBook._grant`)."""
        headroom = self._growth_headroom() + self._growth_pages(req)
        got = self.cache.reserve(req.pages, req.total_prompt_pages, len(req.pages),
                                 req.session.session_id, headroom=headroom)
        if got is None:
            return False
        self.reserved.append(req)
        req.decode_hold, reuse = got
        req.decode_held_pages = reuse.device
        req.rec.decode_node = self.name
        return True

    def retry_reservations(self) -> list[SimRequest]:
        """Reserve for the queued requests, in order, while pages allow; those reserved."""
        done = []
        while self.reserving and self._reserve(self.reserving[0]):
            done.append(self.reserving.popleft())
        return done

    def start_decode(self, req: SimRequest) -> None:
        """The prompt's KV is here and the first token sampled: decode the rest."""
        if req in self.reserved:  # `add_prefilled` takes the reservation
            self.reserved.remove(req)
            req.admit_seq = self._next_seq()
        req.generated = 1
        self._continue_decode(req)

    def _continue_decode(self, req: SimRequest) -> None:
        if req.generated >= req.max_new:
            self._finish(req)
            return
        self.decoding.append(req)
        self.kick()

    def _hold_of(self, req: SimRequest) -> Hold:
        hold = req.prefill_hold if self.role == "unified" else req.decode_hold
        assert hold is not None
        return hold

    def _decode_step(self) -> tuple[float, list[SimRequest]] | None:
        """One token per decoding request that has a page for it (engine `_decode_batch`)."""
        batch: list[SimRequest] = []
        running = sorted(self.decoding, key=lambda r: r.admit_seq)
        for req in running[: self.scheduler.max_running_requests]:
            if req in self.decoding and self._ensure_decode_page(req, batch):
                batch.append(req)
        if not batch:
            return None
        context = sum(req.context for req in batch)
        return self.cluster.profile.decode.step_s(len(batch), context), batch

    def _ensure_decode_page(self, req: SimRequest, batched: list[SimRequest]) -> bool:
        """A page for the K/V of position `req.kv_len` when it crossed a page boundary,
        evicting cache, else retracting the newest running request not in `batched` (engine
        `Scheduler._ensure_decode_page`); False if `req` got retracted or waits a step. A
        decode node retracts nothing here: with offload on (`DecodeRole.can_retract`) the
        engine's does not either, and without it the request waits (re-prefill on a decode
        node is not modelled)."""
        hold = self._hold_of(req)
        if req.kv_len < len(hold.page_ids) * req.page_size:
            return True
        while True:
            if self.cache.grow(hold):
                return True
            if self.role != "unified":
                return False
            victims = [r for r in self.prefilling + self.decoding if r not in batched]
            if not victims:
                return False
            victim = max(victims, key=lambda r: r.admit_seq)
            self._retract(victim)
            if victim is req:
                return False

    def _retract(self, req: SimRequest) -> None:
        """Engine `Scheduler._retract`: its computed full pages go into the tree, the rest
        is freed, and it waits at the head of the queue to re-prefill."""
        hold = req.prefill_hold
        assert hold is not None
        if req in self.prefilling:
            kv_len = req.fill_len - req.to_compute + req.computed
            self.prefilling.remove(req)
        else:
            kv_len = req.kv_len
            self.decoding.remove(req)
        self.cache.insert(hold, req.answer_pages[: kv_len // req.page_size],
                          req.session.session_id)
        self.cache.release(hold)
        req.prefill_hold = None
        req.retractions += 1
        req.computed = req.to_compute = 0
        self.retracted += 1
        self.ready.appendleft(req)

    def _after_decode_step(self, batch: list[SimRequest]) -> None:
        self.decode_steps += 1
        for req in batch:
            req.generated += 1
            if req.first_token_s is None:
                req.first_token_s = self.loop.now
            if req.generated >= req.max_new:
                self.decoding.remove(req)
                self._finish(req)

    def _finish(self, req: SimRequest) -> None:
        if self.role == "unified":
            assert req.prefill_hold is not None
            self.cache.insert(req.prefill_hold, req.answer_pages, req.session.session_id)
            self.cache.release(req.prefill_hold)
        else:
            assert req.decode_hold is not None
            if self.offload:
                done = self.cluster.write_pages(self.name, req.answer_pages, "decode")
                self.write_back_peak_s = max(self.write_back_peak_s, done - self.loop.now)
            self.cache.insert(req.decode_hold, req.answer_pages, req.session.session_id)
            self.cache.release(req.decode_hold)
        req.finished = True
        self.cluster.finished(req)
        self.cluster.released(self.name)

    # ---- the compute loop ---------------------------------------------------------------
    def kick(self) -> None:
        """Start the next step, if the node is idle and has work, once every event of this
        instant has run: a scheduler's loop takes every request that has arrived by the time
        it forms a step, so requests arriving together are batched together."""
        if self.busy or self._kick_pending:
            return
        self._kick_pending = True
        self.loop.at(self.loop.now, self._start_step)

    def _start_step(self) -> None:
        self._kick_pending = False
        if self.busy:
            return
        # the engine's `Scheduler.schedule`: admit, then a prefill step unless a decode step
        # is due after one (a unified node alternates while both have work), else a decode
        # step; a decode step with no runnable request falls back to prefill
        if self.role in ("prefill", "unified"):
            self._admit_ready()
        if self.prefilling and not (self.decoding and self._last_was_prefill):
            self._run_prefill()
            return
        if self.decoding:
            decode = self._decode_step()
            if decode is not None:
                self._last_was_prefill = False
                self._run(decode[0], lambda: self._after_decode_step(decode[1]),
                          len(decode[1]))
                return
        if self.prefilling:
            self._run_prefill()

    def _run_prefill(self) -> None:
        step = self._prefill_step()
        if step is not None:
            self._last_was_prefill = True
            first_tokens = sum(1 for req, chunk in step[1]
                               if req.computed + chunk >= req.to_compute)
            self._run(step[0], lambda: self._after_prefill_step(step[1]), first_tokens)

    def _first_step_s(self) -> float:
        """The warm-up a node's first step pays: `decode_warmup_s` on a decode node (its
        first K/V receive and decode forward), `prefill_warmup_s` on a prefill node,
        `warmup_s` on a unified one."""
        if self.prefill_steps + self.decode_steps:
            return 0.0
        serving = self.cluster.profile.serving
        if self.role == "decode":
            return serving.decode_warmup_s
        return serving.prefill_warmup if self.role == "prefill" else serving.warmup_s

    def _run(self, compute_s: float, after: Callable[[], None], tokens: int) -> None:
        cluster = self.cluster
        work = cluster.step_work(compute_s, self._first_step_s(), tokens)
        self.busy = True
        started = self.loop.now

        def end() -> None:
            self.busy_s += self.loop.now - started
            cluster.relay(tokens)
            after()  # still busy: a kick from inside `after` must not start a step
            inbox, self._at_boundary = self._at_boundary, []
            for action in inbox:
                action()
            self.busy = False
            self._start_step()  # the next step follows at once (as the scheduler's loop)

        cluster.run(work, end)

    def stats(self, duration_s: float) -> dict[str, object]:
        return {"name": self.name, "role": self.role, "busy_s": self.busy_s,
                "utilisation": self.busy_s / duration_s if duration_s else 0.0,
                "prefill_steps": self.prefill_steps, "prefill_tokens": self.prefill_tokens,
                "decode_steps": self.decode_steps, "retracted": self.retracted,
                "write_back_peak_s": self.write_back_peak_s,
                **self.cache.stats()}
