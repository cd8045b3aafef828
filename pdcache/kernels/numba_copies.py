"""CPU page copies compiled with numba (the default on CPU when numba is installed).

Why: a one-layer page of 16 tokens is a 32 KiB copy, below torch's intra-op grain, so torch
copies those one at a time on one thread (about 0.3 of a two-thread memcpy).

Every layout copy is a list of contiguous blocks: one `[S, H, D]` run of one slab (K, V or a
latent) of one layer of one page, contiguous in every layout (device, host, staging). One compiled loop computes each
block's offsets from the page ids and copies it with word-sized loads and stores; copies of at
least `PARALLEL_MIN_BYTES` spread their blocks over threads. Copies whose per-page view exceeds
torch's intra-op grain (all-layer copies, large pages) go to the torch backend instead: one
pass per page either way, and torch splits each over its already-running thread pool.

Same semantics and argument checks as `reference`; `store_kv` and attention are the torch
backend's. Tensors this path cannot address as flat words (on CUDA, non-contiguous, misaligned)
go to the torch backend, so every call is correct.

Threads: numba's `workqueue` layer (fork-safe; chosen unless NUMBA_THREADING_LAYER says
otherwise) does not allow two parallel launches at once, so launches are serialised by a
process-wide lock; each launch already uses all the threads copying needs.
"""

from __future__ import annotations

import math
import os
import threading

import numba
import numpy as np
import torch

from pdcache.kernels import checks, cpu
from pdcache.kernels.cpu import (  # noqa: F401  (the rest of the API, re-exported)
    paged_attention_decode,
    paged_attention_extend,
    store_kv,
)

if "NUMBA_THREADING_LAYER" not in os.environ:
    numba.config.THREADING_LAYER = "workqueue"

# Serialises parallel launches (see the module docstring); holds no data.
_LAUNCH_LOCK = threading.Lock()

# Below this many bytes a copy runs on the calling thread: a parallel launch costs ~30-100 us.
PARALLEL_MIN_BYTES = 1 << 20
# torch's intra-op grain (at::internal::GRAIN_SIZE): a copy of more elements than this is split
# over torch's threads. Page views that big are left to torch (as fast serially, faster with
# threads: no launch).
TORCH_GRAIN_ELEMS = 32768

_WORDS = {8: "int64", 1: "uint8"}


def _signature(word: int) -> str:
    w = _WORDS[word]
    return f"void({w}[::1], {w}[::1], int64[::1], int64[::1], int64, int64, int64, int64, int64, b1)"


@numba.njit(inline="always")
def _copy_block(device, paged, device_ids, paged_ids, i, first_row, num_rows, total_rows,
                pool_pages, block, to_device):  # pragma: no cover (compiled)
    """Block i of a copy: page i // num_rows, then row (a row = one slab of one layer, layer
    major: `layer * K + slab`, K slabs per layer, so device rows are `[L * K, P]` blocks and a
    page-first page is `[L * K]` blocks)."""
    page = i // num_rows
    row = first_row + i % num_rows
    dev = (row * pool_pages + device_ids[page]) * block
    pg = (paged_ids[page] * total_rows + row) * block
    if to_device:
        device[dev : dev + block] = paged[pg : pg + block]
    else:
        paged[pg : pg + block] = device[dev : dev + block]


def _compiled(parallel: bool):
    """numba.njit for the copy loops: eager, cached on disk when numba finds a writable cache
    directory (else compiled in memory, each process)."""
    def jit(fn):
        options = {"parallel": parallel, "nogil": True}
        signatures = [_signature(w) for w in _WORDS]
        try:
            return numba.njit(signatures, cache=True, **options)(fn)
        except RuntimeError:  # "cannot cache function ...: no locator available"
            return numba.njit(signatures, **options)(fn)

    return jit


# Two functions, not one jitted twice: numba's on-disk cache keys on the function, so a serial
# and a parallel compile of the same function would load each other's code.
@_compiled(parallel=False)
def _copy_pages_serial(device, paged, device_ids, paged_ids, first_row, num_rows,
                       total_rows, pool_pages, block, to_device):  # pragma: no cover
    for i in range(device_ids.shape[0] * num_rows):
        _copy_block(device, paged, device_ids, paged_ids, i, first_row, num_rows,
                    total_rows, pool_pages, block, to_device)


@_compiled(parallel=True)
def _copy_pages_parallel(device, paged, device_ids, paged_ids, first_row, num_rows,
                         total_rows, pool_pages, block, to_device):  # pragma: no cover
    for i in numba.prange(device_ids.shape[0] * num_rows):
        _copy_block(device, paged, device_ids, paged_ids, i, first_row, num_rows,
                    total_rows, pool_pages, block, to_device)


def _flat_words(t: torch.Tensor, word: int) -> np.ndarray | None:
    """`t`'s elements as a flat numpy array of `word`-byte integers, or None if not possible."""
    if t.device.type != "cpu" or not t.is_contiguous():
        return None
    if (t.storage_offset() * t.element_size()) % word or (t.numel() * t.element_size()) % word:
        return None
    flat = t.view(-1).view(torch.uint8)
    return (flat.view(torch.int64) if word == 8 else flat).numpy()


def _ids(ids: torch.Tensor, limit: int, name: str) -> np.ndarray:
    rows = ids.to("cpu", torch.int64).contiguous().numpy()
    if rows.size and (rows.min() < 0 or rows.max() >= limit):
        checks.fail("numba copy", f"{name} out of range [0, {limit})")
    return rows


def _copy(device_kv: torch.Tensor, paged: torch.Tensor, device_ids: torch.Tensor,
          paged_ids: torch.Tensor, layer: int | None, to_device: bool) -> bool:
    """Copy pages `device_ids` of the device pool to pages `paged_ids` of a page-first buffer
    (host pool or staging), or back when `to_device`. False (nothing copied) when the torch
    backend does it better or the tensors cannot be addressed as flat words here."""
    layers, slabs, pool_pages = device_kv.shape[:3]
    block_elems = math.prod(device_kv.shape[3:])
    first, count = (0, layers) if layer is None else (layer, 1)
    if slabs * count * block_elems > TORCH_GRAIN_ELEMS:
        return False  # big page views: torch copies each in one pass, split over its threads
    block_bytes = block_elems * device_kv.element_size()
    word = 8 if block_bytes % 8 == 0 else 1
    device_words, paged_words = _flat_words(device_kv, word), _flat_words(paged, word)
    if device_words is None or paged_words is None:
        return False
    total_bytes = len(device_ids) * slabs * count * block_bytes
    # The compiled loop does no bounds checks; checks.py checks only ids already on the CPU.
    device_rows = _ids(device_ids, pool_pages, "device page ids")
    paged_rows = _ids(paged_ids, len(paged), "page-first buffer page ids")
    args = (device_words, paged_words, device_rows, paged_rows, first * slabs, count * slabs,
            layers * slabs, pool_pages, block_bytes // word, to_device)
    if total_bytes < PARALLEL_MIN_BYTES or torch.get_num_threads() == 1:
        _copy_pages_serial(*args)
        return True
    with _LAUNCH_LOCK:
        numba.set_num_threads(min(torch.get_num_threads(), numba.config.NUMBA_NUM_THREADS))
        _copy_pages_parallel(*args)
    return True


def device_to_host(
    device_kv: torch.Tensor,
    host_kv: torch.Tensor,
    device_page_ids: torch.Tensor,
    host_page_ids: torch.Tensor,
    layer: int | None = None,
) -> None:
    checks.check_device_to_host(device_kv, host_kv, device_page_ids, host_page_ids, layer)
    if not _copy(device_kv, host_kv, device_page_ids, host_page_ids, layer, False):
        cpu.device_to_host(device_kv, host_kv, device_page_ids, host_page_ids, layer)


def host_to_device(
    host_kv: torch.Tensor,
    device_kv: torch.Tensor,
    host_page_ids: torch.Tensor,
    device_page_ids: torch.Tensor,
    layer: int | None = None,
) -> None:
    checks.check_host_to_device(host_kv, device_kv, host_page_ids, device_page_ids, layer)
    if not _copy(device_kv, host_kv, device_page_ids, host_page_ids, layer, True):
        cpu.host_to_device(host_kv, device_kv, host_page_ids, device_page_ids, layer)


def pack_pages(device_kv: torch.Tensor, page_ids: torch.Tensor, staging: torch.Tensor) -> None:
    checks.check_pack("pack_pages", device_kv, page_ids, staging)
    staging_ids = torch.arange(len(page_ids))
    if not _copy(device_kv, staging, page_ids, staging_ids, None, False):
        cpu.pack_pages(device_kv, page_ids, staging)


def unpack_pages(staging: torch.Tensor, device_kv: torch.Tensor, page_ids: torch.Tensor) -> None:
    checks.check_pack("unpack_pages", device_kv, page_ids, staging)
    staging_ids = torch.arange(len(page_ids))
    if not _copy(device_kv, staging, page_ids, staging_ids, None, True):
        cpu.unpack_pages(staging, device_kv, page_ids)
