"""Constrained decoding (pdcache.wire.structured): random logits sampled under the grammar's
mask give JSON that validates against the schema, for the byte tokenizer and an exported
preset's tokenizer.json; forced tool calls parse back with the tool-call parser."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

pytest.importorskip("llguidance")
jsonschema = pytest.importorskip("jsonschema")

from pdcache.engine.export import export_preset  # noqa: E402
from pdcache.engine.tokenizer import ByteTokenizer, HFTokenizer, Tokenizer  # noqa: E402
from pdcache.wire.protocol import ApiError  # noqa: E402
from pdcache.wire.structured import GrammarBackend, tool_calls_schema  # noqa: E402
from pdcache.wire.tool_calls import parse_tool_calls, tool_call_format  # noqa: E402

VOCAB = 261
# bounded: every property is required, strings and arrays are capped, no extra properties, so
# even random weights end the value within MAX_STEPS tokens
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 8},
        "ok": {"type": "boolean"},
        "n": {"enum": [1, 2, 3]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 3}, "maxItems": 2},
    },
    "required": ["name", "ok", "n", "tags"],
    "additionalProperties": False,
}
MAX_STEPS = 400
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string", "maxLength": 6}},
                "required": ["city"],
                "additionalProperties": False,
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "noop",
            "parameters": {"type": "object", "properties": {}, "additionalProperties": False},
        },
    },
]


@pytest.fixture(scope="module", params=["byte", "tokenizer.json"])
def tokenizer(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Tokenizer:
    if request.param == "byte":
        return ByteTokenizer()
    out = tmp_path_factory.mktemp("export") / "tiny"
    export_preset("tiny", out)
    return HFTokenizer(Path(out))


def sample(constraint, seed: int) -> tuple[list[int], bool]:
    """Random logits, masked: the engine's contract (allowed_tokens, accept, is_terminated)."""
    gen = torch.Generator().manual_seed(seed)
    out: list[int] = []
    for _ in range(MAX_STEPS):
        mask = constraint.allowed_tokens(VOCAB)
        assert mask.shape == (VOCAB,) and mask.any()
        logits = torch.randn(VOCAB, generator=gen).masked_fill(~mask, float("-inf"))
        token = int(torch.multinomial(torch.softmax(logits, 0), 1, generator=gen))
        constraint.accept(token)
        out.append(token)
        if constraint.is_terminated():
            return out, True
    return out, False


@pytest.mark.parametrize("seed", range(4))
def test_schema_output_validates(tokenizer: Tokenizer, seed: int) -> None:
    backend = GrammarBackend(tokenizer, VOCAB)
    ids, done = sample(backend.json_constraint(SCHEMA), seed)
    assert done, tokenizer.decode(ids)
    value = json.loads(tokenizer.decode(ids))  # strict JSON: no raw control characters
    jsonschema.validate(value, SCHEMA)


def test_unconstrained_sampling_is_not_json(tokenizer: Tokenizer) -> None:
    """The protection off: the same random sampling without the mask is no JSON value."""
    gen = torch.Generator().manual_seed(0)
    ids = [int(torch.randint(0, 256, (1,), generator=gen)) for _ in range(40)]
    with pytest.raises(json.JSONDecodeError):
        json.loads(tokenizer.decode(ids))


def test_json_object_output_is_a_valid_prefix_when_capped(tokenizer: Tokenizer) -> None:
    """`{"type": "object"}` is unbounded: a capped output is still a prefix the grammar took."""
    backend = GrammarBackend(tokenizer, VOCAB)
    ids, done = sample(backend.json_constraint({"type": "object"}), 7)
    text = tokenizer.decode(ids)
    assert text.startswith("{")
    if done:
        assert isinstance(json.loads(text), dict)
    replay = backend.json_constraint({"type": "object"})
    for token in ids:  # every token was allowed where it was taken
        assert replay.allowed_tokens(VOCAB)[token]
        replay.accept(token)


def test_mask_rejects_a_token_the_grammar_forbids(tokenizer: Tokenizer) -> None:
    constraint = GrammarBackend(tokenizer, VOCAB).json_constraint(SCHEMA)
    assert constraint.allowed_tokens(VOCAB)[ord("{")]
    assert not constraint.allowed_tokens(VOCAB)[ord("x")]
    with pytest.raises(ValueError):
        constraint.accept(ord("x"))


@pytest.mark.parametrize("seed", range(3))
def test_forced_tool_call_parses_back(tokenizer: Tokenizer, seed: int) -> None:
    hermes = tool_call_format("hermes")
    backend = GrammarBackend(tokenizer, VOCAB)
    before, after = hermes.wrap("")
    constraint = backend.tool_call_constraint(tool_calls_schema(TOOLS, "arguments"), before, after)
    ids, done = sample(constraint, seed)
    assert done
    content, calls = parse_tool_calls(hermes, tokenizer.decode(ids), {"get_weather", "noop"})
    assert content is None and len(calls) == 1
    schema = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
    jsonschema.validate(json.loads(calls[0].arguments), schema[calls[0].name])


def test_bad_schema_is_a_400_naming_the_field() -> None:
    with pytest.raises(ApiError) as info:
        GrammarBackend(ByteTokenizer(), VOCAB).json_constraint({"type": "objec"})
    assert info.value.status_code == 400 and info.value.param == "response_format"
    assert info.value.code == "invalid_json_schema"


def test_missing_library_is_a_400_naming_the_package(monkeypatch: pytest.MonkeyPatch) -> None:
    import sys

    monkeypatch.setitem(sys.modules, "llguidance", None)  # import raises ImportError
    with pytest.raises(ApiError) as info:
        GrammarBackend(ByteTokenizer(), VOCAB).json_constraint(SCHEMA)
    assert info.value.status_code == 400 and "'llguidance'" in info.value.message
    assert info.value.code == "structured_output_unavailable"


def test_a_schema_compiles_once_and_each_constraint_is_its_own(tokenizer: Tokenizer) -> None:
    """A request's n choices, the router's check and the node's build compile one schema
    once (compiling a costly schema took ~1 s each time); each constraint is a copy of the
    compiled matcher, so one choice's tokens never move another's grammar."""
    backend = GrammarBackend(tokenizer, VOCAB)
    first = backend.json_constraint(SCHEMA)
    ids, done = sample(first, 1)
    assert done and first.is_terminated()
    second = backend.json_constraint(json.loads(json.dumps(SCHEMA)))  # an equal schema
    assert backend.compiled_grammars == 1
    assert not second.is_terminated() and second.allowed_tokens(VOCAB)[ord("{")]
    for token in ids:  # the same walk is open to the copy
        second.accept(token)
    assert second.is_terminated()
    backend.json_constraint({"type": "object"})
    assert backend.compiled_grammars == 2
