"""Choosing a prefill/decode pair for each request.

Prefill policies: `round_robin`, `least_load` (fewest requests in flight), `cache_aware` (the
node whose recently routed prompts share the longest page prefix with this one; ties and
misses fall back to least load, and so does a match whose node has more than `balance`
requests in flight beyond the least loaded one: a prefix every prompt shares, an agent's system
prompt, would otherwise send all traffic to one node). Decode policies: `round_robin`,
`least_load`.
Only healthy nodes are candidates. Called from the router's event loop only (no locking).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

PREFILL_POLICIES = ("round_robin", "least_load", "cache_aware")
DECODE_POLICIES = ("round_robin", "least_load")


@dataclass
class NodeState:
    """What the router knows about one node."""

    name: str
    url: str
    role: str  # prefill | decode | unified
    bootstrap: str | None = None  # prefill: host:port of its KV bootstrap socket
    healthy: bool = True
    # its /health advertises `first_token_stream` (docs/pd-protocol.md "First token from
    # prefill"): a node that does not (an older build) gets the old PD bodies
    first_token_stream: bool = False
    in_flight: int = 0
    consecutive_failures: int = 0
    last_error: str | None = None


class NoHealthyNodeError(RuntimeError):
    """No healthy node of the required role: the router answers 503."""


@dataclass
class PrefixIndex:
    """Approximate page-prefix index per prefill node, learned from routed requests.

    Holds up to `capacity` page keys per node (LRU): a key present for a node means that node
    recently computed or loaded the page chain ending in that key.
    """

    capacity: int = 100_000
    _keys: dict[str, OrderedDict[bytes, None]] = field(default_factory=dict)

    def record(self, node: str, page_keys: Sequence[bytes]) -> None:
        keys = self._keys.setdefault(node, OrderedDict())
        for key in page_keys:
            keys[key] = None
            keys.move_to_end(key)
        while len(keys) > self.capacity:
            keys.popitem(last=False)

    def match_len(self, node: str, page_keys: Sequence[bytes]) -> int:
        """Consecutive leading pages of `page_keys` known on `node`."""
        keys = self._keys.get(node)
        if not keys:
            return 0
        n = 0
        while n < len(page_keys) and page_keys[n] in keys:
            n += 1
        return n

    def forget(self, node: str) -> None:
        self._keys.pop(node, None)


class PairSelector:
    """Picks (prefill, decode) among healthy nodes according to the configured policies."""

    def __init__(self, prefill_policy: str = "round_robin", decode_policy: str = "round_robin",
                 index: PrefixIndex | None = None, balance: int = 0,
                 load: Callable[[NodeState], int] | None = None) -> None:
        """`balance` (cache_aware): the most requests in flight a matching node may have
        beyond the least loaded node and still win; 0: no bound. `load`: a node's requests
        as the policies count them (default its `in_flight`; the router counts the slots it
        granted too: a PD call counts itself only once its task runs, after the rest of a
        burst had picked, and every request of the burst went to one prefill node)."""
        self._load: Callable[[NodeState], int] = load or (lambda node: node.in_flight)
        if prefill_policy not in PREFILL_POLICIES:
            raise ValueError(f"prefill policy must be one of {PREFILL_POLICIES}, got {prefill_policy!r}")
        if decode_policy not in DECODE_POLICIES:
            raise ValueError(f"decode policy must be one of {DECODE_POLICIES}, got {decode_policy!r}")
        self.prefill_policy = prefill_policy
        self.decode_policy = decode_policy
        if balance < 0:
            raise ValueError(f"cache_aware balance must be >= 0, got {balance}")
        self.balance = balance
        self.index = index or PrefixIndex()
        self._turns: dict[str, int] = {}

    def pick_prefill(self, nodes: Sequence[NodeState], page_keys: Sequence[bytes],
                     role: str = "prefill") -> NodeState:
        """The node that computes the prompt: a prefill node, or (role="unified") the unified
        node that serves the whole request, chosen by the prefill policy."""
        healthy = _healthy(nodes, role)
        if self.prefill_policy == "cache_aware" and page_keys:
            best = max(healthy, key=lambda n: (self.index.match_len(n.name, page_keys),
                                               -self._load(n)))
            least = min(healthy, key=self._load)
            if self.index.match_len(best.name, page_keys) > 0 and not self._overloaded(best, least):
                return best
            return least
        return self._pick(healthy, role, self.prefill_policy)

    def _overloaded(self, node: NodeState, least: NodeState) -> bool:
        return self.balance > 0 and self._load(node) - self._load(least) > self.balance

    def pick_decode(self, nodes: Sequence[NodeState]) -> NodeState:
        return self._pick(_healthy(nodes, "decode"), "decode", self.decode_policy)

    def _pick(self, healthy: list[NodeState], role: str, policy: str) -> NodeState:
        if policy == "least_load":
            return min(healthy, key=self._load)
        turn = self._turns.get(role, 0)
        self._turns[role] = turn + 1
        return healthy[turn % len(healthy)]


def _healthy(nodes: Sequence[NodeState], role: str) -> list[NodeState]:
    healthy = [n for n in nodes if n.role == role and n.healthy]
    if not healthy:
        raise NoHealthyNodeError(f"no healthy {role} node")
    return healthy
