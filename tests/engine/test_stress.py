"""A seeded random workload driven step by step on the test's thread (`start(thread=False)`
and `Engine.step()`, so every step can be checked): submissions with shared prefixes and two salts, aborts at any
point, a pool small enough to force eviction and retraction. After every step the page
accounting must be exact; every greedy completion must equal the same request served alone."""

from __future__ import annotations

import random

import pytest

from pdcache.engine.api import GenerateRequest, RequestOutput, SamplingParams
from pdcache.engine.config import CacheConfig, EngineConfig
from pdcache.engine.engine import Engine
from pdcache.engine.loader import load_model
from pdcache.engine.scheduler_config import SchedulerConfig

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
    return Engine(config, model).start(thread=False)  # the test drives it with step()


def make_engine_unstarted(model) -> Engine:
    config = EngineConfig(model=model.config, cache=CacheConfig(page_size=PAGE, num_device_pages=22))
    return Engine(config, model)


def submit(engine: Engine, req: GenerateRequest, sink: dict[str, list[RequestOutput]]) -> None:
    sink[req.rid] = []
    engine.submit(req, sink[req.rid].append)


def run_all(engine: Engine, reqs: list[GenerateRequest]) -> dict[str, list[int]]:
    sink: dict[str, list[RequestOutput]] = {}
    for req in reqs:
        submit(engine, req, sink)
    while engine.step():
        pass
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
            engine.abort(rid)
        engine.step()
        numbers = engine.check_accounting()
        assert numbers["free"] + numbers["used"] == numbers["capacity"] == 22
    while engine.step():
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


def test_step_drives_only_a_threadless_engine_and_shutdown_aborts_the_rest(tiny) -> None:
    params = SamplingParams(max_new_tokens=6, ignore_eos=True)
    with pytest.raises(RuntimeError, match="start the engine with start"):
        make_engine_unstarted(tiny).step()
    threaded = make_engine_unstarted(tiny).start()
    try:
        with pytest.raises(RuntimeError, match="runs its own thread"):
            threaded.step()
    finally:
        threaded.shutdown()

    engine = make_engine(tiny, pages=22)
    sink: dict[str, list[RequestOutput]] = {}
    submit(engine, GenerateRequest("a", [5, 6, 7], params), sink)
    submit(engine, GenerateRequest("b", [8, 9, 10, 11], params), sink)
    assert engine.stats()["queued"] == 2 and not sink["a"]  # nothing runs until step()
    assert engine.step() and sink["a"] and not sink["a"][-1].finished
    engine.shutdown()  # on this thread: the unfinished requests end with "abort"
    assert [sink[rid][-1].finish_reason for rid in "ab"] == ["abort", "abort"]
    assert not engine.is_running and engine.check_accounting()["requests"] == 0
    with pytest.raises(RuntimeError, match="shut down"):
        engine.step()
