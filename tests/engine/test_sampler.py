"""Sampler: greedy is argmax, seeds reproduce, top-k / top-p / min-p restrict the support;
penalties, min_new_tokens and constraint masks, logprobs."""

from __future__ import annotations

import pytest
import torch

from pdcache.engine.api import LogprobRequest, SamplingParams
from pdcache.engine.sampler import (
    SampleRow,
    apply_penalties,
    apply_top_k_top_p,
    input_logprobs,
    make_generator,
    sample,
    sample_rows,
    token_logprob,
)


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


# ---- penalties, masks, min-p, logprobs (sample_rows) -------------------------------------
def test_penalties_match_the_formulas_over_the_output() -> None:
    logits = torch.tensor([[2.0, -1.0, 0.5, 3.0, -2.0, 1.0]])
    params = SamplingParams(repetition_penalty=2.0, frequency_penalty=0.5,
                            presence_penalty=0.25)
    row = SampleRow(params, make_generator(0), output_ids=[3, 3, 4])
    got = apply_penalties(logits, [row])[0].tolist()
    # repetition over the output only (SGLang: 3, 4): positive / 2, negative * 2, the rest
    # (0 and 1 included, prompt tokens under HF's rule) untouched; then frequency (count) and
    # presence (3 twice, 4 once)
    expected = [2.0, -1.0, 0.5, 1.5 - 0.5 * 2 - 0.25, -4.0 - 0.5 - 0.25, 1.0]
    assert got == expected
    assert apply_penalties(logits, [SampleRow(SamplingParams(), make_generator(0),
                                              [3])]) is logits  # none: untouched


def test_penalised_greedy_row_changes_its_token() -> None:
    logits = torch.tensor([[5.0, 4.9, 0.0]])
    plain = sample_rows(logits, [SampleRow(SamplingParams(), make_generator(0),
                                           output_ids=[0])])
    penalised = sample_rows(logits, [SampleRow(SamplingParams(presence_penalty=0.2),
                                               make_generator(0), output_ids=[0])])
    assert plain.tokens == [0] and penalised.tokens == [1]


def test_min_new_tokens_masks_stop_ids_and_the_constraint_wins() -> None:
    logits = torch.tensor([[0.0, 9.0, 1.0, 2.0]] * 3)
    params = SamplingParams(min_new_tokens=2)
    only_stop = torch.tensor([False, True, False, False])
    rows = [
        SampleRow(params, make_generator(0), output_ids=[5], stop_ids=(1,)),  # masked
        SampleRow(params, make_generator(0), output_ids=[5, 6], stop_ids=(1,)),  # reached
        SampleRow(params, make_generator(0), output_ids=[], stop_ids=(1,), allowed=only_stop),
    ]
    assert sample_rows(logits, rows).tokens == [3, 1, 1]


def test_min_p_drops_tokens_below_its_share_of_the_best() -> None:
    probs = torch.tensor([0.45, 0.35, 0.15, 0.05])
    seen = set(draws(probs.log(), SamplingParams(temperature=1.0, min_p=0.5), 400))
    assert seen == {0, 1}  # 0.15 < 0.5 * 0.45


def test_logprobs_are_taken_after_masks_and_temperature_before_truncation() -> None:
    logits = torch.tensor([[1.0, 3.0, 2.0, 0.0]])
    allowed = torch.tensor([True, True, True, False])
    request = LogprobRequest(top_n=4, token_ids=(3, 0))
    params = SamplingParams(temperature=0.5, top_k=2, seed=1)
    result = sample_rows(logits, [SampleRow(params, make_generator(1), allowed=allowed,
                                            logprobs=request)])
    entry = result.logprobs[0]
    masked = torch.tensor([1.0, 3.0, 2.0, float("-inf")])
    expected = torch.log_softmax(masked / 0.5, dim=-1)  # top_k=2 does not truncate these
    assert result.tokens == [1] and entry.token_id == 1
    assert entry.logprob == pytest.approx(float(expected[1]))
    assert [t for t, _ in entry.top] == [1, 2, 0, 3]
    assert entry.top[3][1] == torch.finfo(torch.float32).min  # -inf clamped: JSON-safe
    assert entry.selected == ((3, torch.finfo(torch.float32).min),
                              (0, pytest.approx(float(expected[0]))))
    assert sample_rows(logits, [SampleRow(params, make_generator(1))]).logprobs == [None]


@pytest.mark.parametrize("slice_rows", [1, 7, 50, 512])
def test_prompt_logprobs_in_slices_equal_the_whole_log_softmax(slice_rows, monkeypatch) -> None:
    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(50, 300, generator=gen) * 4
    next_ids = torch.randint(0, 300, (50,), generator=gen).tolist()
    request = LogprobRequest(top_n=5, token_ids=(0, 17, 299))
    whole = torch.log_softmax(logits, dim=-1)
    expected = [token_logprob(whole[i], t, request) for i, t in enumerate(next_ids)]
    rows_seen: list[int] = []
    log_softmax = torch.log_softmax

    def recording(x: torch.Tensor, dim: int) -> torch.Tensor:
        rows_seen.append(x.shape[0])
        return log_softmax(x, dim=dim)

    monkeypatch.setattr(torch, "log_softmax", recording)
    assert input_logprobs(logits, next_ids, request, slice_rows=slice_rows) == expected
    assert max(rows_seen) == min(slice_rows, 50) and sum(rows_seen) == 50
