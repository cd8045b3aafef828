"""The host tier: a page-first KV pool in CPU memory and its page allocator.

`host_kv` is page-first, shaped by the model's `KVGeometry` (`host_shape`): all layers and slabs
of one page are contiguous, so a host page is exactly the payload of a stored page
(docs/design.md §4.3) and moves to or from storage in one I/O.

Page states: FREE → (alloc) → IN_FLIGHT → (commit) → USED → (free) → FREE; an IN_FLIGHT page
(its I/O still running, or abandoned) can also be freed. USED pages can additionally be
*pinned* (read by a backup or a load in progress): pinned pages must not be freed.
Invariant checked by `check()`: free + used + in_flight == capacity.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Sequence
from enum import IntEnum

import torch

from pdcache.engine.config import DTYPES, ModelConfig
from pdcache.engine.kv_geometry import KVGeometry


class PageState(IntEnum):
    FREE = 0
    IN_FLIGHT = 1
    USED = 2


def host_pages_for(
    model: ModelConfig, page_size: int, device_pages: int, ratio: float = 0.0, nbytes: int = 0
) -> int:
    """Host pool size in pages: `nbytes` when given, else `ratio` × the device pool."""
    page_bytes = model.kv_geometry.page_bytes(page_size)
    if nbytes > 0:
        return max(1, nbytes // page_bytes)
    return max(1, int(device_pages * ratio))


class HostKVPool:
    """Owns the host KV tensor, the page states and the pin counts.

    Thread-safe: the scheduler thread allocates, commits and frees; storage workers pin and
    unpin while they read pages. All state changes take `self._lock`.
    """

    def __init__(
        self, num_pages: int, geometry: KVGeometry, page_size: int, pin_memory: bool = False
    ) -> None:
        shape = geometry.host_shape(num_pages, page_size)
        self.geometry = geometry
        self.host_kv = torch.zeros(shape, dtype=DTYPES[geometry.dtype], pin_memory=pin_memory)
        self.page_size = page_size
        self._state = [PageState.FREE] * num_pages
        self._pins = [0] * num_pages
        self._free: list[int] = list(range(num_pages - 1, -1, -1))
        self._counts = {PageState.FREE: num_pages, PageState.IN_FLIGHT: 0, PageState.USED: 0}
        self._lock = threading.Lock()

    @classmethod
    def for_model(
        cls, model: ModelConfig, num_pages: int, page_size: int, pin_memory: bool = False
    ) -> HostKVPool:
        return cls(num_pages, model.kv_geometry, page_size, pin_memory)

    # ---- sizes -------------------------------------------------------------------------
    @property
    def capacity(self) -> int:
        return len(self._state)

    @property
    def page_nbytes(self) -> int:
        return self.host_kv[0].numel() * self.host_kv.element_size()

    @property
    def num_free(self) -> int:
        return self._counts[PageState.FREE]

    @property
    def num_used(self) -> int:
        return self._counts[PageState.USED]

    @property
    def num_in_flight(self) -> int:
        return self._counts[PageState.IN_FLIGHT]

    # ---- state changes -----------------------------------------------------------------
    def alloc(self, n: int) -> list[int] | None:
        """Take `n` free pages into IN_FLIGHT, or None (and nothing taken) if short."""
        with self._lock:
            if n > len(self._free):
                return None
            page_ids = [self._free.pop() for _ in range(n)]
            for p in page_ids:
                self._set(p, PageState.IN_FLIGHT)
            return page_ids

    def commit(self, page_ids: Iterable[int]) -> None:
        """IN_FLIGHT → USED: the pages now hold valid KV owned by the cache."""
        with self._lock:
            for p in page_ids:
                self._expect(p, PageState.IN_FLIGHT)
                self._set(p, PageState.USED)

    def free(self, page_ids: Iterable[int]) -> None:
        """USED or IN_FLIGHT → FREE. Freeing a pinned or already free page is a bug."""
        with self._lock:
            for p in page_ids:
                if self._pins[p]:
                    raise ValueError(f"host page {p} freed while pinned ({self._pins[p]})")
                self._free_locked(p)

    def free_unpinned(self, page_ids: Iterable[int]) -> list[int]:
        """Free those of `page_ids` no I/O pins, in one step under the lock; returns the
        pinned rest. Two separate `is_pinned` passes raced the I/O threads' unpins: a page
        unpinned between them was freed and kept as pinned (freed again later, maybe from
        its next owner), or neither (leaked)."""
        pinned: list[int] = []
        with self._lock:
            for p in page_ids:
                if self._pins[p]:
                    pinned.append(p)
                else:
                    self._free_locked(p)
        return pinned

    def _free_locked(self, p: int) -> None:
        if self._state[p] == PageState.FREE:
            raise ValueError(f"host page {p} freed twice")
        self._set(p, PageState.FREE)
        self._free.append(p)

    def pin(self, page_ids: Iterable[int]) -> None:
        with self._lock:
            for p in page_ids:
                if self._state[p] == PageState.FREE:
                    raise ValueError(f"host page {p} pinned while free")
                self._pins[p] += 1

    def unpin(self, page_ids: Iterable[int]) -> None:
        with self._lock:
            for p in page_ids:
                if self._pins[p] <= 0:
                    raise ValueError(f"host page {p} unpinned more than pinned")
                self._pins[p] -= 1

    def is_used(self, page_id: int) -> bool:
        return self._state[page_id] == PageState.USED

    def is_pinned(self, page_id: int) -> bool:
        return self._pins[page_id] > 0

    @property
    def any_pinned(self) -> bool:
        """Some page is pinned (a storage write or a load reads it)."""
        with self._lock:
            return any(self._pins)

    # ---- data --------------------------------------------------------------------------
    def page_bytes(self, page_ids: Sequence[int]) -> list[torch.Tensor]:
        """1-D uint8 views of the pages (what storage backends read into and write from)."""
        flat = self.host_kv.view(self.capacity, -1)
        return [flat[p].view(torch.uint8) for p in page_ids]

    def check(self) -> None:
        """Raise AssertionError unless free + used + in_flight == capacity and lists agree."""
        with self._lock:
            total = sum(self._counts.values())
            assert total == self.capacity, f"host pages: {self._counts} != {self.capacity}"
            free_states = sum(1 for s in self._state if s == PageState.FREE)
            assert free_states == len(self._free) == self.num_free, "host free list drifted"

    # ---- internals ---------------------------------------------------------------------
    def _set(self, page_id: int, state: PageState) -> None:
        self._counts[self._state[page_id]] -= 1
        self._counts[state] += 1
        self._state[page_id] = state

    def _expect(self, page_id: int, state: PageState) -> None:
        if self._state[page_id] != state:
            raise ValueError(f"host page {page_id} is {self._state[page_id].name}, not {state.name}")
