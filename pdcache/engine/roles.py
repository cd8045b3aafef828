"""What a node's role decides inside the scheduler: `RolePolicy`, and `Unified`, the default.

A node composes its `Scheduler` with one role policy (`Scheduler(role=...)`) and, separately,
its cache tiers (`pdcache.engine.tiers`): the prefill node's is
`pdcache.prefill_node.scheduler.PrefillRole` (finished PD requests stop after their first
token and are held for the KV transfer), the decode node's
`pdcache.decode_node.scheduler.DecodeRole` (requests start prefilled on reserved pages; with
offload their pages are written back and held until copied).

Held pages: `hold_after_finish` keeps a finished request's pages (prompt K/V, partial last
page included) and `hold_on_abort` an aborted running one's, until whoever reads them outside
the engine (a KV transfer, offload copies) calls `Engine.release_held`; `abort_releases_held`
says whether an abort of a held request frees it anyway (the default) or leaves it to that
holder.

Threads: every method runs on the engine thread, except `end_session` (any thread: it only
calls thread-safe storage).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from pdcache.engine.request import Req


class RolePolicy(Protocol):
    """The scheduler's role decisions (see the module docstring)."""

    @property
    def takes_reservations(self) -> bool:
        """Whether the scheduler keeps a reservation book (`Engine.reserve*`, decode's side
        of disaggregation)."""

    def admission_ready(self, req: Req) -> bool:
        """False keeps waiting `req` out of admission, before the tiers are asked (a request
        the role cannot take yet costs no compute, no pages, no tier restart)."""

    def can_retract(self, req: Req) -> bool:
        """False protects running `req` from retraction (something else reads its pages);
        the request short of a page then waits. Its pages the tree already had copies of
        (caching a checkpoint's pages) are then freed only with its other pages."""

    def pages_read_from(self, req: Req) -> int | None:
        """The first page of running `req` that something outside the engine may still read
        (decode offload's queued copies), None when nothing does: window pages free sliding
        pages out of the window only below it."""

    def hold_after_finish(self, req: Req) -> bool:
        """True keeps the pages of the just finished `req` (K/V of `fill_ids[:kv_len]`) until
        `release_held(req.rid)`."""

    def hold_on_abort(self, req: Req) -> bool:
        """True keeps the pages of running `req`, being aborted, until `release_held`."""

    def on_dropped(self, req: Req) -> None:
        """`req` leaves without pages: aborted while waiting (e.g. retracted before)."""

    def abort_releases_held(self, req: Req) -> bool:
        """Whether an abort of held `req` frees its pages (True) or leaves them to its
        holder's `release_held` (False)."""

    def on_prefilled(self, req: Req) -> None:
        """`req` is about to start decoding on pages a prefill node wrote."""

    def after_commit(self, reqs: Sequence[Req]) -> None:
        """A forward of `reqs` was committed (their `kv_len` advanced)."""

    def end_session(self, session_id: str, cache_salt: str) -> bool:
        """The client closed conversation `session_id`: close what the role stored of it.
        Any thread. True when it closed one."""


class Unified:
    """A unified node's role: nothing held, everything retractable, reservations taken (the
    engine's disaggregation primitives work on a unified engine too). Stateless."""

    takes_reservations = True

    def admission_ready(self, req: Req) -> bool:
        return True

    def can_retract(self, req: Req) -> bool:
        return True

    def pages_read_from(self, req: Req) -> int | None:
        return None

    def hold_after_finish(self, req: Req) -> bool:
        return False

    def hold_on_abort(self, req: Req) -> bool:
        return False

    def on_dropped(self, req: Req) -> None:
        pass

    def abort_releases_held(self, req: Req) -> bool:
        return True

    def on_prefilled(self, req: Req) -> None:
        pass

    def after_commit(self, reqs: Sequence[Req]) -> None:
        pass

    def end_session(self, session_id: str, cache_salt: str) -> bool:
        return False
