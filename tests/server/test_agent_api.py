"""The agent API on a unified server, through the official `openai` client: tool calls
(scripted model output: ForcedTokens via tests.agent_support.ScriptedBridge), streamed calls
reassembling to the non-streamed ones, the next turn's cache chain, forced tool calls and
json_schema with constrained decoding (random weights), logprobs equal to the engine's, n
choices with the prompt computed once, and 400s for what is still unsupported."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

openai = pytest.importorskip("openai")
jsonschema = pytest.importorskip("jsonschema")
pytest.importorskip("llguidance")

from pdcache.engine.api import GenerateRequest, LogprobRequest, SamplingParams  # noqa: E402
from tests.agent_support import (  # noqa: E402
    TOOLS,
    ScriptedNode,
    reassemble,
    tool_call_text,
)
from tests.numeric_support import nested_close  # noqa: E402
from tests.router_support import PAGE, page_floor, prompt  # noqa: E402

ASK = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "What is the weather in Paris?"},
]
CALL = tool_call_text("get_weather", '{"city": "Paris"}')


@pytest.fixture(scope="module")
def node() -> Iterator[ScriptedNode]:
    started = ScriptedNode("u0")
    try:
        yield started
    finally:
        started.stop()
    started.engine.check_accounting()


@pytest.fixture(scope="module")
def client(node: ScriptedNode) -> Any:
    return openai.OpenAI(
        base_url=f"{node.url}/v1",
        api_key="unused",
        max_retries=0,
        http_client=httpx.Client(trust_env=False, timeout=60),
    )


def post(node: ScriptedNode, path: str, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(f"{node.url}{path}", json=body, timeout=60, trust_env=False)


# --------------------------------------------------------------------------- tools


def test_tool_call_round_trip_and_the_next_turn_keeps_the_cache_chain(
    node: ScriptedNode, client: Any
) -> None:
    node.script("Checking.\n" + CALL)  # as the template re-renders it: the chain holds
    first = client.chat.completions.create(
        model="m", messages=ASK, tools=TOOLS, temperature=0, max_tokens=200
    )
    choice = first.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content == "Checking."
    [call] = choice.message.tool_calls
    assert call.id.startswith("call_") and call.type == "function"
    assert (call.function.name, json.loads(call.function.arguments)) == (
        "get_weather",
        {"city": "Paris"},
    )
    # turn 2: the assistant turn as the client re-sends it, then the tool's answer
    node.script("It is sunny.")
    history = [
        *ASK,
        choice.message.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": call.id, "content": "sunny, 21 C"},
    ]
    second = client.chat.completions.create(
        model="m", messages=history, tools=TOOLS, temperature=0, max_tokens=200
    )
    assert second.choices[0].message.content == "It is sunny."
    assert second.choices[0].finish_reason == "stop" and not second.choices[0].message.tool_calls
    turn1 = first.usage.prompt_tokens + first.usage.completion_tokens
    cached = second.usage.prompt_tokens_details.cached_tokens
    assert cached >= page_floor(turn1) > page_floor(first.usage.prompt_tokens)


def test_the_sdks_own_dump_of_an_answer_goes_back_as_the_next_turn(
    node: ScriptedNode, client: Any
) -> None:
    node.script("Checking.\n" + CALL)
    first = client.chat.completions.create(
        model="m", messages=ASK, tools=TOOLS, temperature=None, top_p=None, max_tokens=200
    )
    message = first.choices[0].message
    dumped = message.model_dump()  # refusal, annotations, audio, function_call: None
    assert {k for k, v in dumped.items() if v is None} >= {
        "refusal", "annotations", "audio", "function_call"}
    answer = {"role": "tool", "tool_call_id": message.tool_calls[0].id, "content": "sunny"}
    prompts = []
    for sent in (dumped, message.model_dump(exclude_none=True)):
        node.script("It is sunny.")
        second = client.chat.completions.create(
            model="m", messages=[*ASK, sent, answer], tools=TOOLS, temperature=0, max_tokens=200
        )
        assert second.choices[0].message.content == "It is sunny."
        prompts.append(second.usage.prompt_tokens)
    assert prompts[0] == prompts[1]  # the nulls leave the rendered prompt as it was


def test_streamed_tool_calls_reassemble_to_the_non_streamed_ones(
    node: ScriptedNode, client: Any
) -> None:
    text = CALL + "\n" + tool_call_text("get_time", '{"zone": "UTC"}')
    node.script(text, text)
    whole = client.chat.completions.create(model="m", messages=ASK, tools=TOOLS, max_tokens=200)
    chunks = list(
        client.chat.completions.create(
            model="m", messages=ASK, tools=TOOLS, max_tokens=200, stream=True
        )
    )
    content, calls, reasons = reassemble(chunks)
    message = whole.choices[0].message
    assert message.content is None and content == ""
    assert reasons == ["tool_calls"] == [whole.choices[0].finish_reason]
    assert [(c["name"], c["arguments"]) for c in calls] == [
        (c.function.name, c.function.arguments) for c in message.tool_calls
    ]
    assert [c["name"] for c in calls] == ["get_weather", "get_time"]
    assert len({c["id"] for c in calls}) == 2
    argument_chunks = sum(
        1 for ch in chunks for c in ch.choices[0].delta.tool_calls or [] if c.id is None
    )
    assert argument_chunks >= 2  # arguments streamed after each call's head


def test_tool_choice_none_leaves_the_text_alone(node: ScriptedNode, client: Any) -> None:
    node.script(CALL)
    out = client.chat.completions.create(
        model="m", messages=ASK, tools=TOOLS, tool_choice="none", max_tokens=200
    )
    assert out.choices[0].message.content == CALL and not out.choices[0].message.tool_calls
    assert out.choices[0].finish_reason == "stop"


def test_malformed_tool_call_stays_content(node: ScriptedNode, client: Any) -> None:
    broken = tool_call_text("get_weather", '{"city": "Par')
    node.script(broken)
    out = client.chat.completions.create(model="m", messages=ASK, tools=TOOLS, max_tokens=200)
    assert out.choices[0].message.content == broken and out.choices[0].finish_reason == "stop"


@pytest.mark.parametrize(
    "choice", ["required", {"type": "function", "function": {"name": "get_time"}}]
)
def test_forced_tool_call_is_constrained_with_random_weights(client: Any, choice: Any) -> None:
    out = client.chat.completions.create(
        model="m",
        messages=ASK,
        tools=TOOLS,
        tool_choice=choice,
        temperature=1.0,
        seed=3,
        max_tokens=300,
    )
    assert out.choices[0].finish_reason == "tool_calls", out.choices[0].message
    [call] = out.choices[0].message.tool_calls
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
    if isinstance(choice, dict):
        assert call.function.name == "get_time"
    jsonschema.validate(json.loads(call.function.arguments), schemas[call.function.name])


# --------------------------------------------------------------------------- structured output

SCHEMA = {
    "type": "object",
    "properties": {
        "answer": {"type": "string", "maxLength": 10},
        "score": {"enum": [1, 2, 3]},
        "ok": {"type": "boolean"},
    },
    "required": ["answer", "score", "ok"],
    "additionalProperties": False,
}


@pytest.mark.parametrize("seed", [0, 1])
def test_json_schema_output_validates_with_random_weights(client: Any, seed: int) -> None:
    out = client.chat.completions.create(
        model="m",
        messages=ASK,
        temperature=1.0,
        seed=seed,
        max_tokens=300,
        response_format={"type": "json_schema", "json_schema": {"name": "r", "schema": SCHEMA}},
    )
    assert out.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(out.choices[0].message.content), SCHEMA)


def test_unconstrained_output_is_not_json(client: Any) -> None:
    """The protection off: the same request without response_format is no JSON."""
    out = client.chat.completions.create(
        model="m", messages=ASK, temperature=1.0, seed=0, max_tokens=60
    )
    with pytest.raises(json.JSONDecodeError):
        json.loads(out.choices[0].message.content)


def test_json_object_is_a_json_object_or_a_valid_prefix(client: Any) -> None:
    out = client.chat.completions.create(
        model="m",
        messages=ASK,
        temperature=1.0,
        seed=2,
        max_tokens=120,
        response_format={"type": "json_object"},
    )
    text = out.choices[0].message.content
    assert text.startswith("{")
    if out.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(text), dict)


def test_response_format_text_is_plain(node: ScriptedNode, client: Any) -> None:
    node.script("plain")
    out = client.chat.completions.create(
        model="m", messages=ASK, max_tokens=20, response_format={"type": "text"}
    )
    assert out.choices[0].message.content == "plain"


# --------------------------------------------------------------------------- logprobs, n


def engine_logprobs(node: ScriptedNode, ids: list[int], n_tokens: int, top_n: int) -> list:
    outputs = node.engine.generate(
        GenerateRequest(
            "ref",
            ids,
            SamplingParams(max_new_tokens=n_tokens, ignore_eos=True),
            logprobs=LogprobRequest(top_n=top_n),
        ),
        timeout=60,
    )
    return [lp for out in outputs for lp in out.new_logprobs]


def test_chat_logprobs_equal_the_engines(node: ScriptedNode, client: Any) -> None:
    out = client.chat.completions.create(
        model="m",
        messages=ASK,
        temperature=0,
        max_tokens=6,
        logprobs=True,
        top_logprobs=3,
        extra_body={"ignore_eos": True},
    )
    ids = node.tokenizer.apply_chat_template(ASK)
    reference = engine_logprobs(node, ids, 6, 3)
    content = out.choices[0].logprobs.content
    assert len(content) == 6 == len(reference)
    for entry, ref in zip(content, reference, strict=True):
        text = node.tokenizer.decode([ref.token_id], skip_special_tokens=False)
        # the byte tokenizer: a byte token's bytes are its byte, even one of a partial character
        raw = [ref.token_id] if ref.token_id < 256 else list(text.encode())
        # the reference run hits the prefix cache: equal up to fp32 reduction order
        assert (entry.token, entry.bytes) == (text, raw)
        assert entry.logprob == pytest.approx(ref.logprob, abs=1e-4)
        assert [t.logprob for t in entry.top_logprobs] == pytest.approx(
            [lp for _, lp in ref.top], abs=1e-4
        )
        assert entry.top_logprobs[0].logprob == entry.logprob  # greedy: the top one


def test_completion_logprobs_equal_the_engines_streamed_or_not(node: ScriptedNode) -> None:
    ids = prompt(20, 5)
    body = {"prompt": ids, "max_tokens": 5, "temperature": 0, "logprobs": 2, "ignore_eos": True}
    whole = post(node, "/v1/completions", body).json()["choices"][0]["logprobs"]
    reference = engine_logprobs(node, ids, 5, 2)
    assert whole["token_logprobs"] == pytest.approx([r.logprob for r in reference], abs=1e-4)
    # partial characters are `bytes:\xNN` keys, so no two alternatives collide
    assert [list(d.values()) for d in whole["top_logprobs"]] == [
        pytest.approx([lp for _, lp in r.top], abs=1e-4) for r in reference
    ]
    events = sse_data(post(node, "/v1/completions", {**body, "stream": True}).text)
    streamed = [
        lp
        for e in events
        for c in e["choices"]
        if c["logprobs"]
        for lp in c["logprobs"]["token_logprobs"]
    ]
    offsets = [
        o
        for e in events
        for c in e["choices"]
        if c["logprobs"]
        for o in c["logprobs"]["text_offset"]
    ]
    # the streamed request reuses the first one's cached pages (tests/numeric_support.py)
    assert nested_close(streamed, whole["token_logprobs"]) and offsets == whole["text_offset"]


def sse_data(text: str) -> list[dict[str, Any]]:
    datas = [line[6:] for line in text.split("\n") if line.startswith("data: ")]
    assert datas[-1] == "[DONE]"
    return [json.loads(d) for d in datas[:-1]]


def test_n4_gives_four_choices_and_computes_the_prompt_once(node: ScriptedNode) -> None:
    ids = prompt(3 * PAGE + 5, 11)  # 3 full pages + 5 tokens: followers recompute only 5
    body = {
        "prompt": ids,
        "max_tokens": 6,
        "n": 4,
        "temperature": 0.8,
        "seed": 7,
        "ignore_eos": True,
    }
    out = post(node, "/v1/completions", body).json()
    assert [c["index"] for c in out["choices"]] == [0, 1, 2, 3]
    usage = out["usage"]
    assert usage["prompt_tokens"] == len(ids) and usage["completion_tokens"] == 24
    assert usage["computed_tokens"] == len(ids) + 3 * 5  # the prompt once
    assert len({c["text"] for c in out["choices"]}) > 1  # seed + index: different samples
    again = post(node, "/v1/completions", body).json()
    assert [c["text"] for c in again["choices"]] == [c["text"] for c in out["choices"]]


def test_streamed_n_interleaves_indexed_chunks(node: ScriptedNode) -> None:
    body = {
        "messages": ASK,
        "max_tokens": 5,
        "n": 3,
        "stream": True,
        "temperature": 0,
        "ignore_eos": True,
        "stream_options": {"include_usage": True},
    }
    events = sse_data(post(node, "/v1/chat/completions", body).text)
    by_index: dict[int, str] = {}
    finishes: dict[int, str] = {}
    for event in events[:-1]:
        [choice] = event["choices"]
        by_index[choice["index"]] = by_index.get(choice["index"], "") + choice["delta"].get(
            "content", ""
        )
        if choice["finish_reason"]:
            finishes[choice["index"]] = choice["finish_reason"]
    assert finishes == {0: "length", 1: "length", 2: "length"}
    assert len(set(by_index.values())) == 1  # greedy: the same text in every choice
    whole = post(
        node, "/v1/chat/completions", {**body, "stream": False, "stream_options": None}
    ).json()
    assert [c["message"]["content"] for c in whole["choices"]] == [by_index[i] for i in range(3)]
    assert events[-1]["usage"]["completion_tokens"] == 15


# --------------------------------------------------------------------------- still 400

STILL_UNSUPPORTED = [
    ({"messages": ASK, "logit_bias": {"1": 2.0}}, "logit_bias"),
    ({"messages": ASK, "n": 17}, "n"),
    ({"messages": ASK, "top_logprobs": 2}, "top_logprobs"),
    ({"messages": ASK, "top_logprobs": 21, "logprobs": True}, "top_logprobs"),
    ({"messages": ASK, "tool_choice": "auto"}, "tool_choice"),
    (
        {
            "messages": ASK,
            "tools": TOOLS,
            "tool_choice": {"type": "function", "function": {"name": "nope"}},
        },
        "tool_choice.function.name",
    ),
    ({"messages": ASK, "tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice"),
    ({"messages": ASK, "response_format": {"type": "json_schema"}}, "response_format.json_schema"),
    ({"messages": ASK, "response_format": {"type": "yaml"}}, "response_format.type"),
    (
        {
            "messages": ASK,
            "response_format": {
                "type": "json_schema",
                "json_schema": {"name": "x", "schema": {"type": 3}},
            },
        },
        "response_format",
    ),
    (
        {
            "messages": ASK,
            "tools": TOOLS,
            "tool_choice": "required",
            "response_format": {"type": "json_object"},
        },
        "response_format",
    ),
    ({"messages": [{"role": "tool", "content": "x"}]}, "messages[0].tool_call_id"),
    ({"messages": [{"role": "user", "content": "x", "tool_calls": []}]}, "messages[0].tool_calls"),
    (
        {"messages": ASK, "tools": [{"type": "function", "function": {"name": "bad name"}}]},
        "tools[0].function.name",
    ),
]


@pytest.mark.parametrize(("body", "param"), STILL_UNSUPPORTED)
def test_unsupported_values_are_400_naming_the_field(
    node: ScriptedNode, body: dict[str, Any], param: str
) -> None:
    response = post(node, "/v1/chat/completions", body)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param, response.json()
    ok = post(node, "/v1/chat/completions", {"messages": ASK, "max_tokens": 2})
    assert ok.status_code == 200


def test_completion_unsupported_values_are_400(node: ScriptedNode) -> None:
    for body, param in [
        ({"prompt": "x", "logprobs": 21}, "logprobs"),
        ({"prompt": "x", "echo": True}, "echo"),
        ({"prompt": "x", "n": 2, "best_of": 3}, "best_of"),
    ]:
        response = post(node, "/v1/completions", body)
        assert response.status_code == 400 and response.json()["error"]["param"] == param


def test_model_info_names_the_tool_call_parser(node: ScriptedNode) -> None:
    info = httpx.get(f"{node.url}/get_model_info", timeout=10, trust_env=False).json()
    assert info["tool_call_parser"] == "hermes"  # SGLang's field, as --tool-call-parser set it


def test_parallel_tool_calls_false_gives_one_call(node: ScriptedNode, client: Any) -> None:
    node.script(CALL + "\n" + tool_call_text("get_time", '{"zone": "UTC"}'))
    out = client.chat.completions.create(
        model="m", messages=ASK, tools=TOOLS, max_tokens=200, parallel_tool_calls=False
    )
    assert [c.function.name for c in out.choices[0].message.tool_calls] == ["get_weather"]
