"""The router retries a node's 503 on another healthy node of its role, in front of
REAL prefill and decode nodes (tiny preset, zmq KV transfer, in-process uvicorn servers from
tests/pd_harness.py on 127.0.0.1 free ports).

- A full decode node: a real decode node whose whole page pool is reserved by the test
  through its engine (`reserve`), so its `/generate` answers 503 "decode node full" at once.
- A prefill node with its queue full: a real prefill node whose engine admits no queued
  request (`max_queued_requests=0`), so it answers 503 "server overloaded".
The retried attempt is a new room and a new P + D pair; the failed attempt's other call is
cancelled, and every engine returns to idle with exact page accounting.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

pytest.importorskip("pdcache.prefill_node.runtime", reason="the prefill node is not in this build")
pytest.importorskip("pdcache.decode_node.runtime", reason="the decode node is not in this build")

from pdcache.engine.engine import Engine  # noqa: E402
from pdcache.engine.loader import load_model  # noqa: E402
from pdcache.router.app import create_app  # noqa: E402
from pdcache.router.config import RouterConfig  # noqa: E402
from pdcache.router.nodes import NodeEndpoint  # noqa: E402
from tests.pd_harness import PDStack, node_setups, start_stack  # noqa: E402
from tests.router_support import RouterUnderTest, sse_events  # noqa: E402

pytestmark = pytest.mark.slow

PAGE = 4
GREEDY = {"temperature": 0.0, "ignore_eos": True}
HOG = "test-hog"  # the rid whose reservation fills a decode node's pool


@pytest.fixture(scope="module")
def stacks(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[PDStack, PDStack]]:
    """(normal stack, stack whose prefill node refuses every request: queue of 0)."""
    model = load_model("tiny", seed=0)[0]
    prefill_a, decode_a = node_setups(tmp_path_factory.mktemp("a"), model, PAGE, "zmq",
                                      offload=False)
    # no admission queue on d0: a full pool is a 503 at once (with a queue the request would
    # wait there for the test's HOG reservation to go; docs/pd-protocol.md)
    no_wait = dataclasses.replace(decode_a.engine, scheduler=dataclasses.replace(
        decode_a.engine.scheduler, max_pending_reservations=0))
    normal = start_stack(prefill_a, dataclasses.replace(decode_a, engine=no_wait))
    prefill, decode = node_setups(tmp_path_factory.mktemp("b"), model, PAGE, "zmq",
                                  offload=False)
    engine = prefill.engine
    no_queue = dataclasses.replace(engine, scheduler=dataclasses.replace(
        engine.scheduler, max_queued_requests=0))
    refusing = start_stack(dataclasses.replace(prefill, engine=no_queue), decode)
    try:
        yield normal, refusing
    finally:
        refusing.close()
        normal.close()


def router(nodes: tuple[NodeEndpoint, ...]) -> RouterUnderTest:
    config = RouterConfig(nodes=nodes, page_size=PAGE, request_timeout_s=60,
                          health_interval_s=30, prefill_policy="round_robin",
                          decode_policy="round_robin")
    return RouterUnderTest(create_app(config))


def fill_pool(engine: Engine) -> None:
    """Reserve every page of the decode node's pool (a real node, really full)."""
    engine.reserve(HOG, engine.pool.num_pages * engine.pool.page_size)


def ask(client: httpx.Client, seed: int, stream: bool) -> tuple[int, dict[str, Any]]:
    """One request; (status, the JSON answer or the last event's meta-bearing event)."""
    body = {"input_ids": [(seed * 11 + 3 * i) % 250 for i in range(21 + seed)],
            "sampling_params": {"max_new_tokens": 5, **GREEDY}, "stream": stream}
    r = client.post("/generate", json=body)
    if r.status_code != 200 or not stream:
        return r.status_code, r.json()
    events = sse_events(r.text)
    return r.status_code, {"output_ids": events[-1]["output_ids"],  # cumulative chunks
                           "meta_info": events[-1]["meta_info"]}


def counter(client: httpx.Client, name: str, reason: str) -> float:
    text = client.get("/metrics").text
    return next(s.value for f in text_string_to_metric_families(text) for s in f.samples
                if s.name == name and s.labels == {"reason": reason})


def wait_idle(engine: Engine, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        stats = engine.stats()
        if not stats.get("num_running") and not stats.get("queued"):
            engine.check_accounting()
            return
        assert time.monotonic() < deadline, stats
        time.sleep(0.05)


def test_full_decode_node_is_retried_on_the_other_one(stacks: tuple[PDStack, PDStack]) -> None:
    normal, refusing = stacks
    full = normal.decode_server.engine
    fill_pool(full)
    nodes = (NodeEndpoint("p0", "prefill", normal.prefill.url, normal.bootstrap),
             NodeEndpoint("d0", "decode", normal.decode.url),  # full
             NodeEndpoint("d1", "decode", refusing.decode.url))
    try:
        with router(nodes) as client:
            for seed, stream in enumerate((False, True, False, True)):
                status, answer = ask(client, seed, stream)
                assert status == 200, answer
                assert len(answer["output_ids"]) == 5
                assert (answer["meta_info"]["prefill_node"], answer["meta_info"]["decode_node"]) == (
                    "p0", "d1")
            assert counter(client, "pdcache_router_retries_total", "overloaded") >= 1
            assert counter(client, "pdcache_router_rejected_total", "node_overloaded") == 0
            states = client.app.state.router.registry.nodes  # type: ignore[attr-defined]
            assert all(n.healthy for n in states), "a full node is not an unhealthy one"
    finally:
        assert full.release_reservation(HOG)
    for engine in (normal.prefill_server.engine, full, refusing.decode_server.engine):
        wait_idle(engine)


def test_prefill_node_with_a_full_queue_is_retried_on_the_other_one(
    stacks: tuple[PDStack, PDStack]
) -> None:
    normal, refusing = stacks
    nodes = (NodeEndpoint("p0", "prefill", refusing.prefill.url, refusing.bootstrap),
             NodeEndpoint("p1", "prefill", normal.prefill.url, normal.bootstrap),
             NodeEndpoint("d0", "decode", normal.decode.url))
    with router(nodes) as client:
        for seed, stream in enumerate((False, True, False, True)):
            status, answer = ask(client, seed + 10, stream)
            assert status == 200, answer
            assert answer["meta_info"]["prefill_node"] == "p1"
        assert counter(client, "pdcache_router_retries_total", "overloaded") >= 1
    for engine in (refusing.prefill_server.engine, normal.prefill_server.engine,
                   normal.decode_server.engine):
        wait_idle(engine)


def test_a_lone_full_decode_node_gives_the_client_its_503(
    stacks: tuple[PDStack, PDStack]
) -> None:
    normal, _ = stacks
    full = normal.decode_server.engine
    fill_pool(full)
    nodes = (NodeEndpoint("p0", "prefill", normal.prefill.url, normal.bootstrap),
             NodeEndpoint("d0", "decode", normal.decode.url))
    try:
        with router(nodes) as client:
            for seed, stream in enumerate((False, True)):
                r = client.post("/generate", json={
                    "input_ids": list(range(seed + 1, 30)), "stream": stream,
                    "sampling_params": {"max_new_tokens": 3, **GREEDY}})
                assert r.status_code == 503, r.text
                assert r.json()["error"]["code"] == "queue_full"
                assert "decode node full" in r.json()["error"]["message"]
                assert int(r.headers["Retry-After"]) >= 1
            assert counter(client, "pdcache_router_retries_total", "overloaded") == 0
            assert counter(client, "pdcache_router_rejected_total", "node_overloaded") == 2
    finally:
        assert full.release_reservation(HOG)
    wait_idle(normal.prefill_server.engine)
