"""The agent formats of DeepSeek-V3/R1, Kimi K2 and Qwen3 / Qwen3-Coder: the tool-call parsers
`deepseekv3`, `kimi_k2`, `qwen3_coder` (pdcache.wire.tool_calls) and the reasoning parsers
`deepseek-r1`, `qwen3` (pdcache.wire.reasoning), parsed exactly; malformed calls stay text;
any split of a streamed output (1 character at a time, random pieces) reassembles to the
one-shot answer; and a choice splits its thinking off before it parses calls."""

from __future__ import annotations

import json
import random
from typing import Any, get_args

import pytest

from pdcache.config.schema import ReasoningParser, ToolCallParser
from pdcache.engine.tokenizer import ByteTokenizer
from pdcache.wire.agent import AgentFeatures
from pdcache.wire.choices import ChoiceOutput, chat_chunk
from pdcache.wire.protocol import ChatCompletionRequest
from pdcache.wire.reasoning import (
    REASONING_PARSERS,
    ReasoningStream,
    reasoning_format,
    split_reasoning,
)
from pdcache.wire.tool_calls import (
    TOOL_CALL_PARSERS,
    BareJsonCallFormat,
    ToolCallFormat,
    ToolCallStream,
    converted_value,
    forced_call_format,
    parse_tool_calls,
    tool_call_format,
)

DEEPSEEK = tool_call_format("deepseekv3")
KIMI = tool_call_format("kimi_k2")
CODER = tool_call_format("qwen3_coder")
R1 = REASONING_PARSERS["deepseek-r1"]
QWEN3 = REASONING_PARSERS["qwen3"]

SCHEMAS: dict[str, dict[str, Any]] = {
    "get_weather": {
        "type": "object",
        "properties": {
            "city": {"type": "string"},
            "days": {"type": "integer"},
            "metric": {"type": "boolean"},
        },
    },
    "search": {
        "type": "object",
        "properties": {
            "query": {"type": "string"},
            "filters": {"type": "object"},
            "tags": {"type": "array", "items": {"type": "string"}},
            "limit": {"anyOf": [{"type": "integer"}, {"type": "null"}]},
            "ratio": {"type": "number"},
            "mode": {"enum": ["fast", "slow"]},
        },
    },
}
NAMES = set(SCHEMAS)

# --------------------------------------------------------------------------- outputs

DS_BEGIN, DS_END = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"


def ds_call(name: str, args: str) -> str:
    return (f"<｜tool▁call▁begin｜>function<｜tool▁sep｜>{name}\n```json\n{args}\n```"
            "<｜tool▁call▁end｜>")


def kimi_call(call_id: str, args: str) -> str:
    return f"<|tool_call_begin|>{call_id}<|tool_call_argument_begin|>{args}<|tool_call_end|>"


KIMI_BEGIN, KIMI_END = "<|tool_calls_section_begin|>", "<|tool_calls_section_end|>"


def coder_call(name: str, **params: str) -> str:
    body = "".join(f"<parameter={k}>\n{v}\n</parameter>\n" for k, v in params.items())
    return f"<tool_call>\n<function={name}>\n{body}</function>\n</tool_call>"


NESTED = '{"query": "pdcache", "filters": {"lang": ["py", "rs"], "since": {"year": 2024}}}'


def calls_of(fmt: ToolCallFormat, text: str) -> tuple[str | None, list[tuple[str, Any]]]:
    content, calls = parse_tool_calls(fmt, text, SCHEMAS)
    return content, [(c.name, json.loads(c.arguments)) for c in calls]


def test_registries_match_the_config_choices_and_refuse_unknown_names() -> None:
    assert set(TOOL_CALL_PARSERS) == set(get_args(ToolCallParser))
    assert {"deepseekv3", "kimi_k2", "qwen3_coder"} <= set(TOOL_CALL_PARSERS)
    assert set(REASONING_PARSERS) == set(get_args(ReasoningParser)) == {
        "deepseek-r1", "qwen3", "gpt-oss"}
    assert reasoning_format(None) is None
    with pytest.raises(ValueError, match="deepseek-r1, gpt-oss, qwen3"):
        reasoning_format("deepseek_r1")
    with pytest.raises(ValueError, match="kimi_k2"):
        tool_call_format("kimi")
    with pytest.raises(ValueError, match="choose one of deepseek-r1, gpt-oss, qwen3"):
        AgentFeatures(ByteTokenizer(), 261, "hermes", "nope")


# --------------------------------------------------------------------------- deepseekv3


def test_deepseekv3_calls_with_nested_arguments_and_text_around() -> None:
    text = ("Let me look.\n" + DS_BEGIN + ds_call("get_weather", '{"city": "Tokyo", "days": 2}')
            + "\n" + ds_call("search", NESTED) + DS_END + " Done.")
    assert calls_of(DEEPSEEK, text) == (
        "Let me look. Done.",
        [("get_weather", {"city": "Tokyo", "days": 2}), ("search", json.loads(NESTED))],
    )


def test_deepseekv3_only_calls_has_null_content_and_the_section_end_may_be_missing() -> None:
    only = DS_BEGIN + ds_call("get_weather", '{"city": "Oslo"}') + DS_END
    assert calls_of(DEEPSEEK, only) == (None, [("get_weather", {"city": "Oslo"})])
    # the output ended after a complete call (each call has its own end marker)
    unclosed = DS_BEGIN + ds_call("get_weather", '{"city": "Oslo"}')
    assert calls_of(DEEPSEEK, unclosed) == (None, [("get_weather", {"city": "Oslo"})])
    assert calls_of(DEEPSEEK, "plain answer") == ("plain answer", [])


@pytest.mark.parametrize(
    "text",
    [
        DS_BEGIN + ds_call("get_weather", '{"city": "Tok') + DS_END,  # bad JSON
        DS_BEGIN + ds_call("unknown_tool", "{}") + DS_END,  # not a request tool
        DS_BEGIN + ds_call("get_weather", "[1, 2]") + DS_END,  # arguments not an object
        DS_BEGIN + "<｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n{}"
        "<｜tool▁call▁end｜>" + DS_END,  # no ```json fence
        DS_BEGIN + ds_call("search", "{}") + " stray " + ds_call("search", "{}") + DS_END,
        DS_BEGIN + "<｜tool▁call▁begin｜>function<｜tool▁sep｜>search\n```json\n{}",  # cut off
        DS_BEGIN + ds_call("search", "{}") + ds_call("nope", "{}") + DS_END,  # one bad: all text
    ],
)
def test_deepseekv3_malformed_calls_stay_text(text: str) -> None:
    assert calls_of(DEEPSEEK, text) == (text, [])


# --------------------------------------------------------------------------- kimi_k2


def test_kimi_k2_calls_keep_the_models_ids() -> None:
    text = ("Checking both. " + KIMI_BEGIN
            + kimi_call("functions.get_weather:0", '{"city": "Paris"}')
            + kimi_call("functions.search:1", NESTED) + KIMI_END + "\nok")
    content, calls = parse_tool_calls(KIMI, text, SCHEMAS)
    assert content == "Checking both.\nok"
    assert [(c.id, c.name, json.loads(c.arguments)) for c in calls] == [
        ("functions.get_weather:0", "get_weather", {"city": "Paris"}),
        ("functions.search:1", "search", json.loads(NESTED)),
    ]
    # `NAME:IDX` without the namespace names the function too; a repeated id is replaced
    twice = KIMI_BEGIN + kimi_call("search:3", "{}") + kimi_call("search:3", "{}") + KIMI_END
    content, calls = parse_tool_calls(KIMI, twice, SCHEMAS)
    assert content is None and calls[0].id == "search:3" and calls[1].id.startswith("call_")
    assert calls_of(KIMI, KIMI_BEGIN + kimi_call("functions.search:0", " {} ")) == (
        None, [("search", {})])


@pytest.mark.parametrize(
    "text",
    [
        KIMI_BEGIN + kimi_call("functions.search:0", '{"query": ') + KIMI_END,  # bad JSON
        KIMI_BEGIN + kimi_call("functions.nope:0", "{}") + KIMI_END,  # not a request tool
        KIMI_BEGIN + kimi_call("0", '{"query": "x"}') + KIMI_END,  # a bare counter names none
        KIMI_BEGIN + kimi_call("functions.search:0", '"text"') + KIMI_END,  # not an object
        KIMI_BEGIN + "<|tool_call_begin|>functions.search:0{}<|tool_call_end|>" + KIMI_END,
        KIMI_BEGIN + "<|tool_call_begin|>functions.search:0<|tool_call_argument_begin|>{}",
    ],
)
def test_kimi_k2_malformed_calls_stay_text(text: str) -> None:
    assert calls_of(KIMI, text) == (text, [])


# --------------------------------------------------------------------------- qwen3_coder


def test_qwen3_coder_calls_convert_values_by_the_tools_schema() -> None:
    text = (
        "I will search.\n"
        + coder_call("search", query="42", filters='{"lang": ["py"], "n": {"a": null}}',
                     tags='["a", "b"]', limit="5", ratio="0.5", mode="fast")
        + "\n"
        + coder_call("get_weather", city="New York", days="3", metric="True")
        + "\nThat is all."
    )
    assert calls_of(CODER, text) == (
        "I will search.\nThat is all.",
        [
            ("search", {"query": "42", "filters": {"lang": ["py"], "n": {"a": None}},
                        "tags": ["a", "b"], "limit": 5, "ratio": 0.5, "mode": "fast"}),
            ("get_weather", {"city": "New York", "days": 3, "metric": True}),
        ],
    )


def test_qwen3_coder_values_keep_their_inner_lines_and_read_like_sglang() -> None:
    code = "def f():\n    return '<b>'\n"
    text = ("<tool_call>\n<function=search>\n<parameter=query>\n" + code
            + "\n</parameter>\n<parameter=extra>\nnot in the schema\n</parameter>\n"
            "<parameter=limit>\nnull\n</parameter>\n</function>\n</tool_call>")
    assert calls_of(CODER, text) == (
        None, [("search", {"query": code, "extra": "not in the schema", "limit": None})])
    # a missing </parameter> ends at the next parameter or the function's end, as SGLang reads it
    lenient = ("<tool_call><function=get_weather><parameter=city>Rome<parameter=days>4"
               "</function></tool_call>")
    assert calls_of(CODER, lenient) == (None, [("get_weather", {"city": "Rome", "days": 4})])
    # two functions in one block are two calls; no parameters is {}
    two = "<tool_call><function=search></function><function=get_weather></function></tool_call>"
    assert calls_of(CODER, two) == (None, [("search", {}), ("get_weather", {})])


@pytest.mark.parametrize(
    ("text_value", "schema", "expected"),
    [
        ("12", {"type": "integer"}, 12),
        ("twelve", {"type": "integer"}, "twelve"),  # a failed number stays text
        ("3", {"type": "number"}, 3),
        ("3.0", {"type": "number"}, 3.0),
        ("1e3", {"type": "number"}, 1000.0),
        ("nan", {"type": "number"}, "nan"),  # no JSON number
        ("false", {"type": "boolean"}, False),
        ("yes", {"type": "boolean"}, False),  # SGLang: not `true` is false
        ("[1, 2]", {"type": "array"}, [1, 2]),
        ("{'a': (1, 2)}", {"type": "object"}, {"a": [1, 2]}),  # a Python literal
        ("{1, 2}", {"type": "object"}, "{1, 2}"),  # a set is no JSON: text
        ("[1", {"type": "array"}, "[1"),
        ("7", {"type": ["null", "integer"]}, 7),
        ("7", {"anyOf": [{"type": "integer"}, {"type": "string"}]}, "7"),  # mixed: string
        ("2", {"enum": [1, 2, 3]}, 2),
        ("x", {"allOf": [{"type": "string"}]}, "x"),
        ("{}", {"properties": {}}, {}),
        ("NULL", {"type": "string"}, None),
        ("42", None, "42"),  # not in the schema
    ],
)
def test_qwen3_coder_value_conversion(text_value: str, schema: Any, expected: Any) -> None:
    assert converted_value(text_value, schema) == expected
    assert type(converted_value(text_value, schema)) is type(expected)


@pytest.mark.parametrize(
    "text",
    [
        coder_call("unknown_tool", q="1"),  # not a request tool
        "<tool_call>\n<function=search>\n<parameter=query>\nx\n</parameter>\n</tool_call>",
        "<tool_call>\n<function=search>\nstray words\n</function>\n</tool_call>",
        "<tool_call>\n<function=search>\n<parameter=query>\nx\n</parameter>\n</function>",
        "<tool_call>\nsearch(query='x')\n</tool_call>",
    ],
)
def test_qwen3_coder_malformed_calls_stay_text(text: str) -> None:
    assert calls_of(CODER, text) == (text, [])


# --------------------------------------------------------------------------- streaming

STREAM_CASES: list[tuple[ToolCallFormat, str]] = [
    (DEEPSEEK, "Sure é " + DS_BEGIN + ds_call("search", NESTED) + "\n"
     + ds_call("get_weather", '{"city": "Oslo"}') + DS_END + " after"),
    (DEEPSEEK, "a <｜tool▁calls and " + DS_BEGIN + ds_call("search", '{"q": ') + DS_END),
    (DEEPSEEK, DS_BEGIN + ds_call("get_weather", "{}") + "<｜tool▁calls▁e"),
    (KIMI, "x " + KIMI_BEGIN + kimi_call("functions.search:0", NESTED)
     + kimi_call("functions.get_weather:1", '{"city": "Köln"}') + KIMI_END + " y"),
    (KIMI, "<|tool_calls_sec " + KIMI_BEGIN + kimi_call("7", "{}") + KIMI_END),
    (CODER, "pre\n" + coder_call("search", query="a < b", filters='{"k": [1]}')
     + coder_call("get_weather", city="Lima") + "\npost <tool"),
    (CODER, "<tool_call><function=search><parameter=query>open"),
]


def pieces_of(text: str, rng: random.Random | None) -> list[str]:
    if rng is None:
        return list(text)
    cuts = sorted(rng.sample(range(1, len(text)), k=min(8, len(text) - 1)))
    return [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)]


@pytest.mark.parametrize("case", range(len(STREAM_CASES)))
@pytest.mark.parametrize("seed", [None, 0, 1, 2])
def test_streamed_calls_reassemble_to_the_one_shot_answer(case: int, seed: int | None) -> None:
    fmt, text = STREAM_CASES[case]
    whole_content, whole_calls = parse_tool_calls(fmt, text, SCHEMAS)
    stream = ToolCallStream(fmt, SCHEMAS)
    content, calls = "", []
    for piece in pieces_of(text, None if seed is None else random.Random(seed)):
        delta = stream.feed(piece)
        content, calls = content + delta.content, calls + delta.calls
    delta = stream.finish()
    content, calls = content + delta.content, calls + delta.calls
    assert (content or None if calls else content) == whole_content
    assert [(c.name, c.arguments) for c in calls] == [(c.name, c.arguments) for c in whole_calls]
    if fmt is KIMI:
        assert [c.id for c in calls] == [c.id for c in whole_calls]


def test_stream_holds_a_marker_prefix_of_each_format() -> None:
    for fmt, marker in ((DEEPSEEK, DS_BEGIN), (KIMI, KIMI_BEGIN), (CODER, "<tool_call>")):
        stream = ToolCallStream(fmt, SCHEMAS)
        assert stream.feed("text " + marker[:-1]).content == "text"


def test_special_token_formats_and_forced_calls() -> None:
    assert DEEPSEEK.keeps_special_tokens and KIMI.keeps_special_tokens
    assert not CODER.keeps_special_tokens and not tool_call_format("hermes").keeps_special_tokens
    # their calls are no JSON object: a forced call is written and read as the bare JSON call
    for fmt in (DEEPSEEK, KIMI, CODER):
        assert isinstance(forced_call_format(fmt), BareJsonCallFormat)
    hermes = tool_call_format("hermes")
    assert forced_call_format(hermes) is hermes


def test_kimi_output_is_decoded_with_special_tokens_but_not_the_end() -> None:
    tokenizer = ByteTokenizer()
    agent = AgentFeatures(tokenizer, tokenizer.vocab_size, "kimi_k2")
    body = ChatCompletionRequest.model_validate(
        {"messages": [{"role": "user", "content": "hi"}],
         "tools": [{"type": "function", "function": {"name": "search"}}]})
    plan = agent.chat_plan(body)
    ids = [tokenizer.im_start_id, *tokenizer.encode("a"), tokenizer.im_end_id]
    assert agent.text_decoder(plan)(ids) == "<|im_start|>a"
    plain = agent.chat_plan(body.model_copy(update={"tools": None}))
    assert agent.text_decoder(plain)(ids) == "a"


# --------------------------------------------------------------------------- reasoning


@pytest.mark.parametrize(
    ("fmt", "text", "expected"),
    [
        (QWEN3, "<think>\nLet me see.\n</think>\n\nParis.", ("\nLet me see.\n", "\n\nParis.")),
        (QWEN3, "\n<think>a</think>b", ("a", "b")),  # leading space before the tag
        (QWEN3, "Paris.", (None, "Paris.")),  # thinking disabled: no tag, all answer
        (QWEN3, "Paris <think>x</think>", (None, "Paris <think>x</think>")),  # not at the start
        (QWEN3, "<think>cut off", ("cut off", "")),  # the output ended inside the thinking
        (QWEN3, "<think>hm<tool_call>{}</tool_call>", ("hm", "<tool_call>{}</tool_call>")),
        (QWEN3, "<think></think>x", (None, "x")),
        (R1, "Let me see.\n</think>\n\nParis.", ("Let me see.\n", "\n\nParis.")),
        (R1, "<think>\nhm</think>Paris.", ("\nhm", "Paris.")),  # R1-0528 writes the tag
        (R1, "all thinking", ("all thinking", "")),  # no end tag: all reasoning (as SGLang)
        (R1, "a<tool_call>b</think>c", ("a<tool_call>b", "c")),  # no interrupt for R1
        (R1, "", (None, "")),
    ],
)
def test_reasoning_split(fmt: Any, text: str, expected: tuple[str | None, str]) -> None:
    assert split_reasoning(fmt, text) == expected


@pytest.mark.parametrize("fmt", [R1, QWEN3])
@pytest.mark.parametrize("seed", [None, 0, 1, 2])
def test_streamed_reasoning_equals_the_one_shot_split(fmt: Any, seed: int | None) -> None:
    texts = [
        "<think>\nstep < one </thin and on\n</think>\n\nanswer </think> <think>",
        "  <thin",
        "no thinking here at all",
        "<think>unclosed </th",
        "<think>x<tool_ca but <tool_call>{}",
    ]
    for text in texts:
        reasoning, answer = split_reasoning(fmt, text)
        stream = ReasoningStream(fmt)
        streamed = [stream.feed(p) for p in pieces_of(text, None if seed is None else
                                                        random.Random(seed))]
        streamed.append(stream.finish())
        assert "".join(d.reasoning for d in streamed) == (reasoning or "")
        assert "".join(d.answer for d in streamed) == answer


def test_stream_never_releases_a_partial_end_tag() -> None:
    stream = ReasoningStream(QWEN3)
    assert stream.feed("<thi").reasoning == ""
    delta = stream.feed("nk>abc</thi")
    assert (delta.reasoning, delta.answer) == ("abc", "")
    delta = stream.feed("nk>def")
    assert (delta.reasoning, delta.answer) == ("", "def")


# --------------------------------------------------------------------------- a choice


def choice(fmt: ToolCallFormat | None, reasoning: Any) -> ChoiceOutput:
    return ChoiceOutput(0, chat=True, tool_format=fmt, tools=SCHEMAS, reasoning=reasoning)


CHOICE_CASES: list[tuple[ToolCallFormat, Any, str]] = [
    (DEEPSEEK, R1, "The user wants weather; " + DS_BEGIN + " is how I call.</think>\n\n"
     + DS_BEGIN + ds_call("get_weather", '{"city": "Oslo"}') + DS_END),
    (CODER, QWEN3, "<think>\nI should search.\n</think>\n\nSearching.\n"
     + coder_call("search", query="x", limit="2")),
    (KIMI, QWEN3, "<think>plan</think>" + KIMI_BEGIN + kimi_call("functions.search:0", "{}")
     + KIMI_END),
]


@pytest.mark.parametrize("case", range(len(CHOICE_CASES)))
@pytest.mark.parametrize("seed", [None, 3])
def test_choice_parses_calls_in_the_answer_only_streamed_or_not(case: int, seed: int | None
                                                                 ) -> None:
    fmt, reasoning, text = CHOICE_CASES[case]
    whole = choice(fmt, reasoning)
    whole.add(text)
    whole.finish("stop")
    body = whole.body("stop")
    message = body["message"]
    expected_reasoning, answer = split_reasoning(reasoning, text)
    assert message["reasoning_content"] == expected_reasoning
    assert (message["content"], [(c.name, c.arguments) for c in whole.tools.calls]) == (
        parse_tool_calls(fmt, answer, SCHEMAS)[0],
        [(c.name, c.arguments) for c in parse_tool_calls(fmt, answer, SCHEMAS)[1]])
    assert len(message["tool_calls"]) == 1 and body["finish_reason"] == "tool_calls"

    streamed = choice(fmt, reasoning)
    deltas = [streamed.add(p) for p in pieces_of(text, None if seed is None else
                                                   random.Random(seed))]
    deltas.append(streamed.finish("stop"))
    chunks = [chat_chunk(d)["delta"] for d in deltas]
    assert "".join(c.get("reasoning_content", "") for c in chunks) == expected_reasoning
    assert "".join(c.get("content", "") for c in chunks) == (message["content"] or "")
    heads = [t for c in chunks for t in c.get("tool_calls", []) if "id" in t]
    assert [h["function"]["name"] for h in heads] == [
        t["function"]["name"] for t in message["tool_calls"]]
    assert deltas[-1].finish_reason == "tool_calls"


def test_without_a_reasoning_parser_the_thinking_is_content() -> None:
    out = choice(None, None)
    out.add("<think>x</think>y")
    out.finish("stop")
    assert out.body("stop")["message"] == {"role": "assistant", "content": "<think>x</think>y"}
