"""Constrained decoding: `response_format` JSON and forced tool calls as a `TokenConstraint`
(pdcache.engine.api) built on llguidance (docs/tools.md: why llguidance, measured cost).

llguidance is an optional dependency (`pip install 'pdcache[structured]'`), imported on first
use: a request that needs it on a server without it is a 400 naming the package.
`GrammarBackend` owns one tokenizer's `LLTokenizer` (built on the first constrained request;
one per `AgentFeatures`: a server's, and the router's, which checks schemas before routing); `GrammarConstraint` is one request's `LLMatcher`, used on the
engine thread only, as the `TokenConstraint` protocol says.

Output is compact (`whitespace_flexible: false`): a JSON value has no free whitespace, so a
model (random weights included) cannot spin in whitespace. Whether an object takes properties
its schema does not name is the schema's `additionalProperties` (JSON Schema's default: yes).
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from pdcache.engine.tokenizer import ByteTokenizer, HFTokenizer, Tokenizer
from pdcache.wire.protocol import ApiError, bad_request

if TYPE_CHECKING:
    import torch

GRAMMAR_PACKAGE = "llguidance"
COMPACT = {"whitespace_flexible": False}
# compiled grammars kept per backend (a request's n choices, the router's check and a retry
# compile the same schema): each constraint is a copy of the compiled matcher
COMPILED_CACHE = 64


def _llguidance() -> Any:
    try:
        import llguidance
        import llguidance.torch  # noqa: F401 - the bitmask helpers
    except ImportError:
        raise ApiError(
            400,
            "structured output ('response_format' json, 'tool_choice' required "
            f"or named) needs the '{GRAMMAR_PACKAGE}' package on the server "
            "(pip install 'pdcache[structured]')",
            param="response_format",
            code="structured_output_unavailable",
        ) from None
    return llguidance


class GrammarConstraint:
    """One request's grammar matcher as a `TokenConstraint` (engine thread only)."""

    def __init__(self, llg: Any, matcher: Any, vocab_size: int, stop_ids: Sequence[int]) -> None:
        import torch

        self._llg = llg
        self._matcher = matcher
        self._vocab = vocab_size
        self._bitmask = llg.torch.allocate_token_bitmask(1, vocab_size)
        self._stop_ids = set(stop_ids)
        self._shifts = torch.arange(32, dtype=torch.int32)
        self._mask: torch.Tensor | None = None  # the mask for the next token, when computed

    def allowed_tokens(self, vocab_size: int) -> torch.Tensor:
        if self._mask is None:
            self._mask = self._compute_mask()
        mask = self._mask
        if mask.numel() < vocab_size:  # model rows beyond the tokenizer's ids: never allowed
            import torch

            mask = torch.cat([mask, torch.zeros(vocab_size - mask.numel(), dtype=torch.bool)])
        return mask[:vocab_size]

    def _compute_mask(self) -> torch.Tensor:
        self._llg.torch.fill_next_token_bitmask(self._matcher, self._bitmask, 0)
        bits = (self._bitmask[0].unsqueeze(1) >> self._shifts) & 1
        return bits.flatten().bool()[: self._vocab]

    def accept(self, token_id: int) -> None:
        self._mask = None
        if not self._matcher.consume_token(token_id):
            raise ValueError(
                f"token {token_id} is not allowed by the request's grammar: "
                f"{self._matcher.get_error()}"
            )

    def is_terminated(self) -> bool:
        """Done when the grammar stopped (it took a stop token or nothing else may follow), or
        is complete and allows only stop tokens next."""
        if self._matcher.is_stopped():
            return True
        if not self._matcher.is_accepting():
            return False
        if self._mask is None:
            self._mask = self._compute_mask()
        return all(i in self._stop_ids for i in self._mask.nonzero().flatten().tolist())


class GrammarBackend:
    """llguidance set up for one tokenizer; `json_constraint` / `tool_call_constraint` build
    per-request constraints. Thread-safe (the tokenizer is built once, under a lock)."""

    def __init__(self, tokenizer: Tokenizer, vocab_size: int) -> None:
        self._tokenizer = tokenizer
        self._vocab_size = vocab_size
        self._lock = threading.Lock()
        self._lltok: Any = None
        self._llg: Any = None
        self._compiled: OrderedDict[str, Any] = OrderedDict()  # grammar text -> matcher
        self._compiled_lock = threading.Lock()

    def _ll_tokenizer(self) -> Any:
        with self._lock:
            if self._lltok is None:
                llg = _llguidance()
                self._lltok = ll_tokenizer(llg, self._tokenizer, self._vocab_size)
                self._llg = llg
            return self._lltok

    def _constraint(self, key: str, grammar: Callable[[Any], Any], param: str
                    ) -> GrammarConstraint:
        """A fresh constraint of the grammar `key` names: a copy of its compiled matcher
        (compiled once, outside the locks: llguidance releases the GIL while it compiles)."""
        lltok = self._ll_tokenizer()
        with self._compiled_lock:
            compiled = self._compiled.get(key)
            if compiled is not None:
                self._compiled.move_to_end(key)
        if compiled is None:
            compiled = self._llg.LLMatcher(lltok, grammar(self._llg), log_level=0)
            if compiled.is_error():
                raise bad_request(
                    f"the schema cannot be compiled to a grammar: {compiled.get_error()[:500]}",
                    param=param,
                    code="invalid_json_schema",
                )
            with self._compiled_lock:
                self._compiled[key] = compiled
                while len(self._compiled) > COMPILED_CACHE:
                    self._compiled.popitem(last=False)
        return GrammarConstraint(
            self._llg, compiled.deep_copy(), lltok.vocab_size, self._tokenizer.eos_token_ids
        )

    @property
    def compiled_grammars(self) -> int:
        """Grammars compiled and kept (the cache's size)."""
        with self._compiled_lock:
            return len(self._compiled)

    def json_constraint(self, schema: dict[str, Any]) -> GrammarConstraint:
        """Output is one JSON value following `schema` (compact)."""
        text = json.dumps(schema)
        return self._constraint(
            "json:" + text,
            lambda llg: llg.LLMatcher.grammar_from_json_schema(text, defaults=COMPACT),
            "response_format",
        )

    def tool_call_constraint(
        self, call_schema: dict[str, Any], before: str, after: str
    ) -> GrammarConstraint:
        """Output is `before` + one JSON call following `call_schema` + `after` (a tool-call
        format's wrapping, e.g. Hermes' `<tool_call>\\n` ... `\\n</tool_call>`)."""
        schema = {**call_schema, "x-guidance": COMPACT}
        lark = (
            f"start: {json.dumps(before)} call {json.dumps(after)}\n"
            if before or after
            else "start: call\n"
        )
        lark += "call: %json " + json.dumps(schema)
        return self._constraint("lark:" + lark, lambda llg: llg.LLMatcher.grammar_from_lark(lark),
                                "tools")


def ll_tokenizer(llg: Any, tokenizer: Tokenizer, vocab_size: int) -> Any:
    """llguidance's view of our tokenizer: the byte tokenizer's ids 0..255 are the bytes and
    its special ids have no text (only their role as stop tokens can allow them); a checkpoint
    tokenizer is read from its tokenizer.json."""
    stop = list(tokenizer.eos_token_ids)
    if isinstance(tokenizer, ByteTokenizer):
        return llg.LLTokenizer(
            llg.TokenizerWrapper(_ByteVocab(tokenizer)), n_vocab=vocab_size, eos_token=stop
        )
    if isinstance(tokenizer, HFTokenizer):
        return llg.LLTokenizer(str(tokenizer.tokenizer_file), n_vocab=vocab_size, eos_token=stop)
    raise bad_request(
        f"structured output does not support the {type(tokenizer).__name__}",
        param="response_format",
        code="structured_output_unavailable",
    )


class _ByteVocab:
    """What llguidance's `TokenizerWrapper` reads from a tokenizer, for the byte tokenizer."""

    def __init__(self, tokenizer: ByteTokenizer) -> None:
        self.eos_token_id = tokenizer.eos_token_ids[0]
        self.bos_token_id = tokenizer.bos_token_id
        self.tokens = [bytes([i]) for i in range(256)] + [b""] * (tokenizer.vocab_size - 256)
        self.special_token_ids = list(range(256, tokenizer.vocab_size))

    def __call__(self, text: bytes | str) -> list[int]:
        return list(text if isinstance(text, bytes) else text.encode("utf-8"))


def tool_calls_schema(tools: list[dict[str, Any]], arguments_key: str) -> dict[str, Any]:
    """The JSON schema of one call to one of `tools` (OpenAI function definitions):
    `{"name": <a tool's name>, <arguments_key>: <its parameters>}`, nothing else."""
    options = []
    for tool in tools:
        function = tool["function"]
        params = function.get("parameters") or {"type": "object"}
        options.append(
            {
                "type": "object",
                "properties": {"name": {"const": function["name"]}, arguments_key: params},
                "required": ["name", arguments_key],
                "additionalProperties": False,
            }
        )
    return options[0] if len(options) == 1 else {"anyOf": options}
