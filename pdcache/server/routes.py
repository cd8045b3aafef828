"""The HTTP routes of a server around one engine (docs/design.md §4.1), and the app that mounts them.

`ServerRoutes` answers `/generate`, the OpenAI endpoints, `/health`, `/v1/models` and
`/metrics` for the unified server and for the P/D nodes alike; a node composes it with its own
handler for the `/generate` bodies that carry `pd` (`build_app(pd_generate=...)`) and its own
`/health` and `/server_info` fields (`health_extra`, `info_extra`). `build_app` also mounts
SGLang's service endpoints (`pdcache.server.service`). Nothing subclasses a handler.

Threads: every handler runs on the event loop; `/metrics` renders in the thread pool (tier
stats may ask a remote metadata service, a bounded wait).
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from contextlib import aclosing, asynccontextmanager
from typing import Any, Protocol

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException as StarletteHTTPException

from pdcache.server.auth import node_request_allowed, unauthorized
from pdcache.server.bridge import EngineBridge, EngineRequest, Generation
from pdcache.server.protocol import (
    SERVER_ERROR,
    ApiError,
    ChatCompletionRequest,
    CompletionRequest,
    GenerateRequestBody,
    GenerateResponse,
    ModelLimits,
    OpenAIRequestBase,
    TextAssembler,
    bad_request,
    check_prompt,
    check_token_ids,
    default_max_tokens,
    encode_prompt,
    parse_body,
)
from pdcache.server.responses import (
    Handler,
    ResponseHead,
    StreamEnd,
    chat_choice,
    chat_events,
    completion_events,
    http_error,
    model_list,
    now_s,
    run_guarded,
    sse,
    text_choice,
)
from pdcache.server.service import ServiceRoutes

PDHandler = Callable[[Request, GenerateRequestBody], Awaitable[Response]]


class ServerRoutes:
    """Request handling of one server around `bridge.engine`; owns no thread or engine."""

    def __init__(self, bridge: EngineBridge) -> None:
        self.bridge = bridge
        self.engine = bridge.engine
        self.tokenizer = bridge.engine.tokenizer
        model = bridge.engine.config.model
        self.model_name = model.name
        self.limits = ModelLimits(model.vocab_size, model.max_position_embeddings)
        self.created = now_s()

    # ---- /generate

    async def generate(self, request: Request, body: GenerateRequestBody) -> Response:
        gen = Generation(arrival=time.monotonic())
        input_ids = self.checked_prompt(body)
        sampling = body.sampling_params
        handle = self.bridge.submit(gen, input_ids, sampling.to_engine(), body.cache_salt,
                                    body.rid)
        return await self.respond(request, handle, gen, body.stream)

    def checked_prompt(self, body: GenerateRequestBody) -> list[int]:
        """The request's prompt ids (encoding `text`), after every input check of §4.1."""
        body.check_one_prompt()
        param = body.prompt_param()
        input_ids = body.input_ids if body.input_ids is not None else self.encode(body.text, param)
        sampling = body.sampling_params
        check_prompt(input_ids, sampling.max_new_tokens, self.limits, param)
        check_token_ids(sampling.stop_token_ids, self.limits.vocab_size,
                        "sampling_params.stop_token_ids")
        return input_ids

    async def respond(self, request: Request, handle: EngineRequest, gen: Generation,
                      stream: bool) -> Response:
        """A submitted /generate request's answer: SSE events, or one JSON body at the end."""
        text = TextAssembler(self.decode, [])
        if stream:
            return self.bridge.streaming(self._generate_events(handle, gen, text), handle, gen)
        await self.bridge.collect(request, handle, gen, text)
        meta = self.bridge.meta(gen)
        response = GenerateResponse(output_ids=gen.output_ids, text=text.text, meta=meta)
        return JSONResponse(response.model_dump())

    async def _generate_events(self, handle: EngineRequest, gen: Generation,
                               text: TextAssembler) -> AsyncIterator[bytes]:
        async with aclosing(self.bridge.outputs(handle, gen, text)) as stream:
            async for new_ids, delta in stream:
                meta = self.bridge.meta(gen).model_dump()
                yield sse({"output_ids": new_ids, "text": delta, "meta": meta})

    # ---- OpenAI endpoints

    async def chat_completions(self, request: Request) -> Response:
        body = parse_body(ChatCompletionRequest, await request.body())
        body.check_supported()
        input_ids = self.apply_chat_template(body.template_messages())
        kind = "chat.completion.chunk" if body.stream else "chat.completion"
        head = ResponseHead.new("chatcmpl", kind, self.model_name)
        return await self._openai(request, body, input_ids, body.requested_max_tokens(),
                                  "messages", head, chat=True)

    async def completions(self, request: Request) -> Response:
        body = parse_body(CompletionRequest, await request.body())
        body.check_supported()
        prompt = body.single_prompt()
        input_ids = self.encode(prompt, "prompt") if isinstance(prompt, str) else prompt
        head = ResponseHead.new("cmpl", "text_completion", self.model_name)
        return await self._openai(request, body, input_ids, body.max_tokens, "prompt", head,
                                  chat=False)

    async def _openai(self, request: Request, body: OpenAIRequestBase, input_ids: list[int],
                      max_tokens: int | None, param: str, head: ResponseHead, chat: bool
                      ) -> Response:
        gen = Generation(arrival=time.monotonic())
        if max_tokens is None:
            max_tokens = default_max_tokens(len(input_ids), self.limits, param)
        check_prompt(input_ids, max_tokens, self.limits, param)
        check_token_ids(body.stop_token_ids, self.limits.vocab_size, "stop_token_ids")
        handle = self.bridge.submit(gen, input_ids, body.to_engine(max_tokens), body.cache_salt)
        text = TextAssembler(self.decode, body.stop_strings())
        if body.stream:
            end = StreamEnd(lambda: gen.finish_reason, lambda: self.bridge.usage(gen),
                            body.include_usage())
            deltas = self.bridge.text_deltas(handle, gen, text)
            events = (chat_events if chat else completion_events)(head, deltas, end)
            return self.bridge.streaming(events, handle, gen)
        await self.bridge.collect(request, handle, gen, text)
        choice = (chat_choice if chat else text_choice)(text.text, gen.finish_reason)
        return JSONResponse(head.body([choice], usage=self.bridge.usage(gen)))

    # ---- informational endpoints

    def health_body(self) -> dict[str, Any]:
        """/health's fields; 503 (ApiError) when the engine is not serving."""
        try:
            stats = self.engine.stats()
        except Exception as exc:
            raise ApiError(503, f"engine unhealthy: {exc}", type=SERVER_ERROR) from None
        if not self.engine.is_running:
            raise ApiError(503, "engine thread is not running", type=SERVER_ERROR)
        return {"status": "ok", "name": self.bridge.config.name, "model": self.model_name,
                "engine": _json_safe(stats)}

    async def models(self, request: Request) -> Response:
        return JSONResponse(model_list(self.model_name, self.created, self.limits.context_len))

    async def metrics_endpoint(self, request: Request) -> Response:
        # off the event loop: the tier stats may ask a remote metadata service (bounded wait)
        body = await run_in_threadpool(self.bridge.metrics.render)
        return Response(body, media_type=CONTENT_TYPE_LATEST)

    # ---- tokenizer access

    def encode(self, text: str | None, param: str) -> list[int]:
        return encode_prompt(self.tokenizer, text, param)

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids)

    def apply_chat_template(self, messages: list[dict[str, str]]) -> list[int]:
        return list(self.tokenizer.apply_chat_template(messages, add_generation_prompt=True))


def _json_safe(stats: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in stats.items() if isinstance(v, int | float | str | bool | None)}


# --------------------------------------------------------------------------- the app


def build_app(routes: ServerRoutes, *, pd_generate: PDHandler | None = None,
              health_extra: Callable[[], dict[str, Any]] | None = None,
              info_extra: Callable[[], dict[str, Any]] | None = None,
              on_startup: Callable[[], None] | None = None,
              on_shutdown: Callable[[], None] | None = None, title: str = "pdcache") -> FastAPI:
    """The FastAPI app of one server. `/generate` bodies with `pd` go to `pd_generate` (400
    without one); `health_extra()` adds a node's fields to /health and `info_extra()` to
    /server_info (SGLang's service endpoints: `pdcache.server.service`); `on_startup` and
    `on_shutdown` run in the app's lifespan (the runtime's start and close)."""

    async def generate(request: Request) -> Response:
        body = parse_body(GenerateRequestBody, await request.body())
        if body.pd is None:
            return await routes.generate(request, body)
        if pd_generate is None:
            raise bad_request("'pd' is set by the router on P/D nodes only", param="pd",
                              code="unknown_field")
        return await pd_generate(request, body)

    async def health(request: Request) -> Response:
        body = routes.health_body()
        if health_extra is not None:
            body.update(health_extra())
        return JSONResponse(body)

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        if on_startup is not None:
            on_startup()
        try:
            yield
        finally:
            if on_shutdown is not None:
                on_shutdown()

    app = FastAPI(title=title, lifespan=lifespan, docs_url=None, redoc_url=None)
    app.state.routes = routes
    metrics = routes.bridge.metrics
    config = routes.bridge.config

    async def guard(endpoint: str, handler: Handler, request: Request) -> Response:
        if not node_request_allowed(request, config.auth_token, config.metrics_auth):
            response: Response = unauthorized(
                "this node needs the cluster's node credential (Authorization: Bearer ..., "
                "derived from [security] secret_file)", code="invalid_node_credential")
        else:
            response = await run_guarded(endpoint, handler, request)
        metrics.observe_request(endpoint, response.status_code)
        return response

    service = ServiceRoutes(routes.bridge, routes.model_name, info_extra)
    mount(app, [("POST", "/generate", generate),
                ("POST", "/v1/chat/completions", routes.chat_completions),
                ("POST", "/v1/completions", routes.completions),
                ("GET", "/health", health),
                ("GET", "/v1/models", routes.models),
                ("GET", "/metrics", routes.metrics_endpoint),
                *service_handlers(service)], guard)
    return app


class ServiceEndpoints(Protocol):
    """SGLang's service endpoints, as a node (`ServiceRoutes`) or the router answers them."""

    async def server_info(self, request: Request) -> Response: ...
    async def model_info(self, request: Request) -> Response: ...
    async def health_generate(self, request: Request) -> Response: ...
    async def flush_cache(self, request: Request) -> Response: ...


def service_handlers(service: ServiceEndpoints) -> list[tuple[str, str, Handler]]:
    """SGLang's service endpoints, with the methods SGLang accepts (and POST for health);
    the servers and the router mount the same table."""
    return [("GET", "/server_info", service.server_info),
            ("GET", "/get_server_info", service.server_info),
            ("GET", "/model_info", service.model_info),
            ("GET", "/get_model_info", service.model_info),
            ("GET", "/health_generate", service.health_generate),
            ("POST", "/health_generate", service.health_generate),
            ("GET", "/flush_cache", service.flush_cache),
            ("POST", "/flush_cache", service.flush_cache)]


Guard = Callable[[str, Handler, Request], Awaitable[Response]]


def mount(app: FastAPI, handlers: Sequence[tuple[str, str, Handler]], guard: Guard) -> None:
    """Add each (method, path, handler) behind `guard`, and JSON bodies for Starlette's own
    errors (404, 405). Shared by the servers and the router."""
    for method, path, handler in handlers:
        app.add_api_route(path, _guarded(guard, path, handler), methods=[method],
                          include_in_schema=False)
    app.add_exception_handler(StarletteHTTPException, http_error)


def _guarded(guard: Guard, path: str, handler: Handler) -> Handler:
    async def endpoint(request: Request) -> Response:
        return await guard(path, handler, request)

    return endpoint
