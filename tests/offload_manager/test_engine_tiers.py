"""HiCache in the real engine (the tiny preset, and tiny-mla: MLA latent pages, MoE): a prompt
served from the device, the host and the storage tier (a fresh engine over the same hf3fs
directory) gives the tokens of a no-cache run, and reports where its reused tokens came from."""

from __future__ import annotations

import pytest

from pdcache.engine.api import GenerateRequest, SamplingParams
from pdcache.engine.config import CacheConfig, EngineConfig
from pdcache.engine.engine import Engine
from pdcache.engine.loader import load_model
from pdcache.engine.scheduler_config import SchedulerConfig
from pdcache.offload_manager.builder import (
    TierConfig,
    build_tiered_engine,
    fingerprint_for,
    model_identity,
    storage_config_for,
)
from pdcache.offload_manager.hicache import HiCacheConfig

PAGE = 4
PARAMS = SamplingParams(max_new_tokens=8, ignore_eos=True)


@pytest.fixture(scope="module", params=["tiny", "tiny-mla"])
def tiny(request):
    model, tokenizer = load_model(request.param, seed=0)
    return model, tokenizer


def engine_config(model, prefix_cache: bool = True) -> EngineConfig:
    return EngineConfig(
        model=model.config,
        cache=CacheConfig(page_size=PAGE, num_device_pages=96, enable_prefix_cache=prefix_cache),
        scheduler=SchedulerConfig(chunked_prefill_tokens=32),
    )


def tiered(tiny, tmp_path, **hicache):
    model, tokenizer = tiny
    fp = fingerprint_for(model.config, model_identity(model.config.name, 0), PAGE)
    storage = storage_config_for(model.config, PAGE, fp, backend="hf3fs", path=str(tmp_path),
                                 capacity_pages=256)
    tiers = TierConfig(host_pages=64, hicache=HiCacheConfig(**hicache), storage=storage)
    built = build_tiered_engine(engine_config(model), model, tokenizer, tiers)
    built.engine.start()
    return built


def generate(engine: Engine, rid: str, prompt: list[int], salt: str = ""):
    outputs = engine.generate(GenerateRequest(rid, prompt, PARAMS, salt), timeout=120)
    return [t for o in outputs for t in o.new_token_ids], outputs[-1]


def reference_tokens(tiny, prompt: list[int]) -> list[int]:
    model, tokenizer = tiny
    with Engine(engine_config(model, prefix_cache=False), model, tokenizer) as engine:
        return generate(engine, "ref", prompt)[0]


PROMPT = [(7 * i + 3) % 250 for i in range(41)]  # 10 full pages + 1 token


def test_device_host_and_storage_hits_are_exact(tiny, tmp_path) -> None:
    expected = reference_tokens(tiny, PROMPT)
    first = tiered(tiny, tmp_path, prefetch_policy="wait_complete")
    try:
        tokens, out = generate(first.engine, "a", PROMPT)
        assert tokens == expected and out.cached.total == 0
        tokens, out = generate(first.engine, "b", PROMPT)  # device hit
        assert tokens == expected and out.cached.device == 40
        first.engine.flush_cache()  # device pages demoted to the host copies
        tokens, out = generate(first.engine, "c", PROMPT)
        assert tokens == expected
        assert (out.cached.device, out.cached.host) == (0, 40)
        assert out.computed_tokens == len(PROMPT) - 40
        assert first.hicache.wait_idle(10)
        assert first.hicache.stats.backup_storage_pages >= 10
        first.engine.check_accounting()
    finally:
        first.close()
    second = tiered(tiny, tmp_path, prefetch_policy="wait_complete")  # fresh tiers, same storage
    try:
        tokens, out = generate(second.engine, "d", PROMPT)
        assert tokens == expected
        assert (out.cached.device, out.cached.host, out.cached.storage) == (0, 0, 40)
        assert second.hicache.stats.prefetch_pages == 10
        longer = PROMPT + expected + [5, 6, 7]
        tokens, out = generate(second.engine, "e", longer)
        assert tokens == reference_tokens(tiny, longer)
        assert out.cached.total >= 40
        assert second.hicache.wait_idle(10)
        second.engine.check_accounting()
        second.hicache.check()
    finally:
        second.close()


def test_tenants_do_not_share_storage(tiny, tmp_path) -> None:
    first = tiered(tiny, tmp_path)
    try:
        generate(first.engine, "a", PROMPT, salt="alice")
        assert first.hicache.wait_idle(10)
    finally:
        first.close()
    second = tiered(tiny, tmp_path, prefetch_policy="wait_complete")
    try:
        assert generate(second.engine, "b", PROMPT, salt="bob")[1].cached.total == 0
        assert generate(second.engine, "c", PROMPT, salt="alice")[1].cached.storage == 40
    finally:
        second.close()


def test_storage_corruption_is_a_miss_and_recomputed(tiny, tmp_path) -> None:
    expected = reference_tokens(tiny, PROMPT)
    first = tiered(tiny, tmp_path)
    try:
        generate(first.engine, "a", PROMPT)
        assert first.hicache.wait_idle(10)
    finally:
        first.close()
    for data_file in sorted(tmp_path.rglob("*")):
        if data_file.is_file() and data_file.stat().st_size > 1 << 16:
            raw = bytearray(data_file.read_bytes())
            for offset in range(2048, len(raw), 4096):  # one flipped byte per 4 KiB
                raw[offset] ^= 0xFF
            data_file.write_bytes(bytes(raw))
    second = tiered(tiny, tmp_path, prefetch_policy="wait_complete")
    try:
        tokens, out = generate(second.engine, "b", PROMPT)
        assert tokens == expected
        assert out.cached.storage == 0  # every stored page is corrupt: all recomputed
        assert second.storage.stats()["corrupt_pages"] >= 1
    finally:
        second.close()
