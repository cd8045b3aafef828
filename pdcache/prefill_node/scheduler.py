"""The prefill node's scheduler: HiCache scheduling, and PD requests that stop after their
first token and keep their pages until the KV transfer to decode released them."""

from __future__ import annotations

import threading
from collections.abc import Callable

from pdcache.engine.held import HeldReleaseGuard
from pdcache.engine.request import Req
from pdcache.offload_manager.hicache_scheduler import HiCacheScheduler


class PrefillScheduler(HiCacheScheduler):
    """`expect(rid)` (any thread) marks a request as PD: when it finishes, `on_prefilled(req)`
    runs on the engine thread with its pages held; the node frees them with
    `release_guard.allow(rid)` then `Engine.release_held(rid)` once the transfer no longer
    reads them (an abort alone never frees held pages)."""

    def __init__(self, *, on_prefilled: Callable[[Req], None], **kwargs) -> None:
        super().__init__(**kwargs)
        self.on_prefilled = on_prefilled
        self._pd_rids: set[str] = set()
        self._rids_lock = threading.Lock()
        self.release_guard = HeldReleaseGuard()

    def expect(self, rid: str) -> None:
        with self._rids_lock:
            self._pd_rids.add(rid)

    def forget(self, rid: str) -> None:
        with self._rids_lock:
            self._pd_rids.discard(rid)

    def hold_after_finish(self, req: Req) -> bool:
        with self._rids_lock:
            if req.rid not in self._pd_rids:
                return False
            self._pd_rids.discard(req.rid)
        self.on_prefilled(req)
        return True

    def release_held(self, rid: str) -> bool:
        if rid in self.held and not self.release_guard.take(rid):
            return False  # the transfer may still read these pages
        return super().release_held(rid)

    def release_all_held(self) -> None:
        """Shutdown: the transfer layer is closed, nothing reads the pages any more."""
        for rid in list(self.held):
            self.release_guard.allow(rid)
            self.release_held(rid)
