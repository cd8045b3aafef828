"""The device tier's recurrent state of a hybrid model (Qwen3-Next): one `RecurrentStatePool`
beside the KV pool, its slots shared by running requests and state checkpoints.

Sizing (`StateSlots.create`): `SchedulerConfig.max_running_requests` request slots (one per
running request: admission never waits for one) plus `CacheConfig.state_checkpoint_slots`
checkpoint slots (0 without a prefix cache). Checkpoints never take more than their share, so
requests always find a slot. A decode node's prefilled requests get theirs through their
reservation: the `ReservationBook` grants a hybrid reservation only while a request slot is
left for it beside those of the running, waiting and reserved requests.

Ownership: every used slot has exactly one owner: a running request (`Req.state_slot`, from
admission until it finishes, is aborted or retracted), a running or held request's pending
decode checkpoint (`Req.pending_checkpoint`; a held one attaches it to the tree, or frees it,
when its pages are released), or a radix node (`RadixNode.state_slot`, until the tree
frees it with the node's pages or to make room). `Engine.check_accounting` checks
`free + requests + pending + tree == capacity`. Not locked: engine thread only.

Checkpoint points (docs/design.md §4.14): a checkpoint is the state after a page-aligned token
count, attached to the radix node that ends there. The scheduler takes one
- at the prompt's last full page (a chunk of the prefill ends there): the point the request's
  other samples, its retraction and a conversation's next turn share;
- at a branch point: where an admission's page match went deeper than its deepest checkpoint
  (`MatchResult.limited_by == "state"`), the next request with that prefix hits all of it;
- at the answer's last full page (request end): during decode the state is copied into the
  request's one pending checkpoint each time its K/V fills a page, and the last copy goes to
  the tree when the request's pages do, so the next turn of a conversation restores the
  state decode produced.
Those are `[cache] state_checkpoints = "hit_points"` (the default; the scheduler's other
policies, every_page and chunk_ends, rebuild vLLM's and SGLang's, docs/design.md §4.14).
Not at every chunk end or every page: a checkpoint costs `state_bytes()` (Qwen3-Next-80B:
73.7 MiB, the KV of 3,144 tokens) and a mid-prompt point is only hit by a prompt that diverges
exactly there. When no checkpoint slot is free the least recently used checkpoint is dropped
(its node stays, a prefix of deeper checkpoints); with none to drop, no checkpoint is taken
(counted), never a failure.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import torch

from pdcache.engine.state_geometry import RecurrentStateGeometry
from pdcache.engine.state_pool import RecurrentStatePool, StateSnapshot

if TYPE_CHECKING:
    from pdcache.engine.radix import RadixNode


class DeviceCheckpoints(Protocol):
    """The device tier's checkpoints at radix node ends, as HiCache's backup sees them: a
    hybrid model's state slots (`StateSlots`) or a sliding-window model's window tails
    (`pdcache.engine.window_pages.WindowTails`). Engine thread."""

    def has_checkpoint(self, node: RadixNode) -> bool:
        """A checkpoint of the point at `node`'s end is on device now."""

    def snapshot_checkpoint(self, node: RadixNode) -> StateSnapshot:
        """That checkpoint copied to the host (`has_checkpoint(node)` must hold)."""


@dataclass
class StateCounters:
    checkpoints_taken: int = 0  # copied into a checkpoint slot (prompt, branch or decode point)
    checkpoints_skipped: int = 0  # wanted, but no checkpoint slot could be had
    checkpoints_restored: int = 0  # admissions that started from a checkpoint


class StateSlots:
    """The recurrent-state pool and who holds its slots (see the module docstring)."""

    def __init__(self, pool: RecurrentStatePool, checkpoint_slots: int) -> None:
        if not 0 <= checkpoint_slots < pool.capacity:
            raise ValueError(f"{checkpoint_slots} checkpoint slots leave no request slot in a "
                             f"pool of {pool.capacity}")
        self.pool = pool
        self.checkpoint_slots = checkpoint_slots
        self.num_checkpoints = 0  # slots held as checkpoints (tree's and pending ones)
        self.counters = StateCounters()

    @classmethod
    def create(cls, geometry: RecurrentStateGeometry, max_running: int, checkpoint_slots: int,
               device: str | torch.device = "cpu") -> StateSlots:
        """`max_running` request slots plus `checkpoint_slots` on `device`."""
        return cls(RecurrentStatePool(geometry, max_running + checkpoint_slots, device),
                   checkpoint_slots)

    @property
    def state_bytes(self) -> int:
        return self.pool.state_bytes()

    # ---- DeviceCheckpoints: a node's checkpoint is its state slot ------------------------
    def has_checkpoint(self, node: RadixNode) -> bool:
        return node.state_slot is not None

    def snapshot_checkpoint(self, node: RadixNode) -> StateSnapshot:
        assert node.state_slot is not None, "no device checkpoint at this node"
        return self.pool.snapshot(node.state_slot)

    @property
    def num_request_slots(self) -> int:
        return self.pool.num_used - self.num_checkpoints

    @property
    def free_request_slots(self) -> int:
        """Request slots `alloc_request` can still give (the checkpoints' share aside)."""
        return self.pool.capacity - self.checkpoint_slots - self.num_request_slots

    # ---- request slots ---------------------------------------------------------------------
    def alloc_request(self) -> int | None:
        """A zeroed slot for a request being admitted (None: every request slot is held)."""
        if self.free_request_slots <= 0:
            return None
        return self.pool.alloc()

    def free_request(self, slot: int) -> None:
        self.pool.free(slot)

    # ---- checkpoint slots ------------------------------------------------------------------
    def alloc_checkpoint(self) -> int | None:
        """A slot within the checkpoints' share, or None when it is used up."""
        if self.num_checkpoints >= self.checkpoint_slots:
            return None
        slot = self.pool.alloc()
        if slot is not None:
            self.num_checkpoints += 1
        return slot

    def free_checkpoint(self, slot: int) -> None:
        """Take back a checkpoint slot (the tree's `CheckpointSlots`); exactly once."""
        self.pool.free(slot)
        self.num_checkpoints -= 1

    def is_used(self, slot: int) -> bool:
        return self.pool.is_used(slot)

    def stats(self, tree_checkpoints: int) -> dict[str, int]:
        """The engine snapshot's `state_*` entries."""
        counters = self.counters
        return {
            "state_slots_total": self.pool.capacity,
            "state_slots_free": self.pool.num_free,
            "state_slot_bytes": self.state_bytes,
            "state_checkpoints": tree_checkpoints,
            "state_checkpoints_taken_total": counters.checkpoints_taken,
            "state_checkpoints_skipped_total": counters.checkpoints_skipped,
            "state_checkpoints_restored_total": counters.checkpoints_restored,
            "state_checkpoint_bytes_total": counters.checkpoints_taken * self.state_bytes,
        }

    def check_accounting(self, request_slots: list[int | None], pending: list[int],
                         tree_checkpoints: int) -> dict[str, int]:
        """Each running request holds one slot (`request_slots`), a pending decode
        checkpoint (of a running or held request: `pending`) or a tree node
        (`tree_checkpoints` of them) each other used one (docs/design.md §5.1). Engine
        thread. The numbers checked, for `Engine.check_accounting`."""
        pool = self.pool
        pool.check()
        assert None not in request_slots, "a running hybrid request without a state slot"
        numbers = {"state_capacity": pool.capacity, "state_free": pool.num_free,
                   "state_requests": len(request_slots), "state_pending": len(pending),
                   "state_tree": tree_checkpoints}
        held = [*request_slots, *pending]
        assert len(set(held)) == len(held) and all(pool.is_used(s) for s in held), numbers
        assert self.num_checkpoints == len(pending) + tree_checkpoints, numbers
        assert pool.num_free + len(held) + tree_checkpoints == pool.capacity, numbers
        return numbers
