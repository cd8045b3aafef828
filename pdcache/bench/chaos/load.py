"""The steady multi-turn load of `pdcache bench chaos`: `concurrency` conversations in flight
through the router at all times, until the soak's end.

Each worker takes the next session of the trace (the trace repeats with fresh tokens: cycle k
expands the same block ids with token seed `token_seed + k`), and plays its turns one after
the other: the prompt is the session's previous prompt + the ids the stack answered + the
turn's new tokens (token-exact, as `bench replay` does), sent as SGLang's `/generate` with
`input_ids`, greedy, `ignore_eos`, the session's `session_id` and the soak's `cache_salt`. A
failed turn is retried (`retries` times, backoff) as a user would; a session whose turn never
succeeds, or that outgrows the context, makes way for the next one.

Every attempt is one `RequestResult` (appended to `results` and to requests.jsonl); every
success goes to `on_success` (the oracle). An attempt without any answer within
`deadline_s` is `unanswered`. Runs on one asyncio loop (the soak's main thread).
"""

from __future__ import annotations

import asyncio
import itertools
import json
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from typing import Any, TextIO

import httpx
import numpy as np

from pdcache.bench.tokens import BlockExpander
from pdcache.bench.traces import Session, Trace

UNANSWERED = "unanswered"
PROMPT_MISMATCH = "prompt_mismatch"


@dataclass
class RequestResult:
    """One attempt of one turn."""

    request_id: str
    session_id: str
    turn: int
    attempt: int
    dispatched_at_s: float
    done_at_s: float = 0.0
    ok: bool = False
    code: str = ""  # "" when ok; else http_STATUS:CODE, connect_error, unanswered, ...
    message: str = ""
    prefill_node: str = ""
    decode_node: str = ""
    prompt_tokens: int = 0
    cached_tokens: int = 0
    max_new_tokens: int = 0
    output_tokens: int = 0


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
    """Owns the workers, the HTTP client and the results of one soak's traffic."""

    def __init__(
        self,
        settings: LoadSettings,
        trace: Trace,
        sink: TextIO,
        on_success: Callable[[RequestResult, np.ndarray, list[int]], None],
        clock: Callable[[], float],
    ) -> None:
        self.settings = settings
        self.trace = trace
        self.sink = sink
        self.on_success = on_success
        self.clock = clock
        self.results: list[RequestResult] = []
        self._sessions = self._session_stream()

    def _session_stream(self) -> Iterator[tuple[Session, BlockExpander, str]]:
        for cycle in itertools.count():
            expander = BlockExpander(
                self.trace.block_size,
                vocab_high=self.settings.vocab[1],
                vocab_low=self.settings.vocab[0],
                seed=self.settings.token_seed + cycle,
            )
            for session in self.trace.sessions:
                yield (
                    session,
                    expander,
                    f"{self.settings.session_prefix}-c{cycle}-{session.session_id}",
                )

    async def run(self) -> list[RequestResult]:
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
            session, expander, sid = next(self._sessions)
            await self._play(client, session, expander, sid)

    async def _play(
        self, client: httpx.AsyncClient, session: Session, expander: BlockExpander, sid: str
    ) -> None:
        history = np.zeros(0, dtype=np.int32)
        for turn in session.turns:
            new = expander.turn_tokens(turn).astype(np.int32)
            prompt = np.concatenate([history, new]) if turn.with_history else new
            max_new = max(1, turn.output_len)
            if len(prompt) + max_new > self.settings.max_tokens:
                return
            output = await self._turn(client, sid, turn.turn, prompt, max_new)
            if output is None:
                return
            history = np.concatenate([prompt, np.asarray(output, dtype=np.int32)])

    async def _turn(
        self, client: httpx.AsyncClient, sid: str, turn: int, prompt: np.ndarray, max_new: int
    ) -> list[int] | None:
        for attempt in range(self.settings.retries + 1):
            if not self.running():
                return None
            if attempt:
                await asyncio.sleep(self.settings.retry_backoff_s * attempt)
            rec = RequestResult(
                f"{sid}/{turn}/{attempt}",
                sid,
                turn,
                attempt,
                round(self.clock(), 3),
                prompt_tokens=len(prompt),
                max_new_tokens=max_new,
            )
            output = await self._send(client, sid, prompt, max_new, rec)
            rec.done_at_s = round(self.clock(), 3)
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
        rec: RequestResult,
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
            rec.code, rec.message = (
                UNANSWERED,
                f"no answer within {self.settings.deadline_s:g}s ({type(exc).__name__})",
            )
            return None
        except httpx.ConnectError as exc:
            rec.code, rec.message = "connect_error", str(exc)[:200]
            return None
        except httpx.TransportError as exc:
            rec.code, rec.message = f"transport:{type(exc).__name__}", str(exc)[:200]
            return None
        return self._read(resp, rec)

    @staticmethod
    def _read(resp: httpx.Response, rec: RequestResult) -> list[int] | None:
        try:
            data = resp.json()
        except ValueError:
            data = None
        if resp.status_code != 200 or not isinstance(data, dict) or "output_ids" not in data:
            error = (data or {}).get("error") if isinstance(data, dict) else None
            code = (error or {}).get("code") if isinstance(error, dict) else None
            rec.code = f"http_{resp.status_code}:{code or 'no_code'}"
            rec.message = (
                (error or {}).get("message", resp.text)[:300]
                if isinstance(error, dict)
                else resp.text[:300]
            )
            return None
        meta = data.get("meta_info") or {}
        if int(meta.get("prompt_tokens", rec.prompt_tokens)) != rec.prompt_tokens:
            rec.code = PROMPT_MISMATCH
            rec.message = (
                f"sent {rec.prompt_tokens} prompt tokens, the stack saw {meta.get('prompt_tokens')}"
            )
            return None
        output = [int(t) for t in data["output_ids"]]
        rec.ok, rec.output_tokens = True, len(output)
        rec.cached_tokens = int(meta.get("cached_tokens") or 0)
        rec.prefill_node = str(meta.get("prefill_node") or "")
        rec.decode_node = str(meta.get("decode_node") or "")
        return output


def now_s(t0: float) -> Callable[[], float]:
    return lambda: time.monotonic() - t0
