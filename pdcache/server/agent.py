"""The agent API's per-request plan: which tool-call format parses a choice, which constraint
an engine request carries (`response_format` json, a forced tool call), which logprobs it asks
for and how they are written (docs/tools.md).

`AgentFeatures` is built once per server (and once in the router, without constraints: the
nodes build those) from the deployment's `tool_call_parser`; `chat_plan` / `completion_plan`
turn one validated request into a `ChoicePlan` that makes each of its `n` choices' parts.
Owns the server's `GrammarBackend` (built on the first constrained request).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from pdcache.engine.api import LogprobRequest, TokenConstraint, TokenLogprob
from pdcache.engine.tokenizer import ByteTokenizer, Tokenizer
from pdcache.server.bridge import EngineRequest, Generation
from pdcache.server.choices import ChoiceOutput, LogprobFormatter
from pdcache.server.logprobs import openai_chat_logprobs, openai_completion_logprobs
from pdcache.server.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    TextAssembler,
    bad_request,
)
from pdcache.server.structured import GrammarBackend, tool_calls_schema
from pdcache.server.tool_calls import Llama3Format, ToolCallFormat, tool_call_format


@dataclass
class ChoicePlan:
    """What every choice of one request shares; `output(i)` / `constraint()` make choice i's
    own parse state and grammar matcher (each choice needs its own)."""

    chat: bool
    logprobs: LogprobRequest | None = None
    tool_format: ToolCallFormat | None = None
    tool_names: set[str] = field(default_factory=set)
    max_calls: int | None = None  # parallel_tool_calls: false -> 1
    make_constraint: Callable[[], TokenConstraint] | None = None
    format_logprobs: LogprobFormatter | None = None

    def constraint(self) -> TokenConstraint | None:
        return None if self.make_constraint is None else self.make_constraint()

    def output(self, index: int) -> ChoiceOutput:
        return ChoiceOutput(
            index,
            chat=self.chat,
            tool_format=self.tool_format,
            tool_names=self.tool_names,
            max_calls=self.max_calls,
            format_logprobs=self.format_logprobs,
        )


@dataclass
class ChoiceRun:
    """One submitted choice: its engine request, what it produced, its OpenAI output."""

    handle: EngineRequest
    gen: Generation
    text: TextAssembler
    output: ChoiceOutput

    def new_logprobs(self) -> list[TokenLogprob]:
        """The logprobs that arrived since the previous call."""
        return self.gen.take_logprobs()


class AgentFeatures:
    """The deployment's tool-call format and grammar backend, and the plans they make."""

    def __init__(self, tokenizer: Tokenizer, vocab_size: int, tool_call_parser: str) -> None:
        self.tokenizer = tokenizer
        self.tool_format = tool_call_format(tool_call_parser)
        self.grammar = GrammarBackend(tokenizer, vocab_size)

    def chat_plan(self, body: ChatCompletionRequest, constrain: bool = True) -> ChoicePlan:
        """The plan of a chat request. `constrain=False` (the router) skips building the
        constraint: the node that runs the request builds it from the same fields."""
        plan = ChoicePlan(chat=True, logprobs=logprob_request(body.logprobs_top_n()))
        if plan.logprobs is not None:
            plan.format_logprobs = self.chat_logprobs
        if body.parses_tool_calls():
            plan.tool_format, plan.tool_names = self.tool_format, body.tool_names()
            plan.max_calls = 1 if body.parallel_tool_calls is False else None
        if not constrain:
            if body.forces_tool_call():  # the node writes the bare call (node_json_schema)
                plan.tool_format = Llama3Format()
            return plan
        schema = body.json_schema()
        if schema is not None:
            self.grammar.json_constraint(schema)  # compile once here: a bad schema is a 400
            plan.make_constraint = lambda: self.grammar.json_constraint(schema)
        elif body.forces_tool_call():
            tools = [t.template_tool() for t in body.forced_tools()]
            call_schema = tool_calls_schema(tools, self.tool_format.arguments_key)
            before, after = self.tool_format.wrap("")
            self.grammar.tool_call_constraint(call_schema, before, after)
            plan.make_constraint = lambda: self.grammar.tool_call_constraint(
                call_schema, before, after
            )
        return plan

    def node_json_schema(self, body: ChatCompletionRequest) -> str | None:
        """What the router sends a node as SGLang's `sampling_params.json_schema`: the
        `response_format` schema, or for a forced tool call the bare call's
        (`{"name", "arguments"}`, parsed back as JSON by the router's plan)."""
        schema = body.json_schema()
        if schema is None and body.forces_tool_call():
            schema = tool_calls_schema(
                [t.template_tool() for t in body.forced_tools()], "arguments"
            )
        if schema is None:
            return None
        self.grammar.json_constraint(schema)  # a schema the nodes cannot compile: 400 here
        return json.dumps(schema)

    def sampling_constraint(self, sampling: Any) -> TokenConstraint | None:
        """The constraint of a `/generate` sequence: SGLang's `sampling_params.json_schema`
        (a JSON schema as text; what the router sends for `response_format`), else None."""
        text = getattr(sampling, "json_schema", None)
        if text is None:
            return None
        try:
            schema = json.loads(text)
        except json.JSONDecodeError as exc:
            raise bad_request(
                f"'sampling_params.json_schema' is not JSON: {exc}",
                param="sampling_params.json_schema",
                code="invalid_json_schema",
            ) from None
        return self.grammar.json_constraint(schema if isinstance(schema, dict) else {})

    def completion_plan(self, body: CompletionRequest) -> ChoicePlan:
        plan = ChoicePlan(chat=False, logprobs=logprob_request(body.logprobs_top_n()))
        if plan.logprobs is not None:
            plan.format_logprobs = self.completion_logprobs
        return plan

    # ---- OpenAI logprobs objects (pdcache.server.logprobs)

    def token_text(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id], skip_special_tokens=False)

    def chat_logprobs(
        self, logprobs: list[TokenLogprob], offset: int
    ) -> tuple[dict[str, Any], int]:
        return openai_chat_logprobs(logprobs, self.token_text), offset

    def completion_logprobs(
        self, logprobs: list[TokenLogprob], offset: int
    ) -> tuple[dict[str, Any], int]:
        """Completions' logprobs from text offset `offset`, and the offset after them;
        `top_logprobs` keys are `token_key`s."""
        body = openai_completion_logprobs(logprobs, self.token_text, offset)
        body["top_logprobs"] = [{self.token_key(t): v for t, v in lp.top} for lp in logprobs]
        end = body["text_offset"][-1] + len(body["tokens"][-1]) if logprobs else offset
        return body, end

    def token_key(self, token_id: int) -> str:
        """A token's text as completions' `{text: logprob}` keys: a token that is no whole
        character (one byte of a multi-byte one) is `bytes:\\xNN`, as OpenAI writes it, so
        two such alternatives never collide as U+FFFD."""
        text = self.token_text(token_id)
        if "\ufffd" in text and isinstance(self.tokenizer, ByteTokenizer) and token_id < 256:
            return f"bytes:\\x{token_id:02x}"
        return text


def logprob_request(top_n: int | None) -> LogprobRequest | None:
    return None if top_n is None else LogprobRequest(top_n=top_n)
