"""Token sampling: greedy, temperature, top-k, top-p, per-request seeds.

Greedy rows take the argmax. Sampled rows are scaled and truncated in one batched pass;
each then draws from its own `torch.Generator` (seeded from `SamplingParams.seed` when given),
so the same seed and the same logits always give the same tokens, whatever the batch.
Stateless apart from the generators the caller passes in; engine thread only.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from pdcache.engine.api import SamplingParams


def make_generator(seed: int, device: str | torch.device = "cpu") -> torch.Generator:
    generator = torch.Generator(device=device)
    generator.manual_seed(seed & 0xFFFF_FFFF_FFFF_FFFF)
    return generator


def apply_top_k_top_p(
    logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor
) -> torch.Tensor:
    """Mask `logits[B, V]` outside each row's top-k and top-p nucleus with -inf.

    `top_k[B]` (<= 0 or >= V: off), `top_p[B]` (1.0: off). The most likely token always
    survives."""
    vocab = logits.shape[-1]
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    ranks = torch.arange(vocab, device=logits.device).expand_as(sorted_logits)
    k = torch.where(top_k > 0, top_k.clamp(max=vocab), torch.full_like(top_k, vocab))
    drop = ranks >= k[:, None]
    probs = sorted_logits.masked_fill(drop, float("-inf")).softmax(dim=-1)
    mass_before = probs.cumsum(dim=-1) - probs  # probability of the strictly better tokens
    drop |= mass_before >= top_p[:, None]
    drop[:, 0] = False
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.full_like(logits, float("-inf")).scatter(-1, order, sorted_logits)


def sample(
    logits: torch.Tensor,
    params: Sequence[SamplingParams],
    generators: Sequence[torch.Generator],
) -> list[int]:
    """One token per row of `logits[B, V]` (fp32), row b following `params[b]` and drawing
    from `generators[b]` (used only when the row is not greedy)."""
    tokens = logits.argmax(dim=-1)
    sampled_rows = [b for b, p in enumerate(params) if not p.greedy]
    if sampled_rows:
        rows = torch.tensor(sampled_rows, device=logits.device)
        probs = _truncated_probs(logits[rows], [params[b] for b in sampled_rows])
        for i, b in enumerate(sampled_rows):
            draw = torch.multinomial(probs[i].to(generators[b].device), 1, generator=generators[b])
            tokens[b] = draw.to(tokens.device)[0]
    return tokens.tolist()


def _truncated_probs(logits: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
    device = logits.device
    temperature = torch.tensor([p.temperature for p in params], device=device)
    top_k = torch.tensor([p.top_k for p in params], device=device)
    top_p = torch.tensor([p.top_p for p in params], device=device, dtype=logits.dtype)
    scaled = logits.float() / temperature[:, None]
    return apply_top_k_top_p(scaled, top_k, top_p).softmax(dim=-1)
