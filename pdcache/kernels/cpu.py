"""Fast torch implementations of the KV kernels (the CPU default without numba), same semantics as
`reference`.

Copies: a page of one layer is a contiguous `[S, H, D]` block on both sides of every layout, so
a copy is one `_foreach_copy_` over strided views, one view per run of consecutive page ids,
each moving whole blocks in a single pass with no temporary (index_select into a buffer then
index_copy_ out of it would touch every byte twice).
Attention runs SDPA in the pool's dtype (fp32 accumulation inside SDPA) with grouped query
heads handled by SDPA (`enable_gqa`) instead of repeated K/V. Decode is one padded, batched
SDPA over all sequences, chunked to bound memory. Attention sinks (gpt-oss: one logit per query
head in every softmax, attached to no value) are one more key column whose K and V are zero
and whose additive mask entry is the sink: `q . 0 = 0`, so its logit is exactly the sink.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from pdcache.kernels import checks
from pdcache.kernels.checks import IntList, as_int_list

# Upper bound on gathered K (or V) elements per decode chunk.
_DECODE_CHUNK_ELEMS = 1 << 25


def _runs(src_ids: list[int], dst_ids: list[int]) -> list[tuple[int, int, int]]:
    """Split paired id lists into (src_start, dst_start, length) runs of consecutive ids."""
    runs: list[tuple[int, int, int]] = []
    for s, d in zip(src_ids, dst_ids):
        if runs:
            s0, d0, n = runs[-1]
            if s == s0 + n and d == d0 + n:
                runs[-1] = (s0, d0, n + 1)
                continue
        runs.append((s, d, 1))
    return runs


def copy_pages(
    src_pages: torch.Tensor, dst_pages: torch.Tensor, src_ids: torch.Tensor, dst_ids: torch.Tensor
) -> None:
    """`dst_pages[dst_ids[i]] = src_pages[src_ids[i]]`, both indexed along dim 0 (views)."""
    runs = _runs(src_ids.tolist(), dst_ids.tolist())
    if not runs:
        return
    dst_views = [dst_pages.narrow(0, d, n) for _, d, n in runs]
    src_views = [src_pages.narrow(0, s, n) for s, _, n in runs]
    if src_pages.device == dst_pages.device:
        # One dispatch for all runs: per-call overhead matters for small (one-layer) pages.
        torch._foreach_copy_(dst_views, src_views)
    else:
        for dst, src in zip(dst_views, src_views):
            dst.copy_(src)


def device_page_view(device_kv: torch.Tensor, layer: int | None) -> torch.Tensor:
    """Device pool viewed page-major: `[P, L, K, S, H, D]` or, for one layer, `[P, K, S, H, D]`."""
    if layer is None:
        return device_kv.permute(2, 0, 1, 3, 4, 5)
    return device_kv[layer].transpose(0, 1)


def host_page_view(host_kv: torch.Tensor, layer: int | None) -> torch.Tensor:
    return host_kv if layer is None else host_kv[:, layer]


def store_kv(
    device_kv: torch.Tensor, layer: int, slot_ids: torch.Tensor, k: torch.Tensor,
    v: torch.Tensor | None = None,
) -> None:
    checks.check_store(device_kv, layer, slot_ids, k, v)
    _, slabs, pages, page_size, heads, dim = device_kv.shape
    slots = slot_ids.to(device_kv.device)
    for kv, src in enumerate((k, v)[:slabs]):
        flat = device_kv[layer, kv].view(pages * page_size, heads, dim)
        flat.index_copy_(0, slots, src.to(device_kv.device, device_kv.dtype))


def device_to_host(
    device_kv: torch.Tensor,
    host_kv: torch.Tensor,
    device_page_ids: torch.Tensor,
    host_page_ids: torch.Tensor,
    layer: int | None = None,
) -> None:
    checks.check_device_to_host(device_kv, host_kv, device_page_ids, host_page_ids, layer)
    copy_pages(device_page_view(device_kv, layer), host_page_view(host_kv, layer),
               device_page_ids, host_page_ids)


def host_to_device(
    host_kv: torch.Tensor,
    device_kv: torch.Tensor,
    host_page_ids: torch.Tensor,
    device_page_ids: torch.Tensor,
    layer: int | None = None,
) -> None:
    checks.check_host_to_device(host_kv, device_kv, host_page_ids, device_page_ids, layer)
    copy_pages(host_page_view(host_kv, layer), device_page_view(device_kv, layer),
               host_page_ids, device_page_ids)


def pack_pages(device_kv: torch.Tensor, page_ids: torch.Tensor, staging: torch.Tensor) -> None:
    checks.check_pack("pack_pages", device_kv, page_ids, staging)
    n = len(page_ids)
    staging_ids = torch.arange(n)
    copy_pages(device_page_view(device_kv, None), staging, page_ids, staging_ids)


def unpack_pages(staging: torch.Tensor, device_kv: torch.Tensor, page_ids: torch.Tensor) -> None:
    checks.check_pack("unpack_pages", device_kv, page_ids, staging)
    staging_ids = torch.arange(len(page_ids))
    copy_pages(staging, device_page_view(device_kv, None), staging_ids, page_ids)


def _gather_pages(pool: torch.Tensor, pages: torch.Tensor, num_tokens: int) -> torch.Tensor:
    """`pool[P, S, H, D]` pages -> the first `num_tokens` tokens, `[num_tokens, H, D]`."""
    heads, dim = pool.shape[2], pool.shape[3]
    return pool.index_select(0, pages).view(-1, heads, dim)[:num_tokens]


def _gather_kv(device_kv: torch.Tensor, layer: int, pages: torch.Tensor, num_tokens: int,
               value_dim: int | None) -> tuple[torch.Tensor, torch.Tensor]:
    """K `[n, H, D]` and V `[n, H, Dv]`; a latent pool's V is a view of its K's first columns."""
    k = _gather_pages(device_kv[layer, 0], pages, num_tokens)
    if device_kv.shape[1] == 1:
        return k, k[..., : checks.value_width(device_kv, value_dim)]
    return k, _gather_pages(device_kv[layer, 1], pages, num_tokens)


def _causal_mask(
    prefix_len: int, num_q: int, num_kv: int, sliding_window: int | None, device: torch.device,
    explicit: bool = False,
) -> torch.Tensor | None:
    """Bool `[num_q, num_kv]`: which keys each new token sees; None for plain causal attention
    (SDPA's is_causal path) unless `explicit`."""
    if prefix_len == 0 and sliding_window is None and not explicit:
        return None
    q_pos = torch.arange(prefix_len, prefix_len + num_q, device=device)[:, None]
    k_pos = torch.arange(num_kv, device=device)[None, :]
    mask = k_pos <= q_pos
    if sliding_window is not None:
        mask &= q_pos - k_pos < sliding_window
    return mask


def _append_sink_column(
    k: torch.Tensor, v: torch.Tensor, allowed: torch.Tensor, sinks: torch.Tensor, seq_dim: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """K and V with one zero row more along `seq_dim`, and the additive mask (`allowed`'s last
    dim over the keys, broadcast against `sinks`' shape before it) whose extra column holds
    the sinks: the sink column of a softmax row, with no value."""
    zeros_shape = list(k.shape)
    zeros_shape[seq_dim] = 1
    k = torch.cat((k, k.new_zeros(zeros_shape)), dim=seq_dim)
    zeros_shape[-1] = v.shape[-1]
    v = torch.cat((v, v.new_zeros(zeros_shape)), dim=seq_dim)
    blocked = torch.zeros(allowed.shape, dtype=k.dtype, device=k.device)
    blocked.masked_fill_(~allowed, float("-inf"))
    sink_column = sinks.to(k.device, k.dtype)[..., None]
    shape = torch.broadcast_shapes(blocked.shape[:-1], sink_column.shape[:-1])
    mask = torch.cat((blocked.expand(*shape, -1), sink_column.expand(*shape, 1)), dim=-1)
    return k, v, mask


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
    prefix_lens, extend_lens = as_int_list(prefix_lens), as_int_list(extend_lens)
    checks.check_extend(q, device_kv, layer, page_table, prefix_lens, extend_lens, value_dim)
    checks.check_sinks("paged_attention_extend", sinks, q)
    page_size = device_kv.shape[3]
    table = page_table.to(device_kv.device)
    out = q.new_empty((*q.shape[:2], checks.value_width(device_kv, value_dim)))
    start = 0
    for b, (prefix_len, extend_len) in enumerate(zip(prefix_lens, extend_lens)):
        total = prefix_len + extend_len
        pages = table[b, : -(-total // page_size)]
        k, v = (t.transpose(0, 1) for t in _gather_kv(device_kv, layer, pages, total, value_dim))
        qs = q[start : start + extend_len].transpose(0, 1).to(k.dtype)
        mask = _causal_mask(prefix_len, extend_len, total, sliding_window, q.device,
                            explicit=sinks is not None)
        if sinks is not None:
            # mask [T, N] -> [Hq, T, N + 1], a sink per query head
            k, v, mask = _append_sink_column(k, v, mask, sinks[:, None], seq_dim=1)
        # 4-D inputs: CPU SDPA takes its flash kernel only for [B, H, T, D] (3-D: math path).
        o = F.scaled_dot_product_attention(
            qs[None], k[None], v[None], attn_mask=mask, is_causal=mask is None, scale=scale,
            enable_gqa=True,
        )
        out[start : start + extend_len] = o[0].transpose(0, 1).to(q.dtype)
        start += extend_len
    return out


def _decode_chunk(
    q: torch.Tensor,
    device_kv: torch.Tensor,
    layer: int,
    table: torch.Tensor,
    seq_lens: list[int],
    scale: float,
    sliding_window: int | None,
    value_dim: int | None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Padded batched decode of `q[B, Hq, D]` over `table[B, n_pages]` (all valid page ids)."""
    batch, q_heads, dim = q.shape
    kv_heads = device_kv.shape[4]
    num_kv = table.shape[1] * device_kv.shape[3]
    # index_select on the page dim is a parallel block gather; `pool[table]` is ~10x slower.
    flat = table.reshape(-1)
    k = device_kv[layer, 0].index_select(0, flat).view(batch, num_kv, kv_heads, dim)
    if device_kv.shape[1] == 1:  # a latent: V is its first columns (zeroed with K below)
        v = k[..., : checks.value_width(device_kv, value_dim)]
    else:
        v = device_kv[layer, 1].index_select(0, flat).view(batch, num_kv, kv_heads, dim)
    firsts = [0 if sliding_window is None else max(0, n - sliding_window) for n in seq_lens]
    for b, (first, n) in enumerate(zip(firsts, seq_lens)):
        # Slots outside the attended span may hold anything, even NaN (which a mask would not
        # hide: NaN + -inf is NaN): zero them in the gathered copy.
        for t in (k, v):
            t[b, n:].zero_()
            t[b, :first].zero_()
    pos = torch.arange(num_kv, device=q.device)
    lens = torch.tensor(seq_lens, device=q.device)[:, None]
    valid = (pos[None, :] < lens) & (pos[None, :] >= torch.tensor(firsts, device=q.device)[:, None])
    # One query token per sequence: the q heads sharing a kv head are its query rows, so the
    # attention is plain MHA over kv_heads (no `enable_gqa`, which expands K and V per q head:
    # 1.9 vs 0.7 ms a layer at 6 x 1500 tokens, small preset, measured). Head h of q uses kv
    # head h // group, as GQA does.
    grouped = q.view(batch, kv_heads, q_heads // kv_heads, dim)
    mask = valid[:, None, None, :]
    if sinks is not None:
        # mask [B, Hkv, group, N + 1]: query head h's sink at (h // group, h % group)
        k, v, mask = _append_sink_column(k, v, mask, sinks.view(kv_heads, -1), seq_dim=1)
    out = F.scaled_dot_product_attention(
        grouped, k.transpose(1, 2), v.transpose(1, 2), attn_mask=mask, scale=scale,
    )
    return out.reshape(batch, q_heads, v.shape[-1])


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
    lens = as_int_list(seq_lens)
    checks.check_decode(q, device_kv, layer, page_table, lens, value_dim)
    checks.check_sinks("paged_attention_decode", sinks, q)
    page_size, kv_heads, dim = device_kv.shape[3], device_kv.shape[4], device_kv.shape[5]
    table = page_table.to(device_kv.device)
    out = q.new_empty((*q.shape[:2], checks.value_width(device_kv, value_dim)))
    start = 0
    while start < len(lens):
        end = _chunk_end(lens, start, page_size, kv_heads * dim)
        n_pages = -(-max(lens[start:end]) // page_size)
        # Padding columns may hold anything (e.g. -1): read page 0 there; it is masked out.
        rows = table[start:end, :n_pages].clamp(0, device_kv.shape[2] - 1)
        out[start:end] = _decode_chunk(
            q[start:end].to(device_kv.dtype), device_kv, layer, rows, lens[start:end], scale,
            sliding_window, value_dim, sinks,
        ).to(q.dtype)
        start = end
    return out


def _chunk_end(lens: list[int], start: int, page_size: int, token_elems: int) -> int:
    """Largest end such that padding lens[start:end] to their max stays under the chunk bound."""
    end, longest = start, 0
    while end < len(lens):
        longest = max(longest, -(-lens[end] // page_size) * page_size)
        if end > start and (end + 1 - start) * longest * token_elems > _DECODE_CHUNK_ELEMS:
            break
        end += 1
    return end
