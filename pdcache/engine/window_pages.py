"""The device pages of a model's sliding-window layers (gpt-oss), kept apart from the full
layers' so that pages out of every live window can be freed (docs/design.md §4.14).

Two page spaces: the engine's `DeviceKVPool` then holds the full layers only
(`WindowPages.full_geometry`: the sliding layers have no row there) and `WindowPages.pool`
the sliding layers only (`sliding_geometry`), each with its own `PageAllocator`. Page i of a
request in either space holds the same tokens `[i*S, (i+1)*S)`: a request holds one list per
space (`Req.page_ids`, `Req.window_page_ids`, where None marks a sliding page freed because
no window needs it any more), and so does a radix node (`RadixNode.window_page_ids`, None: a
*tombstone*).

Which sliding pages are needed (`first_needed_page`): attention at position p reads tokens
`[p - W + 1, p]`, and a prefix hit at a page-aligned point h needs `[h - W + 1, h)`. A running
request keeps every page from the first one its own last page-aligned point needs (so that
the tree can restore a hit at its end after it releases them), plus the pages from the
window before its prompt's last token to the page the prompt ends in. Those keep three
points restorable: the page boundary below the prompt's last token (the same prompt sent
again, the request's other samples: a hit always leaves one token to compute), the one
below its end (another answer to it), and the first boundary after it (a next turn that
renders the answer differently parts right after the prompt: harmony without the analysis,
a template's assistant header). Everything older is freed as the window moves
(`droppable`; counted in `freed_by_window`).

Allocation: a request gets its sliding pages a prefill chunk at a time (the scheduler's
`_extend_batch`) and one a decode step, so the pool can be smaller than the full layers'
(`[cache] sliding_pages`, at least `min_sliding_pages`): `Req.window_page_ids` covers its
pages up to the last one scheduled, fewer than `Req.page_ids` while a prompt is prefilling.

Ownership: a used sliding page has exactly one owner, as a full page does: a running request
(its own pages, after `num_tree_pages`) or the radix tree. Engine thread only; nothing locks.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from pdcache.engine.kv_geometry import KVGeometry
from pdcache.engine.kv_pool import DeviceKVPool, PageAllocator

if TYPE_CHECKING:
    from pdcache.engine.radix import RadixTree

# A page-table entry for a sliding page that is gone: the kernels mask every position out of
# the window before its value counts, and any page of the pool holds finite numbers.
ABSENT_PAGE = 0


def split_geometry(geometry: KVGeometry, kind: str) -> KVGeometry:
    """`geometry` restricted to the layers of `kind` ("full" or "sliding"): the others have
    no row (marked "linear"); the result has no window, so its layers are all full-shaped."""
    kinds = tuple("full" if k == kind else "linear" for k in geometry.layer_kinds)
    return geometry.with_layer_kinds(kinds, 0)


def can_split(geometry: KVGeometry) -> bool:
    """A geometry with both full and sliding layers (and no linear ones) runs two spaces."""
    kinds = set(geometry.layer_kinds)
    return kinds == {"full", "sliding"}


def min_sliding_pages(window: int, page_size: int, max_running: int, chunk_tokens: int) -> int:
    """The smallest sliding pool every running request can always progress in: each holds
    at most its prompt end's window tail, its current window's and one more page (a decode
    step, or a chunk not starting on a page boundary), and a step's chunks add at most
    `chunk_tokens` worth of pages. A window tail is `ceil((window - 1) / page_size) + 2`
    pages (`WindowPages.tail_pages`)."""
    tail = -(-(window - 1) // page_size) + 2
    return max_running * (2 * tail + 2) + -(-chunk_tokens // page_size)


class WindowPages:
    """The sliding layers' device pool, its allocator, the window and the rows each layer
    has in its space. Mutates only its counter `freed_by_window` (the scheduler frees)."""

    def __init__(self, geometry: KVGeometry, num_pages: int, page_size: int,
                 dtype: torch.dtype, device: str | torch.device = "cpu") -> None:
        if not can_split(geometry):
            raise ValueError(f"window pages need full and sliding layers, got "
                             f"{geometry.describe()}")
        self.window = geometry.sliding_window
        self.page_size = page_size
        self.full_geometry = split_geometry(geometry, "full")
        self.sliding_geometry = split_geometry(geometry, "sliding")
        shape = self.sliding_geometry.device_shape(num_pages, page_size)
        self.pool = DeviceKVPool(torch.zeros(shape, dtype=dtype, device=device),
                                 self.sliding_geometry)
        layers = range(geometry.num_layers)
        # model layer -> its row in its own space's pool
        self.full_rows = {i: self.full_geometry.kv_layer_index(i) for i in layers
                          if geometry.layer_kind(i) == "full"}
        self.sliding_rows = {i: self.sliding_geometry.kv_layer_index(i) for i in layers
                             if geometry.layer_kind(i) == "sliding"}
        self.freed_by_window = 0  # sliding pages freed because no window needed them
        # the tree's sliding pages on locked paths freed because no request read them
        # (`Scheduler._reclaim_window_pages`)
        self.reclaimed_from_tree = 0

    @property
    def allocator(self) -> PageAllocator:
        return self.pool.allocator

    def full_pool(self, num_pages: int, dtype: torch.dtype,
                  device: str | torch.device = "cpu") -> DeviceKVPool:
        """The engine's pool of the full layers only."""
        shape = self.full_geometry.device_shape(num_pages, self.page_size)
        return DeviceKVPool(torch.zeros(shape, dtype=dtype, device=device), self.full_geometry)

    def first_needed_page(self, length: int) -> int:
        """The first page a hit at `length`'s last page boundary (and attention at
        `length` itself) reads on a sliding layer."""
        boundary = length // self.page_size * self.page_size
        return max(0, boundary - self.window + 1) // self.page_size

    def tail_pages(self, num_tokens: int) -> range:
        """The pages whose sliding layers a sequence of `num_tokens` tokens keeps at its end:
        from the first one a hit at its last token's page boundary reads to the page it
        ends in. Everything a continuation reads (attention at `num_tokens`, a hit at the
        boundary below its end or at the first one after) is in it: the *window tail* that
        P→D and the host/storage tiers carry for a prompt's or an answer's end."""
        return range(self.first_needed_page(max(num_tokens - 1, 0)),
                     -(-num_tokens // self.page_size))

    def droppable(self, window_page_ids: list[int | None], first_own: int, kv_len: int,
                  prompt_len: int, read_from: int | None = None) -> list[int]:
        """Indices of own present pages (from `first_own` on) that no window of the request
        needs any more: before its current one and outside its prompt end's tail, and below
        `read_from` (pages something else still reads from there on: decode offload's
        copies). Scans down from there to the first page freed before (everything older
        went then too), so a step costs the pages it frees, not the sequence's length."""
        keep = self.tail_pages(prompt_len)
        drop: list[int] = []
        top = min(self.first_needed_page(kv_len), len(window_page_ids))
        if read_from is not None:
            top = min(top, read_from)
        for index in range(top - 1, first_own - 1, -1):
            if index in keep:
                continue
            if window_page_ids[index] is None:
                break
            drop.append(index)
        return drop

    def check_accounting(self, owned: list[int], tree_pages: int) -> dict[str, int]:
        """Every sliding page is free, the tree's (`tree_pages` of them) or a request's own
        (`owned`: running and held requests', reserved window tails), each exactly once
        (docs/design.md §5.1). Engine thread. The numbers checked."""
        allocator = self.allocator
        allocator.check()
        numbers = {"window_capacity": allocator.capacity, "window_free": allocator.num_free,
                   "window_tree": tree_pages, "window_requests": len(owned)}
        assert len(set(owned)) == len(owned), numbers
        assert all(allocator.is_used(page) for page in owned), numbers
        assert tree_pages + len(owned) == allocator.num_used, numbers
        return numbers

    def stats(self, tree: RadixTree | None) -> dict[str, int]:
        """The sliding layers' page space and the hits the window cut (`Engine.stats`)."""
        allocator = self.allocator
        return {
            "window_pages_total": allocator.capacity,
            "window_pages_free": allocator.num_free,
            "window_pages_cached": tree.window_pages if tree else 0,
            "window_pages_freed_total": self.freed_by_window,
            "window_pages_reclaimed_total": self.reclaimed_from_tree,
            "prefix_hits_limited_by_window_total":
                tree.limited_matches.get("window", 0) if tree else 0,
            "tokens_limited_by_window_total":
                tree.limited_tokens.get("window", 0) if tree else 0,
        }
