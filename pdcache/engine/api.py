"""Types exchanged between the serving front ends (HTTP servers, nodes) and the engine."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class SamplingParams:
    """SGLang-named sampling parameters. `temperature == 0` means greedy."""

    max_new_tokens: int = 128
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = -1  # <= 0: no top-k truncation
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0.0 or self.top_k == 1


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
class GenerateRequest:
    """One request as the engine sees it: token ids in, token ids out."""

    rid: str
    input_ids: list[int]
    sampling: SamplingParams = field(default_factory=SamplingParams)
    cache_salt: str = ""  # tenant namespace: page keys and prefix matches never cross it


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
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached: CachedTokens = field(default_factory=CachedTokens)
    computed_tokens: int = 0
    ttft_s: float | None = None
    e2e_s: float | None = None
