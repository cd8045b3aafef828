"""Logprobs in the shapes clients read: SGLang's `meta_info` keys and OpenAI's chat and
completions `logprobs` objects, from the engine's `TokenLogprob`s (pure functions).

SGLang (0.5.23, `TokenizerManager.add_logprob_to_meta_info` / `detokenize_logprob_tokens`):
a token is a `(logprob, token_id, text)` tuple, `text` None unless `return_text_in_logprobs`;
a position's alternatives are a list of such tuples, or None when the position has none (the
first prompt position, which SGLang never scores). Lists are cumulative over the request; JSON
turns the tuples into arrays.

OpenAI: `bytes` is the token's own bytes (one byte of a multi-byte character is that byte,
not U+FFFD's encoding: `pdcache.wire.token_bytes`); a chat position's `top_logprobs`
is [] when no alternatives were asked for. Completions `text_offset` counts characters from
`text_offset_start` (OpenAI's meaning; SGLang itself writes -1 there).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, TypedDict

from pdcache.engine.api import TokenLogprob

DecodeToken = Callable[[int], str]
TokenBytes = Callable[[int], bytes]
SGLangToken = tuple[float | None, int, str | None]


class OpenAIToken(TypedDict):
    """One alternative of an OpenAI chat logprob entry."""

    token: str
    logprob: float | None
    bytes: list[int]


class OpenAIChatToken(OpenAIToken):
    """One position of an OpenAI chat choice's `logprobs.content`."""

    top_logprobs: list[OpenAIToken]


class OpenAIChatLogprobs(TypedDict):
    content: list[OpenAIChatToken]


class OpenAICompletionLogprobs(TypedDict):
    tokens: list[str]
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]


def sglang_logprob_fields(
    output: list[TokenLogprob],
    input_: list[TokenLogprob] | None,
    *,
    top_n: int,
    token_ids: bool,
    decode_token: DecodeToken | None,
) -> dict[str, Any]:
    """SGLang's logprob `meta_info` keys, in its order: `input_token_logprobs`,
    `output_token_logprobs`, `output_token_logprobs_length`, then with `top_n > 0`
    `input_top_logprobs` / `output_top_logprobs`, then with `token_ids` (a
    `token_ids_logprob` list was sent) `input_token_ids_logprobs` /
    `output_token_ids_logprobs`. `decode_token` given = `return_text_in_logprobs`."""
    prompt = input_ or []
    fields: dict[str, Any] = {
        "input_token_logprobs": [
            _sglang_token(e.logprob, e.token_id, decode_token) for e in prompt
        ],
        "output_token_logprobs": [
            _sglang_token(e.logprob, e.token_id, decode_token) for e in output
        ],
        "output_token_logprobs_length": len(output),
    }
    if top_n > 0:
        fields["input_top_logprobs"] = [_sglang_pairs(e.top[:top_n], decode_token) for e in prompt]
        fields["output_top_logprobs"] = [_sglang_pairs(e.top[:top_n], decode_token) for e in output]
    if token_ids:
        fields["input_token_ids_logprobs"] = [
            _sglang_pairs(e.selected, decode_token) for e in prompt
        ]
        fields["output_token_ids_logprobs"] = [
            _sglang_pairs(e.selected, decode_token) for e in output
        ]
    return fields


def openai_chat_logprobs(
    output: list[TokenLogprob], decode_token: DecodeToken, token_bytes: TokenBytes | None = None
) -> OpenAIChatLogprobs:
    """A chat choice's `logprobs`: `{"content": [{"token", "logprob", "bytes",
    "top_logprobs": [{"token", "logprob", "bytes"}]}]}`. `token_bytes`: a token's raw bytes
    (`pdcache.wire.token_bytes`); without it, the UTF-8 of its text."""
    raw = token_bytes or (lambda token_id: decode_token(token_id).encode("utf-8"))
    content: list[OpenAIChatToken] = []
    for entry in output:
        token = _openai_token(entry.token_id, entry.logprob, decode_token, raw)
        top = [_openai_token(t, lp, decode_token, raw) for t, lp in entry.top]
        content.append(OpenAIChatToken(**token, top_logprobs=top))
    return {"content": content}


def openai_completion_logprobs(
    output: list[TokenLogprob], decode_token: DecodeToken, text_offset_start: int = 0
) -> OpenAICompletionLogprobs:
    """A completion choice's `logprobs`: `tokens`, `token_logprobs`, `top_logprobs` (per
    position a `{text: logprob}` dict of its alternatives; None for a position without a
    logprob) and `text_offset` (where each token's text starts)."""
    tokens: list[str] = []
    token_logprobs: list[float | None] = []
    top_logprobs: list[dict[str, float] | None] = []
    text_offset: list[int] = []
    offset = text_offset_start
    for entry in output:
        text = decode_token(entry.token_id)
        tokens.append(text)
        token_logprobs.append(entry.logprob)
        top_logprobs.append(
            None if entry.logprob is None else {decode_token(t): lp for t, lp in entry.top}
        )
        text_offset.append(offset)
        offset += len(text)
    return {
        "tokens": tokens,
        "token_logprobs": token_logprobs,
        "top_logprobs": top_logprobs,
        "text_offset": text_offset,
    }


def _sglang_token(
    logprob: float | None, token_id: int, decode_token: DecodeToken | None
) -> SGLangToken:
    return (logprob, token_id, None if decode_token is None else decode_token(token_id))


def _sglang_pairs(
    pairs: Sequence[tuple[int, float]], decode_token: DecodeToken | None
) -> list[SGLangToken] | None:
    # SGLang's detokenize_top_logprobs_tokens: an empty position is None, not []
    if not pairs:
        return None
    return [_sglang_token(lp, t, decode_token) for t, lp in pairs]


def _openai_token(token_id: int, logprob: float | None, decode_token: DecodeToken,
                  token_bytes: TokenBytes) -> OpenAIToken:
    return {"token": decode_token(token_id), "logprob": logprob,
            "bytes": list(token_bytes(token_id))}
