"""Observability of the lower tiers through the unified server's /metrics (real tiny engine,
hf3fs storage on a temp dir): backup pages by tier, prefetch pages and bytes, host pool
pages by state, host evictions, I/O queue depths, storage pages and corrupt pages."""

from __future__ import annotations

from fastapi.testclient import TestClient

from pdcache.server.app import ServerConfig, create_app
from tests.hicache_support import (
    OTHER,
    PROMPT,
    PROMPT_PAGES,
    check_every_tier,
    data_files,
    metric,
    post,
    scrape,
    served,
    storage_config,
    tiered,
)

SERVER = "u0"
NEW_TOKENS = 4
# the prompt and the answer's KV (all but the last token) go into the tree: 44 tokens
FINISHED_PAGES = (len(PROMPT) + NEW_TOKENS - 1) // 4


def value(samples: dict, name: str, **labels: str) -> float:
    found = metric(samples, name, server=SERVER, **labels)
    assert found is not None, f"{name}{labels} not exported"
    return found


def test_backup_prefetch_and_pool_series(tiny, tmp_path) -> None:
    model = tiny[0]
    storage = storage_config(model, backend="hf3fs", path=str(tmp_path))
    built = tiered(tiny, storage, host_pages=12, prefetch_policy="wait_complete")
    page_bytes = built.hicache.host_pool.page_nbytes
    with served(built) as client:
        post(client, PROMPT, NEW_TOKENS)
        check_every_tier(built)
        m = scrape(client)
        assert value(m, "pdcache_backup_pages_total", tier="host") == FINISHED_PAGES
        assert value(m, "pdcache_backup_pages_total", tier="storage") == FINISHED_PAGES
        assert value(m, "pdcache_host_pages", state="used") == FINISHED_PAGES
        assert value(m, "pdcache_host_pages", state="free") == 12 - FINISHED_PAGES
        assert value(m, "pdcache_host_pages", state="in_flight") == 0
        assert value(m, "pdcache_host_pages_total") == 12
        assert value(m, "pdcache_io_queue_depth", queue="backup") == 0
        assert value(m, "pdcache_io_queue_depth", queue="prefetch") == 0
        assert value(m, "pdcache_storage_pages", state="used") == FINISHED_PAGES
        assert value(m, "pdcache_storage_pages_total") == 256
        assert value(m, "pdcache_host_evicted_pages_total") == 0
        post(client, OTHER, NEW_TOKENS)  # 10 more pages into a 12-page host pool: LRU host eviction
        check_every_tier(built)
        m = scrape(client)
        assert value(m, "pdcache_host_evicted_pages_total") >= 2 * FINISHED_PAGES - 12
        assert value(m, "pdcache_backup_pages_total", tier="host") == 2 * FINISHED_PAGES
        assert value(m, "pdcache_storage_pages", state="used") == 2 * FINISHED_PAGES
    fresh = tiered(tiny, storage, host_pages=12, prefetch_policy="wait_complete")
    with served(fresh) as client:
        out = post(client, PROMPT, NEW_TOKENS)
        assert out["meta_info"]["cached_tokens_details"]["storage"] == PROMPT_PAGES * 4
        check_every_tier(fresh)
        m = scrape(client)
        assert value(m, "pdcache_prefetch_pages_total") == PROMPT_PAGES
        assert value(m, "pdcache_prefetch_bytes_total") == PROMPT_PAGES * page_bytes
        assert value(m, "pdcache_load_pages_total") == PROMPT_PAGES
        assert metric(m, "pdcache_cached_tokens_total", tier="storage") == PROMPT_PAGES * 4
        assert value(m, "pdcache_storage_read_bytes_total") >= PROMPT_PAGES * page_bytes
        assert value(m, "pdcache_storage_corrupt_pages_total") == 0


def test_corrupt_pages_and_storage_errors_are_exported(tiny, tmp_path) -> None:
    model = tiny[0]
    storage = storage_config(model, backend="hf3fs", path=str(tmp_path))
    built = tiered(tiny, storage)
    generate_and_close = served(built)
    with generate_and_close as client:
        post(client, PROMPT, NEW_TOKENS)
        check_every_tier(built)
    for path in data_files(tmp_path):
        raw = bytearray(path.read_bytes())
        for offset in range(2048, len(raw), 4096):  # one flipped byte per 4 KiB
            raw[offset] ^= 0xFF
        path.write_bytes(bytes(raw))
    fresh = tiered(tiny, storage, prefetch_policy="wait_complete")
    with served(fresh) as client:
        out = post(client, PROMPT, NEW_TOKENS)
        assert out["meta_info"]["cached_tokens_details"]["storage"] == 0
        check_every_tier(fresh)
        m = scrape(client)
        assert value(m, "pdcache_storage_corrupt_pages_total") >= 1
        assert value(m, "pdcache_prefetch_failed_pages_total") >= 1
        assert value(m, "pdcache_prefetch_pages_total") == 0


def test_device_only_server_exports_no_tier_series(tiny) -> None:
    from pdcache.engine.engine import Engine
    from tests.hicache_support import engine_config

    model, tokenizer = tiny
    engine = Engine(engine_config(model), model, tokenizer)
    app = create_app(engine, ServerConfig(name=SERVER))
    with TestClient(app) as client:
        post(client, PROMPT, NEW_TOKENS)
        m = scrape(client)
    assert metric(m, "pdcache_host_pages_total", server=SERVER) is None
    assert metric(m, "pdcache_cached_tokens_total", tier="device") is not None
