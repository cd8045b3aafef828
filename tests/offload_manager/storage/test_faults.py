"""Storage faults: full or read-only disks, a killed metadata service or mooncake_master.

Every fault must turn into misses / False results (counted), never an exception or a hang, and
the backend must recover when the service returns.
"""

from __future__ import annotations

import contextlib
import json
import os
import resource
import select
import shutil
import signal
import socket
import subprocess
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import msgpack
import pytest
import torch

os.environ.setdefault("MC_TCP_BIND_ADDRESS", "127.0.0.1")
os.environ.setdefault("MC_LOG_LEVEL", "ERROR")

from pdcache.offload_manager.storage import create_backend  # noqa: E402
from pdcache.offload_manager.storage.config import StorageConfig  # noqa: E402
from pdcache.offload_manager.storage.metadata import RemoteMetadata  # noqa: E402
from pdcache.offload_manager.storage.metadata_service import LocalMetadataService  # noqa: E402
from tests.polling import wait_until  # noqa: E402

PAGE_BYTES = 4096
SLOT_BYTES = 8192  # header + 4096 rounded up to 4 KiB


def _config(path: Path | str, backend: str = "hf3fs", **over: object) -> StorageConfig:
    values: dict[str, object] = dict(
        backend=backend,
        path=str(path),
        page_bytes=PAGE_BYTES,
        capacity_pages=4,
        fingerprint="fp",
        num_data_files=1,
        timeout_s=0.5,
        retry_interval_s=0.3,
    )
    values.update(over)
    return StorageConfig(**values)  # type: ignore[arg-type]


def _keys(n: int, tag: int = 0) -> list[bytes]:
    return [bytes([tag, i]) * 16 for i in range(n)]


def _pages(n: int, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (n, PAGE_BYTES), dtype=torch.uint8, generator=gen)


def _limited_put_get(cfg: StorageConfig, limit: int) -> dict:
    """Open a backend, cap file sizes at `limit` bytes, put and get 4 pages."""
    backend = create_backend(cfg)
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # writes past the limit fail with EFBIG
    resource.setrlimit(resource.RLIMIT_FSIZE, (limit, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))
    keys, pages = _keys(4), _pages(4)
    put = backend.put_from(keys, list(pages))
    out = torch.zeros_like(pages)
    got = backend.get_into(keys, list(out))
    exact = [bool(torch.equal(out[i], pages[i])) for i in range(4)]
    result = {"put": put, "got": got, "exact": exact, "stats": backend.stats()}
    backend.close()
    return result


def _in_forked_child(fn: Callable[[], dict], timeout_s: float = 60.0) -> dict:
    """Run `fn` in a forked child (its rlimits and signals stay there); its JSON result.

    Forking keeps torch imported (a fresh interpreter takes seconds to import it)."""
    read_fd, write_fd = os.pipe()
    pid = os.fork()
    if pid == 0:  # child: never return into pytest
        code = 0
        try:
            payload = json.dumps(fn())
        except BaseException as exc:
            payload, code = json.dumps({"child_error": repr(exc)}), 1
        with os.fdopen(write_fd, "w") as out:
            out.write(payload)
        os._exit(code)
    os.close(write_fd)
    try:
        ready, _, _ = select.select([read_fd], [], [], timeout_s)
        if not ready:
            os.kill(pid, signal.SIGKILL)
            raise AssertionError(f"child did not finish within {timeout_s}s")
        with os.fdopen(read_fd, "r") as src:
            result = json.loads(src.read())
    finally:
        os.waitpid(pid, 0)
    assert "child_error" not in result, result
    return result


def _full_then_more(cfg: StorageConfig, limit: int) -> dict:
    """`_limited_put_get`'s 4 pages, then 4 more under new keys on the same backend."""
    backend = create_backend(cfg)
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # writes past the limit fail with EFBIG
    resource.setrlimit(resource.RLIMIT_FSIZE, (limit, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))
    result: dict = {"put": backend.put_from(_keys(4), list(_pages(4))),
                    "stats": backend.stats()}
    keys, pages = _keys(4, tag=1), _pages(4, seed=1)
    # two at a time: the pool holds 2 pages now (a batch of 4 reserves 2 and finds it full)
    result["more_put"] = (backend.put_from(keys[:2], list(pages[:2]))
                          + backend.put_from(keys[2:], list(pages[2:])))
    out = torch.zeros_like(pages)
    result["more_got"] = backend.get_into(keys[2:], list(out[2:]))
    result["more_exact"] = bool(torch.equal(out[2:], pages[2:]))
    backend.close()
    return result


def test_hf3fs_disk_full_shrinks_the_pool_and_keeps_storing(tmp_path: Path) -> None:
    """Sparse data files: a slot gets its blocks on its first write. The slots the file
    system had no room for went back to the free list and were handed out again and again:
    the store refused every later page for good, though it could evict into written slots."""
    cfg = _config(tmp_path / "store")
    result = _in_forked_child(lambda: _full_then_more(cfg, limit=2 * SLOT_BYTES))
    assert result["put"] == [True, True, False, False]
    stats = result["stats"]
    assert stats["write_errors"] == 2 and stats["retired_slots"] == 2
    assert (stats["used_pages"], stats["reserved_pages"], stats["free_pages"],
            stats["retired_pages"]) == (2, 0, 0, 2)
    # the store keeps storing in the slots it could write (evicting the oldest)
    assert result["more_put"] == [True] * 4
    assert result["more_got"] == [True, True] and result["more_exact"]


def test_file_disk_full_fails_puts_and_leaves_no_temp_files(tmp_path: Path) -> None:
    cfg = _config(tmp_path / "store", backend="file", capacity_pages=0)
    result = _in_forked_child(lambda: _limited_put_get(cfg, limit=PAGE_BYTES // 2))
    assert result["put"] == [False] * 4 and result["got"] == [False] * 4
    assert result["stats"]["write_errors"] == 4
    assert [p for p in (tmp_path / "store").rglob("*") if p.is_file()] == []


def test_file_backend_removes_stale_temp_files_on_open(tmp_path: Path) -> None:
    cfg = _config(tmp_path, "file", capacity_pages=0)
    create_backend(cfg).close()
    shard = tmp_path / cfg.namespace / "ab"
    shard.mkdir()
    stale, fresh = shard / ".x.page.1.tmp", shard / ".y.page.2.tmp"
    stale.write_bytes(b"partial")
    fresh.write_bytes(b"in flight")
    os.utime(stale, (time.time() - 3600, time.time() - 3600))
    create_backend(cfg).close()
    assert not stale.exists() and fresh.exists()


@pytest.fixture
def tiny_tmpfs() -> Iterator[Path]:
    """A 64 KiB tmpfs (a really full disk: ENOSPC), where this process may mount one."""
    if os.geteuid() != 0 or shutil.which("mount") is None:
        pytest.skip("mounting a tmpfs needs root")
    mnt = Path(tempfile.mkdtemp(prefix="pdcache-full-"))
    ok = (
        subprocess.run(
            ["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(mnt)],
            capture_output=True,
            timeout=10,
        ).returncode
        == 0
    )
    if not ok:
        mnt.rmdir()
        pytest.skip("mount not permitted here")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", str(mnt)], capture_output=True, timeout=10)
        mnt.rmdir()


@pytest.mark.parametrize("backend_name", ["hf3fs", "file"])
def test_enospc_on_a_full_tmpfs(tiny_tmpfs: Path, backend_name: str) -> None:
    backend = create_backend(_config(tiny_tmpfs, backend_name, capacity_pages=32))
    try:
        keys, pages = _keys(24), _pages(24)
        put = backend.put_from(keys, list(pages))
        assert put[0] and not put[-1]  # 64 KiB holds a few pages, not 24
        written = sum(put)
        assert backend.stats()["write_errors"] == 24 - written
        out = torch.zeros_like(pages)
        assert backend.get_into(keys, list(out)) == put
        assert torch.equal(out[:written], pages[:written])
    finally:
        backend.close()


@contextlib.contextmanager
def _read_only(root: Path) -> Iterator[None]:
    """Make `root` read-only: chmod for a normal user; a read-only bind mount for root, which
    ignores permissions (skips where mounting is not permitted)."""
    if os.geteuid() != 0:
        modes = {p: p.stat().st_mode for p in [root, *root.rglob("*")]}
        for path in modes:
            path.chmod(0o555 if path.is_dir() else 0o444)
        try:
            yield
        finally:
            for path, mode in modes.items():
                path.chmod(mode)
        return
    bind = ["mount", "--bind", str(root), str(root)]
    if subprocess.run(bind, capture_output=True, timeout=10).returncode != 0:
        pytest.skip("root cannot bind-mount here, so it cannot make a directory read-only")
    try:
        remount = ["mount", "-o", "remount,bind,ro", str(root)]
        if subprocess.run(remount, capture_output=True, timeout=10).returncode != 0:
            pytest.skip("read-only remount not permitted")
        yield
    finally:
        subprocess.run(["umount", str(root)], capture_output=True, timeout=10)


@pytest.mark.parametrize("backend_name", ["hf3fs", "file"])
def test_read_only_directory_reads_work_puts_fail(tmp_path: Path, backend_name: str) -> None:
    cfg = _config(tmp_path / "store", backend_name, capacity_pages=16)
    keys, pages = _keys(8), _pages(8)
    writer = create_backend(cfg)
    assert writer.put_from(keys[:4], list(pages[:4])) == [True] * 4
    writer.close()
    with _read_only(tmp_path / "store"):
        backend = create_backend(cfg)  # a restart on a read-only directory
        try:
            out = torch.zeros_like(pages)
            assert backend.get_into(keys[:4], list(out[:4])) == [True] * 4
            assert torch.equal(out[:4], pages[:4])
            assert backend.put_from(keys[4:], list(pages[4:])) == [False] * 4
            assert backend.get_into(keys[4:], list(out[4:])) == [False] * 4
            stats = backend.stats()
        finally:
            backend.close()
    assert stats["write_errors"] == 4 and stats["pages_read"] == 4
    if backend_name == "hf3fs":
        assert stats["read_only"] == 1 and stats["reserved_pages"] == 0


def test_a_read_only_node_on_a_shared_full_pool_evicts_nothing(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """hf3fs, one metadata index shared by a writer and a node that can only read (its data
    files opened read-only): with the pool full, the read-only node's puts fail counted and
    leave every stored page alone. They reserved slots before — evicting the writer's least
    recently used pages for writes that then failed (4 of 8 pages gone for 4 puts)."""
    import errno as errnos

    from pdcache.offload_manager.storage.hf3fs import Hf3fsBackend
    from pdcache.offload_manager.storage.metadata import InProcMetadata

    cfg = _config(tmp_path / "store", "hf3fs", capacity_pages=8)
    shared = InProcMetadata(8)
    keys, pages = _keys(12), _pages(12)
    writer = Hf3fsBackend(cfg, shared)
    assert writer.put_from(keys[:8], list(pages[:8])) == [True] * 8  # the pool is full
    real_open = os.open

    def no_write_access(path, flags, *args):  # what a read-only mount answers
        if flags & os.O_RDWR:
            raise OSError(errnos.EROFS, "Read-only file system", str(path))
        return real_open(path, flags, *args)

    monkeypatch.setattr(os, "open", no_write_access)
    reader = Hf3fsBackend(cfg.replace(recover_index=False), shared)
    monkeypatch.setattr(os, "open", real_open)
    try:
        assert reader.stats()["read_only"] == 1
        assert reader.put_from(keys[8:], list(pages[8:])) == [False] * 4
        reader.delete(keys[:2])  # nor does its delete free the writer's slots
        out = torch.zeros_like(pages[:8])
        assert writer.get_into(keys[:8], list(out)) == [True] * 8
        assert torch.equal(out, pages[:8])
        assert reader.stats()["write_errors"] == 4
    finally:
        reader.close()
        writer.close()


@pytest.mark.parametrize("backend_name", ["hf3fs", "file"])
def test_empty_read_only_directory_only_misses(tmp_path: Path, backend_name: str) -> None:
    (tmp_path / "store").mkdir()
    cfg = _config(tmp_path / "store", backend_name)
    with _read_only(tmp_path / "store"):
        backend = create_backend(cfg)
        try:
            keys, pages = _keys(2), _pages(2)
            assert backend.put_from(keys, list(pages)) == [False, False]
            assert backend.get_into(keys, list(pages)) == [False, False]
            assert backend.exists_prefix(keys) == 0
            assert backend.stats()["write_errors"] == 2
        finally:
            backend.close()


@pytest.fixture
def service(tmp_path: Path) -> Iterator[LocalMetadataService]:
    svc = LocalMetadataService(tmp_path / "state").start()
    try:
        yield svc
    finally:
        svc.stop(kill=True)


def _timed(fn, *args):
    start = time.monotonic()
    result = fn(*args)
    return result, time.monotonic() - start


def test_metadata_service_killed_then_restarted(tmp_path: Path, service) -> None:
    backend = create_backend(_config(tmp_path / "data", metadata=service.address, capacity_pages=8))
    try:
        keys, pages = _keys(6), _pages(6)
        assert backend.put_from(keys[:4], list(pages[:4])) == [True] * 4
        service.stop(kill=True)
        out = torch.zeros_like(pages)
        got, took = _timed(backend.get_into, keys[:4], list(out[:4]))
        assert got == [False] * 4 and took < 3.0
        assert backend.put_from(keys[4:], list(pages[4:])) == [False, False]
        assert backend.exists_prefix(keys) == 0
        assert backend.stats()["metadata_errors"] >= 1
        service.start()
        deadline = time.monotonic() + 10
        while backend.exists_prefix(keys) == 0 and time.monotonic() < deadline:
            time.sleep(0.1)
        # Committed before the SIGKILL: all still there, byte-exact.
        assert backend.get_into(keys[:4], list(out[:4])) == [True] * 4
        assert torch.equal(out[:4], pages[:4])
        assert backend.put_from(keys[4:], list(pages[4:])) == [True, True]
        assert backend.exists_prefix(keys) == 6
    finally:
        backend.close()


@pytest.mark.parametrize("kill", [True, False], ids=["sigkill", "sigterm"])
def test_metadata_restart_keeps_every_committed_entry(service, kill: bool) -> None:
    client = RemoteMetadata(service.address, "pool", 64, SLOT_BYTES, timeout_s=2.0)
    try:
        keys = _keys(40, tag=7)
        for start in range(0, 40, 8):
            batch = keys[start : start + 8]
            slots = [slot for _, slot in client.reserve(batch)]
            assert client.commit(batch, slots) == [True] * 8
        client.delete(keys[10:12])
        client.lookup(
            keys[:1]
        )  # recency of keys[0] is flushed lazily; entries must not depend on it
        in_flight = client.reserve(_keys(1, tag=9))[0][1]
        before = dict(client.entries())
        service.stop(kill=kill)
        service.start()
        after = RemoteMetadata(service.address, "pool", 64, SLOT_BYTES, timeout_s=2.0)
        try:
            assert dict(after.entries()) == before and len(before) == 38
            # The reservation did not survive: its commit fails, its slot is free again.
            assert after.commit(_keys(1, tag=9), [in_flight]) == [False]
            stats = after.stats()
            assert (stats["used_pages"], stats["reserved_pages"], stats["free_pages"]) == (
                38,
                0,
                26,
            )
        finally:
            after.close()
    finally:
        client.close()


def test_mooncake_master_killed_gives_misses_without_hanging() -> None:
    pytest.importorskip("mooncake.store")
    from pdcache.offload_manager.storage.mooncake_store import LocalMooncakeMaster

    master = LocalMooncakeMaster().start()
    backend = None
    try:
        cfg = _config(
            "unused",
            "mooncake",
            mooncake_master=master.address,
            mooncake_segment_bytes=16 << 20,
            mooncake_local_buffer_bytes=16 << 20,
            retry_interval_s=2.0,
        )
        backend = create_backend(cfg)
        keys, pages = _keys(3), _pages(3)
        assert backend.put_from(keys[:2], list(pages[:2])) == [True, True]
        master.stop()
        got, took = _timed(backend.get_into, keys[:2], list(torch.zeros_like(pages[:2])))
        assert got == [False, False] and took < 15.0
        (got, took) = _timed(backend.get_into, keys[:2], list(torch.zeros_like(pages[:2])))
        assert got == [False, False] and took < 1.0  # fails fast while the master is down
        assert backend.exists_prefix(keys) == 0
        assert backend.put_from(keys[2:], [pages[2]]) == [False]
        assert backend.stats()["metadata_errors"] >= 1
    finally:
        if backend is not None:
            backend.close()
        master.stop()


@pytest.mark.parametrize("backend_name", ["hf3fs", "file"])
def test_concurrent_readers_and_writers_never_see_wrong_bytes(
    tmp_path: Path, backend_name: str
) -> None:
    """Threads put and get over a store smaller than the key space (constant eviction):
    every page a get reports as found is byte-exact."""
    backend = create_backend(_config(tmp_path, backend_name, capacity_pages=6, io_threads=2))
    keys, pages = _keys(16), _pages(16)
    wrong: list[int] = []
    hits = [0]

    def worker(seed: int) -> None:
        gen = torch.Generator().manual_seed(seed)
        out = torch.zeros(4, PAGE_BYTES, dtype=torch.uint8)
        for _ in range(60):
            idx = torch.randint(0, 16, (4,), generator=gen).tolist()
            backend.put_from([keys[i] for i in idx[:2]], [pages[i] for i in idx[:2]])
            found = backend.get_into([keys[i] for i in idx], list(out))
            for j, ok in enumerate(found):
                hits[0] += ok
                if ok and not torch.equal(out[j], pages[idx[j]]):
                    wrong.append(idx[j])

    threads = [threading.Thread(target=worker, args=(s,)) for s in range(4)]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=60)
        assert not any(t.is_alive() for t in threads)
        assert wrong == [] and hits[0] > 0
        stats = backend.stats()
        assert stats["used_pages"] <= 6
    finally:
        backend.close()


class StalledWrite:
    """The file backend's write of `key` stalls until `release` (a slow disk under one put
    while other puts run): `started` is set once its slot is reserved and its file begun."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, key: bytes) -> None:
        from pdcache.offload_manager.storage.file import FileBackend

        self.started, self.release = threading.Event(), threading.Event()
        write = FileBackend._write_atomic

        def stalled(backend, path, header, payload) -> None:
            if path == backend.page_path(key):
                self.started.set()
                self.release.wait(10)
            write(backend, path, header, payload)

        monkeypatch.setattr(FileBackend, "_write_atomic", stalled)


@pytest.mark.parametrize("meanwhile", ["fill", "delete"])
def test_a_file_put_in_flight_keeps_the_capacity(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                 meanwhile: str) -> None:
    """The flake of the concurrent test above, made deterministic: a put whose file is still
    being written holds a reserved slot. `fill`: others fill the store meanwhile; the reserved
    slot is never their victim (it was, and the put's finish brought its page back over
    capacity). `delete`: the key is deleted meanwhile; the finished put takes a slot again."""
    backend = create_backend(_config(tmp_path, "file", capacity_pages=2))
    keys, pages = _keys(3), _pages(3)
    stall = StalledWrite(monkeypatch, keys[0])
    slow = threading.Thread(target=backend.put_from, args=([keys[0]], [pages[0]]))
    try:
        slow.start()
        assert stall.started.wait(10)
        assert backend.put_from([keys[1]], [pages[1]]) == [True]
        if meanwhile == "delete":
            backend.delete([keys[0]])
        assert backend.put_from([keys[2]], [pages[2]]) == [True]
        stall.release.set()
        slow.join(10)
        assert not slow.is_alive()
        stats = backend.stats()
        assert stats["used_pages"] == 2 and stats["evictions"] == 1
        out = torch.zeros(3, PAGE_BYTES, dtype=torch.uint8)
        found = backend.get_into(keys, list(out))
        assert found == [True, False, True]  # the page written last in each slot, intact
        assert torch.equal(out[0], pages[0]) and torch.equal(out[2], pages[2])
    finally:
        stall.release.set()
        backend.close()


def test_service_capacity_caps_the_pool_and_evicts_lru(tmp_path: Path) -> None:
    with LocalMetadataService(tmp_path / "state", capacity_pages=3) as svc:
        backend = create_backend(
            _config(tmp_path / "data", metadata=svc.address, capacity_pages=16)
        )
        try:
            keys, pages = _keys(5), _pages(5)
            for i in range(5):
                assert backend.put_from([keys[i]], [pages[i]]) == [True]
            stats = backend.stats()
            assert (stats["capacity_pages"], stats["used_pages"], stats["evictions"]) == (3, 3, 2)
            assert [backend.exists_prefix([k]) for k in keys] == [0, 0, 1, 1, 1]
        finally:
            backend.close()


def test_a_pool_the_index_refuses_never_reaches_the_store(tmp_path: Path) -> None:
    """`open` with 0 slots was written to SQLite before the index refused it: every reload
    failed on that row after it, so no pool served, and a restarted service crash-looped."""
    from pdcache.offload_manager.storage.metadata_service import MetadataService

    service = MetadataService(tmp_path / "state")
    good = {"op": "open", "ns": "good", "slots": 8, "slot_bytes": PAGE_BYTES}
    assert service.handle(good)["ok"]
    (status, slot), = service.handle({"op": "reserve", "ns": "good", "keys": [b"k" * 32]})[
        "result"]
    assert service.handle({"op": "commit", "ns": "good", "keys": [b"k" * 32],
                           "slots": [slot]})["result"] == [True]
    for slots in (0, -3):
        bad = service.handle({"op": "open", "ns": "bad", "slots": slots,
                              "slot_bytes": PAGE_BYTES})
        assert not bad["ok"], bad
    service.drop_index()  # what the serve loop does after an unexpected error: reload
    assert service.handle({"op": "lookup", "ns": "good", "keys": [b"k" * 32]})["result"] == [
        slot]
    service.close()
    restarted = MetadataService(tmp_path / "state")
    assert restarted.handle({"op": "lookup", "ns": "good", "keys": [b"k" * 32]})["result"] == [
        slot]
    restarted.close()


def test_service_survives_malformed_requests(service) -> None:
    import zmq

    sock = zmq.Context.instance().socket(zmq.REQ)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.RCVTIMEO, 5000)
    sock.connect(service.address)
    try:
        for junk in (b"\xc1garbage", b"\x93\x01\x02\x03", b"\x81\xa2op\xa4nope"):
            sock.send(junk)
            reply = msgpack.unpackb(sock.recv(), raw=False)
            assert reply["ok"] is False and reply["error"]
    finally:
        sock.close(linger=0)
    client = RemoteMetadata(service.address, "pool", 4, SLOT_BYTES, timeout_s=2.0)
    try:
        assert client.ping() and client.reserve(_keys(1))[0][0] == "new"
    finally:
        client.close()


def test_a_file_store_that_cannot_look_at_a_shard_counts_it_never_raises(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A shard directory whose stat fails with something other than "missing" (EACCES when it
    lost its x bit, ESTALE on NFS): reads are counted misses and writes answer, instead of the
    error escaping `put_from` / `put_state` (failing the writer's whole batch)."""
    import errno as errnos

    cfg = StorageConfig(backend="file", path=str(tmp_path / "store"), page_bytes=4096,
                        fingerprint="fp", state_geometry="g", state_bytes=4096)
    backend = create_backend(cfg)
    key = bytes([0xAB]) * 32
    real_stat = os.stat

    def stale(path, *args, **kwargs):
        if f"{os.sep}ab{os.sep}" in os.fspath(path):
            raise OSError(errnos.ESTALE, "Stale file handle", os.fspath(path))
        return real_stat(path, *args, **kwargs)

    page = torch.zeros(4096, dtype=torch.uint8)
    monkeypatch.setattr(os, "stat", stale)
    try:
        assert backend.get_into([key], [page]) == [False]
        assert isinstance(backend.put_from([key], [page])[0], bool)
        assert isinstance(backend.put_state(key, page, 16), bool)
        assert isinstance(backend.exists_state(key), bool)
    finally:
        monkeypatch.setattr(os, "stat", real_stat)
        backend.close()


def test_a_silent_metadata_service_is_tried_ever_less_often() -> None:
    """A frozen service (or an unreachable host) cost each client one full timeout per
    `retry_interval_s`: callers, the engine's lookups among them, were blocked most of the
    time. The fail-fast window now doubles with every round of failures."""
    from pdcache.offload_manager.storage.metadata import MetadataUnavailable

    with socket.socket() as taken:  # a port nothing answers on: every request times out
        taken.bind(("127.0.0.1", 0))
        port = taken.getsockname()[1]
        client = RemoteMetadata(f"tcp://127.0.0.1:{port}", "pool", 4, SLOT_BYTES,
                                timeout_s=0.2, retry_interval_s=1.0)
        try:
            attempts = []
            for pause in (0.0, 1.5, 1.5):  # the first window is 1 s, the second 2 s
                time.sleep(pause)
                with pytest.raises(MetadataUnavailable):
                    client.lookup([b"k" * 32])
                attempts.append(client.failures)
            # 1.5 s after the second failure it still fails fast (a 1 s window tried again)
            assert attempts == [1, 2, 2]
        finally:
            client.close()
        # a lookup (the engine thread's) waits for another call in flight only so long
        slow = RemoteMetadata(f"tcp://127.0.0.1:{port}", "pool", 4, SLOT_BYTES,
                              timeout_s=1.2, retry_interval_s=0.01)
        def reserve() -> None:
            with contextlib.suppress(MetadataUnavailable):
                slow.reserve([b"w" * 32])

        writer = threading.Thread(target=reserve)
        try:
            time.sleep(0.1)  # past the 10 ms window its first (constructor's) ping opened
            writer.start()
            wait_until(lambda: slow._lock.locked(), 10, "the writer's call")
            start = time.monotonic()
            with pytest.raises(MetadataUnavailable, match="another call"):
                slow.lookup([b"k" * 32])
            assert time.monotonic() - start < 1.0  # not the writer's 1.2 s timeout
        finally:
            writer.join(10)
            slow.close()


def test_clients_with_other_data_file_counts_never_share_a_pool(tmp_path: Path) -> None:
    """A slot's file and offset follow from the number of data files: two clients of one
    pool with different counts wrote each other's pages (every read then missed)."""
    state = {"state_geometry": "g", "state_bytes": 4096, "state_capacity": 1 << 20}
    assert (_config(tmp_path, num_data_files=2, **state).state_pool_name
            != _config(tmp_path, **state).state_pool_name)  # state slots alike
    four = create_backend(_config(tmp_path, num_data_files=4))
    two = create_backend(_config(tmp_path, num_data_files=2))
    try:
        pages = _pages(2)
        assert four.put_from(_keys(1), [pages[0]]) == [True]
        assert two.put_from(_keys(1, tag=1), [pages[1]]) == [True]
        out = torch.zeros(1, PAGE_BYTES, dtype=torch.uint8)
        assert four.get_into(_keys(1), list(out)) == [True]
        assert torch.equal(out[0], pages[0])
    finally:
        four.close()
        two.close()
