"""The decode node's scheduler: decoding requests whose prompt K/V a prefill node wrote, with
the DecodeOffloadManager writing their pages (prompt + answer) back to storage."""

from __future__ import annotations

from collections.abc import Callable

from pdcache.engine.held import HeldReleaseGuard
from pdcache.engine.request import Req, ReqStatus
from pdcache.engine.scheduler import ScheduledBatch, Scheduler
from pdcache.offload_manager.decode_offload import DecodeOffloadManager


class DecodeScheduler(Scheduler):
    """With `offload`, every tracked request's completed pages are offloaded as decoding goes,
    and a finished or aborted request keeps its pages until the manager's copies are done
    (`release(rid)` is then called from the copy thread; the node turns it into
    `Engine.release_held`)."""

    def __init__(self, *, offload: DecodeOffloadManager | None,
                 release: Callable[[str], None], **kwargs) -> None:
        super().__init__(**kwargs)
        self.offload = offload
        self.release = release
        self.release_guard = HeldReleaseGuard()

    def add_prefilled(self, req: Req, first_token: int) -> None:
        if self.offload is not None:
            self.offload.track(req.rid, req.salt)
        super().add_prefilled(req, first_token)

    def commit(self, batch: ScheduledBatch, tokens: list[int]) -> list[Req]:
        touched = super().commit(batch, tokens)
        if self.offload is not None:
            for req in batch.reqs:
                # fill_ids copies the whole sequence: build it only when a page completed
                if req.status is ReqStatus.RUNNING and self.offload.due(req.rid, req.kv_len):
                    self.offload.on_step(req.rid, req.fill_ids[: req.kv_len], req.page_ids)
        return touched

    def can_retract(self, req: Req) -> bool:
        # retraction frees pages at once, but offload copies may be reading them
        return self.offload is None

    def hold_after_finish(self, req: Req) -> bool:
        if self.offload is None:
            return False
        self.offload.finish(req.rid, req.fill_ids[: req.kv_len], list(req.page_ids),
                            self._releaser(req.rid))
        return True

    def abort(self, req: Req, reason: str = "abort", error: str | None = None) -> None:
        if self.offload is None or req.status is not ReqStatus.RUNNING:
            super().abort(req, reason, error)
            return
        # copies of its pages may be running: hold them until the manager lets go
        self.running.remove(req)
        req.status, req.finish_reason, req.error = ReqStatus.FINISHED, reason, error
        req.holding_pages = True
        self.held[req.rid] = req
        self.counters.aborted += 1
        self.offload.abort(req.rid, self._releaser(req.rid))

    def release_held(self, rid: str) -> bool:
        if self.offload is not None and rid in self.held and not self.release_guard.take(rid):
            return False  # offload copies may still read these pages
        return super().release_held(rid)

    def release_all_held(self) -> None:
        for rid in list(self.held):
            self.release_guard.allow(rid)
            super().release_held(rid)

    def _releaser(self, rid: str) -> Callable[[], None]:
        def released() -> None:
            self.release_guard.allow(rid)
            self.release(rid)

        return released
