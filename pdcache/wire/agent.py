"""The agent API's per-request plan: which reasoning and tool-call formats parse a choice,
which constraint an engine request carries (`response_format` json, a forced tool call), which
logprobs it asks for and how they are written (docs/tools.md).

`AgentFeatures` is built once per server (and once in the router, without constraints: the
nodes build those) from the deployment's `tool_call_parser` and `reasoning_parser`;
`chat_plan` / `completion_plan` turn one validated request into a `ChoicePlan` that makes each
of its `n` choices' parts, and `chat_messages` gives the messages the chat template renders.
Owns the server's `GrammarBackend` (built on the first constrained request).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from pdcache.engine.api import LogprobRequest, TokenConstraint, TokenLogprob
from pdcache.engine.tokenizer import Tokenizer
from pdcache.wire.choices import ChoiceOutput, LogprobFormatter
from pdcache.wire.logprobs import (
    TextOffsets,
    openai_chat_logprobs,
    openai_completion_logprobs,
)
from pdcache.wire.protocol import ChatCompletionRequest, CompletionRequest, bad_request
from pdcache.wire.reasoning import (
    ReasoningFormat,
    reasoning_format,
    template_reads_reasoning,
    with_reasoning_history,
)
from pdcache.wire.structured import GrammarBackend, tool_calls_schema
from pdcache.wire.token_bytes import TokenBytes
from pdcache.wire.tool_calls import (
    BareJsonCallFormat,
    ToolCallFormat,
    forced_call_format,
    tool_call_format,
)


@dataclass
class ChoicePlan:
    """What every choice of one request shares; `output(i)` / `constraint()` make choice i's
    own parse state and grammar matcher (each choice needs its own)."""

    chat: bool
    logprobs: LogprobRequest | None = None
    tool_format: ToolCallFormat | None = None
    tools: dict[str, dict[str, Any]] = field(default_factory=dict)  # name -> arguments schema
    max_calls: int | None = None  # parallel_tool_calls: false -> 1
    make_constraint: Callable[[], TokenConstraint] | None = None
    make_logprob_formatter: Callable[[], LogprobFormatter] | None = None  # one per choice
    reasoning: ReasoningFormat | None = None  # None: the thinking (if any) is content

    @property
    def keeps_special_tokens(self) -> bool:
        """Whether the output is decoded with special tokens kept (the call markers are
        special tokens of the model's vocabulary, as kimi_k2's are; or the reasoning
        format's, as gpt-oss's harmony channels are)."""
        if self.reasoning is not None and self.reasoning.keeps_special_tokens:
            return True
        return self.tool_format is not None and self.tool_format.keeps_special_tokens

    def constraint(self) -> TokenConstraint | None:
        return None if self.make_constraint is None else self.make_constraint()

    def output(self, index: int) -> ChoiceOutput:
        return ChoiceOutput(
            index,
            chat=self.chat,
            tool_format=self.tool_format,
            tools=self.tools,
            max_calls=self.max_calls,
            format_logprobs=(
                None if self.make_logprob_formatter is None else self.make_logprob_formatter()
            ),
            reasoning=self.reasoning,
        )


class AgentFeatures:
    """The deployment's tool-call and reasoning formats and grammar backend, and the plans
    they make. ValueError naming the choices for an unknown parser name."""

    def __init__(
        self,
        tokenizer: Tokenizer,
        vocab_size: int,
        tool_call_parser: str,
        reasoning_parser: str | None = None,
    ) -> None:
        self.tokenizer = tokenizer
        self.tool_format = tool_call_format(tool_call_parser)
        self.reasoning = reasoning_format(reasoning_parser)
        self.template_reads_reasoning = template_reads_reasoning(tokenizer)
        self.grammar = GrammarBackend(tokenizer, vocab_size)
        self.token_bytes = TokenBytes(tokenizer)

    def chat_messages(self, body: ChatCompletionRequest) -> list[dict[str, Any]]:
        """The messages the chat template renders: earlier assistant turns' thinking where
        the template sees it (`with_reasoning_history`)."""
        return with_reasoning_history(body.template_messages(), self.reasoning,
                                      self.template_reads_reasoning)

    def text_decoder(self, plan: ChoicePlan) -> Callable[[list[int]], str]:
        """How a choice's output ids become text: special tokens skipped, or kept (but the
        end-of-sequence ones) where the plan's call markers are special tokens."""
        if not plan.keeps_special_tokens:
            return self.tokenizer.decode
        ends = set(self.tokenizer.eos_token_ids)
        return lambda ids: self.tokenizer.decode(
            [i for i in ids if i not in ends], skip_special_tokens=False
        )

    def chat_plan(self, body: ChatCompletionRequest, constrain: bool = True) -> ChoicePlan:
        """The plan of a chat request. `constrain=False` (the router) skips building the
        constraint: the node that runs the request builds it from the same fields. A
        constrained output is the answer from its first token, so its thinking is not split
        off."""
        plan = ChoicePlan(chat=True, logprobs=logprob_request(body.logprobs_top_n()))
        if plan.logprobs is not None:
            plan.make_logprob_formatter = lambda: self.chat_logprobs
        if body.parses_tool_calls():
            plan.tool_format, plan.tools = self.tool_format, body.tool_parameters()
            plan.max_calls = 1 if body.parallel_tool_calls is False else None
        constrained = body.forces_tool_call() or body.json_schema() is not None
        if body.separate_reasoning and not constrained:
            plan.reasoning = self.reasoning
        if not constrain:
            if body.forces_tool_call():  # the node writes the bare call (node_json_schema)
                plan.tool_format = BareJsonCallFormat()
            return plan
        schema = body.json_schema()
        if schema is not None:
            self.grammar.json_constraint(schema)  # compile once here: a bad schema is a 400
            plan.make_constraint = lambda: self.grammar.json_constraint(schema)
        elif body.forces_tool_call():
            self._force_tool_call(plan, body)
        return plan

    def _force_tool_call(self, plan: ChoicePlan, body: ChatCompletionRequest) -> None:
        """Constrain the output to one call in the deployment's format (its wrapping around
        one JSON call), or to the bare JSON call where the format's calls are no JSON."""
        fmt = forced_call_format(self.tool_format)
        tools = [t.template_tool() for t in body.forced_tools()]
        call_schema = tool_calls_schema(tools, fmt.arguments_key)
        before, after = fmt.wrap("")
        self.grammar.tool_call_constraint(call_schema, before, after)
        plan.tool_format = fmt
        plan.make_constraint = lambda: self.grammar.tool_call_constraint(
            call_schema, before, after
        )

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
            # the offsets index the text the choice's TextAssembler releases (server and
            # router build it from these same two)
            decode, stops = self.text_decoder(plan), body.stop_strings()
            plan.make_logprob_formatter = lambda: self.completion_logprobs(
                TextOffsets(decode, stops)
            )
        return plan

    # ---- OpenAI logprobs objects (pdcache.wire.logprobs)

    def token_text(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id], skip_special_tokens=False)

    def chat_logprobs(self, logprobs: list[TokenLogprob]) -> dict[str, Any]:
        return dict(openai_chat_logprobs(logprobs, self.token_text, self.token_bytes))

    def completion_logprobs(self, offsets: TextOffsets) -> LogprobFormatter:
        """One choice's completions logprobs, `text_offset` from its `offsets`; `tokens` and
        the `top_logprobs` keys are `token_key`s."""

        def format_run(logprobs: list[TokenLogprob]) -> dict[str, Any]:
            text_offset = offsets.next([entry.token_id for entry in logprobs])
            return dict(openai_completion_logprobs(logprobs, self.token_key, text_offset))

        return format_run

    def token_key(self, token_id: int) -> str:
        """A token's text as completions' `tokens` and `{text: logprob}` keys: a token that
        is no whole character (a byte of a multi-byte one) is `bytes:` and its bytes as
        `\\xNN`, as OpenAI writes it, so two such alternatives never collide as U+FFFD."""
        text = self.token_text(token_id)
        if "\ufffd" not in text:
            return text
        raw = self.token_bytes(token_id)
        if raw == text.encode("utf-8"):  # the token is U+FFFD itself
            return text
        return "bytes:" + "".join(f"\\x{byte:02x}" for byte in raw)


def logprob_request(top_n: int | None) -> LogprobRequest | None:
    return None if top_n is None else LogprobRequest(top_n=top_n)
