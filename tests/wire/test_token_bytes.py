"""A token's raw bytes (OpenAI logprobs' `bytes`): one byte of a multi-byte character is that
byte, never U+FFFD's encoding, for the byte tokenizer and a byte-level BPE tokenizer.json."""

from __future__ import annotations

from pathlib import Path

import pytest

from pdcache.engine.export import build_hf_tokenizer
from pdcache.engine.presets import byte_tokenizer
from pdcache.engine.tokenizer import HFTokenizer, Tokenizer
from pdcache.wire.token_bytes import TokenBytes, byte_level_decoder

EURO = "€".encode()  # three bytes, each a partial character alone


@pytest.fixture(scope="module", params=["byte", "hf_byte_level"])
def tokenizer(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
              ) -> Tokenizer:
    tok = byte_tokenizer()
    if request.param == "byte":
        return tok
    # the same ids as a checkpoint's byte-level BPE tokenizer.json (one token per byte)
    folder: Path = tmp_path_factory.mktemp("hf")
    build_hf_tokenizer(tok).save(str(folder / "tokenizer.json"))
    return HFTokenizer(folder)


def test_a_partial_character_token_is_its_own_byte(tokenizer: Tokenizer) -> None:
    token_bytes = TokenBytes(tokenizer)
    ids = tokenizer.encode("a€")
    assert len(ids) == 4
    assert [token_bytes(i) for i in ids] == [b"a", EURO[:1], EURO[1:2], EURO[2:]]


def test_a_whole_token_is_the_utf8_of_its_text(tokenizer: Tokenizer) -> None:
    token_bytes = TokenBytes(tokenizer)
    special = 256  # the first special token, in both vocabularies
    text = tokenizer.decode([special], skip_special_tokens=False)
    assert text.startswith("<|") and token_bytes(special) == text.encode()
    assert token_bytes(tokenizer.encode(" ")[0]) == b" "


def test_byte_level_decoder_covers_every_byte_once() -> None:
    decoder = byte_level_decoder()
    assert sorted(decoder.values()) == list(range(256))
    assert (decoder["!"], decoder["Ġ"], decoder["Ā"]) == (ord("!"), ord(" "), 0)
