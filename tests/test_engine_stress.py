"""A seeded random workload driven step by step on the engine's own thread logic (not started,
so every step can be checked): submissions with shared prefixes and two salts, aborts at any
point, a pool small enough to force eviction and retraction. After every step the page
accounting must be exact; every greedy completion must equal the same request served alone."""

from __future__ import annotations

import random

import pytest

from pdcache.engine.api import GenerateRequest, RequestOutput, SamplingParams
from pdcache.engine.config import CacheConfig, EngineConfig, SchedulerConfig
from pdcache.engine.engine import Engine, _Abort, _Submit
from pdcache.engine.loader import load_model

PAGE = 4


@pytest.fixture(scope="module")
def tiny():
    model, _ = load_model("tiny", seed=0)
    return model


def make_engine(model, pages: int, prefix_cache: bool = True) -> Engine:
    config = EngineConfig(
        model=model.config,
        cache=CacheConfig(page_size=PAGE, num_device_pages=pages, enable_prefix_cache=prefix_cache),
        scheduler=SchedulerConfig(chunked_prefill_tokens=12, max_running_requests=5),
    )
    return Engine(config, model)  # never started: the test drives it


def submit(engine: Engine, req: GenerateRequest, sink: dict[str, list[RequestOutput]]) -> None:
    sink[req.rid] = []
    engine._handle(_Submit(engine._new_req(req, sink[req.rid].append, engine._generator_for(req))))


def run_all(engine: Engine, reqs: list[GenerateRequest]) -> dict[str, list[int]]:
    sink: dict[str, list[RequestOutput]] = {}
    for req in reqs:
        submit(engine, req, sink)
    while engine.scheduler.has_work():
        engine._step()
    return {rid: [t for out in outs for t in out.new_token_ids] for rid, outs in sink.items()}


def test_random_workload_keeps_accounting_exact_every_step(tiny) -> None:
    rng = random.Random(11)
    heads = [[rng.randrange(3, 250) for _ in range(n)] for n in (9, 14, 20)]
    engine = make_engine(tiny, pages=22)
    sink: dict[str, list[RequestOutput]] = {}
    requests: dict[str, GenerateRequest] = {}
    aborted: set[str] = set()
    for step in range(100):
        if step < 80 and rng.random() < 0.4:
            prompt = rng.choice(heads) + [rng.randrange(3, 250) for _ in range(rng.randrange(1, 9))]
            greedy = rng.random() < 0.6
            params = SamplingParams(
                max_new_tokens=rng.randrange(1, 10), ignore_eos=True,
                temperature=0.0 if greedy else 0.9, top_k=-1 if greedy else 20, seed=step,
            )
            req = GenerateRequest(f"s{step}", prompt, params, cache_salt=rng.choice(["", "b"]))
            requests[req.rid] = req
            submit(engine, req, sink)
        if rng.random() < 0.08 and requests:
            rid = rng.choice(list(requests))
            if not (sink[rid] and sink[rid][-1].finished):
                aborted.add(rid)
            engine._handle(_Abort(rid))
        engine._step()
        numbers = engine.check_accounting()
        assert numbers["free"] + numbers["used"] == numbers["capacity"] == 22
    while engine.scheduler.has_work():
        engine._step()
        engine.check_accounting()
    stats = engine.stats()
    assert stats["pages_evicted_total"] > 0 and stats["requests_retracted_total"] > 0
    assert engine.check_accounting()["requests"] == 0

    greedy: list[GenerateRequest] = []
    for rid, req in requests.items():
        outputs = sink[rid]
        assert sum(o.finished for o in outputs) == 1 and outputs[-1].finished
        if rid in aborted:
            continue
        assert sum(len(o.new_token_ids) for o in outputs) == req.sampling.max_new_tokens
        if req.sampling.greedy:
            greedy.append(req)
    assert len(greedy) >= 10
    # the same requests in a roomy pool without cache: no eviction, no retraction, no reuse
    expected = run_all(make_engine(tiny, pages=256, prefix_cache=False), greedy)
    for req in greedy:
        assert [t for o in sink[req.rid] for t in o.new_token_ids] == expected[req.rid], req.rid
