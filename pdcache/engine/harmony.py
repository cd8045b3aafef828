"""gpt-oss's harmony chat format: the conversation rendered as harmony messages (docs/tools.md,
"gpt-oss (harmony)").

A harmony message is `<|start|>{role}{header}<|message|>{body}{terminator}`: the header holds
the `<|channel|>` (`analysis`, `commentary`, `final`) and a recipient (`to=functions.NAME` for
a tool call); the terminator is `<|end|>`, `<|call|>` (a tool call) or `<|return|>` (the last
final answer, an end-of-sequence token that history writes as `<|end|>`). The prompt ends with
`<|start|>assistant`, so the model writes its first message from `<|channel|>` on.

`render_harmony` writes an assistant turn as the model wrote it (its `reasoning_content` as an
`analysis` message, its calls as `commentary to=functions.NAME <|constrain|>json` messages
with compact JSON arguments (`call_arguments`), its content as `final`, or as `commentary`
beside calls), and keeps the analysis of every earlier turn (gpt-oss's own template drops it once a final answer
follows): turn t+1's prompt then starts with turn t's prompt and answer, token for token, and
the pages decode wrote for the answer are hit. `HarmonyByteTokenizer` is the byte tokenizer
with this template (the gpt-oss presets' chat format, `presets.preset_tokenizer`).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from pdcache.engine.tokenizer import ByteTokenizer, Message, tojson

START = "<|start|>"
CHANNEL = "<|channel|>"
MESSAGE = "<|message|>"
CONSTRAIN = "<|constrain|>"
END = "<|end|>"
CALL = "<|call|>"
RETURN = "<|return|>"
HARMONY_MARKERS = (START, CHANNEL, MESSAGE, CONSTRAIN, END, CALL, RETURN)

SYSTEM_PREAMBLE = "You are ChatGPT, a large language model trained by OpenAI."
CHANNELS_LINE = "# Valid channels: analysis, commentary, final. Channel must be included for every message."
TOOLS_CHANNEL_LINE = "Calls to these tools must go to the commentary channel: 'functions'."


def call_header(name: str) -> str:
    """The header of a call message after its role: the form gpt-oss writes its calls in."""
    return f"{CHANNEL}commentary to=functions.{name} {CONSTRAIN}json"


def call_arguments(arguments: Any) -> str:
    """A call's arguments as a call message's body: JSON text as it is; an object (what the
    server hands templates for JSON text that parses to one) in compact JSON, the form
    gpt-oss writes its arguments in (OpenAI's harmony guide): a model that spaced its JSON
    otherwise re-renders differently from there on."""
    if isinstance(arguments, str):
        return arguments
    return json.dumps(arguments, ensure_ascii=False, separators=(",", ":"))


def render_harmony(
    messages: list[Message],
    tools: list[dict[str, Any]] | None = None,
    add_generation_prompt: bool = True,
    reasoning_effort: str = "medium",
) -> str:
    """The harmony text of a chat: a system message (reasoning effort, channels), a developer
    message (the caller's system/developer instructions and the tools), then the turns."""
    instructions = [_text(m) for m in messages if m.get("role") in ("system", "developer")]
    out = [_system_message(reasoning_effort, bool(tools))]
    developer = _developer_body("\n\n".join(i for i in instructions if i), tools)
    if developer:
        out.append(f"{START}developer{MESSAGE}{developer}{END}")
    call_names: dict[str, str] = {}  # tool_call_id -> function name, for the tool results
    for message in messages:
        role = message.get("role")
        if role == "user":
            out.append(f"{START}user{MESSAGE}{_text(message)}{END}")
        elif role == "assistant":
            out.append(_assistant_turn(message, call_names))
        elif role == "tool":
            name = message.get("name") or call_names.get(str(message.get("tool_call_id")), "")
            out.append(f"{START}functions.{name} to=assistant{CHANNEL}commentary{MESSAGE}"
                       f"{_text(message)}{END}")
        elif role not in ("system", "developer"):
            raise ValueError(f"harmony has no role {role!r}")
    if add_generation_prompt:
        out.append(f"{START}assistant")
    return "".join(out)


def _text(message: Message) -> str:
    content = message.get("content")
    if content is None:
        return ""
    if not isinstance(content, str):
        raise ValueError(f"a chat message needs string 'content', got {message!r}")
    return content


def _system_message(reasoning_effort: str, has_tools: bool) -> str:
    lines = [SYSTEM_PREAMBLE, "", f"Reasoning: {reasoning_effort}", "", CHANNELS_LINE]
    if has_tools:
        lines.append(TOOLS_CHANNEL_LINE)
    return f"{START}system{MESSAGE}" + "\n".join(lines) + END


def _developer_body(instructions: str, tools: list[dict[str, Any]] | None) -> str:
    parts = [f"# Instructions\n\n{instructions}"] if instructions else []
    if tools:
        parts.append("# Tools\n\n## functions\n\nnamespace functions {\n\n"
                     + "".join(_tool_line(tool) for tool in tools)
                     + "} // namespace functions")
    return "\n\n".join(parts)


def _tool_line(tool: Mapping[str, Any]) -> str:
    """One function of the tools namespace: its description as a comment, its arguments as
    their JSON schema (gpt-oss's template writes a TypeScript type; this is the byte
    preset's simpler, deterministic form)."""
    function = tool.get("function", tool)
    description = function.get("description")
    comment = f"// {description}\n" if description else ""
    return f"{comment}type {function.get('name')} = (_: {tojson(function.get('parameters', {}))}) => any;\n\n"


def _assistant_turn(message: Message, call_names: dict[str, str]) -> str:
    """An assistant turn as the model wrote it: analysis, then the calls (content beside them
    is their commentary preamble) or the final answer."""
    out = []
    reasoning = message.get("reasoning_content", message.get("thinking"))
    if isinstance(reasoning, str):
        out.append(f"{START}assistant{CHANNEL}analysis{MESSAGE}{reasoning}{END}")
    tool_calls = message.get("tool_calls") or []
    content = _text(message)
    if tool_calls:
        if content:
            out.append(f"{START}assistant{CHANNEL}commentary{MESSAGE}{content}{END}")
        for call in tool_calls:
            function = call.get("function", call)
            name = str(function.get("name"))
            call_names[str(call.get("id"))] = name
            out.append(f"{START}assistant{call_header(name)}{MESSAGE}"
                       f"{call_arguments(function.get('arguments'))}{CALL}")
    elif content or not out:
        out.append(f"{START}assistant{CHANNEL}final{MESSAGE}{content}{END}")
    return "".join(out)


class HarmonyByteTokenizer(ByteTokenizer):
    """The byte tokenizer (same ids, same vocabulary) whose chat template is harmony
    (`render_harmony`); the markers are plain bytes, as every special text is to it. The
    `reasoning_effort` template variable (`chat_template_kwargs`) sets the system message's
    effort (default medium)."""

    chat_format = "harmony"

    def apply_chat_template(
        self,
        messages: list[Message],
        add_generation_prompt: bool = True,
        tools: list[dict[str, Any]] | None = None,
        template_kwargs: Mapping[str, Any] | None = None,
    ) -> list[int]:
        effort = str((template_kwargs or {}).get("reasoning_effort", "medium"))
        text = render_harmony(messages, tools, add_generation_prompt, effort)
        return [self.bos_token_id, *self.encode(text)]
