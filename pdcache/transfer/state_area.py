"""Registered host memory for the recurrent states that travel P→D with a hybrid model's pages.

A `StateArea` is `num_slots` slots of one `RecurrentStateGeometry`'s snapshot bytes
(`state_bytes()`, the flat layout of `pdcache.engine.state_pool`) in one contiguous uint8 host
tensor, which the data engine registers once: a target on decode (`KVReceiver.states`: prefill
writes a room's state into the slot its request names), a source on prefill (`KVSender`: each
transfer worker stages the room's snapshot in its own slot, since a snapshot is a fresh host
tensor no engine has registered). Slots start on 4 KiB boundaries (a state's fp32 SSM section
stays aligned for `StateSnapshot` views; RDMA NICs prefer it).
"""

from __future__ import annotations

import threading

import torch

from pdcache.engine.state_geometry import RecurrentStateGeometry
from pdcache.engine.state_pool import StateSnapshot

SLOT_ALIGN = 4096


class StateSlotError(RuntimeError):
    """A free of a slot that is not held (double free) or outside the area."""


class StateArea:
    """Owns the host tensor of `num_slots` state slots and their accounting. A slot is free or
    held by one owner from `alloc` to `free` (exactly once); `alloc` / `free` / `is_held` are
    locked: the decode node allocates on the engine thread (when a room's pages are reserved)
    and frees from whichever thread ends the slot's use — the event loop once the state is
    copied into the engine (`start_decode`), the receiver's control thread (`on_release` of
    a failed room), a leave or close; contents are written by whoever holds the slot."""

    def __init__(self, geometry: RecurrentStateGeometry, num_slots: int) -> None:
        if num_slots < 1:
            raise ValueError(f"a state area needs at least 1 slot, got {num_slots}")
        self.geometry = geometry
        self.geometry_key = geometry.key()
        self.state_bytes = geometry.state_bytes()
        self.slot_stride = -(-self.state_bytes // SLOT_ALIGN) * SLOT_ALIGN
        self.tensor = torch.zeros((num_slots, self.slot_stride), dtype=torch.uint8)
        self._lock = threading.Lock()
        self._free = list(range(num_slots - 1, -1, -1))  # popped from the end: low ids first
        self._held = bytearray(num_slots)

    @property
    def num_slots(self) -> int:
        return len(self._held)

    @property
    def base_addr(self) -> int:
        return self.tensor.data_ptr()

    @property
    def nbytes(self) -> int:
        return self.tensor.numel()

    @property
    def num_free(self) -> int:
        with self._lock:
            return len(self._free)

    def alloc(self) -> int | None:
        """A free slot, now held by the caller; None when every slot is held."""
        with self._lock:
            if not self._free:
                return None
            slot = self._free.pop()
            self._held[slot] = 1
            return slot

    def free(self, slot: int) -> None:
        """Give `slot` back; StateSlotError on a double or foreign free."""
        with self._lock:
            self._check_held(slot)
            self._held[slot] = 0
            self._free.append(slot)

    def is_held(self, slot: int) -> bool:
        with self._lock:
            return 0 <= slot < len(self._held) and bool(self._held[slot])

    def _check_held(self, slot: int) -> None:
        if isinstance(slot, bool) or not isinstance(slot, int) or not 0 <= slot < len(self._held):
            raise StateSlotError(f"state slot {slot!r} is outside the area [0, {len(self._held)})")
        if not self._held[slot]:
            raise StateSlotError(f"state slot {slot} is not held (double free?)")

    def offset(self, slot: int) -> int:
        """Byte offset of `slot` from `base_addr`."""
        return slot * self.slot_stride

    def view(self, slot: int) -> torch.Tensor:
        """The `state_bytes` of `slot` (uint8, 1-D, contiguous): no copy."""
        return self.tensor[slot, : self.state_bytes]

    def snapshot(self, slot: int) -> StateSnapshot:
        """`slot`'s bytes as a `StateSnapshot` of this area's geometry: a view, valid while the
        caller holds the slot (`RecurrentStatePool.restore` copies from it)."""
        return StateSnapshot(self.geometry, self.view(slot))

    def write(self, slot: int, snapshot: StateSnapshot) -> None:
        """Copy `snapshot` into `slot`; ValueError (nothing written) unless it is a snapshot of
        this geometry, exactly `state_bytes` uint8 bytes."""
        check_snapshot(snapshot, self.geometry)
        self.view(slot).copy_(snapshot.data)


def check_snapshot(snapshot: object, geometry: RecurrentStateGeometry) -> None:
    """ValueError unless `snapshot` is a host `StateSnapshot` of `geometry` whose data is the
    whole flat state: `state_bytes()` uint8 elements, 1-D."""
    if not isinstance(snapshot, StateSnapshot):
        raise ValueError(f"a state must be a StateSnapshot, got {type(snapshot).__name__}")
    if snapshot.geometry.key() != geometry.key():
        raise ValueError(f"state of another geometry: {snapshot.geometry.key()} != "
                         f"{geometry.key()}")
    data = snapshot.data
    if (data.dtype != torch.uint8 or data.dim() != 1 or data.device.type != "cpu"
            or data.numel() != geometry.state_bytes()):
        raise ValueError(f"state data of {data.numel()} {data.dtype} elements on {data.device}; "
                         f"expected {geometry.state_bytes()} uint8 bytes on the host")
