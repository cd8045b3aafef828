"""Types exchanged between the serving front ends (HTTP servers, nodes) and the engine.

The request types check themselves (`GenerateRequest.validate`, `SamplingParams.validate`,
`LogprobRequest.validate`: ValueError naming the field); `Engine.submit` and
`Engine.submit_prefilled` call them on the caller's thread. Plain data: no state, no locks.
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    import torch


GREEDY_TEMPERATURE = 1e-6  # SGLang's _SAMPLING_EPS: a lower temperature samples greedily


def is_token_id(value: object, vocab_size: int) -> bool:
    """An integer (not a bool) in [0, vocab_size)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        return False
    return 0 <= int(value) < vocab_size


@dataclass(frozen=True)
class SamplingParams:
    """SGLang-named sampling parameters. A temperature below `GREEDY_TEMPERATURE` (0
    included) means greedy, as SGLang's `_SAMPLING_EPS`: dividing by a tinier one overflows."""

    max_new_tokens: int = 128
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = -1  # <= 0: no top-k truncation
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    min_p: float = 0.0  # 0: off; else drop tokens with p < min_p * p_max
    min_new_tokens: int = 0  # EOS and stop tokens are masked until this many tokens exist
    frequency_penalty: float = 0.0  # OpenAI: logit -= f * count(token in output)
    presence_penalty: float = 0.0  # OpenAI: logit -= p * (token in output)
    repetition_penalty: float = 1.0  # SGLang: scales generated tokens' logits, 1.0: off

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE or self.top_k == 1

    def validate(self) -> None:
        """SGLang's ranges (`SamplingParams.verify`), with the same messages' meaning;
        `max_new_tokens` is the request's to check (it knows the context)."""
        if not math.isfinite(self.temperature) or self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        if not -2.0 <= self.frequency_penalty <= 2.0:
            raise ValueError(f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty}")
        if not -2.0 <= self.presence_penalty <= 2.0:
            raise ValueError(f"presence_penalty must be in [-2, 2], got {self.presence_penalty}")
        if not 0.0 < self.repetition_penalty <= 2.0:
            raise ValueError(
                f"repetition_penalty must be in (0, 2], got {self.repetition_penalty}")
        if not 0 <= self.min_new_tokens <= self.max_new_tokens:
            raise ValueError(
                f"min_new_tokens must be in [0, max_new_tokens={self.max_new_tokens}], got "
                f"{self.min_new_tokens}")


@dataclass(frozen=True)
class CachedTokens:
    """Where the prompt's reused tokens came from (docs/design.md §4.1 `cached_tokens_details`)."""

    device: int = 0
    host: int = 0
    storage: int = 0
    storage_from_decode: int = 0

    @property
    def total(self) -> int:
        # storage_from_decode is a subset of storage, not an extra tier
        return self.device + self.host + self.storage

    def as_dict(self) -> dict[str, int]:
        return {
            "device": self.device,
            "host": self.host,
            "storage": self.storage,
            "storage_from_decode": self.storage_from_decode,
        }


@dataclass(frozen=True)
class CacheFlush:
    """The answer of `Engine.drop_cache`: whether the memory tiers were dropped, what was
    freed, or what kept them (requests in flight, tier I/O in flight)."""

    flushed: bool
    device_pages: int = 0  # device pages the prefix tree gave back
    host_pages: int = 0  # host copies dropped (HiCache); storage is never touched
    busy_requests: int = 0  # requests queued, running, held or reserved: nothing dropped
    tier_busy: bool = False  # host/storage I/O still in flight: nothing dropped

    @property
    def reason(self) -> str:
        if self.flushed:
            return ""
        if self.busy_requests:
            return f"{self.busy_requests} requests in flight"
        return "cache tier I/O in flight" if self.tier_busy else "not flushed"


@dataclass(frozen=True)
class LogprobRequest:
    """What logprobs a request wants (SGLang's `return_logprob` family).

    Output logprobs come with every sampled token; `top_n` alternatives and the logprobs of
    `token_ids` ride along. `input_start` asks for the logprobs of prompt positions
    `input_start..` (each position's token given the ones before it): those positions need
    their logits, so cached pages from there on are recomputed, not reused."""

    top_n: int = 0
    token_ids: tuple[int, ...] = ()
    input_start: int | None = None

    def validate(self, vocab_size: int, prompt_len: int) -> None:
        """`top_n` in [0, vocab_size], token ids in the vocabulary, `input_start` within a
        prompt of `prompt_len` tokens."""
        if isinstance(self.top_n, bool) or not 0 <= self.top_n <= vocab_size:
            raise ValueError(f"logprobs top_n must be in [0, {vocab_size}], got {self.top_n!r}")
        bad = next((t for t in self.token_ids if not is_token_id(t, vocab_size)), None)
        if bad is not None:
            raise ValueError(f"logprobs token id {bad!r} is not an integer in [0, {vocab_size})")
        start = self.input_start
        if start is not None and not 0 <= start <= prompt_len:
            raise ValueError(
                f"logprobs input_start must be in [0, {prompt_len}] (the prompt length), "
                f"got {start}")


@dataclass(frozen=True)
class TokenLogprob:
    """The logprob of one token at one position, with the `top_n` best (sorted, best first) and
    the requested `token_ids` at that position as `(token_id, logprob)` pairs.

    Output tokens: log_softmax of the logits the sampler saw (penalties and masks applied),
    divided by the temperature for sampled requests, before top-k/top-p/min-p truncation:
    SGLang 0.5.23's default (`pdcache.engine.sampler`). Masked tokens read the fp32 minimum,
    not -inf. Prompt tokens: log_softmax of the raw logits. `logprob` is None only for the
    first entry of `RequestOutput.input_logprobs` (the token at `input_start`: no logits
    before it are computed, as in SGLang), whose `top`/`selected` are empty."""

    token_id: int
    logprob: float | None
    top: tuple[tuple[int, float], ...] = ()
    selected: tuple[tuple[int, float], ...] = ()


class TokenConstraint(Protocol):
    """A per-request constraint on what may be sampled next (a grammar matcher, a forced
    sequence). Called on the engine thread only, once per sampled token, in this order:
    `allowed_tokens` (before sampling), then `accept` with the token sampled."""

    def allowed_tokens(self, vocab_size: int) -> torch.Tensor | None:
        """A bool mask `[vocab_size]` of the tokens allowed next; None allows every token."""

    def accept(self, token_id: int) -> None:
        """Advance past `token_id` (one `allowed_tokens` allowed)."""

    def is_terminated(self) -> bool:
        """True once the constraint is complete: the request finishes with reason 'stop'."""


@dataclass(frozen=True)
class GenerateRequest:
    """One request as the engine sees it: token ids in, token ids out."""

    rid: str
    input_ids: list[int]
    sampling: SamplingParams = field(default_factory=SamplingParams)
    cache_salt: str = ""  # tenant namespace: page keys and prefix matches never cross it
    logprobs: LogprobRequest | None = None
    constraint: TokenConstraint | None = None
    # rid of a request with the same prompt submitted just before this one (n > 1 samples):
    # this one is not scheduled until that one's prompt pages are in the prefix tree, so the
    # prompt is computed once and the samples share its pages
    prefill_leader: str | None = None
    # the conversation this request is a turn of (router → node `session_id`): session-aware
    # eviction policies keep the pages of sessions expected back soon
    session_id: str = ""

    def validate(self, vocab_size: int, max_context: int, page_size: int,
                 num_pages: int) -> None:
        """Raise ValueError unless an engine of this vocabulary, context length and KV pool
        (`num_pages` pages of `page_size` tokens) can run the request to `max_new_tokens`."""
        params = self.sampling
        if not self.input_ids:
            raise ValueError("the prompt is empty")
        bad = next((t for t in self.input_ids if not is_token_id(t, vocab_size)), None)
        if bad is not None:
            raise ValueError(f"token id {bad!r} is not an integer in [0, {vocab_size})")
        if params.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {params.max_new_tokens}")
        total = len(self.input_ids) + params.max_new_tokens
        if total > max_context:
            raise ValueError(
                f"prompt ({len(self.input_ids)} tokens) + max_new_tokens ({params.max_new_tokens})"
                f" = {total} exceeds the context length {max_context}"
            )
        if -(-total // page_size) > num_pages:  # the pages its K/V needs
            raise ValueError(
                f"prompt + max_new_tokens = {total} tokens exceeds the KV pool "
                f"({num_pages} pages of {page_size} tokens)"
            )
        params.validate()
        if self.logprobs is not None:
            self.logprobs.validate(vocab_size, len(self.input_ids))
        if self.prefill_leader is not None and self.prefill_leader == self.rid:
            raise ValueError("prefill_leader names the request itself")


@dataclass(frozen=True)
class RequestOutput:
    """Incremental output: the tokens produced since the previous output of this request.

    The last output of a request has `finished=True` and a `finish_reason` of "stop" (EOS or
    a stop token), "length" (max_new_tokens) or "abort" (with `error` set).
    """

    rid: str
    new_token_ids: list[int]
    finished: bool = False
    finish_reason: str | None = None
    error: str | None = None
    # the prompt's numbers: on every output once the prompt is matched (SGLang's first stream
    # chunk carries them), final on the last one (retractions may recompute)
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached: CachedTokens = field(default_factory=CachedTokens)
    computed_tokens: int = 0
    ttft_s: float | None = None
    e2e_s: float | None = None
    # with GenerateRequest.logprobs: one per entry of new_token_ids, and on the first output
    # the prompt's from LogprobRequest.input_start on (the first prompt token has none)
    new_logprobs: list[TokenLogprob] = field(default_factory=list)
    input_logprobs: list[TokenLogprob] | None = None
