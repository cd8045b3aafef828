"""The token oracle of `pdcache chaos`: what a no-cache reference engine answers for the
same input ids, compared token for token with what the stack answered.

`TokenOracle` owns an in-process `Engine` (the topology's model, dtype and seed; prefix cache
off, so no cached page can agree with a wrong one) and the one thread that drives it
(`start(thread=False)` + `step()`: the oracle's thread is the engine thread). While the soak
runs it has a low CPU priority (nice `SOAK_NICE` on that thread: about a tenth of a core
against a busy process), so on a small machine it takes what the soak leaves; `drain` puts it
back to normal priority to catch up once the load stopped (nice 19 would starve it for
minutes on a machine others load too). Checks queue as compact int32 arrays;
computed reference answers are kept in a bounded LRU (`cache_entries`), so a retried prompt is
computed once.
"""

from __future__ import annotations

import hashlib
import itertools
import logging
import os
import queue
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import numpy as np

from pdcache.engine.api import GenerateRequest, RequestOutput, SamplingParams
from pdcache.engine.config import CacheConfig, EngineConfig
from pdcache.engine.engine import Engine
from pdcache.engine.request import pages_for

log = logging.getLogger(__name__)

SOAK_NICE = 10  # the oracle thread's nice value while the soak's load runs


@dataclass(frozen=True)
class AnswerCheck:
    """One successful answer to check: the prompt sent, its length limit, what came back."""

    request_id: str
    input_ids: np.ndarray  # int32
    max_new_tokens: int
    output_ids: tuple[int, ...]


@dataclass(frozen=True)
class WrongAnswer:
    request_id: str
    first_diff: int  # index of the first differing token (or the shorter length)
    expected: tuple[int, ...]
    got: tuple[int, ...]

    def as_json(self) -> dict[str, Any]:
        return {
            "request_id": self.request_id,
            "first_diff": self.first_diff,
            "expected": list(self.expected),
            "got": list(self.got),
        }


def first_difference(expected: tuple[int, ...], got: tuple[int, ...]) -> int | None:
    """Index of the first token where the answers differ (a shorter answer differs at its
    end), None when they are equal."""
    for i, (a, b) in enumerate(zip(expected, got)):
        if a != b:
            return i
    return None if len(expected) == len(got) else min(len(expected), len(got))


def check_answer(check: AnswerCheck, expected: tuple[int, ...]) -> WrongAnswer | None:
    diff = first_difference(expected, check.output_ids)
    if diff is None:
        return None
    return WrongAnswer(check.request_id, diff, expected, check.output_ids)


def _key(check: AnswerCheck) -> bytes:
    digest = hashlib.blake2b(check.input_ids.tobytes(), digest_size=16)
    digest.update(check.max_new_tokens.to_bytes(4, "little"))
    return digest.digest()


class TokenOracle:
    """Checks answers against the reference engine on its own low-priority thread."""

    def __init__(
        self,
        model: Any,
        tokenizer: Any,
        *,
        seed: int,
        page_size: int,
        max_tokens: int,
        batch: int = 4,
        cache_entries: int = 1024,
    ) -> None:
        pages = batch * pages_for(max_tokens, page_size) + 1
        config = EngineConfig(
            model.config, CacheConfig(page_size, pages, enable_prefix_cache=False), seed=seed
        )
        self.engine = Engine(config, model, tokenizer)
        self.batch = batch
        self.cache_entries = cache_entries
        self.checked = 0
        self.cache_hits = 0
        self.wrong: list[WrongAnswer] = []
        self.errors: list[str] = []
        self._cache: OrderedDict[bytes, tuple[int, ...]] = OrderedDict()
        self._rids = itertools.count()
        self._queue: queue.Queue[AnswerCheck] = queue.Queue()
        self._lock = threading.Lock()  # guards the counters and lists above
        self._idle = threading.Event()
        self._foreground = threading.Event()  # set by drain(): normal priority from then on
        self._foreground_applied = False  # the oracle thread's own flag
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # ---- lifecycle (the soak's thread)

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="chaos-oracle", daemon=True)
        self._thread.start()

    def submit(self, check: AnswerCheck) -> None:
        self._idle.clear()
        self._queue.put(check)

    def pending(self) -> int:
        return self._queue.qsize()

    def drain(self, timeout_s: float) -> bool:
        """Wait until every submitted check is done, the oracle at normal priority; False at
        the deadline."""
        self._foreground.set()
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            # wait, never spin: a loop polling the queue at normal priority starved the
            # oracle's niced thread (three checks took 40 s instead of 0.5)
            if self._idle.wait(0.5) and self._queue.empty():
                return True
            if self._thread is not None and not self._thread.is_alive():
                return False
        return False

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(30)

    def report(self) -> dict[str, Any]:
        with self._lock:
            return {
                "checked": self.checked,
                "wrong": len(self.wrong),
                "pending": self.pending(),
                "cache_hits": self.cache_hits,
                "errors": list(self.errors[:10]),
                "first_wrong": [w.as_json() for w in self.wrong[:5]],
            }

    # ---- the oracle's thread

    def _run(self) -> None:
        _set_thread_nice(SOAK_NICE)
        self.engine.start(thread=False)
        try:
            while not self._stop.is_set():
                self._priority()
                checks = self._take()
                if not checks:
                    self._idle.set()
                    continue
                self._check_batch(checks)
        finally:
            self.engine.shutdown()

    def _priority(self) -> None:
        """Back to normal priority once `drain` asked (once)."""
        if self._foreground.is_set() and not self._foreground_applied:
            _set_thread_nice(0)
            self._foreground_applied = True

    def _take(self) -> list[AnswerCheck]:
        try:
            checks = [self._queue.get(timeout=0.2)]
        except queue.Empty:
            return []
        while len(checks) < self.batch:
            try:
                checks.append(self._queue.get_nowait())
            except queue.Empty:
                break
        return checks

    def _check_batch(self, checks: list[AnswerCheck]) -> None:
        todo = {}
        for check in checks:
            expected = self._cache.get(_key(check))
            if expected is None:
                todo.setdefault(_key(check), check)
            else:
                self._cache.move_to_end(_key(check))
                with self._lock:
                    self.cache_hits += 1
        try:
            computed = self._reference(list(todo.values()))
        except Exception as exc:  # noqa: BLE001 - an oracle failure is reported, not fatal
            log.exception("oracle batch failed")
            with self._lock:
                self.errors.append(f"{type(exc).__name__}: {exc}")
            return
        for key, tokens in zip(todo, computed):
            self._cache[key] = tokens
            while len(self._cache) > self.cache_entries:
                self._cache.popitem(last=False)
        for check in checks:
            wrong = check_answer(check, self._cache.get(_key(check), ()))
            with self._lock:
                self.checked += 1
                if wrong is not None:
                    self.wrong.append(wrong)

    def _reference(self, checks: list[AnswerCheck]) -> list[tuple[int, ...]]:
        """The greedy answers of `checks`, computed together on this thread."""
        tokens: dict[str, list[int]] = {}
        finished: set[str] = set()
        errors: dict[str, str] = {}
        for check in checks:
            rid = f"oracle-{next(self._rids)}"
            tokens[rid] = []

            def collect(out: RequestOutput, rid: str = rid) -> None:
                tokens[rid].extend(out.new_token_ids)
                if out.finished:
                    finished.add(rid)
                    if out.error:
                        errors[rid] = out.error

            params = SamplingParams(
                max_new_tokens=check.max_new_tokens, temperature=0.0, ignore_eos=True
            )
            self.engine.submit(GenerateRequest(rid, check.input_ids.tolist(), params), collect)
        while len(finished) < len(checks):
            if self._stop.is_set():
                raise RuntimeError("oracle stopped with checks in flight")
            self._priority()  # a batch of long prompts at nice 10 can take a while
            self.engine.step()
        if errors:
            raise RuntimeError(f"reference engine failed: {next(iter(errors.values()))}")
        return [tuple(t) for t in tokens.values()]


def _set_thread_nice(value: int) -> bool:
    """Set the calling thread's nice value (Linux: a thread id names one thread); lowering it
    needs CAP_SYS_NICE or RLIMIT_NICE, so this is best effort. Whether it took."""
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), value)
    except (OSError, AttributeError):
        return False
    return True
