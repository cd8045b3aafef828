"""`pdcache serve` as a real uvicorn subprocess: readiness line, two-turn reuse against a
no-prefix-cache server, and client disconnects that abort the request in the engine."""

from __future__ import annotations

import random
import signal
import subprocess
import sys
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from fastapi.testclient import TestClient

from pdcache.engine.config import CacheConfig
from pdcache.engine.engine import Engine
from pdcache.server.app import ServerConfig, create_app
from pdcache.server.cli import READY_PREFIX
from tests.polling import wait_until
from tests.process_support import PdcacheProcess

pytestmark = pytest.mark.slow

PAGE = 16
GREEDY = {"temperature": 0.0, "ignore_eos": True}
STARTUP_TIMEOUT_S = 90.0


class ServeProcess(PdcacheProcess):
    """`python -m pdcache serve ... --port 0`, ready once it prints its URL."""

    def __init__(self, *args: str) -> None:
        super().__init__(["serve", "--model", "tiny", "--port", "0", *args], READY_PREFIX,
                         STARTUP_TIMEOUT_S)


@pytest.fixture(scope="module")
def nocache() -> Iterator[ServeProcess]:
    server = ServeProcess("--no-prefix-cache", "--page-size", str(PAGE), "--name", "nocache")
    try:
        yield server
    finally:
        code = server.stop()
        # uvicorn shuts down gracefully (lifespan stops the engine), then re-raises SIGTERM
        assert code in (0, -signal.SIGTERM), code
        assert any("Application shutdown complete" in line for line in server.log), server.log


@pytest.fixture(scope="module")
def cached() -> Iterator[TestClient]:
    engine = Engine.from_spec("tiny", cache=CacheConfig(page_size=PAGE, num_device_pages=512))
    with TestClient(create_app(engine, ServerConfig(name="cached"))) as client:
        yield client
    engine.check_accounting()


def post_generate(client: httpx.Client | TestClient, url: str, ids: list[int], n: int) -> dict:
    body = {"input_ids": ids, "sampling_params": {"max_new_tokens": n, **GREEDY}}
    r = client.post(url + "/generate", json=body)
    assert r.status_code == 200, r.text
    return r.json()


def test_two_turn_reuse_equals_no_cache(nocache: ServeProcess, cached: TestClient) -> None:
    rng = random.Random(11)
    turn1 = [rng.randrange(256) for _ in range(83)]
    with httpx.Client(timeout=60) as http:
        ref1 = post_generate(http, nocache.url, turn1, 20)
        got1 = post_generate(cached, "", turn1, 20)
        assert got1["output_ids"] == ref1["output_ids"]
        turn2 = turn1 + got1["output_ids"] + [rng.randrange(256) for _ in range(25)]
        ref2 = post_generate(http, nocache.url, turn2, 20)
        got2 = post_generate(cached, "", turn2, 20)
    assert got2["output_ids"] == ref2["output_ids"]
    meta = got2["meta_info"]
    assert meta["cached_tokens"] >= len(turn1) // PAGE * PAGE
    assert meta["cached_tokens_details"]["device"] == meta["cached_tokens"]
    assert meta["computed_tokens"] == len(turn2) - meta["cached_tokens"]
    assert ref2["meta_info"]["cached_tokens"] == 0 and ref2["meta_info"]["computed_tokens"] == len(turn2)
    assert ref2["meta_info"]["prefill_node"] == "nocache"


def test_concurrent_requests_equal_sequential(nocache: ServeProcess) -> None:
    rng = random.Random(12)
    prompts = [[rng.randrange(256) for _ in range(rng.randrange(5, 70))] for _ in range(6)]
    with httpx.Client(timeout=60) as http:
        sequential = [post_generate(http, nocache.url, p, 12)["output_ids"] for p in prompts]
        with ThreadPoolExecutor(max_workers=len(prompts)) as pool:
            futures = [pool.submit(post_generate, http, nocache.url, p, 12) for p in prompts]
            concurrent = [f.result(timeout=60)["output_ids"] for f in futures]
    assert concurrent == sequential


def metric(text: str, line_prefix: str) -> float:
    for line in text.splitlines():
        if line.startswith(line_prefix + " "):
            return float(line.split()[-1])
    return 0.0


def test_client_disconnect_aborts_in_engine(nocache: ServeProcess) -> None:
    aborts = 'pdcache_requests_finished_total{reason="abort"}'
    running = 'pdcache_running_requests{server="nocache"}'
    used = 'pdcache_device_pages_used{server="nocache"}'
    long = {"input_ids": [1, 2, 3, 4], "sampling_params": {"max_new_tokens": 6000, **GREEDY}}
    with httpx.Client(timeout=60) as http:
        base = metric(http.get(nocache.url + "/metrics").text, aborts)
        # streaming: read one event, then hang up
        with http.stream("POST", nocache.url + "/generate", json={**long, "stream": True}) as r:
            assert r.status_code == 200
            first = next(r.iter_lines())
            assert first.startswith("data: ")

        def aborted(count: float) -> bool:
            text = http.get(nocache.url + "/metrics").text
            return metric(text, aborts) == count and metric(text, running) == 0

        wait_until(lambda: aborted(base + 1))
        # non-streaming: the client gives up waiting
        with pytest.raises(httpx.ReadTimeout):
            http.post(
                nocache.url + "/v1/completions",
                json={"prompt": [5, 6], "max_tokens": 6000, **GREEDY},
                timeout=1.0,
            )
        wait_until(lambda: aborted(base + 2))
        text = http.get(nocache.url + "/metrics").text
        assert metric(text, used) == 0  # no prefix cache: nothing may hold a page now
        ok = post_generate(http, nocache.url, [7, 8, 9], 3)
        assert len(ok["output_ids"]) == 3
        assert http.get(nocache.url + "/health").status_code == 200


def test_cli_rejects_unknown_model() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "pdcache", "serve", "--model", "/nonexistent/model", "--port", "0"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode != 0
    assert "nonexistent" in proc.stderr
