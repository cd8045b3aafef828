"""DecodeOffloadManager on a local 1 prefill + 1 decode stack (tiny preset, hf3fs storage shared
through the metadata service, mooncake transfer): a 5-turn greedy session equals the unified
no-cache run, turn t+1 reuses prompt_t and the answer_t pages decode wrote back, offload off
recomputes the answer, write_back prefill still gets the answer's chain from decode, metrics
and accounting."""

from __future__ import annotations

import pytest

from pdcache.engine.page_keys import chain_page_keys, make_salt
from pdcache.offload_manager.storage import create_backend
from tests.pd_harness import (
    MetadataService,
    UnifiedReference,
    assert_answers_reused,
    assert_stack_idle,
    metric_value,
    node_setups,
    page_floor,
    run_session,
    start_stack,
)

pytest.importorskip("mooncake.engine", reason="mooncake wheel not installed")

PAGE = 4
ANSWER = 16  # 4 pages per answer
FIRST = [(7 * i + 3) % 250 for i in range(30)]
MESSAGES = [[(11 * t + j) % 250 + 1 for j in range(5)] for t in range(4)]


@pytest.fixture(scope="module", autouse=True)
def mooncake_env():
    mp = pytest.MonkeyPatch()
    mp.setenv("MC_TCP_BIND_ADDRESS", "127.0.0.1")
    mp.setenv("MC_LOG_LEVEL", "ERROR")
    yield
    mp.undo()


@pytest.fixture(scope="module")
def reference(tiny):
    ref = UnifiedReference(*tiny, PAGE)
    yield ref
    ref.close()


@pytest.fixture()
def stack_factory(tiny, tmp_path):
    """Starts P+D on hf3fs storage shared through a metadata service; stops all at the end."""
    service = MetadataService(tmp_path / "metadata")
    stacks = []

    def start(offload: bool = True, write_policy: str = "write_through"):
        settings = {"path": str(tmp_path / "storage"), "capacity_pages": 4096,
                    "metadata": service.address}
        prefill, decode = node_setups(tmp_path, tiny[0], PAGE, "mooncake", offload=offload,
                                      write_policy=write_policy, storage_settings=settings)
        stacks.append(start_stack(prefill, decode))
        return stacks[-1], decode.storage

    yield start
    for stack in stacks:
        stack.close()
    service.stop()


def test_five_turn_session_reuses_decode_written_answers(stack_factory, reference) -> None:
    stack, _ = stack_factory(offload=True)
    turns = run_session(stack, FIRST, MESSAGES, ANSWER, reference)
    assert len(turns) == 5
    assert_answers_reused(turns, MESSAGES, PAGE)
    offload = stack.decode_server_app.state.offload
    snap = offload.snapshot()
    assert snap["pages_offloaded"] >= 4 * 4  # at least every answer's pages
    assert snap["pages_skipped"] > 0  # prefill's write-through pages are not rewritten
    assert snap["pages_dropped"] == snap["pages_failed"] == 0
    assert_stack_idle(stack)
    d_metrics = stack.client.get(f"{stack.decode.url}/metrics").text
    p_metrics = stack.client.get(f"{stack.prefill.url}/metrics").text
    server = {"server": "d0"}
    assert metric_value(d_metrics, "pdcache_decode_offload_pages_offloaded_total",
                        **server) == snap["pages_offloaded"]
    assert metric_value(d_metrics, "pdcache_decode_offload_pages_skipped_total",
                        **server) == snap["pages_skipped"]
    assert metric_value(d_metrics, "pdcache_decode_offload_pages_dropped_total", **server) == 0
    assert metric_value(d_metrics, "pdcache_decode_offload_write_latency_seconds_count",
                        **server) == snap["writes"] > 0
    assert metric_value(d_metrics, "pdcache_decode_offload_staging_pages_used", **server) == 0
    from_decode = sum(t.meta["cached_tokens_details"]["storage_from_decode"] for t in turns)
    assert metric_value(p_metrics, "pdcache_cached_tokens_total",
                        tier="storage_from_decode") == from_decode > 0


def test_offload_off_recomputes_the_answer(stack_factory, reference) -> None:
    stack, _ = stack_factory(offload=False)
    assert stack.decode_server_app.state.offload is None
    turns = run_session(stack, FIRST, MESSAGES[:1], ANSWER, reference)
    prev, turn = turns
    meta = turn.meta
    assert meta["cached_tokens_details"]["storage_from_decode"] == 0
    assert meta["cached_tokens"] <= len(prev.prompt)
    assert meta["computed_tokens"] >= len(prev.answer), meta
    assert_stack_idle(stack)


def test_write_back_prefill_decode_fills_the_chain(stack_factory, reference, tiny) -> None:
    stack, storage_config = stack_factory(offload=True, write_policy="write_back")
    turns = run_session(stack, FIRST, MESSAGES[:1], ANSWER, reference)
    first, second = turns
    # prefill wrote nothing (write_back, no eviction): every stored page of turn 1's chain,
    # prompt pages included, was written by decode
    kv_tokens = (first.prompt + first.answer)[:-1]
    keys = chain_page_keys(kv_tokens, PAGE, make_salt(storage_config.fingerprint, ""))
    backend = create_backend(storage_config)
    try:
        assert backend.exists_prefix(keys) == len(keys)
        import torch

        scratch = torch.empty(len(keys), storage_config.page_bytes, dtype=torch.uint8)
        origins: list[str | None] = []
        assert all(backend.get_into(keys, list(scratch), origins=origins))
        assert origins == ["decode"] * len(keys)
    finally:
        backend.close()
    meta = second.meta
    assert meta["cached_tokens"] >= page_floor(len(kv_tokens) + 1, PAGE) - PAGE, meta
    answer_part = meta["cached_tokens"] - page_floor(len(first.prompt), PAGE)
    assert meta["cached_tokens_details"]["storage_from_decode"] >= answer_part > 0, meta
    assert_stack_idle(stack)
