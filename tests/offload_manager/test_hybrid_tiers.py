"""Qwen3-Next (hybrid: DeltaNet layers with a recurrent state, gated attention with KV pages)
on HiCache's host and storage tiers (docs/design.md §4.14): state checkpoints are backed up
with their pages (device slot → host state slot → storage state object) and a lower-tier hit is
served only where the state comes back with it.

The checkpoint is the tiny one of `tests/engine/test_qwen3_next.py` (transformers, fp32, seed
7): 4 layers, page size 4. Tokens are compared with a no-cache engine (itself equal to
transformers', `tests/engine/test_qwen3_next_engine.py`) and once with transformers here.
"""

from __future__ import annotations

import threading
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
from pdcache.engine.page_keys import state_key  # noqa: E402
from pdcache.engine.scheduler_config import SchedulerConfig  # noqa: E402
from pdcache.offload_manager.builder import (  # noqa: E402
    TierConfig,
    TieredEngine,
    build_tiered_engine,
    fingerprint_for,
    storage_config_for,
)
from pdcache.offload_manager.hicache import HiCache, HiCacheConfig  # noqa: E402
from tests.engine.test_qwen3_next import VOCAB, save_qwen3_next  # noqa: E402

PAGE = 4
STEPS = 6
PROMPT = [(i * 37 + 11) % VOCAB for i in range(30)]  # 7 full pages + 2 tokens
LOGPROB_ATOL = 2e-3


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, torch.nn.Module]:
    path = tmp_path_factory.mktemp("qwen3-next-tiers")
    return path, save_qwen3_next(path)


@pytest.fixture(scope="module")
def hybrid(checkpoint) -> torch.nn.Module:
    return load_model(str(checkpoint[0]))[0]


def engine_config(model: torch.nn.Module, prefix_cache: bool = True,
                  checkpoint_slots: int = 8) -> EngineConfig:
    return EngineConfig(
        model=model.config,
        cache=CacheConfig(page_size=PAGE, num_device_pages=96,
                          state_checkpoint_slots=checkpoint_slots,
                          enable_prefix_cache=prefix_cache),
        scheduler=SchedulerConfig(chunked_prefill_tokens=2048, max_running_requests=4),
    )


def tiered(model: torch.nn.Module, path: Path, backend: str | None = "file",
           host_state_slots: int = 0, checkpoint_slots: int = 8,
           storage_extra: dict[str, str] | None = None, **hicache: str) -> TieredEngine:
    """A driven engine over HiCache: host tier, and a `backend` storage tier (None: none)."""
    fingerprint = fingerprint_for(model.config, "qwen3-next-test", PAGE)
    extra = {"state_capacity": 32} if backend == "hf3fs" else {}
    extra.update(storage_extra or {})
    storage = None if backend is None else storage_config_for(
        model.config, PAGE, fingerprint, backend=backend, path=str(path), capacity_pages=256,
        **extra)
    tiers = TierConfig(host_pages=64, storage=storage, host_state_slots=host_state_slots,
                       hicache=HiCacheConfig(prefetch_policy="wait_complete", **hicache))
    built = build_tiered_engine(engine_config(model, checkpoint_slots=checkpoint_slots), model,
                                None, tiers)
    built.engine.start(thread=False)
    return built


def generate(engine: Engine, prompt: list[int], rid: str = "r",
             steps: int = STEPS) -> tuple[list[int], list[float], RequestOutput]:
    outs: list[RequestOutput] = []
    engine.submit(GenerateRequest(
        rid=rid, input_ids=prompt,
        sampling=SamplingParams(max_new_tokens=steps, temperature=0.0, ignore_eos=True),
        logprobs=LogprobRequest()), outs.append)
    while engine.step():
        pass
    assert outs and outs[-1].finished and outs[-1].error is None, outs[-1:]
    tokens = [t for out in outs for t in out.new_token_ids]
    logprobs = [float(lp.logprob) for out in outs for lp in out.new_logprobs]
    return tokens, logprobs, outs[-1]


@pytest.fixture(scope="module")
def reference(hybrid):
    """Greedy tokens and logprobs of a no-cache engine, by prompt."""
    engine = Engine(engine_config(hybrid, prefix_cache=False), hybrid).start(thread=False)
    memo: dict[tuple[int, ...], tuple[list[int], list[float]]] = {}

    def run(prompt: list[int], steps: int = STEPS) -> tuple[list[int], list[float]]:
        key = (*prompt, -steps)
        if key not in memo:
            memo[key] = generate(engine, prompt, f"ref{len(memo)}", steps)[:2]
        return memo[key]

    yield run
    engine.shutdown()


def assert_same(got: tuple[list[int], list[float], RequestOutput],
                want: tuple[list[int], list[float]]) -> None:
    assert got[0] == want[0]
    torch.testing.assert_close(torch.tensor(got[1]), torch.tensor(want[1]),
                               atol=LOGPROB_ATOL, rtol=0)


def idle_and_exact(built: TieredEngine) -> dict[str, int]:
    """Storage writes ended; every tier's state slots accounted for (device: engine, host:
    the tree's host checkpoints are every used host state slot)."""
    hicache = built.hicache
    assert hicache.wait_idle(10)
    numbers = built.engine.check_accounting()
    assert numbers["state_requests"] == numbers["state_pending"] == 0, numbers
    hicache.check()
    assert hicache.host_states_untracked() == 0
    return numbers


def drop_memory_tiers(built: TieredEngine) -> None:
    """Device and host tiers emptied (storage untouched): every state slot is free again."""
    assert built.hicache.wait_idle(10)
    assert built.engine.drop_cache().flushed
    numbers = built.engine.check_accounting()
    assert numbers["state_free"] == numbers["state_capacity"], numbers
    assert built.hicache.host_states is not None and built.hicache.host_states.num_used == 0


def state_key_at(built: TieredEngine, tokens: list[int]) -> bytes:
    """The storage key of the checkpoint after `tokens` (whole pages)."""
    geometry = built.hicache.host_states.geometry.key()
    return state_key(built.hicache.page_keys(tokens, "")[-1], geometry)


def test_engine_refuses_tiers_that_do_not_carry_state(hybrid, tmp_path) -> None:
    from pdcache.offload_manager.hiradix import HiRadixTree
    from pdcache.offload_manager.host_pool import HostKVPool

    config = engine_config(hybrid)
    host = HostKVPool.for_model(config.model, 8, PAGE)
    with pytest.raises(ValueError, match="recurrent state"):
        Engine(config, hybrid, make_tree=lambda pool, states=None: HiRadixTree(
            PAGE, pool.allocator, host))


def test_cold_then_host_hit_is_exact(hybrid, checkpoint, reference, tmp_path) -> None:
    built = tiered(hybrid, tmp_path / "store")
    try:
        cold = generate(built.engine, PROMPT, "a")
        assert_same(cold, reference(PROMPT))
        hf = checkpoint[1]
        ids = list(PROMPT)
        with torch.inference_mode():
            for _ in range(STEPS):
                ids.append(int(hf(torch.tensor([ids])).logits[0, -1].argmax()))
        assert cold[0] == ids[len(PROMPT):]
        idle_and_exact(built)
        stats = built.hicache.stats
        # write_through: the prompt's checkpoint (28 tokens) and the answer's (32) reached
        # host and storage with their pages
        assert stats.backup_host_states == 2 and stats.backup_storage_states == 2
        assert built.engine.flush_cache() > 0  # device evicted, host copies stay
        warm = generate(built.engine, PROMPT, "b")
        assert_same(warm, reference(PROMPT))
        assert (warm[2].cached.device, warm[2].cached.host) == (0, 28)
        assert stats.load_host_states == 1 and stats.load_state_bytes > 0
        idle_and_exact(built)
        # the restored node got its device checkpoint back: a third run hits the device
        third = generate(built.engine, PROMPT, "c")
        assert_same(third, reference(PROMPT))
        assert third[2].cached.device == 28
        drop_memory_tiers(built)
    finally:
        built.close()


@pytest.mark.parametrize("host_mode", ["inclusive", "exclusive"])
def test_a_host_hit_gets_its_device_checkpoint_back_with_the_share_full(
        hybrid, reference, tmp_path, host_mode: str) -> None:
    """Two device checkpoint slots, both held by another prompt's checkpoints when a host hit
    restores PROMPT's node: the least recently used checkpoint gives way, as for one the
    scheduler takes, so the next identical request hits the device. It took none before: the
    node sat on device without a checkpoint, neither the device rule nor the host match
    served it, and the next request recomputed it (exclusive: its host copy was gone too)."""
    built = tiered(hybrid, tmp_path / "store", backend=None, checkpoint_slots=2,
                   host_mode=host_mode)
    other = [(i * 53 + 7) % VOCAB for i in range(30)]
    try:
        generate(built.engine, PROMPT, "a")
        assert built.engine.flush_cache() > 0  # device evicted; host (or exclusive host) keeps it
        generate(built.engine, other, "x")  # its prompt's and answer's checkpoints: 2 of 2
        restored = generate(built.engine, PROMPT, "b")
        assert (restored[2].cached.device, restored[2].cached.host) == (0, 28)
        again = generate(built.engine, PROMPT, "c")
        assert again[2].cached.device == 28
        for run in (restored, again):
            assert_same(run, reference(PROMPT))
        idle_and_exact(built)
    finally:
        built.close()


@pytest.mark.parametrize("backend", ["file", "hf3fs"])
def test_storage_hits_and_next_turn_are_exact(hybrid, reference, tmp_path, backend) -> None:
    built = tiered(hybrid, tmp_path / backend, backend)
    try:
        answer = generate(built.engine, PROMPT, "t1")[0]
        idle_and_exact(built)
        drop_memory_tiers(built)
        again = generate(built.engine, PROMPT, "t1-again")
        assert_same(again, reference(PROMPT))
        assert again[2].cached.storage == 28  # the prompt-end checkpoint's state object
        # turn 2 extends turn 1's answer: it restores the state decode left at the answer's
        # last full page (32 tokens), read from storage
        idle_and_exact(built)
        drop_memory_tiers(built)
        turn2 = PROMPT + answer + [5, 9, 13, 17, 21]
        second = generate(built.engine, turn2, "t2")
        assert_same(second, reference(turn2))
        assert second[2].cached.storage == 32
        hicache = built.hicache
        assert hicache.stats.prefetch_states == hicache.stats.load_storage_states == 2
        idle_and_exact(built)
        storage = built.storage.stats()
        stats = hicache.stats
        # bytes per tier: states and KV both written and read, equal to the objects stored
        assert stats.backup_storage_state_bytes > 0 and stats.backup_storage_kv_bytes > 0
        # (a state already stored, as the prompt's after the drop, is skipped by the store)
        assert storage["states_written"] + storage["states_skipped"] == \
            stats.backup_storage_states
        assert storage["state_bytes_written"] == \
            storage["states_written"] * hicache.host_states.slot_nbytes
        assert storage["state_bytes_read"] == stats.prefetch_state_bytes
        assert storage["states_read"] == stats.prefetch_states
        assert stats.prefetch_state_bytes == 2 * hicache.host_states.slot_nbytes
        assert stats.backup_host_state_bytes == stats.backup_host_states * \
            hicache.host_states.slot_nbytes
        snapshot = built.engine.scheduler.tiers.stats()
        assert snapshot["host_state_slots_used"] == hicache.tree.host_checkpoints()
        assert snapshot["host_state_slots_untracked"] == 0
    finally:
        built.close()


def test_missing_or_refused_state_shortens_the_hit(hybrid, reference, tmp_path) -> None:
    built = tiered(hybrid, tmp_path / "store")
    try:
        answer = generate(built.engine, PROMPT, "t1")[0]
        turn2 = PROMPT + answer + [5, 9, 13, 17, 21]
        answer_end = state_key_at(built, turn2[:32])
        idle_and_exact(built)
        storage = built.storage
        # deleted: the probe finds the prompt's checkpoint (28) as the deepest state object
        storage.delete_states([answer_end])
        drop_memory_tiers(built)
        got = generate(built.engine, turn2, "t2")
        assert_same(got, reference(turn2))
        assert got[2].cached.storage == 28
        idle_and_exact(built)
        # refused: turn 2's own prompt checkpoint (40 tokens, written by "t2") replaced by
        # a state object claiming another position; 32 has none: the hit falls back to 28
        turn2_end = state_key_at(built, turn2[:40])
        assert storage.exists_state(turn2_end) and not storage.exists_state(answer_end)
        storage.delete_states([turn2_end])
        bogus = torch.zeros(built.hicache.host_states.slot_nbytes, dtype=torch.uint8)
        assert storage.put_state(turn2_end, bogus, tokens=4)
        drop_memory_tiers(built)
        misses = built.hicache.stats.prefetch_state_misses
        got = generate(built.engine, turn2, "t3")
        assert_same(got, reference(turn2))
        assert got[2].cached.storage == 28  # the previous checkpoint, never the bad state
        assert built.hicache.stats.prefetch_state_misses == misses + 1
        idle_and_exact(built)
        drop_memory_tiers(built)
    finally:
        built.close()


def turn_one_in_storage_only(hybrid, tmp_path: Path,
                             delay_s: str) -> tuple[TieredEngine, Path, list[int]]:
    """An engine over a storage tier whose every call the control file delays (`delay_s`
    now), after turn 1 of PROMPT, with device and host emptied: (engine, control file,
    turn 1's answer)."""
    control = tmp_path / "delay"
    control.write_text(delay_s)
    built = tiered(hybrid, tmp_path / "store", storage_extra={"fault_injection": str(control)})
    answer = generate(built.engine, PROMPT, "t1")[0]
    idle_and_exact(built)
    drop_memory_tiers(built)
    return built, control, answer


def test_the_state_probe_is_one_storage_call(hybrid, reference, tmp_path) -> None:
    """A storage hit probes the state object at each stored page's end on the engine thread;
    that is one batched call now (`exists_states`): it was a call per page, on a remote
    store a metadata round trip each while every running request waited. Calls counted by
    the delay wrapper (1 ms each): the page probe, the state probe, then on the IO thread
    one page read and one state read."""
    built, control, answer = turn_one_in_storage_only(hybrid, tmp_path, "0.001")
    try:
        turn2 = PROMPT + answer + [5, 9, 13, 17, 21]
        before = built.storage.stats()["injected_delays"]
        # the test's thread is the engine's (`start(thread=False)`)
        assert built.hicache.start_prefetch("probe", turn2, "", 0, len(turn2) // PAGE) == 8
        assert built.storage.stats()["injected_delays"] - before <= 4  # 1 + 8 page by page
        built.hicache.cancel_prefetch("probe")
        got = generate(built.engine, turn2, "t2")
        assert_same(got, reference(turn2))
        assert got[2].cached.storage == 32
    finally:
        built.close()


def test_a_storage_hit_continues_a_device_match_that_grew_while_it_was_read(
        hybrid, reference, tmp_path) -> None:
    """Turn 2 waits for its storage read (pages 0-7 and the state at 32) while a shorter
    request sharing its first 20 tokens runs and caches them on device with a checkpoint. At
    turn 2's admission the device match covers the read's first 5 pages: the read's last 3
    pages and its state continue it (the whole read was thrown away, 12 tokens recomputed)."""
    built, _, answer = turn_one_in_storage_only(hybrid, tmp_path, "0")
    reads = threading.Event()  # turn 2's storage reads wait until the shorter request ended
    storage = built.storage
    for name in ("get_into", "get_state_into"):
        read = getattr(storage, name)
        setattr(storage, name, lambda *a, _read=read, **k: reads.wait(30) and _read(*a, **k))
    try:
        turn2, shorter = PROMPT + answer + [5, 9, 13, 17, 21], PROMPT[:21]
        outs: dict[str, list[RequestOutput]] = {"b": [], "t2": []}
        for rid, prompt in (("b", shorter), ("t2", turn2)):
            built.engine.submit(GenerateRequest(
                rid=rid, input_ids=prompt,
                sampling=SamplingParams(max_new_tokens=STEPS, temperature=0.0, ignore_eos=True),
                logprobs=LogprobRequest()), outs[rid].append)
        while not outs["b"] or not outs["b"][-1].finished:  # its storage probe: no state
            assert built.engine.step(), "the shorter request did not finish"
        assert not outs["t2"]  # still waiting for its read
        reads.set()
        while built.engine.step() or not outs["t2"] or not outs["t2"][-1].finished:
            pass
        assert outs["b"][-1].cached.device == 0
        last = outs["t2"][-1]
        tokens = [t for out in outs["t2"] for t in out.new_token_ids]
        assert tokens == reference(turn2)[0]
        assert (last.cached.device, last.cached.storage) == (20, 12)
        idle_and_exact(built)
    finally:
        reads.set()
        built.close()


def test_hit_without_its_state_gives_wrong_tokens(hybrid, reference, tmp_path,
                                                   monkeypatch) -> None:
    """The protection shown off: pages from storage served with a zero state (no restore)."""
    monkeypatch.setattr(HiCache, "restore_state", lambda self, slot, host, node, pref:
                        self.prefetches.release_state(pref.state_slot if pref else None))
    built = tiered(hybrid, tmp_path / "store")
    try:
        generate(built.engine, PROMPT, "t1")
        drop_memory_tiers(built)
        tokens, logprobs, out = generate(built.engine, PROMPT, "t2")
        assert out.cached.storage == 28
        want_tokens, want_logprobs = reference(PROMPT)
        diff = (torch.tensor(logprobs) - torch.tensor(want_logprobs)).abs().max()
        assert tokens != want_tokens or diff > 10 * LOGPROB_ATOL
    finally:
        built.close()


def test_write_back_backs_a_dropped_checkpoint_up_before_it_is_freed(hybrid, reference,
                                                                      tmp_path) -> None:
    """write_back with two device checkpoint slots and three prompts: taking the later
    prompts' checkpoints drops the earlier ones (least recently used). Each is backed up as
    it is dropped (with its node's pages, not on host yet); before, only the pages reached
    storage, at their eviction, and the first prompts' storage hits were recomputed."""
    built = tiered(hybrid, tmp_path / "store", checkpoint_slots=2, host_state_slots=16,
                   write_policy="write_back")
    prompts = [[(i * 37 + 11 + k) % VOCAB for i in range(30)] for k in range(3)]
    try:
        for k, prompt in enumerate(prompts):
            generate(built.engine, prompt, f"a{k}")
        assert built.engine.flush_cache() > 0  # write_back: the rest goes up now
        drop_memory_tiers(built)
        for k, prompt in enumerate(prompts):
            got = generate(built.engine, prompt, f"b{k}")
            assert_same(got, reference(prompt))
            assert got[2].cached.storage == 28, k  # the prompt's checkpoint, from storage
        idle_and_exact(built)
    finally:
        built.close()


def test_write_back_backs_states_up_at_eviction_and_frees_them_once(hybrid, reference,
                                                                     tmp_path) -> None:
    """write_back: the device eviction hook sees the checkpoint before it is freed and backs it
    up with the pages. One host state slot: the second backup drops the first host checkpoint
    (its pages stay, counted), and a host hit is served only at the one left."""
    built = tiered(hybrid, tmp_path, None, host_state_slots=1, write_policy="write_back")
    try:
        generate(built.engine, PROMPT, "a")
        stats = built.hicache.stats
        assert stats.backup_host_states == 0  # nothing written before an eviction
        assert built.engine.flush_cache() > 0  # answer node (32) first, then the prompt's (28)
        assert stats.backup_host_states == 2
        assert built.hicache.tree.num_host_evicted_states == 1
        idle_and_exact(built)
        warm = generate(built.engine, PROMPT + [3, 1, 4, 1, 5], "b")
        assert_same(warm, reference(PROMPT + [3, 1, 4, 1, 5]))
        assert warm[2].cached.host == 28  # 32 has host pages but no host checkpoint left
        idle_and_exact(built)
        built.engine.flush_cache()
        # host eviction of every copy frees every host state slot exactly once
        tree = built.hicache.tree
        tree.evict_host(tree.host_pages)
        idle_and_exact(built)
        assert built.hicache.host_states.num_used == 0
        drop_memory_tiers(built)
    finally:
        built.close()


def test_topology_keys_reach_the_tiers(hybrid, tmp_path) -> None:
    """`[storage] state_capacity` and `[cache] state_checkpoint_slots` are topology keys; the
    storage config takes its state geometry from the model and counts a page's KV layers."""
    from pdcache.config.node_setup import storage_from_spec
    from pdcache.config.schema import CacheSpec, StorageSpec, field_values
    from pdcache.engine.cache_settings import DeviceCacheSettings

    model = hybrid.config
    spec = StorageSpec(backend="hf3fs", path=str(tmp_path), state_capacity=16)
    storage = storage_from_spec(spec, model, PAGE, fingerprint_for(model, "t", PAGE))
    assert storage.state_capacity == 16
    assert storage.state_geometry == model.state_geometry.key()
    assert storage.state_bytes == model.state_geometry.state_bytes()
    assert storage.num_layers == model.kv_geometry.num_kv_layers < model.num_hidden_layers
    cache = field_values(CacheSpec(state_checkpoint_slots=5), DeviceCacheSettings)
    assert cache["state_checkpoint_slots"] == 5


def test_hf3fs_state_pool_is_sized_when_unset() -> None:
    """hf3fs keeps states in a slot pool of its own: a hybrid topology that names no
    `state_capacity` gets a quarter of the page capacity's bytes (a model without state gets
    none, and an explicit size wins)."""
    from pdcache.engine.presets import preset_config
    from pdcache.offload_manager.builder import storage_config_for

    hybrid = preset_config("tiny-qwen3-next")
    state_bytes = hybrid.state_geometry.state_bytes()
    capacity = 64 * state_bytes
    auto = storage_config_for(hybrid, 16, "fp", backend="hf3fs", capacity_bytes=capacity)
    assert auto.state_capacity == capacity // 4 // state_bytes == 16
    given = storage_config_for(hybrid, 16, "fp", backend="hf3fs", capacity_bytes=capacity,
                               state_capacity=3)
    assert given.state_capacity == 3
    dense = storage_config_for(preset_config("tiny"), 16, "fp", backend="hf3fs",
                               capacity_bytes=capacity)
    assert dense.state_capacity == 0
