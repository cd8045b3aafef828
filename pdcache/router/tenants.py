"""Tenants of the router: who a request is (its API key), what it may reach, how much it may use.

With tenants configured (`[[router.tenant]]`, `pdcache router --tenant NAME=KEY`, or the one
`api_key`, which is the tenant `default`), every request but `/health` and `/metrics` needs
`Authorization: Bearer KEY`; the key names the tenant, and the tenant — never the client —
decides:
- the page-key namespace: the `cache_salt` the nodes see is `tenant/NAME` plus, when the client
  gave one, `/` + its salt (`Tenant.cache_salt`), so a client salt only subdivides its own
  tenant's namespace and no request of B can hit (or time) a page of A;
- the session scope: sessions are keyed by (tenant, session_id) (`Tenant.session_key`);
- the in-flight limit: beyond `max_inflight` units in flight, 429 with `Retry-After`. A unit is
  one sequence (a `/generate` batch of B prompts with n samples each holds B x n, an OpenAI
  request its n choices: `hold_sequences`) or one call that goes out to every node
  (`/close_session`, `/server_info`); counting requests let one batch of 256 prompts in under
  `max_inflight = 1`.
Without tenants the router is open and `cache_salt` / `session_id` pass as the client sent them.

`TenantGate` is the ASGI middleware that authenticates, sets `request.state.tenant` and holds
the in-flight slot for the whole response (a stream too: the ASGI call returns only after its
last byte or the client's disconnect). Event loop only; nothing is locked.
"""

from __future__ import annotations

import hashlib
import hmac
import re
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from fastapi.responses import JSONResponse
from starlette.requests import Request
from starlette.types import ASGIApp, Receive, Scope, Send

from pdcache.config.schema import TenantLimits
from pdcache.offload_manager.storage.config import TENANT_PREFIX
from pdcache.wire.auth import bearer_token, unauthorized
from pdcache.wire.protocol import ApiError, error_body

DEFAULT_TENANT = "default"  # the tenant of the single `api_key`
# a tenant's name: no '/', so that no tenant's cache salt or session id (its name, '/', the
# client's salt or id) is another's (`config.validate` checks topology names the same way)
TENANT_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")
NAMESPACE_PREFIX = TENANT_PREFIX  # what the nodes' storage reads back (tenant_namespace)
OPEN_PATHS = ("/health", "/liveness", "/metrics")  # probes and scrapers: aggregate numbers, no tenant's data
GENERATION_PATHS = ("/generate", "/v1/chat/completions", "/v1/completions", "/health_generate")
# what the in-flight limit counts: generations, and the calls that go out to every node
LIMITED_PATHS = (*GENERATION_PATHS, "/close_session", "/server_info", "/get_server_info")
EXTRA_UNITS = "tenant_extra_units"  # request.state: units a handler took beyond the gate's one
RATE_LIMITED = "rate_limit_exceeded"


@dataclass(frozen=True)
class Tenant(TenantLimits):
    """One principal of the router. `api_key` is never printed (repr). Its limits
    (`max_inflight`: generations in flight at the router) are `[[router.tenant]]`'s
    `TenantLimits`, declared once."""

    name: str
    api_key: str = field(repr=False)

    def __post_init__(self) -> None:
        # every way to a tenant (topology, `--tenant`, the single api_key) comes through here
        if not TENANT_NAME.match(self.name):
            raise ValueError(f"tenant name {self.name!r}: expected letters, digits, '_', '-' "
                             "or '.' (a '/' would let it share another tenant's namespace)")

    @property
    def namespace(self) -> str:
        return NAMESPACE_PREFIX + self.name

    def cache_salt(self, client_salt: str | None) -> str:
        """The salt the nodes hash this tenant's pages with: its namespace, subdivided by the
        client's salt. Names hold no '/', so no other tenant can produce the same salt."""
        return self.namespace if client_salt is None else f"{self.namespace}/{client_salt}"


def scoped_salt(tenant: Tenant | None, client_salt: str | None) -> str | None:
    return client_salt if tenant is None else tenant.cache_salt(client_salt)


SessionKey = str | tuple[str, str]


def session_key(tenant: Tenant | None, session_id: str | None) -> SessionKey | None:
    """The router's key of a session: (tenant, id), so B's `s1` is not A's `s1`; the client's
    id itself on a router without tenants."""
    if session_id is None or tenant is None:
        return session_id
    return (tenant.name, session_id)


def node_session_id(key: SessionKey) -> str:
    """The session id the nodes' eviction policies see: the tenant's namespace before the
    client's id, so two tenants' `s1` are two sessions there too."""
    if isinstance(key, tuple):
        tenant, session_id = key
        return f"{NAMESPACE_PREFIX}{tenant}/{session_id}"
    return key


def parse_tenant_flag(text: str) -> tuple[str, str]:
    """`NAME=KEY` of `pdcache router --tenant`. ValueError when malformed."""
    name, sep, key = text.partition("=")
    if not sep or not name.strip() or not key.strip():
        raise ValueError(f"--tenant {text.split('=')[0]}=...: expected NAME=KEY")
    return name.strip(), key.strip()


class TenantDirectory:
    """The router's tenants, found by key in constant time per tenant."""

    def __init__(self, tenants: Iterable[Tenant]) -> None:
        self.tenants = tuple(tenants)
        self._digests = [(t, _digest(t.api_key)) for t in self.tenants]

    @property
    def enabled(self) -> bool:
        return bool(self.tenants)

    def authenticate(self, token: str | None) -> Tenant | None:
        """The tenant whose key is `token`. Fixed-size digests are compared (so not even a
        key's length shows), every one of them (no early exit) and each in constant time:
        timing tells nothing about which keys exist or how much of one matched."""
        if token is None:
            return None
        given = _digest(token)
        found = None
        for tenant, digest in self._digests:
            if hmac.compare_digest(given, digest):
                found = tenant
        return found


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode()).digest()


class TenantInflight:
    """Units (sequences, fan-out calls) in flight per tenant. Event loop only."""

    def __init__(self) -> None:
        self._inflight: dict[str, int] = {}

    def inflight(self, tenant: Tenant) -> int:
        return self._inflight.get(tenant.name, 0)

    def try_acquire(self, tenant: Tenant, units: int = 1) -> bool:
        count = self.inflight(tenant)
        if tenant.max_inflight > 0 and count + units > tenant.max_inflight:
            return False
        self._inflight[tenant.name] = count + units
        return True

    def release(self, tenant: Tenant, units: int = 1) -> None:
        self._inflight[tenant.name] = max(0, self.inflight(tenant) - units)


Observe = Callable[[str, int, float], None]


class TenantGate:
    """ASGI middleware: authentication and per-tenant in-flight limits (module docstring).

    `observe(path, status, seconds)` counts its refusals in the request metrics (only for
    `known_paths`, so unknown paths cannot grow the label set); `retry_after_s()` is the
    Retry-After of a 429."""

    def __init__(self, app: ASGIApp, directory: TenantDirectory, limits: TenantInflight, *,
                 known_paths: Iterable[str] = (), observe: Observe | None = None,
                 retry_after_s: Callable[[], int] = lambda: 1) -> None:
        self.app = app
        self.directory = directory
        self.limits = limits
        self.known_paths = frozenset(known_paths)
        self.observe = observe
        self.retry_after_s = retry_after_s

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        path = scope.get("path", "")
        if scope["type"] != "http" or not self.directory.enabled or path in OPEN_PATHS:
            await self.app(scope, receive, send)
            return
        start = time.monotonic()
        tenant = self.directory.authenticate(bearer_token(Request(scope)))
        if tenant is None:
            await self._refuse(unauthorized("invalid or missing API key (Authorization: "
                                            "Bearer KEY)"), scope, receive, send, start)
            return
        scope.setdefault("state", {})["tenant"] = tenant
        if path not in LIMITED_PATHS:
            await self.app(scope, receive, send)
            return
        if not self.limits.try_acquire(tenant):
            await self._refuse(self._too_many(tenant), scope, receive, send, start)
            return
        try:
            await self.app(scope, receive, send)
        finally:
            self.limits.release(tenant, 1 + scope["state"].get(EXTRA_UNITS, 0))


    def _too_many(self, tenant: Tenant) -> JSONResponse:
        body = error_body(f"too many requests in flight for this API key (limit "
                          f"{tenant.max_inflight})", type=RATE_LIMITED, code=RATE_LIMITED)
        return JSONResponse(body, status_code=429,
                            headers={"Retry-After": str(self.retry_after_s())})

    async def _refuse(self, response: JSONResponse, scope: Scope, receive: Receive, send: Send,
                      start: float) -> None:
        await response(scope, receive, send)
        path = scope.get("path", "")
        if self.observe is not None and path in self.known_paths:
            self.observe(path, response.status_code, time.monotonic() - start)


def tenant_of(request: Any) -> Tenant | None:
    """The tenant `TenantGate` authenticated for `request` (None: the router has none)."""
    return getattr(request.state, "tenant", None)


def hold_sequences(request: Request, limits: TenantInflight, sequences: int) -> None:
    """A handler's request runs `sequences` sequences: it holds one unit each (`TenantGate`
    took one); 429 (`ApiError`) when its tenant has not that many left. Released with the
    gate's when the response ends (`EXTRA_UNITS`)."""
    tenant = tenant_of(request)
    extra = sequences - 1
    if tenant is None or extra <= 0:
        return
    if not limits.try_acquire(tenant, extra):
        raise ApiError(429, f"{sequences} sequences is more than this API key may have in "
                            f"flight now (limit {tenant.max_inflight})",
                       type=RATE_LIMITED, code=RATE_LIMITED)
    setattr(request.state, EXTRA_UNITS, extra)
