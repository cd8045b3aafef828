"""DecodeOffloadManager backpressure: when staging cannot hold a whole batch, the head of the
chain is written and only the tail is dropped (a chain's head is what later lookups find)."""

from __future__ import annotations

import threading

import torch

from pdcache.engine.page_keys import chain_page_keys, make_salt
from pdcache.offload_manager.decode_offload import DecodeOffloadManager
from tests.storage_doubles import DictBackend

LAYERS, PAGES, PAGE, HEADS, DIM = 2, 16, 4, 2, 8
FP = "staging-test"


def test_short_staging_keeps_the_chain_head_and_drops_the_tail() -> None:
    kv = torch.randn(LAYERS, 2, PAGES, PAGE, HEADS, DIM, generator=torch.Generator().manual_seed(1))
    storage = DictBackend()
    mgr = DecodeOffloadManager(kv, storage, FP, staging_pages=3).start()
    tokens = list(range(6 * PAGE))
    pages = [9, 1, 4, 12, 3, 7]
    mgr.track("r")
    released = threading.Event()
    mgr.finish("r", tokens, pages, released.set)  # one batch of 6 pages, 3 staging pages
    assert released.wait(10) and mgr.wait_idle(10)
    keys = chain_page_keys(tokens, PAGE, make_salt(FP))
    assert storage.exists_prefix(keys) == 3
    for key, page in zip(keys[:3], pages[:3]):
        assert storage.pages[key] == kv[:, :, page].contiguous().numpy().tobytes()
    assert (mgr.stats.pages_offloaded, mgr.stats.pages_dropped) == (3, 3)
    mgr.check()
    snap = mgr.snapshot()
    assert snap["staging_pages_used"] == 0 and snap["pending_copies"] == 0
    mgr.close()
