"""The router in front of two REAL unified nodes (tiny engines behind uvicorn on loopback):
routing policies, sessions, streaming proxy, OpenAI usage, API key, metrics."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from pdcache.router.app import create_app
from pdcache.router.config import RouterConfig
from pdcache.router.nodes import NodeEndpoint
from tests.router_support import (
    GREEDY,
    PAGE,
    RouterUnderTest,
    ThreadedServer,
    UnifiedNode,
    page_floor,
    prompt,
    sse_events,
)


def router_client(nodes: list[UnifiedNode], **overrides: Any) -> RouterUnderTest:
    endpoints = tuple(NodeEndpoint(n.name, "unified", n.url) for n in nodes)
    config = RouterConfig(nodes=endpoints, page_size=PAGE, request_timeout_s=60,
                          health_interval_s=30, **overrides)
    return RouterUnderTest(create_app(config))


def generate(client: RouterUnderTest, ids: list[int], n: int, **extra: Any) -> dict[str, Any]:
    body = {"input_ids": ids, "sampling_params": {"max_new_tokens": n, **GREEDY}, **extra}
    r = client.post("/generate", json=body)
    assert r.status_code == 200, r.text
    return r.json()


def scrape(client: RouterUnderTest) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    r = client.get("/metrics")
    assert r.status_code == 200
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(r.text) for s in family.samples}


# --------------------------------------------------------------------------- policies


def test_round_robin_alternates_and_names_the_node(nodes: list[UnifiedNode]) -> None:
    with router_client(nodes, prefill_policy="round_robin") as client:
        served = [generate(client, prompt(20, seed=i), 2)["meta_info"] for i in range(4)]
    assert [m["prefill_node"] for m in served] == ["u0", "u1", "u0", "u1"]
    assert all(m["decode_node"] == m["prefill_node"] for m in served)


def test_least_load_avoids_the_busy_node(nodes: list[UnifiedNode]) -> None:
    with router_client(nodes, prefill_policy="least_load") as client:
        body = {"input_ids": prompt(20, 1), "stream": True,
                "sampling_params": {"max_new_tokens": 4000, **GREEDY}}
        with client.stream("POST", "/generate", json=body) as long_stream:
            assert long_stream.status_code == 200
            lines = long_stream.iter_lines()  # kept referenced: dropping it closes the stream
            next(lines)  # u0 is now busy with this request
            router = client.app.state.router  # type: ignore[attr-defined]
            assert [n.in_flight for n in router.registry.nodes] == [1, 0]
            assert generate(client, prompt(20, 2), 2)["meta_info"]["prefill_node"] == "u1"
        deadline = time.monotonic() + 10
        while nodes[0].running() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert nodes[0].running() == 0, "closing the client stream aborts the node's request"
        assert [n.in_flight for n in router.registry.nodes] == [0, 0]


def test_cache_aware_sends_the_next_turn_to_the_node_that_served_the_first(
        nodes: list[UnifiedNode]) -> None:
    with router_client(nodes, prefill_policy="cache_aware") as client:
        router = client.app.state.router  # type: ignore[attr-defined]
        first = prompt(70, seed=11)
        router.registry.nodes[0].in_flight = 5  # u0 busy: turn 1 goes to u1 (least load)
        try:
            turn1 = generate(client, first, 12)
        finally:
            router.registry.nodes[0].in_flight = 0
        assert turn1["meta_info"]["prefill_node"] == "u1"
        history = first + turn1["output_ids"]
        known = router.selector.index.match_len("u1", router.page_keys(history, None))
        assert known == len(history) // PAGE  # the answer's pages are indexed too
        turn2 = generate(client, history + prompt(9, seed=12), 4)
        assert turn2["meta_info"]["prefill_node"] == "u1"  # a tie on load, but u1 holds the prefix
        assert turn2["meta_info"]["cached_tokens"] >= page_floor(len(history)) - PAGE > 0
        other = generate(client, prompt(70, seed=13), 2)
        assert other["meta_info"]["prefill_node"] == "u0" and other["meta_info"]["cached_tokens"] == 0


# --------------------------------------------------------------------------- sessions


def test_session_turn_with_only_the_new_message_equals_the_full_history(
        nodes: list[UnifiedNode]) -> None:
    with router_client(nodes, prefill_policy="cache_aware") as client:
        first, new = prompt(53, seed=21), prompt(11, seed=22)
        turn1 = generate(client, first, 15, session_id="s1")
        turn2 = generate(client, new, 6, session_id="s1")
        full = first + turn1["output_ids"] + new
        assert turn2["meta_info"]["prompt_tokens"] == len(full)
        assert turn2["meta_info"]["cached_tokens"] >= page_floor(len(first) + 15) - PAGE
        assert turn2["meta_info"]["prefill_node"] == turn1["meta_info"]["prefill_node"]
        explicit = generate(client, full, 6)  # no session: the whole history spelled out
        assert turn2["output_ids"] == explicit["output_ids"]
        # a client that resends the whole history with its session_id is not doubled
        resent = generate(client, full + turn2["output_ids"] + new, 3, session_id="s1")
        assert resent["meta_info"]["prompt_tokens"] == len(full) + 6 + len(new)
        assert client.app.state.router.sessions.turns("s1") == 3  # type: ignore[attr-defined]
        # the router forwards session_id: the node's eviction policies learned the turns
        served = {n.name: n for n in nodes}[turn1["meta_info"]["prefill_node"]]
        assert served.engine.tree.sessions.num_turns("s1") == 3


def test_an_evicted_session_s_next_turn_is_409_not_a_turn_without_history(
        nodes: list[UnifiedNode]) -> None:
    """The router keeps max_sessions histories; a turn of an evicted one that sends only its
    new message would run without the conversation (it did, answering 200): 409
    session_expired. Resending the whole conversation continues it."""
    with router_client(nodes, max_sessions=1) as client:
        first = prompt(20, seed=31)
        turn1 = generate(client, first, 3, session_id="old")
        generate(client, prompt(10, seed=32), 2, session_id="other")  # evicts "old"
        body = {"input_ids": prompt(5, seed=33), "session_id": "old",
                "sampling_params": {"max_new_tokens": 2, **GREEDY}}
        lost = client.post("/generate", json=body)
        assert lost.status_code == 409 and lost.json()["error"]["code"] == "session_expired"
        resent = generate(client, first + turn1["output_ids"] + body["input_ids"], 2,
                          session_id="old")
        assert resent["meta_info"]["prompt_tokens"] == 20 + 3 + 5


def test_failed_turn_is_not_committed(nodes: list[UnifiedNode]) -> None:
    with router_client(nodes) as client:
        generate(client, prompt(30, 31), 4, session_id="s2")
        router = client.app.state.router  # type: ignore[attr-defined]
        before = router.sessions.history("s2")
        r = client.post("/generate", json={"input_ids": [999], "session_id": "s2"})
        assert r.status_code == 400 and r.json()["error"]["param"] == "input_ids"
        assert router.sessions.history("s2") == before


def test_chat_session_continues_the_exact_token_history(nodes: list[UnifiedNode]) -> None:
    with router_client(nodes) as client:
        router = client.app.state.router  # type: ignore[attr-defined]
        tok = router.tokenizer
        system = {"role": "system", "content": "You are terse. " * 4}
        first = [system, {"role": "user", "content": "hello there"}]
        body = {"messages": first, "max_tokens": 10, **GREEDY}
        r1 = client.post("/v1/chat/completions", json={**body, "session_id": "c1"})
        assert r1.status_code == 200, r1.text
        turn1_ids = tok.apply_chat_template(first)
        history = router.sessions.history("c1")
        assert history[: len(turn1_ids)] == turn1_ids and len(history) == len(turn1_ids) + 10
        new = [{"role": "user", "content": "and then?"}]
        r2 = client.post("/v1/chat/completions",
                         json={"messages": new, "max_tokens": 5, "session_id": "c1", **GREEDY})
        assert r2.status_code == 200, r2.text
        usage = r2.json()["usage"]
        expected = router.chat.continue_ids(history, new)
        assert usage["prompt_tokens"] == len(expected)
        assert usage["prompt_tokens_details"]["cached_tokens"] >= page_floor(len(history)) - PAGE
        assert router.sessions.history("c1")[: len(expected)] == expected
        assert len(router.sessions.history("c1")) == len(expected) + 5


# --------------------------------------------------------------------------- streaming / OpenAI


def test_streaming_generate_equals_non_streaming(nodes: list[UnifiedNode]) -> None:
    with router_client(nodes, prefill_policy="round_robin") as client:
        ids = prompt(40, seed=41)
        plain = generate(client, ids, 20)
        body = {"input_ids": ids, "stream": True,
                "sampling_params": {"max_new_tokens": 20, **GREEDY}}
        r = client.post("/generate", json=body)
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        events = sse_events(r.text)
    # cumulative chunks (SGLang's default), built by the router from the node's deltas
    assert len(events) > 1 and events[-1]["output_ids"] == plain["output_ids"]
    assert events[-1]["text"] == plain["text"]
    for before, after in zip(events, events[1:], strict=False):
        assert after["output_ids"][: len(before["output_ids"])] == before["output_ids"]
    last = events[-1]["meta_info"]
    assert last["finish_reason"] == {"type": "length", "length": 20}
    assert last["completion_tokens"] == 20
    assert last["prefill_node"] != plain["meta_info"]["prefill_node"]  # round robin moved on


def test_chat_completions_usage_and_stream_equal(nodes: list[UnifiedNode]) -> None:
    with router_client(nodes, prefill_policy="cache_aware") as client:
        messages = [{"role": "user", "content": "tell me about caches " * 5}]
        body = {"messages": messages, "max_tokens": 12, **GREEDY}
        r1 = client.post("/v1/chat/completions", json=body)
        r2 = client.post("/v1/chat/completions", json=body)
        assert r1.status_code == r2.status_code == 200, r1.text
        one, two = r1.json(), r2.json()
        assert one["object"] == "chat.completion" and one["model"] == "pdcache-tiny"
        prompt_len = len(client.app.state.router.tokenizer.apply_chat_template(messages))  # type: ignore[attr-defined]
        assert one["usage"]["prompt_tokens"] == prompt_len
        assert one["usage"]["completion_tokens"] == 12
        details = two["usage"]["cached_tokens_details"]
        cached = two["usage"]["prompt_tokens_details"]["cached_tokens"]
        assert cached == details["device"] + details["host"] + details["storage"]
        assert cached >= page_floor(prompt_len) - PAGE > 0
        stream = {**body, "stream": True, "stream_options": {"include_usage": True}}
        r3 = client.post("/v1/chat/completions", json=stream)
        events = sse_events(r3.text)
    text = "".join(c["delta"].get("content", "") for e in events for c in e["choices"])
    assert text == one["choices"][0]["message"]["content"]
    assert events[-1]["usage"]["completion_tokens"] == 12
    assert events[-2]["choices"][0]["finish_reason"] == "length"


def test_completions_with_stop_string_cut_text(nodes: list[UnifiedNode]) -> None:
    with router_client(nodes) as client:
        body = {"prompt": "abc " * 10, "max_tokens": 30, **GREEDY}
        full = client.post("/v1/completions", json=body).json()["choices"][0]["text"]
        assert len(full) > 4
        stop = full[3:5]
        cut = client.post("/v1/completions", json={**body, "stop": stop}).json()
        assert cut["choices"][0]["text"] == full[: full.index(stop)]
        assert cut["choices"][0]["finish_reason"] == "stop"


# --------------------------------------------------------------------------- access, errors


def test_api_key_required_when_configured(nodes: list[UnifiedNode]) -> None:
    with router_client(nodes, api_key="sekret") as client:
        body = {"input_ids": prompt(10, 51), "sampling_params": {"max_new_tokens": 2}}
        missing = client.post("/generate", json=body)
        wrong = client.post("/generate", json=body, headers={"Authorization": "Bearer nope"})
        assert missing.status_code == wrong.status_code == 401
        assert missing.json()["error"]["code"] == "invalid_api_key"
        assert client.get("/v1/models").status_code == 401
        good = client.post("/generate", json=body, headers={"Authorization": "Bearer sekret"})
        assert good.status_code == 200, good.text
        assert client.get("/health").status_code == 200  # probes need no key
        # a health check that generates is a request like any other: it needs the key
        assert client.get("/health_generate").status_code == 401
        authorized = {"Authorization": "Bearer sekret"}
        assert client.get("/health_generate", headers=authorized).status_code == 200


def test_bad_requests_are_400_without_touching_nodes(nodes: list[UnifiedNode]) -> None:
    with router_client(nodes) as client:
        before = scrape(client)
        cases = [
            {"input_ids": [1, 2], "pd": {"room": 1, "role": "prefill"}},
            {"input_ids": [1, 300]},
            {"text": "x", "input_ids": [1]},
            {"input_ids": [1], "sampling_params": {"max_new_tokens": 0}},
            {"input_ids": [1] * 9000},
        ]
        for body in cases:
            r = client.post("/generate", json=body)
            assert r.status_code == 400, (body, r.text)
            assert set(r.json()["error"]) == {"message", "type", "param", "code"}
        r = client.post("/v1/chat/completions", json={"messages": []})
        assert r.status_code == 400
        after = scrape(client)
    sent = [k for k in after if k[0] == "pdcache_router_node_requests_total"]
    assert all(after[k] == before.get(k, 0.0) for k in sent)


def test_a_request_over_the_logprob_budget_never_reaches_a_node(nodes: list[UnifiedNode]) -> None:
    """The router sums a request's logprobs over its sequences (prompt positions from
    logprob_start_len, output tokens, 1 + top_logprobs_num each) before routing any: over
    LOGPROB_ENTRY_BUDGET it is a 400 and no node is asked."""
    from pdcache.wire.generate_api import LOGPROB_ENTRY_BUDGET

    per_prompt = LOGPROB_ENTRY_BUDGET // (64 * 101) + 1
    body = {"input_ids": [prompt(per_prompt, 60 + i) for i in range(64)],
            "sampling_params": {"max_new_tokens": 1, **GREEDY},
            "return_logprob": True, "logprob_start_len": 0, "top_logprobs_num": 100}
    with router_client(nodes) as client:
        before = scrape(client)
        r = client.post("/generate", json=body)
        after = scrape(client)
    assert r.status_code == 400 and r.json()["error"]["code"] == "logprobs_too_large", r.text
    sent = [k for k in after if k[0] == "pdcache_router_node_requests_total"]
    assert all(after[k] == before.get(k, 0.0) for k in sent)


@pytest.mark.parametrize("limit", [1024, None], ids=["limited", "protection-off"])
def test_a_body_over_the_limit_is_413_declared_or_chunked(nodes: list[UnifiedNode],
                                                          limit: int | None) -> None:
    """A request body over `max_request_bytes` is refused as it is read, whether its length
    is declared or it comes chunked (then never buffered past the limit), and counted; off
    (the default 32 MiB), the same bodies reach the node and are answered."""
    overrides = {} if limit is None else {"max_request_bytes": limit}
    body = {"input_ids": prompt(300, 52), "sampling_params": {"max_new_tokens": 1, **GREEDY}}
    raw = json.dumps(body).encode()
    assert len(raw) > 1024

    def chunks() -> Iterator[bytes]:
        for start in range(0, len(raw), 200):
            yield raw[start:start + 200]

    with router_client(nodes, **overrides) as client:
        declared = client.post("/generate", content=raw,
                               headers={"Content-Type": "application/json"})
        chunked = client.post("/generate", content=chunks(),
                              headers={"Content-Type": "application/json"})
        small = client.post("/generate", json={**body, "input_ids": prompt(10, 52)})
        counted = scrape(client)
    assert small.status_code == 200, small.text
    if limit is None:
        assert declared.status_code == chunked.status_code == 200, (declared.text, chunked.text)
        return
    assert declared.status_code == chunked.status_code == 413, (declared.text, chunked.text)
    assert declared.json()["error"]["code"] == chunked.json()["error"]["code"] == \
        "request_too_large"
    assert "1024 bytes" in declared.json()["error"]["message"]
    key = ("pdcache_router_requests_total", (("endpoint", "/generate"), ("status", "413")))
    assert counted[key] == 2


def test_metrics_health_and_models(nodes: list[UnifiedNode]) -> None:
    with router_client(nodes, prefill_policy="round_robin") as client:
        ids = prompt(48, seed=61)
        generate(client, ids, 3)
        before = scrape(client)
        again = generate(client, ids, 3)  # round robin: the other node, cold
        again2 = generate(client, ids, 3)  # back to the first node: warm
        after = scrape(client)
        health = client.get("/health").json()
        models = client.get("/v1/models").json()
    cached = again["meta_info"]["cached_tokens"] + again2["meta_info"]["cached_tokens"]
    assert cached > 0
    key = ("pdcache_router_cached_tokens_total", (("tier", "device"),))
    assert after[key] - before[key] == cached
    ok = ("pdcache_router_requests_total", (("endpoint", "/generate"), ("status", "200")))
    assert after[ok] - before[ok] == 2
    assert after[("pdcache_router_node_healthy", (("node", "u0"), ("role", "unified")))] == 1
    assert after[("pdcache_router_node_in_flight", (("node", "u1"), ("role", "unified")))] == 0
    assert health["status"] == "ok" and [n["name"] for n in health["nodes"]] == ["u0", "u1"]
    assert models["data"][0]["id"] == "pdcache-tiny"


def test_client_disconnect_cancels_the_node_request(nodes: list[UnifiedNode]) -> None:
    endpoints = (NodeEndpoint("u0", "unified", nodes[0].url),)
    config = RouterConfig(nodes=endpoints, page_size=PAGE, request_timeout_s=60)
    router_server = ThreadedServer(create_app(config))
    try:
        body = {"input_ids": prompt(30, 71), "stream": True,
                "sampling_params": {"max_new_tokens": 2000, **GREEDY}}
        with httpx.Client(base_url=router_server.url, timeout=30) as http:
            with http.stream("POST", "/generate", json=body) as r:
                assert r.status_code == 200
                lines = r.iter_lines()
                next(lines)
                assert nodes[0].running() == 1
        deadline = time.monotonic() + 10
        while nodes[0].running() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert nodes[0].running() == 0
        router = router_server.server.config.app.state.router  # type: ignore[attr-defined]
        while router.registry.nodes[0].in_flight and time.monotonic() < deadline:
            time.sleep(0.05)
        assert router.registry.nodes[0].in_flight == 0
    finally:
        router_server.stop()


def test_streamed_session_turn_commits_and_text_prompts_work(nodes: list[UnifiedNode]) -> None:
    with router_client(nodes) as client:
        router = client.app.state.router  # type: ignore[attr-defined]
        body = {"text": "first message. " * 3, "session_id": "st", "stream": True,
                "sampling_params": {"max_new_tokens": 8, **GREEDY}}
        events = sse_events(client.post("/generate", json=body).text)
        out1 = events[-1]["output_ids"]
        first_ids = router.tokenizer.encode(body["text"])
        assert router.sessions.history("st") == first_ids + out1
        body2 = {**body, "text": "second."}
        events = sse_events(client.post("/generate", json=body2).text)
        meta = events[-1]["meta_info"]
        assert meta["prompt_tokens"] == len(first_ids) + 8 + len("second.")
        assert meta["cached_tokens"] >= page_floor(len(first_ids) + 8) - PAGE


def test_streamed_completion_stops_at_stop_string(nodes: list[UnifiedNode]) -> None:
    with router_client(nodes) as client:
        body = {"prompt": "xyz " * 10, "max_tokens": 30, **GREEDY}
        full = client.post("/v1/completions", json=body).json()["choices"][0]["text"]
        stop = full[4:6]
        r = client.post("/v1/completions", json={**body, "stop": [stop], "stream": True,
                                                 "stream_options": {"include_usage": True}})
        events = sse_events(r.text)
        text = "".join(c["text"] for e in events for c in e["choices"])
        assert text == full[: full.index(stop)]
        assert events[-2]["choices"][0]["finish_reason"] == "stop"
        assert events[-1]["usage"]["completion_tokens"] >= 1
        router = client.app.state.router  # type: ignore[attr-defined]
        wait = time.monotonic() + 10
        while any(n.in_flight for n in router.registry.nodes) and time.monotonic() < wait:
            time.sleep(0.05)
        assert [n.in_flight for n in router.registry.nodes] == [0, 0]
    deadline = time.monotonic() + 10
    while any(n.running() for n in nodes) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert [n.running() for n in nodes] == [0, 0]  # the stop string aborted the node request


def test_a_router_out_of_node_connections_is_busy_and_its_probes_still_run(
        nodes: list[UnifiedNode]) -> None:
    """Probes shared the requests' connection pool: with every connection in use they timed
    out and took every node out of service, and a request finding the pool used up marked its
    (healthy) node unreachable. Now probes have a pool of their own, and an exhausted pool is
    the router's own overload: 503 router_busy, the node untouched."""
    import asyncio

    with router_client(nodes[:1], max_node_connections=1, connect_timeout_s=0.3,
                       health_timeout_s=1.0) as client:
        router = client.app.state.router  # type: ignore[attr-defined]
        body = {"input_ids": prompt(20, 1), "stream": True,
                "sampling_params": {"max_new_tokens": 4000, **GREEDY}}
        with client.stream("POST", "/generate", json=body) as long_stream:
            assert long_stream.status_code == 200
            lines = long_stream.iter_lines()  # kept referenced: dropping it closes the stream
            next(lines)  # the router's one node connection carries this stream now
            busy = client.post("/generate", json={"input_ids": prompt(20, 2),
                                                  "sampling_params": {"max_new_tokens": 2}})
            assert busy.status_code == 503, busy.text
            assert busy.json()["error"]["code"] == "router_busy"
            errors = scrape(client).get(("pdcache_router_node_requests_total", (
                ("node", "u0"), ("outcome", "error"), ("role", "unified"))), 0.0)
            assert errors == 0  # the router's own shortage, not the node's error
            asyncio.run_coroutine_threadsafe(router.registry.check_all(),
                                             router.loop).result(10)
            (node,) = router.registry.nodes
            assert node.healthy and node.consecutive_failures == 0, node.last_error
        assert generate(client, prompt(20, 3), 2)["meta_info"]["prefill_node"] == "u0"


def test_liveness_answers_while_no_node_can_serve() -> None:
    """/health is 503 while no node serves (readiness); /liveness is 200 as long as the
    router answers, with no key even when tenants are configured (a probe has none)."""
    from pdcache.router.tenants import Tenant
    from tests.net_support import free_ports
    from tests.polling import wait_until

    (dead,) = free_ports(1)
    endpoints = (NodeEndpoint("u0", "unified", f"http://127.0.0.1:{dead}"),)
    config = RouterConfig(nodes=endpoints, page_size=PAGE, request_timeout_s=60,
                          health_interval_s=0.2, tenants=(Tenant("t", "key-t-0123456789"),))
    with RouterUnderTest(create_app(config)) as client:
        wait_until(lambda: client.get("/health").status_code == 503, what="the dead node seen")
        alive = client.get("/liveness")
        assert alive.status_code == 200 and alive.json()["status"] == "ok"
        assert client.get("/v1/models").status_code == 401  # the rest still needs a key
