"""Restart: `pdcache serve` processes on one hf3fs directory and one `pdcache metadata-server`.
A prompt served before a server restart is a storage hit afterwards with the same tokens; the
metadata service killed with SIGKILL and restarted alone on its state directory keeps its
index (every committed page is still found) and the running server keeps storing through it."""

from __future__ import annotations

import time

import pytest

from pdcache.engine.presets import PRESETS
from pdcache.offload_manager.storage import create_backend
from pdcache.offload_manager.storage.metadata_service import LocalMetadataService
from tests.hicache_support import OTHER, PROMPT, ServeProcess, metric, prompt_keys, storage_config

pytestmark = pytest.mark.slow

NEW_TOKENS = 8
STORED_PAGES = (len(PROMPT) + NEW_TOKENS - 1) // 4  # prompt + answer KV, page 4
CAPACITY = 4 << 20


def serve(storage_dir: str, service: LocalMetadataService) -> ServeProcess:
    return ServeProcess(
        "--host-pages", "64", "--storage-backend", "hf3fs", "--storage-path", storage_dir,
        "--storage-capacity", "4MiB", "--storage-metadata", service.address,
        "--prefetch-policy", "wait_complete", "--name", "u0",
    )


def wait_backed_up(server: ServeProcess, pages: int, timeout_s: float = 60.0) -> dict:
    """Until /metrics says `pages` pages reached storage (writes are asynchronous)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        m = server.metrics()
        done = metric(m, "pdcache_backup_pages_total", server="u0", tier="storage")
        if done is not None and done >= pages:
            return m
        time.sleep(0.2)
    raise AssertionError(f"{pages} pages not backed up to storage within {timeout_s}s")


def stopped_cleanly(server: ServeProcess) -> bool:
    code = server.stop()  # uvicorn re-raises the SIGTERM it handled: -15 is a clean exit
    return code in (0, -15) and not any("Traceback" in line for line in server.log)


def test_server_and_metadata_service_restarts_keep_the_cache(tmp_path) -> None:
    storage_dir = str(tmp_path / "hf3fs")
    cfg = storage_config(PRESETS["tiny"], backend="hf3fs", path=storage_dir, capacity_pages=0,
                         capacity_bytes=CAPACITY)
    service = LocalMetadataService(tmp_path / "meta-state").start()
    servers: list[ServeProcess] = []
    try:
        first = serve(storage_dir, service)
        servers.append(first)
        cold = first.generate(PROMPT, NEW_TOKENS)
        assert cold["meta_info"]["cached_tokens"] == 0
        wait_backed_up(first, STORED_PAGES)
        assert stopped_cleanly(first), "".join(first.log[-30:])

        second = serve(storage_dir, service)  # fresh process: empty device and host tiers
        servers.append(second)
        warm = second.generate(PROMPT, NEW_TOKENS)
        details = warm["meta_info"]["cached_tokens_details"]
        assert details["storage"] == 40 and details["device"] == details["host"] == 0
        assert warm["output_ids"] == cold["output_ids"]
        wait_backed_up(second, STORED_PAGES)  # its own write-through (present pages skipped)

        service.stop(kill=True)  # SIGKILL: no clean shutdown of the index
        service.start()
        probe = create_backend(cfg.replace(metadata=service.address))
        try:
            assert probe.exists_prefix(prompt_keys(cfg, PROMPT)) == 10  # the index survived
            other = second.generate(OTHER, NEW_TOKENS)  # the server stores through it again
            assert other["meta_info"]["cached_tokens"] == 0
            m = wait_backed_up(second, STORED_PAGES + (len(OTHER) + NEW_TOKENS - 1) // 4)
            assert probe.exists_prefix(prompt_keys(cfg, OTHER)) == 10
            stats = probe.stats()
        finally:
            probe.close()
        assert stats["used_pages"] == 2 * STORED_PAGES and stats["reserved_pages"] == 0
        assert stats["used_pages"] + stats["free_pages"] == stats["capacity_pages"]
        pages = {s: metric(m, "pdcache_storage_pages", server="u0", state=s)
                 for s in ("used", "free", "reserved")}
        assert sum(pages.values()) == metric(m, "pdcache_storage_pages_total", server="u0")
        assert stopped_cleanly(second), "".join(second.log[-30:])
    except BaseException:
        for server in servers:  # shown by pytest on failure
            server.stop()
            print("---- server log ----\n" + "".join(server.log[-60:]))
        raise
    finally:
        for server in servers:
            server.stop()
        service.stop()
