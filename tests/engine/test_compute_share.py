"""Compute share ([scheduler] compute_share, docs/design.md §4.13): engines that share compute
order their work as one unified engine does, decode steps after prefill batches."""

from __future__ import annotations

import errno
import fcntl
import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from pdcache.engine.api import GenerateRequest, RequestOutput, SamplingParams
from pdcache.engine.compute_share import ComputeShare
from pdcache.engine.engine import Engine
from pdcache.engine.forward import ForwardBatch, ForwardMode
from pdcache.engine.reservations import Admission
from tests.engine.test_serving import make_engine, prompt_of, tokens_of
from tests.transfer_support import scaled_limit, wait_until

PARAMS = SamplingParams(max_new_tokens=4, ignore_eos=True)


@pytest.fixture(scope="module")
def tiny():
    from pdcache.engine.loader import load_model

    model, _ = load_model("tiny", seed=0)
    return model


@pytest.fixture
def share_path(tmp_path: Path) -> str:
    return str(tmp_path / "host" / "compute.share")  # its directory is created on open


# ---- the share itself ---------------------------------------------------------------------
def test_an_announcement_is_seen_by_other_engines_only_while_it_lasts(share_path) -> None:
    prefill, decode = ComputeShare(share_path), ComputeShare(share_path)
    try:
        assert not decode.others_busy()
        prefill.announce(True)
        prefill.announce(True)  # unchanged: no second announcement
        assert decode.others_busy() and decode.others_busy()
        assert not prefill.others_busy()  # its own announcement is not "another engine"
        assert not prefill.announcing  # probing dropped it: a prober computes no prefill
        assert not decode.others_busy()
        prefill.announce(True)
        assert decode.others_busy()
        prefill.announce(False)
        assert not decode.others_busy()
        stats = prefill.stats()
    finally:
        prefill.close()
        decode.close()
        prefill.close()  # idempotent
    assert stats["compute_share_announcements_total"] == 2
    assert stats["compute_share_misses_total"] == 0
    assert Path(share_path).stat().st_mode & 0o777 == 0o600


def test_an_announcement_never_blocks_behind_a_probe(share_path) -> None:
    """A probe holds the exclusive lock for two system calls; an announcement that meets it
    (here: one that never lets go) gives up after a few tries, counts a miss and is taken at
    the next call, so a prefill engine never waits on a decode engine."""
    prefill = ComputeShare(share_path)
    stuck = os.open(share_path, os.O_RDWR)
    try:
        fcntl.flock(stuck, fcntl.LOCK_EX)
        started = time.monotonic()
        prefill.announce(True)
        took = time.monotonic() - started
        assert not prefill.announcing and prefill.stats()["compute_share_misses_total"] == 1
        fcntl.flock(stuck, fcntl.LOCK_UN)
        prefill.announce(True)
        assert prefill.announcing
    finally:
        os.close(stuck)
        prefill.close()
    assert took < scaled_limit(0.5)


def test_a_killed_announcer_holds_decode_back_no_more(share_path) -> None:
    """The kernel drops a dead process's flock with its file descriptor: a crashed prefill
    node leaves nothing for decode nodes to wait on."""
    code = ("import sys, time\n"
            "from pdcache.engine.compute_share import ComputeShare\n"
            "share = ComputeShare(sys.argv[1]); share.announce(True)\n"
            "print('announced', flush=True); time.sleep(120)\n")
    child = subprocess.Popen([sys.executable, "-c", code, share_path], stdout=subprocess.PIPE,
                             text=True)
    probe = ComputeShare(share_path)
    try:
        assert child.stdout is not None and child.stdout.readline().strip() == "announced"
        assert probe.others_busy()
        child.kill()
        child.wait(timeout=scaled_limit(10))
        assert not probe.others_busy()
    finally:
        child.kill()
        probe.close()


def test_a_share_that_cannot_be_opened_names_the_key(tmp_path: Path) -> None:
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("")
    with pytest.raises(OSError, match=r"compute_share"):
        ComputeShare(blocker / "compute.share")


def test_a_failing_flock_turns_the_share_off_instead_of_stalling(share_path, monkeypatch) -> None:
    """A lock call that fails other than "held" (a filesystem without flock) is counted and
    turns the share off: announcing and probing go on without raising, holding nothing. A
    file that takes no lock at all is refused when the share opens, naming the key."""
    share = ComputeShare(share_path)

    def no_locks(fd: int, operation: int) -> None:
        raise OSError(errno.ENOLCK, "No locks available")

    monkeypatch.setattr(fcntl, "flock", no_locks)
    try:
        share.announce(True)
        assert not share.announcing and not share.others_busy()
        share.announce(True)
        assert share.stats()["compute_share_errors_total"] == 1
        with pytest.raises(OSError, match="compute_share"):
            ComputeShare(share_path)
    finally:
        share.close()


def test_a_closed_share_refuses_use(share_path) -> None:
    share = ComputeShare(share_path)
    share.close()
    with pytest.raises(RuntimeError, match="closed"):
        share.others_busy()


# ---- the engine's side ----------------------------------------------------------------------
class ProbingModel:
    """The real model; each forward records its mode and what a probe of the share saw."""

    def __init__(self, model, share_path: str) -> None:
        self.model, self.config = model, model.config
        self.probe = ComputeShare(share_path)
        self.seen: list[tuple[ForwardMode, bool]] = []

    def forward(self, batch: ForwardBatch, device_kv: torch.Tensor) -> torch.Tensor:
        self.seen.append((batch.mode, self.probe.others_busy()))
        return self.model.forward(batch, device_kv)


@pytest.mark.parametrize("shared", [True, False])
def test_an_engine_announces_exactly_while_it_computes_prefill(tiny, share_path, shared) -> None:
    """A probe inside every forward sees the engine's announcement during each of its prefill
    chunks (30 prompt tokens, 8 a chunk: the later ones run with nothing queued) and not
    during its decode steps; once the engine idles the announcement is gone. Without
    `compute_share` nothing is announced."""
    model = ProbingModel(tiny, share_path)
    probe = ComputeShare(share_path)
    engine = make_engine(model, budget=8, compute_share=share_path if shared else None)
    try:
        outputs = engine.generate(GenerateRequest("a", prompt_of(21, 30), PARAMS), timeout=60)
        assert outputs[-1].finished
        wait_until(lambda: not probe.others_busy(), 5, "the idle engine to drop its announcement")
        stats = engine.stats()
    finally:
        engine.shutdown()
        model.probe.close()
        probe.close()
    modes = [mode for mode, _ in model.seen]
    assert modes == [ForwardMode.EXTEND] * 4 + [ForwardMode.DECODE] * 3
    seen = [busy for _, busy in model.seen]
    assert seen == ([True] * 4 + [False] * 3 if shared else [False] * 7)
    # announced from the queued request through its last chunk, once
    assert stats.get("compute_share_announcements_total", 0) == (1 if shared else 0)


def _first_and_rest(engine: Engine, req: GenerateRequest, on_first: Callable[[], None]) -> list[int]:
    """Tokens of `req`; `on_first()` runs on the engine thread when its first token (the
    prefill's) arrives."""
    outputs: list[RequestOutput] = []
    done = threading.Event()

    def collect(out: RequestOutput) -> None:
        outputs.append(out)
        if len(outputs) == 1:
            on_first()
        if out.finished:
            done.set()

    engine.submit(req, collect)
    assert done.wait(60), "request never finished"
    return tokens_of(outputs)


def _decode_beside_an_announcement(tiny, share_path: str, req: GenerateRequest, hold_s: float,
                                   shared: bool) -> tuple[list[int], int, dict]:
    """Runs `req` while another engine announces from `req`'s first token (its prefill): for
    `hold_s` with the share, or until this engine has decoded (bounded) without it. Returns
    the tokens, this engine's steps when the announcement ended, its stats."""
    prefill = ComputeShare(share_path)
    engine = make_engine(tiny, compute_share=share_path if shared else None,
                         decode_yield_max_ms=10_000)  # far beyond hold_s: only the release ends it
    steps_at_release: list[int] = []

    def release() -> None:
        if shared:
            time.sleep(hold_s)
        else:
            wait_until(lambda: engine.stats()["steps_total"] >= 2, 10, "a decode step")
        steps_at_release.append(engine.stats()["steps_total"])
        prefill.announce(False)

    releaser = threading.Thread(target=release)

    def announce() -> None:  # on the engine thread, before it looks at the share again
        prefill.announce(True)
        releaser.start()

    try:
        tokens = _first_and_rest(engine, req, announce)
        releaser.join(scaled_limit(30))
        return tokens, steps_at_release[0], engine.stats()
    finally:
        engine.shutdown()
        prefill.close()


def test_decode_steps_wait_while_another_engine_computes_prefill(tiny, share_path) -> None:
    """While another engine announces, this engine's decode steps are held (at most
    `decode_yield_max_ms`, here far longer than the announcement); after it ends they run,
    and the tokens are those of an engine without a share. Without the share
    (`compute_share` unset) the same request decodes through the announcement."""
    hold_s = 0.3
    req = GenerateRequest("a", prompt_of(22, 30), PARAMS)
    reference = make_engine(tiny)
    try:
        expected = tokens_of(reference.generate(req, timeout=60))
    finally:
        reference.shutdown()
    tokens, steps, stats = _decode_beside_an_announcement(tiny, share_path, req, hold_s, True)
    assert tokens == expected
    assert steps == 1  # only the prefill step ran before the release; every decode step after
    assert stats["yielded_steps_total"] >= 1
    assert stats["yielded_seconds_total"] >= 0.5 * hold_s
    tokens, steps, stats = _decode_beside_an_announcement(tiny, share_path, req, hold_s, False)
    assert tokens == expected
    assert steps >= 2 and stats["yielded_steps_total"] == 0


class _HeldEngine:
    """A threaded engine decoding request "a" (4 tokens) while another engine announces from
    its `hold_from`-th token on, with a bound far beyond any test: only the test's `release()`
    (or the engine's own reasons to stop holding) lets its decode steps run."""

    def __init__(self, model: Any, share_path: str, pages: int = 256, hold_from: int = 1) -> None:
        self.prefill = ComputeShare(share_path)
        self.engine = make_engine(model, pages=pages, compute_share=share_path,
                                  decode_yield_max_ms=10_000)
        self.held = threading.Event()
        self.done = threading.Event()
        self.tokens: list[int] = []

        def collect(out: RequestOutput) -> None:
            self.tokens.extend(out.new_token_ids)
            if not self.held.is_set() and len(self.tokens) >= hold_from:
                self.prefill.announce(True)  # on the engine thread, before it looks again
                self.held.set()
            if out.finished:
                self.done.set()

        self.engine.submit(GenerateRequest("a", prompt_of(25, 30), PARAMS), collect)
        assert self.held.wait(scaled_limit(30)), "no first token"

    def release(self) -> None:
        self.prefill.announce(False)
        assert self.done.wait(scaled_limit(30)), "request a never finished"

    def close(self) -> None:
        self.engine.shutdown()
        self.prefill.close()


def test_a_held_decode_engine_answers_reservations_at_once(tiny, share_path) -> None:
    """A reservation (a prefill request gated on this decode node) is granted during the
    hold, not after it: the announcing prefill node is waiting for exactly that."""
    held = _HeldEngine(tiny, share_path)
    answers: list[Admission] = []
    try:
        held.engine.reserve_when_free("b", 8, answers.append, max_new_tokens=4)
        wait_until(lambda: bool(answers), 3, "the reservation's answer")
        decoded_meanwhile = len(held.tokens) - 1
        held.release()
        held.engine.release_reservation("b")
    finally:
        held.close()
    assert answers[0].ok and not answers[0].queued
    assert decoded_meanwhile == 0  # still held when it was granted


def test_a_held_engine_runs_its_own_prefill_at_once(tiny, share_path) -> None:
    """A request for this engine's own prefill ends the hold: its first token comes long
    before the bound, while "a" is still decoding (the scheduler alternates: at most one
    decode step of "a" before "b"'s prefill, and held again after it)."""
    held = _HeldEngine(tiny, share_path)
    first: list[int] = []
    try:
        held.engine.submit(GenerateRequest("b", prompt_of(26, 20), PARAMS),
                           lambda out: first.extend(out.new_token_ids[:1]) if not first else None)
        wait_until(lambda: bool(first), 3, "b's first token")
        decoded_meanwhile, a_done = len(held.tokens) - 1, held.done.is_set()
        held.release()
    finally:
        held.close()
    assert decoded_meanwhile <= 1 and not a_done


class AnnouncementModel:
    """The real model; each forward records its mode and whether its own engine announced."""

    def __init__(self, model: Any) -> None:
        self.model, self.config = model, model.config
        self.engine: Engine | None = None
        self.seen: list[tuple[ForwardMode, bool]] = []

    def forward(self, batch: ForwardBatch, device_kv: torch.Tensor) -> torch.Tensor:
        share = self.engine.pacer.share if self.engine is not None else None
        self.seen.append((batch.mode, share is not None and share.announcing))
        return self.model.forward(batch, device_kv)


def test_a_prefill_that_ends_a_hold_runs_announced(tiny, share_path) -> None:
    """Held after a decode step (the scheduler's next batch for a new request is then its
    prefill), the engine's own prefill that ends the hold is announced while it computes: the
    announcement is set after the hold, right before the step, so other decode engines on the
    share wait for it too."""
    model = AnnouncementModel(tiny)
    held = _HeldEngine(model, share_path, hold_from=2)
    model.engine = held.engine
    first: list[int] = []
    try:
        held.engine.submit(GenerateRequest("b", prompt_of(27, 20), PARAMS),
                           lambda out: first.extend(out.new_token_ids[:1]) if not first else None)
        wait_until(lambda: bool(first), 3, "b's first token")
        held.release()
    finally:
        held.close()
    prefills = [announced for mode, announced in model.seen if mode is ForwardMode.EXTEND]
    assert len(prefills) == 2 and prefills[1]  # a's (before the model knew its engine), b's


def test_shutdown_ends_a_hold_without_another_step(tiny, share_path) -> None:
    """Shutdown during a hold: the loop stops without running the held decode step."""
    held = _HeldEngine(tiny, share_path)
    try:
        steps = held.engine.stats()["steps_total"]
        held.engine.shutdown()
        after = held.engine._num_steps  # noqa: SLF001 - counted on the stopped engine thread
    finally:
        held.close()
    assert steps == after == 1  # the prefill step only


def test_a_decode_engine_short_of_pages_does_not_hold(tiny, share_path) -> None:
    """A reservation queued for pages that only this engine's decode steps free (its pool is
    full) ends the hold and keeps it off: "a" decodes to its end and "b" is granted while the
    other engine still announces. Holding on would keep both waiting for the announcement."""
    # 16 pages of 4 tokens: "a" holds 8 and keeps 1 to decode in; "b" needs 7 + 1: it queues
    held = _HeldEngine(tiny, share_path, pages=16)
    answers: list[Admission] = []
    try:
        held.engine.reserve_when_free("b", 28, answers.append, max_new_tokens=4)
        wait_until(lambda: bool(answers), 5, "b's grant")
        finished_first = held.done.is_set()
        held.release()
        held.engine.release_reservation("b")
        stats = held.engine.stats()
    finally:
        held.close()
    assert answers[0].ok and answers[0].queued and finished_first
    assert stats["reservations_pending"] == 0


def test_a_decode_step_waits_no_longer_than_its_bound(tiny, share_path) -> None:
    """An announcement that never ends (a prefill node computing for minutes) delays each
    decode step by `decode_yield_max_ms` at most: the request still finishes."""
    bound_ms = 100
    prefill = ComputeShare(share_path)
    prefill.announce(True)
    engine = make_engine(tiny, compute_share=share_path, decode_yield_max_ms=bound_ms)
    try:
        outputs = engine.generate(GenerateRequest("a", prompt_of(23, 30), PARAMS), timeout=60)
        stats = engine.stats()
    finally:
        engine.shutdown()
        prefill.close()
    assert len(tokens_of(outputs)) == 4
    assert stats["yielded_steps_total"] == 3  # every decode step, each let through at the bound
    assert stats["yielded_seconds_total"] >= 3 * 0.9 * bound_ms / 1000


def test_an_engine_with_no_work_left_drops_its_announcement(tiny, share_path) -> None:
    """A prefill-only request (one token: its last batch is a prefill batch) leaves the
    engine announcing until its loop finds nothing to run, which then drops the
    announcement, so decode nodes beside an idle prefill node are never held."""
    probe = ComputeShare(share_path)
    engine = make_engine(tiny, compute_share=share_path)
    try:
        outputs = engine.generate(
            GenerateRequest("a", prompt_of(24, 30), SamplingParams(max_new_tokens=1)), timeout=60)
        assert outputs[-1].finished
        wait_until(lambda: not probe.others_busy(), 5, "the idle engine to drop its announcement")
        stats = engine.stats()
    finally:
        engine.shutdown()
        probe.close()
    assert stats["compute_share_announcements_total"] == 1
    assert stats["compute_share_busy_seconds_total"] > 0
