"""The routing core of the router: sessions, node picking, dispatch with retries, and finishing
a turn (docs/design.md §4.1). HTTP (request parsing, OpenAI bodies, auth) is
`pdcache.router.app`'s; this module never sees a `Request`.

`Router` picks a node (unified) or a prefill + decode pair (`PairSelector`) and forwards
`/generate` with token ids (`Proxy`, docs/pd-protocol.md). It keeps each session's exact token
history: with `session_id`, a request carries only the new message, and the router prepends
the session's previous input + output ids, committing a turn only when it succeeded.

State (sessions, prefix index, node states, admission queue) lives on the event loop; nothing
is locked. Every request has a deadline (`request_timeout_s`).

Load: with `max_inflight_per_node` a request waits in the router's bounded FIFO
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
import time
import uuid
from collections.abc import Awaitable, Callable, Hashable
from dataclasses import dataclass, field
from typing import Any, TypeVar

import httpx
from pydantic import ValidationError

from pdcache.engine.config import ModelConfig
from pdcache.engine.page_keys import chain_page_keys, make_salt
from pdcache.engine.tokenizer import Tokenizer
from pdcache.router.admission import Admission, Ask, HasRoom
from pdcache.router.config import RouterConfig
from pdcache.router.metrics import QueueView, RouterMetrics
from pdcache.router.node_client import (
    BAD_GATEWAY,
    NodeOverloadedError,
    NodeUnreachableError,
    node_transport,
)
from pdcache.router.nodes import NodeRegistry
from pdcache.router.policy import NodeState, NoHealthyNodeError, PairSelector
from pdcache.router.proxy import Proxy, close_stream
from pdcache.router.proxy import RouteStream as UpstreamStream
from pdcache.router.route import Deadline, Route
from pdcache.router.sessions import ChatContinuation, SessionStore
from pdcache.router.tenants import TenantInflight, node_session_id
from pdcache.wire.agent import AgentFeatures
from pdcache.wire.generate_api import GenerateMeta
from pdcache.wire.protocol import (
    OVERLOADED,
    SERVER_ERROR,
    ApiError,
    ModelLimits,
    bad_request,
    encode_prompt,
)

T = TypeVar("T")
FINISHED_OK = ("stop", "length")
PROBE_CONNECTIONS = 64  # the health probes' own pool: one probe per node at a time


@dataclass
class Prepared:
    """A validated request, ready to forward."""

    input_ids: list[int]
    sampling: dict[str, Any]
    cache_salt: str | None  # as the nodes see it: inside the tenant's namespace (tenants.py)
    session_id: Hashable | None  # the router's session key (tenants.session_key)
    # the session history the prompt was built on (`SessionStore.version`): a turn commits
    # only onto it
    session_version: int = 0
    arrival: float = field(default_factory=time.monotonic)
    page_keys: list[bytes] | None = None  # the prompt's, computed once (cache-aware routing)
    stream: bool = False  # the client asked for SSE (SGLang's is_streaming label)
    extra: dict[str, Any] = field(default_factory=dict)  # more /generate fields (logprobs)


@dataclass
class Turn:
    """What a routed request produced. `meta` is the answering node's last `meta_info`,
    typed (`GenerateMeta`, the fields the router reads); None until a node sent one. The
    router asks nodes for incremental events, so each event's ids and text are new ones."""

    route: Route
    output_ids: list[int] = field(default_factory=list)
    meta: GenerateMeta | None = None
    finish_reason: str | None = None  # SGLang's finish_reason type: stop, length, abort

    def absorb(self, event: dict[str, Any]) -> list[int]:
        """Take one node answer or event: its new ids and meta_info. The event's `meta_info`
        (passed on to the client) is made to name the route's nodes; one without the fields
        of a `GenerateMeta` is a bad gateway."""
        ids = event.get("output_ids")
        if not isinstance(ids, list) or not all(isinstance(i, int) for i in ids):
            raise ApiError(502, f"node answered without a valid 'output_ids': {str(event)[:200]}",
                           type=SERVER_ERROR, code=BAD_GATEWAY)
        raw = event.get("meta_info")
        if raw is not None:
            if not isinstance(raw, dict):
                raise ApiError(502, "node answered a 'meta_info' that is not an object: "
                               f"{raw!r:.200}", type=SERVER_ERROR, code=BAD_GATEWAY)
            raw["prefill_node"] = self.route.prefill_name
            raw["decode_node"] = self.route.decode_name
            if self.meta is not None and raw.get("finish_reason") is None:
                # mid-stream: only the first and the final meta_info are read (typed); the
                # others pass through as they are (no validation per token on the hot path)
                self.output_ids.extend(ids)
                return ids
            try:
                self.meta = GenerateMeta.model_validate(raw)
            except ValidationError as exc:
                raise ApiError(502, f"node answered an invalid 'meta_info': {exc.errors()[:2]}",
                               type=SERVER_ERROR, code=BAD_GATEWAY) from None
            self.finish_reason = self.meta.finish_type or self.finish_reason
        self.output_ids.extend(ids)
        return ids


class Router:
    """The routing core; owns the HTTP client, node registry, selector, sessions, admission queue,
    metrics and proxy. Runs on the router's event loop (`startup` records it)."""

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
        self.model_config = model
        self.model_name = config.served_model_name or model.name
        self.limits = ModelLimits(model.vocab_size, model.max_position_embeddings)
        self.selector = PairSelector(config.prefill_policy, config.decode_policy,
                                     balance=config.cache_aware_balance, load=self._load)
        self.sessions = SessionStore(config.max_sessions, config.session_ttl_s)
        self.chat = ChatContinuation(self.tokenizer)
        self.agent = AgentFeatures(self.tokenizer, model.vocab_size, config.tool_call_parser,
                                   config.reasoning_parser)
        self.tenant_limits = TenantInflight()  # in flight per tenant (`TenantGate` holds them)
        self._salt_base = f"router;model={self.model_name};page={config.page_size}"
        # every call to a node (generate, health, service endpoints) carries the node
        # credential derived from the cluster secret, when there is one
        self.client = httpx.AsyncClient(trust_env=False, headers=config.node_headers(),
                                        transport=node_transport(config.max_node_connections))
        # health probes get a pool of their own: with every request connection in use they
        # waited for one, timed out, and marked every node unhealthy (a router under load
        # then refused everything: 503 no_healthy_node)
        self.probe_client = httpx.AsyncClient(trust_env=False, headers=config.node_headers(),
                                              transport=node_transport(PROBE_CONNECTIONS))
        self.registry = NodeRegistry(
            config.nodes, self.probe_client, health_interval_s=config.health_interval_s,
            health_timeout_s=config.health_timeout_s, unhealthy_after=config.unhealthy_after,
            on_recovered=lambda node: self.selector.index.forget(node.name),
            on_checked=lambda: self.admission.pump())
        limits = {n.name: config.inflight_limit(n) for n in config.nodes}
        self.admission = Admission(lambda n: limits.get(n.name, 0), config.max_queue)
        admission = self.admission
        queue = QueueView(lambda: admission.depth, lambda: admission.peak_depth,
                          admission.held, admission.limit)
        self.metrics = RouterMetrics(lambda: self.registry.nodes, lambda: len(self.sessions),
                                     queue, model_name=self.model_name)
        admission.observer = self.metrics
        self.proxy = Proxy(self.client, self.registry, connect_timeout_s=config.connect_timeout_s,
                           on_node_result=self.metrics.observe_node,
                           first_token_from_prefill=config.first_token_from_prefill)

    def _load(self, node: NodeState) -> int:
        """A node's requests for the policies: its calls in flight, or the slots the router
        granted it when more (granted synchronously at the pick: a burst sees its own)."""
        return max(node.in_flight, self.admission.held(node))

    # ---- lifecycle

    async def startup(self) -> None:
        self.loop = asyncio.get_running_loop()  # the loop all router state lives on
        await self.registry.check_all()  # bounded by health_timeout_s per node
        self.registry.start()

    async def shutdown(self) -> None:
        await self.registry.stop()
        await self.client.aclose()
        await self.probe_client.aclose()

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
        # incremental events: the router relays new ids and text, and builds the client's
        # cumulative chunks itself (OutputBuilder)
        body: dict[str, Any] = {"input_ids": prep.input_ids, "sampling_params": prep.sampling,
                                "rid": f"router-{uuid.uuid4().hex}",
                                "incremental_streaming_output": True, **prep.extra}
        if prep.cache_salt is not None:
            body["cache_salt"] = prep.cache_salt
        if prep.session_id:  # the nodes' session-aware eviction policies learn turns from it
            body["session_id"] = node_session_id(prep.session_id)
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
                await close_stream(stream)
                raise
            self.metrics.ttft.observe(time.monotonic() - prep.arrival)
            return stream, first

        (stream, first), route = await self._routed(prep, deadline, attempt)
        return stream, first, route

    def finish(self, prep: Prepared, turn: Turn) -> None:
        """Account a finished request; commit the session turn only if it succeeded."""
        self.metrics.observe_meta(turn.meta, len(turn.output_ids))
        self.metrics.observe_sglang(turn.meta, len(turn.output_ids),
                                    time.monotonic() - prep.arrival, prep.stream,
                                    turn.finish_reason)
        if turn.finish_reason not in FINISHED_OK:
            return
        if prep.session_id and not self.sessions.commit(
                prep.session_id, prep.input_ids, turn.output_ids, prep.session_version):
            # another turn of the session committed while this one ran, or it was closed
            self.metrics.session_commits_refused.inc()
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

    def session_prompt(self, session_id: Hashable | None, new_ids: list[int]) -> list[int]:
        """The full prompt: the session's exact history + the new message's ids. A client
        that resends the whole history (it starts with the stored one) is taken as is."""
        history = self.sessions.history(session_id) if session_id else []
        if not history:
            self._check_not_lost(session_id, new_ids)
            return new_ids
        if new_ids[: len(history)] == history:
            return new_ids
        return history + new_ids

    def _check_not_lost(self, session_id: Hashable | None, prompt_ids: list[int]) -> None:
        """409 `session_expired` when the session's history was evicted or expired and this
        prompt does not resend it: the turn would run on the new message alone."""
        if session_id is not None and self.sessions.lost(session_id, prompt_ids):
            raise ApiError(409, "this session's history is gone (evicted for room, or idle past "
                                "the router's session TTL): send the whole conversation to "
                                "continue it, or start a new session_id", param="session_id",
                           code="session_expired")

    def chat_prompt(self, session_id: Hashable | None, messages: list[dict[str, Any]],
                    tools: list[dict[str, Any]] | None = None,
                    template_kwargs: dict[str, Any] | None = None) -> list[int]:
        """The chat's prompt ids. With a session: its exact history + the new messages. The
        new messages are all of them (the client sent only those), or, when the client
        resent the conversation, those after its last assistant turn (`_new_messages`): the
        assistant turns are the ids the model produced, however the client re-wrote them (a
        tool loop's `tool_calls`). A resent conversation that is not the session's (another
        number of answers, another first prompt: an edited or cut conversation) is rendered
        as it is. `template_kwargs`: the request's `chat_template_kwargs`, every rendering."""
        try:
            standalone = self.render_chat(messages, tools, template_kwargs)
            history = self.sessions.history(session_id) if session_id else []
            if not history:
                self._check_not_lost(session_id, standalone)
                return standalone
            if standalone[: len(history)] == history:
                return standalone
            new = self._new_messages(session_id, history, messages, tools, template_kwargs)
            if new is None:
                return standalone
            return self.chat.continue_ids(history, new, tools, template_kwargs)
        except ValueError as exc:
            raise bad_request(str(exc), param="messages", code="chat_template") from None

    def render_chat(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None,
                    template_kwargs: dict[str, Any] | None = None) -> list[int]:
        return list(self.tokenizer.apply_chat_template(
            messages, add_generation_prompt=True, tools=tools, template_kwargs=template_kwargs))

    def _new_messages(self, session_id: Hashable, history: list[int],
                      messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None,
                      template_kwargs: dict[str, Any] | None) -> list[dict[str, Any]] | None:
        """The messages after the history: all of them when they hold no assistant turn (the
        client sent only the new ones); after the last assistant turn of a resent
        conversation that is the session's, with one assistant turn per committed answer and
        the first prompt the history's; None when it is not the session's. (The turns before
        the last answer re-rendered never matched once an earlier answer had been re-written:
        the whole conversation was appended to the history from a tool loop's third turn,
        and an edited question kept the turn it replaced.)"""
        answers = [i for i, m in enumerate(messages) if m.get("role") == "assistant"]
        if not answers:
            return messages
        if len(answers) != self.sessions.turns(session_id):
            return None
        first = self.render_chat(messages[: answers[0]], tools, template_kwargs)
        if history[: len(first)] != first:
            return None
        return messages[answers[-1] + 1:]

    def encode(self, text: str | None, param: str) -> list[int]:
        return encode_prompt(self.tokenizer, text, param)

