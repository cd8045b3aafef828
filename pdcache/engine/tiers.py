"""The cache tiers below the device tree, as the scheduler sees them: `CacheTiers`, and
`DeviceOnly`, the default that has none.

A node composes its `Scheduler` with one tiers object (`Scheduler(tiers=...)`); HiCache's
host + storage tiers are `pdcache.offload_manager.hicache_tiers.HiCacheTiers`. Any role
(unified, prefill, decode) may have any tiers: the role's decisions live in a separate
`RolePolicy` (`pdcache.engine.roles`).

Threads: every method runs on the engine thread (the scheduler calls them from `add`,
`schedule`, admission, caching and abort), except `start` (the thread calling
`Engine.start()`, before the engine thread runs) and `end_session` (any thread: it only
calls thread-safe storage).

Hybrid models (recurrent state, docs/design.md §4.14): tiers other than `DeviceOnly` must say
`carries_state = True` (a class attribute: they back state checkpoints up with their pages and
restore the state of their hits into `req.state_slot` in `reuse_lower_tiers`); the scheduler
refuses any others with a model's state slots. With window pages (a sliding-window model's
sliding layers in their own space) they must say `carries_window = True` (window tails backed
up and restored as checkpoints, `TierReuse.window_page_ids`) and take the scheduler's sliding
page allocator (`use_window_pages`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from pdcache.engine.api import CachedTokens
from pdcache.engine.radix import InsertResult, MatchResult, RadixNode, RadixTree
from pdcache.engine.request import KVLoad, Req


@dataclass
class TierReuse:
    """What a lower cache tier put into the pages allocated after the device match.

    The first `tree_pages` of them now belong to the tree (restored nodes; the request locks
    `node` instead of the device match's node); the next `own_pages` stay the request's own but
    hold reused K/V too. `kv_load` fills them (waited per layer by the next forward); `cached`
    splits the reused tokens by tier."""

    tree_pages: int = 0
    node: RadixNode | None = None
    own_pages: int = 0
    kv_load: KVLoad | None = None
    cached: CachedTokens | None = None
    # window pages: the request's sliding pages of all `tree_pages + own_pages` reused pages
    # (the device match's included; None: a tombstone); None: the device match's stand
    window_page_ids: list[int | None] | None = None


class CacheTiers(Protocol):
    """The scheduler's view of the tiers below the device tree (see the module docstring)."""

    def start(self) -> None:
        """Start the threads the tiers own (HiCache's IO workers); once, from
        `Engine.start()` before the engine thread."""

    def on_queued(self, req: Req) -> None:
        """`req` entered the waiting queue (start a prefetch)."""

    def admission_ready(self, req: Req) -> bool:
        """False keeps `req` waiting (others behind it may still be admitted)."""

    def reuse_lower_tiers(self, req: Req, match: MatchResult, own_page_ids: list[int],
                          max_pages: int) -> TierReuse:
        """Put reused K/V of the pages after `match` into `own_page_ids` (freshly allocated,
        in order), at most `max_pages` pages counted from the start of the fill."""

    def on_cached(self, req: Req, result: InsertResult) -> None:
        """Pages of `req` up to `result.last_node` were just inserted into the tree."""

    def on_dequeued(self, req: Req) -> None:
        """A waiting request is leaving without being admitted (abort)."""

    def on_step(self) -> None:
        """Called at the start of every `Scheduler.schedule()`."""

    def idle(self) -> bool:
        """No tier I/O is in flight (`Engine.drop_cache` waits for it)."""

    def drop(self) -> tuple[int, int]:
        """Idle engine: drop every cached page of the memory tiers; returns (device pages,
        host pages) freed."""

    def end_session(self, session_id: str, cache_salt: str) -> bool:
        """The client closed conversation `session_id` (tenant `cache_salt`): close its
        storage session. Any thread. True when a tier closed it."""


class DeviceOnly:
    """No tier below the device tree: every hook is a no-op, `drop` flushes the tree.
    Holds nothing but the tree (None without a prefix cache)."""

    def __init__(self, tree: RadixTree | None) -> None:
        self.tree = tree

    def start(self) -> None:
        pass

    def on_queued(self, req: Req) -> None:
        pass

    def admission_ready(self, req: Req) -> bool:
        return True

    def reuse_lower_tiers(self, req: Req, match: MatchResult, own_page_ids: list[int],
                          max_pages: int) -> TierReuse:
        return TierReuse()

    def on_cached(self, req: Req, result: InsertResult) -> None:
        pass

    def on_dequeued(self, req: Req) -> None:
        pass

    def on_step(self) -> None:
        pass

    def idle(self) -> bool:
        return True

    def drop(self) -> tuple[int, int]:
        return (self.tree.flush() if self.tree is not None else 0), 0

    def end_session(self, session_id: str, cache_salt: str) -> bool:
        return False
