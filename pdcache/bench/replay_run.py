"""The run loop of `pdcache bench replay`: `Replayer` drives one replay on one asyncio event
loop (every session a task; `--concurrency` a semaphore), releasing turns by mode
(`PoissonGate` for poisson arrivals, trace timestamps, `RoundBarrier` for `--round-barrier`),
`SessionPlayer` building each turn's token-exact prompt from the session's real history (the
one session player: `pdcache chaos` plays its sessions with it too), sending it
(`pdcache.bench.replay_http`), tracking the theoretical reuse, and writing one
`RequestRecord` per request to `requests.jsonl` as it completes. Returns the run's counts
(the run part of `summary.json`; `pdcache.bench.report` writes the rest).
"""

from __future__ import annotations

import asyncio
import json
import sys
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol, TextIO

import httpx
import numpy as np
from tqdm import tqdm

from pdcache.bench.replay_config import ReplayConfig
from pdcache.bench.replay_http import send_plain, send_stream
from pdcache.bench.replay_records import (
    PROMPT_MISMATCH,
    PromptMismatchError,
    RequestRecord,
    check_prompt_tokens,
)
from pdcache.bench.tokens import BlockExpander, ReuseTracker
from pdcache.bench.traces import Session, Trace, Turn

EMPTY = np.zeros(0, dtype=np.int64)


class PoissonGate:
    """Releases one waiter per tick of a Poisson process; FIFO (asyncio.Lock is fair)."""

    def __init__(self, rate: float, seed: int) -> None:
        self.rate = rate
        self.rng = np.random.default_rng(seed)
        self.lock = asyncio.Lock()
        self.next_tick: float | None = None

    async def wait(self) -> None:
        async with self.lock:
            loop = asyncio.get_running_loop()
            now = loop.time()
            tick = now if self.next_tick is None else max(self.next_tick, now)
            self.next_tick = tick + float(self.rng.exponential(1.0 / self.rate))
            await asyncio.sleep(max(0.0, tick - now))


def poisson_session_starts(trace: Trace, request_rate: float, seed: int) -> dict[str, float]:
    """Start times (s) of the trace's sessions, in trace order, as a Poisson process whose
    rate is `request_rate` / (mean turns per session): the offered request rate is then
    `request_rate` when every turn is sent. The first session starts at 0."""
    sessions = trace.sessions
    if not sessions:
        return {}
    session_rate = request_rate * len(sessions) / trace.num_requests
    gaps = np.random.default_rng(seed).exponential(1.0 / session_rate, len(sessions))
    starts = np.concatenate([[0.0], np.cumsum(gaps[:-1])])
    return {s.session_id: float(t) for s, t in zip(sessions, starts)}


class RoundBarrier:
    """Round k opens when every session that has a turn k-1 finished (or dropped) it."""

    def __init__(self, sessions: tuple[Session, ...]) -> None:
        # keyed by `turn.turn`, as `wait` and `finish` are: a branching trace (Bailian) has
        # two turns of one depth in a session, and counting by position left a round
        # pending for good (the run then waited out --max-duration)
        counts = Counter(turn.turn for s in sessions for turn in s.turns)
        rounds = max(counts, default=-1) + 1
        self.pending = [counts.get(k, 0) for k in range(rounds)]
        self.events = [asyncio.Event() for _ in range(rounds)]
        for k, count in enumerate(self.pending):
            if count == 0:
                self.events[k].set()

    async def wait(self, round_index: int) -> None:
        if round_index > 0:
            await self.events[round_index - 1].wait()

    def finish(self, round_index: int) -> None:
        self.pending[round_index] -= 1
        if self.pending[round_index] == 0:
            self.events[round_index].set()


@dataclass(frozen=True)
class TurnAnswer:
    """A sent turn the session goes on from: the ids the stack answered ([] when the turn
    failed but nothing after it needs its answer) and when it completed, on the driver's clock
    (the next turn's think time counts from then)."""

    output: list[int]
    done_s: float


class TurnDriver(Protocol):
    """Paces, sends and records the turns a `SessionPlayer` builds: the replay's `Replayer`
    and the chaos soak's steady load (`pdcache.chaos.load.SteadyLoad`)."""

    async def release(self, turn: Turn, parent_done_s: float) -> None:
        """Wait until `turn` may be sent (its parent completed at `parent_done_s`)."""

    def drop(self, session: Session, index: int, reason: str) -> None:
        """The session stops before its turn `index`, for `reason`."""

    async def send(
        self, session: Session, index: int, turn: Turn, prompt: np.ndarray, max_new: int
    ) -> TurnAnswer | None:
        """Send the turn and record it; None ends the session (the driver accounted for the
        turns left)."""


class SessionPlayer:
    """Plays one session's turns in order, each prompt token-exact: a turn that carries history
    sends the session's previous prompt + the ids the stack actually answered + its new
    tokens, so the stack sees what a real conversation would send it. Owns the block expander
    and the context cap (`max_tokens_cap`: prompt + answer); holds no state between sessions.
    The driver (`TurnDriver`) paces, sends and records each turn."""

    def __init__(
        self, expander: BlockExpander, max_tokens_cap: int | None, cut_long_prompts: bool = True
    ) -> None:
        self.expander = expander
        self.max_tokens_cap = max_tokens_cap
        # a turn without history over the cap is cut to fit (else the session stops there)
        self.cut_long_prompts = cut_long_prompts

    def build_prompt(self, turn: Turn, history: np.ndarray) -> tuple[np.ndarray, int] | None:
        """(prompt, max_new_tokens), or None when the turn exceeds the context cap."""
        new = self.expander.turn_tokens(turn)
        prompt = np.concatenate([history, new]) if turn.dependent else new
        max_new = max(1, turn.output_len)
        cap = self.max_tokens_cap
        if cap is not None and len(prompt) + max_new > cap:
            if turn.dependent or turn.with_history or not self.cut_long_prompts:
                return None
            max_new = min(max_new, max(1, cap // 2))
            prompt = prompt[: cap - max_new]
        return prompt, max_new

    async def play(self, session: Session, driver: TurnDriver) -> None:
        history, parent_done_s = EMPTY, 0.0
        for index, turn in enumerate(session.turns):
            await driver.release(turn, parent_done_s)
            built = self.build_prompt(turn, history)
            if built is None:
                return driver.drop(session, index, "max_tokens_cap")
            answer = await driver.send(session, index, turn, *built)
            if answer is None:
                return None
            parent_done_s = answer.done_s
            history = np.concatenate([built[0], np.asarray(answer.output, dtype=np.int64)])
        return None


class Replayer:
    """Drives one replay: owns the HTTP client, the reuse tracker, the output file and the
    records written to it (`records`, in completion order)."""

    def __init__(
        self, cfg: ReplayConfig, trace: Trace, expander: BlockExpander, sink: TextIO
    ) -> None:
        self.cfg = cfg
        self.trace = trace
        self.expander = expander
        self.sink = sink
        self.player = SessionPlayer(expander, cfg.max_tokens_cap)
        self.tracker = ReuseTracker(cfg.page_size)
        self.records: list[RequestRecord] = []
        self.counts = {"sent": 0, "ok": 0, "failed": 0, "skipped": 0, PROMPT_MISMATCH: 0}
        self.first_mismatch: str | None = None  # "REQUEST_ID: message" of the first one
        self.skip_reasons: dict[str, int] = {}
        self.stopping = False
        self.slow = 0  # requests with a TTFT over cfg.slow_ttft_s (--stop-after-slow)
        self.stopped_early = False

    @property
    def stop_reason(self) -> str:
        return "stop_after_slow" if self.stopped_early else "max_duration"

    # -- timing -------------------------------------------------------------------------------

    def now(self) -> float:
        return asyncio.get_running_loop().time() - self.t0

    async def sleep_until(self, t: float) -> None:
        await asyncio.sleep(max(0.0, min(t, self.cfg.max_duration_s) - self.now()))

    async def release(self, turn: Turn, parent_done_s: float) -> None:
        await self._release(turn, parent_done_s)
        # its schedule lets it go now: a wait for --concurrency from here is the client's
        self.due_s[turn.request_id] = self.now()

    async def _release(self, turn: Turn, parent_done_s: float) -> None:
        cfg = self.cfg
        if self.barrier is not None:
            await self.barrier.wait(turn.turn)
        if cfg.mode == "trace":
            if turn.dependent:
                await self.sleep_until(parent_done_s + turn.delay_s / cfg.speedup)
            else:
                await self.sleep_until(turn.arrival_s / cfg.speedup)
        elif cfg.mode == "poisson":
            if turn.dependent:
                await self.sleep_until(parent_done_s + turn.delay_s / cfg.speedup)
            assert self.gate is not None
            await self.gate.wait()
        elif cfg.mode == "poisson-sessions":
            if turn.dependent:
                await self.sleep_until(parent_done_s + turn.delay_s / cfg.speedup)
            else:
                await self.sleep_until(self.session_starts[turn.session_id])

    # -- one session --------------------------------------------------------------------------

    def drop(self, session: Session, index: int, reason: str) -> None:
        """Count the session's turns from `index` on as skipped, for `reason`."""
        for turn in session.turns[index:]:
            self.counts["skipped"] += 1
            self.skip_reasons[reason] = self.skip_reasons.get(reason, 0) + 1
            if self.barrier is not None:
                self.barrier.finish(turn.turn)
            self.pbar.update(1)

    async def send(
        self, session: Session, index: int, turn: Turn, prompt: np.ndarray, max_new: int
    ) -> TurnAnswer | None:
        if self.stopping or self.now() >= self.cfg.max_duration_s:
            return self.drop(session, index, self.stop_reason)
        async with self.semaphore:
            if self.now() >= self.cfg.max_duration_s:
                return self.drop(session, index, "max_duration")
            rec, output = await self.dispatch(session, turn, prompt, max_new)
        done_s = self.now()
        self.finish(turn, rec)
        if not rec.ok and index + 1 < len(session.turns):
            if any(t.dependent for t in session.turns[index + 1 :]):
                return self.drop(session, index + 1, "parent_failed")
        return TurnAnswer(output, done_s)

    async def dispatch(
        self, session: Session, turn: Turn, prompt: np.ndarray, max_new: int
    ) -> tuple[RequestRecord, list[int]]:
        now = self.now()
        due = self.due_s.pop(turn.request_id, now)
        rec = RequestRecord(
            turn.request_id, session.session_id, turn.turn, dispatch_s=round(now, 6),
            prompt_tokens=len(prompt), max_new_tokens=max_new,
            new_input_tokens=turn.input_len if turn.dependent else len(prompt),
            queued_s=round(max(0.0, now - due), 6),
        )
        keys = self.tracker.keys(prompt)
        rec.theoretical_cached_tokens = self.tracker.reusable_tokens(keys, len(prompt))
        self.counts["sent"] += 1
        output: list[int] = []
        try:
            output = await asyncio.wait_for(
                self.post(session, prompt, max_new, rec, lambda: self.tracker.add(keys)),
                self.cfg.request_timeout_s)
            check_prompt_tokens(rec)
            rec.ok, rec.output_tokens = True, len(output)
            full = np.concatenate([prompt, np.asarray(output, dtype=np.int64)])
            self.tracker.add(self.tracker.extend_keys(keys, full[:-1]))  # last token: no KV
        except asyncio.CancelledError:
            rec.error = ("cancelled: --stop-after-slow reached" if self.stopped_early
                         else "cancelled: --max-duration + --drain-timeout reached")
            self.write(rec)
            self.counts["failed"] += 1
            raise
        except asyncio.TimeoutError:  # not the builtin TimeoutError before Python 3.11
            rec.error = f"TimeoutError: no complete response in {self.cfg.request_timeout_s:g}s"
        except PromptMismatchError as exc:
            rec.output_tokens = len(output)
            self.mismatch(rec, exc)
        except Exception as exc:  # noqa: BLE001 - any failure is this request's, never the run's
            rec.error = f"{type(exc).__name__}: {exc}"[:500]
        return rec, output

    def mismatch(self, rec: RequestRecord, exc: PromptMismatchError) -> None:
        """Record a prompt mismatch on `rec` (failed) and in the run's counts."""
        rec.error = f"{PROMPT_MISMATCH}: {exc}"
        self.counts[PROMPT_MISMATCH] += 1
        if self.first_mismatch is None:
            self.first_mismatch = f"{rec.request_id}: {exc}"

    async def post(
        self, session: Session, prompt: np.ndarray, max_new: int, rec: RequestRecord,
        on_first_token: Callable[[], None],
    ) -> list[int]:
        """`POST /generate` of one request (streamed or not), filling `rec`; its output ids."""
        body: dict[str, Any] = {
            "input_ids": prompt.tolist(),
            "sampling_params": {"max_new_tokens": max_new, "ignore_eos": True,
                                "temperature": self.cfg.temperature},
            "stream": self.cfg.stream,
            # the replay reads each chunk's new ids (ITL per token): SGLang's incremental chunks
            "incremental_streaming_output": True,
        }
        if self.cfg.send_session_id and len(session.turns) > 1:
            rec.sent_session_id = self.cfg.session_id_for(session.session_id)
            body["session_id"] = rec.sent_session_id
        if self.cfg.cache_salt is not None:
            body["cache_salt"] = self.cfg.cache_salt
        sender = send_stream if self.cfg.stream else send_plain
        return await sender(self.client, body, rec, on_first_token)

    def finish(self, turn: Turn, rec: RequestRecord) -> None:
        self.counts["ok" if rec.ok else "failed"] += 1
        self.write(rec)
        cfg = self.cfg
        if cfg.stop_after_slow is not None and cfg.slow_ttft_s is not None:
            if rec.ttft_s is not None and rec.ttft_s > cfg.slow_ttft_s:
                self.slow += 1
            if self.slow >= cfg.stop_after_slow and not self.stopped_early:
                self.stopped_early = self.stopping = True
                self.stop_event.set()
        if self.barrier is not None:
            self.barrier.finish(turn.turn)
        self.pbar.update(1)

    def write(self, rec: RequestRecord) -> None:
        self.records.append(rec)
        self.sink.write(json.dumps(rec.__dict__) + "\n")
        self.sink.flush()

    # -- whole run ----------------------------------------------------------------------------

    async def run(self) -> dict[str, Any]:
        cfg = self.cfg
        self.t0 = asyncio.get_running_loop().time()
        self.stop_event = asyncio.Event()
        self.semaphore = asyncio.Semaphore(cfg.concurrency)
        self.gate = PoissonGate(cfg.rate, cfg.seed) if cfg.mode == "poisson" else None
        self.session_starts = (
            poisson_session_starts(self.trace, cfg.rate or 0.0, cfg.seed)
            if cfg.mode == "poisson-sessions" else {})
        self.barrier = RoundBarrier(self.trace.sessions) if cfg.round_barrier else None
        self.due_s: dict[str, float] = {}  # request id -> when its schedule let it go
        limits = httpx.Limits(max_connections=cfg.concurrency + 4)
        timeout = httpx.Timeout(cfg.request_timeout_s, connect=30.0)
        self.pbar = tqdm(total=self.trace.num_requests, file=sys.stderr, unit="req",
                         disable=not cfg.progress, desc="replay")
        wall_start = time.perf_counter()
        async with httpx.AsyncClient(base_url=cfg.url, limits=limits, timeout=timeout) as client:
            self.client = client
            tasks = [asyncio.create_task(self.player.play(s, self)) for s in self.trace.sessions]
            # every session done, the deadline, or an early stop (finish sets stop_event)
            everything = asyncio.ensure_future(asyncio.wait(tasks))
            stopped = asyncio.ensure_future(self.stop_event.wait())
            await asyncio.wait([everything, stopped], return_when=asyncio.FIRST_COMPLETED,
                               timeout=cfg.max_duration_s + cfg.drain_timeout_s)
            self.stopping = True
            for task in (*tasks, stopped, everything):
                if not task.done():
                    task.cancel()
            results = await asyncio.gather(*tasks, return_exceptions=True)
            await asyncio.gather(stopped, everything, return_exceptions=True)
        self.pbar.close()
        errors = [r for r in results if isinstance(r, BaseException)
                  and not isinstance(r, asyncio.CancelledError)]
        for err in errors:  # a bug in the replayer itself: say so, never hide it
            print(f"replay: session task failed: {err!r}", file=sys.stderr)
        not_sent = self.trace.num_requests - self.counts["sent"] - self.counts["skipped"]
        return {
            "duration_s": time.perf_counter() - wall_start,
            "requests_total": self.trace.num_requests,
            "requests_sent": self.counts["sent"],
            "requests_skipped": self.counts["skipped"] + not_sent,
            "skip_reasons": self.skip_reasons,
            "replayer_errors": len(errors),
            "session_prefix": cfg.session_prefix,
            "requests_prompt_mismatch": self.counts[PROMPT_MISMATCH],
            "first_prompt_mismatch": self.first_mismatch,
            "stopped_early": self.stopped_early,
        }
