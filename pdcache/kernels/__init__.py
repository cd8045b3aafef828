"""Moving and attending over paged KV: one small functional API, several implementations.

Layouts:
- device pool (layer-first): `device_kv[L, 2, P, S, H, D]`; `device_kv[l, 0]` is layer l's K
  pages, `device_kv[l, 1]` its V pages. A slot id is `page_id * S + offset`.
- host pool (page-first): `host_kv[P, L, 2, S, H, D]`; one page, all layers, is contiguous, so
  it is exactly the payload of a stored page (DESIGN.md §4.3).
- staging buffer: `staging[N, L, 2, S, H, D]`, the same order as host pages.

Functions (all mutate only their destination argument):
- `store_kv(device_kv, layer, slot_ids[T], k[T,H,D], v[T,H,D])`
- `device_to_host(device_kv, host_kv, device_page_ids[N], host_page_ids[N], layer=None)`
- `host_to_device(host_kv, device_kv, host_page_ids[N], device_page_ids[N], layer=None)`
  (`layer=None`: all layers; an int: that layer only, for the per-layer load)
- `pack_pages(device_kv, page_ids[N], staging)` / `unpack_pages(staging, device_kv, page_ids[N])`
- `paged_attention_extend(q[T,Hq,D], device_kv, layer, page_table[B,maxP], prefix_lens,
  extend_lens, scale, sliding_window=None) -> [T,Hq,D]`
- `paged_attention_decode(q[B,Hq,D], device_kv, layer, page_table, seq_lens, scale,
  sliding_window=None) -> [B,Hq,D]`

The implementation is chosen per call by the device of the tensors ("torch" on CPU,
"triton" on CUDA when triton is installed) and can be forced with the environment variable
`PDCACHE_KERNELS=torch|triton` or `select_backend(name)` on a `KernelSet`.
"""

from __future__ import annotations

from pdcache.kernels.dispatch import (
    KernelSet,
    default_kernels,
    device_to_host,
    host_to_device,
    pack_pages,
    paged_attention_decode,
    paged_attention_extend,
    store_kv,
    unpack_pages,
)

__all__ = [
    "KernelSet",
    "default_kernels",
    "device_to_host",
    "host_to_device",
    "pack_pages",
    "paged_attention_decode",
    "paged_attention_extend",
    "store_kv",
    "unpack_pages",
]
