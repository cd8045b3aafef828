"""Decode admission for a hybrid model through the router (docs/design.md §4.12, §4.14): on a
Qwen3-Next decode node whose pool is held (a reservation of the test's own, as in
tests/pd/test_admission.py) a routed request waits in decode's admission queue, the next one
beyond the queue's bound gets 503 `queue_full` with `Retry-After` (never a 500), and the
waiting one decodes the reference's tokens once the pool frees. Nothing leaks: page and state
slot accounting exact on both nodes.

Tiny Qwen3-Next checkpoint of `tests/pd/test_hybrid_pd.py` (page size 4).
"""

from __future__ import annotations

import concurrent.futures
import dataclasses

import pytest

pytest.importorskip("transformers")

from pdcache.router.app import create_app  # noqa: E402
from pdcache.router.config import RouterConfig  # noqa: E402
from pdcache.router.nodes import NodeEndpoint  # noqa: E402
from tests.pd.test_hybrid_pd import (  # noqa: E402
    ANSWER,
    PAGE,
    PROMPT,
    assert_idle,
    checkpoint,  # noqa: F401  (fixture)
    hybrid,  # noqa: F401  (fixture)
    reference,  # noqa: F401  (fixture)
    setups,
    start,
)
from tests.pd_harness import metric_value  # noqa: E402
from tests.polling import poll  # noqa: E402
from tests.router_support import RouterUnderTest  # noqa: E402

pytestmark = pytest.mark.slow
HOG = "test-hog"
POOL = 64  # decode's device pages: the hog takes all but a few, no request fits beside it


def routed(client, prompt: list[int]):
    return client.post("/generate", json={
        "input_ids": prompt,
        "sampling_params": {"max_new_tokens": ANSWER, "ignore_eos": True, "temperature": 0}})


def queue_depth(stack) -> float:
    text = stack.client.get(f"{stack.decode.url}/metrics").text
    return metric_value(text, "pdcache_decode_admission_queue_depth")


def test_a_hybrid_request_beyond_capacity_waits_or_gets_503(hybrid, reference, checkpoint,  # noqa: F811
                                                            tmp_path):
    prefill, decode = setups(tmp_path, hybrid[0])
    engine_config = dataclasses.replace(
        decode.engine, cache=dataclasses.replace(decode.engine.cache, num_device_pages=POOL),
        scheduler=dataclasses.replace(decode.engine.scheduler, max_pending_reservations=1))
    stack = start(prefill, dataclasses.replace(decode, engine=engine_config), hybrid)
    nodes = (NodeEndpoint("p0", "prefill", stack.prefill.url, stack.bootstrap),
             NodeEndpoint("d0", "decode", stack.decode.url))
    config = RouterConfig(nodes=nodes, page_size=PAGE, model=str(checkpoint[0]),
                          request_timeout_s=60, health_interval_s=30)
    engine = stack.decode_server.engine
    held = False
    try:
        engine.reserve(HOG, (POOL - 2) * PAGE)  # the pool is held: requests wait
        held = True
        with RouterUnderTest(create_app(config)) as client, \
                concurrent.futures.ThreadPoolExecutor(1) as pool:
            waiting = pool.submit(routed, client, PROMPT)
            assert poll(lambda: queue_depth(stack) == 1, 20), waiting.done() and waiting.result()
            full = routed(client, PROMPT[::-1])
            assert full.status_code == 503, full.text
            assert full.json()["error"]["code"] == "queue_full", full.text
            assert int(full.headers["Retry-After"]) >= 1
            assert waiting.running() and not waiting.done()  # still waiting for pages
            assert engine.release_reservation(HOG)
            held = False
            answer = waiting.result(timeout=60)
        assert answer.status_code == 200, answer.text
        assert answer.json()["output_ids"] == reference(PROMPT, ANSWER)
        assert_idle(stack)
    finally:
        if held:
            engine.release_reservation(HOG)
        stack.close()
