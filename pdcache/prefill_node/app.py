"""The prefill node's HTTP side (docs/pd-protocol.md): the handler of `/generate` bodies whose
`pd.role` is "prefill", over the server's `EngineBridge` and the `PrefillController`.

Such a request is computed up to its first token (HiCache reuse on the way); the controller
hands its prompt pages to the decode node through the sender, and the answer goes out once
the room is released: success with the first token and cache statistics, or a JSON error.
A `stream: true` body (the router's, with `[router] first_token_from_prefill`) is answered
in SSE instead: the first token's chunk as soon as it is sampled, before the K/V push, then
that same answer (or the error) as the last event once the room is released.
Requests without `pd` are the shared routes' (served like a unified server's).

Admission (docs/pd-protocol.md, "Decode admission"): the request is queued in the engine at
once (its storage prefetch starts), but computed only once its decode node asked for the K/V
(the scheduler's gate); a decode that never asks within room_timeout_s + bootstrap_timeout_s
ends it with 503 `decode_wait_timeout`. `DecodeWaitMetrics` records the wait.

Threads: everything here runs on the event loop; the controller's `notify` (a transfer
thread) only schedules the result on the loop (`call_soon_threadsafe`).
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response
from starlette.background import BackgroundTask

from pdcache.engine.api import LogprobRequest
from pdcache.prefill_node.controller import DuplicateRoomError, PrefillController, PrefillOutcome
from pdcache.prefill_node.metrics import DecodeWaitMetrics
from pdcache.server.bridge import EngineRequest, Generation, json_ready, resolve_on_loop
from pdcache.server.routes import SequenceRun, ServerRoutes
from pdcache.transfer.messages import prompt_logprobs_too_large
from pdcache.transfer.sender import KVSender
from pdcache.wire.detokenize import TextAssembler
from pdcache.wire.generate_api import GenerateItem, GenerateRequestBody, single_item
from pdcache.wire.protocol import OVERLOADED, SERVER_ERROR, ApiError, bad_request
from pdcache.wire.responses import event_stream, sse


class PrefillHooks:
    """The steps of a PD prefill request where something outside the node (a test, a fault
    injector) may hold or fail it: each is awaited on the event loop with the request's
    room. This base class does nothing at any step; it holds no state."""

    async def streaming(self, room: int) -> None:
        """The first token is computed and the answer is an SSE stream (the router's
        `first_token_from_prefill` body): its first event, that token, goes out next."""

    async def awaiting_release(self, room: int) -> None:
        """The first token is computed (and, in a stream, sent); the handler now waits for
        the room's release (the K/V push and decode's done)."""


class PrefillApp:
    """`pd_generate`, `health_extra` and `info_extra` of one prefill node; holds no state of its own (the
    rooms are the controller's). `hooks` (public, replaceable) is awaited at each step of a
    request (`PrefillHooks`)."""

    def __init__(self, routes: ServerRoutes, controller: PrefillController,
                 sender: KVSender, hooks: PrefillHooks | None = None) -> None:
        self.routes = routes
        self.bridge = routes.bridge
        self.controller = controller
        self.sender = sender
        self.hooks = hooks if hooks is not None else PrefillHooks()
        self.decode_wait = DecodeWaitMetrics(self.bridge.metrics.registry,
                                             controller.waiting_for_decode,
                                             self.bridge.config.name)

    @property
    def decode_wait_timeout_s(self) -> float:
        """How long a PD request waits for its decode to ask: decode's admission deadline (at
        most a room's timeout) plus the time its request takes to arrive."""
        config = self.sender.config
        return config.room_timeout_s + config.bootstrap_timeout_s

    async def pd_generate(self, request: Request, body: GenerateRequestBody) -> Response:
        pd = body.pd_params("prefill")
        assert pd is not None
        if pd.role != "prefill":
            raise bad_request("this is a prefill node: pd.role must be 'prefill'", code="wrong_role")
        body.check_supported()
        item = single_item(body)
        gen = Generation(arrival=time.monotonic())
        input_ids = self.routes.checked_prompt(item)
        self._check_logprobs_fit(item.logprobs, len(input_ids))
        # compiled on a worker thread; kept, so the submit below takes a copy
        await asyncio.to_thread(self.routes.agent.sampling_constraint, item.sampling)
        room, rid = pd.room, item.rid or f"pd-{pd.room}"
        requested: asyncio.Future[float] = asyncio.get_running_loop().create_future()
        released = self._open(rid, room, requested)
        started = time.monotonic()
        streamed = False
        try:
            sampling = item.sampling.to_engine()
            # the first token only; min_new_tokens >= 1 still keeps it from being a stop token;
            # sampled here under the request's grammar (decode rebuilds it)
            first_only = dataclasses.replace(sampling, max_new_tokens=1,
                                             min_new_tokens=min(sampling.min_new_tokens, 1))
            handle = self.bridge.submit(gen, input_ids, first_only, body.cache_salt, rid,
                                        logprobs=item.logprobs,
                                        constraint=self.routes.agent.sampling_constraint(
                                            item.sampling),
                                        session_id=body.session_id)
            watchdog = asyncio.ensure_future(self._watch_decode(requested, handle))
            try:
                text = self.routes.assembler(item)
                await self.bridge.collect(request, handle, gen, text)
            finally:
                if not watchdog.done():
                    watchdog.cancel()
            if watchdog.done() and not watchdog.cancelled() and watchdog.result():
                raise ApiError(503, f"room {room}: its decode node did not ask for the K/V "
                                    f"within {self.decode_wait_timeout_s:.0f}s",
                               type=OVERLOADED, code="decode_wait_timeout")
            if gen.finish_reason not in ("length", "stop") or not gen.output_ids:
                self.controller.close_room(room, f"prefill failed: {gen.finish_reason}")
                raise ApiError(500, f"prefill of room {room} failed ({gen.finish_reason})",
                               type=SERVER_ERROR, code="prefill_failed")
            # taken once (it consumes the chunk's logprobs): the first event's and the answer's
            meta_info = self.routes.meta_info(SequenceRun(item, handle, gen, text), body)
            if body.stream and body.pd is not None:  # sglang-router's bodies: JSON, as ever
                await self.hooks.streaming(room)
                streamed = True
                return self._pd_stream(item, gen, text, meta_info, released, room, started,
                                       pd.decode_node)
            outcome = await self._wait_release(released, room)
        finally:
            if not streamed:  # the stream closes its room itself, once it ends
                self.controller.close_room(room)  # no-op once released; else abort (orphan)
        return JSONResponse(self._pd_answer(gen, text, meta_info, outcome,
                                            time.monotonic() - started, pd.decode_node))

    def _check_logprobs_fit(self, logprobs: LogprobRequest | None, prompt_len: int) -> None:
        """400 `logprobs_too_large` before any compute when the prompt logprobs asked for
        cannot ride the Done message to decode (it would drop it and time the room out)."""
        why = prompt_logprobs_too_large(prompt_len, logprobs, self.sender.config.max_message_bytes)
        if why:
            raise bad_request(why, code="logprobs_too_large")

    async def _watch_decode(self, requested: asyncio.Future[float],
                            handle: EngineRequest) -> bool:
        """Record how long decode took to ask for the K/V; past the deadline, abort the
        request still held out of compute (True: the handler answers 503). Aborting before
        the room is closed keeps the gate shut until the engine saw the abort."""
        try:
            waited = await asyncio.wait_for(asyncio.shield(requested), self.decode_wait_timeout_s)
        except asyncio.TimeoutError:
            if handle.finished or not self.controller.wait_for_decode:
                return False
            self.decode_wait.timeouts.inc()
            handle.abort()
            return True
        self.decode_wait.wait.observe(waited)
        return False

    def _open(self, rid: str, room: int, requested: asyncio.Future[float]
              ) -> asyncio.Future[PrefillOutcome]:
        loop = asyncio.get_running_loop()
        released: asyncio.Future[PrefillOutcome] = loop.create_future()
        try:
            self.controller.open_room(rid, room, resolve_on_loop(loop, released),
                                      on_requested=resolve_on_loop(loop, requested))
        except DuplicateRoomError:
            raise bad_request(f"room {room} is already in use", code="duplicate_room") from None
        except RuntimeError as exc:  # shutting down
            raise ApiError(503, f"prefill node unavailable: {exc}", type=OVERLOADED,
                           code="unavailable") from None
        return released

    async def _wait_release(self, released: asyncio.Future[PrefillOutcome], room: int
                            ) -> PrefillOutcome:
        await self.hooks.awaiting_release(room)
        timeout = self.sender.config.room_timeout_s + 5.0
        try:
            outcome = await asyncio.wait_for(asyncio.shield(released), timeout)
        except asyncio.TimeoutError:
            raise ApiError(504, f"KV transfer of room {room} did not finish in {timeout:.0f}s",
                           type=SERVER_ERROR, code="transfer_timeout") from None
        if not outcome.ok:
            raise ApiError(502, f"KV transfer of room {room} failed: {outcome.reason}",
                           type=SERVER_ERROR, code="transfer_failed")
        return outcome

    def _pd_stream(self, item: GenerateItem, gen: Generation, text: TextAssembler,
                   meta_info: dict[str, Any], released: asyncio.Future[PrefillOutcome],
                   room: int, started: float, decode_node: str | None) -> Response:
        """The SSE answer of a `stream: true` PD body (docs/pd-protocol.md, "First token from
        prefill"): the first token's chunk at once, as a unified node's stream sends it, then
        once the room is released the JSON answer (`_pd_answer`) as the last event, or an
        error event; then [DONE]. The room is closed when the stream ends or is dropped."""
        closed = False

        def close_room() -> None:
            nonlocal closed
            if not closed:
                closed = True
                self.controller.close_room(room)  # no-op once released; else abort (orphan)

        async def events() -> AsyncIterator[bytes]:
            try:
                first_text = self.routes.first_token_text(item, gen.output_ids[0])
                first = first_token_chunk(first_text, gen.output_ids, meta_info)
                first["meta_info"]["decode_node"] = decode_node or ""  # as in the answer
                yield sse(first)
                outcome = await self._wait_release(released, room)
                yield sse(self._pd_answer(gen, text, dict(meta_info), outcome,
                                          time.monotonic() - started, decode_node))
            finally:
                close_room()

        return event_stream(events(), BackgroundTask(close_room))

    def _pd_answer(self, gen: Generation, text: TextAssembler, meta_info: dict[str, Any],
                   outcome: PrefillOutcome, elapsed_s: float, decode_node: str | None
                   ) -> dict[str, Any]:
        """SGLang's answer of a prefill server (the first token), plus `pd`: `transfer_s`, the
        handler's whole time (prefill included); `push_s`, from the prompt's K/V being
        complete to the room's release (the transfer and its `done`)."""
        meta_info["decode_node"] = decode_node or ""
        pd = {"room": outcome.room, "bytes": outcome.nbytes, "transfer_s": elapsed_s,
              "push_s": outcome.push_s}
        return {"text": text.text, "output_ids": gen.output_ids, "meta_info": meta_info,
                "pd": pd}

    def health_extra(self) -> dict[str, Any]:
        """/health's PD fields: the sender's counters and `pd_rooms_open`, the controller's
        rooms not yet closed (an idle node has none: `pdcache chaos` checks it)."""
        return {"role": "prefill", "bootstrap": self.sender.bootstrap_addr,
                "transfer": json_ready(self.sender.stats()),
                "pd_rooms_open": len(self.controller.rooms()),
                # the router streams the first token from prefill only when both advertise it
                "first_token_stream": True}

    def info_extra(self) -> dict[str, Any]:
        """/server_info's PD fields (SGLang's names): the KV bootstrap port (once started)."""
        addr = self.sender.bootstrap_addr
        port = int(addr.rsplit(":", 1)[1]) if addr else None
        return {"disaggregation_bootstrap_port": port, "disaggregation_bootstrap_addr": addr,
                "disaggregation_transfer_backend": self.sender.config.engine}


def first_token_chunk(first_text: str, output_ids: list[int], meta_info: dict[str, Any]
                      ) -> dict[str, Any]:
    """The chunk a unified node's stream sends for the first token (cumulative and
    incremental chunks agree on it): `first_text`, its text as released after that token
    alone (held-back partial characters and stop-string prefixes come with decode's later
    events), and a mid-stream `meta_info` (no `finish_reason`, no `e2e_latency`: the
    request's end is decode's final event, even for one that ends at the first token)."""
    mid_stream = {k: v for k, v in meta_info.items() if k != "e2e_latency"}
    mid_stream["finish_reason"] = None
    return {"text": first_text, "output_ids": list(output_ids), "meta_info": mid_stream}
