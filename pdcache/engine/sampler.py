"""Token sampling: penalties, min_new_tokens, constraint masks, greedy / temperature / top-k /
top-p / min-p, per-request seeds, and logprobs.

One batched pass over the fp32 logits `[B, V]`, in this order (SGLang's):
1. penalties: repetition (over the output only, as SGLang 0.5.23's BatchedRepetitionPenalizer,
   not HF/CTRL's prompt + output: a positive logit of a generated token is divided by the
   penalty, a negative one multiplied), then frequency and presence (OpenAI: over the output,
   `logit -= frequency * count + presence * (count > 0)`);
2. `min_new_tokens`: the row's stop tokens (EOS, `stop_token_ids`) get -inf until the output
   holds that many tokens;
3. the constraint's mask (`TokenConstraint.allowed_tokens`): disallowed tokens get -inf. A row
   whose min_new_tokens mask leaves no allowed token keeps the constraint's mask alone (the
   constraint wins);
4. logprobs (rows that asked): log_softmax of these logits, divided by the temperature for
   sampled rows (greedy rows: temperature 1), before top-k / top-p / min-p truncation. That is
   what SGLang 0.5.23 returns by default (`SGLANG_RETURN_ORIGINAL_LOGPROB` unset: sampler.py
   takes `log(softmax(logits / T))` of the logits its `apply_logits_bias` already penalised and
   masked). -inf (a masked token) is clamped to the fp32 minimum so the value stays JSON-safe;
5. greedy rows take the argmax of these logits; sampled rows are scaled by the temperature,
   truncated (top-k, top-p, min-p) and each draws from its own `torch.Generator` (seeded from
   `SamplingParams.seed` when given), so the same seed and logits give the same tokens,
   whatever the batch. NaN/+inf (a tiny repetition penalty or temperature overflowing) are
   sanitised after the penalties and the scaling; a row that still cannot be drawn from is
   reported in `SampleResult.errors` and fails alone, never its batch.

Stateless apart from the generators the caller passes in; engine thread only.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from pdcache.engine.api import LogprobRequest, SamplingParams, TokenLogprob

_FP32_MIN = torch.finfo(torch.float32).min
_FP32_MAX = torch.finfo(torch.float32).max


def sanitize_logits(logits: torch.Tensor) -> torch.Tensor:
    """`logits` with NaN and -inf kept out of sampling's way: NaN -> -inf (never chosen),
    +inf -> the fp32 maximum (a tiny repetition penalty or temperature overflows the
    division), -inf (a mask) stays. A row holding only -inf still fails its own draw."""
    return torch.nan_to_num(logits, nan=float("-inf"), posinf=_FP32_MAX, neginf=float("-inf"))


@dataclass
class SampleRow:
    """What the sampler needs to know of one row besides its logits.

    `output_ids` feed the penalties (read only when a penalty is on; the prompt is not
    penalised, as in SGLang);
    `stop_ids` are the tokens masked while `len(output_ids) < params.min_new_tokens`;
    `allowed` is the constraint's bool mask `[V]` (None: every token); `logprobs` asks for the
    sampled token's `TokenLogprob`."""

    params: SamplingParams
    generator: torch.Generator
    output_ids: Sequence[int] = ()
    stop_ids: Sequence[int] = ()
    allowed: torch.Tensor | None = None
    logprobs: LogprobRequest | None = None


@dataclass
class SampleResult:
    tokens: list[int]
    logprobs: list[TokenLogprob | None]  # per row; None where the row did not ask
    # row -> why it could not be sampled; its `tokens` entry is a placeholder the caller must
    # drop (it fails that request alone, the other rows are good)
    errors: dict[int, str] = field(default_factory=dict)


def make_generator(seed: int, device: str | torch.device = "cpu") -> torch.Generator:
    generator = torch.Generator(device=device)
    generator.manual_seed(seed & 0xFFFF_FFFF_FFFF_FFFF)
    return generator


def apply_top_k_top_p(
    logits: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    min_p: torch.Tensor | None = None,
) -> torch.Tensor:
    """Mask `logits[B, V]` outside each row's top-k, top-p nucleus and min-p floor with -inf.

    `top_k[B]` (<= 0 or >= V: off), `top_p[B]` (1.0: off), `min_p[B]` (0: off; drops tokens
    whose probability is below `min_p * p_max`). The most likely token always survives."""
    vocab = logits.shape[-1]
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    ranks = torch.arange(vocab, device=logits.device).expand_as(sorted_logits)
    k = torch.where(top_k > 0, top_k.clamp(max=vocab), torch.full_like(top_k, vocab))
    drop = ranks >= k[:, None]
    probs = sorted_logits.masked_fill(drop, float("-inf")).softmax(dim=-1)
    mass_before = probs.cumsum(dim=-1) - probs  # probability of the strictly better tokens
    drop |= mass_before >= top_p[:, None]
    if min_p is not None:
        drop |= probs < (min_p[:, None] * probs[:, :1])
    drop[:, 0] = False
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.full_like(logits, float("-inf")).scatter(-1, order, sorted_logits)


def apply_penalties(logits: torch.Tensor, rows: Sequence[SampleRow]) -> torch.Tensor:
    """`logits[B, V]` with each row's repetition, frequency and presence penalties applied
    (a new tensor; rows without penalties are unchanged)."""
    penalised = [b for b, row in enumerate(rows) if _has_penalty(row.params)]
    if not penalised:
        return logits
    out = logits.clone()
    vocab, device = logits.shape[-1], logits.device
    for b in penalised:
        params, row_logits = rows[b].params, out[b]
        output = torch.tensor(list(rows[b].output_ids), dtype=torch.long, device=device)
        counts = torch.bincount(output, minlength=vocab).to(row_logits.dtype)
        if params.repetition_penalty != 1.0:
            seen = counts > 0  # generated tokens only (SGLang), the prompt's are left alone
            scaled = torch.where(
                row_logits > 0,
                row_logits / params.repetition_penalty,
                row_logits * params.repetition_penalty,
            )
            row_logits = torch.where(seen, scaled, row_logits)
        row_logits = row_logits - params.frequency_penalty * counts
        row_logits = row_logits - params.presence_penalty * (counts > 0).to(row_logits.dtype)
        out[b] = row_logits
    return out


def apply_masks(logits: torch.Tensor, rows: Sequence[SampleRow]) -> torch.Tensor:
    """`logits[B, V]` with the min_new_tokens stop-token mask and the constraint masks applied
    (-inf); see the module docstring for the precedence."""
    masked_rows = [b for b, row in enumerate(rows) if row.allowed is not None or _holds_stop(row)]
    if not masked_rows:
        return logits
    out = logits.clone()
    for b in masked_rows:
        row = rows[b]
        allowed = torch.ones(logits.shape[-1], dtype=torch.bool, device=logits.device)
        if _holds_stop(row):
            allowed[torch.tensor(list(row.stop_ids), dtype=torch.long, device=logits.device)] = (
                False
            )
        if row.allowed is not None:
            constraint = row.allowed.to(device=logits.device, dtype=torch.bool)
            both = allowed & constraint
            allowed = both if bool(both.any()) else constraint
        out[b] = out[b].masked_fill(~allowed, float("-inf"))
    return out


def sample_rows(logits: torch.Tensor, rows: Sequence[SampleRow]) -> SampleResult:
    """One token per row of `logits[B, V]` (fp32) following `rows[b]`, with the logprobs the
    rows asked for."""
    logits = apply_masks(sanitize_logits(apply_penalties(logits.float(), rows)), rows)
    tokens = logits.argmax(dim=-1)
    errors: dict[int, str] = {}
    sampled = [b for b, row in enumerate(rows) if not row.params.greedy]
    if sampled:
        index = torch.tensor(sampled, device=logits.device)
        probs = _truncated_probs(logits[index], [rows[b].params for b in sampled])
        for i, b in enumerate(sampled):
            generator = rows[b].generator
            try:  # a row whose probabilities are unusable fails alone, not its batch
                draw = torch.multinomial(probs[i].to(generator.device), 1, generator=generator)
            except RuntimeError as exc:
                errors[b] = f"sampling failed: {exc}"
                continue
            tokens[b] = draw.to(tokens.device)[0]
    token_list = tokens.tolist()
    return SampleResult(token_list, _output_logprobs(logits, rows, token_list), errors)


def sample(
    logits: torch.Tensor,
    params: Sequence[SamplingParams],
    generators: Sequence[torch.Generator],
) -> list[int]:
    """One token per row of `logits[B, V]` (fp32), row b following `params[b]` and drawing
    from `generators[b]` (used only when the row is not greedy); no penalty history, masks or
    logprobs (`sample_rows` has them)."""
    rows = [SampleRow(p, g) for p, g in zip(params, generators)]
    return sample_rows(logits, rows).tokens


def token_logprob(logprobs: torch.Tensor, token_id: int, request: LogprobRequest) -> TokenLogprob:
    """The `TokenLogprob` of `token_id` from one position's logprobs `[V]`: the `top_n` best
    (sorted, best first; ties by lower id) and the requested `token_ids`."""
    top: tuple[tuple[int, float], ...] = ()
    if request.top_n > 0:
        values, ids = logprobs.topk(min(request.top_n, logprobs.shape[-1]))
        top = tuple(zip(ids.tolist(), values.tolist()))
    selected: tuple[tuple[int, float], ...] = ()
    if request.token_ids:
        wanted = torch.tensor(list(request.token_ids), dtype=torch.long, device=logprobs.device)
        selected = tuple(zip(request.token_ids, logprobs[wanted].tolist()))
    return TokenLogprob(int(token_id), float(logprobs[token_id]), top, selected)


INPUT_LOGPROB_SLICE_ROWS = 512  # rows of [rows, V] fp32 log_softmax alive at once


def input_logprobs(
    logits: torch.Tensor,
    next_ids: Sequence[int],
    request: LogprobRequest,
    slice_rows: int = INPUT_LOGPROB_SLICE_ROWS,
) -> list[TokenLogprob]:
    """Prompt logprobs: row i of `logits[N, V]` (raw, fp32) is the position before
    `next_ids[i]`; each is the log_softmax of the model's logits (no temperature, penalty or
    mask: those belong to sampling, as in SGLang). Computed `slice_rows` rows at a time and
    only the chosen / top-n / selected values kept, so a long prompt never holds a second
    `[N, V]` fp32 tensor (log_softmax is per row: slicing changes no value)."""
    if slice_rows < 1:
        raise ValueError(f"slice_rows must be >= 1, got {slice_rows}")
    out: list[TokenLogprob] = []
    for first in range(0, len(next_ids), slice_rows):
        logprobs = torch.log_softmax(logits[first : first + slice_rows].float(), dim=-1)
        ids = next_ids[first : first + slice_rows]
        out += [token_logprob(logprobs[i], int(t), request) for i, t in enumerate(ids)]
    return out


def _output_logprobs(
    logits: torch.Tensor, rows: Sequence[SampleRow], tokens: list[int]
) -> list[TokenLogprob | None]:
    out: list[TokenLogprob | None] = [None] * len(rows)
    wanted = [b for b, row in enumerate(rows) if row.logprobs is not None]
    if not wanted:
        return out
    index = torch.tensor(wanted, device=logits.device)
    temperature = torch.tensor(
        [1.0 if rows[b].params.greedy else rows[b].params.temperature for b in wanted],
        device=logits.device,
    )
    logprobs = torch.log_softmax(sanitize_logits(logits[index] / temperature[:, None]), dim=-1)
    logprobs = logprobs.clamp(min=_FP32_MIN)
    for i, b in enumerate(wanted):
        request = rows[b].logprobs
        assert request is not None
        out[b] = token_logprob(logprobs[i], tokens[b], request)
    return out


def _has_penalty(params: SamplingParams) -> bool:
    return (
        params.repetition_penalty != 1.0
        or params.frequency_penalty != 0.0
        or params.presence_penalty != 0.0
    )


def _holds_stop(row: SampleRow) -> bool:
    return bool(row.stop_ids) and len(row.output_ids) < row.params.min_new_tokens


def _truncated_probs(logits: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
    device = logits.device
    temperature = torch.tensor([p.temperature for p in params], device=device)
    top_k = torch.tensor([p.top_k for p in params], device=device)
    top_p = torch.tensor([p.top_p for p in params], device=device, dtype=logits.dtype)
    min_p = torch.tensor([p.min_p for p in params], device=device, dtype=logits.dtype)
    scaled = sanitize_logits(logits.float() / temperature[:, None])
    return apply_top_k_top_p(scaled, top_k, top_p, min_p).softmax(dim=-1)
