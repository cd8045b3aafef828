"""The scheduler's cache tiers (`CacheTiers`, composed into `Scheduler(tiers=...)`), driven by a
minimal host tier written here: pages the tree caches are copied to host memory, and later
requests load them back (per layer) either as their own pages or restored into the tree.
Tokens must equal a no-cache run."""

from __future__ import annotations

import functools
import random
import threading

import pytest
import torch

from pdcache.engine.api import CachedTokens, GenerateRequest, SamplingParams
from pdcache.engine.config import CacheConfig, EngineConfig
from pdcache.engine.engine import Engine
from pdcache.engine.kv_pool import DeviceKVPool
from pdcache.engine.loader import load_model
from pdcache.engine.radix import InsertResult, MatchResult, RadixTree
from pdcache.engine.request import Req
from pdcache.engine.roles import RolePolicy, Unified
from pdcache.engine.scheduler import Scheduler
from pdcache.engine.scheduler_config import SchedulerConfig
from pdcache.engine.tiers import DeviceOnly, TierReuse

PAGE = 4
PARAMS = SamplingParams(max_new_tokens=10, ignore_eos=True)


class LayerCopy:
    """Copies host pages into device pages one layer at a time, recording the layers asked."""

    def __init__(self, device_kv: torch.Tensor, pages: list[torch.Tensor], page_ids: list[int]):
        self.device_kv, self.pages, self.page_ids = device_kv, pages, page_ids
        self.next_layer = 0
        self.waited: list[int] = []

    @property
    def done(self) -> bool:
        return self.next_layer == self.device_kv.shape[0]

    def wait(self, layer: int) -> None:
        self.waited.append(layer)
        while self.next_layer <= layer:
            for page, page_id in zip(self.pages, self.page_ids):
                self.device_kv[self.next_layer, :, page_id] = page[self.next_layer]
            self.next_layer += 1

    def finish(self) -> None:
        self.wait(self.device_kv.shape[0] - 1)


class HostSnapshotTiers(DeviceOnly):
    """A host tier keyed by token prefix (one entry per full page)."""

    def __init__(self, tree: RadixTree, pool: DeviceKVPool, *, restore_into_tree: bool) -> None:
        super().__init__(tree)
        self.pool = pool
        self.restore_into_tree = restore_into_tree
        self.host: dict[tuple[int, ...], torch.Tensor] = {}
        self.loads: list[LayerCopy] = []
        self.blocked: set[str] = set()
        self.queued: list[str] = []
        self.dequeued: list[str] = []

    def on_queued(self, req: Req) -> None:
        self.queued.append(req.rid)

    def on_dequeued(self, req: Req) -> None:
        self.dequeued.append(req.rid)

    def admission_ready(self, req: Req) -> bool:
        return req.rid not in self.blocked

    def on_cached(self, req: Req, result: InsertResult) -> None:
        tokens = req.fill_ids
        held = self.tree.match_prefix(tokens, req.salt).page_ids
        for i, page_id in enumerate(held):
            key = tuple(tokens[: (i + 1) * PAGE])
            self.host.setdefault(key, self.pool.device_kv[:, :, page_id].clone())

    def reuse_lower_tiers(
        self, req: Req, match: MatchResult, own_page_ids: list[int], max_pages: int
    ) -> TierReuse:
        tokens, first = req.fill_ids, len(match.page_ids)
        hits = []
        for i in range(first, max_pages):
            page = self.host.get(tuple(tokens[: (i + 1) * PAGE]))
            if page is None:
                break
            hits.append(page)
        if not hits:
            return TierReuse()
        load = LayerCopy(self.pool.device_kv, hits, own_page_ids[: len(hits)])
        self.loads.append(load)
        cached = CachedTokens(device=match.cached_len, host=len(hits) * PAGE)
        if not self.restore_into_tree:
            return TierReuse(own_pages=len(hits), kv_load=load, cached=cached)
        end = (first + len(hits)) * PAGE
        result = self.tree.insert(tokens[:end], match.page_ids + own_page_ids[: len(hits)], req.salt)
        assert not result.duplicate_page_ids
        return TierReuse(tree_pages=len(hits), node=result.last_node, kv_load=load, cached=cached)


@pytest.fixture(scope="module")
def tiny():
    model, _ = load_model("tiny", seed=0)
    return model


def composed(make_tiers=None, role: RolePolicy | None = None):
    """`Engine(make_scheduler=...)`: a `Scheduler` with `make_tiers(tree, pool)` and `role`."""

    def make_scheduler(**kwargs) -> Scheduler:
        tiers = make_tiers(kwargs["tree"], kwargs["pool"]) if make_tiers is not None else None
        return Scheduler(**kwargs, tiers=tiers, role=role)

    return make_scheduler


def make_engine(model, make_tiers=None, prefix_cache: bool = True) -> Engine:
    config = EngineConfig(
        model=model.config,
        cache=CacheConfig(page_size=PAGE, num_device_pages=128, enable_prefix_cache=prefix_cache),
        scheduler=SchedulerConfig(chunked_prefill_tokens=16),
    )
    return Engine(config, model, make_scheduler=composed(make_tiers)).start()


def run(engine: Engine, rid: str, prompt: list[int]):
    outputs = engine.generate(GenerateRequest(rid, prompt, PARAMS), timeout=60)
    return [t for o in outputs for t in o.new_token_ids], outputs[-1]


@pytest.mark.parametrize("restore_into_tree", [False, True])
def test_host_tier_hooks_reuse_exactly(tiny, restore_into_tree: bool) -> None:
    rng = random.Random(3)
    turn1 = [rng.randrange(3, 250) for _ in range(30)]
    factory = functools.partial(HostSnapshotTiers, restore_into_tree=restore_into_tree)
    engine = make_engine(tiny, factory)
    tier = engine.scheduler.tiers
    assert isinstance(tier, HostSnapshotTiers)
    try:
        answer, _ = run(engine, "t1", turn1)
        turn2 = turn1 + answer + [7, 8, 9, 10, 11]
        assert engine.flush_cache() > 0  # the device tier forgets; the host tier remembers
        tokens2, final2 = run(engine, "t2", turn2)
        tokens3, final3 = run(engine, "t3", turn2)
        numbers = engine.check_accounting()
    finally:
        engine.shutdown()
    expected = (len(turn1) + len(answer) - 1) // PAGE * PAGE
    assert final2.cached == CachedTokens(device=0, host=expected)
    assert final2.computed_tokens == len(turn2) - expected
    assert tier.loads[0].waited[:4] == [0, 1, 2, 3] and tier.loads[0].done
    if restore_into_tree:  # restored pages stayed in the tree: turn 3 hits the device
        assert final3.cached.device >= expected
    assert numbers["requests"] == 0 and numbers["tree"] == numbers["used"]
    assert tier.queued == ["t1", "t2", "t3"]

    reference = make_engine(tiny, prefix_cache=False)
    try:
        ref_tokens, _ = run(reference, "t2", turn2)
    finally:
        reference.shutdown()
    assert tokens2 == ref_tokens == tokens3


def test_not_ready_request_waits_while_others_run(tiny) -> None:
    factory = functools.partial(HostSnapshotTiers, restore_into_tree=False)
    engine = make_engine(tiny, factory)
    tier = engine.scheduler.tiers
    assert isinstance(tier, HostSnapshotTiers)
    finished = threading.Event()
    tier.blocked.add("slow")
    try:
        engine.submit(GenerateRequest("slow", [5, 6, 7], PARAMS),
                      lambda out: out.finished and finished.set())
        _, fast = run(engine, "fast", [8, 9, 10])
        assert fast.finish_reason == "length" and not finished.is_set()
        assert engine.stats()["num_waiting"] == 1
        tier.blocked.clear()
        assert finished.wait(30)
        engine.submit(GenerateRequest("gone", [5, 6], PARAMS), lambda out: None)
        tier.blocked.add("never")
        engine.submit(GenerateRequest("never", [5, 6], PARAMS), lambda out: None)
        engine.abort("never")
        engine.check_accounting()  # runs on the engine thread after the abort was handled
        assert tier.dequeued == ["never"]
    finally:
        engine.shutdown()


class ProtectingRole(Unified):
    """Never retracts the requests named in `protected`."""

    def __init__(self, protected: set[str]) -> None:
        self.protected = protected

    def can_retract(self, req: Req) -> bool:
        return req.rid not in self.protected


class SeeingTiers(DeviceOnly):
    """Remembers every request queued."""

    def __init__(self, tree: RadixTree | None, pool: DeviceKVPool) -> None:
        super().__init__(tree)
        self.seen: dict[str, Req] = {}

    def on_queued(self, req: Req) -> None:
        self.seen[req.rid] = req


def run_sync(engine: Engine, reqs: list[GenerateRequest]) -> dict[str, list[int]]:
    """Drive the engine step by step on this thread (deterministic scheduling)."""
    engine.start(thread=False)
    outputs: dict[str, list[int]] = {req.rid: [] for req in reqs}
    for req in reqs:
        sink = outputs[req.rid]
        engine.submit(req, lambda out, sink=sink: sink.extend(out.new_token_ids))
    while engine.step():
        pass
    engine.check_accounting()
    return outputs


def test_protected_requests_are_never_retracted(tiny) -> None:
    rng = random.Random(9)
    params = SamplingParams(max_new_tokens=16, ignore_eos=True)
    reqs = [GenerateRequest(f"p{i}", [rng.randrange(3, 250) for _ in range(18 + 3 * i)], params)
            for i in range(6)]
    reference = make_engine(tiny, prefix_cache=False)
    try:
        expected = {
            req.rid: [t for o in reference.generate(req, 60) for t in o.new_token_ids]
            for req in reqs
        }
    finally:
        reference.shutdown()
    config = EngineConfig(
        model=tiny.config,
        cache=CacheConfig(page_size=PAGE, num_device_pages=24),
        scheduler=SchedulerConfig(chunked_prefill_tokens=16),
    )
    retractions = {}
    for protected in (set(), {"p2"}):  # unprotected, p2 is the one retracted under pressure
        factory = composed(SeeingTiers, ProtectingRole(protected))
        engine = Engine(config, tiny, make_scheduler=factory)
        assert run_sync(engine, reqs) == expected
        tiers = engine.scheduler.tiers
        assert isinstance(tiers, SeeingTiers)
        seen = tiers.seen
        retractions[frozenset(protected)] = {rid: r.num_retractions for rid, r in seen.items()}
    assert retractions[frozenset()]["p2"] > 0
    assert retractions[frozenset({"p2"})]["p2"] == 0


class FailingBackupTiers(DeviceOnly):
    """`on_cached` raises once, as a broken backup path would."""

    def __init__(self, tree: RadixTree | None, pool: DeviceKVPool) -> None:
        super().__init__(tree)
        self.failures_left = 1

    def on_cached(self, req: Req, result: InsertResult) -> None:
        if self.failures_left:
            self.failures_left -= 1
            raise OSError("backup device gone")


def test_hook_failure_after_finish_still_delivers_the_final_output(tiny) -> None:
    engine = make_engine(tiny, FailingBackupTiers)
    try:
        first = engine.generate(GenerateRequest("a", list(range(5, 30)), PARAMS), 30)
        assert first[-1].finish_reason == "length" and first[-1].completion_tokens == 10
        assert engine.stats()["step_errors_total"] == 1
        second = engine.generate(GenerateRequest("b", list(range(5, 30)), PARAMS), 30)
        assert [t for o in second for t in o.new_token_ids] == \
            [t for o in first for t in o.new_token_ids]
        assert second[-1].cached.device == 24  # the failed hook came after the insert
        numbers = engine.check_accounting()
        assert numbers["requests"] == 0
    finally:
        engine.shutdown()
