"""FastAPI app of the router: the OpenAI-compatible front door of a deployment (docs/design.md §4.1).

The router tokenizes (chat template included), validates with the same models as the unified
server (`pdcache.server.protocol`), picks a node (unified) or a prefill + decode pair
(`PairSelector`), and forwards `/generate` with token ids (`Proxy`, docs/pd-protocol.md). It
streams the answering node's events through, builds OpenAI responses itself (text, stop
strings, usage with the per-tier cached tokens the node reported), and keeps each session's
exact token history: with `session_id`, a request carries only the new message, and the router
prepends the session's previous input + output ids, committing a turn only when it succeeded.

State (sessions, prefix index, node states, admission queue) lives on the event loop; nothing
is locked. Every request has a deadline (`request_timeout_s`); a client that goes away cancels
the upstream requests (their connections close, so the nodes abort them).

Load (issue 17): with `max_inflight_per_node` a request waits in the router's bounded FIFO
queue until its nodes have a free slot (`pdcache.router.admission`: 503 `queue_full` /
`queue_timeout` with `Retry-After` otherwise). A request whose node was unreachable, or
answered 503 (full, queue full) while another healthy node of that role exists, is sent again
(up to `max_attempts` tries in all, within its deadline) with a fresh rid and, in PD, a fresh
room and BOTH calls again: the failed attempt's other call is cancelled (P aborts its room; D
frees its pages). A room is never reused: the router cannot tell whether D reached P before it
failed (D's reserve refuses before asking P, but D's engine queue can refuse after the KV
arrived), rooms are single-use on both nodes (`duplicate_room`), and a D that refuses answers
in milliseconds, so little of P's work is lost (and P's prefix cache keeps what it computed).
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any, TypeVar

import anyio
import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.background import BackgroundTask

from pdcache.engine.api import CachedTokens
from pdcache.engine.config import ModelConfig
from pdcache.engine.page_keys import chain_page_keys, make_salt
from pdcache.engine.tokenizer import Tokenizer
from pdcache.router.admission import Admission, Ask, HasRoom, RouterBusyError
from pdcache.router.config import RouterConfig
from pdcache.router.metrics import QueueView, RouterMetrics
from pdcache.router.node_client import BAD_GATEWAY, NodeOverloadedError, NodeUnreachableError
from pdcache.router.nodes import NodeRegistry
from pdcache.router.policy import NoHealthyNodeError, PairSelector
from pdcache.router.proxy import Proxy
from pdcache.router.proxy import RouteStream as UpstreamStream
from pdcache.router.route import Deadline, Route
from pdcache.router.sessions import ChatContinuation, SessionStore
from pdcache.server.bridge import wait_for_disconnect
from pdcache.server.protocol import (
    OVERLOADED,
    SERVER_ERROR,
    ApiError,
    ChatCompletionRequest,
    CompletionRequest,
    GenerateRequestBody,
    ModelLimits,
    OpenAIRequestBase,
    TextAssembler,
    bad_request,
    check_prompt,
    check_token_ids,
    default_max_tokens,
    error_body,
    parse_body,
)
from pdcache.server.responses import (
    Handler,
    ResponseHead,
    StreamEnd,
    chat_choice,
    chat_events,
    completion_events,
    drain,
    event_stream,
    model_list,
    now_s,
    run_guarded,
    sse,
    text_choice,
    usage_body,
)
from pdcache.server.routes import mount

log = logging.getLogger(__name__)

T = TypeVar("T")
FINISHED_OK = ("stop", "length")
OPEN_PATHS = ("/health", "/metrics")  # reachable without the API key (probes, scrapers)


@dataclass
class Prepared:
    """A validated request, ready to forward."""

    input_ids: list[int]
    sampling: dict[str, Any]
    cache_salt: str | None
    session_id: str | None
    arrival: float = field(default_factory=time.monotonic)
    page_keys: list[bytes] | None = None  # the prompt's, computed once (cache-aware routing)


@dataclass
class Turn:
    """What a routed request produced."""

    route: Route
    output_ids: list[int] = field(default_factory=list)
    meta: dict[str, Any] = field(default_factory=dict)
    finish_reason: str | None = None


class Router:
    """Request handling of the router; owns the HTTP client, node registry and sessions."""

    def __init__(self, config: RouterConfig, tokenizer: Tokenizer | None = None,
                 model_config: ModelConfig | None = None) -> None:
        from pdcache.engine.loader import load_model_config, load_tokenizer

        if not config.nodes:
            raise ValueError("the router needs at least one node")
        roles = {n.role for n in config.nodes}
        if "unified" in roles and roles != {"unified"}:
            raise ValueError("mix of unified and prefill/decode nodes: give one kind")
        if roles & {"prefill", "decode"} and roles != {"prefill", "decode"}:
            raise ValueError("a PD deployment needs at least one prefill and one decode node")
        self.config = config
        self.tokenizer = tokenizer or load_tokenizer(config.model)
        model = model_config or load_model_config(config.model, seed=config.model_seed)
        self.model_name = config.served_model_name or model.name
        self.limits = ModelLimits(model.vocab_size, model.max_position_embeddings)
        self.selector = PairSelector(config.prefill_policy, config.decode_policy)
        self.sessions = SessionStore(config.max_sessions, config.session_ttl_s)
        self.chat = ChatContinuation(self.tokenizer)
        self._salt_base = f"router;model={self.model_name};page={config.page_size}"
        self.created = now_s()
        self.client = httpx.AsyncClient(trust_env=False, limits=httpx.Limits(
            max_connections=4096, max_keepalive_connections=256))
        self.registry = NodeRegistry(
            config.nodes, self.client, health_interval_s=config.health_interval_s,
            health_timeout_s=config.health_timeout_s, unhealthy_after=config.unhealthy_after,
            on_recovered=lambda node: self.selector.index.forget(node.name),
            on_checked=lambda: self.admission.pump())
        limits = {n.name: config.inflight_limit(n) for n in config.nodes}
        self.admission = Admission(lambda n: limits.get(n.name, 0), config.max_queue)
        admission = self.admission
        queue = QueueView(lambda: admission.depth, lambda: admission.peak_depth,
                          admission.held, admission.limit)
        self.metrics = RouterMetrics(lambda: self.registry.nodes, lambda: len(self.sessions),
                                     queue)
        admission.observer = self.metrics
        self.proxy = Proxy(self.client, self.registry, connect_timeout_s=config.connect_timeout_s,
                           on_node_result=self.metrics.observe_node)

    # ---- lifecycle

    async def startup(self) -> None:
        self.loop = asyncio.get_running_loop()  # the loop all router state lives on
        await self.registry.check_all()  # bounded by health_timeout_s per node
        self.registry.start()

    async def shutdown(self) -> None:
        await self.registry.stop()
        await self.client.aclose()

    # ---- routing

    def page_keys(self, token_ids: list[int], cache_salt: str | None) -> list[bytes]:
        salt = make_salt(self._salt_base, cache_salt or "")
        return chain_page_keys(token_ids, self.config.page_size, salt)

    def _roles(self) -> tuple[str, ...]:
        return ("prefill", "decode") if self.registry.is_pd else ("unified",)

    def check(self, exclude: frozenset[str]) -> None:
        """ApiError 503 `no_healthy_node` unless every role has a healthy node not excluded."""
        for role in self._roles():
            if not self.registry.has_other(role, exclude):
                raise ApiError(503, f"no healthy node can serve this request: no healthy {role} "
                               "node" + (" left to try" if exclude else ""),
                               type=OVERLOADED, code="no_healthy_node")

    def pick(self, prep: Prepared, exclude: frozenset[str] = frozenset(),
             has_room: HasRoom | None = None) -> Route | None:
        """A route among healthy nodes not in `exclude` with a free slot (`has_room`); None
        when some role has none. Records the prompt's keys for the chosen prefill node."""
        nodes = [n for n in self.registry.nodes if n.name not in exclude
                 and (has_room is None or has_room(n))]
        if self.selector.prefill_policy == "cache_aware" and prep.page_keys is None:
            prep.page_keys = self.page_keys(prep.input_ids, prep.cache_salt)
        keys = prep.page_keys or []
        try:
            if not self.registry.is_pd:
                route = Route(unified=self.selector.pick_prefill(nodes, keys, role="unified"))
            else:
                route = Route(prefill=self.selector.pick_prefill(nodes, keys),
                              decode=self.selector.pick_decode(nodes))
        except NoHealthyNodeError:
            return None
        self.selector.index.record(route.first_node.name, keys)  # co-locate concurrent turns
        return route

    def ask(self, prep: Prepared, exclude: frozenset[str]) -> Ask:
        return Ask(lambda: self.check(exclude),
                   lambda has_room: self.pick(prep, exclude, has_room))

    def node_body(self, prep: Prepared) -> dict[str, Any]:
        body: dict[str, Any] = {"input_ids": prep.input_ids, "sampling_params": prep.sampling,
                                "rid": f"router-{uuid.uuid4().hex}"}
        if prep.cache_salt is not None:
            body["cache_salt"] = prep.cache_salt
        return body

    async def _routed(self, prep: Prepared, deadline: Deadline,
                      send: Callable[[Route], Awaitable[T]]) -> tuple[T, Route]:
        """`send` on a route admitted with its slots (waiting for them if need be). A node that
        was unreachable or answered 503 is excluded and the request sent again elsewhere
        (`retry_reason`); the route's slots are released on every failure (and by the proxy
        when the work ends)."""
        exclude: set[str] = set()
        for attempt in range(1, self.config.max_attempts + 1):
            route = await self.admission.admit(self.ask(prep, frozenset(exclude)), deadline,
                                               front=attempt > 1)
            try:
                return await send(route), route
            except (NodeUnreachableError, NodeOverloadedError) as exc:
                route.release_all()
                reason = self.retry_reason(exc, attempt, deadline, exclude)
                if reason is None:
                    if isinstance(exc, NodeOverloadedError):
                        self.metrics.rejected("node_overloaded")
                    raise
                self.metrics.retries.labels(reason).inc()
            except BaseException:
                route.release_all()
                raise
        raise AssertionError("unreachable")

    def retry_reason(self, exc: NodeUnreachableError | NodeOverloadedError, attempt: int,
                     deadline: Deadline, exclude: set[str]) -> str | None:
        """Why the failed attempt is tried again (`unreachable`, `overloaded`), or None. Adds
        the failed node to `exclude`. An overloaded node is retried only when another
        healthy node of its role exists: a lone full node's 503 reaches the client."""
        exclude.add(exc.node.name)
        if attempt >= self.config.max_attempts or deadline.remaining() <= 0:
            return None
        if isinstance(exc, NodeUnreachableError):
            return "unreachable"
        return "overloaded" if self.registry.has_other(exc.node.role, exclude) else None

    async def send_json(self, prep: Prepared, deadline: Deadline) -> tuple[dict[str, Any], Route]:
        # a fresh body (rid) per attempt: a node that got an abandoned try may still hold its rid
        return await self._routed(
            prep, deadline,
            lambda route: self.proxy.generate(route, self.node_body(prep), deadline))

    async def send_stream(self, prep: Prepared, deadline: Deadline
                          ) -> tuple[UpstreamStream, dict[str, Any] | None, Route]:
        """Open the upstream stream and wait for its first event, so failures before the
        first token are still proper HTTP errors (and may be retried elsewhere)."""
        async def attempt(route: Route) -> tuple[UpstreamStream, dict[str, Any] | None]:
            stream = await self.proxy.stream(route, self.node_body(prep), deadline)
            try:
                first = await stream.next()
            except BaseException:
                await _close(stream)
                raise
            self.metrics.ttft.observe(time.monotonic() - prep.arrival)
            return stream, first

        (stream, first), route = await self._routed(prep, deadline, attempt)
        return stream, first, route

    def finish(self, prep: Prepared, turn: Turn) -> None:
        """Account a finished request; commit the session turn only if it succeeded."""
        self.metrics.observe_meta(turn.meta, len(turn.output_ids))
        if turn.finish_reason not in FINISHED_OK:
            return
        if prep.session_id:
            self.sessions.commit(prep.session_id, prep.input_ids, turn.output_ids)
        if prep.page_keys is not None:
            self.selector.index.record(turn.route.first_node.name, self._answer_keys(prep, turn))

    def _answer_keys(self, prep: Prepared, turn: Turn) -> list[bytes]:
        """Keys of the pages prompt + answer fill beyond the prompt's full pages (the chain
        continues from the prompt's last key: no rehash of the prompt)."""
        keys = prep.page_keys or []
        start = len(keys) * self.config.page_size
        rest = (prep.input_ids + turn.output_ids)[start:]
        if not keys:
            return self.page_keys(rest, prep.cache_salt)
        return chain_page_keys(rest, self.config.page_size, b"", prev_key=keys[-1])

    # ---- prompts

    def session_prompt(self, session_id: str | None, new_ids: list[int]) -> list[int]:
        """The full prompt: the session's exact history + the new message's ids. A client
        that resends the whole history (it starts with the stored one) is taken as is."""
        history = self.sessions.history(session_id) if session_id else []
        if not history or new_ids[: len(history)] == history:
            return new_ids
        return history + new_ids

    def chat_prompt(self, session_id: str | None, messages: list[dict[str, str]]) -> list[int]:
        try:
            standalone = list(self.tokenizer.apply_chat_template(messages,
                                                                 add_generation_prompt=True))
            history = self.sessions.history(session_id) if session_id else []
            if not history or standalone[: len(history)] == history:
                return standalone
            return self.chat.continue_ids(history, messages)
        except ValueError as exc:
            raise bad_request(str(exc), param="messages", code="chat_template") from None

    def encode(self, text: str | None, param: str) -> list[int]:
        if not text:
            raise bad_request("the prompt is empty", param=param, code="empty_prompt")
        return list(self.tokenizer.encode(text))

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids)

    # ---- /generate

    async def generate(self, request: Request) -> Response:
        body = parse_body(GenerateRequestBody, await request.body())
        body.check_one_prompt()
        if body.pd is not None:
            raise bad_request("'pd' is set by the router only", param="pd", code="unknown_field")
        param = body.prompt_param()
        new_ids = body.input_ids if body.input_ids is not None else self.encode(body.text, param)
        input_ids = self.session_prompt(body.session_id, new_ids)
        sampling = body.sampling_params
        check_prompt(input_ids, sampling.max_new_tokens, self.limits, param)
        check_token_ids(sampling.stop_token_ids, self.limits.vocab_size,
                        "sampling_params.stop_token_ids")
        prep = Prepared(input_ids, sampling.model_dump(), body.cache_salt, body.session_id)
        deadline = Deadline(self.config.request_timeout_s)
        if body.stream:
            stream, first, route = await watch(request, self.send_stream(prep, deadline))
            events = self._generate_events(prep, stream, first, Turn(route))
            return streaming(events, stream)
        data, route = await watch(request, self.send_json(prep, deadline))
        turn = Turn(route)
        _absorb(turn, data)
        self.finish(prep, turn)
        return JSONResponse(data)

    async def _generate_events(self, prep: Prepared, stream: UpstreamStream,
                               event: dict[str, Any] | None, turn: Turn) -> AsyncIterator[bytes]:
        try:
            while event is not None:
                _absorb(turn, event)
                yield sse(event)
                event = await stream.next()
            self.finish(prep, turn)
        finally:
            await _close(stream)

    # ---- OpenAI endpoints

    def _openai_prep(self, body: OpenAIRequestBase, input_ids: list[int],
                     max_tokens: int | None, param: str) -> Prepared:
        if max_tokens is None:
            max_tokens = default_max_tokens(len(input_ids), self.limits, param)
        check_prompt(input_ids, max_tokens, self.limits, param)
        check_token_ids(body.stop_token_ids, self.limits.vocab_size, "stop_token_ids")
        sampling = {"max_new_tokens": max_tokens, "temperature": body.temperature,
                    "top_p": body.top_p, "top_k": body.top_k, "seed": body.seed,
                    "stop_token_ids": list(body.stop_token_ids), "ignore_eos": body.ignore_eos}
        return Prepared(input_ids, sampling, body.cache_salt, body.session_id)

    async def chat_completions(self, request: Request) -> Response:
        body = parse_body(ChatCompletionRequest, await request.body())
        body.check_supported()
        stops = body.stop_strings()
        input_ids = self.chat_prompt(body.session_id, body.template_messages())
        prep = self._openai_prep(body, input_ids, body.requested_max_tokens(), "messages")
        kind = "chat.completion.chunk" if body.stream else "chat.completion"
        head = ResponseHead.new("chatcmpl", kind, self.model_name)
        return await self._openai(request, prep, body, stops, head, chat=True)

    async def completions(self, request: Request) -> Response:
        body = parse_body(CompletionRequest, await request.body())
        body.check_supported()
        stops = body.stop_strings()
        prompt = body.single_prompt()
        new_ids = self.encode(prompt, "prompt") if isinstance(prompt, str) else list(prompt)
        input_ids = self.session_prompt(body.session_id, new_ids)
        prep = self._openai_prep(body, input_ids, body.max_tokens, "prompt")
        head = ResponseHead.new("cmpl", "text_completion", self.model_name)
        return await self._openai(request, prep, body, stops, head, chat=False)

    async def _openai(self, request: Request, prep: Prepared, body: OpenAIRequestBase,
                      stops: list[str], head: ResponseHead, chat: bool) -> Response:
        deadline = Deadline(self.config.request_timeout_s)
        stream, first, route = await watch(request, self.send_stream(prep, deadline))
        turn, text = Turn(route), TextAssembler(self.decode, stops)
        deltas = self._deltas(prep, stream, first, turn, text)
        if body.stream:
            end = StreamEnd(lambda: turn.finish_reason, lambda: self._usage_of(turn),
                            body.include_usage())
            events = (chat_events if chat else completion_events)(head, deltas, end)
            return streaming(events, stream)
        try:
            await watch(request, drain(deltas))
        finally:
            await _close(stream)  # idempotent; covers a drain cancelled before it started
        choice = (chat_choice if chat else text_choice)(text.text, turn.finish_reason)
        return JSONResponse(head.body([choice], usage=self.usage(prep, turn)))

    async def _deltas(self, prep: Prepared, stream: UpstreamStream, event: dict[str, Any] | None,
                      turn: Turn, text: TextAssembler) -> AsyncIterator[str]:
        """Text deltas of the upstream stream, cut at the first stop string (which closes
        the upstream request: the node aborts it)."""
        try:
            while event is not None:
                ids = _absorb(turn, event)
                delta = text.add(ids) if ids else ""
                if text.stopped:
                    turn.finish_reason = "stop"
                    break
                if delta:
                    yield delta
                event = await stream.next()
            else:
                delta = text.flush()
            if delta:
                yield delta
            self.finish(prep, turn)
        finally:
            await _close(stream)

    def usage(self, prep: Prepared, turn: Turn) -> dict[str, Any]:
        turn.meta.setdefault("prompt_tokens", len(prep.input_ids))
        return self._usage_of(turn)

    def _usage_of(self, turn: Turn) -> dict[str, Any]:
        meta = turn.meta
        details = meta.get("cached_tokens_details") or {}
        cached = CachedTokens(**{k: int(details.get(k) or 0) for k in CachedTokens().as_dict()})
        prompt = int(meta.get("prompt_tokens") or 0)
        return usage_body(prompt, len(turn.output_ids), cached, int(meta.get("computed_tokens") or 0))

    # ---- informational endpoints

    async def health(self, request: Request) -> Response:
        ok = self.registry.can_serve()
        body = {"status": "ok" if ok else "unavailable", "name": self.config.name,
                "mode": "pd" if self.registry.is_pd else "unified", "model": self.model_name,
                "sessions": len(self.sessions), "queue_depth": self.admission.depth,
                "nodes": self.registry.describe()}
        return JSONResponse(body, status_code=200 if ok else 503)

    async def models(self, request: Request) -> Response:
        return JSONResponse(model_list(self.model_name, self.created, self.limits.context_len))

    async def metrics_endpoint(self, request: Request) -> Response:
        return Response(self.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    # ---- plumbing

    def authorized(self, request: Request) -> bool:
        key = self.config.api_key
        if not key or request.url.path in OPEN_PATHS:
            return True
        given = request.headers.get("authorization", "")
        scheme, _, token = given.partition(" ")
        return scheme.lower() == "bearer" and secrets.compare_digest(token.strip().encode(),
                                                                     key.encode())

    async def guarded(self, endpoint: str, handler: Handler, request: Request) -> Response:
        """Run a handler; map every failure to a JSON error; count status and latency."""
        start = time.monotonic()
        if not self.authorized(request):
            response: Response = JSONResponse(
                error_body("invalid or missing API key (Authorization: Bearer KEY)",
                           type="authentication_error", code="invalid_api_key"),
                status_code=401, headers={"WWW-Authenticate": "Bearer"})
        else:
            response = await run_guarded(endpoint, _with_retry_after(handler), request)
        self.metrics.observe_request(endpoint, response.status_code, time.monotonic() - start)
        return response


# --------------------------------------------------------------------------- helpers


def _absorb(turn: Turn, event: dict[str, Any]) -> list[int]:
    """Take one node answer or event: its new ids and meta; names the route's nodes."""
    ids = event.get("output_ids")
    if not isinstance(ids, list) or not all(isinstance(i, int) for i in ids):
        raise ApiError(502, f"node answered without a valid 'output_ids': {str(event)[:200]}",
                       type=SERVER_ERROR, code=BAD_GATEWAY)
    meta = event.get("meta")
    if isinstance(meta, dict):
        meta["prefill_node"] = turn.route.prefill_name
        meta["decode_node"] = turn.route.decode_name
        turn.meta = meta
        turn.finish_reason = meta.get("finish_reason") or turn.finish_reason
    turn.output_ids.extend(ids)
    return ids


def _with_retry_after(handler: Handler) -> Handler:
    """`handler`, with the router's own 503s (admission) rendered with their Retry-After."""
    async def handle(request: Request) -> Response:
        try:
            return await handler(request)
        except RouterBusyError as exc:
            return JSONResponse(exc.body(), status_code=exc.status_code,
                                headers={"Retry-After": str(exc.retry_after_s)})

    return handle


async def watch(request: Request, work: Awaitable[T]) -> T:
    """Await `work`, cancelling it (and so its upstream requests) if the client leaves."""
    task = asyncio.ensure_future(work)
    gone = asyncio.ensure_future(wait_for_disconnect(request))
    try:
        await asyncio.wait({task, gone}, return_when=asyncio.FIRST_COMPLETED)
        if not task.done():
            raise ApiError(499, "client disconnected", type="client_disconnected")
        return task.result()
    finally:
        for fut in (task, gone):
            fut.cancel()
        await asyncio.gather(task, gone, return_exceptions=True)


async def _close(stream: UpstreamStream) -> None:
    """Close upstream connections even from a cancelled scope (client disconnect)."""
    with anyio.CancelScope(shield=True), anyio.move_on_after(10):
        await stream.aclose()


def streaming(events: AsyncIterator[bytes], stream: UpstreamStream) -> Response:
    """SSE response; the background close covers a client gone before the first pull."""
    return event_stream(events, BackgroundTask(_close, stream))


# --------------------------------------------------------------------------- factory


def create_app(config: RouterConfig, *, tokenizer: Tokenizer | None = None,
               model_config: ModelConfig | None = None) -> FastAPI:
    router = Router(config, tokenizer, model_config)

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        await router.startup()
        try:
            yield
        finally:
            await router.shutdown()

    app = FastAPI(title="pdcache router", lifespan=lifespan, docs_url=None, redoc_url=None)
    app.state.router = router
    mount(app, [("POST", "/generate", router.generate),
                ("POST", "/v1/chat/completions", router.chat_completions),
                ("POST", "/v1/completions", router.completions),
                ("GET", "/health", router.health),
                ("GET", "/v1/models", router.models),
                ("GET", "/metrics", router.metrics_endpoint)], router.guarded)
    return app
