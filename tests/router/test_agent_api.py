"""The agent API through the router, with the official `openai` client, in front of a real
unified node whose output is scripted (tests.agent_support.ScriptedNode): tool calls parsed
from the node's ids, streamed calls reassembling to the non-streamed ones, a tool loop that
keeps its cache chain (the resent assistant turn maps back to the produced ids), n choices
with the prompt counted once, logprobs, json_schema and forced tool calls built on the node,
and 400s naming what is still unsupported."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

openai = pytest.importorskip("openai")

from pdcache.router.app import create_app  # noqa: E402
from pdcache.router.config import RouterConfig  # noqa: E402
from pdcache.router.nodes import NodeEndpoint  # noqa: E402
from tests.agent_support import TOOLS, ScriptedNode, reassemble, tool_call_text  # noqa: E402
from tests.router_support import PAGE, RouterUnderTest, page_floor, prompt  # noqa: E402

ASK = [{"role": "user", "content": "Weather in Paris, then the time in UTC?"}]
# written as a model would, not as the template re-renders it ("Checking.\n<tool_call>" with
# the arguments' tojson spacing): only the router's exact history keeps the chain
CALL = "Checking. " + tool_call_text("get_weather", '{"city":"Paris"}')


@pytest.fixture(scope="module")
def node() -> Iterator[ScriptedNode]:
    started = ScriptedNode("u0")
    try:
        yield started
    finally:
        started.stop()


@pytest.fixture(scope="module")
def router(node: ScriptedNode) -> Iterator[httpx.Client]:
    config = RouterConfig(
        nodes=(NodeEndpoint("u0", "unified", node.url),),
        page_size=PAGE,
        request_timeout_s=60,
        health_interval_s=30,
    )
    with RouterUnderTest(create_app(config)) as client:
        yield client


@pytest.fixture(scope="module")
def client(router: httpx.Client) -> Any:
    return openai.OpenAI(
        base_url=f"{router.base_url}/v1",
        api_key="unused",
        max_retries=0,
        http_client=httpx.Client(trust_env=False, timeout=60),
    )


def tool_loop(node: ScriptedNode, client: Any, session: str | None) -> tuple[Any, Any]:
    extra = {"session_id": session} if session else {}
    node.script(CALL, "It is sunny.")
    first = client.chat.completions.create(
        model="m", messages=ASK, tools=TOOLS, max_tokens=200, extra_body=extra
    )
    message = first.choices[0].message
    history = [
        *ASK,
        message.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": message.tool_calls[0].id, "content": "sunny"},
    ]
    second = client.chat.completions.create(
        model="m", messages=history, tools=TOOLS, max_tokens=200, extra_body=extra
    )
    return first, second


@pytest.mark.parametrize("session", ["loop-1", None])
def test_tool_loop_keeps_its_cache_chain_through_the_session(
    node: ScriptedNode, client: Any, session: str | None
) -> None:
    first, second = tool_loop(node, client, session)
    choice = first.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content == "Checking."
    [call] = choice.message.tool_calls
    assert call.id.startswith("call_")
    assert (call.function.name, json.loads(call.function.arguments)) == (
        "get_weather",
        {"city": "Paris"},
    )
    assert second.choices[0].message.content == "It is sunny."
    turn1 = first.usage.prompt_tokens + first.usage.completion_tokens
    cached = second.usage.prompt_tokens_details.cached_tokens
    if session:  # the assistant turn is the ids the model produced: prompt + answer cached
        assert cached >= page_floor(turn1)
        assert second.usage.prompt_tokens > turn1
    else:  # the protection off: re-rendered, the answer differs from what was produced
        assert page_floor(first.usage.prompt_tokens) <= cached < page_floor(turn1)


def test_streamed_tool_calls_through_the_router_equal_the_non_streamed(
    node: ScriptedNode, client: Any
) -> None:
    text = tool_call_text("get_time", '{"zone": "CET"}')
    node.script(text, text)
    whole = client.chat.completions.create(model="m", messages=ASK, tools=TOOLS, max_tokens=200)
    content, calls, reasons = reassemble(
        list(
            client.chat.completions.create(
                model="m", messages=ASK, tools=TOOLS, max_tokens=200, stream=True
            )
        )
    )
    [call] = whole.choices[0].message.tool_calls
    assert (content, reasons) == ("", ["tool_calls"])
    assert [(c["name"], c["arguments"]) for c in calls] == [
        (call.function.name, call.function.arguments)
    ]


def test_n2_through_the_router_counts_the_prompt_once(router: httpx.Client) -> None:
    """Two node requests; the usage has the prompt once. A unified node caches choice 0's
    prompt when choice 0 ends, so choice 1 (sent at choice 0's first token) may or may not
    find it: computed tokens lie between the prompt once and twice (P/D: tests/pd)."""
    ids = prompt(2 * PAGE + 7, 3)
    out = router.post(
        "/v1/completions",
        json={"prompt": ids, "n": 2, "max_tokens": 4, "temperature": 0, "ignore_eos": True},
    ).json()
    assert [c["index"] for c in out["choices"]] == [0, 1]
    assert out["choices"][0]["text"] == out["choices"][1]["text"]  # greedy
    assert out["usage"]["prompt_tokens"] == len(ids)
    assert out["usage"]["completion_tokens"] == 8
    assert len(ids) + 7 <= out["usage"]["computed_tokens"] <= 2 * len(ids)


def test_logprobs_and_penalties_are_forwarded(node: ScriptedNode, router: httpx.Client) -> None:
    """The router asks the node for SGLang's logprobs and reads them back from `meta_info`:
    equal to what the node itself answers, streamed or not."""
    body = {
        "messages": ASK,
        "max_tokens": 5,
        "temperature": 0,
        "logprobs": True,
        "top_logprobs": 2,
        "ignore_eos": True,
        "presence_penalty": 0.5,
    }
    direct = httpx.post(
        f"{node.url}/v1/chat/completions", json=body, trust_env=False, timeout=60
    ).json()["choices"][0]
    routed = router.post("/v1/chat/completions", json=body).json()["choices"][0]
    assert routed["message"] == direct["message"]

    def values(logprobs: dict) -> list:
        return [
            (
                e["token"],
                round(e["logprob"], 4),
                [round(t["logprob"], 4) for t in e["top_logprobs"]],
            )
            for e in logprobs["content"]
        ]

    assert len(routed["logprobs"]["content"]) == 5
    assert values(routed["logprobs"]) == values(direct["logprobs"])
    events = [
        json.loads(line[6:])
        for line in router.post("/v1/chat/completions", json={**body, "stream": True}).text.split(
            "\n"
        )
        if line.startswith("data: {")
    ]
    streamed = [
        e
        for ev in events
        for c in ev["choices"]
        if c.get("logprobs")
        for e in c["logprobs"]["content"]
    ]
    assert values({"content": streamed}) == values(direct["logprobs"])


SCHEMA = {
    "type": "object",
    "properties": {"answer": {"type": "string", "maxLength": 10}, "ok": {"type": "boolean"}},
    "required": ["answer", "ok"],
    "additionalProperties": False,
}


def test_json_schema_and_forced_tool_calls_are_built_on_the_node(router: httpx.Client) -> None:
    """The router sends SGLang's `sampling_params.json_schema`; the node constrains its
    random-weight output with it."""
    jsonschema = pytest.importorskip("jsonschema")
    out = router.post(
        "/v1/chat/completions",
        json={
            "messages": ASK,
            "temperature": 1.0,
            "seed": 4,
            "max_tokens": 200,
            "response_format": {
                "type": "json_schema",
                "json_schema": {"name": "r", "schema": SCHEMA},
            },
        },
    ).json()
    jsonschema.validate(json.loads(out["choices"][0]["message"]["content"]), SCHEMA)
    forced = router.post(
        "/v1/chat/completions",
        json={
            "messages": ASK,
            "tools": TOOLS,
            "temperature": 1.0,
            "seed": 5,
            "max_tokens": 200,
            "tool_choice": {"type": "function", "function": {"name": "get_time"}},
        },
    ).json()
    choice = forced["choices"][0]
    assert choice["finish_reason"] == "tool_calls", choice
    [call] = choice["message"]["tool_calls"]
    assert call["function"]["name"] == "get_time"
    jsonschema.validate(
        json.loads(call["function"]["arguments"]), TOOLS[1]["function"]["parameters"]
    )


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"logit_bias": {"1": 1.0}}, "logit_bias"),
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "x", "schema": {"type": 3}},
                }
            },
            "response_format",
        ),
    ],
)
def test_what_the_router_cannot_serve_is_a_400(
    router: httpx.Client, extra: dict[str, Any], param: str
) -> None:
    r = router.post("/v1/chat/completions", json={"messages": ASK, **extra})
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


def test_router_model_info_names_its_tool_call_parser(router: httpx.Client) -> None:
    assert router.get("/get_model_info").json()["tool_call_parser"] == "hermes"
