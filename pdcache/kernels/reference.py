"""Torch reference implementations of the KV kernels: they define correctness.

Layouts (see `pdcache.kernels` for the full contract):
- device pool, layer-first: `device_kv[L, 2, P, S, H, D]` (2 = K, V)
- host pool, page-first:    `host_kv[P, L, 2, S, H, D]` (a page's layers are contiguous)
- staging buffer:           `staging[N, L, 2, S, H, D]` (same order as a host page)
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def store_kv(
    device_kv: torch.Tensor, layer: int, slot_ids: torch.Tensor, k: torch.Tensor, v: torch.Tensor
) -> None:
    page_size = device_kv.shape[3]
    pages, offsets = slot_ids // page_size, slot_ids % page_size
    device_kv[layer, 0, pages, offsets] = k.to(device_kv.dtype)
    device_kv[layer, 1, pages, offsets] = v.to(device_kv.dtype)


def device_to_host(
    device_kv: torch.Tensor,
    host_kv: torch.Tensor,
    device_page_ids: torch.Tensor,
    host_page_ids: torch.Tensor,
    layer: int | None = None,
) -> None:
    if layer is None:
        # [L, 2, N, S, H, D] -> [N, L, 2, S, H, D]
        pages = device_kv[:, :, device_page_ids.to(device_kv.device)].permute(2, 0, 1, 3, 4, 5)
        host_kv[host_page_ids.to(host_kv.device)] = pages.to(host_kv.device)
    else:
        pages = device_kv[layer, :, device_page_ids.to(device_kv.device)].transpose(0, 1)
        host_kv[host_page_ids.to(host_kv.device), layer] = pages.to(host_kv.device)


def host_to_device(
    host_kv: torch.Tensor,
    device_kv: torch.Tensor,
    host_page_ids: torch.Tensor,
    device_page_ids: torch.Tensor,
    layer: int | None = None,
) -> None:
    dst = device_page_ids.to(device_kv.device)
    if layer is None:
        pages = host_kv[host_page_ids.to(host_kv.device)].permute(1, 2, 0, 3, 4, 5)
        device_kv[:, :, dst] = pages.to(device_kv.device)
    else:
        pages = host_kv[host_page_ids.to(host_kv.device), layer].transpose(0, 1)
        device_kv[layer, :, dst] = pages.to(device_kv.device)


def pack_pages(device_kv: torch.Tensor, page_ids: torch.Tensor, staging: torch.Tensor) -> None:
    """Gather device pages into `staging[N, L, 2, S, H, D]` (page-first, as stored)."""
    staging[: len(page_ids)] = device_kv[:, :, page_ids.to(device_kv.device)].permute(
        2, 0, 1, 3, 4, 5
    ).to(staging.device)


def unpack_pages(staging: torch.Tensor, device_kv: torch.Tensor, page_ids: torch.Tensor) -> None:
    """Scatter `staging[N, L, 2, S, H, D]` into the device pages `page_ids`."""
    n = len(page_ids)
    device_kv[:, :, page_ids.to(device_kv.device)] = staging[:n].permute(1, 2, 0, 3, 4, 5).to(
        device_kv.device
    )


def gather_kv(
    device_kv: torch.Tensor, layer: int, page_ids: torch.Tensor, num_tokens: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V of the first `num_tokens` tokens held in `page_ids`: two `[num_tokens, H, D]`."""
    _, _, _, page_size, heads, dim = device_kv.shape
    k = device_kv[layer, 0, page_ids].reshape(-1, heads, dim)[:num_tokens]
    v = device_kv[layer, 1, page_ids].reshape(-1, heads, dim)[:num_tokens]
    return k, v


def _attend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    prefix_len: int,
    scale: float,
    sliding_window: int | None,
) -> torch.Tensor:
    """Causal attention of `q[T, Hq, D]` (positions prefix_len..) over `k, v[prefix_len+T, Hkv, D]`."""
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
    out = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=mask, scale=scale)
    return out.transpose(0, 1).to(q.dtype)


def paged_attention_extend(
    q: torch.Tensor,
    device_kv: torch.Tensor,
    layer: int,
    page_table: torch.Tensor,
    prefix_lens: list[int],
    extend_lens: list[int],
    scale: float,
    sliding_window: int | None = None,
) -> torch.Tensor:
    """Prefill-with-prefix: `q[sum(extend_lens), Hq, D]` of several sequences, concatenated.

    Sequence b has `prefix_lens[b]` cached tokens followed by `extend_lens[b]` new tokens, whose
    K/V are already stored in the pool; its pages are `page_table[b]`.
    """
    out = torch.empty_like(q)
    start = 0
    page_size = device_kv.shape[3]
    for b, (prefix_len, extend_len) in enumerate(zip(prefix_lens, extend_lens)):
        total = prefix_len + extend_len
        pages = page_table[b, : (total + page_size - 1) // page_size]
        k, v = gather_kv(device_kv, layer, pages, total)
        qs = q[start : start + extend_len]
        out[start : start + extend_len] = _attend(qs, k, v, prefix_len, scale, sliding_window)
        start += extend_len
    return out


def paged_attention_decode(
    q: torch.Tensor,
    device_kv: torch.Tensor,
    layer: int,
    page_table: torch.Tensor,
    seq_lens: list[int],
    scale: float,
    sliding_window: int | None = None,
) -> torch.Tensor:
    """One new token per sequence: `q[B, Hq, D]`; sequence b attends to its `seq_lens[b]` tokens
    (the new token's K/V included)."""
    return paged_attention_extend(
        q, device_kv, layer, page_table, [n - 1 for n in seq_lens], [1] * len(seq_lens), scale,
        sliding_window,
    )
