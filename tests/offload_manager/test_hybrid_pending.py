"""A hybrid prefetch waits for an announced state object (docs/design.md §4.10 "States",
§4.14): the next turn's answer-end state is announced as pending (as decode's offload does)
but not stored yet. With `pending_wait` the request waits (not admitted) until the key
settles: LANDED, it restores that state (the deepest hit, exact tokens); GONE (the write
failed), it falls back to the deepest stored state (exact tokens, a shorter hit). Without
`pending_wait` it does not wait and takes the shorter hit at once.

The tiny Qwen3-Next checkpoint and driven engine of `tests/offload_manager/test_hybrid_tiers.py`
(page size 4, file storage, `wait_complete`).
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("transformers")

from pdcache.engine.api import (  # noqa: E402
    GenerateRequest,
    LogprobRequest,
    RequestOutput,
    SamplingParams,
)
from pdcache.offload_manager.builder import (  # noqa: E402
    TierConfig,
    TieredEngine,
    build_tiered_engine,
    fingerprint_for,
    storage_config_for,
)
from pdcache.offload_manager.hicache import HiCacheConfig  # noqa: E402
from pdcache.offload_manager.pending import PendingPages  # noqa: E402
from tests.offload_manager.test_hybrid_tiers import (  # noqa: E402
    PAGE,
    PROMPT,
    STEPS,
    assert_same,
    checkpoint,  # noqa: F401  (fixture)
    drop_memory_tiers,
    engine_config,
    generate,
    hybrid,  # noqa: F401  (fixture)
    idle_and_exact,
    reference,  # noqa: F401  (fixture)
    state_key_at,
)

WAIT_S = 0.5  # the request stays queued this long while its state is pending (reads: ms)


def tiered_with_pending(model: Any, path: Path, pending_wait: bool
                        ) -> tuple[TieredEngine, PendingPages]:
    pending = PendingPages()
    fingerprint = fingerprint_for(model.config, "qwen3-next-test", PAGE)
    storage = storage_config_for(model.config, PAGE, fingerprint, backend="file",
                                 path=str(path), capacity_pages=256)
    tiers = TierConfig(host_pages=64, storage=storage, hicache=HiCacheConfig(
        prefetch_policy="wait_complete", pending_wait=pending_wait))
    built = build_tiered_engine(engine_config(model), model, None, tiers, pending=pending)
    built.engine.start(thread=False)
    return built, pending


def stored_then_pending(built: TieredEngine, pending: PendingPages, key: bytes) -> torch.Tensor:
    """Take the stored state object `key` out of storage (its bytes returned) and announce it
    as being written, as decode's offload does before its write lands."""
    storage = built.storage
    assert storage is not None
    state = torch.zeros(built.hicache.host_states.slot_nbytes, dtype=torch.uint8)
    assert storage.get_state_into(key, state) is not None
    storage.delete_states([key])
    pending.pending([key], ttl_s=30.0)
    return state


def submit(built: TieredEngine, prompt: list[int], rid: str) -> list[RequestOutput]:
    outs: list[RequestOutput] = []
    built.engine.submit(GenerateRequest(
        rid=rid, input_ids=prompt,
        sampling=SamplingParams(max_new_tokens=STEPS, temperature=0.0, ignore_eos=True),
        logprobs=LogprobRequest()), outs.append)
    return outs


def finish(built: TieredEngine, outs: list[RequestOutput]
           ) -> tuple[list[int], list[float], RequestOutput]:
    while built.engine.step():
        pass
    assert outs and outs[-1].finished and outs[-1].error is None, outs[-1:]
    return ([t for o in outs for t in o.new_token_ids],
            [float(lp.logprob) for o in outs for lp in o.new_logprobs], outs[-1])


@pytest.mark.parametrize("lands", [True, False], ids=["landed", "gone"])
def test_the_prefetch_waits_for_an_announced_state(hybrid, reference, tmp_path,  # noqa: F811
                                                   lands: bool) -> None:
    built, pending = tiered_with_pending(hybrid, tmp_path / "store", pending_wait=True)
    try:
        answer = generate(built.engine, PROMPT, "t1")[0]
        turn2 = PROMPT + answer + [5, 9, 13, 17, 21]
        key = state_key_at(built, turn2[:32])  # the answer-end checkpoint
        idle_and_exact(built)
        state = stored_then_pending(built, pending, key)
        drop_memory_tiers(built)
        outs = submit(built, turn2, "t2")
        deadline = time.monotonic() + WAIT_S
        while time.monotonic() < deadline:
            built.engine.step()
            time.sleep(0.002)
        assert outs == [], "admitted while its announced state was still being written"
        if lands:
            assert built.storage is not None
            assert built.storage.put_state(key, state, tokens=32, origin="decode")
        pending.settled([key], [lands])
        got = finish(built, outs)
        assert_same(got, reference(turn2))
        assert got[2].cached.storage == (32 if lands else 28)  # else the prompt's checkpoint
        idle_and_exact(built)
        drop_memory_tiers(built)
    finally:
        built.close()


def test_without_pending_wait_the_shorter_hit_is_taken_at_once(hybrid, reference,  # noqa: F811
                                                               tmp_path) -> None:
    built, pending = tiered_with_pending(hybrid, tmp_path / "store", pending_wait=False)
    try:
        answer = generate(built.engine, PROMPT, "t1")[0]
        turn2 = PROMPT + answer + [5, 9, 13, 17, 21]
        key = state_key_at(built, turn2[:32])
        idle_and_exact(built)
        stored_then_pending(built, pending, key)
        drop_memory_tiers(built)
        got = generate(built.engine, turn2, "t2")  # never waits: the state is not read
        assert_same(got, reference(turn2))
        assert got[2].cached.storage == 28
        assert built.hicache.stats.pending_raced_pages == 0  # its pages were all stored
        idle_and_exact(built)
        drop_memory_tiers(built)
    finally:
        built.close()
