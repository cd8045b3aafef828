"""gpt-oss's harmony format: the `gpt-oss` reasoning and tool-call parsers (pdcache.wire.harmony
under pdcache.wire.reasoning / pdcache.wire.tool_calls) read analysis as reasoning, final as
the answer and commentary calls as tool calls, whole and streamed (split at every character,
one character at a time), robust to missing terminators, unknown channels and malformed
calls; and the harmony chat template (pdcache.engine.harmony) re-renders an answer as it was
generated, so turn 1's prompt + output ids are a prefix of turn 2's prompt."""

from __future__ import annotations

import json
from typing import Any

import pytest

from pdcache.engine.harmony import HarmonyByteTokenizer, render_harmony
from pdcache.engine.presets import preset_tokenizer
from pdcache.engine.tokenizer import ByteTokenizer
from pdcache.wire.agent import AgentFeatures
from pdcache.wire.choices import ChoiceOutput, chat_chunk
from pdcache.wire.harmony import HarmonyEvent, HarmonyReader
from pdcache.wire.protocol import ChatCompletionRequest
from pdcache.wire.reasoning import REASONING_PARSERS, ReasoningStream, split_reasoning
from pdcache.wire.tool_calls import (
    BareJsonCallFormat,
    ToolCallStream,
    forced_call_format,
    parse_tool_calls,
    tool_call_format,
)

GPT_OSS = REASONING_PARSERS["gpt-oss"]
CALLS = tool_call_format("gpt-oss")
TOOLS = {"get_weather": {"type": "object"}, "get_time": {"type": "object"}}
TOOL_DEFS = [{"type": "function", "function": {"name": name, "description": f"The {name}",
                                               "parameters": schema}}
             for name, schema in TOOLS.items()]

ANALYSIS = "<|channel|>analysis<|message|>The user wants the weather.\nLook it up.<|end|>"


def call(name: str, args: str, end: str = "<|call|>") -> str:
    return (f"<|start|>assistant<|channel|>commentary to=functions.{name} "
            f"<|constrain|>json<|message|>{args}{end}")


FINAL = ANALYSIS + "<|start|>assistant<|channel|>final<|message|>It is mild.\n<|return|>"
ONE_CALL = ANALYSIS + call("get_weather", '{"city":"Paris"}')
TWO_CALLS = (ANALYSIS + "<|start|>assistant<|channel|>commentary<|message|>Checking both.<|end|>"
             + call("get_weather", '{"city": "Paris"}') + call("get_time", ' {"zone":"CET"} '))

# output -> (reasoning, content, [(name, arguments)]) with both parsers on; the content is
# None only beside calls (as OpenAI's), else "" when there is none
CASES: list[tuple[str, tuple[str | None, str | None, list[tuple[str, str]]]]] = [
    (FINAL, ("The user wants the weather.\nLook it up.", "It is mild.\n", [])),
    (ONE_CALL, ("The user wants the weather.\nLook it up.", None,
                [("get_weather", '{"city":"Paris"}')])),
    (ONE_CALL.removesuffix("<|call|>"),  # the decoder dropped the end-of-sequence <|call|>
     ("The user wants the weather.\nLook it up.", None, [("get_weather", '{"city":"Paris"}')])),
    (TWO_CALLS, ("The user wants the weather.\nLook it up.", "Checking both.",
                 [("get_weather", '{"city": "Paris"}'), ("get_time", ' {"zone":"CET"} ')])),
    # the recipient after the role, no <|constrain|>: as gpt-oss's own template writes calls
    ("<|start|>assistant to=functions.get_time<|channel|>commentary json<|message|>{}<|call|>",
     (None, None, [("get_time", "{}")])),
    # final without <|return|> (an end-of-sequence token), analysis without <|end|>
    ("<|channel|>analysis<|message|>hmm<|start|>assistant<|channel|>final<|message|>Yes",
     ("hmm", "Yes", [])),
    # truncated inside the thinking: all reasoning, no answer
    ("<|channel|>analysis<|message|>still thinking <|", ("still thinking <|", "", [])),
    # no harmony at all: the text is the answer
    ("plain words", (None, "plain words", [])),
    # an unknown channel is shown, not hidden; a header the output never finished is dropped
    ("<|channel|>aside<|message|>psst<|end|><|start|>assistant<|channel|>fin",
     (None, "psst", [])),
    # a tool the request does not have, arguments that are no object, a built-in tool, and
    # unreadable JSON: each call message stays content, markers included
    (call("get_stock", "{}"), (None, call("get_stock", "{}"), [])),
    (call("get_weather", "[1]"), (None, call("get_weather", "[1]"), [])),
    ("<|channel|>analysis to=browser.search<|message|>{}<|call|>",
     (None, "<|channel|>analysis to=browser.search<|message|>{}<|call|>", [])),
    (call("get_weather", '{"city":'), (None, call("get_weather", '{"city":'), [])),
    # empty arguments are no arguments; a stray terminator marks nothing
    (call("get_time", "") + "<|end|>", (None, None, [("get_time", "{}")])),
    # a text marker that is no harmony marker is text
    ("<|channel|>final<|message|>a <|weird|> b", (None, "a <|weird|> b", [])),
]


def parsed(pieces: list[str]) -> tuple[str | None, str | None, list[tuple[str, str]]]:
    """Both parsers, as a choice runs them, over the output fed in `pieces`."""
    thinking, calls = ReasoningStream(GPT_OSS), ToolCallStream(CALLS, TOOLS)
    for piece in pieces:
        calls.feed(thinking.feed(piece).answer)
    calls.feed(thinking.finish().answer)
    calls.finish()
    return (thinking.reasoning or None, calls.content,
            [(c.name, c.arguments) for c in calls.calls])


@pytest.mark.parametrize(("text", "expected"), CASES)
def test_whole_output(text: str, expected: Any) -> None:
    assert parsed([text]) == expected


@pytest.mark.parametrize(("text", "expected"), CASES)
def test_split_at_every_boundary_and_char_by_char(text: str, expected: Any) -> None:
    for cut in range(len(text) + 1):
        assert parsed([text[:cut], text[cut:]]) == expected, cut
    assert parsed(list(text)) == expected


def test_reasoning_parser_alone_passes_calls_on_as_written() -> None:
    assert split_reasoning(GPT_OSS, ONE_CALL) == (
        "The user wants the weather.\nLook it up.", call("get_weather", '{"city":"Paris"}'))
    assert split_reasoning(GPT_OSS, FINAL)[1] == "It is mild.\n"


def test_tool_call_parser_alone_leaves_the_analysis_out() -> None:
    """As SGLang's gpt-oss detector: without the reasoning parser the thinking is no content."""
    content, calls = parse_tool_calls(CALLS, FINAL, TOOLS)
    assert (content, calls) == ("It is mild.\n", [])
    content, calls = parse_tool_calls(CALLS, TWO_CALLS, TOOLS)
    assert content == "Checking both." and [c.name for c in calls] == ["get_weather", "get_time"]
    assert len({c.id for c in calls}) == 2


def test_streamed_reasoning_comes_as_it_is_written_and_markers_never_leak() -> None:
    thinking = ReasoningStream(GPT_OSS)
    deltas = [thinking.feed(ch) for ch in FINAL]
    reasoning = [d.reasoning for d in deltas if d.reasoning]
    assert len(reasoning) > 10  # streamed, not held to the end
    assert all("<|" not in d.reasoning + d.answer for d in deltas)
    answer_from = next(i for i, d in enumerate(deltas) if d.answer)
    assert answer_from < len(FINAL) - len("<|return|>")  # the answer streams too


def test_reader_events() -> None:
    reader = HarmonyReader()
    events = reader.feed(TWO_CALLS) + reader.finish()
    assert [e.kind for e in events] == ["reasoning", "answer", "call", "call"]
    assert events[2] == HarmonyEvent(
        "call", '{"city": "Paris"}', call("get_weather", '{"city": "Paris"}'),
        "functions.get_weather")


def test_max_calls_keeps_the_first() -> None:
    stream = ToolCallStream(CALLS, TOOLS, max_calls=1)
    stream.feed(TWO_CALLS)
    stream.finish()
    assert [c.name for c in stream.calls] == ["get_weather"]


def test_choice_streams_reasoning_content_and_calls_and_ends_with_tool_calls() -> None:
    out = ChoiceOutput(0, chat=True, tool_format=CALLS, tools=TOOLS, reasoning=GPT_OSS)
    chunks = [chat_chunk(out.add(ch)) for ch in TWO_CALLS] + [chat_chunk(out.finish("stop"))]
    deltas = [c["delta"] for c in chunks]
    assert "".join(d.get("reasoning_content", "") for d in deltas) == (
        "The user wants the weather.\nLook it up.")
    assert "".join(d.get("content", "") for d in deltas) == "Checking both."
    heads = [t for d in deltas for t in d.get("tool_calls", []) if "id" in t]
    assert [h["function"]["name"] for h in heads] == ["get_weather", "get_time"]
    assert chunks[-1]["finish_reason"] == "tool_calls"
    message = out.body("stop")["message"]
    assert message["reasoning_content"] == "The user wants the weather.\nLook it up."
    assert [json.loads(c["function"]["arguments"]) for c in message["tool_calls"]] == [
        {"city": "Paris"}, {"zone": "CET"}]


def test_the_markers_are_decoded_kept_and_the_presets_speak_harmony() -> None:
    tokenizer = HarmonyByteTokenizer()
    for tool_parser, reasoning in (("gpt-oss", None), ("hermes", "gpt-oss")):
        agent = AgentFeatures(tokenizer, tokenizer.vocab_size, tool_parser, reasoning)
        body = ChatCompletionRequest.model_validate(
            {"messages": [{"role": "user", "content": "hi"}], "tools": TOOL_DEFS})
        assert agent.chat_plan(body).keeps_special_tokens
    # a forced call is constrained text: the bare JSON call, not special-token markers
    assert isinstance(forced_call_format(CALLS), BareJsonCallFormat)
    assert isinstance(preset_tokenizer("tiny-gpt-oss"), HarmonyByteTokenizer)
    assert isinstance(preset_tokenizer("small-gpt-oss"), HarmonyByteTokenizer)
    assert type(preset_tokenizer("tiny")) is ByteTokenizer


# --------------------------------------------------------------------------- the template


def test_render_harmony_roles_channels_and_tool_results() -> None:
    messages = [
        {"role": "system", "content": "Be terse."},
        {"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": None, "reasoning_content": "R",
         "tool_calls": [{"id": "c1", "type": "function",
                         "function": {"name": "get_weather", "arguments": '{"city":"P"}'}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
    ]
    text = render_harmony(messages, TOOL_DEFS, reasoning_effort="low")
    assert text.startswith("<|start|>system<|message|>")
    assert "Reasoning: low" in text
    assert "<|start|>developer<|message|># Instructions\n\nBe terse.\n\n# Tools" in text
    assert "type get_weather = (_: {\"type\": \"object\"}) => any;" in text
    assert text.endswith(
        "<|start|>user<|message|>Weather?<|end|>"
        "<|start|>assistant<|channel|>analysis<|message|>R<|end|>"
        + call("get_weather", '{"city":"P"}')
        + "<|start|>functions.get_weather to=assistant<|channel|>commentary<|message|>sunny"
        "<|end|><|start|>assistant")
    with pytest.raises(ValueError, match="no role"):
        render_harmony([{"role": "narrator", "content": "x"}])


def prompt_ids(agent: AgentFeatures, messages: list[dict[str, Any]]) -> list[int]:
    """The prompt the server renders (`AgentFeatures.chat_messages`, then the template)."""
    body = ChatCompletionRequest.model_validate({"messages": messages, "tools": TOOL_DEFS})
    return agent.tokenizer.apply_chat_template(agent.chat_messages(body), tools=TOOL_DEFS)


COMPACT_CALLS = (ANALYSIS + "<|start|>assistant<|channel|>commentary<|message|>Both.<|end|>"
                 + call("get_weather", '{"city":"Paris"}') + call("get_time", '{"zone":"CET"}'))


@pytest.mark.parametrize(("output", "stop", "follow_up"), [
    (FINAL, "<|return|>", {"role": "user", "content": "And tomorrow?"}),
    (ONE_CALL, "", {"role": "tool", "content": "sunny"}),
    (COMPACT_CALLS, "", {"role": "tool", "content": "sunny"}),
])
def test_turn_two_prompt_extends_turn_one_prompt_and_output(
    output: str, stop: str, follow_up: dict[str, Any]
) -> None:
    """Token level: the answer, parsed into `reasoning_content` / `content` / `tool_calls`
    and sent back, re-renders to the ids the model produced (all but the end-of-sequence
    `<|return|>`, never fed to the model: history writes `<|end|>` there), so turn 2's
    prompt starts with turn 1's prompt + output and the cache chain stays intact."""
    tokenizer = HarmonyByteTokenizer()
    agent = AgentFeatures(tokenizer, tokenizer.vocab_size, "gpt-oss", "gpt-oss")
    first = [{"role": "system", "content": "Be terse."},
             {"role": "user", "content": "Weather in Paris?"}]
    prompt = prompt_ids(agent, first)
    produced = tokenizer.encode(output.removesuffix(stop) if stop else output)
    body = ChatCompletionRequest.model_validate({"messages": first, "tools": TOOL_DEFS})
    out = agent.chat_plan(body).output(0)
    out.add(output)
    out.finish("stop")
    message = out.body("stop")["message"]
    calls = message.get("tool_calls") or []
    replies = [{**follow_up, "tool_call_id": c["id"]} for c in calls] or [follow_up]
    second = [*first, {k: v for k, v in message.items() if v is not None}, *replies]
    assert prompt_ids(agent, second)[: len(prompt) + len(produced)] == [*prompt, *produced]
    # a client that drops the thinking: the histories part inside the analysis's header
    dropped = {k: v for k, v in message.items() if v is not None and k != "reasoning_content"}
    without = prompt_ids(agent, [*first, dropped, *replies])
    assert without[: len(prompt) + len("<|channel|>")] == [*prompt, *produced][: len(without[
        : len(prompt) + len("<|channel|>")])]
    assert without[len(prompt) + len("<|channel|>")] != produced[len("<|channel|>")]


def test_spaced_arguments_re_render_compact_so_the_chain_ends_in_them() -> None:
    """The server hands the template the arguments as an object: JSON the model spaced comes
    back compact, and the hit ends inside that call (at its first space)."""
    tokenizer = HarmonyByteTokenizer()
    agent = AgentFeatures(tokenizer, tokenizer.vocab_size, "gpt-oss", "gpt-oss")
    first = [{"role": "user", "content": "Weather in Paris?"}]
    prompt = prompt_ids(agent, first)
    body = ChatCompletionRequest.model_validate({"messages": first, "tools": TOOL_DEFS})
    out = agent.chat_plan(body).output(0)
    out.add(TWO_CALLS)
    out.finish("stop")
    message = out.body("stop")["message"]
    assert message["tool_calls"][0]["function"]["arguments"] == '{"city": "Paris"}'  # as written
    replies = [{"role": "tool", "tool_call_id": c["id"], "content": "ok"}
               for c in message["tool_calls"]]
    second = prompt_ids(agent, [*first, {k: v for k, v in message.items() if v is not None},
                                *replies])
    produced = [*prompt, *tokenizer.encode(TWO_CALLS)]
    parted = next(i for i, (a, b) in enumerate(zip(second, produced)) if a != b)
    assert parted == len(prompt) + TWO_CALLS.index('"city": ') + len('"city":')  # ASCII: 1 id
