"""SGLang's native `/generate` (docs/sglang.md, docs/design.md §4.1): the request model, its
expansion into single sequences, and the response and stream shapes.

Shared by the unified server, the P/D nodes and the router, so it depends on pydantic and the
engine's plain types only. The request model accepts every field of SGLang 0.5.23's
`GenerateReqInput` (and every sampling parameter of its `SamplingParams`): the ones pdcache
implements are typed; the others are accepted only at their default/empty value and answer
400 `unsupported_parameter` naming the field otherwise (`check_supported`), so nothing is
silently ignored. tests/server/test_generate_api.py holds the field lists against the
installed SGLang, so a field SGLang adds cannot be missed.

A request is expanded into `GenerateItem`s (one prompt, one sample each): a batch (`text` or
`input_ids` as a list) and `sampling_params.n > 1` answer a list, as SGLang does. Each item's
answer is built by an `OutputBuilder`: SGLang's `{"text", "output_ids", "meta_info"}`, its
stream chunks cumulative (every chunk holds the whole text and ids so far, SGLang's default) or
incremental (SGLang's `--incremental-streaming-output`).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Mapping
from contextlib import aclosing
from dataclasses import dataclass
from types import MappingProxyType
from typing import Annotated, Any, Literal, TypeVar

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationInfo,
    create_model,
    field_validator,
    model_validator,
)

from pdcache.engine.api import CachedTokens, LogprobRequest, SamplingParams
from pdcache.wire.protocol import (
    SEED_LIMIT,
    CacheSalt,
    SessionId,
    Stop,
    bad_request,
    checked_stop_strings,
    unsupported,
)

T = TypeVar("T")
_STRICT = ConfigDict(strict=True, extra="forbid", allow_inf_nan=False)
TokenIds = list[int]
Seed = Annotated[int, Field(ge=0, lt=SEED_LIMIT)]
TOP_K_ALL = 1 << 30  # SGLang's "no top-k" default; any k >= this is no truncation
MAX_SAMPLES = 64  # n per prompt
MAX_BATCH = 256  # items (prompts x n) per request
# logprobs: alternatives per position, and what one request may ask for in all (positions x
# (1 + top_n + token ids) over its sequences): a 256-prompt batch asking every prompt
# position's whole vocabulary was ~120 GB of answer for one client (~110 bytes an entry as
# Python objects; the budget is ~0.5 GB)
MAX_TOP_LOGPROBS = 256
LOGPROB_ENTRY_BUDGET = 1 << 22
EMPTY: tuple[Any, ...] = (None, False, "", 0, (), {})  # neutral values of unimplemented fields
# the meta_info lists that grow with the output: sliced per chunk when streaming
# incrementally, concatenated by a router that streams cumulatively
OUTPUT_LOGPROB_KEYS = ("output_token_logprobs", "output_top_logprobs",
                       "output_token_ids_logprobs")
INPUT_LOGPROB_KEYS = ("input_token_logprobs", "input_top_logprobs", "input_token_ids_logprobs")




# --------------------------------------------------------------------------- sampling_params

# SGLang sampling parameters pdcache does not implement, with the values that mean "off"
UNSUPPORTED_SAMPLING: Mapping[str, tuple[Any, ...]] = MappingProxyType({
    "stop_regex": (None, "", ()), "regex": (None,), "ebnf": (None,),
    "structural_tag": (None,), "beam_width": (None, 0, 1), "stream_interval": (None,),
    "logit_bias": (None, {}), "custom_params": (None, {}), "watermark": (None, {}),
    "choice": (None, ()), "spaces_between_special_tokens": (True,),
})


class _SamplingBase(BaseModel):
    """SGLang's sampling names pdcache implements. Defaults are the engine's (greedy, 128 new
    tokens), not SGLang's temperature 1.0 (docs/sglang.md)."""

    model_config = _STRICT

    max_new_tokens: int = Field(default=SamplingParams.max_new_tokens, ge=1)
    min_new_tokens: int = Field(default=0, ge=0)
    temperature: float = Field(default=SamplingParams.temperature, ge=0.0)
    top_p: float = Field(default=SamplingParams.top_p, gt=0.0, le=1.0)
    top_k: int = SamplingParams.top_k  # <= 0 or >= 2**30: no top-k truncation
    min_p: float = Field(default=0.0, ge=0.0, le=1.0)
    frequency_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    presence_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    repetition_penalty: float = Field(default=1.0, gt=0.0, le=2.0)
    seed: Seed | None = None
    sampling_seed: Seed | None = None  # SGLang's name for `seed`
    stop: Stop | None = None
    stop_token_ids: TokenIds = Field(default_factory=list)
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    no_stop_trim: bool = False
    n: int = Field(default=1, ge=1, le=MAX_SAMPLES)
    json_schema: str | None = None  # SGLang's: constrained decoding (wire/structured.py)

    @model_validator(mode="before")
    @classmethod
    def _drop_nulls(cls, data: Any) -> Any:
        # SGLang takes null as "the default" for its sampling parameters
        if isinstance(data, dict):
            return {k: v for k, v in data.items() if v is not None}
        return data

    @field_validator("min_new_tokens")
    @classmethod
    def _min_within_max(cls, value: int, info: ValidationInfo) -> int:
        # cross-field, as SGLang's verify(): refused here, before a P/D prefill is wasted on
        # it (the prefill node caps min_new_tokens to its one token and could not tell);
        # a field validator (max_new_tokens is validated first) so the 400 names this field
        top = info.data.get("max_new_tokens")
        if isinstance(top, int) and value > top:
            raise ValueError(f"min_new_tokens ({value}) must be <= max_new_tokens ({top})")
        return value

    def check_supported(self, param: str) -> None:
        for name, neutral in UNSUPPORTED_SAMPLING.items():
            if not _is_neutral(getattr(self, name), neutral):
                raise unsupported(f"{param}.{name}",
                                  f"'{param}.{name}' is not supported by pdcache")
        if self.seed is not None and self.sampling_seed not in (None, self.seed):
            raise bad_request("give 'seed' or 'sampling_seed', not both",
                              param=f"{param}.sampling_seed")
        # refused here, before anything is submitted: every node checks a body first
        checked_stop_strings(self.stop, f"{param}.stop")

    def stop_strings(self) -> list[str]:
        return checked_stop_strings(self.stop, "sampling_params.stop")

    def to_engine(self) -> SamplingParams:
        top_k = -1 if self.top_k >= TOP_K_ALL else self.top_k
        return SamplingParams(
            max_new_tokens=self.max_new_tokens, temperature=self.temperature,
            top_p=self.top_p, top_k=top_k,
            seed=self.seed if self.seed is not None else self.sampling_seed,
            stop_token_ids=tuple(self.stop_token_ids), ignore_eos=self.ignore_eos,
            min_p=self.min_p, min_new_tokens=self.min_new_tokens,
            frequency_penalty=self.frequency_penalty, presence_penalty=self.presence_penalty,
            repetition_penalty=self.repetition_penalty)

    def forwarded(self) -> dict[str, Any]:
        """What a router sends a node for one sample (n is the router's business)."""
        return self.model_dump(exclude_defaults=True, exclude={"n"})


GenerateSamplingParams = create_model(
    "GenerateSamplingParams", __base__=_SamplingBase,
    **{name: (Any, neutral[0]) for name, neutral in UNSUPPORTED_SAMPLING.items()})


# --------------------------------------------------------------------------- the request

# `GenerateReqInput` fields pdcache does not implement, with the values that mean "off".
# A batch may give one value per item: a list of neutral values is neutral too.
UNSUPPORTED_FIELDS: Mapping[str, tuple[Any, ...]] = MappingProxyType({
    "input_embeds": EMPTY, "image_data": EMPTY, "video_data": EMPTY, "audio_data": EMPTY,
    "mm_hashes": EMPTY, "mm_content_hashes": EMPTY, "use_audio_in_video": (False,),
    "video_config": EMPTY, "watermark": EMPTY, "return_sampling_mask": EMPTY,
    "sampling_logprobs_mode": EMPTY, "return_flat_raw_top_logprobs": (False,),
    "return_flat_raw_output_top_logprobs": (False,), "return_flat_raw_top_logprobs_b64": (False,),
    "return_hidden_states": EMPTY, "return_routed_experts": (False,),
    "routed_experts_start_len": (0,), "return_indexer_topk": (False,), "modalities": EMPTY,
    "session_params": EMPTY, "lora_path": EMPTY, "lora_id": EMPTY,
    "custom_logit_processor": EMPTY, "positional_embed_overrides": EMPTY,
    "bootstrap_pair_key": EMPTY, "decode_tp_size": (None, 1), "routed_dp_rank": (None, 0),
    "data_parallel_rank": (None, 0), "disagg_prefill_dp_rank": (None, 0),
    "routing_key": EMPTY, "http_worker_ipc": EMPTY, "background": (False,),
    "require_reasoning": (False,), "max_thinking_tokens": (None,), "priority": (None, 0),
    "extra_key": EMPTY, "return_bytes": (False,), "return_entropy": (False,),
    "return_prompt_token_ids": (False,), "need_wait_for_mm_inputs": EMPTY,
    "num_items_assigned": EMPTY, "encoder_urls": EMPTY, "max_dynamic_patch": (None,),
    "min_dynamic_patch": (None,), "image_max_dynamic_patch": (None,),
    "video_max_dynamic_patch": (None,), "images_config": EMPTY, "mm_processor_kwargs": EMPTY,
    "multi_item_delimiter_indices": EMPTY, "token_indices_to_pool": EMPTY, "kv_hints": EMPTY,
})
# accepted with any value, no effect on the answer: request tracking and logging controls
# (pdcache logs no request contents) — docs/sglang.md
TRACKING_FIELDS = ("model", "conversation_id", "no_logs", "custom_labels", "external_trace_header",
                   "received_time", "log_metrics")


class StreamOptions(BaseModel):
    """SGLang's clients send OpenAI's `stream_options` to /generate too; `meta_info` carries
    the usage in every chunk, so `include_usage` changes nothing here."""

    model_config = ConfigDict(strict=True, extra="ignore")

    include_usage: bool = False


class PDParams(BaseModel):
    """Set only by the router on requests to prefill and decode nodes (docs/pd-protocol.md)."""

    model_config = _STRICT

    room: int = Field(ge=0, lt=1 << 63)
    role: Literal["prefill", "decode"]
    bootstrap: str | None = Field(default=None, max_length=256)  # decode: P's bootstrap
    prefill_node: str | None = Field(default=None, max_length=128)
    decode_node: str | None = Field(default=None, max_length=128)
    # decode: the router already streamed the first token (prefill's stream), so decode's
    # stream starts after it (docs/pd-protocol.md, "First token from prefill")
    first_token_streamed: bool = False


Rid = Annotated[str, Field(min_length=1, max_length=128)]


class _GenerateBase(BaseModel):
    """`POST /generate`: SGLang's fields pdcache implements, and its extensions."""

    model_config = _STRICT

    text: str | list[str] | None = None
    input_ids: TokenIds | list[TokenIds] | None = None
    sampling_params: GenerateSamplingParams | list[GenerateSamplingParams] | None = None  # type: ignore[valid-type]
    rid: Rid | list[Rid] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    return_logprob: bool | list[bool] | None = None
    logprob_start_len: int | list[int] | None = None
    top_logprobs_num: int | list[int] | None = None
    token_ids_logprob: TokenIds | list[TokenIds] | None = None
    return_text_in_logprobs: bool = False
    session_id: SessionId | None = None
    cache_salt: CacheSalt | None = None
    # SGLang's PD fields: on prefill/decode nodes, what sglang-router injects
    bootstrap_host: str | None = Field(default=None, max_length=253)
    bootstrap_port: int | None = Field(default=None, ge=0, lt=65536)
    bootstrap_room: int | None = Field(default=None, ge=0, lt=1 << 63)
    # pdcache extensions
    incremental_streaming_output: bool | None = None  # None: the server's setting
    pd: PDParams | None = None
    # tracking only (TRACKING_FIELDS); `model` is not SGLang's, but sglang-router sends it
    # (null) to every worker: one model per deployment, the name is not checked
    model: str | None = None
    conversation_id: str | None = None
    no_logs: bool = False
    custom_labels: dict[str, str] | None = None
    external_trace_header: dict[str, Any] | None = None
    received_time: float | None = None
    log_metrics: bool = True

    # ---- checks

    def check_supported(self) -> None:
        """400 `unsupported_parameter` for the first unimplemented field with a value."""
        for name, neutral in UNSUPPORTED_FIELDS.items():
            if not _is_neutral(getattr(self, name), neutral):
                raise unsupported(name, f"'{name}' is not supported by pdcache")
        for i, sampling in enumerate(self._sampling_list()):
            sampling.check_supported("sampling_params" if not isinstance(
                self.sampling_params, list) else f"sampling_params[{i}]")

    def check_one_prompt(self) -> None:
        if (self.input_ids is None) == (self.text is None):
            raise bad_request("give exactly one of 'input_ids' or 'text'", code="invalid_prompt")

    def prompt_param(self) -> str:
        return "input_ids" if self.input_ids is not None else "text"

    # ---- batch shape

    @property
    def is_batch_prompt(self) -> bool:
        if isinstance(self.text, list):
            return True
        ids = self.input_ids
        return bool(ids) and isinstance(ids[0], list)  # type: ignore[index]

    def prompts(self) -> list[str | list[int]]:
        self.check_one_prompt()
        if isinstance(self.text, str):
            return [self.text]
        if isinstance(self.text, list):
            return list(self.text)
        assert self.input_ids is not None
        return list(self.input_ids) if self.is_batch_prompt else [self.input_ids]  # type: ignore[list-item]

    def _sampling_list(self) -> list[_SamplingBase]:
        sp = self.sampling_params
        if sp is None:
            return [GenerateSamplingParams()]
        return list(sp) if isinstance(sp, list) else [sp]

    def items(self) -> list[GenerateItem]:
        """The single sequences this request asks for, in answer order (prompt-major, then
        sample): a batch of B prompts with n samples each is B*n items."""
        prompts = self.prompts()
        if not prompts:
            raise bad_request("the batch is empty", param=self.prompt_param(),
                              code="empty_prompt")
        count = len(prompts)
        samplings = _per_item(self._sampling_list(), count, "sampling_params",
                              broadcast=not isinstance(self.sampling_params, list))
        rids = self._rids(count)
        total = sum(s.n for s in samplings)
        if total > MAX_BATCH:
            raise bad_request(f"{total} sequences in one request; at most {MAX_BATCH}",
                              param=self.prompt_param(), code="batch_too_large")
        items: list[GenerateItem] = []
        for i, (prompt, sampling) in enumerate(zip(prompts, samplings, strict=True)):
            logprobs = self._logprob_request(i, count)
            first = len(items)
            for j in range(sampling.n):
                rid = rids[i] if rids[i] is None or j == 0 else f"{rids[i]}-{j}"
                items.append(GenerateItem(
                    index=len(items), prompt=prompt, sampling=sampling, rid=rid,
                    logprobs=logprobs, leader=first if j > 0 else None,
                    param=self.prompt_param() + (f"[{i}]" if self.is_batch_prompt else "")))
        return items

    @property
    def answers_list(self) -> bool:
        """SGLang answers a list for a batch and for n > 1."""
        return self.is_batch_prompt or any(s.n > 1 for s in self._sampling_list())

    def _rids(self, count: int) -> list[str | None]:
        if isinstance(self.rid, list):
            if len(self.rid) != count:
                raise bad_request(f"'rid' has {len(self.rid)} entries for {count} prompts",
                                  param="rid")
            if len(set(self.rid)) != len(self.rid):
                raise bad_request("'rid' entries must be unique", param="rid")
            return list(self.rid)
        if self.rid is not None and self.is_batch_prompt:
            return [f"{self.rid}_{i}" for i in range(count)]  # SGLang: a prefix per item
        return [self.rid] * count

    def _logprob_request(self, i: int, count: int) -> LogprobRequest | None:
        wanted = _pick(self.return_logprob, i, count, "return_logprob")
        if not wanted:
            return None
        start = _pick(self.logprob_start_len, i, count, "logprob_start_len")
        top_n = _pick(self.top_logprobs_num, i, count, "top_logprobs_num") or 0
        if not 0 <= top_n <= MAX_TOP_LOGPROBS:
            raise bad_request(f"'top_logprobs_num' must be in [0, {MAX_TOP_LOGPROBS}]",
                              param="top_logprobs_num")
        ids = self.token_ids_logprob
        if ids and isinstance(ids[0], list):
            ids = _pick(ids, i, count, "token_ids_logprob")  # type: ignore[arg-type]
        input_start = None if start is None or start < 0 else start
        return LogprobRequest(top_n=top_n, token_ids=tuple(ids or ()),  # type: ignore[arg-type]
                              input_start=input_start)

    # ---- PD

    def pd_params(self, role: str) -> PDParams | None:
        """The PD parameters of a node request: our router's `pd`, or SGLang's `bootstrap_*`
        fields (sglang-router sends the same body to P and D with them injected)."""
        if self.pd is not None or self.bootstrap_room is None:
            return self.pd
        if role == "decode":
            if not self.bootstrap_host or self.bootstrap_port is None:
                raise bad_request("a decode request needs 'bootstrap_host' and "
                                  "'bootstrap_port' with 'bootstrap_room'",
                                  param="bootstrap_host", code="invalid_bootstrap")
            return PDParams(room=self.bootstrap_room, role="decode",
                            bootstrap=f"{self.bootstrap_host}:{self.bootstrap_port}")
        return PDParams(room=self.bootstrap_room, role="prefill")

    def has_bootstrap(self) -> bool:
        return self.bootstrap_field() is not None

    def bootstrap_field(self) -> str | None:
        """The first of SGLang's PD fields that is set."""
        return next((name for name in ("bootstrap_room", "bootstrap_host", "bootstrap_port")
                     if getattr(self, name) is not None), None)


GenerateRequestBody = create_model(
    "GenerateRequestBody", __base__=_GenerateBase,
    **{name: (Any, neutral[0]) for name, neutral in UNSUPPORTED_FIELDS.items()})


class LogprobBudget:
    """What a request's logprobs may cost in all (`LOGPROB_ENTRY_BUDGET` entries); a server
    `spend`s each sequence's before submitting it. One per request; not thread-safe."""

    def __init__(self, budget: int = LOGPROB_ENTRY_BUDGET) -> None:
        self.left = budget

    def spend(self, prompt_len: int, max_new_tokens: int, request: LogprobRequest | None) -> None:
        """400 `logprobs_too_large` once the request's sequences ask for more than the budget:
        each returned position (the prompt's from `input_start`, every output token) costs
        1 + top_n + len(token_ids) entries."""
        if request is None:
            return
        positions = max_new_tokens
        if request.input_start is not None:
            positions += max(0, prompt_len - request.input_start)
        self.left -= positions * (1 + request.top_n + len(request.token_ids))
        if self.left < 0:
            raise bad_request(
                f"the logprobs asked for exceed {LOGPROB_ENTRY_BUDGET} entries (positions x "
                "(1 + top_logprobs_num + token_ids_logprob) over the request's sequences): raise "
                "logprob_start_len, lower top_logprobs_num or split the batch",
                param="top_logprobs_num", code="logprobs_too_large")


@dataclass(frozen=True)
class GenerateItem:
    """One sequence of a /generate request: its prompt, sampling and logprob request.
    `leader` is the index of the first sample of the same prompt (n > 1): its rid is this
    one's `prefill_leader`, so the prompt is computed once."""

    index: int
    prompt: str | list[int]
    sampling: _SamplingBase
    rid: str | None
    logprobs: LogprobRequest | None
    leader: int | None
    param: str


def _is_neutral(value: Any, neutral: tuple[Any, ...]) -> bool:
    """Whether `value` means "off" (a list of such values, one per batch item, too)."""
    if isinstance(value, list):
        if not value:
            return () in neutral
        return all(not isinstance(v, list | dict) and _is_neutral(v, neutral) for v in value)
    if isinstance(value, dict):
        return not value and {} in neutral
    return any(value == n and type(value) is type(n) for n in neutral)


def _per_item(values: list[Any], count: int, param: str, broadcast: bool) -> list[Any]:
    if broadcast:
        return values * count if len(values) == 1 else values
    if len(values) != count:
        raise bad_request(f"'{param}' has {len(values)} entries for {count} prompts",
                          param=param)
    return values


def _pick(value: Any, i: int, count: int, param: str) -> Any:
    if not isinstance(value, list):
        return value
    if len(value) != count:
        raise bad_request(f"'{param}' has {len(value)} entries for {count} prompts", param=param)
    return value[i]


# --------------------------------------------------------------------------- the answer


class CachedTokensDetails(BaseModel):
    device: int = 0
    host: int = 0
    storage: int = 0
    storage_from_decode: int = 0

    @classmethod
    def of(cls, cached: CachedTokens) -> CachedTokensDetails:
        return cls(**cached.as_dict())


class GenerateMeta(BaseModel):
    """The fields of a node's `meta_info` the router reads (typed); the rest (SGLang's
    `id`, logprobs, ...) passes through untouched."""

    model_config = ConfigDict(extra="allow")

    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    cached_tokens_details: CachedTokensDetails
    computed_tokens: int
    ttft_s: float | None = None
    e2e_latency: float | None = None
    prefill_node: str
    decode_node: str
    finish_reason: dict[str, Any] | None = None

    @property
    def finish_type(self) -> str | None:
        """"stop", "length" or "abort" (SGLang's finish_reason `type`)."""
        return None if self.finish_reason is None else self.finish_reason.get("type")


def finish_reason_object(reason: str | None, completion_tokens: int, matched: int | str | None,
                         error: str | None = None) -> dict[str, Any] | None:
    """SGLang's finish_reason: `{"type": "length", "length": N}`, `{"type": "stop",
    "matched": token id or stop string}`, `{"type": "abort", "message": ...}`."""
    if reason is None:
        return None
    if reason == "length":
        return {"type": "length", "length": completion_tokens}
    if reason == "stop":
        return {"type": "stop", "matched": matched}
    return {"type": "abort", "message": error or "aborted"}


@dataclass
class OutputBuilder:
    """Builds one sequence's SGLang answer: `{"text", "output_ids", "meta_info"}` (+ `index`
    in a list). `add` takes the next new ids and new text and returns the stream chunk:
    cumulative (whole text and ids so far) unless `incremental`. Output logprob lists in a
    `meta_info` handed to `add` are this chunk's; a cumulative chunk carries all so far."""

    incremental: bool
    index: int | None = None
    text: str = ""
    output_ids: list[int] | None = None
    _logprob_lists: dict[str, list[Any]] | None = None
    _input_logprobs: dict[str, Any] | None = None

    def __post_init__(self) -> None:
        self.output_ids = []
        self._logprob_lists = {}
        self._input_logprobs = {}

    def add(self, new_ids: list[int], new_text: str, meta_info: dict[str, Any]
            ) -> dict[str, Any]:
        assert self.output_ids is not None
        self.output_ids.extend(new_ids)
        self.text += new_text
        if self.incremental:
            return self._chunk(new_text, new_ids, meta_info)
        return self._chunk(self.text, list(self.output_ids), self._cumulative(meta_info))

    def final(self, meta_info: dict[str, Any]) -> dict[str, Any]:
        """The whole answer (a non-streaming response)."""
        assert self.output_ids is not None
        return self._chunk(self.text, self.output_ids, self._cumulative(meta_info))

    def _cumulative(self, meta_info: dict[str, Any]) -> dict[str, Any]:
        assert self._logprob_lists is not None and self._input_logprobs is not None
        if not self._logprob_lists and not any(key in meta_info for key in OUTPUT_LOGPROB_KEYS):
            return meta_info
        merged = dict(meta_info)
        for key in INPUT_LOGPROB_KEYS:  # sent once (first chunk); every cumulative chunk has it
            if key in meta_info:
                self._input_logprobs[key] = meta_info[key]
            elif key in self._input_logprobs:
                merged[key] = self._input_logprobs[key]
        for key in OUTPUT_LOGPROB_KEYS:
            if isinstance(meta_info.get(key), list) or key in self._logprob_lists:
                so_far = self._logprob_lists.setdefault(key, [])
                so_far.extend(meta_info.get(key) or [])
                merged[key] = list(so_far)
        if "output_token_logprobs" in merged:
            merged["output_token_logprobs_length"] = len(merged["output_token_logprobs"])
        return merged

    def _chunk(self, text: str, ids: list[int], meta_info: dict[str, Any]) -> dict[str, Any]:
        chunk = {"text": text, "output_ids": ids, "meta_info": meta_info}
        if self.index is not None:
            chunk["index"] = self.index
        return chunk


async def merge_streams(streams: list[AsyncIterator[T]]) -> AsyncIterator[T]:
    """The items of several streams as each comes (SGLang's batch stream: interleaved, each
    chunk with its `index`). Closing the merge closes every stream."""
    if len(streams) == 1:
        async with aclosing(streams[0]) as only:
            async for item in only:
                yield item
        return
    pending = {asyncio.ensure_future(anext(s)): s for s in streams}
    try:
        while pending:
            done, _ = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            for task in done:
                stream = pending.pop(task)
                try:
                    item = task.result()
                except StopAsyncIteration:
                    continue
                yield item
                pending[asyncio.ensure_future(anext(stream))] = stream
    finally:
        for task in pending:
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
        await asyncio.gather(*(s.aclose() for s in streams  # type: ignore[attr-defined]
                               if hasattr(s, "aclose")), return_exceptions=True)


def single_item(body: _GenerateBase) -> GenerateItem:
    """The one sequence of a P/D node request (no batch, n = 1): 400 otherwise."""
    items = body.items()
    if len(items) != 1:
        raise unsupported("sampling_params.n" if not body.is_batch_prompt else "text",
                          "a prefill/decode node serves one sequence per request; send a "
                          "batch or n > 1 through the router")
    return items[0]
