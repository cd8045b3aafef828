from __future__ import annotations

import threading

import pytest
import torch

from pdcache.engine.kv_geometry import KVGeometry
from pdcache.offload_manager.host_pool import HostKVPool


def make_pool(num_pages: int = 8) -> HostKVPool:
    return HostKVPool(num_pages, KVGeometry.mha(3, 2, 8, "float16"), page_size=4)


def test_alloc_commit_free_accounting() -> None:
    pool = make_pool(8)
    a = pool.alloc(5)
    assert a is not None and len(set(a)) == 5
    assert (pool.num_free, pool.num_in_flight, pool.num_used) == (3, 5, 0)
    assert pool.alloc(4) is None  # short: nothing taken
    assert pool.num_free == 3
    pool.commit(a[:3])
    assert (pool.num_free, pool.num_in_flight, pool.num_used) == (3, 2, 3)
    pool.free(a)
    assert (pool.num_free, pool.num_in_flight, pool.num_used) == (8, 0, 0)
    pool.check()


def test_misuse_is_detected() -> None:
    pool = make_pool(4)
    pages = pool.alloc(2)
    assert pages is not None
    with pytest.raises(ValueError, match="not IN_FLIGHT"):
        pool.commit(pages)
        pool.commit(pages)
    pool.pin(pages[:1])
    with pytest.raises(ValueError, match="pinned"):
        pool.free(pages[:1])
    pool.unpin(pages[:1])
    with pytest.raises(ValueError, match="unpinned more"):
        pool.unpin(pages[:1])
    pool.free(pages)
    with pytest.raises(ValueError, match="freed twice"):
        pool.free(pages[:1])
    pool.check()


def test_page_bytes_are_views_of_page_first_layout() -> None:
    pool = make_pool(4)
    views = pool.page_bytes([2])
    assert views[0].dtype == torch.uint8 and views[0].numel() == pool.page_nbytes
    views[0].fill_(0x3C)  # 0x3C3C as fp16 is 1.0586; every element of page 2 changes
    assert torch.all(pool.host_kv[2] == torch.tensor(0x3C3C, dtype=torch.int16).view(torch.float16))
    assert torch.all(pool.host_kv[[0, 1, 3]] == 0)


def test_concurrent_alloc_free_keeps_invariant() -> None:
    pool = make_pool(64)
    errors: list[BaseException] = []

    def churn(seed: int) -> None:
        try:
            for i in range(300):
                pages = pool.alloc(1 + (seed + i) % 4)
                if pages:
                    pool.commit(pages)
                    pool.free(pages)
        except BaseException as exc:  # pragma: no cover - reported below
            errors.append(exc)

    threads = [threading.Thread(target=churn, args=(s,)) for s in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert not errors
    assert pool.num_free == 64
    pool.check()


class UnpinWhileLooking(HostKVPool):
    """A pool whose pin check lets the storage write of `page` end right after it answered
    "pinned" (what the backup IO thread can do between two looks of the engine thread)."""

    page: int | None = None

    def is_pinned(self, page_id: int) -> bool:
        pinned = super().is_pinned(page_id)
        if pinned and page_id == self.page:
            self.page = None
            self.unpin([page_id])  # the write's completion, on the IO thread
        return pinned


def test_orphans_are_released_exactly_once_while_writes_end() -> None:
    """Orphaned host pages (their node gone while a storage write pinned them) are freed
    once their write ends, exactly once, even when a write ends while the tree looks at its
    pins: two separate looks freed such a page and kept it as an orphan too (freed again
    later, from whoever owned it by then), or kept it as neither (leaked)."""
    from pdcache.engine.kv_pool import PageAllocator
    from pdcache.offload_manager.hiradix import HiRadixTree

    pool = UnpinWhileLooking(4, KVGeometry.mha(1, 1, 4, "float32"), 4)
    tree = HiRadixTree(4, PageAllocator(4), pool)
    orphan = pool.alloc(1)
    assert orphan is not None
    pool.commit(orphan)
    pool.pin(orphan)
    tree._orphans = list(orphan)  # its node was dropped while the write pinned it
    pool.page = orphan[0]
    tree.release_orphans()
    assert pool.num_free + len(tree._orphans) == 4  # free, or still an orphan: not both
    if pool.page is not None:  # the write did not end while the tree looked: it ends now
        pool.page = None
        pool.unpin(orphan)
    tree.release_orphans()  # freed now if not before
    assert tree._orphans == [] and pool.num_free == 4
    pool.check()
