"""Byte tokenizer round trips, special tokens and chat template; HF tokenizer chat templates."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from pdcache.engine.loader import load_model
from pdcache.engine.tokenizer import BYTE_SPECIAL_TOKENS, ByteTokenizer, HFTokenizer

TOK = ByteTokenizer()


@given(st.text())
def test_byte_round_trip_any_text(text: str) -> None:
    ids = TOK.encode(text)
    assert all(0 <= i < 256 for i in ids)
    assert TOK.decode(ids) == text


def test_byte_ids_are_utf8_bytes() -> None:
    assert TOK.encode("aé") == [0x61, 0xC3, 0xA9]
    assert TOK.vocab_size == 256 + len(BYTE_SPECIAL_TOKENS) == 261


def test_special_tokens_are_never_produced_from_text() -> None:
    ids = TOK.encode("<|im_end|><|eos|>")
    assert ids == list(b"<|im_end|><|eos|>")
    assert not set(ids) & set(TOK.eos_token_ids)


def test_special_ids_and_decode() -> None:
    eos, im_end = TOK.special_ids["<|eos|>"], TOK.special_ids["<|im_end|>"]
    assert TOK.eos_token_ids == (eos, im_end)
    assert TOK.bos_token_id == 256 and TOK.pad_token_id == 258
    ids = [TOK.bos_token_id, *TOK.encode("hi"), eos]
    assert TOK.decode(ids) == "hi"
    assert TOK.decode(ids, skip_special_tokens=False) == "<|bos|>hi<|eos|>"
    with pytest.raises(ValueError, match="outside the vocabulary"):
        TOK.decode([261])


def test_decode_joins_multibyte_across_special_tokens_safely() -> None:
    euro = TOK.encode("€")
    assert TOK.decode(euro[:2]) == "\ufffd"  # an incomplete character is replaced, not raised
    assert TOK.decode([*euro, TOK.im_end_id, *euro]) == "€€"


def test_byte_chat_template() -> None:
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello"},
        {"role": "user", "content": "Again"},
    ]
    ids = TOK.apply_chat_template(messages)
    assert ids[0] == TOK.bos_token_id
    assert TOK.decode(ids, skip_special_tokens=False) == (
        "<|bos|><|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n"
        "<|im_start|>assistant\nHello<|im_end|>\n<|im_start|>user\nAgain<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    no_prompt = TOK.apply_chat_template(messages, add_generation_prompt=False)
    assert ids[: len(no_prompt)] == no_prompt  # turn t's ids are a prefix of turn t+1's


def test_chat_template_prefix_property_across_turns() -> None:
    turn1 = [{"role": "user", "content": "What is 2+2?"}]
    prompt1 = TOK.apply_chat_template(turn1)
    answer = TOK.encode("4") + [TOK.im_end_id]
    turn2 = [*turn1, {"role": "assistant", "content": "4"}, {"role": "user", "content": "x"}]
    prompt2 = TOK.apply_chat_template(turn2)
    assert prompt2[: len(prompt1) + len(answer)] == prompt1 + answer


@pytest.mark.parametrize("bad", [{"role": "user"}, {"role": 1, "content": "x"}, {}])
def test_malformed_messages_are_rejected(bad: dict) -> None:
    with pytest.raises(ValueError, match="role"):
        TOK.apply_chat_template([bad])


def test_presets_use_the_byte_tokenizer() -> None:
    model, tok = load_model("tiny")
    assert isinstance(tok, ByteTokenizer)
    assert model.config.vocab_size == tok.vocab_size
    assert model.config.eos_token_ids == tok.eos_token_ids


def _write_hf_tokenizer(path: Path, config: dict) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"[UNK]": 0, "hello": 1, "world": 2, "<s>": 3, "</s>": 4}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.add_special_tokens(["<s>", "</s>"])
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps(config))


def test_hf_tokenizer_special_tokens_and_template(tmp_path: Path) -> None:
    template = (
        "{{ bos_token }}{% for m in messages %}{{ m['content'] }} {% endfor %}"
        "{% if add_generation_prompt %}world{% endif %}"
    )
    config = {"bos_token": {"content": "<s>"}, "eos_token": "</s>", "chat_template": template}
    _write_hf_tokenizer(tmp_path, config)
    tok = HFTokenizer(tmp_path, eos_token_ids=[2])
    assert tok.bos_token_id == 3
    assert tok.eos_token_ids == (2, 4)
    assert tok.encode("hello world") == [1, 2]
    assert tok.apply_chat_template([{"role": "user", "content": "hello"}]) == [3, 1, 2]
    assert tok.decode([3, 1, 4]) == "hello"


def test_hf_template_errors_are_value_errors(tmp_path: Path) -> None:
    template = "{{ raise_exception('only user messages') }}"
    _write_hf_tokenizer(tmp_path, {"chat_template": template})
    tok = HFTokenizer(tmp_path)
    with pytest.raises(ValueError, match="only user messages"):
        tok.apply_chat_template([{"role": "user", "content": "hello"}])


def test_hf_chat_template_from_jinja_file(tmp_path: Path) -> None:
    _write_hf_tokenizer(tmp_path, {})
    (tmp_path / "chat_template.jinja").write_text("{{ messages[0]['content'] }}")
    tok = HFTokenizer(tmp_path)
    assert tok.apply_chat_template([{"role": "user", "content": "world"}]) == [2]


def test_hf_tokenizer_missing_file_names_it(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="tokenizer.json"):
        HFTokenizer(tmp_path)


def test_template_kwargs_reach_the_chat_template(tmp_path: Path) -> None:
    """`chat_template_kwargs` ({"enable_thinking": false}, read the way Qwen3's template reads
    it): the generation prompt changes; without it, or with true, it does not; a variable
    the server sets is refused."""
    template = ("{% for m in messages %}{{ m['content'] }} {% endfor %}"
                "{% if enable_thinking is defined and enable_thinking is false %}hello "
                "{% endif %}world")
    _write_hf_tokenizer(tmp_path, {"chat_template": template})
    tok = HFTokenizer(tmp_path)
    chat = [{"role": "user", "content": "hello"}]
    assert tok.apply_chat_template(chat) == [1, 2]
    assert tok.apply_chat_template(chat, template_kwargs={"enable_thinking": False}) == [1, 1, 2]
    assert tok.apply_chat_template(chat, template_kwargs={"enable_thinking": True}) == [1, 2]
    with pytest.raises(ValueError, match="server's to set"):
        tok.apply_chat_template(chat, template_kwargs={"add_generation_prompt": False})
    # the byte tokenizer's fixed template reads no variables: the same ids
    assert TOK.apply_chat_template(chat, template_kwargs={"enable_thinking": False}) == \
        TOK.apply_chat_template(chat)
