"""A hybrid model's state series on `/metrics` (docs/operations.md "Hybrid models"): a unified
server around a `tiny-qwen3-next` engine with HiCache (host + file storage, write_through)
serves one request; the engine's checkpoint counters, each tier hop's state and KV bytes and
the host state pool then read exactly what the engine and HiCache counted, and the P→D
transfer's state bytes sit beside its KV bytes."""

from __future__ import annotations

from pathlib import Path

from fastapi.testclient import TestClient
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from pdcache.engine.config import CacheConfig, EngineConfig
from pdcache.engine.loader import load_model
from pdcache.engine.scheduler_config import SchedulerConfig
from pdcache.offload_manager.builder import (
    TierConfig,
    build_tiered_engine,
    fingerprint_for,
    storage_config_for,
)
from pdcache.offload_manager.hicache import HiCacheConfig
from pdcache.server.app import ServerConfig, create_app
from pdcache.server.metrics import TransferCollector

PAGE = 4
PROMPT = [(i * 37 + 11) % 200 + 3 for i in range(30)]  # 7 full pages + 2 tokens
STEPS = 6  # 35 tokens computed: checkpoints at the prompt's (28) and answer's (32) last page

Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def parse(text: str) -> Samples:
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def value(samples: Samples, name: str, **labels: str) -> float:
    return samples[(name, tuple(sorted({"server": "hybrid", **labels}.items())))]


def test_a_hybrid_request_shows_in_the_state_series(tmp_path: Path) -> None:
    model, tokenizer = load_model("tiny-qwen3-next", seed=0)
    config = EngineConfig(
        model=model.config,
        cache=CacheConfig(page_size=PAGE, num_device_pages=96, state_checkpoint_slots=8),
        scheduler=SchedulerConfig(max_running_requests=4))
    storage = storage_config_for(model.config, PAGE, fingerprint_for(model.config, "m", PAGE),
                                 backend="file", path=str(tmp_path), capacity_pages=256)
    built = build_tiered_engine(config, model, tokenizer, TierConfig(
        host_pages=64, storage=storage, hicache=HiCacheConfig(prefetch_policy="wait_complete")))
    app = create_app(built.engine, ServerConfig(name="hybrid"), on_shutdown=built.close)
    with TestClient(app) as client:
        body = {"input_ids": PROMPT,
                "sampling_params": {"max_new_tokens": STEPS, "temperature": 0.0,
                                    "ignore_eos": True}}
        assert client.post("/generate", json=body).status_code == 200
        assert built.hicache.wait_idle(10)
        samples = parse(client.get("/metrics").text)
        engine = built.engine.stats()
        tiers = built.hicache.stats

    slot_bytes = model.config.state_geometry.state_bytes()
    assert value(samples, "pdcache_state_slot_bytes") == engine["state_slot_bytes"] == slot_bytes
    assert value(samples, "pdcache_state_slots_total") == engine["state_slots_total"] == 4 + 8
    assert value(samples, "pdcache_state_checkpoints") == 2  # 28 and 32
    # the prompt's checkpoint, and the decode one renewed once (at 32)
    assert value(samples, "pdcache_state_checkpoints_taken_total") == 2
    assert value(samples, "pdcache_state_checkpoint_bytes_total") == 2 * slot_bytes
    assert value(samples, "pdcache_state_checkpoints_skipped_total") == 0
    assert value(samples, "pdcache_state_limited_hits_total") == 0

    page_bytes = model.config.kv_geometry.page_bytes(PAGE)
    # write_through: both checkpoints reached host and storage beside the 8 pages
    assert tiers.backup_host_states == tiers.backup_storage_states == 2
    for path in ("device_to_host", "host_to_storage"):
        assert value(samples, "pdcache_state_bytes_total", path=path) == 2 * slot_bytes
        assert value(samples, "pdcache_kv_bytes_total", path=path) == 8 * page_bytes
    assert value(samples, "pdcache_state_bytes_total", path="host_to_device") == 0
    assert value(samples, "pdcache_state_tier_checkpoints_total", event="storage_written") == 2
    assert value(samples, "pdcache_state_host_slots", state="used") == 2
    assert value(samples, "pdcache_state_host_bytes_used") == 2 * slot_bytes
    assert value(samples, "pdcache_state_host_slots_total") == 16  # twice the device share


def test_transfer_state_bytes_beside_the_kv_bytes() -> None:
    registry = CollectorRegistry()
    stats = {"bytes_sent": 4096, "state_bytes_sent": 58368, "rejected": {}}
    registry.register(TransferCollector(lambda: stats, "hybrid"))
    samples = parse(generate_latest(registry).decode())
    assert value(samples, "pdcache_kv_transfer_bytes_total", direction="sent") == 4096
    assert value(samples, "pdcache_state_transfer_bytes_total", direction="sent") == 58368
    assert ("pdcache_state_transfer_bytes_total",
            (("direction", "received"), ("server", "hybrid"))) not in samples
