"""Token constraints (`pdcache.engine.api.TokenConstraint`) the engine ships.

`ForcedTokens` is the test double that scripts a model's output: whatever the weights say
(random presets included), the request yields exactly the given tokens and then finishes
with reason "stop". Tests of everything above the engine (tool-call parsing, streaming,
logprob formatting, P/D) use it to make a random-weight model "say" a chosen text: encode the
text, pass `ForcedTokens(ids)` as `GenerateRequest.constraint`.

Since only one token is allowed at each step, a forced token's output logprob is 0.0 and
every other token reads the fp32 minimum (the logprobs are taken after the constraint's
mask, as SGLang takes them after its grammar mask).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


class ForcedTokens:
    """Allow exactly `token_ids[i]` as the i-th sampled token; terminated after the last.

    Engine thread only (the engine calls it; nothing locks). Raises ValueError from `accept`
    for a token that is not the expected one (the engine then fails the request), and from
    the constructor for an empty sequence."""

    def __init__(self, token_ids: Sequence[int]) -> None:
        if not token_ids:
            raise ValueError("ForcedTokens needs at least one token")
        self.token_ids = [int(t) for t in token_ids]
        self.position = 0

    def allowed_tokens(self, vocab_size: int) -> torch.Tensor | None:
        mask = torch.zeros(vocab_size, dtype=torch.bool)
        if self.position < len(self.token_ids):
            token = self.token_ids[self.position]
            if not 0 <= token < vocab_size:
                raise ValueError(f"forced token {token} is outside the vocabulary")
            mask[token] = True
        return mask

    def accept(self, token_id: int) -> None:
        if self.position >= len(self.token_ids):
            raise ValueError(f"token {token_id} after the forced sequence ended")
        expected = self.token_ids[self.position]
        if token_id != expected:
            raise ValueError(f"token {token_id} where the forced sequence has {expected}")
        self.position += 1

    def is_terminated(self) -> bool:
        return self.position >= len(self.token_ids)
