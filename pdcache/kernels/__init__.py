"""Moving and attending over paged KV: one small functional API, several implementations.

Layouts (the shapes come from the model's `pdcache.engine.kv_geometry.KVGeometry`; `K` is the
number of slabs a layer caches per token: 2 for K and V, 1 for an MLA latent):
- device pool (layer-first): `device_kv[L, K, P, S, H, D]`; `device_kv[l, 0]` is layer l's K
  pages, `device_kv[l, 1]` its V pages (K = 2), or `device_kv[l, 0]` its latent pages (K = 1).
  A slot id is `page_id * S + offset`.
- host pool (page-first): `host_kv[P, L, K, S, H, D]`; one page, all layers, is contiguous, so
  it is exactly the payload of a stored page (docs/design.md §4.3).
- staging buffer: `staging[N, L, K, S, H, D]`, the same order as host pages.

Ids are 1-D int32/int64 tensors, any order, not necessarily contiguous. Page tables are
`[B, maxP]` int tensors; columns past a sequence's `ceil(len / S)` pages are padding (any value,
e.g. -1) and never read. Bad shapes, dtypes or ids raise `KernelArgumentError` (a ValueError).

Ops, methods of a `KernelSet` and functions of each backend module (all mutate only their
destination argument):
- `store_kv(device_kv, layer, slot_ids[T], k[T,H,D], v[T,H,D])` (a latent pool: `v` None)
- `device_to_host(device_kv, host_kv, device_page_ids[N], host_page_ids[N], layer=None)`
- `host_to_device(host_kv, device_kv, host_page_ids[N], device_page_ids[N], layer=None)`
  (`layer=None`: all layers; an int: that layer only, for the per-layer load)
- `pack_pages(device_kv, page_ids[N], staging)` / `unpack_pages(staging, device_kv, page_ids[N])`
- `paged_attention_extend(q[T,Hq,D], device_kv, layer, page_table[B,maxP], prefix_lens,
  extend_lens, scale, sliding_window=None, value_dim=None, sinks=None) -> [T,Hq,Dv]`
- `paged_attention_decode(q[B,Hq,D], device_kv, layer, page_table, seq_lens, scale,
  sliding_window=None, value_dim=None, sinks=None) -> [B,Hq,Dv]`
  (on a latent pool, MLA with absorbed weights: K is the latent row, V its first `value_dim`
  elements, so `Dv = value_dim`; on a K/V pool `Dv = D`. `sliding_window` W: a token sees
  itself and the W - 1 before it. `sinks[Hq]`: gpt-oss's attention sinks, one logit per query
  head that joins every softmax row and carries no value; every backend honours both)

Backends: "reference" (plain torch, defines correctness; tests compare against it), "torch"
(fast torch: block copies, batched decode), "numba" (torch's, with page copies compiled by numba
into one parallel loop over blocks: the default on CPU when `numba` is installed, else "torch"),
"triton" (the default when any tensor argument is on CUDA and triton is installed; extend and
decode attention included). Callers hold a `KernelSet(name)`: "auto" chooses per call by the
devices of the tensors, a backend name forces it. Nodes build theirs from the frozen config
(`EngineConfig.kernels`: `[node] kernels` in a topology, `--kernels` on the command line);
benchmarks and tests pass `KernelSet("reference")` (or call `KERNEL_BACKENDS.get(name)()`).
On CUDA the triton copies address a host pool directly when it is pinned (`pin_memory()`);
a pageable host pool falls back to per-page `copy_` (correct, slower).
`pdcache.kernels.testing` holds the oracles (dense float64 attention, per-block copies).
"""

from __future__ import annotations

from pdcache.kernels.checks import KernelArgumentError
from pdcache.kernels.dispatch import AUTO, KERNEL_BACKENDS, KernelSet

__all__ = ["AUTO", "KERNEL_BACKENDS", "KernelArgumentError", "KernelSet"]
