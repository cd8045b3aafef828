"""Prefetch restarts (`HiCacheConfig.prefetch_restarts`, topology key `[cache]
prefetch_restarts`) in the real engine, tiny preset, a 40-page prompt whose pages storage holds:
a request queues with pages 0..9 on device, so its prefetch reads pages 10..39; before its
admission the device and host tiers lose pages 0..9 (what tier pressure does to a waiting
request). With a restart the prefetch starts again at page 0 and every prompt page is a
storage hit; with restarts off (0) the prefetched pages no longer continue the match and the
whole prompt is recomputed; under `wait_complete` and `timeout` alike. Under `timeout`, a read
still running at its deadline is not read again (restarts would only add reads to a store
that slow). Every run gives the no-cache run's tokens; every tier's accounting holds.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator, Sequence
from typing import Any

import pytest

from pdcache.engine.api import GenerateRequest
from pdcache.offload_manager.builder import TierConfig, build_tiered_engine
from pdcache.offload_manager.hicache import HiCacheConfig
from pdcache.offload_manager.storage import BACKENDS
from pdcache.offload_manager.storage.file import FileBackend
from tests.hicache_support import (
    PAGE,
    PARAMS,
    check_every_tier,
    engine_config,
    generate,
    reference_tokens,
    run_to_end,
    storage_config,
    tiered,
)
from tests.polling import wait_until

PROMPT = [(11 * i + 7) % 250 for i in range(161)]  # 40 full pages + 1 token
PAGES = 40
ON_DEVICE = 10  # pages the request finds on device when it queues
GATED = "gated-reads"


class GatedReads(FileBackend):
    """File storage whose page reads wait at `gate` (bounded) while `hold` is set, telling
    `held` they got there."""

    def __init__(self, config: Any) -> None:
        super().__init__(config)
        self.hold = False
        self.gate = threading.Event()
        self.held = threading.Event()

    def get_into(self, keys: Sequence[bytes], host_pages: Sequence[Any],
                 origins: list[str | None] | None = None) -> list[bool]:
        if self.hold:
            self.held.set()
            assert self.gate.wait(30), "the test never opened the gate"
        return super().get_into(keys, host_pages, origins)


@pytest.fixture
def gated() -> Iterator[str]:
    BACKENDS.register(GATED, f"{__name__}:GatedReads")
    try:
        yield GATED
    finally:
        BACKENDS.unregister(GATED)


@pytest.fixture(scope="module")
def expected(tiny) -> list[int]:
    return reference_tokens(tiny, PROMPT)


def _seeded(tiny, tmp_path):
    """Storage holding PROMPT's pages, written through by an engine that computed them."""
    cfg = storage_config(tiny[0], backend="file", path=str(tmp_path / "store"))
    seeder = tiered(tiny, cfg)
    try:
        generate(seeder.engine, "seed", PROMPT)
        assert seeder.hicache.wait_idle(20)
    finally:
        seeder.close()
    return cfg


def _driven(tiny, storage, restarts: int, policy: str = "wait_complete", host_pages: int = 64,
            **timeouts: float):
    """An engine the test drives with `engine.step()`, reading storage page by page;
    write-back, so nothing new is written."""
    model, tokenizer = tiny
    hicache = HiCacheConfig(prefetch_policy=policy, write_policy="write_back",
                            prefetch_restarts=restarts, **timeouts)
    built = build_tiered_engine(engine_config(model), model, tokenizer,
                                TierConfig(host_pages, hicache, storage))
    built.engine.start(thread=False)
    return built


def _queue_then_shrink_its_match(built, backend: GatedReads, rid: str) -> list:
    """Serve PROMPT's first ON_DEVICE pages (they stay on device), hold storage reads, queue
    `rid` with PROMPT (its prefetch reads pages 10..39, held), then drop pages 0..9 from device
    and host. Returns `rid`'s outputs (the gate is still closed)."""
    first: list = []
    built.engine.submit(GenerateRequest("first", PROMPT[: ON_DEVICE * PAGE + 1], PARAMS),
                        first.append)
    run_to_end(built)
    assert first[-1].finished and built.hicache.wait_idle(20)
    backend.hold = True
    outputs: list = []
    built.engine.submit(GenerateRequest(rid, PROMPT, PARAMS), outputs.append)
    assert built.engine.step()  # queued
    assert built.hicache.prefetch_first_page(rid) == ON_DEVICE
    assert backend.held.wait(20)
    built.engine.scheduler.tiers.drop()
    return outputs


@pytest.mark.parametrize("restarts", [1, 0])
@pytest.mark.parametrize("policy", ["wait_complete", "timeout"])
def test_prefetch_restarts_when_the_match_shrinks_before_admission(
        tiny, expected, tmp_path, gated, restarts: int, policy: str) -> None:
    cfg = _seeded(tiny, tmp_path)
    built = _driven(tiny, cfg.replace(backend=gated), restarts, policy)
    backend = built.storage
    assert isinstance(backend, GatedReads)
    try:
        outputs = _queue_then_shrink_its_match(built, backend, "moved")
        backend.gate.set()
        wait_until(lambda: built.hicache.prefetch_ready("moved"))
        assert built.engine.step()
        waiting = [r.rid for r in built.engine.scheduler.waiting]
        if restarts:  # read again from page 0: it waits for that read, not admitted yet
            assert waiting == ["moved"] and built.hicache.prefetch_first_page("moved") == 0
        else:
            assert waiting == []
        run_to_end(built)
        out = outputs[-1]
        assert out.finished and [t for o in outputs for t in o.new_token_ids] == expected
        assert built.hicache.stats.prefetch_restarts == restarts
        if restarts:
            assert (out.cached.device, out.cached.host, out.cached.storage) == (0, 0, PAGES * PAGE)
        else:  # pages 10..39 were read but no longer continue the match: all recomputed
            assert out.cached.total == 0
        check_every_tier(built)  # host pool too: free + used == capacity, nothing in flight
    finally:
        backend.gate.set()
        built.close()


def test_a_read_still_running_at_its_deadline_is_not_restarted(tiny, expected, tmp_path,
                                                               gated) -> None:
    """Under `timeout`, a prefetch whose read has not ended by its deadline is not read again
    when the match shrank (storage that slow gains nothing from a second read): the request is
    admitted at the deadline and recomputes, exact, no restart counted."""
    cfg = _seeded(tiny, tmp_path)
    # host room for a second read beside the held one: only the deadline rule stops a restart
    built = _driven(tiny, cfg.replace(backend=gated), 1, "timeout", host_pages=128,
                    prefetch_timeout_base_s=0.5, prefetch_timeout_per_1k_tokens_s=0.0)
    backend = built.storage
    assert isinstance(backend, GatedReads)
    try:
        outputs = _queue_then_shrink_its_match(built, backend, "slow")
        wait_until(lambda: built.hicache.prefetch_ready("slow"))  # the deadline, read still held
        assert built.engine.step()
        assert [r.rid for r in built.engine.scheduler.waiting] == []  # admitted, not restarted
        backend.gate.set()
        run_to_end(built)
        assert [t for o in outputs for t in o.new_token_ids] == expected
        assert outputs[-1].cached.total == 0 and built.hicache.stats.prefetch_restarts == 0
        check_every_tier(built)
    finally:
        backend.gate.set()
        built.close()


@pytest.mark.parametrize("restarts", [1, 0])
def test_a_prefetch_makes_host_room_without_evicting_the_match_it_continues(
        tiny, expected, tmp_path, restarts: int) -> None:
    """The request's first 10 pages are on host only, the least recently used there, and the
    host pool is nearly full; its prefetch of pages 10..39 evicts host copies for room — the
    other prompt's, never its own match (those went first: the match shrank before
    admission, so the whole prompt was read again with a restart, recomputed without one)."""
    cfg = _seeded(tiny, tmp_path)
    other = [(13 * i + 5) % 250 for i in range(35 * PAGE + 1)]
    # write-through: 12 + 37 pages (prompts and answers) on host, 1 free
    built = tiered(tiny, cfg, host_pages=50, write_policy="write_through",
                   prefetch_policy="wait_complete", prefetch_restarts=restarts)
    try:
        generate(built.engine, "first", PROMPT[: ON_DEVICE * PAGE + 1])
        generate(built.engine, "other", other)
        assert built.hicache.wait_idle(20)
        assert built.engine.flush_cache() > 0  # device copies only: host keeps them
        assert built.hicache.host_pool.num_free < PAGES - ON_DEVICE  # the read must evict
        tokens, out = generate(built.engine, "back", PROMPT)
        assert tokens == expected
        assert (out.cached.device, out.cached.host, out.cached.storage) == (
            0, ON_DEVICE * PAGE, (PAGES - ON_DEVICE) * PAGE)
        assert built.hicache.stats.prefetch_restarts == 0
        check_every_tier(built)
    finally:
        built.close()
