"""Argument checks shared by every kernel backend: wrong shapes fail here with a clear message,
not deep inside an indexing op (or, on a GPU, as a silent out-of-bounds write)."""

from __future__ import annotations

from collections.abc import Sequence

import torch

IntList = Sequence[int] | torch.Tensor

_INDEX_DTYPES = (torch.int32, torch.int64)


class KernelArgumentError(ValueError):
    """A kernel was called with tensors whose shape, dtype or values break the layout contract."""


def fail(op: str, message: str) -> None:
    raise KernelArgumentError(f"{op}: {message}")


def as_int_list(values: IntList) -> list[int]:
    if isinstance(values, torch.Tensor):
        return [int(x) for x in values.tolist()]
    return [int(x) for x in values]


def check_device_pool(op: str, device_kv: torch.Tensor) -> None:
    if device_kv.dim() != 6 or device_kv.shape[1] not in (1, 2):
        fail(op, f"device_kv must be [L, K, P, S, H, D] with K = 2 (K, V) or 1 (a latent), "
                 f"got {tuple(device_kv.shape)}")


def check_host_pool(op: str, host_kv: torch.Tensor, device_kv: torch.Tensor, name: str) -> None:
    """`host_kv[P, L, K, S, H, D]` (or a staging buffer) must match the device pool's page."""
    check_device_pool(op, device_kv)
    if host_kv.dim() != 6:
        fail(op, f"{name} must be [N, L, K, S, H, D], got {tuple(host_kv.shape)}")
    layers, slabs, _, page_size, heads, dim = device_kv.shape
    want = (layers, slabs, page_size, heads, dim)
    if tuple(host_kv.shape[1:]) != want:
        fail(op, f"{name} page shape {tuple(host_kv.shape[1:])} != device page shape {want}")
    if host_kv.dtype != device_kv.dtype:
        fail(op, f"{name} dtype {host_kv.dtype} != device_kv dtype {device_kv.dtype}")


def check_ids(op: str, ids: torch.Tensor, limit: int, name: str) -> None:
    """1-D integer ids in [0, limit); values are checked on CPU only (a GPU check would sync)."""
    if not isinstance(ids, torch.Tensor) or ids.dim() != 1 or ids.dtype not in _INDEX_DTYPES:
        got = (ids.dtype, tuple(ids.shape)) if isinstance(ids, torch.Tensor) else type(ids)
        fail(op, f"{name} must be a 1-D int32/int64 tensor, got {got}")
    if ids.device.type == "cpu" and ids.numel() > 0:
        values = ids.tolist()  # cheaper than two tensor reductions for the usual short lists
        low, high = min(values), max(values)
        if low < 0 or high >= limit:
            fail(op, f"{name} out of range [0, {limit}): min {low}, max {high}")


def check_page_copy(
    op: str, src_ids: torch.Tensor, dst_ids: torch.Tensor, src_pages: int, dst_pages: int
) -> None:
    check_ids(op, src_ids, src_pages, "source page ids")
    check_ids(op, dst_ids, dst_pages, "destination page ids")
    if src_ids.numel() != dst_ids.numel():
        fail(op, f"{src_ids.numel()} source pages but {dst_ids.numel()} destination pages")


def check_staging(op: str, page_ids: torch.Tensor, device_pages: int, staging_pages: int) -> None:
    check_ids(op, page_ids, device_pages, "page_ids")
    if page_ids.numel() > staging_pages:
        fail(op, f"{page_ids.numel()} pages do not fit a staging buffer of {staging_pages}")


def check_device_to_host(device_kv: torch.Tensor, host_kv: torch.Tensor,
                         device_page_ids: torch.Tensor, host_page_ids: torch.Tensor,
                         layer: int | None) -> None:
    op = "device_to_host"
    check_host_pool(op, host_kv, device_kv, "host_kv")
    check_layer(op, layer, device_kv)
    check_page_copy(op, device_page_ids, host_page_ids, device_kv.shape[2], len(host_kv))


def check_host_to_device(host_kv: torch.Tensor, device_kv: torch.Tensor,
                         host_page_ids: torch.Tensor, device_page_ids: torch.Tensor,
                         layer: int | None) -> None:
    op = "host_to_device"
    check_host_pool(op, host_kv, device_kv, "host_kv")
    check_layer(op, layer, device_kv)
    check_page_copy(op, host_page_ids, device_page_ids, len(host_kv), device_kv.shape[2])


def check_pack(op: str, device_kv: torch.Tensor, page_ids: torch.Tensor,
               staging: torch.Tensor) -> None:
    """pack_pages / unpack_pages arguments."""
    check_host_pool(op, staging, device_kv, "staging")
    check_staging(op, page_ids, device_kv.shape[2], len(staging))


def check_layer(op: str, layer: int | None, device_kv: torch.Tensor) -> None:
    if layer is not None and not 0 <= layer < device_kv.shape[0]:
        fail(op, f"layer {layer} out of range [0, {device_kv.shape[0]})")


def check_store(
    device_kv: torch.Tensor, layer: int, slot_ids: torch.Tensor, k: torch.Tensor,
    v: torch.Tensor | None,
) -> None:
    """A 2-slab pool stores `k` and `v`; a latent (1-slab) pool stores `k` alone (`v` None)."""
    op = "store_kv"
    check_device_pool(op, device_kv)
    check_layer(op, layer, device_kv)
    _, slabs, pages, page_size, heads, dim = device_kv.shape
    check_ids(op, slot_ids, pages * page_size, "slot_ids")
    if (v is None) != (slabs == 1):
        fail(op, "a latent pool (1 slab) takes k only, a K/V pool (2 slabs) both k and v")
    want = (slot_ids.numel(), heads, dim)
    for name, t in (("k", k), ("v", v)):
        if t is not None and tuple(t.shape) != want:
            fail(op, f"{name} must be [T, H, D] = {want}, got {tuple(t.shape)}")


def check_attention(
    op: str,
    q: torch.Tensor,
    device_kv: torch.Tensor,
    layer: int,
    page_table: torch.Tensor,
    seq_lens: list[int],
    num_q: int,
    value_dim: int | None = None,
) -> None:
    """q `[num_q, Hq, D]`, GQA-compatible heads, and a page table wide enough for every seq;
    `value_dim` (latent pools only) within the row."""
    check_device_pool(op, device_kv)
    check_layer(op, layer, device_kv)
    _, slabs, _, page_size, kv_heads, dim = device_kv.shape
    if q.dim() != 3 or q.shape[0] != num_q or q.shape[2] != dim:
        fail(op, f"q must be [{num_q}, Hq, {dim}], got {tuple(q.shape)}")
    if value_dim is not None and (slabs != 1 or not 0 < value_dim <= dim):
        fail(op, f"value_dim {value_dim} needs a latent pool (1 slab) of rows >= it")
    if q.shape[1] % kv_heads:
        fail(op, f"query heads {q.shape[1]} not a multiple of kv heads {kv_heads}")
    if page_table.dim() != 2 or page_table.dtype not in _INDEX_DTYPES:
        fail(op, f"page_table must be a 2-D int tensor, got {page_table.dtype} "
                 f"{tuple(page_table.shape)}")
    if page_table.shape[0] < len(seq_lens):
        fail(op, f"page_table has {page_table.shape[0]} rows for {len(seq_lens)} sequences")
    need = max((-(-n // page_size) for n in seq_lens), default=0)
    if need > page_table.shape[1]:
        fail(op, f"a sequence needs {need} pages but page_table has {page_table.shape[1]} columns")
    if any(n < 1 for n in seq_lens):
        fail(op, f"every sequence must hold at least one token, got lengths {seq_lens}")


def check_extend(
    q: torch.Tensor,
    device_kv: torch.Tensor,
    layer: int,
    page_table: torch.Tensor,
    prefix_lens: list[int],
    extend_lens: list[int],
    value_dim: int | None = None,
) -> None:
    op = "paged_attention_extend"
    if len(prefix_lens) != len(extend_lens):
        fail(op, f"{len(prefix_lens)} prefix_lens but {len(extend_lens)} extend_lens")
    if any(n < 0 for n in prefix_lens) or any(n < 1 for n in extend_lens):
        fail(op, "prefix_lens must be >= 0 and extend_lens >= 1")
    seq_lens = [p + e for p, e in zip(prefix_lens, extend_lens)]
    check_attention(op, q, device_kv, layer, page_table, seq_lens, sum(extend_lens), value_dim)


def check_decode(
    q: torch.Tensor, device_kv: torch.Tensor, layer: int, page_table: torch.Tensor,
    seq_lens: list[int], value_dim: int | None = None,
) -> None:
    check_attention("paged_attention_decode", q, device_kv, layer, page_table, seq_lens,
                    len(seq_lens), value_dim)


def check_sinks(op: str, sinks: torch.Tensor | None, q: torch.Tensor) -> None:
    """`sinks` (gpt-oss's per-head sink logits) is None or a `[Hq]` float tensor."""
    if sinks is None:
        return
    if sinks.dim() != 1 or sinks.shape[0] != q.shape[1] or not sinks.is_floating_point():
        fail(op, f"sinks must be a float [{q.shape[1]}] (one logit per query head), got "
                 f"{sinks.dtype} {tuple(sinks.shape)}")


def value_width(device_kv: torch.Tensor, value_dim: int | None) -> int:
    """Width of the values attention returns: the V row, or a latent's first `value_dim`."""
    return device_kv.shape[5] if value_dim is None else value_dim
