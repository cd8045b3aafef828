"""The serving engine: one scheduler thread driving model, pool, radix tree and sampler.

The engine owns the thread loop, its inbox and the public API; the parts it drives live beside
it: the composed `Scheduler` (its cache tiers, its role policy and, for a role that takes
reservations, the `ReservationBook`), the `DecodePacer` (decode pacing and compute-share
yielding, asked before each step), request validation on the request types
(`GenerateRequest.validate`) and output building on the request (`Req.take_output`).

Threading: the public methods (`submit`, `abort`, `generate`, `stats`, `check_accounting`,
`flush_cache`, `drop_cache`, `wake`, `shutdown`, and for disaggregation `reserve`,
`reserve_when_free`, `cancel_reservation`, `release_reservation`, `submit_prefilled`,
`release_held`) may be called from any thread; they validate on the caller's thread and only
touch an inbox queue and a lock-protected snapshot, and the ones that return engine state run
on the engine thread through the inbox. Everything else (scheduler, tiers, role, reservation
book, pacer, pool, tree, runner, sampler, request state) belongs to the engine thread, which
also calls every `on_output` callback. A failure inside a step fails the requests of that
step (finish_reason "abort" with `error`), is logged and counted, and the thread keeps
running.

Driven without a thread: `start(thread=False)` starts none, and the caller runs the loop one
iteration at a time with `step()`; its own thread is then the engine thread (deterministic
scheduling for synchronous tests and tools).

Outputs: `on_output` gets one `RequestOutput` per step that produced tokens for the request,
then exactly one with `finished=True` (which carries the last tokens, if any, and the request's
statistics); concatenating every `new_token_ids` gives the whole completion. The finished
one may come from another thread: the scheduler's role can gate it (`Req.output_gate`; a decode
node's answer waits until prefill recorded its pending pages), and then it is handed over on
the thread that opens the gate (the decode transfer thread).
"""

from __future__ import annotations

import functools
import logging
import queue
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass
from typing import Any

import torch

from pdcache.engine.api import (
    CacheFlush,
    GenerateRequest,
    RequestOutput,
    TokenLogprob,
    is_token_id,
)
from pdcache.engine.config import CacheConfig, EngineConfig
from pdcache.engine.eviction import make_policy
from pdcache.engine.kv_pool import DeviceKVPool
from pdcache.engine.pacer import POLL_S, DecodePacer
from pdcache.engine.radix import RadixTree, RestoreRule, SlidingWindowRule, StateCheckpointRule
from pdcache.engine.request import OutputCallback, Req, ReqStatus, pages_for
from pdcache.engine.reservations import Admission, PendingReservation, ReservationBook
from pdcache.engine.runner import CausalLMLike, ModelRunner
from pdcache.engine.sampler import SampleRow, input_logprobs, make_generator, sample_rows
from pdcache.engine.scheduler import NO_STATE_TIERS, ScheduledBatch, Scheduler
from pdcache.engine.scheduler_config import SchedulerConfig
from pdcache.engine.state_cache import StateSlots
from pdcache.engine.state_pool import StateSnapshot
from pdcache.engine.window_pages import WindowPages, can_split, min_sliding_pages
from pdcache.kernels import KernelSet

logger = logging.getLogger(__name__)

_IDLE_WAIT_S = 0.05  # nothing to do: wait this long for the inbox (any item wakes at once)
_STALLED_WAIT_S = POLL_S  # work waits on something else (e.g. a prefetch): poll this often


class EngineOverloadedError(RuntimeError):
    """The waiting queue is full (`SchedulerConfig.max_queued_requests`), or `reserve` found no
    room; retry later."""


class EngineNotRunningError(RuntimeError):
    """`submit` on an engine that is not started or already shut down."""


@dataclass
class _Submit:
    req: Req


@dataclass
class _Reserve:
    pending: PendingReservation


@dataclass
class _CancelReservation:
    rid: str


@dataclass
class _SubmitPrefilled:
    req: Req
    first_token: int
    first_logprob: TokenLogprob | None = None
    state: StateSnapshot | None = None  # a hybrid model's recurrent state from prefill


@dataclass
class _Abort:
    rid: str


@dataclass
class _ReleaseHeld:
    rid: str


@dataclass
class _Call:
    fn: Callable[[], Any]
    future: Future


class Engine:
    """Continuous-batching engine over a paged device KV pool with a radix prefix cache.

    Owns the engine thread, its inbox, the scheduler and pacer it drives, and the snapshot
    `stats()` reads; `_lock` guards the live request ids, the pending counts, the error
    counters and the snapshot (see the module docstring for which thread calls what)."""

    def __init__(
        self,
        config: EngineConfig,
        model: CausalLMLike,
        tokenizer: Any = None,
        make_tree: Callable[..., RadixTree] | None = None,
        make_scheduler: Callable[..., Scheduler] | None = None,
        *,
        window_pages: bool = False,
    ) -> None:
        """`make_tree` builds the prefix tree over the pool (default: a device-only
        `RadixTree`); `make_scheduler` is called with `Scheduler`'s keyword arguments (config,
        cache, pool, tree, max_context, eos_token_ids) and returns the node's composed
        `Scheduler` (its `tiers` and `role`; default: `Scheduler` itself, device-only and
        unified). A hybrid model (linear layers: `ModelConfig.state_geometry`) also gets the
        recurrent-state slots (`pdcache.engine.state_cache.StateSlots`): `make_tree` is then
        called as `make_tree(pool, states=...)` and must return a tree whose hits need a state
        checkpoint (HiCache's tiers carry the checkpoints; a tree without a restore rule is
        refused). `window_pages`: a sliding-window model keeps its sliding layers' pages
        apart (§4.14) under `make_scheduler` too (a decode node: its reservations then hold
        the prompt's window tail, `Admission.window_page_ids`) and under `make_tree` (called
        `make_tree(pool, window=...)`: HiCache's tiers carry window tails,
        `build_tiered_engine(window_pages=True)`); without `make_tree` and `make_scheduler`
        it always does. Not started: call `start()`."""
        self.config = config
        self.model = model
        self.tokenizer = tokenizer
        # a sliding-window model served device-only by a unified node keeps its sliding
        # layers' pages apart and frees those out of every window (window pages, §4.14);
        # host/storage tiers and P→D nodes keep every page of every layer unless the node
        # asks (`window_pages`: a decode node, prefill then sends the window tail only; a
        # tiered unified node, its tiers then carry window tails as checkpoints)
        self.window = (_window_pages(config)
                       if window_pages or (make_tree is None and make_scheduler is None)
                       else None)
        self.pool = _device_pool(config, self.window)
        self.states = _state_slots(config)
        self.tree = _prefix_tree(config, self.pool, self.states, self.window, make_tree)
        extra: dict[str, Any] = {} if self.states is None else {"states": self.states}
        if self.window is not None:
            extra["window"] = self.window
        self.scheduler = (make_scheduler or Scheduler)(
            config=config.scheduler,
            cache=config.cache,
            pool=self.pool,
            tree=self.tree,
            max_context=config.model.max_position_embeddings,
            eos_token_ids=config.model.eos_token_ids,
            **extra,
        )
        self.kernels = KernelSet(config.kernels)  # the model's, HiCache's and offload's KV kernels
        self.runner = ModelRunner(model, self.pool, self.kernels,
                                  None if self.states is None else self.states.pool,
                                  self.window)
        self._inbox: queue.Queue = queue.Queue()
        self._lock = threading.Lock()  # guards the fields below
        self._live_rids: set[str] = set()
        self._num_pending = 0  # submitted, not yet seen by the engine thread
        self._num_waiting = 0  # in the scheduler's waiting queue (as of the last step)
        self._snapshot: dict[str, Any] = {}
        self._seed_rng = make_generator(config.seed)
        self._step_errors = 0
        self._callback_errors = 0
        self._num_steps = 0
        self._stop = threading.Event()
        # asked by the engine thread before each step (decode pacing, compute-share yielding)
        self.pacer = DecodePacer(config.scheduler, self.scheduler, self._hold_step,
                                 self._stop.is_set)
        self._thread: threading.Thread | None = None
        self._driven = False  # start(thread=False): the caller runs the loop with step()
        self._update_snapshot()

    # ---- construction ------------------------------------------------------------------
    @classmethod
    def from_spec(
        cls,
        spec: str,
        *,
        cache: CacheConfig | None = None,
        scheduler: SchedulerConfig | None = None,
        dtype: str | None = None,
        device: str = "cpu",
        seed: int = 0,
    ) -> Engine:
        """Engine over `pdcache.engine.loader.load_model(spec)` (a preset or a checkpoint
        directory); not started."""
        from pdcache.engine.loader import load_model

        model, tokenizer = load_model(spec, dtype=dtype, seed=seed, device=device)
        config = EngineConfig(
            model=model.config,
            cache=cache or CacheConfig(),
            scheduler=scheduler or SchedulerConfig(),
            device=device,
            seed=seed,
        )
        return cls(config, model, tokenizer)

    # ---- lifecycle ---------------------------------------------------------------------
    def start(self, *, thread: bool = True) -> Engine:
        """Start the scheduler's tier threads (`CacheTiers.start`), then the engine thread; with
        `thread=False` no engine thread: the caller drives the engine with `step()` (and
        `generate`, which waits for the thread, is of no use). The compute share opens here,
        for a threaded engine only (driven: never shared)."""
        if self._thread is not None or self._driven:
            raise RuntimeError("engine already started")
        self.pacer.open(threaded=thread)
        try:
            self.scheduler.tiers.start()
        except BaseException:
            self.pacer.abandon()
            raise
        if not thread:
            self._driven = True
            return self
        self._thread = threading.Thread(target=self._run, name="pdcache-engine", daemon=True)
        self._thread.start()
        return self

    def step(self) -> bool:
        """One iteration of the engine loop on the caller's thread, for an engine started with
        `start(thread=False)`: handle everything the public methods queued (submissions,
        aborts, releases), then schedule and run one batch, calling `on_output` callbacks here.
        Returns whether work is left: `while engine.step(): pass` runs everything submitted to
        the end (a step stalled on a prefetch runs no batch and returns True). Unlike the
        thread's loop it lets an exception outside a batch propagate. Raises RuntimeError on an
        engine with a thread, or not started, or shut down."""
        if self._thread is not None:
            raise RuntimeError("step(): the engine runs its own thread (start(thread=False) "
                               "for an engine the caller drives)")
        if not self._driven:
            raise RuntimeError("step(): start the engine with start(thread=False) first")
        if self._stop.is_set():
            raise RuntimeError("step(): the engine is shut down")
        self._drain_inbox(timeout=0.0)
        if self.scheduler.has_work():
            self._step()
        self._grant_pending()
        self._update_snapshot()
        return self.scheduler.has_work() or not self._inbox.empty()

    def shutdown(self, timeout: float = 10.0) -> None:
        """Stop the thread (bounded join); unfinished requests end with "abort", and every
        reserved or held page is freed (a reservation's prefix-tree pages are unlocked):
        stop whatever reads held pages (transfer, offload) first, so its last `release_held`
        calls are handled before."""
        with self._lock:
            self._stop.set()
        self._inbox.put(None)
        if self._thread is not None:
            self._thread.join(timeout)
            if self._thread.is_alive():
                logger.error("engine thread did not stop within %.1fs", timeout)
        elif self._driven:  # the caller's thread is the engine thread
            self._drain_inbox(timeout=0.0)
            self._finish_all("engine shut down")
            self._update_snapshot()

    def in_flight(self, rid: str) -> bool:
        """Whether request `rid` is submitted and not finished (queued, running), or finished
        with its pages held (decode's offload copies still read them; prefill's transfer).
        Any thread: a held rid is added before the finished one leaves `_live_rids`, so
        no moment shows neither."""
        with self._lock:
            return self._rid_taken(rid)

    def _rid_taken(self, rid: str) -> bool:
        """Under `_lock`. `scheduler.held` is the engine thread's; a dict lookup from here
        is atomic. Reusing a held rid replaced the held request in the scheduler: its
        pages leaked, and its release freed the new one's pages under its copies."""
        return rid in self._live_rids or rid in self.scheduler.held

    @property
    def is_running(self) -> bool:
        """Accepting requests: started (with a live thread, or `thread=False`), not shut down."""
        if self._stop.is_set():
            return False
        return self._driven or (self._thread is not None and self._thread.is_alive())

    def __enter__(self) -> Engine:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    # ---- public API (any thread) -------------------------------------------------------
    def submit(self, req: GenerateRequest, on_output: OutputCallback) -> None:
        """Queue `req`; `on_output` gets its outputs on the engine thread (a gated last one on
        the gate's: see Outputs above). Raises ValueError
        for an invalid request, EngineOverloadedError when the queue is full."""
        self._validate(req)
        with self._lock:  # stop is set under this lock: a request put here is always drained
            if not self.is_running:
                raise EngineNotRunningError("the engine is not running")
            if self._rid_taken(req.rid):
                raise ValueError(f"request id {req.rid!r} is already in flight")
            queued = self._num_pending + self._num_waiting
            if queued >= self.config.scheduler.max_queued_requests:
                raise EngineOverloadedError(f"engine queue is full ({queued} requests waiting)")
            self._live_rids.add(req.rid)
            self._num_pending += 1
            self._inbox.put(_Submit(self._new_req(req, on_output, self._generator_for(req))))

    def abort(self, rid: str) -> None:
        """Finish request `rid` with "abort" as soon as the engine thread sees it (no-op for an
        unknown or already finished request). Also frees pages reserved under `rid`, and those
        held under it unless the scheduler's role leaves them to their holder
        (`RolePolicy.abort_releases_held`)."""
        self._inbox.put(_Abort(rid))

    # ---- disaggregation (any thread) ---------------------------------------------------
    def reserve(self, rid: str, num_tokens: int, timeout: float = 30.0) -> list[int]:
        """Decode node: allocate the device pages a prefill node will write the K/V of
        `num_tokens` prompt tokens of `rid` into (page i holds tokens [i*S, (i+1)*S)). Raises
        EngineOverloadedError when the pool cannot provide them even after eviction; ValueError
        on an engine whose role takes no reservations."""
        if num_tokens < 1 or pages_for(num_tokens, self.pool.page_size) > self.pool.num_pages:
            raise ValueError(f"cannot reserve pages for {num_tokens} tokens")
        book = self._book()
        taken: list[bool] = []  # engine thread: whether this call's reserve took pages

        def reserve() -> list[int] | None:
            page_ids = book.reserve(rid, num_tokens)
            taken.append(page_ids is not None)
            return page_ids

        try:
            page_ids = self._call(reserve, timeout)
        except FutureTimeout:  # the builtin TimeoutError only from Python 3.11 on
            # the reserve still runs once the engine thread gets to it, and nobody would ever
            # release what it took (the caller never learnt the pages): a release is queued
            # behind it, for this call's pages only
            self._call_later(lambda: any(taken) and book.release(rid))
            raise
        if page_ids is None:
            raise EngineOverloadedError(f"no room for {num_tokens} tokens of K/V")
        return page_ids

    def reserve_when_free(self, rid: str, num_tokens: int, on_done: Callable[[Admission], None],
                          max_new_tokens: int = 0, prefix_ids: Sequence[int] = (),
                          salt: str = "") -> None:
        """Decode node: reserve the pages of `num_tokens` prompt tokens of `rid` as soon as the
        pool can give them, in arrival order behind the reservations already waiting
        (`SchedulerConfig.max_pending_reservations` of them at most). A grant also keeps back
        the pages that it and every admitted request need to decode `max_new_tokens`, so it is
        granted only when they all can finish. With a prefix tree and the prompt's
        `prefix_ids` (under tenant `salt`), its leading pages that the tree holds are reused
        (locked, never the last page: `Admission.cached_pages`) and only the rest reserved.
        `on_done(Admission)` runs exactly once, on the
        engine thread: at once (granted, or the queue is full) or when the pages free, the
        reservation is cancelled, or the engine stops; it must not block. Raises ValueError at
        once for a request that can never fit the pool or an engine whose role takes no
        reservations, EngineNotRunningError."""
        self._book()
        page_size, capacity = self.pool.page_size, self.pool.num_pages
        context = self.config.model.max_position_embeddings
        if num_tokens < 1:
            raise ValueError(f"cannot reserve pages for {num_tokens} tokens")
        # what `submit_prefilled` will accept: a whole answer that can never fit is refused now,
        # before prefill computes anything
        whole = min(num_tokens + max(max_new_tokens, 0), context)
        if pages_for(whole, page_size) > capacity:
            raise ValueError(
                f"prompt ({num_tokens} tokens) + max_new_tokens ({max_new_tokens}) needs "
                f"{pages_for(whole, page_size)} pages of K/V; this node's pool holds {capacity}"
                f" pages ({capacity * page_size} tokens)")
        growth = min(max(max_new_tokens, 0), self.config.scheduler.decode_reserve_tokens)
        total = min(num_tokens + growth, context)
        num_pages = pages_for(num_tokens, page_size)
        pending = PendingReservation(rid, num_pages, pages_for(total, page_size) - num_pages,
                                     time.monotonic(), on_done, tuple(prefix_ids), salt,
                                     num_tokens)
        with self._lock:  # as in submit: anything put here is drained, even at shutdown
            if not self.is_running:
                raise EngineNotRunningError("the engine is not running")
            self._inbox.put(_Reserve(pending))

    def cancel_reservation(self, rid: str) -> None:
        """Take `rid` out of the admission queue: its `on_done` gets "cancelled". Pages already
        granted are not touched (the grant's `on_done` came, or comes first)."""
        self._inbox.put(_CancelReservation(rid))

    def release_reservation(self, rid: str, timeout: float = 30.0) -> bool:
        """Free the pages reserved for `rid` (transfer failed); False if there were none."""
        return self._call(lambda: self.scheduler.release_reservation(rid), timeout)

    def submit_prefilled(
        self, req: GenerateRequest, first_token: int, on_output: OutputCallback, *,
        first_logprob: TokenLogprob | None = None,
        input_logprobs: list[TokenLogprob] | None = None,
        state: StateSnapshot | None = None,
    ) -> None:
        """Decode node: start decoding `req`, whose prompt K/V a prefill node wrote into the
        pages `reserve(req.rid, len(req.input_ids))` (or `reserve_when_free`) returned, after
        the tree's prefix pages of a `reserve_when_free` grant, and which sampled `first_token`.
        The first output carries `first_token`; then as `submit`. With `req.logprobs` the
        first output also carries prefill's `first_logprob` (a None logprob when prefill sent
        none) and `input_logprobs`; `req.constraint` accepts `first_token` first (a refusal
        fails the request) and the penalties count it. A request refused on the engine thread
        (no reservation, the wrong page count, another prompt or salt than its reserved
        prefix's; a hybrid model without prefill's recurrent `state` after the prompt, or
        with one of another geometry) ends with "abort" and its reservation is freed. `state`
        is read on the engine thread: the caller must not change it after this call."""
        self._validate(req)
        if not is_token_id(first_token, self.config.model.vocab_size):
            raise ValueError(f"first token {first_token!r} is not in the vocabulary")
        if first_logprob is not None and first_logprob.token_id != int(first_token):
            raise ValueError("first_logprob is not the first token's")
        with self._lock:
            if not self.is_running:
                raise EngineNotRunningError("the engine is not running")
            if self._rid_taken(req.rid):
                raise ValueError(f"request id {req.rid!r} is already in flight")
            self._live_rids.add(req.rid)
            new = self._new_req(req, on_output, self._generator_for(req))
            if req.logprobs is not None and input_logprobs is not None:
                new.input_logprobs = list(input_logprobs)
            self._inbox.put(_SubmitPrefilled(new, int(first_token), first_logprob, state))

    def release_held(self, rid: str) -> None:
        """The pages of finished request `rid`, kept by the scheduler's role
        (`hold_after_finish` or `hold_on_abort`), may go (into the prefix cache, the rest
        freed). Handled on the engine thread after everything queued before it, so a release
        sent while the request is being held (from the role's call itself) still finds it
        held."""
        self._inbox.put(_ReleaseHeld(rid))

    def wake(self) -> None:
        """Make the engine thread look at its queue now (e.g. a prefetch just finished)."""
        self._inbox.put(None)

    def stats(self) -> dict[str, Any]:
        """Counters as of the end of the last engine step (never blocks on a step)."""
        with self._lock:
            return dict(self._snapshot, queued=self._num_pending + self._num_waiting)

    def check_accounting(self, timeout: float = 30.0) -> dict[str, int]:
        """Assert page accounting (on the engine thread when running): free + used ==
        capacity and tree-held + request-held == used. Returns the numbers."""
        return self._call(self._check_accounting, timeout)

    def flush_cache(self, timeout: float = 30.0) -> int:
        """Evict every unlocked page of the prefix cache; returns the pages freed."""
        return self._call(lambda: self.tree.flush() if self.tree else 0, timeout)

    def end_session(self, session_id: str, cache_salt: str = "") -> bool:
        """The client closed conversation `session_id` (`/close_session`): the lower tiers
        and the role close its storage session (`Scheduler.end_session`). Any thread, not
        the engine thread's queue: only thread-safe storage backends are called. True when one
        did."""
        return self.scheduler.end_session(session_id, cache_salt)

    def drop_cache(self, timeout: float = 30.0) -> CacheFlush:
        """Drop every cached page of the memory tiers (the device tree and, with HiCache, the
        host copies; storage is never touched, and nothing is backed up on the way), only when
        the engine is idle: no request submitted, queued, running, held or reserved, and no
        tier I/O in flight. Otherwise nothing changes and the answer says what is busy. Runs
        on the engine thread (`_call`)."""
        return self._call(self._drop_cache, timeout)

    def generate(self, req: GenerateRequest, timeout: float = 60.0) -> list[RequestOutput]:
        """Submit and wait for the final output; on timeout aborts and raises TimeoutError."""
        outputs: list[RequestOutput] = []
        done = threading.Event()

        def collect(out: RequestOutput) -> None:
            outputs.append(out)
            if out.finished:
                done.set()

        self.submit(req, collect)
        if not done.wait(timeout):
            self.abort(req.rid)
            raise TimeoutError(f"request {req.rid} did not finish within {timeout}s")
        return outputs

    # ---- validation (caller's thread) ---------------------------------------------------
    def _validate(self, req: GenerateRequest) -> None:
        """`req.validate` against this engine's model and pool (ValueError)."""
        model = self.config.model
        req.validate(model.vocab_size, model.max_position_embeddings, self.pool.page_size,
                     self.pool.num_pages)

    def _book(self) -> ReservationBook:
        """The scheduler's reservation book; ValueError when its role takes none. Set at
        construction, never replaced: any thread."""
        book = self.scheduler.reservations
        if book is None:
            raise ValueError("this engine's role takes no reservations")
        return book

    def _generator_for(self, req: GenerateRequest) -> torch.Generator:
        seed = req.sampling.seed
        if seed is None:  # reproducible per engine seed and submission order
            seed = int(torch.randint(0, 2**62, (1,), generator=self._seed_rng))
        return make_generator(seed)

    def _new_req(
        self, req: GenerateRequest, on_output: OutputCallback, generator: torch.Generator
    ) -> Req:
        return Req(
            rid=req.rid,
            prompt_ids=[int(t) for t in req.input_ids],
            sampling=req.sampling,
            salt=req.cache_salt,
            on_output=on_output,
            generator=generator,
            page_size=self.pool.page_size,
            logprobs=req.logprobs,
            constraint=req.constraint,
            prefill_leader=req.prefill_leader,
            session_id=req.session_id,
        )

    # ---- engine thread -----------------------------------------------------------------
    def _run(self) -> None:
        logger.info("engine thread started")
        progressed = False
        while not self._stop.is_set():
            try:
                if progressed:
                    self._drain_inbox(timeout=0.0)
                    self.pacer.pace()
                else:  # idle, or stalled (e.g. no waiting request ready)
                    stalled = self.scheduler.has_work()
                    self._drain_inbox(timeout=_STALLED_WAIT_S if stalled else _IDLE_WAIT_S)
                progressed = False
                if self.scheduler.has_work() and not self._stop.is_set():
                    self.pacer.yield_to_prefill()
                self.pacer.announce()
                if self.scheduler.has_work() and not self._stop.is_set():
                    progressed = self._step()
                self._grant_pending()  # after anything that may have freed pages
            except Exception:  # never let the loop die: log, count, go on
                logger.exception("engine loop error")
                self._step_errors += 1
            self._update_snapshot()
        try:
            self._drain_inbox(timeout=0.0)
            self._finish_all("engine shut down")
        finally:
            self.pacer.close()  # nothing of a stopped engine is announced
        self._update_snapshot()
        logger.info("engine thread stopped")

    def _drain_inbox(self, timeout: float) -> None:
        try:
            item = self._inbox.get(timeout=timeout) if timeout > 0 else self._inbox.get_nowait()
        except queue.Empty:
            return
        while True:
            if item is not None:  # None only wakes the thread up
                self._handle(item)
            try:
                item = self._inbox.get_nowait()
            except queue.Empty:
                return

    def _hold_step(self, timeout: float) -> None:
        """The pacer holds the next decode step: handle the inbox for at most `timeout`, then
        grant queued reservations (requests that arrive join the held-back step, pages freed
        go to reservations at once, as after a step). Engine thread."""
        self._drain_inbox(timeout=timeout)
        self._grant_pending()

    def _handle(self, item: Any) -> None:
        if isinstance(item, _Submit):
            with self._lock:
                self._num_pending -= 1
            self.scheduler.add(item.req)
        elif isinstance(item, _SubmitPrefilled):
            self._start_prefilled(item.req, item.first_token, item.first_logprob, item.state)
        elif isinstance(item, _Abort):
            req = self.scheduler.find(item.rid)
            if req is not None:
                self._fail([req], error="aborted by client", reason="abort")
            self.scheduler.release_reservation(item.rid)
            self.scheduler.abort_held(item.rid)
            self._cancel_pending(item.rid)
        elif isinstance(item, _Reserve):
            self._queue_reservation(item.pending)
        elif isinstance(item, _CancelReservation):
            self._cancel_pending(item.rid)
        elif isinstance(item, _ReleaseHeld):
            self.scheduler.release_held(item.rid)
        elif isinstance(item, _Call):
            try:
                item.future.set_result(item.fn())
            except Exception as exc:
                item.future.set_exception(exc)

    def _step(self) -> bool:
        """Schedule and run one batch; False when there was nothing runnable."""
        batch: ScheduledBatch | None = None
        started = time.monotonic()
        try:
            batch = self.scheduler.schedule()
            if batch is None:
                return False
            self.pacer.note_batch(batch.mode, started)
            logits = self.runner.forward(batch)
            kept_rows = self.scheduler.requeue_failed_loads(batch)
            if kept_rows is not None:  # reused K/V that failed verification: rows discarded
                logits = logits[torch.tensor(kept_rows, dtype=torch.long, device=logits.device)]
            num_sampled = len(batch.sample_rows)
            self._record_input_logprobs(batch, logits[num_sampled:])
            rows = [batch.reqs[row] for row in batch.sample_rows]
            result = sample_rows(logits[:num_sampled], [self._sample_row(r) for r in rows])
            for row, error in result.errors.items():  # failed before commit: token dropped
                logger.error("sampling %s failed: %s", rows[row].rid, error)
                self._fail([rows[row]], error=error)
            self._accept(rows, result.tokens)
            touched = self.scheduler.commit(batch, result.tokens, result.logprobs)
            self._num_steps += 1
        except Exception as exc:
            logger.exception("engine step failed")
            self._step_errors += 1
            # a failed schedule() may leave any request half-done: fail them all
            victims = self._all_unfinished() if batch is None else batch.reqs
            self._fail([r for r in victims if not r.finished], error=f"engine step failed: {exc!r}")
            for req in batch.reqs if batch else []:
                if req.finished and req.finish_reason != "abort":
                    self._emit(req)  # finished by this step's commit before it failed
            return True
        self._update_snapshot()  # a client that saw its final output sees these stats too
        for req in touched:
            self._emit(req)
        return True

    def _record_input_logprobs(self, batch: ScheduledBatch, logits: torch.Tensor) -> None:
        """Prompt logprobs from the logits of `batch.logprob_spans` (row `first + i` of a span
        gives the logprob of prompt token `first + i + 1`)."""
        offset = 0
        for row, first, end in batch.logprob_spans:
            req = batch.reqs[row]
            span = logits[offset : offset + end - first]
            offset += end - first
            if req.input_logprobs is None or req.logprobs is None:
                continue
            next_ids = req.prompt_ids[first + 1 : end + 1]
            req.input_logprobs.extend(input_logprobs(span, next_ids, req.logprobs))

    def _sample_row(self, req: Req) -> SampleRow:
        """What the sampler needs of `req`; a constraint that raises or allows no token fails
        the request (aborted before commit, so its token is dropped)."""
        params = req.sampling
        allowed = None
        if req.constraint is not None and not req.finished:
            try:
                allowed = req.constraint.allowed_tokens(self.config.model.vocab_size)
                if allowed is not None and not bool(allowed.any()):
                    raise ValueError("the constraint allows no token")
            except Exception as exc:
                logger.exception("constraint of %s failed", req.rid)
                self._fail([req], error=f"constraint failed: {exc}")
                allowed = None
        stop_ids: tuple[int, ...] = ()
        if params.min_new_tokens > len(req.output_ids):
            eos = () if params.ignore_eos else self.config.model.eos_token_ids
            vocab = self.config.model.vocab_size  # a stop id outside it can never be sampled
            stop_ids = tuple(t for t in (*eos, *params.stop_token_ids) if is_token_id(t, vocab))
        return SampleRow(params, req.generator, req.output_ids, stop_ids,
                         allowed, req.logprobs)

    def _accept(self, reqs: list[Req], tokens: list[int]) -> None:
        """Advance each constraint past its sampled token; one that raises fails its request."""
        for req, token in zip(reqs, tokens):
            if req.constraint is None or req.finished:
                continue
            try:
                req.constraint.accept(token)
            except Exception as exc:
                # no traceback: the grammar (a client's schema, its tools) is in it, and logs
                # carry no request contents
                logger.warning("constraint of %s refused token %d (%s)", req.rid, token,
                               type(exc).__name__)
                self._fail([req], error=f"constraint failed: {exc}")

    def _all_unfinished(self) -> list[Req]:
        return list(self.scheduler.running) + list(self.scheduler.waiting)

    def _fail(self, reqs: list[Req], error: str, reason: str = "abort") -> None:
        for req in reqs:
            try:
                self.scheduler.abort(req, reason=reason, error=error)
            except Exception:  # accounting may be off: keep going, check_accounting tells
                logger.exception("releasing request %s failed", req.rid)
                req.status, req.finish_reason, req.error = ReqStatus.FINISHED, reason, error
            self._emit(req)

    def _finish_all(self, error: str) -> None:
        book = self.scheduler.reservations
        for rid in list(book.pending if book else ()):
            self._cancel_pending(rid, reason="shutdown")
        self._fail(self._all_unfinished(), error=error)
        for rid in list(book.reserved if book else ()):
            self.scheduler.release_reservation(rid)
        for rid in list(self.scheduler.held):
            self.scheduler.release_held(rid)

    # ---- the admission queue (engine thread; the scheduler's `ReservationBook`) -----------
    def _queue_reservation(self, pending: PendingReservation) -> None:
        if self._stop.is_set():
            self._answer(pending, Admission(pending.rid, None, "shutdown"))
            return
        admission = self._book().admit(pending)
        if admission is not None:  # None: queued, answered when granted or cancelled
            self._answer(pending, admission)

    def _grant_pending(self) -> None:
        book = self.scheduler.reservations
        if book is None or not book.pending:
            return
        for pending, admission in book.grant_queued():
            self._answer(pending, admission)

    def _cancel_pending(self, rid: str, reason: str = "cancelled") -> None:
        book = self.scheduler.reservations
        answer = book.cancel(rid, reason) if book is not None else None
        if answer is not None:
            self._answer(*answer)

    def _answer(self, pending: PendingReservation, admission: Admission) -> None:
        """Hand `admission` to the reservation's `on_done` (engine thread)."""
        try:
            pending.on_done(admission)
        except Exception:  # nobody took the pages: give them back, never leak them
            with self._lock:
                self._callback_errors += 1
            logger.exception("reservation callback of %s raised", pending.rid)
            if admission.ok:
                self.scheduler.release_reservation(pending.rid)

    def _start_prefilled(self, req: Req, first_token: int, first_logprob: TokenLogprob | None,
                         state: StateSnapshot | None = None) -> None:
        try:
            if req.constraint is not None:
                try:
                    req.constraint.accept(first_token)
                except Exception as exc:
                    self.scheduler.release_reservation(req.rid)  # nothing will decode on it
                    raise ValueError(f"constraint failed on the first token: {exc}") from exc
            self.scheduler.add_prefilled(req, first_token, first_logprob, state)
        except ValueError as exc:
            self.scheduler.release_reservation(req.rid)  # refused: its pages (if any) go back
            req.status, req.finish_reason, req.error = ReqStatus.FINISHED, "abort", str(exc)
            self.scheduler.counters.aborted += 1
        self._emit(req)

    def _emit(self, req: Req) -> None:
        output = req.take_output()
        if req.finished:
            with self._lock:
                self._live_rids.discard(req.rid)
            if req.output_gate is not None:  # the last output waits (Req.output_gate)
                gate, req.output_gate = req.output_gate, None
                gate(functools.partial(self._deliver, req, output))
                return
        if not self._deliver(req, output) and not req.finished:
            self._fail([req], error="on_output callback raised")

    def _deliver(self, req: Req, output: RequestOutput) -> bool:
        """Hand `output` to the request's callback; False when it raised (counted). Any
        thread: a gated last output is delivered on the gate's."""
        try:
            req.on_output(output)
        except Exception:
            with self._lock:  # gated outputs count from other threads
                self._callback_errors += 1
            logger.exception("on_output of request %s raised", req.rid)
            return False
        return True

    # ---- introspection (engine thread) -------------------------------------------------
    def _call(self, fn: Callable[[], Any], timeout: float) -> Any:
        """Run `fn` on the engine thread; directly when there is no live engine thread (not
        started, driven by `step()`, or stopped and joined) or when already on it. While the
        thread is stopping nothing may run beside its last drain: EngineNotRunningError.
        The check and the put share `_lock` with `shutdown`'s stop flag, so every call queued
        is handled by the thread's final drain."""
        thread = self._thread
        if thread is None or not thread.is_alive() or threading.current_thread() is thread:
            return fn()
        future: Future = Future()
        with self._lock:
            if self._stop.is_set():
                raise EngineNotRunningError("the engine is shutting down")
            self._inbox.put(_Call(fn, future))
        return future.result(timeout)

    def _call_later(self, fn: Callable[[], Any]) -> None:
        """Queue `fn` for the engine thread without waiting for it (nothing when stopping:
        the thread's last drain then runs only what was queued before)."""
        with self._lock:
            if not self._stop.is_set():
                self._inbox.put(_Call(fn, Future()))

    def _drop_cache(self) -> CacheFlush:
        scheduler = self.scheduler
        with self._lock:
            busy = len(self._live_rids)  # submitted and not finished (queued, running, held)
        busy += len(scheduler.reservations or ()) + len(scheduler.held)
        if busy:
            return CacheFlush(False, busy_requests=busy)
        if not scheduler.tiers.idle():
            return CacheFlush(False, tier_busy=True)
        device, host = scheduler.tiers.drop()
        self._update_snapshot()
        return CacheFlush(True, device_pages=device, host_pages=host)

    def _check_accounting(self) -> dict[str, int]:
        allocator = self.pool.allocator
        allocator.check()
        if self.tree is not None:
            self.tree.check()
        tree_pages = self.tree.total_pages if self.tree else 0
        scheduler = self.scheduler
        holders = scheduler.running + list(scheduler.held.values())
        request_pages = sum(r.num_own_pages for r in holders)
        if scheduler.reservations is not None:
            request_pages += scheduler.reservations.num_reserved_pages
        request_pages += sum(len(r.deferred_free_page_ids) for r in holders)
        for req in self._all_unfinished() + list(scheduler.held.values()):
            req.check()
        numbers = {
            "capacity": allocator.capacity,
            "free": allocator.num_free,
            "used": allocator.num_used,
            "tree": tree_pages,
            "requests": request_pages,
        }
        assert allocator.num_free + allocator.num_used == allocator.capacity, numbers
        assert tree_pages + request_pages == allocator.num_used, numbers
        if self.states is not None:
            running = scheduler.running
            pending = [r.pending_checkpoint for r in holders if r.pending_checkpoint is not None]
            numbers.update(self.states.check_accounting(
                [r.state_slot for r in running], pending,
                self.tree.num_checkpoints if self.tree is not None else 0))
        if self.window is not None:
            owned = [page for req in holders for page in req.own_window_page_ids]
            if scheduler.reservations is not None:  # window tails awaiting their transfer
                owned += [page for pages in scheduler.reservations.reserved_window.values()
                          for page in pages]
            numbers.update(self.window.check_accounting(
                owned, self.tree.window_pages if self.tree is not None else 0))
        return numbers

    def _update_snapshot(self) -> None:
        allocator, counters = self.pool.allocator, self.scheduler.counters
        tree, book = self.tree, self.scheduler.reservations
        snapshot = {
            "num_waiting": len(self.scheduler.waiting),
            "num_running": len(self.scheduler.running),
            "page_size": self.pool.page_size,
            "pages_total": allocator.capacity,
            "pages_free": allocator.num_free,
            "pages_used": allocator.num_used,
            "cached_pages": tree.total_pages if tree else 0,
            "pages_evictable": tree.evictable_pages if tree else 0,
            "pages_reserved": book.num_reserved_pages if book else 0,
            "reservations_pending": len(book.pending) if book else 0,
            "reservations_pending_pages": book.num_pending_pages if book else 0,
            "requests_held": len(self.scheduler.held),
            "tokens_in_cache": (tree.total_pages if tree else 0) * self.pool.page_size,
            "pages_evicted_total": tree.num_evicted_pages if tree else 0,
            "suspect_pages_dropped_total": tree.num_dropped_suspect_pages if tree else 0,
            "tokens_cached_total": counters.cached_tokens,
            "tokens_computed_total": counters.computed_tokens,
            # decode: prompt tokens whose K/V its prefix tree had (prefill wrote only the
            # rest), counted at grant (a grant freed before decoding counts too)
            "tokens_reserved_from_cache_total":
                (book.prefix_pages if book else 0) * self.pool.page_size,
            "requests_admitted_total": counters.admitted,
            "requests_finished_total": counters.finished,
            "requests_aborted_total": counters.aborted,
            "requests_retracted_total": counters.retracted,
            "steps_total": self._num_steps,
            **self.pacer.stats(),  # paced_*, yielded_*, compute_share_*
            "step_errors_total": self._step_errors,
            "callback_errors_total": self._callback_errors,
        }
        if self.states is not None:
            snapshot.update(self.states.stats(tree.num_checkpoints if tree else 0))
            limited = tree.limited_matches if tree else {}
            snapshot["prefix_hits_limited_by_state_total"] = limited.get("state", 0)
            snapshot["tokens_limited_by_state_total"] = (
                tree.limited_tokens.get("state", 0) if tree else 0)
            snapshot["state_checkpoints_evicted_total"] = (
                tree.num_evicted_checkpoints if tree else 0)
            snapshot["state_checkpoints_dropped_total"] = (
                tree.num_dropped_checkpoints if tree else 0)
        if self.window is not None:
            snapshot.update(self.window.stats(self.tree))
        with self._lock:
            self._snapshot = snapshot
            self._num_waiting = snapshot["num_waiting"]


def _device_pool(config: EngineConfig, window: WindowPages | None) -> DeviceKVPool:
    """The device KV pool: every layer's pages, or only the full layers' with window pages
    (the sliding layers then have a pool of their own, `window.pool`)."""
    cache = config.cache
    if window is not None:
        return window.full_pool(cache.num_device_pages, config.model.torch_dtype, config.device)
    return DeviceKVPool.create(config.model, cache.num_device_pages, cache.page_size,
                               config.device)


def _prefix_tree(config: EngineConfig, pool: DeviceKVPool, states: StateSlots | None,
                 window: WindowPages | None,
                 make_tree: Callable[..., RadixTree] | None) -> RadixTree | None:
    """The prefix tree over `pool` (None without a prefix cache): the device-only one, or
    `make_tree`'s, which for a hybrid model must restore its recurrent states."""
    if not config.cache.enable_prefix_cache:
        return None
    if make_tree is None:
        return _device_tree(pool, config.cache, states, window)
    if window is not None:  # its hits need the window tail: the tree carries it (HiCache's)
        return make_tree(pool, window=window)
    if states is None:
        return make_tree(pool)
    tree = make_tree(pool, states=states)
    if not tree.restore_rules or tree.checkpoints is not states:
        raise ValueError(f"{NO_STATE_TIERS}: {config.model.name} has linear-attention layers "
                         f"({states.pool.describe()}) and its tree does not restore them")
    return tree


def _device_tree(pool: DeviceKVPool, cache: CacheConfig, states: StateSlots | None,
                 window: WindowPages | None = None) -> RadixTree:
    """The device-only prefix tree, evicting by `cache.device_eviction`; with `states` (a
    hybrid model) its hits need a state checkpoint (`StateCheckpointRule`), with `window`
    (window pages) the sliding pages of the window before them (`SlidingWindowRule`)."""
    sessions = cache.make_sessions()
    policy = make_policy(cache.device_eviction, sessions)
    rules: list[RestoreRule] = [] if states is None else [StateCheckpointRule()]
    if window is not None:
        rules.append(SlidingWindowRule(window.window, pool.page_size))
    return RadixTree(pool.page_size, pool.allocator, policy=policy, sessions=sessions,
                     restore_rules=rules, checkpoints=states,
                     window_allocator=None if window is None else window.allocator)


def _window_pages(config: EngineConfig) -> WindowPages | None:
    """The sliding layers' own page space of a model mixing full and sliding layers
    (`[cache] sliding_pages`, 0: as many as the full layers'; §4.14); None for every other
    model. ValueError for a pool too small for every running request to progress."""
    geometry = config.model.kv_geometry
    if not can_split(geometry):
        return None
    cache, scheduler = config.cache, config.scheduler
    num_pages = cache.sliding_pages or cache.num_device_pages
    floor = min_sliding_pages(geometry.sliding_window, cache.page_size,
                              scheduler.max_running_requests, scheduler.chunked_prefill_tokens)
    # as many as the full layers' never run short first (a request's and the tree's
    # sliding pages are among their full pages); a smaller pool must let everyone progress
    if cache.sliding_pages and num_pages < floor:
        raise ValueError(
            f"[cache] sliding_pages = {num_pages} is too small for this model's window of "
            f"{geometry.sliding_window} tokens: at least {floor} (max_running_requests "
            f"{scheduler.max_running_requests} x (2 window tails + 2 pages) + one chunk of "
            f"{scheduler.chunked_prefill_tokens} tokens)")
    return WindowPages(geometry, num_pages, cache.page_size, config.model.torch_dtype,
                       config.device)


def _state_slots(config: EngineConfig) -> StateSlots | None:
    """A hybrid model's state slots: one per running request plus the checkpoints' share
    (`CacheConfig.state_checkpoint_slots`, none without a prefix cache); None otherwise."""
    geometry = config.model.state_geometry
    if geometry is None:
        return None
    cache = config.cache
    checkpoints = cache.state_checkpoint_slots if cache.enable_prefix_cache else 0
    return StateSlots.create(geometry, config.scheduler.max_running_requests, checkpoints,
                             config.device)
