"""FastAPI app of the router: the OpenAI-compatible front door of a deployment (docs/design.md §4.1).

`RouterApp` holds the HTTP handlers of `/generate`, the OpenAI endpoints (`/v1/chat/completions`,
`/v1/completions`, `/v1/models`), `/health` and `/metrics` (SGLang's service endpoints are
`pdcache.router.service`'s), and the guard around them (API
key, error mapping, request metrics). They tokenize (chat template included), validate with
the same models as the unified server (`pdcache.wire.protocol`), and hand the request to the
routing core (`pdcache.router.core.Router`: sessions, node or pair picking, dispatch with
retries). They stream the answering node's events through and build OpenAI responses
themselves (text, stop strings, usage with the per-tier cached tokens the node reported).

Everything runs on the server's event loop, the one the core's state lives on; nothing is
locked. Every request has a deadline (`request_timeout_s`); a client that goes away cancels
the upstream requests (their connections close, so the nodes abort them). `create_app` builds
the core and the app; `app.state.router` is the core.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Hashable
from contextlib import aclosing, asynccontextmanager
from dataclasses import dataclass, replace
from typing import Any, TypeVar

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.background import BackgroundTask

from pdcache.engine.api import CachedTokens, TokenLogprob
from pdcache.engine.config import ModelConfig
from pdcache.engine.tokenizer import Tokenizer
from pdcache.router.admission import RouterBusyError
from pdcache.router.config import RouterConfig
from pdcache.router.core import Prepared, Router, Turn
from pdcache.router.node_client import BAD_GATEWAY
from pdcache.router.proxy import RouteStream as UpstreamStream
from pdcache.router.proxy import close_stream
from pdcache.router.route import Deadline, Route
from pdcache.router.service import RouterService
from pdcache.router.tenants import (
    Tenant,
    TenantDirectory,
    TenantGate,
    hold_sequences,
    scoped_salt,
    session_key,
    tenant_of,
)
from pdcache.transfer.config import TransferConfig
from pdcache.transfer.messages import prompt_logprobs_too_large
from pdcache.wire.agent import ChoicePlan
from pdcache.wire.auth import bearer_token
from pdcache.wire.choices import ChoiceDelta, ChoiceOutput, choice_events
from pdcache.wire.detokenize import TextAssembler
from pdcache.wire.generate_api import (
    GenerateItem,
    GenerateRequestBody,
    LogprobBudget,
    OutputBuilder,
    merge_streams,
)
from pdcache.wire.mount import mount
from pdcache.wire.protocol import (
    SEED_LIMIT,
    SERVER_ERROR,
    ApiError,
    ChatCompletionRequest,
    CompletionRequest,
    OpenAIRequestBase,
    bad_request,
    check_prompt,
    check_token_ids,
    default_max_tokens,
    error_body,
    parse_body,
    unsupported,
)
from pdcache.wire.responses import (
    Handler,
    ResponseHead,
    StreamEnd,
    drain,
    event_stream,
    model_list,
    now_s,
    run_guarded,
    sse,
    usage_body,
    wait_for_disconnect,
)
from pdcache.wire.service import service_handlers

T = TypeVar("T")


class RouterApp:
    """The router's HTTP handlers over one routing core (`router`), on its event loop."""

    def __init__(self, router: Router, directory: TenantDirectory | None = None) -> None:
        self.router = router
        self.created = now_s()
        # with tenants, /health is open (probes) but shows the nodes (internal addresses,
        # their last errors) only to a caller with a key
        self.directory = directory or TenantDirectory(())

    # ---- /generate (SGLang's native API: pdcache.wire.generate_api)

    async def generate(self, request: Request) -> Response:
        """Each sequence of the request (batch x n) is routed on its own (cache-aware routing
        co-locates the samples of one prompt); the answers are SGLang's, built here from the
        nodes' incremental events."""
        body = parse_body(GenerateRequestBody, await request.body())
        if body.pd is not None:
            raise bad_request("'pd' is set by the router only", param="pd", code="unknown_field")
        body.check_supported()
        if body.has_bootstrap():
            raise unsupported(body.bootstrap_field() or "bootstrap_room", "'bootstrap_*' are for prefill and decode "
                              "nodes; this is the router")
        items = body.items()
        if body.session_id and len(items) > 1:
            raise unsupported("session_id", "a session continues one sequence: no batch or n > 1")
        tenant = tenant_of(request)
        preps = [self._generate_prep(item, body, tenant) for item in items]
        budget = LogprobBudget()
        for item, prep in zip(items, preps, strict=True):
            budget.spend(len(prep.input_ids), item.sampling.max_new_tokens, item.logprobs)
        hold_sequences(request, self.router.tenant_limits, len(items))
        deadline = Deadline(self.router.config.request_timeout_s)
        listed = body.answers_list
        incremental = self.incremental(body)
        builders = [OutputBuilder(incremental, item.index if listed else None) for item in items]
        if body.stream:
            opened = await watch(request, open_all(
                [self._open(prep, deadline, ahead=len(preps) > 1) for prep in preps],
                _close_opened), discard=_close_opened)
            streams = _opened_or_raise(opened)
            sequences = [self._generate_chunks(prep, stream, first, Turn(route), builder)
                         for prep, (stream, first, route), builder
                         in zip(preps, streams, builders, strict=True)]
            chunks = sequences[0] if len(sequences) == 1 else merge_streams(sequences)
            return streaming_many(_as_sse(chunks), [stream for stream, _, _ in streams])
        answers = await watch(request, all_or_none(
            [self._generate_json(prep, deadline, builder)
             for prep, builder in zip(preps, builders, strict=True)]))
        return JSONResponse(answers if listed else answers[0])

    async def _open(self, prep: Prepared, deadline: Deadline, ahead: bool
                    ) -> tuple[UpstreamStream, dict[str, Any] | None, Route]:
        """One sequence's stream, read ahead (`RouteStream.read_ahead`) when the request has
        others: its events go out once they all opened, its node slot must not wait for it."""
        stream, first, route = await self.router.send_stream(prep, deadline)
        if ahead:
            stream.read_ahead()
        return stream, first, route

    def incremental(self, body: GenerateRequestBody) -> bool:
        chosen = body.incremental_streaming_output
        return self.router.config.incremental_streaming_output if chosen is None else chosen

    def _generate_prep(self, item: GenerateItem, body: GenerateRequestBody,
                       tenant: Tenant | None) -> Prepared:
        prompt = item.prompt
        new_ids = prompt if isinstance(prompt, list) else self.router.encode(prompt, item.param)
        session = session_key(tenant, body.session_id)
        input_ids = self.router.session_prompt(session, new_ids)
        sampling = item.sampling
        check_prompt(input_ids, sampling.max_new_tokens, self.router.limits, item.param)
        check_token_ids(sampling.stop_token_ids, self.router.limits.vocab_size,
                        "sampling_params.stop_token_ids")
        if self.router.registry.is_pd:  # refused here, before a node spends anything on it
            # the nodes' limit: the topology has no key for it, every node runs the default
            limit = TransferConfig().max_message_bytes
            why = prompt_logprobs_too_large(len(input_ids), item.logprobs, limit)
            if why:
                raise bad_request(why, code="logprobs_too_large")
        return Prepared(input_ids, sampling.forwarded(), scoped_salt(tenant, body.cache_salt),
                        session, self._session_version(session), stream=body.stream,
                        extra=_logprob_fields(item, body))

    async def _generate_json(self, prep: Prepared, deadline: Deadline, builder: OutputBuilder
                             ) -> dict[str, Any]:
        data, route = await self.router.send_json(prep, deadline)
        turn = Turn(route)
        turn.absorb(data)
        self.router.finish(prep, turn)
        builder.add(turn.output_ids, str(data.get("text") or ""), {})
        return builder.final(data.get("meta_info") or {})

    async def _generate_chunks(self, prep: Prepared, stream: UpstreamStream,
                               event: dict[str, Any] | None, turn: Turn, builder: OutputBuilder
                               ) -> AsyncIterator[dict[str, Any]]:
        try:
            while event is not None:
                ids = turn.absorb(event)
                yield builder.add(ids, str(event.get("text") or ""), event.get("meta_info") or {})
                event = await stream.next()
            self.router.finish(prep, turn)
        finally:
            await close_stream(stream)

    # ---- OpenAI endpoints

    def _openai_prep(self, request: Request, body: OpenAIRequestBase, input_ids: list[int],
                     max_tokens: int | None, param: str) -> Prepared:
        if max_tokens is None:
            max_tokens = default_max_tokens(len(input_ids), self.router.limits, param)
        check_prompt(input_ids, max_tokens, self.router.limits, param)
        check_token_ids(body.stop_token_ids, self.router.limits.vocab_size, "stop_token_ids")
        hold_sequences(request, self.router.tenant_limits, body.n)
        sampling = {"max_new_tokens": max_tokens, "temperature": body.temperature,
                    "top_p": body.top_p, "top_k": body.top_k, "seed": body.seed,
                    "stop_token_ids": list(body.stop_token_ids), "ignore_eos": body.ignore_eos}
        for name in ("presence_penalty", "frequency_penalty"):  # SGLang's names too
            if getattr(body, name):
                sampling[name] = getattr(body, name)
        top_n = body.logprobs_top_n()
        extra = {} if top_n is None else {"return_logprob": True, "top_logprobs_num": top_n}
        tenant = tenant_of(request)
        session = session_key(tenant, body.session_id)
        return Prepared(input_ids, sampling, scoped_salt(tenant, body.cache_salt), session,
                        self._session_version(session), stream=bool(body.stream), extra=extra)

    def _session_version(self, session: Hashable | None) -> int:
        """The history version the prompt was just built on (no await since: the event
        loop ran nothing in between)."""
        return self.router.sessions.version(session) if session else 0

    async def chat_completions(self, request: Request) -> Response:
        body = parse_body(ChatCompletionRequest, await request.body())
        body.check_supported()
        stops = body.stop_strings()
        session = session_key(tenant_of(request), body.session_id)
        input_ids = self.router.chat_prompt(session, self.router.agent.chat_messages(body),
                                            body.template_tools(), body.template_kwargs())
        prep = self._openai_prep(request, body, input_ids, body.requested_max_tokens(),
                                 "messages")
        # compiled on a worker thread: a costly schema must not stall the event loop
        json_schema = await asyncio.to_thread(self.router.agent.node_json_schema, body)
        if json_schema is not None:
            prep.sampling["json_schema"] = json_schema  # the nodes build the constraint
        kind = "chat.completion.chunk" if body.stream else "chat.completion"
        head = ResponseHead.new("chatcmpl", kind, self.router.model_name)
        plan = self.router.agent.chat_plan(body, constrain=False)
        return await self._openai(request, prep, body, stops, head, plan)

    async def completions(self, request: Request) -> Response:
        body = parse_body(CompletionRequest, await request.body())
        body.check_supported()
        stops = body.stop_strings()
        prompt = body.single_prompt()
        new_ids = self.router.encode(prompt, "prompt") if isinstance(prompt, str) else list(prompt)
        session = session_key(tenant_of(request), body.session_id)
        input_ids = self.router.session_prompt(session, new_ids)
        prep = self._openai_prep(request, body, input_ids, body.max_tokens, "prompt")
        head = ResponseHead.new("cmpl", "text_completion", self.router.model_name)
        plan = self.router.agent.completion_plan(body)
        return await self._openai(request, prep, body, stops, head, plan)

    async def _openai(self, request: Request, prep: Prepared, body: OpenAIRequestBase,
                      stops: list[str], head: ResponseHead, plan: ChoicePlan) -> Response:
        """Route the request's `n` choices, each its own node request. Choice i > 0 is sent
        once choice 0's first token arrived and, in PD, its prefill call ended: its prompt
        pages are then in that prefill node's tree, where the cache-aware policy sends the
        others (the prompt computed once). A unified node caches the prompt when choice 0
        ends, so there the others may compute it again. Only choice 0 commits the session."""
        deadline = Deadline(self.router.config.request_timeout_s)
        choices: list[RoutedChoice] = []
        try:
            for index in range(body.n):
                choice_prep = prep if index == 0 else sample_prep(prep, index)
                stream, first, route = await watch(
                    request, self._open(choice_prep, deadline, ahead=body.n > 1),
                    discard=_close_sent)
                choices.append(RoutedChoice(choice_prep, stream, first, Turn(route),
                                            TextAssembler(self.router.agent.text_decoder(plan),
                                                          stops),
                                            plan.output(index)))
                if index == 0 and body.n > 1:
                    await watch(request, stream.prefill_finished())
        except BaseException:
            for choice in choices:
                await close_stream(choice.stream)
            raise
        deltas = merge_streams([self._choice_deltas(choice) for choice in choices])
        if body.stream:
            end = StreamEnd(lambda: self.usage_of(choices), body.include_usage())
            events = choice_events(head, deltas, body.n, end, plan.chat)
            return streaming_many(events, [choice.stream for choice in choices])
        try:
            await watch(request, drain(deltas))
        finally:
            await close_streams(choices)  # idempotent; covers a drain cancelled before it started
        bodies = [choice.output.body(choice.turn.finish_reason) for choice in choices]
        return JSONResponse(head.body(bodies, usage=self.usage_of(choices)))

    async def _choice_deltas(self, choice: RoutedChoice) -> AsyncIterator[ChoiceDelta]:
        texts = self._deltas(choice.prep, choice.stream, choice.first, choice.turn, choice.text)
        async with aclosing(texts) as stream:
            async for text, logprobs in stream:
                delta = choice.output.add(text, logprobs)
                if not delta.empty():
                    yield delta
        yield choice.output.finish(choice.turn.finish_reason)

    def usage_of(self, choices: list[RoutedChoice]) -> dict[str, Any]:
        """The prompt once (choice 0's numbers), every choice's completion and computed
        tokens."""
        usages = [self.usage(c.prep, c.turn) for c in choices]
        first = usages[0]
        completion = sum(u["completion_tokens"] for u in usages)
        return {**first, "completion_tokens": completion,
                "total_tokens": first["prompt_tokens"] + completion,
                "computed_tokens": sum(u["computed_tokens"] for u in usages)}

    async def _deltas(self, prep: Prepared, stream: UpstreamStream, event: dict[str, Any] | None,
                      turn: Turn, text: TextAssembler
                      ) -> AsyncIterator[tuple[str, list[TokenLogprob]]]:
        """(text delta, output logprobs of its event) of the upstream stream, cut at the first
        stop string (which closes the upstream request: the node aborts it)."""
        try:
            logprobs: list[TokenLogprob] = []
            while event is not None:
                ids = turn.absorb(event)
                logprobs = node_logprobs(event)
                delta = text.add(ids) if ids else ""
                if text.stopped:
                    turn.finish_reason = "stop"
                    break
                if delta or logprobs:
                    yield delta, logprobs
                event = await stream.next()
            else:
                delta, logprobs = text.flush(), []
            if delta or logprobs:
                yield delta, logprobs
            self.router.finish(prep, turn)
        finally:
            await close_stream(stream)

    def usage(self, prep: Prepared, turn: Turn) -> dict[str, Any]:
        return self._usage_of(turn, len(prep.input_ids))

    def _usage_of(self, turn: Turn, prompt_tokens: int = 0) -> dict[str, Any]:
        """OpenAI usage from the node's typed meta (a node that sent none: the prompt the
        router sent, nothing reused)."""
        meta = turn.meta
        if meta is None:
            return usage_body(prompt_tokens, len(turn.output_ids), CachedTokens(), 0)
        cached = CachedTokens(**meta.cached_tokens_details.model_dump())
        return usage_body(meta.prompt_tokens, len(turn.output_ids), cached, meta.computed_tokens)

    # ---- informational endpoints

    async def health(self, request: Request) -> Response:
        router = self.router
        ok = router.registry.can_serve()
        body = {"status": "ok" if ok else "unavailable", "name": router.config.name,
                "mode": "pd" if router.registry.is_pd else "unified", "model": router.model_name}
        # what tells of the traffic (other tenants' activity included) only with a key
        if not self.directory.enabled or self.directory.authenticate(bearer_token(request)):
            body.update(sessions=len(router.sessions), queue_depth=router.admission.depth,
                        nodes=router.registry.describe())
        return JSONResponse(body, status_code=200 if ok else 503)

    async def liveness(self, request: Request) -> Response:
        """200 while this process answers, whatever its nodes' health: a cluster restarts a
        router whose liveness fails, and restarting it cures no node (its /health is the
        readiness: 503 while no node can serve)."""
        return JSONResponse({"status": "ok", "name": self.router.config.name})

    async def models(self, request: Request) -> Response:
        router = self.router
        return JSONResponse(model_list(router.model_name, self.created, router.limits.context_len))

    async def metrics_endpoint(self, request: Request) -> Response:
        return Response(self.router.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    # ---- plumbing

    async def guarded(self, endpoint: str, handler: Handler, request: Request) -> Response:
        """Run a handler (authenticated by `TenantGate` before it gets here); map every
        failure to a JSON error; count status and latency."""
        start = time.monotonic()
        response = await run_guarded(endpoint, _with_retry_after(handler), request)
        self.router.metrics.observe_request(endpoint, response.status_code,
                                            time.monotonic() - start)
        return response

    def tenant_guarded(self, handler: Handler) -> Handler:
        """`handler` refused (403) to tenants: it acts on every tenant's cache at once."""
        async def handle(request: Request) -> Response:
            if tenant_of(request) is not None:
                return JSONResponse(error_body(
                    "flushing the shared caches is an operator action: call the nodes with "
                    "the cluster's node credential", type="permission_error",
                    code="forbidden"), status_code=403)
            return await handler(request)

        return handle


# --------------------------------------------------------------------------- helpers


@dataclass
class RoutedChoice:
    """One choice of an OpenAI request: its routed node request and its OpenAI output."""

    prep: Prepared
    stream: UpstreamStream
    first: dict[str, Any] | None
    turn: Turn
    text: TextAssembler
    output: ChoiceOutput


def sample_prep(prep: Prepared, index: int) -> Prepared:
    """Choice `index` > 0 of `prep`: its own seed (a given seed + index), no session turn."""
    seed = prep.sampling.get("seed")
    sampling = {**prep.sampling, "seed": None if seed is None else (seed + index) % SEED_LIMIT}
    return replace(prep, sampling=sampling, session_id=None, arrival=time.monotonic())


async def close_streams(choices: list[RoutedChoice]) -> None:
    for choice in choices:
        await close_stream(choice.stream)


def node_logprobs(event: dict[str, Any]) -> list[TokenLogprob]:
    """The output logprobs of one incremental node event: SGLang's `meta_info`
    `output_token_logprobs` `[(logprob, id, text)]` and `output_top_logprobs` (per token a
    list of such, or null)."""
    info = event.get("meta_info")
    if not isinstance(info, dict) or not info.get("output_token_logprobs"):
        return []
    tokens = info["output_token_logprobs"]
    tops = info.get("output_top_logprobs") or [None] * len(tokens)
    try:
        return [TokenLogprob(int(token[1]), token[0],
                             top=tuple((int(t[1]), t[0]) for t in top or ()))
                for token, top in zip(tokens, tops, strict=True)]
    except (TypeError, ValueError, IndexError) as exc:
        raise ApiError(502, f"node answered invalid logprobs: {exc}", type=SERVER_ERROR,
                       code=BAD_GATEWAY) from None


def _with_retry_after(handler: Handler) -> Handler:
    """`handler`, with the router's own 503s (admission) rendered with their Retry-After."""
    async def handle(request: Request) -> Response:
        try:
            return await handler(request)
        except RouterBusyError as exc:
            return JSONResponse(exc.body(), status_code=exc.status_code,
                                headers={"Retry-After": str(exc.retry_after_s)})

    return handle


async def watch(request: Request, work: Awaitable[T],
                discard: Callable[[T], Awaitable[None]] | None = None) -> T:
    """Await `work`, cancelling it (and so its upstream requests) if the client leaves.

    `discard` gets a result that `work` produced but no caller will see: the client left
    (or this call was cancelled) while `work` was finishing, e.g. a gather whose last stream
    opened just as it was cancelled (a cancel of a gather whose children are done does not
    stop it). What it holds (open upstream streams, their nodes' in-flight slots) is freed
    there instead of leaking."""
    task = asyncio.ensure_future(work)
    gone = asyncio.ensure_future(wait_for_disconnect(request))
    handed = False
    try:
        await asyncio.wait({task, gone}, return_when=asyncio.FIRST_COMPLETED)
        if not task.done():
            raise ApiError(499, "client disconnected", type="client_disconnected")
        result = task.result()
        handed = True
        return result
    finally:
        await _cancel_all([task, gone])
        if discard is not None and not handed and task.done() and not task.cancelled() \
                and task.exception() is None:
            await discard(task.result())


async def open_all(opens: list[Awaitable[T]],
                   close: Callable[[list[Any]], Awaitable[None]]) -> list[T | BaseException]:
    """Every sequence's stream opened concurrently: their results or errors. Cancelled (the
    client left while some were still opening): every open is cancelled and awaited, and
    `close` gets the streams that did open — a cancelled gather throws its finished
    children's results away, and with them the node slots their streams hold, for good."""
    tasks = [asyncio.ensure_future(opening) for opening in opens]
    try:
        return await asyncio.gather(*tasks, return_exceptions=True)
    except BaseException:
        await _cancel_all(tasks)
        await close([task.result() for task in tasks
                     if not task.cancelled() and task.exception() is None])
        raise


async def all_or_none(works: list[Awaitable[T]]) -> list[T]:
    """Every sequence's answer; on the first failure (or a cancel) the others are cancelled
    and awaited: no node goes on computing an answer nobody will read (and a tenant's
    in-flight bound, released with the response, keeps bounding the work behind it)."""
    tasks = [asyncio.ensure_future(work) for work in works]
    try:
        return await asyncio.gather(*tasks)
    finally:
        await _cancel_all(tasks)


async def _cancel_all(tasks: list[asyncio.Future[Any]]) -> None:
    """Cancel `tasks` (nothing for those done) and wait until each has ended."""
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)


async def _close_opened(opened: list[Any]) -> None:
    """`watch`'s discard for a batch of `send_stream` results (streams, or their errors)."""
    await asyncio.gather(*(close_stream(result[0]) for result in opened
                           if not isinstance(result, BaseException)))


async def _close_sent(sent: tuple[UpstreamStream, Any, Any]) -> None:
    """`watch`'s discard for one `send_stream` result."""
    await close_stream(sent[0])


def streaming_many(events: AsyncIterator[bytes], streams: list[UpstreamStream]) -> Response:
    """SSE response over the upstream streams of one answer (a /generate's sequences, an
    OpenAI request's choices); the background close covers a client gone before the first
    pull."""
    async def close_all() -> None:
        for stream in streams:
            await close_stream(stream)

    return event_stream(events, BackgroundTask(close_all))


def _opened_or_raise(opened: list[Any]) -> list[tuple[UpstreamStream, Any, Any]]:
    """The opened streams of a batch; if one failed, the others are closed (in the
    background) and its error raised."""
    failed = [r for r in opened if isinstance(r, BaseException)]
    if not failed:
        return opened
    asyncio.ensure_future(_close_opened(opened))
    raise failed[0]


async def _as_sse(chunks: AsyncIterator[dict[str, Any]]) -> AsyncIterator[bytes]:
    async with aclosing(chunks) as stream:
        async for chunk in stream:
            yield sse(chunk)


def _logprob_fields(item: GenerateItem, body: GenerateRequestBody) -> dict[str, Any]:
    """The logprob fields of one sequence's node request (SGLang's names)."""
    request = item.logprobs
    if request is None:
        return {}
    fields: dict[str, Any] = {"return_logprob": True, "top_logprobs_num": request.top_n,
                              "return_text_in_logprobs": body.return_text_in_logprobs,
                              "logprob_start_len": -1 if request.input_start is None
                              else request.input_start}
    if request.token_ids:
        fields["token_ids_logprob"] = list(request.token_ids)
    return fields


# --------------------------------------------------------------------------- factory


def create_app(config: RouterConfig, *, tokenizer: Tokenizer | None = None,
               model_config: ModelConfig | None = None) -> FastAPI:
    router = Router(config, tokenizer, model_config)
    directory = TenantDirectory(config.all_tenants())
    handlers = RouterApp(router, directory)
    service = RouterService(router)

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        await router.startup()
        try:
            yield
        finally:
            await router.shutdown()

    app = FastAPI(title="pdcache router", lifespan=lifespan, docs_url=None, redoc_url=None)
    app.state.router = router
    table = [(method, path, handlers.tenant_guarded(handler) if "flush" in path else handler)
             for method, path, handler in service_handlers(service)]
    routes = [("POST", "/generate", handlers.generate),
              ("POST", "/v1/chat/completions", handlers.chat_completions),
              ("POST", "/v1/completions", handlers.completions),
              ("GET", "/health", handlers.health),
              ("GET", "/liveness", handlers.liveness),
              ("GET", "/v1/models", handlers.models),
              ("GET", "/metrics", handlers.metrics_endpoint),
              *table]
    mount(app, routes, handlers.guarded, config.max_request_bytes)
    app.add_middleware(TenantGate, directory=directory,
                       limits=router.tenant_limits, known_paths=[r[1] for r in routes],
                       observe=router.metrics.observe_request,
                       retry_after_s=router.admission.retry_after_s)
    return app
