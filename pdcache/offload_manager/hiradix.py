"""The radix tree of the hierarchical cache: device residency plus host residency per node.

Extends the device tree (`pdcache.engine.radix`): a node may lose its device pages and live on
with a host copy (host-only); such nodes hang below the on-device top of the tree. Matching
continues past the device part through host-only nodes; restoring loads them back on device.
Host eviction ranks host leaves by `host_policy` (`pdcache.engine.eviction`; LRU by default)
and never touches a node whose host pages are pinned
(being loaded to device or written to storage).

Hybrid models (docs/design.md §4.14): with `host_states` a node's host copy may carry the
state checkpoint (window pages: the window tail, `WindowTails`) after its last token (`RadixNode.host_state_slot`, a `HostStatePool` slot the
tree owns; only on a node with host pages, so it leaves exactly when they do: host eviction,
an exclusive tier's release after a load, a dropped sub-tree; a slot a storage write still
pins is orphaned and freed once unpinned, like host pages). The host continuation of a match
then ends at the deepest host node carrying one (every layer kind restorable there).

Threading: like the base tree, engine thread only. Host pages are freed through the
`HostKVPool`, which is thread-safe.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Sequence
from dataclasses import dataclass, field

from pdcache.engine.eviction import EvictionPolicy, EvictKey, LruPolicy, SessionTracker
from pdcache.engine.kv_pool import PageAllocator
from pdcache.engine.radix import (
    CheckpointSlots,
    EvictCallback,
    MatchResult,
    RadixNode,
    RadixTree,
    RestoreRule,
)
from pdcache.offload_manager.host_pool import HostKVPool
from pdcache.offload_manager.host_state_pool import HostStatePool


@dataclass
class HostMatch:
    """Host-only continuation of a device match: `(node, pages matched in it)` in path order."""

    nodes: list[tuple[RadixNode, int]] = field(default_factory=list)

    @property
    def num_pages(self) -> int:
        return sum(n for _, n in self.nodes)

    @property
    def host_page_ids(self) -> list[int]:
        return [p for node, n in self.nodes for p in node.host_page_ids[:n]]


class HiRadixTree(RadixTree):
    """Radix tree whose nodes may be on device, on host, or both."""

    def __init__(self, page_size: int, allocator: PageAllocator, host_pool: HostKVPool,
                 on_evict: EvictCallback | None = None, policy: EvictionPolicy | None = None,
                 host_policy: EvictionPolicy | None = None,
                 sessions: SessionTracker | None = None, *,
                 restore_rules: Sequence[RestoreRule] = (),
                 checkpoints: CheckpointSlots | None = None,
                 host_states: HostStatePool | None = None,
                 window_allocator: PageAllocator | None = None) -> None:
        super().__init__(page_size, allocator, on_evict, policy, sessions,
                         restore_rules=restore_rules, checkpoints=checkpoints,
                         window_allocator=window_allocator)
        self.host_pool = host_pool
        self.host_states = host_states  # hybrid models: host copies of state checkpoints
        self._state_orphans: list[int] = []  # host state slots a storage write still pins
        self.num_host_evicted_states = 0
        self.host_policy: EvictionPolicy = host_policy or LruPolicy()
        # host pages of nodes cut off from the tree while a storage write still read them
        self._orphans: list[int] = []
        self._in_device_pass = False  # inside `evict`: host evictions share `_pass_heap`
        self._pass_heap: _HostHeap | None = None
        self.num_host_evicted_pages = 0

    # ---- matching ----------------------------------------------------------------------
    def match_host(self, device: MatchResult, token_ids: Sequence[int], max_pages: int) -> HostMatch:
        """Host-only pages that continue `device` (a `match_prefix` result), up to `max_pages`
        pages in total. Read-only."""
        match = HostMatch()
        node, done = device.last_node, len(device.page_ids)
        if node is None or done >= max_pages or not self._fully_matched(node, done):
            return match
        tokens = tuple(token_ids)
        while done < max_pages:
            child = node.children.get(self._page_at(tokens, done))
            if child is None or child.on_device or child.host_page_ids is None:
                break
            matched = self._count_matching_pages(child.key, tokens, done, max_pages - done)
            if matched == 0:
                break
            match.nodes.append((child, matched))
            node, done = child, done + matched
            if matched < child.num_pages:
                break
        if self.host_states is not None:
            self._cut_to_host_checkpoint(match)
        return match

    def _cut_to_host_checkpoint(self, match: HostMatch) -> None:
        """Hybrid models: the host continuation ends at its deepest node end carrying a host
        state checkpoint (the linear layers restore only there); nothing without one."""
        while match.nodes:
            node, matched = match.nodes[-1]
            if matched == node.num_pages and node.host_state_slot is not None:
                return
            match.nodes.pop()

    def restore(self, match: HostMatch, device_page_ids: Sequence[int]) -> RadixNode | None:
        """Give the matched host-only nodes device pages (already filled, or being filled, by
        the caller's host → device load); returns the deepest restored node (lock it)."""
        offset, last = 0, None
        for node, matched in match.nodes:
            if matched < node.num_pages:
                node = self._split(node, matched)
            node.device_page_ids = list(device_page_ids[offset : offset + matched])
            # its sliding pages come later (a window tail, `WindowTails.fill`), if at all
            node.window_page_ids = self.tombstones(matched)
            self._device_pages += matched
            offset, last = offset + matched, node
        if last is not None:
            self._note_leaf(last)  # on device again; the restored ones above it are not leaves
        return last

    # ---- host eviction -----------------------------------------------------------------
    @property
    def host_pages(self) -> int:
        return sum(len(n.host_page_ids) for n in self._iter_nodes() if n.host_page_ids is not None)

    def evict(self, num_pages: int) -> int:
        """Device eviction (`RadixTree.evict`). The host evictions its victims trigger (the
        exclusive host tier) share one ranked heap of host leaves for the whole pass, instead
        of a tree scan per victim; victims admitted to host during the pass are not evicted
        from host in the same pass."""
        self._in_device_pass, self._pass_heap = True, None
        try:
            return super().evict(num_pages)
        finally:
            self._in_device_pass, self._pass_heap = False, None

    def evict_host(self, num_pages: int, keep: frozenset[RadixNode] = frozenset()) -> int:
        """Free host copies of host leaves (skipping pinned ones and those of `keep`), in
        `host_policy` order, until `num_pages` are freed or none is left; host-only nodes
        without children disappear."""
        if num_pages <= 0:
            return 0
        heap = self._host_heap(keep)
        freed = 0
        while freed < num_pages:
            node = heap.pop_valid(keep)
            if node is None:
                break
            parent = node.parent
            freed += self._drop_host(node)
            if (parent is not None and not parent.is_root and parent not in keep
                    and self._host_evictable(parent)):
                heap.push(parent)
        return freed

    def _host_heap(self, keep: frozenset[RadixNode]) -> _HostHeap:
        if not self._in_device_pass or keep:
            return _HostHeap(self, keep)
        if self._pass_heap is None:
            self._pass_heap = _HostHeap(self, keep)
        return self._pass_heap

    def release_orphans(self) -> int:
        """Free the orphaned host pages (`_on_device_evicted`) no storage write pins any
        more; returns how many."""
        before = len(self._orphans)
        self._orphans = self.host_pool.free_unpinned(self._orphans)
        freed = before - len(self._orphans)
        if self.host_states is not None and self._state_orphans:
            states = self.host_states
            for slot in [s for s in self._state_orphans if not states.is_pinned(s)]:
                states.free(slot)
                self._state_orphans.remove(slot)
        return freed

    # ---- host state checkpoints (hybrid models) ----------------------------------------
    @property
    def num_orphan_states(self) -> int:
        return len(self._state_orphans)

    def host_checkpoints(self) -> int:
        """Host state slots the tree's nodes hold."""
        return sum(1 for n in self._iter_nodes() if n.host_state_slot is not None)

    def set_host_checkpoint(self, node: RadixNode, slot: int) -> None:
        """`slot` (held in `host_states`) is `node`'s host checkpoint now; the tree owns it."""
        assert node.host_page_ids is not None and node.host_state_slot is None, \
            "a host checkpoint needs a node with host pages and none yet"
        node.host_state_slot = slot

    def drop_lru_host_checkpoint(self, keep: frozenset[RadixNode] = frozenset()) -> bool:
        """Free the least recently used host checkpoint no storage write pins (its node and
        pages stay); False when there is none."""
        assert self.host_states is not None
        states = self.host_states
        holders = [n for n in self._iter_nodes() if n.host_state_slot is not None
                   and n not in keep and not states.is_pinned(n.host_state_slot)]
        if not holders:
            return False
        self._free_host_state(min(holders, key=lambda n: n.last_access))
        self.num_host_evicted_states += 1
        return True

    def _free_host_state(self, node: RadixNode) -> None:
        """Free `node`'s host checkpoint exactly once (orphaned while a write pins it)."""
        slot, node.host_state_slot = node.host_state_slot, None
        if slot is None:
            return
        assert self.host_states is not None
        if self.host_states.is_pinned(slot):
            self._state_orphans.append(slot)
        else:
            self.host_states.free(slot)

    @property
    def num_orphan_pages(self) -> int:
        return len(self._orphans)

    def host_ownership(self) -> tuple[int, int]:
        """(host pages the tree's nodes hold, how many of those are pinned). Engine thread; a
        metrics scrape may call it racily (`HiCache.snapshot` retries a torn walk)."""
        owned = pinned = 0
        for node in self._iter_nodes():
            ids = node.host_page_ids
            if ids is not None:
                owned += len(ids)
                pinned += sum(1 for p in ids if self.host_pool.is_pinned(p))
        return owned, pinned

    def host_admits(self, victim: RadixNode, num_pages: int) -> bool:
        """Exclusive host tier: whether a device victim is worth `num_pages` host pages, i.e.
        there is room, or some host leaf ranks below it under `host_policy` (it would be
        evicted to make room) - a victim that would be the host's first eviction is dropped. A
        victim with host-only children is always admitted (dropping it would orphan them)."""
        if self.host_pool.num_free >= num_pages or victim.children:
            return True  # room, or host-only pages below it that are reachable only through it
        heap = self._host_heap(frozenset())
        lowest = heap.lowest_key(victim)
        return lowest is not None and lowest < heap.key(victim)

    def drop_host_copies(self, node: RadixNode | None, host_page_ids: Sequence[int]) -> int:
        """Exclusive host tier, after a host → device load: free the host copies, among
        `host_page_ids`, of `node` and its ancestors (on device again), except pinned ones
        (a storage write still reads them). Returns the host pages freed."""
        loaded, freed = set(host_page_ids), 0
        for item in self._ancestors(node):
            ids = item.host_page_ids
            if not item.on_device or ids is None or not loaded.issuperset(ids):
                continue
            if any(self.host_pool.is_pinned(p) for p in ids):
                continue
            self.host_pool.free(ids)
            item.host_page_ids = None
            self._free_host_state(item)
            freed += len(ids)
        return freed

    def check(self) -> None:
        super().check()
        seen: set[int] = set()
        for node in self._iter_nodes():
            if node.host_page_ids is None:
                assert node.on_device, "node with neither device nor host pages"
                continue
            assert len(node.host_page_ids) == node.num_pages, "host page count != key pages"
            for page_id in node.host_page_ids:
                assert page_id not in seen, f"host page {page_id} held twice by the tree"
                assert self.host_pool.is_used(page_id), f"tree holds host page {page_id} not USED"
                seen.add(page_id)
        for page_id in self._orphans:
            assert page_id not in seen, f"orphaned host page {page_id} still held by the tree"
            assert self.host_pool.is_used(page_id), f"orphaned host page {page_id} not USED"
            seen.add(page_id)
        assert len(seen) <= self.host_pool.num_used, (len(seen), self.host_pool.num_used)
        self._check_host_states()

    def _check_host_states(self) -> None:
        slots: set[int] = set()
        for node in self._iter_nodes():
            slot = node.host_state_slot
            if slot is None:
                continue
            assert node.host_page_ids is not None, "a host checkpoint without host pages"
            assert self.host_states is not None and self.host_states.is_used(slot), \
                f"tree holds free host state slot {slot}"
            assert slot not in slots, f"host state slot {slot} held twice by the tree"
            slots.add(slot)
        for slot in self._state_orphans:
            assert slot not in slots, f"orphaned host state slot {slot} still held by the tree"
            assert self.host_states is not None and self.host_states.is_used(slot)
            slots.add(slot)
        if self.host_states is not None:
            self.host_states.check()
            assert len(slots) <= self.host_states.num_used, (len(slots),
                                                             self.host_states.num_used)

    # ---- internals ---------------------------------------------------------------------
    def _on_device_evicted(self, node: RadixNode) -> None:
        """A node whose device copy is gone with no host copy cannot be matched past, so
        its host-only descendants are unreachable: drop the whole sub-tree (their host pages
        are freed now, or once the storage write reading them ends)."""
        if node.host_page_ids is None and node.children:
            for item in self._descendants(node):
                assert not item.on_device, "device node below an evicted one"
                if item.host_page_ids is not None:
                    self._release_host(item.host_page_ids)
                    self.num_host_evicted_pages += len(item.host_page_ids)
                    item.host_page_ids = None
                    self._free_host_state(item)
            node.children.clear()
        super()._on_device_evicted(node)

    def _release_host(self, page_ids: list[int]) -> None:
        self._orphans.extend(self.host_pool.free_unpinned(page_ids))

    def _fully_matched(self, node: RadixNode, done_pages: int) -> bool:
        return node.is_root or sum(n.num_pages for n in node.path_from_root()) == done_pages

    def _host_leaves(self, keep: frozenset[RadixNode]) -> list[RadixNode]:
        """`_host_leaf` nodes not in `keep`, in `_iter_nodes` order: one walk, inlined (it
        runs on every host eviction)."""
        found: list[RadixNode] = []
        stack = [child for root in self._roots.values() for child in root.children.values()]
        while stack:
            node = stack.pop()
            children = node.children
            if children:
                stack.extend(children.values())
            if node.host_page_ids is None or node.lock_ref > 0 or node in keep:
                continue
            for child in children.values():
                if child.host_page_ids is not None:
                    break
            else:
                found.append(node)
        return found

    def _host_leaf(self, node: RadixNode) -> bool:
        """Unlocked, with host pages, and no child with host pages (pins not checked)."""
        if node.host_page_ids is None or node.lock_ref > 0:
            return False
        return not any(c.host_page_ids is not None for c in node.children.values())

    def _host_evictable(self, node: RadixNode) -> bool:
        if not self._host_leaf(node):
            return False
        is_pinned = self.host_pool.is_pinned
        return not any(is_pinned(p) for p in node.host_page_ids)

    def _drop_host(self, node: RadixNode) -> int:
        page_ids = node.host_page_ids or []
        self.host_pool.free(page_ids)
        node.host_page_ids = None
        self._free_host_state(node)
        self.num_host_evicted_pages += len(page_ids)
        if not node.on_device and not node.children:
            parent = node.parent
            del parent.children[self._page_at(node.key, 0)]
            if parent.is_root and not parent.children:
                del self._roots[parent.salt]
        return len(page_ids)


class _HostHeap:
    """Host leaves ranked by the tree's `host_policy` (keys taken once, at build or push).
    Entries are checked when they surface: a node that lost its host copy, gained a host
    child, is pinned or joined `keep` since is skipped (lazy deletion). Pins are checked
    only there, not at build: a pinned leaf is skipped wherever it ranks, so the order of the
    others is the same, and only the leaves that surface pay a scan of their pages (a leaf
    that another thread unpins meanwhile competes again, where a scan at build left it out)."""

    def __init__(self, tree: HiRadixTree, keep: frozenset[RadixNode]) -> None:
        self.tree = tree
        self.key = tree.host_policy.key_fn()
        self._order = itertools.count()
        self._heap = [(self.key(n), next(self._order), n) for n in tree._host_leaves(keep)]
        heapq.heapify(self._heap)

    def push(self, node: RadixNode) -> None:
        heapq.heappush(self._heap, (self.key(node), next(self._order), node))

    def pop_valid(self, keep: frozenset[RadixNode]) -> RadixNode | None:
        while self._heap:
            node = heapq.heappop(self._heap)[2]
            if node not in keep and self.tree._host_evictable(node):
                return node
        return None

    def lowest_key(self, skip: RadixNode) -> EvictKey | None:
        """Key of the first host leaf that would be evicted (not `skip`), or None."""
        while self._heap:
            key, _, node = self._heap[0]
            if node is not skip and self.tree._host_evictable(node):
                return key
            heapq.heappop(self._heap)
        return None
