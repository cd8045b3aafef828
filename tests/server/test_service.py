"""SGLang's service endpoints and `sglang:*` series on a real unified server (tiny preset with a
host tier, Starlette TestClient): `/server_info`, `/get_model_info`, `/health_generate`,
`/flush_cache` (device and host tiers dropped, busy answers 400) and exact metric values."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from typing import Any

import pytest
from fastapi.testclient import TestClient
from prometheus_client.parser import text_string_to_metric_families

from pdcache import __version__
from pdcache.engine.api import GenerateRequest, SamplingParams
from pdcache.engine.config import CacheConfig, EngineConfig
from pdcache.engine.engine import Engine
from pdcache.engine.loader import load_model
from pdcache.engine.scheduler_config import SchedulerConfig
from pdcache.offload_manager.builder import TierConfig, TieredEngine, build_tiered_engine
from pdcache.offload_manager.hicache import HiCacheConfig
from pdcache.server.app import ServerConfig, create_app

PAGE = 4
DEVICE_PAGES = 1024
HOST_PAGES = 128
GREEDY = {"temperature": 0.0, "ignore_eos": True}
MODEL = "pdcache-tiny"
SCHED = {"model_name": MODEL, "engine_type": "unified", "tp_rank": "0", "pp_rank": "0",
         "moe_ep_rank": "0"}


@pytest.fixture(scope="module")
def tiny() -> tuple[Any, Any]:
    return load_model("tiny", seed=0)


def engine_config(model: Any, device_pages: int = DEVICE_PAGES) -> EngineConfig:
    return EngineConfig(model=model.config,
                        cache=CacheConfig(page_size=PAGE, num_device_pages=device_pages),
                        scheduler=SchedulerConfig(chunked_prefill_tokens=64))


@pytest.fixture(scope="module")
def tiered(tiny: tuple[Any, Any]) -> Iterator[TieredEngine]:
    model, tokenizer = tiny
    tiers = TierConfig(host_pages=HOST_PAGES, hicache=HiCacheConfig(write_policy="write_through"))
    built = build_tiered_engine(engine_config(model), model, tokenizer, tiers)
    built.engine.start()
    try:
        yield built
    finally:
        built.close()


@pytest.fixture(scope="module")
def client(tiered: TieredEngine) -> Iterator[TestClient]:
    config = ServerConfig(name="u0", request_timeout_s=60, manage_engine=False, model_path="tiny")
    with TestClient(create_app(tiered.engine, config)) as c:
        yield c
    tiered.engine.check_accounting()


def prompt(n: int, seed: int) -> list[int]:
    return [(seed * 31 + 7 * i) % 250 + 3 for i in range(n)]


def generate(client: TestClient, ids: list[int], n: int, stream: bool = False) -> dict[str, Any]:
    body = {"input_ids": ids, "sampling_params": {"max_new_tokens": n, **GREEDY}, "stream": stream}
    r = client.post("/generate", json=body)
    assert r.status_code == 200, r.text
    if not stream:
        return r.json()["meta_info"]
    metas = [line for line in r.text.split("\n") if line.startswith("data: {")]
    return json.loads(metas[-1][len("data: "):])["meta_info"]


def scrape(client: TestClient) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    r = client.get("/metrics")
    assert r.status_code == 200
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(r.text) for s in family.samples}


def value(samples: dict, name: str, **labels: str) -> float:
    return samples.get((name, tuple(sorted(labels.items()))), 0.0)


# --------------------------------------------------------------------------- info endpoints


def test_server_info_has_sglang_fields(client: TestClient, tiny: tuple[Any, Any]) -> None:
    info = client.get("/server_info")
    assert info.status_code == 200
    assert client.get("/get_server_info").json() == info.json()
    body = info.json()
    assert body["page_size"] == PAGE and body["model_path"] == body["tokenizer_path"] == "tiny"
    assert body["served_model_name"] == MODEL
    assert body["context_length"] == tiny[0].config.max_position_embeddings == 8192
    assert body["disaggregation_mode"] == "null" and "disaggregation_bootstrap_port" not in body
    assert body["version"] == __version__ and body["role"] == "unified" and body["name"] == "u0"
    assert body["max_total_num_tokens"] == DEVICE_PAGES * PAGE
    assert body["enable_hierarchical_cache"] is True
    assert body["hicache_write_policy"] == "write_through"
    assert body["hicache_host_pages"] == HOST_PAGES and body["hicache_storage_backend"] is None
    state = body["internal_states"][0]  # what sglang.bench_serving / one_batch_server read
    assert state["memory_usage"]["token_capacity"] == DEVICE_PAGES * PAGE
    assert state["effective_max_running_requests_per_dp"] == body["max_running_requests"]


def test_model_info(client: TestClient) -> None:
    r = client.get("/get_model_info")
    assert r.status_code == 200 and client.get("/model_info").json() == r.json()
    info = r.json()
    assert info["model_path"] == info["tokenizer_path"] == "tiny"
    assert info["served_model_name"] == MODEL and info["is_generation"] is True
    assert info["load_format"] == "dummy" and info["disaggregation_mode"] == "null"
    assert info["architectures"] == ["LlamaForCausalLM"] and info["model_type"] == "llama"


# --------------------------------------------------------------------------- /health_generate


def test_health_generate_runs_one_token_uncounted(client: TestClient,
                                                  tiered: TieredEngine) -> None:
    before, finished = scrape(client), tiered.engine.stats()["requests_finished_total"]
    for method in ("GET", "POST"):
        r = client.request(method, "/health_generate")
        assert r.status_code == 200 and r.content == b""
    after = scrape(client)
    assert tiered.engine.stats()["requests_finished_total"] == finished + 2  # really generated
    for name in ("sglang:num_requests_total", "sglang:prompt_tokens_total"):
        assert value(after, name, model_name=MODEL, engine_type="unified",
                     is_streaming="false") == value(before, name, model_name=MODEL,
                                                    engine_type="unified", is_streaming="false")
    assert value(after, "pdcache_requests_total", endpoint="/health_generate", status="200") \
        - value(before, "pdcache_requests_total", endpoint="/health_generate", status="200") == 2


def test_health_generate_503_when_stopped_or_stuck(tiny: tuple[Any, Any]) -> None:
    model, tokenizer = tiny
    engine = Engine(engine_config(model, device_pages=64), model, tokenizer)
    engine.start(thread=False)  # accepts requests, but nothing steps them: the health request hangs
    config = ServerConfig(name="s0", manage_engine=False, health_check_timeout_s=0.2)
    with TestClient(create_app(engine, config)) as c:
        r = c.get("/health_generate")
        assert r.status_code == 503 and r.headers["Retry-After"] == "1"
        assert "did not finish within 0.2 s" in r.json()["error"]["message"]
        while engine.step():  # the abort of the hung health request is handled
            pass
        assert engine.stats()["requests_aborted_total"] == 1
        engine.shutdown()
        r = c.get("/health_generate")
        assert r.status_code == 503 and r.json()["error"]["code"] == "unhealthy"
        assert "not running" in r.json()["error"]["message"]


# --------------------------------------------------------------------------- /flush_cache


def test_flush_cache_drops_device_and_host_tiers(client: TestClient, tiered: TieredEngine) -> None:
    ids = prompt(41, seed=1)  # 10 full pages + 1 token
    full = len(ids) // PAGE * PAGE
    assert generate(client, ids, 4)["cached_tokens_details"]["device"] == 0
    assert generate(client, ids, 4)["cached_tokens_details"]["device"] == full
    assert tiered.engine.flush_cache() > 0  # device only: the host copies remain...
    again = generate(client, ids, 4)["cached_tokens_details"]
    assert again["device"] == 0 and again["host"] == full  # ...and serve the prompt
    assert generate(client, ids, 4)["cached_tokens_details"]["device"] == full
    assert tiered.hicache.wait_idle(10)
    r = client.post("/flush_cache")
    assert r.status_code == 200 and r.text.startswith("Cache flushed.\n"), r.text
    assert "storage untouched" in r.text
    stats = tiered.engine.stats()
    assert stats["cached_pages"] == 0 and stats["pages_free"] == DEVICE_PAGES
    assert tiered.hicache.host_pool.num_used == 0
    cold = generate(client, ids, 4)
    assert cold["cached_tokens"] == 0 and cold["cached_tokens_details"]["device"] == 0
    assert cold["cached_tokens_details"]["host"] == 0 and cold["computed_tokens"] == len(ids)
    assert client.get("/flush_cache").status_code == 200
    tiered.engine.check_accounting()
    tiered.hicache.check()


def test_flush_cache_busy_answers_400_like_sglang(client: TestClient,
                                                  tiered: TieredEngine) -> None:
    engine = tiered.engine
    long = GenerateRequest("busy-flush", prompt(9, seed=2),  # most of the pool: runs for seconds
                           SamplingParams(max_new_tokens=4000, ignore_eos=True))
    engine.submit(long, lambda out: None)
    try:
        r = client.post("/flush_cache")
        assert r.status_code == 400 and r.text == "Flush cache failed: 1 requests in flight.\n"
        start = time.monotonic()
        r = client.post("/flush_cache", params={"timeout": 0.3})
        assert r.status_code == 400 and "after waiting 0.3 s" in r.text
        assert time.monotonic() - start >= 0.3
        assert client.post("/flush_cache", params={"timeout": "soon"}).status_code == 400
        assert client.post("/flush_cache", params={"timeout": -1}).status_code == 400
    finally:
        engine.abort(long.rid)
    r = client.post("/flush_cache", params={"timeout": 10})  # waits for the abort
    assert r.status_code == 200, r.text


# --------------------------------------------------------------------------- sglang:* series


def test_sglang_series_exact_after_requests(client: TestClient, tiered: TieredEngine) -> None:
    assert client.post("/flush_cache", params={"timeout": 10}).status_code == 200
    base = {"model_name": MODEL, "engine_type": "unified"}
    no, yes = {**base, "is_streaming": "false"}, {**base, "is_streaming": "true"}
    before = scrape(client)
    a, b = prompt(23, seed=3), prompt(30, seed=4)
    metas = [generate(client, a, 5), generate(client, a, 6), generate(client, b, 3, stream=True)]
    after = scrape(client)

    def grew(name: str, **labels: str) -> float:
        return value(after, name, **labels) - value(before, name, **labels)

    assert grew("sglang:num_requests_total", **no) == 2
    assert grew("sglang:num_requests_total", **yes) == 1
    assert grew("sglang:prompt_tokens_total", **no) == 2 * len(a)
    assert grew("sglang:prompt_tokens_total", **yes) == len(b)
    assert grew("sglang:generation_tokens_total", **no) == 11
    assert grew("sglang:generation_tokens_total", **yes) == 3
    device = sum(m["cached_tokens_details"]["device"] for m in metas)
    assert device == len(a) // PAGE * PAGE  # the second turn of `a` only
    assert grew("sglang:cached_tokens_total", **base, cache_source="device") == device
    assert grew("sglang:cached_tokens_total", **base, cache_source="host") == 0
    assert grew("sglang:num_aborted_requests_total", **base) == 0
    assert grew("sglang:e2e_request_latency_seconds_count", **no) == 2
    assert grew("sglang:e2e_request_latency_seconds_count", **yes) == 1
    assert grew("sglang:time_to_first_token_seconds_count", **no) == 2
    assert grew("sglang:time_to_first_token_seconds_count", **yes) == 1
    assert grew("sglang:request_time_per_output_token_seconds_count", **no) == 2
    itl = grew("sglang:inter_token_latency_seconds_count", **base)
    assert itl == grew("pdcache_inter_token_latency_seconds_count") == (5 - 1) + (6 - 1) + (3 - 1)
    # the pdcache_* series are unchanged beside them
    assert grew("pdcache_prompt_tokens_total") == 2 * len(a) + len(b)
    assert grew("pdcache_cached_tokens_total", tier="device") == device
    # scheduler gauges of an idle engine: nothing runs, the cache is all evictable
    assert value(after, "sglang:num_running_reqs", **SCHED) == 0
    assert value(after, "sglang:num_queue_reqs", **SCHED) == 0
    assert value(after, "sglang:token_usage", **SCHED) == 0.0
    assert value(after, "sglang:num_used_tokens", **SCHED) == 0
    cached = tiered.engine.stats()["cached_pages"] * PAGE
    assert value(after, "sglang:kv_evictable_tokens", **SCHED) == cached > 0
    assert value(after, "sglang:kv_available_tokens", **SCHED) == DEVICE_PAGES * PAGE - cached
    assert value(after, "sglang:hicache_host_total_tokens", **SCHED) == HOST_PAGES * PAGE
    assert value(after, "sglang:hicache_host_used_tokens", **SCHED) == \
        tiered.hicache.host_pool.num_used * PAGE
    assert (("sglang:num_retracted_requests_total", tuple(sorted(SCHED.items())))) in after
