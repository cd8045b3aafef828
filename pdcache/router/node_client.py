"""Talking to ONE node: its `/generate` over HTTP (JSON or SSE), and what its answers mean.

`NodeClient` sends one body to one node under the request's deadline and keeps the node's
in-flight count for JSON calls; `EventStream` parses a node's SSE answer at the byte level.
Errors are `ApiError`s the app renders as-is: 4xx from a node pass through, a node that cannot
be reached is a 502 `NodeUnreachableError` (and the node is marked unhealthy), garbage or a
connection dying mid-response is a 502, the request's deadline is a 504. A node's 503 (full,
queue full, not running) is a `NodeOverloadedError` naming the node, so the routing core can
retry elsewhere.

Owns no state beyond one call: the shared `httpx.AsyncClient` and the node registry belong to
the routing core (`pdcache.router.core`). Everything runs on the router's event loop; routes
(unified node or P + D pair) are `pdcache.router.proxy`'s.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
from collections import deque
from collections.abc import Callable
from typing import Any

import anyio
import httpx
import orjson

from pdcache.router.nodes import NodeRegistry
from pdcache.router.policy import NodeState
from pdcache.router.route import Deadline
from pdcache.wire.protocol import INVALID_REQUEST, OVERLOADED, SERVER_ERROR, TIMEOUT, ApiError
from pdcache.wire.serving import POOL_IDLE_S

BAD_GATEWAY = "bad_gateway"
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


# --------------------------------------------------------------------------- error mapping


def error_from_response(node: NodeState, status: int, content: bytes) -> ApiError:
    """A node's non-200 answer: its OpenAI-style error passed through (5xx other than
    503/504 become 502, as the router is the gateway); garbage becomes a 502. A 503 is the
    node's overload whatever its body (an ingress or sidecar in front of a restarting node
    answers one in HTML): retried elsewhere. A 401 / 403 refused the router's own node
    credential (a rotated cluster secret): the router's failure, a 502, never the client's
    authentication error."""
    error = _error_object(content)
    text = content[:200].decode(errors="replace")
    if status == 503 and error is None:
        return NodeOverloadedError(node, ApiError(
            503, f"{node.role} node {node.name} is unavailable: {text!r}", type=OVERLOADED,
            code="node_unavailable"))
    if status in (401, 403):
        message = (error or {}).get("message") or text
        return ApiError(502, f"{node.role} node {node.name} refused the router's credential "
                        f"({status}: {message}): check the cluster secret both use",
                        type=SERVER_ERROR, code=BAD_GATEWAY)
    if error is None:
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


ROUTER_BUSY = "router_busy"  # the router's own connection pool is used up (not the node)


def _transport_error(node: NodeState, exc: httpx.HTTPError, deadline: Deadline) -> ApiError:
    if isinstance(exc, httpx.PoolTimeout):  # the router's own pool is used up, not the node
        return ApiError(503, f"the router has no free connection to {node.role} node "
                        f"{node.name} (every one of [router] max_node_connections is in use)",
                        type=OVERLOADED, code=ROUTER_BUSY)
    if isinstance(exc, httpx.ConnectError | httpx.ConnectTimeout):
        return NodeUnreachableError(node, f"{type(exc).__name__}: {exc}")
    if isinstance(exc, httpx.TimeoutException):
        return deadline.error(f"{node.role} node {node.name}")
    return ApiError(502, f"{node.role} node {node.name} broke the connection: "
                    f"{type(exc).__name__}: {exc}", type=SERVER_ERROR, code=BAD_GATEWAY)


# --------------------------------------------------------------------------- SSE stream

# At most this long reading a stream's end after [DONE]: our nodes send it with [DONE]; an
# upstream that keeps its body open must not hold the client's own end (the drain runs
# before it) for long — its connection is closed instead
_DRAIN_S = 0.05
_DRAIN_CHUNKS = 4  # ... and at most this many chunks


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
        self._ended = False  # [DONE] came: the node finished, the connection may be reused
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
        if payload == b"[DONE]":
            self._ended = True
            return None
        return self._parse(payload)

    def _split(self, chunk: bytes) -> None:
        *lines, self._buffer = (self._buffer + chunk).split(b"\n")
        for line in lines:
            if line.startswith(b"data:"):
                self._payloads.append(line[5:].strip())

    def _parse(self, payload: bytes) -> dict[str, Any]:
        try:
            event = orjson.loads(payload)  # one parse per relayed event: the fast parser
        except orjson.JSONDecodeError:
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
        """Before [DONE]: close the connection (the node sees a disconnect and aborts the
        request). After it: read the body's end first (the chunked encoding's last chunk), so
        the connection goes back to the pool instead of being closed — without that every
        streamed request cost the router a new TCP connection to each node."""
        if self.closed:
            return
        self.closed = True
        with contextlib.suppress(Exception):
            if self._ended:
                await self._drain()
            await self._response.aclose()

    async def _drain(self) -> None:
        """What follows [DONE] (nothing but the body's end, from our nodes), bounded in time
        and size: a node that keeps sending loses its connection instead."""
        with anyio.move_on_after(min(self._deadline.remaining(), _DRAIN_S)):
            for _ in range(_DRAIN_CHUNKS):
                if await anext(self._chunks, None) is None:
                    return


# --------------------------------------------------------------------------- the client


def node_transport(max_connections: int = 4096) -> httpx.AsyncHTTPTransport:
    """The connection pool to the nodes: connections are kept and reused (`EventStream`
    drains a finished stream for that), with TCP_NODELAY, so a request's body, written after
    its headers, never waits for the node's delayed ACK (the nodes set it on their side too:
    `wire.serving.listen`). An idle connection is dropped after `POOL_IDLE_S`, well before
    the node closes it (`KEEP_ALIVE_S`)."""
    return httpx.AsyncHTTPTransport(
        limits=httpx.Limits(max_connections=max_connections,
                            max_keepalive_connections=min(256, max_connections),
                            keepalive_expiry=POOL_IDLE_S),
        socket_options=[(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)])


class NodeClient:
    """Sends one `/generate` body to one node; maintains its in-flight count (JSON calls) and
    reports each call's outcome (`on_node_result`)."""

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

    async def post_json(self, node: NodeState, body: dict[str, Any], deadline: Deadline
                        ) -> dict[str, Any]:
        """Non-streaming `/generate` on `node`: the parsed JSON answer, or ApiError."""
        with self._registry.in_flight(node):
            try:
                data = await asyncio.wait_for(self._post(node, body, deadline),
                                              deadline.remaining())
            except asyncio.TimeoutError:
                self.result(node, False)
                raise deadline.error(f"{node.role} node {node.name}") from None
            except ApiError as exc:
                self.result(node, False, exc)
                raise
        self.result(node, True)
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

    async def stream_to_end(self, node: NodeState, body: dict[str, Any], deadline: Deadline,
                            on_first: Callable[[dict[str, Any]], None]) -> dict[str, Any]:
        """Streaming `/generate` on `node` read to its end (a prefill node's stream,
        docs/pd-protocol.md "First token from prefill"): `on_first` gets the first event as
        soon as it arrives; the result is the last one (the node's answer), or ApiError.
        Keeps the node's in-flight count like `post_json`."""
        with self._registry.in_flight(node):
            try:
                events = await self.open_stream(node, body, deadline)
                try:
                    last = await events.next()
                    if last is None:
                        raise ApiError(502, f"{node.role} node {node.name} ended its stream "
                                       "without an event", type=SERVER_ERROR, code=BAD_GATEWAY)
                    on_first(last)
                    while (event := await events.next()) is not None:
                        last = event
                finally:
                    await events.aclose()
            except ApiError as exc:
                self.result(node, False, exc)
                raise
        self.result(node, True)
        return last

    def _timeout(self, deadline: Deadline) -> httpx.Timeout:
        remaining = max(deadline.remaining(), 0.001)
        connect = min(self._connect_timeout_s, remaining)
        return httpx.Timeout(remaining, connect=connect, pool=connect)

    def _failed(self, node: NodeState, exc: httpx.HTTPError, deadline: Deadline) -> ApiError:
        error = _transport_error(node, exc, deadline)
        if isinstance(error, NodeUnreachableError):
            self._registry.mark_unreachable(node, error.message)
        return error

    def result(self, node: NodeState, ok: bool, error: BaseException | None = None) -> None:
        """Report the outcome of one call to `node` (`on_node_result`: the metrics); a call
        the router itself could not make (`router_busy`: no free connection) is none."""
        if isinstance(error, ApiError) and error.code == ROUTER_BUSY:
            return
        if self._on_node_result is not None:
            self._on_node_result(node, ok)
