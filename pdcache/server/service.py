"""SGLang's service endpoints on one server around an engine (docs/design.md §4.1).

`/server_info` (also `/get_server_info`), `/get_model_info` (also `/model_info`),
`/health_generate` and `/flush_cache` answer with the field names and status codes of SGLang
0.5.23's `http_server.py`, and with the fields its own clients read (`page_size`,
`tokenizer_path`, `internal_states[i].memory_usage.token_capacity`,
`effective_max_running_requests_per_dp`). The unified server and both node roles mount them
through `routes.build_app`; a node adds its own fields with `info_extra` (a prefill node's
`disaggregation_bootstrap_port`).

Owns nothing: `ServiceRoutes` reads the engine's frozen config and calls `Engine.submit`
(health) and `Engine.drop_cache` (flush). Handlers run on the event loop; the flush polls the
engine from the thread pool (each `drop_cache` runs on the engine thread); the health
request's `on_output` runs on the engine thread and only resolves a future on the loop.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import time
import uuid
from collections.abc import Callable
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from starlette.concurrency import run_in_threadpool

from pdcache import __version__
from pdcache.engine.api import CacheFlush, GenerateRequest, RequestOutput, SamplingParams
from pdcache.engine.engine import Engine, EngineNotRunningError, EngineOverloadedError
from pdcache.offload_manager.hicache_tiers import HiCacheTiers
from pdcache.server.bridge import EngineBridge, resolve_on_loop
from pdcache.wire.protocol import SERVER_ERROR, ApiError
from pdcache.wire.service import (
    TIER_IO_GRACE_S,
    close_session_body,
    model_info_body,
    timeout_param,
)

InfoExtra = Callable[[], dict[str, Any]]

# what SGLang's `--disaggregation-mode` says for each of our roles
DISAGGREGATION_MODES = {"unified": "null", "prefill": "prefill", "decode": "decode"}
HEALTH_CHECK_RID_PREFIX = "HEALTH_CHECK"  # SGLang's prefix for its health requests
FLUSHED_TEXT = ("Cache flushed.\nPlease check backend logs for more details. (When there are "
                "running or waiting requests, the operation will not be performed.)\n")
FLUSH_POLL_S = 0.02


def disaggregation_mode(role: str) -> str:
    return DISAGGREGATION_MODES.get(role, "null")


class ServiceRoutes:
    """`/server_info`, `/get_model_info`, `/health_generate`, `/flush_cache` of one server."""

    def __init__(self, bridge: EngineBridge, served_name: str,
                 info_extra: InfoExtra | None = None) -> None:
        self.bridge = bridge
        self.engine: Engine = bridge.engine
        self.config = bridge.config
        self.served_name = served_name
        self.model_path = self.config.model_path or self.engine.config.model.name
        self.mode = disaggregation_mode(self.config.role)
        self.info_extra = info_extra

    # ---- /server_info, /get_model_info

    def server_info_body(self) -> dict[str, Any]:
        """SGLang's server-args names for what this server runs with, plus `internal_states`
        (one scheduler) and pdcache's `version`; a node's `info_extra()` is merged last."""
        cfg = self.engine.config
        cache, sched, model = cfg.cache, cfg.scheduler, cfg.model
        tokens = cache.num_device_pages * cache.page_size
        body: dict[str, Any] = {
            "model_path": self.model_path, "tokenizer_path": self.model_path,
            "served_model_name": self.served_name,
            "context_length": model.max_position_embeddings, "page_size": cache.page_size,
            "dtype": model.dtype, "kv_cache_dtype": model.dtype, "device": cfg.device,
            "random_seed": cfg.seed, "max_running_requests": sched.max_running_requests,
            "max_queued_requests": sched.max_queued_requests,
            "chunked_prefill_size": sched.chunked_prefill_tokens,
            "max_total_num_tokens": tokens, "disable_radix_cache": not cache.enable_prefix_cache,
            "disaggregation_mode": self.mode, "tp_size": 1, "dp_size": 1,
            "skip_tokenizer_init": False, "is_embedding": False,
            "internal_states": [{"effective_max_running_requests_per_dp":
                                 sched.max_running_requests,
                                 "memory_usage": {"token_capacity": tokens},
                                 "dp_size": 1, "attn_dp_size": 1}],
            "version": __version__, "frontend": "pdcache", "name": self.config.name,
            "role": self.config.role,
        }
        body.update(self._hicache_fields())
        if self.info_extra is not None:
            body.update(self.info_extra())
        return body

    def _hicache_fields(self) -> dict[str, Any]:
        tiers = self.engine.scheduler.tiers
        if not isinstance(tiers, HiCacheTiers):
            return {"enable_hierarchical_cache": False}
        hicache = tiers.hicache
        return {"enable_hierarchical_cache": True,
                "hicache_write_policy": hicache.config.write_policy,
                "hicache_storage_prefetch_policy": hicache.config.prefetch_policy,
                "hicache_host_pages": hicache.host_pool.capacity,
                "hicache_storage_backend": None if hicache.storage is None
                else type(hicache.storage).__name__}

    async def server_info(self, request: Request) -> Response:
        return JSONResponse(self.server_info_body())

    async def model_info(self, request: Request) -> Response:
        return JSONResponse(model_info_body(self.engine.config.model, self.model_path,
                                            self.served_name, self.mode,
                                            self.config.tool_call_parser,
                                            self.config.reasoning_parser))

    # ---- /health_generate

    async def health_generate(self, request: Request) -> Response:
        """One greedy 1-token generation of `[0]` straight through the engine (not counted in
        the request metrics, as SGLang's `log_metrics=False`): 200 (empty) once it finished,
        503 when it could not be queued, failed, or missed `health_check_timeout_s`."""
        loop = asyncio.get_running_loop()
        done: asyncio.Future[RequestOutput] = loop.create_future()
        notify = resolve_on_loop(loop, done)
        rid = f"{HEALTH_CHECK_RID_PREFIX}_{uuid.uuid4().hex}"
        req = GenerateRequest(rid=rid, input_ids=[0],
                              sampling=SamplingParams(max_new_tokens=1, temperature=0.0))
        try:
            self.engine.submit(req, lambda out: notify(out) if out.finished else None)
        except (EngineNotRunningError, EngineOverloadedError) as exc:
            raise _unhealthy(f"engine cannot take the health request: {exc}") from None
        try:
            out = await asyncio.wait_for(done, self.config.health_check_timeout_s)
        except asyncio.TimeoutError:
            self.engine.abort(rid)
            raise _unhealthy("the health request did not finish within "
                             f"{self.config.health_check_timeout_s:g} s") from None
        if out.finish_reason == "abort":
            raise _unhealthy(f"the health request failed: {out.error or 'aborted'}")
        return Response(status_code=200)

    # ---- /close_session

    async def close_session(self, request: Request) -> Response:
        """SGLang's `/close_session` for our request-field sessions: `{"session_id": SID,
        "cache_salt": SALT?}` closes the storage session this node's writes for them used
        (`Engine.end_session`: its stored pages are evicted first). 200 `{"closed": bool}`
        (false: no storage tier here), 400 on a bad body, 503 when storage refused."""
        session_id, cache_salt = await close_session_body(request)
        try:
            closed = await run_in_threadpool(self.engine.end_session, session_id, cache_salt)
        except Exception as exc:  # noqa: BLE001 - the backend's error, reported to the caller
            raise _unhealthy(f"storage could not close the session: {exc}") from None
        return JSONResponse({"closed": closed})

    # ---- /flush_cache

    async def flush_cache(self, request: Request) -> Response:
        """Drop the device and host tiers once the engine is idle (storage untouched). As
        SGLang: `?timeout=S` (default 0) waits up to S seconds for running and queued requests
        to end; 200 "Cache flushed." or 400 when still busy. Tier I/O in flight (storage
        writes of an idle engine) is waited for up to max(S, 5 s)."""
        # bounded by the server's request deadline: the wait holds a thread-pool worker
        timeout = min(timeout_param(request), self.bridge.config.request_timeout_s)
        try:
            result = await run_in_threadpool(flush_when_idle, self.engine, timeout)
        except EngineNotRunningError as exc:
            raise _unhealthy(f"engine is not running: {exc}") from None
        except concurrent.futures.TimeoutError:
            raise _unhealthy("the engine did not answer the flush in time") from None
        if not result.flushed:
            waited = f" after waiting {timeout:g} s" if timeout > 0 else ""
            return PlainTextResponse(f"Flush cache failed: {result.reason}{waited}.\n",
                                     status_code=400)
        return PlainTextResponse(
            f"{FLUSHED_TEXT}Dropped {result.device_pages} device pages and {result.host_pages} "
            "host pages; storage untouched.\n")


def flush_when_idle(engine: Engine, timeout_s: float) -> CacheFlush:
    """`engine.drop_cache()` until it flushed: busy requests are waited for up to `timeout_s`,
    tier I/O of an idle engine up to max(`timeout_s`, TIER_IO_GRACE_S). Blocking: call it off
    the event loop (each try runs on the engine thread)."""
    start = time.monotonic()
    while True:
        result = engine.drop_cache()
        limit = timeout_s if result.busy_requests else max(timeout_s, TIER_IO_GRACE_S)
        if result.flushed or time.monotonic() - start >= limit:
            return result
        time.sleep(FLUSH_POLL_S)


def _unhealthy(message: str) -> ApiError:
    return ApiError(503, message, type=SERVER_ERROR, code="unhealthy")
