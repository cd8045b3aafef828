"""The decode node's role in the scheduler (`DecodeRole`, a `pdcache.engine.roles.RolePolicy`):
decoding requests whose prompt K/V a prefill node wrote into reserved pages (the scheduler
keeps a reservation book), with the DecodeOffloadManager writing their pages (prompt +
answer) back to storage. The node composes it with any cache tiers (default: device only).

The offload hooks stay here because they are scheduling: which pages completed this step
(`after_commit`), whether a request may be retracted (`can_retract`) — they read the engine
thread's request state. When a held request's pages are freed is the `DecodeController`'s
decision (`hold_for_offload`), as for every other PD page of this node. Engine thread only,
except `end_session` (any thread).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Protocol

from pdcache.engine.request import Req, ReqStatus
from pdcache.engine.state_cache import StateSlots
from pdcache.engine.window_pages import WindowTails
from pdcache.offload_manager.decode_offload import AnswerState, DecodeOffloadManager


class OffloadHolds(Protocol):
    """`DecodeController.hold_for_offload`: the callback that frees a held request, once."""

    def hold_for_offload(self, rid: str) -> Callable[[], None]: ...


class DecodeRole:
    """With `offload`, every tracked request's completed pages are offloaded as decoding goes,
    and a finished or aborted running request keeps its pages until the manager's copies are
    done: the manager then calls the callback `holds.hold_for_offload(rid)` returned (copy
    thread), which frees them through `Engine.release_held`. An abort never frees them.

    A hybrid model (`states`, the engine's state slots) with offload also writes each
    finished request's answer-end state: the state after its last full page, taken from the
    scheduler's pending decode checkpoint (decode's prefix cache on: a device copy per page,
    one host copy per request) or, without a tree, from the host copy this role keeps of the
    request's state at each page it completes (`_page_states`, one per request: a host copy
    per page). With `window_tails` (window pages stored as full-layer pages plus window
    tails, docs/design.md §4.14) the answer-end "state" is the window tail at the request's
    last full page, read from its sliding pages at finish. Holds `offload`, `holds`,
    `states`, `window_tails` and `_page_states`."""

    takes_reservations = True

    def __init__(self, offload: DecodeOffloadManager | None, holds: OffloadHolds,
                 states: StateSlots | None = None,
                 window_tails: WindowTails | None = None) -> None:
        self.offload = offload
        self.holds = holds
        self.states = states if offload is not None else None
        # window pages whose stored format is full-layer pages + window tails (§4.14): the
        # answer's tail goes to storage as its end "state"
        self.window_tails = window_tails if offload is not None else None
        self._page_states: dict[str, AnswerState] = {}  # rid -> state at its last full page

    def admission_ready(self, req: Req) -> bool:
        return True

    def on_prefilled(self, req: Req) -> None:
        if self.offload is not None:
            self.offload.track(req.rid, req.salt, req.session_id)

    def after_commit(self, reqs: Sequence[Req]) -> None:
        if self.offload is None:
            return
        for req in reqs:
            # fill_ids copies the whole sequence: build it only when a page completed
            if req.status is ReqStatus.RUNNING and self.offload.due(req.rid, req.kv_len):
                self.offload.on_step(req.rid, req.fill_ids[: req.kv_len], req.page_ids,
                                     self._window_of(req))
            if self.states is not None:
                self._keep_page_state(req)

    def _keep_page_state(self, req: Req) -> None:
        """Without the scheduler's pending checkpoint (no tree), keep a host copy of the
        state of a request that just completed a page: its answer-end state, if it ends
        before the next."""
        assert self.states is not None and self.offload is not None
        if (req.status is not ReqStatus.RUNNING or req.state_slot is None or req.kv_len == 0
                or req.kv_len % self.offload.page_size or req.pending_checkpoint is not None):
            return
        self._page_states[req.rid] = AnswerState(req.kv_len,
                                                 self.states.pool.snapshot(req.state_slot))

    def _answer_state(self, req: Req) -> AnswerState | None:
        """`req`'s state after its last full page, as a host copy (None: not kept)."""
        kept = self._page_states.pop(req.rid, None)
        if self.offload is None or (self.states is None and self.window_tails is None):
            return None
        end = req.kv_len // self.offload.page_size * self.offload.page_size
        if end == 0:
            return None
        if self.window_tails is not None:  # the sliding pages a hit at `end` reads
            tail = self.window_tails.snapshot_pages(req.window_page_ids,
                                                    end // self.offload.page_size)
            return None if tail is None else AnswerState(end, tail)
        assert self.states is not None
        pool = self.states.pool
        if req.pending_checkpoint is not None and req.pending_checkpoint_len == end:
            return AnswerState(end, pool.snapshot(req.pending_checkpoint))
        if req.state_slot is not None and req.kv_len == end:
            return AnswerState(end, pool.snapshot(req.state_slot))
        return kept if kept is not None and kept.tokens == end else None

    def end_session(self, session_id: str, cache_salt: str) -> bool:
        if self.offload is None:
            return False
        return self.offload.end_session(session_id, cache_salt)

    def can_retract(self, req: Req) -> bool:
        # retraction frees pages at once: only once no offload copy reads them (never
        # retracting froze decode for good when its pages ran out past the grants' decode
        # budget: no victim, nobody finishing). Re-admitted, its later pages are offloaded
        # from where they were.
        return self.offload is None or self.offload.copies_done(req.rid)

    def pages_read_from(self, req: Req) -> int | None:
        # window pages: copies not ended yet read the sliding pages of the pages they cover
        # (a request not offloaded, e.g. a plain one sent to this node, has none; copies of
        # full-layer pages, the window-tail format, read none: its tail is read at finish)
        if (self.offload is None or self.offload.window is None
                or not self.offload.tracking(req.rid)):
            return None
        return self.offload.copied_pages(req.rid)

    def _window_of(self, req: Req) -> list[int | None] | None:
        """`req`'s sliding pages, for an offload manager over window pages (else None)."""
        assert self.offload is not None
        return None if self.offload.window is None else list(req.window_page_ids)

    def hold_after_finish(self, req: Req) -> bool:
        if self.offload is None:
            return False
        state = self._answer_state(req)  # a hybrid model's answer-end state (else None)
        extra = {} if state is None else {"state": state}
        delivery = self.offload.finish(req.rid, req.fill_ids[: req.kv_len], list(req.page_ids),
                                       self.holds.hold_for_offload(req.rid), **extra,
                                       window_page_ids=self._window_of(req))
        if delivery is not None:  # the answer waits until prefill knows its pages are coming
            req.output_gate = delivery.add_done_callback
        return True

    def on_dropped(self, req: Req) -> None:
        # aborted while waiting (retracted before): no pages, but offload still tracks it
        self._page_states.pop(req.rid, None)
        if self.offload is not None and self.offload.tracking(req.rid):
            self.offload.abort(req.rid, lambda: None)

    def hold_on_abort(self, req: Req) -> bool:
        if self.offload is None:
            return False
        # copies of its pages may be running: hold them until the manager lets go
        self._page_states.pop(req.rid, None)
        self.offload.abort(req.rid, self.holds.hold_for_offload(req.rid))
        return True

    def abort_releases_held(self, req: Req) -> bool:
        return self.offload is None  # held only for offload: the copies decide
