"""Running an app: binding its socket before anything slow, then uvicorn on it until
SIGINT/SIGTERM with a ready line scripts can wait for. Shared by every node
(`server.runtime.serve`) and the router (`pdcache router`); holds no state between calls.
"""

from __future__ import annotations

import socket
import sys
from collections.abc import Callable

import uvicorn
from fastapi import FastAPI


class _AnnouncingServer(uvicorn.Server):
    """Prints the runtime's lines and the URL once the listening socket is up, so scripts
    can wait for the ready line."""

    def __init__(self, config: uvicorn.Config, lines: Callable[[], list[str]],
                 ready: str) -> None:
        super().__init__(config)
        self._lines = lines
        self._ready = ready

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        await super().startup(sockets=sockets)
        if self.started:
            for line in self._lines():
                print(line, flush=True)
            print(self._ready, flush=True)


def listen(host: str, port: int, command: str) -> socket.socket | None:
    """Bind the HTTP socket first, so a busy port fails before the model loads.

    With TCP_NODELAY, which the accepted connections inherit: asyncio sets it only on
    sockets whose `proto` is IPPROTO_TCP, and `create_server`'s is 0. Without it a streamed
    answer on a kept-alive connection waited for the client's delayed ACK (Nagle): 44 ms
    to the first token instead of 1.5 (`tests/wire/test_serving.py`)."""
    try:
        sock = socket.create_server((host, port))
    except OSError as exc:
        print(f"pdcache {command}: cannot listen on {host}:{port}: {exc}", file=sys.stderr)
        return None
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return sock


# An idle kept-alive connection: the server closes it after KEEP_ALIVE_S; a pooling client
# must drop it well before (the router's node pool: POOL_IDLE_S). With both at the same
# value (uvicorn's and httpx's default, 5 s) a request sent as the server closes the
# connection fails as "disconnected without a response", which no retry may cover (the node
# could have received it): an agentic session thinking ~5 s between turns hit that race.
KEEP_ALIVE_S = 30
POOL_IDLE_S = 10.0


def server_config(app: FastAPI, log_level: str,
                  tls: tuple[str | None, str | None] | None = None,
                  drain_s: float = 30.0) -> uvicorn.Config:
    """The uvicorn settings every node and the router serve with (`serve_app`); `drain_s`:
    how long requests in flight may finish after SIGTERM (`ApiSettings.drain_s`)."""
    cert, key = tls if tls is not None else (None, None)
    return uvicorn.Config(app, log_level=log_level, timeout_graceful_shutdown=drain_s,
                          timeout_keep_alive=KEEP_ALIVE_S, ssl_certfile=cert, ssl_keyfile=key)


def serve_app(app: FastAPI, sock: socket.socket, host: str, log_level: str, command: str,
              lines: Callable[[], list[str]] = list,
              tls: tuple[str | None, str | None] | None = None,
              drain_s: float = 30.0) -> int:
    """Run `app` on the bound `sock` until SIGINT/SIGTERM; once it accepts requests, print
    `lines()` and the ready line `pdcache COMMAND: ready at http://HOST:PORT`. Shared by every
    node and the router; 0 when it served, 1 when it never started. `tls`: (certificate
    chain, private key) PEM files: HTTPS (uvicorn's TLS), and the ready line says https."""
    port = sock.getsockname()[1]
    shown = f"[{host}]" if ":" in host else host
    uv_config = server_config(app, log_level, tls, drain_s)
    scheme = "https" if uv_config.ssl_certfile else "http"
    server = _AnnouncingServer(uv_config, lines,
                               f"pdcache {command}: ready at {scheme}://{shown}:{port}")
    try:
        server.run(sockets=[sock])
    finally:
        sock.close()
    return 0 if server.started else 1
