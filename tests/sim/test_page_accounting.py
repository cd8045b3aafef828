"""The simulator's page accounting under pressure is the engine's: the same hand-made requests
through a real `Engine` (tiny model, driven step by step) and through a simulated unified node
give the same retractions, the same evicted pages and the same cache hit of every request.

The engine's rules the node follows (pdcache/engine/scheduler.py): admission takes the
fill's pages and keeps one page free per decoding request (`_try_admit`), decode grows a
page at a time and retracts the newest running request when even eviction leaves none
(`_ensure_decode_page`, `_retract`), and a request's pages enter the tree when it releases
them (`_release(cache=True)`)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from pdcache.bench.replay_records import RequestRecord
from pdcache.bench.tokens import ReuseTracker
from pdcache.bench.traces import Session
from pdcache.config.parse import load_topology
from pdcache.engine.api import GenerateRequest, RequestOutput, SamplingParams
from pdcache.engine.config import CacheConfig, EngineConfig
from pdcache.engine.engine import Engine
from pdcache.engine.loader import load_model
from pdcache.engine.scheduler_config import SchedulerConfig
from pdcache.sim.cache import NodeCache, page_tokens
from pdcache.sim.events import EventLoop
from pdcache.sim.nodes import Cluster, SimNode
from pdcache.sim.profile import load_profile
from pdcache.sim.request import SimRequest

ROOT = Path(__file__).resolve().parents[2]
PAGE, POOL, BUDGET, RUNNING = 4, 22, 12, 5
HEAD = [7, 11, 13, 17, 19, 23, 29, 31, 37]  # a shared prefix of two full pages and a bit
# (prompt, max_new_tokens): shared heads, answers long enough to cross page boundaries
REQUESTS = [(HEAD + [40, 41, 42], 9), (HEAD + [50, 51], 12), ([60, 61, 62, 63, 64, 65], 10),
            (HEAD + [70, 71, 72, 73, 74], 8), ([80, 81, 82], 11)]
PROFILE = """
[prefill]
base_s = 0.004
per_token_s = 2e-5
per_token_context_s = 1e-9
[decode]
base_s = 0.005
per_request_s = 1e-4
per_context_token_s = 1e-8
[transfer]
bandwidth_Bps = 1e9
per_room_s = 0.001
[host]
h2d_bandwidth_Bps = 1e10
d2h_bandwidth_Bps = 1e10
[storage]
read_bandwidth_Bps = 1e9
write_bandwidth_Bps = 1e9
node_nic_Bps = 1e9
op_latency_s = 0.0005
metadata_op_s = 0.0002
"""


Wave = list[tuple[list[int], int]]


def second_wave(answers: dict[str, list[int]]) -> Wave:
    """Follow-up turns sent once the first wave is done: the first prompt with its answer
    and more (a multi-turn hit through answer pages), the shared head again, a new one."""
    first = REQUESTS[0][0] + answers["r0"] + [90, 91, 92]
    return [(first, 6), (HEAD + [95, 96, 97, 98], 7), (REQUESTS[2][0] + answers["r2"][:3], 5),
            ([100, 101, 102, 103, 104], 9)]


def run_engine(pool: int) -> tuple[dict[str, int], dict[str, int], dict[str, list[int]]]:
    """The real engine, one wave after the other: its retractions and evicted pages, each
    request's cached tokens and answer."""
    model, _ = load_model("tiny", seed=0)
    config = EngineConfig(
        model=model.config, cache=CacheConfig(page_size=PAGE, num_device_pages=pool),
        scheduler=SchedulerConfig(chunked_prefill_tokens=BUDGET, max_running_requests=RUNNING))
    engine = Engine(config, model).start(thread=False)
    sink: dict[str, list[RequestOutput]] = {}

    def play(wave: Wave, first: int) -> None:
        for i, (prompt, max_new) in enumerate(wave, start=first):
            sink[f"r{i}"] = []
            engine.submit(GenerateRequest(f"r{i}", prompt, SamplingParams(
                max_new_tokens=max_new, ignore_eos=True, temperature=0.0)),
                sink[f"r{i}"].append)
        while engine.step():
            engine.check_accounting()

    play(REQUESTS, 0)
    answers = {rid: [t for out in outs for t in out.new_token_ids] for rid, outs in sink.items()}
    play(second_wave(answers), len(REQUESTS))
    stats = engine.stats()
    cached = {rid: outs[-1].cached.device for rid, outs in sink.items()}
    answers = {rid: [t for out in outs for t in out.new_token_ids] for rid, outs in sink.items()}
    return ({"retracted": stats["requests_retracted_total"],
             "evicted": stats["pages_evicted_total"]}, cached, answers)


def run_sim(pool: int, answers: dict[str, list[int]], profile: Path
            ) -> tuple[dict[str, int], dict[str, int]]:
    """The same requests (with the engine's answers) on one simulated unified node with the
    same pool and budgets, one wave after the other."""
    topology = load_topology(ROOT / "configs" / "unified.toml", [
        "model.preset=tiny", "storage.backend=none", f"cache.page_size={PAGE}",
        f"cache.device_pages={pool}", "cache.host_pages=0",
        f"scheduler.chunked_prefill_tokens={BUDGET}",
        f"scheduler.max_running_requests={RUNNING}"])
    (spec,) = topology.nodes
    loop = EventLoop()
    node: SimNode | None = None

    def released(_: str) -> None:
        assert node is not None
        node.kick()

    cluster = Cluster(loop, load_profile(profile), 1, None, None,
                      lambda req: None, lambda req: None, released)
    cache = NodeCache(spec.name, spec.cache, 0, loop.clock, None, loop.at)
    node = SimNode(spec, cache, cluster)
    tracker = ReuseTracker(PAGE)
    requests: list[SimRequest] = []

    def play(wave: Wave, first: int) -> None:
        assert node is not None
        for i, (prompt, max_new) in enumerate(wave, start=first):
            keys = tracker.keys(prompt)
            full = np.array(prompt + answers[f"r{i}"])
            answer_keys = tracker.extend_keys(keys, full[:-1])
            req = SimRequest(RequestRecord(f"r{i}", "s", 0), Session("s", ()), 0,
                             None, len(prompt), max_new, keys,  # type: ignore[arg-type]
                             page_tokens(keys), page_tokens(answer_keys), loop.now, PAGE)
            requests.append(req)
            node.submit_prefill(req)
        loop.run()

    play(REQUESTS, 0)
    play(second_wave(answers), len(REQUESTS))
    assert all(req.finished for req in requests)
    cache.check(idle=True)
    cached = {req.rec.request_id: req.rec.cached_device for req in requests}
    return ({"retracted": node.retracted, "evicted": cache.tree.num_evicted_pages}, cached)


@pytest.mark.filterwarnings("ignore")
@pytest.mark.parametrize("pool", [14, 16, 18])
def test_pressure_retractions_evictions_and_hits_are_the_engines(pool: int,
                                                                  tmp_path: Path) -> None:
    profile = tmp_path / "profile.toml"
    profile.write_text(PROFILE)
    engine_counts, engine_cached, answers = run_engine(pool)
    sim_counts, sim_cached = run_sim(pool, answers, profile)
    assert engine_counts["retracted"] > 0 and engine_counts["evicted"] > 0  # under pressure
    assert sim_counts == engine_counts
    assert sim_cached == engine_cached
