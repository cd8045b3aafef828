"""The durable next turn (docs/design.md §4.10) on a 1 prefill + 1 decode stack (tiny preset,
file storage, zmq transfer): 8 concurrent sessions with 1024-token answers and zero think
time. Decode's storage writes are made slow through the store's own knob
(`StorageConfig.write_delay_s`) and the whole answer is written at its end
(`stride_pages` above the answer), so every next turn looks its answer up while decode is
still writing it. With `pending_wait` on, every turn's `storage_from_decode` is the previous
answer's page floor and nothing races; with it off the same run recomputes the answers and
the raced counter shows it."""

from __future__ import annotations

import concurrent.futures
import sys
import threading
import time

import httpx
import pytest

from pdcache.config import NodeSetup, OffloadSettings
from pdcache.config.node_setup import with_keys
from pdcache.config.security import SecuritySettings
from pdcache.engine.config import CacheConfig, EngineConfig
from pdcache.engine.loader import load_model
from pdcache.engine.scheduler_config import SchedulerConfig
from pdcache.offload_manager.builder import (
    TierConfig,
    fingerprint_for,
    model_identity,
    storage_config_for,
)
from pdcache.offload_manager.hicache import HiCache, HiCacheConfig
from pdcache.offload_manager.pending import PendingPages
from pdcache.transfer.config import TransferConfig
from pdcache.transfer.delivery import MarksDelivery
from tests.pd_harness import (
    MetadataService,
    PDStack,
    assert_stack_idle,
    free_port,
    metric_value,
    page_floor,
    start_stack,
)

PAGE = 16
ANSWER = 1024
SESSIONS = 8
PROBE_ANSWER = 8  # the last turn only checks what its prompt found; its answer is not used
WRITE_DELAY_S = 0.25  # per storage write of decode's: 8 answers land 0.25 .. 2 s after the end
MESSAGE = [5, 6, 7, 8, 9, 10, 11, 12]


@pytest.fixture(scope="module")
def tiny():
    return load_model("tiny", seed=0)


def setups(tmp_path, model, pending_wait: bool, metadata: str = "",
           pending_pull: str = "never",
           security: SecuritySettings | None = None) -> tuple[NodeSetup, NodeSetup]:
    """File storage, or hf3fs slots shared through the metadata service at `metadata`. The
    wait is what this file tests: no pull from decode's staging unless `pending_pull` says
    and `security` has the cluster secret a pull needs (tests/pd/test_durable_pull.py)."""
    security = security or SecuritySettings()
    fp = fingerprint_for(model.config, model_identity("tiny", 0), PAGE)
    where = {"backend": "hf3fs", "capacity_pages": 8192, "metadata": metadata} if metadata \
        else {"backend": "file"}
    storage = with_keys(storage_config_for(model.config, PAGE, fp,
                                           path=str(tmp_path / "storage"), **where), security)
    assert storage is not None
    # the ack bound well above the slow prefill of test_the_answer_waits_for_prefill_...
    transfer = TransferConfig(engine="zmq", bootstrap_timeout_s=10, room_timeout_s=60,
                              heartbeat_interval_s=0.5, pending_ack_timeout_s=5.0)
    sched = SchedulerConfig(chunked_prefill_tokens=1024, max_running_requests=SESSIONS)
    hicache = HiCacheConfig(prefetch_policy="timeout", prefetch_timeout_base_s=20.0,
                            pending_wait=pending_wait, pending_pull=pending_pull)
    p_engine = EngineConfig(model.config, CacheConfig(PAGE, 2048), sched)
    d_engine = EngineConfig(model.config, CacheConfig(PAGE, 2048, enable_prefix_cache=False),
                            sched)
    prefill = NodeSetup("p0", "prefill", "127.0.0.1", 0, p_engine,
                        TierConfig(2048, hicache, storage), fp, storage, transfer, free_port(),
                        security=security)
    slow = storage.replace(write_delay_s=WRITE_DELAY_S)
    decode = NodeSetup("d0", "decode", "127.0.0.1", 0, d_engine, None, fp, slow, transfer,
                       offload=OffloadSettings(staging_pages=2048, stride_pages=256,
                                               pending_ttl_s=30.0), security=security)
    return prefill, decode


def session(stack: PDStack, index: int, answers: list[int]) -> list[tuple[list[int], dict]]:
    """One conversation, no think time: each turn is sent the moment the last one answered.
    Returns (prompt, D's answer) per turn."""
    prompt = [(31 * index + 7 * i) % 250 + 1 for i in range(40 + 3 * index)]
    turns = []
    for answer_tokens in answers:
        _, d = stack.generate(prompt, answer_tokens, salt="")
        assert "output_ids" in d, d
        assert len(d["output_ids"]) == answer_tokens
        turns.append((prompt, d))
        prompt = prompt + d["output_ids"] + MESSAGE
    return turns


BASELINE_TOKENS = 32


def measured_timeout_s(stack: PDStack, sessions: int, answers: list[int]) -> float:
    """Per-request HTTP timeout scaled from how fast this machine is right now: one short
    answer timed alone, times the decode steps and concurrency of the longest turn, with 4×
    room (load slows every request alike); never under the harness's 120 s."""
    start = time.monotonic()
    stack.generate(list(range(1, 41)), BASELINE_TOKENS, salt="baseline")
    per_token_s = (time.monotonic() - start) / BASELINE_TOKENS
    return max(120.0, 4 * per_token_s * max(answers) * sessions)


def run(tmp_path, tiny, pending_wait: bool, answers: list[int], sessions: int = SESSIONS,
        metadata: str = "", pending_pull: str = "never",
        security: SecuritySettings | None = None):
    prefill, decode = setups(tmp_path, tiny[0], pending_wait, metadata,
                             pending_pull=pending_pull, security=security)
    stack = start_stack(prefill, decode)
    if security is not None:
        stack.client.headers.update(security.node_headers())
    try:
        timeout_s = measured_timeout_s(stack, sessions, answers)
        stack.client.timeout = httpx.Timeout(timeout_s)
        with concurrent.futures.ThreadPoolExecutor(sessions) as pool:
            futures = [pool.submit(session, stack, i, answers) for i in range(sessions)]
            sessions = [f.result(timeout=timeout_s * len(answers) + 60) for f in futures]
        metrics = stack.client.get(f"{stack.prefill.url}/metrics").text
        assert_stack_idle(stack)
        return sessions, metrics, stack.decode_server.receiver.stats()
    finally:
        stack.close()


def answer_pages_tokens(prompt: list[int], answer: list[int]) -> int:
    """Tokens of the pages only decode wrote: from prompt_t's last full page to the last full
    page of prompt_t + answer_t (the last answer token's K/V is never computed)."""
    return page_floor(len(prompt) + len(answer) - 1, PAGE) - page_floor(len(prompt), PAGE)


def pending(metrics: str, outcome: str) -> float:
    return metric_value(metrics, "pdcache_pending_pages_total", server="p0", outcome=outcome)


def assert_every_answer_found(sessions) -> None:
    for turns in sessions:
        for (prev_prompt, prev), (_, turn) in zip(turns, turns[1:]):
            details = turn["meta_info"]["cached_tokens_details"]
            expected = answer_pages_tokens(prev_prompt, prev["output_ids"])
            assert details["storage_from_decode"] == expected, turn["meta_info"]
            assert turn["meta_info"]["computed_tokens"] <= len(MESSAGE) + PAGE


def test_every_next_turn_finds_the_previous_answer(tmp_path, tiny) -> None:
    sessions, metrics, receiver = run(tmp_path, tiny, True, [ANSWER, PROBE_ANSWER])
    assert_every_answer_found(sessions)
    assert pending(metrics, "raced") == 0
    # the writes really were late: every next turn met its answer pending and waited for it
    answer_pages = sum(answer_pages_tokens(p, a["output_ids"]) // PAGE
                       for turns in sessions for (p, a) in turns[:-1])
    assert pending(metrics, "found") >= answer_pages
    assert pending(metrics, "waited") == pending(metrics, "found")
    assert receiver["pending_pages_announced"] > 0 and receiver["settled_pages_announced"] > 0


def test_without_pending_wait_the_next_turn_races_the_write(tmp_path, tiny) -> None:
    sessions, metrics, _ = run(tmp_path, tiny, False, [ANSWER, PROBE_ANSWER])
    short = 0
    for turns in sessions:
        (prev_prompt, prev), (_, turn) = turns
        found = turn["meta_info"]["cached_tokens_details"]["storage_from_decode"]
        short += found < answer_pages_tokens(prev_prompt, prev["output_ids"])
    assert short > 0, "every next turn found its answer: the race did not happen"
    assert pending(metrics, "raced") > 0
    assert pending(metrics, "waited") == 0


def test_the_wait_does_not_depend_on_the_store(tmp_path, tiny) -> None:
    """The same contract on hf3fs slots committed through the metadata service (the channel
    is the control plane, never the store): shorter answers, 4 sessions."""
    service = MetadataService(tmp_path / "metadata")
    try:
        sessions, metrics, _ = run(tmp_path, tiny, True, [256, PROBE_ANSWER], sessions=4,
                                   metadata=service.address)
    finally:
        service.stop()
    assert_every_answer_found(sessions)
    assert pending(metrics, "raced") == 0 and pending(metrics, "waited") > 0


# a prefill control thread records a mark only after the next lookup, or after this: under
# the nodes' heartbeat deadline (0.5 s x 5), so the mark's delivery ends with a pong
SLOW_MARK_S = 1.5


class LateMarks:
    """The adversary: `PendingPages.pending` (prefill's control thread) holds each mark until
    a lookup later than its arrival ran (`HiCache.start_prefetch`), at most SLOW_MARK_S."""

    def __init__(self, monkeypatch) -> None:
        self.lookups = 0
        self.changed = threading.Condition()
        record, lookup = PendingPages.pending, HiCache.start_prefetch

        def late_record(pages, *args, **kwargs) -> None:
            with self.changed:
                seen = self.lookups
                self.changed.wait_for(lambda: self.lookups > seen, SLOW_MARK_S)
            record(pages, *args, **kwargs)

        def counted_lookup(cache, *args, **kwargs) -> int:
            found = lookup(cache, *args, **kwargs)
            with self.changed:
                self.lookups += 1
                self.changed.notify_all()
            return found

        monkeypatch.setattr(PendingPages, "pending", late_record)
        monkeypatch.setattr(HiCache, "start_prefetch", counted_lookup)


@pytest.mark.parametrize("gated", [True, False], ids=["answer-waits", "no-wait"])
def test_the_answer_waits_for_prefill_to_record_its_pending_pages(
        tmp_path, tiny, monkeypatch, gated: bool) -> None:
    """The mark and the answer race (design §4.10, "Delivery"): the mark goes decode →
    prefill's control thread, the answer decode → client → prefill's HTTP side. A prefill
    slow to record marks (its control thread starved on a loaded host: seen in CI) met the
    next turn first and recomputed the answer. Decode's last output now waits until the
    prefill answered a ping sent behind the marks; with that wait removed (`gated` False:
    every delivery counts as done at once) the next turn misses its answer."""
    LateMarks(monkeypatch)
    # writes land well after the late mark, so only the mark can tell the next turn
    monkeypatch.setattr(sys.modules[__name__], "WRITE_DELAY_S", 3 * SLOW_MARK_S)
    if not gated:
        monkeypatch.setattr(MarksDelivery, "add_done_callback", lambda self, fn: fn())
    sessions, metrics, receiver = run(tmp_path, tiny, True, [64, 64, PROBE_ANSWER], sessions=1)
    if gated:
        assert_every_answer_found(sessions)
        assert pending(metrics, "raced") == 0 and pending(metrics, "waited") > 0
        assert receiver["pending_marks_acked"] > 0 and receiver["pending_ack_timeouts"] == 0
        return
    (turns,) = sessions
    found = [turn["meta_info"]["cached_tokens_details"]["storage_from_decode"]
             for _, turn in turns[1:]]
    assert found == [0, 0], f"a next turn found its answer without waiting for the mark: {found}"
