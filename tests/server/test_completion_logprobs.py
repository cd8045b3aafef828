"""Completions `logprobs.text_offset` index the choice's `text` on the unified server (the
tiny engine's random weights, which write special tokens and bytes of multi-byte or
invalid characters): each token's text is at its offset, a skipped special token adds
nothing, a byte of a character points at the character; streamed (offsets go on across
chunks), not streamed, n choices, and a text cut by a stop string."""

from __future__ import annotations

import json
from typing import Any

from fastapi.testclient import TestClient

from pdcache.engine.engine import Engine

GREEDY = {"temperature": 0.0, "ignore_eos": True}
# greedy from this prompt, the tiny preset writes special tokens and non-ASCII bytes
BODY = {"prompt": "hello", "max_tokens": 32, "logprobs": 1, **GREEDY}


def specials(engine: Engine) -> set[str]:
    """The byte tokenizer's special tokens' texts (skipped in a choice's text)."""
    return set(engine.tokenizer.special_tokens.values())


def key_bytes(token: str) -> bytes | None:
    """The bytes of a `bytes:\\xNN...` token (a byte of a multi-byte character); else None."""
    if not token.startswith("bytes:"):
        return None
    return bytes(int(pair, 16) for pair in token[len("bytes:") :].split("\\x")[1:])


def assert_offsets_index(text: str, logprobs: dict[str, Any], skipped: set[str],
                         cut: bool = False) -> None:
    """Token i's text is at `text[text_offset[i]:]` (a skipped special token's is ""); `cut`
    (a stop string ended the text): the stop string's tokens and those after it may sit at
    the text's end."""
    tokens, offsets = logprobs["tokens"], logprobs["text_offset"]
    assert len(offsets) == len(tokens) and offsets[:1] == [0], offsets
    assert offsets == sorted(offsets) and offsets[-1] <= len(text), (offsets, len(text))
    for i, (token, offset) in enumerate(zip(tokens, offsets, strict=True)):
        raw = key_bytes(token)
        if token in skipped or (cut and offset == len(text)):
            continue  # adds nothing to the text (offsets in order, checked above)
        if raw is not None:  # a byte of the character (or U+FFFD) at its offset
            char = text[offset]
            assert char == "\ufffd" or raw in char.encode(), (i, token, text, offsets)
        else:
            assert text.startswith(token, offset), (i, token, text, offsets)


def streamed_choices(client: TestClient, body: dict[str, Any]) -> dict[int, dict[str, Any]]:
    """Each choice's joined text and logprobs of a streamed answer; asserts no chunk's
    offset is past the text streamed so far."""
    r = client.post("/v1/completions", json={**body, "stream": True})
    assert r.status_code == 200, r.text
    datas = [line[6:] for line in r.text.split("\n") if line.startswith("data: ")]
    assert datas[-1] == "[DONE]"
    joined: dict[int, dict[str, Any]] = {}
    for data in datas[:-1]:
        for choice in json.loads(data)["choices"]:
            into = joined.setdefault(choice["index"], {"text": "", "tokens": [],
                                                       "text_offset": []})
            into["text"] += choice["text"]
            logprobs = choice["logprobs"] or {"tokens": [], "text_offset": []}
            assert all(o <= len(into["text"]) for o in logprobs["text_offset"])
            into["tokens"] += logprobs["tokens"]
            into["text_offset"] += logprobs["text_offset"]
    return joined


def completion(client: TestClient, body: dict[str, Any]) -> list[dict[str, Any]]:
    r = client.post("/v1/completions", json=body)
    assert r.status_code == 200, r.text
    return r.json()["choices"]


def test_offsets_index_the_text_not_streamed(client: TestClient, engine: Engine) -> None:
    [choice] = completion(client, BODY)
    logprobs = choice["logprobs"]
    assert_offsets_index(choice["text"], logprobs, specials(engine))
    # the run has what used to shift the offsets: a special token, partial characters
    assert set(logprobs["tokens"]) & specials(engine), logprobs["tokens"]
    assert any(key_bytes(t) for t in logprobs["tokens"]), logprobs["tokens"]
    # `tokens` are written as the `top_logprobs` keys (greedy: the chosen token is the top)
    assert [next(iter(top)) for top in logprobs["top_logprobs"]] == logprobs["tokens"]


def test_offsets_go_on_across_stream_chunks(client: TestClient, engine: Engine) -> None:
    [whole] = completion(client, BODY)
    streamed = streamed_choices(client, BODY)[0]
    assert_offsets_index(streamed["text"], streamed, specials(engine))
    assert (streamed["text"], streamed["tokens"], streamed["text_offset"]) == (
        whole["text"], whole["logprobs"]["tokens"], whole["logprobs"]["text_offset"])


def test_each_of_n_choices_indexes_its_own_text(client: TestClient, engine: Engine) -> None:
    body = {**BODY, "n": 3, "temperature": 1.0, "seed": 11}
    choices = completion(client, body)
    assert len(choices) == 3
    for choice in choices:
        assert_offsets_index(choice["text"], choice["logprobs"], specials(engine))
    streamed = streamed_choices(client, body)
    assert sorted(streamed) == [0, 1, 2]
    for choice in streamed.values():
        assert_offsets_index(choice["text"], choice, specials(engine))


def test_offsets_stay_within_a_text_a_stop_string_cut(
    client: TestClient, engine: Engine
) -> None:
    [full] = completion(client, BODY)
    # one ASCII character after the special token: nothing is held back as its start
    stop = next(c for c in full["text"][5:] if c.isascii() and c.isprintable())
    body = {**BODY, "stop": [stop]}
    [choice] = completion(client, body)
    assert choice["finish_reason"] == "stop" and stop not in choice["text"]
    assert_offsets_index(choice["text"], choice["logprobs"], specials(engine), cut=True)
    streamed = streamed_choices(client, body)[0]
    assert_offsets_index(streamed["text"], streamed, specials(engine), cut=True)
