"""gpt-oss's harmony format through a real unified server and the official `openai` client: a
`tiny-gpt-oss` node with the presets' harmony template (pdcache.engine.presets.preset_tokenizer)
and the `gpt-oss` reasoning and tool-call parsers, its output scripted (tests.agent_support
.ScriptedBridge: ForcedTokens). The analysis comes back as `reasoning_content`, the final
answer as the content, commentary calls as `tool_calls`, streamed and not; and sending the
answer back keeps the next turn's cache chain: turn 2 hits the pages of turn 1's answer."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import pytest

openai = pytest.importorskip("openai")

from pdcache.engine.config import CacheConfig  # noqa: E402
from pdcache.engine.engine import Engine  # noqa: E402
from pdcache.engine.harmony import HarmonyByteTokenizer  # noqa: E402
from pdcache.server.bridge import ServerConfig  # noqa: E402
from pdcache.server.routes import ServerRoutes, build_app  # noqa: E402
from tests.agent_support import TOOLS, ScriptedBridge  # noqa: E402
from tests.router_support import PAGE, ThreadedServer, page_floor  # noqa: E402

ANALYSIS = ("<|channel|>analysis<|message|>The user asks about Paris. Weather questions need "
            "a lookup: call get_weather, then answer in one short sentence.<|end|>")
CALL = ("<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json"
        '<|message|>{"city":"Paris"}<|call|>')
FINAL = "<|start|>assistant<|channel|>final<|message|>It is sunny in Paris.<|return|>"


class HarmonyNode:
    """A real unified server (uvicorn, loopback) around a `tiny-gpt-oss` engine with the
    harmony byte template and a `ScriptedBridge`; `script(texts...)` queues outputs."""

    def __init__(self) -> None:
        self.engine = Engine.from_spec(
            "tiny-gpt-oss", cache=CacheConfig(page_size=PAGE, num_device_pages=512))
        assert isinstance(self.engine.tokenizer, HarmonyByteTokenizer)  # the preset's own
        config = ServerConfig(name="u0", request_timeout_s=60, tool_call_parser="gpt-oss",
                              reasoning_parser="gpt-oss")
        self.bridge = ScriptedBridge(self.engine, config)
        app = build_app(ServerRoutes(self.bridge), on_startup=self.engine.start,
                        on_shutdown=self.engine.shutdown)
        self.server = ThreadedServer(app)
        self.url = self.server.url

    def script(self, *texts: str) -> None:
        """One output per text: its bytes, then an end-of-sequence id (the byte presets'
        stand-in for `<|return|>` / `<|call|>`, which the decoder drops as gpt-oss's are)."""
        tokenizer = self.engine.tokenizer
        self.bridge.script(*([*tokenizer.encode(t), tokenizer.im_end_id] for t in texts))

    def stop(self) -> None:
        self.server.stop()


@pytest.fixture(scope="module")
def node() -> Iterator[HarmonyNode]:
    started = HarmonyNode()
    try:
        yield started
    finally:
        started.stop()
    started.engine.check_accounting()


def client_for(node: HarmonyNode) -> Any:
    return openai.OpenAI(base_url=f"{node.url}/v1", api_key="unused", max_retries=0,
                         http_client=httpx.Client(trust_env=False, timeout=60))


def ask(topic: str) -> list[dict[str, Any]]:
    return [{"role": "system", "content": "You are terse."},
            {"role": "user", "content": f"({topic}) What is the weather in Paris?"}]


def stream_parts(chunks: list[Any]) -> tuple[str, str, list[tuple[str, str]], list[str]]:
    """(reasoning, content, calls as (name, arguments), finish reasons) of a chat stream."""
    reasoning, content, calls, reasons = "", "", {}, []
    for chunk in chunks:
        for choice in chunk.choices:
            reasoning += getattr(choice.delta, "reasoning_content", None) or ""
            content += choice.delta.content or ""
            for call in choice.delta.tool_calls or []:
                name, args = calls.get(call.index, ("", ""))
                calls[call.index] = (call.function.name or name,
                                     args + (call.function.arguments or ""))
            if choice.finish_reason is not None:
                reasons.append(choice.finish_reason)
    return reasoning, content, [calls[i] for i in sorted(calls)], reasons


REASONING = ANALYSIS.removeprefix("<|channel|>analysis<|message|>").removesuffix("<|end|>")


@pytest.mark.parametrize(("output", "content", "calls", "reason"), [
    (ANALYSIS + FINAL, "It is sunny in Paris.", [], "stop"),
    (ANALYSIS + CALL, None, [("get_weather", '{"city":"Paris"}')], "tool_calls"),
])
def test_channels_streamed_and_not(node: HarmonyNode, output: str, content: str | None,
                                   calls: list[tuple[str, str]], reason: str) -> None:
    client = client_for(node)
    node.script(output, output)
    answer = client.chat.completions.create(model="m", messages=ask("channels"), tools=TOOLS,
                                            max_tokens=400)
    message = answer.choices[0].message
    assert getattr(message, "reasoning_content", None) == REASONING
    assert message.content == content
    assert [(c.function.name, c.function.arguments) for c in message.tool_calls or []] == calls
    assert answer.choices[0].finish_reason == reason
    chunks = list(client.chat.completions.create(model="m", messages=ask("channels"),
                                                 tools=TOOLS, max_tokens=400, stream=True))
    assert stream_parts(chunks) == (REASONING, content or "", calls, [reason])


def test_next_turn_hits_the_answer_pages_only_with_the_analysis_sent_back(
    node: HarmonyNode,
) -> None:
    """Turn 1 calls a tool; its message and the tool's result go back; turn 2's prompt
    re-renders turn 1's answer as generated, so the hit covers turn 1's prompt and answer.
    A client that drops `reasoning_content` parts the histories at the analysis."""
    client = client_for(node)
    for kept in (True, False):
        first_messages = ask(f"chain kept={kept}")
        node.script(ANALYSIS + CALL, ANALYSIS + FINAL)
        first = client.chat.completions.create(model="m", messages=first_messages,
                                               tools=TOOLS, max_tokens=400)
        message = first.choices[0].message.model_dump(exclude_none=True)
        if not kept:
            message.pop("reasoning_content")
        reply = {"role": "tool", "tool_call_id": message["tool_calls"][0]["id"],
                 "content": "sunny"}
        second = client.chat.completions.create(
            model="m", messages=[*first_messages, message, reply], tools=TOOLS, max_tokens=400)
        assert second.choices[0].message.content == "It is sunny in Paris."
        prompt = first.usage.prompt_tokens
        turn1 = prompt + first.usage.completion_tokens  # the last (end-of-sequence) id unfed
        cached = second.usage.prompt_tokens_details.cached_tokens
        assert page_floor(turn1 - 1) > page_floor(prompt) + PAGE  # the answer spans pages
        if kept:
            assert cached >= page_floor(turn1 - 1)
        else:  # the hit ends at the last whole page before the parting (`<|channel|>` on)
            assert cached == page_floor(prompt + len("<|channel|>"))
