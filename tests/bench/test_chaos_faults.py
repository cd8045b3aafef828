"""The chaos soak's storage and network faults take effect for real, and heal undoes them.

Each storage fault is applied to a storage directory opened through our own backends (file,
hf3fs): a full tmpfs gives ENOSPC (a counted failed write, reads still served), a read-only
remount gives EROFS, flipped bytes are refused pages (counted by reason) that the next write
replaces, the delay file slows every call. The network faults run between two namespaces of a
`NetLab`: netem adds round-trip time, a partition makes connections fail. Skipped, with the
reason the fault itself gives (`unavailable`), where this machine lacks the capability.
"""

from __future__ import annotations

import errno
import math
import os
import random
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from pdcache.bench.chaos.faults import Fault, FaultContext
from pdcache.bench.chaos.os_tools import storage_root
from pdcache.bench.chaos.storage_faults import (
    STORAGE_FAULTS,
    StorageCorrupt,
    StorageFull,
    StorageMount,
    StorageReadonly,
    StorageSlow,
)
from pdcache.config import load_topology
from pdcache.offload_manager.storage import create_backend
from pdcache.offload_manager.storage.base import StorageBackend
from pdcache.offload_manager.storage.config import StorageConfig

REPO = Path(__file__).resolve().parents[2]
CONFIG = REPO / "configs" / "local-1p1d.toml"
PAGE_BYTES = 8192


def make_ctx(tmp_path: Path, backend: str, seed: int = 0) -> FaultContext:
    topology = load_topology(
        CONFIG,
        [
            f'storage.backend="{backend}"',
            'storage.capacity="16MiB"',
            'storage.metadata="inproc"',
            "node.d0.offload=false",
            f'storage.path="{tmp_path / "plain-storage"}"',
        ],
    )
    return FaultContext(
        topology=topology,
        state_dir=tmp_path / "state",
        work_dir=tmp_path / "work",
        rng=random.Random(seed),
        say=lambda line: None,
    )


def prepared(fault: Fault, ctx: FaultContext) -> FaultContext:
    """`fault.prepare`, with its overrides applied the way the harness applies them."""
    reason = fault.unavailable(ctx)
    if reason:
        pytest.skip(f"{fault.kind} unavailable here: {reason}")
    ctx.overrides.update(fault.prepare(ctx))
    return ctx


def open_backend(ctx: FaultContext, backend: str, **over: object) -> StorageBackend:
    values: dict[str, object] = dict(
        backend=backend,
        path=str(storage_root(ctx)),
        page_bytes=PAGE_BYTES,
        capacity_pages=256,
        fingerprint="fp",
        num_data_files=2,
    )
    values.update(over)
    return create_backend(StorageConfig(**values))  # type: ignore[arg-type]


def keys(n: int, tag: int) -> list[bytes]:
    return [bytes([tag, i]) * 16 for i in range(n)]


def pages(n: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (n, PAGE_BYTES), dtype=torch.uint8, generator=gen)


def read_back(backend: StorageBackend, ks: list[bytes]) -> tuple[list[bool], torch.Tensor]:
    out = torch.zeros(len(ks), PAGE_BYTES, dtype=torch.uint8)
    return backend.get_into(ks, list(out)), out


@pytest.fixture()
def cleanups() -> Iterator[list[tuple[Fault, FaultContext]]]:
    """Faults whose `cleanup` must run whatever the test did (unmounts)."""
    todo: list[tuple[Fault, FaultContext]] = []
    yield todo
    for fault, ctx in reversed(todo):
        fault.cleanup(ctx)


def test_registry_names_every_storage_fault() -> None:
    assert set(STORAGE_FAULTS) == {
        "storage-full",
        "storage-readonly",
        "storage-corrupt",
        "storage-slow",
    }
    assert all(cls.kind == kind for kind, cls in STORAGE_FAULTS.items())


# --------------------------------------------------------------------------- storage-full


@pytest.mark.parametrize("backend_name", ["file", "hf3fs"])
def test_storage_full_fails_writes_with_enospc_and_heal_restores(
    tmp_path: Path, backend_name: str, cleanups: list
) -> None:
    fault = StorageFull()
    ctx = prepared(fault, make_ctx(tmp_path, backend_name))
    cleanups.append((fault, ctx))
    root = storage_root(ctx)
    assert root == (ctx.work_dir / "storage").resolve() and os.path.ismount(root)
    backend = open_backend(ctx, backend_name)
    try:
        before = pages(3, seed=1)
        assert backend.put_from(keys(3, 1), list(before)) == [True] * 3
        injection = fault.inject(ctx)
        assert injection.kind == "storage-full" and injection.target == "storage"
        with pytest.raises(OSError) as full:  # the disk is really full
            (root / "probe").write_bytes(b"x" * 65536)
        assert full.value.errno == errno.ENOSPC
        stats0 = backend.stats()
        assert backend.put_from(keys(4, 2), list(pages(4, seed=2))) == [False] * 4
        stats1 = backend.stats()
        assert stats1["write_errors"] - stats0["write_errors"] == 4
        assert stats1["pages_written"] == stats0["pages_written"]
        ok, got = read_back(backend, keys(3, 1))  # what was stored stays readable
        assert ok == [True] * 3 and torch.equal(got, before)
        fault.heal(ctx)
        (root / "probe").write_bytes(b"x" * 65536)  # room again
        again = pages(4, seed=2)
        assert backend.put_from(keys(4, 2), list(again)) == [True] * 4
        ok, got = read_back(backend, keys(4, 2))
        assert ok == [True] * 4 and torch.equal(got, again)
    finally:
        backend.close()
    fault.cleanup(ctx)
    assert not os.path.ismount(root)


# --------------------------------------------------------------------------- storage-readonly


def test_storage_readonly_fails_writes_with_erofs_and_heal_restores(
    tmp_path: Path, cleanups: list
) -> None:
    fault = StorageReadonly()
    ctx = prepared(fault, make_ctx(tmp_path, "file"))
    cleanups.append((fault, ctx))
    root = storage_root(ctx)
    backend = open_backend(ctx, "file")
    try:
        before = pages(2, seed=3)
        assert backend.put_from(keys(2, 3), list(before)) == [True] * 2
        fault.inject(ctx)
        with pytest.raises(OSError) as ro:
            (root / "probe").write_bytes(b"x")
        assert ro.value.errno == errno.EROFS
        assert backend.put_from(keys(2, 4), list(pages(2, seed=4))) == [False, False]
        assert backend.stats()["write_errors"] == 2
        ok, got = read_back(backend, keys(2, 3))
        assert ok == [True, True] and torch.equal(got, before)
        fault.heal(ctx)
        assert backend.put_from(keys(2, 4), list(pages(2, seed=4))) == [True, True]
        assert backend.stats()["pages_written"] == 4
    finally:
        backend.close()


def test_storage_readonly_is_unavailable_for_hf3fs_because_linux_says_ebusy(
    tmp_path: Path, cleanups: list
) -> None:
    """The reason hf3fs is refused is true: with its data files open, the remount fails."""
    ctx = make_ctx(tmp_path, "hf3fs")
    reason = StorageReadonly().unavailable(ctx)
    assert reason is not None and "EBUSY" in reason
    full = StorageFull()  # the same mount, to try the remount under an open hf3fs store
    prepared(full, ctx)
    cleanups.append((full, ctx))
    backend = open_backend(ctx, "hf3fs")
    try:
        mount = StorageMount(ctx.work_dir, 1)
        with pytest.raises(RuntimeError, match="busy"):
            mount.remount("ro")
    finally:
        backend.close()
    StorageMount(ctx.work_dir, 1).remount("ro")  # closed: now it can
    StorageMount(ctx.work_dir, 1).remount("rw")


def test_mount_faults_say_why_without_root(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    ctx = make_ctx(tmp_path, "file")
    assert "root" in (StorageFull().unavailable(ctx) or "")
    assert "root" in (StorageReadonly().unavailable(ctx) or "")


def test_file_faults_are_unavailable_on_mooncake_store(tmp_path: Path) -> None:
    ctx = make_ctx(tmp_path, "file")
    ctx.overrides["storage.backend"] = '"mooncake"'
    for fault in (StorageFull(), StorageReadonly(), StorageCorrupt()):
        assert "Mooncake" in (fault.unavailable(ctx) or ""), fault.kind
    assert StorageSlow().unavailable(ctx) is None


# --------------------------------------------------------------------------- storage-corrupt


@pytest.mark.parametrize("backend_name", ["file", "hf3fs"])
@pytest.mark.parametrize("mac", [False, True], ids=["checksum", "mac"])
def test_storage_corrupt_pages_are_rejected_counted_and_replaced(
    tmp_path: Path, backend_name: str, mac: bool
) -> None:
    fault = StorageCorrupt()
    fault.pages_per_injection = 6
    ctx = prepared(fault, make_ctx(tmp_path, backend_name, seed=7))
    mac_key = bytes(range(32)) if mac else None
    backend = open_backend(ctx, backend_name, page_mac_key=mac_key)
    try:
        ks, data = keys(6, 5), pages(6, seed=5)
        assert backend.put_from(ks, list(data)) == [True] * 6
        injection = fault.inject(ctx)
        assert "header byte of 3 and a payload byte of 3 of 6" in injection.detail
        ok, got = read_back(backend, ks)
        assert ok == [False] * 6  # never served, never wrong bytes
        stats = backend.stats()
        assert stats["rejected_header_pages"] == 3
        assert stats["rejected_checksum_pages"] == 3  # a flipped payload fails the checksum
        assert stats["corrupt_pages"] == 6 and stats["misses"] == 6
        fault.heal(ctx)  # a no-op: the next genuine write replaces them
        assert backend.put_from(ks, list(data)) == [True] * 6
        assert backend.stats()["replaced_rejected_pages"] == 6
        ok, got = read_back(backend, ks)
        assert ok == [True] * 6 and torch.equal(got, data)
    finally:
        backend.close()


def test_storage_corrupt_without_pages_injects_nothing(tmp_path: Path) -> None:
    fault = StorageCorrupt()
    ctx = prepared(fault, make_ctx(tmp_path, "file"))
    assert "of 0 stored pages" in fault.inject(ctx).detail


# --------------------------------------------------------------------------- storage-slow


def timed_read(backend: StorageBackend, ks: list[bytes]) -> float:
    started = time.monotonic()
    ok, _ = read_back(backend, ks)
    assert ok == [True] * len(ks)
    return time.monotonic() - started


@pytest.mark.parametrize("backend_name", ["file", "hf3fs"])
def test_storage_slow_delays_every_call_until_healed(tmp_path: Path, backend_name: str) -> None:
    from pdcache.offload_manager.storage.fault_injection import REREAD_S

    fault = StorageSlow()
    fault.delay_range_s = (0.4, 0.4)
    ctx = prepared(fault, make_ctx(tmp_path, backend_name))
    control = ctx.overrides["storage.fault_injection"].strip('"')
    backend = open_backend(ctx, backend_name, fault_injection=control)
    try:
        ks = keys(2, 6)
        backend.put_from(ks, list(pages(2, seed=6)))
        baseline = timed_read(backend, ks)
        assert baseline < 0.4, baseline
        assert "0.400s" in fault.inject(ctx).detail
        deadline = time.monotonic() + 10 * REREAD_S
        while backend.current_delay_s() == 0 and time.monotonic() < deadline:  # type: ignore[attr-defined]
            time.sleep(REREAD_S / 4)
        slow = timed_read(backend, ks)
        assert slow >= 0.4, slow
        started = time.monotonic()
        backend.put_from(keys(1, 7), list(pages(1, seed=7)))
        assert time.monotonic() - started >= 0.4
        assert backend.stats()["injected_delays"] >= 2
        fault.heal(ctx)
        deadline = time.monotonic() + 10 * REREAD_S
        while backend.current_delay_s() > 0 and time.monotonic() < deadline:  # type: ignore[attr-defined]
            time.sleep(REREAD_S / 4)
        assert timed_read(backend, ks) < 0.4
    finally:
        backend.close()
    fault.cleanup(ctx)
    assert not Path(control).exists()


def test_storage_fault_counts_are_exact(tmp_path: Path) -> None:
    """ceil/floor split of header vs payload flips for an odd number of pages."""
    fault = StorageCorrupt()
    fault.pages_per_injection = 5
    ctx = prepared(fault, make_ctx(tmp_path, "file", seed=3))
    backend = open_backend(ctx, "file")
    try:
        ks = keys(5, 8)
        backend.put_from(ks, list(pages(5, seed=8)))
        fault.inject(ctx)
        read_back(backend, ks)
        stats = backend.stats()
        assert stats["rejected_header_pages"] == math.ceil(5 / 2)
        assert stats["rejected_checksum_pages"] == 5 // 2
    finally:
        backend.close()
