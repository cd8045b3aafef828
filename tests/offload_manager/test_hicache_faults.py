"""Storage faults at the server level (unified server app over the real tiny engine with
HiCache): a read-only storage directory, a full disk (a tiny tmpfs) and a storage pool far too
small, and the metadata service killed mid-run. Every request still succeeds with the tokens
of a no-cache run (recompute); the failures are counted in /metrics; the I/O workers keep
running and store again once storage is back; every tier's accounting holds afterwards."""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from pdcache.offload_manager.storage.metadata_service import LocalMetadataService
from tests.hicache_support import (
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

pytestmark = pytest.mark.slow

THIRD = [(13 * i + 1) % 250 for i in range(41)]


@pytest.fixture(scope="module")
def expected(tiny) -> dict[str, list[int]]:
    return {name: reference_tokens(tiny, prompt)
            for name, prompt in (("prompt", PROMPT), ("other", OTHER), ("third", THIRD))}


def _mount(*argv: str) -> bool:
    return subprocess.run(["mount", *argv], capture_output=True, timeout=10).returncode == 0


@contextmanager
def read_only(root: Path) -> Iterator[None]:
    """`root` as a read-only bind mount (root ignores file modes, so chmod would not do)."""
    if os.geteuid() != 0 or shutil.which("mount") is None:
        pytest.skip("a read-only bind mount needs root")
    if not _mount("--bind", str(root), str(root)):
        pytest.skip("bind mounts not permitted here")
    try:
        if not _mount("-o", "remount,bind,ro", str(root)):
            pytest.skip("read-only remount not permitted here")
        yield
    finally:
        subprocess.run(["umount", str(root)], capture_output=True, timeout=10)


@contextmanager
def small_tmpfs(size: str) -> Iterator[tuple[Path, Callable[[str], None]]]:
    """A tmpfs of `size` (a really full disk) and a function that resizes it."""
    if os.geteuid() != 0 or shutil.which("mount") is None:
        pytest.skip("mounting a tmpfs needs root")
    mnt = Path(tempfile.mkdtemp(prefix="pdcache-hicache-full-"))
    if not _mount("-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(mnt)):
        mnt.rmdir()
        pytest.skip("mount not permitted here")

    def resize(new_size: str) -> None:
        assert _mount("-o", f"remount,size={new_size}", str(mnt))

    try:
        yield mnt, resize
    finally:
        subprocess.run(["umount", str(mnt)], capture_output=True, timeout=10)
        mnt.rmdir()


def errors(client, kind: str) -> float:
    return metric(scrape(client), "pdcache_storage_errors_total", server="u0", kind=kind) or 0.0


def test_read_only_directory_serves_old_pages_and_recomputes_the_rest(
        tiny, expected, tmp_path) -> None:
    root = tmp_path / "hf3fs"
    cfg = storage_config(tiny[0], backend="hf3fs", path=str(root))
    first = tiered(tiny, cfg)
    with served(first) as client:
        post(client, PROMPT)
        check_every_tier(first)
    with read_only(root):
        built = tiered(tiny, cfg, prefetch_policy="wait_complete")
        with served(built) as client:
            out = post(client, PROMPT)  # reads still work
            assert out["output_ids"] == expected["prompt"]
            assert out["meta_info"]["cached_tokens_details"]["storage"] == 40
            out = post(client, OTHER)  # its backup fails: counted, nothing else
            assert out["output_ids"] == expected["other"]
            stats = check_every_tier(built)
            assert stats["read_only"] == 1 and stats["write_errors"] > 0
            assert built.hicache.stats.backup_failed_pages > 0
            assert errors(client, "write") > 0


def test_file_backend_turned_read_only_mid_run_recovers(tiny, expected, tmp_path) -> None:
    root = tmp_path / "files"
    root.mkdir()
    cfg = storage_config(tiny[0], backend="file", path=str(root))
    built = tiered(tiny, cfg)
    with served(built) as client:
        with read_only(root):
            out = post(client, PROMPT)
            assert out["output_ids"] == expected["prompt"]
            check_every_tier(built)
            failed = built.hicache.stats.backup_failed_pages
            assert failed > 0 and built.hicache.stats.backup_storage_pages == 0
        out = post(client, OTHER)  # storage is back: the same worker stores again
        assert out["output_ids"] == expected["other"]
        check_every_tier(built)
        assert built.hicache.stats.backup_storage_pages > 0
        assert built.hicache.stats.backup_failed_pages == failed
    fresh = tiered(tiny, cfg, prefetch_policy="wait_complete")
    with served(fresh) as client:
        out = post(client, OTHER)
        assert out["meta_info"]["cached_tokens_details"]["storage"] == 40
        assert out["output_ids"] == expected["other"]
        out = post(client, PROMPT)  # never stored: recomputed
        assert out["meta_info"]["cached_tokens"] == 0 and out["output_ids"] == expected["prompt"]
        check_every_tier(fresh)


def test_full_disk_fails_writes_then_recovers_when_it_grows(tiny, expected) -> None:
    with small_tmpfs("16k") as (mnt, resize):
        cfg = storage_config(tiny[0], backend="hf3fs", path=str(mnt))
        built = tiered(tiny, cfg)
        with served(built) as client:
            out = post(client, PROMPT)
            assert out["output_ids"] == expected["prompt"]
            stats = check_every_tier(built)
            # room for at most one 12 KiB slot of the 12 pages (prompt + answer KV)
            assert stats["write_errors"] >= 11 and stats["used_pages"] <= 1
            assert errors(client, "write") > 0
            resize("8m")  # room again: later backups go through
            out = post(client, OTHER)
            assert out["output_ids"] == expected["other"]
            stats = check_every_tier(built)
            assert stats["used_pages"] >= 10
        fresh = tiered(tiny, cfg, prefetch_policy="wait_complete")
        with served(fresh) as client:
            out = post(client, OTHER)
            assert out["meta_info"]["cached_tokens_details"]["storage"] == 40
            assert out["output_ids"] == expected["other"]
            check_every_tier(fresh)


def test_storage_pool_smaller_than_a_prompt_evicts_and_stays_exact(
        tiny, expected, tmp_path) -> None:
    cfg = storage_config(tiny[0], backend="hf3fs", path=str(tmp_path), capacity_pages=4)
    built = tiered(tiny, cfg)
    with served(built) as client:
        for name, prompt in (("prompt", PROMPT), ("other", OTHER)):
            assert post(client, prompt)["output_ids"] == expected[name]
        stats = check_every_tier(built)
        assert stats["used_pages"] == 4 and stats["evictions"] > 0
    fresh = tiered(tiny, cfg, prefetch_policy="wait_complete")
    with served(fresh) as client:
        for name, prompt in (("prompt", PROMPT), ("other", OTHER)):
            out = post(client, prompt)  # at most the 4 pages the pool holds are reused
            assert out["output_ids"] == expected[name]
            assert out["meta_info"]["cached_tokens_details"]["storage"] <= 4 * 4
        check_every_tier(fresh)


def test_metadata_service_killed_mid_run_then_restarted(tiny, expected, tmp_path) -> None:
    root = str(tmp_path / "hf3fs")
    service = LocalMetadataService(tmp_path / "state").start()
    try:
        cfg = storage_config(tiny[0], backend="hf3fs", path=root, metadata=service.address,
                             timeout_s=1.0, retry_interval_s=0.5)
        built = tiered(tiny, cfg, prefetch_policy="wait_complete")
        with served(built) as client:
            post(client, PROMPT)
            check_every_tier(built)
            service.stop(kill=True)
            out = post(client, OTHER)  # backup fails, the request does not
            assert out["output_ids"] == expected["other"]
            assert built.hicache.wait_idle(20)
            assert built.hicache.stats.backup_failed_pages > 0
            assert errors(client, "metadata") > 0
            down = tiered(tiny, cfg, prefetch_policy="wait_complete")  # a node starting now
            with served(down) as down_client:
                out = post(down_client, PROMPT)  # storage lookup fails: recompute
                assert out["output_ids"] == expected["prompt"]
                assert out["meta_info"]["cached_tokens"] == 0
                assert down.hicache.wait_idle(20)
            service.start()  # same port, same state directory
            out = post(client, THIRD)
            assert out["output_ids"] == expected["third"]
            check_every_tier(built)
        fresh = tiered(tiny, cfg, prefetch_policy="wait_complete")
        with served(fresh) as client:
            for name, prompt in (("prompt", PROMPT), ("third", THIRD)):
                out = post(client, prompt)
                assert out["meta_info"]["cached_tokens_details"]["storage"] == 40, name
                assert out["output_ids"] == expected[name]
            check_every_tier(fresh)
    finally:
        service.stop()
