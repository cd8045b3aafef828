"""Address arithmetic of a paged KV pool `kv[L, K, P, S, H, D]` (K slabs per layer: 2 for K and V,
1 for an MLA latent; see `pdcache.engine.kv_geometry`) and of page-to-page copies."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch


@dataclass(frozen=True)
class KVLayout:
    """Where each page of a contiguous `[L, K, P, ...]` pool lives in memory.

    The page of layer l, slab k (K, V or the latent), page p starts at
    `base_addr + ((l * K + k) * num_pages + p) * page_bytes`; `page_bytes` is one slab's page.
    """

    base_addr: int
    num_layers: int
    num_pages: int
    page_bytes: int
    num_slabs: int = 2

    @classmethod
    def from_tensor(cls, kv: torch.Tensor) -> KVLayout:
        if kv.dim() < 3 or kv.shape[1] not in (1, 2):
            raise ValueError(f"KV pool must be [L, K, P, ...] with K = 1 or 2 slabs, got shape "
                             f"{tuple(kv.shape)}")
        if not kv.is_contiguous():
            raise ValueError("KV pool must be contiguous")
        page_bytes = kv[0, 0, 0].numel() * kv.element_size()
        return cls(kv.data_ptr(), kv.shape[0], kv.shape[2], page_bytes, kv.shape[1])

    @property
    def num_rows(self) -> int:
        """Slabs of all layers: the pool is `num_rows` runs of `num_pages` pages."""
        return self.num_layers * self.num_slabs

    @property
    def nbytes(self) -> int:
        return self.num_rows * self.num_pages * self.page_bytes

    def check_pages(self, page_ids: np.ndarray, what: str) -> None:
        if page_ids.size and (page_ids.min() < 0 or page_ids.max() >= self.num_pages):
            raise ValueError(f"{what} page ids outside [0, {self.num_pages})")

    def page_addrs(self, page_ids: np.ndarray) -> np.ndarray:
        """Addresses of every (layer, slab, page), layer-major: shape [L * K * len(page_ids)]."""
        return self.layer_page_addrs(range(self.num_layers), page_ids)

    def layer_page_addrs(self, layers: Sequence[int], page_ids: np.ndarray) -> np.ndarray:
        """Addresses of every (layer, slab, page) of `layers` (rows of this pool, in that
        order), layer-major: shape [len(layers) * K * len(page_ids)]."""
        rows = np.asarray(layers, dtype=np.int64)
        if rows.size and (rows.min() < 0 or rows.max() >= self.num_layers):
            raise ValueError(f"layer rows outside [0, {self.num_layers})")
        slabs = (rows[:, None] * self.num_slabs
                 + np.arange(self.num_slabs, dtype=np.int64)[None, :]).reshape(-1)
        pages = slabs[:, None] * self.num_pages + np.asarray(page_ids, dtype=np.int64)[None, :]
        return (self.base_addr + pages * self.page_bytes).reshape(-1)


@dataclass(frozen=True)
class WriteBatch:
    """A batched copy: entry i copies lengths[i] bytes from local srcs[i] to remote dsts[i]."""

    srcs: np.ndarray  # int64 addresses in the writer's memory
    dsts: np.ndarray  # int64 addresses in the peer's memory
    lengths: np.ndarray  # int64 byte counts

    @property
    def nbytes(self) -> int:
        return int(self.lengths.sum())

    def __len__(self) -> int:
        return int(self.lengths.size)

    def coalesced(self) -> WriteBatch:
        """Merge entries whose source and destination both continue the previous entry."""
        if len(self) <= 1:
            return self
        ends_src = self.srcs[:-1] + self.lengths[:-1]
        ends_dst = self.dsts[:-1] + self.lengths[:-1]
        starts = np.concatenate(([True], (self.srcs[1:] != ends_src) | (self.dsts[1:] != ends_dst)))
        first = np.flatnonzero(starts)
        lengths = np.add.reduceat(self.lengths, first)
        return WriteBatch(self.srcs[first], self.dsts[first], lengths)

    def split(self, max_entries: int, max_bytes: int) -> list[WriteBatch]:
        """Consecutive sub-batches of at most `max_entries` entries and `max_bytes` bytes,
        in order; an entry longer than `max_bytes` (a coalesced run of contiguous pages) is
        cut into consecutive pieces first, so the byte bound (abort latency, what a
        cancelled room leaves on the wire) holds for contiguous pages too."""
        pieces = self.chunked(max_bytes)
        parts: list[WriteBatch] = []
        start = 0
        cumulative = np.cumsum(pieces.lengths)
        while start < len(pieces):
            base = cumulative[start - 1] if start else 0
            by_bytes = int(np.searchsorted(cumulative, base + max_bytes, side="right"))
            end = min(start + max_entries, max(by_bytes, start + 1), len(pieces))
            parts.append(WriteBatch(pieces.srcs[start:end], pieces.dsts[start:end],
                                    pieces.lengths[start:end]))
            start = end
        return parts

    def chunked(self, max_bytes: int) -> WriteBatch:
        """The same copy with every entry longer than `max_bytes` cut into consecutive
        pieces of `max_bytes` (the last one shorter); ValueError for `max_bytes` < 1."""
        if max_bytes < 1:
            raise ValueError(f"max_bytes must be >= 1, got {max_bytes}")
        if not len(self) or int(self.lengths.max()) <= max_bytes:
            return self
        counts = -(-self.lengths // max_bytes)  # pieces per entry (ceil)
        entry = np.repeat(np.arange(len(self)), counts)
        first = np.repeat(np.cumsum(counts) - counts, counts)  # each piece's entry's first
        offsets = (np.arange(entry.size, dtype=np.int64) - first) * max_bytes
        lengths = np.minimum(self.lengths[entry] - offsets, max_bytes)
        return WriteBatch(self.srcs[entry] + offsets, self.dsts[entry] + offsets, lengths)


def page_copy_batch(src: KVLayout, dst: KVLayout, src_pages: np.ndarray,
                    dst_pages: np.ndarray) -> WriteBatch:
    """Every layer's slab pages src_pages[i] → dst_pages[i], coalesced into runs."""
    shape = (src.num_layers, src.num_slabs, src.page_bytes)
    if shape != (dst.num_layers, dst.num_slabs, dst.page_bytes):
        raise ValueError(
            f"KV layouts differ: {src.num_layers} layers × {src.num_slabs} slabs × "
            f"{src.page_bytes} B pages vs {dst.num_layers} × {dst.num_slabs} × {dst.page_bytes}"
        )
    if len(src_pages) != len(dst_pages):
        raise ValueError(f"{len(src_pages)} source pages for {len(dst_pages)} destination pages")
    src.check_pages(src_pages, "source")
    dst.check_pages(dst_pages, "destination")
    srcs = src.page_addrs(src_pages)
    lengths = np.full(srcs.size, src.page_bytes, dtype=np.int64)
    return WriteBatch(srcs, dst.page_addrs(dst_pages), lengths).coalesced()


def layer_copy_batch(src: KVLayout, src_layers: Sequence[int], dst: KVLayout,
                     dst_layers: Sequence[int], src_pages: np.ndarray,
                     dst_pages: np.ndarray) -> WriteBatch:
    """Layer rows `src_layers[j]` of pages src_pages[i] → rows `dst_layers[j]` of
    dst_pages[i], every slab, coalesced into runs: a copy between pools that hold different
    layer sets (window pages: the full layers in one space, the sliding ones in another)."""
    if (src.num_slabs, src.page_bytes) != (dst.num_slabs, dst.page_bytes):
        raise ValueError(f"KV layouts differ: {src.num_slabs} slabs × {src.page_bytes} B pages "
                         f"vs {dst.num_slabs} × {dst.page_bytes}")
    if len(src_layers) != len(dst_layers):
        raise ValueError(f"{len(src_layers)} source layers for {len(dst_layers)} destination "
                         f"layers")
    if len(src_pages) != len(dst_pages):
        raise ValueError(f"{len(src_pages)} source pages for {len(dst_pages)} destination pages")
    src.check_pages(src_pages, "source")
    dst.check_pages(dst_pages, "destination")
    srcs = src.layer_page_addrs(src_layers, src_pages)
    lengths = np.full(srcs.size, src.page_bytes, dtype=np.int64)
    return WriteBatch(srcs, dst.layer_page_addrs(dst_layers, dst_pages), lengths).coalesced()


def window_tail_copy_batch(src: KVLayout, dst_full: KVLayout, dst_window: KVLayout,
                           layer_kinds: Sequence[str], src_pages: np.ndarray,
                           dst_pages: np.ndarray, tail: range,
                           dst_window_pages: np.ndarray) -> WriteBatch:
    """A sequence's pages from a one-space pool `src` (every KV layer of `layer_kinds`, in
    order) to a split one (window pages): the full layers of every page into `dst_full`
    (its rows: the full layers in order), the sliding layers into `dst_window` (the sliding
    layers in order) for the pages of `tail` only (indices into `src_pages`, landing on
    `dst_window_pages`). The rest of the sliding pages never move: the receiver records
    them as tombstones."""
    full = [i for i, kind in enumerate(layer_kinds) if kind == "full"]
    sliding = [i for i, kind in enumerate(layer_kinds) if kind == "sliding"]
    if len(full) + len(sliding) != len(layer_kinds) or len(layer_kinds) != src.num_layers:
        raise ValueError(f"a window-tail copy needs full and sliding layers only, one per "
                         f"source row: {''.join(k[0].upper() for k in layer_kinds)} over "
                         f"{src.num_layers} rows")
    if tail.step != 1 or (len(tail) and (tail.start < 0 or tail.stop > len(src_pages))):
        raise ValueError(f"window tail {tail} outside the {len(src_pages)} pages sent")
    pages = np.asarray(src_pages, dtype=np.int64)
    full_batch = layer_copy_batch(src, full, dst_full, range(len(full)), pages, dst_pages)
    tail_batch = layer_copy_batch(src, sliding, dst_window, range(len(sliding)),
                                  pages[tail.start:tail.stop], dst_window_pages)
    return WriteBatch(np.concatenate((full_batch.srcs, tail_batch.srcs)),
                      np.concatenate((full_batch.dsts, tail_batch.dsts)),
                      np.concatenate((full_batch.lengths, tail_batch.lengths)))
