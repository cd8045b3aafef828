"""The host tier's state slots (`HostStatePool`): accounting (each slot freed exactly once,
never while pinned), byte-exact snapshots in and out, refusal of another geometry, and a
state moved device pool -> host slot -> storage -> host slot -> device pool unchanged."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from pdcache.engine.page_keys import chain_page_keys, make_salt, state_key
from pdcache.engine.state_geometry import LinearAttentionConfig, RecurrentStateGeometry
from pdcache.engine.state_pool import RecurrentStatePool, StateAllocationError, StateSnapshot
from pdcache.offload_manager.host_state_pool import HostStatePool
from pdcache.offload_manager.storage import create_backend
from pdcache.offload_manager.storage.config import StorageConfig

LINEAR = LinearAttentionConfig(conv_kernel=4, key_head_dim=8, value_head_dim=8,
                               num_key_heads=2, num_value_heads=4)
GEOMETRY = RecurrentStateGeometry((0, 2), LINEAR, "bfloat16")


def _snapshot(seed: int, geometry: RecurrentStateGeometry = GEOMETRY) -> StateSnapshot:
    gen = torch.Generator().manual_seed(seed)
    data = torch.randint(0, 256, (geometry.state_bytes(),), dtype=torch.uint8, generator=gen)
    return StateSnapshot(geometry, data)


def test_slots_are_freed_exactly_once_and_never_while_pinned() -> None:
    pool = HostStatePool(GEOMETRY, 3, pin_memory=False)
    assert pool.slot_nbytes == GEOMETRY.state_bytes()
    slots = [pool.alloc() for _ in range(3)]
    assert slots == [0, 1, 2] and pool.alloc() is None
    assert (pool.num_used, pool.num_free) == (3, 0)
    pool.check()
    pool.pin(1)
    with pytest.raises(StateAllocationError, match="pinned"):
        pool.free(1)
    pool.unpin(1)
    with pytest.raises(StateAllocationError, match="unpinned more than pinned"):
        pool.unpin(1)
    pool.free(1)
    with pytest.raises(StateAllocationError, match="double free"):
        pool.free(1)
    with pytest.raises(StateAllocationError, match="outside"):
        pool.free(7)
    with pytest.raises(StateAllocationError, match="not held"):
        pool.pin(1)
    pool.check()
    assert pool.stats() == {"host_state_slots": 3, "host_state_slots_used": 2,
                            "host_state_slots_pinned": 0,
                            "host_state_bytes_used": 2 * GEOMETRY.state_bytes()}
    assert pool.alloc() == 1  # the freed slot is reused
    for slot in (0, 1, 2):
        pool.free(slot)
    assert pool.num_free == 3
    pool.check()


def test_check_finds_a_corrupted_free_list() -> None:
    pool = HostStatePool(GEOMETRY, 2, pin_memory=False)
    slot = pool.alloc()
    assert slot is not None
    pool._free.append(slot)  # a free that skipped the accounting: what check() is for
    with pytest.raises(AssertionError):
        pool.check()


def test_snapshots_in_and_out_are_byte_exact_and_other_geometries_refused() -> None:
    pool = HostStatePool(GEOMETRY, 2, pin_memory=False)
    slot = pool.alloc()
    assert slot is not None
    snap = _snapshot(1)
    pool.store(slot, snap)
    assert torch.equal(pool.snapshot(slot).data, snap.data)
    other = RecurrentStateGeometry((1, 3), LINEAR, "bfloat16")
    with pytest.raises(ValueError, match="another geometry"):
        pool.store(slot, _snapshot(2, other))
    with pytest.raises(ValueError, match="bytes"):
        pool.store(slot, StateSnapshot(GEOMETRY, snap.data[:-1]))
    assert torch.equal(pool.slot_bytes(slot), snap.data)  # nothing written by the refusals


def test_a_state_goes_device_host_storage_host_device_unchanged(tmp_path: Path) -> None:
    device = RecurrentStatePool(GEOMETRY, 2)
    src = device.alloc()
    assert src is not None
    gen = torch.Generator().manual_seed(3)
    device.conv[:, src].copy_(torch.randn(device.conv[:, src].shape, generator=gen))
    device.ssm[:, src].copy_(torch.randn(device.ssm[:, src].shape, generator=gen))
    host = HostStatePool(GEOMETRY, 2, pin_memory=False)
    slot = host.alloc()
    assert slot is not None
    host.store(slot, device.snapshot(src))
    store = create_backend(StorageConfig(
        backend="file", path=str(tmp_path), page_bytes=4096, fingerprint="fp",
        state_geometry=GEOMETRY.key(), state_bytes=GEOMETRY.state_bytes()))
    try:
        page = chain_page_keys(list(range(16)), 16, make_salt("fp", ""))[0]
        key = state_key(page, GEOMETRY.key())
        host.pin(slot)
        assert store.put_state(key, host.slot_bytes(slot), tokens=16)
        host.unpin(slot)
        back = host.alloc()
        assert back is not None
        assert store.get_state_into(key, host.slot_bytes(back), tokens=16) == "prefill"
        stats = store.stats()
        assert stats["state_bytes_written"] == stats["state_bytes_read"] == GEOMETRY.state_bytes()
    finally:
        store.close()
    dst = device.alloc()
    assert dst is not None
    device.restore(dst, host.snapshot(back))
    assert torch.equal(device.conv[:, dst], device.conv[:, src])
    assert torch.equal(device.ssm[:, dst], device.ssm[:, src])
    for s in (slot, back):
        host.free(s)
    host.check()
    device.check()
