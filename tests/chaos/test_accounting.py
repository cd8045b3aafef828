"""`pdcache chaos` leak accounting over a real unified server (tiny preset, host tier,
hf3fs storage on a temp dir): an idle node reads 0 leaked pages, and host pages held outside
the radix tree (a USED page no node owns, a tree page left pinned) are reported as leaked."""

from __future__ import annotations

import pytest

from pdcache.chaos.accounting import node_accounting
from pdcache.engine.loader import load_model
from tests.hicache_support import (
    PROMPT,
    check_every_tier,
    post,
    served,
    storage_config,
    tiered,
)


@pytest.fixture(scope="module")
def tiny():
    return load_model("tiny", seed=0)


def accounting(client) -> dict:
    health = client.get("/health")
    metrics = client.get("/metrics")
    assert health.status_code == 200 and metrics.status_code == 200
    return node_accounting(health.json(), metrics.text)


def test_host_pages_outside_the_tree_are_leaked_pages(tiny, tmp_path) -> None:
    storage = storage_config(tiny[0], backend="hf3fs", path=str(tmp_path))
    built = tiered(tiny, storage, host_pages=32)
    pool = built.hicache.host_pool
    with served(built) as client:
        post(client, PROMPT, 4)
        check_every_tier(built)
        idle = accounting(client)
        assert idle["leaked_pages"] == 0, idle
        assert idle["detail"]["host_pages_untracked"] == 0
        leaked = pool.alloc(3)  # a USED page nobody owns: what a lost free leaves behind
        assert leaked is not None
        pool.commit(leaked)
        tree_page = next(p for p in range(pool.capacity) if pool.is_used(p) and p not in leaked)
        pool.pin([tree_page])  # a load or backup that never unpinned
        reading = accounting(client)
        assert reading["detail"]["host_pages_untracked"] == 3
        assert reading["detail"]["host_pages_pinned_in_tree"] == 1
        assert reading["detail"]["host_pages_in_flight"] == 0
        assert reading["leaked_pages"] == 3 + 1
        pool.unpin([tree_page])
        pool.free(leaked)
        assert accounting(client)["leaked_pages"] == 0
