"""The engine <-> asyncio bridge: one `EngineBridge` per HTTP app around an Engine.

The engine runs its own thread and reports progress through `on_output` callbacks; each
request gets an asyncio queue fed with `loop.call_soon_threadsafe` (`EngineRequest`). Every
wait on that queue has a deadline (`ServerConfig.request_timeout_s`), and a request whose
client went away (or that timed out, or whose stop string matched) is aborted in the engine,
so no engine work or KV page outlives its HTTP request. `EngineBridge.finish` counts every
request once in the server's metrics, whichever way it ended.

Threads: everything here runs on the event loop, except `EngineRequest.on_output` (engine
thread; a decode answer's gated last output: the decode transfer thread), which only
schedules a queue put on the loop.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable
from contextlib import aclosing
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from fastapi import Request
from fastapi.responses import Response
from starlette.background import BackgroundTask

from pdcache.config.schema import ApiSettings, NodeAuthSettings, field_values
from pdcache.engine.api import (
    CachedTokens,
    GenerateRequest,
    LogprobRequest,
    RequestOutput,
    SamplingParams,
    TokenConstraint,
    TokenLogprob,
)
from pdcache.engine.engine import Engine, EngineNotRunningError, EngineOverloadedError
from pdcache.engine.state_pool import StateSnapshot
from pdcache.server.metrics import ServerMetrics
from pdcache.wire.detokenize import TextAssembler
from pdcache.wire.generate_api import finish_reason_object
from pdcache.wire.protocol import OVERLOADED, SERVER_ERROR, TIMEOUT, ApiError, bad_request
from pdcache.wire.responses import event_stream, usage_body, wait_for_disconnect

if TYPE_CHECKING:
    from pdcache.config.node_setup import NodeSetup

log = logging.getLogger(__name__)

CLIENT_DISCONNECTED = "client_disconnected"


@dataclass(frozen=True, kw_only=True)
class ServerConfig(ApiSettings, NodeAuthSettings):
    """Settings of one HTTP server process around an engine: the node's `ApiSettings`
    (request deadline, parsers, /generate streaming) and `[security]`'s `NodeAuthSettings`
    (whether /metrics needs the credential; both declared once, in the topology schema) and
    what the process itself adds."""

    name: str = "unified"
    manage_engine: bool = True  # start the engine at app startup and shut it down at exit
    role: str = "unified"  # unified | prefill | decode (/server_info's disaggregation_mode)
    model_path: str = ""  # preset name or checkpoint path; "" = the model's name
    health_check_timeout_s: float = 20.0  # /health_generate's deadline (SGLang's default)
    # Bearer credential every endpoint but /health (and /metrics unless metrics_auth) needs:
    # derived from the cluster secret (`SecuritySettings.node_http_token`); None: open.
    auth_token: str | None = None

    @classmethod
    def of(cls, setup: NodeSetup) -> ServerConfig:
        """The server settings of a node process."""
        return cls(name=setup.name, role=setup.role, model_path=setup.model_path,
                   **field_values(setup.server),
                   **field_values(setup.security, NodeAuthSettings),
                   auth_token=setup.security.node_http_token)


# --------------------------------------------------------------------------- one request


class EngineRequest:
    """One submitted engine request, its outputs bridged into an asyncio queue."""

    def __init__(self, engine: Engine, rid: str, deadline: float) -> None:
        self._engine = engine
        self._loop = asyncio.get_running_loop()
        self._queue: asyncio.Queue[RequestOutput] = asyncio.Queue()
        self.rid = rid
        self.deadline = deadline
        self.finished = False  # the final output arrived
        self.abort_sent = False

    def on_output(self, out: RequestOutput) -> None:
        """Engine-thread callback; must never raise into the engine loop."""
        try:
            self._loop.call_soon_threadsafe(self._queue.put_nowait, out)
        except RuntimeError:  # event loop already closed: the server is shutting down
            pass

    async def next(self, disconnected: asyncio.Future[None] | None) -> RequestOutput:
        """The next output; ApiError on deadline, client disconnect or engine failure."""
        remaining = self.deadline - time.monotonic()
        getter = asyncio.ensure_future(self._queue.get())
        waiting: set[asyncio.Future[Any]] = {getter}
        if disconnected is not None:
            waiting.add(disconnected)
        try:
            await asyncio.wait(waiting, timeout=max(remaining, 0.0), return_when="FIRST_COMPLETED")
        finally:
            if not getter.done():
                getter.cancel()
        if getter.done() and not getter.cancelled():
            return self._check(getter.result())
        if disconnected is not None and disconnected.done():
            raise ApiError(499, "client disconnected", type=CLIENT_DISCONNECTED)
        raise ApiError(504, f"request {self.rid} passed its deadline", type=TIMEOUT, code="timeout")

    def _check(self, out: RequestOutput) -> RequestOutput:
        if out.finished:
            self.finished = True
            if out.finish_reason == "abort" and not self.abort_sent:
                reason = out.error or "no reason given"
                raise ApiError(500, f"engine aborted the request: {reason}", type=SERVER_ERROR,
                               code="engine_abort")
        return out

    def abort(self) -> None:
        """Ask the engine to abort unless finished or already asked; idempotent."""
        if self.finished or self.abort_sent:
            return
        self.abort_sent = True
        try:
            self._engine.abort(self.rid)
        except Exception:
            log.exception("engine.abort(%s) failed", self.rid)

    async def drain(self, disconnected: asyncio.Future[None] | None) -> RequestOutput | None:
        """After `abort()`: wait (within the deadline) for the final output, for its stats."""
        try:
            while True:
                out = await self.next(disconnected)
                if out.finished:
                    return out
        except ApiError:
            return None


class PrefillStats(Protocol):
    """What a prefill node reported about a PD request's prompt (the decode side's view)."""

    @property
    def cached(self) -> CachedTokens: ...
    @property
    def computed_tokens(self) -> int: ...
    @property
    def prefill_node(self) -> str: ...


@dataclass
class Generation:
    """What one request produced so far, with its timings (server clock, from arrival).

    With `report` (a decode node's PD request), the prompt's reuse numbers are prefill's:
    the decode engine only received the prompt's K/V."""

    arrival: float
    report: PrefillStats | None = None
    output_ids: list[int] = field(default_factory=list)
    prompt_tokens: int = 0
    cached: CachedTokens = field(default_factory=CachedTokens)
    computed_tokens: int = 0
    finish_reason: str | None = None
    first_token_at: float | None = None
    last_token_at: float | None = None
    done_at: float | None = None
    stream: bool = False  # answered as SSE (`EngineBridge.streaming`): SGLang's is_streaming
    rid: str = ""  # meta_info.id
    error: str | None = None  # an abort's reason
    matched: int | str | None = None  # what stopped it: a stop string, else the last token
    # logprobs (GenerateRequest.logprobs): output ones not yet sent, the prompt's once
    new_logprobs: list[TokenLogprob] = field(default_factory=list)
    input_logprobs: list[TokenLogprob] | None = None

    def __post_init__(self) -> None:
        if self.report is not None:
            self.cached, self.computed_tokens = self.report.cached, self.report.computed_tokens

    def absorb(self, out: RequestOutput, now: float) -> float | None:
        """Record one engine output; returns the gap since the previous tokens (for ITL)."""
        gap = None if self.last_token_at is None else now - self.last_token_at
        self.absorb_stats(out)
        if out.new_token_ids:
            self.output_ids.extend(out.new_token_ids)
            self.first_token_at = self.first_token_at or now
            self.last_token_at = now
        self.new_logprobs.extend(out.new_logprobs)
        if out.input_logprobs is not None:
            self.input_logprobs = out.input_logprobs
        if out.finished:
            self.finish_reason = out.finish_reason
            self.error = out.error
            if out.finish_reason == "stop" and self.matched is None and self.output_ids:
                self.matched = self.output_ids[-1]  # EOS or a stop token id
        return gap

    def take_logprobs(self) -> list[TokenLogprob]:
        """The output logprobs absorbed since the previous call (one chunk's)."""
        taken, self.new_logprobs = self.new_logprobs, []
        return taken

    def absorb_stats(self, out: RequestOutput) -> None:
        if out.prompt_tokens:  # outputs carry the prompt statistics once the prompt is matched
            self.prompt_tokens = out.prompt_tokens
            if self.report is None:
                self.cached = out.cached
                self.computed_tokens = out.computed_tokens

    @property
    def ttft_s(self) -> float | None:
        return None if self.first_token_at is None else self.first_token_at - self.arrival

    @property
    def e2e_s(self) -> float | None:
        return None if self.done_at is None else self.done_at - self.arrival


# --------------------------------------------------------------------------- the bridge


class EngineBridge:
    """Submits requests to one engine and runs them to their end on the event loop.

    Owns no thread and no engine lifecycle (the runtime starts and stops the engine); it
    mutates only its `metrics` (on the loop) and the `Generation` it is handed."""

    def __init__(self, engine: Engine, config: ServerConfig, metrics: ServerMetrics) -> None:
        self.engine = engine
        self.config = config
        self.metrics = metrics

    def _new_handle(self, rid: str) -> EngineRequest:
        return EngineRequest(self.engine, rid, time.monotonic() + self.config.request_timeout_s)

    def submit(self, gen: Generation, input_ids: list[int], sampling: SamplingParams,
               salt: str | None, rid: str | None = None, *,
               logprobs: LogprobRequest | None = None, prefill_leader: str | None = None,
               constraint: TokenConstraint | None = None, session_id: str | None = None
               ) -> EngineRequest:
        """Queue a request in the engine; 503 when full or stopped, 400 when invalid.
        `logprobs`, `prefill_leader`, `constraint` and `session_id` are `GenerateRequest`'s."""
        handle = self._new_handle(rid or uuid.uuid4().hex)
        gen.rid = handle.rid
        req = GenerateRequest(rid=handle.rid, input_ids=input_ids, sampling=sampling,
                              cache_salt=salt or "", logprobs=logprobs,
                              prefill_leader=prefill_leader, constraint=constraint,
                              session_id=session_id or "")
        try:
            self.engine.submit(req, handle.on_output)
        except EngineOverloadedError as exc:
            raise ApiError(503, f"server overloaded: {exc}", type=OVERLOADED,
                           code="overloaded") from None
        except EngineNotRunningError as exc:
            raise ApiError(503, f"server unavailable: {exc}", type=OVERLOADED,
                           code="unavailable") from None
        except ValueError as exc:
            raise bad_request(str(exc), code="invalid_request") from None
        gen.prompt_tokens = len(input_ids)
        return handle

    def submit_prefilled(self, gen: Generation, rid: str, input_ids: list[int],
                         sampling: SamplingParams, salt: str | None, first_token: int, *,
                         logprobs: LogprobRequest | None = None,
                         constraint: TokenConstraint | None = None,
                         first_logprob: TokenLogprob | None = None,
                         input_logprobs: list[TokenLogprob] | None = None,
                         session_id: str | None = None,
                         state: StateSnapshot | None = None,
                         ) -> EngineRequest:
        """Start decoding a request whose prompt K/V sits in the pages reserved under `rid`
        (and, for a hybrid model, whose recurrent `state` prefill sent);
        on failure the reservation is freed and the request answers 500. `first_logprob` /
        `input_logprobs`: what prefill's report carried; a `constraint` is rebuilt from the
        request and the engine advances it past `first_token` (`Engine.submit_prefilled`);
        `session_id`: the conversation the turn belongs to (the decode tree's session
        eviction policy)."""
        handle = self._new_handle(rid)
        gen.rid = rid
        req = GenerateRequest(rid=rid, input_ids=input_ids, sampling=sampling,
                              cache_salt=salt or "", logprobs=logprobs, constraint=constraint,
                              session_id=session_id or "")  # the session eviction policy's
        try:
            self.engine.submit_prefilled(req, first_token, handle.on_output,
                                         first_logprob=first_logprob,
                                         input_logprobs=input_logprobs, state=state)
        except (ValueError, EngineNotRunningError) as exc:
            self.engine.abort(rid)  # frees the reservation
            raise ApiError(500, f"cannot start decoding: {exc}", type=SERVER_ERROR) from None
        gen.prompt_tokens = len(input_ids)
        return handle

    async def outputs(self, handle: EngineRequest, gen: Generation, text: TextAssembler,
                      disconnected: asyncio.Future[None] | None = None
                      ) -> AsyncIterator[tuple[list[int], str]]:
        """Yield (new token ids, new text) until the request ends; aborts it on early exit."""
        try:
            while not handle.finished:
                out = await handle.next(disconnected)
                gap = gen.absorb(out, time.monotonic())
                if out.new_token_ids:
                    self.metrics.observe_tokens(len(out.new_token_ids), gap)
                delta = text.add(out.new_token_ids) if out.new_token_ids else ""
                if text.stopped:
                    gen.matched, gen.finish_reason = text.matched, "stop"
                    yield out.new_token_ids, delta
                    await self._stop_early(handle, gen, disconnected)
                    break
                if handle.finished:
                    delta += text.flush()
                if out.new_token_ids or delta or handle.finished:
                    yield out.new_token_ids, delta
        finally:
            handle.abort()
            self.finish(gen)

    async def text_deltas(self, handle: EngineRequest, gen: Generation, text: TextAssembler
                          ) -> AsyncIterator[str]:
        """The non-empty text deltas of `outputs` (what an OpenAI stream sends)."""
        async with aclosing(self.outputs(handle, gen, text)) as stream:
            async for _, delta in stream:
                if delta:
                    yield delta

    async def _stop_early(self, handle: EngineRequest, gen: Generation,
                          disconnected: asyncio.Future[None] | None) -> None:
        """A stop string matched: abort the engine request, keep its final prompt stats."""
        gen.finish_reason = "stop"
        if handle.finished:
            return
        handle.abort()
        final = await handle.drain(disconnected)
        if final is not None:
            gen.absorb_stats(final)

    async def collect(self, request: Request, handle: EngineRequest, gen: Generation,
                      text: TextAssembler) -> None:
        """Run a non-streaming request to its end, aborting it if the client goes away."""
        await self.collect_many(request, [(handle, gen, text)])

    async def collect_many(self, request: Request,
                           runs: list[tuple[EngineRequest, Generation, TextAssembler]]) -> None:
        """Run non-streaming requests (one /generate's sequences) to their end; the client
        going away, or one of them failing, aborts them all."""
        disconnected = asyncio.ensure_future(wait_for_disconnect(request))

        async def run(handle: EngineRequest, gen: Generation, text: TextAssembler) -> None:
            async with aclosing(self.outputs(handle, gen, text, disconnected)) as stream:
                async for _ in stream:
                    pass

        tasks = [asyncio.ensure_future(run(*r)) for r in runs]
        try:
            await asyncio.gather(*tasks)
        finally:
            disconnected.cancel()
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            for handle, gen, _ in runs:
                self._cleanup(handle, gen)

    def streaming(self, events: AsyncIterator[bytes], handle: EngineRequest, gen: Generation
                  ) -> Response:
        """SSE response whose cleanup aborts the request and counts it (client gone early)."""
        return self.streaming_many(events, [(handle, gen)])

    def streaming_many(self, events: AsyncIterator[bytes],
                       runs: list[tuple[EngineRequest, Generation]]) -> Response:
        """`streaming` for one /generate's sequences."""
        for _, gen in runs:
            gen.stream = True
        return event_stream(events, BackgroundTask(self._cleanup_all, runs))

    def _cleanup_all(self, runs: list[tuple[EngineRequest, Generation]]) -> None:
        for handle, gen in runs:
            self._cleanup(handle, gen)

    def _cleanup(self, handle: EngineRequest, gen: Generation) -> None:
        handle.abort()
        self.finish(gen)

    def finish(self, gen: Generation) -> None:
        """Count a request in the metrics, once, whichever way it ended."""
        if gen.done_at is not None:
            return
        gen.done_at = time.monotonic()
        gen.finish_reason = gen.finish_reason or "abort"
        self.metrics.finished.labels(gen.finish_reason).inc()
        self.metrics.observe_prompt(gen.prompt_tokens, gen.cached, gen.computed_tokens)
        if gen.ttft_s is not None:
            self.metrics.ttft.observe(gen.ttft_s)
        self.metrics.e2e.observe(gen.e2e_s or 0.0)
        self._observe_sglang(gen)

    def _observe_sglang(self, gen: Generation) -> None:
        """The request in SGLang's series (`sglang:*`), as its tokenizer manager counts it."""
        series, completion = self.metrics.sglang, len(gen.output_ids)
        series.observe_finished(gen.prompt_tokens, completion, gen.cached, gen.e2e_s or 0.0,
                                stream=gen.stream, aborted=gen.finish_reason == "abort")
        decode_s = None
        if gen.first_token_at is not None and gen.done_at is not None:
            decode_s = gen.done_at - gen.first_token_at
        series.observe_latency(gen.ttft_s, decode_s, completion, stream=gen.stream)

    def meta_info(self, gen: Generation, logprobs: dict[str, Any] | None = None
                  ) -> dict[str, Any]:
        """SGLang's `meta_info` of `gen` now (in SGLang's key order), then pdcache's fields;
        `finish_reason` and `e2e_latency` once it ended. `logprobs`: SGLang's logprob keys
        for this answer or chunk (`pdcache.wire.logprobs`)."""
        prefill_node = gen.report.prefill_node if gen.report is not None else self.config.name
        completion = len(gen.output_ids)
        info: dict[str, Any] = {
            "id": gen.rid,
            "finish_reason": finish_reason_object(gen.finish_reason, completion, gen.matched,
                                                  gen.error),
            "prompt_tokens": gen.prompt_tokens, "weight_version": "default",
            "num_retractions": 0}
        if logprobs:
            info.update(logprobs)
        info.update({"reasoning_tokens": 0, "completion_tokens": completion,
                     "cached_tokens": gen.cached.total,
                     "cached_tokens_details": gen.cached.as_dict()})
        if gen.finish_reason is not None:
            info["e2e_latency"] = time.monotonic() - gen.arrival if gen.done_at is None \
                else gen.e2e_s
        info.update({"computed_tokens": gen.computed_tokens, "ttft_s": gen.ttft_s,
                     "prefill_node": prefill_node, "decode_node": self.config.name})
        return info

    def usage(self, gen: Generation) -> dict[str, Any]:
        return usage_body(gen.prompt_tokens, len(gen.output_ids), gen.cached, gen.computed_tokens)


# --------------------------------------------------------------------------- helpers


def set_result_once(future: asyncio.Future, value: Any) -> None:
    """For `loop.call_soon_threadsafe`: resolve `future` unless it is already done."""
    if not future.done():
        future.set_result(value)


def resolve_on_loop(loop: asyncio.AbstractEventLoop, future: asyncio.Future[Any]
                    ) -> Callable[[Any], None]:
    """A callback for another thread (a node controller's `notify`): resolve `future` on
    `loop` with its argument, once; a closed loop (the server is gone) is ignored."""

    def notify(value: Any) -> None:
        try:
            loop.call_soon_threadsafe(set_result_once, future, value)
        except RuntimeError:
            pass

    return notify


def json_ready(value: Any) -> Any:
    """`value` with every key a string and every leaf JSON-native (others become strings)."""
    if isinstance(value, dict):
        return {str(k): json_ready(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [json_ready(v) for v in value]
    if isinstance(value, int | float | str | bool) or value is None:
        return value
    return str(value)
