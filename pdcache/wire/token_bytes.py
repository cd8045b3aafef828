"""The raw bytes of one token (OpenAI logprobs' `bytes`), from the tokenizer's vocabulary.

A token that is part of a multi-byte character decodes alone to U+FFFD, whose UTF-8 bytes
say nothing of the token; its own bytes let a client rebuild the character from consecutive
tokens. The byte tokenizer's ids 0..255 are their bytes; a checkpoint tokenizer's piece is
read from its tokenizer.json: a byte-level BPE piece (GPT-2's byte -> printable character
map) or a SentencePiece byte-fallback piece (`<0xNN>`). Every other token's bytes are the
UTF-8 encoding of its text.
"""

from __future__ import annotations

import re
from functools import cached_property
from typing import Any

from pdcache.engine.tokenizer import ByteTokenizer, HFTokenizer, Tokenizer

_BYTE_FALLBACK = re.compile(r"<0x([0-9A-Fa-f]{2})>")


def byte_level_decoder() -> dict[str, int]:
    """Byte-level BPE's printable character -> byte map (the inverse of GPT-2's
    `bytes_to_unicode`, which the `tokenizers` ByteLevel decoder uses)."""
    printable = {*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
                 *range(ord("®"), ord("ÿ") + 1)}
    chars, shifted = {}, 0
    for byte in range(256):
        if byte in printable:
            chars[chr(byte)] = byte
        else:
            chars[chr(256 + shifted)] = byte
            shifted += 1
    return chars


class TokenBytes:
    """`token_bytes(token_id)`: the token's raw bytes. Loads a checkpoint's vocabulary on
    first need (a partial-character token), once."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer

    def __call__(self, token_id: int) -> bytes:
        text = self.tokenizer.decode([token_id], skip_special_tokens=False)
        if "\ufffd" not in text:  # a whole-character token: its text is its bytes
            return text.encode("utf-8")
        raw = self._raw(token_id)
        return text.encode("utf-8") if raw is None else raw

    def _raw(self, token_id: int) -> bytes | None:
        if isinstance(self.tokenizer, ByteTokenizer):
            return bytes([token_id]) if token_id < 256 else None
        piece = self._vocabulary.id_to_token(token_id) if self._vocabulary else None
        if piece is None:
            return None
        fallback = _BYTE_FALLBACK.fullmatch(piece)
        if fallback is not None:
            return bytes([int(fallback.group(1), 16)])
        decoder = self._byte_decoder
        if all(char in decoder for char in piece):
            return bytes(decoder[char] for char in piece)
        return None

    @cached_property
    def _vocabulary(self) -> Any:
        if not isinstance(self.tokenizer, HFTokenizer):
            return None
        from tokenizers import Tokenizer as RustTokenizer

        return RustTokenizer.from_file(str(self.tokenizer.tokenizer_file))

    @cached_property
    def _byte_decoder(self) -> dict[str, int]:
        return byte_level_decoder()
