"""Reasoning and the family tool-call formats on a unified server, through the official
`openai` client (scripted model output: tests.agent_support.ScriptedBridge): the thinking as
`reasoning_content`, streamed and not, calls parsed from the answer only; the next turn's cache
chain when the client sends the thinking back (and what dropping it costs); and the
`reasoning_parser` setting, from the topology, the flags and the router's, an unknown name
refused with the list of names."""

from __future__ import annotations

import argparse
import json
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

openai = pytest.importorskip("openai")

from pdcache.config import add_node_flags, add_topology_arguments, node_from_args  # noqa: E402
from pdcache.config.node_setup import setup_for  # noqa: E402
from pdcache.config.parse import parse_topology  # noqa: E402
from pdcache.config.schema import TopologyError  # noqa: E402
from pdcache.engine.loader import load_model_config  # noqa: E402
from pdcache.engine.tokenizer import ByteTokenizer  # noqa: E402
from pdcache.router.app import create_app  # noqa: E402
from pdcache.router.config import RouterConfig  # noqa: E402
from pdcache.router.nodes import NodeEndpoint  # noqa: E402
from pdcache.server.bridge import ServerConfig  # noqa: E402
from pdcache.wire.agent import AgentFeatures  # noqa: E402
from pdcache.wire.protocol import ChatCompletionRequest  # noqa: E402
from pdcache.wire.reasoning import (  # noqa: E402
    reasoning_format,
    template_reads_reasoning,
    with_reasoning_history,
)
from tests.agent_support import TOOLS, ScriptedNode, tool_call_text  # noqa: E402
from tests.router_support import PAGE, RouterUnderTest, page_floor  # noqa: E402

THINKING = "<think>\nThe user asks about Paris. Weather questions need a lookup; answer short.\n"
QWEN3_OUTPUT = THINKING + "</think>\n\nIt is usually mild in Paris."


def ask(topic: str) -> list[dict[str, Any]]:
    # every test its own conversation, so no test hits the pages of another
    return [{"role": "system", "content": "You are terse."},
            {"role": "user", "content": f"({topic}) What is the weather in Paris?"}]


def client_for(node: ScriptedNode | httpx.Client) -> Any:
    url = node.url if isinstance(node, ScriptedNode) else node.base_url
    return openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0,
                         http_client=httpx.Client(trust_env=False, timeout=60))


@pytest.fixture(scope="module")
def qwen3() -> Iterator[ScriptedNode]:
    """Qwen3's formats: hermes calls (the byte template's), qwen3 thinking."""
    started = ScriptedNode("u0", tool_call_parser="hermes", reasoning_parser="qwen3")
    try:
        yield started
    finally:
        started.stop()
    started.engine.check_accounting()


@pytest.fixture(scope="module")
def coder() -> Iterator[ScriptedNode]:
    """Qwen3-Coder's calls with DeepSeek-R1's thinking (the template opened `<think>`)."""
    started = ScriptedNode("u1", tool_call_parser="qwen3_coder", reasoning_parser="deepseek-r1")
    try:
        yield started
    finally:
        started.stop()
    started.engine.check_accounting()


@pytest.fixture(scope="module")
def router(qwen3: ScriptedNode) -> Iterator[httpx.Client]:
    """A router with its own reasoning parser in front of the qwen3 node (which then only
    returns ids: the router parses)."""
    config = RouterConfig(nodes=(NodeEndpoint("u0", "unified", qwen3.url),), page_size=PAGE,
                          request_timeout_s=60, health_interval_s=30, reasoning_parser="qwen3")
    with RouterUnderTest(create_app(config)) as client:
        yield client


def reasoning_of(message_or_delta: Any) -> str | None:
    return getattr(message_or_delta, "reasoning_content", None)


def stream_parts(chunks: list[Any]) -> tuple[str, str, list[tuple[str, str]], list[str]]:
    """(reasoning, content, calls as (name, arguments), finish reasons) of a chat stream."""
    reasoning, content, calls, reasons = "", "", {}, []
    for chunk in chunks:
        for choice in chunk.choices:
            reasoning += reasoning_of(choice.delta) or ""
            content += choice.delta.content or ""
            for call in choice.delta.tool_calls or []:
                name, args = calls.get(call.index, ("", ""))
                calls[call.index] = (call.function.name or name,
                                     args + (call.function.arguments or ""))
            if choice.finish_reason is not None:
                reasons.append(choice.finish_reason)
    return reasoning, content, [calls[i] for i in sorted(calls)], reasons


# --------------------------------------------------------------------------- the answer


def test_thinking_is_reasoning_content_streamed_and_not(qwen3: ScriptedNode) -> None:
    client = client_for(qwen3)
    qwen3.script(QWEN3_OUTPUT, QWEN3_OUTPUT)
    whole = client.chat.completions.create(model="m", messages=ask("split"), max_tokens=300)
    message = whole.choices[0].message
    assert reasoning_of(message) == THINKING.removeprefix("<think>")
    assert message.content == "\n\nIt is usually mild in Paris."
    assert whole.choices[0].finish_reason == "stop"
    chunks = list(client.chat.completions.create(model="m", messages=ask("split"),
                                                 max_tokens=300, stream=True))
    reasoning, content, calls, reasons = stream_parts(chunks)
    assert (reasoning, content, calls, reasons) == (reasoning_of(message), message.content, [],
                                                    ["stop"])
    assert sum(1 for c in chunks if c.choices and reasoning_of(c.choices[0].delta)) >= 1


def test_calls_are_parsed_from_the_answer_and_the_stream_matches(qwen3: ScriptedNode) -> None:
    client = client_for(qwen3)
    # the thinking may name a tool; only the answer's calls are parsed
    text = (THINKING + "Maybe get_time too?\n</think>\n\nChecking.\n"
            + tool_call_text("get_weather", '{"city": "Paris"}'))
    qwen3.script(text, text)
    whole = client.chat.completions.create(model="m", messages=ask("calls"), tools=TOOLS,
                                           max_tokens=400)
    choice = whole.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content == "\n\nChecking."
    [call] = choice.message.tool_calls
    assert (call.function.name, json.loads(call.function.arguments)) == (
        "get_weather", {"city": "Paris"})
    thinking = THINKING.removeprefix("<think>") + "Maybe get_time too?\n"
    assert reasoning_of(choice.message) == thinking
    chunks = list(client.chat.completions.create(model="m", messages=ask("calls"), tools=TOOLS,
                                                 max_tokens=400, stream=True))
    assert stream_parts(chunks) == (reasoning_of(choice.message), "\n\nChecking.",
                                    [("get_weather", call.function.arguments)], ["tool_calls"])


def test_separate_reasoning_false_leaves_the_thinking_in_the_content(qwen3: ScriptedNode
                                                                     ) -> None:
    qwen3.script(QWEN3_OUTPUT)
    out = client_for(qwen3).chat.completions.create(
        model="m", messages=ask("unsplit"), max_tokens=300,
        extra_body={"separate_reasoning": False})
    assert out.choices[0].message.content == QWEN3_OUTPUT
    assert reasoning_of(out.choices[0].message) is None


def test_coder_calls_through_the_server_with_typed_arguments(coder: ScriptedNode) -> None:
    client = client_for(coder)
    text = ("The user wants Paris; call get_weather.\n</think>\n\n"
            "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n"
            "</function>\n</tool_call>\n<tool_call>\n<function=get_time>\n<parameter=zone>\nCET\n"
            "</parameter>\n</function>\n</tool_call>")
    coder.script(text, text)
    whole = client.chat.completions.create(model="m", messages=ask("coder"), tools=TOOLS,
                                           max_tokens=400)
    message = whole.choices[0].message
    assert reasoning_of(message) == "The user wants Paris; call get_weather.\n"
    assert message.content is None and whole.choices[0].finish_reason == "tool_calls"
    assert [(c.function.name, json.loads(c.function.arguments)) for c in message.tool_calls] == [
        ("get_weather", {"city": "Paris"}), ("get_time", {"zone": "CET"})]
    chunks = list(client.chat.completions.create(model="m", messages=ask("coder"), tools=TOOLS,
                                                 max_tokens=400, stream=True))
    assert stream_parts(chunks) == (
        reasoning_of(message), "",
        [(c.function.name, c.function.arguments) for c in message.tool_calls], ["tool_calls"])


def test_malformed_coder_call_stays_content(coder: ScriptedNode) -> None:
    broken = "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</tool_call>"
    coder.script("ok</think>" + broken)
    out = client_for(coder).chat.completions.create(model="m", messages=ask("broken"),
                                                    tools=TOOLS, max_tokens=300)
    assert out.choices[0].message.content == broken and not out.choices[0].message.tool_calls
    assert out.choices[0].finish_reason == "stop"


def test_reasoning_content_only_on_assistant_messages(qwen3: ScriptedNode) -> None:
    messages = [{"role": "user", "content": "hi", "reasoning_content": "x"}]
    response = httpx.post(f"{qwen3.url}/v1/chat/completions", json={"messages": messages},
                          timeout=60, trust_env=False)
    assert response.status_code == 400
    assert response.json()["error"]["param"] == "messages[0].reasoning_content"


def test_model_info_names_the_reasoning_parser(qwen3: ScriptedNode) -> None:
    info = httpx.get(f"{qwen3.url}/get_model_info", timeout=10, trust_env=False).json()
    assert (info["reasoning_parser"], info["tool_call_parser"]) == ("qwen3", "hermes")


# --------------------------------------------------------------------------- the next turn


def prompt_ids(tokenizer: ByteTokenizer, agent: AgentFeatures,
               messages: list[dict[str, Any]]) -> list[int]:
    """The prompt the server renders (its `AgentFeatures.chat_messages`, then the template)."""
    body = ChatCompletionRequest.model_validate({"messages": messages})
    return tokenizer.apply_chat_template(agent.chat_messages(body), add_generation_prompt=True)


@pytest.mark.parametrize(("parser", "output"), [
    ("qwen3", QWEN3_OUTPUT),
    ("deepseek-r1", QWEN3_OUTPUT),  # R1-0528 writes the open tag itself
    ("qwen3", "No thinking this time."),
])
def test_turn_two_prompt_extends_turn_one_prompt_and_output(parser: str, output: str) -> None:
    """Token level: with the thinking sent back, the assistant turn re-renders to the ids
    decode produced (the byte template knows no thinking: it gets `<think>...</think>` in
    the content), so turn 1's prompt + output ids are a prefix of turn 2's prompt."""
    tokenizer = ByteTokenizer()
    agent = AgentFeatures(tokenizer, tokenizer.vocab_size, "hermes", parser)
    first = ask("token level")
    prompt = prompt_ids(tokenizer, agent, first)
    produced = [*tokenizer.encode(output), tokenizer.im_end_id]
    out = agent.chat_plan(ChatCompletionRequest.model_validate({"messages": first})).output(0)
    out.add(output)
    out.finish("stop")
    message = out.body("stop")["message"]
    assert message.get("reasoning_content") is None or output.startswith("<think>")
    second = [*first, {k: v for k, v in message.items() if v is not None},
              {"role": "user", "content": "And tomorrow?"}]
    assert prompt_ids(tokenizer, agent, second)[: len(prompt) + len(produced)] == [
        *prompt, *produced]
    # the client that drops the thinking: the histories part where the thinking was
    dropped = [*first, {"role": "assistant", "content": message["content"]}, second[-1]]
    if message.get("reasoning_content") is not None:
        assert prompt_ids(tokenizer, agent, dropped)[len(prompt)] != produced[0]


def test_history_thinking_goes_where_the_template_reads_it() -> None:
    qwen3 = reasoning_format("qwen3")
    turn = [{"role": "assistant", "content": "\n\nA", "reasoning_content": "\nR\n"}]
    assert with_reasoning_history(turn, qwen3, native=True) == turn  # Qwen3's template
    assert with_reasoning_history(turn, qwen3, native=False) == [
        {"role": "assistant", "content": "<think>\nR\n</think>\n\nA"}]
    calls_only = [{"role": "assistant", "content": None, "reasoning_content": "R",
                   "tool_calls": []}]
    assert with_reasoning_history(calls_only, qwen3, native=False)[0]["content"] == (
        "<think>R</think>")
    # no reasoning parser: the deployment's model does not think; the field is dropped
    assert with_reasoning_history(turn, None, native=False) == [
        {"role": "assistant", "content": "\n\nA"}]

    class ThinkingTemplate:
        chat_template = "{{ message.reasoning_content }}"

    assert template_reads_reasoning(ThinkingTemplate())  # type: ignore[arg-type]
    assert not template_reads_reasoning(ByteTokenizer())


def test_next_turn_hits_the_answer_pages_only_with_the_thinking_sent_back(
    qwen3: ScriptedNode,
) -> None:
    client = client_for(qwen3)
    for kept in (True, False):
        first_messages = ask(f"chain kept={kept}")
        qwen3.script(QWEN3_OUTPUT, "Fine.")
        first = client.chat.completions.create(model="m", messages=first_messages,
                                               max_tokens=300)
        message = first.choices[0].message.model_dump(exclude_none=True)
        if not kept:
            message.pop("reasoning_content")
        second = client.chat.completions.create(
            model="m", messages=[*first_messages, message,
                                 {"role": "user", "content": "And tomorrow?"}], max_tokens=300)
        assert second.choices[0].message.content == "Fine."
        prompt = first.usage.prompt_tokens
        turn1 = prompt + first.usage.completion_tokens
        cached = second.usage.prompt_tokens_details.cached_tokens
        assert page_floor(turn1) > page_floor(prompt) + 16  # the answer spans whole pages
        if kept:
            assert cached >= page_floor(turn1)
        else:  # the hit ends where the histories part: the answer's pages are recomputed
            assert page_floor(prompt) <= cached < page_floor(turn1)


def test_router_splits_the_thinking_and_keeps_the_chain(qwen3: ScriptedNode,
                                                        router: httpx.Client) -> None:
    client = client_for(router)
    first_messages = ask("router")
    qwen3.script(QWEN3_OUTPUT, QWEN3_OUTPUT, "Fine.")
    first = client.chat.completions.create(model="m", messages=first_messages, max_tokens=300)
    message = first.choices[0].message
    assert (reasoning_of(message), message.content) == (
        THINKING.removeprefix("<think>"), "\n\nIt is usually mild in Paris.")
    chunks = list(client.chat.completions.create(model="m", messages=first_messages,
                                                 max_tokens=300, stream=True))
    assert stream_parts(chunks) == (reasoning_of(message), message.content, [], ["stop"])
    second = client.chat.completions.create(
        model="m", max_tokens=300,
        messages=[*first_messages, message.model_dump(exclude_none=True),
                  {"role": "user", "content": "And tomorrow?"}])
    turn1 = first.usage.prompt_tokens + first.usage.completion_tokens
    assert second.usage.prompt_tokens_details.cached_tokens >= page_floor(turn1)


# --------------------------------------------------------------------------- configuration

UNIFIED = """
[model]
preset = "tiny"

[cache]
device_pages = 128

[router]
port = 8000
{router}

[[node]]
name = "u0"
role = "unified"
port = 31000
{node}
"""


def node_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser()
    add_topology_arguments(parser)
    add_node_flags(parser, "unified")
    return parser


def test_reasoning_parser_key_and_flag_reach_the_server(tmp_path: Any) -> None:
    model = load_model_config("tiny")
    path = tmp_path / "t.toml"
    path.write_text(UNIFIED.format(router="", node='reasoning_parser = "deepseek-r1"'))
    args = node_parser().parse_args(["--config", str(path), "--node", "u0"])
    setup = setup_for(*_topology_and_name(args), model)
    assert ServerConfig.of(setup).reasoning_parser == "deepseek-r1"
    args = node_parser().parse_args(["--config", str(path), "--node", "u0",
                                     "--reasoning-parser", "qwen3"])
    assert setup_for(*_topology_and_name(args), model).server.reasoning_parser == "qwen3"
    path.write_text(UNIFIED.format(router="", node=""))
    args = node_parser().parse_args(["--config", str(path), "--node", "u0"])
    assert setup_for(*_topology_and_name(args), model).server.reasoning_parser is None
    flag = node_parser()._option_string_actions["--reasoning-parser"]
    assert set(flag.choices) == {"deepseek-r1", "qwen3", "gpt-oss"}


def _topology_and_name(args: argparse.Namespace) -> tuple[Any, str]:
    topology, node = node_from_args(args, ["unified"])
    return topology, node.name


@pytest.mark.parametrize(("router", "node"), [("", 'reasoning_parser = "deepseek_r1"'),
                                              ('reasoning_parser = "r1"', "")])
def test_unknown_reasoning_parser_is_refused_with_the_names(router: str, node: str) -> None:
    with pytest.raises(TopologyError, match="reasoning_parser.*deepseek-r1, qwen3"):
        parse_topology(UNIFIED.format(router=router, node=node), "t.toml", ())


def test_unknown_parser_names_fail_the_server_and_the_flags() -> None:
    with pytest.raises(SystemExit):
        node_parser().parse_args(["--reasoning-parser", "qwen2"])
    tokenizer = ByteTokenizer()
    with pytest.raises(ValueError, match="deepseek-r1, gpt-oss, qwen3"):
        AgentFeatures(tokenizer, tokenizer.vocab_size, "hermes", "qwen2")


def test_router_reasoning_parser_flag_and_key(tmp_path: Any) -> None:
    from pdcache.router.cli import add_arguments, build_config

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    assert build_config(parser.parse_args(["--unified", "127.0.0.1:1"]))[0].reasoning_parser is None
    args = parser.parse_args(["--unified", "127.0.0.1:1", "--reasoning-parser", "qwen3",
                              "--tool-call-parser", "qwen3_coder"])
    config = build_config(args)[0]
    assert (config.reasoning_parser, config.tool_call_parser) == ("qwen3", "qwen3_coder")
    path = tmp_path / "t.toml"
    path.write_text(UNIFIED.format(router='reasoning_parser = "deepseek-r1"', node=""))
    config = build_config(parser.parse_args(["--config", str(path), "--node", "router"]))[0]
    assert config.reasoning_parser == "deepseek-r1"


@pytest.mark.parametrize("through", ["node", "router"])
def test_chat_template_kwargs_are_accepted_and_the_servers_own_refused(
        qwen3: ScriptedNode, router: httpx.Client, through: str) -> None:
    """`chat_template_kwargs` ({"enable_thinking": false}) reaches the template (the byte
    template reads none: the prompt is unchanged) on a node and through the router; a key the
    server sets itself is a 400 naming the parameter."""
    client = httpx.Client(base_url=qwen3.url, timeout=60) if through == "node" else router
    qwen3.script("It is mild.")
    body = {"model": "m", "messages": ask(f"kwargs-{through}"), "max_tokens": 32,
            "chat_template_kwargs": {"enable_thinking": False}}
    answer = client.post("/v1/chat/completions", json=body)
    assert answer.status_code == 200, answer.text
    assert answer.json()["choices"][0]["message"]["content"] == "It is mild."
    bad = client.post("/v1/chat/completions",
                      json={**body, "chat_template_kwargs": {"messages": []}})
    assert bad.status_code == 400
    assert bad.json()["error"]["param"] == "chat_template_kwargs"
