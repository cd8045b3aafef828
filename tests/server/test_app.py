"""Unified server in-process (real `tiny` engine, Starlette TestClient): endpoints, streaming,
OpenAI schema, bad input, deadlines, overload and exact metric deltas."""

from __future__ import annotations

import json
import random
import time
from dataclasses import replace
from typing import Any

import pytest
from fastapi.testclient import TestClient
from prometheus_client.parser import text_string_to_metric_families

from pdcache.engine.engine import Engine
from pdcache.engine.scheduler_config import SchedulerConfig
from pdcache.server.app import ServerConfig, create_app

PAGE = 16  # the page size of conftest.py's engine
GREEDY = {"temperature": 0.0, "ignore_eos": True}


def prompt(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(256) for _ in range(n)]


def generate(client: TestClient, ids: list[int], n: int, **extra: Any) -> dict[str, Any]:
    body = {"input_ids": ids, "sampling_params": {"max_new_tokens": n, **GREEDY}, **extra}
    r = client.post("/generate", json=body)
    assert r.status_code == 200, r.text
    return r.json()


def sse_events(text: str) -> list[Any]:
    """Parsed `data:` payloads of an SSE body; asserts it ends with exactly one [DONE]."""
    datas = [line[len("data: ") :] for line in text.split("\n") if line.startswith("data: ")]
    assert datas and datas[-1] == "[DONE]" and datas.count("[DONE]") == 1, text[-300:]
    return [json.loads(d) for d in datas[:-1]]


def scrape(client: TestClient) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    r = client.get("/metrics")
    assert r.status_code == 200
    out = {}
    for family in text_string_to_metric_families(r.text):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def delta(before: dict, after: dict, name: str, **labels: str) -> float:
    key = (name, tuple(sorted(labels.items())))
    return after.get(key, 0.0) - before.get(key, 0.0)


# --------------------------------------------------------------------------- /generate


def test_generate_input_ids_and_text(client: TestClient, engine: Engine) -> None:
    text = "The quick brown fox jumps over the lazy dog"
    ids = engine.tokenizer.encode(text)
    by_ids = generate(client, ids, 8)
    r = client.post(
        "/generate", json={"text": text, "sampling_params": {"max_new_tokens": 8, **GREEDY}}
    )
    assert r.status_code == 200
    by_text = r.json()
    assert len(by_ids["output_ids"]) == 8
    assert by_text["output_ids"] == by_ids["output_ids"]
    assert by_ids["text"] == engine.tokenizer.decode(by_ids["output_ids"])
    meta = by_text["meta_info"]
    assert meta["prompt_tokens"] == len(ids) and meta["completion_tokens"] == 8
    assert meta["finish_reason"] == {"type": "length", "length": 8}
    assert meta["prefill_node"] == meta["decode_node"] == "u0"
    assert set(meta["cached_tokens_details"]) == {
        "device",
        "host",
        "storage",
        "storage_from_decode",
    }
    assert meta["cached_tokens"] + meta["computed_tokens"] == meta["prompt_tokens"]
    assert 0 < meta["ttft_s"] <= meta["e2e_latency"]


def test_generate_stop_token_and_seeded_sampling(client: TestClient) -> None:
    ids = prompt(30, seed=1)
    greedy = generate(client, ids, 10)["output_ids"]
    stop_at = greedy[4]
    body = {
        "input_ids": ids,
        "sampling_params": {"max_new_tokens": 10, "temperature": 0.0, "stop_token_ids": [stop_at]},
    }
    stopped = client.post("/generate", json=body).json()
    first = greedy.index(stop_at)
    assert stopped["output_ids"] == greedy[: first + 1]
    assert stopped["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop_at}
    sampled = {"max_new_tokens": 12, "temperature": 1.0, "seed": 7, "ignore_eos": True}
    a = client.post("/generate", json={"input_ids": ids, "sampling_params": sampled}).json()
    b = client.post("/generate", json={"input_ids": ids, "sampling_params": sampled}).json()
    assert a["output_ids"] == b["output_ids"] and len(a["output_ids"]) == 12


def test_generate_stream_equals_non_stream(client: TestClient) -> None:
    ids = prompt(50, seed=2)
    plain = generate(client, ids, 12)
    r = client.post(
        "/generate",
        json={
            "input_ids": ids,
            "sampling_params": {"max_new_tokens": 12, **GREEDY},
            "stream": True,
        },
    )
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    chunks = sse_events(r.text)
    # SGLang's default: cumulative chunks, each the whole output so far
    assert len(chunks) > 1 and chunks[-1]["output_ids"] == plain["output_ids"]
    assert chunks[-1]["text"] == plain["text"]
    for before, after in zip(chunks, chunks[1:], strict=False):
        assert after["output_ids"][: len(before["output_ids"])] == before["output_ids"]
        assert after["text"].startswith(before["text"])
    last = chunks[-1]["meta_info"]
    assert last["finish_reason"] == {"type": "length", "length": 12}
    assert last["completion_tokens"] == 12
    assert all(c["meta_info"]["finish_reason"] is None for c in chunks[:-1])
    assert last["cached_tokens"] >= 48  # the non-streaming run cached the prompt's full pages


def test_generate_cache_salt_isolates_prefixes(client: TestClient) -> None:
    ids = prompt(64, seed=3)
    generate(client, ids, 2, cache_salt="tenant-a")
    same = generate(client, ids, 2, cache_salt="tenant-a")["meta_info"]
    other = generate(client, ids, 2, cache_salt="tenant-b")["meta_info"]
    assert same["cached_tokens"] >= 48
    assert other["cached_tokens"] == 0


# --------------------------------------------------------------------------- OpenAI


MESSAGES = [
    {"role": "system", "content": "You are terse."},
    {
        "role": "user",
        "content": [{"type": "text", "text": "Name three "}, {"type": "text", "text": "colours."}],
    },
]


def test_chat_completion_matches_generate(client: TestClient, engine: Engine) -> None:
    flat = [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Name three colours."},
    ]
    ids = engine.tokenizer.apply_chat_template(flat, add_generation_prompt=True)
    ref = generate(client, ids, 6)
    body = {"model": "anything", "messages": MESSAGES, "max_tokens": 6, "seed": 3, **GREEDY}
    r = client.post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    out = r.json()
    assert out["object"] == "chat.completion" and out["model"] == engine.config.model.name
    choice = out["choices"][0]
    assert choice["message"] == {"role": "assistant", "content": ref["text"]}
    assert choice["finish_reason"] == "length"
    usage = out["usage"]
    assert usage["prompt_tokens"] == len(ids) and usage["completion_tokens"] == 6
    assert usage["total_tokens"] == len(ids) + 6
    # the same prompt was just served by /generate: its full pages are reused
    assert usage["prompt_tokens_details"]["cached_tokens"] >= len(ids) // PAGE * PAGE
    assert (
        usage["cached_tokens_details"]["device"] == usage["prompt_tokens_details"]["cached_tokens"]
    )

    stream = client.post(
        "/v1/chat/completions",
        json={
            **body,
            "max_completion_tokens": 6,
            "stream": True,
            "stream_options": {"include_usage": True},
        },
    )
    chunks = sse_events(stream.text)
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    content = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks if c["choices"])
    assert content == ref["text"]
    assert chunks[-2]["choices"][0]["finish_reason"] == "length"
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 6
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)


def byte_tokenizer_bytes(engine: Engine, token_id: int) -> list[int]:
    """A byte tokenizer token's own bytes: ids 0..255 are bytes, the rest special tokens."""
    if token_id < 256:
        return [token_id]
    return list(engine.tokenizer.decode([token_id], skip_special_tokens=False).encode())


def test_chat_logprob_bytes_are_each_tokens_own_bytes(
    client: TestClient, engine: Engine
) -> None:
    ids = engine.tokenizer.apply_chat_template(MESSAGES[:1], add_generation_prompt=True)
    ref = generate(client, ids, 24)["output_ids"]
    assert any(0x80 <= t < 256 for t in ref), ref  # bytes of multi-byte characters
    body = {"messages": MESSAGES[:1], "max_tokens": 24, "logprobs": True, "top_logprobs": 2,
            **GREEDY}
    content = client.post("/v1/chat/completions", json=body).json()["choices"][0][
        "logprobs"]["content"]
    assert [e["bytes"] for e in content] == [byte_tokenizer_bytes(engine, t) for t in ref]
    # greedy: each position's first alternative is the chosen token
    assert [e["top_logprobs"][0]["bytes"] for e in content] == [e["bytes"] for e in content]


def test_completions_text_ids_stream_and_stop(client: TestClient, engine: Engine) -> None:
    ids = prompt(40, seed=4)
    ref = generate(client, ids, 24)
    body = {"prompt": ids, "max_tokens": 24, **GREEDY}
    out = client.post("/v1/completions", json=body).json()
    assert out["object"] == "text_completion" and out["choices"][0]["text"] == ref["text"]
    assert out["usage"]["prompt_tokens"] == 40 and out["usage"]["completion_tokens"] == 24
    text_prompt = "Once upon a time"
    by_text = client.post(
        "/v1/completions", json={"prompt": [text_prompt], "max_tokens": 5, **GREEDY}
    )
    by_ids = generate(client, engine.tokenizer.encode(text_prompt), 5)
    assert by_text.json()["choices"][0]["text"] == by_ids["text"]

    stream = client.post("/v1/completions", json={**body, "stream": True})
    chunks = sse_events(stream.text)
    assert "".join(c["choices"][0]["text"] for c in chunks) == ref["text"]
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"

    # a stop string taken from the middle of the greedy text cuts it there
    full = ref["text"]
    start = next(i for i in range(3, len(full) - 2) if "\ufffd" not in full[i : i + 2])
    stop = full[start : start + 2]
    cut = full[: full.find(stop)]
    for stream_flag in (False, True):
        r = client.post("/v1/completions", json={**body, "stop": [stop], "stream": stream_flag})
        if stream_flag:
            got = "".join(c["choices"][0]["text"] for c in sse_events(r.text))
            reason = sse_events(r.text)[-1]["choices"][0]["finish_reason"]
        else:
            got, reason = r.json()["choices"][0]["text"], r.json()["choices"][0]["finish_reason"]
        assert (got, reason) == (cut, "stop")


# --------------------------------------------------------------------------- bad input

CTX = 8192  # tiny preset context
BAD_REQUESTS: list[tuple[str, Any, str]] = [
    ("/generate", b"{bad json", "invalid_json"),
    ("/generate", b"[1, 2, 3]", "model_type"),
    ("/generate", {"input_ids": [1, "2"]}, "int_type"),
    ("/generate", {"input_ids": [1, 2.5]}, "int_type"),
    ("/generate", {"text": 42}, "string_type"),
    ("/generate", {"text": "a", "stream": "yes"}, "bool_type"),
    ("/generate", {"text": "a", "sampling_params": {"max_new_tokens": "4"}}, "int_type"),
    ("/generate", {"text": "a", "extra": 1}, "unknown_field"),
    ("/generate", {"text": "a", "sampling_params": {"max_tokens": 4}}, "unknown_field"),
    ("/generate", {"input_ids": []}, "empty_prompt"),
    ("/generate", {"text": ""}, "empty_prompt"),
    ("/generate", {}, "invalid_prompt"),
    ("/generate", {"text": "a", "input_ids": [1]}, "invalid_prompt"),
    ("/generate", {"input_ids": [1, 261]}, "token_id_out_of_range"),
    ("/generate", {"input_ids": [-1]}, "token_id_out_of_range"),
    (
        "/generate",
        {"input_ids": [1], "sampling_params": {"stop_token_ids": [999]}},
        "token_id_out_of_range",
    ),
    (
        "/generate",
        {"input_ids": [1] * (CTX - 10), "sampling_params": {"max_new_tokens": 11}},
        "context_length_exceeded",
    ),
    (
        "/generate",
        {"input_ids": [1], "sampling_params": {"max_new_tokens": 0}},
        "greater_than_equal",
    ),
    ("/generate", {"input_ids": [1], "sampling_params": {"top_p": 1.5}}, "less_than_equal"),
    ("/v1/chat/completions", b"not json", "invalid_json"),
    ("/v1/chat/completions", {"messages": []}, "too_short"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": 5}]}, None),
    (
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "x"}], "logit_bias": {"1": 1.0}},
        "unsupported_parameter",
    ),
    (
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "x"}], "max_tokens": 0},
        "greater_than_equal",
    ),
    (
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "x"}], "max_tokens": CTX},
        "context_length_exceeded",
    ),
    (
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "x"}], "top_k_typo": 1},
        "unknown_field",
    ),
    (
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2},
        "invalid_logprobs",
    ),
    ("/v1/completions", {"prompt": "x", "echo": True}, "unsupported_parameter"),
    ("/v1/completions", {"prompt": "x", "max_tokens": 0}, "greater_than_equal"),
    ("/v1/completions", {"prompt": []}, "empty_prompt"),
    ("/v1/completions", {"prompt": ""}, "empty_prompt"),
    ("/v1/completions", {"prompt": [261]}, "token_id_out_of_range"),
    ("/v1/completions", {"prompt": ["a", "b"]}, "unsupported_parameter"),
    ("/v1/completions", {"prompt": "x", "max_tokens": CTX}, "context_length_exceeded"),
    ("/v1/completions", {"prompt": "x", "temperature": "hot"}, "float_type"),
]


@pytest.mark.parametrize(("path", "body", "code"), BAD_REQUESTS)
def test_bad_input_is_4xx_json_then_server_still_serves(
    client: TestClient, path: str, body: Any, code: str | None
) -> None:
    if isinstance(body, bytes):
        r = client.post(path, content=body, headers={"content-type": "application/json"})
    else:
        r = client.post(path, json=body)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["type"] == "invalid_request_error" and error["message"]
    if code is not None:
        assert error["code"] == code, error
    good = client.post(
        "/generate", json={"input_ids": [5, 6, 7], "sampling_params": {"max_new_tokens": 2}}
    )
    assert good.status_code == 200 and len(good.json()["output_ids"]) >= 1


@pytest.mark.parametrize("limit", [512, None], ids=["limited", "protection-off"])
def test_a_node_refuses_a_body_over_its_limit(engine: Engine, limit: int | None) -> None:
    """A node's own `max_request_bytes` (a client may reach a node without the router):
    an OpenAI body over it is a 413 JSON error, counted; the default lets it through."""
    extra = {} if limit is None else {"max_request_bytes": limit}
    config = ServerConfig(name="u0", request_timeout_s=60, manage_engine=False, **extra)
    body = {"model": "tiny", "max_tokens": 1, "temperature": 0,
            "messages": [{"role": "user", "content": "ab " * 200}]}
    with TestClient(create_app(engine, config)) as client:
        r = client.post("/v1/chat/completions", json=body)
        metrics = client.get("/metrics").text
    if limit is None:
        assert r.status_code == 200, r.text
        return
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large", r.text
    assert 'endpoint="/v1/chat/completions",status="413"} 1.0' in metrics


def test_unknown_route_and_method_are_json(client: TestClient) -> None:
    r = client.get("/nope")
    assert r.status_code == 404 and r.json()["error"]["type"] == "not_found_error"
    r = client.get("/generate")
    assert r.status_code == 405 and "error" in r.json()


LONG = {"ignore_eos": True, "temperature": 0.0}  # each would run ~8000 tokens if submitted
EMPTY_STOP_STRINGS: list[tuple[str, dict[str, Any], str]] = [
    ("/generate", {"input_ids": [1, 2, 3],
                   "sampling_params": {"max_new_tokens": 8000, "stop": [""], **LONG}},
     "sampling_params.stop"),
    # the batch's second sequence is refused: its first must not be left running either
    ("/generate", {"input_ids": [[1, 2, 3], [4, 5, 6]],
                   "sampling_params": [{"max_new_tokens": 8000, **LONG},
                                       {"max_new_tokens": 8000, "stop": "", **LONG}]},
     "sampling_params[1].stop"),
    ("/v1/completions", {"prompt": [1, 2, 3], "max_tokens": 8000, "n": 2, "stop": [""],
                         **LONG}, "stop"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "stream": True,
                              "max_tokens": 8000, "stop": ["a", ""], **LONG}, "stop"),
]


@pytest.mark.parametrize(("path", "body", "param"), EMPTY_STOP_STRINGS)
def test_a_refused_stop_string_leaves_nothing_in_the_engine(
    client: TestClient, engine: Engine, path: str, body: dict[str, Any], param: str
) -> None:
    admitted = wait_idle(engine)["requests_admitted_total"]
    r = client.post(path, json=body)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param
    # refused before any submit: the engine is idle at once and admitted nothing
    assert wait_idle(engine, timeout=2.0)["requests_admitted_total"] == admitted

# --------------------------------------------------------------------------- deadlines, overload


def wait_idle(engine: Engine, timeout: float = 10.0) -> dict[str, Any]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        stats = engine.stats()
        if stats.get("num_running", stats.get("running")) == 0 and stats["queued"] == 0:
            return stats
        time.sleep(0.02)
    raise AssertionError(f"engine still busy: {engine.stats()}")


def test_deadline_gives_504_and_aborts_in_engine(engine: Engine) -> None:
    app = create_app(engine, ServerConfig(name="t", request_timeout_s=0.3, manage_engine=False))
    long = {"input_ids": prompt(20, seed=5), "sampling_params": {"max_new_tokens": 4000, **GREEDY}}
    with TestClient(app) as c:
        t0 = time.monotonic()
        r = c.post("/generate", json=long)
        assert r.status_code == 504 and r.json()["error"]["type"] == "timeout_error"
        assert time.monotonic() - t0 < 5
        wait_idle(engine)
        r = c.post(
            "/v1/completions", json={"prompt": [1, 2], "max_tokens": 4000, "stream": True, **GREEDY}
        )
        events = sse_events(r.text)
        assert events[-1]["error"]["type"] == "timeout_error"
        wait_idle(engine)
        ok = c.post(
            "/generate", json={"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 2}}
        )
        assert ok.status_code == 200
        text = c.get("/metrics").text
        assert 'pdcache_requests_finished_total{reason="abort"} 2.0' in text
    engine.check_accounting()


def test_overloaded_engine_gives_503(engine: Engine) -> None:
    config = replace(engine.config, scheduler=SchedulerConfig(max_queued_requests=0))
    full = Engine(config, engine.model, engine.tokenizer)
    with TestClient(create_app(full, ServerConfig(name="full"))) as c:
        r = c.post("/generate", json={"input_ids": [1, 2, 3]})
        assert r.status_code == 503 and r.headers["retry-after"] == "1"
        assert r.json()["error"]["type"] == "overloaded_error"
        r = c.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}]})
        assert r.status_code == 503
        assert c.get("/health").status_code == 200
    assert c.get("/health").status_code == 503  # engine shut down with the app


class FailingForward:
    """The real tiny model, except that its next `failures` forwards raise (fault injection)."""

    def __init__(self, model: Any) -> None:
        self.model = model
        self.failures = 0

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if self.failures > 0:
            self.failures -= 1
            raise RuntimeError("injected forward failure")
        return self.model.forward(*args, **kwargs)


def test_engine_failure_is_500_json_and_server_survives(engine: Engine) -> None:
    model = FailingForward(engine.model)
    flaky = Engine(engine.config, model, engine.tokenizer)
    body = {"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 3, **GREEDY}}
    with TestClient(create_app(flaky, ServerConfig(name="flaky"))) as c:
        model.failures = 1
        r = c.post("/generate", json=body)
        assert r.status_code == 500
        assert r.json()["error"]["type"] == "server_error"
        assert "injected forward failure" in r.json()["error"]["message"]
        model.failures = 1
        events = sse_events(c.post("/generate", json={**body, "stream": True}).text)
        assert events[-1]["error"]["code"] == "engine_abort"
        ok = c.post("/generate", json=body)
        assert ok.status_code == 200 and len(ok.json()["output_ids"]) == 3
        assert c.get("/health").status_code == 200
        metrics = c.get("/metrics").text
        assert 'pdcache_engine_step_errors_total{server="flaky"} 2.0' in metrics
        assert 'pdcache_requests_total{endpoint="/generate",status="500"} 1.0' in metrics
        flaky.check_accounting()


# --------------------------------------------------------------------------- metrics, info


def test_metrics_exact_deltas(client: TestClient) -> None:
    ids = prompt(40, seed=6)
    before = scrape(client)
    first = generate(client, ids, 6)["meta_info"]
    second = generate(client, ids, 6)["meta_info"]
    bad = client.post("/generate", json={"input_ids": [999]})
    assert bad.status_code == 400
    after = scrape(client)

    assert second["cached_tokens"] >= 32  # page-floor of the 40-token prompt
    assert delta(before, after, "pdcache_requests_total", endpoint="/generate", status="200") == 2
    assert delta(before, after, "pdcache_requests_total", endpoint="/generate", status="400") == 1
    assert delta(before, after, "pdcache_requests_total", endpoint="/metrics", status="200") == 1
    assert delta(before, after, "pdcache_requests_finished_total", reason="length") == 2
    assert delta(before, after, "pdcache_prompt_tokens_total") == 80
    assert delta(before, after, "pdcache_generation_tokens_total") == 12
    cached = first["cached_tokens"] + second["cached_tokens"]
    assert delta(before, after, "pdcache_cached_tokens_total", tier="device") == cached
    assert delta(before, after, "pdcache_cached_tokens_total", tier="storage") == 0
    computed = first["computed_tokens"] + second["computed_tokens"]
    assert delta(before, after, "pdcache_computed_tokens_total") == computed == 80 - cached
    assert delta(before, after, "pdcache_time_to_first_token_seconds_count") == 2
    assert delta(before, after, "pdcache_e2e_request_latency_seconds_count") == 2
    assert delta(before, after, "pdcache_inter_token_latency_seconds_count") == 10
    pages = after[("pdcache_device_pages_total", (("server", "u0"),))]
    free = after[("pdcache_device_pages_free", (("server", "u0"),))]
    used = after[("pdcache_device_pages_used", (("server", "u0"),))]
    assert pages == 512 and free + used == pages and used > 0
    assert after[("pdcache_queue_depth", (("server", "u0"),))] == 0


def test_health_and_models(client: TestClient, engine: Engine) -> None:
    health = client.get("/health")
    assert health.status_code == 200 and health.json()["status"] == "ok"
    models = client.get("/v1/models").json()
    assert models["object"] == "list"
    assert models["data"][0]["id"] == engine.config.model.name
    assert models["data"][0]["max_model_len"] == CTX


def test_pd_body_on_a_unified_server_is_400(client: TestClient) -> None:
    """`pd` is the router's field for P/D nodes: a unified server must not serve it as a plain
    request (it would generate the whole answer where prefill expects one token)."""
    body = {"input_ids": prompt(8, 1), "sampling_params": {"max_new_tokens": 2},
            "pd": {"room": 7, "role": "prefill"}}
    response = client.post("/generate", json=body)
    assert response.status_code == 400
    assert response.json()["error"]["param"] == "pd"
    ok = client.post("/generate", json={"input_ids": prompt(8, 1),
                                        "sampling_params": {"max_new_tokens": 2}})
    assert ok.status_code == 200
