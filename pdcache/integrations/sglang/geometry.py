"""How SGLang's host KV pool lays out one page (the four host layouts, MHA and MLA), and
the byte views the plugin moves."""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from pdcache.engine.config import dtype_name
from pdcache.engine.kv_geometry import KVGeometry

# --------------------------------------------------------------------------- host pool pages


@dataclass(frozen=True)
class PageGeometry:
    """How one page sits in an SGLang host pool, and its canonical (stored) shape.

    `page_shape` is a page as sliced from the pool buffer (and as SGLang's flat data pages
    are ordered); `perm` turns that into `canonical_shape`.
    """

    kind: str  # "mha" | "mla"
    layout: str
    layer_num: int
    page_size: int
    head_num: int
    head_dim: int
    dtype: torch.dtype
    page_shape: tuple[int, ...]
    perm: tuple[int, ...]
    canonical_shape: tuple[int, ...]

    @functools.cached_property
    def kv_geometry(self) -> KVGeometry:
        """pdcache's geometry of the same cache (its stored pages have the canonical bytes)."""
        if self.kind == "mla":
            return KVGeometry.from_device_shape((self.layer_num, 1, 0, 0, 1, self.head_dim),
                                                dtype_name(self.dtype))
        return KVGeometry.mha(self.layer_num, self.head_num, self.head_dim, dtype_name(self.dtype))

    @functools.cached_property
    def page_bytes(self) -> int:
        return int(np.prod(self.canonical_shape)) * self.dtype.itemsize

    @functools.cached_property
    def run_bytes(self) -> int:
        """Bytes of one contiguous run of a page ("split" layouts)."""
        return self.page_bytes // max(1, self.split_pieces)

    @classmethod
    def from_host_pool(cls, pool: Any) -> PageGeometry:
        """Geometry of SGLang's MHATokenToKVPoolHost / MLATokenToKVPoolHost (or a lookalike)."""
        layout, size, layers = pool.layout, pool.page_size, pool.layer_num
        if hasattr(pool, "kv_cache_dim"):
            dim = int(pool.kv_cache_dim)
            shapes = {
                "layer_first": ((layers, size, 1, dim), (0, 1, 2, 3)),
                "page_first": ((size, layers, 1, dim), (1, 0, 2, 3)),
                "page_first_direct": ((layers, size, 1, dim), (0, 1, 2, 3)),
            }
            kind, heads, canonical = "mla", 1, (layers, size, 1, dim)
        else:
            heads, dim = int(pool.head_num), int(pool.head_dim)
            if getattr(pool, "v_head_dim", dim) != dim:
                raise ValueError("pdcache storage needs K and V of the same head_dim")
            shapes = {
                "layer_first": ((2, layers, size, heads, dim), (1, 0, 2, 3, 4)),
                "page_first": ((2, size, layers, heads, dim), (2, 0, 1, 3, 4)),
                "page_first_direct": ((2, layers, size, heads, dim), (1, 0, 2, 3, 4)),
                "page_head": ((2, heads, size, layers, dim), (3, 0, 2, 1, 4)),
            }
            kind, canonical = "mha", (layers, 2, size, heads, dim)
        if layout not in shapes:
            raise ValueError(f"host layout {layout!r} ({kind}) is not supported; use one of "
                             f"{sorted(shapes)}")
        page_shape, perm = shapes[layout]
        return cls(kind, layout, layers, size, heads, dim, pool.dtype, page_shape, perm,
                   canonical)

    def _bytes_shape(self, shape: tuple[int, ...]) -> tuple[int, ...]:
        return (*shape[:-1], shape[-1] * self.dtype.itemsize)

    def pool_page(self, kv_bytes: np.ndarray, first_token: int) -> np.ndarray:
        """A view (no copy) of the page starting at host token `first_token`, canonical order.

        `kv_bytes` is the pool's kv_buffer as bytes (`byte_array`): numpy slicing costs about
        a microsecond where a torch view costs ten, and a batch makes hundreds.
        """
        i, size = first_token, self.page_size
        if self.layout == "layer_first":
            page = kv_bytes[:, :, i : i + size] if self.kind == "mha" else kv_bytes[:, i : i + size]
        elif self.layout == "page_first":
            page = kv_bytes[:, i : i + size] if self.kind == "mha" else kv_bytes[i : i + size]
        else:  # page_first_direct, page_head: the buffer has a page axis
            page = kv_bytes[:, i // size] if self.kind == "mha" else kv_bytes[i // size]
        return page.transpose(self.perm)

    def flat_page(self, flat: torch.Tensor) -> np.ndarray:
        """A view of one of SGLang's flat data pages (layout order), canonical order."""
        return byte_array(flat).reshape(self._bytes_shape(self.page_shape)).transpose(self.perm)

    def stored(self, page: np.ndarray) -> np.ndarray:
        """A stored (canonical, contiguous) page of bytes seen in the canonical shape."""
        return page.reshape(self._bytes_shape(self.canonical_shape))

    @property
    def split_pieces(self) -> int:
        """Contiguous runs per page in the pool (K and V for MHA, the page for MLA: the payload
        of the "split" payload); 0 when the layout has none (layer_first, page_head)."""
        if self.layout not in ("page_first", "page_first_direct"):
            return 0
        return 2 if self.kind == "mha" else 1

    def pool_runs(self, kv_flat: torch.Tensor, first_token: int) -> tuple[torch.Tensor, ...]:
        """The page's contiguous runs (K then V for MHA) as 1-D uint8 views of the pool.

        `kv_flat` is the whole kv_buffer as one flat uint8 tensor (`flat_bytes`): slicing it
        costs a fraction of slicing the N-d buffer, and a batch makes hundreds.
        """
        run = self.run_bytes
        if self.layout == "page_first":  # token-major: a page is `page_size` tokens of runs
            start = first_token * (run // self.page_size)
        else:  # page_first_direct: a page axis
            start = (first_token // self.page_size) * run
        if self.kind == "mla":
            return (kv_flat[start : start + run],)
        v_start = start + kv_flat.numel() // 2
        return kv_flat[start : start + run], kv_flat[v_start : v_start + run]

    def flat_runs(self, flat: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """The same runs of one of SGLang's flat data pages (they are in pool order)."""
        return tuple(_bytes_of(flat).chunk(self.split_pieces))


def byte_array(tensor: torch.Tensor) -> np.ndarray:
    """A CPU tensor whose last dim is contiguous as a numpy uint8 array (no copy)."""
    return tensor.view(torch.uint8).numpy()


def flat_bytes(tensor: torch.Tensor) -> torch.Tensor:
    """A contiguous tensor as one flat uint8 tensor (no copy); raises if not contiguous."""
    return tensor.view(-1).view(torch.uint8)


def _bytes_of(tensor: torch.Tensor) -> torch.Tensor:
    """A contiguous tensor as a 1-D uint8 view (no copy)."""
    if not tensor.is_contiguous():
        raise ValueError("expected a contiguous run of the host pool")
    return tensor.reshape(-1).view(torch.uint8)
