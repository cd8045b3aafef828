"""Tool-call parsers: a model's text output → OpenAI `tool_calls` (docs/tools.md).

One parser per output format, picked per deployment like SGLang's `--tool-call-parser`
(`[server] tool_call_parser`, `--tool-call-parser`; `TOOL_CALL_PARSERS` is the registry):

- `hermes` (also `qwen`, `qwen25`): `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`
  blocks (Hermes, Qwen2.5/3, and pdcache's own byte-tokenizer template); text outside the
  blocks is the message content.
- `llama3`: Llama-3.1/3.2 JSON calls, `{"name": ..., "parameters": {...}}` (or `"arguments"`),
  several separated by `;`, either the whole output (it starts with `{`) or after
  `<|python_tag|>` (the text before it is content). The tag is a special token in Llama's
  vocabulary, so it is seen only where the output is decoded with special tokens kept.

A call is taken only when its JSON parses to an object with a string `name` that names one of
the request's tools and object arguments; anything else stays text (a malformed call is
content, never a 500). `ToolCallStream` is the streaming form and the only implementation:
the non-streaming answer is the same machine fed the whole text, so a streamed answer
reassembles to the non-streamed one exactly. Calls are released when complete (the block
closed, or the output ended): one delta with `id`, `type`, `function.name` and empty
arguments, then the arguments in chunks, as OpenAI streams them.
"""

from __future__ import annotations

import json
import uuid
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any, ClassVar

ARGUMENT_CHUNK_CHARS = 16  # streamed arguments come in pieces of this many characters


@dataclass(frozen=True)
class ToolCall:
    """One parsed call: OpenAI's `{"id", "type": "function", "function": {name, arguments}}`."""

    id: str
    name: str
    arguments: str  # JSON text of an object

    @staticmethod
    def new(name: str, arguments: dict[str, Any]) -> ToolCall:
        return ToolCall(
            f"call_{uuid.uuid4().hex[:24]}", name, json.dumps(arguments, ensure_ascii=False)
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
    arguments_key: ClassVar[str] = "arguments"  # the key a constrained call is written with

    def opens_at_start(self, text: str) -> bool:
        """Whether the output (stripped of leading space) is a call region without a marker."""
        return False

    @abstractmethod
    def parse_region(self, region: str) -> list[tuple[str, dict[str, Any]]] | None:
        """(name, arguments) of every call in one region's text; None when it is not calls."""

    @abstractmethod
    def wrap(self, call_json: str) -> tuple[str, str]:
        """Text around one call's JSON when the output is constrained to calls."""


def _call_of(obj: Any, keys: tuple[str, ...]) -> tuple[str, dict[str, Any]] | None:
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args: Any = next((obj[k] for k in keys if k in obj), {})
    if isinstance(args, str):  # some models write the arguments as JSON text
        try:
            args = json.loads(args)
        except json.JSONDecodeError:
            return None
    return (obj["name"], args) if isinstance(args, dict) else None


class HermesFormat(ToolCallFormat):
    name = "hermes"
    start = "<tool_call>"
    end = "</tool_call>"

    def parse_region(self, region: str) -> list[tuple[str, dict[str, Any]]] | None:
        try:
            obj = json.loads(region)
        except json.JSONDecodeError:
            return None
        objs = obj if isinstance(obj, list) else [obj]
        calls = [_call_of(o, ("arguments", "parameters")) for o in objs]
        return None if not calls or any(c is None for c in calls) else calls  # type: ignore[return-value]

    def wrap(self, call_json: str) -> tuple[str, str]:
        return "<tool_call>\n", "\n</tool_call>"


class Llama3Format(ToolCallFormat):
    name = "llama3"
    start = "<|python_tag|>"
    end = None
    arguments_key = "parameters"

    def opens_at_start(self, text: str) -> bool:
        return text.lstrip().startswith("{")

    def parse_region(self, region: str) -> list[tuple[str, dict[str, Any]]] | None:
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

    def wrap(self, call_json: str) -> tuple[str, str]:
        return "", ""


TOOL_CALL_PARSERS: dict[str, type[ToolCallFormat]] = {
    "hermes": HermesFormat,
    "qwen": HermesFormat,
    "qwen25": HermesFormat,
    "llama3": Llama3Format,
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


class ToolCallStream:
    """Incremental parse of one output: `feed` text pieces, then `finish`.

    Content is released as soon as it cannot be the start of a call marker; whitespace that
    only separates content from a call (or ends the output) is dropped. A call region is held
    until it closes; it becomes calls if it parses, else its text becomes content."""

    def __init__(
        self, fmt: ToolCallFormat, tool_names: set[str], max_calls: int | None = None
    ) -> None:
        self.fmt = fmt
        self.tool_names = tool_names
        self.max_calls = max_calls  # `parallel_tool_calls: false`: 1; later calls are dropped
        self._pending = ""  # text not yet classified
        self._region: str | None = None  # the open call region's text (after the marker)
        self._seen_text = False  # non-space output seen (the marker-less start is over)
        self._space = ""  # held whitespace between content and what follows
        self._opened_bare = False  # the open region started without a marker (llama3 `{`)
        self.calls: list[ToolCall] = []
        self.content_parts: list[str] = []

    def feed(self, text: str) -> ParsedDelta:
        self._pending += text
        out = ParsedDelta()
        self._advance(out, final=False)
        return out

    def finish(self) -> ParsedDelta:
        out = ParsedDelta()
        self._advance(out, final=True)
        if self._region is not None:  # the output ended inside a region
            self._close_region(out, self._region, closed=self.fmt.end is None)
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
                self._close_region(out, region, closed=True)
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
                self._content(out, self._pending[:cut], final=True)
                self._pending = self._pending[cut + len(fmt.start) :]
                self._region = ""
                self._opened_bare = False
                continue
            keep = 0 if final else _partial_suffix(self._pending, fmt.start)
            self._content(out, self._pending[: len(self._pending) - keep], final=False)
            self._pending = self._pending[len(self._pending) - keep :]
            return

    def _close_region(self, out: ParsedDelta, region: str, closed: bool) -> None:
        calls = self.fmt.parse_region(region) if closed else None
        if calls is None or any(name not in self.tool_names for name, _ in calls):
            marker = "" if self._opened_bare else self.fmt.start
            tail = self.fmt.end if closed and self.fmt.end is not None else ""
            self._content(out, marker + region + tail, final=False)
            return
        self._space = ""  # whitespace before a call is not content
        for name, args in calls:
            if self.max_calls is not None and len(self.calls) >= self.max_calls:
                return
            call = ToolCall.new(name, args)
            self.calls.append(call)
            out.calls.append(call)

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
    fmt: ToolCallFormat, text: str, tool_names: set[str]
) -> tuple[str | None, list[ToolCall]]:
    """The content and calls of a whole output (the streaming machine, fed at once)."""
    stream = ToolCallStream(fmt, tool_names)
    stream.feed(text)
    stream.finish()
    return stream.content, stream.calls
