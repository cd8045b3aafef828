"""Router-side admission: per-node in-flight limits and a bounded FIFO of waiting requests, so
overload becomes a wait (up to the request's deadline) instead of an error.

A request holds a *slot* on every node of its route from the moment it is admitted until its
work there ends: a prefill node's slot frees as soon as P's call answered (P is done once the
KV is pushed), the answering node's (decode or unified) when the response is complete or the
client left (`pdcache.router.proxy` releases them). A node whose slots are all held is no
candidate. A request that finds no candidate for one of its roles waits in the queue, in
arrival order (a retried request goes to the front: it arrived before the others), and is
dispatched when a slot frees or a node becomes healthy again. It is refused instead:
- at once with 503 `queue_full` when `max_queue` requests already wait (`max_queue` 0: no
  waiting at all, a busy router refuses at once);
- with 503 `queue_timeout` when its deadline passes in the queue. 503, not 504: no node was
  asked anything, the router itself is busy, and 503 + `Retry-After` tells the client (and the
  OpenAI SDKs) to come back later;
- with 503 `no_healthy_node` when no healthy node could serve it at all (waiting is pointless).
Each of these carries `Retry-After` (`RouterBusyError.retry_after_s`: the mean time a request
recently held its slots, 1..60 s). A limit <= 0 is no limit: then nothing ever waits.

The queue is strict FIFO: a head waiting for a node (e.g. one that excluded the others after
their 503s) holds the ones behind it. Everything here runs on the router's event loop (no
locks); releases come from request handlers and task done-callbacks on that loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import math
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from pdcache.router.policy import NodeState
from pdcache.router.route import Deadline, Route
from pdcache.wire.protocol import OVERLOADED, ApiError

HasRoom = Callable[[NodeState], bool]
MAX_RETRY_AFTER_S = 60
HOLD_EWMA_WEIGHT = 0.2  # weight of the newest hold time in the mean


class RouterBusyError(ApiError):
    """503 from the router's own admission, with the `Retry-After` seconds to send."""

    def __init__(self, message: str, code: str, retry_after_s: int) -> None:
        super().__init__(503, message, type=OVERLOADED, code=code)
        self.retry_after_s = retry_after_s


@dataclass(frozen=True)
class Ask:
    """What one request needs from admission.

    `check()` raises ApiError (503) when no healthy node could ever serve it (waiting would
    be pointless); `pick(has_room)` picks its route among the nodes with a free slot, or
    returns None when one of its roles has none."""

    check: Callable[[], None]
    pick: Callable[[HasRoom], Route | None]


class AdmissionObserver:
    """Hooks for metrics; the default does nothing."""

    def waited(self, route: Route, seconds: float) -> None:
        """A request was admitted on `route` after `seconds` in the queue (0: no wait)."""

    def rejected(self, reason: str) -> None:
        """Admission refused a request (`queue_full`, `queue_timeout`, `no_healthy_node`)."""


class Lease:
    """The slots one admitted request holds; owned by that request, released per node
    (idempotent) by the proxy and by the routing core on failure. Event loop only."""

    def __init__(self, admission: Admission, nodes: Sequence[NodeState]) -> None:
        self._admission = admission
        self._held = {n.name: n for n in nodes}
        self._granted_at = time.monotonic()

    def release(self, node: NodeState) -> None:
        if self._held.pop(node.name, None) is not None:
            self._admission._freed(node, self._granted_at if not self._held else None)

    def release_all(self) -> None:
        for node in list(self._held.values()):
            self.release(node)


@dataclass
class _Waiter:
    ask: Ask
    future: asyncio.Future[Route]
    since: float


class Admission:
    """Owns the slot counts per node and the queue of waiting requests. Event loop only."""

    def __init__(self, limit_of: Callable[[NodeState], int], max_queue: int,
                 observer: AdmissionObserver | None = None) -> None:
        self._limit_of = limit_of
        self.max_queue = max(0, max_queue)
        self.observer = observer or AdmissionObserver()  # metrics; set once, before serving
        self._held: dict[str, int] = {}
        self._queue: deque[_Waiter] = deque()
        self.peak_depth = 0
        self._mean_hold_s = 1.0

    # ---- queries

    @property
    def depth(self) -> int:
        return len(self._queue)

    def held(self, node: NodeState) -> int:
        return self._held.get(node.name, 0)

    def limit(self, node: NodeState) -> int:
        """The node's in-flight limit; <= 0 is none."""
        return self._limit_of(node)

    def has_room(self, node: NodeState) -> bool:
        limit = self._limit_of(node)
        return limit <= 0 or self.held(node) < limit

    def retry_after_s(self) -> int:
        """Seconds a refused client should wait: about one recent mean slot hold time."""
        return min(MAX_RETRY_AFTER_S, max(1, math.ceil(self._mean_hold_s)))

    # ---- admitting

    async def admit(self, ask: Ask, deadline: Deadline, *, front: bool = False) -> Route:
        """The request's route with its slots held (`route.lease`): at once when a slot is
        free and nobody waits, else after waiting. Raises ApiError as described above."""
        self._check(ask)
        if not self._queue:
            route = self._grant(ask, 0.0)
            if route is not None:
                return route
        if len(self._queue) >= self.max_queue:
            raise self._busy("queue_full", f"the router's queue is full ({len(self._queue)} "
                             "requests wait for a node with a free slot)")
        if deadline.remaining() <= 0:
            raise self._busy("queue_timeout", "the request's deadline passed before a node "
                             "had a free slot")
        return await self._wait(ask, deadline, front)

    async def _wait(self, ask: Ask, deadline: Deadline, front: bool) -> Route:
        loop = asyncio.get_running_loop()
        waiter = _Waiter(ask, loop.create_future(), time.monotonic())
        (self._queue.appendleft if front else self._queue.append)(waiter)
        self.peak_depth = max(self.peak_depth, len(self._queue))
        timer = loop.call_later(deadline.remaining(), self._expire, waiter, deadline)
        try:
            return await waiter.future
        except asyncio.CancelledError:
            self._abandon(waiter)
            raise
        finally:
            timer.cancel()

    def pump(self) -> None:
        """Dispatch waiting requests, head first, while their routes have free slots; fail
        those no healthy node can serve any more. Called when a slot frees, after health
        checks and when a waiter leaves."""
        while self._queue:
            head = self._queue[0]
            if head.future.done():
                self._queue.popleft()
                continue
            try:
                self._check(head.ask)
                route = self._grant(head.ask, time.monotonic() - head.since)
            except Exception as exc:  # noqa: BLE001 - the waiter's failure, not the pump's
                self._queue.popleft()
                head.future.set_exception(exc)
                continue
            if route is None:
                return
            self._queue.popleft()
            head.future.set_result(route)

    # ---- internals

    def _check(self, ask: Ask) -> None:
        try:
            ask.check()
        except ApiError as exc:
            self.observer.rejected(exc.code or "no_healthy_node")
            raise

    def _grant(self, ask: Ask, waited_s: float) -> Route | None:
        route = ask.pick(self.has_room)
        if route is None:
            return None
        for node in route.nodes:
            self._held[node.name] = self.held(node) + 1
        self.observer.waited(route, waited_s)
        return dataclasses.replace(route, lease=Lease(self, route.nodes))

    def _freed(self, node: NodeState, granted_at: float | None) -> None:
        """A lease let go of `node`; `granted_at` when it was the lease's last slot."""
        self._held[node.name] = max(0, self.held(node) - 1)
        if granted_at is not None:
            hold = time.monotonic() - granted_at
            self._mean_hold_s += HOLD_EWMA_WEIGHT * (hold - self._mean_hold_s)
        self.pump()

    def _expire(self, waiter: _Waiter, deadline: Deadline) -> None:
        if waiter.future.done():
            return
        self._remove(waiter)
        waiter.future.set_exception(self._busy(
            "queue_timeout", f"no node had a free slot within the request's deadline of "
            f"{deadline.timeout_s:g}s"))
        self.pump()

    def _abandon(self, waiter: _Waiter) -> None:
        """The waiting request was cancelled (client gone): give back a route granted at the
        same moment, or leave the queue."""
        fut = waiter.future
        if fut.done() and not fut.cancelled() and fut.exception() is None:
            route = fut.result()
            route.release_all()
            return
        self._remove(waiter)
        self.pump()

    def _remove(self, waiter: _Waiter) -> None:
        with contextlib.suppress(ValueError):
            self._queue.remove(waiter)

    def _busy(self, code: str, message: str) -> RouterBusyError:
        self.observer.rejected(code)
        return RouterBusyError(message, code, self.retry_after_s())
