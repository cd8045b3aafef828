"""`RadixTree.evict` keeps its ranked leaves across passes (stable-key policies): the pages it
evicts, and their order, are those of the algorithm it replaced, which ranked every leaf afresh
on every pass. The old algorithm is kept here, test-only, as the reference; a seeded random
workload (inserts with shared prefixes, matches, locks held across operations, sessions,
state checkpoints, window pages with tombstones, evictions, flushes) runs against both and
must log the same evictions, in the same order."""

from __future__ import annotations

import heapq
import itertools
import random
from dataclasses import dataclass, field

import pytest

from pdcache.engine.eviction import SessionTracker, make_policy
from pdcache.engine.kv_pool import PageAllocator
from pdcache.engine.radix import (
    RadixNode,
    RadixTree,
    SlidingWindowRule,
    StateCheckpointRule,
)

PAGE = 2
EvictionLog = list[tuple[str, str, tuple[int, ...], tuple[int | None, ...]]]


def reference_evict(tree: RadixTree, num_pages: int) -> int:
    """`RadixTree.evict` as it was: every pass ranks every evictable leaf afresh."""
    if num_pages <= 0 or tree.evictable_pages == 0:
        return 0
    key = tree.policy.key_fn()
    order = itertools.count()
    heap = [(key(n), next(order), n) for n in tree._iter_nodes() if tree._evictable(n)]
    heapq.heapify(heap)
    freed = 0
    while freed < num_pages and heap:
        node = heapq.heappop(heap)[2]
        parent = node.parent
        freed += tree._evict_device(node)
        if parent is not None and tree._evictable(parent):
            heapq.heappush(heap, (key(parent), next(order), parent))
    return freed


def log_entry(kind: str, node: RadixNode, page_ids: list[int] | None) -> tuple:
    """What an eviction freed: the node (its salt and tokens from the root) and its pages."""
    tokens = tuple(t for item in node.path_from_root() for t in item.key)
    return (kind, node.salt, tokens, tuple(page_ids or ()))


class LoggedTree(RadixTree):
    """The product tree, logging each device eviction."""

    def __init__(self, *args: object, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]
        self.log: EvictionLog = []

    def _evict_device(self, node: RadixNode) -> int:
        self.log.append(log_entry("device", node, node.device_page_ids))
        return super()._evict_device(node)


class ReferenceEviction(RadixTree):
    """A tree evicting by the reference algorithm."""

    def evict(self, num_pages: int) -> int:
        return reference_evict(self, num_pages)


class ReferenceTree(LoggedTree, ReferenceEviction):
    """The reference, logging each device eviction."""


@dataclass
class Slots:
    """State checkpoint slots (`CheckpointSlots`): a free list."""

    size: int
    free: list[int] = field(default_factory=list)
    used: set[int] = field(default_factory=set)

    def __post_init__(self) -> None:
        self.free = list(range(self.size))

    def take(self) -> int | None:
        if not self.free:
            return None
        slot = self.free.pop()
        self.used.add(slot)
        return slot

    def free_checkpoint(self, slot: int) -> None:
        self.used.remove(slot)
        self.free.append(slot)

    def is_used(self, slot: int) -> bool:
        return slot in self.used


def random_prompt(rng: random.Random) -> list[int]:
    """Pages drawn from a few small alphabets, so prompts share prefixes and branch."""
    num_pages = rng.randint(1, 8)
    return [t for i in range(num_pages) for t in (rng.randint(0, 2 if i < 4 else 5), i)]


def run_workload(tree_class: type[LoggedTree], policy: str, hybrid: bool,
                 seed: int) -> tuple[EvictionLog, list[tuple]]:
    """A seeded random workload; returns the eviction log and the final tree contents."""
    rng = random.Random(seed)
    now = [0.0]
    sessions = SessionTracker(5.0, clock=lambda: now[0])
    allocator, window = PageAllocator(24), PageAllocator(24)
    slots = Slots(4)
    rules = (StateCheckpointRule(), SlidingWindowRule(3, PAGE)) if hybrid else ()
    tree = tree_class(PAGE, allocator, policy=make_policy(policy, sessions), sessions=sessions,
                      restore_rules=rules, checkpoints=slots if hybrid else None,
                      window_allocator=window if hybrid else None)
    held: list[RadixNode | None] = []
    for _ in range(400):
        now[0] += rng.random()
        op = rng.random()
        if op < 0.55:
            turn(tree, rng, held, hybrid, slots)
        elif op < 0.7 and held:
            tree.unlock(held.pop(rng.randrange(len(held))))
        elif op < 0.85:
            tree.evict(rng.randint(1, 6))
        elif op < 0.9 and hybrid:
            tree.drop_lru_checkpoint()
        elif op < 0.93:
            sessions.end(f"s{rng.randint(0, 4)}")
        elif op < 0.95:
            tree.flush()
        tree.check()
    return tree.log, snapshot(tree)


def turn(tree: RadixTree, rng: random.Random, held: list[RadixNode | None], hybrid: bool,
         slots: Slots) -> None:
    """One request: match, lock, allocate (evicting), insert, note its session, maybe
    checkpoint its end, and unlock now or leave the lock held for later."""
    tokens = random_prompt(rng)
    salt = rng.choice(("", "", "t"))
    match = tree.match_pages(tokens, salt)
    tree.lock(match.last_node)
    num_pages = len(tokens) // PAGE
    new = num_pages - len(match.page_ids)
    short = new - tree.allocator.num_free
    if short > 0:
        tree.evict(short)
    pages = tree.allocator.alloc(new) if new <= tree.allocator.num_free else None
    if pages is None:
        tree.unlock(match.last_node)
        return
    window_ids: list[int | None] | None = None
    if hybrid:
        fresh = [None if rng.random() < 0.3 else tree.window_allocator.alloc(1) for _ in pages]
        window_ids = [*match.window_page_ids, *[w[0] if w else None for w in fresh]]
    result = tree.insert(tokens, [*match.page_ids, *pages], salt, window_ids)
    tree.allocator.free(result.duplicate_page_ids)
    if result.duplicate_window_page_ids:
        tree.window_allocator.free(result.duplicate_window_page_ids)
    session = f"s{rng.randint(0, 4)}"
    tree.note_session(result.last_node, session, new_turn=True)
    if hybrid and rng.random() < 0.5:
        slot = slots.take()
        if slot is not None and not tree.set_checkpoint(result.last_node, slot):
            slots.free_checkpoint(slot)
    tree.lock(result.last_node)
    tree.unlock(match.last_node)
    if rng.random() < 0.3:
        held.append(result.last_node)
    else:
        tree.unlock(result.last_node)


def snapshot(tree: RadixTree) -> list[tuple]:
    return sorted((log_entry("node", n, n.device_page_ids), n.lock_ref, n.state_slot,
                   tuple(-1 if w is None else w for w in n.window_page_ids or ()))
                  for n in tree._iter_nodes())


@pytest.mark.parametrize("hybrid", [False, True])
@pytest.mark.parametrize("policy", ["lru", "session"])
@pytest.mark.parametrize("seed", range(6))
def test_evictions_match_the_reference_algorithm(policy: str, hybrid: bool, seed: int) -> None:
    log, tree = run_workload(LoggedTree, policy, hybrid, seed)
    reference_log, reference_tree = run_workload(ReferenceTree, policy, hybrid, seed)
    assert len(log) > 20, "the workload must evict"
    assert log == reference_log
    assert tree == reference_tree


def test_a_stale_kept_heap_is_dropped_and_rebuilt() -> None:
    """Pushes without evictions (a roomy cache) cannot grow the kept heap without bound."""
    tree = LoggedTree(PAGE, PageAllocator(64))
    tree.insert([1, 1], tree.allocator.alloc(1))
    assert tree.evict(1) == 1
    for i in range(200):
        if tree.allocator.num_free < 2:
            tree.evict(2)
        result = tree.insert([2, 2, i, i], tree.allocator.alloc(2))
        tree.allocator.free(result.duplicate_page_ids)
        tree.lock(result.last_node)
        tree.unlock(result.last_node)
        if tree._leaf_heap is not None:
            assert len(tree._leaf_heap) <= 2 * tree.total_pages + 65
        tree.check()
