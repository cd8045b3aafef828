"""The decode node's HTTP server (docs/pd-protocol.md).

A request with `pd.role == "decode"` reserves device pages for its prompt, asks the prefill
node named by `pd.bootstrap` to write the prompt's K/V into them (`KVReceiver`), and once that
is done decodes from the first token prefill sampled, answering like any `/generate`
(streaming or not). Its `meta` carries prefill's cache statistics. A failed or timed-out
transfer is a 502/504 JSON error; the reserved pages are freed when the transfer layer says
nothing writes them any more.

Threads: handlers on the event loop; `on_release` on the receiver's control thread; the only
shared state is `_rooms` under `_lock`.
"""

from __future__ import annotations

import asyncio
import dataclasses
import threading
import time
from dataclasses import dataclass
from typing import Any

from fastapi import Request
from fastapi.responses import Response

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
from pdcache.transfer import KVReceiver, Outcome, PrefillReport, RoomState, TransferError


@dataclass
class _Room:
    rid: str
    loop: asyncio.AbstractEventLoop
    released: asyncio.Future


class DecodeServer:
    """The `pd` requests of a decode node: they start from K/V pushed by a prefill node.
    Other requests are the `routes`' (a unified server's)."""

    def __init__(self, routes: ServerRoutes, receiver: KVReceiver) -> None:
        self.routes = routes
        self.bridge = routes.bridge
        self.engine = routes.engine
        self.config = routes.bridge.config
        self.receiver = receiver
        self._rooms: dict[int, _Room] = {}
        self._lock = threading.Lock()

    # ---- transfer callback --------------------------------------------------------------
    def on_release(self, outcome: Outcome) -> None:
        """Receiver thread: the room is over; on failure its reserved pages can go."""
        with self._lock:
            entry = self._rooms.pop(outcome.room_id, None)
        if entry is None:
            return
        if outcome.state is not RoomState.SUCCESS:
            self.engine.abort(entry.rid)  # frees the reservation (nothing writes it any more)
        entry.loop.call_soon_threadsafe(set_result_once, entry.released, outcome)

    # ---- /generate ----------------------------------------------------------------------
    async def pd_generate(self, request: Request, body: GenerateRequestBody) -> Response:
        assert body.pd is not None
        if body.pd.role != "decode" or not body.pd.bootstrap:
            raise bad_request("this is a decode node: pd needs role 'decode' and 'bootstrap'",
                              code="wrong_role")
        return await self._generate_pd(request, body)

    async def _generate_pd(self, request: Request, body: GenerateRequestBody) -> Response:
        arrival = time.monotonic()
        input_ids = self.routes.checked_prompt(body)
        sampling = body.sampling_params
        room = body.pd.room
        rid = body.rid or f"pd-{room}"
        report = await self._receive(request, room, rid, body.pd.bootstrap, input_ids)
        if body.pd.prefill_node:
            report = dataclasses.replace(report, prefill_node=body.pd.prefill_node)
        gen = Generation(arrival=arrival, report=report)
        handle = self.bridge.submit_prefilled(gen, rid, input_ids, sampling.to_engine(),
                                              body.cache_salt, report.first_token)
        return await self.routes.respond(request, handle, gen, body.stream)

    async def _receive(self, request: Request, room: int, rid: str, bootstrap: str,
                       input_ids: list[int]) -> PrefillReport:
        """Reserve pages and wait until prefill wrote the prompt's K/V into them."""
        pages = await self._reserve(rid, len(input_ids))
        loop = asyncio.get_running_loop()
        entry = _Room(rid, loop, loop.create_future())
        with self._lock:
            if room in self._rooms:
                self.engine.abort(rid)
                raise bad_request(f"room {room} is already in use", code="duplicate_room")
            self._rooms[room] = entry
        try:
            self.receiver.request(room, bootstrap, pages, len(input_ids))
        except (ValueError, TransferError) as exc:
            with self._lock:
                self._rooms.pop(room, None)
            self.engine.abort(rid)
            raise bad_request(f"room {room}: {exc}", code="bad_room") from None
        await self._wait(entry, room, request)
        result = self.receiver.wait(room, 0.0)  # finished: returns at once
        return result.report

    async def _reserve(self, rid: str, num_tokens: int) -> list[int]:
        try:
            return await asyncio.to_thread(self.engine.reserve, rid, num_tokens)
        except EngineOverloadedError as exc:
            raise ApiError(503, f"decode node full: {exc}", type=OVERLOADED,
                           code="overloaded") from None
        except EngineNotRunningError as exc:
            raise ApiError(503, f"decode node unavailable: {exc}", type=OVERLOADED,
                           code="unavailable") from None
        except ValueError as exc:
            raise bad_request(str(exc), code="invalid_request") from None

    async def _wait(self, entry: _Room, room: int, request: Request) -> Outcome:
        """The room's outcome; a caller that leaves (the router cancelling) or the deadline
        aborts the room, which tells prefill and frees the pages once nothing writes them."""
        timeout = self.receiver.config.room_timeout_s + 5.0
        disconnected = asyncio.ensure_future(wait_for_disconnect(request))
        try:
            await asyncio.wait({entry.released, disconnected}, timeout=timeout,
                               return_when=asyncio.FIRST_COMPLETED)
        except asyncio.CancelledError:
            self.receiver.abort(room, "decode request cancelled before the KV arrived")
            raise
        finally:
            disconnected.cancel()
        if not entry.released.done():
            gone = disconnected.done() and not disconnected.cancelled()
            reason = "caller disconnected" if gone else f"no KV within {timeout:.0f}s"
            self.receiver.abort(room, f"decode request ended before the KV arrived: {reason}")
            if gone:
                raise ApiError(499, f"room {room}: {reason}", type=CLIENT_DISCONNECTED)
            raise ApiError(504, f"room {room}: {reason}", type=SERVER_ERROR,
                           code="transfer_timeout")
        outcome = entry.released.result()
        if outcome.state is not RoomState.SUCCESS:
            code = "transfer_timeout" if outcome.code == "timeout" else "transfer_failed"
            status = 504 if code == "transfer_timeout" else 502
            raise ApiError(status, f"KV transfer of room {room} failed: {outcome.reason}",
                           type=SERVER_ERROR, code=code)
        return outcome

    def health_extra(self) -> dict[str, Any]:
        return {"role": "decode", "transfer": json_ready(self.receiver.stats())}
