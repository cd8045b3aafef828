"""Turns a `ScheduledBatch` into a `ForwardBatch` and runs the model on it.

Owns nothing but references to the model, the KV pool and (hybrid models) the recurrent-state
pool; it reads request state and never mutates it (the scheduler commits results; the model
advances each request's state slot in place). Engine thread only.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import torch

from pdcache.engine.forward import ForwardBatch, WindowBatch
from pdcache.engine.kv_pool import DeviceKVPool
from pdcache.engine.request import KVLoad, Req
from pdcache.engine.scheduler import ScheduledBatch
from pdcache.engine.state_pool import RecurrentStatePool
from pdcache.engine.window_pages import ABSENT_PAGE, WindowPages
from pdcache.kernels import KernelSet


class CausalLMLike(Protocol):
    def forward(self, batch: ForwardBatch, device_kv: torch.Tensor) -> torch.Tensor: ...


class ModelRunner:
    """Builds batch tensors (positions, K/V slots, page table) and calls the model."""

    def __init__(self, model: CausalLMLike, pool: DeviceKVPool,
                 kernels: KernelSet | None = None,
                 state_pool: RecurrentStatePool | None = None,
                 window: WindowPages | None = None) -> None:
        """`window`: the sliding layers' own pages (window pages; `pool` then holds the full
        layers only)."""
        self.model = model
        self.pool = pool
        self.state_pool = state_pool
        self.window = window
        self.device = pool.device_kv.device
        self.kernels = kernels or KernelSet()

    def build(self, batch: ScheduledBatch) -> ForwardBatch:
        """Flatten the new tokens of `batch`: `extend_lens[b]` tokens of request b, from its
        `kv_len` on; logits for `batch.sample_rows`, then for `batch.logprob_spans`."""
        input_ids: list[int] = []
        positions: list[torch.Tensor] = []
        out_slots: list[torch.Tensor] = []
        for req, length in zip(batch.reqs, batch.extend_lens):
            start = req.kv_len
            input_ids += req.fill_slice(start, start + length)
            pos = torch.arange(start, start + length, dtype=torch.long)
            positions.append(pos)
            out_slots.append(self._slots(req.page_ids, pos))
        ends = torch.tensor(batch.extend_lens, dtype=torch.long).cumsum(0) - 1
        rows = ends[batch.sample_rows]
        if batch.logprob_spans:  # prompt positions whose logits give prompt logprobs
            starts = ends + 1 - torch.tensor(batch.extend_lens, dtype=torch.long)
            spans = [torch.arange(first, end, dtype=torch.long) - batch.reqs[row].kv_len
                     + starts[row] for row, first, end in batch.logprob_spans]
            rows = torch.cat([rows, *spans])
        return ForwardBatch(
            mode=batch.mode,
            input_ids=torch.tensor(input_ids, dtype=torch.long, device=self.device),
            positions=torch.cat(positions).to(self.device),
            out_slots=torch.cat(out_slots).to(self.device),
            page_table=self._page_table(batch.reqs),
            prefix_lens=[req.kv_len for req in batch.reqs],
            extend_lens=list(batch.extend_lens),
            logits_indices=rows.to(self.device),
            wait_layer=_wait_all(batch.kv_loads) if batch.kv_loads else None,
            kernels=self.kernels,
            state_pool=self.state_pool,
            state_slots=self._state_slots(batch.reqs),
            window=self._window_batch(batch.reqs, positions),
        )

    def _window_batch(self, reqs: list[Req], positions: list[torch.Tensor]
                      ) -> WindowBatch | None:
        """The sliding layers' pages of `reqs` (window pages), None without them. The new
        tokens' sliding pages are always there; freed ones read as `ABSENT_PAGE`."""
        if self.window is None:
            return None
        tables = [[ABSENT_PAGE if page is None else page for page in req.window_page_ids]
                  for req in reqs]
        size, slots = self.pool.page_size, []
        for req, table, pos in zip(reqs, tables, positions):
            first, last = int(pos[0]) // size, int(pos[-1]) // size
            assert last < len(req.window_page_ids) and None not in req.window_page_ids[
                first : last + 1], f"request {req.rid}: a new token without its sliding page"
            slots.append(self._slots(table, pos))
        window = self.window
        return WindowBatch(window.pool.device_kv, _table(tables).to(self.device),
                           torch.cat(slots).to(self.device), window.full_rows,
                           window.sliding_rows)

    def _state_slots(self, reqs: list[Req]) -> list[int] | None:
        """Each request's state slot (hybrid models), holding its state after `kv_len`."""
        if self.state_pool is None:
            return None
        slots = [req.state_slot for req in reqs]
        assert all(slot is not None for slot in slots), "a hybrid request without a state slot"
        return [int(slot) for slot in slots if slot is not None]

    def forward(self, batch: ScheduledBatch) -> torch.Tensor:
        """fp32 logits `[len(batch.sample_rows) + span positions, vocab]`: the sample rows',
        then each of `batch.logprob_spans`' positions in order."""
        forward_batch = self.build(batch)
        with torch.inference_mode():
            logits = self.model.forward(forward_batch, self.pool.device_kv)
        for load in batch.kv_loads:  # a model that skipped wait_layer still completes them
            load.finish()
        return logits

    def _slots(self, page_ids: list[int], positions: torch.Tensor) -> torch.Tensor:
        """Pool slot of each position: page_ids[pos // S] * S + pos % S."""
        size = self.pool.page_size
        first, last = int(positions[0]) // size, int(positions[-1]) // size
        pages = torch.tensor(page_ids[first : last + 1], dtype=torch.long)
        return pages[positions // size - first] * size + positions % size

    def _page_table(self, reqs: list[Req]) -> torch.Tensor:
        return _table([req.page_ids for req in reqs]).to(self.device)


def _table(rows: list[list[int]]) -> torch.Tensor:
    """A page table `[len(rows), longest]`, zero-padded."""
    table = torch.zeros((len(rows), max(len(row) for row in rows)), dtype=torch.long)
    for index, row in enumerate(rows):
        table[index, : len(row)] = torch.tensor(row, dtype=torch.long)
    return table


def _wait_all(loads: list[KVLoad]) -> Callable[[int], None]:
    def wait_layer(layer: int) -> None:
        for load in loads:
            load.wait(layer)

    return wait_layer
