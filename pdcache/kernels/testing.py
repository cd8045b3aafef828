"""Test oracles for the KV kernels, independent of every backend (no SDPA, no page gathers).

`PagedCase` builds a pool whose unused slots hold NaN, writes each sequence's K/V token by
token at non-contiguous pages, pads the page table with -1, and keeps the dense K/V so an
attention result can be checked against `dense_attention` (float64, explicit softmax). With a
`value_dim` the pool is a latent one (one slab: MLA), whose values are each row's first
`value_dim` elements.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

TOLERANCE = {torch.float32: 2e-5, torch.float16: 4e-3, torch.bfloat16: 3e-2}


def random_pool(
    shape: tuple[int, ...], dtype: torch.dtype, gen: torch.Generator, device: str = "cpu"
) -> torch.Tensor:
    return torch.randn(shape, generator=gen).to(device=device, dtype=dtype)


def random_page_ids(n: int, total: int, gen: torch.Generator, device: str = "cpu") -> torch.Tensor:
    """`n` distinct page ids out of `total`, in random (non-contiguous, unsorted) order."""
    return torch.randperm(total, generator=gen)[:n].to(device)


def assert_bytes_equal(actual: torch.Tensor, expected: torch.Tensor, what: str = "") -> None:
    a = actual.detach().cpu().contiguous().view(torch.uint8)
    b = expected.detach().cpu().contiguous().view(torch.uint8)
    if not torch.equal(a, b):
        bad = int((a != b).sum()) if a.shape == b.shape else -1
        shapes = f"{tuple(actual.shape)} vs {tuple(expected.shape)}"
        raise AssertionError(f"{what}: {bad} bytes differ ({shapes})")


def dense_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    first_pos: int,
    scale: float,
    sliding_window: int | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """`q[T, Hq, D]` at positions first_pos.. over `k, v[N, Hkv, D]`, causal, float64;
    `sinks[Hq]`: one more logit per head in each softmax row, attached to no value."""
    group = q.shape[1] // k.shape[1]
    qd = q.double().transpose(0, 1)  # [Hq, T, D]
    kd = k.double().transpose(0, 1).repeat_interleave(group, 0)
    vd = v.double().transpose(0, 1).repeat_interleave(group, 0)
    scores = qd @ kd.transpose(1, 2) * scale
    q_pos = torch.arange(first_pos, first_pos + q.shape[0])[:, None]
    k_pos = torch.arange(k.shape[0])[None, :]
    allowed = k_pos <= q_pos
    if sliding_window is not None:
        allowed &= q_pos - k_pos < sliding_window
    scores = scores.masked_fill(~allowed, float("-inf"))
    if sinks is not None:
        sink_column = sinks.double().cpu()[:, None, None].expand(-1, q.shape[0], 1)
        scores = torch.cat((scores, sink_column), dim=-1)
    weights = torch.exp(scores - scores.amax(-1, keepdim=True))
    weights = weights / weights.sum(-1, keepdim=True)
    if sinks is not None:
        weights = weights[..., :-1]
    return (weights @ vd).transpose(0, 1)


@dataclass
class PagedCase:
    """A pool holding `len(seq_lens)` sequences of one layer, plus their dense K/V."""

    device_kv: torch.Tensor  # [L, K, P, S, H, D], NaN where no token was written
    layer: int
    page_table: torch.Tensor  # [B, max_pages], padded with -1
    seq_lens: list[int]
    dense_k: list[torch.Tensor]  # [seq_len, H, D] per sequence
    dense_v: list[torch.Tensor]


def make_paged_case(
    seq_lens: list[int],
    page_size: int,
    kv_heads: int,
    dim: int,
    dtype: torch.dtype,
    gen: torch.Generator,
    layers: int = 2,
    spare_pages: int = 3,
    device: str = "cpu",
    value_dim: int | None = None,
) -> PagedCase:
    pages_per_seq = [-(-n // page_size) for n in seq_lens]
    total_pages = sum(pages_per_seq) + spare_pages
    slabs = 2 if value_dim is None else 1
    pool = torch.full((layers, slabs, total_pages, page_size, kv_heads, dim), float("nan"))
    pool = pool.to(dtype)
    order = torch.randperm(total_pages, generator=gen).tolist()
    table = torch.full((len(seq_lens), max(pages_per_seq) + 1), -1, dtype=torch.int64)
    layer = layers - 1
    dense_k, dense_v = [], []
    for b, n in enumerate(seq_lens):
        pages = [order.pop() for _ in range(pages_per_seq[b])]
        table[b, : len(pages)] = torch.tensor(pages)
        k = torch.randn(n, kv_heads, dim, generator=gen).to(dtype)
        v = torch.randn(n, kv_heads, dim, generator=gen).to(dtype)
        if value_dim is not None:
            v = k[..., :value_dim]
        for t in range(n):
            pool[layer, 0, pages[t // page_size], t % page_size] = k[t]
            if value_dim is None:
                pool[layer, 1, pages[t // page_size], t % page_size] = v[t]
        dense_k.append(k)
        dense_v.append(v)
    return PagedCase(pool.to(device), layer, table.to(device), list(seq_lens), dense_k, dense_v)


def expected_extend(
    case: PagedCase,
    q: torch.Tensor,
    prefix_lens: list[int],
    scale: float,
    sliding_window: int | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Dense float64 result for `paged_attention_extend` on `case` (new tokens at the end)."""
    outs, start = [], 0
    for b, total in enumerate(case.seq_lens):
        num_new = total - prefix_lens[b]
        qs = q[start : start + num_new].cpu()
        outs.append(dense_attention(qs, case.dense_k[b], case.dense_v[b], prefix_lens[b], scale,
                                    sliding_window, sinks))
        start += num_new
    return torch.cat(outs)


@dataclass(frozen=True)
class CopyShape:
    layers: int
    device_pages: int
    host_pages: int
    page_size: int
    heads: int
    dim: int
    num_pages: int  # pages moved (<= both pool sizes)
    slabs: int = 2  # per layer: 2 (K, V) or 1 (an MLA latent)


def check_copies(backend, shape: CopyShape, dtype: torch.dtype, seed: int, device: str = "cpu",
                 layer: int | None = None) -> None:
    """Run every copy op of `backend` on random non-contiguous pages and check each against a
    per-block oracle, byte for byte; device -> host -> device must round-trip exactly."""
    gen = torch.Generator().manual_seed(seed)
    s = shape
    page = (s.page_size, s.heads, s.dim)
    device_kv = random_pool((s.layers, s.slabs, s.device_pages, *page), dtype, gen, device)
    host_kv = random_pool((s.host_pages, s.layers, s.slabs, *page), dtype, gen, device="cpu")
    if device != "cpu" and seed % 2 == 0:
        host_kv = host_kv.pin_memory()  # GPU kernels read pinned host memory directly
    dev_ids = random_page_ids(s.num_pages, s.device_pages, gen, device)
    host_ids = random_page_ids(s.num_pages, s.host_pages, gen)
    layers = range(s.layers) if layer is None else [layer]

    host_before = host_kv.clone()
    backend.device_to_host(device_kv, host_kv, dev_ids, host_ids, layer=layer)
    expected = host_before.clone()
    for d, h in zip(dev_ids.tolist(), host_ids.tolist()):
        for lyr in layers:
            expected[h, lyr] = device_kv[lyr, :, d].cpu()
    assert_bytes_equal(host_kv, expected, f"device_to_host layer={layer}")

    back = random_pool(tuple(device_kv.shape), dtype, gen, device)
    back_before = back.clone()
    backend.host_to_device(host_kv, back, host_ids, dev_ids, layer=layer)
    want = back_before.clone()
    for d in dev_ids.tolist():
        for lyr in layers:
            want[lyr, :, d] = device_kv[lyr, :, d]
    assert_bytes_equal(back, want, f"round trip device->host->device layer={layer}")


def check_pack_store(backend, shape: CopyShape, dtype: torch.dtype, seed: int,
                     device: str = "cpu") -> None:
    """pack -> unpack round trip and store_kv, each against a per-block/per-token oracle."""
    gen = torch.Generator().manual_seed(seed)
    s = shape
    page = (s.page_size, s.heads, s.dim)
    device_kv = random_pool((s.layers, s.slabs, s.device_pages, *page), dtype, gen, device)
    ids = random_page_ids(s.num_pages, s.device_pages, gen, device)
    staging = torch.zeros((s.num_pages + 1, s.layers, s.slabs, *page), dtype=dtype, device=device)
    backend.pack_pages(device_kv, ids, staging)
    for i, d in enumerate(ids.tolist()):
        assert_bytes_equal(staging[i], device_kv[:, :, d], "pack_pages")
    assert_bytes_equal(staging[-1], torch.zeros_like(staging[-1]), "pack_pages past N")

    target = random_pool(tuple(device_kv.shape), dtype, gen, device)
    want = target.clone()
    want[:, :, ids] = device_kv[:, :, ids]
    backend.unpack_pages(staging, target, ids)
    assert_bytes_equal(target, want, "unpack_pages")

    num_tokens = min(5, s.device_pages * s.page_size)
    slots = torch.randperm(s.device_pages * s.page_size, generator=gen)[:num_tokens].to(device)
    k = random_pool((num_tokens, s.heads, s.dim), torch.float32, gen, device)
    v = random_pool((num_tokens, s.heads, s.dim), torch.float32, gen, device)
    want = target.clone()
    lyr = s.layers - 1
    for t, slot in enumerate(slots.tolist()):
        want[lyr, 0, slot // s.page_size, slot % s.page_size] = k[t].to(dtype)
        if s.slabs == 2:
            want[lyr, 1, slot // s.page_size, slot % s.page_size] = v[t].to(dtype)
    backend.store_kv(target, lyr, slots, k, v if s.slabs == 2 else None)
    assert_bytes_equal(target, want, "store_kv")


def check_attention(backend, seq_lens: list[int], new_tokens: list[int], page_size: int,
                    q_heads: int, kv_heads: int, dim: int, dtype: torch.dtype, seed: int,
                    sliding_window: int | None = None, device: str = "cpu",
                    value_dim: int | None = None, with_sinks: bool = False) -> None:
    """Extend (and, where every sequence adds one token, decode) against dense float64; with
    `value_dim`, on a latent pool (values: each row's first `value_dim` elements); with
    `with_sinks`, random per-head sink logits (gpt-oss's attention sinks)."""
    gen = torch.Generator().manual_seed(seed)
    case = make_paged_case(seq_lens, page_size, kv_heads, dim, dtype, gen, device=device,
                           value_dim=value_dim)
    prefix_lens = [n - e for n, e in zip(seq_lens, new_tokens)]
    q = torch.randn(sum(new_tokens), q_heads, dim, generator=gen).to(dtype)
    scale = dim**-0.5
    # sinks in the pool's dtype, as a model holds them; the oracle reads the same values
    sinks = (2 * torch.randn(q_heads, generator=gen)).to(dtype) if with_sinks else None
    want = expected_extend(case, q, prefix_lens, scale, sliding_window, sinks)
    on_device = None if sinks is None else sinks.to(device)
    got = backend.paged_attention_extend(
        q.to(device), case.device_kv, case.layer, case.page_table, prefix_lens, new_tokens,
        scale, sliding_window=sliding_window, value_dim=value_dim, sinks=on_device,
    )
    _assert_close(got, want, dtype, "paged_attention_extend")
    if all(e == 1 for e in new_tokens):
        got = backend.paged_attention_decode(
            q.to(device), case.device_kv, case.layer, case.page_table, seq_lens, scale,
            sliding_window=sliding_window, value_dim=value_dim, sinks=on_device,
        )
        _assert_close(got, want, dtype, "paged_attention_decode")


def _assert_close(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype, what: str) -> None:
    assert got.dtype == dtype and got.shape == want.shape, (what, got.dtype, got.shape)
    err = (got.cpu().double() - want).abs().max().item()
    assert err <= TOLERANCE[dtype], f"{what}: max abs error {err} > {TOLERANCE[dtype]} ({dtype})"
