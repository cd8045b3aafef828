"""Tool-call parsers (pdcache.wire.tool_calls): each format parsed exactly, malformed calls
stay text, and the streamed parse (any split of the text) equals the one-shot parse."""

from __future__ import annotations

import json
import random
from typing import get_args

import pytest

from pdcache.config.schema import ToolCallParser
from pdcache.wire.tool_calls import (
    TOOL_CALL_PARSERS,
    ToolCallStream,
    parse_tool_calls,
    tool_call_format,
)

NAMES = {"get_weather", "lookup"}
HERMES = tool_call_format("hermes")
LLAMA3 = tool_call_format("llama3")


def calls_of(fmt, text: str) -> tuple[str | None, list[tuple[str, dict]]]:
    content, calls = parse_tool_calls(fmt, text, NAMES)
    for call in calls:
        assert call.id.startswith("call_") and len(call.id) == 29
    return content, [(c.name, json.loads(c.arguments)) for c in calls]


def test_registry_matches_the_config_choices() -> None:
    assert set(TOOL_CALL_PARSERS) == set(get_args(ToolCallParser))
    with pytest.raises(ValueError, match="llama3"):
        tool_call_format("nope")


def test_hermes_parses_calls_and_keeps_content() -> None:
    text = (
        'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}'
        '\n</tool_call>\n<tool_call>\n{"name": "lookup", "arguments": {"q": "x", "n": 2}}'
        "\n</tool_call>"
    )
    assert calls_of(HERMES, text) == (
        "Let me check.",
        [("get_weather", {"city": "Paris"}), ("lookup", {"q": "x", "n": 2})],
    )
    assert calls_of(tool_call_format("qwen25"), text)[1][0][0] == "get_weather"


def test_hermes_only_call_has_null_content_and_plain_text_is_content() -> None:
    assert calls_of(HERMES, '<tool_call>{"name": "lookup", "arguments": {}}</tool_call>') == (
        None,
        [("lookup", {})],
    )
    assert calls_of(HERMES, "just text, no call ") == ("just text, no call", [])


@pytest.mark.parametrize(
    "text",
    [
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Par}\n</tool_call>',  # bad JSON
        '<tool_call>\n{"name": "unknown_tool", "arguments": {}}\n</tool_call>',  # not in tools
        '<tool_call>\n{"arguments": {}}\n</tool_call>',  # no name
        '<tool_call>\n{"name": "lookup", "arguments": [1]}\n</tool_call>',  # arguments not an object
        '<tool_call>\n{"name": "lookup", "arguments": {}}',  # never closed
    ],
)
def test_hermes_malformed_call_stays_text(text: str) -> None:
    assert calls_of(HERMES, text) == (text, [])


def test_llama3_json_calls_with_and_without_python_tag() -> None:
    whole = '{"name": "lookup", "parameters": {"q": "a"}}; {"name": "get_weather", "arguments": {}}'
    assert calls_of(LLAMA3, whole) == (None, [("lookup", {"q": "a"}), ("get_weather", {})])
    tagged = 'Calling now <|python_tag|>{"name": "lookup", "parameters": {"q": "b"}}'
    assert calls_of(LLAMA3, tagged) == ("Calling now", [("lookup", {"q": "b"})])


@pytest.mark.parametrize(
    "text",
    [
        '{"name": "lookup", "parameters": {"q": "a"}',  # unterminated
        '{"name": "lookup", "parameters": {"q": "a"}} trailing words',
        '{"not": "a call"}',
        "plain answer",
    ],
)
def test_llama3_malformed_stays_text(text: str) -> None:
    assert calls_of(LLAMA3, text) == (text, [])


def test_hermes_format_is_not_llama3() -> None:
    text = '{"name": "lookup", "parameters": {}}'
    assert calls_of(HERMES, text) == (text, [])  # a bare JSON object is content for hermes


@pytest.mark.parametrize("fmt", [HERMES, LLAMA3])
@pytest.mark.parametrize("seed", range(5))
def test_streamed_parse_equals_one_shot_for_every_split(fmt, seed: int) -> None:
    texts = [
        'Sure <tool_call>\n{"name": "lookup", "arguments": {"q": "é"}}\n</tool_call> done',
        '<tool_call>{"name": "lookup", "arguments": {}</tool_call> <tool_c',
        'hi <|python_tag|>{"name": "lookup", "parameters": {"q": 1}}',
        '{"name": "get_weather", "parameters": {"city": "Oslo"}}',
        "a < b <tool and <|python but no call",
    ]
    rng = random.Random(seed)
    for text in texts:
        whole_content, whole_calls = parse_tool_calls(fmt, text, NAMES)
        stream = ToolCallStream(fmt, NAMES)
        cuts = sorted(rng.sample(range(1, len(text)), k=min(6, len(text) - 1)))
        pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)]
        content, calls = "", []
        for piece in pieces:
            delta = stream.feed(piece)
            content += delta.content
            calls += delta.calls
        delta = stream.finish()
        content += delta.content
        calls += delta.calls
        assert (content or None if calls else content) == whole_content
        assert [(c.name, c.arguments) for c in calls] == [
            (c.name, c.arguments) for c in whole_calls
        ]


def test_stream_never_releases_a_marker_prefix() -> None:
    stream = ToolCallStream(HERMES, NAMES)
    assert stream.feed("abc <tool_").content == "abc"
    delta = stream.feed('call>{"name": "lookup", "arguments": {}}</tool_call>')
    assert delta.content == "" and [c.name for c in delta.calls] == ["lookup"]


def test_stream_deltas_are_openais_shape() -> None:
    _, [call] = parse_tool_calls(
        HERMES,
        '<tool_call>{"name": "lookup", "arguments": '
        '{"query": "a long argument value"}}</tool_call>',
        NAMES,
    )
    deltas = call.stream_deltas(3)
    assert deltas[0] == {
        "index": 3,
        "id": call.id,
        "type": "function",
        "function": {"name": "lookup", "arguments": ""},
    }
    assert all(set(d) == {"index", "function"} and d["index"] == 3 for d in deltas[1:])
    assert "".join(d["function"]["arguments"] for d in deltas) == call.arguments
    assert len(deltas) > 2  # the arguments come in more than one chunk


def test_max_calls_keeps_only_the_first_call() -> None:
    """`parallel_tool_calls: false`: one call; the others are dropped, not content."""
    text = (
        '<tool_call>{"name": "lookup", "arguments": {}}</tool_call>\n'
        '<tool_call>{"name": "get_weather", "arguments": {}}</tool_call>'
    )
    stream = ToolCallStream(HERMES, NAMES, max_calls=1)
    stream.feed(text)
    stream.finish()
    assert [c.name for c in stream.calls] == ["lookup"] and stream.content is None
    assert [c.name for c in parse_tool_calls(HERMES, text, NAMES)[1]] == ["lookup", "get_weather"]
