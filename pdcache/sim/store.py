"""The storage tier's contents in simulation: which pages are stored, who wrote them, and
which writes are still under way.

Pages are named by their page token (`pdcache.sim.pages`: the chained page key, as an int),
so "page k is stored" means "the prefix up to page k was stored", as with the real chained
keys. Capacity is in pages; the least recently used page goes first when it is full (the
store's `session` eviction policy is not modelled). A write of a page already stored or being
written moves no bytes (the servers check `exists` before writing).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

ORIGINS = ("prefill", "decode")


@dataclass(frozen=True)
class StoredRun:
    """The pages a lookup found, from `start`: `count` of them, which of them a decode
    node wrote, readable from `ready_s` (after the pending writes among them end)."""

    start: int
    count: int
    decode_flags: tuple[bool, ...]  # per page of the run: written by a decode node
    ready_s: float

    @property
    def from_decode(self) -> int:
        return sum(self.decode_flags)


class SimStore:
    """Owns the stored pages (page token -> origin, in LRU order) and the pending writes
    (page token -> (completion time, origin)). Engine-free; driven by the event loop."""

    def __init__(self, capacity_pages: int) -> None:
        self.capacity_pages = max(1, capacity_pages)
        self._pages: OrderedDict[int, str] = OrderedDict()
        self._pending: dict[int, tuple[float, str]] = {}
        self.evicted_pages = 0
        self.written_pages = dict.fromkeys(ORIGINS, 0)

    def __len__(self) -> int:
        return len(self._pages)

    def lookup(self, pages: Sequence[int], start: int, end: int, now: float,
               pending: bool = True) -> StoredRun:
        """The consecutive pages of `pages[start:end]` stored (or being written, with
        `pending`: the reader waits for those writes)."""
        flags: list[bool] = []
        ready = now
        for page in pages[start:end]:
            origin = self._pages.get(page)
            if origin is None:
                write = self._pending.get(page) if pending else None
                if write is None:
                    break
                ready, origin = max(ready, write[0]), write[1]
            flags.append(origin == "decode")
        return StoredRun(start, len(flags), tuple(flags), ready)

    def touch(self, pages: Sequence[int]) -> None:
        """A read used these pages: they are the most recently used now."""
        for page in pages:
            if page in self._pages:
                self._pages.move_to_end(page)

    def to_write(self, pages: Sequence[int]) -> list[int]:
        """The pages of `pages` neither stored nor being written (in order)."""
        return [p for p in pages if p not in self._pages and p not in self._pending]

    def begin_write(self, pages: Sequence[int], origin: str, done_s: float) -> None:
        for page in pages:
            self._pending[page] = (done_s, origin)

    def end_write(self, pages: Sequence[int], origin: str) -> None:
        """The write of `pages` completed: they are stored (evicting the oldest if full)."""
        for page in pages:
            if self._pending.pop(page, None) is None:
                continue
            self._pages[page] = origin
            self._pages.move_to_end(page)
            self.written_pages[origin] += 1
        while len(self._pages) > self.capacity_pages:
            self._pages.popitem(last=False)
            self.evicted_pages += 1
