"""HTTP contract models: strict parsing, OpenAI-style errors, prompt limits, text assembly."""

from __future__ import annotations

import json
import random
from typing import Any

import pytest

from pdcache.engine.api import CachedTokens
from pdcache.wire.detokenize import TextAssembler
from pdcache.wire.generate_api import GenerateRequestBody
from pdcache.wire.protocol import (
    ApiError,
    ChatCompletionRequest,
    CompletionRequest,
    ModelLimits,
    check_prompt,
    default_max_tokens,
    parse_body,
)
from pdcache.wire.responses import sse, usage_body

LIMITS = ModelLimits(vocab_size=100, context_len=64)


def parse_error(model, body: str | bytes) -> ApiError:
    raw = body.encode() if isinstance(body, str) else body
    with pytest.raises(ApiError) as info:
        parse_body(model, raw)
    err = info.value
    assert err.status_code == 400
    assert set(err.body()["error"]) == {"message", "type", "param", "code"}
    return err


def test_generate_body_parses_sglang_names() -> None:
    body = parse_body(
        GenerateRequestBody,
        json.dumps(
            {
                "input_ids": [1, 2, 3],
                "sampling_params": {
                    "max_new_tokens": 7,
                    "temperature": 0,
                    "top_p": 0.9,
                    "top_k": 5,
                    "seed": 11,
                    "stop_token_ids": [4],
                    "ignore_eos": True,
                },
                "session_id": "s",
                "cache_salt": "tenant",
                "stream": True,
            }
        ).encode(),
    )
    sp = body.sampling_params.to_engine()
    assert (sp.max_new_tokens, sp.temperature, sp.top_p, sp.top_k) == (7, 0.0, 0.9, 5)
    assert (sp.seed, sp.stop_token_ids, sp.ignore_eos) == (11, (4,), True)
    assert body.stream and body.cache_salt == "tenant" and body.prompt_param() == "input_ids"


@pytest.mark.parametrize(
    ("body", "code", "param"),
    [
        ("{not json", "invalid_json", None),
        ("[1, 2]", "model_type", None),
        ('{"input_ids": [1, "2"]}', "int_type", "input_ids[1]"),
        ('{"input_ids": [1, 2.5]}', "int_type", "input_ids[1]"),
        ('{"input_ids": "1 2"}', "list_type", "input_ids"),
        ('{"text": 5}', "string_type", "text"),
        ('{"text": "a", "stream": "yes"}', "bool_type", "stream"),
        ('{"text": "a", "bogus": 1}', "unknown_field", "bogus"),
        ('{"text": "a", "sampling_params": {"max_tokens": 3}}', "unknown_field", None),
        ('{"text": "a", "sampling_params": {"max_new_tokens": 0}}', "greater_than_equal", None),
        ('{"text": "a", "sampling_params": {"max_new_tokens": "3"}}', "int_type", None),
        ('{"text": "a", "sampling_params": {"temperature": -1}}', "greater_than_equal", None),
        ('{"text": "a", "sampling_params": {"top_p": 0}}', "greater_than", None),
        ('{"text": "a", "sampling_params": {"seed": -1}}', "greater_than_equal", None),
        # kept per session / scanned per token: bounded
        ('{"text": "a", "session_id": "' + "s" * 257 + '"}', "string_too_long", "session_id"),
        ('{"text": "a", "cache_salt": "' + "c" * 257 + '"}', "string_too_long", "cache_salt"),
    ],
)
def test_generate_body_rejects(body: str, code: str, param: str | None) -> None:
    err = parse_error(GenerateRequestBody, body)
    assert err.code == code
    if param is not None:
        assert err.param == param
    if "sampling_params" in body and code != "invalid_json":
        assert err.param is not None and err.param.startswith("sampling_params.")


def test_generate_needs_exactly_one_prompt() -> None:
    for body in ("{}", '{"text": "a", "input_ids": [1]}'):
        with pytest.raises(ApiError) as info:
            parse_body(GenerateRequestBody, body.encode()).check_one_prompt()
        assert info.value.status_code == 400


@pytest.mark.parametrize(
    ("ids", "max_new", "code"),
    [
        ([], 1, "empty_prompt"),
        ([1, 100], 1, "token_id_out_of_range"),
        ([-1], 1, "token_id_out_of_range"),
        ([1] * 60, 5, "context_length_exceeded"),
        ([1] * 64, 1, "context_length_exceeded"),
    ],
)
def test_check_prompt_rejects(ids: list[int], max_new: int, code: str) -> None:
    with pytest.raises(ApiError) as info:
        check_prompt(ids, max_new, LIMITS, "input_ids")
    assert info.value.code == code and info.value.param == "input_ids"


def test_check_prompt_accepts_exact_fit_and_default_max_tokens() -> None:
    check_prompt([99] * 60, 4, LIMITS, "input_ids")
    assert default_max_tokens(60, LIMITS, "messages") == 4
    with pytest.raises(ApiError):
        default_max_tokens(64, LIMITS, "messages")


def test_chat_request_rules() -> None:
    ok = parse_body(
        ChatCompletionRequest,
        b'{"model": "x", "messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}],'
        b' "max_completion_tokens": 3, "max_tokens": 9, "stream": true,'
        b' "stream_options": {"include_usage": true}, "seed": 1, "user": "u"}',
    )
    ok.check_supported()
    assert ok.requested_max_tokens() == 3 and ok.include_usage()
    assert ok.template_messages() == [{"role": "user", "content": "hi"}]

    def rejected(body: str) -> ApiError:
        with pytest.raises(ApiError) as info:
            parse_body(ChatCompletionRequest, body.encode()).check_supported()
        assert info.value.status_code == 400
        return info.value

    msgs = '"messages": [{"role": "user", "content": "hi"}]'
    assert rejected(f'{{{msgs}, "n": 17}}').param == "n"
    assert rejected(f'{{{msgs}, "max_tokens": 0}}').param == "max_tokens"
    assert rejected(f'{{{msgs}, "logit_bias": {{"1": 1}}}}').code == "unsupported_parameter"
    assert rejected(f'{{{msgs}, "presence_penalty": 2.5}}').param == "presence_penalty"
    assert rejected(f'{{{msgs}, "repetition_penalty": 1.1}}').code == "unknown_field"
    assert rejected(f'{{{msgs}, "stream_options": {{"include_usage": true}}}}').param == (
        "stream_options"
    )
    assert rejected('{"messages": []}').param == "messages"
    assert rejected(f'{{{msgs}, "temperature": Infinity}}').param == "temperature"
    assert rejected(f'{{{msgs}, "stop": {json.dumps(["x"] * 17)}}}').param == "stop"
    assert rejected('{"messages": [{"role": "robot", "content": "x"}]}').param == (
        "messages[0].role"
    )
    image = '{"type": "image_url", "image_url": {"url": "x"}}'
    assert (
        rejected(f'{{"messages": [{{"role": "user", "content": [{image}]}}]}}').status_code == 400
    )


def test_completion_prompt_forms() -> None:
    def prompt(body: str) -> str | list[int]:
        req = parse_body(CompletionRequest, body.encode())
        req.check_supported()
        return req.single_prompt()

    assert prompt('{"prompt": "abc"}') == "abc"
    assert prompt('{"prompt": [1, 2]}') == [1, 2]
    assert prompt('{"prompt": ["abc"]}') == "abc"
    assert prompt('{"prompt": [[3, 4]]}') == [3, 4]
    for bad in ('{"prompt": ["a", "b"]}', '{"prompt": "a", "echo": true}', '{"prompt": [1.5]}'):
        with pytest.raises(ApiError):
            prompt(bad)
    assert parse_body(CompletionRequest, b'{"prompt": "a"}').max_tokens == 16


def checked_error(model, body: dict[str, Any]) -> ApiError:
    """The 400 of a body that parses but that `check_supported` refuses."""
    parsed = parse_body(model, json.dumps(body).encode())
    with pytest.raises(ApiError) as info:
        parsed.check_supported()
    assert info.value.status_code == 400
    return info.value


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"input_ids": [1], "sampling_params": {"stop": ""}}, "sampling_params.stop"),
        ({"input_ids": [[1], [2]], "sampling_params": [{}, {"stop": ["a", ""]}]},
         "sampling_params[1].stop"),
        # a P/D node's body: the node checks it before it reserves pages or submits anything
        ({"input_ids": [1], "sampling_params": {"stop": [""]},
          "pd": {"role": "decode", "room": 1, "bootstrap": "tcp://p:1"}},
         "sampling_params.stop"),
    ],
)
def test_generate_check_refuses_an_empty_stop_string(body: dict[str, Any], param: str) -> None:
    err = checked_error(GenerateRequestBody, body)
    assert (err.param, err.message) == (param, "stop strings must be non-empty")


@pytest.mark.parametrize("model", [ChatCompletionRequest, CompletionRequest])
def test_openai_check_refuses_an_empty_stop_string(model: type) -> None:
    prompt = {"messages": [{"role": "user", "content": "hi"}]} \
        if model is ChatCompletionRequest else {"prompt": "hi"}
    err = checked_error(model, {**prompt, "stop": ["a", ""]})
    assert (err.param, err.message) == ("stop", "stop strings must be non-empty")


# the assistant message of a chat answer as the OpenAI SDK dumps it (`message.model_dump()`)
SDK_ASSISTANT = {"role": "assistant", "content": "yo", "refusal": None, "annotations": None,
                 "audio": None, "function_call": None, "tool_calls": None}


def chat(messages: list[dict[str, Any]], **extra: Any) -> ChatCompletionRequest:
    body = parse_body(ChatCompletionRequest,
                      json.dumps({"messages": messages, **extra}).encode())
    body.check_supported()
    return body


def test_an_sdk_dumped_assistant_message_renders_as_the_plain_one() -> None:
    user = {"role": "user", "content": "hi"}
    plain = chat([user, {"role": "assistant", "content": "yo"}]).template_messages()
    assert chat([user, SDK_ASSISTANT]).template_messages() == plain
    cited = {**SDK_ASSISTANT, "annotations": [{"type": "url_citation", "url_citation": {}}]}
    assert chat([user, cited]).template_messages() == plain
    # a refusal is what the assistant said instead of an answer
    refused = {**SDK_ASSISTANT, "content": None, "refusal": "I can't."}
    assert chat([user, refused]).template_messages()[1] == {"role": "assistant",
                                                            "content": "I can't."}


@pytest.mark.parametrize(
    ("message", "param", "code"),
    [
        ({**SDK_ASSISTANT, "function_call": {"name": "f", "arguments": "{}"}},
         "messages[0].function_call", "unsupported_parameter"),
        ({**SDK_ASSISTANT, "audio": {"id": "a1"}}, "messages[0].audio", "unsupported_parameter"),
        ({"role": "user", "content": "x", "refusal": "no"}, "messages[0].refusal",
         "invalid_message"),
        ({"role": "user", "content": "x", "annotations": []}, "messages[0].annotations",
         "invalid_message"),
    ],
)
def test_assistant_message_fields_pdcache_cannot_honour_are_400(
    message: dict[str, Any], param: str, code: str
) -> None:
    err = checked_error(ChatCompletionRequest, {"messages": [message]})
    assert (err.param, err.code) == (param, code)


def test_a_genuinely_unknown_message_field_is_still_refused() -> None:
    err = parse_error(ChatCompletionRequest,
                      json.dumps({"messages": [{**SDK_ASSISTANT, "mood": None}]}))
    assert (err.code, err.param) == ("unknown_field", "messages[0].mood")


CHAT_NULLABLE = ("temperature", "top_p", "n", "stream", "max_tokens", "top_k", "ignore_eos",
                 "stop_token_ids", "separate_reasoning", "stop", "seed", "logprobs")


def test_null_openai_fields_mean_not_given() -> None:
    messages = [{"role": "user", "content": "hi"}]
    nulls = chat(messages, **dict.fromkeys(CHAT_NULLABLE))
    bare = chat(messages)
    assert nulls == bare and nulls.to_engine(8) == bare.to_engine(8)
    assert (nulls.temperature, nulls.n, nulls.stream, nulls.separate_reasoning) == (
        1.0, 1, False, True)
    completion = parse_body(CompletionRequest, b'{"prompt": "a", "max_tokens": null, '
                                               b'"n": null, "top_k": null}')
    assert (completion.max_tokens, completion.n, completion.top_k) == (16, 1, -1)


def test_null_required_or_unknown_fields_are_still_refused() -> None:
    assert parse_error(ChatCompletionRequest, b'{"messages": null}').param == "messages"
    assert parse_error(CompletionRequest, b'{"prompt": null}').param == "prompt"
    err = parse_error(CompletionRequest, b'{"prompt": "a", "temprature": null}')
    assert (err.code, err.param) == ("unknown_field", "temprature")


def byte_decode(ids: list[int]) -> str:
    return bytes(ids).decode("utf-8", errors="replace")


def test_text_assembler_holds_partial_utf8() -> None:
    asm = TextAssembler(byte_decode, [])
    euro = list("€".encode())
    assert asm.add([ord("a")]) == "a"
    assert asm.add([euro[0]]) == ""
    assert asm.add([euro[1]]) == ""
    assert asm.add([euro[2], ord("b")]) == "€b"
    assert asm.add([euro[0]]) == ""
    assert asm.flush() == "\ufffd" and asm.text == "a€b\ufffd"


def test_text_assembler_stop_strings() -> None:
    asm = TextAssembler(byte_decode, ["END", "xy"])
    out = [asm.add(list(b"hello E")), asm.add(list(b"N")), asm.add(list(b"X more"))]
    assert out == ["hello ", "", "ENX more"] and not asm.stopped
    assert asm.add(list(b" EN")) == " "
    assert asm.add(list(b"D tail")) == "" and asm.stopped
    assert asm.text == "hello ENX more "
    asm2 = TextAssembler(byte_decode, ["xy"])
    assert asm2.add(list(b"abxyc")) == "ab" and asm2.stopped


def test_text_assembler_decodes_in_context() -> None:
    # a SentencePiece-like decoder: a leading word-boundary marker is dropped at the start
    vocab = {1: "\u2581Hello", 2: "\u2581world", 3: "!"}

    def decode(ids: list[int]) -> str:
        return "".join(vocab[i] for i in ids).replace("\u2581", " ").lstrip(" ")

    asm = TextAssembler(decode, [])
    assert [asm.add([1]), asm.add([2]), asm.add([3])] == ["Hello", " world", "!"]
    assert asm.text == decode([1, 2, 3])


def test_usage_body_and_sse() -> None:
    usage = usage_body(10, 3, CachedTokens(device=4, storage=2, storage_from_decode=1), 4)
    assert usage["total_tokens"] == 13
    assert usage["prompt_tokens_details"] == {"cached_tokens": 6}
    assert usage["cached_tokens_details"] == {
        "device": 4,
        "host": 0,
        "storage": 2,
        "storage_from_decode": 1,
    }
    assert sse({"a": 1}) == b'data: {"a":1}\n\n'
    assert sse("[DONE]") == b"data: [DONE]\n\n"


def test_bounded_strings_at_their_limit_parse() -> None:
    """The bounds refuse only past them: a 256-character session id and salt, a
    1,024-character stop string (OpenAI's body too) are accepted."""
    body = parse_body(GenerateRequestBody, json.dumps({
        "text": "a", "session_id": "s" * 256, "cache_salt": "c" * 256,
        "sampling_params": {"stop": ["x" * 1024]}}).encode())
    assert len(body.session_id or "") == 256
    body.check_supported()
    chat = {"messages": [{"role": "user", "content": "hi"}], "stop": "y" * 1024}
    parse_body(ChatCompletionRequest, json.dumps(chat).encode()).check_supported()
    for stop in ("y" * 1025, ["ok", "y" * 1025]):
        with pytest.raises(ApiError) as info:
            parse_body(ChatCompletionRequest, json.dumps({**chat, "stop": stop}).encode()
                       ).check_supported()
        assert info.value.code == "stop_too_long" and info.value.param == "stop"
    long_stop = {"text": "a", "sampling_params": {"stop": ["ok", "x" * 1025]}}
    with pytest.raises(ApiError) as info:
        parse_body(GenerateRequestBody, json.dumps(long_stop).encode()).check_supported()
    assert info.value.code == "stop_too_long"


def _brute_safe_len(text: str, stops: list[str], emitted: int) -> int:
    hold = max((k for stop in stops for k in range(1, min(len(stop) - 1, len(text)) + 1)
                if text.endswith(stop[:k])), default=0)
    return max(len(text) - hold, emitted)


def test_text_assembler_holds_back_exactly_the_longest_stop_prefix() -> None:
    """The hold-back (text a later token may turn into a stop) is the longest tail that
    begins a stop string, the same as trying every prefix (what it did, at O(stop length^2)
    a token), on random texts over a small alphabet where tails often begin stops."""
    rng = random.Random(7)
    for _ in range(300):
        stops = ["".join(rng.choice("ab") for _ in range(rng.randint(1, 9)))
                 for _ in range(rng.randint(1, 4))]
        asm = TextAssembler(byte_decode, stops)
        released = ""
        for _ in range(12):
            piece = "".join(rng.choice("abc") for _ in range(rng.randint(1, 3)))
            before = len(asm.emitted)
            released += asm.add(list(piece.encode()))
            if asm.stopped:
                break
            assert len(asm.emitted) == _brute_safe_len(asm.text, stops, before)
        assert asm.emitted == released
