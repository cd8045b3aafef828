"""Tool-call parsers: a model's text output → OpenAI `tool_calls` (docs/tools.md).

One parser per output format, picked per deployment like SGLang's `--tool-call-parser`
(`[[node]]` / `[router] tool_call_parser`, `--tool-call-parser`; `TOOL_CALL_PARSERS` is the
registry):

- `hermes` (also `qwen`, `qwen25`): `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`
  blocks (Hermes, Qwen2.5/3, and pdcache's own byte-tokenizer template); text outside the
  blocks is the message content.
- `llama3`: Llama-3.1/3.2 JSON calls, `{"name": ..., "parameters": {...}}` (or `"arguments"`),
  several separated by `;`, either the whole output (it starts with `{`) or after
  `<|python_tag|>` (the text before it is content). The tag is a special token in Llama's
  vocabulary, so it is seen only where the output is decoded with special tokens kept.
- `deepseekv3`: DeepSeek-V3/R1, `<｜tool▁calls▁begin｜>` then per call
  `<｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME\n```json\nARGS\n```<｜tool▁call▁end｜>`, then
  `<｜tool▁calls▁end｜>`.
- `kimi_k2`: Kimi K2, `<|tool_calls_section_begin|>` then per call
  `<|tool_call_begin|>functions.NAME:IDX<|tool_call_argument_begin|>ARGS<|tool_call_end|>`,
  then `<|tool_calls_section_end|>`; the call's id is the model's `functions.NAME:IDX` (Kimi's
  template writes the id back into the next turn's prompt).
- `qwen3_coder`: Qwen3-Coder, `<tool_call>` blocks of
  `<function=NAME><parameter=P>VALUE</parameter>...</function>`; each VALUE is text, converted
  by the type its tool's JSON schema gives P (integer, number, boolean, object/array as JSON,
  else kept as the string).
- `gpt-oss`: gpt-oss's harmony messages (`pdcache.wire.harmony`): a call is a message with
  a recipient, `<|channel|>commentary to=functions.NAME <|constrain|>json<|message|>ARGS
  <|call|>` (the recipient may also follow the role: `<|start|>assistant to=functions.NAME
  <|channel|>commentary json<|message|>`); `<|call|>` may be missing (the decoder drops it
  as an end-of-sequence token). The content is the `final` bodies and `commentary`
  preambles, as written; `analysis` is left out (the `gpt-oss` reasoning parser shows it).
  The arguments are the model's own JSON text (an object); sent back, the server hands the
  template the object, which the harmony template writes as compact JSON, gpt-oss's form
  (pdcache.engine.harmony.call_arguments).

A call is taken only when it parses to a `name` that names one of the request's tools and
object arguments; anything else stays text (a malformed call is content, never a 500).
`ToolCallStream` is the streaming form and the only implementation: the non-streaming answer
is the same machine fed the whole text, so a streamed answer reassembles to the non-streamed
one exactly. Calls are released when complete (the block
closed, or the output ended): one delta with `id`, `type`, `function.name` and empty
arguments, then the arguments in chunks, as OpenAI streams them.
"""

from __future__ import annotations

import ast
import json
import math
import re
import uuid
import warnings
from abc import ABC, abstractmethod
from collections.abc import Collection, Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar

from pdcache.wire.harmony import HarmonyEvent, HarmonyReader, function_name

ARGUMENT_CHUNK_CHARS = 16  # streamed arguments come in pieces of this many characters

# a request's tools as the parsers see them: name -> the JSON schema of its arguments
ToolSchemas = Mapping[str, Mapping[str, Any]]


@dataclass(frozen=True)
class ToolCall:
    """One parsed call: OpenAI's `{"id", "type": "function", "function": {name, arguments}}`."""

    id: str
    name: str
    arguments: str  # JSON text of an object

    @staticmethod
    def new(name: str, arguments: dict[str, Any], call_id: str | None = None) -> ToolCall:
        return ToolCall(
            call_id or f"call_{uuid.uuid4().hex[:24]}",
            name,
            json.dumps(arguments, ensure_ascii=False),
        )

    def body(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "type": "function",
            "function": {"name": self.name, "arguments": self.arguments},
        }

    def stream_deltas(self, index: int) -> list[dict[str, Any]]:
        """OpenAI's `delta.tool_calls` entries for this call: the head, then argument chunks."""
        head = {
            "index": index,
            "id": self.id,
            "type": "function",
            "function": {"name": self.name, "arguments": ""},
        }
        args = self.arguments
        chunks = [
            args[i : i + ARGUMENT_CHUNK_CHARS] for i in range(0, len(args), ARGUMENT_CHUNK_CHARS)
        ]
        return [head, *({"index": index, "function": {"arguments": c}} for c in chunks)]


@dataclass(frozen=True)
class RegionCall:
    """One call read from a call region, before the request's tools are checked."""

    name: str
    arguments: dict[str, Any]
    call_id: str | None = None  # the model's own id (kimi_k2); None: pdcache makes one


@dataclass
class ParsedDelta:
    """What one piece of output added: content text and completed calls."""

    content: str = ""
    calls: list[ToolCall] = field(default_factory=list)


class ToolCallFormat(ABC):
    """A format: where a call region starts and ends, and how its text becomes calls."""

    name: ClassVar[str]
    start: ClassVar[str]  # the marker that opens a call region
    end: ClassVar[str | None]  # the marker that closes it; None: the end of the output
    # the region may also end with the output: each call inside has its own end marker, so a
    # complete call is recognisable without the region's
    end_optional: ClassVar[bool] = False
    # the markers are special tokens in the model's vocabulary: decode with them kept
    keeps_special_tokens: ClassVar[bool] = False
    # a constrained (forced) call can be written as wrap(one JSON call); otherwise the
    # constrained output is the bare JSON call (`BareJsonCallFormat`)
    json_calls: ClassVar[bool] = True
    arguments_key: ClassVar[str] = "arguments"  # the key a constrained call is written with
    # the output is harmony messages, read by `HarmonyReader` (no call regions)
    harmony: ClassVar[bool] = False

    def opens_at_start(self, text: str) -> bool:
        """Whether the output (stripped of leading space) is a call region without a marker."""
        return False

    @abstractmethod
    def parse_region(self, region: str, tools: ToolSchemas) -> list[RegionCall] | None:
        """Every call in one region's text; None when it is not calls."""

    def wrap(self, call_json: str) -> tuple[str, str]:
        """Text around one call's JSON when the output is constrained to calls."""
        return "", ""

    def harmony_call(self, event: HarmonyEvent) -> ToolCall | None:
        """The call of a harmony call message (`harmony` formats); None: it is none."""
        return None


def _call_of(obj: Any, keys: tuple[str, ...]) -> RegionCall | None:
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = _arguments(next((obj[k] for k in keys if k in obj), {}))
    return None if args is None else RegionCall(obj["name"], args)


def _arguments(value: Any) -> dict[str, Any] | None:
    """Call arguments as an object: an object, or JSON text of one (some models write the
    arguments as a string); None otherwise."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError:
            return None
    return value if isinstance(value, dict) else None


def _all_or_none(calls: list[RegionCall | None]) -> list[RegionCall] | None:
    if not calls or any(c is None for c in calls):
        return None
    return calls  # type: ignore[return-value]


class HermesFormat(ToolCallFormat):
    name = "hermes"
    start = "<tool_call>"
    end = "</tool_call>"

    def parse_region(self, region: str, tools: ToolSchemas) -> list[RegionCall] | None:
        try:
            obj = json.loads(region)
        except json.JSONDecodeError:
            return None
        objs = obj if isinstance(obj, list) else [obj]
        return _all_or_none([_call_of(o, ("arguments", "parameters")) for o in objs])

    def wrap(self, call_json: str) -> tuple[str, str]:
        return "<tool_call>\n", "\n</tool_call>"


class Llama3Format(ToolCallFormat):
    name = "llama3"
    start = "<|python_tag|>"
    end = None
    arguments_key = "parameters"

    def opens_at_start(self, text: str) -> bool:
        return text.lstrip().startswith("{")

    def parse_region(self, region: str, tools: ToolSchemas) -> list[RegionCall] | None:
        decoder, calls, idx = json.JSONDecoder(), [], 0
        text = region.strip()
        while idx < len(text):
            try:
                obj, end = decoder.raw_decode(text, idx)
            except json.JSONDecodeError:
                return None
            call = _call_of(obj, ("parameters", "arguments"))
            if call is None:
                return None
            calls.append(call)
            idx = end
            while idx < len(text) and text[idx] in " \t\r\n;":
                idx += 1
        return calls or None


class BareJsonCallFormat(Llama3Format):
    """The constrained output of a forced call in a format whose calls are no JSON object
    (`json_calls` False): `{"name": N, "arguments": {...}}` alone. Not a deployment's choice."""

    name = "json"
    arguments_key = "arguments"


def _match_all(pattern: re.Pattern[str], region: str) -> list[re.Match[str]] | None:
    """Consecutive matches of `pattern` covering `region` but for trailing whitespace; None
    when anything else is in it (then the region is not calls)."""
    matches, pos = [], 0
    while region[pos:].strip():
        found = pattern.match(region, pos)
        if found is None:
            return None
        matches.append(found)
        pos = found.end()
    return matches


class DeepSeekV3Format(ToolCallFormat):
    """DeepSeek-V3/R1's calls (SGLang's `deepseekv3`)."""

    name = "deepseekv3"
    start = "<｜tool▁calls▁begin｜>"
    end = "<｜tool▁calls▁end｜>"
    end_optional = True
    keeps_special_tokens = True
    json_calls = False
    CALL: ClassVar[re.Pattern[str]] = re.compile(
        r"\s*<｜tool▁call▁begin｜>[^<\n]*<｜tool▁sep｜>(?P<name>[^<\n]+?)[ \t]*\n```json\n"
        r"(?P<args>.*?)\n```\s*<｜tool▁call▁end｜>",
        re.DOTALL,
    )

    def parse_region(self, region: str, tools: ToolSchemas) -> list[RegionCall] | None:
        matches = _match_all(self.CALL, region)
        if not matches:
            return None
        return _all_or_none([_named_call(m["name"].strip(), m["args"]) for m in matches])


def _named_call(name: str, args_text: str, call_id: str | None = None) -> RegionCall | None:
    args = _arguments(args_text)
    return None if args is None else RegionCall(name, args, call_id)


class KimiK2Format(ToolCallFormat):
    """Kimi K2's calls (SGLang's `kimi_k2`). A call is taken only when its id names the
    function (`functions.NAME:IDX` or `NAME:IDX`); a bare counter names none."""

    name = "kimi_k2"
    start = "<|tool_calls_section_begin|>"
    end = "<|tool_calls_section_end|>"
    end_optional = True
    keeps_special_tokens = True
    json_calls = False
    CALL: ClassVar[re.Pattern[str]] = re.compile(
        r"\s*<\|tool_call_begin\|>\s*(?P<id>[^\s<|]+)\s*<\|tool_call_argument_begin\|>"
        r"(?P<args>.*?)<\|tool_call_end\|>",
        re.DOTALL,
    )
    CALL_ID: ClassVar[re.Pattern[str]] = re.compile(r"(?:functions\.)?(?P<name>[\w.\-]+):\d+")

    def parse_region(self, region: str, tools: ToolSchemas) -> list[RegionCall] | None:
        matches = _match_all(self.CALL, region)
        if not matches:
            return None
        calls: list[RegionCall | None] = []
        for found in matches:
            named = self.CALL_ID.fullmatch(found["id"])
            if named is None:
                return None
            calls.append(_named_call(named["name"], found["args"], found["id"]))
        return _all_or_none(calls)


class Qwen3CoderFormat(ToolCallFormat):
    """Qwen3-Coder's XML-ish calls (SGLang's `qwen3_coder`). A parameter's value ends at its
    `</parameter>`, or (as SGLang reads a missing close) at the next `<parameter=` or at the
    function's end; one newline on each side of it is the layout, not the value."""

    name = "qwen3_coder"
    start = "<tool_call>"
    end = "</tool_call>"
    json_calls = False
    FUNCTION: ClassVar[re.Pattern[str]] = re.compile(
        r"\s*<function=(?P<name>[^>\n]+)>(?P<body>.*?)</function>", re.DOTALL
    )
    PARAMETER: ClassVar[re.Pattern[str]] = re.compile(
        r"\s*<parameter=(?P<name>[^>\n]+)>(?P<value>.*?)(?:</parameter>|(?=<parameter=)|\Z)",
        re.DOTALL,
    )

    def parse_region(self, region: str, tools: ToolSchemas) -> list[RegionCall] | None:
        functions = _match_all(self.FUNCTION, region)
        if not functions:
            return None
        calls: list[RegionCall | None] = []
        for function in functions:
            name = function["name"].strip()
            params = _match_all(self.PARAMETER, function["body"])
            if params is None:
                return None
            calls.append(RegionCall(name, _typed_arguments(params, tools.get(name, {}))))
        return _all_or_none(calls)


class GptOssFormat(ToolCallFormat):
    """gpt-oss's harmony calls (SGLang's `gpt-oss`): `ToolCallStream` reads the output with a
    `HarmonyReader`; `parse_region` reads one call message's body."""

    name = "gpt-oss"
    start = "<|channel|>"
    end = "<|call|>"
    end_optional = True
    keeps_special_tokens = True
    json_calls = False
    harmony = True

    def parse_region(self, region: str, tools: ToolSchemas) -> list[RegionCall] | None:
        """Unused: harmony output has no call regions (`harmony_call` reads a message)."""
        return None

    def harmony_call(self, event: HarmonyEvent) -> ToolCall | None:
        """The call of a call message: its recipient's function and the arguments text (an
        object, or empty: no arguments), kept as written; None when it is no such call."""
        name = function_name(event.recipient)
        text = event.text.strip()
        if not name or (text and _arguments(text) is None):
            return None
        return ToolCall(f"call_{uuid.uuid4().hex[:24]}", name, event.text if text else "{}")


def _typed_arguments(params: list[re.Match[str]], schema: Mapping[str, Any]) -> dict[str, Any]:
    properties = schema_properties(schema)
    arguments: dict[str, Any] = {}
    for param in params:
        value = param["value"]
        value = value[1:] if value.startswith("\n") else value
        value = value[:-1] if value.endswith("\n") else value
        name = param["name"].strip()
        arguments[name] = converted_value(value, properties.get(name))
    return arguments


def schema_properties(schema: Any) -> dict[str, Any]:
    """The top-level `properties` of an arguments schema; without them, those of its
    `anyOf`/`oneOf`/`allOf` branches (first wins), as SGLang reads them."""
    if not isinstance(schema, Mapping):
        return {}
    properties = schema.get("properties")
    if isinstance(properties, Mapping):
        return dict(properties)
    merged: dict[str, Any] = {}
    for keyword in ("anyOf", "oneOf", "allOf"):
        for branch in schema.get(keyword) or []:
            for key, value in schema_properties(branch).items():
                merged.setdefault(key, value)
    return merged


def schema_type(schema: Any) -> str | None:
    """The primary JSON type a property schema gives (SGLang's `infer_type_from_json_schema`):
    `type` (the first non-null of a list), one type shared by `anyOf`/`oneOf` branches (string
    when they differ), the type of `enum` values, a typed `allOf` branch, `properties` →
    object, `items` → array; None when it says nothing."""
    if not isinstance(schema, Mapping):
        return None
    declared = schema.get("type")
    if isinstance(declared, str):
        return declared
    if isinstance(declared, list) and declared:
        return next((t for t in declared if t != "null"), "string")
    branches = schema.get("anyOf") or schema.get("oneOf")
    if isinstance(branches, list):
        found = _branch_types(branches)
        if found:
            return found
    if isinstance(schema.get("enum"), list):
        kinds = {_json_kind(v) for v in schema["enum"]}
        return kinds.pop() if len(kinds) == 1 else "string"
    if isinstance(schema.get("allOf"), list):
        typed = [t for t in map(schema_type, schema["allOf"]) if t and t != "string"]
        return typed[0] if typed else "string"
    if "properties" in schema:
        return "object"
    return "array" if "items" in schema else None


def _branch_types(branches: list[Any]) -> str | None:
    types = [t for t in map(schema_type, branches) if t]
    distinct = set(types)
    if not types:
        return None
    if len(distinct) == 1:
        return types[0]
    if len(distinct) == 2 and "null" in distinct:
        return next(t for t in types if t != "null")
    return "string" if "string" in distinct else types[0]


def _json_kind(value: Any) -> str:
    kinds: list[tuple[type | tuple[type, ...], str]] = [
        (bool, "boolean"), (int, "integer"), (float, "number"), (str, "string"),
        (list, "array"), (dict, "object"),
    ]
    if value is None:
        return "null"
    return next((kind for cls, kind in kinds if isinstance(value, cls)), "string")


def converted_value(text: str, property_schema: Any) -> Any:
    """A qwen3_coder parameter's text as its schema's type, as SGLang converts it: `null` is
    None; a parameter the schema does not describe, or a string type, stays text; integer /
    number / boolean parse (a failed number stays text, a non-`true` boolean is false);
    object / array (and types the schema leaves open) parse as JSON, then as a Python
    literal, and stay text when neither reads."""
    if text.lower() == "null":
        return None
    if property_schema is None:
        return text
    kind = (schema_type(property_schema) or "string").strip().lower()
    if kind in ("string", "str", "text", "varchar", "char", "enum"):
        return text
    if kind.startswith(("int", "uint", "long", "short", "unsigned")):
        return _or_text(text, int)
    if kind.startswith(("num", "float")):
        return _number(text)
    if kind in ("boolean", "bool", "binary"):
        return text.lower() == "true"
    if kind in ("object", "array", "arr") or kind.startswith(("dict", "list")):
        try:
            return json.loads(text)
        except json.JSONDecodeError:
            pass
    return _literal(text)


def _or_text(text: str, parse: Any) -> Any:
    try:
        return parse(text)
    except ValueError:
        return text


def _number(text: str) -> Any:
    value = _or_text(text, float)
    if isinstance(value, float) and not math.isfinite(value):
        return text  # nan / inf are no JSON numbers
    whole = isinstance(value, float) and value.is_integer()
    # "3" is the integer 3, "3.0" / "3e0" stay floats, as SGLang writes them
    return int(value) if whole and "." not in text and "e" not in text.lower() else value


def _literal(text: str) -> Any:
    """`text` as a Python literal (SGLang's fallback) when that is JSON-able, else the text."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # invalid escapes in model text are not our news
            value = ast.literal_eval(text)
        # through JSON and back: tuples become lists, and what JSON cannot hold is refused
        return json.loads(json.dumps(value))
    except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
        return text


TOOL_CALL_PARSERS: dict[str, type[ToolCallFormat]] = {
    "hermes": HermesFormat,
    "qwen": HermesFormat,
    "qwen25": HermesFormat,
    "llama3": Llama3Format,
    "deepseekv3": DeepSeekV3Format,
    "kimi_k2": KimiK2Format,
    "qwen3_coder": Qwen3CoderFormat,
    "gpt-oss": GptOssFormat,
}
DEFAULT_TOOL_CALL_PARSER = "hermes"  # the format of pdcache's own chat template


def tool_call_format(name: str) -> ToolCallFormat:
    """The registered format called `name`; ValueError naming the choices otherwise."""
    try:
        return TOOL_CALL_PARSERS[name]()
    except KeyError:
        raise ValueError(
            f"unknown tool-call parser {name!r}; choose one of "
            f"{', '.join(sorted(TOOL_CALL_PARSERS))}"
        ) from None


def forced_call_format(fmt: ToolCallFormat) -> ToolCallFormat:
    """The format a forced (constrained) call is written and parsed in."""
    return fmt if fmt.json_calls else BareJsonCallFormat()


def tool_schemas(tools: ToolSchemas | Collection[str]) -> ToolSchemas:
    """`tools` as name -> arguments schema; a bare collection of names has empty schemas."""
    if isinstance(tools, Mapping):
        return tools
    return {name: {} for name in tools}


class ToolCallStream:
    """Incremental parse of one output: `feed` text pieces, then `finish`.

    Content is released as soon as it cannot be the start of a call marker; whitespace that
    only separates content from a call (or ends the output) is dropped. A call region is held
    until it closes; it becomes calls if it parses, else its text becomes content."""

    def __init__(
        self,
        fmt: ToolCallFormat,
        tools: ToolSchemas | Collection[str],
        max_calls: int | None = None,
    ) -> None:
        self.fmt = fmt
        self.tools = tool_schemas(tools)
        self.max_calls = max_calls  # `parallel_tool_calls: false`: 1; later calls are dropped
        self._pending = ""  # text not yet classified
        self._region: str | None = None  # the open call region's text (after the marker)
        self._seen_text = False  # non-space output seen (the marker-less start is over)
        self._space = ""  # held whitespace between content and what follows
        self._opened_bare = False  # the open region started without a marker (llama3 `{`)
        self.calls: list[ToolCall] = []
        self.content_parts: list[str] = []
        self._harmony = HarmonyReader() if fmt.harmony else None

    def feed(self, text: str) -> ParsedDelta:
        if self._harmony is not None:
            return self._harmony_delta(self._harmony.feed(text))
        self._pending += text
        out = ParsedDelta()
        self._advance(out, final=False)
        return out

    def finish(self) -> ParsedDelta:
        if self._harmony is not None:
            return self._harmony_delta(self._harmony.finish())
        out = ParsedDelta()
        self._advance(out, final=True)
        if self._region is not None:  # the output ended inside a region
            readable = self.fmt.end is None or self.fmt.end_optional
            # what is still pending is the start of an end marker the output never finished
            self._close_region(out, self._region, closed=False, readable=readable,
                               held=self._pending)
        elif self._pending:
            self._content(out, self._pending, final=True)
        self._pending = ""
        return out

    @property
    def content(self) -> str | None:
        text = "".join(self.content_parts)
        return text if text or not self.calls else None

    def _advance(self, out: ParsedDelta, final: bool) -> None:
        fmt = self.fmt
        while self._pending:
            if self._region is not None:
                if fmt.end is None:
                    self._region += self._pending
                    self._pending = ""
                    return
                cut = self._pending.find(fmt.end)
                if cut < 0:
                    keep = _partial_suffix(self._pending, fmt.end)
                    self._region += self._pending[: len(self._pending) - keep]
                    self._pending = self._pending[len(self._pending) - keep :]
                    return
                region, self._pending = (
                    self._region + self._pending[:cut],
                    self._pending[cut + len(fmt.end) :],
                )
                self._region = None
                self._close_region(out, region, closed=True, readable=True)
                continue
            if not self._seen_text:
                stripped = self._pending.lstrip()
                if not stripped:
                    return
                self._seen_text = True
                if fmt.opens_at_start(stripped):
                    self._region, self._pending = "", stripped
                    self._opened_bare = True
                    continue
            cut = self._pending.find(fmt.start)
            if cut >= 0:
                # the space before the marker waits: dropped if the region is calls, content
                # if it is not (`_close_region`)
                self._content(out, self._pending[:cut], final=False)
                self._pending = self._pending[cut + len(fmt.start) :]
                self._region = ""
                self._opened_bare = False
                continue
            keep = 0 if final else _partial_suffix(self._pending, fmt.start)
            self._content(out, self._pending[: len(self._pending) - keep], final=False)
            self._pending = self._pending[len(self._pending) - keep :]
            return

    def _harmony_delta(self, events: list[HarmonyEvent]) -> ParsedDelta:
        """Harmony events as content and calls: shown text is content as written (its
        messages' ends are markers, not space); a call message that reads as a call of one
        of the request's tools is a call, any other is content, markers included."""
        out = ParsedDelta()
        for event in events:
            if event.kind == "answer":
                self._shown(out, event.text)
            elif event.kind == "call":
                self._harmony_call(out, event)
        return out

    def _harmony_call(self, out: ParsedDelta, event: HarmonyEvent) -> None:
        call = self.fmt.harmony_call(event)
        if call is None or call.name not in self.tools:
            self._shown(out, event.raw)
            return
        if self.max_calls is not None and len(self.calls) >= self.max_calls:
            return
        self.calls.append(call)
        out.calls.append(call)

    def _shown(self, out: ParsedDelta, text: str) -> None:
        if text:
            self.content_parts.append(text)
            out.content += text

    def _close_region(
        self, out: ParsedDelta, region: str, closed: bool, readable: bool, held: str = ""
    ) -> None:
        """End a region: its calls when it parses (`readable`: it may be read at all) and
        names only the request's tools; else its text, markers and `held` included, is
        content."""
        calls = self.fmt.parse_region(region, self.tools) if readable else None
        if calls is None or any(call.name not in self.tools for call in calls):
            marker = "" if self._opened_bare else self.fmt.start
            tail = self.fmt.end if closed and self.fmt.end is not None else held
            self._content(out, marker + region + tail, final=False)
            return
        self._space = ""  # whitespace before a call is not content
        for found in calls:
            if self.max_calls is not None and len(self.calls) >= self.max_calls:
                return
            call = ToolCall.new(found.name, found.arguments, self._unused(found.call_id))
            self.calls.append(call)
            out.calls.append(call)

    def _unused(self, call_id: str | None) -> str | None:
        """The model's call id unless an earlier call of this output has it (ids are unique
        per answer; a repeat gets a made one)."""
        return None if call_id in {call.id for call in self.calls} else call_id

    def _content(self, out: ParsedDelta, text: str, final: bool) -> None:
        """Release `text` as content, holding trailing whitespace until more content follows
        (`final`: what follows is a call region or the end, so that whitespace is dropped)."""
        if not text:
            return
        body = text.rstrip()
        if body:
            piece = self._space + body
            self._space = ""
            self.content_parts.append(piece)
            out.content += piece
        self._space += text[len(body) :]
        if final:
            self._space = ""


def _partial_suffix(text: str, marker: str) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of `marker`."""
    for k in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:k]):
            return k
    return 0


def parse_tool_calls(
    fmt: ToolCallFormat, text: str, tools: ToolSchemas | Collection[str]
) -> tuple[str | None, list[ToolCall]]:
    """The content and calls of a whole output (the streaming machine, fed at once)."""
    stream = ToolCallStream(fmt, tools)
    stream.feed(text)
    stream.finish()
    return stream.content, stream.calls
