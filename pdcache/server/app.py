"""FastAPI app of the unified server: the HTTP contract of DESIGN.md §4.1 around one Engine.

The engine runs its own thread and reports progress through `on_output` callbacks; each
request gets an asyncio queue fed with `loop.call_soon_threadsafe`. Every wait on that queue
has a deadline (`ServerConfig.request_timeout_s`), and a request whose client went away (or
that timed out, or whose stop string matched) is aborted in the engine, so no engine work or
KV page outlives its HTTP request.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import aclosing, asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.background import BackgroundTask
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException as StarletteHTTPException

from pdcache.engine.api import CachedTokens, GenerateRequest, RequestOutput, SamplingParams
from pdcache.engine.engine import Engine, EngineNotRunningError, EngineOverloadedError
from pdcache.server.metrics import ServerMetrics
from pdcache.server.protocol import (
    NOT_FOUND,
    OVERLOADED,
    SERVER_ERROR,
    SSE_DONE,
    TIMEOUT,
    ApiError,
    CachedTokensDetails,
    ChatCompletionRequest,
    CompletionRequest,
    GenerateMeta,
    GenerateRequestBody,
    GenerateResponse,
    ModelLimits,
    OpenAIRequestBase,
    ResponseHead,
    TextAssembler,
    bad_request,
    chat_choice,
    chat_delta,
    check_prompt,
    check_token_ids,
    default_max_tokens,
    error_body,
    now_s,
    parse_body,
    sse,
    text_choice,
    usage_body,
)

log = logging.getLogger(__name__)

CLIENT_DISCONNECTED = "client_disconnected"


@dataclass(frozen=True)
class ServerConfig:
    """Settings of one HTTP server process around an engine."""

    name: str = "unified"
    request_timeout_s: float = 600.0  # deadline of every wait on the engine, per request
    manage_engine: bool = True  # start the engine at app startup and shut it down at exit


# --------------------------------------------------------------------------- engine bridge


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
                raise ApiError(
                    500,
                    f"engine aborted the request: {reason}",
                    type=SERVER_ERROR,
                    code="engine_abort",
                )
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


# --------------------------------------------------------------------------- one generation


@dataclass
class Generation:
    """What one request produced so far, with its timings (server clock, from arrival)."""

    arrival: float
    output_ids: list[int] = field(default_factory=list)
    prompt_tokens: int = 0
    cached: CachedTokens = field(default_factory=CachedTokens)
    computed_tokens: int = 0
    finish_reason: str | None = None
    first_token_at: float | None = None
    last_token_at: float | None = None
    done_at: float | None = None

    def absorb(self, out: RequestOutput, now: float) -> float | None:
        """Record one engine output; returns the gap since the previous tokens (for ITL)."""
        gap = None if self.last_token_at is None else now - self.last_token_at
        self.absorb_stats(out)
        if out.new_token_ids:
            self.output_ids.extend(out.new_token_ids)
            self.first_token_at = self.first_token_at or now
            self.last_token_at = now
        if out.finished:
            self.finish_reason = out.finish_reason
        return gap

    def absorb_stats(self, out: RequestOutput) -> None:
        if out.prompt_tokens:  # only final outputs carry the prompt statistics
            self.prompt_tokens = out.prompt_tokens
            self.cached = out.cached
            self.computed_tokens = out.computed_tokens

    @property
    def ttft_s(self) -> float | None:
        return None if self.first_token_at is None else self.first_token_at - self.arrival

    @property
    def e2e_s(self) -> float | None:
        return None if self.done_at is None else self.done_at - self.arrival


# --------------------------------------------------------------------------- the server


class UnifiedServer:
    """Request handling of one unified (prefill + decode) server; owns no engine thread."""

    def __init__(self, engine: Engine, config: ServerConfig) -> None:
        self.engine = engine
        self.config = config
        self.tokenizer = engine.tokenizer
        model = engine.config.model
        self.model_name = model.name
        self.limits = ModelLimits(model.vocab_size, model.max_position_embeddings)
        # HiCacheScheduler has stats(); a device-only scheduler does not
        tier_stats = getattr(getattr(engine, "scheduler", None), "stats", None)
        self.metrics = ServerMetrics(config.name, stats=engine.stats,
                                     tier_stats=tier_stats if callable(tier_stats) else None)
        self.created = now_s()

    # ---- plumbing shared by the endpoints

    async def guarded(
        self, endpoint: str, handler: Callable[[Request], Awaitable[Response]], request: Request
    ) -> Response:
        """Run a handler; map every failure to a JSON error and count the status code."""
        try:
            response = await handler(request)
        except ApiError as exc:
            response = error_response(exc)
        except Exception as exc:  # a bug must cost one request, never the process
            log.exception("%s failed", endpoint)
            response = error_response(ApiError(500, f"internal error: {exc}", type=SERVER_ERROR))
        self.metrics.observe_request(endpoint, response.status_code)
        return response

    def submit(
        self,
        gen: Generation,
        input_ids: list[int],
        sampling: SamplingParams,
        salt: str | None,
        rid: str | None = None,
    ) -> EngineRequest:
        rid = rid or uuid.uuid4().hex
        handle = EngineRequest(self.engine, rid, time.monotonic() + self.config.request_timeout_s)
        req = GenerateRequest(
            rid=rid, input_ids=input_ids, sampling=sampling, cache_salt=salt or ""
        )
        try:
            self.engine.submit(req, handle.on_output)
        except EngineOverloadedError as exc:
            raise ApiError(
                503, f"server overloaded: {exc}", type=OVERLOADED, code="overloaded"
            ) from None
        except EngineNotRunningError as exc:
            raise ApiError(
                503, f"server unavailable: {exc}", type=OVERLOADED, code="unavailable"
            ) from None
        except ValueError as exc:
            raise bad_request(str(exc), code="invalid_request") from None
        gen.prompt_tokens = len(input_ids)
        return handle

    async def outputs(
        self,
        handle: EngineRequest,
        gen: Generation,
        text: TextAssembler,
        disconnected: asyncio.Future[None] | None = None,
    ) -> AsyncIterator[tuple[list[int], str]]:
        """Yield (new token ids, new text) until the request ends; aborts it on early exit."""
        try:
            while not handle.finished:
                out = await handle.next(disconnected)
                now = time.monotonic()
                gap = gen.absorb(out, now)
                if out.new_token_ids:
                    self.metrics.observe_tokens(len(out.new_token_ids), gap)
                delta = text.add(out.new_token_ids) if out.new_token_ids else ""
                if text.stopped:
                    yield out.new_token_ids, delta
                    await self._stop_early(handle, gen, disconnected)
                    break
                if handle.finished:
                    delta += text.flush()
                if out.new_token_ids or delta or handle.finished:
                    yield out.new_token_ids, delta
        finally:
            handle.abort()
            self._finish(gen)

    async def _stop_early(
        self, handle: EngineRequest, gen: Generation, disconnected: asyncio.Future[None] | None
    ) -> None:
        """A stop string matched: abort the engine request, keep its final prompt stats."""
        gen.finish_reason = "stop"
        if handle.finished:
            return
        handle.abort()
        final = await handle.drain(disconnected)
        if final is not None:
            gen.absorb_stats(final)

    def _cleanup(self, handle: EngineRequest, gen: Generation) -> None:
        handle.abort()
        self._finish(gen)

    def _finish(self, gen: Generation) -> None:
        if gen.done_at is not None:
            return
        gen.done_at = time.monotonic()
        gen.finish_reason = gen.finish_reason or "abort"
        self.metrics.finished.labels(gen.finish_reason).inc()
        self.metrics.observe_prompt(gen.prompt_tokens, gen.cached, gen.computed_tokens)
        if gen.ttft_s is not None:
            self.metrics.ttft.observe(gen.ttft_s)
        self.metrics.e2e.observe(gen.e2e_s or 0.0)

    async def collect(
        self, request: Request, handle: EngineRequest, gen: Generation, text: TextAssembler
    ) -> None:
        """Run a non-streaming request to its end, aborting it if the client goes away."""
        disconnected = asyncio.ensure_future(wait_for_disconnect(request))
        try:
            async with aclosing(self.outputs(handle, gen, text, disconnected)) as stream:
                async for _ in stream:
                    pass
        finally:
            disconnected.cancel()

    def streaming(
        self, events: AsyncIterator[bytes], handle: EngineRequest, gen: Generation
    ) -> Response:
        """SSE response; errors become an `error` event, and the stream always ends [DONE].

        The background task covers a client that leaves before the first event is pulled:
        the event generator never ran, so only it can abort the request and count it."""
        return StreamingResponse(
            sse_guard(events),
            media_type="text/event-stream",
            background=BackgroundTask(self._cleanup, handle, gen),
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
        )

    def meta(self, gen: Generation) -> GenerateMeta:
        return GenerateMeta(
            prompt_tokens=gen.prompt_tokens,
            completion_tokens=len(gen.output_ids),
            cached_tokens=gen.cached.total,
            cached_tokens_details=CachedTokensDetails.of(gen.cached),
            computed_tokens=gen.computed_tokens,
            ttft_s=gen.ttft_s,
            e2e_s=gen.e2e_s,
            prefill_node=self.config.name,
            decode_node=self.config.name,
            finish_reason=gen.finish_reason,
        )

    def usage(self, gen: Generation) -> dict[str, Any]:
        return usage_body(gen.prompt_tokens, len(gen.output_ids), gen.cached, gen.computed_tokens)

    # ---- /generate

    async def generate(self, request: Request) -> Response:
        gen = Generation(arrival=time.monotonic())
        body = parse_body(GenerateRequestBody, await request.body())
        input_ids = self.checked_prompt(body)
        sampling = body.sampling_params
        handle = self.submit(gen, input_ids, sampling.to_engine(), body.cache_salt, body.rid)
        return await self.respond(request, handle, gen, body.stream)

    def checked_prompt(self, body: GenerateRequestBody) -> list[int]:
        """The request's prompt ids (encoding `text`), after every input check of §4.1."""
        body.check_one_prompt()
        param = body.prompt_param()
        input_ids = body.input_ids if body.input_ids is not None else self.encode(body.text, param)
        sampling = body.sampling_params
        check_prompt(input_ids, sampling.max_new_tokens, self.limits, param)
        check_token_ids(
            sampling.stop_token_ids, self.limits.vocab_size, "sampling_params.stop_token_ids"
        )
        return input_ids

    async def respond(
        self, request: Request, handle: EngineRequest, gen: Generation, stream: bool
    ) -> Response:
        """A submitted /generate request's answer: SSE events, or one JSON body at the end."""
        text = TextAssembler(self.decode, [])
        if stream:
            return self.streaming(self._generate_events(handle, gen, text), handle, gen)
        await self.collect(request, handle, gen, text)
        response = GenerateResponse(output_ids=gen.output_ids, text=text.text, meta=self.meta(gen))
        return JSONResponse(response.model_dump())

    async def _generate_events(
        self, handle: EngineRequest, gen: Generation, text: TextAssembler
    ) -> AsyncIterator[bytes]:
        async with aclosing(self.outputs(handle, gen, text)) as stream:
            async for new_ids, delta in stream:
                meta = self.meta(gen).model_dump()
                yield sse({"output_ids": new_ids, "text": delta, "meta": meta})

    # ---- OpenAI endpoints

    def _openai_prepare(
        self,
        gen: Generation,
        body: OpenAIRequestBase,
        input_ids: list[int],
        max_tokens: int | None,
        param: str,
    ) -> tuple[EngineRequest, TextAssembler]:
        stops = body.stop_strings()
        if max_tokens is None:
            max_tokens = default_max_tokens(len(input_ids), self.limits, param)
        check_prompt(input_ids, max_tokens, self.limits, param)
        check_token_ids(body.stop_token_ids, self.limits.vocab_size, "stop_token_ids")
        handle = self.submit(gen, input_ids, body.to_engine(max_tokens), body.cache_salt)
        return handle, TextAssembler(self.decode, stops)

    async def chat_completions(self, request: Request) -> Response:
        gen = Generation(arrival=time.monotonic())
        body = parse_body(ChatCompletionRequest, await request.body())
        body.check_supported()
        input_ids = self.apply_chat_template(body.template_messages())
        max_tokens = body.requested_max_tokens()
        handle, text = self._openai_prepare(gen, body, input_ids, max_tokens, "messages")
        if body.stream:
            head = ResponseHead.new("chatcmpl", "chat.completion.chunk", self.model_name)
            return self.streaming(self._chat_events(handle, gen, text, head, body), handle, gen)
        await self.collect(request, handle, gen, text)
        head = ResponseHead.new("chatcmpl", "chat.completion", self.model_name)
        choice = chat_choice(text.text, gen.finish_reason)
        return JSONResponse(head.body([choice], usage=self.usage(gen)))

    async def _chat_events(
        self,
        handle: EngineRequest,
        gen: Generation,
        text: TextAssembler,
        head: ResponseHead,
        body: OpenAIRequestBase,
    ) -> AsyncIterator[bytes]:
        yield sse(head.body([chat_delta({"role": "assistant", "content": ""}, None)]))
        async with aclosing(self.outputs(handle, gen, text)) as stream:
            async for _, delta in stream:
                if delta:
                    yield sse(head.body([chat_delta({"content": delta}, None)]))
        yield sse(head.body([chat_delta({}, gen.finish_reason)]))
        if body.include_usage():
            yield sse(head.body([], usage=self.usage(gen)))

    async def completions(self, request: Request) -> Response:
        gen = Generation(arrival=time.monotonic())
        body = parse_body(CompletionRequest, await request.body())
        body.check_supported()
        prompt = body.single_prompt()
        input_ids = self.encode(prompt, "prompt") if isinstance(prompt, str) else prompt
        handle, text = self._openai_prepare(gen, body, input_ids, body.max_tokens, "prompt")
        head = ResponseHead.new("cmpl", "text_completion", self.model_name)
        if body.stream:
            return self.streaming(
                self._completion_events(handle, gen, text, head, body), handle, gen
            )
        await self.collect(request, handle, gen, text)
        choice = text_choice(text.text, gen.finish_reason)
        return JSONResponse(head.body([choice], usage=self.usage(gen)))

    async def _completion_events(
        self,
        handle: EngineRequest,
        gen: Generation,
        text: TextAssembler,
        head: ResponseHead,
        body: OpenAIRequestBase,
    ) -> AsyncIterator[bytes]:
        async with aclosing(self.outputs(handle, gen, text)) as stream:
            async for _, delta in stream:
                if delta:
                    yield sse(head.body([text_choice(delta, None)]))
        yield sse(head.body([text_choice("", gen.finish_reason)]))
        if body.include_usage():
            yield sse(head.body([], usage=self.usage(gen)))

    # ---- informational endpoints

    async def health(self, request: Request) -> Response:
        try:
            stats = self.engine.stats()
        except Exception as exc:
            raise ApiError(503, f"engine unhealthy: {exc}", type=SERVER_ERROR) from None
        if not self.engine.is_running:
            raise ApiError(503, "engine thread is not running", type=SERVER_ERROR)
        return JSONResponse(
            {
                "status": "ok",
                "name": self.config.name,
                "model": self.model_name,
                "engine": _json_safe(stats),
            }
        )

    async def models(self, request: Request) -> Response:
        entry = {
            "id": self.model_name,
            "object": "model",
            "created": self.created,
            "owned_by": "pdcache",
            "max_model_len": self.limits.context_len,
        }
        return JSONResponse({"object": "list", "data": [entry]})

    async def metrics_endpoint(self, request: Request) -> Response:
        # off the event loop: the tier stats may ask a remote metadata service (bounded wait)
        body = await run_in_threadpool(self.metrics.render)
        return Response(body, media_type=CONTENT_TYPE_LATEST)

    # ---- tokenizer access

    def encode(self, text: str | None, param: str) -> list[int]:
        if not text:
            raise bad_request("the prompt is empty", param=param, code="empty_prompt")
        return list(self.tokenizer.encode(text))

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids)

    def apply_chat_template(self, messages: list[dict[str, str]]) -> list[int]:
        return list(self.tokenizer.apply_chat_template(messages, add_generation_prompt=True))


# --------------------------------------------------------------------------- helpers


async def wait_for_disconnect(request: Request) -> None:
    """Returns when the client disconnects (or the ASGI server ends the response cycle)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def sse_guard(events: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
    """Pass events through; a failure becomes one `data: {"error": ...}` event, then [DONE]."""
    try:
        async with aclosing(events) as stream:
            async for event in stream:
                yield event
    except ApiError as exc:
        yield sse(exc.body())
    except Exception as exc:  # a bug must end this stream cleanly, not the connection
        log.exception("streaming response failed")
        yield sse(error_body(f"internal error: {exc}", type=SERVER_ERROR))
    yield SSE_DONE


def error_response(exc: ApiError) -> JSONResponse:
    headers = {"Retry-After": "1"} if exc.status_code == 503 else None
    return JSONResponse(exc.body(), status_code=exc.status_code, headers=headers)


def _json_safe(stats: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in stats.items() if isinstance(v, int | float | str | bool | None)}


def json_ready(value: Any) -> Any:
    """`value` with every key a string and every leaf JSON-native (others become strings)."""
    if isinstance(value, dict):
        return {str(k): json_ready(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [json_ready(v) for v in value]
    if isinstance(value, int | float | str | bool) or value is None:
        return value
    return str(value)


def set_result_once(future: asyncio.Future, value: Any) -> None:
    """For `loop.call_soon_threadsafe`: resolve `future` unless it is already done."""
    if not future.done():
        future.set_result(value)


# --------------------------------------------------------------------------- factory


def create_app(
    engine: Engine,
    config: ServerConfig | None = None,
    server: UnifiedServer | None = None,
    on_shutdown: Callable[[], None] | None = None,
) -> FastAPI:
    """Build the app. With `config.manage_engine` the app starts and stops the engine.

    Prefill and decode nodes pass their own `server` (a `UnifiedServer` subclass) and an
    `on_shutdown` that closes what they own besides the engine (transfer, cache tiers)."""
    config = config or ServerConfig()
    server = server or UnifiedServer(engine, config)

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        if config.manage_engine:
            engine.start()
        try:
            yield
        finally:
            if config.manage_engine:
                engine.shutdown()
            if on_shutdown is not None:
                on_shutdown()

    app = FastAPI(title="pdcache", lifespan=lifespan, docs_url=None, redoc_url=None)
    app.state.server = server
    routes: list[tuple[str, str, Callable[[Request], Awaitable[Response]]]] = [
        ("POST", "/generate", server.generate),
        ("POST", "/v1/chat/completions", server.chat_completions),
        ("POST", "/v1/completions", server.completions),
        ("GET", "/health", server.health),
        ("GET", "/v1/models", server.models),
        ("GET", "/metrics", server.metrics_endpoint),
    ]
    for method, path, handler in routes:
        app.add_api_route(
            path, _guard(server, path, handler), methods=[method], include_in_schema=False
        )
    app.add_exception_handler(StarletteHTTPException, _http_error)
    return app


def _guard(
    server: UnifiedServer, path: str, handler: Callable[[Request], Awaitable[Response]]
) -> Callable[[Request], Awaitable[Response]]:
    async def endpoint(request: Request) -> Response:
        return await server.guarded(path, handler, request)

    return endpoint


async def _http_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, StarletteHTTPException)
    kind = NOT_FOUND if exc.status_code == 404 else "invalid_request_error"
    body = error_body(str(exc.detail), type=kind, code=str(exc.status_code))
    return JSONResponse(body, status_code=exc.status_code)
