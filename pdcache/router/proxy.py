"""Forwarding one `/generate` through a route: to a unified node, or to a prefill + decode
pair at once (docs/pd-protocol.md), with cancellation of the pair's other call.

`Proxy` owns no state beyond one request; its calls to single nodes (HTTP, SSE parsing, error
mapping, in-flight counts) are `pdcache.router.node_client.NodeClient`'s. In PD mode the
request goes to P and D at once; if P fails, D's request is cancelled (closing its connection
makes D abort the room) and the client gets P's error; if D fails, P is cancelled and the
client gets D's error (P's, if P failed too; a D that refused with 503 never reached P, so P is
not waited for). Cancelling a call (client disconnect) closes every upstream connection it
holds. Everything runs on the router's event loop.

First token from prefill (`first_token_from_prefill`, streaming only, for a pair whose nodes
both advertise `first_token_stream` in /health): P is asked to stream too, and the client's
first event is P's (the first token, sent before the K/V push), released once D admitted the
request (its stream opened); D, told `first_token_streamed`, streams the rest
(docs/pd-protocol.md).

Slots: a `Route` may carry the router-side slots its request holds (`SlotHolder`,
`pdcache.router.admission`). The proxy frees them as the work ends: P's when P's call is over,
the answering node's (D or unified) when the JSON answer is in or the stream is closed.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
from collections.abc import Callable
from typing import Any

import anyio
import httpx

from pdcache.router.node_client import (
    BAD_GATEWAY,
    EventStream,
    NodeClient,
    NodeOverloadedError,
    NodeUnreachableError,
)
from pdcache.router.nodes import NodeRegistry
from pdcache.router.policy import NodeState
from pdcache.router.route import Deadline, Route
from pdcache.wire.generate_api import PDParams
from pdcache.wire.protocol import OVERLOADED, SERVER_ERROR, ApiError

log = logging.getLogger(__name__)

PREFILL_ERROR_GRACE_S = 1.0  # after D failed: how long P gets to report the root cause
PREFILL_FINISH_GRACE_S = 5.0  # after D succeeded: how long P's answer is awaited (accounting)
CLOSE_BOUND_S = 10.0  # close_stream: the most a client's cleanup waits on its upstream


class Proxy:
    """Sends `/generate` bodies through routes (one node, or P + D); its `NodeClient`
    maintains the nodes' in-flight counts."""

    def __init__(
        self,
        client: httpx.AsyncClient,
        registry: NodeRegistry,
        *,
        connect_timeout_s: float = 5.0,
        on_node_result: Callable[[NodeState, bool], None] | None = None,
        first_token_from_prefill: bool = True,
    ) -> None:
        self._client = NodeClient(client, registry, connect_timeout_s=connect_timeout_s,
                                  on_node_result=on_node_result)
        # PD streams: the client's first token is prefill's, sent before the K/V push
        self.first_token_from_prefill = first_token_from_prefill

    # ---- a route (unified node or P + D)

    async def generate(self, route: Route, body: dict[str, Any], deadline: Deadline
                       ) -> dict[str, Any]:
        """Non-streaming `/generate` through `route`: the answering node's JSON. The route's
        slots are free when this returns or raises."""
        try:
            if route.unified is not None:
                return await self._client.post_json(route.unified, {**body, "stream": False},
                                                    deadline)
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
            events = await self._client.open_stream(node, {**body, "stream": True}, deadline)
        except BaseException as exc:
            node.in_flight -= 1
            self._client.result(node, False, exc)
            raise
        return RouteStream(self._client, events, None, route)

    # ---- PD

    def first_token_from_prefill_on(self, route: Route) -> bool:
        """Whether a stream on `route` takes its first token from P: the setting is on and
        both nodes advertise it in /health (`first_token_stream`); an older node (a rolling
        upgrade) gets the old bodies, which it understands."""
        prefill, decode = route.prefill, route.decode
        return (self.first_token_from_prefill and prefill is not None and decode is not None
                and prefill.first_token_stream and decode.first_token_stream)

    def _pd_bodies(self, route: Route, body: dict[str, Any], stream: bool, first_from_p: bool
                   ) -> tuple[dict[str, Any], dict[str, Any]]:
        """P's and D's bodies; `first_from_p` (streaming only, decided once by the caller from
        `first_token_from_prefill_on`): P streams the first token, D's stream starts after it."""
        prefill, decode = route.prefill, route.decode
        assert prefill is not None and decode is not None
        if not prefill.bootstrap:
            raise ApiError(503, f"prefill node {prefill.name} has no known bootstrap address",
                           type=OVERLOADED, code="no_bootstrap")
        room = secrets.randbits(63)
        first_from_p = stream and first_from_p
        p_pd = PDParams(room=room, role="prefill", decode_node=decode.name)
        d_pd = PDParams(room=room, role="decode", bootstrap=prefill.bootstrap,
                        prefill_node=prefill.name, first_token_streamed=first_from_p)
        p_body = {**body, "stream": first_from_p, "pd": p_pd.model_dump(exclude_none=True)}
        d_body = {**body, "stream": stream,
                  "pd": d_pd.model_dump(exclude_none=True, exclude_defaults=True)}
        return p_body, d_body

    async def _pd_generate(self, route: Route, body: dict[str, Any], deadline: Deadline
                           ) -> dict[str, Any]:
        p_body, d_body = self._pd_bodies(route, body, stream=False, first_from_p=False)
        assert route.prefill is not None and route.decode is not None
        p_task = self._prefill_task(route, p_body, deadline)
        d_task = asyncio.create_task(self._client.post_json(route.decode, d_body, deadline))
        try:
            # until D answers or P fails: once D answered, P gets its grace and its outcome is
            # only logged (the wait used to end on the first exception only: a D answer then
            # waited for P to the deadline, and a P failing after it threw the answer away)
            while not d_task.done() and _failure(p_task) is None:
                running = {task for task in (p_task, d_task) if not task.done()}
                await asyncio.wait(running, return_when=asyncio.FIRST_COMPLETED)
            d_error = _failure(d_task)
            if d_task.done() and d_error is None:
                await _settle(p_task, PREFILL_FINISH_GRACE_S)
                return d_task.result()
            p_error = _failure(p_task)
            if p_error is not None:
                raise p_error
            assert d_error is not None
            raise await _root_cause(p_task, d_error)
        finally:
            await _cancel(p_task, d_task)

    async def _pd_stream(self, route: Route, body: dict[str, Any], deadline: Deadline
                         ) -> RouteStream:
        # decided once: the bodies and the stream's shape must agree even if a health probe
        # changes a node's `first_token_stream` in between
        first_from_p = self.first_token_from_prefill_on(route)
        p_body, d_body = self._pd_bodies(route, body, stream=True, first_from_p=first_from_p)
        prefill, decode = route.prefill, route.decode
        assert prefill is not None and decode is not None
        if first_from_p:
            return self._pd_stream_first_from_prefill(route, p_body, d_body, deadline)
        p_task = self._prefill_task(route, p_body, deadline)
        decode.in_flight += 1
        try:
            events = await _race_prefill(p_task,
                                         self._client.open_stream(decode, d_body, deadline))
        except BaseException as exc:
            decode.in_flight -= 1
            self._client.result(decode, False, exc)
            await _cancel(p_task)
            raise
        return RouteStream(self._client, events, p_task, route)

    def _pd_stream_first_from_prefill(self, route: Route, p_body: dict[str, Any],
                                      d_body: dict[str, Any], deadline: Deadline
                                      ) -> RouteStream:
        """P's stream and D's at once, neither awaited here: D's response starts only once
        the K/V is in, P's first event (the first token) comes before the K/V push. The
        `RouteStream` yields P's first event, then D's."""
        decode = route.decode
        assert decode is not None
        first: asyncio.Future[dict[str, Any]] = asyncio.get_running_loop().create_future()
        p_task = self._prefill_task(route, p_body, deadline, first)
        decode.in_flight += 1
        opening = asyncio.create_task(self._client.open_stream(decode, d_body, deadline))
        return RouteStream(self._client, None, p_task, route,
                           decode_opening=(decode, opening), prefill_first=first)

    def _prefill_task(self, route: Route, p_body: dict[str, Any], deadline: Deadline,
                      first: asyncio.Future[dict[str, Any]] | None = None
                      ) -> asyncio.Task[dict[str, Any]]:
        """P's call as a task; its slot frees as soon as the call is over (P's work is done
        once the KV is pushed, while D still decodes). With `first`, P streams (its body has
        `stream: true`): `first` gets its first event, the task's result is its last (the
        answer P's JSON call gives)."""
        prefill = route.prefill
        assert prefill is not None
        if first is None:
            call = self._client.post_json(prefill, p_body, deadline)
        else:
            call = self._client.stream_to_end(prefill, p_body, deadline,
                                              lambda event: _resolve(first, event))
        task = asyncio.create_task(call)
        task.add_done_callback(lambda _task: route.release(prefill))
        return task


class RouteStream:
    """The event stream of one routed request (D's, or the unified node's), plus P's call.

    Until the first event arrives a failure of P wins (D is closed, P's error raised). After
    the stream ends P gets a short grace to answer; `aclose()` cancels whatever is left.

    With the first token from prefill (`prefill_first`, `decode_opening`): the first event is
    P's first event, given out only once D's stream opened (D answers its headers when it
    admitted the request), then D's events follow. P failing before its first event is handed
    out (even after P sent it, while D still opens) raises P's error; D's opening failing
    raises the root cause (`_root_cause`), as before: either way an HTTP error the routing
    core may retry. D failing after it opened is a mid-stream
    error (docs/pd-protocol.md, "First token from prefill")."""

    def __init__(self, client: NodeClient, events: EventStream | None,
                 prefill: asyncio.Task[dict[str, Any]] | None, route: Route | None = None,
                 *, decode_opening: tuple[NodeState, asyncio.Task[EventStream]] | None = None,
                 prefill_first: asyncio.Future[dict[str, Any]] | None = None) -> None:
        self._client = client
        self._events = events
        self._opening = decode_opening[1] if decode_opening is not None else None
        if events is not None:
            self._node = events.node
        else:
            assert decode_opening is not None
            self._node = decode_opening[0]
        self._prefill = prefill
        self._prefill_first = prefill_first
        self._route = route
        self._started = False
        # a node error ended the stream (an early close by the router or the client is not
        # one: a stream ended at a client's stop string was counted as the node's error)
        self._failed = False
        self._released = False
        # read_ahead(): the events read so far, (event, error) pairs, and the reading task
        self._ahead: asyncio.Queue[tuple[dict[str, Any] | None, Exception | None]] | None = None
        self._pump: asyncio.Task[None] | None = None

    async def prefill_finished(self) -> None:
        """Wait until P answered (PD: its request ended, so its prompt pages are in P's
        prefix tree); at once on a unified route. P's failure is not raised here: the
        stream's `next()` reports it."""
        if self._prefill is not None:
            await asyncio.wait({self._prefill})

    def read_ahead(self) -> None:
        """From now on read the stream to its end in the background, keeping its events for
        `next()`, and close it (its route's slots freed) at its end or error. A request of
        several sequences (n > 1, a batch) gives out their events only once all of them
        opened: an opened one must not hold its node slot meanwhile — with a per-node limit
        the others waited for the slot it held until their deadline, and so did other
        requests' sequences. Event loop only."""
        if self._ahead is None:
            self._ahead = asyncio.Queue()
            self._pump = asyncio.ensure_future(self._read_all(self._ahead))

    async def _read_all(self, out: asyncio.Queue[tuple[dict[str, Any] | None,
                                                      Exception | None]]) -> None:
        try:
            while (event := await self._read()) is not None:
                out.put_nowait((event, None))
            out.put_nowait((None, None))
        except Exception as exc:  # given out by next(), where a direct read raises it
            out.put_nowait((None, exc))
        finally:
            with anyio.CancelScope(shield=True), anyio.move_on_after(CLOSE_BOUND_S):
                await self._close_upstream()

    async def next(self) -> dict[str, Any] | None:
        if self._ahead is None:
            return await self._read()
        event, error = await self._ahead.get()
        if event is None:  # the end stays the end for a later call
            self._ahead.put_nowait((event, error))
        if error is not None:
            raise error
        return event

    async def _read(self) -> dict[str, Any] | None:
        try:
            if not self._started and self._prefill_first is not None:
                event: dict[str, Any] | None = await self._first_from_prefill()
            else:
                events = await self._opened()
                if self._started or self._prefill is None:
                    event = await events.next()
                else:
                    event = await _race_prefill(self._prefill, events.next())
        except BaseException as exc:
            if isinstance(exc, ApiError):
                self._failed = True
                if self._prefill is not None:
                    raise await _root_cause(self._prefill, exc) from None
            raise
        self._started = True
        if event is None:
            if self._prefill is not None:
                await _settle(self._prefill, PREFILL_FINISH_GRACE_S)
        return event

    async def _first_from_prefill(self) -> dict[str, Any]:
        """P's first event, once D's stream opened too (D answers its headers once it
        admitted the request: pages reserved, P asked), so that every refusal of D's
        admission (503 `queue_full` / `queue_timeout` / `unavailable`) is still an HTTP error
        the routing core retries; a failure of P or of D's opening before that is raised."""
        first, prefill, opening = self._prefill_first, self._prefill, self._opening
        assert first is not None and prefill is not None and opening is not None
        # P stays watched until its first event is handed out: P failing after that event
        # but while D is still opening is still an HTTP error, not token 1 and then a
        # mid-stream error the client cannot retry
        waiting: set[asyncio.Future[Any]] = {first, prefill, opening}
        while not (first.done() and opening.done()):
            await asyncio.wait(waiting, return_when=asyncio.FIRST_COMPLETED)
            if prefill.done():
                waiting.discard(prefill)
                p_error = _failure(prefill)
                if p_error is not None:
                    raise p_error
                if not first.done():  # cannot be: P's result comes after its first event
                    raise ApiError(502, "prefill node answered without its first event",
                                   type=SERVER_ERROR, code=BAD_GATEWAY)
            if opening.done():
                waiting.discard(opening)
                d_error = _failure(opening)
                if d_error is not None:
                    raise d_error
            if first.done():
                waiting.discard(first)
        self._events = opening.result()
        return first.result()

    async def _opened(self) -> EventStream:
        """D's event stream, once its response began (the first token from prefill: D opens
        it once the K/V is in); a failure of P meanwhile wins, as before the first event."""
        if self._events is None:
            assert self._opening is not None and self._prefill is not None
            self._events = await _race_prefill(self._prefill, self._opening)
        return self._events

    async def aclose(self) -> None:
        """Close D's stream and cancel P's call, then free the route's slots. The slots are
        freed whatever the closing does (raises, or is cancelled by `close_stream`'s bound):
        a node's in-flight count that outlived its request would skew routing for good. A
        read ahead still running stops first."""
        if self._pump is not None:
            self._pump.cancel()
            await asyncio.gather(self._pump, return_exceptions=True)
        await self._close_upstream()

    async def _close_upstream(self) -> None:
        try:
            if self._opening is not None:
                await _cancel(self._opening)
                if self._events is None and self._opening.done() \
                        and not self._opening.cancelled() and self._opening.exception() is None:
                    self._events = self._opening.result()  # opened, never read: close it
            if self._events is not None:
                try:
                    await self._events.aclose()
                except BaseException:  # a close that raises or hangs: the node's failure
                    self._failed = True
                    raise
            if self._prefill is not None:
                await _cancel(self._prefill)
        finally:
            self._release()

    def _release(self) -> None:
        if self._released:
            return
        self._released = True
        self._node.in_flight -= 1
        self._client.result(self._node, not self._failed)
        if self._route is not None:
            self._route.release_all()


async def close_stream(stream: RouteStream) -> None:
    """Close upstream connections even from a cancelled scope (client disconnect)."""
    with anyio.CancelScope(shield=True), anyio.move_on_after(CLOSE_BOUND_S):
        try:
            await stream.aclose()
        except Exception:  # the slots are freed (aclose); the other streams still get closed
            log.warning("closing an upstream stream failed", exc_info=True)


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
    that refused the request (503, or a 4xx such as `kv_exceeds_pool`) never asked P for the
    KV, and P (held out of compute until D asks) has nothing to report: no grace then; nor
    for an unreachable D (nothing reached it, so it asked P for nothing either)."""
    refused = isinstance(decode_error, ApiError) and decode_error.status_code < 500
    if isinstance(decode_error, NodeOverloadedError | NodeUnreachableError) or refused:
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


def _resolve(future: asyncio.Future[Any], value: Any) -> None:
    if not future.done():
        future.set_result(value)


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
