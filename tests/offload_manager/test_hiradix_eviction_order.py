"""The hierarchical tree's evictions are those of the algorithms they replaced: device
eviction keeps its ranked leaves across passes (stable-key policies), and host eviction checks
pins only on the leaves that surface instead of on every host page at every heap build. The old
algorithms are kept here, test-only, as the reference (`reference_evict` and the host heap
that scanned pins at build); a seeded random workload over HiCache (turns with shared prefixes,
host hits loaded back, backups, locks held across operations, storage-write pins, device and
host evictions) runs against both, for each policy and host mode, and must log the same
evictions, in the same order."""

from __future__ import annotations

import heapq
import itertools
import random

import pytest
import torch

from pdcache.engine.eviction import EvictKey, SessionTracker, make_policy
from pdcache.engine.kv_geometry import KVGeometry
from pdcache.engine.kv_pool import PageAllocator
from pdcache.engine.radix import RadixNode
from pdcache.offload_manager.hicache import HiCache, HiCacheConfig
from pdcache.offload_manager.hiradix import HiRadixTree
from pdcache.offload_manager.host_pool import HostKVPool
from tests.engine.test_radix_eviction_order import EvictionLog, log_entry, reference_evict

L, S, H, D = 1, 2, 1, 2  # layers, page size, kv heads, head dim


class LoggedHiTree(HiRadixTree):
    """The product tree, logging each device and host eviction."""

    def __init__(self, *args: object, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]
        self.log: EvictionLog = []

    def _evict_device(self, node: RadixNode) -> int:
        self.log.append(log_entry("device", node, node.device_page_ids))
        return super()._evict_device(node)

    def _drop_host(self, node: RadixNode) -> int:
        self.log.append(log_entry("host", node, node.host_page_ids))
        return super()._drop_host(node)


class ReferenceHiEviction(HiRadixTree):
    """A hierarchical tree evicting by the reference algorithms."""

    def evict(self, num_pages: int) -> int:
        self._in_device_pass, self._pass_heap = True, None
        try:
            return reference_evict(self, num_pages)
        finally:
            self._in_device_pass, self._pass_heap = False, None

    def _host_heap(self, keep: frozenset[RadixNode]) -> ReferenceHostHeap:  # type: ignore[override]
        if not self._in_device_pass or keep:
            return ReferenceHostHeap(self, keep)
        if self._pass_heap is None:
            self._pass_heap = ReferenceHostHeap(self, keep)  # type: ignore[assignment]
        return self._pass_heap  # type: ignore[return-value]


class ReferenceHiTree(LoggedHiTree, ReferenceHiEviction):
    """The reference, logging each device and host eviction."""


class ReferenceHostHeap:
    """The host heap as it was: every host leaf's pages scanned for pins at build."""

    def __init__(self, tree: HiRadixTree, keep: frozenset[RadixNode]) -> None:
        self.tree = tree
        self.key = tree.host_policy.key_fn()
        self._order = itertools.count()
        self._heap = [(self.key(n), next(self._order), n) for n in tree._iter_nodes()
                      if n not in keep and self._evictable(n)]
        heapq.heapify(self._heap)

    def _evictable(self, node: RadixNode) -> bool:
        tree = self.tree
        if node.host_page_ids is None or node.lock_ref > 0:
            return False
        if any(tree.host_pool.is_pinned(p) for p in node.host_page_ids):
            return False
        return not any(c.host_page_ids is not None for c in node.children.values())

    def push(self, node: RadixNode) -> None:
        heapq.heappush(self._heap, (self.key(node), next(self._order), node))

    def pop_valid(self, keep: frozenset[RadixNode]) -> RadixNode | None:
        while self._heap:
            node = heapq.heappop(self._heap)[2]
            if node not in keep and self._evictable(node):
                return node
        return None

    def lowest_key(self, skip: RadixNode) -> EvictKey | None:
        while self._heap:
            key, _, node = self._heap[0]
            if node is not skip and self._evictable(node):
                return key
            heapq.heappop(self._heap)
        return None


class Workload:
    """What the HiCache scheduler does per request (as `test_tier_policies.TierSim`), plus
    locks held across operations, storage-write pins and explicit evictions."""

    def __init__(self, tree_class: type[LoggedHiTree], device_policy: str, host_policy: str,
                 host_mode: str, seed: int) -> None:
        self.rng = random.Random(seed)
        self.now = 0.0
        self.sessions = SessionTracker(5.0, clock=lambda: self.now)
        self.alloc = PageAllocator(20)
        self.host = HostKVPool(14, KVGeometry.mha(L, H, D, "float32"), S)
        self.tree = tree_class(S, self.alloc, self.host,
                               policy=make_policy(device_policy, self.sessions),
                               host_policy=make_policy(host_policy, self.sessions),
                               sessions=self.sessions)
        self.cache = HiCache(self.tree, torch.zeros(L, 2, 20, S, H, D), None,
                             HiCacheConfig(host_mode=host_mode), "fp")
        self.held: list[RadixNode | None] = []
        self.pins: list[list[int]] = []

    def run(self, num_ops: int) -> tuple[EvictionLog, list[tuple]]:
        rng, tree = self.rng, self.tree
        for _ in range(num_ops):
            self.now += rng.random()
            op = rng.random()
            if op < 0.5:
                self.turn()
            elif op < 0.62 and self.held:
                tree.unlock(self.held.pop(rng.randrange(len(self.held))))
            elif op < 0.72:
                tree.evict(rng.randint(1, 5))
            elif op < 0.8:
                tree.evict_host(rng.randint(1, 5))
            elif op < 0.88:
                self.pin()
            elif op < 0.96 and self.pins:
                self.host.unpin(self.pins.pop(rng.randrange(len(self.pins))))
                tree.release_orphans()
            else:
                self.sessions.end(f"s{rng.randint(0, 4)}")
            self.cache.check()
        return tree.log, self.snapshot()

    def turn(self) -> None:
        rng, tree = self.rng, self.tree
        num_pages = rng.randint(1, 7)
        tokens = [t for i in range(num_pages) for t in (rng.randint(0, 2 if i < 3 else 4), i)]
        salt = rng.choice(("", "", "t"))
        device = tree.match_prefix(tokens, salt)
        tree.lock(device.last_node)
        need = num_pages - len(device.page_ids)
        if need > self.alloc.num_free:
            tree.evict(need - self.alloc.num_free)
        own = self.alloc.alloc(need) if need <= self.alloc.num_free else None
        if own is None:
            tree.unlock(device.last_node)
            return
        host = tree.match_host(device, tokens, num_pages)
        node, load = self.cache.load(host, None, own) if host.nodes else (device.last_node, None)
        if host.nodes:
            tree.lock(node)
            tree.unlock(device.last_node)
        if load is not None:
            load.finish()
        result = tree.insert(tokens, device.page_ids + own, salt)
        self.alloc.free(result.duplicate_page_ids)
        tree.note_session(result.last_node, f"s{rng.randint(0, 4)}", new_turn=True)
        tree.lock(result.last_node)
        tree.unlock(node)
        if rng.random() < 0.3:
            self.held.append(result.last_node)
        else:
            tree.unlock(result.last_node)
        self.cache.backup(tokens, salt, result.last_node)

    def pin(self) -> None:
        """A storage write starts reading a random host copy."""
        backed = sorted((log_entry("node", n, n.host_page_ids), n.host_page_ids)
                        for n in self.tree._iter_nodes() if n.host_page_ids is not None)
        if backed:
            page_ids = list(self.rng.choice(backed)[1])
            self.host.pin(page_ids)
            self.pins.append(page_ids)

    def snapshot(self) -> list[tuple]:
        return sorted((log_entry("node", n, n.device_page_ids), tuple(n.host_page_ids or ()),
                       n.lock_ref) for n in self.tree._iter_nodes())


@pytest.mark.parametrize("host_mode", ["inclusive", "exclusive"])
@pytest.mark.parametrize(("device_policy", "host_policy"),
                         [("lru", "lru"), ("session", "session"), ("lru", "session")])
@pytest.mark.parametrize("seed", range(4))
def test_evictions_match_the_reference_algorithms(device_policy: str, host_policy: str,
                                                  host_mode: str, seed: int) -> None:
    log, tree = Workload(LoggedHiTree, device_policy, host_policy, host_mode, seed).run(400)
    reference = Workload(ReferenceHiTree, device_policy, host_policy, host_mode, seed).run(400)
    kinds = {entry[0] for entry in log}
    assert kinds == {"device", "host"}, "the workload must evict from both tiers"
    assert (log, tree) == reference
