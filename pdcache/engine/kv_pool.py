"""Paged device KV pool: the `device_kv` tensor and the allocator of its pages.

Ownership: a `DeviceKVPool` owns one tensor `device_kv`, shaped by the model's `KVGeometry`
(layer-first, `P` pages; see `pdcache.engine.kv_geometry`), and one `PageAllocator` over its
pages. Every page is at any time
either free (in the allocator) or used, and a used page has exactly one owner: a running
request or the radix tree. Neither class locks: both are used from the engine thread only.
"""

from __future__ import annotations

import torch

from pdcache.engine.config import ModelConfig
from pdcache.engine.kv_geometry import KVGeometry


class PageAllocationError(RuntimeError):
    """A free of a page that is not allocated (double free) or out of range."""


class PageAllocator:
    """Exact page accounting: `num_free + num_used == capacity` always holds.

    `alloc(n)` is all-or-nothing (None when fewer than n pages are free) and hands out the
    lowest free ids first, so a test's page ids are reproducible.
    """

    def __init__(self, capacity: int) -> None:
        if capacity < 1:
            raise ValueError(f"a page pool needs at least 1 page, got {capacity}")
        self._capacity = capacity
        # popped from the end: reversed so that low ids go out first
        self._free_ids: list[int] = list(range(capacity - 1, -1, -1))
        self._in_use = bytearray(capacity)  # 1 where the page is allocated

    @property
    def capacity(self) -> int:
        return self._capacity

    @property
    def num_free(self) -> int:
        return len(self._free_ids)

    @property
    def num_used(self) -> int:
        return self._capacity - len(self._free_ids)

    def alloc(self, num_pages: int) -> list[int] | None:
        """Take `num_pages` free pages, or None (nothing taken) when too few are free."""
        if num_pages < 0:
            raise ValueError(f"cannot allocate {num_pages} pages")
        if num_pages > len(self._free_ids):
            return None
        page_ids = [self._free_ids.pop() for _ in range(num_pages)]
        for page_id in page_ids:
            self._in_use[page_id] = 1
        return page_ids

    def free(self, page_ids: list[int]) -> None:
        """Return pages to the pool; raises PageAllocationError on a double or foreign free
        (checked for every id before any is freed, so a bad call frees nothing)."""
        seen: set[int] = set()
        for page_id in page_ids:
            if not 0 <= page_id < self._capacity:
                raise PageAllocationError(
                    f"page {page_id} is outside the pool [0, {self._capacity})"
                )
            if not self._in_use[page_id] or page_id in seen:
                raise PageAllocationError(f"double free of page {page_id}")
            seen.add(page_id)
        for page_id in page_ids:
            self._in_use[page_id] = 0
            self._free_ids.append(page_id)

    def is_used(self, page_id: int) -> bool:
        return bool(self._in_use[page_id])

    def check(self) -> None:
        """Raise AssertionError if the free list and the in-use map disagree."""
        free_set = set(self._free_ids)
        assert len(free_set) == len(self._free_ids), "duplicate ids in the free list"
        assert all(not self._in_use[i] for i in free_set), "a free page is marked in use"
        assert sum(self._in_use) + len(free_set) == self._capacity, "pages lost"


def allocate_kv_tensor(
    model_config: ModelConfig, num_pages: int, page_size: int, device: str | torch.device = "cpu"
) -> torch.Tensor:
    """A zeroed device pool of `num_pages` pages of the model's KV geometry, in its dtype."""
    shape = model_config.kv_geometry.device_shape(num_pages, page_size)
    return torch.zeros(shape, dtype=model_config.torch_dtype, device=device)


class DeviceKVPool:
    """The device tier's memory: `device_kv` plus the allocator of its pages."""

    def __init__(self, device_kv: torch.Tensor, geometry: KVGeometry | None = None) -> None:
        if geometry is not None:
            geometry.check_device_shape(tuple(device_kv.shape))
        elif device_kv.dim() != 6 or device_kv.shape[1] not in (1, 2):
            raise ValueError(f"device_kv must be a 6-D pool of 1 or 2 slabs per layer, got "
                             f"{tuple(device_kv.shape)}")
        self.device_kv = device_kv
        self.allocator = PageAllocator(device_kv.shape[2])

    @classmethod
    def create(
        cls,
        model_config: ModelConfig,
        num_pages: int,
        page_size: int,
        device: str | torch.device = "cpu",
    ) -> DeviceKVPool:
        return cls(allocate_kv_tensor(model_config, num_pages, page_size, device),
                   model_config.kv_geometry)

    @property
    def page_size(self) -> int:
        return self.device_kv.shape[3]

    @property
    def num_pages(self) -> int:
        return self.device_kv.shape[2]

    @property
    def page_bytes(self) -> int:
        """Bytes of one page across all layers and slabs."""
        return self.device_kv.numel() // self.num_pages * self.device_kv.element_size()

    def slot(self, page_id: int, offset: int) -> int:
        return page_id * self.page_size + offset
