"""Response bodies and event streams of the HTTP contract (docs/design.md §4.1), one builder per
shape, shared by the unified server, the P/D nodes and the router.

Everything here is a pure function of what a request produced (text deltas, finish reason,
usage numbers) or a thin FastAPI response around it; nothing holds state or touches an engine,
so the router (which relays a node's tokens) and a server (which produces them) build
byte-identical bodies and streams.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import aclosing
from dataclasses import dataclass
from typing import Any

import orjson
from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.background import BackgroundTask
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import Message, Send

from pdcache.engine.api import CachedTokens
from pdcache.wire.protocol import NOT_FOUND, SERVER_ERROR, ApiError, error_body

log = logging.getLogger(__name__)

Handler = Callable[[Request], Awaitable[Response]]

# --------------------------------------------------------------------------- OpenAI bodies


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def now_s() -> int:
    return int(time.time())


def usage_body(
    prompt_tokens: int, completion_tokens: int, cached: CachedTokens, computed_tokens: int
) -> dict[str, Any]:
    """OpenAI usage plus pdcache's per-tier breakdown of the reused prompt tokens."""
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached.total},
        "cached_tokens_details": cached.as_dict(),
        "computed_tokens": computed_tokens,
    }


@dataclass(frozen=True)
class ResponseHead:
    """`id`, `object`, `created` and `model` of one OpenAI response or stream."""

    id: str
    object: str
    created: int
    model: str

    @classmethod
    def new(cls, prefix: str, obj: str, model: str) -> ResponseHead:
        return cls(new_id(prefix), obj, now_s(), model)

    def body(self, choices: list[dict[str, Any]], **extra: Any) -> dict[str, Any]:
        head = {"id": self.id, "object": self.object, "created": self.created}
        return {**head, "model": self.model, "choices": choices, **extra}


def model_list(model: str, created: int, context_len: int) -> dict[str, Any]:
    """`GET /v1/models`: the one model this deployment serves."""
    entry = {"id": model, "object": "model", "created": created, "owned_by": "pdcache",
             "max_model_len": context_len}
    return {"object": "list", "data": [entry]}


# --------------------------------------------------------------------------- SSE streams


def sse(payload: dict[str, Any] | str) -> bytes:
    """One server-sent event: `data: <json>` (or a literal such as `[DONE]`), encoded as
    SGLang's HTTP server encodes its events (orjson: compact, UTF-8, non-str keys allowed),
    so a /generate stream is byte-identical to SGLang's."""
    if isinstance(payload, str):
        return f"data: {payload}\n\n".encode()
    return b"data: " + orjson.dumps(payload, option=orjson.OPT_NON_STR_KEYS) + b"\n\n"


SSE_DONE = sse("[DONE]")


@dataclass(frozen=True)
class StreamEnd:
    """How an OpenAI stream closes: the usage once the deltas ran out (a callable, read after
    the last delta), and whether the client asked for the usage chunk."""

    usage: Callable[[], dict[str, Any]]
    include_usage: bool


async def drain(deltas: AsyncIterator[Any]) -> None:
    """Run a delta stream to its end (a non-streaming answer is built from what it absorbed)."""
    async with aclosing(deltas) as texts:
        async for _ in texts:
            pass


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


# How long one write of a stream may wait for the client to read. A client that keeps its
# connection open but stops reading (a suspended agent, a partition) held its request, the
# node slot, the upstream and its tenant's slot for good: no deadline covered writes.
WRITE_STALL_S = 60.0
_TIMEOUT = getattr(asyncio, "timeout", None)  # Python 3.11+


class StallBoundedStream(StreamingResponse):
    """A StreamingResponse whose every write must end within `stall_timeout_s`; past it the
    stream ends as if the client had left: the event generator is closed (its `finally`
    blocks free what the request holds) and the background cleanup runs. The response never
    completed: the server logs it and closes the transport (the socket itself goes once the
    kernel drops what the client never read)."""

    def __init__(self, content: AsyncIterator[bytes], *, stall_timeout_s: float,
                 **kwargs: Any) -> None:
        super().__init__(content, **kwargs)
        self.stall_timeout_s = stall_timeout_s

    async def stream_response(self, send: Send) -> None:
        async def bounded(message: Message) -> None:
            try:
                if _TIMEOUT is not None:  # 3.11+: no task per write (wait_for makes one)
                    async with _TIMEOUT(self.stall_timeout_s):
                        await send(message)
                else:
                    await asyncio.wait_for(send(message), self.stall_timeout_s)
            except asyncio.TimeoutError:  # the builtin TimeoutError only from 3.11 on
                raise _ClientStalled from None

        try:
            await super().stream_response(bounded)
        except _ClientStalled:
            log.warning("client read nothing for %.1f s: its stream ends", self.stall_timeout_s)
            aclose = getattr(self.body_iterator, "aclose", None)
            if aclose is not None:
                await aclose()


class _ClientStalled(Exception):
    """One write to the client did not end in time (`StallBoundedStream`)."""


def event_stream(events: AsyncIterator[bytes], cleanup: BackgroundTask,
                 stall_timeout_s: float = WRITE_STALL_S) -> Response:
    """SSE response; errors become an `error` event and the stream always ends [DONE]; a
    client that reads nothing for `stall_timeout_s` is left (`StallBoundedStream`).

    `cleanup` also runs for a client that leaves before the first event is pulled: the event
    generator never ran then, so only it can abort the request (or close the upstream)."""
    return StallBoundedStream(
        sse_guard(events), stall_timeout_s=stall_timeout_s, media_type="text/event-stream",
        background=cleanup, headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})


# --------------------------------------------------------------------------- errors


def error_response(exc: ApiError) -> JSONResponse:
    headers = {"Retry-After": "1"} if exc.status_code == 503 else None
    return JSONResponse(exc.body(), status_code=exc.status_code, headers=headers)


async def run_guarded(endpoint: str, handler: Handler, request: Request) -> Response:
    """Run a handler; every failure becomes a JSON error (a bug costs one request, never the
    process)."""
    try:
        return await handler(request)
    except ApiError as exc:
        return error_response(exc)
    except Exception as exc:
        log.exception("%s failed", endpoint)
        return error_response(ApiError(500, f"internal error: {exc}", type=SERVER_ERROR))


async def http_error(request: Request, exc: Exception) -> Response:
    """Starlette's own errors (404, 405) in the same JSON error shape."""
    assert isinstance(exc, StarletteHTTPException)
    kind = NOT_FOUND if exc.status_code == 404 else "invalid_request_error"
    body = error_body(str(exc.detail), type=kind, code=str(exc.status_code))
    return JSONResponse(body, status_code=exc.status_code)


async def wait_for_disconnect(request: Request) -> None:
    """Returns when the client disconnects (or the ASGI server ends the response cycle)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return
