"""The simulation of one topology on one trace: `Simulation` builds the nodes, the router and
the store from a `Topology`, plays the trace's sessions the way `bench replay` does, and
leaves one `RequestRecord` per request.

Playing the trace. The trace is read and prepared by `bench replay`'s own code
(`prepare_trace`, `ReplayConfig`), each turn's prompt is built by its `SessionPlayer`
(history = previous prompt + the answer), the answer's ids are `BlockExpander`'s
placeholder output, and the theoretical reuse is tracked by its `ReuseTracker` at the same
moments (prompt keys at dispatch, cacheable at the first token; prompt + answer at
completion). Pacing follows `--mode`: `afap` (think times ignored), `trace` (timestamps and
think times, divided by `--speedup`), `poisson` (each turn released by a Poisson gate of
`--rate`), `poisson-sessions` (sessions start as a Poisson process); at most `--concurrency`
requests are in flight from the client, as in the replay; no request is sent after
`--max-duration` (those left are skipped, `max_duration`), and the requests in flight then run
to their end (no drain timeout). `--round-barrier` and `--stop-after-slow` are refused.

A request's life: router (admission FIFO, `PairSelector`) -> prefill node (lookup, storage
prefetch) and the decode node's page reservation (at its next step boundary), which lets the
prefill compute (the real prefill scheduler's decode-admission gate) -> chunked prefill -> KV push
(`[transfer]` cost of the pages the decode node lacks) -> decode steps -> decode write-back
(origin decode) and the router's completion. Unified nodes do both halves themselves. The
profile's `[serving]` costs sit on that path: `request_s` before the router, `handoff_s`
between the decode reservation and the prefill gate, `step_s` and the warm-ups on the nodes'
steps.
"""

from __future__ import annotations

import os
import sys
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

from pdcache.bench.replay import prepare_trace
from pdcache.bench.replay_config import ReplayConfig
from pdcache.bench.replay_records import RequestRecord
from pdcache.bench.replay_run import SessionPlayer, poisson_session_starts
from pdcache.bench.tokens import BlockExpander, ReuseTracker
from pdcache.bench.traces import Session, Trace
from pdcache.config.schema import NodeSpec, RouterSpec, Topology
from pdcache.engine.config import ModelConfig
from pdcache.engine.loader import load_model_config
from pdcache.offload_manager.host_pool import host_pages_for
from pdcache.router.policy import NodeState
from pdcache.router.route import Route
from pdcache.sim.cache import NodeCache, page_tokens
from pdcache.sim.events import EventLoop
from pdcache.sim.io import StorageIO
from pdcache.sim.nodes import Cluster, SimNode
from pdcache.sim.profile import Profile
from pdcache.sim.request import SimRequest
from pdcache.sim.router import SimRouter
from pdcache.sim.store import SimStore

ROLE_KEYS = ("prefill", "decode", "unified")  # `--set sim.ROLE=N`


def local_host_slots(node_threads: int) -> int:
    """How many nodes launched here compute at once at full speed: this host's cores over
    the torch threads each node uses (`node_threads`: the `OMP_NUM_THREADS` the caller
    launches its nodes with, given explicitly: `--node-threads`)."""
    cores = os.cpu_count() or 1
    return max(1, cores // max(1, node_threads))


@dataclass(frozen=True)
class SimOptions:
    """The simulator's own settings (the trace and pacing are the `ReplayConfig`'s)."""

    ttft_slo_s: float | None = None  # goodput counts requests with TTFT at most this
    tpot_slo_s: float | None = None  # ... and TPOT at most this
    bucket_s: float = 1.0  # storage bandwidth over time: bucket width (simulated seconds)
    shared_host_slots: int = 0  # nodes computing at once at full speed on one host (`Cluster`)
    progress: bool = False  # a throttled progress line on stderr


def scale_roles(topology: Topology, counts: dict[str, int]) -> Topology:
    """The topology with `counts[role]` nodes of each role named: the first nodes of the role
    are kept, more are copies of the first (named NAME-i)."""
    nodes = list(topology.nodes)
    for role, count in counts.items():
        of_role = [n for n in nodes if n.role == role]
        if not of_role:
            raise ValueError(f"sim.{role}={count}: the topology has no {role} node to copy")
        if count < 1:
            raise ValueError(f"sim.{role} must be >= 1, got {count}")
        template = of_role[0]
        copies = [replace(template, name=f"{template.name}-{i}")
                  for i in range(len(of_role), count)]
        keep = {id(n) for n in of_role[:count]}
        nodes = [n for n in nodes if n.role != role or id(n) in keep] + copies
    return replace(topology, nodes=tuple(nodes))


def node_host_pages(spec: NodeSpec, model: ModelConfig, page_size: int) -> int:
    """The host tier's pages of a simulated node (0: none; decode nodes and nodes without a
    prefix cache have none), sized as the node sizes its `HostKVPool`."""
    cache = spec.cache
    prefix_cache = cache.prefix_cache or spec.role == "prefill"
    if spec.role == "decode" or cache.host_pages == 0 or not prefix_cache:
        return 0
    return cache.host_pages or host_pages_for(model, page_size, cache.device_pages,
                                              cache.effective_host_ratio, cache.host_bytes or 0)


def seeded_trace_spec(spec: str, seed: int) -> str:
    """A synthetic trace spec drawn with `seed` unless it names its own seed."""
    fmt, _, rest = spec.partition(":")
    if fmt != "synthetic" or any(i.strip().startswith("seed=") for i in rest.split(",")):
        return spec
    return f"{spec},seed={seed}" if rest.strip() else f"{spec}seed={seed}"


@dataclass
class _SessionState:
    session: Session
    history: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))
    done_s: float = 0.0


class Simulation:
    """One run: owns the event loop, the nodes, the router, the store and the records."""

    def __init__(self, topology: Topology, profile: Profile, replay: ReplayConfig,
                 options: SimOptions = SimOptions()) -> None:
        self.topology = topology
        self.profile = profile
        self.options = options
        self.page_size = topology.cache.page_size
        if replay.round_barrier or replay.stop_after_slow is not None:
            raise ValueError("--round-barrier and --stop-after-slow are not simulated")
        cfg = replace(replay, page_size=self.page_size, session_prefix="")
        self.cfg = cfg.resolved()
        self.trace: Trace = prepare_trace(self.cfg)
        self.expander = BlockExpander(self.trace.block_size, vocab_high=cfg.vocab_size,
                                      vocab_low=cfg.vocab_low, seed=cfg.token_seed)
        self.player = SessionPlayer(self.expander, cfg.max_tokens_cap)
        self.tracker = ReuseTracker(self.page_size)
        self.loop = EventLoop()
        model = load_model_config(topology.model.ref, dtype=topology.model.dtype)
        self.model = model
        self.page_bytes = model.kv_geometry.page_bytes(self.page_size)
        storage = topology.storage
        self.store = SimStore(storage.capacity // self.page_bytes) if storage.enabled else None
        self.io = StorageIO(profile.storage, options.bucket_s) if storage.enabled else None
        self.cluster = Cluster(self.loop, profile, self.page_bytes, self.store, self.io,
                               self._prefill_done, self._finished, self._released,
                               shared_host_slots=options.shared_host_slots)
        self.nodes = {spec.name: SimNode(spec, self._cache_for(spec), self.cluster)
                      for spec in topology.nodes}
        states = [NodeState(n.name, n.url, n.role) for n in topology.nodes]
        self.router = SimRouter(topology.router or RouterSpec(), states, self._start,
                                self._refuse)
        self.records: list[dict[str, Any]] = []
        self.requests: list[SimRequest] = []
        self.skip_reasons: dict[str, int] = {}
        self.counts = {"sent": 0, "ok": 0, "failed": 0, "skipped": 0}
        self.stuck = 0  # requests left unfinished when no event was left (`_fail_stuck`)
        self._slots = self.cfg.concurrency
        self._slot_waiters: deque[Callable[[], None]] = deque()
        self._gate_next: float | None = None
        self._gate_rng = np.random.default_rng(self.cfg.seed)
        self._sessions = {s.session_id: _SessionState(s) for s in self.trace.sessions}
        self._progress_at = 0.0
        self._answer_keys: dict[int, list[bytes]] = {}  # id(request) -> prompt + answer keys

    # ---- building ---------------------------------------------------------------------
    def _cache_for(self, spec: NodeSpec) -> NodeCache:
        prefix_cache = spec.cache.prefix_cache or spec.role == "prefill"
        host = node_host_pages(spec, self.model, self.page_size)
        write = self.cluster.write_pages if self.store is not None else None
        return NodeCache(spec.name, spec.cache, host, self.loop.clock, write, self.loop.at,
                         prefix_cache=prefix_cache)

    # ---- pacing (the replay's modes) ---------------------------------------------------
    def _release_first(self, state: _SessionState, starts: dict[str, float]) -> None:
        turn = state.session.turns[0]
        mode = self.cfg.mode
        when = 0.0
        if mode == "trace":
            when = turn.arrival_s / self.cfg.speedup
        elif mode == "poisson-sessions":
            when = starts[state.session.session_id]
        self.loop.at(when, lambda: self._gate(state, 0))

    def _release_next(self, state: _SessionState, index: int) -> None:
        turn, mode = state.session.turns[index], self.cfg.mode
        when = self.loop.now
        if mode != "afap" and turn.dependent:
            when = state.done_s + turn.delay_s / self.cfg.speedup
        elif mode == "trace":  # a turn on the trace's clock (no history: its own timestamp)
            when = max(when, turn.arrival_s / self.cfg.speedup)
        self.loop.at(when, lambda: self._gate(state, index))

    def _gate(self, state: _SessionState, index: int) -> None:
        """The poisson mode's gate (one release per tick), then a client slot."""
        if self.cfg.mode == "poisson":
            now = self.loop.now
            tick = now if self._gate_next is None else max(self._gate_next, now)
            self._gate_next = tick + float(self._gate_rng.exponential(1.0 / (self.cfg.rate or 1)))
            self.loop.at(tick, lambda: self._acquire(lambda: self._send(state, index, tick)))
            return
        due = self.loop.now
        self._acquire(lambda: self._send(state, index, due))

    def _acquire(self, send: Callable[[], None]) -> None:
        if self._slots > 0:
            self._slots -= 1
            send()
        else:
            self._slot_waiters.append(send)

    def _free_slot(self) -> None:
        if self._slot_waiters:
            self._slot_waiters.popleft()()
        else:
            self._slots += 1

    # ---- one request ------------------------------------------------------------------
    def _send(self, state: _SessionState, index: int, due_s: float) -> None:
        """Send turn `index`, due at `due_s` (its wait for a client slot since then is the
        record's `queued_s`, as the replay records it)."""
        session, turn = state.session, state.session.turns[index]
        if self.loop.now >= self.cfg.max_duration_s:  # the replay sends nothing after it
            self._drop(session, index, "max_duration")
            self._free_slot()
            return
        built = self.player.build_prompt(turn, state.history)
        if built is None:
            self._drop(session, index, "max_tokens_cap")
            self._free_slot()
            return
        prompt, max_new = built
        now = self.loop.now
        rec = RequestRecord(turn.request_id, session.session_id, turn.turn,
                            dispatch_s=round(now, 6), prompt_tokens=len(prompt),
                            max_new_tokens=max_new,
                            new_input_tokens=turn.input_len if turn.dependent else len(prompt),
                            queued_s=round(max(0.0, now - due_s), 6))
        keys = self.tracker.keys(prompt)
        rec.theoretical_cached_tokens = self.tracker.reusable_tokens(keys, len(prompt))
        full = np.concatenate([prompt, self.expander.placeholder_output(turn.request_id,
                                                                        max_new)])
        answer_keys = self.tracker.extend_keys(keys, full[:-1])  # the last token has no KV
        state.history = full
        req = SimRequest(rec, session, index, turn, len(prompt), max_new, keys,
                         page_tokens(keys), page_tokens(answer_keys), now, self.page_size)
        self._answer_keys[id(req)] = answer_keys
        self.counts["sent"] += 1
        self.requests.append(req)
        # the serving path before the router queues it (HTTP, router hop, tokeniser): its
        # cost is the profile's `[serving] request_s`, paid by every request (work on the
        # nodes' host: slower on a busy shared one, whose cores run router, client and steps)
        self.cluster.run(self.profile.serving.request_s, lambda: self.router.submit(req))

    def _start(self, req: SimRequest, route: Route) -> None:
        if route.unified is not None:
            self.nodes[route.unified.name].submit_prefill(req)
            return
        assert route.prefill is not None and route.decode is not None
        prefill, decode = self.nodes[route.prefill.name], self.nodes[route.decode.name]
        prefill.submit_prefill(req, gated=True)
        decode.at_step_boundary(lambda: self._reserve(req, decode))

    def _reserve(self, req: SimRequest, decode: SimNode) -> None:
        """The decode node reads the request: pages reserved now, or queued until free."""
        if decode.reserve(req):
            self._open_gate(req)

    def _open_gate(self, req: SimRequest) -> None:
        """Decode reserved: its K/V request reaches the prefill node `handoff_s` later."""
        route = req.route
        assert route is not None and route.prefill is not None
        prefill = self.nodes[route.prefill.name]
        self.cluster.run(self.profile.serving.handoff_s, lambda: prefill.open_gate(req))

    def _prefill_done(self, req: SimRequest) -> None:
        self.tracker.add(req.keys)  # the prompt is cacheable once its first token exists
        route = req.route
        assert route is not None
        if route.unified is not None or self.router.settings.first_token_from_prefill:
            req.first_token_s = self.loop.now
        if route.unified is None and req.decode_hold is not None:
            self._push(req)

    def _push(self, req: SimRequest) -> None:
        """Prefill -> decode: the prompt pages the decode node lacks, at the link's pace."""
        route = req.route
        assert route is not None and route.prefill is not None and route.decode is not None
        prefill, decode = self.nodes[route.prefill.name], self.nodes[route.decode.name]
        pages = req.total_prompt_pages - req.decode_held_pages
        cost = self.profile.transfer
        done = prefill.push.occupy(self.loop.now, pages * self.page_bytes) + cost.per_room_s

        def pushed() -> None:
            assert req.prefill_hold is not None
            # the prefill engine's `release_held` -> `_release(cache=True)`: the prompt's
            # pages enter its tree once the K/V has gone
            prefill.cache.insert(req.prefill_hold, req.pages, req.session.session_id)
            prefill.cache.release(req.prefill_hold)
            self.router.release(req, route.prefill)
            decode.start_decode(req)
            self._released(prefill.name)

        self.loop.at(done, pushed)

    def _released(self, name: str) -> None:
        """Node `name` freed pages and a router slot: its waiting reservations and prefill
        admissions, and the router's queue, may go on."""
        node = self.nodes[name]
        for req in node.retry_reservations():
            self._open_gate(req)
        node.kick()
        self.router.pump()

    def _finished(self, req: SimRequest) -> None:
        now, rec = self.loop.now, req.rec
        route = req.route
        assert route is not None
        if req.first_token_s is None:
            req.first_token_s = now
        rec.ok, rec.output_tokens = True, req.max_new
        rec.ttft_s = rec.server_ttft_s = req.first_token_s - req.released_s
        rec.e2e_s = now - req.released_s
        if req.max_new > 1:
            req.tpot_s = (now - req.first_token_s) / (req.max_new - 1)
        last = route.unified or route.decode
        assert last is not None
        self.router.release(req, last)
        answer_keys = self._answer_keys.pop(id(req))
        self.router.finish(req, answer_keys)
        self.tracker.add(answer_keys)
        self.counts["ok"] += 1
        self._record(req)
        state = self._sessions[req.session.session_id]
        state.done_s = now
        self._free_slot()
        if req.index + 1 < len(req.session.turns):
            self._release_next(state, req.index + 1)

    def _refuse(self, req: SimRequest, reason: str) -> None:
        req.rec.error = f"RouterBusyError: {reason}"
        req.finished = True
        self._answer_keys.pop(id(req), None)
        self.counts["failed"] += 1
        self._record(req)
        self._free_slot()
        session = req.session
        if any(t.dependent for t in session.turns[req.index + 1:]):
            self._drop(session, req.index + 1, "parent_failed")
        elif req.index + 1 < len(session.turns):  # the session goes on, as the replay's does
            # (its later turns were neither sent nor counted: lost from every total)
            state = self._sessions[session.session_id]
            state.done_s = self.loop.now
            self._release_next(state, req.index + 1)

    def _drop(self, session: Session, index: int, reason: str) -> None:
        for _ in session.turns[index:]:
            self.counts["skipped"] += 1
            self.skip_reasons[reason] = self.skip_reasons.get(reason, 0) + 1

    def _record(self, req: SimRequest) -> None:
        row = dict(req.rec.__dict__)
        row["tpot_s"] = req.tpot_s
        self.records.append(row)

    # ---- the run ----------------------------------------------------------------------
    def run(self) -> None:
        """Play the whole trace to its end."""
        starts = (poisson_session_starts(self.trace, self.cfg.rate or 0.0, self.cfg.seed)
                  if self.cfg.mode == "poisson-sessions" else {})
        for state in self._sessions.values():
            self._release_first(state, starts)
        self.loop.run(self._progress if self.options.progress else None)
        if self.options.progress:
            self._progress(final=True)
        self._fail_stuck()

    def _fail_stuck(self) -> None:
        """Requests no event will move any more (a prompt larger than a node's device pool,
        a decode node that can never reserve it) are recorded as failed, named so."""
        for req in self.requests:
            if not req.finished:
                req.finished = True
                req.rec.error = "SimulationStuck: never got the device pages it needs"
                self.counts["failed"] += 1
                self.stuck += 1
                self._record(req)
                self._drop(req.session, req.index + 1, "parent_failed")

    def _progress(self, final: bool = False) -> None:
        """A progress line on stderr, at most one per wall-clock second (display only)."""
        if self.loop.events_run % 256 and not final:
            return
        wall = time.monotonic()
        if wall - self._progress_at < 1.0 and not final:
            return
        self._progress_at = wall
        done = self.counts["ok"] + self.counts["failed"] + self.counts["skipped"]
        end = "\n" if final else "\r"
        print(f"sim: t={self.loop.now:.1f}s  requests {done}/{self.trace.num_requests}  "
              f"events {self.loop.events_run}", end=end, file=sys.stderr, flush=True)

    def check(self) -> None:
        """After `run`: every request finished once, every node's cache passes the real
        invariant checks with nothing held."""
        assert self.stuck == 0, f"{self.stuck} request(s) never finished"
        seen = [r["request_id"] for r in self.records]
        assert len(seen) == len(set(seen)), "a request finished twice"
        assert all(req.finished for req in self.requests), "a request never finished"
        assert len(self.records) == self.counts["sent"], (len(self.records), self.counts)
        for node in self.nodes.values():
            assert not (node.ready or node.prefilling or node.decoding or node.reserving
                        or node.parked or node.reserved), (
                f"{node.name}: work left")
            node.cache.check(idle=True)
