"""The rooms a prefill and a decode node report on /health (`pd_rooms_open`, `pd_held`): what
`pdcache bench chaos` reads to find leaked rooms once the stack is idle. Real tiny-preset
nodes over HTTP with the zmq transfer engine (tests/pd_harness.py).

A room opened by a prefill request whose decode half never came shows on the prefill node
while it waits, and goes once it gives up (503 `decode_wait_timeout`); a whole request
opens a room on both nodes and leaves none behind."""

from __future__ import annotations

import concurrent.futures
import dataclasses
import secrets
from collections.abc import Iterator

import httpx
import pytest

from pdcache.engine.loader import load_model
from tests.pd_harness import PDStack, node_setups, start_stack
from tests.polling import poll

pytestmark = pytest.mark.slow

PAGE = 16
BOOTSTRAP_TIMEOUT_S = 1.0  # prefill waits room_timeout + bootstrap timeout for its decode
ROOM_TIMEOUT_S = 2.0


@pytest.fixture(scope="module")
def stack(tmp_path_factory) -> Iterator[PDStack]:
    model = load_model("tiny", seed=0)[0]
    prefill, decode = node_setups(tmp_path_factory.mktemp("acct"), model, PAGE, "zmq", offload=True)
    transfer = dataclasses.replace(
        prefill.transfer, bootstrap_timeout_s=BOOTSTRAP_TIMEOUT_S, room_timeout_s=ROOM_TIMEOUT_S
    )
    stack = start_stack(dataclasses.replace(prefill, transfer=transfer), decode)
    try:
        yield stack
    finally:
        stack.close()


def health(stack: PDStack, url: str) -> dict:
    return stack.client.get(f"{url}/health").json()


def test_idle_nodes_report_no_rooms(stack: PDStack) -> None:
    prefill, decode = health(stack, stack.prefill.url), health(stack, stack.decode.url)
    assert prefill["pd_rooms_open"] == 0
    assert (decode["pd_rooms_open"], decode["pd_held"]) == (0, 0)


def test_a_prefill_room_without_decode_shows_until_it_times_out(stack: PDStack) -> None:
    body = {
        "input_ids": list(range(40)),
        "sampling_params": {"max_new_tokens": 4},
        "pd": {"room": secrets.randbits(63), "role": "prefill", "decode_node": "d0"},
    }
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        answer = pool.submit(httpx.post, f"{stack.prefill.url}/generate", json=body, timeout=60)
        assert poll(lambda: health(stack, stack.prefill.url)["pd_rooms_open"] == 1, 10)
        resp = answer.result()
    assert resp.status_code == 503, resp.text
    assert resp.json()["error"]["code"] == "decode_wait_timeout"
    assert poll(lambda: health(stack, stack.prefill.url)["pd_rooms_open"] == 0, 10)


def test_a_whole_request_leaves_no_room_behind(stack: PDStack) -> None:
    p, d = stack.generate(list(range(100, 180)), 40)
    assert len(d["output_ids"]) == 40 and p["output_ids"] == d["output_ids"][:1]
    assert stack.offload_idle(30)
    assert poll(lambda: health(stack, stack.prefill.url)["pd_rooms_open"] == 0, 10)
    decode = health(stack, stack.decode.url)
    assert poll(
        lambda: (
            (
                health(stack, stack.decode.url)["pd_rooms_open"],
                health(stack, stack.decode.url)["pd_held"],
            )
            == (0, 0)
        ),
        10,
    ), decode
