"""DecodeOffloadManager backpressure: when staging cannot hold a whole batch, the head of the
chain is written and only the tail is dropped (a chain's head is what later lookups find)."""

from __future__ import annotations

import threading

import pytest
import torch

from pdcache.engine.page_keys import chain_page_keys, make_salt
from pdcache.offload_manager.decode_offload import DecodeOffloadManager
from tests.storage_doubles import DictBackend

LAYERS, PAGES, PAGE, HEADS, DIM = 2, 16, 4, 2, 8
FP = "staging-test"


class SlowLookup(DictBackend):
    """Storage whose lookups wait until `lookups` is set (the copy thread stalls)."""

    def __init__(self) -> None:
        super().__init__()
        self.lookups = threading.Event()
        self.lookups.set()

    def exists_prefix(self, keys):  # type: ignore[no-untyped-def]
        assert self.lookups.wait(60)
        return super().exists_prefix(keys)


class ReleaseHeld:
    """The decode controller's `hold_for_offload` for a bare engine (`built["engine"]`):
    the copies' end releases the held request."""

    def __init__(self, built: dict) -> None:
        self.built = built

    def hold_for_offload(self, rid: str):  # type: ignore[no-untyped-def]
        return lambda: self.built["engine"].release_held(rid)


def test_short_staging_keeps_the_chain_head_and_drops_the_tail() -> None:
    kv = torch.randn(LAYERS, 2, PAGES, PAGE, HEADS, DIM, generator=torch.Generator().manual_seed(1))
    storage = DictBackend()
    mgr = DecodeOffloadManager(kv, storage, FP, staging_pages=3).start()
    tokens = list(range(6 * PAGE))
    pages = [9, 1, 4, 12, 3, 7]
    mgr.track("r")
    released = threading.Event()
    mgr.finish("r", tokens, pages, released.set)  # one batch of 6 pages, 3 staging pages
    assert released.wait(10) and mgr.wait_idle(10)
    keys = chain_page_keys(tokens, PAGE, make_salt(FP))
    assert storage.exists_prefix(keys) == 3
    for key, page in zip(keys[:3], pages[:3]):
        assert storage.pages[key] == kv[:, :, page].contiguous().numpy().tobytes()
    assert (mgr.stats.pages_offloaded, mgr.stats.pages_dropped) == (3, 3)
    mgr.check()
    snap = mgr.snapshot()
    assert snap["staging_pages_used"] == 0 and snap["pending_copies"] == 0
    mgr.close()


def test_an_answer_state_whose_pages_were_dropped_is_not_written(tmp_path) -> None:
    """A hybrid answer's end state can only be hit with every page before it: with staging
    short (3 of 6 pages written), it is not written (`states_dropped`; it was, as a whole
    state object no request could reach), and with room it is."""
    from pdcache.engine.loader import load_model
    from pdcache.engine.page_keys import state_key
    from pdcache.engine.state_pool import StateSnapshot
    from pdcache.offload_manager.builder import fingerprint_for, storage_config_for
    from pdcache.offload_manager.decode_offload import AnswerState
    from pdcache.offload_manager.storage import create_backend

    model = load_model("tiny-qwen3-next", seed=0)[0]
    config = model.config
    fingerprint = fingerprint_for(config, "m", PAGE)
    storage = create_backend(storage_config_for(config, PAGE, fingerprint, backend="file",
                                                path=str(tmp_path), capacity_pages=64))
    kv = torch.randn(config.kv_geometry.device_shape(PAGES, PAGE))
    geometry = config.state_geometry
    tokens = list(range(6 * PAGE))
    state_at_end = state_key(chain_page_keys(tokens, PAGE, make_salt(fingerprint))[-1],
                             geometry.key())
    for staging, written in ((3, False), (8, True)):
        mgr = DecodeOffloadManager(kv, storage, fingerprint, staging_pages=staging).start()
        try:
            mgr.track("r")
            released = threading.Event()
            snapshot = StateSnapshot(geometry, torch.zeros(geometry.state_bytes(),
                                                           dtype=torch.uint8))
            mgr.finish("r", tokens, [9, 1, 4, 12, 3, 7], released.set,
                       AnswerState(len(tokens), snapshot))
            assert released.wait(10) and mgr.wait_idle(10)
            stats = mgr.stats
            assert storage.exists_state(state_at_end) is written
            assert (stats.states_offloaded, stats.states_dropped) == (int(written),
                                                                       int(not written))
            assert stats.states_failed == 0
            mgr.check()
        finally:
            mgr.close()
        storage.delete(chain_page_keys(tokens, PAGE, make_salt(fingerprint)))
    storage.close()


def test_after_a_dropped_page_the_chain_rest_and_its_state_are_not_written(tmp_path) -> None:
    """Staging short for a mid-answer batch (3 of 6 pages kept): the answer's last batch
    fits, but a lookup finds only the chain's first 3 pages, so its page and the answer's
    end state (a whole state object; 73.7 MiB on Qwen3-Next-80B) were written for nothing,
    and `states_dropped` said 0. They are dropped now, counted."""
    from pdcache.engine.loader import load_model
    from pdcache.engine.page_keys import state_key
    from pdcache.engine.state_pool import StateSnapshot
    from pdcache.offload_manager.builder import fingerprint_for, storage_config_for
    from pdcache.offload_manager.decode_offload import AnswerState
    from pdcache.offload_manager.storage import create_backend

    config = load_model("tiny-qwen3-next", seed=0)[0].config
    fingerprint = fingerprint_for(config, "m", PAGE)
    storage = create_backend(storage_config_for(config, PAGE, fingerprint, backend="file",
                                                path=str(tmp_path), capacity_pages=64))
    kv = torch.randn(config.kv_geometry.device_shape(PAGES, PAGE))
    geometry = config.state_geometry
    tokens, pages = list(range(7 * PAGE)), [9, 1, 4, 12, 3, 7, 2]
    keys = chain_page_keys(tokens, PAGE, make_salt(fingerprint))
    mgr = DecodeOffloadManager(kv, storage, fingerprint, staging_pages=3).start()
    try:
        mgr.track("r")
        mgr.on_step("r", tokens[: 6 * PAGE], pages[:6])  # pages 3-5 find no staging
        assert mgr.wait_idle(10)
        released = threading.Event()
        snapshot = StateSnapshot(geometry, torch.zeros(geometry.state_bytes(), dtype=torch.uint8))
        mgr.finish("r", tokens, pages, released.set, AnswerState(len(tokens), snapshot))
        assert released.wait(10) and mgr.wait_idle(10)
        assert storage.exists_prefix(keys) == 3 and keys[6] not in set(storage.keys())
        assert not storage.exists_state(state_key(keys[-1], geometry.key()))
        stats = mgr.stats
        assert (stats.pages_offloaded, stats.pages_dropped) == (3, 4)
        assert (stats.states_offloaded, stats.states_dropped) == (0, 1)
        mgr.check()
    finally:
        mgr.close()
        storage.close()


def test_a_decoding_requests_duplicate_pages_outlive_its_queued_copies() -> None:
    """Hybrid decode node with a prefix tree and `state_checkpoints = "every_page"`: two
    requests of one prompt; at each page boundary the second's pages go to the tree, which
    has the first's already. The second's offload copies, queued with its own page ids (the
    storage lookup ahead of them is slow), read them later. They were freed at once and went
    to the next reservation meanwhile: its K/V was staged, served to pulls and stored under
    the prompt's keys. Now they are freed with the request's other pages."""
    from pdcache.decode_node.scheduler import DecodeRole
    from pdcache.engine.api import GenerateRequest, SamplingParams
    from pdcache.engine.config import CacheConfig, EngineConfig
    from pdcache.engine.engine import Engine
    from pdcache.engine.loader import load_model
    from pdcache.engine.scheduler import Scheduler
    from pdcache.engine.scheduler_config import SchedulerConfig
    from pdcache.engine.state_pool import StateSnapshot

    model = load_model("tiny-qwen3-next", seed=0)[0]
    storage, built = SlowLookup(), {}
    storage.lookups.clear()  # the copy thread stalls until the test says

    def make_scheduler(**kwargs):  # type: ignore[no-untyped-def]
        mgr = built["mgr"] = DecodeOffloadManager(kwargs["pool"].device_kv, storage, FP,
                                                  staging_pages=64, stride_pages=1)
        return Scheduler(**kwargs, role=DecodeRole(mgr, ReleaseHeld(built), kwargs.get("states")))

    config = EngineConfig(model=model.config, cache=CacheConfig(
        page_size=PAGE, num_device_pages=40, state_checkpoint_slots=16,
        state_checkpoints="every_page"), scheduler=SchedulerConfig(max_running_requests=8))
    engine = built["engine"] = Engine(config, model, make_scheduler=make_scheduler)
    mgr = built["mgr"].start()
    engine.start(thread=False)
    try:
        geometry = engine.states.pool.geometry
        state = StateSnapshot(geometry, torch.zeros(geometry.state_bytes(), dtype=torch.uint8))
        prompt = [(i * 37 + 11) % model.config.vocab_size for i in range(10)]
        reserved = {}
        for rid in ("a", "b"):
            reserved[rid] = engine.reserve(rid, len(prompt))
            engine.submit_prefilled(GenerateRequest(rid, prompt, SamplingParams(
                max_new_tokens=8, temperature=0.0, ignore_eos=True)), 5, lambda _out: None,
                state=state)
        for _ in range(4):  # both past the page boundary at 12 tokens, copies queued
            engine.step()
        allocator = engine.scheduler.allocator
        assert all(allocator.is_used(page) for page in reserved["b"])
        storage.lookups.set()
        while engine.step():
            pass
        assert mgr.wait_idle(10)
        while engine.step():  # the copies' releases
            pass
        numbers = engine.check_accounting()
        assert numbers["requests"] == 0 and not engine.scheduler.held
    finally:
        storage.lookups.set()
        mgr.close()
        engine.shutdown()


def test_window_pages_stage_every_layer_from_both_spaces_and_leave_absent_ones() -> None:
    """A sliding-window model's decode with window pages (docs/design.md §4.14): the full
    layers in the engine's pool, the sliding ones in the window pool. Offload stages each
    page as a stored page of every layer (byte-equal to the one-space page), and a prompt
    page whose sliding layers never came here (beyond the window tail prefill sends) is not
    written: prefill, which computed it, stores it; the pages after it still are."""
    from pdcache.engine.kv_geometry import KVGeometry
    from pdcache.engine.window_pages import WindowPages

    kinds = ("sliding", "full", "sliding", "full")
    geometry = KVGeometry.mha(4, HEADS, DIM, "float32").with_layer_kinds(kinds, 8)
    window = WindowPages(geometry, PAGES, PAGE, torch.float32)
    full_kv = window.full_pool(PAGES, torch.float32).device_kv
    generator = torch.Generator().manual_seed(3)
    full_kv.copy_(torch.randn(full_kv.shape, generator=generator))
    window.pool.device_kv.copy_(torch.randn(window.pool.device_kv.shape, generator=generator))
    storage = DictBackend()
    mgr = DecodeOffloadManager(full_kv, storage, FP, staging_pages=8, window=window,
                               geometry=geometry).start()
    tokens = list(range(5 * PAGE))
    pages, sliding = [9, 1, 4, 12, 3], [None, None, 6, 2, 11]  # prompt pages 0-1: tail only
    mgr.track("r")
    released = threading.Event()
    mgr.finish("r", tokens, pages, released.set, window_page_ids=sliding)
    assert released.wait(10) and mgr.wait_idle(10)
    keys = chain_page_keys(tokens, PAGE, make_salt(FP))
    assert [key in storage.pages for key in keys] == [False, False, True, True, True]
    for key, page, slide in zip(keys[2:], pages[2:], sliding[2:]):
        rows = [window.pool.device_kv[window.sliding_rows[layer], :, slide] if kind == "sliding"
                else full_kv[window.full_rows[layer], :, page] for layer, kind in enumerate(kinds)]
        assert storage.pages[key] == torch.stack(rows).contiguous().numpy().tobytes()
    stats = mgr.stats
    assert (stats.pages_offloaded, stats.pages_left_to_prefill, stats.pages_dropped) == (3, 2, 0)
    mgr.check()
    mgr.close()


def test_window_pages_behind_the_window_wait_for_their_copies() -> None:
    """Decode with window pages and offload: the engine frees a decoding request's sliding
    pages as its window moves, but only below the pages whose copies ended
    (`DecodeRole.pages_read_from`): with the copies held back by a slow storage lookup,
    nothing is freed; once they ran, the pages behind the window go."""
    from pdcache.decode_node.scheduler import DecodeRole
    from pdcache.engine.api import GenerateRequest, SamplingParams
    from pdcache.engine.config import CacheConfig, EngineConfig
    from pdcache.engine.engine import Engine
    from pdcache.engine.loader import load_model
    from pdcache.engine.scheduler import Scheduler
    from pdcache.engine.scheduler_config import SchedulerConfig

    model = load_model("tiny-gpt-oss", seed=0)[0]
    storage, built = SlowLookup(), {}
    storage.lookups.clear()  # the copy thread stalls until the test says

    def make_scheduler(**kwargs):  # type: ignore[no-untyped-def]
        mgr = built["mgr"] = DecodeOffloadManager(
            kwargs["pool"].device_kv, storage, FP, staging_pages=64, window=kwargs["window"],
            geometry=model.config.kv_geometry)
        return Scheduler(**kwargs, role=DecodeRole(mgr, ReleaseHeld(built)))

    config = EngineConfig(model=model.config, cache=CacheConfig(page_size=PAGE,
                                                                num_device_pages=64),
                          scheduler=SchedulerConfig(max_running_requests=2))
    engine = built["engine"] = Engine(config, model, make_scheduler=make_scheduler,
                                      window_pages=True)
    mgr = built["mgr"].start()
    engine.start(thread=False)
    try:
        prompt = list(range(3, 43))
        admissions = []
        engine.reserve_when_free("r", len(prompt), admissions.append, max_new_tokens=24)
        engine.step()
        assert admissions and admissions[0].ok and admissions[0].window_page_ids
        done = []
        engine.submit_prefilled(GenerateRequest("r", prompt, SamplingParams(
            max_new_tokens=24, ignore_eos=True)), 5, lambda out: done.append(out.finished))
        for _ in range(20):  # 60 tokens: the window (16) left answer page 10 behind
            engine.step()
        assert engine.stats()["window_pages_freed_total"] == 0  # their copies still queued
        storage.lookups.set()
        while not (done and done[-1]) or engine.step():
            engine.step()
        assert mgr.wait_idle(10)
        while engine.step():
            pass
        assert engine.stats()["window_pages_freed_total"] > 0
        numbers = engine.check_accounting()
        assert numbers["requests"] == 0 and numbers["window_requests"] == 0, numbers
    finally:
        storage.lookups.set()
        mgr.close()
        engine.shutdown()


def two_long_decodes(storage: DictBackend, max_queued_pages: int = 4096):  # type: ignore[no-untyped-def]
    """A decode engine (tiny, DecodeRole with offload over `storage`) whose pool of 24 pages
    fits one of two granted requests past their decode budget (8 tokens), not both; the two
    are started. Returns (engine, manager, finals by rid)."""
    from pdcache.decode_node.scheduler import DecodeRole
    from pdcache.engine.api import GenerateRequest, SamplingParams
    from pdcache.engine.config import CacheConfig, EngineConfig
    from pdcache.engine.engine import Engine
    from pdcache.engine.loader import load_model
    from pdcache.engine.scheduler import Scheduler
    from pdcache.engine.scheduler_config import SchedulerConfig

    model = load_model("tiny", seed=0)[0]
    built = {}

    def make_scheduler(**kwargs):  # type: ignore[no-untyped-def]
        mgr = built["mgr"] = DecodeOffloadManager(kwargs["pool"].device_kv, storage, FP,
                                                  staging_pages=16,
                                                  max_queued_pages=max_queued_pages)
        return Scheduler(**kwargs, role=DecodeRole(mgr, ReleaseHeld(built)))

    config = EngineConfig(model=model.config, cache=CacheConfig(page_size=PAGE,
                                                                num_device_pages=24),
                          scheduler=SchedulerConfig(decode_reserve_tokens=8))
    engine = built["engine"] = Engine(config, model, make_scheduler=make_scheduler)
    mgr = built["mgr"].start()
    engine.start(thread=False)
    finals: dict[str, object] = {}
    for rid in ("a", "b"):  # each fits alone (17 pages), not both
        engine.reserve_when_free(rid, 8, lambda _admission: None, max_new_tokens=60)
    engine.step()
    for rid in ("a", "b"):
        engine.submit_prefilled(
            GenerateRequest(rid, list(range(3, 11)), SamplingParams(max_new_tokens=60,
                                                                    ignore_eos=True)),
            5, lambda out: finals.__setitem__(out.rid, out) if out.finished else None)
    return engine, mgr, finals


def step_until(engine, mgr, done, limit: int = 2000) -> None:  # type: ignore[no-untyped-def]
    for _ in range(limit):
        if done():
            return
        engine.step()
        mgr.wait_idle(1)  # copies end (the engine retracts a request only after)


@pytest.mark.parametrize("queue", ["roomy", "once_full"])
def test_decode_with_offload_retracts_once_copies_are_done_instead_of_freezing(queue) -> None:
    """A grant keeps room for `decode_reserve_tokens` answer tokens only; past them requests
    take pages as they free. With offload, decode never retracted (copies might read the
    pages): two requests filling the pool at a page boundary found no victim, and nobody
    finished, for good. A request whose copies ended may give way now, and both finish;
    also after copy tasks were dropped with the queue full (their pages were never marked
    copied: the freeze came back)."""
    storage = SlowLookup()
    engine, mgr, finals = two_long_decodes(storage, 4096 if queue == "roomy" else 3)
    try:
        if queue == "once_full":
            storage.lookups.clear()  # the copy thread stalls: the queue fills, tasks drop
            for _ in range(200):
                engine.step()
            storage.lookups.set()
            assert mgr.stats.pages_dropped > 0
        step_until(engine, mgr, lambda: len(finals) == 2)
        assert sorted(finals) == ["a", "b"], [(r.rid, len(r.output_ids))
                                              for r in engine.scheduler.running]
        assert all(out.error is None and out.completion_tokens == 60 for out in finals.values())
        assert engine.stats()["requests_retracted_total"] > 0
        assert mgr.wait_idle(10)
        while engine.step():
            pass
        numbers = engine.check_accounting()
        assert numbers["requests"] == 0 and not engine.scheduler.held, numbers
    finally:
        storage.lookups.set()
        mgr.close()
        engine.shutdown()


def test_a_retracted_decode_aborted_while_waiting_leaves_offload() -> None:
    """Retracted, a decode request waits; aborted there it never reached the role (its
    abort hook runs for running requests): offload tracked it for good."""
    from pdcache.engine.request import ReqStatus

    engine, mgr, finals = two_long_decodes(DictBackend())
    try:
        waiting: list[str] = []
        step_until(engine, mgr, lambda: waiting.extend(
            r.rid for r in engine.scheduler.waiting if r.status is ReqStatus.WAITING) or waiting)
        assert waiting, "no retraction happened"
        victim = waiting[0]
        assert mgr.tracking(victim)
        engine.abort(victim)
        step_until(engine, mgr, lambda: len(finals) == 2)
        assert finals[victim].finish_reason == "abort"
        assert mgr.wait_idle(10) and not mgr.tracking(victim)
        assert mgr.copies_done(victim) and mgr.copied_pages(victim) == 0  # forgotten
    finally:
        mgr.close()
        engine.shutdown()
