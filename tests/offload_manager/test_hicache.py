from __future__ import annotations

import time

import pytest
import torch

from pdcache.engine.kv_geometry import KVGeometry
from pdcache.engine.kv_pool import PageAllocator
from pdcache.offload_manager.hicache import HiCache, HiCacheConfig
from pdcache.offload_manager.hiradix import HiRadixTree
from pdcache.offload_manager.host_pool import HostKVPool
from pdcache.offload_manager.pending import PendingPages
from tests.storage_doubles import DictBackend

L, P, S, H, D = 2, 16, 4, 2, 8
FP = "fp"


class Stack:
    """Device pool + host pool + HiCache over one storage backend."""

    def __init__(self, storage, host_pages: int = 16, pending: PendingPages | None = None,
                 **cfg) -> None:
        self.device_kv = torch.zeros(L, 2, P, S, H, D)
        self.alloc = PageAllocator(P)
        self.host = HostKVPool(host_pages, KVGeometry.mha(L, H, D, "float32"), S)
        self.tree = HiRadixTree(S, self.alloc, self.host)
        self.cache = HiCache(self.tree, self.device_kv, storage, HiCacheConfig(**cfg), FP,
                             pending=pending)
        self.cache.start()

    def prefill(self, tokens: list[int], salt: str = "") -> list[int]:
        """Pretend a forward computed `tokens`: fill pages with a pattern, insert, back up."""
        pages = self.alloc.alloc(len(tokens) // S)
        for i, page in enumerate(pages):
            self.device_kv[:, :, page] = float(tokens[i * S]) + torch.arange(S * H * D).view(S, H, D)
        result = self.tree.insert(tokens, pages, salt)
        self.cache.backup(tokens, salt, result.last_node)
        return pages

    def expected(self, tokens: list[int]) -> torch.Tensor:
        return torch.stack([float(tokens[i * S]) + torch.arange(S * H * D).view(S, H, D)
                            for i in range(len(tokens) // S)])

    def device_pages(self, page_ids: list[int]) -> torch.Tensor:
        return self.device_kv[0, 0, page_ids]

    def close(self) -> None:
        assert self.cache.wait_idle(10)
        self.cache.check()
        self.cache.close()


TOKENS = list(range(10, 10 + 3 * S))


def test_write_through_backs_up_to_host_and_storage_byte_exact() -> None:
    storage = DictBackend()
    st = Stack(storage)
    pages = st.prefill(TOKENS)
    assert st.cache.wait_idle(10)
    keys = st.cache.page_keys(TOKENS, "")
    assert len(storage.pages) == 3
    for key, page in zip(keys, pages):
        assert storage.pages[key] == st.device_kv[:, :, page].contiguous().numpy().tobytes()
    assert st.cache.stats.backup_host_pages == 3 and st.cache.stats.backup_storage_pages == 3
    st.close()


def test_device_eviction_demotes_to_host_and_load_restores() -> None:
    st = Stack(DictBackend())
    st.prefill(TOKENS)
    assert st.tree.evict(3) == 3 and st.alloc.num_used == 0
    device, host = st.cache.match(TOKENS + [1], "", max_pages=3)
    assert device.cached_len == 0 and host.num_pages == 3
    new_pages = st.alloc.alloc(3)
    node, load = st.cache.load(host, None, new_pages)
    load.wait(L - 1)
    assert torch.equal(st.device_kv[:, 0, new_pages][0], st.expected(TOKENS))
    assert torch.equal(st.device_kv[:, :, new_pages].permute(2, 0, 1, 3, 4, 5).contiguous(),
                       st.host.host_kv[host.host_page_ids])
    st.tree.lock(node)
    assert st.tree.match_prefix(TOKENS, "").cached_len == 3 * S  # back on device
    st.tree.unlock(node)
    st.close()


def test_partial_host_match_splits_node() -> None:
    st = Stack(DictBackend())
    st.prefill(TOKENS)
    st.tree.evict(3)
    other = TOKENS[: 2 * S] + [999] * S
    device, host = st.cache.match(other, "", max_pages=3)
    assert host.num_pages == 2
    node, load = st.cache.load(host, None, st.alloc.alloc(2))
    load.finish()
    assert node.num_pages == 2 and st.tree.match_prefix(TOKENS, "").cached_len == 2 * S
    st.close()


def test_write_back_backs_up_only_on_eviction() -> None:
    storage = DictBackend()
    st = Stack(storage, write_policy="write_back")
    st.prefill(TOKENS)
    assert st.host.num_used == 0 and not storage.pages
    st.tree.evict(3)
    assert st.host.num_used == 3
    assert st.cache.wait_idle(10) and len(storage.pages) == 3
    st.close()


def test_write_through_selective_waits_for_hits() -> None:
    st = Stack(DictBackend(), write_policy="write_through_selective", write_through_threshold=2)
    st.prefill(TOKENS)
    assert st.host.num_used == 0
    node = st.tree.match_prefix(TOKENS, "").last_node
    for _ in range(2):  # two requests admitted on it (a lock alone is no hit)
        st.tree.lock(node)
        st.tree.unlock(node)
    st.cache.backup(TOKENS, "", node)
    assert st.host.num_used == 0
    for _ in range(2):
        st.tree.count_hit(node)
    st.cache.backup(TOKENS, "", node)
    assert st.host.num_used == 3
    st.close()


@pytest.mark.parametrize("policy", ["best_effort", "wait_complete", "timeout"])
def test_prefetch_from_storage_in_a_fresh_process(policy: str) -> None:
    storage = DictBackend()
    writer = Stack(storage)
    writer.prefill(TOKENS)
    writer.close()
    st = Stack(storage, prefetch_policy=policy)  # new tiers, same storage
    assert st.cache.start_prefetch("r", TOKENS + [1], "", first_page=0, max_pages=3) == 3
    deadline = time.monotonic() + 10
    while not st.cache.prefetches.complete("r") and time.monotonic() < deadline:
        time.sleep(0.01)
    assert st.cache.prefetch_ready("r")
    result = st.cache.take_prefetch("r")
    assert len(result.host_page_ids) == 3 and result.from_decode_pages == 0
    device_pages = st.alloc.alloc(3)
    _, load = st.cache.load(st.cache.match(TOKENS, "", 0)[1], result, device_pages)
    load.finish()
    assert torch.equal(st.device_kv[0, 0, device_pages], st.expected(TOKENS))
    assert st.cache.stats.prefetch_pages == 3
    assert st.host.num_used == 0  # prefetched host pages were released after the load
    st.close()


def test_prefetch_policies_when_storage_stalls() -> None:
    storage = DictBackend()
    writer = Stack(storage)
    writer.prefill(TOKENS)
    writer.close()
    storage.gate.clear()
    waits = Stack(storage, prefetch_policy="wait_complete")
    assert waits.cache.start_prefetch("r", TOKENS, "", 0, 3) == 3
    assert not waits.cache.prefetch_ready("r")
    times_out = Stack(storage, prefetch_policy="timeout", prefetch_timeout_base_s=0.05,
                      prefetch_timeout_per_1k_tokens_s=0.0)
    times_out.cache.start_prefetch("r", TOKENS, "", 0, 3)
    assert not times_out.cache.prefetch_ready("r")
    time.sleep(0.06)
    assert times_out.cache.prefetch_ready("r")
    assert times_out.cache.take_prefetch("r").host_page_ids == []  # nothing arrived in time
    assert times_out.cache.stats.prefetch_abandoned_pages == 3
    storage.gate.set()
    waits.cache.cancel_prefetch("r")
    waits.close()
    times_out.close()  # abandoned pages were freed once their reads ended
    assert times_out.host.num_free == times_out.host.capacity


def test_wait_complete_admits_at_its_cap_when_a_read_hangs() -> None:
    """`wait_complete` has no deadline of its own: a read that never ends (a wedged store)
    held the request in the queue for good. It is admitted at `prefetch_timeout_max_s`,
    with what arrived (nothing here), and the pages still being read are abandoned."""
    storage = DictBackend()
    writer = Stack(storage)
    writer.prefill(TOKENS)
    writer.close()
    storage.gate.clear()
    st = Stack(storage, prefetch_policy="wait_complete", prefetch_timeout_max_s=0.2)
    started = time.monotonic()
    assert st.cache.start_prefetch("r", TOKENS, "", 0, 3) == 3
    assert not st.cache.prefetch_ready("r", now=started + 0.1)
    assert st.cache.prefetch_ready("r", now=time.monotonic() + 0.2)
    assert st.cache.take_prefetch("r").host_page_ids == []
    assert st.cache.stats.prefetch_abandoned_pages == 3
    storage.gate.set()
    st.close()
    assert st.host.num_free == st.host.capacity


def test_storage_down_is_survived() -> None:
    storage = DictBackend()
    storage.down = True
    st = Stack(storage)
    st.prefill(TOKENS)
    assert st.cache.wait_idle(10)
    assert st.cache.stats.backup_failed_pages == 3 and st.cache.stats.storage_errors == 1
    storage.down = False
    fresh = Stack(storage)
    assert fresh.cache.start_prefetch("r", TOKENS, "", 0, 3) == 0  # nothing was stored
    more = [t + 100 for t in TOKENS]
    st.prefill(more)
    assert st.cache.wait_idle(10) and len(storage.pages) == 3  # worker recovered
    st.close()
    fresh.close()


@pytest.mark.parametrize("down", [False, True])
def test_backup_is_counted_before_its_pages_are_unpinned(down: bool) -> None:
    """`wait_idle` returns once no host page is pinned: a storage write's counters must be
    final by then (they were counted after the unpin, and a test reading them right after
    `wait_idle` once saw `backup_failed_pages` 0)."""
    storage = DictBackend()
    storage.down = down
    st = Stack(storage)
    seen: list[tuple[int, int]] = []
    unpin = st.host.unpin

    def unpin_and_look(ids):  # the IO thread's completion unpins the written pages
        seen.append((st.cache.stats.backup_storage_pages, st.cache.stats.backup_failed_pages))
        return unpin(ids)

    st.host.unpin = unpin_and_look  # type: ignore[method-assign]
    st.prefill(TOKENS)
    assert st.cache.wait_idle(10)
    assert seen == [(0, 3) if down else (3, 0)]
    st.close()


def test_host_eviction_is_lru_and_skips_pinned() -> None:
    st = Stack(DictBackend(), host_pages=6)
    a, b, c, d = (list(range(k, k + 3 * S)) for k in (100, 200, 300, 400))
    st.prefill(a)
    st.prefill(b)
    assert st.cache.wait_idle(10)  # storage writes done: host copies unpinned
    st.tree.evict(6)  # both live on host only now; a is the least recently used
    node_a = st.cache.match(a, "", 3)[1].nodes[0][0]
    st.host.pin(node_a.host_page_ids)  # a is being loaded: not evictable
    assert st.tree.evict_host(3) == 3
    assert st.cache.match(b, "", 3)[1].num_pages == 0
    assert st.cache.match(a, "", 3)[1].num_pages == 3
    st.host.unpin(node_a.host_page_ids)
    st.prefill(c)
    st.prefill(d)  # host full: the LRU host copy (a) goes
    assert st.cache.match(a, "", 3)[1].num_pages == 0
    assert st.tree.match_prefix(c, "").cached_len == 3 * S
    st.close()


def test_tenants_never_share() -> None:
    storage = DictBackend()
    st = Stack(storage)
    st.prefill(TOKENS, salt="alice")
    assert st.cache.wait_idle(10)  # alice's storage writes landed (they are asynchronous)
    fresh = Stack(storage)
    assert fresh.cache.start_prefetch("r", TOKENS, "bob", 0, 3) == 0
    assert fresh.cache.start_prefetch("s", TOKENS, "alice", 0, 3) == 3
    fresh.cache.cancel_prefetch("s")
    st.close()
    fresh.close()


@pytest.mark.parametrize("host_mode", ["inclusive", "exclusive"])
def test_write_back_keeps_backing_up_once_the_host_is_full(host_mode: str) -> None:
    """write_back, a 4-page host, six 2-page nodes evicted from device one after another:
    each is copied to host (the host evicting its least recently used copies, already in
    storage) and written to storage. The inclusive host never evicted there: once full,
    every later victim was dropped, not even written (4 of 12 pages stored)."""
    storage = DictBackend()
    device_kv = torch.zeros(L, 2, P, S, H, D)
    allocator = PageAllocator(P)
    host = HostKVPool(4, KVGeometry.mha(L, H, D, "float32"), S)
    tree = HiRadixTree(S, allocator, host)
    cache = HiCache(tree, device_kv, storage,
                    HiCacheConfig(write_policy="write_back", host_mode=host_mode), FP)
    cache.start()
    try:
        for turn in range(6):
            tokens = list(range(1000 * turn, 1000 * turn + 2 * S))
            pages = allocator.alloc(2)
            assert pages is not None
            cache.backup(tokens, "", tree.insert(tokens, pages, "").last_node)
            tree.evict(2)
            assert cache.wait_idle(5)
        assert len(storage.pages) == 12
        assert cache.stats.backup_storage_pages == 12 and cache.stats.backup_skipped_pages == 0
        cache.check()
    finally:
        cache.close()
