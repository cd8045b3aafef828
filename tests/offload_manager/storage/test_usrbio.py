"""The hf3fs `usrbio` IO engine against a stand-in of the 3FS native client.

`hf3fs_py_usrbio` only builds inside the 3FS source tree, so it cannot run here. This stand-in
implements the documented API (make_iovec, make_ioring, prepare/submit/wait, register_fd) with
positional file IO, so the engine's batching, userdata mapping and copies are exercised; the
real client is a drop-in on a 3FS mount.
"""

from __future__ import annotations

import os
import sys
import types
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from pdcache.offload_manager.storage import create_backend
from pdcache.offload_manager.storage.config import StorageConfig

PAGE_BYTES = 4096


@dataclass
class _IovSlice:
    buf: memoryview


class _Iovec:
    def __init__(self, shm) -> None:
        self.buf = shm.buf

    def __getitem__(self, span: slice) -> _IovSlice:
        return _IovSlice(self.buf[span])


@dataclass
class _Result:
    result: int
    userdata: object


class _Ring:
    def __init__(self, entries: int, for_read: bool) -> None:
        self.entries = entries
        self.for_read = for_read
        self.pending: list[tuple[_IovSlice, int, int, object]] = []
        self.max_batch = 0

    def prepare(self, iov: _IovSlice, for_read: bool, fd: int, offset: int, userdata=None):
        assert for_read == self.for_read and len(self.pending) < self.entries
        assert fd in _REGISTERED, "IO on an fd that was not registered"
        self.pending.append((iov, fd, offset, userdata))

    def submit(self) -> _Ring:
        return self

    def wait(self, min_results: int) -> list[_Result]:
        assert min_results == len(self.pending)
        self.max_batch = max(self.max_batch, len(self.pending))
        op = os.preadv if self.for_read else os.pwritev
        done = [_Result(op(fd, [iov.buf], off), ud) for iov, fd, off, ud in self.pending]
        self.pending = []
        return list(reversed(done))  # completion order is not submission order


_REGISTERED: set[int] = set()
_RINGS: list[_Ring] = []


def _fake_usrbio() -> types.ModuleType:
    mod = types.ModuleType("hf3fs_py_usrbio")
    mod.make_iovec = lambda shm, mount_point, block_size=0, numa=-1: _Iovec(shm)

    def make_ioring(mount_point, entries, for_read=True, io_depth=0, **kw):
        ring = _Ring(entries, for_read)
        _RINGS.append(ring)
        return ring

    mod.make_ioring = make_ioring
    mod.register_fd = _REGISTERED.add
    mod.deregister_fd = _REGISTERED.remove
    return mod


@pytest.fixture
def usrbio(monkeypatch: pytest.MonkeyPatch) -> None:
    _REGISTERED.clear()
    _RINGS.clear()
    monkeypatch.setitem(sys.modules, "hf3fs_py_usrbio", _fake_usrbio())


def test_usrbio_engine_round_trip_in_batches(usrbio: None, tmp_path: Path) -> None:
    cfg = StorageConfig(
        path=str(tmp_path),
        page_bytes=PAGE_BYTES,
        capacity_pages=16,
        fingerprint="fp",
        io_engine="usrbio",
        usrbio_mount=str(tmp_path),
        usrbio_entries=4,
    )
    backend = create_backend(cfg)
    try:
        assert len(_REGISTERED) == cfg.num_data_files
        keys = [bytes([i]) * 32 for i in range(10)]
        pages = torch.randint(
            0, 256, (10, PAGE_BYTES), dtype=torch.uint8, generator=torch.Generator().manual_seed(3)
        )
        assert backend.put_from(keys, list(pages), origin="decode") == [True] * 10
        out, origins = torch.zeros_like(pages), []
        assert backend.get_into(keys, list(out), origins) == [True] * 10
        assert torch.equal(out, pages) and origins == ["decode"] * 10
        assert max(ring.max_batch for ring in _RINGS) == 4  # 10 pages in batches of 4
        blob = bytearray(backend.read_object(keys[7]))
        blob[200] ^= 1
        backend.write_object(keys[7], bytes(blob))
        assert backend.get_into(keys[6:8], list(out[6:8])) == [True, False]
        assert backend.stats()["corrupt_pages"] == 1
    finally:
        backend.close()
    assert _REGISTERED == set()  # every fd deregistered before close


def test_usrbio_needs_a_mount_point(usrbio: None, tmp_path: Path) -> None:
    cfg = StorageConfig(
        path=str(tmp_path), page_bytes=PAGE_BYTES, capacity_pages=4, io_engine="usrbio"
    )
    with pytest.raises(ValueError, match="usrbio_mount"):
        create_backend(cfg)


def test_concurrent_reads_and_writes_keep_their_own_bytes(usrbio: None, tmp_path: Path) -> None:
    """The backup worker writes while the prefetch worker reads, through one backend: every
    write reported ok reads back as its own bytes. The two shared one iovec's slots without a
    lock: writes committed another batch's bytes (reported ok, lost: wrong-key rejections and
    checksum failures on the reads back)."""
    import threading

    cfg = StorageConfig(path=str(tmp_path), page_bytes=PAGE_BYTES, capacity_pages=2048,
                        fingerprint="fp", io_engine="usrbio", usrbio_mount=str(tmp_path),
                        usrbio_entries=8, pipeline_pages=0)
    backend = create_backend(cfg)
    gen = torch.Generator().manual_seed(5)
    old_keys = [bytes([1, i]) * 16 for i in range(32)]
    assert all(backend.put_from(old_keys, list(torch.randint(0, 256, (32, PAGE_BYTES),
                                                           dtype=torch.uint8, generator=gen))))
    count = 1024
    keys = [bytes([2, i % 256, i // 256]) * 8 + bytes(8) for i in range(count)]
    pages = torch.randint(0, 256, (count, PAGE_BYTES), dtype=torch.uint8, generator=gen)
    stop = threading.Event()

    def read_old() -> None:
        out = torch.empty(32, PAGE_BYTES, dtype=torch.uint8)
        while not stop.is_set():
            backend.get_into(old_keys, list(out))

    reader = threading.Thread(target=read_old)
    reader.start()
    try:
        wrote = [ok for at in range(0, count, 16)
                 for ok in backend.put_from(keys[at : at + 16], list(pages[at : at + 16]))]
    finally:
        stop.set()
        reader.join(30)
    try:
        out = torch.zeros_like(pages)
        assert backend.get_into(keys, list(out)) == wrote == [True] * count
        assert torch.equal(out, pages)
    finally:
        backend.close()
