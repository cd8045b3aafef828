"""Disaggregation primitives in one process: a prefill engine holds a finished request's pages,
their K/V is copied page by page into pages a decode engine reserved, and the decode engine
continues from the first token. Tokens must equal a unified run; accounting stays exact."""

from __future__ import annotations

import functools
import random
import threading
from concurrent.futures import TimeoutError as FutureTimeout

import pytest

from pdcache.engine.api import GenerateRequest, RequestOutput, SamplingParams
from pdcache.engine.config import CacheConfig, EngineConfig
from pdcache.engine.engine import Engine, EngineNotRunningError, EngineOverloadedError
from pdcache.engine.loader import load_model
from pdcache.engine.request import Req
from pdcache.engine.roles import RolePolicy, Unified
from pdcache.engine.scheduler import Scheduler
from pdcache.engine.scheduler_config import SchedulerConfig
from tests.polling import poll

PAGE = 4
DECODE = SamplingParams(max_new_tokens=12, ignore_eos=True)


class HoldingRole(Unified):
    """Prefill side: keeps every finished request's pages, remembering which they are."""

    def __init__(self) -> None:
        self.finished_pages: dict[str, tuple[list[int], int]] = {}

    def hold_after_finish(self, req: Req) -> bool:
        self.finished_pages[req.rid] = (list(req.page_ids), req.kv_len)
        return True


@pytest.fixture(scope="module")
def tiny():
    model, _ = load_model("tiny", seed=0)
    return model


def make_engine(model, pages: int = 128, role: RolePolicy | None = None) -> Engine:
    config = EngineConfig(
        model=model.config,
        cache=CacheConfig(page_size=PAGE, num_device_pages=pages),
        scheduler=SchedulerConfig(chunked_prefill_tokens=64),
    )
    return Engine(config, model, make_scheduler=functools.partial(Scheduler, role=role)).start()


def tokens_of(outputs: list[RequestOutput]) -> list[int]:
    return [t for out in outputs for t in out.new_token_ids]


def test_a_reserve_that_timed_out_frees_its_pages(tiny) -> None:
    """`reserve` gave up waiting for a busy engine thread, which took the pages later: the
    caller never learnt them and nobody released them (a leak, found by review)."""
    engine = make_engine(tiny, pages=8)
    busy, go = threading.Event(), threading.Event()

    def hold_the_engine_thread(admission) -> None:  # an `on_done` runs on the engine thread
        busy.set()
        go.wait(30)

    try:
        assert len(engine.reserve("kept", 4)) == 1
        engine.reserve_when_free("held", 4, hold_the_engine_thread)  # 1 page
        assert busy.wait(30)
        with pytest.raises(FutureTimeout):
            engine.reserve("late", 9, timeout=0.05)  # 3 pages, taken once the thread is free
        with pytest.raises(FutureTimeout):  # refused once it runs ("kept" has pages): the
            engine.reserve("kept", 9, timeout=0.05)  # release queued behind it spares them
        go.set()
        numbers = engine.check_accounting()  # after the queued calls ran
        assert numbers["used"] == 2, numbers  # "held" and "kept": "late"'s 3 pages came back
        assert engine.release_reservation("kept") and not engine.release_reservation("late")
    finally:
        go.set()
        engine.shutdown()


def test_prefill_hold_transfer_decode_equals_unified(tiny) -> None:
    rng = random.Random(5)
    prompt = [rng.randrange(3, 250) for _ in range(29)]  # 7 full pages + a partial one
    unified = make_engine(tiny)
    prefill = make_engine(tiny, role=HoldingRole())
    decode = make_engine(tiny, pages=64)
    try:
        expected = tokens_of(unified.generate(GenerateRequest("r", prompt, DECODE), 60))
        first = prefill.generate(GenerateRequest("r", prompt, SamplingParams(max_new_tokens=1)), 60)
        first_token = first[-1].new_token_ids[0]
        src_pages, kv_len = prefill.scheduler.role.finished_pages["r"]
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


def decode_prefilled(engine: Engine, prompt: list[int], first_token: int,
                     rid: str = "r") -> list[RequestOutput]:
    outputs: list[RequestOutput] = []
    done = threading.Event()

    def on_output(out: RequestOutput) -> None:
        outputs.append(out)
        if out.finished:
            done.set()

    engine.submit_prefilled(GenerateRequest(rid, prompt, DECODE), first_token, on_output)
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
        # e's reservation (3 pages) was not adopted: the refusal freed it (nobody else would:
        # the decode controller handed the room to the engine)
        assert numbers["requests"] == 0 and numbers["used"] == 0
        assert not engine.release_reservation("e")
    finally:
        engine.shutdown()
    finals = {o.rid: o for o in outputs if o.finished}
    assert "no reserved pages" in finals["d"].error
    assert "reserved 3 pages, its prompt needs 1" in finals["e"].error
    with pytest.raises(ValueError, match="vocabulary"):
        engine.submit_prefilled(GenerateRequest("f", [1], DECODE), -1, outputs.append)


def test_held_pages_freed_by_abort_and_shutdown(tiny) -> None:
    engine = make_engine(tiny, role=HoldingRole())
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


# ---- the admission queue: reservations that wait for pages (decode nodes) -------------------

def driven_engine(model, pages: int, max_pending: int) -> Engine:
    config = EngineConfig(model.config, CacheConfig(page_size=PAGE, num_device_pages=pages),
                          SchedulerConfig(chunked_prefill_tokens=64,
                                          max_pending_reservations=max_pending))
    return Engine(config, model).start(thread=False)


def test_admission_queue_grants_in_arrival_order_as_pages_free(tiny) -> None:
    # Protections, each failing here when off: FIFO (without `not self.pending` in
    # queue_reservation, "c" — 3 pages, they are free — is granted before "b"); the bound (without
    # the max_pending_reservations check "d" queues); the growth headroom (without
    # `growth_headroom()` in _grant, "c" is granted with "b", leaving "b" no page to decode).
    engine = driven_engine(tiny, pages=8, max_pending=2)
    answers: dict[str, object] = {}
    order: list[str] = []

    def on_done(admission) -> None:
        assert admission.rid not in answers, f"{admission.rid} answered twice"
        answers[admission.rid] = admission
        order.append(admission.rid)

    engine.reserve_when_free("a", 17, on_done)  # 5 of 8 pages
    engine.reserve_when_free("b", 20, on_done, max_new_tokens=4)  # 5 pages + 1 to decode
    engine.reserve_when_free("c", 12, on_done)  # 3 pages: fits now, but waits behind "b"
    engine.reserve_when_free("d", 4, on_done)  # the queue holds 2
    engine.step()
    assert order == ["a", "d"] and answers["a"].ok and not answers["a"].queued
    assert answers["d"].reason == "queue_full" and answers["d"].page_ids is None
    assert engine.stats()["reservations_pending"] == 2
    with pytest.raises(ValueError, match="pool holds 8 pages"):
        engine.reserve_when_free("x", 30, on_done, max_new_tokens=4)  # 9 pages: never fits
    assert engine.check_accounting()["requests"] == 5
    assert engine.release_reservation("a")
    engine.step()
    assert order == ["a", "d", "b"]  # b takes 5 and keeps 1 for its decode: c (3) waits
    assert answers["b"].queued and answers["b"].waited_s > 0 and len(answers["b"].page_ids) == 5
    assert engine.check_accounting()["requests"] == 5
    engine.submit_prefilled(GenerateRequest("b", [5] * 20, SamplingParams(4, ignore_eos=True)),
                            7, lambda out: None)
    while engine.step():
        pass
    assert order == ["a", "d", "b", "c"] and answers["c"].ok  # b finished: its pages freed
    engine.release_reservation("c")
    assert engine.check_accounting()["requests"] == 0  # (b's full pages are in the tree)
    engine.shutdown()


def test_admission_queue_of_zero_refuses_what_must_wait(tiny) -> None:
    """`max_pending_reservations = 0`: a reservation that fits is granted, one that would
    have to wait for pages is refused at once (`queue_full`), nothing queues."""
    engine = driven_engine(tiny, pages=8, max_pending=0)
    answers: dict[str, object] = {}
    engine.reserve_when_free("a", 17, lambda a: answers.setdefault(a.rid, a))  # 5 of 8 pages
    engine.reserve_when_free("b", 20, lambda a: answers.setdefault(a.rid, a))  # 5: must wait
    engine.step()
    assert answers["a"].ok and answers["b"].reason == "queue_full"
    assert engine.stats()["reservations_pending"] == 0
    engine.release_reservation("a")
    assert engine.check_accounting()["requests"] == 0
    engine.shutdown()


def test_admission_keeps_room_for_a_bounded_part_of_each_answer(tiny) -> None:
    """A client without `max_tokens` asks for the whole context. Keeping room for all of it
    would admit one such request at a time; an admission keeps room for
    `decode_reserve_tokens` of it. Without the bound, "a" keeps 5 + 10 of the 16 pages and "b"
    waits behind it. A whole answer that can never fit the pool is still refused at once (what
    `submit_prefilled` would refuse after prefill had computed it)."""
    config = EngineConfig(tiny.config, CacheConfig(page_size=PAGE, num_device_pages=16),
                          SchedulerConfig(chunked_prefill_tokens=64, decode_reserve_tokens=8))
    engine = Engine(config, tiny).start(thread=False)
    answers: dict[str, object] = {}
    for rid in ("a", "b"):
        engine.reserve_when_free(rid, 20, lambda a: answers.setdefault(a.rid, a),
                                 max_new_tokens=40)  # 60 of the pool's 64 tokens
    engine.step()
    assert answers["a"].ok and answers["b"].ok  # 5 + 2 pages each: both fit 16 at once
    assert not answers["b"].queued
    with pytest.raises(ValueError, match="pool holds 16 pages"):
        engine.reserve_when_free("c", 20, print, max_new_tokens=8000)
    engine.submit_prefilled(GenerateRequest("a", [5] * 20, SamplingParams(40, ignore_eos=True)),
                            7, lambda out: None)  # what was granted starts decoding
    engine.release_reservation("b")
    while engine.step():
        pass
    assert engine.check_accounting()["requests"] == 0
    engine.shutdown()


def test_queued_reservations_leave_on_cancel_abort_and_shutdown(tiny) -> None:
    engine = driven_engine(tiny, pages=4, max_pending=8)
    answers: dict[str, object] = {}
    for rid in ("hog", "q1", "q2", "q3"):
        engine.reserve_when_free(rid, 16, lambda a: answers.setdefault(a.rid, a))
    engine.step()
    assert answers["hog"].ok and set(answers) == {"hog"}
    engine.cancel_reservation("q1")
    engine.abort("q2")
    engine.step()
    assert answers["q1"].reason == answers["q2"].reason == "cancelled"
    assert engine.stats()["reservations_pending"] == 1
    engine.cancel_reservation("hog")  # granted pages are not the queue's: untouched
    engine.step()
    assert engine.check_accounting()["requests"] == 4
    engine.shutdown()
    assert answers["q3"].reason == "shutdown"
    assert engine.check_accounting()["requests"] == 0
    with pytest.raises(EngineNotRunningError):
        engine.reserve_when_free("late", 4, print)


def test_decode_prefix_cache_reuses_a_finished_turn_and_keeps_it_locked(tiny) -> None:
    """Decode's prefix cache (docs/design.md §4.12): turn 2's reservation takes turn 1's
    pages (prompt + answer K/V) from the tree, prefill writes only the rest, and the tokens
    equal a unified run. The reused pages stay locked until the reservation goes: without the
    lock, the eviction that the second reservation needs takes them (checked below)."""
    rng = random.Random(11)
    prompt = [rng.randrange(3, 250) for _ in range(29)]
    unified = make_engine(tiny)
    prefill = make_engine(tiny, role=HoldingRole())
    decode = make_engine(tiny, pages=40)
    try:
        answer = _prefill_and_decode(prefill, decode, "t1", prompt, 0)
        assert answer == tokens_of(unified.generate(GenerateRequest("u1", prompt, DECODE), 60))
        prompt2 = prompt + answer + [rng.randrange(3, 250) for _ in range(9)]  # 50 tokens
        kept = (len(prompt) + len(answer) - 1) // PAGE  # turn 1's K/V: every token but the last
        assert decode.stats()["cached_pages"] == kept == 10
        grant = _reserve(decode, "t2", prompt2)
        assert grant.cached_pages == kept and len(grant.page_ids) == 13 - kept
        assert decode.stats()["tokens_reserved_from_cache_total"] == kept * PAGE
        other_tenant = _reserve(decode, "x", prompt2, salt="tenant/b")
        assert other_tenant.cached_pages == 0  # another salt never matches
        decode.release_reservation("x")
        # one page more than is free: only evicting turn 2's reused prefix could give it,
        # and that prefix is locked, so it waits in the queue until cancelled
        answers: list = []
        free = decode.check_accounting()["free"]
        decode.reserve_when_free("big", (free + 1) * PAGE, answers.append)
        assert poll(lambda: decode.stats()["reservations_pending"] == 1)
        decode.cancel_reservation("big")
        assert poll(lambda: bool(answers)) and answers[0].reason == "cancelled"
        assert decode.stats()["cached_pages"] == kept and decode.stats()["pages_evictable"] == 0
        expected = tokens_of(unified.generate(GenerateRequest("u2", prompt2, DECODE), 60))
        assert _prefill_and_decode(prefill, decode, "t2", prompt2, kept, grant) == expected
        numbers = decode.check_accounting()
        assert numbers["requests"] == 0 and numbers["tree"] == numbers["used"]
    finally:
        for engine in (unified, prefill, decode):
            engine.shutdown()


def test_decode_prefix_cache_refuses_a_request_of_another_salt(tiny) -> None:
    """A request submitted on a reservation whose prefix the tree matched under another salt
    is refused (its release would file the tree's pages under that salt: one page in two
    nodes) and the reservation is freed; without the check it decodes and the tree breaks."""
    rng = random.Random(12)
    prompt = [rng.randrange(3, 250) for _ in range(29)]
    prefill = make_engine(tiny, role=HoldingRole())
    decode = make_engine(tiny, pages=40)
    try:
        answer = _prefill_and_decode(prefill, decode, "t1", prompt, 0)
        prompt2 = prompt + answer + [5, 6, 7]
        assert _reserve(decode, "t2", prompt2).cached_pages > 0
        outputs: list[RequestOutput] = []
        done = threading.Event()

        def on_output(out: RequestOutput) -> None:
            outputs.append(out)
            done.set()

        decode.submit_prefilled(GenerateRequest("t2", prompt2, DECODE, cache_salt="tenant/b"),
                                7, on_output)
        assert done.wait(30) and outputs[-1].finish_reason == "abort"
        assert "not the prompt its pages were reserved for" in (outputs[-1].error or "")
        numbers = decode.check_accounting()  # the tree's check passes, nothing reserved
        assert numbers["requests"] == 0 and decode.stats()["pages_evictable"] == numbers["tree"]
    finally:
        prefill.shutdown()
        decode.shutdown()


def _reserve(engine: Engine, rid: str, prompt: list[int], salt: str = ""):
    answers: list = []
    done = threading.Event()

    def on_done(admission) -> None:
        answers.append(admission)
        done.set()

    engine.reserve_when_free(rid, len(prompt), on_done, prefix_ids=prompt, salt=salt)
    assert done.wait(30)
    return answers[0]


def _prefill_and_decode(prefill: Engine, decode: Engine, rid: str, prompt: list[int],
                        cached_pages: int, grant=None) -> list[int]:
    """Prefill `prompt`, copy its pages from `cached_pages` on into decode's reservation (as
    the transfer does), decode; the answer's tokens."""
    first = prefill.generate(GenerateRequest(rid, prompt, SamplingParams(max_new_tokens=1)), 60)
    src_pages, _ = prefill.scheduler.role.finished_pages[rid]
    grant = grant or _reserve(decode, rid, prompt)
    assert grant.ok and grant.cached_pages == cached_pages
    decode.pool.device_kv[:, :, grant.page_ids] = prefill.pool.device_kv[:, :, src_pages[cached_pages:]]
    prefill.release_held(rid)
    return tokens_of(decode_prefilled(decode, prompt, first[-1].new_token_ids[0], rid))
