"""OpenAI choices: one choice's text (and logprobs) → its `message` / `delta` bodies, with
the thinking split off (`reasoning_content`) and tool calls parsed out of the answer; and the
event stream of `n` choices (docs/design.md §4.1).

Shared by the unified server (which produces the text) and the router (which relays a node's
tokens), so both build byte-identical bodies. Pure: a `ChoiceOutput` holds one choice's parse
state and is used from one event loop.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from contextlib import aclosing
from dataclasses import dataclass, field
from typing import Any

from pdcache.engine.api import TokenLogprob
from pdcache.wire.reasoning import ReasoningFormat, ReasoningStream
from pdcache.wire.responses import ResponseHead, StreamEnd, sse
from pdcache.wire.tool_calls import ToolCallFormat, ToolCallStream, ToolSchemas

# one choice's own: the OpenAI `logprobs` object of the choice's next run of tokens, every
# value a per-position list; stateful (completions' `text_offset` goes on from the last run)
LogprobFormatter = Callable[[list[TokenLogprob]], dict[str, Any]]


@dataclass
class ChoiceDelta:
    """What one choice adds to a stream: thinking, content, finished tool calls, logprobs,
    the end."""

    index: int
    content: str = ""
    tool_calls: list[dict[str, Any]] = field(default_factory=list)
    logprobs: dict[str, Any] | None = None
    finish_reason: str | None = None
    reasoning: str = ""  # `delta.reasoning_content`

    def empty(self) -> bool:
        return not (
            self.content or self.reasoning or self.tool_calls or self.logprobs
            or self.finish_reason
        )


class ChoiceOutput:
    """One choice: text deltas (after stop strings) in, OpenAI bodies out.

    With a reasoning format the text is first split by `ReasoningStream` (thinking, then the
    answer); with a tool-call format the answer goes through `ToolCallStream` (content and
    completed calls); without, the answer is content as it is. Logprobs are formatted per
    delta by this choice's `format_logprobs` (None: the request asked for none), and the
    non-streaming body's are those deltas' joined."""

    def __init__(
        self,
        index: int,
        *,
        chat: bool,
        tool_format: ToolCallFormat | None = None,
        tools: ToolSchemas | None = None,
        max_calls: int | None = None,
        format_logprobs: LogprobFormatter | None = None,
        reasoning: ReasoningFormat | None = None,
    ) -> None:
        self.index = index
        self.chat = chat
        self.thinking = ReasoningStream(reasoning) if reasoning is not None else None
        self.tools = (
            ToolCallStream(tool_format, tools or {}, max_calls)
            if tool_format is not None
            else None
        )
        self.format_logprobs = format_logprobs
        self.text = ""  # all content released so far (no tool-call text)
        self._logprob_runs: list[dict[str, Any]] = []  # each delta's logprobs object
        self._call_count = 0

    def add(self, text: str, logprobs: list[TokenLogprob] | None = None) -> ChoiceDelta:
        reasoning, answer = "", text
        if self.thinking is not None:
            split = self.thinking.feed(text)
            reasoning, answer = split.reasoning, split.answer
        if self.tools is None:
            return self._delta(reasoning, answer, [], logprobs)
        parsed = self.tools.feed(answer)
        return self._delta(reasoning, parsed.content, parsed.calls, logprobs)

    def finish(self, engine_reason: str | None) -> ChoiceDelta:
        """The end of the output: what the parsers still held, and the finish reason."""
        reasoning, answer = "", ""
        if self.thinking is not None:
            split = self.thinking.finish()
            reasoning, answer = split.reasoning, split.answer
        if self.tools is None:
            delta = self._delta(reasoning, answer, [], None)
        else:
            parsed = self.tools.feed(answer)
            held = self.tools.finish()
            delta = self._delta(reasoning, parsed.content + held.content,
                                parsed.calls + held.calls, None)
        delta.finish_reason = self.finish_reason(engine_reason)
        return delta

    def finish_reason(self, engine_reason: str | None) -> str | None:
        if self.tools is not None and self.tools.calls and engine_reason == "stop":
            return "tool_calls"
        return engine_reason

    def _delta(
        self, reasoning: str, content: str, calls: list[Any], logprobs: list[TokenLogprob] | None
    ) -> ChoiceDelta:
        delta = ChoiceDelta(self.index, content, reasoning=reasoning)
        self.text += content
        for call in calls:
            delta.tool_calls.extend(call.stream_deltas(self._call_count))
            self._call_count += 1
        if logprobs and self.format_logprobs is not None:
            delta.logprobs = self.format_logprobs(logprobs)
            self._logprob_runs.append(delta.logprobs)
        return delta

    # ---- non-streaming bodies

    def _all_logprobs(self) -> dict[str, Any] | None:
        if self.format_logprobs is None:
            return None
        # joined, not formatted again: the formatter's text offsets went on past these runs
        whole = self.format_logprobs([])
        for run in self._logprob_runs:
            for key, positions in run.items():
                whole[key] = whole[key] + positions
        return whole

    def body(self, engine_reason: str | None) -> dict[str, Any]:
        """The choice of a non-streaming answer (call after `finish`)."""
        reason = self.finish_reason(engine_reason)
        if not self.chat:
            return {
                "index": self.index,
                "text": self.text,
                "logprobs": self._all_logprobs(),
                "finish_reason": reason,
            }
        message: dict[str, Any] = {"role": "assistant", "content": self.text}
        if self.thinking is not None:
            message["reasoning_content"] = self.thinking.reasoning or None
        if self.tools is not None and self.tools.calls:
            message["content"] = self.tools.content
            message["tool_calls"] = [call.body() for call in self.tools.calls]
        return {
            "index": self.index,
            "message": message,
            "logprobs": self._all_logprobs(),
            "finish_reason": reason,
        }


# --------------------------------------------------------------------------- streams


def chat_chunk(delta: ChoiceDelta) -> dict[str, Any]:
    body: dict[str, Any] = {}
    if delta.reasoning:
        body["reasoning_content"] = delta.reasoning
    if delta.content:
        body["content"] = delta.content
    if delta.tool_calls:
        body["tool_calls"] = delta.tool_calls
    return {
        "index": delta.index,
        "delta": body,
        "logprobs": delta.logprobs,
        "finish_reason": delta.finish_reason,
    }


def text_chunk(delta: ChoiceDelta) -> dict[str, Any]:
    return {
        "index": delta.index,
        "text": delta.content,
        "logprobs": delta.logprobs,
        "finish_reason": delta.finish_reason,
    }


async def choice_events(
    head: ResponseHead, deltas: AsyncIterator[ChoiceDelta], n: int, end: StreamEnd, chat: bool
) -> AsyncIterator[bytes]:
    """The SSE events of `n` choices: (chat) a role chunk per choice, then each delta as its
    own chunk tagged with its `index` (choices interleave as they are produced), each
    choice's finish as it ends, then the usage chunk when asked for."""
    if chat:
        for index in range(n):
            role = {
                "index": index,
                "delta": {"role": "assistant", "content": ""},
                "logprobs": None,
                "finish_reason": None,
            }
            yield sse(head.body([role]))
    chunk = chat_chunk if chat else text_chunk
    async with aclosing(deltas) as stream:  # closing it ends the producers
        async for delta in stream:
            if not delta.empty():
                yield sse(head.body([chunk(delta)]))
    if end.include_usage:
        yield sse(head.body([], usage=end.usage()))
