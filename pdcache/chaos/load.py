"""The steady multi-turn load of `pdcache chaos`: `concurrency` conversations in flight
through the router at all times, until the soak's end.

Each worker takes the next session of the trace (the trace repeats with fresh tokens: cycle k
expands the same block ids with token seed `token_seed + k`) and plays it with the replay's
session player (`pdcache.bench.replay_run.SessionPlayer`: each prompt the session's previous
prompt + the ids the stack answered + the turn's new tokens), sent as SGLang's `/generate`
with `input_ids`, greedy, `ignore_eos`, the session's `session_id` and the soak's
`cache_salt`. A failed turn is retried (`retries` times, backoff) as a user would; a session
whose turn never succeeds, or that outgrows the context, makes way for the next one.

Every attempt is one `AttemptRecord` (the replay's `RequestRecord` with the attempt, when it
ended and a failure code; appended to `results` and to requests.jsonl); every success goes to
`on_success` (the oracle). An attempt without any answer within `deadline_s` is
`unanswered`. Runs on one asyncio loop (the soak's main thread).
"""

from __future__ import annotations

import asyncio
import itertools
import json
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from typing import Any, TextIO

import httpx
import numpy as np

from pdcache.bench.replay_records import (
    PROMPT_MISMATCH,
    PromptMismatchError,
    RequestRecord,
    check_prompt_tokens,
)
from pdcache.bench.replay_run import SessionPlayer, TurnAnswer
from pdcache.bench.tokens import BlockExpander
from pdcache.bench.traces import Session, Trace, Turn

UNANSWERED = "unanswered"
__all__ = ["PROMPT_MISMATCH", "UNANSWERED", "AttemptRecord", "LoadSettings", "SteadyLoad"]


@dataclass
class AttemptRecord(RequestRecord):
    """One attempt of one turn: a replay record, with which attempt it was, when it ended
    (`done_s`, on the soak's clock as `dispatch_s` is) and why it failed (`code`: "" when
    ok; else http_STATUS:CODE, connect_error, unanswered, prompt_mismatch, ...; `error` says
    more)."""

    attempt: int = 0
    done_s: float = 0.0
    code: str = ""


@dataclass(frozen=True)
class LoadSettings:
    url: str
    duration_s: float
    concurrency: int = 4
    deadline_s: float = 120.0  # an attempt with no answer by then is unanswered
    retries: int = 3
    retry_backoff_s: float = 0.5
    max_tokens: int = 2048  # prompt + answer: the model's context
    vocab: tuple[int, int] = (0, 256)
    token_seed: int = 0
    cache_salt: str = ""
    session_prefix: str = "chaos"
    headers: tuple[tuple[str, str], ...] = ()


class SteadyLoad:
    """Owns the workers, the HTTP client and the results of one soak's traffic; the
    `TurnDriver` of the session player (one turn: its attempts until one succeeds)."""

    def __init__(
        self,
        settings: LoadSettings,
        trace: Trace,
        sink: TextIO,
        on_success: Callable[[AttemptRecord, np.ndarray, list[int]], None],
        clock: Callable[[], float],
    ) -> None:
        self.settings = settings
        self.trace = trace
        self.sink = sink
        self.on_success = on_success
        self.clock = clock
        self.results: list[AttemptRecord] = []
        self._sessions = self._session_stream()

    def _session_stream(self) -> Iterator[tuple[Session, SessionPlayer, str]]:
        for cycle in itertools.count():
            expander = BlockExpander(
                self.trace.block_size,
                vocab_high=self.settings.vocab[1],
                vocab_low=self.settings.vocab[0],
                seed=self.settings.token_seed + cycle,
            )
            # a session that outgrows the context stops there (no prompt is cut to fit)
            player = SessionPlayer(expander, self.settings.max_tokens, cut_long_prompts=False)
            for session in self.trace.sessions:
                yield (
                    session,
                    player,
                    f"{self.settings.session_prefix}-c{cycle}-{session.session_id}",
                )

    async def run(self) -> list[AttemptRecord]:
        s = self.settings
        limits = httpx.Limits(max_connections=s.concurrency + 2)
        timeout = httpx.Timeout(s.deadline_s)  # connect included: no answer by then = unanswered
        async with httpx.AsyncClient(
            base_url=s.url, limits=limits, timeout=timeout, headers=dict(s.headers)
        ) as client:
            await asyncio.gather(*(self._worker(client) for _ in range(s.concurrency)))
        return self.results

    def running(self) -> bool:
        return self.clock() < self.settings.duration_s

    async def _worker(self, client: httpx.AsyncClient) -> None:
        while self.running():
            session, player, sid = next(self._sessions)
            await player.play(session, _Conversation(self, client, sid))

    async def attempts(
        self, client: httpx.AsyncClient, sid: str, turn: int, prompt: np.ndarray, max_new: int
    ) -> list[int] | None:
        """The turn's attempts until one succeeds (its output) or the retries or the soak
        run out (None)."""
        for attempt in range(self.settings.retries + 1):
            if not self.running():
                return None
            if attempt:
                await asyncio.sleep(self.settings.retry_backoff_s * attempt)
            rec = AttemptRecord(
                f"{sid}/{turn}/{attempt}",
                sid,
                turn,
                dispatch_s=round(self.clock(), 3),
                prompt_tokens=len(prompt),
                max_new_tokens=max_new,
                sent_session_id=sid,
                attempt=attempt,
            )
            output = await self._send(client, sid, prompt, max_new, rec)
            rec.done_s = round(self.clock(), 3)
            self.results.append(rec)
            self.sink.write(json.dumps(asdict(rec)) + "\n")
            if rec.ok and output is not None:
                self.on_success(rec, prompt, output)
                return output
        return None

    async def _send(
        self,
        client: httpx.AsyncClient,
        sid: str,
        prompt: np.ndarray,
        max_new: int,
        rec: AttemptRecord,
    ) -> list[int] | None:
        body: dict[str, Any] = {
            "input_ids": prompt.tolist(),
            "session_id": sid,
            "stream": False,
            "sampling_params": {"max_new_tokens": max_new, "temperature": 0.0, "ignore_eos": True},
        }
        if self.settings.cache_salt:
            body["cache_salt"] = self.settings.cache_salt
        try:
            resp = await asyncio.wait_for(
                client.post("/generate", json=body), self.settings.deadline_s
            )
        except (asyncio.TimeoutError, httpx.TimeoutException) as exc:
            rec.code, rec.error = (
                UNANSWERED,
                f"no answer within {self.settings.deadline_s:g}s ({type(exc).__name__})",
            )
            return None
        except httpx.ConnectError as exc:
            rec.code, rec.error = "connect_error", str(exc)[:200]
            return None
        except httpx.TransportError as exc:
            rec.code, rec.error = f"transport:{type(exc).__name__}", str(exc)[:200]
            return None
        return self._read(resp, rec)

    @staticmethod
    def _read(resp: httpx.Response, rec: AttemptRecord) -> list[int] | None:
        rec.http_status = resp.status_code
        try:
            data = resp.json()
        except ValueError:
            data = None
        if resp.status_code != 200 or not isinstance(data, dict) or "output_ids" not in data:
            error = (data or {}).get("error") if isinstance(data, dict) else None
            code = (error or {}).get("code") if isinstance(error, dict) else None
            rec.code = f"http_{resp.status_code}:{code or 'no_code'}"
            rec.error = (
                (error or {}).get("message", resp.text)[:300]
                if isinstance(error, dict)
                else resp.text[:300]
            )
            return None
        rec.apply_meta(data.get("meta_info") or {})
        try:
            check_prompt_tokens(rec)
        except PromptMismatchError as exc:
            rec.code, rec.error = PROMPT_MISMATCH, str(exc)
            return None
        output = [int(t) for t in data["output_ids"]]
        rec.ok, rec.output_tokens = True, len(output)
        return output


class _Conversation:
    """One play of one session by a worker (`TurnDriver`): no pacing (the next turn goes as
    soon as the previous one answered), no accounting of turns left unplayed."""

    def __init__(self, load: SteadyLoad, client: httpx.AsyncClient, sid: str) -> None:
        self.load = load
        self.client = client
        self.sid = sid

    async def release(self, turn: Turn, parent_done_s: float) -> None:
        return None

    def drop(self, session: Session, index: int, reason: str) -> None:
        return None

    async def send(
        self, session: Session, index: int, turn: Turn, prompt: np.ndarray, max_new: int
    ) -> TurnAnswer | None:
        output = await self.load.attempts(self.client, self.sid, turn.turn, prompt, max_new)
        return None if output is None else TurnAnswer(output, self.load.clock())
