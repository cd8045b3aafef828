"""Decode admission that waits, on real tiny-preset nodes over HTTP with the zmq
transfer engine (tests/pd_harness.py).

- a burst of N = pool / prompt + 2 concurrent long prompts on a small decode pool: all
  succeed; the ones that did not fit waited in decode's admission queue (metrics), prefill
  computed none of them before decode asked (its gate), page accounting exact on both nodes;
- a prompt that can never fit decode's pool: 400 at once, with the limit;
- the queue bound (503 `queue_full`), a caller gone while queued (the queue empties, nothing
  leaks) and a passed deadline (503 `queue_timeout`, `Retry-After`), on a decode node whose
  pool is held by a reservation of the test's own (`Engine.reserve`, which never queues).

Protections and how each test fails with it off: see the comments in the tests."""

from __future__ import annotations

import concurrent.futures
import dataclasses
import secrets
import time
from collections.abc import Iterator

import httpx
import pytest

from pdcache.engine.loader import load_model
from pdcache.engine.request import pages_for
from tests.pd_harness import (
    PDStack,
    assert_stack_idle,
    metric_value,
    node_setups,
    start_stack,
)
from tests.polling import poll

PAGE = 16
PROMPT_TOKENS = 300  # 19 pages
NEW_TOKENS = 48  # 300 + 48 tokens = 22 pages per request
PER_REQUEST = pages_for(PROMPT_TOKENS + NEW_TOKENS, PAGE)
FITS = 3
POOL = FITS * PER_REQUEST + PER_REQUEST // 2  # room for 3 requests, not 4
BURST = FITS + 2
HOG = "test-hog"


def with_decode(decode, pages: int, max_pending: int, room_timeout_s: float | None = None):
    engine = decode.engine
    engine = dataclasses.replace(
        engine, cache=dataclasses.replace(engine.cache, num_device_pages=pages),
        scheduler=dataclasses.replace(engine.scheduler, max_pending_reservations=max_pending))
    transfer = decode.transfer
    if room_timeout_s is not None:
        transfer = dataclasses.replace(transfer, room_timeout_s=room_timeout_s)
    return dataclasses.replace(decode, engine=engine, transfer=transfer)


@pytest.fixture(scope="module")
def model():
    return load_model("tiny", seed=0)[0]


@pytest.fixture(scope="module")
def burst_stack(tmp_path_factory, model) -> Iterator[PDStack]:
    prefill, decode = node_setups(tmp_path_factory.mktemp("burst"), model, PAGE, "zmq",
                                  offload=False)
    stack = start_stack(prefill, with_decode(decode, POOL, max_pending=16))
    try:
        yield stack
    finally:
        stack.close()


@pytest.fixture(scope="module")
def tight_stack(tmp_path_factory, model) -> Iterator[PDStack]:
    """Decode: a queue of 1, and a deadline of ROOM_TIMEOUT_S (min(request, room timeout))."""
    prefill, decode = node_setups(tmp_path_factory.mktemp("tight"), model, PAGE, "zmq",
                                  offload=False)
    stack = start_stack(prefill, with_decode(decode, POOL, max_pending=1,
                                             room_timeout_s=ROOM_TIMEOUT_S))
    try:
        yield stack
    finally:
        stack.close()


ROOM_TIMEOUT_S = 3.0


def prompt(seed: int, n: int = PROMPT_TOKENS) -> list[int]:
    return [(seed * 31 + 7 * i) % 250 + 3 for i in range(n)]


def decode_body(stack: PDStack, input_ids: list[int], new_tokens: int = NEW_TOKENS) -> dict:
    return {"input_ids": input_ids,
            "sampling_params": {"max_new_tokens": new_tokens, "ignore_eos": True},
            "pd": {"room": secrets.randbits(63), "role": "decode", "bootstrap": stack.bootstrap,
                   "prefill_node": "p0"}}


def metrics(stack: PDStack, which: str = "decode") -> str:
    url = stack.decode.url if which == "decode" else stack.prefill.url
    return stack.client.get(f"{url}/metrics").text


def queue_depth(stack: PDStack) -> float:
    return metric_value(metrics(stack), "pdcache_decode_admission_queue_depth")


def test_a_burst_larger_than_the_decode_pool_waits_and_every_request_succeeds(
        burst_stack: PDStack) -> None:
    # Protection: the admission queue. With it off (max_pending_reservations=0, i.e. main's
    # behaviour: refuse when the pool is short) requests 4 and 5 get 503 "decode node full" and
    # the `"output_ids" in d` assertion fails.
    stack = burst_stack
    with concurrent.futures.ThreadPoolExecutor(BURST) as pool:
        answers = list(pool.map(lambda s: stack.generate(prompt(s), NEW_TOKENS), range(BURST)))
    for p, d in answers:
        assert "output_ids" in d, (p, d)
        assert len(d["output_ids"]) == NEW_TOKENS and p["output_ids"] == d["output_ids"][:1]
    text = metrics(stack)
    queued = metric_value(text, "pdcache_decode_admission_admitted_total", queued="true")
    at_once = metric_value(text, "pdcache_decode_admission_admitted_total", queued="false")
    assert queued + at_once == BURST and queued >= BURST - FITS, text
    assert metric_value(text, "pdcache_decode_admission_wait_seconds_count") == BURST
    assert metric_value(text, "pdcache_decode_admission_wait_seconds_sum") > 0  # they waited
    for reason in ("never_fits", "queue_full", "deadline"):
        assert metric_value(text, "pdcache_decode_admission_rejected_total", reason=reason) == 0
    assert metric_value(text, "pdcache_decode_admission_queue_depth") == 0
    # prefill held every request out of compute until decode asked for its K/V
    p_text = metrics(stack, "prefill")
    assert metric_value(p_text, "pdcache_prefill_decode_wait_seconds_count") == BURST
    assert metric_value(p_text, "pdcache_prefill_decode_wait_seconds_sum") > 0
    assert metric_value(p_text, "pdcache_prefill_waiting_for_decode") == 0
    assert_stack_idle(stack)  # exact page accounting on both nodes, no room left


def test_a_prompt_larger_than_the_pool_is_refused_at_once(burst_stack: PDStack) -> None:
    stack = burst_stack
    too_long = POOL * PAGE - NEW_TOKENS + 1  # prompt + max_new_tokens is one token too many
    started = time.monotonic()
    r = stack.client.post(f"{stack.decode.url}/generate",
                          json=decode_body(stack, prompt(1, too_long)))
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["code"] == "kv_exceeds_pool" and f"holds {POOL} pages" in error["message"]
    assert time.monotonic() - started < 5  # at once, not after a wait
    text = metrics(stack)
    assert metric_value(text, "pdcache_decode_admission_rejected_total", reason="never_fits") == 1
    assert_stack_idle(stack)


def test_queue_bound_caller_gone_and_deadline(tight_stack: PDStack) -> None:
    stack = tight_stack
    engine = stack.decode_server.engine
    engine.reserve(HOG, (POOL - PER_REQUEST + 1) * PAGE)  # the pool is held: requests wait
    try:
        # 1. a caller that leaves while queued leaves the queue. Protection: leave() cancels
        # the queued reservation; without it the queue depth stays 1 (wait_for fails) and the
        # next request finds the queue full.
        with httpx.Client(timeout=httpx.Timeout(10, read=ROOM_TIMEOUT_S / 3)) as impatient:
            with pytest.raises(httpx.ReadTimeout):
                impatient.post(f"{stack.decode.url}/generate",
                               json=decode_body(stack, prompt(2)))
        assert poll(lambda: queue_depth(stack) == 0, 10), metrics(stack)
        # 2. the bound: one queued request fills a queue of 1; the next is refused at once.
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            waiting = pool.submit(stack.client.post, f"{stack.decode.url}/generate",
                                  json=decode_body(stack, prompt(3)))
            assert poll(lambda: queue_depth(stack) == 1, 10)
            started = time.monotonic()
            full = stack.client.post(f"{stack.decode.url}/generate",
                                     json=decode_body(stack, prompt(4)))
            assert full.status_code == 503, full.text
            assert full.json()["error"]["code"] == "queue_full"
            assert int(full.headers["Retry-After"]) >= 1
            assert time.monotonic() - started < ROOM_TIMEOUT_S / 2
            # 3. the queued one's deadline (min(request timeout, room timeout)) passes
            late = waiting.result(timeout=ROOM_TIMEOUT_S + 10)
        assert late.status_code == 503, late.text
        assert late.json()["error"]["code"] == "queue_timeout"
        assert int(late.headers["Retry-After"]) >= 1
        text = metrics(stack)
        for reason, count in (("queue_full", 1), ("deadline", 1), ("never_fits", 0)):
            assert metric_value(text, "pdcache_decode_admission_rejected_total",
                                reason=reason) == count, text
        # the 503 is answered before the engine thread drops the reservation (leave() aborts
        # it there): on a loaded machine the gauge can still read 1 for a moment
        assert poll(lambda: queue_depth(stack) == 0, 10), metrics(stack)
        assert metric_value(text, "pdcache_decode_admission_admitted_total", queued="true") == 0
    finally:
        assert engine.release_reservation(HOG)
    assert_stack_idle(stack)  # nothing queued, reserved or held is left behind
    # the node serves again once the pool is free
    p, d = stack.generate(prompt(5), 4)
    assert len(d["output_ids"]) == 4, (p, d)
    assert_stack_idle(stack)
