"""The router's own admission: per-node in-flight limits and a bounded FIFO queue
in front of REAL `tiny` unified nodes (in-process uvicorn on 127.0.0.1 free ports).

The node's slot is occupied deterministically by a lease the test takes through the router's
own admission (on the router's loop), the way a long request would hold it: the queued
requests are then real requests to a real node. Waits are bounded polls, never bare sleeps.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from pdcache.router.admission import Ask
from pdcache.router.app import create_app
from pdcache.router.config import RouterConfig
from pdcache.router.core import Router
from pdcache.router.nodes import NodeEndpoint
from pdcache.router.route import Deadline, Route
from tests.polling import wait_until
from tests.router_support import GREEDY, PAGE, RouterUnderTest, UnifiedNode, prompt, sse_events

pytestmark = pytest.mark.slow

Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


@pytest.fixture(scope="module")
def node() -> Iterator[UnifiedNode]:
    u0 = UnifiedNode("u0")
    try:
        yield u0
    finally:
        u0.stop()


def router_for(node: UnifiedNode, **overrides: Any) -> RouterUnderTest:
    config = RouterConfig(nodes=(NodeEndpoint("u0", "unified", node.url),), page_size=PAGE,
                          health_interval_s=30, **{"request_timeout_s": 60, **overrides})
    return RouterUnderTest(create_app(config))


def router_of(client: httpx.Client) -> Router:
    return client.app.state.router  # type: ignore[attr-defined]


def hold_slot(router: Router) -> Route:
    """Take u0's slot through the router's admission, on the router's loop."""
    node = router.registry.nodes[0]
    ask = Ask(lambda: None, lambda has_room: Route(unified=node) if has_room(node) else None)
    future = asyncio.run_coroutine_threadsafe(router.admission.admit(ask, Deadline(60)),
                                              router.loop)
    return future.result(10)


def release(router: Router, route: Route) -> None:
    router.loop.call_soon_threadsafe(route.release_all)


def body(seed: int, n: int = 4) -> dict[str, Any]:
    return {"input_ids": prompt(24, seed), "sampling_params": {"max_new_tokens": n, **GREEDY}}


def scrape(client: httpx.Client) -> Samples:
    r = client.get("/metrics")
    assert r.status_code == 200
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(r.text) for s in family.samples}


def metric(samples: Samples, name: str, **labels: str) -> float:
    return samples[(name, tuple(sorted(labels.items())))]


def test_inflight_limit_makes_concurrent_requests_wait_and_all_succeed(node: UnifiedNode
                                                                       ) -> None:
    n = 4
    with router_for(node, max_inflight_per_node=1, max_queue=16) as client:
        router = router_of(client)
        held = hold_slot(router)
        with ThreadPoolExecutor(n) as pool:
            futures = [pool.submit(client.post, "/generate", json=body(i)) for i in range(n)]
            wait_until(lambda: router.admission.depth == n, 20.0, f"{n} requests in the queue")
            assert all(not f.done() for f in futures), "nothing may pass a full node"
            during = scrape(client)
            release(router, held)
            answers = [f.result(60) for f in futures]
        assert [a.status_code for a in answers] == [200] * n, [a.text for a in answers]
        assert all(len(a.json()["output_ids"]) == 4 for a in answers)
        wait_until(lambda: router.admission.held(router.registry.nodes[0]) == 0, 20.0, "slots freed")
        after = scrape(client)
    assert metric(during, "pdcache_router_queue_depth") == n
    assert metric(during, "pdcache_router_node_slots_held", node="u0", role="unified") == 1
    assert metric(after, "pdcache_router_queue_depth") == 0
    assert metric(after, "pdcache_router_queue_depth_peak") == n
    assert metric(after, "pdcache_router_node_inflight_limit", node="u0", role="unified") == 1
    labels = {"node": "u0", "role": "unified"}
    # the holder did not wait (le=0 bucket), every real request did
    assert metric(after, "pdcache_router_queue_wait_seconds_count", **labels) == n + 1
    assert metric(after, "pdcache_router_queue_wait_seconds_bucket", le="0.0", **labels) == 1
    assert metric(after, "pdcache_router_queue_wait_seconds_sum", **labels) > 0
    assert metric(after, "pdcache_router_rejected_total", reason="queue_full") == 0


def test_a_request_of_more_sequences_than_the_node_s_slots_still_succeeds(
        node: UnifiedNode) -> None:
    """One slot on the node, requests of two sequences (a streamed batch; OpenAI n = 2): the
    first sequence is read ahead once it opened, so it ends and frees the slot the second
    waits for. Its stream was read only once every sequence had opened, so the second
    waited for the slot the first held: 503 `queue_timeout` at the request's deadline."""
    single = body(7)
    with router_for(node, max_inflight_per_node=1, request_timeout_s=8) as client:
        router = router_of(client)
        want = client.post("/generate", json=single).json()["output_ids"]
        batch = {**single, "input_ids": [single["input_ids"]] * 2, "stream": True}
        streamed = client.post("/generate", json=batch)
        assert streamed.status_code == 200, streamed.text
        events = [e for e in sse_events(streamed.text) if isinstance(e, dict)]
        for index in range(2):  # each event carries the sequence's tokens so far
            got = [e["output_ids"] for e in events if e.get("index") == index]
            assert got and got[-1] == want, (index, got)
        choices = client.post("/v1/completions", json={
            "prompt": single["input_ids"], "max_tokens": 4, "n": 2, **GREEDY})
        assert choices.status_code == 200, choices.text
        texts = [c["text"] for c in choices.json()["choices"]]
        assert len(texts) == 2 and texts[0] == texts[1]
        wait_until(lambda: router.admission.held(router.registry.nodes[0]) == 0, 20.0,
                   "slots freed")
        assert router.registry.nodes[0].in_flight == 0


def test_full_queue_is_503_with_retry_after_and_the_queued_one_still_succeeds(
    node: UnifiedNode
) -> None:
    with router_for(node, max_inflight_per_node=1, max_queue=1) as client:
        router = router_of(client)
        held = hold_slot(router)
        with ThreadPoolExecutor(1) as pool:
            queued = pool.submit(client.post, "/generate", json=body(1))
            wait_until(lambda: router.admission.depth == 1, 20.0, "one request in the queue")
            refused = client.post("/generate", json=body(2))
            release(router, held)
            assert queued.result(60).status_code == 200
        samples = scrape(client)
    assert refused.status_code == 503
    assert int(refused.headers["Retry-After"]) >= 1
    assert refused.json()["error"]["code"] == "queue_full"
    assert metric(samples, "pdcache_router_rejected_total", reason="queue_full") == 1


def test_deadline_passed_in_the_queue_is_503_queue_timeout_with_retry_after(
    node: UnifiedNode
) -> None:
    with router_for(node, max_inflight_per_node=1) as client:
        start = time.monotonic()  # baseline: one unqueued request end to end
        assert client.post("/generate", json=body(3)).status_code == 200
        baseline_s = time.monotonic() - start
    timeout_s = max(1.0, 20 * baseline_s)
    with router_for(node, max_inflight_per_node=1, request_timeout_s=timeout_s) as client:
        router = router_of(client)
        held = hold_slot(router)
        try:
            start = time.monotonic()
            late = client.post("/generate", json=body(4))
            elapsed = time.monotonic() - start
            # a client that leaves while queued leaves the queue
            with pytest.raises(httpx.ReadTimeout):
                client.post("/generate", json=body(5), timeout=httpx.Timeout(60, read=0.3))
            wait_until(lambda: router.admission.depth == 0, 20.0, "the gone client left the queue")
        finally:
            release(router, held)
        samples = scrape(client)
    assert late.status_code == 503, late.text
    assert late.json()["error"]["code"] == "queue_timeout"
    assert int(late.headers["Retry-After"]) >= 1
    assert timeout_s <= elapsed < timeout_s + 5 + 10 * baseline_s
    assert metric(samples, "pdcache_router_rejected_total", reason="queue_timeout") == 1


def test_config_rejects_bad_limits() -> None:
    with pytest.raises(ValueError):
        RouterConfig(nodes=(NodeEndpoint("u0", "unified", "http://127.0.0.1:1"),),
                     max_queue=-1)
    config = RouterConfig(nodes=(NodeEndpoint("u0", "unified", "http://127.0.0.1:1",
                                              max_inflight=2),
                                 NodeEndpoint("u1", "unified", "http://127.0.0.1:2")),
                          max_inflight_per_node=5)
    assert [config.inflight_limit(n) for n in config.nodes] == [2, 5]


def test_flags_set_the_admission_fields() -> None:
    import argparse

    from pdcache.router.cli import add_arguments, build_config

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(["--unified", "127.0.0.1:1", "--max-inflight-per-node", "3",
                              "--max-queue", "7", "--max-attempts", "2"])
    config, _, _ = build_config(args)
    assert (config.max_inflight_per_node, config.max_queue, config.max_attempts) == (3, 7, 2)
    config, _, _ = build_config(parser.parse_args(["--unified", "127.0.0.1:1"]))
    assert (config.max_inflight_per_node, config.max_queue, config.max_attempts) == (0, 1024, 3)


def test_topology_router_keys_set_the_admission_fields() -> None:
    """`[router] max_inflight_per_node / max_queue / max_attempts` reach the router that
    `pdcache launch` starts (`--config --node router`); a flag still wins."""
    import argparse

    from pdcache.router.cli import add_arguments, build_config

    config_path = Path(__file__).resolve().parents[2] / "configs" / "local-1p1d.toml"
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    sets = ["--set", "router.max_inflight_per_node=4", "--set", "router.max_queue=9",
            "--set", "router.max_attempts=2"]
    args = parser.parse_args(["--config", str(config_path), "--node", "router", *sets])
    config, _, _ = build_config(args)
    assert (config.max_inflight_per_node, config.max_queue, config.max_attempts) == (4, 9, 2)
    args = parser.parse_args(["--config", str(config_path), "--node", "router", *sets,
                              "--max-queue", "3"])
    assert build_config(args)[0].max_queue == 3
