"""`FirstTokenSkip`: a decode node's stream chunks once the router already sent the first
token (docs/pd-protocol.md, "First token from prefill"), unit by unit; the node's whole stream
is tests/prefill_node/test_pd_stream.py's and tests/router/test_pd_first_token.py's."""

from __future__ import annotations

from typing import Any

import pytest

from pdcache.decode_node.first_token import FirstTokenSkip


def _chunk(text: str, ids: list[int], final: bool = False, **meta: Any) -> dict[str, Any]:
    finish = {"type": "length", "length": 9} if final else None
    return {"text": text, "output_ids": ids, "meta_info": {"finish_reason": finish, **meta}}


def test_first_token_skip_trims_incremental_chunks() -> None:
    """Decode's stream after prefill streamed token 1 (text "ab"): a chunk that holds token 1
    and token 2 loses the first id, its text and its logprob entries; the prompt's stay."""
    skip = FirstTokenSkip(incremental=True, first_text="ab")
    lps = {"input_token_logprobs": [[None, 7, None]],
           "output_token_logprobs": [[-1.0, 1, None], [-2.0, 2, None]],
           "output_top_logprobs": [[[-1.0, 1, None]], [[-2.0, 2, None]]],
           "output_token_logprobs_length": 2}
    out = skip.trim(_chunk("abcd", [1, 2], **lps))
    assert out == _chunk("cd", [2], input_token_logprobs=[[None, 7, None]],
                         output_token_logprobs=[[-2.0, 2, None]],
                         output_top_logprobs=[[[-2.0, 2, None]]], output_token_logprobs_length=1)
    assert skip.trim(_chunk("e", [3])) == _chunk("e", [3])  # later chunks pass as they are
    # token 1 alone, its text held back (a partial character): nothing left, nothing sent
    held = FirstTokenSkip(incremental=True, first_text="")
    assert held.trim(_chunk("", [1])) is None
    assert held.trim(_chunk("\u00e9", [2])) == _chunk("\u00e9", [2])
    # an answer of one token still ends: its final chunk, empty
    one = FirstTokenSkip(incremental=True, first_text="a")
    assert one.trim(_chunk("a", [1], final=True)) == _chunk("", [], final=True)


def test_first_token_skip_text_not_a_prefix_drops_only_the_common_part(
        caplog: pytest.LogCaptureFixture) -> None:
    """Prefill's token-1 text spanning decode's chunks is dropped across them; a first text
    that is not a prefix of decode's (a tokenizer re-rendering it once token 2 came) drops
    only the common prefix, keeps the rest of decode's text and logs it."""
    spans = FirstTokenSkip(incremental=True, first_text="abc")
    assert spans.trim(_chunk("ab", [1])) is None
    assert spans.trim(_chunk("cd", [2])) == _chunk("d", [2])
    skip = FirstTokenSkip(incremental=True, first_text=" ab")
    with caplog.at_level("WARNING", logger="pdcache.decode_node.first_token"):
        out = skip.trim(_chunk(" aX yz", [1, 2]))
    assert out == _chunk("X yz", [2])  # not " yz": nothing of decode's own text is lost
    assert "does not start with" in caplog.text
    assert skip.trim(_chunk(" ab", [3])) == _chunk(" ab", [3])  # later chunks untouched


def test_first_token_skip_drops_the_cumulative_chunk_of_token_1_alone() -> None:
    skip = FirstTokenSkip(incremental=False, first_text="a")
    assert skip.trim(_chunk("a", [1])) is None
    assert skip.trim(_chunk("ab", [1, 2])) == _chunk("ab", [1, 2])
    assert FirstTokenSkip(False, "a").trim(_chunk("a", [1], final=True)) == \
        _chunk("a", [1], final=True)
