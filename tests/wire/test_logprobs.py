"""Logprob formatting: SGLang's meta_info keys byte-compared with the installed sglang's own
`TokenizerManager.add_logprob_to_meta_info` (its methods run on our values), OpenAI's chat
and completions shapes, and completions' `text_offset` indexing the choice's own text
(special tokens skipped, characters split over tokens, stop strings, stream chunks)."""

from __future__ import annotations

import ast
import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from pdcache.engine.api import TokenLogprob
from pdcache.engine.export import build_hf_tokenizer
from pdcache.engine.presets import byte_tokenizer
from pdcache.engine.tokenizer import HFTokenizer
from pdcache.wire.agent import AgentFeatures
from pdcache.wire.detokenize import TextAssembler
from pdcache.wire.logprobs import (
    TextOffsets,
    openai_chat_logprobs,
    openai_completion_logprobs,
    sglang_logprob_fields,
)
from pdcache.wire.protocol import CompletionRequest

TEXTS = {5: "Hel", 7: "lo", 9: " wor", 11: "ld", 13: "é", 2: "!"}


def decode(token_id: int) -> str:
    return TEXTS[token_id]


PROMPT = [
    TokenLogprob(5, None),
    TokenLogprob(7, -1.5, top=((9, -0.5), (7, -1.5)), selected=((2, -4.0),)),
    TokenLogprob(9, -0.25, top=((9, -0.25), (11, -2.0)), selected=((2, -3.0),)),
]
OUTPUT = [
    TokenLogprob(11, -0.125, top=((11, -0.125), (13, -2.5)), selected=((2, -6.0),)),
    TokenLogprob(13, -0.75, top=((2, -0.5), (13, -0.75)), selected=((2, -0.5),)),
]


def sglang_manager_methods() -> dict[str, Any]:
    """The installed sglang's logprob methods of TokenizerManager, compiled on their own (the
    module itself needs uvloop, zmq, ...); the reference our formatting must equal."""
    sglang = pytest.importorskip("sglang")
    path = Path(sglang.__file__).parent / "srt/managers/tokenizer_manager.py"
    tree = ast.parse(path.read_text())
    manager = next(
        n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "TokenizerManager"
    )
    wanted = {
        "add_logprob_to_meta_info",
        "detokenize_logprob_tokens",
        "detokenize_top_logprobs_tokens",
    }
    namespace: dict[str, Any] = {"List": list, "Optional": Any, "ReqState": Any}
    for node in manager.body:
        if isinstance(node, ast.FunctionDef) and node.name in wanted:
            exec(compile(ast.Module([node], []), str(path), "exec"), namespace)
    assert wanted <= set(namespace)
    return namespace


def sglang_reference(top_n: int, token_ids: bool, text: bool) -> dict[str, Any]:
    methods = sglang_manager_methods()
    tokenizer = SimpleNamespace(batch_decode=lambda ids: [decode(i[0]) for i in ids])
    manager = SimpleNamespace(tokenizer=tokenizer)
    for name in ("detokenize_logprob_tokens", "detokenize_top_logprobs_tokens"):
        setattr(manager, name, methods[name].__get__(manager))

    def top_rows(entries, pick):
        vals = [None if e.logprob is None else [lp for _, lp in pick(e)] for e in entries]
        idx = [None if e.logprob is None else [t for t, _ in pick(e)] for e in entries]
        return vals, idx

    in_top_val, in_top_idx = top_rows(PROMPT, lambda e: e.top[:top_n])
    out_top_val, out_top_idx = top_rows(OUTPUT, lambda e: e.top[:top_n])
    in_ids_val, in_ids_idx = top_rows(PROMPT, lambda e: e.selected)
    out_ids_val, out_ids_idx = top_rows(OUTPUT, lambda e: e.selected)
    state = SimpleNamespace(
        obj=SimpleNamespace(
            return_flat_raw_top_logprobs=False, return_flat_raw_output_top_logprobs=False
        ),
        input_token_logprobs_val=[e.logprob for e in PROMPT],
        input_token_logprobs_idx=[e.token_id for e in PROMPT],
        input_token_logprobs=[],
        output_token_logprobs_val=[e.logprob for e in OUTPUT],
        output_token_logprobs_idx=[e.token_id for e in OUTPUT],
        output_token_logprobs=[],
        input_top_logprobs_scheduler_flat=None,
        input_top_logprobs_val=in_top_val,
        input_top_logprobs_idx=in_top_idx,
        input_top_logprobs=[],
        output_top_logprobs_val=out_top_val,
        output_top_logprobs_idx=out_top_idx,
        output_top_logprobs=[],
        input_token_ids_logprobs_val=in_ids_val,
        input_token_ids_logprobs_idx=in_ids_idx,
        input_token_ids_logprobs=[],
        output_token_ids_logprobs_val=out_ids_val,
        output_token_ids_logprobs_idx=out_ids_idx,
        output_token_ids_logprobs=[],
    )
    meta: dict[str, Any] = {}
    methods["add_logprob_to_meta_info"](
        manager, meta, state, top_n, [2] if token_ids else None, text, True
    )
    return meta


@pytest.mark.parametrize(
    "top_n,token_ids,text",
    [
        (0, False, False),
        (2, False, True),
        (1, True, False),
        (2, True, True),
    ],
)
def test_sglang_fields_equal_sglangs_own_meta_info(top_n: int, token_ids: bool, text: bool) -> None:
    ours = sglang_logprob_fields(
        OUTPUT, PROMPT, top_n=top_n, token_ids=token_ids, decode_token=decode if text else None
    )
    reference = sglang_reference(top_n, token_ids, text)
    assert ours == reference
    assert list(ours) == list(reference)  # same keys, same order
    assert json.dumps(ours) == json.dumps(reference)


def test_sglang_fields_values_and_no_input() -> None:
    fields = sglang_logprob_fields(OUTPUT, None, top_n=1, token_ids=False, decode_token=decode)
    assert fields == {
        "input_token_logprobs": [],
        "output_token_logprobs": [(-0.125, 11, "ld"), (-0.75, 13, "é")],
        "output_token_logprobs_length": 2,
        "input_top_logprobs": [],
        "output_top_logprobs": [[(-0.125, 11, "ld")], [(-0.5, 2, "!")]],
    }
    prompt_only = sglang_logprob_fields([], PROMPT, top_n=2, token_ids=True, decode_token=None)
    assert prompt_only["input_token_logprobs"][0] == (None, 5, None)
    assert prompt_only["input_top_logprobs"][0] is None  # SGLang never scores it
    assert prompt_only["input_token_ids_logprobs"][1] == [(-4.0, 2, None)]


def test_openai_chat_logprobs() -> None:
    assert openai_chat_logprobs(OUTPUT, decode) == {
        "content": [
            {
                "token": "ld",
                "logprob": -0.125,
                "bytes": [108, 100],
                "top_logprobs": [
                    {"token": "ld", "logprob": -0.125, "bytes": [108, 100]},
                    {"token": "é", "logprob": -2.5, "bytes": [195, 169]},
                ],
            },
            {
                "token": "é",
                "logprob": -0.75,
                "bytes": [195, 169],
                "top_logprobs": [
                    {"token": "!", "logprob": -0.5, "bytes": [33]},
                    {"token": "é", "logprob": -0.75, "bytes": [195, 169]},
                ],
            },
        ]
    }
    bare = [TokenLogprob(9, -1.0)]
    assert openai_chat_logprobs(bare, decode)["content"][0]["top_logprobs"] == []


def test_openai_completion_logprobs_take_their_offsets() -> None:
    echoed = PROMPT + OUTPUT
    got = openai_completion_logprobs(echoed, decode, [3, 6, 8, 12, 14])
    assert got == {
        "tokens": ["Hel", "lo", " wor", "ld", "é"],
        "token_logprobs": [None, -1.5, -0.25, -0.125, -0.75],
        "top_logprobs": [
            None,
            {" wor": -0.5, "lo": -1.5},
            {" wor": -0.25, "ld": -2.0},
            {"ld": -0.125, "é": -2.5},
            {"!": -0.5, "é": -0.75},
        ],
        "text_offset": [3, 6, 8, 12, 14],
    }
    assert openai_completion_logprobs([], decode, []) == {
        "tokens": [],
        "token_logprobs": [],
        "top_logprobs": [],
        "text_offset": [],
    }
    with pytest.raises(ValueError, match="2 text offsets for 5 tokens"):
        openai_completion_logprobs(echoed, decode, [0, 1])


# --------------------------------------------------------------------------- text offsets

BYTES = byte_tokenizer()  # ids 0..255 are bytes, 256.. special tokens (skipped in text)
SPECIAL = BYTES.im_start_id
EURO = list("€".encode())  # one character over three tokens
# "a", a special, "€" over three bytes, "b", a special
SPECIALS_AND_EURO = [*BYTES.encode("a"), SPECIAL, *EURO, *BYTES.encode("b"), SPECIAL]


def released_text(ids: list[int], stops: list[str]) -> str:
    """A choice's text: what its `TextAssembler` releases."""
    text = TextAssembler(BYTES.decode, stops)
    return text.add(ids) + text.flush()


def test_text_offsets_skip_special_tokens_and_start_a_character_at_its_first_byte() -> None:
    assert released_text(SPECIALS_AND_EURO, []) == "a€b"
    offsets = TextOffsets(BYTES.decode, []).next(SPECIALS_AND_EURO)
    assert offsets == [0, 1, 1, 1, 1, 2, 3]


@pytest.mark.parametrize("split", range(len(SPECIALS_AND_EURO) + 1))
def test_text_offsets_go_on_across_runs(split: int) -> None:
    # a stream's chunks: "€" may be split over two of them
    offsets = TextOffsets(BYTES.decode, [])
    runs = offsets.next(SPECIALS_AND_EURO[:split]) + offsets.next(SPECIALS_AND_EURO[split:])
    assert runs == [0, 1, 1, 1, 1, 2, 3]


def test_text_offsets_of_an_invalid_byte_point_at_its_replacement_character() -> None:
    ids = [*BYTES.encode("a"), EURO[0], *BYTES.encode("b"), EURO[1]]  # ends mid-character
    assert released_text(ids, []) == "a\ufffdb\ufffd"
    assert TextOffsets(BYTES.decode, []).next(ids) == [0, 1, 2, 3]


def test_text_offsets_stay_within_a_text_a_stop_string_cut() -> None:
    ids = BYTES.encode("ab€xyz")
    assert released_text(ids, ["€x"]) == "ab"
    # the stop string's tokens, and those after it in the same run, are at the text's end
    assert TextOffsets(BYTES.decode, ["€x"]).next(ids) == [0, 1, 2, 2, 2, 2, 2, 2]


def test_text_offsets_of_a_held_stop_string_start() -> None:
    ids = BYTES.encode("axyb")
    assert released_text(ids, ["xyz"]) == "axyb"
    # "y" arrives while "xy" may still start "xyz": it points where the held text starts
    assert TextOffsets(BYTES.decode, ["xyz"]).next(ids) == [0, 1, 1, 3]


def test_completion_choices_write_tokens_keys_and_offsets_of_their_own_text() -> None:
    agent = AgentFeatures(BYTES, BYTES.vocab_size, "hermes")
    plan = agent.completion_plan(CompletionRequest(prompt="x", logprobs=1))
    first, second = plan.output(0), plan.output(1)
    runs = [SPECIALS_AND_EURO[:3], SPECIALS_AND_EURO[3:]]  # "€" split over two deltas
    streamed = [first.add(text, chosen(run)).logprobs for text, run in zip(["a", "€b"], runs,
                                                                          strict=True)]
    first.finish("length")
    assert [run["text_offset"] for run in streamed if run] == [[0, 1, 1], [1, 1, 2, 3]]
    whole = first.body("length")["logprobs"]
    keys = ["a", "<|im_start|>", "bytes:\\xe2", "bytes:\\x82", "bytes:\\xac", "b", "<|im_start|>"]
    assert whole["tokens"] == keys
    assert [key for top in whole["top_logprobs"] for key in top] == keys
    assert whole["text_offset"] == [0, 1, 1, 1, 1, 2, 3]
    # each choice has its own offsets
    assert second.add("b", chosen(BYTES.encode("b"))).logprobs["text_offset"] == [0]


def chosen(ids: list[int]) -> list[TokenLogprob]:
    return [TokenLogprob(token_id, -1.0, top=((token_id, -1.0),)) for token_id in ids]


def test_token_key_of_a_byte_level_bpe_partial_character(tmp_path: Path) -> None:
    build_hf_tokenizer(BYTES).save(str(tmp_path / "tokenizer.json"))
    tokenizer = HFTokenizer(tmp_path)
    agent = AgentFeatures(tokenizer, tokenizer.vocab_size, "hermes")
    assert [agent.token_key(i) for i in tokenizer.encode("a€")] == [
        "a", "bytes:\\xe2", "bytes:\\x82", "bytes:\\xac"
    ]
