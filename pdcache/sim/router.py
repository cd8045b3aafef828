"""The simulated router: the real `PairSelector` (routing policies and the cache-aware prefix
index) and the real `Admission` (per-node in-flight limits), with the waiting requests in a
FIFO of the simulation's own.

`Router.pick` and `Router.finish` (`pdcache.router.core`) are mirrored: the candidates are the
nodes with a free slot, the chosen prefill node learns the prompt's page keys at pick time and
prompt + answer's at completion. `Admission.admit` never has to wait here: the simulation asks
only when every role has a node with a free slot, so the coroutine completes at its first
step and is driven without an event loop (`admit_now`). A request that would wait joins the
FIFO, which is bounded by `[router] max_queue` (beyond: refused, `queue_full`).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Sequence

from pdcache.config.schema import RouterSettings
from pdcache.router.admission import Admission, Ask
from pdcache.router.policy import NodeState, PairSelector
from pdcache.router.route import Deadline, Route
from pdcache.sim.request import SimRequest


def admit_now(admission: Admission, ask: Ask, timeout_s: float) -> Route:
    """`admission.admit(ask)` when it grants at once (the caller checked there is room)."""
    coroutine = admission.admit(ask, Deadline(timeout_s))
    try:
        coroutine.send(None)
    except StopIteration as stop:
        return stop.value
    coroutine.close()
    raise AssertionError("admission tried to wait: the simulation asked without room")


class SimRouter:
    """Owns the node states, the selector, the admission slots and the waiting FIFO."""

    def __init__(self, settings: RouterSettings, nodes: Sequence[NodeState],
                 start: Callable[[SimRequest, Route], None],
                 refuse: Callable[[SimRequest, str], None]) -> None:
        self.settings = settings
        self.nodes = list(nodes)
        self.pd = any(n.role == "prefill" for n in self.nodes)
        self.roles = ("prefill", "decode") if self.pd else ("unified",)
        self.selector = PairSelector(settings.prefill_policy, settings.decode_policy,
                                     balance=settings.cache_aware_balance)
        limit = settings.max_inflight_per_node
        self.admission = Admission(lambda node: limit, settings.max_queue)
        self.queue: deque[SimRequest] = deque()
        self._start = start
        self._refuse = refuse
        self.peak_queue = 0
        self.refused = 0

    def submit(self, req: SimRequest) -> None:
        if self.queue or not self._has_room():
            if len(self.queue) >= self.admission.max_queue:
                self.refused += 1
                self._refuse(req, "queue_full")
                return
            self.queue.append(req)
            self.peak_queue = max(self.peak_queue, len(self.queue))
            return
        self._dispatch(req)

    def pump(self) -> None:
        """Dispatch waiting requests, head first, while every role has a free slot."""
        while self.queue and self._has_room():
            self._dispatch(self.queue.popleft())

    def _has_room(self) -> bool:
        return all(any(n.role == role and n.healthy and self.admission.has_room(n)
                       for n in self.nodes) for role in self.roles)

    def _pick(self, req: SimRequest, has_room: Callable[[NodeState], bool]) -> Route:
        nodes = [n for n in self.nodes if has_room(n)]
        keys = req.keys if self.selector.prefill_policy == "cache_aware" else []
        if self.pd:
            route = Route(prefill=self.selector.pick_prefill(nodes, keys),
                          decode=self.selector.pick_decode(nodes))
        else:
            route = Route(unified=self.selector.pick_prefill(nodes, keys, role="unified"))
        self.selector.index.record(route.first_node.name, keys)
        return route

    def _dispatch(self, req: SimRequest) -> None:
        ask = Ask(lambda: None, lambda has_room: self._pick(req, has_room))
        route = admit_now(self.admission, ask, self.settings.request_timeout_s)
        for node in route.nodes:
            node.in_flight += 1
        req.route = route
        self._start(req, route)

    def release(self, req: SimRequest, node: NodeState) -> None:
        """The request's work on `node` ended: its slot frees."""
        assert req.route is not None
        node.in_flight -= 1
        req.route.release(node)

    def finish(self, req: SimRequest, answer_keys: list[bytes]) -> None:
        """A request completed: its prefill node learns prompt + answer's page keys."""
        if self.selector.prefill_policy == "cache_aware" and req.route is not None:
            self.selector.index.record(req.route.first_node.name, answer_keys)
