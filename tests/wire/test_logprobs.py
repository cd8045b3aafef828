"""Logprob formatting: SGLang's meta_info keys byte-compared with the installed sglang's own
`TokenizerManager.add_logprob_to_meta_info` (its methods run on our values), and OpenAI's chat
and completions shapes."""

from __future__ import annotations

import ast
import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from pdcache.engine.api import TokenLogprob
from pdcache.wire.logprobs import (
    openai_chat_logprobs,
    openai_completion_logprobs,
    sglang_logprob_fields,
)

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


def test_openai_completion_logprobs_offsets_count_characters() -> None:
    echoed = PROMPT + OUTPUT
    got = openai_completion_logprobs(echoed, decode, text_offset_start=3)
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
    assert openai_completion_logprobs([], decode) == {
        "tokens": [],
        "token_logprobs": [],
        "top_logprobs": [],
        "text_offset": [],
    }
