"""A node's cache in simulation: pdcache's own prefix trees, eviction policies, host pool and
write policy, driven with page tokens instead of token ids.

Page tokens. A prompt's page k is named by its chained page key (`pdcache.engine.page_keys`,
the function every server computes) cut to an int (`page_tokens`). Because the keys are
chained, page k's key equal means the whole prefix up to page k is equal, so a tree of page
size 1 over page tokens matches exactly the pages a tree of page size `page_size` over token
ids matches, and holds one tree node entry per page instead of `page_size` token ids.

The device tier is the real `RadixTree` (or `HiRadixTree` with a host tier) over a real
`PageAllocator` sized by `[cache] device_pages`; the device and host eviction policies are
`pdcache.engine.eviction`'s; the write policy (write_through, write_through_selective,
write_back, the exclusive host tier) is `pdcache.offload_manager.backup.Backup` itself, with
the KV copy skipped (`NoCopy`: only its time is modelled) and its storage writes handed to
the simulated store through `Backup`'s public seam (`SimStorageWriter`, a `StorageWriter`). The host pool is a real `HostKVPool` whose pages
hold 4 bytes each (`PAGE_GEOMETRY`): its page states and pins are what the tree checks.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from pdcache.config.schema import CacheSpec
from pdcache.engine.eviction import SessionTracker, make_policy
from pdcache.engine.kv_geometry import KVGeometry
from pdcache.engine.kv_pool import PageAllocator
from pdcache.engine.radix import RadixNode, RadixTree
from pdcache.offload_manager.backup import Backup
from pdcache.offload_manager.hiradix import HiRadixTree
from pdcache.offload_manager.host_pool import HostKVPool

# The host pool's pages only need an identity: one 4-byte element each.
PAGE_GEOMETRY = KVGeometry("mha", num_layers=1, heads=1, head_dim=1, value_dim=1, dtype="float16")
PAGE_TOKEN_BYTES = 8

# (node, page tokens, origin) -> when the storage write completes; None: no storage tier
StorageWrite = Callable[[str, list[int], str], float]
Later = Callable[[float, Callable[[], None]], None]  # run an action at a simulated time


def page_tokens(keys: Sequence[bytes]) -> list[int]:
    """The page tokens of chained page keys (their first 8 bytes, little-endian)."""
    return [int.from_bytes(key[:PAGE_TOKEN_BYTES], "little") for key in keys]


class NoCopy:
    """The kernel set `Backup` copies device pages to host with: the copy is not run, its
    time is charged by the simulation."""

    def device_to_host(self, *args: Any) -> None:
        return None


class SimStorageWriter:
    """The `StorageWriter` of a simulated node: a backup's pages go to the simulated store;
    the host pages stay pinned until the simulated write completes, as the real backup IO
    thread keeps them. Owns nothing but the pins it takes."""

    def __init__(self, tree: HiRadixTree, node: str, write: StorageWrite, later: Later) -> None:
        self.tree = tree
        self.node = node
        self._store_write = write
        self._later = later

    def write_pages(self, keys: list[bytes], host_ids: list[int], namespace: str,
                    session: str) -> None:
        host_pool = self.tree.host_pool
        host_pool.pin(host_ids)
        # the backup's page keys are page tokens here (`sim_backup`'s `page_keys`)
        done_s = self._store_write(self.node, [int(k) for k in keys], "prefill")

        def done() -> None:
            host_pool.unpin(host_ids)
            self.tree.release_orphans()

        self._later(done_s, done)


def alloc_host_pages(tree: HiRadixTree, num_pages: int,
                     keep: frozenset[RadixNode]) -> list[int] | None:
    """Host pages, evicting host copies by the host policy when short (HiCache's)."""
    page_ids = tree.host_pool.alloc(num_pages)
    if page_ids is None:
        tree.evict_host(num_pages - tree.host_pool.num_free, keep)
        page_ids = tree.host_pool.alloc(num_pages)
    return page_ids


def sim_backup(tree: HiRadixTree, spec: CacheSpec, node: str, write: StorageWrite | None,
               later: Later, counts: Counter[str]) -> Backup:
    """pdcache's own `Backup` over a simulated node's tree: no KV copy (`NoCopy`), page
    tokens as page keys, storage writes to the simulated store (none without storage)."""
    writer = SimStorageWriter(tree, node, write, later) if write is not None else None
    return Backup(
        tree, torch.empty(0), NoCopy(), None, spec.write_policy, spec.write_through_threshold,
        spec.host_mode, 0, page_keys=lambda tokens, salt: list(tokens),
        alloc_host=lambda num_pages, keep: alloc_host_pages(tree, num_pages, keep),
        count=lambda **kw: counts.update(kw), storage_writer=writer)


@dataclass
class Hold:
    """What one request holds in one node's cache: the locked node, the device pages it
    uses (tree pages first), the copies of its own the tree refused (`duplicates`) and how
    many leading pages of `page_ids` the tree owns now (`inserted`)."""

    locked: RadixNode | None
    page_ids: list[int]
    duplicates: set[int] = field(default_factory=set)
    inserted: int = 0


@dataclass(frozen=True)
class Reuse:
    """The pages of a prompt found at admission: on device, then on host after them."""

    device: int
    host: int


class NodeCache:
    """One node's device (and host) tier: the real tree, allocator, policies and write policy.
    Owns them; every method runs on the simulation's single thread."""

    def __init__(self, name: str, spec: CacheSpec, host_pages: int, clock: Callable[[], float],
                 write: StorageWrite | None, later: Later, prefix_cache: bool = True) -> None:
        self.name = name
        self.spec = spec
        self.counts: Counter[str] = Counter()
        self.sessions = SessionTracker(idle_s=spec.session_idle_s, clock=clock)
        self.allocator = PageAllocator(spec.device_pages)
        policy = make_policy(spec.device_eviction, self.sessions)
        self.prefix_cache = prefix_cache
        self.backup: Backup | None = None
        self.tree: RadixTree
        if host_pages > 0:
            host_pool = HostKVPool(host_pages, PAGE_GEOMETRY, 1)
            host_policy = make_policy(spec.host_eviction, self.sessions)
            tree = HiRadixTree(1, self.allocator, host_pool, policy=policy,
                               host_policy=host_policy, sessions=self.sessions)
            self.backup = sim_backup(tree, spec, name, write, later, self.counts)
            if self.backup.writes_on_evict:
                tree.on_evict = self.backup.on_device_evict
            self.tree = tree
        else:
            self.tree = RadixTree(1, self.allocator, policy=policy, sessions=self.sessions)

    @property
    def hierarchical(self) -> bool:
        return isinstance(self.tree, HiRadixTree)

    def reserve(self, pages: Sequence[int], total_pages: int, cap: int, session_id: str,
                headroom: int = 0, new_turn: bool = True) -> tuple[Hold, Reuse] | None:
        """Lock the prompt's cached prefix and take device pages for the rest of
        `total_pages` (host-resident pages are restored into the tree); None (nothing held)
        when the pool cannot make room. `cap`: pages that may count as reused. `headroom`:
        pages that must stay obtainable beside them (the engine's `alloc_pages(reserve=)`)."""
        tree = self.tree
        match = tree.match_prefix(pages) if self.prefix_cache else None
        matched = match.page_ids if match is not None else []
        last = match.last_node if match is not None else None
        tree.lock(last)
        need = max(0, total_pages - len(matched))
        page_ids = self._alloc(need, headroom)
        if page_ids is None:
            tree.unlock(last)
            return None
        tree.note_session(last, session_id, new_turn=new_turn)
        host = 0
        if self.hierarchical and match is not None and len(matched) < cap:
            last, host = self._restore(match, pages, page_ids, cap, last)
        if new_turn and last is not None and not last.is_root:
            tree.count_hit(last)  # once per request, as `Scheduler._try_admit` counts it
        return Hold(last, matched + page_ids), Reuse(min(len(matched), cap), host)

    def _alloc(self, num_pages: int, headroom: int = 0) -> list[int] | None:
        """`num_pages` pages, evicting cache when short, leaving `headroom` more free: the
        engine's `Scheduler.alloc_pages` (pdcache/engine/scheduler.py, "memory")."""
        short = num_pages + headroom - self.allocator.num_free
        if short > 0:
            self.tree.evict(short)
        if self.allocator.num_free < num_pages + headroom:
            return None
        return self.allocator.alloc(num_pages)

    def grow(self, hold: Hold) -> bool:
        """One more page for a decoding request (it crossed a page boundary), evicting
        cache when short; False when none can be had (`_ensure_decode_page`)."""
        page = self._alloc(1)
        if page is None:
            return False
        hold.page_ids.extend(page)
        return True

    def _restore(self, match: Any, pages: Sequence[int], page_ids: list[int], cap: int,
                 locked: RadixNode | None) -> tuple[RadixNode | None, int]:
        """Host pages after the device match get device pages (the load's time is the
        caller's to charge); returns the node now locked and the pages restored."""
        tree = self.tree
        assert isinstance(tree, HiRadixTree)
        host_match = tree.match_host(match, pages, cap)
        host = host_match.num_pages
        if host == 0:
            return locked, 0
        host_ids = host_match.host_page_ids
        restored = tree.restore(host_match, page_ids[:host])
        tree.lock(restored)
        tree.unlock(locked)
        if self.spec.host_mode == "exclusive":
            self.counts["host_released_pages"] += tree.drop_host_copies(restored, host_ids)
        return restored, host

    def insert(self, hold: Hold, pages: Sequence[int], session_id: str) -> None:
        """The request's first `len(pages)` pages are computed: the tree takes them (and the
        write policy backs them up); the lock moves to the inserted path."""
        if not self.prefix_cache or not pages:
            return
        tree = self.tree
        result = tree.insert(pages, hold.page_ids[: len(pages)])
        hold.duplicates.update(result.duplicate_page_ids)
        hold.inserted = max(hold.inserted, len(pages))
        tree.lock(result.last_node)
        tree.unlock(hold.locked)
        hold.locked = result.last_node
        tree.note_session(result.last_node, session_id, new_turn=False)
        if self.backup is not None:
            self.backup.backup(pages, "", result.last_node)

    def release(self, hold: Hold) -> None:
        """The request is done here: unlock, free every page the tree did not take."""
        self.tree.unlock(hold.locked)
        hold.locked = None
        rest = [p for p in hold.page_ids[hold.inserted:] if p not in hold.duplicates]
        self.allocator.free(sorted(hold.duplicates) + rest)
        hold.page_ids, hold.duplicates = [], set()

    def check(self, idle: bool) -> None:
        """The real invariant checks of the allocator and the tree (and the host pool);
        `idle`: no request holds anything, so every used page is the tree's and unlocked."""
        self.allocator.check()
        self.tree.check()
        if isinstance(self.tree, HiRadixTree):
            self.tree.host_pool.check()
        if idle:
            assert self.tree.locked_pages == 0, f"{self.name}: pages still locked"
            assert self.allocator.num_used == self.tree.total_pages, (
                f"{self.name}: {self.allocator.num_used} pages used, the tree owns "
                f"{self.tree.total_pages}")

    def stats(self) -> dict[str, int]:
        out = {"device_pages": self.allocator.capacity, "device_used": self.allocator.num_used,
               "device_evicted_pages": self.tree.num_evicted_pages}
        if isinstance(self.tree, HiRadixTree):
            out["host_pages"] = self.tree.host_pool.capacity
            out["host_evicted_pages"] = self.tree.num_host_evicted_pages
        return {**out, **dict(sorted(self.counts.items()))}
