"""`pdcache bench replay`: replay a multi-turn trace against a running stack over HTTP.

Every request goes to `POST {url}/generate` with token ids (docs/design.md §4.1). Turns that carry
history send the session's previous prompt + the ids the server actually generated + the new
tokens, so the server sees exactly what a real conversation would send it; `session_id` is
sent too for the router's affinity. Outputs are forced to the trace's length (`ignore_eos`).

Modes: `afap` (as fast as possible under `--concurrency`; think times ignored), `poisson`
(requests released at Poisson times of rate `--rate`, think times honoured), `trace` (trace
timestamps honoured). `--speedup` divides timestamps and think times. `--round-barrier` releases turn k of every
session only once turn k-1 of every session has finished. The run is bounded by
`--max-duration` (then in-flight requests get `--drain-timeout` before being cancelled);
failures are recorded and counted, never fatal. Writes `DIR/requests.jsonl` as requests
complete, then `DIR/summary.json`, a table and plots (`pdcache.bench.report`).

Hygiene: the `session_id`s sent are `RUN-SID` with a fresh run id `r<8 hex>` per run (or
`--session-prefix`), so a second run against the same router never continues the first run's
sessions. Every answer's `meta.prompt_tokens` must equal the prompt length the replay sent: a
mismatch (the server prepended another history) fails that request (`prompt_mismatch`), is
counted in the summary, and makes the command exit 1 naming the first one.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import secrets
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

import httpx
import numpy as np
from tqdm import tqdm

from pdcache.bench.tokens import BlockExpander, ReuseTracker
from pdcache.bench.traces import Session, Trace, Turn, limit_requests, load_trace, rescale_blocks

MODES = ("afap", "poisson", "trace")
EMPTY = np.zeros(0, dtype=np.int64)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--url", required=True, help="base URL of the stack (router or server)")
    parser.add_argument("--out", required=True, help="output directory")
    add_replay_options(parser)


def add_replay_options(parser: argparse.ArgumentParser) -> None:
    """Every replay option but the target (--url) and --out: shared with `bench compare`."""
    parser.add_argument("--trace", required=True,
                        help="FORMAT:PATH (mooncake, bailian, sharegpt, sessions) or "
                             "synthetic:key=value,... (see pdcache.bench.traces.SyntheticSpec)")
    parser.add_argument("--mode", choices=MODES, default=None,
                        help="default: poisson with --rate, else afap")
    parser.add_argument("--concurrency", type=int, default=4, help="max requests in flight")
    parser.add_argument("--rate", type=float, default=None, help="poisson: requests per second")
    parser.add_argument("--speedup", type=float, default=1.0, help="trace: time compression")
    parser.add_argument("--round-barrier", action="store_true",
                        help="turn k of every session waits for turn k-1 of all sessions")
    parser.add_argument("--max-requests", type=int, default=None,
                        help="keep the first N requests (whole sessions in start order)")
    parser.add_argument("--max-duration", type=float, default=1800.0,
                        help="stop dispatching after S seconds")
    parser.add_argument("--drain-timeout", type=float, default=60.0,
                        help="after --max-duration, wait this long for in-flight requests")
    parser.add_argument("--request-timeout", type=float, default=600.0)
    parser.add_argument("--page-size", type=int, default=16,
                        help="page size of the theoretical reuse computation")
    parser.add_argument("--max-tokens-cap", type=int, default=None,
                        help="cap prompt + output tokens per request (the model's context): "
                             "independent prompts are cut at the end, a session stops at the "
                             "turn that would exceed it (counted as skipped)")
    parser.add_argument("--vocab-size", type=int, default=256,
                        help="token ids are drawn from [--vocab-low, --vocab-size)")
    parser.add_argument("--vocab-low", type=int, default=0)
    parser.add_argument("--token-seed", type=int, default=0, help="seed of block expansion")
    parser.add_argument("--block-size", type=int, default=None,
                        help="block size of the trace's ids (default: the format's)")
    parser.add_argument("--scale-block-size", type=int, default=None,
                        help="replay each block id as this many tokens (shrinks real traces)")
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--no-stream", dest="stream", action="store_false",
                        help="non-streaming requests (no ITL; TTFT from the server's meta)")
    parser.add_argument("--no-session-id", dest="session_id", action="store_false",
                        help="do not send session_id")
    parser.add_argument("--session-prefix", default=None, metavar="PREFIX",
                        help="session ids sent are PREFIX-SID (default: a fresh run id "
                             "r<8 hex> per run, so runs never share router sessions; '' sends "
                             "the trace's ids as they are)")
    parser.add_argument("--cache-salt", default=None,
                        help="send this cache_salt (a fresh one isolates the run from pages "
                             "earlier runs left in the stack's caches)")
    parser.add_argument("--seed", type=int, default=0, help="poisson arrivals seed")
    parser.add_argument("--no-plots", dest="plots", action="store_false")
    parser.add_argument("--no-progress", dest="progress", action="store_false")


@dataclass(frozen=True)
class ReplayConfig:
    url: str
    mode: str = "afap"
    concurrency: int = 4
    rate: float | None = None
    speedup: float = 1.0
    round_barrier: bool = False
    max_duration_s: float = 1800.0
    drain_timeout_s: float = 60.0
    request_timeout_s: float = 600.0
    page_size: int = 16
    max_tokens_cap: int | None = None
    temperature: float = 0.0
    stream: bool = True
    send_session_id: bool = True
    cache_salt: str | None = None
    seed: int = 0
    progress: bool = True
    session_prefix: str = ""  # "" sends the trace's session ids as they are

    def session_id_for(self, trace_session_id: str) -> str:
        """The `session_id` sent for a trace session: `PREFIX-SID`, or SID without a prefix."""
        prefix = self.session_prefix
        return f"{prefix}-{trace_session_id}" if prefix else trace_session_id

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> ReplayConfig:
        mode = args.mode or ("poisson" if args.rate else "afap")
        if mode == "poisson" and not args.rate:
            raise ValueError("--mode poisson needs --rate R (requests per second)")
        if args.concurrency < 1 or args.speedup <= 0:
            raise ValueError("--concurrency must be >= 1 and --speedup > 0")
        return cls(
            url=args.url.rstrip("/"), mode=mode, concurrency=args.concurrency, rate=args.rate,
            speedup=args.speedup, round_barrier=args.round_barrier,
            max_duration_s=args.max_duration, drain_timeout_s=args.drain_timeout,
            request_timeout_s=args.request_timeout, page_size=args.page_size,
            max_tokens_cap=args.max_tokens_cap, temperature=args.temperature,
            stream=args.stream, send_session_id=args.session_id, cache_salt=args.cache_salt,
            seed=args.seed,
            progress=args.progress,
            session_prefix=new_run_id() if args.session_prefix is None else args.session_prefix,
        )


def new_run_id() -> str:
    """A fresh run id, `r` + 8 hex digits: the default session-id prefix of one replay."""
    return f"r{secrets.token_hex(4)}"


class PromptMismatchError(Exception):
    """The server's `prompt_tokens` differs from the prompt the replay sent."""

    def __init__(self, sent: int, seen: int, session_id: str | None) -> None:
        where = f"session {session_id!r}" if session_id else "no session_id"
        super().__init__(
            f"sent {sent} prompt tokens, the server saw {seen} ({where}): another history was "
            "prepended; replay with a fresh --session-prefix")
        self.sent, self.seen = sent, seen


PROMPT_MISMATCH = "prompt_mismatch"


def check_prompt_tokens(rec: RequestRecord) -> None:
    """Raise PromptMismatchError if the answer's meta named another prompt length. Answers
    without `prompt_tokens` (servers that do not report it) are not checked."""
    seen = rec.server_prompt_tokens
    if seen is not None and seen != rec.prompt_tokens:
        raise PromptMismatchError(rec.prompt_tokens, seen, rec.sent_session_id)


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


class RoundBarrier:
    """Round k opens when every session that has a turn k-1 finished (or dropped) it."""

    def __init__(self, sessions: tuple[Session, ...]) -> None:
        rounds = max((len(s.turns) for s in sessions), default=0)
        self.pending = [sum(len(s.turns) > k for s in sessions) for k in range(rounds)]
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


@dataclass
class RequestRecord:
    """One line of requests.jsonl."""

    request_id: str
    session_id: str
    turn: int
    ok: bool = False
    error: str | None = None
    http_status: int | None = None
    dispatch_s: float = 0.0
    prompt_tokens: int = 0
    new_input_tokens: int = 0
    max_new_tokens: int = 0
    output_tokens: int = 0
    cached_tokens: int = 0
    cached_device: int = 0
    cached_host: int = 0
    cached_storage: int = 0
    cached_storage_from_decode: int = 0
    computed_tokens: int | None = None
    theoretical_cached_tokens: int = 0
    ttft_s: float | None = None
    server_ttft_s: float | None = None
    e2e_s: float | None = None
    itl_s: list[float] = field(default_factory=list)
    prefill_node: str | None = None
    decode_node: str | None = None
    sent_session_id: str | None = None  # the `session_id` sent (None: none was sent)
    server_prompt_tokens: int | None = None  # the answer's `meta.prompt_tokens`

    def apply_meta(self, meta: dict[str, Any]) -> None:
        details = meta.get("cached_tokens_details") or {}
        seen = meta.get("prompt_tokens")
        self.server_prompt_tokens = None if seen is None else int(seen)
        self.cached_tokens = int(meta.get("cached_tokens") or 0)
        for tier in ("device", "host", "storage", "storage_from_decode"):
            setattr(self, f"cached_{tier}", int(details.get(tier) or 0))
        computed = meta.get("computed_tokens")
        self.computed_tokens = None if computed is None else int(computed)
        ttft = meta.get("ttft_s")
        self.server_ttft_s = None if ttft is None else float(ttft)
        self.prefill_node = meta.get("prefill_node")
        self.decode_node = meta.get("decode_node")


class HttpError(Exception):
    def __init__(self, status: int, body: str) -> None:
        super().__init__(f"HTTP {status}: {body[:300]}")
        self.status = status


class StreamErrorChunk(Exception):
    """The server reported an error inside a 200 event stream."""


@dataclass
class StreamState:
    """Timing of a streamed response, measured on arrival of token-bearing chunks."""

    start: float
    output_ids: list[int] = field(default_factory=list)
    first_token_at: float | None = None
    last_at: float | None = None
    itl_s: list[float] = field(default_factory=list)
    meta: dict[str, Any] = field(default_factory=dict)

    def on_chunk(self, chunk: dict[str, Any], now: float) -> None:
        if chunk.get("error"):
            raise StreamErrorChunk(json.dumps(chunk["error"])[:300])
        ids = chunk.get("output_ids") or []
        if ids:
            if self.first_token_at is None:
                self.first_token_at = now
                gaps = [0.0] * (len(ids) - 1)  # tokens of the first chunk arrive together
            else:
                gaps = [(now - (self.last_at or now)) / len(ids)] * len(ids)
            self.itl_s.extend(gaps)
            self.last_at = now
            self.output_ids.extend(int(t) for t in ids)
        if chunk.get("meta"):
            self.meta = chunk["meta"]


async def send_stream(
    client: httpx.AsyncClient, body: dict[str, Any], rec: RequestRecord,
    on_first_token: Callable[[], None],
) -> list[int]:
    state = StreamState(start=time.perf_counter())
    async with client.stream("POST", "/generate", json=body) as resp:
        rec.http_status = resp.status_code
        if resp.status_code != 200:
            raise HttpError(resp.status_code, (await resp.aread()).decode(errors="replace"))
        async for line in resp.aiter_lines():
            if not line.startswith("data:"):
                continue
            payload = line[5:].strip()
            if payload == "[DONE]":
                break
            had_token = state.first_token_at is not None
            state.on_chunk(json.loads(payload), time.perf_counter())
            if not had_token and state.first_token_at is not None:
                on_first_token()
    end = time.perf_counter()
    rec.apply_meta(state.meta)
    rec.e2e_s = end - state.start
    rec.ttft_s = None if state.first_token_at is None else state.first_token_at - state.start
    rec.itl_s = [round(g, 6) for g in state.itl_s]
    return state.output_ids


async def send_plain(
    client: httpx.AsyncClient, body: dict[str, Any], rec: RequestRecord,
    on_first_token: Callable[[], None],
) -> list[int]:
    start = time.perf_counter()
    resp = await client.post("/generate", json=body)
    rec.http_status = resp.status_code
    if resp.status_code != 200:
        raise HttpError(resp.status_code, resp.text)
    data = resp.json()
    rec.e2e_s = time.perf_counter() - start
    rec.apply_meta(data.get("meta") or {})
    rec.ttft_s = rec.server_ttft_s
    on_first_token()  # not observable without streaming: the prompt counts from completion
    return [int(t) for t in data.get("output_ids") or []]


class Replayer:
    """Drives one replay: owns the HTTP client, the reuse tracker and the output file."""

    def __init__(
        self, cfg: ReplayConfig, trace: Trace, expander: BlockExpander, sink: TextIO
    ) -> None:
        self.cfg = cfg
        self.trace = trace
        self.expander = expander
        self.sink = sink
        self.tracker = ReuseTracker(cfg.page_size)
        self.counts = {"sent": 0, "ok": 0, "failed": 0, "skipped": 0, PROMPT_MISMATCH: 0}
        self.first_mismatch: str | None = None  # "REQUEST_ID: message" of the first one
        self.skip_reasons: dict[str, int] = {}
        self.stopping = False

    # -- timing -------------------------------------------------------------------------------

    def now(self) -> float:
        return asyncio.get_running_loop().time() - self.t0

    async def sleep_until(self, t: float) -> None:
        await asyncio.sleep(max(0.0, min(t, self.cfg.max_duration_s) - self.now()))

    async def wait_release(self, turn: Turn, parent_done_s: float) -> None:
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

    # -- one session --------------------------------------------------------------------------

    def skip(self, session: Session, from_turn: int, reason: str) -> None:
        for turn in session.turns[from_turn:]:
            self.counts["skipped"] += 1
            self.skip_reasons[reason] = self.skip_reasons.get(reason, 0) + 1
            if self.barrier is not None:
                self.barrier.finish(turn.turn)
            self.pbar.update(1)

    def build_prompt(self, turn: Turn, history: np.ndarray) -> tuple[np.ndarray, int] | None:
        """(prompt, max_new_tokens), or None when the session exceeds --max-tokens-cap."""
        new = self.expander.turn_tokens(turn)
        prompt = np.concatenate([history, new]) if turn.dependent else new
        max_new = max(1, turn.output_len)
        cap = self.cfg.max_tokens_cap
        if cap is not None and len(prompt) + max_new > cap:
            if turn.dependent or turn.with_history:
                return None
            max_new = min(max_new, max(1, cap // 2))
            prompt = prompt[: cap - max_new]
        return prompt, max_new

    async def run_session(self, session: Session) -> None:
        history, parent_done_s = EMPTY, 0.0
        for index, turn in enumerate(session.turns):
            await self.wait_release(turn, parent_done_s)
            built = self.build_prompt(turn, history)
            if built is None:
                return self.skip(session, index, "max_tokens_cap")
            if self.stopping or self.now() >= self.cfg.max_duration_s:
                return self.skip(session, index, "max_duration")
            async with self.semaphore:
                if self.now() >= self.cfg.max_duration_s:
                    return self.skip(session, index, "max_duration")
                rec, output = await self.dispatch(session, turn, *built)
            parent_done_s = self.now()
            self.finish(turn, rec)
            if not rec.ok and index + 1 < len(session.turns):
                if any(t.dependent for t in session.turns[index + 1 :]):
                    return self.skip(session, index + 1, "parent_failed")
            history = np.concatenate([built[0], np.asarray(output, dtype=np.int64)])

    async def dispatch(
        self, session: Session, turn: Turn, prompt: np.ndarray, max_new: int
    ) -> tuple[RequestRecord, list[int]]:
        rec = RequestRecord(
            turn.request_id, session.session_id, turn.turn, dispatch_s=round(self.now(), 6),
            prompt_tokens=len(prompt), max_new_tokens=max_new,
            new_input_tokens=turn.input_len if turn.dependent else len(prompt),
        )
        keys = self.tracker.keys(prompt)
        rec.theoretical_cached_tokens = self.tracker.reusable_tokens(keys, len(prompt))
        self.counts["sent"] += 1
        output: list[int] = []
        try:
            output = await asyncio.wait_for(
                self.send(session, prompt, max_new, rec, lambda: self.tracker.add(keys)),
                self.cfg.request_timeout_s)
            check_prompt_tokens(rec)
            rec.ok, rec.output_tokens = True, len(output)
            full = np.concatenate([prompt, np.asarray(output, dtype=np.int64)])
            self.tracker.add(self.tracker.extend_keys(keys, full[:-1]))  # last token: no KV
        except asyncio.CancelledError:
            rec.error = "cancelled: --max-duration + --drain-timeout reached"
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

    async def send(
        self, session: Session, prompt: np.ndarray, max_new: int, rec: RequestRecord,
        on_first_token: Callable[[], None],
    ) -> list[int]:
        body: dict[str, Any] = {
            "input_ids": prompt.tolist(),
            "sampling_params": {"max_new_tokens": max_new, "ignore_eos": True,
                                "temperature": self.cfg.temperature},
            "stream": self.cfg.stream,
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
        if self.barrier is not None:
            self.barrier.finish(turn.turn)
        self.pbar.update(1)

    def write(self, rec: RequestRecord) -> None:
        self.sink.write(json.dumps(rec.__dict__) + "\n")
        self.sink.flush()

    # -- whole run ----------------------------------------------------------------------------

    async def run(self) -> dict[str, Any]:
        cfg = self.cfg
        self.t0 = asyncio.get_running_loop().time()
        self.semaphore = asyncio.Semaphore(cfg.concurrency)
        self.gate = PoissonGate(cfg.rate, cfg.seed) if cfg.mode == "poisson" else None
        self.barrier = RoundBarrier(self.trace.sessions) if cfg.round_barrier else None
        limits = httpx.Limits(max_connections=cfg.concurrency + 4)
        timeout = httpx.Timeout(cfg.request_timeout_s, connect=30.0)
        self.pbar = tqdm(total=self.trace.num_requests, file=sys.stderr, unit="req",
                         disable=not cfg.progress, desc="replay")
        wall_start = time.perf_counter()
        async with httpx.AsyncClient(base_url=cfg.url, limits=limits, timeout=timeout) as client:
            self.client = client
            tasks = [asyncio.create_task(self.run_session(s)) for s in self.trace.sessions]
            _, pending = await asyncio.wait(
                tasks, timeout=cfg.max_duration_s + cfg.drain_timeout_s)
            self.stopping = True
            for task in pending:
                task.cancel()
            results = await asyncio.gather(*tasks, return_exceptions=True)
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
        }


def prepare_trace(args: argparse.Namespace) -> Trace:
    trace = load_trace(args.trace, block_size=args.block_size)
    if args.scale_block_size:
        trace = rescale_blocks(trace, args.scale_block_size)
    if args.max_requests is not None:
        trace = limit_requests(trace, args.max_requests)
    return trace


def run(args: argparse.Namespace) -> int:
    from pdcache.bench import report

    try:
        cfg = ReplayConfig.from_args(args)
        trace = prepare_trace(args)
    except ValueError as exc:
        print(f"pdcache bench replay: {exc}", file=sys.stderr)
        return 2
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    expander = BlockExpander(trace.block_size, vocab_high=args.vocab_size,
                             vocab_low=args.vocab_low, seed=args.token_seed)
    with (out_dir / "requests.jsonl").open("w") as sink:
        run_info = asyncio.run(Replayer(cfg, trace, expander, sink).run())
    run_info.update(trace=args.trace, trace_name=trace.name, block_size=trace.block_size,
                    sessions=len(trace.sessions), config=cfg.__dict__)
    summary = report.write_report(out_dir, run_info, plots=args.plots,
                                  json_path=getattr(args, "json_path", None))
    if run_info["requests_prompt_mismatch"]:
        print(f"pdcache bench replay: FAILED: {run_info['requests_prompt_mismatch']} answer(s) "
              f"saw another prompt than the one sent; first: {run_info['first_prompt_mismatch']}",
              file=sys.stderr)
        return 1
    return 0 if summary["requests_ok"] > 0 or run_info["requests_sent"] == 0 else 1
