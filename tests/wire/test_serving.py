"""`wire.serving.listen`: the HTTP socket every node and the router serve on."""

from __future__ import annotations

import contextlib
import socket
from collections.abc import AsyncIterator

import pytest

from pdcache.wire.serving import listen
from tests.polling import wait_until


def test_accepted_connections_send_at_once() -> None:
    """TCP_NODELAY on the listening socket, inherited by each accepted connection (asyncio
    sets it only where `proto` is IPPROTO_TCP, which `create_server`'s is not): without it a
    streamed answer on a kept-alive connection waits for the client's delayed ACK."""
    server = listen("127.0.0.1", 0, "test")
    assert server is not None
    with server, socket.create_connection(server.getsockname()[:2], timeout=5) as client:
        accepted, _ = server.accept()
        with accepted:
            assert server.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY)
            assert accepted.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY)
            assert client.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY) == 0  # ours only
    plain = socket.create_server(("127.0.0.1", 0))  # what listen() did before: no option
    with plain:
        assert plain.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY) == 0
    taken = listen("127.0.0.1", 0, "test")
    assert taken is not None
    with taken:
        assert listen("127.0.0.1", taken.getsockname()[1], "test") is None  # a busy port


def _get(conn: socket.socket) -> bytes:
    """One keep-alive GET on `conn`: the response's bytes (b"" when the server closed)."""
    conn.sendall(b"GET /ping HTTP/1.1\r\nHost: test\r\n\r\n")
    return conn.recv(4096)


def test_an_idle_connection_outlives_a_pooling_client_s_idle_time() -> None:
    """A connection idle longer than a pooling client keeps it (httpx's default 5 s, the
    router's POOL_IDLE_S) is still served: with the server closing at the same time
    (uvicorn's default, 5 s) a request sent at that moment found the connection closing
    and failed without a response. With the old keep-alive it fails here (b"")."""
    import threading

    import uvicorn
    from fastapi import FastAPI

    from pdcache.wire.serving import KEEP_ALIVE_S, POOL_IDLE_S, server_config

    app = FastAPI()
    app.get("/ping")(lambda: {"ok": True})
    idle_s = 5.5  # past the old keep-alive, the clients' default expiry
    assert POOL_IDLE_S < KEEP_ALIVE_S and idle_s < KEEP_ALIVE_S
    sock = listen("127.0.0.1", 0, "test")
    assert sock is not None
    server = uvicorn.Server(server_config(app, "warning"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    try:
        with socket.create_connection(sock.getsockname()[:2], timeout=30) as conn:
            first = _get(conn)
            assert first.startswith(b"HTTP/1.1 200"), first
            threading.Event().wait(idle_s)  # the idle period itself is what is tested
            again = _get(conn)
            assert again.startswith(b"HTTP/1.1 200"), again
    finally:
        server.should_exit = True
        thread.join(10)
        sock.close()


def test_a_client_that_stops_reading_a_stream_is_left() -> None:
    """A streaming client that keeps its connection open but reads nothing (a suspended
    agent, a partition) held its request for good: the writes to it waited forever and no
    deadline covered them, so the event generator never ended and its cleanup never ran.
    Now a write that waits past the stall bound ends the stream as a client gone would."""
    import threading

    from fastapi import FastAPI
    from starlette.background import BackgroundTask

    from pdcache.wire.responses import event_stream
    from tests.polling import scaled_limit
    from tests.router_support import ThreadedServer

    generator_closed, cleaned_up = threading.Event(), threading.Event()
    app = FastAPI()

    @app.get("/stream")
    async def stream():  # type: ignore[no-untyped-def]
        async def events():  # endless 64 KiB events: the socket buffers fill at once
            try:
                while True:
                    yield b"data: " + b"x" * 65536 + b"\n\n"
            finally:
                generator_closed.set()

        return event_stream(events(), BackgroundTask(cleaned_up.set), stall_timeout_s=0.5)

    server = ThreadedServer(app)
    try:
        with socket.socket() as client:
            client.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
            client.connect(("127.0.0.1", server.port))
            client.sendall(b"GET /stream HTTP/1.1\r\nHost: test\r\n\r\n")  # never read
            assert generator_closed.wait(scaled_limit(20.0))
            assert cleaned_up.wait(scaled_limit(10.0))
    finally:
        server.stop()


@pytest.mark.parametrize("drain_s", [10.0, 0.2], ids=["drained", "protection-off"])
def test_a_stream_in_flight_at_shutdown_finishes_within_the_drain(drain_s: float) -> None:
    """SIGTERM (uvicorn's `should_exit`) stops the server accepting and lets a request in
    flight finish for `drain_s` (`ApiSettings.drain_s`): a 1.2 s stream ends whole under a
    10 s drain; under 0.2 s (uvicorn's hard-coded 5 s was the same for a longer stream:
    every rollout cut answers mid-way) it is cut."""
    import asyncio
    import threading

    import httpx
    import uvicorn
    from fastapi import FastAPI
    from fastapi.responses import StreamingResponse

    from pdcache.wire.serving import server_config

    chunks = 12

    async def ticks() -> AsyncIterator[bytes]:
        for i in range(chunks):
            yield f"{i}\n".encode()
            await asyncio.sleep(0.1)

    app = FastAPI()
    app.get("/stream")(lambda: StreamingResponse(ticks(), media_type="text/plain"))
    sock = listen("127.0.0.1", 0, "test")
    assert sock is not None
    server = uvicorn.Server(server_config(app, "warning", drain_s=drain_s))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    host, port = sock.getsockname()[:2]
    got: list[str] = []
    try:
        with httpx.Client(timeout=30, trust_env=False) as http:
            wait_until(lambda: server.started, what="the server up")
            with http.stream("GET", f"http://{host}:{port}/stream") as r:
                lines = r.iter_lines()
                got.append(next(lines))
                server.should_exit = True  # what uvicorn's SIGTERM handler sets
                with contextlib.suppress(httpx.HTTPError):
                    got.extend(lines)
        thread.join(timeout=30)
        assert not thread.is_alive()
    finally:
        server.should_exit = True
        sock.close()
    if drain_s > 1:
        assert got == [str(i) for i in range(chunks)]
    else:
        assert len(got) < chunks, got
