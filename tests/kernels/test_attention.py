"""Paged attention (reference and fast torch) against a dense float64 oracle.

Pools hold NaN in every slot no sequence wrote, pages are scattered, page tables are padded
with -1: an implementation that reads a slot it should not turns the result into NaN.
"""

from __future__ import annotations

import random

import pytest
import torch

from pdcache.kernels import checks, testing
from pdcache.kernels.dispatch import KERNEL_BACKENDS

BACKENDS = ["reference", "torch"]
DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def _random_case(seed: int, decode: bool) -> dict:
    rng = random.Random(seed)
    batch = rng.randint(1, 4)
    seq_lens = [rng.randint(1, 40) for _ in range(batch)]
    new = [1 if decode else rng.randint(1, n) for n in seq_lens]
    kv_heads = rng.choice([1, 2])
    return dict(
        seq_lens=seq_lens, new_tokens=new, page_size=rng.choice([1, 4, 16]),
        q_heads=kv_heads * rng.choice([1, 2, 4]), kv_heads=kv_heads, dim=rng.choice([8, 16]),
        sliding_window=rng.choice([None, None, rng.randint(1, 12)]),
    )


@pytest.mark.parametrize("name", BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("seed", range(6))
def test_attention_matches_dense_oracle(name, dtype, seed):
    params = _random_case(seed, decode=seed % 2 == 0)
    testing.check_attention(KERNEL_BACKENDS.get(name)(), dtype=dtype, seed=seed, **params)


@pytest.mark.parametrize("name", BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("seed", range(4))
def test_latent_attention_matches_dense_oracle(name, dtype, seed):
    """MLA with absorbed weights: one latent slab read as K, its first `value_dim` as V."""
    rng = random.Random(100 + seed)
    decode = seed % 2 == 0
    seq_lens = [rng.randint(1, 40) for _ in range(rng.randint(1, 3))]
    testing.check_attention(
        KERNEL_BACKENDS.get(name)(), seq_lens=seq_lens,
        new_tokens=[1 if decode else rng.randint(1, n) for n in seq_lens],
        page_size=rng.choice([1, 4, 16]), q_heads=rng.choice([1, 4]), kv_heads=1, dim=24,
        value_dim=16, dtype=dtype, seed=seed,
    )


@pytest.mark.parametrize("name", BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("seed", range(4))
def test_attention_with_sinks_matches_dense_oracle(name, dtype, seed):
    """gpt-oss: a sink logit per query head joins every softmax, with or without a window."""
    params = _random_case(200 + seed, decode=seed % 2 == 0)
    params["sliding_window"] = [None, 5][seed // 2]
    testing.check_attention(KERNEL_BACKENDS.get(name)(), dtype=dtype, seed=seed,
                            with_sinks=True, **params)


@pytest.mark.parametrize("name", BACKENDS)
def test_attention_rejects_bad_sinks(name):
    backend = KERNEL_BACKENDS.get(name)()
    pool = torch.zeros(1, 2, 4, 4, 2, 8)
    table = torch.zeros(2, 2, dtype=torch.int64)
    q = torch.zeros(2, 4, 8)
    with pytest.raises(checks.KernelArgumentError, match=r"sinks must be a float \[4\]"):
        backend.paged_attention_decode(q, pool, 0, table, [3, 4], 1.0, sinks=torch.zeros(2))
    with pytest.raises(checks.KernelArgumentError, match="sinks must be"):
        backend.paged_attention_extend(q, pool, 0, table, [2, 3], [1, 1], 1.0,
                                       sinks=torch.zeros(4, dtype=torch.long))


@pytest.mark.parametrize("name", BACKENDS)
def test_decode_batch_with_very_different_lengths(name):
    testing.check_attention(
        KERNEL_BACKENDS.get(name)(), seq_lens=[1, 97, 3, 64], new_tokens=[1, 1, 1, 1],
        page_size=16, q_heads=8, kv_heads=2, dim=32, dtype=torch.bfloat16, seed=11,
    )


def test_torch_decode_chunks_when_batch_is_large(monkeypatch):
    """Force one sequence per chunk: results must not depend on the chunking."""
    from pdcache.kernels import cpu

    monkeypatch.setattr(cpu, "_DECODE_CHUNK_ELEMS", 1)
    testing.check_attention(
        cpu, seq_lens=[5, 33, 17], new_tokens=[1, 1, 1], page_size=4, q_heads=4, kv_heads=2,
        dim=8, dtype=torch.float32, seed=3,
    )


@pytest.mark.parametrize("name", BACKENDS)
def test_attention_rejects_bad_shapes(name):
    backend = KERNEL_BACKENDS.get(name)()
    pool = torch.zeros(1, 2, 4, 4, 2, 8)
    table = torch.zeros(2, 2, dtype=torch.int64)
    with pytest.raises(checks.KernelArgumentError, match="not a multiple"):
        backend.paged_attention_decode(torch.zeros(2, 3, 8), pool, 0, table, [3, 4], 1.0)
    with pytest.raises(checks.KernelArgumentError, match="columns"):
        backend.paged_attention_decode(torch.zeros(2, 2, 8), pool, 0, table, [3, 9], 1.0)
    with pytest.raises(checks.KernelArgumentError, match=r"q must be \[5"):
        backend.paged_attention_extend(torch.zeros(4, 2, 8), pool, 0, table, [0, 1], [2, 3], 1.0)
    with pytest.raises(checks.KernelArgumentError, match="2-D int"):
        backend.paged_attention_decode(torch.zeros(2, 2, 8), pool, 0, table.float(), [3, 4], 1.0)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("name", BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_attention_on_cuda(name, dtype):
    for seed in range(4):
        params = _random_case(seed, decode=seed % 2 == 0)
        testing.check_attention(KERNEL_BACKENDS.get(name)(), dtype=dtype, seed=seed,
                                device="cuda", **params)
