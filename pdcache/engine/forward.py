"""The one object that carries a batch from the scheduler into the model's forward pass."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from enum import Enum
from typing import TYPE_CHECKING

import torch

from pdcache.kernels import KernelSet

if TYPE_CHECKING:
    from pdcache.engine.state_pool import RecurrentStatePool


@dataclass
class WindowBatch:
    """A model whose sliding layers keep their own pages (`pdcache.engine.window_pages`):
    their pool `device_kv`, each sequence's sliding pages `page_table[B, max_pages]` (pages
    out of the window point anywhere: the kernels mask them), the new tokens' slots
    `out_slots[T]` there, and every attention layer's row in its own pool (`full_rows`: in
    the model's `device_kv`; `sliding_rows`: in this one)."""

    device_kv: torch.Tensor = field(repr=False)
    page_table: torch.Tensor
    out_slots: torch.Tensor
    full_rows: dict[int, int]
    sliding_rows: dict[int, int]


class ForwardMode(Enum):
    EXTEND = "extend"  # prefill (possibly chunked, possibly after a cached prefix)
    DECODE = "decode"  # one new token per sequence


@dataclass
class ForwardBatch:
    """Flattened tokens of several sequences plus where their K/V lives.

    - `input_ids`, `positions`, `out_slots`: `[T]`, the new tokens of all sequences concatenated;
      `out_slots[t]` is the device pool slot (page_id * page_size + offset) where token t's K/V
      is stored before attention.
    - `page_table[B, max_pages]`: device page ids of each sequence (prefix and new tokens).
    - `prefix_lens[b]`: tokens of sequence b already in the pool before this batch;
      `extend_lens[b]`: its new tokens (1 per sequence in DECODE mode).
    - `logits_indices`: rows of the flattened batch whose logits are returned (by default the
      last new token of each sequence).
    - `wait_layer(layer)`: called before a layer reads K/V, so a host→device load of that layer
      can finish while earlier layers compute (HiCache per-layer load). None: nothing to wait.
    - `kernels`: the KV kernels the model stores and attends with (the engine's
      `EngineConfig.kernels`; "auto" when a test builds a batch by hand).
    - `state_pool`, `state_slots[b]`: hybrid models only (Qwen3-Next): the recurrent-state
      pool and sequence b's slot in it, holding its state after `prefix_lens[b]` tokens on
      entry and after its new tokens on return. None for models without linear layers.
    - `window`: the sliding layers' own pages (window pages); None: every layer reads
      `device_kv` row `layer_id` through `page_table`.
    """

    mode: ForwardMode
    input_ids: torch.Tensor
    positions: torch.Tensor
    out_slots: torch.Tensor
    page_table: torch.Tensor
    prefix_lens: list[int]
    extend_lens: list[int]
    logits_indices: torch.Tensor | None = None
    wait_layer: Callable[[int], None] | None = field(default=None, repr=False)
    kernels: KernelSet = field(default_factory=KernelSet, repr=False)
    state_pool: RecurrentStatePool | None = field(default=None, repr=False)
    state_slots: list[int] | None = None
    window: WindowBatch | None = None

    @property
    def batch_size(self) -> int:
        return len(self.extend_lens)

    @property
    def seq_lens(self) -> list[int]:
        return [p + e for p, e in zip(self.prefix_lens, self.extend_lens)]

    def last_token_indices(self) -> torch.Tensor:
        ends = torch.tensor(self.extend_lens, dtype=torch.long).cumsum(0) - 1
        return ends.to(self.input_ids.device)
