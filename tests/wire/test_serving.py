"""`wire.serving.listen`: the HTTP socket every node and the router serve on."""

from __future__ import annotations

import socket

from pdcache.wire.serving import listen


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
