"""The router in front of REAL prefill and decode nodes (tiny preset, zmq KV transfer, in-process
uvicorn servers from tests/pd_harness.py): greedy outputs through router -> P + D equal the
unified no-cache engine for single prompts, streaming and a 3-turn session that sends only the
new message; concurrent requests all succeed; a dead prefill node gives a quick error and the
decode node's pages return to idle."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import pytest

from tests.polling import wait_until

pytest.importorskip("pdcache.prefill_node.runtime", reason="the prefill node is not in this build")
pytest.importorskip("pdcache.decode_node.runtime", reason="the decode node is not in this build")

from pdcache.engine.api import GenerateRequest, SamplingParams  # noqa: E402
from pdcache.engine.config import CacheConfig, EngineConfig  # noqa: E402
from pdcache.engine.engine import Engine  # noqa: E402
from pdcache.engine.loader import load_model  # noqa: E402
from pdcache.router.app import create_app  # noqa: E402
from pdcache.router.config import RouterConfig  # noqa: E402
from pdcache.router.nodes import NodeEndpoint  # noqa: E402
from tests.pd_harness import PDStack, free_port, node_setups, start_stack  # noqa: E402
from tests.router_support import RawServer, RouterUnderTest, sse_events  # noqa: E402

pytestmark = pytest.mark.slow

PAGE = 4
GREEDY = {"temperature": 0.0, "ignore_eos": True}


@pytest.fixture(scope="module")
def tiny() -> Any:
    return load_model("tiny", seed=0)


@pytest.fixture(scope="module")
def reference(tiny: Any) -> Iterator[Engine]:
    model, tokenizer = tiny
    config = EngineConfig(model.config, CacheConfig(PAGE, 512, enable_prefix_cache=False))
    with Engine(config, model, tokenizer) as engine:
        yield engine


def unified_tokens(engine: Engine, ids: list[int], n: int) -> list[int]:
    params = SamplingParams(max_new_tokens=n, ignore_eos=True)
    outputs = engine.generate(GenerateRequest(f"ref-{time.monotonic_ns()}", ids, params), 120)
    return [t for o in outputs for t in o.new_token_ids]


def start_pd(tmp_path: Any, tiny: Any) -> PDStack:
    prefill, decode = node_setups(tmp_path, tiny[0], PAGE, "zmq", offload=False)
    return start_stack(prefill, decode)


def pd_router(stack: PDStack, **overrides: Any) -> RouterUnderTest:
    nodes = (NodeEndpoint("p0", "prefill", stack.prefill.url, stack.bootstrap),
             NodeEndpoint("d0", "decode", stack.decode.url))
    config = RouterConfig(nodes=nodes, page_size=PAGE, request_timeout_s=60,
                          health_interval_s=30, **overrides)
    return RouterUnderTest(create_app(config))


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory, tiny: Any) -> Iterator[PDStack]:
    pd = start_pd(tmp_path_factory.mktemp("pd"), tiny)
    try:
        yield pd
    finally:
        pd.close()


def generate(client: httpx.Client, ids: list[int], n: int, **extra: Any) -> dict[str, Any]:
    body = {"input_ids": ids, "sampling_params": {"max_new_tokens": n, **GREEDY}, **extra}
    r = client.post("/generate", json=body)
    assert r.status_code == 200, r.text
    return r.json()


def test_pd_outputs_equal_unified_plain_and_streamed(stack: PDStack, reference: Engine) -> None:
    with pd_router(stack) as client:
        for seed, n in ((1, 9), (2, 17)):
            ids = [(seed * 7 + 3 * i) % 250 for i in range(23 + seed)]
            out = generate(client, ids, n)
            assert out["output_ids"] == unified_tokens(reference, ids, n)
            assert (out["meta_info"]["prefill_node"], out["meta_info"]["decode_node"]) == ("p0", "d0")
            body = {"input_ids": ids, "stream": True,
                    "sampling_params": {"max_new_tokens": n, **GREEDY}}
            events = sse_events(client.post("/generate", json=body).text)
            assert events[-1]["output_ids"] == out["output_ids"]  # cumulative chunks
    stack.prefill_server.engine.check_accounting()
    stack.decode_server.engine.check_accounting()


def test_pd_three_turn_session_sends_only_new_messages(stack: PDStack, reference: Engine
                                                       ) -> None:
    with pd_router(stack) as client:
        history: list[int] = []
        for turn in range(3):
            new = [(11 * turn + 5 * i + 1) % 250 for i in range(18)]
            out = generate(client, new, 7, session_id="pd-s")
            full = history + new
            assert out["meta_info"]["prompt_tokens"] == len(full)
            assert out["output_ids"] == unified_tokens(reference, full, 7)
            if history:  # prefill's cache holds at least the previous prompt
                assert out["meta_info"]["cached_tokens"] >= (len(history) - 7) // PAGE * PAGE - PAGE
            history = full + out["output_ids"]


def test_pd_chat_completion_and_concurrency(stack: PDStack) -> None:
    with pd_router(stack) as client:
        r = client.post("/v1/chat/completions", json={
            "messages": [{"role": "user", "content": "hi there " * 4}], "max_tokens": 6,
            **GREEDY})
        assert r.status_code == 200, r.text
        usage = r.json()["usage"]
        assert usage["completion_tokens"] == 6 and "cached_tokens_details" in usage

        def one(i: int) -> int:
            body = {"input_ids": [(i * 13 + j) % 250 for j in range(20 + i % 5)],
                    "sampling_params": {"max_new_tokens": 5, **GREEDY}, "stream": i % 2 == 0}
            return client.post("/generate", json=body).status_code

        with ThreadPoolExecutor(32) as pool:
            codes = list(pool.map(one, range(32)))
        assert codes == [200] * 32
        router = client.app.state.router  # type: ignore[attr-defined]
        assert [n.in_flight for n in router.registry.nodes] == [0, 0]
    wait_idle(stack.decode_server.engine)
    stack.prefill_server.engine.check_accounting()


def wait_idle(engine: Engine, timeout_s: float = 30.0) -> dict[str, Any]:
    deadline = time.monotonic() + timeout_s
    while True:
        stats = engine.stats()
        idle = not stats.get("num_running") and not stats.get("pages_reserved")
        if idle or time.monotonic() > deadline:
            assert idle, stats
            engine.check_accounting()
            return stats
        time.sleep(0.1)


def test_dead_prefill_node_fails_fast_and_decode_returns_to_idle(tmp_path: Any, tiny: Any
                                                                 ) -> None:
    pd = start_pd(tmp_path, tiny)
    try:
        with pd_router(pd, connect_timeout_s=2.0) as client:
            assert generate(client, list(range(30)), 3)["meta_info"]["decode_node"] == "d0"
            pd.prefill.stop()
            start = time.monotonic()
            r = client.post("/generate", json={"input_ids": list(range(40)),
                                               "sampling_params": {"max_new_tokens": 3}})
            elapsed = time.monotonic() - start
            assert r.status_code in (502, 503), r.text
            assert set(r.json()["error"]) == {"message", "type", "param", "code"}
            assert elapsed < 10, elapsed
            health = client.get("/health")
            assert health.status_code == 503
            assert [n["healthy"] for n in health.json()["nodes"]] == [False, True]
            r = client.post("/generate", json={"input_ids": [1, 2, 3]})
            assert r.status_code == 503 and r.json()["error"]["code"] == "no_healthy_node"
        wait_idle(pd.decode_server.engine)
    finally:
        pd.client.close()
        pd.decode.stop()


def test_pd_over_mooncake_equals_unified(tmp_path: Any, tiny: Any, reference: Engine,
                                         monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("mooncake.engine", reason="mooncake wheel not installed")
    monkeypatch.setenv("MC_TCP_BIND_ADDRESS", "127.0.0.1")
    monkeypatch.setenv("MC_LOG_LEVEL", "ERROR")
    prefill, decode = node_setups(tmp_path, tiny[0], PAGE, "mooncake", offload=False)
    pd = start_stack(prefill, decode)
    try:
        with pd_router(pd) as client:
            ids = [(3 * i + 2) % 250 for i in range(29)]
            out = generate(client, ids, 8)
            assert out["output_ids"] == unified_tokens(reference, ids, 8)
            body = {"messages": [{"role": "user", "content": "x" * 20}], "max_tokens": 4,
                    "stream": True, **GREEDY}
            events = sse_events(client.post("/v1/chat/completions", json=body).text)
            assert events[-1]["choices"][0]["finish_reason"] == "length"
    finally:
        pd.close()


def test_pd_client_disconnect_cancels_decode(stack: PDStack) -> None:
    with pd_router(stack) as client:
        body = {"input_ids": list(range(1, 30)), "stream": True,  # D's pool: 1024 tokens
                "sampling_params": {"max_new_tokens": 900, **GREEDY}}
        with client.stream("POST", "/generate", json=body) as r:
            assert r.status_code == 200
            lines = r.iter_lines()  # kept referenced: dropping it closes the stream
            assert next(lines).startswith("data: ")  # the first token came from P via D
            engine = stack.decode_server.engine
            wait_until(lambda: engine.stats()["num_running"] == 1)  # D is decoding
        wait_idle(stack.decode_server.engine)
        router = client.app.state.router  # type: ignore[attr-defined]
        wait_until(lambda: [n.in_flight for n in router.registry.nodes] == [0, 0])


def test_failing_prefill_answer_is_the_clients_error(stack: PDStack) -> None:
    """P answers 500 (its own failure) while D waits for KV: the client gets P's error at
    once, D's request is cancelled and D returns to idle."""
    boom = json.dumps({"error": {"message": "boom in prefill", "type": "server_error",
                                 "param": None, "code": "prefill_failed"}}).encode()
    fake_p = RawServer("reply", b"HTTP/1.1 500 Internal Server Error\r\ncontent-type: "
                       b"application/json\r\ncontent-length: " + str(len(boom)).encode()
                       + b"\r\nconnection: close\r\n\r\n" + boom)
    nodes = (NodeEndpoint("p0", "prefill", fake_p.url, f"127.0.0.1:{free_port()}"),
             NodeEndpoint("d0", "decode", stack.decode.url))
    config = RouterConfig(nodes=nodes, page_size=PAGE, request_timeout_s=60,
                          health_interval_s=30)
    try:
        with RouterUnderTest(create_app(config)) as client:
            for stream in (False, True):
                start = time.monotonic()
                r = client.post("/generate", json={"input_ids": list(range(5, 40)),
                                                   "stream": stream})
                assert r.status_code == 502, r.text
                error = r.json()["error"]
                assert "boom in prefill" in error["message"] and error["code"] == "prefill_failed"
                assert time.monotonic() - start < 5
    finally:
        fake_p.stop()
    wait_idle(stack.decode_server.engine)


def test_cache_aware_keeps_a_conversation_on_its_prefill_node(
        stack: PDStack, tmp_path: Any, tiny: Any, reference: Engine) -> None:
    """2P1D: the second prefill node is another stack's P (any P can push to any D)."""
    other = start_pd(tmp_path, tiny)
    nodes = (NodeEndpoint("p0", "prefill", stack.prefill.url, stack.bootstrap),
             NodeEndpoint("p1", "prefill", other.prefill.url, other.bootstrap),
             NodeEndpoint("d0", "decode", stack.decode.url))
    config = RouterConfig(nodes=nodes, page_size=PAGE, request_timeout_s=60,
                          health_interval_s=30, prefill_policy="cache_aware")
    try:
        with RouterUnderTest(create_app(config)) as client:
            router = client.app.state.router  # type: ignore[attr-defined]
            first = [(17 * i + 4) % 250 for i in range(41)]
            router.registry.nodes[0].in_flight = 3  # p0 busy: turn 1 goes to p1
            try:
                turn1 = generate(client, first, 6, session_id="ca")
            finally:
                router.registry.nodes[0].in_flight = 0
            assert turn1["meta_info"]["prefill_node"] == "p1"
            turn2 = generate(client, [7, 7, 7, 7, 7], 6, session_id="ca")
            assert turn2["meta_info"]["prefill_node"] == "p1"  # load tie: the prefix decides
            assert turn2["meta_info"]["cached_tokens"] >= len(first) // PAGE * PAGE - PAGE
            full = first + turn1["output_ids"] + [7, 7, 7, 7, 7]
            assert turn2["output_ids"] == unified_tokens(reference, full, 6)
            fresh = generate(client, [(3 * i) % 250 for i in range(41)], 2)
            assert fresh["meta_info"]["prefill_node"] == "p0"
    finally:
        other.close()
    stack.decode_server.engine.check_accounting()


def generate_calls(server: Any) -> float:
    """The /generate requests a node answered so far, every status, by its own
    `pdcache_requests_total{endpoint, status}` series."""
    registry = server.pd.bridge.metrics.registry
    return sum(sample.value for metric in registry.collect() for sample in metric.samples
               if sample.name == "pdcache_requests_total"
               and sample.labels.get("endpoint") == "/generate")


def test_oversized_prompt_logprobs_are_refused_by_the_router(stack: PDStack) -> None:
    """1000 prompt positions with top 200 need ~1.6 MB, over the nodes' 1 MiB message limit:
    a 400 from the router itself (no node answered a /generate for it, by the nodes' own
    request counters: the prefill node would refuse it the same way), no node touched;
    from the prompt's end they fit."""
    ids = [(7 * i + 3) % 250 for i in range(1000)]
    before = stack.prefill_server.engine.stats()["tokens_computed_total"]
    calls = [generate_calls(stack.prefill_server), generate_calls(stack.decode_server)]
    with pd_router(stack) as client:
        fields = {"return_logprob": True, "top_logprobs_num": 200}
        body = {"input_ids": ids, "sampling_params": {"max_new_tokens": 2, **GREEDY},
                "logprob_start_len": 0, **fields}
        r = client.post("/generate", json=body)
        assert r.status_code == 400, r.text
        assert r.json()["error"]["code"] == "logprobs_too_large"
        assert stack.prefill_server.engine.stats()["tokens_computed_total"] == before
        assert [generate_calls(stack.prefill_server),
                generate_calls(stack.decode_server)] == calls  # the router answered alone
        ok = client.post("/generate", json={**body, "logprob_start_len": 998})
        assert ok.status_code == 200, ok.text
        assert len(ok.json()["meta_info"]["input_top_logprobs"]) == 2
        assert generate_calls(stack.prefill_server) > calls[0]  # the counter sees a call
