"""Fixed slots of per-request recurrent state for the linear-attention layers of a hybrid model
(Qwen3-Next's gated DeltaNet), beside the paged KV of its attention layers.

Ownership: a `RecurrentStatePool` owns two device tensors, layer-first like `device_kv`:

- `conv[Ll, N, conv_dim, conv_kernel - 1]` in the model dtype,
- `ssm[Ll, N, num_value_heads, key_head_dim, value_head_dim]` in fp32,

(`Ll` linear layers in `geometry.layer_ids` order, `N` slots) and the accounting of its slots.
A slot is free or held by exactly one owner (a running request); `alloc` zeroes it (the state
before any token) and `free` takes it back exactly once. The model reads and writes a batch's
slots in place through `ForwardBatch.state_pool` / `state_slots`. Not locked: engine thread
only, as `DeviceKVPool`.

Snapshot byte layout (`StateSnapshot.data`, a flat uint8 host tensor of
`geometry.state_bytes()` bytes; what tiers store and P→D moves), little-endian native:

    [0, conv_bytes)            conv states, [Ll, conv_dim, conv_kernel - 1] C order, model dtype
    [conv_bytes, state_bytes)  SSM states,  [Ll, Hv, Dk, Dv] C order, fp32

with `Ll` in `geometry.layer_ids` order. A snapshot carries its geometry; `restore` refuses
one of another geometry or length, so a state never lands in a pool it does not fit.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pdcache.engine.state_geometry import CheckpointGeometry, RecurrentStateGeometry

_TORCH_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16,
}


class StateAllocationError(RuntimeError):
    """A free of a slot that is not held (double free) or out of range."""


@dataclass(frozen=True)
class StateSnapshot:
    """One request's state at one point, on the host: `data` is the flat byte layout of the
    module docstring, `geometry` what it fits."""

    geometry: CheckpointGeometry  # a recurrent state's, or a window tail's
    data: torch.Tensor  # uint8 [geometry.state_bytes()], CPU

    @property
    def nbytes(self) -> int:
        return self.data.numel()


class RecurrentStatePool:
    """`num_slots` request states of `geometry` on `device` (see the module docstring)."""

    def __init__(self, geometry: RecurrentStateGeometry, num_slots: int,
                 device: str | torch.device = "cpu") -> None:
        if num_slots < 1:
            raise ValueError(f"a state pool needs at least 1 slot, got {num_slots}")
        self.geometry = geometry
        layers = geometry.num_layers
        self.conv = torch.zeros((layers, num_slots, *geometry.conv_shape),
                                dtype=_TORCH_DTYPES[geometry.conv_dtype], device=device)
        self.ssm = torch.zeros((layers, num_slots, *geometry.ssm_shape),
                               dtype=_TORCH_DTYPES[geometry.ssm_dtype], device=device)
        # popped from the end: reversed so that low ids go out first
        self._free_ids: list[int] = list(range(num_slots - 1, -1, -1))
        self._in_use = bytearray(num_slots)

    # ---- accounting ------------------------------------------------------------------------
    @property
    def capacity(self) -> int:
        return len(self._in_use)

    @property
    def num_free(self) -> int:
        return len(self._free_ids)

    @property
    def num_used(self) -> int:
        return self.capacity - self.num_free

    def alloc(self) -> int | None:
        """A free slot holding the zero state (before any token), or None when all are held."""
        if not self._free_ids:
            return None
        slot = self._free_ids.pop()
        self._in_use[slot] = 1
        self.conv[:, slot].zero_()
        self.ssm[:, slot].zero_()
        return slot

    def free(self, slot: int) -> None:
        """Give `slot` back; StateAllocationError on a double or foreign free."""
        self._check_held(slot)
        self._in_use[slot] = 0
        self._free_ids.append(slot)

    def is_used(self, slot: int) -> bool:
        return bool(self._in_use[slot])

    def check(self) -> None:
        """AssertionError if the free list and the in-use map disagree."""
        free_set = set(self._free_ids)
        assert len(free_set) == len(self._free_ids), "duplicate ids in the free list"
        assert all(not self._in_use[i] for i in free_set), "a free slot is marked in use"
        assert sum(self._in_use) + len(free_set) == self.capacity, "slots lost"

    def _check_held(self, slot: int) -> None:
        if not 0 <= slot < self.capacity:
            raise StateAllocationError(f"state slot {slot} is outside the pool "
                                       f"[0, {self.capacity})")
        if not self._in_use[slot]:
            raise StateAllocationError(f"state slot {slot} is not held (double free?)")

    # ---- contents --------------------------------------------------------------------------
    def state_bytes(self) -> int:
        """Bytes of one slot's state (= of a snapshot)."""
        return self.geometry.state_bytes()

    def copy_slot(self, src: int, dst: int) -> None:
        """Make held slot `dst` hold `src`'s state (a branch of the same prefix)."""
        self._check_held(src)
        self._check_held(dst)
        self.conv[:, dst].copy_(self.conv[:, src])
        self.ssm[:, dst].copy_(self.ssm[:, src])

    def snapshot(self, slot: int) -> StateSnapshot:
        """Held slot `slot`'s state, copied to the host in the flat byte layout."""
        self._check_held(slot)
        conv = self.conv[:, slot].contiguous().cpu().reshape(-1).view(torch.uint8)
        ssm = self.ssm[:, slot].contiguous().cpu().reshape(-1).view(torch.uint8)
        return StateSnapshot(self.geometry, torch.cat((conv, ssm)))

    def restore(self, slot: int, snapshot: StateSnapshot) -> None:
        """Overwrite held slot `slot` with `snapshot`; ValueError (nothing written) for a
        snapshot of another geometry or of the wrong length or dtype."""
        self._check_held(slot)
        if snapshot.geometry != self.geometry:
            raise ValueError(f"state snapshot of another geometry: {snapshot.geometry.key()} "
                             f"!= this pool's {self.geometry.key()}")
        data = snapshot.data
        if data.dtype != torch.uint8 or data.dim() != 1 or data.numel() != self.state_bytes():
            raise ValueError(f"state snapshot of {data.numel()} {data.dtype} elements; this "
                             f"pool's states are {self.state_bytes()} uint8 bytes")
        split = self.geometry.conv_bytes
        conv = data[:split].view(self.conv.dtype).view(self.conv[:, slot].shape)
        ssm = data[split:].view(self.ssm.dtype).view(self.ssm[:, slot].shape)
        self.conv[:, slot].copy_(conv)
        self.ssm[:, slot].copy_(ssm)

    def describe(self) -> str:
        return f"{self.capacity} slots of {self.geometry.describe()}"
