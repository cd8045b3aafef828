"""`proxy.RouteStream` with the first token from prefill, driven through its public `next()`
and `aclose()` with P's call, P's first event and D's opening as controlled asyncio tasks, so
the order of events is exact: P failing after its first event but while D is still opening
is P's HTTP error (retryable), never token 1 followed by a mid-stream error."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from pdcache.router.proxy import RouteStream
from pdcache.wire.protocol import SERVER_ERROR, ApiError


class Node:
    def __init__(self) -> None:
        self.in_flight = 1  # the proxy counts the stream before it builds the RouteStream


class Client:
    def __init__(self) -> None:
        self.results: list[bool] = []

    def result(self, node: Node, ok: bool) -> None:
        self.results.append(ok)


class Events:
    """D's opened event stream: one event, then the end."""

    def __init__(self) -> None:
        self.closed = False
        self._left: list[dict[str, Any]] = [{"text": "d"}]

    async def next(self) -> dict[str, Any] | None:
        return self._left.pop(0) if self._left else None

    async def aclose(self) -> None:
        self.closed = True


@pytest.mark.parametrize("p_fails", [True, False], ids=["prefill_fails", "prefill_ok"])
def test_prefill_failing_while_decode_opens_is_an_http_error(p_fails: bool) -> None:
    async def scenario() -> tuple[list[Any], Client, Node, Events]:
        loop = asyncio.get_running_loop()
        first: asyncio.Future[dict[str, Any]] = loop.create_future()
        p_may_end, d_may_open = asyncio.Event(), asyncio.Event()
        events = Events()

        async def prefill() -> dict[str, Any]:
            first.set_result({"text": "p"})
            await p_may_end.wait()
            if p_fails:
                raise ApiError(502, "prefill died after its first event", type=SERVER_ERROR,
                               code="prefill_failed")
            return {"text": "p"}

        async def opening() -> Events:
            await d_may_open.wait()
            return events

        node, client = Node(), Client()
        p_task, d_task = asyncio.create_task(prefill()), asyncio.create_task(opening())
        stream = RouteStream(client, None, p_task, None,  # type: ignore[arg-type]
                             decode_opening=(node, d_task), prefill_first=first)  # type: ignore[arg-type]
        got: list[Any] = []
        reading = asyncio.create_task(stream.next())
        await asyncio.wait_for(first, 5)
        p_may_end.set()  # P ends (or fails) while D has not opened yet
        await asyncio.wait({p_task}, timeout=5)
        d_may_open.set()
        try:
            while (event := await asyncio.wait_for(reading, 5)) is not None:
                got.append(event)
                reading = asyncio.create_task(stream.next())
            got.append(None)
        except ApiError as exc:
            got.append((exc.status_code, exc.code))
        finally:
            await stream.aclose()
        return got, client, node, events

    got, client, node, events = asyncio.run(scenario())
    if p_fails:
        assert got == [(502, "prefill_failed")]  # no token 1: an error the router can retry
        assert client.results == [False]
    else:
        assert got == [{"text": "p"}, {"text": "d"}, None]
        assert client.results == [True]
    assert node.in_flight == 0 and events.closed


class BrokenEvents(Events):
    """D's stream whose close raises, or never ends (`hang`)."""

    def __init__(self, hang: bool) -> None:
        super().__init__()
        self.hang = hang

    async def aclose(self) -> None:
        if self.hang:
            await asyncio.Event().wait()
        raise RuntimeError("connection reset while closing")


class Route:
    def __init__(self) -> None:
        self.released = 0

    def release_all(self) -> None:
        self.released += 1


@pytest.mark.parametrize("hang", [False, True], ids=["close_raises", "close_hangs"])
def test_closing_frees_the_slots_whatever_the_upstream_close_does(
        hang: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """A D stream whose close raises, or outlives `close_stream`'s bound: the node's in-flight
    count and the route's slots are freed all the same (once), and `close_stream` returns."""
    from pdcache.router import proxy

    monkeypatch.setattr(proxy, "CLOSE_BOUND_S", 0.2)

    async def scenario() -> tuple[Node, Client, Route]:
        node, client, route = Node(), Client(), Route()
        events = BrokenEvents(hang)
        events.node = node  # type: ignore[attr-defined]
        stream = RouteStream(client, events, None, route)  # type: ignore[arg-type]
        await asyncio.wait_for(proxy.close_stream(stream), 5)
        await asyncio.wait_for(proxy.close_stream(stream), 5)  # a second close frees nothing more
        return node, client, route

    node, client, route = asyncio.run(scenario())
    assert (node.in_flight, client.results, route.released) == (0, [False], 1)


class DisconnectingRequest:
    """A request whose client is gone once `gone` is set (all `wait_for_disconnect` reads)."""

    def __init__(self, gone: asyncio.Event) -> None:
        self._gone = gone

    async def receive(self) -> dict[str, Any]:
        await self._gone.wait()
        return {"type": "http.disconnect"}


@pytest.mark.parametrize("client_leaves", [True, False], ids=["client_left", "client_stayed"])
def test_watch_discards_a_result_that_arrived_after_the_client_left(client_leaves: bool) -> None:
    """The client leaves while `work` finishes anyway (a gather whose last stream opened as it
    was cancelled): the opened stream goes to `discard` (closed, its slots freed), never lost;
    a result handed to the caller is not discarded."""
    from pdcache.router.app import watch

    async def scenario() -> tuple[Any, list[str]]:
        gone, discarded = asyncio.Event(), []

        async def work() -> str:
            if not client_leaves:
                return "stream"
            try:
                await asyncio.sleep(30)
            except asyncio.CancelledError:  # finished opening just as it was cancelled
                return "stream"
            return "late"

        async def discard(result: str) -> None:
            discarded.append(result)

        if client_leaves:
            gone.set()
        try:
            got: Any = await watch(DisconnectingRequest(gone), work(),  # type: ignore[arg-type]
                                   discard=discard)
        except ApiError as exc:
            got = exc.status_code
        return got, discarded

    got, discarded = asyncio.run(scenario())
    assert (got, discarded) == ((499, ["stream"]) if client_leaves else ("stream", []))


@pytest.mark.parametrize("opener", ["open_all", "gather"])
def test_a_batch_whose_client_leaves_while_it_opens_closes_what_opened(opener: str) -> None:
    """A streamed batch of two: sequence A's stream is open, B still waits for its first
    event when the client leaves. `open_all` closes A (its node slot and in-flight count
    freed); a plain gather, cancelled, threw A away with its slot held for good (the
    router's `/generate` used one: that node's limit then refused everything behind it)."""
    from pdcache.router.app import open_all, watch

    async def scenario() -> tuple[Any, list[Any]]:
        gone, closed, a_open = asyncio.Event(), [], asyncio.Event()

        async def open_a() -> tuple[str, None, None]:
            a_open.set()
            return ("A", None, None)

        async def open_b() -> tuple[str, None, None]:
            await asyncio.sleep(30)
            return ("B", None, None)

        async def close(opened: list[Any]) -> None:
            closed.extend(result[0] for result in opened)

        async def leave() -> None:
            await a_open.wait()
            await asyncio.sleep(0.05)
            gone.set()

        work = (open_all([open_a(), open_b()], close) if opener == "open_all" else
                asyncio.gather(open_a(), open_b(), return_exceptions=True))
        leaving = asyncio.ensure_future(leave())
        try:
            got: Any = await watch(DisconnectingRequest(gone), work,  # type: ignore[arg-type]
                                   discard=close)
        except ApiError as exc:
            got = exc.status_code
        await leaving
        return got, closed

    got, closed = asyncio.run(asyncio.wait_for(scenario(), 10))
    assert got == 499
    assert closed == (["A"] if opener == "open_all" else [])


@pytest.mark.parametrize("runner", ["all_or_none", "gather"])
def test_a_failed_sequence_of_a_batch_stops_the_others(runner: str) -> None:
    """One sequence of a non-streamed batch fails: the client gets the error, and the other
    sequences are cancelled (their node requests with them) — a plain gather left them
    running, holding node slots past a tenant's in-flight bound."""
    from pdcache.router.app import all_or_none

    async def scenario() -> bool:
        cancelled = asyncio.Event()

        async def fails() -> str:
            await asyncio.sleep(0.01)
            raise ApiError(400, "refused")

        async def slow() -> str:
            try:
                await asyncio.sleep(30)
            except asyncio.CancelledError:
                cancelled.set()
                raise
            return "late"

        work = (all_or_none([fails(), slow()]) if runner == "all_or_none"
                else asyncio.gather(fails(), slow()))
        with pytest.raises(ApiError):
            await work
        await asyncio.sleep(0.05)
        return cancelled.is_set()

    assert asyncio.run(asyncio.wait_for(scenario(), 10)) is (runner == "all_or_none")
