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
from pdcache.offload_manager.decode_offload import DecodeOffloadManager


class OffloadHolds(Protocol):
    """`DecodeController.hold_for_offload`: the callback that frees a held request, once."""

    def hold_for_offload(self, rid: str) -> Callable[[], None]: ...


class DecodeRole:
    """With `offload`, every tracked request's completed pages are offloaded as decoding goes,
    and a finished or aborted running request keeps its pages until the manager's copies are
    done: the manager then calls the callback `holds.hold_for_offload(rid)` returned (copy
    thread), which frees them through `Engine.release_held`. An abort never frees them.
    Holds only `offload` and `holds`."""

    takes_reservations = True

    def __init__(self, offload: DecodeOffloadManager | None, holds: OffloadHolds) -> None:
        self.offload = offload
        self.holds = holds

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
                self.offload.on_step(req.rid, req.fill_ids[: req.kv_len], req.page_ids)

    def end_session(self, session_id: str, cache_salt: str) -> bool:
        if self.offload is None:
            return False
        return self.offload.end_session(session_id, cache_salt)

    def can_retract(self, req: Req) -> bool:
        # retraction frees pages at once, but offload copies may be reading them
        return self.offload is None

    def hold_after_finish(self, req: Req) -> bool:
        if self.offload is None:
            return False
        delivery = self.offload.finish(req.rid, req.fill_ids[: req.kv_len], list(req.page_ids),
                                       self.holds.hold_for_offload(req.rid))
        if delivery is not None:  # the answer waits until prefill knows its pages are coming
            req.output_gate = delivery.add_done_callback
        return True

    def hold_on_abort(self, req: Req) -> bool:
        if self.offload is None:
            return False
        # copies of its pages may be running: hold them until the manager lets go
        self.offload.abort(req.rid, self.holds.hold_for_offload(req.rid))
        return True

    def abort_releases_held(self, req: Req) -> bool:
        return self.offload is None  # held only for offload: the copies decide
