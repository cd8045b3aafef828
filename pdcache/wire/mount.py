"""How an app mounts its handlers: each behind one guard (authentication, metrics), and
Starlette's own errors (404, 405) as JSON error bodies. The servers (`server.routes.build_app`)
and the router (`router.app.create_app`) mount their tables with it. Pure; no state.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence

from fastapi import FastAPI, Request
from fastapi.responses import Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from pdcache.wire.body_limit import BodyLimit
from pdcache.wire.responses import Handler, http_error

Guard = Callable[[str, Handler, Request], Awaitable[Response]]


def mount(app: FastAPI, handlers: Sequence[tuple[str, str, Handler]], guard: Guard,
          max_request_bytes: int) -> None:
    """Add each (method, path, handler) behind `guard`, JSON bodies for Starlette's own
    errors (404, 405), and the bound on request bodies (`BodyLimit`). Shared by the servers
    and the router."""
    for method, path, handler in handlers:
        app.add_api_route(path, _guarded(guard, path, handler), methods=[method],
                          include_in_schema=False)
    app.add_exception_handler(StarletteHTTPException, http_error)
    app.add_middleware(BodyLimit, max_bytes=max_request_bytes)


def _guarded(guard: Guard, path: str, handler: Handler) -> Handler:
    async def endpoint(request: Request) -> Response:
        return await guard(path, handler, request)

    return endpoint
