"""Prompt logprobs too big for the Done message (the P/D control message that carries them):
the prefill node refuses them at admission with 400 `logprobs_too_large`, before any compute;
past that check (disabled here) the sender aborts the room instead of sending a message decode
would drop, so both nodes answer at once instead of after the room's timeout. Also: a
`min_new_tokens` above `max_new_tokens` is a 400 on either node before any prefill."""

from __future__ import annotations

import concurrent.futures
import dataclasses
import secrets
import time
from collections.abc import Iterator

import pytest

from pdcache.engine.loader import load_model
from pdcache.prefill_node.app import PrefillApp
from tests.pd_harness import PDStack, node_setups, start_stack

PAGE = 4
PROMPT = [(5 * i + 3) % 250 for i in range(18)]
LIMIT = 8192  # max_message_bytes: 18 prompt positions with top 50 need ~7.4 KB + overhead


@pytest.fixture(scope="module")
def stack(tmp_path_factory) -> Iterator[PDStack]:
    model = load_model("tiny", seed=0)[0]
    prefill, decode = node_setups(tmp_path_factory.mktemp("pd_lp"), model, PAGE, "zmq", False)
    transfer = dataclasses.replace(prefill.transfer, max_message_bytes=LIMIT)
    prefill = dataclasses.replace(prefill, transfer=transfer)
    decode = dataclasses.replace(decode, transfer=transfer)
    stack = start_stack(prefill, decode)
    try:
        yield stack
    finally:
        stack.close()


def bodies(stack: PDStack, start: int, top_n: int) -> tuple[dict, dict]:
    room = secrets.randbits(63)
    base = {
        "input_ids": PROMPT,
        "sampling_params": {"max_new_tokens": 3, "ignore_eos": True},
        "return_logprob": True,
        "logprob_start_len": start,
        "top_logprobs_num": top_n,
    }
    return (
        {**base, "pd": {"room": room, "role": "prefill", "decode_node": "d0"}},
        {
            **base,
            "pd": {
                "room": room,
                "role": "decode",
                "bootstrap": stack.bootstrap,
                "prefill_node": "p0",
            },
        },
    )


def pair(stack: PDStack, start: int, top_n: int):
    p_body, d_body = bodies(stack, start, top_n)
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        p = pool.submit(stack.client.post, f"{stack.prefill.url}/generate", json=p_body)
        d = pool.submit(stack.client.post, f"{stack.decode.url}/generate", json=d_body)
        return p.result(), d.result()


def test_oversized_prompt_logprobs_are_refused_at_admission(stack) -> None:
    p_body, _ = bodies(stack, 0, 50)
    computed = stack.prefill_server.engine.check_accounting()
    answer = stack.client.post(f"{stack.prefill.url}/generate", json=p_body, timeout=10)
    assert answer.status_code == 400, answer.text
    assert answer.json()["error"]["code"] == "logprobs_too_large"
    assert stack.prefill_server.engine.check_accounting() == computed
    # the same request from the last prompt position fits and crosses the pair
    p, d = pair(stack, len(PROMPT) - 2, 50)
    assert p.status_code == d.status_code == 200, (p.text, d.text)
    assert len(d.json()["meta_info"]["input_top_logprobs"]) == 2


def test_the_sender_aborts_a_room_whose_done_is_too_big(stack, monkeypatch) -> None:
    monkeypatch.setattr(PrefillApp, "_check_logprobs_fit", lambda self, lp, n: None)
    started = time.monotonic()
    p, d = pair(stack, 0, 100)  # ~14.6 KB of prompt logprobs
    elapsed = time.monotonic() - started
    assert elapsed < stack.prefill_server.sender.config.room_timeout_s / 2, elapsed
    assert p.status_code >= 500 and d.status_code >= 500, (p.text, d.text)
    assert "logprobs_too_large" in p.text or "message limit" in p.text, p.text
    assert stack.prefill_server.sender.counters["oversized_done"] == 1


@pytest.mark.parametrize("node", ["prefill", "decode"])
def test_min_new_tokens_above_max_is_refused_before_any_prefill(stack, node: str) -> None:
    p_body, d_body = bodies(stack, len(PROMPT) - 1, 0)
    body = p_body if node == "prefill" else d_body
    body["sampling_params"] = {"max_new_tokens": 2, "min_new_tokens": 5}
    before = stack.prefill_server.engine.stats()["tokens_computed_total"]
    answer = stack.client.post(getattr(stack, node).url + "/generate", json=body, timeout=10)
    assert answer.status_code == 400, answer.text
    assert answer.json()["error"]["param"] == "sampling_params.min_new_tokens"
    assert stack.prefill_server.engine.stats()["tokens_computed_total"] == before
