"""Page allocator and page-granular radix tree: matching, dedupe, namespaces, locks, LRU."""

from __future__ import annotations

import random

import pytest

from pdcache.engine.kv_pool import PageAllocationError, PageAllocator
from pdcache.engine.radix import RadixTree

PAGE = 4


def make_tree(capacity: int = 64, on_evict=None) -> tuple[RadixTree, PageAllocator]:
    allocator = PageAllocator(capacity)
    return RadixTree(PAGE, allocator, on_evict=on_evict), allocator


def put(tree: RadixTree, tokens: list[int], salt: str = "") -> list[int]:
    """Allocate pages for `tokens`' full pages, insert them, free duplicates; returns the
    pages the tree holds for them afterwards."""
    pages = tree.allocator.alloc(len(tokens) // PAGE)
    result = tree.insert(tokens, pages, salt)
    tree.allocator.free(result.duplicate_page_ids)
    return tree.match_prefix(tokens, salt).page_ids


# ---- allocator ---------------------------------------------------------------------------
def test_allocator_all_or_nothing_and_double_free() -> None:
    allocator = PageAllocator(5)
    first = allocator.alloc(3)
    assert first == [0, 1, 2]
    assert allocator.alloc(3) is None and allocator.num_free == 2  # nothing taken
    allocator.free([1])
    with pytest.raises(PageAllocationError, match="double free"):
        allocator.free([1])
    with pytest.raises(PageAllocationError, match="double free"):
        allocator.free([0, 0])
    assert allocator.is_used(0)  # the failed call freed nothing
    with pytest.raises(PageAllocationError, match="outside"):
        allocator.free([5])
    assert allocator.num_free + allocator.num_used == allocator.capacity == 5
    allocator.check()


# ---- match / insert ----------------------------------------------------------------------
def test_match_counts_full_pages_only() -> None:
    tree, _ = make_tree()
    tokens = list(range(100, 114))  # 3 full pages + 2 tokens
    held = put(tree, tokens)
    assert len(held) == 3
    assert tree.match_prefix(tokens).cached_len == 12
    assert tree.match_prefix(tokens[:11]).cached_len == 8  # a partial page never matches
    assert tree.match_prefix(tokens[:8] + [0, 0, 0, 0]).page_ids == held[:2]
    assert tree.match_prefix([1, 2, 3, 4]).cached_len == 0
    tree.check()


def test_match_is_read_only() -> None:
    tree, _ = make_tree()
    put(tree, list(range(8)))
    before = [(n.last_access, n.hit_count, n.lock_ref) for n, _ in tree.walk(list(range(8)))]
    tree.match_prefix(list(range(8)))
    assert [(n.last_access, n.hit_count, n.lock_ref) for n, _ in tree.walk(list(range(8)))] == before


def test_insert_dedupes_and_splits_at_page_boundary() -> None:
    tree, allocator = make_tree()
    a = list(range(16))  # 4 pages
    held_a = put(tree, a)
    b = a[:8] + [90, 91, 92, 93, 94, 95, 96, 97]  # shares 2 pages, then diverges
    b_pages = allocator.alloc(4)
    result = tree.insert(b, b_pages, "")
    assert result.duplicate_page_ids == b_pages[:2]  # caller's copies of the shared pages
    assert result.num_new_pages == 2
    allocator.free(result.duplicate_page_ids)
    assert tree.match_prefix(b).page_ids == held_a[:2] + b_pages[2:]
    assert tree.match_prefix(a).page_ids == held_a
    assert tree.num_nodes() == 3  # split into shared head + two tails
    assert tree.total_pages == 6 == allocator.num_used
    tree.check()


def test_walk_reports_every_node_on_the_path_with_partial_last() -> None:
    tree, _ = make_tree()
    a = list(range(16))
    put(tree, a)
    put(tree, a[:8] + [60] * 8)
    path = tree.walk(a[:12] + [0] * 4)
    assert [(node.num_pages, matched) for node, matched in path] == [(2, 2), (2, 1)]
    assert tree.walk([5] * 8) == [] and tree.walk(a, salt="other") == []


def test_reinserting_own_pages_is_not_a_duplicate() -> None:
    tree, allocator = make_tree()
    tokens = list(range(12))
    held = put(tree, tokens)
    extra = allocator.alloc(1)
    result = tree.insert(tokens + [7, 7, 7, 7], held + extra, "")
    assert result.duplicate_page_ids == []
    assert tree.match_prefix(tokens + [7, 7, 7, 7]).page_ids == held + extra
    tree.check()


def test_salts_never_share_nodes_or_pages() -> None:
    tree, allocator = make_tree()
    tokens = list(range(8))
    held_x = put(tree, tokens, salt="tenant-x")
    assert tree.match_prefix(tokens, "tenant-y").cached_len == 0
    assert tree.match_prefix(tokens, "").cached_len == 0
    held_y = put(tree, tokens, salt="tenant-y")
    assert set(held_x).isdisjoint(held_y)
    assert tree.total_pages == 4 == allocator.num_used
    tree.check()


# ---- locks and eviction -------------------------------------------------------------------
def test_evict_lru_leaf_first_and_never_locked() -> None:
    evicted: list[list[int]] = []
    tree, allocator = make_tree(on_evict=lambda node, pages: evicted.append(list(pages)))
    shared = [1, 1, 1, 1]
    old = put(tree, shared + [2, 2, 2, 2])
    mid = put(tree, shared + [3, 3, 3, 3])
    new = put(tree, shared + [4, 4, 4, 4])
    locked = tree.match_prefix(shared + [3, 3, 3, 3])
    tree.lock(locked.last_node)  # also touches its path: now the most recent
    assert tree.evictable_pages == 2  # the two unlocked leaves; the shared head is locked
    assert tree.evict(1) == 1 and evicted == [old[1:]]
    assert tree.evict(1) == 1 and evicted[-1] == new[1:]
    assert tree.evict(100) == 0  # the rest is locked (path of the locked leaf)
    assert tree.match_prefix(shared + [3, 3, 3, 3]).page_ids == mid
    tree.unlock(locked.last_node)
    assert tree.evictable_pages == tree.total_pages == 2
    assert tree.evict(100) == 2  # leaf, then its parent once it became a leaf
    assert tree.total_pages == 0 and allocator.num_free == allocator.capacity
    tree.check()


def test_lock_protects_across_split_and_unlock_balances() -> None:
    tree, allocator = make_tree()
    a = list(range(16))
    put(tree, a)
    node = tree.match_prefix(a).last_node
    tree.lock(node)
    put(tree, a[:4] + [50, 51, 52, 53])  # splits the locked node
    assert tree.locked_pages == 4
    assert tree.evict(100) == 1  # only the new unlocked leaf
    tree.unlock(node)
    assert tree.locked_pages == 0
    assert tree.num_nodes() == 2  # the unlocked leaf is evicted: a's head and tail are left
    assert all(n.lock_ref == 0 for n, _ in tree.walk(a))
    tree.check()
    tree.flush()
    assert allocator.num_used == 0
    with pytest.raises(AssertionError, match="not locked"):
        tree.unlock(node)


def test_random_operations_keep_accounting_exact() -> None:
    rng = random.Random(7)
    tree, allocator = make_tree(capacity=48)
    locked: list = []
    for _ in range(400):
        op = rng.random()
        tokens = [rng.randrange(3) for _ in range(rng.randrange(1, 7) * PAGE)]
        salt = rng.choice(["", "s"])
        if op < 0.5:
            pages = allocator.alloc(len(tokens) // PAGE)
            if pages is None:
                tree.evict(len(tokens) // PAGE)
                continue
            allocator.free(tree.insert(tokens, pages, salt).duplicate_page_ids)
        elif op < 0.7:
            node = tree.match_prefix(tokens, salt).last_node
            tree.lock(node)
            locked.append(node)
        elif op < 0.85 and locked:
            tree.unlock(locked.pop(rng.randrange(len(locked))))
        else:
            tree.evict(rng.randrange(1, 6))
        tree.check()
        allocator.check()
        assert tree.total_pages == allocator.num_used  # the tree is the only owner here
    for node in locked:
        tree.unlock(node)
    tree.flush()
    assert allocator.num_free == allocator.capacity
