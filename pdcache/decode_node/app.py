"""The decode node's HTTP side (docs/pd-protocol.md): the handler of `/generate` bodies whose
`pd.role` is "decode", over the server's `EngineBridge` and the `DecodeController`.

Such a request reserves device pages for its prompt, asks the prefill node named by
`pd.bootstrap` to write the prompt's K/V into them, and once that is done decodes from the
first token prefill sampled, answering like any `/generate` (streaming or not); its `meta`
carries prefill's cache statistics (`Generation.report`). A failed or timed-out transfer is a
502/504 JSON error; a caller that leaves while the K/V is awaited aborts the room. Which
pages are freed when is the controller's business.

With `pd.first_token_streamed` (the router streams prefill's first token) a streaming answer
starts as soon as the request is admitted: headers and an SSE comment (`ADMITTED`), so every
admission refusal is still an HTTP error the router can retry, while anything after (the
transfer failing, the node closing) is an error event; its events start after token 1.

Admission (docs/pd-protocol.md, "Decode admission"): a request whose pages the pool cannot
give now waits in the engine's admission queue, in arrival order, until running requests free
them, and only then is prefill asked for the K/V. It is refused only when it can never fit the
pool (400 `kv_exceeds_pool`, at once), when the queue is full (503 `queue_full`) or when its
deadline — arrival + min(request timeout, room timeout) — passes while it waits (503
`queue_timeout`); a caller that leaves while queued leaves the queue. `AdmissionMetrics`
counts each outcome and the wait.

Threads: everything here runs on the event loop; the controller's callbacks (`on_admitted`
on the engine thread, `notify` on a transfer thread) only schedule results on the loop.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import aclosing
from typing import Any

from fastapi import Request
from fastapi.responses import Response, StreamingResponse
from starlette.background import BackgroundTask

from pdcache.decode_node.controller import (
    Admitted,
    DecodeController,
    DecodeOutcome,
    DuplicateRoomError,
    RoomCancelledError,
)
from pdcache.decode_node.first_token import FirstTokenSkip
from pdcache.decode_node.metrics import AdmissionMetrics
from pdcache.engine.engine import EngineNotRunningError
from pdcache.server.bridge import CLIENT_DISCONNECTED, Generation, json_ready, resolve_on_loop
from pdcache.server.routes import ServerRoutes
from pdcache.transfer.messages import PrefillReport
from pdcache.transfer.receiver import KVReceiver
from pdcache.wire.generate_api import GenerateRequestBody, single_item
from pdcache.wire.protocol import OVERLOADED, SERVER_ERROR, ApiError, bad_request
from pdcache.wire.responses import SSE_DONE, sse, wait_for_disconnect

log = logging.getLogger(__name__)

# the first bytes of an admitted `first_token_streamed` stream: an SSE comment line, which
# SSE readers (the router's `EventStream` too) skip; it only makes the response start
ADMITTED = b": admitted\n\n"


class DecodeHooks:
    """The steps of a PD decode request where something outside the node (a test, a fault
    injector) may hold or fail it: each is awaited on the event loop with the request's
    room. This base class does nothing at any step; it holds no state."""

    async def admitted(self, room: int) -> None:
        """The room's pages are reserved and prefill was asked for their K/V; the handler
        goes on to answer (a `first_token_streamed` stream opens here)."""

    async def awaiting_kv(self, room: int) -> None:
        """The handler is about to wait for the K/V: holding here is a slow transfer as the
        handler sees it."""

    async def kv_arrived(self, room: int) -> None:
        """Prefill wrote the K/V into the room's pages; decoding starts next. An `ApiError`
        raised here fails the request as a failed transfer does (whoever raises it leaves
        the room first: `DecodeController.leave`)."""


class DecodeApp:
    """`pd_generate`, `health_extra` and `info_extra` of one decode node; holds no state of its own (the
    rooms and their pages are the controller's). `hooks` (public, replaceable) is awaited at
    each step of a request (`DecodeHooks`)."""

    def __init__(self, routes: ServerRoutes, controller: DecodeController,
                 receiver: KVReceiver, hooks: DecodeHooks | None = None) -> None:
        self.routes = routes
        self.bridge = routes.bridge
        self.controller = controller
        self.receiver = receiver
        self.hooks = hooks if hooks is not None else DecodeHooks()
        self.admission = AdmissionMetrics(self.bridge.metrics.registry, self.bridge.engine.stats,
                                          self.bridge.config.name)

    @property
    def admission_timeout_s(self) -> float:
        """How long a request may wait for pages: its request deadline, at most a room's."""
        return min(self.bridge.config.request_timeout_s, self.receiver.config.room_timeout_s)

    async def pd_generate(self, request: Request, body: GenerateRequestBody) -> Response:
        pd = body.pd_params("decode")
        assert pd is not None
        if pd.role != "decode" or not pd.bootstrap:
            raise bad_request("this is a decode node: pd needs role 'decode' and 'bootstrap'",
                              code="wrong_role")
        body.check_supported()
        item = single_item(body)
        arrival = time.monotonic()
        input_ids = self.routes.checked_prompt(item)
        # a bad schema: 400; compiled on a worker thread
        constraint = await asyncio.to_thread(self.routes.agent.sampling_constraint, item.sampling)
        room, rid = pd.room, item.rid or f"pd-{pd.room}"
        released = await self._admit(request, room, rid, pd.bootstrap, input_ids,
                                     body.cache_salt or "", item.sampling.max_new_tokens,
                                     arrival + self.admission_timeout_s)

        async def decode(report: PrefillReport) -> Response:
            if pd.prefill_node:
                report = dataclasses.replace(report, prefill_node=pd.prefill_node)
            gen = Generation(arrival=arrival, report=report)
            sampling, salt = item.sampling.to_engine(), body.cache_salt
            try:
                handle = self.controller.start_decode(room, lambda state: (
                    self.bridge.submit_prefilled(
                        gen, rid, input_ids, sampling, salt, report.first_token,
                        logprobs=item.logprobs, constraint=constraint,
                        first_logprob=report.first_token_logprob(),
                        input_logprobs=report.prompt_logprobs(), session_id=body.session_id,
                        state=state)))
            except RoomCancelledError as exc:  # the node is closing
                raise ApiError(503, f"decode node unavailable: {exc}", type=OVERLOADED,
                               code="unavailable") from None
            # decoding runs: anything failing before its answer takes it over must end it
            with self.routes.ended_on_error(lambda: [(handle, gen)]):
                trim = None
                if pd.first_token_streamed and body.stream:  # the client has token 1 already
                    first_text = self.routes.first_token_text(item, report.first_token)
                    trim = FirstTokenSkip(self.routes.incremental(body), first_text).trim
                return await self.routes.respond(request, handle, gen, body, item, trim)

        if pd.first_token_streamed and body.stream:
            return self._admitted_stream(request, room, released, decode)
        return await decode(await self._arrived(released, room, request))

    def _admitted_stream(self, request: Request, room: int,
                         released: asyncio.Future[DecodeOutcome],
                         decode: Callable[[PrefillReport], Awaitable[Response]]) -> Response:
        """The stream of an admitted `first_token_streamed` request (docs/pd-protocol.md,
        "First token from prefill"): its headers and an SSE comment (`ADMITTED`, which SSE
        readers skip) go out at once, so the router knows it was admitted before it gives
        out prefill's first token; then, once the K/V is in, decode's own stream. A failure
        from here on (transfer, timeout, a node closing) is an error event, then [DONE]."""
        inner: list[Response] = []

        async def events() -> AsyncIterator[bytes]:
            # the room is left here, not in the background task: under ASGI spec >= 2.4 a
            # failed send (the caller gone, even at ADMITTED) skips the background, while
            # this generator's close still runs the finally (leave is idempotent: a no-op
            # once the K/V arrived and decoding took the room)
            try:
                yield ADMITTED
                try:
                    inner.append(await decode(await self._arrived(released, room, request)))
                except Exception as exc:  # as `sse_guard` renders a failure: event, [DONE]
                    if not isinstance(exc, ApiError):
                        log.exception("decode stream of room %d failed", room)
                        exc = ApiError(500, f"internal error: {exc}", type=SERVER_ERROR)
                    yield sse(exc.body())
                    yield SSE_DONE
                    return
                stream = inner[0]
                assert isinstance(stream, StreamingResponse)
                async with aclosing(stream.body_iterator) as chunks:  # type: ignore[type-var]
                    async for chunk in chunks:
                        yield chunk
            finally:
                self.controller.leave(room, "decode stream closed before the KV arrived")

        async def cleanup() -> None:
            if inner and inner[0].background is not None:
                await inner[0].background()  # the decoding request's own cleanup

        return StreamingResponse(events(), media_type="text/event-stream",
                                 background=BackgroundTask(cleanup),
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    async def _arrived(self, released: asyncio.Future[DecodeOutcome], room: int,
                       request: Request) -> PrefillReport:
        """Wait until prefill wrote the prompt's K/V into the room's pages."""
        await self.hooks.awaiting_kv(room)
        outcome = await self._wait(released, room, request)
        assert outcome.report is not None
        await self.hooks.kv_arrived(room)
        return outcome.report

    async def _admit(self, request: Request, room: int, rid: str, bootstrap: str,
                     input_ids: list[int], salt: str, max_new_tokens: int, deadline: float
                     ) -> asyncio.Future[DecodeOutcome]:
        """Reserve pages (waiting in the admission queue until `deadline` if the pool is short
        now; the leading ones from this node's prefix cache when it has them) and ask prefill
        for the K/V of the rest: the room's release future (`_arrived` awaits it). Every
        refusal here is an HTTP error (503s the router retries elsewhere)."""
        num_tokens = len(input_ids)
        loop = asyncio.get_running_loop()
        released: asyncio.Future[DecodeOutcome] = loop.create_future()
        admitted: asyncio.Future[Admitted] = loop.create_future()
        try:
            self.controller.open_room(rid, room, resolve_on_loop(loop, released))
        except DuplicateRoomError as exc:
            raise bad_request(str(exc), code=exc.code) from None
        except RuntimeError as exc:  # shutting down
            raise ApiError(503, f"decode node unavailable: {exc}", type=OVERLOADED,
                           code="unavailable") from None
        try:
            self.controller.request_kv(room, bootstrap, num_tokens, resolve_on_loop(loop, admitted),
                                       max_new_tokens=max_new_tokens, prefix_ids=input_ids,
                                       salt=salt)
        except ValueError as exc:  # can never fit this node's pool
            self.admission.observe_rejected("never_fits")
            raise bad_request(f"decode node cannot hold this request: {exc}",
                              code="kv_exceeds_pool") from None
        except (EngineNotRunningError, RoomCancelledError) as exc:
            raise ApiError(503, f"decode node unavailable: {exc}", type=OVERLOADED,
                           code="unavailable") from None
        await self._admitted(admitted, room, request, num_tokens, deadline)
        await self.hooks.admitted(room)
        return released

    async def _admitted(self, admitted: asyncio.Future[Admitted], room: int, request: Request,
                        num_tokens: int, deadline: float) -> None:
        """Wait for the room's admission (pages reserved, prefill asked) until `deadline`; a
        caller that leaves, or the deadline, takes the room out of the queue."""
        timeout = max(deadline - time.monotonic(), 0.0)
        gone = await self._race_caller(admitted, request, timeout, room,
                                       "decode request cancelled while waiting for pages")
        if gone is not None:
            reason = "caller disconnected" if gone else "deadline passed"
            self.controller.leave(room, f"decode request left the admission queue: {reason}")
            if gone:
                raise ApiError(499, f"room {room}: {reason} while waiting for pages",
                               type=CLIENT_DISCONNECTED)
            self.admission.observe_rejected("deadline")
            raise ApiError(503, f"decode node full: no room for {num_tokens} tokens of K/V "
                                f"within {self.admission_timeout_s:.0f}s", type=OVERLOADED,
                           code="queue_timeout")
        result = admitted.result()
        if result.ok:
            cached = min(result.cached_pages * self.bridge.engine.pool.page_size, num_tokens)
            self.admission.observe_admitted(result.waited_s, result.queued, num_tokens, cached)
            return
        if result.reason == "queue_full":
            self.admission.observe_rejected("queue_full")
            raise ApiError(503, f"decode node full: no room for {num_tokens} tokens of K/V now "
                                f"and its admission queue is full", type=OVERLOADED,
                           code="queue_full")
        if result.reason == "bad_room":
            raise bad_request(result.message, code="bad_room")
        raise ApiError(503, f"decode node unavailable: {result.reason}", type=OVERLOADED,
                       code="unavailable")

    async def _race_caller(self, future: asyncio.Future[Any], request: Request, timeout: float,
                           room: int, cancelled: str) -> bool | None:
        """Wait for `future` until `timeout` or the caller leaving; a cancelled handler makes
        the controller leave `room` (`cancelled` says why). None when `future` is done, else
        whether the caller went away (False: the deadline passed)."""
        disconnected = asyncio.ensure_future(wait_for_disconnect(request))
        try:
            await asyncio.wait({future, disconnected}, timeout=timeout,
                               return_when=asyncio.FIRST_COMPLETED)
        except asyncio.CancelledError:
            self.controller.leave(room, cancelled)
            raise
        finally:
            disconnected.cancel()
        if future.done():
            return None
        return disconnected.done() and not disconnected.cancelled()

    async def _wait(self, released: asyncio.Future[DecodeOutcome], room: int,
                    request: Request) -> DecodeOutcome:
        """The room's outcome; a caller that leaves (the router cancelling) or the deadline
        makes the controller abort the room (prefill is told; the pages are freed once
        nothing writes them)."""
        timeout = self.receiver.config.room_timeout_s + 5.0
        gone = await self._race_caller(released, request, timeout, room,
                                       "decode request cancelled before the KV arrived")
        if gone is not None:
            reason = "caller disconnected" if gone else f"no KV within {timeout:.0f}s"
            self.controller.leave(room, f"decode request ended before the KV arrived: {reason}")
            if gone:
                raise ApiError(499, f"room {room}: {reason}", type=CLIENT_DISCONNECTED)
            raise ApiError(504, f"room {room}: {reason}", type=SERVER_ERROR,
                           code="transfer_timeout")
        outcome = released.result()
        if not outcome.ok and outcome.code == "aborted" and self.receiver.closing:
            # receiver.close() aborted the room: the node shuts down, another may serve it
            raise ApiError(503, f"decode node unavailable: room {room}: {outcome.reason}",
                           type=OVERLOADED, code="unavailable")
        if not outcome.ok:
            code = "transfer_timeout" if outcome.code == "timeout" else "transfer_failed"
            status = 504 if code == "transfer_timeout" else 502
            raise ApiError(status, f"KV transfer of room {room} failed: {outcome.reason}",
                           type=SERVER_ERROR, code=code)
        return outcome

    def health_extra(self) -> dict[str, Any]:
        """/health's PD fields: the receiver's counters, `pd_rooms_open` (the controller's rooms
        not yet closed) and `pd_held` (finished requests whose pages are held for offload); an
        idle node has neither (`pdcache chaos` checks it)."""
        return {"role": "decode", "transfer": json_ready(self.receiver.stats()),
                "pd_rooms_open": len(self.controller.rooms()),
                "pd_held": len(self.controller.held()),
                # the router streams the first token from prefill only when both advertise it
                "first_token_stream": True}

    def info_extra(self) -> dict[str, Any]:
        """/server_info's PD fields (SGLang's names)."""
        return {"disaggregation_transfer_backend": self.receiver.config.engine}
