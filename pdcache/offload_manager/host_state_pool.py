"""The host tier of recurrent states: fixed slots of one request state each, beside the host
KV pool (`host_pool.HostKVPool`), for HiCache's host tier of a hybrid model (Qwen3-Next), or of
one window tail each for a sliding-window model with window pages (gpt-oss: any
`CheckpointGeometry`, docs/design.md §4.14).

A slot holds exactly one state snapshot in its flat byte layout
(`pdcache.engine.state_pool`: conv states, then SSM states; `geometry.state_bytes()` bytes),
so a slot is what a device state pool snapshots into and restores from, and what a storage
backend stores (`put_state`) and reads into (`get_state_into`) without any reshaping.

Slot states: FREE -> (alloc) -> HELD -> (free) -> FREE, each transition exactly once (a double
or foreign free raises). A HELD slot may be *pinned* (a storage write or a load reads it) and is
not freed while pinned. There is no eviction policy here: the tiers that hold the slots decide
what to free (the interface HiCache wires in later). Invariant checked by `check()`: free +
held == capacity, and the free list matches the slot states.
"""

from __future__ import annotations

import threading

import torch

from pdcache.engine.state_geometry import CheckpointGeometry
from pdcache.engine.state_pool import StateAllocationError, StateSnapshot


def default_pin_memory() -> bool:
    """Pinned host memory when a CUDA device can copy from it asynchronously, else pageable."""
    return torch.cuda.is_available()


class HostStatePool:
    """Owns `num_slots` state slots of `geometry` in one host tensor `[num_slots, state_bytes]`
    (uint8, pinned when `pin_memory`), their states and pin counts. Thread-safe: the scheduler
    allocates and frees, storage workers pin and unpin; every change takes `self._lock`."""

    def __init__(self, geometry: CheckpointGeometry, num_slots: int,
                 pin_memory: bool | None = None) -> None:
        if num_slots < 1:
            raise ValueError(f"a host state pool needs at least 1 slot, got {num_slots}")
        pin = default_pin_memory() if pin_memory is None else pin_memory
        self.geometry = geometry
        self.slot_nbytes = geometry.state_bytes()
        self.data = torch.zeros((num_slots, self.slot_nbytes), dtype=torch.uint8, pin_memory=pin)
        self._held = bytearray(num_slots)
        self._pins = [0] * num_slots
        self._free: list[int] = list(range(num_slots - 1, -1, -1))  # low ids go out first
        self._lock = threading.Lock()

    # ---- sizes -------------------------------------------------------------------------
    @property
    def capacity(self) -> int:
        return len(self._held)

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.capacity - self.num_free

    @property
    def pinned(self) -> bool:
        return self.data.is_pinned()

    # ---- state changes -----------------------------------------------------------------
    def alloc(self) -> int | None:
        """A free slot, now held (its bytes are whatever it held last), or None when full."""
        with self._lock:
            if not self._free:
                return None
            slot = self._free.pop()
            self._held[slot] = 1
            return slot

    def free(self, slot: int) -> None:
        """Give a held slot back; StateAllocationError for a free, foreign or pinned slot."""
        with self._lock:
            self._check_held(slot)
            if self._pins[slot]:
                raise StateAllocationError(f"host state slot {slot} freed while pinned "
                                           f"({self._pins[slot]})")
            self._held[slot] = 0
            self._free.append(slot)

    def pin(self, slot: int) -> None:
        """A reader (storage write, load) holds `slot`'s bytes until `unpin`."""
        with self._lock:
            self._check_held(slot)
            self._pins[slot] += 1

    def unpin(self, slot: int) -> None:
        with self._lock:
            if not 0 <= slot < self.capacity or self._pins[slot] <= 0:
                raise StateAllocationError(f"host state slot {slot} unpinned more than pinned")
            self._pins[slot] -= 1

    def is_used(self, slot: int) -> bool:
        return bool(self._held[slot])

    def is_pinned(self, slot: int) -> bool:
        return self._pins[slot] > 0

    # ---- data --------------------------------------------------------------------------
    def slot_bytes(self, slot: int) -> torch.Tensor:
        """The held slot's bytes, a 1-D uint8 view (what `put_state` / `get_state_into` take)."""
        with self._lock:
            self._check_held(slot)
        return self.data[slot]

    def store(self, slot: int, snapshot: StateSnapshot) -> None:
        """Copy `snapshot` into held `slot`; ValueError (nothing written) for a snapshot of
        another geometry or length."""
        if snapshot.geometry != self.geometry:
            raise ValueError(f"state snapshot of another geometry: {snapshot.geometry.key()} "
                             f"!= this pool's {self.geometry.key()}")
        if snapshot.data.dtype != torch.uint8 or snapshot.nbytes != self.slot_nbytes:
            raise ValueError(f"state snapshot of {snapshot.nbytes} {snapshot.data.dtype} "
                             f"elements; this pool's states are {self.slot_nbytes} bytes")
        self.slot_bytes(slot).copy_(snapshot.data.reshape(-1))

    def snapshot(self, slot: int) -> StateSnapshot:
        """Held `slot` as a snapshot that *views* the slot (no copy): valid while it is held;
        `RecurrentStatePool.restore` copies it to the device."""
        return StateSnapshot(self.geometry, self.slot_bytes(slot))

    def stats(self) -> dict[str, int]:
        """Slot accounting in slots and bytes (the host tier's state bytes)."""
        with self._lock:
            used = self.capacity - len(self._free)
            pinned = sum(1 for pins in self._pins if pins)
        return {"host_state_slots": self.capacity, "host_state_slots_used": used,
                "host_state_slots_pinned": pinned,
                "host_state_bytes_used": used * self.slot_nbytes}

    def check(self) -> None:
        """AssertionError unless free + held == capacity and the free list matches."""
        with self._lock:
            free_set = set(self._free)
            assert len(free_set) == len(self._free), "duplicate ids in the host state free list"
            assert all(not self._held[i] for i in free_set), "a free host state slot is held"
            assert sum(self._held) + len(free_set) == self.capacity, "host state slots lost"
            assert all(not self._pins[i] for i in free_set), "a free host state slot is pinned"

    def describe(self) -> str:
        kind = "pinned" if self.pinned else "pageable"
        return f"{self.capacity} {kind} host slots of {self.geometry.describe()}"

    # ---- internals ---------------------------------------------------------------------
    def _check_held(self, slot: int) -> None:
        if not 0 <= slot < self.capacity:
            raise StateAllocationError(f"host state slot {slot} is outside the pool "
                                       f"[0, {self.capacity})")
        if not self._held[slot]:
            raise StateAllocationError(f"host state slot {slot} is not held (double free?)")
