"""The HTTP routes of a server around one engine (docs/design.md §4.1), and the app that mounts them.

`ServerRoutes` answers `/generate`, the OpenAI endpoints, `/health`, `/v1/models` and
`/metrics` for the unified server and for the P/D nodes alike; a node composes it with its own
handler for the `/generate` bodies that carry `pd` (`build_app(pd_generate=...)`) and its own
`/health` and `/server_info` fields (`health_extra`, `info_extra`). `build_app` also mounts
SGLang's service endpoints (`pdcache.server.service`), with `wire.mount.mount`, as the router
mounts its own. Nothing subclasses a handler.

Threads: every handler runs on the event loop; `/metrics` renders in the thread pool (tier
stats may ask a remote metadata service, a bounded wait).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Iterator
from contextlib import aclosing, asynccontextmanager, contextmanager
from dataclasses import dataclass
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.concurrency import run_in_threadpool

from pdcache.engine.api import TokenConstraint, TokenLogprob
from pdcache.server.bridge import EngineBridge, EngineRequest, Generation
from pdcache.server.service import ServiceRoutes
from pdcache.wire.agent import AgentFeatures, ChoicePlan
from pdcache.wire.auth import node_request_allowed, unauthorized
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
    SERVER_ERROR,
    ApiError,
    ChatCompletionRequest,
    CompletionRequest,
    ModelLimits,
    OpenAIRequestBase,
    bad_request,
    check_prompt,
    check_token_ids,
    default_max_tokens,
    encode_prompt,
    parse_body,
    unsupported,
)
from pdcache.wire.responses import (
    Handler,
    ResponseHead,
    StreamEnd,
    model_list,
    now_s,
    run_guarded,
    sse,
    usage_body,
)
from pdcache.wire.service import service_handlers

PDHandler = Callable[[Request, GenerateRequestBody], Awaitable[Response]]
# a filter of one sequence's stream chunks: the chunk to send, or None to send nothing
ChunkFilter = Callable[[dict[str, Any]], dict[str, Any] | None]


@dataclass
class SequenceRun:
    """One submitted sequence of a /generate request and what builds its answer."""

    item: GenerateItem
    handle: EngineRequest
    gen: Generation
    text: TextAssembler
    builder: OutputBuilder | None = None
    trim: ChunkFilter | None = None  # decode: leaves out the token prefill streamed already


@dataclass
class ChoiceRun:
    """One submitted choice: its engine request, what it produced, its OpenAI output."""

    handle: EngineRequest
    gen: Generation
    text: TextAssembler
    output: ChoiceOutput

    def new_logprobs(self) -> list[TokenLogprob]:
        """The logprobs that arrived since the previous call."""
        return self.gen.take_logprobs()


async def _as_sse(chunks: AsyncIterator[dict[str, Any]]) -> AsyncIterator[bytes]:
    async with aclosing(chunks) as stream:
        async for chunk in stream:
            yield sse(chunk)


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
        self.agent = AgentFeatures(self.tokenizer, model.vocab_size,
                                   bridge.config.tool_call_parser,
                                   bridge.config.reasoning_parser)

    # ---- /generate (SGLang's native API: pdcache.wire.generate_api)

    async def generate(self, request: Request, body: GenerateRequestBody) -> Response:
        """Every sequence of the request (batch x n) submitted at once; samples of one
        prompt after its first wait for its prompt pages (`prefill_leader`)."""
        body.check_supported()
        if body.has_bootstrap():
            raise unsupported(body.bootstrap_field() or "bootstrap_room", "'bootstrap_*' are for prefill and decode "
                              "nodes; this is a unified server")
        runs: list[SequenceRun] = []
        budget = LogprobBudget()
        items = body.items()
        # each sequence's grammar built on a worker thread (the event loop serves on)
        constraints = await asyncio.to_thread(
            lambda: [self.agent.sampling_constraint(item.sampling) for item in items])
        with self.ended_on_error(lambda: [(run.handle, run.gen) for run in runs]):
            for item, constraint in zip(items, constraints, strict=True):
                runs.append(self.start(item, body, runs, constraint, budget))
            return await self.respond_runs(request, runs, body)

    def start(self, item: GenerateItem, body: GenerateRequestBody, earlier: list[SequenceRun],
              constraint: TokenConstraint | None, budget: LogprobBudget) -> SequenceRun:
        """Check and submit one sequence; a sample's `prefill_leader` is its prompt's first.
        Whatever may refuse it comes first: a request submitted but not returned would run on
        with nothing to abort it."""
        gen = Generation(arrival=time.monotonic())
        input_ids = self.checked_prompt(item)
        budget.spend(len(input_ids), item.sampling.max_new_tokens, item.logprobs)
        text = self.assembler(item)
        leader = earlier[item.leader].handle.rid if item.leader is not None else None
        handle = self.bridge.submit(gen, input_ids, item.sampling.to_engine(), body.cache_salt,
                                    item.rid, logprobs=item.logprobs, prefill_leader=leader,
                                    constraint=constraint, session_id=body.session_id)
        return SequenceRun(item, handle, gen, text)

    @contextmanager
    def ended_on_error(self, submitted: Callable[[], Iterable[tuple[EngineRequest, Generation]]]
                       ) -> Iterator[None]:
        """Any exception inside aborts and counts the requests `submitted()` lists then (the
        ones already in the engine): nothing else would end them."""
        try:
            yield
        except BaseException:
            for handle, gen in submitted():
                handle.abort()
                self.bridge.finish(gen)
            raise

    def checked_prompt(self, item: GenerateItem) -> list[int]:
        """The item's prompt ids (encoding text), after every input check of §4.1."""
        prompt = item.prompt
        input_ids = prompt if isinstance(prompt, list) else self.encode(prompt, item.param)
        sampling = item.sampling
        check_prompt(input_ids, sampling.max_new_tokens, self.limits, item.param)
        check_token_ids(sampling.stop_token_ids, self.limits.vocab_size,
                        "sampling_params.stop_token_ids")
        if item.logprobs is not None:
            check_token_ids(list(item.logprobs.token_ids), self.limits.vocab_size,
                            "token_ids_logprob")
        return input_ids

    def assembler(self, item: GenerateItem) -> TextAssembler:
        sampling = item.sampling
        skip = sampling.skip_special_tokens
        return TextAssembler(lambda ids: self.tokenizer.decode(ids, skip_special_tokens=skip),
                             sampling.stop_strings(), keep_stop=sampling.no_stop_trim)

    def incremental(self, body: GenerateRequestBody) -> bool:
        chosen = body.incremental_streaming_output
        return self.bridge.config.incremental_streaming_output if chosen is None else chosen

    async def respond(self, request: Request, handle: EngineRequest, gen: Generation,
                      body: GenerateRequestBody, item: GenerateItem,
                      trim: ChunkFilter | None = None) -> Response:
        """A submitted single-sequence request's answer (the P/D nodes'). `trim` filters a
        stream's chunks: the decode node's, whose client already has the first token
        (`first_token_streamed`), starts after it."""
        with self.ended_on_error(lambda: [(handle, gen)]):
            run = SequenceRun(item, handle, gen, self.assembler(item), trim=trim)
            return await self.respond_runs(request, [run], body)

    def first_token_text(self, item: GenerateItem, token: int) -> str:
        """The text a stream releases with `item`'s first token alone (prefill's first
        event; the decode node's stream leaves it out)."""
        return self.assembler(item).add([token])

    async def respond_runs(self, request: Request, runs: list[SequenceRun],
                           body: GenerateRequestBody) -> Response:
        """SSE chunks (cumulative unless incremental; interleaved with `index` for a list),
        or one JSON body at the end: an object, or a list for a batch / n > 1."""
        listed = body.answers_list
        incremental = self.incremental(body)
        for run in runs:
            run.builder = OutputBuilder(incremental, run.item.index if listed else None)
        if body.stream:
            events = merge_streams([self._sequence_chunks(run, body) for run in runs])
            pairs = [(run.handle, run.gen) for run in runs]
            return self.bridge.streaming_many(_as_sse(events), pairs)
        await self.bridge.collect_many(request, [(r.handle, r.gen, r.text) for r in runs])
        answers = []
        for run in runs:
            assert run.builder is not None
            run.builder.text = run.text.text
            run.builder.output_ids = run.gen.output_ids
            answers.append(run.builder.final(self.meta_info(run, body)))
        return JSONResponse(answers if listed else answers[0])

    async def _sequence_chunks(self, run: SequenceRun, body: GenerateRequestBody
                               ) -> AsyncIterator[dict[str, Any]]:
        builder = run.builder
        assert builder is not None
        outputs = self.bridge.outputs(run.handle, run.gen, run.text)
        async with aclosing(outputs) as stream:
            async for new_ids, delta in stream:
                chunk = builder.add(new_ids, delta, self.meta_info(run, body))
                if run.trim is not None and (chunk := run.trim(chunk)) is None:
                    continue
                yield chunk

    def meta_info(self, run: SequenceRun, body: GenerateRequestBody) -> dict[str, Any]:
        """`meta_info` now, with the logprobs absorbed since the previous chunk."""
        logprobs = None
        if run.item.logprobs is not None:
            logprobs = self.logprob_fields(run, body)
        return self.bridge.meta_info(run.gen, logprobs)

    def logprob_fields(self, run: SequenceRun, body: GenerateRequestBody) -> dict[str, Any]:
        from pdcache.wire.logprobs import sglang_logprob_fields

        request = run.item.logprobs
        assert request is not None
        gen = run.gen
        decode = (lambda tok: self.tokenizer.decode([tok], skip_special_tokens=False)) \
            if body.return_text_in_logprobs else None
        # this chunk's output logprobs (OutputBuilder makes them cumulative); the prompt's in
        # every chunk, as SGLang sends them
        return sglang_logprob_fields(gen.take_logprobs(), gen.input_logprobs,
                                     top_n=request.top_n, token_ids=bool(request.token_ids),
                                     decode_token=decode)

    # ---- OpenAI endpoints

    async def chat_completions(self, request: Request) -> Response:
        body = parse_body(ChatCompletionRequest, await request.body())
        body.check_supported()
        input_ids = self.apply_chat_template(self.agent.chat_messages(body),
                                             body.template_tools(), body.template_kwargs())
        kind = "chat.completion.chunk" if body.stream else "chat.completion"
        head = ResponseHead.new("chatcmpl", kind, self.model_name)
        # its grammar compiled on a worker thread (the event loop serves on meanwhile)
        plan = await asyncio.to_thread(self.agent.chat_plan, body)
        return await self._openai(request, body, input_ids, body.requested_max_tokens(),
                                  "messages", head, plan)

    async def completions(self, request: Request) -> Response:
        body = parse_body(CompletionRequest, await request.body())
        body.check_supported()
        prompt = body.single_prompt()
        input_ids = self.encode(prompt, "prompt") if isinstance(prompt, str) else prompt
        head = ResponseHead.new("cmpl", "text_completion", self.model_name)
        plan = self.agent.completion_plan(body)
        return await self._openai(request, body, input_ids, body.max_tokens, "prompt", head,
                                  plan)

    async def _openai(self, request: Request, body: OpenAIRequestBase, input_ids: list[int],
                      max_tokens: int | None, param: str, head: ResponseHead, plan: ChoicePlan
                      ) -> Response:
        """Submit the request's `n` choices (choice i > 0 waits for choice 0's prompt pages:
        `prefill_leader`), then answer them as one body or one interleaved stream."""
        if max_tokens is None:
            max_tokens = default_max_tokens(len(input_ids), self.limits, param)
        check_prompt(input_ids, max_tokens, self.limits, param)
        check_token_ids(body.stop_token_ids, self.limits.vocab_size, "stop_token_ids")
        runs: list[ChoiceRun] = []
        # a later choice failing to queue (or anything else) ends the earlier ones too
        with self.ended_on_error(lambda: [(run.handle, run.gen) for run in runs]):
            for index in range(body.n):
                runs.append(self._submit_choice(body, input_ids, max_tokens, plan, index,
                                                runs[0].handle.rid if runs else None))
            if body.stream:
                end = StreamEnd(lambda: self._usage(runs), body.include_usage())
                deltas = merge_streams([self._choice_deltas(run) for run in runs])
                events = choice_events(head, deltas, body.n, end, plan.chat)
                return self.bridge.streaming_many(events, [(r.handle, r.gen) for r in runs])
            await asyncio.gather(*(self._collect_choice(request, run) for run in runs))
        choices = [run.output.body(run.gen.finish_reason) for run in runs]
        return JSONResponse(head.body(choices, usage=self._usage(runs)))

    def _submit_choice(self, body: OpenAIRequestBase, input_ids: list[int], max_tokens: int,
                       plan: ChoicePlan, index: int, leader: str | None) -> ChoiceRun:
        """Submit choice `index`; whatever may refuse it comes first: a request submitted but
        not returned would run on with nothing to abort it."""
        gen = Generation(arrival=time.monotonic())
        text = TextAssembler(self.agent.text_decoder(plan), body.stop_strings())
        output, constraint = plan.output(index), plan.constraint()
        handle = self.bridge.submit(gen, input_ids, body.to_engine(max_tokens, index),
                                    body.cache_salt, logprobs=plan.logprobs,
                                    constraint=constraint, prefill_leader=leader,
                                    session_id=body.session_id)
        return ChoiceRun(handle, gen, text, output)

    async def _choice_deltas(self, run: ChoiceRun) -> AsyncIterator[ChoiceDelta]:
        async with aclosing(self.bridge.outputs(run.handle, run.gen, run.text)) as stream:
            async for _, delta in stream:
                delta_out = run.output.add(delta, run.new_logprobs())
                if not delta_out.empty():
                    yield delta_out
        yield run.output.finish(run.gen.finish_reason)

    async def _collect_choice(self, request: Request, run: ChoiceRun) -> None:
        # the whole text at once: the tool-call parse of a whole text equals the streamed one
        await self.bridge.collect(request, run.handle, run.gen, run.text)
        run.output.add(run.text.text, run.new_logprobs())
        run.output.finish(run.gen.finish_reason)

    def _usage(self, runs: list[ChoiceRun]) -> dict[str, Any]:
        """The prompt once (choice 0's reuse numbers), every choice's completion tokens, and
        the prompt tokens all choices computed (the prompt once with `prefill_leader`)."""
        first = runs[0].gen
        return usage_body(first.prompt_tokens, sum(len(r.gen.output_ids) for r in runs),
                          first.cached, sum(r.gen.computed_tokens for r in runs))

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

    def apply_chat_template(self, messages: list[dict[str, Any]],
                            tools: list[dict[str, Any]] | None = None,
                            template_kwargs: dict[str, Any] | None = None) -> list[int]:
        try:
            return list(self.tokenizer.apply_chat_template(
                messages, add_generation_prompt=True, tools=tools,
                template_kwargs=template_kwargs))
        except ValueError as exc:
            raise bad_request(str(exc), param="messages", code="chat_template") from None


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
        if body.pd is None and not body.has_bootstrap():
            return await routes.generate(request, body)
        if pd_generate is None:
            if body.pd is None:
                return await routes.generate(request, body)  # 400 unsupported_parameter
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
                *service_handlers(service)], guard, config.max_request_bytes)
    return app
