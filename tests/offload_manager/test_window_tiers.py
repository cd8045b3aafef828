"""Window pages on HiCache's host and storage tiers (docs/design.md §4.14): a gpt-oss-style
model (alternating sliding and full layers) keeps only its windows on device while its host
and stored pages carry the full layers only; a node end whose window tail is on device when
its pages are backed up gets a host tail slot (then a stored object under `window_page_key`),
and a lower-tier hit is served only where its tail comes back with it.

The tiny gpt-oss checkpoint of `tests/engine/test_gpt_oss.py` (transformers, fp32, window 8,
pages of 4 tokens): tokens and logprobs are compared with transformers'.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")

from pdcache.engine.api import (  # noqa: E402
    GenerateRequest,
    LogprobRequest,
    RequestOutput,
    SamplingParams,
)
from pdcache.engine.config import CacheConfig, EngineConfig  # noqa: E402
from pdcache.engine.engine import Engine  # noqa: E402
from pdcache.engine.loader import load_model  # noqa: E402
from pdcache.engine.scheduler_config import SchedulerConfig  # noqa: E402
from pdcache.engine.window_pages import WindowTailGeometry  # noqa: E402
from pdcache.offload_manager.builder import (  # noqa: E402
    TierConfig,
    TieredEngine,
    build_tiered_engine,
    fingerprint_for,
    storage_config_for,
)
from pdcache.offload_manager.hicache import HiCacheConfig  # noqa: E402
from tests.engine.test_gpt_oss import PAGE, WINDOW, prompt_of, save_gpt_oss  # noqa: E402
from tests.engine.test_sliding_window_pages import hf_greedy  # noqa: E402

STEPS = 6
PROMPT = prompt_of(41, 30)  # 7 full pages + 2 tokens
LOGPROB_ATOL = 2e-4
TAIL_PAGES = -(-(WINDOW - 1) // PAGE)  # the sliding pages a hit at a page boundary reads


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, torch.nn.Module]:
    path = tmp_path_factory.mktemp("gpt-oss-window-tiers")
    return path, save_gpt_oss(path, seed=13)


@pytest.fixture(scope="module")
def model(checkpoint) -> torch.nn.Module:
    return load_model(str(checkpoint[0]))[0]


@pytest.fixture(scope="module")
def expected(checkpoint):
    """transformers' greedy tokens and logprobs, by prompt."""
    memo: dict[tuple[int, ...], tuple[list[int], list[float]]] = {}

    def run(prompt: list[int]) -> tuple[list[int], list[float]]:
        if tuple(prompt) not in memo:
            memo[tuple(prompt)] = hf_greedy(checkpoint[1], prompt, STEPS)
        return memo[tuple(prompt)]

    return run


def tiered(model: torch.nn.Module, path: Path, backend: str | None = "file",
           window_pages: bool = True, host_state_slots: int = 16,
           **hicache: str) -> TieredEngine:
    """A driven engine over HiCache with window pages: host tier, a `backend` store."""
    fingerprint = fingerprint_for(model.config, "gpt-oss-test", PAGE, window_pages)
    storage = None if backend is None else storage_config_for(
        model.config, PAGE, fingerprint, window_pages, backend=backend, path=str(path),
        capacity_pages=256)
    config = EngineConfig(
        model=model.config,
        cache=CacheConfig(page_size=PAGE, num_device_pages=96),
        scheduler=SchedulerConfig(chunked_prefill_tokens=2048, max_running_requests=4),
        kernels="torch",
    )
    tiers = TierConfig(host_pages=64, storage=storage, host_state_slots=host_state_slots,
                       hicache=HiCacheConfig(prefetch_policy="wait_complete", **hicache))
    built = build_tiered_engine(config, model, None, tiers, window_pages=window_pages)
    built.engine.start(thread=False)
    return built


def generate(engine: Engine, prompt: list[int],
             rid: str) -> tuple[list[int], list[float], RequestOutput]:
    outs: list[RequestOutput] = []
    engine.submit(GenerateRequest(
        rid=rid, input_ids=prompt,
        sampling=SamplingParams(max_new_tokens=STEPS, temperature=0.0, ignore_eos=True),
        logprobs=LogprobRequest()), outs.append)
    while engine.step():
        pass
    assert outs and outs[-1].finished and outs[-1].error is None, outs[-1:]
    tokens = [t for out in outs for t in out.new_token_ids]
    logprobs = [float(lp.logprob) for out in outs for lp in out.new_logprobs]
    return tokens, logprobs, outs[-1]


def assert_same(got: tuple[list[int], list[float], RequestOutput],
                want: tuple[list[int], list[float]]) -> None:
    assert got[0] == want[0]
    torch.testing.assert_close(torch.tensor(got[1]), torch.tensor(want[1]),
                               atol=LOGPROB_ATOL, rtol=0)


def idle_and_exact(built: TieredEngine) -> dict[str, int]:
    """Storage writes ended; every sliding page and host tail slot accounted for."""
    hicache = built.hicache
    assert hicache.wait_idle(10)
    numbers = built.engine.check_accounting()
    assert numbers["window_requests"] == 0, numbers
    hicache.check()
    assert hicache.host_states_untracked() == 0
    return numbers


def test_cold_then_host_hit_is_exact(model, expected, tmp_path) -> None:
    built = tiered(model, tmp_path / "store", backend=None)
    try:
        engine = built.engine
        assert engine.window is not None
        # the device pool and the host pages hold the full layers only
        assert engine.pool.device_kv.shape[0] == 2
        assert built.hicache.host_pool.host_kv.shape[1] == 2
        cold = generate(engine, PROMPT, "a")
        assert_same(cold, expected(PROMPT))
        idle_and_exact(built)
        stats = built.hicache.stats
        # write_through: the prompt's tail (28 tokens) and the answer's (32) reached host
        assert stats.backup_host_states == 2
        tail_bytes = built.hicache.host_states.slot_nbytes
        assert tail_bytes == TAIL_PAGES * engine.window.sliding_geometry.page_bytes(PAGE)
        assert engine.flush_cache() > 0  # device evicted, host copies stay
        assert engine.window.allocator.num_used == 0
        warm = generate(engine, PROMPT, "b")
        assert_same(warm, expected(PROMPT))
        assert (warm[2].cached.device, warm[2].cached.host) == (0, 28)
        assert stats.load_host_states == 1 and stats.load_state_bytes == tail_bytes
        idle_and_exact(built)
        # the restored node got its tail back on device: a third run hits the device
        third = generate(engine, PROMPT, "c")
        assert_same(third, expected(PROMPT))
        assert third[2].cached.device == 28
        idle_and_exact(built)
    finally:
        built.close()


def drop_memory_tiers(built: TieredEngine) -> None:
    """Device and host tiers emptied (storage untouched): every sliding page and host tail
    slot is free again."""
    assert built.hicache.wait_idle(10)
    assert built.engine.drop_cache().flushed
    numbers = built.engine.check_accounting()
    assert numbers["window_free"] == numbers["window_capacity"], numbers
    assert built.hicache.host_states is not None and built.hicache.host_states.num_used == 0


@pytest.mark.parametrize("backend", ["file", "hf3fs"])
def test_storage_hits_and_next_turn_are_exact(model, expected, tmp_path, backend) -> None:
    """A prompt's tail object serves a storage hit at its last full page; a second turn
    extending the first's answer hits the answer's tail (32 tokens) from storage."""
    built = tiered(model, tmp_path / backend, backend)
    try:
        answer = generate(built.engine, PROMPT, "t1")[0]
        idle_and_exact(built)
        drop_memory_tiers(built)
        again = generate(built.engine, PROMPT, "t1-again")
        assert_same(again, expected(PROMPT))
        assert again[2].cached.storage == 28
        idle_and_exact(built)
        drop_memory_tiers(built)
        turn2 = PROMPT + answer + prompt_of(7, 5)
        second = generate(built.engine, turn2, "t2")
        assert_same(second, expected(turn2))
        assert second[2].cached.storage == 32
        stats = built.hicache.stats
        assert stats.prefetch_states == stats.load_storage_states == 2
        idle_and_exact(built)
        storage = built.storage.stats()
        tail_bytes = built.hicache.host_states.slot_nbytes
        assert storage["state_bytes_written"] == storage["states_written"] * tail_bytes
        assert stats.prefetch_state_bytes == 2 * tail_bytes
    finally:
        built.close()


def test_a_prompt_diverging_inside_a_window_gets_the_longest_exact_hit(
        model, expected, tmp_path) -> None:
    """From host, a hit ends only at a node end carrying its tail: a prompt diverging at
    token 26 (inside the 28-token node) gets no host hit, one diverging at token 31 (after
    the answer's first token) the prompt's 28; both exact."""
    built = tiered(model, tmp_path / "store", backend=None)
    try:
        answer = generate(built.engine, PROMPT, "a")[0]
        for rid, prompt, hit in (("mid-prompt", PROMPT[:26] + prompt_of(3, 6), 0),
                                 ("mid-answer", PROMPT + answer[:1] + prompt_of(5, 8), 28)):
            assert built.hicache.wait_idle(10)
            built.engine.flush_cache()
            got = generate(built.engine, prompt, rid)
            assert_same(got, expected(prompt))
            assert (got[2].cached.device, got[2].cached.host) == (0, hit)
            idle_and_exact(built)
    finally:
        built.close()


def test_a_host_hit_without_its_tail_gives_other_logits(model, expected, tmp_path,
                                                        monkeypatch) -> None:
    """Shown off: the same host hit served with its tail pages left unwritten (the
    protection: `WindowTails.restore`) reads stale sliding pages and gives other logits."""
    from pdcache.engine.window_pages import WindowTails

    built = tiered(model, tmp_path / "store", backend=None)
    try:
        generate(built.engine, PROMPT, "a")
        generate(built.engine, prompt_of(9, 40), "other")  # sliding pages full of its K/V
        assert built.hicache.wait_idle(10)
        built.engine.flush_cache()
        monkeypatch.setattr(WindowTails, "restore", lambda *args: None)
        tokens, logprobs, last = generate(built.engine, PROMPT, "b")
        assert last.cached.host == 28
        want_tokens, want_logprobs = expected(PROMPT)
        gap = (torch.tensor(logprobs) - torch.tensor(want_logprobs)).abs().max()
        assert tokens != want_tokens or gap > 1e-2, gap
    finally:
        built.close()


@pytest.mark.parametrize("write_policy,host_mode", [("write_back", "inclusive"),
                                                     ("write_through", "exclusive")])
def test_tails_freed_exactly_once_on_every_tier(model, expected, tmp_path, write_policy,
                                                host_mode) -> None:
    """write_back (tails backed up at device eviction) and an exclusive host (host copies
    and their tails released once loaded): three conversations through a 3-slot host tail
    pool; every sliding page, host page and host tail slot is accounted for after each."""
    built = tiered(model, tmp_path / "store", backend=None, host_state_slots=3,
                   write_policy=write_policy, host_mode=host_mode)
    try:
        prompts = [PROMPT, prompt_of(21, 26), PROMPT[:20] + prompt_of(22, 9)]
        for round_, order in enumerate((prompts, prompts[::-1])):  # newest tails first
            for index, prompt in enumerate(order):
                got = generate(built.engine, prompt, f"{round_}-{index}")
                assert_same(got, expected(prompt))
                idle_and_exact(built)
                built.engine.flush_cache()
                idle_and_exact(built)
        stats = built.hicache.stats
        assert stats.load_host_states > 0
        assert built.hicache.tree.num_host_evicted_states > 0  # 3 slots: tails gave way
        drop_memory_tiers(built)
    finally:
        built.close()


def stored_bytes(built: TieredEngine) -> tuple[int, int]:
    """(full-layer KV bytes, window tail bytes) HiCache wrote to storage."""
    assert built.hicache.wait_idle(10)
    stats = built.hicache.stats
    return stats.backup_storage_kv_bytes, stats.backup_storage_state_bytes


def test_storage_holds_full_layer_pages_plus_tails(model, expected, tmp_path) -> None:
    """Two turns stored with window pages against the one-space format (every layer of
    every page): pages carry the full layers only (half of gpt-oss's layers), plus one
    tail object per checkpointed node end; both formats answer the same."""
    per_format: dict[bool, list[tuple[int, int]]] = {}
    for window_pages in (False, True):
        built = tiered(model, tmp_path / f"store-{window_pages}", window_pages=window_pages)
        try:
            answer = generate(built.engine, PROMPT, "t1")[0]
            turns = [stored_bytes(built)]
            turn2 = PROMPT + answer + prompt_of(7, 5)
            assert_same(generate(built.engine, turn2, "t2"), expected(turn2))
            turns.append(stored_bytes(built))
            per_format[window_pages] = turns
        finally:
            built.close()
    one_space, split = per_format[False], per_format[True]
    page_bytes = model.config.kv_geometry.page_bytes(PAGE)
    tail_bytes = TAIL_PAGES * page_bytes // 2  # the sliding half of the layers
    # turn 1: 8 pages (32 of its 35 K/V tokens), tails at 28 and 32; turn 2 (a 41-token
    # prompt, 46 K/V tokens): 3 more pages, tails at 40 and 44
    print(f"stored bytes after each turn (KV, tails): one space {one_space}, split {split}")
    assert one_space == [(8 * page_bytes, 0), (11 * page_bytes, 0)]
    assert split == [(8 * page_bytes // 2, 2 * tail_bytes),
                     (11 * page_bytes // 2, 4 * tail_bytes)]
    assert sum(split[1]) < one_space[1][0]


@pytest.mark.parametrize("protected", [True, False])
def test_a_branch_point_gets_its_tail_for_the_next_request(model, expected, tmp_path,
                                                           monkeypatch, protected) -> None:
    """The second of two prompts sharing 20 tokens stops its prefill where its page match
    went deeper than its hit (the window cut it) and caches its pages there, so the branch
    point ends a node whose tail is backed up: a third prompt with that prefix, after the
    device was flushed, hits it from host. Shown off: without the stop, no tail at 20 and
    no host hit."""
    if not protected:
        from pdcache.engine.scheduler import Scheduler

        monkeypatch.setattr(Scheduler, "_window_branch_point", lambda self, req, match: [])
    built = tiered(model, tmp_path / "store", backend=None)
    try:
        shared = PROMPT[:20]
        for rid, tail_seed in (("first", 31), ("second", 32)):
            prompt = shared + prompt_of(tail_seed, 10)
            assert_same(generate(built.engine, prompt, rid), expected(prompt))
        assert built.hicache.wait_idle(10)
        built.engine.flush_cache()
        third = shared + prompt_of(33, 10)
        got = generate(built.engine, third, "third")
        assert_same(got, expected(third))
        assert got[2].cached.host == (20 if protected else 0)
        idle_and_exact(built)
    finally:
        built.close()


def test_a_host_hit_without_a_tail_at_its_end_is_never_served(model, tmp_path,
                                                                monkeypatch) -> None:
    """Shown off: without the host continuation's cut to a node end carrying a tail
    (`_cut_to_host_checkpoint`), the prompt diverging at token 26 would be served 24 host
    tokens with no tail to restore: its admission fails instead of guessing."""
    from pdcache.offload_manager.hiradix import HiRadixTree

    built = tiered(model, tmp_path / "store", backend=None)
    try:
        generate(built.engine, PROMPT, "a")
        assert built.hicache.wait_idle(10)
        built.engine.flush_cache()
        monkeypatch.setattr(HiRadixTree, "_cut_to_host_checkpoint", lambda self, match: None)
        with pytest.raises(AssertionError, match="host hit, no tail"):
            generate(built.engine, PROMPT[:26] + prompt_of(3, 6), "mid-prompt")
    finally:
        built.close()


def submit(engine: Engine, prompt: list[int], rid: str, steps: int) -> list[RequestOutput]:
    """`prompt` queued for `steps` greedy tokens; the engine is stepped by the caller."""
    outs: list[RequestOutput] = []
    engine.submit(GenerateRequest(
        rid=rid, input_ids=prompt,
        sampling=SamplingParams(max_new_tokens=steps, temperature=0.0, ignore_eos=True),
        logprobs=LogprobRequest()), outs.append)
    return outs


def tokens_of(outs: list[RequestOutput]) -> list[int]:
    assert outs and outs[-1].finished and outs[-1].error is None, outs[-1:]
    return [t for out in outs for t in out.new_token_ids]


def drain(engine: Engine) -> None:
    while engine.step():
        pass


def test_a_host_hit_restoring_several_nodes_keeps_window_ids_in_line(
        model, checkpoint, tmp_path) -> None:
    """A host hit restores two nodes, the tail only in the second: the first gets a window
    list of tombstones, so a later device hit through both has one window id per page (a
    short list shifted the tail's sliding pages and wedged admission)."""
    built = tiered(model, tmp_path / "store", backend=None)
    try:
        engine = built.engine
        outs = submit(engine, PROMPT, "a", 12)
        drain(engine)
        answer = tokens_of(outs)
        assert built.hicache.wait_idle(10)
        engine.flush_cache()
        base = PROMPT + answer[:11]  # 10 full pages: nodes [0, 28) and [28, 40) on host
        first = submit(engine, base + prompt_of(7, 2), "r1", 1)
        drain(engine)
        assert tokens_of(first) and first[-1].cached.host == 40
        match = engine.tree.match_pages(base)
        assert len(match.page_ids) == 10
        assert len(match.window_page_ids) == len(match.page_ids)
        assert match.window_page_ids[-TAIL_PAGES:] != [None] * TAIL_PAGES
        engine.check_accounting()
        prompt = base + prompt_of(8, 2)
        second = submit(engine, prompt, "r2", STEPS)
        drain(engine)
        assert tokens_of(second) == hf_greedy(checkpoint[1], prompt, STEPS)[0]
        assert second[-1].cached.device == 40
        idle_and_exact(built)
    finally:
        built.close()


def test_taking_a_tails_pages_never_frees_the_admitted_match(model, checkpoint,
                                                             tmp_path) -> None:
    """A host-continuable admission takes a tail's sliding pages first; short of them the
    scheduler reclaims tree sliding pages, but never the admitting request's device match:
    here the allocation fails (`got is None`) and the request runs on its device hit, whose
    sliding pages must still be its own."""
    built = tiered(model, tmp_path / "store", backend=None)
    try:
        engine = built.engine
        alloc = engine.window.allocator
        outs = submit(engine, PROMPT, "a", STEPS)
        drain(engine)
        answer = tokens_of(outs)
        assert built.hicache.wait_idle(10)
        assert engine.tree.evict(1)  # the answer's node [28, 32) leaves device (host stays)
        # a running request locks [0, 28): its tail is reclaimable as far as `keep` knows
        other = PROMPT[:28] + prompt_of(5, 2)
        other_outs = submit(engine, other, "r0", 20)
        while engine.scheduler.find("r0") is None or engine.scheduler.find("r0").kv_len < 33:
            assert engine.step()
        busy = alloc.alloc(alloc.num_free)  # the rest of the sliding pool is taken
        prompt = PROMPT + answer[:2] + prompt_of(6, 1)
        outs = submit(engine, prompt, "q", STEPS)
        engine.step()
        req = engine.scheduler.find("q")
        assert req is not None and req.cached.device == 28 and req.cached.host == 0
        held = [page for page in req.window_page_ids if page is not None]
        assert held and all(alloc.is_used(page) for page in held)
        alloc.free(busy)
        drain(engine)
        assert tokens_of(outs) == hf_greedy(checkpoint[1], prompt, STEPS)[0]
        assert tokens_of(other_outs) == hf_greedy(checkpoint[1], other, 20)[0]
        idle_and_exact(built)
    finally:
        built.close()


def test_pages_and_tails_of_another_window_never_match(model, tmp_path) -> None:
    """The stored pages' fingerprint and the tail key name the window: the full layers'
    K/V depend on it, and windows 8 and 7 over pages of 4 both have 2-page tails."""
    config = model.config
    other = replace(config, sliding_window=WINDOW - 1)
    tail = WindowTailGeometry.of(config.kv_geometry, PAGE)
    other_tail = WindowTailGeometry.of(other.kv_geometry, PAGE)
    assert tail.num_pages == other_tail.num_pages
    assert tail.key() != other_tail.key()
    fingerprint = fingerprint_for(config, "gpt-oss-test", PAGE, True)
    assert fingerprint != fingerprint_for(other, "gpt-oss-test", PAGE, True)
    stored = storage_config_for(config, PAGE, fingerprint, True, backend="file",
                                path=str(tmp_path))
    assert stored.state_geometry == tail.key()
    # one-space pages (no window tails) named the window already
    assert fingerprint_for(config, "id", PAGE, False) != fingerprint_for(other, "id", PAGE, False)


@pytest.mark.parametrize("failing", ["load", "restore_window_tail"])
def test_a_failed_restore_frees_the_tail_pages_it_was_given(model, tmp_path, monkeypatch,
                                                            failing: str) -> None:
    """The tail's sliding pages are taken before the host hit is loaded and its tail
    restored: when either raises (the engine fails the step's requests), they go back to
    the pool."""
    built = tiered(model, tmp_path / "store", backend=None)
    try:
        engine = built.engine
        generate(engine, PROMPT, "a")
        assert built.hicache.wait_idle(10)
        assert engine.flush_cache() > 0
        assert engine.window.allocator.num_used == 0

        def fail(*args: object, **kwargs: object) -> None:
            raise RuntimeError(f"{failing} failed")

        monkeypatch.setattr(built.hicache, failing, fail)
        outs = submit(engine, PROMPT, "b", STEPS)
        engine.step()  # the engine fails the step's requests
        assert outs and outs[-1].error is not None and f"{failing} failed" in outs[-1].error
        assert engine.window.allocator.num_used == 0
    finally:
        monkeypatch.undo()
        built.close()
