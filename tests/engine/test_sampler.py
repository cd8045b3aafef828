"""Sampler: greedy is argmax, seeds reproduce, top-k / top-p restrict the support."""

from __future__ import annotations

import torch

from pdcache.engine.api import SamplingParams
from pdcache.engine.sampler import apply_top_k_top_p, make_generator, sample


def draws(logits: torch.Tensor, params: SamplingParams, n: int, seed: int = 0) -> list[int]:
    generator = make_generator(seed)
    return [sample(logits[None], [params], [generator])[0] for _ in range(n)]


def test_greedy_rows_are_argmax_in_a_mixed_batch() -> None:
    logits = torch.randn(5, 300, generator=torch.Generator().manual_seed(1))
    params = [SamplingParams(), SamplingParams(temperature=1.0, seed=3), SamplingParams(),
              SamplingParams(temperature=0.7, top_k=1), SamplingParams()]
    generators = [make_generator(i) for i in range(5)]
    tokens = sample(logits, params, generators)
    argmax = logits.argmax(-1).tolist()
    assert [tokens[i] for i in (0, 2, 3, 4)] == [argmax[i] for i in (0, 2, 3, 4)]


def test_same_seed_same_tokens_other_seed_differs() -> None:
    logits = torch.zeros(256)  # uniform: every draw is pure generator output
    params = SamplingParams(temperature=1.0, seed=11)
    first = draws(logits, params, 30, seed=11)
    assert first == draws(logits, params, 30, seed=11)
    assert first != draws(logits, params, 30, seed=12)
    assert len(set(first)) > 10


def test_top_k_restricts_support() -> None:
    logits = torch.linspace(0.0, 1.0, 50)  # top-3 are ids 47, 48, 49
    seen = set(draws(logits, SamplingParams(temperature=5.0, top_k=3), 300))
    assert seen == {47, 48, 49}


def test_top_p_restricts_support_to_nucleus() -> None:
    probs = torch.tensor([0.05, 0.5, 0.15, 0.3])
    logits = probs.log()
    seen = set(draws(logits, SamplingParams(temperature=1.0, top_p=0.7), 400))
    assert seen == {1, 3}  # 0.5 + 0.3 covers 0.7; 0.15 and 0.05 are cut
    seen_all = set(draws(logits, SamplingParams(temperature=1.0, top_p=1.0), 400))
    assert seen_all == {0, 1, 2, 3}


def test_truncation_always_keeps_the_best_token() -> None:
    logits = torch.tensor([[0.0, 9.0, 1.0], [3.0, 2.0, 1.0]])
    masked = apply_top_k_top_p(logits, torch.tensor([-1, 1]), torch.tensor([1e-6, 1.0]))
    assert torch.isfinite(masked).tolist() == [[False, True, False], [True, False, False]]
