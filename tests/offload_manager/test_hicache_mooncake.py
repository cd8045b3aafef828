"""HiCache over the Mooncake Store backend (a real `mooncake_master` on loopback), at the
server level: a prompt served from device, host and storage (a second node with fresh tiers
reading what the first one stored) gives the tokens of a no-cache run; the master killed
mid-run costs only storage hits, and once it is back the same node stores again."""

from __future__ import annotations

import os
import time

import pytest

os.environ.setdefault("MC_TCP_BIND_ADDRESS", "127.0.0.1")
os.environ.setdefault("MC_LOG_LEVEL", "ERROR")

from tests.hicache_support import (  # noqa: E402
    OTHER,
    PROMPT,
    check_every_tier,
    metric,
    post,
    reference_tokens,
    scrape,
    served,
    storage_config,
    tiered,
)

pytest.importorskip("mooncake.store")
from pdcache.offload_manager.storage.mooncake_store import LocalMooncakeMaster  # noqa: E402

pytestmark = pytest.mark.slow

THIRD = [(13 * i + 1) % 250 for i in range(41)]
MB = 1 << 20


@pytest.fixture
def master():
    master = LocalMooncakeMaster().start()
    try:
        yield master
    finally:
        master.stop()


def mooncake_config(tiny, master: LocalMooncakeMaster):
    return storage_config(tiny[0], backend="mooncake", mooncake_master=master.address,
                          mooncake_segment_bytes=16 * MB, mooncake_local_buffer_bytes=16 * MB,
                          retry_interval_s=0.5)


def test_device_host_and_mooncake_hits_are_exact(tiny, master) -> None:
    expected = reference_tokens(tiny, PROMPT)
    cfg = mooncake_config(tiny, master)
    first = tiered(tiny, cfg, prefetch_policy="wait_complete")
    with served(first) as client:
        out = post(client, PROMPT)
        assert out["output_ids"] == expected and out["meta_info"]["cached_tokens"] == 0
        out = post(client, PROMPT)
        assert out["output_ids"] == expected
        assert out["meta_info"]["cached_tokens_details"]["device"] == 40
        first.engine.flush_cache()  # device pages demoted to their host copies
        out = post(client, PROMPT)
        assert out["output_ids"] == expected
        details = out["meta_info"]["cached_tokens_details"]
        assert (details["device"], details["host"]) == (0, 40)
        stats = check_every_tier(first)
        assert first.hicache.stats.backup_storage_pages >= 10 and stats["used_pages"] >= 10
        # a second node, fresh tiers, same store (the objects live in the first one's segment)
        second = tiered(tiny, mooncake_config(tiny, master), prefetch_policy="wait_complete")
        with served(second) as other_client:
            out = post(other_client, PROMPT)
            assert out["output_ids"] == expected
            details = out["meta_info"]["cached_tokens_details"]
            assert (details["device"], details["host"], details["storage"]) == (0, 0, 40)
            assert second.hicache.stats.prefetch_pages == 10
            longer = PROMPT + expected + [5, 6, 7]
            out = post(other_client, longer)
            assert out["output_ids"] == reference_tokens(tiny, longer)
            assert out["meta_info"]["cached_tokens"] >= 40
            check_every_tier(second)
            assert second.storage.stats()["corrupt_pages"] == 0


def _wait_store_back(built, timeout_s: float = 20.0) -> None:
    """Until the restarted master accepts this client's writes again (it remounts its
    segment on its next ping, about a second)."""
    probe_key = b"\xee" * 32
    page = built.hicache.host_pool.page_bytes([0])
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if built.storage.put_from([probe_key], page) == [True]:
            built.storage.delete([probe_key])
            return
        time.sleep(0.3)
    raise AssertionError("the store did not come back")


def test_master_killed_mid_run_then_restarted(tiny, master) -> None:
    expected = {"other": reference_tokens(tiny, OTHER), "third": reference_tokens(tiny, THIRD)}
    cfg = mooncake_config(tiny, master)
    built = tiered(tiny, cfg, prefetch_policy="wait_complete")
    with served(built) as client:
        post(client, PROMPT)
        check_every_tier(built)
        master.stop()  # SIGKILL
        out = post(client, OTHER)
        assert out["output_ids"] == expected["other"]
        assert built.hicache.wait_idle(20)
        assert built.hicache.stats.backup_failed_pages > 0
        assert metric(scrape(client), "pdcache_storage_errors_total", server="u0",
                      kind="metadata") > 0
        master.start()  # same port, empty store
        _wait_store_back(built)
        stored = built.hicache.stats.backup_storage_pages
        out = post(client, THIRD)
        assert out["output_ids"] == expected["third"]
        check_every_tier(built)
        assert built.hicache.stats.backup_storage_pages > stored
        second = tiered(tiny, mooncake_config(tiny, master), prefetch_policy="wait_complete")
        with served(second) as other_client:
            out = post(other_client, THIRD)
            assert out["meta_info"]["cached_tokens_details"]["storage"] == 40
            assert out["output_ids"] == expected["third"]
            check_every_tier(second)
