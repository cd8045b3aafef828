"""Torch reference implementations of the KV kernels: they define correctness.

Written to be obviously right, not fast: plain advanced indexing for copies and one SDPA call
per sequence for attention. Tests compare every other backend against these functions.

Layouts (see `pdcache.kernels` for the full contract; K = 2 slabs K, V or 1 latent slab):
- device pool, layer-first: `device_kv[L, K, P, S, H, D]`
- host pool, page-first:    `host_kv[P, L, K, S, H, D]` (a page's layers are contiguous)
- staging buffer:           `staging[N, L, K, S, H, D]` (same order as a host page)
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from pdcache.kernels import checks
from pdcache.kernels.checks import IntList, as_int_list


def store_kv(
    device_kv: torch.Tensor, layer: int, slot_ids: torch.Tensor, k: torch.Tensor,
    v: torch.Tensor | None = None,
) -> None:
    """Write token t's K/V (or latent: `k` alone) to slot `slot_ids[t]` (= page * S + offset)
    of `layer`."""
    checks.check_store(device_kv, layer, slot_ids, k, v)
    page_size = device_kv.shape[3]
    slots = slot_ids.to(device_kv.device)
    pages, offsets = slots // page_size, slots % page_size
    for slab, rows in enumerate((k, v)[: device_kv.shape[1]]):
        device_kv[layer, slab, pages, offsets] = rows.to(device_kv.device, device_kv.dtype)


def device_to_host(
    device_kv: torch.Tensor,
    host_kv: torch.Tensor,
    device_page_ids: torch.Tensor,
    host_page_ids: torch.Tensor,
    layer: int | None = None,
) -> None:
    """host page `host_page_ids[i]` := device page `device_page_ids[i]` (all layers or one)."""
    checks.check_device_to_host(device_kv, host_kv, device_page_ids, host_page_ids, layer)
    src = device_page_ids.to(device_kv.device)
    dst = host_page_ids.to(host_kv.device)
    if layer is None:
        # [L, K, N, S, H, D] -> [N, L, K, S, H, D]
        host_kv[dst] = device_kv[:, :, src].permute(2, 0, 1, 3, 4, 5).to(host_kv.device)
    else:
        host_kv[dst, layer] = device_kv[layer, :, src].transpose(0, 1).to(host_kv.device)


def host_to_device(
    host_kv: torch.Tensor,
    device_kv: torch.Tensor,
    host_page_ids: torch.Tensor,
    device_page_ids: torch.Tensor,
    layer: int | None = None,
) -> None:
    """device page `device_page_ids[i]` := host page `host_page_ids[i]` (all layers or one)."""
    checks.check_host_to_device(host_kv, device_kv, host_page_ids, device_page_ids, layer)
    src = host_page_ids.to(host_kv.device)
    dst = device_page_ids.to(device_kv.device)
    if layer is None:
        device_kv[:, :, dst] = host_kv[src].permute(1, 2, 0, 3, 4, 5).to(device_kv.device)
    else:
        device_kv[layer, :, dst] = host_kv[src, layer].transpose(0, 1).to(device_kv.device)


def pack_pages(device_kv: torch.Tensor, page_ids: torch.Tensor, staging: torch.Tensor) -> None:
    """Gather device pages into `staging[:N]` (`[N, L, K, S, H, D]`, page-first, as stored)."""
    checks.check_pack("pack_pages", device_kv, page_ids, staging)
    src = page_ids.to(device_kv.device)
    staging[: len(page_ids)] = device_kv[:, :, src].permute(2, 0, 1, 3, 4, 5).to(staging.device)


def unpack_pages(staging: torch.Tensor, device_kv: torch.Tensor, page_ids: torch.Tensor) -> None:
    """Scatter `staging[:N]` (`[N, L, K, S, H, D]`) into the device pages `page_ids`."""
    checks.check_pack("unpack_pages", device_kv, page_ids, staging)
    dst = page_ids.to(device_kv.device)
    n = len(page_ids)
    device_kv[:, :, dst] = staging[:n].permute(1, 2, 0, 3, 4, 5).to(device_kv.device)


def gather_kv(
    device_kv: torch.Tensor, layer: int, page_ids: torch.Tensor, num_tokens: int,
    value_dim: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V of the first `num_tokens` tokens held in `page_ids`: `[num_tokens, H, D]` and
    `[num_tokens, H, Dv]`. A latent pool's K is the latent row, its V the row's first
    `value_dim` elements (all of it when None)."""
    _, slabs, _, _, heads, dim = device_kv.shape
    k = device_kv[layer, 0, page_ids].reshape(-1, heads, dim)[:num_tokens]
    if slabs == 1:
        return k, k[..., : checks.value_width(device_kv, value_dim)]
    v = device_kv[layer, 1, page_ids].reshape(-1, heads, dim)[:num_tokens]
    return k, v


def _attend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    prefix_len: int,
    scale: float,
    sliding_window: int | None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal attention of `q[T, Hq, D]` (positions prefix_len..) over
    `k, v[prefix_len + T, Hkv, D]`; `sinks[Hq]`: one more logit per head in each softmax,
    attached to no value (gpt-oss)."""
    num_q, num_kv = q.shape[0], k.shape[0]
    group = q.shape[1] // k.shape[1]
    qh = q.transpose(0, 1).float()
    kh = k.transpose(0, 1).float().repeat_interleave(group, dim=0)
    vh = v.transpose(0, 1).float().repeat_interleave(group, dim=0)
    q_pos = torch.arange(prefix_len, prefix_len + num_q, device=q.device)[:, None]
    k_pos = torch.arange(num_kv, device=q.device)[None, :]
    mask = k_pos <= q_pos
    if sliding_window is not None:
        mask &= q_pos - k_pos < sliding_window
    if sinks is None:
        out = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=mask, scale=scale)
    else:
        scores = (qh @ kh.transpose(1, 2) * scale).masked_fill(~mask, float("-inf"))
        sink_column = sinks.float().to(q.device)[:, None, None].expand(-1, num_q, 1)
        weights = torch.cat((scores, sink_column), dim=-1).softmax(dim=-1)[..., :-1]
        out = weights @ vh
    return out.transpose(0, 1).to(q.dtype)


def paged_attention_extend(
    q: torch.Tensor,
    device_kv: torch.Tensor,
    layer: int,
    page_table: torch.Tensor,
    prefix_lens: IntList,
    extend_lens: IntList,
    scale: float,
    sliding_window: int | None = None,
    value_dim: int | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Prefill-with-prefix: `q[sum(extend_lens), Hq, D]` of several sequences, concatenated.

    Sequence b has `prefix_lens[b]` cached tokens followed by `extend_lens[b]` new tokens, whose
    K/V are already stored in the pool; its pages are `page_table[b, :ceil(len / S)]` (columns
    past that are padding and never read). A token attends to itself and the
    `sliding_window - 1` tokens before it (all earlier tokens when `sliding_window` is None).
    On a latent pool (MLA with absorbed weights) the keys are the latent rows and the values
    their first `value_dim` elements: the output is `[T, Hq, value_dim]`. `sinks[Hq]` (None:
    none): a learned logit per query head that joins every softmax and carries no value
    (gpt-oss's attention sinks).
    """
    prefix_lens, extend_lens = as_int_list(prefix_lens), as_int_list(extend_lens)
    checks.check_extend(q, device_kv, layer, page_table, prefix_lens, extend_lens, value_dim)
    checks.check_sinks("paged_attention_extend", sinks, q)
    out = q.new_empty((*q.shape[:2], checks.value_width(device_kv, value_dim)))
    start = 0
    page_size = device_kv.shape[3]
    table = page_table.to(device_kv.device)
    for b, (prefix_len, extend_len) in enumerate(zip(prefix_lens, extend_lens)):
        total = prefix_len + extend_len
        pages = table[b, : (total + page_size - 1) // page_size]
        k, v = gather_kv(device_kv, layer, pages, total, value_dim)
        qs = q[start : start + extend_len]
        out[start : start + extend_len] = _attend(qs, k, v, prefix_len, scale, sliding_window,
                                                  sinks)
        start += extend_len
    return out


def paged_attention_decode(
    q: torch.Tensor,
    device_kv: torch.Tensor,
    layer: int,
    page_table: torch.Tensor,
    seq_lens: IntList,
    scale: float,
    sliding_window: int | None = None,
    value_dim: int | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """One new token per sequence: `q[B, Hq, D]`; sequence b attends to its `seq_lens[b]` tokens
    (the new token's K/V included). `value_dim`, `sinks`: as for `paged_attention_extend`."""
    seq_lens = as_int_list(seq_lens)
    checks.check_decode(q, device_kv, layer, page_table, seq_lens, value_dim)
    return paged_attention_extend(
        q, device_kv, layer, page_table, [n - 1 for n in seq_lens], [1] * len(seq_lens), scale,
        sliding_window, value_dim, sinks,
    )
