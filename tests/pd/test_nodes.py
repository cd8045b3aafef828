"""Prefill and decode nodes over real HTTP and a real KV transfer (tiny preset): outputs equal
the unified no-cache engine; turn t+1 reuses prompt_t from prefill's tiers and answer_t from
the pages decode wrote back to storage."""

from __future__ import annotations

import pytest

from pdcache.engine.api import GenerateRequest, SamplingParams
from pdcache.engine.config import CacheConfig, EngineConfig
from pdcache.engine.engine import Engine
from pdcache.engine.loader import load_model
from tests.pd_harness import MetadataService, node_setups, start_stack

PAGE = 4


@pytest.fixture(scope="module")
def tiny():
    return load_model("tiny", seed=0)


@pytest.fixture()
def metadata(tmp_path):
    service = MetadataService(tmp_path / "metadata")
    yield service.address
    service.stop()


def hf3fs_settings(tmp_path, metadata: str) -> dict:
    """hf3fs shared by P and D: one data directory, one metadata service (global KV manager)."""
    return {"path": str(tmp_path / "storage"), "capacity_pages": 4096, "metadata": metadata}


def unified_tokens(tiny, prompt: list[int], max_new_tokens: int) -> list[int]:
    model, tokenizer = tiny
    config = EngineConfig(model.config, CacheConfig(PAGE, 256, enable_prefix_cache=False))
    with Engine(config, model, tokenizer) as engine:
        params = SamplingParams(max_new_tokens=max_new_tokens, ignore_eos=True)
        outputs = engine.generate(GenerateRequest("ref", prompt, params), timeout=120)
    return [t for o in outputs for t in o.new_token_ids]


@pytest.mark.parametrize("engine", ["zmq", "mooncake"])
def test_two_turns_reuse_prompt_and_answer(tiny, tmp_path, metadata, engine) -> None:
    if engine == "mooncake":
        pytest.importorskip("mooncake.engine", reason="mooncake wheel not installed")
    prefill, decode = node_setups(tmp_path, tiny[0], PAGE, engine, offload=True,
                                  storage_settings=hf3fs_settings(tmp_path, metadata))
    stack = start_stack(prefill, decode)
    try:
        prompt = [(5 * i + 1) % 250 for i in range(30)]
        p1, d1 = stack.generate(prompt, 13)
        answer = d1["output_ids"]
        assert answer == unified_tokens(tiny, prompt, 13)
        assert p1["output_ids"] == answer[:1]
        assert d1["meta_info"]["prefill_node"] == "p0" and d1["meta_info"]["decode_node"] == "d0"
        assert stack.offload_idle()
        turn2 = prompt + answer + [9, 8, 7, 6, 5]
        p2, d2 = stack.generate(turn2, 6)
        assert d2["output_ids"] == unified_tokens(tiny, turn2, 6)
        details = d2["meta_info"]["cached_tokens_details"]
        kv_len = len(prompt) + len(answer) - 1  # the last answer token has no KV yet
        assert d2["meta_info"]["cached_tokens"] >= (kv_len // PAGE - 1) * PAGE
        assert details["storage_from_decode"] > 0
        assert d2["meta_info"]["computed_tokens"] <= len(turn2) - d2["meta_info"]["cached_tokens"]
        stack.prefill_server.engine.check_accounting()
        stack.decode_server.engine.check_accounting()
    finally:
        stack.close()
