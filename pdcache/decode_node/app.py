"""The decode node's HTTP side (docs/pd-protocol.md): the handler of `/generate` bodies whose
`pd.role` is "decode", over the server's `EngineBridge` and the `DecodeController`.

Such a request reserves device pages for its prompt, asks the prefill node named by
`pd.bootstrap` to write the prompt's K/V into them, and once that is done decodes from the
first token prefill sampled, answering like any `/generate` (streaming or not); its `meta`
carries prefill's cache statistics (`Generation.report`). A failed or timed-out transfer is a
502/504 JSON error; a caller that leaves while the K/V is awaited aborts the room. Which
pages are freed when is the controller's business.

Threads: everything here runs on the event loop, except `controller.request_kv` (it blocks on
the engine: a worker thread via `asyncio.to_thread`); the controller's `notify` (a transfer
thread) only schedules the result on the loop.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import Callable
from typing import Any

from fastapi import Request
from fastapi.responses import Response

from pdcache.decode_node.controller import (
    BadRoomError,
    DecodeController,
    DecodeOutcome,
    DuplicateRoomError,
    RoomCancelledError,
)
from pdcache.engine.engine import EngineNotRunningError, EngineOverloadedError
from pdcache.server.bridge import (
    CLIENT_DISCONNECTED,
    Generation,
    json_ready,
    set_result_once,
    wait_for_disconnect,
)
from pdcache.server.protocol import (
    OVERLOADED,
    SERVER_ERROR,
    ApiError,
    GenerateRequestBody,
    bad_request,
)
from pdcache.server.routes import ServerRoutes
from pdcache.transfer import KVReceiver, PrefillReport


class DecodeApp:
    """`pd_generate` and `health_extra` of one decode node; holds no state of its own (the
    rooms and their pages are the controller's)."""

    def __init__(self, routes: ServerRoutes, controller: DecodeController,
                 receiver: KVReceiver) -> None:
        self.routes = routes
        self.bridge = routes.bridge
        self.controller = controller
        self.receiver = receiver

    async def pd_generate(self, request: Request, body: GenerateRequestBody) -> Response:
        pd = body.pd
        assert pd is not None
        if pd.role != "decode" or not pd.bootstrap:
            raise bad_request("this is a decode node: pd needs role 'decode' and 'bootstrap'",
                              code="wrong_role")
        arrival = time.monotonic()
        input_ids = self.routes.checked_prompt(body)
        room, rid = pd.room, body.rid or f"pd-{pd.room}"
        report = await self._receive(request, room, rid, pd.bootstrap, len(input_ids))
        if pd.prefill_node:
            report = dataclasses.replace(report, prefill_node=pd.prefill_node)
        gen = Generation(arrival=arrival, report=report)
        sampling, salt = body.sampling_params.to_engine(), body.cache_salt
        try:
            handle = self.controller.start_decode(room, lambda: self.bridge.submit_prefilled(
                gen, rid, input_ids, sampling, salt, report.first_token))
        except RoomCancelledError as exc:  # the node is closing
            raise ApiError(503, f"decode node unavailable: {exc}", type=OVERLOADED,
                           code="unavailable") from None
        return await self.routes.respond(request, handle, gen, body.stream)

    async def _receive(self, request: Request, room: int, rid: str, bootstrap: str,
                       num_tokens: int) -> PrefillReport:
        """Reserve pages and wait until prefill wrote the prompt's K/V into them."""
        loop = asyncio.get_running_loop()
        released: asyncio.Future[DecodeOutcome] = loop.create_future()
        try:
            self.controller.open_room(rid, room, _on_loop(loop, released))
        except DuplicateRoomError:
            raise bad_request(f"room {room} is already in use", code="duplicate_room") from None
        except RuntimeError as exc:  # shutting down
            raise ApiError(503, f"decode node unavailable: {exc}", type=OVERLOADED,
                           code="unavailable") from None
        try:
            await asyncio.to_thread(self.controller.request_kv, room, bootstrap, num_tokens)
        except asyncio.CancelledError:
            self.controller.leave(room, "decode request cancelled before the KV arrived")
            raise
        except (EngineOverloadedError, EngineNotRunningError, ValueError,
                RoomCancelledError) as exc:
            raise _request_error(exc) from None
        outcome = await self._wait(released, room, request)
        assert outcome.report is not None
        return outcome.report

    async def _wait(self, released: asyncio.Future[DecodeOutcome], room: int,
                    request: Request) -> DecodeOutcome:
        """The room's outcome; a caller that leaves (the router cancelling) or the deadline
        makes the controller abort the room (prefill is told; the pages are freed once
        nothing writes them)."""
        timeout = self.receiver.config.room_timeout_s + 5.0
        disconnected = asyncio.ensure_future(wait_for_disconnect(request))
        try:
            await asyncio.wait({released, disconnected}, timeout=timeout,
                               return_when=asyncio.FIRST_COMPLETED)
        except asyncio.CancelledError:
            self.controller.leave(room, "decode request cancelled before the KV arrived")
            raise
        finally:
            disconnected.cancel()
        if not released.done():
            gone = disconnected.done() and not disconnected.cancelled()
            reason = "caller disconnected" if gone else f"no KV within {timeout:.0f}s"
            self.controller.leave(room, f"decode request ended before the KV arrived: {reason}")
            if gone:
                raise ApiError(499, f"room {room}: {reason}", type=CLIENT_DISCONNECTED)
            raise ApiError(504, f"room {room}: {reason}", type=SERVER_ERROR,
                           code="transfer_timeout")
        outcome = released.result()
        if not outcome.ok:
            code = "transfer_timeout" if outcome.code == "timeout" else "transfer_failed"
            status = 504 if code == "transfer_timeout" else 502
            raise ApiError(status, f"KV transfer of room {room} failed: {outcome.reason}",
                           type=SERVER_ERROR, code=code)
        return outcome

    def health_extra(self) -> dict[str, Any]:
        return {"role": "decode", "transfer": json_ready(self.receiver.stats())}


def _request_error(exc: Exception) -> ApiError:
    """`request_kv`'s failures (nothing is left reserved) as HTTP errors."""
    if isinstance(exc, EngineOverloadedError):
        return ApiError(503, f"decode node full: {exc}", type=OVERLOADED, code="overloaded")
    if isinstance(exc, EngineNotRunningError | RoomCancelledError):
        return ApiError(503, f"decode node unavailable: {exc}", type=OVERLOADED,
                        code="unavailable")
    if isinstance(exc, BadRoomError):
        return bad_request(str(exc), code="bad_room")
    return bad_request(str(exc), code="invalid_request")


def _on_loop(loop: asyncio.AbstractEventLoop, future: asyncio.Future[DecodeOutcome]
             ) -> Callable[[DecodeOutcome], None]:
    """The controller's `notify` (any thread): resolve `future` on its loop."""

    def notify(outcome: DecodeOutcome) -> None:
        try:
            loop.call_soon_threadsafe(set_result_once, future, outcome)
        except RuntimeError:  # the loop is closed: the server is gone
            pass

    return notify
