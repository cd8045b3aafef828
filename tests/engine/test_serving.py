"""Engine end to end on the `tiny` preset: chunked prefill, prefix reuse across turns,
concurrency with aborts, memory pressure, stop conditions, validation and failure handling."""

from __future__ import annotations

import random
import threading
import time
from dataclasses import replace

import pytest
import torch

from pdcache.engine.api import GenerateRequest, RequestOutput, SamplingParams
from pdcache.engine.config import CacheConfig, EngineConfig
from pdcache.engine.engine import Engine, EngineNotRunningError, EngineOverloadedError
from pdcache.engine.forward import ForwardBatch
from pdcache.engine.loader import load_model
from pdcache.engine.scheduler_config import SchedulerConfig

PAGE = 4
GREEDY = SamplingParams(max_new_tokens=12, ignore_eos=True)


@pytest.fixture(scope="module")
def tiny():
    model, _ = load_model("tiny", seed=0)
    return model


class RecordingModel:
    """The real model, recording the logits it returns (and optionally failing or pausing)."""

    def __init__(self, model, fail_on_call: int | None = None) -> None:
        self.model, self.config = model, model.config
        self.logits: list[torch.Tensor] = []
        self.calls = 0
        self.fail_on_call = fail_on_call
        self.gate = threading.Event()
        self.gate.set()

    def forward(self, batch: ForwardBatch, device_kv: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        if not self.gate.wait(30):
            raise TimeoutError("test gate never opened")
        if self.calls == self.fail_on_call:
            raise RuntimeError("injected failure")
        out = self.model.forward(batch, device_kv)
        if len(out):
            self.logits.append(out.clone())
        return out


def make_engine(model, pages: int = 256, budget: int = 2048, prefix_cache: bool = True,
                **sched) -> Engine:
    config = EngineConfig(
        model=model.config,
        cache=CacheConfig(page_size=PAGE, num_device_pages=pages, enable_prefix_cache=prefix_cache),
        scheduler=SchedulerConfig(chunked_prefill_tokens=budget, **sched),
    )
    return Engine(config, model).start()


def tokens_of(outputs: list[RequestOutput]) -> list[int]:
    return [t for out in outputs for t in out.new_token_ids]


def run(engine: Engine, rid: str, prompt: list[int], params: SamplingParams = GREEDY):
    outputs = engine.generate(GenerateRequest(rid, prompt, params), timeout=60)
    assert outputs[-1].finished and sum(o.finished for o in outputs) == 1
    return tokens_of(outputs), outputs[-1]


def prompt_of(seed: int, length: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 250) for _ in range(length)]


# ---- exactness -------------------------------------------------------------------------
def test_chunked_prefill_matches_unchunked(tiny) -> None:
    prompt = prompt_of(1, 37)
    results = []
    for budget in (4096, 5):  # 5: every chunk ends mid-page (page size 4)
        model = RecordingModel(tiny)
        engine = make_engine(model, budget=budget)
        try:
            tokens, final = run(engine, "r", prompt)
            engine.check_accounting()
        finally:
            engine.shutdown()
        assert final.computed_tokens == len(prompt) and final.finish_reason == "length"
        results.append((tokens, model.logits))
    (full_tokens, full_logits), (chunked_tokens, chunked_logits) = results
    assert chunked_tokens == full_tokens and len(full_tokens) == GREEDY.max_new_tokens
    assert len(full_logits) == len(chunked_logits) == GREEDY.max_new_tokens
    for a, b in zip(full_logits, chunked_logits):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)


def test_second_turn_reuses_prompt_and_answer(tiny) -> None:
    turn1 = prompt_of(2, 45)
    engine = make_engine(tiny)
    try:
        answer, first = run(engine, "t1", turn1)
        turn2 = turn1 + answer + prompt_of(3, 7)
        tokens2, second = run(engine, "t2", turn2)
        numbers = engine.check_accounting()
        assert engine.flush_cache() == numbers["tree"] > 0
        again, third = run(engine, "t2-again", turn2)
        assert again == tokens2 and third.cached.device == 0
    finally:
        engine.shutdown()
    assert first.cached.device == 0 and first.computed_tokens == 45
    # K/V of turn 1 covers prompt + answer minus its last token; full pages of it are reused
    expected = (len(turn1) + len(answer) - 1) // PAGE * PAGE
    assert expected > len(turn1) // PAGE * PAGE  # the answer's pages count too
    assert second.cached.device == expected
    assert second.computed_tokens == len(turn2) - expected
    assert numbers["requests"] == 0 and numbers["tree"] == numbers["used"]

    reference = make_engine(tiny, prefix_cache=False)
    try:
        ref_tokens, ref_final = run(reference, "t2", turn2)
        assert reference.check_accounting()["used"] == 0
    finally:
        reference.shutdown()
    assert tokens2 == ref_tokens and ref_final.cached.device == 0


def test_mixed_concurrent_requests_with_aborts_keep_accounting(tiny) -> None:
    engine = make_engine(tiny, pages=96, budget=24, max_running_requests=6)
    shared = prompt_of(4, 20)
    cases: dict[str, tuple[list[int], SamplingParams]] = {}
    for i in range(16):
        prompt = (shared if i % 2 else []) + prompt_of(10 + i, 3 + 5 * (i % 5))
        params = [
            GREEDY,
            SamplingParams(max_new_tokens=9, temperature=0.9, seed=100 + i % 3, ignore_eos=True),
            SamplingParams(max_new_tokens=7, temperature=1.2, top_k=5, seed=7, ignore_eos=True),
            SamplingParams(max_new_tokens=10, temperature=0.8, top_p=0.6, ignore_eos=True),
        ][i % 4]
        cases[f"r{i}"] = (prompt, params)
    cases["twin-a"] = cases["twin-b"] = (shared + [9, 9], cases["r1"][1])  # same seed twice
    done = threading.Event()
    results: dict[str, list[RequestOutput]] = {rid: [] for rid in cases}

    def collector(rid: str):
        def on_output(out: RequestOutput) -> None:
            results[rid].append(out)
            if rid in ("r3", "r8") and not out.finished:
                engine.abort(rid)  # abort after the first streamed token
            if all(outs and outs[-1].finished for outs in results.values()):
                done.set()
        return on_output

    try:
        for rid, (prompt, params) in cases.items():
            engine.submit(GenerateRequest(rid, prompt, params), collector(rid))
            if rid == "r5":
                engine.abort("r5")  # abort while queued
        assert done.wait(60), "not every request finished"
        numbers = engine.check_accounting()
        stats = engine.stats()
    finally:
        engine.shutdown()
    assert numbers["free"] + numbers["used"] == numbers["capacity"]
    assert numbers["requests"] == 0 and numbers["tree"] == numbers["used"]
    assert stats["num_running"] == stats["num_waiting"] == stats["queued"] == 0
    aborted = {rid for rid, outs in results.items() if outs[-1].finish_reason == "abort"}
    assert aborted == {"r3", "r5", "r8"}
    for rid, outs in results.items():
        if rid not in aborted:
            assert len(tokens_of(outs)) == cases[rid][1].max_new_tokens, rid
            assert outs[-1].completion_tokens == cases[rid][1].max_new_tokens
    assert tokens_of(results["twin-a"]) == tokens_of(results["twin-b"])
    # greedy requests in the crowd equal the same request served alone
    solo = make_engine(tiny, prefix_cache=False)
    try:
        for rid in ("r0", "r4", "r12"):
            assert tokens_of(results[rid]) == run(solo, rid, cases[rid][0])[0], rid
    finally:
        solo.shutdown()


def test_memory_pressure_evicts_and_retracts_but_stays_exact(tiny) -> None:
    params = SamplingParams(max_new_tokens=16, ignore_eos=True)
    prompts = {f"m{i}": prompt_of(30 + i, 18 + 3 * i) for i in range(6)}
    reference = make_engine(tiny, prefix_cache=False)
    try:
        expected = {rid: run(reference, rid, p, params)[0] for rid, p in prompts.items()}
    finally:
        reference.shutdown()
    # 24 pages (96 tokens) while each request needs 9-14 pages over its life
    engine = make_engine(tiny, pages=24, budget=16)
    finished = threading.Semaphore(0)
    results: dict[str, list[RequestOutput]] = {rid: [] for rid in prompts}

    def collector(rid: str):
        def on_output(out: RequestOutput) -> None:
            results[rid].append(out)
            if out.finished:
                finished.release()
        return on_output

    try:
        for round_ in range(2):  # round 2 also hits what round 1 left in the cache
            for rid, prompt in prompts.items():
                results[rid] = []
                engine.submit(GenerateRequest(rid, prompt, params), collector(rid))
            for _ in prompts:
                assert finished.acquire(timeout=60)
            for rid in prompts:
                assert tokens_of(results[rid]) == expected[rid], (round_, rid)
        numbers = engine.check_accounting()
        stats = engine.stats()
    finally:
        engine.shutdown()
    assert stats["pages_evicted_total"] > 0 and stats["requests_retracted_total"] > 0
    assert numbers["requests"] == 0 and numbers["free"] + numbers["used"] == 24


# ---- stop conditions ---------------------------------------------------------------------
def test_stop_token_eos_and_ignore_eos(tiny) -> None:
    prompt = prompt_of(5, 21)
    engine = make_engine(tiny)
    try:
        free_run, _ = run(engine, "a", prompt)
        stop_at = free_run[3]
        index = free_run.index(stop_at)
        stopped, final = run(engine, "b", prompt, replace(GREEDY, stop_token_ids=(stop_at,)))
        assert stopped == free_run[: index + 1] and final.finish_reason == "stop"
        one, final = run(engine, "one", prompt, replace(GREEDY, max_new_tokens=1))
        assert one == free_run[:1] and final.finish_reason == "length"
        assert final.cached.device == len(prompt) // PAGE * PAGE  # earlier runs cached it
        assert engine.check_accounting()["requests"] == 0
    finally:
        engine.shutdown()
    eos_model = RecordingModel(tiny)
    eos_model.config = replace(tiny.config, eos_token_ids=(stop_at,))
    eos_engine = make_engine(eos_model)
    try:
        by_eos, final = run(eos_engine, "c", prompt, replace(GREEDY, ignore_eos=False))
        assert by_eos == free_run[: index + 1] and final.finish_reason == "stop"
        ignored, final = run(eos_engine, "d", prompt, GREEDY)
        assert ignored == free_run and final.finish_reason == "length"
    finally:
        eos_engine.shutdown()


# ---- validation and failures -----------------------------------------------------------
def test_invalid_requests_raise_clear_errors(tiny) -> None:
    engine = make_engine(tiny, pages=16)
    vocab, context = tiny.config.vocab_size, tiny.config.max_position_embeddings
    bad = {
        "empty": ([], GREEDY, "empty"),
        "vocab": ([1, vocab], GREEDY, "not an integer in"),
        "negative": ([1, -1], GREEDY, "not an integer in"),
        "float": ([1, 2.5], GREEDY, "not an integer in"),
        "bool": ([True, 2], GREEDY, "not an integer in"),
        "context": ([1] * 10, SamplingParams(max_new_tokens=context), "context length"),
        "zero": ([1, 2], SamplingParams(max_new_tokens=0), "max_new_tokens"),
        "pool": ([1] * 60, SamplingParams(max_new_tokens=5), "KV pool"),
        "top_p": ([1, 2], SamplingParams(5, temperature=1.0, top_p=0.0), "top_p"),
    }
    try:
        for rid, (prompt, params, message) in bad.items():
            with pytest.raises(ValueError, match=message):
                engine.submit(GenerateRequest(rid, prompt, params), lambda out: None)
        tokens, final = run(engine, "good", [5, 6, 7])
        assert final.finish_reason == "length" and len(tokens) == GREEDY.max_new_tokens
    finally:
        engine.shutdown()
    with pytest.raises(EngineNotRunningError):
        engine.submit(GenerateRequest("late", [1, 2], GREEDY), lambda out: None)


def test_queue_full_raises_overloaded_and_duplicate_rid_rejected(tiny) -> None:
    model = RecordingModel(tiny)
    engine = make_engine(model, max_queued_requests=3)
    outputs: list[RequestOutput] = []
    try:
        model.gate.clear()  # the engine thread blocks inside its first forward
        engine.submit(GenerateRequest("busy", [1, 2, 3], GREEDY), outputs.append)
        for _ in range(200):
            if model.calls:
                break
            threading.Event().wait(0.01)
        for i in range(3):
            engine.submit(GenerateRequest(f"q{i}", [4, 5, 6], GREEDY), outputs.append)
        with pytest.raises(EngineOverloadedError, match="queue is full"):
            engine.submit(GenerateRequest("q3", [4, 5, 6], GREEDY), outputs.append)
        with pytest.raises(ValueError, match="already in flight"):
            engine.submit(GenerateRequest("q0", [4, 5, 6], GREEDY), outputs.append)
        model.gate.set()
        for _ in range(500):
            if sum(o.finished for o in outputs) == 4:
                break
            threading.Event().wait(0.01)
        assert sum(o.finished and o.finish_reason == "length" for o in outputs) == 4
        engine.check_accounting()
    finally:
        model.gate.set()
        engine.shutdown()


def test_step_failure_aborts_batch_and_engine_survives(tiny) -> None:
    model = RecordingModel(tiny, fail_on_call=3)
    engine = make_engine(model)
    try:
        outputs = engine.generate(GenerateRequest("x", prompt_of(6, 9), GREEDY), timeout=30)
        final = outputs[-1]
        assert final.finish_reason == "abort" and "injected failure" in final.error
        assert len(tokens_of(outputs)) == 2  # prefill token + one decode before the failure
        tokens, good = run(engine, "y", prompt_of(6, 9))
        assert good.finish_reason == "length" and tokens[:2] == tokens_of(outputs)
        assert engine.stats()["step_errors_total"] == 1
        engine.check_accounting()
    finally:
        engine.shutdown()


def test_raising_callback_aborts_only_its_request(tiny) -> None:
    engine = make_engine(tiny)
    seen: list[RequestOutput] = []

    def bad_callback(out: RequestOutput) -> None:
        seen.append(out)
        if not out.finished:
            raise RuntimeError("client went away")

    try:
        engine.submit(GenerateRequest("bad", prompt_of(7, 10), GREEDY), bad_callback)
        tokens, final = run(engine, "fine", prompt_of(8, 10))
        assert final.finish_reason == "length"
        for _ in range(200):
            if seen and seen[-1].finished:
                break
            threading.Event().wait(0.01)
        assert seen[-1].finish_reason == "abort" and "callback" in seen[-1].error
        assert engine.stats()["callback_errors_total"] >= 1
        assert engine.check_accounting()["requests"] == 0
    finally:
        engine.shutdown()


def test_shutdown_aborts_unfinished_requests(tiny) -> None:
    model = RecordingModel(tiny)
    engine = make_engine(model)
    outputs: list[RequestOutput] = []
    model.gate.clear()
    engine.submit(GenerateRequest("long", prompt_of(9, 10), GREEDY), outputs.append)
    engine.submit(GenerateRequest("queued", prompt_of(10, 10), GREEDY), outputs.append)
    threading.Timer(0.2, model.gate.set).start()
    engine.shutdown(timeout=30)
    finals = {o.rid: o for o in outputs if o.finished}
    assert set(finals) == {"long", "queued"}
    assert all(o.finish_reason == "abort" for o in finals.values())
    assert engine.check_accounting()["used"] == engine.check_accounting()["tree"]


# ---- decode pacing ([scheduler] decode_step_interval_ms) --------------------------------
def _timed_run(engine: Engine, req: GenerateRequest,
               on_output=None) -> tuple[list[int], list[float]]:
    """Tokens of `req` and the monotonic time each of its outputs arrived."""
    outputs: list[RequestOutput] = []
    times: list[float] = []
    done = threading.Event()

    def collect(out: RequestOutput) -> None:
        outputs.append(out)
        times.append(time.monotonic())
        if on_output is not None:
            on_output(out)
        if out.finished:
            done.set()

    engine.submit(req, collect)
    assert done.wait(60), "request never finished"
    return tokens_of(outputs), times


class StampedModel(RecordingModel):
    """The real model, stamping the monotonic time each forward starts."""

    def __init__(self, model) -> None:
        super().__init__(model)
        self.starts: list[float] = []

    def forward(self, batch: ForwardBatch, device_kv: torch.Tensor) -> torch.Tensor:
        self.starts.append(time.monotonic())
        return super().forward(batch, device_kv)


def test_decode_pacing_spaces_decode_steps_and_keeps_the_tokens(tiny) -> None:
    """With `decode_step_interval_ms`, consecutive decode steps start at least that far apart,
    the tokens are those of an unpaced engine, and the engine counts the steps it held back;
    unpaced, it holds none back."""
    interval_ms = 150
    prompt = prompt_of(11, 9)
    params = SamplingParams(max_new_tokens=6, ignore_eos=True)
    model = StampedModel(tiny)
    paced, unpaced = make_engine(model, decode_step_interval_ms=interval_ms), make_engine(tiny)
    try:
        tokens, _ = _timed_run(paced, GenerateRequest("a", prompt, params))
        expected, _ = _timed_run(unpaced, GenerateRequest("a", prompt, params))
        paced_stats, unpaced_stats = paced.stats(), unpaced.stats()
    finally:
        paced.shutdown()
        unpaced.shutdown()
    assert tokens == expected and len(tokens) == 6
    # forward 0 is the prefill, the rest decode steps: a load-free measure of step starts
    # (the scheduling before each forward is all that separates them from the paced starts)
    decode_starts = model.starts[1:]
    gaps = [later - earlier for earlier, later in zip(decode_starts, decode_starts[1:], strict=False)]
    assert gaps and min(gaps) >= 0.8 * interval_ms / 1000, gaps
    assert paced_stats["paced_steps_total"] >= len(gaps) - 1
    assert paced_stats["paced_seconds_total"] > 0
    assert unpaced_stats["paced_steps_total"] == 0


def test_a_request_waiting_for_prefill_ends_the_pacing_wait(tiny) -> None:
    """A unified engine paced at the longest interval: a request submitted right after a
    decode step (from that step's output callback, so the wait has just begun) gets its
    first token long before the interval is up, since prefill does not wait for decode's
    pacing. Without that exit it would wait out the second."""
    interval_s = 1.0
    engine = make_engine(tiny, decode_step_interval_ms=int(interval_s * 1000))
    submitted: list[float] = []
    first_token: list[float] = []
    a_outputs: list[RequestOutput] = []
    done = threading.Event()

    def second_output(out: RequestOutput) -> None:
        a_outputs.append(out)
        if submitted or len(a_outputs) < 2:  # the first came from prefill, the second decoded
            return
        submitted.append(time.monotonic())
        engine.submit(GenerateRequest("b", prompt_of(13, 9), SamplingParams(max_new_tokens=2)),
                      on_b)

    def on_b(out: RequestOutput) -> None:
        if out.new_token_ids and not first_token:
            first_token.append(time.monotonic())
        if out.finished:
            done.set()

    try:
        _timed_run(engine, GenerateRequest("a", prompt_of(12, 9),
                                           SamplingParams(max_new_tokens=4, ignore_eos=True)),
                   on_output=second_output)
        assert done.wait(60)
    finally:
        engine.shutdown()
    assert submitted and first_token
    assert first_token[0] - submitted[0] < interval_s / 2, first_token[0] - submitted[0]
