"""The prefill node's role in the scheduler (`PrefillRole`, a `pdcache.engine.roles.RolePolicy`):
PD requests stop after their first token and keep their pages while the KV transfer to decode
reads them. The node composes it with HiCache's tiers (`build_tiered_engine(role=...)`).

A PD request is admitted for compute only once its decode node asked for its K/V
(`admission_ready` -> `PrefillController.decode_ready`, asked before the tiers): until then it
waits in the queue (its storage prefetch runs meanwhile) and requests behind it may go first.

Whether a finished request is held, and when its pages go, is the `PrefillController`'s
decision (`pdcache.prefill_node.controller`); this class only turns the scheduler's role
calls into its calls. Engine thread only.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from pdcache.engine.api import CachedTokens
from pdcache.engine.request import Req, pages_for
from pdcache.engine.state_cache import StateSlots
from pdcache.engine.state_pool import StateSnapshot
from pdcache.transfer.messages import PrefillReport, pack_logprobs


class PrefilledSink(Protocol):
    """`PrefillController.take_prefilled`'s side of the scheduler."""

    def take_prefilled(self, rid: str, page_ids: list[int], report: PrefillReport,
                       state: StateSnapshot | None = None,
                       window_page_ids: list[int | None] | None = None) -> bool: ...

    def decode_ready(self, rid: str) -> bool: ...


class PrefillRole:
    """A finished request is held when `pd.take_prefilled` takes its prompt pages (a PD
    request whose room is open); held pages are freed only by `Engine.release_held`, which the
    controller calls once the transfer no longer reads them — never by an abort. Takes no
    reservations. Holds `pd` and, for a hybrid model, the engine's `states` (`use_states`,
    set once the engine is built): a held request's recurrent state goes with its pages.

    The state sent is the one after the last prompt token: `hold_after_finish` runs before
    the scheduler frees the request's slot, and prefill's extend forward never feeds the
    first token it sampled (decode's first step does), so the slot holds exactly the state
    that matches the prompt K/V decode receives."""

    takes_reservations = False

    def __init__(self, pd: PrefilledSink) -> None:
        self.pd = pd
        self.states: StateSlots | None = None
        self.window_pages = False  # `use_window_pages`

    def use_window_pages(self, window_pages: bool) -> None:
        """The engine keeps window pages (its sliding layers' windows only, docs/design.md
        §4.14): a held request's sliding pages go to the sender with its pages."""
        self.window_pages = window_pages

    def use_states(self, states: StateSlots | None) -> None:
        """The engine's recurrent-state slots (None: not a hybrid model)."""
        self.states = states

    def admission_ready(self, req: Req) -> bool:
        # decode first: a request decode cannot take yet costs no compute and no pages
        return self.pd.decode_ready(req.rid)

    def can_retract(self, req: Req) -> bool:
        return True

    def pages_read_from(self, req: Req) -> int | None:
        return None  # the transfer reads a request's pages once it finished (held)

    def hold_after_finish(self, req: Req) -> bool:
        pages = req.page_ids[: pages_for(len(req.prompt_ids), req.page_size)]
        # with logprobs asked for, the first token's and the prompt's go to decode too
        first_logprob = pack_logprobs(req.output_logprobs[:1]) if req.logprobs else b""
        report = PrefillReport(req.output_ids[0], len(req.prompt_ids), req.computed_tokens,
                               req.cached or CachedTokens(), first_logprob=first_logprob,
                               input_logprobs=pack_logprobs(req.input_logprobs))
        state = self._prompt_state(req)
        if self.window_pages:  # the sender reads the window tail from the sliding pool
            return self.pd.take_prefilled(req.rid, list(pages), report,
                                          window_page_ids=req.window_page_ids[: len(pages)])
        if state is None:
            return self.pd.take_prefilled(req.rid, list(pages), report)
        return self.pd.take_prefilled(req.rid, list(pages), report, state=state)

    def _prompt_state(self, req: Req) -> StateSnapshot | None:
        """A host copy of `req`'s state after its prompt (None: not a hybrid model). A fresh
        tensor: the sender reads it until the room's release, long after the slot is freed."""
        if self.states is None or req.state_slot is None or req.kv_len != len(req.prompt_ids):
            return None  # not hybrid, or decoded past its prompt: not a PD prefill's end
        return self.states.pool.snapshot(req.state_slot)

    def hold_on_abort(self, req: Req) -> bool:
        return False

    def on_dropped(self, req: Req) -> None:
        pass

    def abort_releases_held(self, req: Req) -> bool:
        return False  # the transfer may still read them: the controller frees them

    def on_prefilled(self, req: Req) -> None:
        pass

    def after_commit(self, reqs: Sequence[Req]) -> None:
        pass

    def end_session(self, session_id: str, cache_salt: str) -> bool:
        return False
