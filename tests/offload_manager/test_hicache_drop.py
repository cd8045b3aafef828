"""`Engine.drop_cache` with HiCache (what a node's `/flush_cache` calls): device and host tiers
dropped once idle, no backup on the way (write_back), storage untouched; refused while busy."""

from __future__ import annotations

import pytest

from pdcache.engine.api import GenerateRequest, SamplingParams
from tests.hicache_support import PROMPT, PROMPT_PAGES, generate, storage_config, tiered


@pytest.mark.parametrize("policy", ["write_through", "write_back"])
def test_drop_cache_empties_device_and_host_not_storage(tiny, tmp_path, policy: str) -> None:
    storage = storage_config(tiny[0], backend="file", path=str(tmp_path / "pages"))
    built = tiered(tiny, storage, write_policy=policy)
    try:
        generate(built.engine, "r1", PROMPT)
        assert built.hicache.wait_idle(20)
        stored = built.storage.stats()
        backups = built.hicache.snapshot()["backup_host_pages"]
        result = built.engine.drop_cache()
        assert result.flushed and result.device_pages > 0
        assert result.host_pages == backups  # every host copy, and only after write_through
        assert (backups >= PROMPT_PAGES) if policy == "write_through" else (backups == 0)
        assert built.hicache.snapshot()["backup_host_pages"] == backups  # nothing backed up
        assert built.hicache.host_pool.num_used == 0
        assert built.engine.stats()["cached_pages"] == 0
        assert built.storage.stats() == stored  # storage untouched
        _, final = generate(built.engine, "r2", PROMPT)
        assert final.cached.device == final.cached.host == 0
        assert final.cached.storage == (PROMPT_PAGES * 4 if policy == "write_through" else 0)
        built.engine.check_accounting()
        built.hicache.check()
    finally:
        built.close()


def test_drop_cache_refuses_while_a_request_runs(tiny) -> None:
    built = tiered(tiny, None)
    try:
        engine = built.engine
        engine.submit(GenerateRequest("long", PROMPT, SamplingParams(max_new_tokens=300,
                                                                      ignore_eos=True)),
                      lambda out: None)
        busy = engine.drop_cache()
        assert not busy.flushed and busy.busy_requests == 1
        assert busy.reason == "1 requests in flight"
        engine.abort("long")
    finally:
        built.close()
