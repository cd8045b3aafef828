"""SGLang's service endpoints through the router, in front of two REAL unified nodes: info from
the router and its nodes, a routed `/health_generate`, `/flush_cache` fanned out to every node
(and the same prompt hitting no device page after it), and the router's `sglang:*` series."""

from __future__ import annotations

import socket
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

from pdcache import __version__
from pdcache.engine.api import GenerateRequest, SamplingParams
from pdcache.router.app import create_app
from pdcache.router.config import RouterConfig
from pdcache.router.nodes import NodeEndpoint
from tests.router_support import GREEDY, PAGE, RouterUnderTest, UnifiedNode, prompt, sse_events

MODEL = "pdcache-tiny"


def router_for(endpoints: tuple[NodeEndpoint, ...], **overrides: Any) -> RouterUnderTest:
    config = RouterConfig(nodes=endpoints, page_size=PAGE, request_timeout_s=60,
                          health_interval_s=30, **overrides)
    return RouterUnderTest(create_app(config))


def router_client(nodes: list[UnifiedNode], **overrides: Any) -> RouterUnderTest:
    return router_for(tuple(NodeEndpoint(n.name, "unified", n.url) for n in nodes), **overrides)


def dead_url() -> str:
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{s.getsockname()[1]}"


def generate(client: httpx.Client, ids: list[int], n: int, stream: bool = False
             ) -> dict[str, Any]:
    body = {"input_ids": ids, "sampling_params": {"max_new_tokens": n, **GREEDY},
            "stream": stream}
    r = client.post("/generate", json=body)
    assert r.status_code == 200, r.text
    return sse_events(r.text)[-1]["meta_info"] if stream else r.json()["meta_info"]


def scrape(url: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    r = httpx.get(f"{url}/metrics", timeout=30, trust_env=False)
    assert r.status_code == 200
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(r.text) for s in family.samples}


def value(samples: dict, name: str, **labels: str) -> float:
    return samples.get((name, tuple(sorted(labels.items()))), 0.0)


def node_generates(nodes: list[UnifiedNode]) -> float:
    return sum(value(scrape(n.url), "pdcache_requests_total", endpoint="/generate", status="200")
               for n in nodes)


# --------------------------------------------------------------------------- info


def test_server_info_lists_the_nodes(nodes: list[UnifiedNode]) -> None:
    router = router_client(nodes)
    with router as client:
        r = client.get("/server_info")
        assert r.status_code == 200
        assert client.get("/get_server_info").json().keys() == r.json().keys()
    info = r.json()
    assert info["page_size"] == PAGE and info["model_path"] == "tiny"
    assert info["served_model_name"] == MODEL and info["context_length"] == 8192
    assert info["disaggregation_mode"] == "null" and info["version"] == __version__
    assert [w["name"] for w in info["workers"]] == ["u0-self", "u1-self"]
    assert all(w["page_size"] == PAGE for w in info["workers"])
    assert len(info["internal_states"]) == 2 and info["node_errors"] == {}


def test_model_info_from_the_router(nodes: list[UnifiedNode]) -> None:
    with router_client(nodes, served_model_name="my-model") as client:
        r = client.get("/get_model_info")
        assert r.status_code == 200 and client.get("/model_info").json() == r.json()
    info = r.json()
    assert info["model_path"] == info["tokenizer_path"] == "tiny"
    assert info["served_model_name"] == "my-model" and info["is_generation"] is True


def test_server_info_reports_a_dead_node() -> None:
    with router_for((NodeEndpoint("gone", "unified", dead_url()),)) as client:
        r = client.get("/server_info")
    assert r.status_code == 200
    assert r.json()["workers"] == [] and "gone" in r.json()["node_errors"]


# --------------------------------------------------------------------------- /health_generate


def test_health_generate_is_a_routed_request(nodes: list[UnifiedNode]) -> None:
    router = router_client(nodes)
    with router as client:
        before = node_generates(nodes)
        r = client.get("/health_generate")
        assert r.status_code == 200 and r.content == b""
        assert client.post("/health_generate").status_code == 200
        assert node_generates(nodes) - before == 2  # one node /generate each
        router_metrics = scrape(router.url)
    assert value(router_metrics, "sglang:num_requests_total", model_name=MODEL,
                 engine_type="router", is_streaming="false") == 0  # not a served request


def test_health_generate_503_without_a_healthy_node() -> None:
    with router_for((NodeEndpoint("gone", "unified", dead_url()),)) as client:
        r = client.get("/health_generate")
    assert r.status_code == 503 and r.json()["error"]["code"] == "unhealthy"


# --------------------------------------------------------------------------- /flush_cache


def test_flush_cache_fans_out_and_drops_the_device_pages(nodes: list[UnifiedNode]) -> None:
    ids = prompt(50, seed=11)
    full = len(ids) // PAGE * PAGE
    with router_client(nodes) as client:
        assert client.post("/flush_cache", params={"timeout": 10}).status_code == 200
        generate(client, ids, 4)
        warm = generate(client, ids, 4)  # cache-aware: the same node, a device hit
        assert warm["cached_tokens_details"]["device"] == full > 0
        r = client.post("/flush_cache")
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["success"] is True
        assert [(n["name"], n["status"]) for n in body["nodes"]] == [("u0", 200), ("u1", 200)]
        assert all(n["message"].startswith("Cache flushed.") for n in body["nodes"])
        cold = generate(client, ids, 4)
    assert cold["cached_tokens"] == 0 and cold["cached_tokens_details"]["device"] == 0
    assert cold["computed_tokens"] == len(ids)


def test_flush_cache_reports_a_busy_and_a_dead_node(nodes: list[UnifiedNode]) -> None:
    busy = nodes[0].engine
    long = GenerateRequest("router-busy-flush", prompt(9, seed=12),
                           SamplingParams(max_new_tokens=4000, ignore_eos=True))
    busy.submit(long, lambda out: None)
    try:
        with router_client(nodes) as client:
            r = client.get("/flush_cache")
        assert r.status_code == 400
        report = {n["name"]: n for n in r.json()["nodes"]}
        assert report["u0"]["status"] == 400 and "1 requests in flight" in report["u0"]["message"]
        assert report["u1"]["status"] == 200 and r.json()["success"] is False
    finally:
        busy.abort(long.rid)
    endpoints = (NodeEndpoint("u1", "unified", nodes[1].url),
                 NodeEndpoint("gone", "unified", dead_url()))
    with router_for(endpoints) as client:
        r = client.post("/flush_cache", params={"timeout": 5})
    assert r.status_code == 502
    assert [n["status"] for n in r.json()["nodes"]] == [200, 502]


# --------------------------------------------------------------------------- sglang:* series


def test_router_sglang_series_count_finished_requests(nodes: list[UnifiedNode]) -> None:
    base = {"model_name": MODEL, "engine_type": "router"}
    no, yes = {**base, "is_streaming": "false"}, {**base, "is_streaming": "true"}
    a, b = prompt(37, seed=13), prompt(20, seed=14)
    router = router_client(nodes)
    with router as client:
        assert client.post("/flush_cache", params={"timeout": 10}).status_code == 200
        before = scrape(router.url)
        metas = [generate(client, a, 4), generate(client, a, 5), generate(client, b, 2, True)]
        after = scrape(router.url)

    def grew(name: str, **labels: str) -> float:
        return value(after, name, **labels) - value(before, name, **labels)

    assert grew("sglang:num_requests_total", **no) == 2
    assert grew("sglang:num_requests_total", **yes) == 1
    assert grew("sglang:prompt_tokens_total", **no) == 2 * len(a)
    assert grew("sglang:prompt_tokens_total", **yes) == len(b)
    assert grew("sglang:generation_tokens_total", **no) == 9
    assert grew("sglang:generation_tokens_total", **yes) == 2
    device = sum(m["cached_tokens_details"]["device"] for m in metas)
    assert device == len(a) // PAGE * PAGE
    assert grew("sglang:cached_tokens_total", **base, cache_source="device") == device
    assert grew("sglang:e2e_request_latency_seconds_count", **no) == 2
    assert grew("pdcache_router_prompt_tokens_total") == 2 * len(a) + len(b)  # unchanged


# --------------------------------------------------------------------------- in front of P + D


def test_pd_router_service_endpoints(tmp_path: Any) -> None:
    from pdcache.engine.loader import load_model
    from tests.pd_harness import node_setups, start_stack

    model, _ = load_model("tiny", seed=0)
    prefill, decode = node_setups(tmp_path, model, 4, "zmq", offload=False)
    stack = start_stack(prefill, decode)
    try:
        endpoints = (NodeEndpoint("p0", "prefill", stack.prefill.url, stack.bootstrap),
                     NodeEndpoint("d0", "decode", stack.decode.url))
        with router_for(endpoints) as client:
            info = client.get("/server_info").json()
            assert client.get("/health_generate").status_code == 200  # through P and D
            flushed = client.post("/flush_cache", params={"timeout": 10})
        assert info["disaggregation_mode"] == "pd"
        assert [p["disaggregation_bootstrap_port"] for p in info["prefill"]] == \
            [prefill.bootstrap_port]
        assert [d["disaggregation_mode"] for d in info["decode"]] == ["decode"]
        assert flushed.status_code == 200
        assert [(n["name"], n["role"]) for n in flushed.json()["nodes"]] == \
            [("p0", "prefill"), ("d0", "decode")]
        stack.prefill_server.engine.check_accounting()
        stack.decode_server.engine.check_accounting()
    finally:
        stack.close()
