"""Logprobs in the shapes clients read: SGLang's `meta_info` keys and OpenAI's chat and
completions `logprobs` objects, from the engine's `TokenLogprob`s (pure functions, but
`TextOffsets`: one choice's decoding state).

SGLang (0.5.23, `TokenizerManager.add_logprob_to_meta_info` / `detokenize_logprob_tokens`):
a token is a `(logprob, token_id, text)` tuple, `text` None unless `return_text_in_logprobs`;
a position's alternatives are a list of such tuples, or None when the position has none (the
first prompt position, which SGLang never scores). Lists are cumulative over the request; JSON
turns the tuples into arrays.

OpenAI: `bytes` is the token's own bytes (one byte of a multi-byte character is that byte,
not U+FFFD's encoding: `pdcache.wire.token_bytes`); a chat position's `top_logprobs`
is [] when no alternatives were asked for. Completions `text_offset` indexes the choice's
`text` (OpenAI's meaning; SGLang itself writes -1 there): `TextOffsets` runs the choice's own
decoding over its ids, so a skipped special token adds nothing and a character split over
tokens starts where its first byte's token does.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, TypedDict

from pdcache.engine.api import TokenLogprob
from pdcache.wire.detokenize import TextAssembler

DecodeToken = Callable[[int], str]
DecodeIds = Callable[[list[int]], str]
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
    output: list[TokenLogprob], token_key: DecodeToken, text_offset: list[int]
) -> OpenAICompletionLogprobs:
    """A completion choice's `logprobs`: `tokens` (each token's `token_key`), `token_logprobs`,
    `top_logprobs` (per position a `{token_key: logprob}` dict of its alternatives; None for a
    position without a logprob) and `text_offset` (where each token's text starts in the
    choice's text: `TextOffsets.next`), one per position of `output`."""
    if len(text_offset) != len(output):
        raise ValueError(f"{len(text_offset)} text offsets for {len(output)} tokens")
    return {
        "tokens": [token_key(entry.token_id) for entry in output],
        "token_logprobs": [entry.logprob for entry in output],
        "top_logprobs": [
            None if e.logprob is None else {token_key(t): lp for t, lp in e.top} for e in output
        ],
        "text_offset": text_offset,
    }


class TextOffsets:
    """Completions' `text_offset` of one choice, run by run (a stream's chunks go on where
    the previous one ended).

    Runs the choice's own decoding (`decode`, `stops`: its `TextAssembler`'s) one token at a
    time, so each offset indexes the choice's `text` whatever the tokens are: a token starts
    where its own text does; a skipped special token adds nothing (it points where the text
    it came after ends, before a character still pending); every byte of a multi-byte
    character points at the character's start (the bytes pending before a character is
    complete, at the first of them). No offset is past the text
    released once its token is in: a token held back as the start of a possible stop string
    (its second and later ones) points where that start is, and the tokens of the stop string
    that cut the text (and any after it) at the text's end."""

    def __init__(self, decode: DecodeIds, stops: list[str]) -> None:
        # one id at a time: per-token offsets, which the choice's own assembler (fed a run of
        # ids per engine step) cannot give
        self._text = TextAssembler(decode, stops)
        self._decode = decode
        self._decoded_ids = 0  # how many ids the decoded text covers (the rest: pending)

    def next(self, token_ids: list[int]) -> list[int]:
        """The offsets of the choice's next tokens."""
        offsets: list[int] = []
        for token_id in token_ids:
            start = len(self._text.text)
            if not self._text.stopped:  # a run may go on past the stop string's token
                start = self._add(token_id)
            # the decoded text may end in a stop string's start, which a later token cuts
            offsets.append(min(start, len(self._text.emitted)))
        return offsets

    def _add(self, token_id: int) -> int:
        """Add the token; where its own text starts in the decoded text."""
        decoded_len = len(self._text.text)
        self._text.add([token_id])
        if len(self._text.text) == decoded_len and not self._text.stopped:
            return decoded_len  # nothing of it decoded yet: a partial character, a skipped token
        # its text came with the ids pending before it: a character it completed starts at
        # that character's first byte, invalid bytes before it are U+FFFDs before it. One
        # decoded id of context, as TextAssembler keeps (SentencePiece's word spaces).
        context_start = max(0, self._decoded_ids - 1)
        context = self._decode(self._text.ids[context_start : self._decoded_ids])
        window = self._text.ids[context_start:]
        before_own = _common_prefix_len(self._decode(window[:-1]), self._decode(window))
        self._decoded_ids = len(self._text.ids)
        own_start = max(decoded_len, decoded_len - len(context) + before_own)
        # a stop string it completed cut the text: nothing of it is past the cut
        return min(own_start, len(self._text.text))


def _common_prefix_len(a: str, b: str) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


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
