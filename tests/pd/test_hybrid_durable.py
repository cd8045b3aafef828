"""The durable next turn for a hybrid model (docs/design.md §4.10, §4.14): decode announces the
answer-end state object it will write with the answer's pages, and the next turn's prefill
waits for both under its prefetch policy. Decode's store is slow (`write_delay_s` on every page
write, the state queued behind the pages on the same writer) and the next turn is sent the
moment the answer arrives, so its lookup always meets the answer's pages and state still being
written. With `pending_wait` it restores the state decode wrote and decodes the reference's
tokens; without it the answer is recomputed (same tokens, nothing from decode).

Tiny Qwen3-Next checkpoint of `tests/pd/test_hybrid_pd.py` (page size 4), hf3fs slots shared
through the metadata service.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("transformers")

from tests.pd.test_hybrid_pd import (  # noqa: E402
    MESSAGE,
    PAGE,
    PROMPT,
    assert_idle,
    checkpoint,  # noqa: F401  (fixture)
    hybrid,  # noqa: F401  (fixture)
    reference,  # noqa: F401  (fixture)
    setups,
    start,
)
from tests.pd_harness import MetadataService, metric_value, page_floor  # noqa: E402

ANSWER = 12
WRITE_DELAY_S = 1.0  # per page write of decode's: its batch and the state land >= 1 s late


def next_turn_without_waiting(tmp_path: Path, loaded: Any, greedy: Any,
                              pending_wait: bool) -> tuple[dict, dict, str]:
    """Turn 1, then turn 2 at once (decode still writing turn 1's answer and state): turn 2's
    meta_info, prefill's HiCache stats and metrics."""
    service = MetadataService(tmp_path / "metadata")
    prefill, decode = setups(tmp_path, loaded[0], offload=True, metadata=service.address)
    assert prefill.tiers is not None and decode.storage is not None
    hicache = dataclasses.replace(prefill.tiers.hicache, pending_wait=pending_wait)
    prefill = dataclasses.replace(prefill, tiers=dataclasses.replace(prefill.tiers,
                                                                     hicache=hicache))
    decode = dataclasses.replace(decode,
                                 storage=decode.storage.replace(write_delay_s=WRITE_DELAY_S))
    stack = start(prefill, decode, loaded)
    try:
        _, first = stack.generate(PROMPT, ANSWER)
        answer = first["output_ids"]
        assert answer == greedy(PROMPT, ANSWER)
        prompt = PROMPT + answer + MESSAGE
        offload = stack.decode_server_app.state.offload
        assert not offload.idle, "decode's writes ended before the next turn: no race"
        _, second = stack.generate(prompt, ANSWER)
        assert second["output_ids"] == greedy(prompt, ANSWER)
        assert stack.offload_idle(30)
        assert offload.snapshot()["states_offloaded"] == 2
        stats = stack.prefill_server.tiered.hicache.snapshot()
        metrics = stack.client.get(f"{stack.prefill.url}/metrics").text
        assert_idle(stack)
        return second["meta_info"], stats, metrics
    finally:
        stack.close()
        service.stop()


def pending(metrics: str, outcome: str) -> float:
    return metric_value(metrics, "pdcache_pending_pages_total", server="p0", outcome=outcome)


def test_the_next_turn_waits_for_the_answer_end_state(hybrid, reference, tmp_path) -> None:  # noqa: F811
    meta, stats, metrics = next_turn_without_waiting(tmp_path, hybrid, reference, True)
    # the state after the answer's last full page: every page up to it from storage, the
    # answer's pages as decode wrote them
    answer_end = page_floor(len(PROMPT) + ANSWER - 1, PAGE)
    assert meta["cached_tokens"] == answer_end, meta
    details = meta["cached_tokens_details"]
    assert details["storage_from_decode"] >= answer_end - page_floor(len(PROMPT), PAGE), meta
    assert stats["prefetch_states"] == 1 and stats["load_storage_states"] == 1, stats
    assert pending(metrics, "found") > 0 and pending(metrics, "raced") == 0
    assert pending(metrics, "waited") + pending(metrics, "pulled") == pending(metrics, "found")


def test_without_the_wait_the_answer_is_recomputed(hybrid, reference, tmp_path) -> None:  # noqa: F811
    meta, _, metrics = next_turn_without_waiting(tmp_path, hybrid, reference, False)
    assert meta["cached_tokens_details"]["storage_from_decode"] == 0, meta
    assert meta["cached_tokens"] <= page_floor(len(PROMPT), PAGE), meta
    assert pending(metrics, "found") > 0 and pending(metrics, "raced") > 0
    assert pending(metrics, "waited") == 0
