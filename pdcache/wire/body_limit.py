"""A bound on request bodies (`[router]` / `[[node]]` `max_request_bytes`): without one a
client could make the router or a node buffer any number of bytes (a multi-GB body is read
whole by `request.body()` before validation sees it), which takes the process's memory and
every other tenant's requests with it.

`BodyLimit` is the ASGI middleware both apps install (`wire.mount.mount`). It refuses lazily,
when the handler reads the body: a declared `Content-Length` over the limit fails the first
read, a chunked body the read that crosses it, both with a 413 `ApiError` the handler's guard
renders as every other error (authenticated first, counted in the request metrics). Bytes
past the limit are never buffered. Stateless; no thread.
"""

from __future__ import annotations

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from pdcache.wire.protocol import ApiError
from pdcache.wire.responses import error_response

REQUEST_TOO_LARGE = "request_too_large"


def too_large(max_bytes: int) -> ApiError:
    return ApiError(413, f"the request body is over this server's limit of {max_bytes} bytes "
                         "([router] / [[node]] max_request_bytes)", code=REQUEST_TOO_LARGE)


def declared_length(scope: Scope) -> int | None:
    """The request's Content-Length, None when absent or not a number."""
    for name, value in scope.get("headers", ()):
        if name == b"content-length":
            try:
                return int(value)
            except ValueError:
                return None
    return None


class BodyLimit:
    """ASGI middleware: a request body over `max_bytes` fails its read with a 413 (module
    docstring); an error escaping an unguarded handler before its response started is sent
    as that 413."""

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        if max_bytes < 1:
            raise ValueError(f"max_request_bytes must be positive, got {max_bytes}")
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = declared_length(scope)
        received = 0
        started = False

        async def limited_receive() -> Message:
            nonlocal received
            if declared is not None and declared > self.max_bytes:
                raise too_large(self.max_bytes)
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_bytes:
                    raise too_large(self.max_bytes)
            return message

        async def tracking_send(message: Message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, limited_receive, tracking_send)
        except ApiError as exc:
            if started or exc.status_code != 413:
                raise
            await error_response(exc)(scope, receive, send)
