"""HTTP contract of docs/design.md §4.1: request models, validation and error bodies.

Shared by the unified server, the router and the P/D nodes, so it depends on pydantic and
the engine's plain types only (no FastAPI, no engine instance). Every malformed request maps
to an `ApiError`, which carries an HTTP status and an OpenAI-style body
`{"error": {"message", "type", "param", "code"}}`.

Request models are strict (JSON types are not coerced: "5" is not an int, 1.0 is not a token
id) and, where a silently ignored field would change results, reject unknown fields.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Annotated, Any, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from pdcache.engine.api import SamplingParams
from pdcache.engine.tokenizer import RESERVED_TEMPLATE_VARIABLES

# --------------------------------------------------------------------------- errors

INVALID_REQUEST = "invalid_request_error"
NOT_FOUND = "not_found_error"
OVERLOADED = "overloaded_error"
TIMEOUT = "timeout_error"
SERVER_ERROR = "server_error"

SEED_LIMIT = 2**63  # torch generators take a 64-bit seed; keep it a non-negative int64


class ApiError(Exception):
    """A request that cannot be served; rendered as an OpenAI-style JSON error body."""

    def __init__(
        self,
        status_code: int,
        message: str,
        *,
        type: str = INVALID_REQUEST,  # noqa: A002 - OpenAI's field name
        param: str | None = None,
        code: str | None = None,
    ) -> None:
        super().__init__(message)
        self.status_code = status_code
        self.message = message
        self.type = type
        self.param = param
        self.code = code

    def body(self) -> dict[str, Any]:
        return error_body(self.message, type=self.type, param=self.param, code=self.code)


def error_body(
    message: str,
    *,
    type: str = INVALID_REQUEST,  # noqa: A002
    param: str | None = None,
    code: str | None = None,
) -> dict[str, Any]:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


def bad_request(message: str, *, param: str | None = None, code: str | None = None) -> ApiError:
    return ApiError(400, message, param=param, code=code)


# --------------------------------------------------------------------------- parsing

M = TypeVar("M", bound=BaseModel)


def parse_body(model_cls: type[M], raw: bytes) -> M:
    """Validate a raw JSON body against `model_cls`; any problem becomes a 400 `ApiError`."""
    try:
        return model_cls.model_validate_json(raw)
    except ValidationError as exc:
        raise _validation_error(exc) from None


def _validation_error(exc: ValidationError) -> ApiError:
    first = exc.errors(include_url=False)[0]
    if first["type"] == "json_invalid":
        return bad_request(f"request body is not valid JSON: {first['msg']}", code="invalid_json")
    param = _loc_to_param(first["loc"])
    if first["type"] == "extra_forbidden":
        return bad_request(f"unknown field '{param}'", param=param, code="unknown_field")
    where = f"'{param}': " if param else "request body: "
    extra = f" (and {exc.error_count() - 1} more errors)" if exc.error_count() > 1 else ""
    return bad_request(f"{where}{first['msg']}{extra}", param=param, code=first["type"])


def _loc_to_param(loc: tuple[int | str, ...]) -> str | None:
    # pydantic adds union member tags ('list[int]', 'str', 'Model') to the location; keep
    # field names
    parts: list[str] = []
    for item in loc:
        if isinstance(item, int):
            parts.append(f"[{item}]")
        elif "[" not in item and item not in ("str", "int", "float", "bool") \
                and not item[:1].isupper():  # a union member's tag (a model's class name)
            parts.append(("." if parts else "") + item)
    return "".join(parts) or None


# --------------------------------------------------------------------------- limits


@dataclass(frozen=True)
class ModelLimits:
    """What a server knows about its model to validate prompts before queueing them."""

    vocab_size: int
    context_len: int


def encode_prompt(tokenizer: Any, text: str | None, param: str) -> list[int]:
    """The token ids of a text prompt; an empty one is a 400 naming `param`."""
    if not text:
        raise bad_request("the prompt is empty", param=param, code="empty_prompt")
    return list(tokenizer.encode(text))


def check_token_ids(ids: list[int], vocab_size: int, param: str) -> None:
    for i, tok in enumerate(ids):
        if tok < 0 or tok >= vocab_size:
            raise bad_request(
                f"'{param}[{i}]' = {tok} is out of range [0, {vocab_size})",
                param=param,
                code="token_id_out_of_range",
            )


def check_prompt(
    input_ids: list[int], max_new_tokens: int, limits: ModelLimits, param: str
) -> None:
    """Reject empty prompts, ids outside the vocabulary and prompts that overflow the context."""
    if not input_ids:
        raise bad_request("the prompt is empty", param=param, code="empty_prompt")
    check_token_ids(input_ids, limits.vocab_size, param)
    total = len(input_ids) + max_new_tokens
    if total > limits.context_len:
        raise bad_request(
            f"prompt ({len(input_ids)} tokens) + max new tokens ({max_new_tokens}) = {total} "
            f"exceeds the model's context length of {limits.context_len} tokens",
            param=param,
            code="context_length_exceeded",
        )


def checked_stop_strings(stop: str | list[str] | None, param: str) -> list[str]:
    """`stop` as a list; an empty stop string (it would match before any text) is a 400."""
    stops = [stop] if isinstance(stop, str) else list(stop or [])
    if any(s == "" for s in stops):
        raise bad_request("stop strings must be non-empty", param=param)
    if any(len(s) > MAX_STOP_CHARS for s in stops):
        raise bad_request(f"a stop string is at most {MAX_STOP_CHARS} characters", param=param,
                          code="stop_too_long")
    return stops


def default_max_tokens(prompt_len: int, limits: ModelLimits, param: str) -> int:
    """OpenAI chat semantics: no `max_tokens` means 'up to the end of the context'."""
    room = limits.context_len - prompt_len
    if room < 1:
        raise bad_request(
            f"prompt ({prompt_len} tokens) leaves no room in the model's context length of "
            f"{limits.context_len} tokens",
            param=param,
            code="context_length_exceeded",
        )
    return room


# --------------------------------------------------------------------------- /generate
# SGLang's native /generate request and answer: pdcache.wire.generate_api

_STRICT = ConfigDict(strict=True, extra="forbid", allow_inf_nan=False)
TokenIds = list[int]
Seed = Annotated[int, Field(ge=0, lt=SEED_LIMIT)]
# Strings a server keeps per request or per session (router and node session maps, radix
# roots) or scans per streamed token: bounded, or one client's 1 MiB ids took gigabytes and
# its 32k-character stop strings 0.4 s of the event loop per token.
SessionId = Annotated[str, Field(max_length=256)]
CacheSalt = Annotated[str, Field(max_length=256)]
MAX_STOP_CHARS = 1024  # checked_stop_strings
Stop = str | Annotated[list[str], Field(max_length=16)]


# --------------------------------------------------------------------------- OpenAI


class StreamOptions(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")

    include_usage: bool = False


class TextPart(BaseModel):
    model_config = _STRICT

    type: Literal["text"]
    text: str


class ToolCallFunction(BaseModel):
    model_config = _STRICT

    name: str = Field(min_length=1, max_length=256)
    arguments: str  # JSON text of an object (OpenAI's shape)


class AssistantToolCall(BaseModel):
    """A call an earlier assistant turn made (`messages[i].tool_calls[j]`)."""

    model_config = _STRICT

    id: str = Field(min_length=1, max_length=256)
    type: Literal["function"] = "function"
    function: ToolCallFunction

    def template_call(self) -> dict[str, Any]:
        """The call as chat templates read it: HF templates (Qwen's `tojson`) want the
        arguments as an object, so JSON text that parses to one is handed over parsed."""
        try:
            args: Any = json.loads(self.function.arguments)
        except json.JSONDecodeError:
            args = self.function.arguments
        if not isinstance(args, dict):
            args = self.function.arguments
        return {"id": self.id, "type": "function",
                "function": {"name": self.function.name, "arguments": args}}


class ChatMessage(BaseModel):
    model_config = _STRICT

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[AssistantToolCall] | None = None  # assistant turns only
    tool_call_id: str | None = None  # tool turns only: the call this answers
    # assistant turns only: the thinking the answer's `reasoning_content` returned, sent back
    # so the turn re-renders as it was produced (pdcache.wire.reasoning)
    reasoning_content: str | None = None
    # the rest of an OpenAI assistant message, as SDKs send a returned one back
    # (`message.model_dump()`): `refusal` is what the assistant said instead of an answer
    # (its text when `content` is empty); `annotations` (url citations of text already in
    # `content`) do not change the prompt; `audio` and the deprecated `function_call` are
    # refused unless null (`check`)
    refusal: str | None = None
    annotations: list[dict[str, Any]] | None = None
    audio: dict[str, Any] | None = None
    function_call: dict[str, Any] | None = None

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(part.text for part in self.content)
        return self.content or self.refusal or ""

    def check(self, i: int) -> None:
        self._check_openai_assistant_fields(i)
        if self.tool_calls is not None and self.role != "assistant":
            raise bad_request("only assistant messages carry 'tool_calls'",
                              param=f"messages[{i}].tool_calls", code="invalid_message")
        if self.role == "tool" and not self.tool_call_id:
            raise bad_request("a 'tool' message needs 'tool_call_id'",
                              param=f"messages[{i}].tool_call_id", code="invalid_message")
        if self.tool_call_id is not None and self.role != "tool":
            raise bad_request("only tool messages carry 'tool_call_id'",
                              param=f"messages[{i}].tool_call_id", code="invalid_message")
        if self.reasoning_content is not None and self.role != "assistant":
            raise bad_request("only assistant messages carry 'reasoning_content'",
                              param=f"messages[{i}].reasoning_content", code="invalid_message")

    def _check_openai_assistant_fields(self, i: int) -> None:
        given = [name for name in ("refusal", "annotations", "audio", "function_call")
                 if getattr(self, name) is not None]
        for name in given:
            if self.role != "assistant":
                raise bad_request(f"only assistant messages carry '{name}'",
                                  param=f"messages[{i}].{name}", code="invalid_message")
        if self.audio is not None:
            raise unsupported(f"messages[{i}].audio", "audio messages are not supported")
        if self.function_call is not None:
            raise unsupported(f"messages[{i}].function_call",
                              "'function_call' (OpenAI's deprecated functions API) is not "
                              "supported: send the call in 'tool_calls' and its result as a "
                              "'tool' message")

    def template_message(self) -> dict[str, Any]:
        message: dict[str, Any] = {"role": self.role, "content": self.text()}
        if self.tool_calls:
            message["content"] = self.text() or None
            message["tool_calls"] = [call.template_call() for call in self.tool_calls]
        if self.tool_call_id is not None:
            message["tool_call_id"] = self.tool_call_id
        if self.name is not None:
            message["name"] = self.name
        if self.reasoning_content is not None:
            message["reasoning_content"] = self.reasoning_content
        return message


class FunctionDefinition(BaseModel):
    model_config = _STRICT

    name: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.\-]+$")
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema of the arguments object
    strict: bool | None = None


class ToolDefinition(BaseModel):
    model_config = _STRICT

    type: Literal["function"]
    function: FunctionDefinition

    def template_tool(self) -> dict[str, Any]:
        return {"type": "function", "function": self.function.model_dump(exclude_none=True)}


class NamedFunction(BaseModel):
    model_config = _STRICT

    name: str


class NamedToolChoice(BaseModel):
    model_config = _STRICT

    type: Literal["function"]
    function: NamedFunction


class JsonSchemaFormat(BaseModel):
    model_config = _STRICT

    name: str = Field(min_length=1, max_length=64)
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(BaseModel):
    model_config = _STRICT

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    def check(self) -> None:
        if (self.type == "json_schema") != (self.json_schema is not None):
            raise bad_request("'response_format.json_schema' is given with (and only with) "
                              "type 'json_schema'", param="response_format.json_schema",
                              code="invalid_response_format")

    def schema(self) -> dict[str, Any] | None:
        """The JSON schema output must follow; `{}` (any JSON object) for json_object, None
        for text."""
        if self.type == "text":
            return None
        if self.type == "json_object":
            return {"type": "object"}
        assert self.json_schema is not None
        return self.json_schema.schema_ or {}


MAX_N = 16  # choices per request: each is one engine request
MAX_TOP_LOGPROBS = 20  # OpenAI's limit for chat


class OpenAIRequestBase(BaseModel):
    """Fields shared by chat and text completions, plus pdcache extensions.

    Unknown fields are rejected (as OpenAI does); fields OpenAI defines but pdcache does not
    implement are accepted only at their neutral value, so nothing is silently ignored.
    """

    model_config = _STRICT

    model: str | None = None
    temperature: float = Field(default=1.0, ge=0.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    seed: Seed | None = None
    stop: Stop | None = None
    n: int = Field(default=1, ge=1, le=MAX_N)
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    presence_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
    logit_bias: dict[str, float] | None = None
    # pdcache / SGLang extensions
    top_k: int = -1
    stop_token_ids: TokenIds = Field(default_factory=list)
    ignore_eos: bool = False
    session_id: SessionId | None = None
    cache_salt: CacheSalt | None = None

    @model_validator(mode="before")
    @classmethod
    def _drop_nulls(cls, data: Any) -> Any:
        # OpenAI's spec lets every optional field be null, meaning "not given" (the SDKs and
        # agent frameworks send e.g. temperature=None); a required field or an unknown one
        # keeps its null, so it is still refused
        if not isinstance(data, dict):
            return data
        fields = cls.model_fields
        return {k: v for k, v in data.items()
                if v is not None or k not in fields or fields[k].is_required()}

    def check_supported(self) -> None:
        if self.logit_bias:
            raise unsupported("logit_bias", "'logit_bias' is not supported")
        if self.stream_options is not None and not self.stream:
            raise bad_request("'stream_options' needs 'stream': true", param="stream_options")
        self.stop_strings()  # refused here, before anything is submitted

    def stop_strings(self) -> list[str]:
        return checked_stop_strings(self.stop, "stop")

    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    def to_engine(self, max_new_tokens: int, index: int = 0) -> SamplingParams:
        """The engine's sampling of choice `index` (of `n`): a given seed is offset by the
        index, so seeded samples differ from each other and are each reproducible."""
        return SamplingParams(
            max_new_tokens=max_new_tokens,
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=self.top_k,
            seed=None if self.seed is None else (self.seed + index) % SEED_LIMIT,
            stop_token_ids=tuple(self.stop_token_ids),
            ignore_eos=self.ignore_eos,
            presence_penalty=self.presence_penalty or 0.0,
            frequency_penalty=self.frequency_penalty or 0.0,
        )

    def logprobs_top_n(self) -> int | None:
        """How many alternatives per token the request's logprobs want; None: no logprobs."""
        return None


def unsupported(param: str, message: str) -> ApiError:
    return bad_request(message, param=param, code="unsupported_parameter")


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice


class ChatCompletionRequest(OpenAIRequestBase):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(default=None, ge=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool | None = None
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)
    tools: list[ToolDefinition] | None = Field(default=None, max_length=128)
    tool_choice: ToolChoice | None = None
    parallel_tool_calls: bool | None = None
    response_format: ResponseFormat | None = None
    metadata: dict[str, str] | None = None
    store: bool | None = None
    # SGLang's: false leaves the deployment's reasoning parser off (thinking stays content)
    separate_reasoning: bool = True
    # extra chat-template variables (SGLang's and vLLM's): {"enable_thinking": false}
    chat_template_kwargs: dict[str, Any] | None = None

    def check_supported(self) -> None:
        super().check_supported()
        for i, message in enumerate(self.messages):
            message.check(i)
        if self.top_logprobs and not self.logprobs:
            raise bad_request("'top_logprobs' needs 'logprobs': true", param="top_logprobs",
                              code="invalid_logprobs")
        if self.response_format is not None:
            self.response_format.check()
        if self.tool_choice is not None and self.tool_choice != "none" and not self.tools:
            raise bad_request("'tool_choice' needs 'tools'", param="tool_choice",
                              code="invalid_tool_choice")
        name = self.named_tool()
        if name is not None and name not in self.tool_names():
            raise bad_request(f"'tool_choice' names the function {name!r}, which is not in "
                              "'tools'", param="tool_choice.function.name",
                              code="invalid_tool_choice")
        if self.forces_tool_call() and self.json_schema() is not None:
            raise bad_request("'response_format' json and a forced tool call ('tool_choice' "
                              "required or named) cannot both constrain the output",
                              param="response_format", code="unsupported_parameter")

    def requested_max_tokens(self) -> int | None:
        if self.max_completion_tokens is not None:
            return self.max_completion_tokens
        return self.max_tokens

    def template_messages(self) -> list[dict[str, Any]]:
        return [m.template_message() for m in self.messages]

    def template_tools(self) -> list[dict[str, Any]] | None:
        return [t.template_tool() for t in self.tools] if self.tools else None

    def template_kwargs(self) -> dict[str, Any] | None:
        """`chat_template_kwargs`, refused (400) where it would set what the server sets."""
        kwargs = self.chat_template_kwargs or None
        taken = sorted(RESERVED_TEMPLATE_VARIABLES & set(kwargs or {}))
        if taken:
            raise bad_request(f"chat_template_kwargs may not set {taken}: the server sets them",
                              param="chat_template_kwargs", code="invalid_value")
        return kwargs

    def tool_names(self) -> set[str]:
        return {t.function.name for t in self.tools or []}

    def tool_parameters(self) -> dict[str, dict[str, Any]]:
        """Each tool's arguments schema by name (`{}` when it gives none)."""
        return {t.function.name: t.function.parameters or {} for t in self.tools or []}

    def named_tool(self) -> str | None:
        choice = self.tool_choice
        return choice.function.name if isinstance(choice, NamedToolChoice) else None

    def parses_tool_calls(self) -> bool:
        """Whether the output is parsed for tool calls (tools given, tool_choice not none)."""
        return bool(self.tools) and self.tool_choice != "none"

    def forces_tool_call(self) -> bool:
        return bool(self.tools) and (self.tool_choice == "required"
                                     or self.named_tool() is not None)

    def forced_tools(self) -> list[ToolDefinition]:
        """The tools a forced call may use: the named one, or all for 'required'."""
        name = self.named_tool()
        return [t for t in self.tools or [] if name is None or t.function.name == name]

    def json_schema(self) -> dict[str, Any] | None:
        return None if self.response_format is None else self.response_format.schema()

    def logprobs_top_n(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None


class CompletionRequest(OpenAIRequestBase):
    prompt: str | TokenIds | list[str] | list[TokenIds]
    max_tokens: int = Field(default=16, ge=1)
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None
    logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)

    def check_supported(self) -> None:
        super().check_supported()
        if self.echo:
            raise unsupported("echo", "'echo' is not supported")
        if self.suffix:
            raise unsupported("suffix", "'suffix' is not supported")
        if self.best_of not in (None, 1, self.n):
            raise unsupported("best_of", "only best_of = n is supported")

    def logprobs_top_n(self) -> int | None:
        return self.logprobs

    def single_prompt(self) -> str | list[int]:
        """The one prompt of this request: a string or token ids (batches are rejected)."""
        prompt = self.prompt
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], str | list):
            if len(prompt) != 1:
                raise unsupported("prompt", "batched prompts are not supported; send one")
            prompt = prompt[0]
        return prompt  # type: ignore[return-value]
