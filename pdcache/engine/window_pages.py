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

Below the device tier (host, storage) a window tail is the sliding layers' *checkpoint* at a
radix node end, as a recurrent state is one (`WindowTails`, `WindowTailGeometry`): host and
stored pages carry the full layers only, and a node end whose tail is on device when its pages
are backed up gets a host state slot (then a stored object under `window_page_key`) holding
the sliding layers of the `ceil((W - 1) / S)` pages a hit there reads.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from pdcache.engine.kv_geometry import KVGeometry
from pdcache.engine.kv_pool import DeviceKVPool, PageAllocator
from pdcache.engine.page_keys import window_page_key
from pdcache.engine.state_pool import StateSnapshot

if TYPE_CHECKING:
    from pdcache.engine.radix import RadixNode, RadixTree

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


# ------------------------------------------------------------------------- window tails
@dataclass(frozen=True)
class WindowTailGeometry:
    """A window tail as a checkpoint blob (`CheckpointGeometry`): the sliding layers of the
    `num_pages = ceil((window - 1) / page_size)` pages before a page-aligned point (all a hit
    there reads), page-first, each `[L_sliding, K, S, H, D]` in the pool's dtype; pages before
    token 0 (a point closer to the start than the window) are zeros."""

    layers_key: str  # the sliding geometry's layout key: other layer mixes never match
    window: int
    page_size: int
    page_bytes: int  # one page of the sliding layers

    @classmethod
    def of(cls, geometry: KVGeometry, page_size: int) -> WindowTailGeometry:
        """The window tail of a model mixing full and sliding layers (`can_split`)."""
        return cls.of_sliding(split_geometry(geometry, "sliding"), geometry.sliding_window,
                              page_size)

    @classmethod
    def of_sliding(cls, sliding: KVGeometry, window: int, page_size: int
                   ) -> WindowTailGeometry:
        """The tail of `sliding` (a sliding-only geometry, `split_geometry`) for `window`."""
        return cls(sliding.layout_key(page_size), window, page_size,
                   sliding.page_bytes(page_size))

    @property
    def num_pages(self) -> int:
        return -(-(self.window - 1) // self.page_size)

    def tail_range(self, end_pages: int) -> range:
        """Page indices a hit after `end_pages` pages reads on the sliding layers."""
        return range(max(0, end_pages - self.num_pages), end_pages)

    def state_bytes(self) -> int:
        return self.num_pages * self.page_bytes

    def key(self) -> str:
        # the window too: windows with the same page count (7 and 8 over pages of 4) hold
        # different K/V, and the sliding geometry's key has no window (`split_geometry`)
        return (f"window_tail;window={self.window};pages={self.num_pages}x{self.page_size};"
                f"{self.layers_key}")

    def describe(self) -> str:
        return (f"window tail of {self.num_pages} sliding pages (window {self.window}) = "
                f"{self.state_bytes():,} B")

    def object_key(self, page_key: bytes) -> bytes:
        """`window_page_key` of the tail ending with the page keyed `page_key`."""
        return window_page_key(page_key, self.key())


class WindowTails:
    """The window tails at radix node ends on device (`DeviceCheckpoints`, for HiCache's
    backup) and their restore from a host blob into sliding pages. Owns nothing: it reads
    the tree's sliding pages and writes the pages a restore is given. Engine thread."""

    def __init__(self, window: WindowPages) -> None:
        self.window = window
        self.geometry = WindowTailGeometry.of_sliding(window.sliding_geometry, window.window,
                                                      window.page_size)

    def has_checkpoint(self, node: RadixNode) -> bool:
        return None not in self._tail_of(node)

    def snapshot_checkpoint(self, node: RadixNode) -> StateSnapshot:
        return self._snapshot(self._tail_of(node))

    def snapshot_pages(self, window_page_ids: list[int | None], end_pages: int
                       ) -> StateSnapshot | None:
        """The tail after the first `end_pages` of a request's sliding pages (decode
        offload's answer end), None when one of them was freed."""
        pages = [window_page_ids[i] for i in self.geometry.tail_range(end_pages)]
        return None if None in pages else self._snapshot(pages)

    def _snapshot(self, pages: list[int | None]) -> StateSnapshot:
        assert None not in pages, "no window tail on device at this point"
        pad = self.geometry.num_pages - len(pages)
        kv = self.window.pool.device_kv
        blob = torch.zeros((self.geometry.num_pages, *self._page_shape), dtype=kv.dtype)
        if pages:  # one gather of every page, page-first (`[L, K, P, ...]` → `[P, L, K, ...]`)
            blob[pad:] = kv[:, :, pages].movedim(2, 0)
        return StateSnapshot(self.geometry, blob.reshape(-1).view(torch.uint8))

    def restore(self, blob: torch.Tensor, end_pages: int,
                targets: list[tuple[int, int]]) -> None:
        """Write the tail `blob` (a snapshot's bytes) of the point after `end_pages` pages
        into sliding pages: `targets` are `(page index, sliding page id)` within its range."""
        if not targets:
            return
        kv = self.window.pool.device_kv
        pages = blob.view(kv.dtype).view(self.geometry.num_pages, *self._page_shape)
        tail = self.geometry.tail_range(end_pages)
        offset = self.geometry.num_pages - len(tail) - tail.start  # page index → blob slot
        slots = [offset + index for index, _ in targets]
        kv[:, :, [page for _, page in targets]] = pages[slots].movedim(0, 2)

    def fill(self, blob: torch.Tensor, tree: RadixTree, path: list[RadixNode],
             num_tree_pages: int, end_pages: int, spare: list[int]
             ) -> tuple[list[int | None], list[int]]:
        """The sliding pages of a lower-tier hit after `end_pages` pages whose first
        `num_tree_pages` are the tree's (`path`, root to its deepest node): its tail pages
        the tree lacks are taken from `spare` (free sliding pages, a whole tail's), filled
        from `blob` and given to the tree nodes (tree pages) or returned as the request's own
        (the rest). Returns the request's sliding page ids of all `end_pages` pages (None: a
        tombstone) and the spare pages not taken."""
        # a device hit may end inside its last node: only its first pages are the hit's
        slots = _page_slots(path)
        assert len(slots) >= num_tree_pages, (len(slots), num_tree_pages)
        slots = slots[:num_tree_pages]
        tail = self.geometry.tail_range(end_pages)
        missing = [i for i in tail if i >= num_tree_pages or _window_at(*slots[i]) is None]
        assert len(missing) <= len(spare), "fewer spare sliding pages than a tail"
        targets = list(zip(missing, spare))
        self.restore(blob, end_pages, targets)
        own: dict[int, int] = {}
        for index, page in targets:
            if index < num_tree_pages:
                tree.adopt_window_page(*slots[index], page)
            else:
                own[index] = page
        ids: list[int | None] = [_window_at(*slot) for slot in slots]
        return ids + [own.get(i) for i in range(num_tree_pages, end_pages)], spare[len(missing):]

    @property
    def _page_shape(self) -> tuple[int, ...]:
        return self.window.sliding_geometry.page_shape(self.window.page_size)

    def _tail_of(self, node: RadixNode) -> list[int | None]:
        """The sliding page ids of the tail at `node`'s end (None: freed)."""
        slots = _page_slots(node.path_from_root())
        return [_window_at(*slots[i]) for i in self.geometry.tail_range(len(slots))]


def _page_slots(path: list[RadixNode]) -> list[tuple[RadixNode, int]]:
    """(node, page index in it) of every page along `path`, root first."""
    return [(node, index) for node in path for index in range(node.num_pages)]


def _window_at(node: RadixNode, index: int) -> int | None:
    pages = node.window_page_ids
    return None if pages is None else pages[index]

