"""Bearer credentials on HTTP: reading them, comparing them in constant time, the 401 answer.

The nodes check the cluster's node credential (`ServerConfig.auth_token`, derived from the
cluster secret); the router checks its tenants' API keys (`pdcache.router.tenants`). Both
answer a missing or wrong credential with the same OpenAI-shaped 401, which names neither
the expected credential nor any other principal. Pure functions; no state.
"""

from __future__ import annotations

import hmac

from fastapi import Request
from fastapi.responses import JSONResponse

from pdcache.wire.protocol import error_body

AUTHENTICATION_ERROR = "authentication_error"
NODE_OPEN_PATHS = ("/health",)  # probes: liveness says nothing a peer could abuse


def bearer_token(request: Request) -> str | None:
    """The token of `Authorization: Bearer TOKEN`, None when there is none."""
    scheme, _, token = request.headers.get("authorization", "").partition(" ")
    token = token.strip()
    return token if scheme.lower() == "bearer" and token else None


def token_matches(given: str | None, expected: str) -> bool:
    """Constant-time comparison (the time taken says nothing about how much matched)."""
    return given is not None and hmac.compare_digest(given.encode(), expected.encode())


def unauthorized(message: str, code: str = "invalid_api_key") -> JSONResponse:
    """401 in the OpenAI error shape, with the challenge header."""
    return JSONResponse(error_body(message, type=AUTHENTICATION_ERROR, code=code),
                        status_code=401, headers={"WWW-Authenticate": "Bearer"})


def node_request_allowed(request: Request, token: str | None, metrics_auth: bool) -> bool:
    """Whether a node may serve `request`: always without a credential configured; else
    /health (and /metrics unless `metrics_auth`) is open and the rest needs the token."""
    if token is None:
        return True
    path = request.url.path
    if path in NODE_OPEN_PATHS or (path == "/metrics" and not metrics_auth):
        return True
    return token_matches(bearer_token(request), token)
