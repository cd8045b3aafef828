"""Reasoning parsers: a thinking model's output → OpenAI `reasoning_content` + the answer
(docs/tools.md, "Reasoning").

One parser per deployment, like SGLang's `--reasoning-parser` (`[[node]]` / `[router]
reasoning_parser`, `--reasoning-parser`; `REASONING_PARSERS` is the registry; none by
default):

- `deepseek-r1`: DeepSeek-R1's template opens `<think>` in the prompt, so the output starts
  inside the thinking: everything before `</think>` is reasoning (a leading `<think>`, which
  R1-0528 writes itself, is dropped); without `</think>` the whole output is reasoning.
- `qwen3`: Qwen3 writes `<think>` itself; the output is thinking only when it opens with the
  tag (leading whitespace allowed), and a disabled thinking (`enable_thinking: false` in the
  template) writes no tag, so it is all answer. Thinking ends at `</think>`, or at a
  `<tool_call>` that opens before it (kept in the answer: Qwen3.5 sometimes calls a tool
  without closing its thinking), or with the output.
- `gpt-oss`: gpt-oss's harmony messages (`pdcache.wire.harmony`): `analysis` bodies are the
  reasoning, `final` bodies (and `commentary` preambles, and text outside any message) the
  answer; a call message (`to=functions.NAME`) passes into the answer as written, markers
  included, for the `gpt-oss` tool-call parser to read. The markers are special tokens of
  gpt-oss's vocabulary: the output is decoded with them kept.

The reasoning text and the answer are returned as the model wrote them, whitespace included
(as SGLang does), so that a client that sends them back lets the server re-render the turn
as it was produced (`with_reasoning_history`). `ReasoningStream` is the streaming form and
the only implementation: the non-streaming split is the same machine fed the whole text.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pdcache.engine.tokenizer import Tokenizer
from pdcache.wire.harmony import HarmonyEvent, HarmonyReader

THINK_START = "<think>"
THINK_END = "</think>"


@dataclass(frozen=True)
class ReasoningFormat:
    """Where a model's thinking starts and ends in its output."""

    name: str
    starts_inside: bool  # the template opened the thinking: the output starts in it
    interrupt: str | None = None  # a marker that ends thinking unclosed (kept in the answer)
    start: str = THINK_START
    end: str = THINK_END
    harmony: bool = False  # gpt-oss's channels, not tags (`HarmonyReader`)
    keeps_special_tokens: bool = False  # the markers are special tokens: decode them kept


REASONING_PARSERS: dict[str, ReasoningFormat] = {
    "deepseek-r1": ReasoningFormat("deepseek-r1", starts_inside=True),
    "qwen3": ReasoningFormat("qwen3", starts_inside=False, interrupt="<tool_call>"),
    "gpt-oss": ReasoningFormat("gpt-oss", starts_inside=False, start="", end="",
                               harmony=True, keeps_special_tokens=True),
}


def reasoning_format(name: str | None) -> ReasoningFormat | None:
    """The registered format called `name` (None: no reasoning parser); ValueError naming the
    choices for an unknown name."""
    if name is None:
        return None
    try:
        return REASONING_PARSERS[name]
    except KeyError:
        raise ValueError(
            f"unknown reasoning parser {name!r}; choose one of "
            f"{', '.join(sorted(REASONING_PARSERS))}"
        ) from None


@dataclass
class ReasoningDelta:
    """What one piece of output added: thinking text and answer text."""

    reasoning: str = ""
    answer: str = ""


class ReasoningStream:
    """Incremental split of one output: `feed` text pieces, then `finish`.

    Text is released as soon as no marker can still start in it: at the start the open tag
    may still be arriving, inside the thinking the end tag (or the interrupt marker). A
    harmony format is read by a `HarmonyReader` instead: its channels say which is which."""

    def __init__(self, fmt: ReasoningFormat) -> None:
        self.fmt = fmt
        self._phase = "start"  # start -> thinking -> answer (or start -> answer)
        self._pending = ""
        self.reasoning_parts: list[str] = []
        self._harmony = HarmonyReader() if fmt.harmony else None

    @property
    def reasoning(self) -> str:
        return "".join(self.reasoning_parts)

    def feed(self, text: str) -> ReasoningDelta:
        if self._harmony is not None:
            return self._harmony_delta(self._harmony.feed(text))
        self._pending += text
        out = ReasoningDelta()
        self._advance(out, final=False)
        return out

    def finish(self) -> ReasoningDelta:
        if self._harmony is not None:
            return self._harmony_delta(self._harmony.finish())
        out = ReasoningDelta()
        self._advance(out, final=True)
        return out

    def _harmony_delta(self, events: list[HarmonyEvent]) -> ReasoningDelta:
        """Harmony events as a split: analysis is reasoning; shown text is the answer, and so
        is a call message, as written (the tool-call parser reads it there)."""
        out = ReasoningDelta()
        for event in events:
            if event.kind == "reasoning":
                self._reason(out, event.text)
            else:
                out.answer += event.raw if event.kind == "call" else event.text
        return out

    def _advance(self, out: ReasoningDelta, final: bool) -> None:
        if self._phase == "start" and not self._open(final):
            return
        if self._phase == "thinking":
            self._think(out, final)
        if self._phase == "answer" and self._pending:
            out.answer += self._pending
            self._pending = ""

    def _open(self, final: bool) -> bool:
        """Decide, from the output's first text, whether it opens with the thinking tag;
        False while that cannot be told yet."""
        stripped = self._pending.lstrip()
        if not final and self.fmt.start.startswith(stripped):
            return False  # nothing but space yet, or a part of the tag
        if stripped.startswith(self.fmt.start):
            self._pending = stripped[len(self.fmt.start) :]
            self._phase = "thinking"
        else:
            self._phase = "thinking" if self.fmt.starts_inside else "answer"
        return True

    def _think(self, out: ReasoningDelta, final: bool) -> None:
        ends = [m for m in (self.fmt.end, self.fmt.interrupt) if m]
        found = [(at, m) for at, m in ((self._pending.find(m), m) for m in ends) if at >= 0]
        if found:
            at, marker = min(found)
            self._reason(out, self._pending[:at])
            # the end tag belongs to neither part; an interrupting marker is the answer's
            skip = len(marker) if marker == self.fmt.end else 0
            self._pending = self._pending[at + skip :]
            self._phase = "answer"
            return
        keep = 0 if final else max(_partial_suffix(self._pending, m) for m in ends)
        self._reason(out, self._pending[: len(self._pending) - keep])
        self._pending = self._pending[len(self._pending) - keep :]

    def _reason(self, out: ReasoningDelta, text: str) -> None:
        if text:
            self.reasoning_parts.append(text)
            out.reasoning += text


def _partial_suffix(text: str, marker: str) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of `marker`."""
    for k in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:k]):
            return k
    return 0


def split_reasoning(fmt: ReasoningFormat, text: str) -> tuple[str | None, str]:
    """(reasoning or None, answer) of a whole output: the streaming machine, fed at once."""
    stream = ReasoningStream(fmt)
    answer = stream.feed(text).answer + stream.finish().answer
    return stream.reasoning or None, answer


# --------------------------------------------------------------------------- the next turn


def template_reads_reasoning(tokenizer: Tokenizer) -> bool:
    """Whether the tokenizer's chat template renders an assistant message's
    `reasoning_content` itself (Qwen3's does; so does the harmony template of the gpt-oss
    presets); pdcache's byte template does not."""
    if getattr(tokenizer, "chat_format", None) == "harmony":
        return True
    template = getattr(tokenizer, "chat_template", None)
    return isinstance(template, str) and "reasoning_content" in template


def with_reasoning_history(
    messages: list[dict[str, Any]], fmt: ReasoningFormat | None, native: bool
) -> list[dict[str, Any]]:
    """The template messages with each assistant turn's `reasoning_content` where the
    template can see it: left as the field when the template reads it (`native`), else put
    back into the content as the model wrote it (`<think>` + reasoning + `</think>` +
    content), so the turn re-renders to the tokens decode produced and the next turn reuses
    the pages its answer wrote. Without a reasoning parser the deployment's model does not
    think, and the field is dropped rather than shown to it as text. Harmony is never
    folded into the content (its thinking is a message of its own): the field stays, and is
    also given as `thinking`, the name gpt-oss's own template reads."""
    if fmt is not None and fmt.harmony:
        return [_with_thinking(message) for message in messages]
    if native:
        return messages
    return [_folded(message, fmt) if "reasoning_content" in message else message
            for message in messages]


def _with_thinking(message: dict[str, Any]) -> dict[str, Any]:
    reasoning = message.get("reasoning_content")
    if not isinstance(reasoning, str) or "thinking" in message:
        return message
    return {**message, "thinking": reasoning}


def _folded(message: dict[str, Any], fmt: ReasoningFormat | None) -> dict[str, Any]:
    folded = {k: v for k, v in message.items() if k != "reasoning_content"}
    reasoning = message["reasoning_content"]
    if fmt is not None and isinstance(reasoning, str):
        folded["content"] = f"{fmt.start}{reasoning}{fmt.end}{message.get('content') or ''}"
    return folded
