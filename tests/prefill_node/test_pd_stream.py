"""A prefill node's SSE answer and a decode node's stream after a streamed first token
(docs/pd-protocol.md "First token from prefill"), on a REAL pair over HTTP (tiny preset, zmq
KV transfer), driven as the router drives it: P's first event is the first token's chunk, its
last the JSON answer it gives without `stream`; D's stream with `first_token_streamed` holds
every token after the first (incremental) or drops the chunk of the first token alone
(cumulative), and still ends with its final event for a one-token answer. sglang-router's
`bootstrap_*` bodies get P's JSON answer even with `stream: true`."""

from __future__ import annotations

import concurrent.futures
import secrets
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

pytest.importorskip("pdcache.prefill_node.runtime", reason="the prefill node is not in this build")
pytest.importorskip("pdcache.decode_node.runtime", reason="the decode node is not in this build")

from pdcache.engine.loader import load_model  # noqa: E402
from tests.pd_harness import PDStack, node_setups, start_stack  # noqa: E402
from tests.router_support import sse_events  # noqa: E402

pytestmark = pytest.mark.slow

PROMPT = [(11 + 5 * i) % 250 for i in range(27)]


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[PDStack]:
    model = load_model("tiny", seed=0)
    prefill, decode = node_setups(tmp_path_factory.mktemp("pd"), model[0], 4, "zmq", offload=False)
    pd = start_stack(prefill, decode)
    try:
        yield pd
    finally:
        pd.close()


def pair(
    stack: PDStack,
    max_new_tokens: int,
    *,
    p_stream: bool,
    first_streamed: bool,
    incremental: bool = True,
    **extra: Any,
) -> tuple[httpx.Response, httpx.Response]:
    """One request to P and D at once, streaming from D; each in its own cache namespace."""
    room = secrets.randbits(63)
    base = {
        "input_ids": PROMPT,
        "cache_salt": f"s{room}",
        "incremental_streaming_output": incremental,
        "sampling_params": {
            "max_new_tokens": max_new_tokens,
            "temperature": 0.0,
            "ignore_eos": True,
        },
        **extra,
    }
    p_body = {
        **base,
        "stream": p_stream,
        "pd": {"room": room, "role": "prefill", "decode_node": "d0"},
    }
    d_pd = {"room": room, "role": "decode", "bootstrap": stack.bootstrap, "prefill_node": "p0"}
    if first_streamed:
        d_pd["first_token_streamed"] = True
    d_body = {**base, "stream": True, "pd": d_pd}
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        p = pool.submit(stack.client.post, f"{stack.prefill.url}/generate", json=p_body)
        d = pool.submit(stack.client.post, f"{stack.decode.url}/generate", json=d_body)
        return p.result(), d.result()


def test_prefill_streams_the_first_token_then_its_answer(stack: PDStack) -> None:
    p_plain, d_plain = pair(stack, 6, p_stream=False, first_streamed=False, return_logprob=True)
    answer = p_plain.json()
    p_sse, d_sse = pair(stack, 6, p_stream=True, first_streamed=True, return_logprob=True)
    assert p_sse.headers["content-type"].startswith("text/event-stream")
    first, last = sse_events(p_sse.text)
    assert first["output_ids"] == answer["output_ids"] and len(first["output_ids"]) == 1
    assert list(first) == ["text", "output_ids", "meta_info"]
    meta = first["meta_info"]
    assert meta["finish_reason"] is None and "e2e_latency" not in meta
    assert meta["completion_tokens"] == 1 and meta["prompt_tokens"] == len(PROMPT)
    assert [t for _, t, _ in meta["output_token_logprobs"]] == first["output_ids"]
    # the last event is P's JSON answer (its accounting: the router's p_task result)
    assert set(last) == set(answer) and last["output_ids"] == answer["output_ids"]
    assert last["pd"]["bytes"] == answer["pd"]["bytes"] > 0
    assert last["meta_info"]["finish_reason"] == answer["meta_info"]["finish_reason"]
    # D after a streamed first token: every later token, once; the same tokens and logprobs
    plain, after = sse_events(d_plain.text), sse_events(d_sse.text)
    ids = [i for e in plain for i in e["output_ids"]]
    assert [i for e in after for i in e["output_ids"]] == ids[1:]
    lps = [x for e in plain for x in e["meta_info"]["output_token_logprobs"]]
    assert [x for e in after for x in e["meta_info"]["output_token_logprobs"]] == lps[1:]
    assert first["text"] + "".join(e["text"] for e in after) == "".join(e["text"] for e in plain)
    assert after[-1]["meta_info"]["completion_tokens"] == 6


def test_decode_after_a_streamed_first_token_cumulative_and_one_token(stack: PDStack) -> None:
    _, d_on = pair(stack, 5, p_stream=True, first_streamed=True, incremental=False)
    _, d_off = pair(stack, 5, p_stream=False, first_streamed=False, incremental=False)
    on, off = sse_events(d_on.text), sse_events(d_off.text)
    # admitted: D's response began before the K/V (an SSE comment); without the flag it did not
    assert d_on.text.startswith(": admitted\n\n") and d_off.text.startswith("data: ")
    assert off[0]["output_ids"] == on[-1]["output_ids"][:1]  # without the flag: token 1 alone
    assert all(len(e["output_ids"]) > 1 for e in on)  # with it: that chunk is not sent again
    assert on[-1]["output_ids"] == off[-1]["output_ids"] and on[-1]["text"] == off[-1]["text"]
    # an answer of one token: D's only event is its end (the token itself was P's)
    p_one, d_one = pair(stack, 1, p_stream=True, first_streamed=True)
    (final,) = sse_events(d_one.text)
    assert final["output_ids"] == [] and final["text"] == ""
    assert final["meta_info"]["finish_reason"]["type"] == "length"
    assert final["meta_info"]["completion_tokens"] == 1
    assert len(sse_events(p_one.text)[0]["output_ids"]) == 1


def test_sglang_router_bodies_get_json_even_when_streaming(stack: PDStack) -> None:
    """sglang-router sends P the client's body (`stream: true` included) with `bootstrap_*`:
    P answers JSON as before; only our router's `pd` bodies stream."""
    room = secrets.randbits(63)
    host, port = stack.bootstrap.removeprefix("tcp://").rsplit(":", 1)
    body = {
        "input_ids": PROMPT,
        "stream": True,
        "bootstrap_room": room,
        "bootstrap_host": host,
        "bootstrap_port": int(port),
        "sampling_params": {"max_new_tokens": 3, "temperature": 0.0, "ignore_eos": True},
    }
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        p = pool.submit(stack.client.post, f"{stack.prefill.url}/generate", json=body)
        d = pool.submit(stack.client.post, f"{stack.decode.url}/generate", json=body)
        p_resp, d_resp = p.result(), d.result()
    assert p_resp.status_code == 200 and p_resp.headers["content-type"] == "application/json"
    assert len(p_resp.json()["output_ids"]) == 1
    assert sse_events(d_resp.text)[0]["output_ids"][:1] == p_resp.json()["output_ids"]
