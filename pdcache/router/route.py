"""Where one routed request goes and by when: `Route` (a unified node, or a prefill + decode
pair, with the router slots the request holds there) and `Deadline`.

Plain per-request values, made by the routing core (`pdcache.router.core`) and the admission
queue (`pdcache.router.admission`) and read by the proxy (`pdcache.router.proxy`), all on the
router's event loop. A `Route` frees its slots through its `SlotHolder` (idempotent); it owns
nothing else.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Protocol

from pdcache.router.policy import NodeState
from pdcache.wire.protocol import TIMEOUT, ApiError


class SlotHolder(Protocol):
    """Router-side slots held by one request on its route's nodes (idempotent releases)."""

    def release(self, node: NodeState) -> None: ...

    def release_all(self) -> None: ...


@dataclass(frozen=True)
class Route:
    """Where one request goes: a unified node, or a prefill + decode pair; `lease` holds the
    request's router slots on those nodes (None when the router does not limit them)."""

    unified: NodeState | None = None
    prefill: NodeState | None = None
    decode: NodeState | None = None
    lease: SlotHolder | None = field(default=None, compare=False)

    @property
    def nodes(self) -> tuple[NodeState, ...]:
        return tuple(n for n in (self.unified, self.prefill, self.decode) if n is not None)

    def release(self, node: NodeState) -> None:
        """This request's work on `node` is over: free its slot there (idempotent)."""
        if self.lease is not None:
            self.lease.release(node)

    def release_all(self) -> None:
        if self.lease is not None:
            self.lease.release_all()

    @property
    def prefill_name(self) -> str:
        node = self.unified or self.prefill
        assert node is not None
        return node.name

    @property
    def decode_name(self) -> str:
        node = self.unified or self.decode
        assert node is not None
        return node.name

    @property
    def first_node(self) -> NodeState:
        """The node whose prefix cache serves the prompt (for the cache-aware index)."""
        node = self.unified or self.prefill
        assert node is not None
        return node


class Deadline:
    """The point in time (monotonic clock) by which one request must be answered."""

    def __init__(self, timeout_s: float) -> None:
        self.timeout_s = timeout_s
        self.at = time.monotonic() + timeout_s

    def remaining(self) -> float:
        return max(0.0, self.at - time.monotonic())

    def error(self, what: str) -> ApiError:
        return ApiError(504, f"{what} did not finish within the router's deadline of "
                        f"{self.timeout_s:g}s", type=TIMEOUT, code="timeout")
