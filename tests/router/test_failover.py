"""Failure semantics of the router: killed nodes (kill -9 of real `pdcache serve` processes),
recovery, and bounded-time 502/503/504 from nodes that hang, answer garbage or fail; the
`pdcache router` command itself."""

from __future__ import annotations

import json
import signal
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from pdcache.engine.config import CacheConfig
from pdcache.engine.engine import Engine
from pdcache.router.app import create_app
from pdcache.router.cli import READY_PREFIX as ROUTER_READY
from pdcache.router.config import RouterConfig
from pdcache.router.nodes import NodeEndpoint
from pdcache.server.app import ServerConfig
from pdcache.server.app import create_app as create_unified_app
from pdcache.server.cli import READY_PREFIX as SERVE_READY
from tests.polling import wait_until
from tests.router_support import (
    GREEDY,
    PAGE,
    RawServer,
    RouterUnderTest,
    ServeProcess,
    ThreadedServer,
    UnifiedNode,
    prompt,
)

ROOT = Path(__file__).resolve().parents[2]


def body(n: int = 3, seed: int = 0, **extra: Any) -> dict[str, Any]:
    return {"input_ids": prompt(24, seed), "sampling_params": {"max_new_tokens": n, **GREEDY},
            **extra}


def router_for(nodes: list[tuple[str, str]], **overrides: Any) -> RouterUnderTest:
    endpoints = tuple(NodeEndpoint(name, "unified", url) for name, url in nodes)
    settings = {"page_size": PAGE, "request_timeout_s": 30, "health_interval_s": 30,
                "health_timeout_s": 0.5, **overrides}
    return RouterUnderTest(create_app(RouterConfig(nodes=endpoints, **settings)))


# --------------------------------------------------------------------------- killed nodes


@pytest.mark.slow
def test_killed_node_is_avoided_and_none_left_is_503() -> None:
    u0 = UnifiedNode("u0")
    u1 = None
    try:
        u1 = ServeProcess(["serve", "--model", "tiny", "--port", "0", "--name", "u1",
                           "--log-level", "warning"], SERVE_READY)
        check_killed_node(u0, u1)
    finally:
        if u1 is not None:
            u1.kill()
        u0.stop()


def check_killed_node(u0: UnifiedNode, u1: ServeProcess) -> None:
    with router_for([("u0", u0.url), ("u1", u1.url)], prefill_policy="round_robin",
                    health_interval_s=0.2) as client:
        served = [client.post("/generate", json=body(seed=i)).json()["meta_info"]["prefill_node"]
                  for i in range(2)]
        assert served == ["u0", "u1"]
        u1.kill()  # kill -9 of the serve process: no goodbye
        for i in range(4):  # every request succeeds, on u0 (re-routed if it tried u1)
            r = client.post("/generate", json=body(seed=10 + i))
            assert r.status_code == 200, r.text
            assert r.json()["meta_info"]["prefill_node"] == "u0"
        health = client.get("/health").json()
        assert health["status"] == "ok"
        assert [n["healthy"] for n in health["nodes"]] == [True, False]
        u0.stop()
        start = time.monotonic()
        r = client.post("/generate", json=body())
        assert r.status_code in (502, 503), r.text
        assert r.json()["error"]["type"] in ("overloaded_error", "server_error")
        assert time.monotonic() - start < 5
        deadline = time.monotonic() + 5
        while client.get("/health").status_code != 503 and time.monotonic() < deadline:
            time.sleep(0.1)
        assert client.get("/health").status_code == 503
        r = client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2})
        assert r.status_code == 503 and r.json()["error"]["code"] == "no_healthy_node"


def test_node_that_comes_back_is_healthy_again() -> None:
    node = UnifiedNode("u0")
    port = node.server.port
    with router_for([("u0", node.url)], health_interval_s=0.1, unhealthy_after=2) as client:
        router = client.app.state.router  # type: ignore[attr-defined]
        assert client.post("/generate", json=body()).status_code == 200
        assert router.selector.index.match_len("u0", router.page_keys(body()["input_ids"], None))
        node.stop()
        wait_until(lambda: not router.registry.nodes[0].healthy)
        assert client.post("/generate", json=body()).json()["error"]["code"] == "no_healthy_node"
        engine = Engine.from_spec("tiny", cache=CacheConfig(page_size=PAGE, num_device_pages=64))
        restarted = ThreadedServer(create_unified_app(engine, ServerConfig(name="again")),
                                   port=port)
        try:
            wait_until(lambda: router.registry.nodes[0].healthy)
            # a restarted node has an empty cache: its prefix index was forgotten
            assert router.selector.index.match_len(
                "u0", router.page_keys(body()["input_ids"], None)) == 0
            assert client.post("/generate", json=body()).status_code == 200
        finally:
            restarted.stop()


# --------------------------------------------------------------------------- bad nodes


def http_reply(status: str, payload: bytes, content_type: str = "application/json") -> bytes:
    head = (f"HTTP/1.1 {status}\r\ncontent-type: {content_type}\r\n"
            f"content-length: {len(payload)}\r\nconnection: close\r\n\r\n")
    return head.encode() + payload


@pytest.mark.parametrize("stream", [False, True])
def test_hanging_node_is_a_504_in_bounded_time(stream: bool) -> None:
    node = RawServer("hang")
    try:
        with router_for([("u0", node.url)], request_timeout_s=1.0) as client:
            start = time.monotonic()
            r = client.post("/generate", json=body(stream=stream))
            elapsed = time.monotonic() - start
            assert r.status_code == 504, r.text
            assert r.json()["error"]["type"] == "timeout_error"
            assert elapsed < 4, elapsed
            r = client.post("/v1/chat/completions", json={
                "messages": [{"role": "user", "content": "x"}], "max_tokens": 2})
            assert r.status_code == 504
    finally:
        node.stop()


@pytest.mark.parametrize("reply, status, code", [
    (http_reply("200 OK", b"hello", "text/plain"), 502, "bad_gateway"),
    (http_reply("500 Internal Server Error", json.dumps({"error": {
        "message": "boom", "type": "server_error", "param": None, "code": None}}).encode()),
     502, None),
    (http_reply("400 Bad Request", json.dumps({"error": {
        "message": "bad ids", "type": "invalid_request_error", "param": "input_ids",
        "code": "token_id_out_of_range"}}).encode()), 400, "token_id_out_of_range"),
    # a node's 503 is its overload whatever the body (an ingress in front of it): retryable,
    # and with no other node the client gets it as a 503
    (http_reply("503 Service Unavailable", b"<html>busy</html>", "text/html"), 503,
     "node_unavailable"),
    # the node refused the router's credential: not the client's authentication error
    (http_reply("401 Unauthorized", json.dumps({"error": {
        "message": "bad token", "type": "authentication_error", "param": None,
        "code": None}}).encode()), 502, "bad_gateway"),
    (b"HTTP/1.1 200 OK\r\ncontent-length: 100\r\n\r\n{\"output", 502, "bad_gateway"),
])
def test_node_errors_and_garbage_map_to_json_errors(reply: bytes, status: int,
                                                    code: str | None) -> None:
    node = RawServer("reply", reply)
    try:
        with router_for([("u0", node.url)], request_timeout_s=5.0) as client:
            r = client.post("/generate", json=body())
            assert r.status_code == status, r.text
            error = r.json()["error"]
            assert set(error) == {"message", "type", "param", "code"}
            assert error["code"] == code
            streamed = client.post("/generate", json=body(stream=True))
            assert streamed.status_code == status
            health = client.get("/health")
            assert health.status_code == 200  # the router itself never died
    finally:
        node.stop()


def test_garbage_midstream_becomes_an_error_event() -> None:
    events = b'data: {"output_ids": [65], "text": "A"}\n\ndata: {nonsense\n\n'
    reply = (b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
             b"content-length: " + str(len(events)).encode() + b"\r\n\r\n" + events)
    node = RawServer("reply", reply)
    try:
        with router_for([("u0", node.url)], request_timeout_s=5.0) as client:
            r = client.post("/generate", json=body(stream=True))
            assert r.status_code == 200
            datas = [line[6:] for line in r.text.split("\n") if line.startswith("data: ")]
            assert json.loads(datas[0])["output_ids"] == [65]
            assert json.loads(datas[1])["error"]["code"] == "bad_gateway"
            assert datas[-1] == "[DONE]"
    finally:
        node.stop()


def test_a_meta_that_is_not_generate_meta_is_a_bad_gateway() -> None:
    """The router reads the node's `meta` as the typed `GenerateMeta` the nodes answer with:
    a node whose meta lacks its fields (here `prompt_tokens` is a string) is a 502, never
    usage numbers made up from whatever keys happen to be there."""
    answer = {"output_ids": [65], "text": "A",
              "meta_info": {"prompt_tokens": "4", "completion_tokens": 1}}
    node = RawServer("reply", http_reply("200 OK", json.dumps(answer).encode()))
    try:
        with router_for([("u0", node.url)], request_timeout_s=5.0) as client:
            r = client.post("/generate", json=body())
            assert r.status_code == 502, r.text
            assert r.json()["error"]["code"] == "bad_gateway"
            assert "invalid 'meta_info'" in r.json()["error"]["message"]
    finally:
        node.stop()


# --------------------------------------------------------------------------- the command


def test_build_config_from_topology_and_flags() -> None:
    import argparse

    from pdcache.router.cli import add_arguments, build_config

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(["--config", str(ROOT / "configs" / "local-1p1d.toml"),
                              "--node", "router", "--set", "model.preset=tiny",
                              "--decode-policy", "least_load"])
    config, host, port = build_config(args)
    assert [(n.name, n.role, n.url, n.bootstrap) for n in config.nodes] == [
        ("p0", "prefill", "http://127.0.0.1:30001", "127.0.0.1:8998"),
        ("d0", "decode", "http://127.0.0.1:30002", None)]
    assert (config.model, config.page_size, config.prefill_policy, config.decode_policy) == (
        "tiny", 16, "cache_aware", "least_load")
    assert (host, port) == ("127.0.0.1", 8000)
    args = parser.parse_args(["--prefill", "127.0.0.1:1@127.0.0.1:2", "--decode",
                              "http://127.0.0.1:3/"])
    config, _, _ = build_config(args)
    assert [(n.name, n.url, n.bootstrap) for n in config.nodes] == [
        ("p0", "http://127.0.0.1:1", "127.0.0.1:2"), ("d0", "http://127.0.0.1:3", None)]


@pytest.mark.slow
def test_router_command_serves_and_stops() -> None:
    node = UnifiedNode("u0")
    router = None
    try:
        router = ServeProcess(["router", "--unified", node.url, "--port", "0", "--model", "tiny",
                               "--api-key", "k", "--log-level", "warning"], ROUTER_READY)
        with httpx.Client(base_url=router.url, timeout=30, trust_env=False) as http:
            assert "nodes" not in http.get("/health").json()  # open: no internal addresses
            health = http.get("/health", headers={"Authorization": "Bearer k"}).json()
            assert health["nodes"][0]["name"] == "u0"
            assert http.post("/generate", json=body()).status_code == 401
            r = http.post("/generate", json=body(), headers={"Authorization": "Bearer k"})
            assert r.status_code == 200 and len(r.json()["output_ids"]) == 3
        # uvicorn shuts down gracefully (lifespan closes the client), then re-raises SIGTERM
        assert router.terminate() in (0, -signal.SIGTERM)
        assert not any("Traceback" in line for line in router.log)
    finally:
        if router is not None:
            router.kill()
        node.stop()


def _meta(prompt_tokens: int, completion_tokens: int) -> dict[str, Any]:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "cached_tokens": 0, "cached_tokens_details": {}, "computed_tokens": prompt_tokens,
            "finish_reason": {"type": "length"}}


def test_pd_json_answer_survives_a_late_prefill() -> None:
    """PD without streaming: decode answered, prefill's own call ended later. The router
    waited for prefill to the deadline when it hung (a 504, the answer lost) and threw the
    answer away when it failed after it (a 502). Prefill now gets its grace, its outcome
    only logged, as on the streaming path."""
    import asyncio

    from fastapi import FastAPI
    from fastapi.responses import JSONResponse

    prefill_app, decode_app = FastAPI(), FastAPI()

    @prefill_app.get("/health")
    async def prefill_health() -> dict[str, str]:
        return {"status": "ok", "bootstrap": "127.0.0.1:1"}

    @prefill_app.post("/generate")
    async def prefill_generate() -> JSONResponse:
        await asyncio.sleep(0.5)  # decode has answered by then
        return JSONResponse({"error": {"message": "bookkeeping failed", "type": "server_error"}},
                            status_code=500)

    @decode_app.get("/health")
    async def decode_health() -> dict[str, str]:
        return {"status": "ok"}

    @decode_app.post("/generate")
    async def decode_generate() -> dict[str, Any]:
        return {"text": "abc", "output_ids": [1, 2, 3], "meta_info": _meta(24, 3)}

    servers = [ThreadedServer(prefill_app), ThreadedServer(decode_app)]
    endpoints = (NodeEndpoint("p0", "prefill", servers[0].url),
                 NodeEndpoint("d0", "decode", servers[1].url))
    config = RouterConfig(nodes=endpoints, page_size=PAGE, request_timeout_s=30,
                          health_interval_s=30, health_timeout_s=2.0)
    try:
        with RouterUnderTest(create_app(config)) as client:
            start = time.monotonic()
            r = client.post("/generate", json=body())
            assert r.status_code == 200, r.text
            assert r.json()["output_ids"] == [1, 2, 3]
            assert time.monotonic() - start < 20  # within prefill's grace, not the deadline
    finally:
        for server in servers:
            server.stop(3)


def test_a_pd_burst_is_spread_over_the_prefill_nodes() -> None:
    """Requests reaching the router together (an agent's parallel tool calls): a PD call
    counted itself in its node's load only once its task ran, after the rest of the burst
    had picked, so least_load (and cache_aware without a match) sent all of it to one
    prefill node. The slots granted at the pick count now."""
    import asyncio
    from collections import Counter

    from fastapi import FastAPI

    from pdcache.router.core import Prepared, Router
    from pdcache.router.route import Deadline

    def node_app(bootstrap: str | None) -> FastAPI:
        app = FastAPI()

        @app.get("/health")
        async def health() -> dict[str, str]:
            return {"status": "ok", **({"bootstrap": bootstrap} if bootstrap else {})}

        @app.post("/generate")
        async def generate() -> dict[str, Any]:
            await asyncio.sleep(0.2)
            return {"text": "abc", "output_ids": [1, 2, 3], "meta_info": _meta(24, 3)}

        return app

    servers = [ThreadedServer(node_app(f"127.0.0.1:{40000 + i}")) for i in range(2)]
    servers += [ThreadedServer(node_app(None)) for _ in range(2)]
    endpoints = (NodeEndpoint("p0", "prefill", servers[0].url),
                 NodeEndpoint("p1", "prefill", servers[1].url),
                 NodeEndpoint("d0", "decode", servers[2].url),
                 NodeEndpoint("d1", "decode", servers[3].url))

    async def burst(policy: str) -> Counter[str]:
        router = Router(RouterConfig(nodes=endpoints, page_size=PAGE, prefill_policy=policy,
                                     decode_policy="least_load", health_interval_s=30))
        await router.startup()
        try:
            preps = [Prepared(prompt(24, seed=i), {"max_new_tokens": 3}, None, None)
                     for i in range(6)]
            sent = await asyncio.gather(*(router.send_json(p, Deadline(30)) for p in preps))
            return Counter(route.prefill_name for _, route in sent)
        finally:
            await router.shutdown()

    try:
        for policy in ("least_load", "cache_aware"):
            assert asyncio.run(burst(policy)) == {"p0": 3, "p1": 3}, policy
    finally:
        for server in servers:
            server.stop(3)


def test_a_learnt_bootstrap_address_follows_the_prefill_node() -> None:
    """A prefill node restarted on another bootstrap port advertises it in /health; the
    router kept the first one it learnt, and every PD request through the node failed until
    the router restarted. A configured address stays as configured."""
    import asyncio

    from fastapi import FastAPI

    from pdcache.router.nodes import NodeRegistry

    advertised = ["127.0.0.1:41001"]
    app = FastAPI()

    @app.get("/health")
    async def health() -> dict[str, str]:
        return {"status": "ok", "bootstrap": advertised[0]}

    server = ThreadedServer(app)

    async def probe_twice() -> list[str | None]:
        async with httpx.AsyncClient(trust_env=False) as client:
            registry = NodeRegistry((NodeEndpoint("learnt", "prefill", server.url),
                                     NodeEndpoint("set", "prefill", server.url,
                                                  "127.0.0.1:42000")), client)
            await registry.check_all()
            first = [n.bootstrap for n in registry.nodes]
            advertised[0] = "127.0.0.1:41002"  # restarted on another port
            await registry.check_all()
            return first + [n.bootstrap for n in registry.nodes]

    try:
        assert asyncio.run(probe_twice()) == ["127.0.0.1:41001", "127.0.0.1:42000",
                                              "127.0.0.1:41002", "127.0.0.1:42000"]
    finally:
        server.stop(3)
