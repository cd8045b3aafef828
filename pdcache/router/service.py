"""SGLang's service endpoints on the router (docs/design.md §4.1), over its routing core.

- `/server_info` (also `/get_server_info`): the router's own settings under SGLang's names
  (`model_path`, `page_size`, `context_length`, ...), plus every node's own `/server_info`:
  listed under `prefill` and `decode` in PD (what SGLang's router answers, and what
  `sglang.bench_serving` reads: `decode[0].internal_states`) or `workers` with the nodes'
  `internal_states` at the top (unified); a node that did not answer is in `node_errors`.
- `/get_model_info` (also `/model_info`): from the router's own model config.
- `/flush_cache`: sent to every node with the client's `timeout`; 200 when every node flushed,
  400 when a node was busy, 502 when a node could not be asked; the body reports each node.
  The cache-aware index forgets the nodes that flushed.
- `/health_generate`: one greedy 1-token request of `[0]` routed like any other (admission,
  retries, the P + D pair); 200 (empty) when it came back, 503 otherwise. Not counted in
  the token series, not part of any session.

Owns nothing; runs on the router's event loop (the core's state lives there).
"""

from __future__ import annotations

import asyncio
from typing import Any

import httpx
from fastapi import Request
from fastapi.responses import JSONResponse, Response

from pdcache import __version__
from pdcache.router.core import Prepared, Router
from pdcache.router.policy import NodeState
from pdcache.router.route import Deadline
from pdcache.router.tenants import node_session_id, scoped_salt, session_key, tenant_of
from pdcache.wire.protocol import SERVER_ERROR, ApiError
from pdcache.wire.service import TIER_IO_GRACE_S, close_session_body, model_info_body, timeout_param

HEALTH_CHECK_TIMEOUT_S = 20.0  # SGLang's default SGLANG_HEALTH_CHECK_TIMEOUT


class RouterService:
    """The router's `/server_info`, `/get_model_info`, `/flush_cache`, `/close_session`,
    `/health_generate`."""

    def __init__(self, router: Router) -> None:
        self.router = router

    @property
    def mode(self) -> str:
        """SGLang's `disaggregation_mode` of a unified deployment ("null"); "pd" otherwise."""
        return "pd" if self.router.registry.is_pd else "null"

    # ---- /server_info, /get_model_info

    def own_info(self) -> dict[str, Any]:
        router, config = self.router, self.router.config
        return {"model_path": config.model, "tokenizer_path": config.model,
                "served_model_name": router.model_name,
                "context_length": router.limits.context_len, "page_size": config.page_size,
                "disaggregation_mode": self.mode, "version": __version__,
                "frontend": "pdcache-router", "name": config.name,
                "prefill_policy": config.prefill_policy, "decode_policy": config.decode_policy,
                "max_inflight_per_node": config.max_inflight_per_node,
                "max_queue": config.max_queue, "max_attempts": config.max_attempts,
                "request_timeout_s": config.request_timeout_s}

    async def server_info(self, request: Request) -> Response:
        nodes = self.router.registry.nodes
        answers = await asyncio.gather(*(self._node_info(n) for n in nodes))
        body = self.own_info()
        errors = {n.name: a for n, a in zip(nodes, answers, strict=True) if isinstance(a, str)}
        infos = [(n, a) for n, a in zip(nodes, answers, strict=True) if isinstance(a, dict)]
        if self.router.registry.is_pd:
            for role in ("prefill", "decode"):
                body[role] = [info for node, info in infos if node.role == role]
        else:
            body["workers"] = [info for _, info in infos]
            body["internal_states"] = [s for _, info in infos
                                       for s in info.get("internal_states") or []]
        body["node_errors"] = errors
        return JSONResponse(body)

    async def _node_info(self, node: NodeState) -> dict[str, Any] | str:
        """The node's /server_info, or why it could not be had."""
        try:
            resp = await self.router.client.get(f"{node.url}/server_info",
                                                timeout=self.router.config.health_timeout_s)
            if resp.status_code != 200:
                return f"GET /server_info answered {resp.status_code}"
            info = resp.json()
        except (httpx.HTTPError, ValueError) as exc:
            return f"GET /server_info failed: {type(exc).__name__}: {exc}"
        return info if isinstance(info, dict) else "GET /server_info answered a non-object"

    async def model_info(self, request: Request) -> Response:
        router = self.router
        return JSONResponse(model_info_body(router.model_config, router.config.model,
                                            router.model_name, self.mode,
                                            router.config.tool_call_parser,
                                            router.config.reasoning_parser))

    # ---- /flush_cache

    async def flush_cache(self, request: Request) -> Response:
        timeout = timeout_param(request)
        nodes = self.router.registry.nodes
        reports = await asyncio.gather(*(self._flush(n, timeout) for n in nodes))
        statuses = {r["status"] for r in reports}
        status = 200 if statuses == {200} else 400 if statuses <= {200, 400} else 502
        for node, report in zip(nodes, reports, strict=True):
            if report["status"] == 200:
                self.router.selector.index.forget(node.name)
        return JSONResponse({"success": status == 200, "nodes": reports}, status_code=status)

    async def _flush(self, node: NodeState, timeout: float) -> dict[str, Any]:
        report: dict[str, Any] = {"name": node.name, "role": node.role}
        wait_s = max(timeout, TIER_IO_GRACE_S) + self.router.config.connect_timeout_s + 5.0
        try:
            resp = await self.router.client.post(f"{node.url}/flush_cache",
                                                 params={"timeout": timeout}, timeout=wait_s)
        except httpx.HTTPError as exc:
            return {**report, "status": 502,
                    "message": f"POST /flush_cache failed: {type(exc).__name__}: {exc}"}
        return {**report, "status": resp.status_code, "message": resp.text.strip()}

    # ---- /close_session

    async def close_session(self, request: Request) -> Response:
        """`{"session_id": SID, "cache_salt": SALT?}`: every node closes the storage session
        its writes for this conversation used, with the ids the router gave them (the
        tenant's namespace: `node_session_id`, `scoped_salt`), so a tenant closes only its
        own sessions. 200 when every node answered 200, 502 otherwise; per-node reports."""
        session_id, client_salt = await close_session_body(request)
        tenant = tenant_of(request)
        key = session_key(tenant, session_id)
        assert key is not None
        forgot = self.router.sessions.close(key)  # its history: the next turn starts anew
        body: dict[str, Any] = {"session_id": node_session_id(key)}
        salt = scoped_salt(tenant, client_salt or None)
        if salt:
            body["cache_salt"] = salt
        nodes = self.router.registry.nodes
        reports = await asyncio.gather(*(self._close(n, body) for n in nodes))
        ok = all(r["status"] == 200 for r in reports)
        return JSONResponse({"success": ok, "router_history_dropped": forgot, "nodes": reports},
                            status_code=200 if ok else 502)

    async def _close(self, node: NodeState, body: dict[str, Any]) -> dict[str, Any]:
        report: dict[str, Any] = {"name": node.name, "role": node.role}
        try:
            resp = await self.router.client.post(f"{node.url}/close_session", json=body,
                                                 timeout=self.router.config.health_timeout_s)
            answer = resp.json() if resp.status_code == 200 else {}
        except (httpx.HTTPError, ValueError) as exc:
            return {**report, "status": 502,
                    "message": f"POST /close_session failed: {type(exc).__name__}: {exc}"}
        closed = bool(answer.get("closed")) if isinstance(answer, dict) else False
        return {**report, "status": resp.status_code, "closed": closed}

    # ---- /health_generate

    async def health_generate(self, request: Request) -> Response:
        prep = Prepared([0], {"max_new_tokens": 1, "temperature": 0.0}, None, None)
        deadline = Deadline(min(HEALTH_CHECK_TIMEOUT_S, self.router.config.request_timeout_s))
        try:
            await self.router.send_json(prep, deadline)
        except ApiError as exc:
            raise ApiError(503, f"routed health request failed ({exc.status_code}): "
                           f"{exc.message}", type=SERVER_ERROR, code="unhealthy") from None
        return Response(status_code=200)
