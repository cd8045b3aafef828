"""Disaggregation primitives in one process: a prefill engine holds a finished request's pages,
their K/V is copied page by page into pages a decode engine reserved, and the decode engine
continues from the first token. Tokens must equal a unified run; accounting stays exact."""

from __future__ import annotations

import random
import threading

import pytest

from pdcache.engine.api import GenerateRequest, RequestOutput, SamplingParams
from pdcache.engine.config import CacheConfig, EngineConfig, SchedulerConfig
from pdcache.engine.engine import Engine, EngineOverloadedError
from pdcache.engine.loader import load_model
from pdcache.engine.request import Req
from pdcache.engine.scheduler import Scheduler

PAGE = 4
DECODE = SamplingParams(max_new_tokens=12, ignore_eos=True)


class HoldingScheduler(Scheduler):
    """Prefill side: keeps every finished request's pages, remembering which they are."""

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self.finished_pages: dict[str, tuple[list[int], int]] = {}

    def hold_after_finish(self, req: Req) -> bool:
        self.finished_pages[req.rid] = (list(req.page_ids), req.kv_len)
        return True


@pytest.fixture(scope="module")
def tiny():
    model, _ = load_model("tiny", seed=0)
    return model


def make_engine(model, pages: int = 128, scheduler=None) -> Engine:
    config = EngineConfig(
        model=model.config,
        cache=CacheConfig(page_size=PAGE, num_device_pages=pages),
        scheduler=SchedulerConfig(chunked_prefill_tokens=64),
    )
    return Engine(config, model, make_scheduler=scheduler).start()


def tokens_of(outputs: list[RequestOutput]) -> list[int]:
    return [t for out in outputs for t in out.new_token_ids]


def test_prefill_hold_transfer_decode_equals_unified(tiny) -> None:
    rng = random.Random(5)
    prompt = [rng.randrange(3, 250) for _ in range(29)]  # 7 full pages + a partial one
    unified = make_engine(tiny)
    prefill = make_engine(tiny, scheduler=HoldingScheduler)
    decode = make_engine(tiny, pages=64)
    try:
        expected = tokens_of(unified.generate(GenerateRequest("r", prompt, DECODE), 60))
        first = prefill.generate(GenerateRequest("r", prompt, SamplingParams(max_new_tokens=1)), 60)
        first_token = first[-1].new_token_ids[0]
        src_pages, kv_len = prefill.scheduler.finished_pages["r"]
        assert kv_len == len(prompt) and len(src_pages) == 8
        assert prefill.stats()["requests_held"] == 1
        assert prefill.check_accounting()["requests"] == 8  # held pages count as the request's

        dst_pages = decode.reserve("r", len(prompt))
        assert decode.check_accounting()["requests"] == len(dst_pages) == 8
        # the transfer: page-by-page copy of every layer's K and V
        decode.pool.device_kv[:, :, dst_pages] = prefill.pool.device_kv[:, :, src_pages]
        prefill.release_held("r")
        outputs = decode_prefilled(decode, prompt, first_token)
        assert tokens_of(outputs) == expected
        assert outputs[0].new_token_ids == [first_token]
        assert outputs[-1].completion_tokens == DECODE.max_new_tokens
        numbers = prefill.check_accounting()
        assert numbers["requests"] == 0 and numbers["tree"] == len(prompt) // PAGE
        assert decode.check_accounting()["requests"] == 0
    finally:
        for engine in (unified, prefill, decode):
            engine.shutdown()


def decode_prefilled(engine: Engine, prompt: list[int], first_token: int) -> list[RequestOutput]:
    outputs: list[RequestOutput] = []
    done = threading.Event()

    def on_output(out: RequestOutput) -> None:
        outputs.append(out)
        if out.finished:
            done.set()

    engine.submit_prefilled(GenerateRequest("r", prompt, DECODE), first_token, on_output)
    assert done.wait(60)
    return outputs


def test_reservations_fail_cleanly_and_are_always_freed(tiny) -> None:
    engine = make_engine(tiny, pages=8)
    outputs: list[RequestOutput] = []
    try:
        assert len(engine.reserve("a", 17)) == 5
        with pytest.raises(EngineOverloadedError, match="no room"):
            engine.reserve("b", 16)  # 4 pages, 3 free
        with pytest.raises(ValueError, match="already has reserved pages"):
            engine.reserve("a", 4)
        assert engine.release_reservation("a") and not engine.release_reservation("a")
        engine.reserve("c", 8)
        engine.abort("c")  # frees the reservation too
        assert engine.check_accounting()["used"] == 0
        # decoding without a reservation ends at once with a clear error
        engine.submit_prefilled(GenerateRequest("d", [1, 2, 3], DECODE), 7, outputs.append)
        engine.reserve("e", 9)
        engine.submit_prefilled(GenerateRequest("e", [1, 2, 3], DECODE), 7, outputs.append)
        numbers = engine.check_accounting()  # after both submissions were handled
        assert numbers["requests"] == 3  # e's reservation (3 pages) was not adopted
        engine.release_reservation("e")
        assert engine.check_accounting()["used"] == 0
    finally:
        engine.shutdown()
    finals = {o.rid: o for o in outputs if o.finished}
    assert "no reserved pages" in finals["d"].error
    assert "reserved 3 pages, its prompt needs 1" in finals["e"].error
    with pytest.raises(ValueError, match="vocabulary"):
        engine.submit_prefilled(GenerateRequest("f", [1], DECODE), -1, outputs.append)


def test_held_pages_freed_by_abort_and_shutdown(tiny) -> None:
    engine = make_engine(tiny, scheduler=HoldingScheduler)
    try:
        for rid in ("x", "y"):
            engine.generate(GenerateRequest(rid, list(range(5, 15)), SamplingParams(3)), 60)
        assert engine.check_accounting()["requests"] > 0
        assert engine.stats()["requests_held"] == 2
        engine.abort("x")
        engine.check_accounting()  # handled after the abort
        assert list(engine.scheduler.held) == ["y"]
    finally:
        engine.shutdown()
    numbers = engine.check_accounting()  # not running: checked in this thread
    assert numbers["requests"] == 0 and numbers["used"] == numbers["tree"]


def test_no_reservation_beside_a_stopping_engine_thread(tiny) -> None:
    """While the engine thread is still running after `shutdown()` (its join timed out), a
    `reserve` from another thread must not run the scheduler on that thread beside it (the
    thread's final drain frees pages): it is refused with EngineNotRunningError. Without the
    guard, `reserve` ran `scheduler.reserve` on the caller's thread and returned pages."""
    from pdcache.engine.engine import EngineNotRunningError

    engine = make_engine(tiny, pages=32)
    in_callback, release = threading.Event(), threading.Event()

    def block(out: RequestOutput) -> None:  # engine thread: hold it inside a callback
        in_callback.set()
        release.wait(30)

    req = GenerateRequest(rid="blocker", input_ids=[1, 2, 3], sampling=DECODE)
    engine.submit(req, block)
    assert in_callback.wait(30)
    engine.shutdown(timeout=0.05)  # stop flag set; the thread is still inside `block`
    try:
        with pytest.raises(EngineNotRunningError):
            engine.reserve("late", 8)
    finally:
        release.set()
    engine.shutdown(timeout=30)
    assert engine.check_accounting()["free"] == 32
