"""Test doubles for the agent API: a unified server whose model output is scripted.

Random weights never emit a tool call, so tests script the output with the engine's
`ForcedTokens` constraint (pdcache.engine.constraints). It is installed by `ScriptedBridge`,
a test-only `EngineBridge` subclass that the fixture builds the app around: a request takes
the next queued script, if any. No HTTP field and no config key reaches it, so a normal
server cannot be made to force tokens (docs/tools.md).
"""

from __future__ import annotations

from collections import deque
from typing import Any

from pdcache.engine.api import SamplingParams
from pdcache.engine.config import CacheConfig
from pdcache.engine.constraints import ForcedTokens
from pdcache.engine.engine import Engine
from pdcache.server.app import server_metrics
from pdcache.server.bridge import EngineBridge, EngineRequest, Generation, ServerConfig
from pdcache.server.routes import ServerRoutes, build_app
from tests.router_support import PAGE, ThreadedServer

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The weather in a city",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string", "maxLength": 8}},
                "required": ["city"],
                "additionalProperties": False,
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "get_time",
            "description": "The time in a zone",
            "parameters": {
                "type": "object",
                "properties": {"zone": {"enum": ["UTC", "CET"]}},
                "required": ["zone"],
                "additionalProperties": False,
            },
        },
    },
]
TOOL_NAMES = {"get_weather", "get_time"}


class ScriptedBridge(EngineBridge):
    """An `EngineBridge` whose next submissions output the queued token scripts exactly
    (`ForcedTokens`); without a queued script a request runs as it would. Event loop only."""

    def __init__(self, engine: Engine, config: ServerConfig) -> None:
        super().__init__(engine, config, server_metrics(engine, config.name, config.role))
        self.scripts: deque[list[int]] = deque()

    def script(self, *outputs: list[int]) -> None:
        self.scripts.extend(outputs)

    def submit(
        self,
        gen: Generation,
        input_ids: list[int],
        sampling: SamplingParams,
        salt: str | None,
        rid: str | None = None,
        **fields: Any,
    ) -> EngineRequest:
        if self.scripts:
            fields["constraint"] = ForcedTokens(self.scripts.popleft())
        return super().submit(gen, input_ids, sampling, salt, rid, **fields)


class ScriptedNode:
    """A real unified server (uvicorn, loopback) around its own `tiny` engine and a
    `ScriptedBridge`; `script(ids...)` queues outputs."""

    def __init__(
        self,
        name: str = "u0",
        device_pages: int = 512,
        tool_call_parser: str = "hermes",
        reasoning_parser: str | None = None,
    ) -> None:
        self.engine = Engine.from_spec(
            "tiny", cache=CacheConfig(page_size=PAGE, num_device_pages=device_pages)
        )
        config = ServerConfig(
            name=name,
            request_timeout_s=60,
            tool_call_parser=tool_call_parser,
            reasoning_parser=reasoning_parser,
        )
        self.bridge = ScriptedBridge(self.engine, config)
        self.tokenizer = self.engine.tokenizer
        app = build_app(
            ServerRoutes(self.bridge),
            on_startup=self.engine.start,
            on_shutdown=self.engine.shutdown,
        )
        self.server = ThreadedServer(app)
        self.url = self.server.url

    def script(self, *texts: str) -> list[list[int]]:
        """Queue one output per text: its bytes, then the end of the assistant turn."""
        outputs = [[*self.tokenizer.encode(t), self.tokenizer.im_end_id] for t in texts]
        self.bridge.script(*outputs)
        return outputs

    def stop(self) -> None:
        self.server.stop()


def tool_call_text(name: str, arguments: str) -> str:
    """What a Hermes/Qwen model writes to call a tool (our template's format)."""
    return f'<tool_call>\n{{"name": "{name}", "arguments": {arguments}}}\n</tool_call>'


def reassemble(chunks: list[Any]) -> tuple[str, list[dict[str, str]], list[str | None]]:
    """(content, tool calls, finish reasons) of an openai-client chat stream, reassembled the
    way OpenAI's docs do it: a call's first delta has its id and name, later ones append
    arguments."""
    content, calls, reasons = "", {}, []
    for chunk in chunks:
        for choice in chunk.choices:
            delta = choice.delta
            content += delta.content or ""
            for call in delta.tool_calls or []:
                if call.id is not None:
                    assert call.type == "function" and call.function.name
                    assert call.index not in calls
                    calls[call.index] = {
                        "id": call.id,
                        "name": call.function.name,
                        "arguments": call.function.arguments or "",
                    }
                else:
                    assert call.function.name is None
                    calls[call.index]["arguments"] += call.function.arguments or ""
            if choice.finish_reason is not None:
                reasons.append(choice.finish_reason)
    return content, [calls[i] for i in sorted(calls)], reasons
