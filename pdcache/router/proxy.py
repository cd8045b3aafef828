"""Forwarding one `/generate` to a unified node or to a prefill + decode pair
(docs/pd-protocol.md), with deadlines, error mapping and cancellation.

Owns no state beyond one request: `Proxy` holds the shared `httpx.AsyncClient` and the node
registry (whose in-flight counts it maintains). Errors are `ApiError`s the app renders as-is:
4xx from a node pass through, a node that cannot be reached is a 502 `NodeUnreachableError`
(and the node is marked unhealthy), garbage or a connection dying mid-response is a 502, the
request's deadline is a 504. A node's 503 (full, queue full, not running) is a
`NodeOverloadedError` naming the node, so the app can retry elsewhere. In PD mode the request
goes to P and D at once; if P fails, D's request is cancelled (closing its connection makes D
abort the room) and the client gets P's error; if D fails, P is cancelled and the client gets
D's error (P's, if P failed too; a D that refused with 503 never reached P, so P is not waited
for). Cancelling a call (client disconnect) closes every upstream connection it holds.

Slots: a `Route` may carry the router-side slots its request holds (`SlotHolder`,
`pdcache.router.admission`). The proxy frees them as the work ends: P's when P's call is over,
the answering node's (D or unified) when the JSON answer is in or the stream is closed.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import secrets
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import anyio
import httpx

from pdcache.router.nodes import NodeRegistry
from pdcache.router.policy import NodeState
from pdcache.server.protocol import (
    INVALID_REQUEST,
    OVERLOADED,
    SERVER_ERROR,
    TIMEOUT,
    ApiError,
)

log = logging.getLogger(__name__)

BAD_GATEWAY = "bad_gateway"
PREFILL_ERROR_GRACE_S = 1.0  # after D failed: how long P gets to report the root cause
PREFILL_FINISH_GRACE_S = 5.0  # after D succeeded: how long P's answer is awaited (accounting)
MAX_ERROR_BYTES = 64 * 1024


class NodeUnreachableError(ApiError):
    """The node refused or timed out the connection: nothing reached it, a retry is safe."""

    def __init__(self, node: NodeState, detail: str) -> None:
        super().__init__(502, f"{node.role} node {node.name} is unreachable: {detail}",
                         type=SERVER_ERROR, code="node_unreachable")
        self.node = node


class NodeOverloadedError(ApiError):
    """The node answered 503 (full, queue full, not running): it refused the request, so
    another node of its role may take it. The node's own error (status, type, code, message)
    is kept, so a 503 that is not retried reaches the client unchanged."""

    def __init__(self, node: NodeState, error: ApiError) -> None:
        super().__init__(error.status_code, error.message, type=error.type, param=error.param,
                         code=error.code)
        self.node = node


class SlotHolder(Protocol):
    """Router-side slots held by one request on its route's nodes (idempotent releases)."""

    def release(self, node: NodeState) -> None: ...

    def release_all(self) -> None: ...


@dataclass(frozen=True)
class Route:
    """Where one request goes: a unified node, or a prefill + decode pair; `lease` holds the
    request's router slots on those nodes (None when the router does not limit them)."""

    unified: NodeState | None = None
    prefill: NodeState | None = None
    decode: NodeState | None = None
    lease: SlotHolder | None = field(default=None, compare=False)

    @property
    def nodes(self) -> tuple[NodeState, ...]:
        return tuple(n for n in (self.unified, self.prefill, self.decode) if n is not None)

    def release(self, node: NodeState) -> None:
        """This request's work on `node` is over: free its slot there (idempotent)."""
        if self.lease is not None:
            self.lease.release(node)

    def release_all(self) -> None:
        if self.lease is not None:
            self.lease.release_all()

    @property
    def prefill_name(self) -> str:
        node = self.unified or self.prefill
        assert node is not None
        return node.name

    @property
    def decode_name(self) -> str:
        node = self.unified or self.decode
        assert node is not None
        return node.name

    @property
    def first_node(self) -> NodeState:
        """The node whose prefix cache serves the prompt (for the cache-aware index)."""
        node = self.unified or self.prefill
        assert node is not None
        return node


class Deadline:
    def __init__(self, timeout_s: float) -> None:
        self.timeout_s = timeout_s
        self.at = time.monotonic() + timeout_s

    def remaining(self) -> float:
        return max(0.0, self.at - time.monotonic())

    def error(self, what: str) -> ApiError:
        return ApiError(504, f"{what} did not finish within the router's deadline of "
                        f"{self.timeout_s:g}s", type=TIMEOUT, code="timeout")


# --------------------------------------------------------------------------- error mapping


def error_from_response(node: NodeState, status: int, content: bytes) -> ApiError:
    """A node's non-200 answer: its OpenAI-style error passed through (5xx other than
    503/504 become 502, as the router is the gateway); garbage becomes a 502."""
    error = _error_object(content)
    if error is None:
        text = content[:200].decode(errors="replace")
        return ApiError(502, f"{node.role} node {node.name} answered {status} without a JSON "
                        f"error: {text!r}", type=SERVER_ERROR, code=BAD_GATEWAY)
    message = str(error.get("message") or f"{node.role} node {node.name} answered {status}")
    kind = str(error.get("type") or (INVALID_REQUEST if status < 500 else SERVER_ERROR))
    param, code = error.get("param"), error.get("code")
    if status >= 500 and status not in (503, 504):
        message = f"{node.role} node {node.name} failed: {message}"
        status = 502
    return _overloaded(node, ApiError(status, message, type=kind, param=param, code=code))


def _overloaded(node: NodeState, error: ApiError) -> ApiError:
    """A 503 becomes a NodeOverloadedError naming `node` (retryable elsewhere)."""
    return NodeOverloadedError(node, error) if error.status_code == 503 else error


def error_from_event(node: NodeState, error: Any) -> ApiError:
    """An `{"error": ...}` event inside a node's SSE stream."""
    error = error if isinstance(error, dict) else {"message": str(error)}
    kind = str(error.get("type") or SERVER_ERROR)
    status = {TIMEOUT: 504, OVERLOADED: 503, INVALID_REQUEST: 400}.get(kind, 502)
    message = f"{node.role} node {node.name}: {error.get('message') or 'stream failed'}"
    return _overloaded(node, ApiError(status, message, type=kind, param=error.get("param"),
                                      code=error.get("code")))


def _error_object(content: bytes) -> dict[str, Any] | None:
    try:
        body = json.loads(content)
    except ValueError:
        return None
    error = body.get("error") if isinstance(body, dict) else None
    return error if isinstance(error, dict) else None


def _transport_error(node: NodeState, exc: httpx.HTTPError, deadline: Deadline) -> ApiError:
    if isinstance(exc, httpx.ConnectError | httpx.ConnectTimeout | httpx.PoolTimeout):
        return NodeUnreachableError(node, f"{type(exc).__name__}: {exc}")
    if isinstance(exc, httpx.TimeoutException):
        return deadline.error(f"{node.role} node {node.name}")
    return ApiError(502, f"{node.role} node {node.name} broke the connection: "
                    f"{type(exc).__name__}: {exc}", type=SERVER_ERROR, code=BAD_GATEWAY)


# --------------------------------------------------------------------------- SSE stream


class EventStream:
    """The `data:` events of one node's streaming `/generate` response, under a deadline.

    Parses SSE at the byte level from the response's chunks (one `data:` line per event, as
    the nodes send them): forwarding costs one chunk read and one JSON parse per event."""

    def __init__(self, node: NodeState, response: httpx.Response, deadline: Deadline) -> None:
        self.node = node
        self._response = response
        self._chunks = response.aiter_bytes()
        self._buffer = b""
        self._payloads: deque[bytes] = deque()
        self._deadline = deadline
        self.closed = False

    async def next(self) -> dict[str, Any] | None:
        """The next event; None once the stream ended with [DONE]. ApiError on error events,
        garbage, a broken connection or the deadline."""
        while not self._payloads:
            chunk = await self._next_chunk()
            if chunk is None:
                self._split(b"\n")  # a last line without its newline
                if not self._payloads:
                    raise ApiError(502, f"{self.node.role} node {self.node.name} ended its "
                                   "stream without [DONE]", type=SERVER_ERROR, code=BAD_GATEWAY)
                break
            self._split(chunk)
        payload = self._payloads.popleft()
        return None if payload == b"[DONE]" else self._parse(payload)

    def _split(self, chunk: bytes) -> None:
        *lines, self._buffer = (self._buffer + chunk).split(b"\n")
        for line in lines:
            if line.startswith(b"data:"):
                self._payloads.append(line[5:].strip())

    def _parse(self, payload: bytes) -> dict[str, Any]:
        try:
            event = json.loads(payload)
        except ValueError:
            event = None
        if not isinstance(event, dict):
            raise ApiError(502, f"{self.node.role} node {self.node.name} sent a malformed event: "
                           f"{payload[:200]!r}", type=SERVER_ERROR, code=BAD_GATEWAY)
        if "error" in event:
            raise error_from_event(self.node, event["error"])
        return event

    async def _next_chunk(self) -> bytes | None:
        try:
            # a cancel scope, not wait_for: no task per read on the hot path
            with anyio.fail_after(self._deadline.remaining()):
                return await anext(self._chunks)
        except StopAsyncIteration:
            return None
        except TimeoutError:
            raise self._deadline.error(f"{self.node.role} node {self.node.name}") from None
        except httpx.HTTPError as exc:
            raise _transport_error(self.node, exc, self._deadline) from None

    async def aclose(self) -> None:
        """Close the connection (the node sees a disconnect and aborts the request)."""
        if not self.closed:
            self.closed = True
            with contextlib.suppress(Exception):
                await self._response.aclose()


# --------------------------------------------------------------------------- the proxy


class Proxy:
    """Sends `/generate` bodies to nodes; maintains their in-flight counts."""

    def __init__(
        self,
        client: httpx.AsyncClient,
        registry: NodeRegistry,
        *,
        connect_timeout_s: float = 5.0,
        on_node_result: Callable[[NodeState, bool], None] | None = None,
    ) -> None:
        self._client = client
        self._registry = registry
        self._connect_timeout_s = connect_timeout_s
        self._on_node_result = on_node_result

    # ---- one node

    async def post_json(self, node: NodeState, body: dict[str, Any], deadline: Deadline
                        ) -> dict[str, Any]:
        """Non-streaming `/generate` on `node`: the parsed JSON answer, or ApiError."""
        with self._registry.in_flight(node):
            try:
                data = await asyncio.wait_for(self._post(node, body, deadline),
                                              deadline.remaining())
            except asyncio.TimeoutError:
                self._result(node, False)
                raise deadline.error(f"{node.role} node {node.name}") from None
            except ApiError:
                self._result(node, False)
                raise
        self._result(node, True)
        return data

    async def _post(self, node: NodeState, body: dict[str, Any], deadline: Deadline
                    ) -> dict[str, Any]:
        try:
            resp = await self._client.post(f"{node.url}/generate", json=body,
                                           timeout=self._timeout(deadline))
        except httpx.HTTPError as exc:
            raise self._failed(node, exc, deadline) from None
        if resp.status_code != 200:
            raise error_from_response(node, resp.status_code, resp.content[:MAX_ERROR_BYTES])
        try:
            data = resp.json()
        except ValueError:
            data = None
        if not isinstance(data, dict):
            raise ApiError(502, f"{node.role} node {node.name} answered a non-JSON body",
                           type=SERVER_ERROR, code=BAD_GATEWAY)
        return data

    async def open_stream(self, node: NodeState, body: dict[str, Any], deadline: Deadline
                          ) -> EventStream:
        """Streaming `/generate` on `node`, once its response headers arrived."""
        request = self._client.build_request("POST", f"{node.url}/generate", json=body,
                                             timeout=self._timeout(deadline))
        try:
            resp = await asyncio.wait_for(self._client.send(request, stream=True),
                                          deadline.remaining())
        except asyncio.TimeoutError:
            raise deadline.error(f"{node.role} node {node.name}") from None
        except httpx.HTTPError as exc:
            raise self._failed(node, exc, deadline) from None
        if resp.status_code != 200:
            try:
                content = await asyncio.wait_for(resp.aread(), min(deadline.remaining(), 5.0))
            except (asyncio.TimeoutError, httpx.HTTPError):
                content = b""
            finally:
                await resp.aclose()
            raise error_from_response(node, resp.status_code, content[:MAX_ERROR_BYTES])
        return EventStream(node, resp, deadline)

    def _timeout(self, deadline: Deadline) -> httpx.Timeout:
        remaining = max(deadline.remaining(), 0.001)
        return httpx.Timeout(remaining, connect=min(self._connect_timeout_s, remaining))

    def _failed(self, node: NodeState, exc: httpx.HTTPError, deadline: Deadline) -> ApiError:
        error = _transport_error(node, exc, deadline)
        if isinstance(error, NodeUnreachableError):
            self._registry.mark_unreachable(node, error.message)
        return error

    def _result(self, node: NodeState, ok: bool) -> None:
        if self._on_node_result is not None:
            self._on_node_result(node, ok)

    # ---- a route (unified node or P + D)

    async def generate(self, route: Route, body: dict[str, Any], deadline: Deadline
                       ) -> dict[str, Any]:
        """Non-streaming `/generate` through `route`: the answering node's JSON. The route's
        slots are free when this returns or raises."""
        try:
            if route.unified is not None:
                return await self.post_json(route.unified, {**body, "stream": False}, deadline)
            return await self._pd_generate(route, body, deadline)
        finally:
            route.release_all()

    async def stream(self, route: Route, body: dict[str, Any], deadline: Deadline
                     ) -> RouteStream:
        """Streaming `/generate` through `route`; `next()` gives its events in order. The
        route's slots are free once the stream is closed (or when this raises)."""
        try:
            if route.unified is not None:
                return await self._unified_stream(route, body, deadline)
            return await self._pd_stream(route, body, deadline)
        except BaseException:
            route.release_all()
            raise

    async def _unified_stream(self, route: Route, body: dict[str, Any], deadline: Deadline
                              ) -> RouteStream:
        node = route.unified
        assert node is not None
        node.in_flight += 1
        try:
            events = await self.open_stream(node, {**body, "stream": True}, deadline)
        except BaseException:
            node.in_flight -= 1
            self._result(node, False)
            raise
        return RouteStream(self, events, None, route)

    # ---- PD

    def _pd_bodies(self, route: Route, body: dict[str, Any], stream: bool
                   ) -> tuple[dict[str, Any], dict[str, Any]]:
        prefill, decode = route.prefill, route.decode
        assert prefill is not None and decode is not None
        if not prefill.bootstrap:
            raise ApiError(503, f"prefill node {prefill.name} has no known bootstrap address",
                           type=OVERLOADED, code="no_bootstrap")
        room = secrets.randbits(63)
        p_body = {**body, "stream": False,
                  "pd": {"room": room, "role": "prefill", "decode_node": decode.name}}
        d_body = {**body, "stream": stream,
                  "pd": {"room": room, "role": "decode", "bootstrap": prefill.bootstrap,
                         "prefill_node": prefill.name}}
        return p_body, d_body

    async def _pd_generate(self, route: Route, body: dict[str, Any], deadline: Deadline
                           ) -> dict[str, Any]:
        p_body, d_body = self._pd_bodies(route, body, stream=False)
        assert route.prefill is not None and route.decode is not None
        p_task = self._prefill_task(route, p_body, deadline)
        d_task = asyncio.create_task(self.post_json(route.decode, d_body, deadline))
        try:
            await asyncio.wait({p_task, d_task}, return_when=asyncio.FIRST_EXCEPTION)
            p_error, d_error = _failure(p_task), _failure(d_task)
            if p_error is not None:
                raise p_error
            if d_error is not None:
                raise await _root_cause(p_task, d_error)
            await _settle(p_task, PREFILL_FINISH_GRACE_S)
            return d_task.result()
        finally:
            await _cancel(p_task, d_task)

    async def _pd_stream(self, route: Route, body: dict[str, Any], deadline: Deadline
                         ) -> RouteStream:
        p_body, d_body = self._pd_bodies(route, body, stream=True)
        prefill, decode = route.prefill, route.decode
        assert prefill is not None and decode is not None
        p_task = self._prefill_task(route, p_body, deadline)
        decode.in_flight += 1
        try:
            events = await _race_prefill(p_task, self.open_stream(decode, d_body, deadline))
        except BaseException:
            decode.in_flight -= 1
            self._result(decode, False)
            await _cancel(p_task)
            raise
        return RouteStream(self, events, p_task, route)

    def _prefill_task(self, route: Route, p_body: dict[str, Any], deadline: Deadline
                      ) -> asyncio.Task[dict[str, Any]]:
        """P's call as a task; its slot frees as soon as the call is over (P's work is done
        once the KV is pushed, while D still decodes)."""
        prefill = route.prefill
        assert prefill is not None
        task = asyncio.create_task(self.post_json(prefill, p_body, deadline))
        task.add_done_callback(lambda _task: route.release(prefill))
        return task


class RouteStream:
    """The event stream of one routed request (D's, or the unified node's), plus P's call.

    Until the first event arrives a failure of P wins (D is closed, P's error raised). After
    the stream ends P gets a short grace to answer; `aclose()` cancels whatever is left."""

    def __init__(self, proxy: Proxy, events: EventStream,
                 prefill: asyncio.Task[dict[str, Any]] | None, route: Route | None = None
                 ) -> None:
        self._proxy = proxy
        self._events = events
        self._prefill = prefill
        self._route = route
        self._started = False
        self._ok = False
        self._released = False

    async def next(self) -> dict[str, Any] | None:
        try:
            if self._started or self._prefill is None:
                event = await self._events.next()
            else:
                event = await _race_prefill(self._prefill, self._events.next())
        except BaseException as exc:
            if isinstance(exc, ApiError) and self._prefill is not None:
                raise await _root_cause(self._prefill, exc) from None
            raise
        self._started = True
        if event is None:
            self._ok = True
            if self._prefill is not None:
                await _settle(self._prefill, PREFILL_FINISH_GRACE_S)
        return event

    async def aclose(self) -> None:
        await self._events.aclose()
        if self._prefill is not None:
            await _cancel(self._prefill)
        if not self._released:
            self._released = True
            self._events.node.in_flight -= 1
            self._proxy._result(self._events.node, self._ok)
            if self._route is not None:
                self._route.release_all()


# --------------------------------------------------------------------------- task helpers


async def _race_prefill(prefill: asyncio.Task[Any], work: Any) -> Any:
    """Run `work` (a coroutine) unless P fails first; P's failure cancels it and is raised."""
    work_task = asyncio.ensure_future(work)
    try:
        await asyncio.wait({prefill, work_task}, return_when=asyncio.FIRST_COMPLETED)
        p_error = _failure(prefill)
        if not work_task.done() and p_error is not None:
            raise p_error
        if not work_task.done():  # P succeeded first: D keeps going on its own
            await asyncio.wait({work_task})
        return work_task.result()
    except BaseException:
        if work_task.done() and not work_task.cancelled() and _failure(work_task) is None:
            result = work_task.result()
            if isinstance(result, EventStream):
                await result.aclose()
        raise
    finally:
        await _cancel(work_task)


async def _root_cause(prefill: asyncio.Task[Any], decode_error: BaseException) -> BaseException:
    """D failed: if P failed too (now or within a short grace), P's error is the cause. A D
    that refused the request (503) never asked P for the KV: no grace for P then."""
    if isinstance(decode_error, NodeOverloadedError):
        return _failure(prefill) or decode_error
    if not prefill.done():
        await asyncio.wait({prefill}, timeout=PREFILL_ERROR_GRACE_S)
    return _failure(prefill) or decode_error


async def _settle(task: asyncio.Task[Any], grace_s: float) -> None:
    """Give `task` up to `grace_s` to finish; its outcome is only logged."""
    if not task.done():
        await asyncio.wait({task}, timeout=grace_s)
    error = _failure(task)
    if error is not None:
        log.warning("prefill call failed after decode succeeded: %s", error)


def _failure(task: asyncio.Future[Any]) -> BaseException | None:
    """The exception a finished task raised (None if it succeeded, was cancelled or runs)."""
    if not task.done() or task.cancelled():
        return None
    return task.exception()


async def _cancel(*tasks: asyncio.Future[Any]) -> None:
    pending = [t for t in tasks if not t.done()]
    for task in pending:
        task.cancel()
    if pending:  # the outer task's own cancellation still propagates out of gather
        await asyncio.gather(*pending, return_exceptions=True)
