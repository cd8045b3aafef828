"""Shared pieces of the HiCache tests (`tests/offload_manager/test_hicache_*.py`): the tiny engine with tiers,
no-cache reference tokens, metrics scraping, and `pdcache serve` as a subprocess."""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
from fastapi.testclient import TestClient
from prometheus_client.parser import text_string_to_metric_families

from pdcache.engine.api import GenerateRequest, SamplingParams
from pdcache.engine.config import CacheConfig, EngineConfig
from pdcache.engine.engine import Engine
from pdcache.engine.page_keys import chain_page_keys, make_salt
from pdcache.engine.scheduler_config import SchedulerConfig
from pdcache.offload_manager.builder import (
    TierConfig,
    TieredEngine,
    build_tiered_engine,
    fingerprint_for,
    model_identity,
    storage_config_for,
)
from pdcache.offload_manager.hicache import HiCacheConfig
from pdcache.offload_manager.storage.config import StorageConfig
from pdcache.server.app import ServerConfig, create_app
from pdcache.server.cli import READY_PREFIX
from tests.process_support import PdcacheProcess

PAGE = 4
PARAMS = SamplingParams(max_new_tokens=8, ignore_eos=True)
PROMPT = [(7 * i + 3) % 250 for i in range(41)]  # 10 full pages + 1 token
PROMPT_PAGES = 10
OTHER = [(11 * i + 5) % 250 for i in range(41)]


def engine_config(model: Any, prefix_cache: bool = True, device_pages: int = 96) -> EngineConfig:
    return EngineConfig(
        model=model.config,
        cache=CacheConfig(page_size=PAGE, num_device_pages=device_pages,
                          enable_prefix_cache=prefix_cache),
        scheduler=SchedulerConfig(chunked_prefill_tokens=32),
    )


def storage_config(model: Any, **settings: Any) -> StorageConfig:
    """Storage of the tiny preset (seed 0, page 4): what `pdcache serve --model tiny` uses.
    `model` is a loaded model or its ModelConfig."""
    config = getattr(model, "config", model)
    fp = fingerprint_for(config, model_identity("tiny", 0), PAGE)
    settings.setdefault("capacity_pages", 256)
    return storage_config_for(config, PAGE, fp, **settings)


def prompt_keys(storage: StorageConfig, tokens: list[int], salt: str = "") -> list[bytes]:
    """The storage keys of the full pages of `tokens` (as every node computes them)."""
    return chain_page_keys(tokens, PAGE, make_salt(storage.fingerprint, salt))


def tiered(tiny: tuple[Any, Any], storage: StorageConfig | None, host_pages: int = 64,
           device_pages: int = 96, **hicache: Any) -> TieredEngine:
    """A started engine (tiny preset) with a host pool and optional storage."""
    model, tokenizer = tiny
    tiers = TierConfig(host_pages=host_pages, hicache=HiCacheConfig(**hicache), storage=storage)
    built = build_tiered_engine(engine_config(model, device_pages=device_pages), model, tokenizer,
                                tiers)
    built.engine.start()
    return built


def generate(engine: Engine, rid: str, prompt: list[int], salt: str = ""):
    outputs = engine.generate(GenerateRequest(rid, prompt, PARAMS, salt), timeout=120)
    return [t for o in outputs for t in o.new_token_ids], outputs[-1]


def reference_tokens(tiny: tuple[Any, Any], prompt: list[int]) -> list[int]:
    model, tokenizer = tiny
    with Engine(engine_config(model, prefix_cache=False), model, tokenizer) as engine:
        return generate(engine, "ref", prompt)[0]


def run_to_end(built: TieredEngine, limit_s: float = 120.0) -> None:
    """Step an engine started with `thread=False` until it has no work (bounded)."""
    deadline = time.monotonic() + limit_s
    while built.engine.step():
        assert time.monotonic() < deadline, "the driven engine did not finish"
        time.sleep(0.001)  # a step stalled on a prefetch returns at once: don't spin hot


def check_every_tier(built: TieredEngine, timeout_s: float = 20.0) -> dict[str, int]:
    """Accounting on every tier once I/O is idle: device free + used == capacity (and tree +
    requests == used), host free + used + in_flight == capacity with no pin left, storage
    used + free + reserved == capacity. Returns the storage numbers (empty without storage)."""
    assert built.hicache.wait_idle(timeout_s), "HiCache I/O did not go idle"
    built.engine.check_accounting()
    built.hicache.check()
    pool = built.hicache.host_pool
    assert pool.num_free + pool.num_used + pool.num_in_flight == pool.capacity
    assert pool.num_in_flight == 0
    if built.storage is None:
        return {}
    stats = built.storage.stats()
    if "capacity_pages" in stats and stats["capacity_pages"]:
        total = (stats["used_pages"] + stats["free_pages"] + stats["reserved_pages"]
                 + stats.get("retired_pages", 0))  # hf3fs: slots a full file system refused
        assert total == stats["capacity_pages"], stats
    return stats


def parse_metrics(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    out = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            out[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return out


def metric(samples: dict, name: str, **labels: str) -> float | None:
    return samples.get((name, tuple(sorted(labels.items()))))


class ServeProcess(PdcacheProcess):
    """`python -m pdcache serve --model tiny --port 0 ARGS`, ready once it prints its URL."""

    def __init__(self, *args: str, startup_timeout_s: float = 90.0) -> None:
        cmd = ["serve", "--model", "tiny", "--port", "0", "--page-size", str(PAGE),
               "--log-level", "warning", *args]
        super().__init__(cmd, READY_PREFIX, startup_timeout_s,
                         env={"MC_TCP_BIND_ADDRESS": "127.0.0.1", "MC_LOG_LEVEL": "ERROR"})

    def generate(self, prompt: list[int], max_new_tokens: int = 8) -> dict[str, Any]:
        body = {"input_ids": prompt, "sampling_params": {"max_new_tokens": max_new_tokens,
                                                         "temperature": 0.0, "ignore_eos": True}}
        r = httpx.post(f"{self.url}/generate", json=body, timeout=120)
        assert r.status_code == 200, r.text
        return r.json()

    def metrics(self) -> dict:
        r = httpx.get(f"{self.url}/metrics", timeout=30)
        assert r.status_code == 200
        return parse_metrics(r.text)

    def stop(self) -> int:
        return super().stop(timeout_s=20)


@contextmanager
def served(built: TieredEngine, name: str = "u0") -> Iterator[TestClient]:
    """The unified server app over a started tiered engine; closes the engine and its tiers
    on exit."""
    app = create_app(built.engine, ServerConfig(name=name, manage_engine=False))
    try:
        with TestClient(app) as client:
            yield client
    finally:
        built.close()


def post(client: TestClient, prompt: list[int], max_new_tokens: int = 8) -> dict[str, Any]:
    body = {"input_ids": prompt,
            "sampling_params": {"max_new_tokens": max_new_tokens, "ignore_eos": True}}
    r = client.post("/generate", json=body)
    assert r.status_code == 200, r.text
    return r.json()


def scrape(client: TestClient) -> dict:
    r = client.get("/metrics")
    assert r.status_code == 200
    return parse_metrics(r.text)


def data_files(root: Path) -> list[Path]:
    return sorted(p for p in root.rglob("*") if p.is_file())
