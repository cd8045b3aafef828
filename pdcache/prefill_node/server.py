"""The prefill node's HTTP server (docs/pd-protocol.md).

A request with `pd.role == "prefill"` is computed up to its first token (HiCache reuse on the
way), its prompt pages go to the decode node through `KVSender`, and the answer is sent once
the transfer is released: success with the first token and cache statistics, or a JSON error.
Requests without `pd` are served like a unified server's (handy for warm-up and checks).

Threads: HTTP handlers on the event loop; `_on_prefilled` on the engine thread; `_on_release`
on transfer threads. The only state they share is `_rooms` (under `_lock`), and results reach
the loop through `call_soon_threadsafe`.
"""

from __future__ import annotations

import asyncio
import dataclasses
import threading
import time
from dataclasses import dataclass
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from pdcache.engine.api import CachedTokens
from pdcache.engine.request import Req, pages_for
from pdcache.server.bridge import Generation, json_ready, set_result_once
from pdcache.server.protocol import (
    SERVER_ERROR,
    ApiError,
    GenerateRequestBody,
    TextAssembler,
    bad_request,
)
from pdcache.server.routes import ServerRoutes
from pdcache.transfer import KVSender, Outcome, PrefillReport, RoomState


@dataclass
class _Room:
    rid: str
    loop: asyncio.AbstractEventLoop
    released: asyncio.Future
    sent: bool = False
    sent_at: float = 0.0  # monotonic: prompt K/V complete, handed to the sender
    released_at: float = 0.0  # monotonic: the transfer layer released the room


class PrefillServer:
    """The `pd` requests of a prefill node: computed to their first token, then their KV is
    pushed to a decode node. Other requests are the `routes`' (a unified server's)."""

    def __init__(self, routes: ServerRoutes, sender: KVSender) -> None:
        self.routes = routes
        self.bridge = routes.bridge
        self.engine = routes.engine
        self.config = routes.bridge.config
        self.sender = sender
        self._rooms: dict[int, _Room] = {}  # room -> the handler waiting for it
        self._orphans: dict[int, str] = {}  # room -> rid, transfer running, handler gone
        self._room_of: dict[str, int] = {}
        self._lock = threading.RLock()

    # ---- engine and transfer callbacks --------------------------------------------------
    def on_prefilled(self, req: Req) -> None:
        """Engine thread: the request's prompt K/V is complete and its pages are held."""
        pages = req.page_ids[: pages_for(len(req.prompt_ids), self.engine.pool.page_size)]
        cached = req.cached
        report = PrefillReport(req.output_ids[0], len(req.prompt_ids), req.computed_tokens,
                               cached or CachedTokens(), self.config.name)
        # Held across send(): the handler cannot close the room between the lookup and
        # `sent`, so exactly one of on_release / this method frees the pages (RLock: send()
        # may run on_release on this thread).
        with self._lock:
            room = self._room_of.get(req.rid)
            entry = self._rooms.get(room) if room is not None else None
            accepted = entry is not None and self.sender.send(room, pages, report)
            if accepted:
                entry.sent, entry.sent_at = True, time.monotonic()
            else:
                self._room_of.pop(req.rid, None)
        if not accepted:  # the room is already over: nobody will read these pages
            self._release(req.rid)

    def on_release(self, outcome: Outcome) -> None:
        """Transfer thread: the room's pages are no longer read."""
        with self._lock:
            entry = self._rooms.pop(outcome.room_id, None)
            rid = entry.rid if entry else self._orphans.pop(outcome.room_id, None)
            if rid is not None:
                self._room_of.pop(rid, None)
        if rid is not None:
            self._release(rid)
        if entry is not None:
            entry.released_at = time.monotonic()
            entry.loop.call_soon_threadsafe(set_result_once, entry.released, outcome)

    def _release(self, rid: str) -> None:
        self.scheduler.release_guard.allow(rid)
        self.engine.release_held(rid)

    # ---- /generate ----------------------------------------------------------------------
    async def pd_generate(self, request: Request, body: GenerateRequestBody) -> Response:
        assert body.pd is not None
        if body.pd.role != "prefill":
            raise bad_request("this is a prefill node: pd.role must be 'prefill'", code="wrong_role")
        return await self._generate_pd(request, body)

    async def _generate_pd(self, request: Request, body: GenerateRequestBody) -> Response:
        gen = Generation(arrival=time.monotonic())
        input_ids = self.routes.checked_prompt(body)
        sampling = body.sampling_params
        room = body.pd.room
        rid = body.rid or f"pd-{room}"
        entry = self._open_room(room, rid)
        started = time.monotonic()
        try:
            first_only = dataclasses.replace(sampling.to_engine(), max_new_tokens=1)
            handle = self.bridge.submit(gen, input_ids, first_only, body.cache_salt, rid)
            await self.bridge.collect(request, handle, gen,
                                     TextAssembler(self.routes.decode, []))
            if gen.finish_reason not in ("length", "stop") or not gen.output_ids:
                self.sender.abort(room, f"prefill failed: {gen.finish_reason}")
                raise ApiError(500, f"prefill of room {room} failed ({gen.finish_reason})",
                               type=SERVER_ERROR, code="prefill_failed")
            outcome = await self._wait_release(entry, room)
        finally:
            self._close_room(room, rid)
        push_s = max(entry.released_at - entry.sent_at, 0.0) if entry.sent_at else 0.0
        return self._pd_response(gen, outcome, time.monotonic() - started, push_s,
                                 body.pd.decode_node)

    def _open_room(self, room: int, rid: str) -> _Room:
        loop = asyncio.get_running_loop()
        entry = _Room(rid, loop, loop.create_future())
        with self._lock:
            if room in self._rooms or room in self._orphans:
                raise bad_request(f"room {room} is already in use", code="duplicate_room")
            self._rooms[room] = entry
            self._room_of[rid] = room
        self.scheduler.expect(rid)
        return entry

    def _close_room(self, room: int, rid: str) -> None:
        """The handler is done. A room whose transfer is still running becomes an orphan:
        it is aborted, and `on_release` frees its pages when the engine stops reading them."""
        self.scheduler.forget(rid)
        with self._lock:
            entry = self._rooms.pop(room, None)
            if entry is None:
                return  # already released
            if entry.sent:
                self._orphans[room] = rid
            else:
                self._room_of.pop(rid, None)
        if entry.sent:
            self.sender.abort(room, "prefill request ended early")

    async def _wait_release(self, entry: _Room, room: int) -> Outcome:
        timeout = self.sender.config.room_timeout_s + 5.0
        try:
            outcome = await asyncio.wait_for(asyncio.shield(entry.released), timeout)
        except asyncio.TimeoutError:
            raise ApiError(504, f"KV transfer of room {room} did not finish in {timeout:.0f}s",
                           type=SERVER_ERROR, code="transfer_timeout") from None
        if outcome.state is not RoomState.SUCCESS:
            raise ApiError(502, f"KV transfer of room {room} failed: {outcome.reason}",
                           type=SERVER_ERROR, code="transfer_failed")
        return outcome

    def _pd_response(self, gen: Generation, outcome: Outcome, elapsed_s: float, push_s: float,
                     decode_node: str | None) -> Response:
        """`pd.transfer_s`: the handler's whole time (prefill included); `pd.push_s`: from the
        prompt's K/V being complete to the room's release (the transfer and its `done`)."""
        meta = self.bridge.meta(gen).model_dump()
        meta["decode_node"] = decode_node or ""
        nbytes = getattr(outcome.data, "nbytes", 0) if outcome.data is not None else 0
        pd = {"room": outcome.room_id, "bytes": nbytes, "transfer_s": elapsed_s,
              "push_s": push_s}
        return JSONResponse({"output_ids": gen.output_ids, "meta": meta, "pd": pd})

    @property
    def scheduler(self):
        return self.engine.scheduler

    def health_extra(self) -> dict[str, Any]:
        return {"role": "prefill", "bootstrap": self.sender.bootstrap_addr,
                "transfer": json_ready(self.sender.stats())}
