"""One simulated request: the trace turn it plays, its prompt as page tokens, where it is in
its life (router queue, prefill, transfer, decode) and the record it leaves.

The record is `pdcache.bench.replay_records.RequestRecord`, the very line `bench replay`
writes to requests.jsonl, so the replay's report (`pdcache.bench.report`) summarises a
simulated run with the same definitions as a measured one.
"""

from __future__ import annotations

from dataclasses import dataclass

from pdcache.bench.replay_records import RequestRecord
from pdcache.bench.traces import Session, Turn
from pdcache.router.route import Route
from pdcache.sim.cache import Hold


@dataclass(eq=False)
class SimRequest:
    """A request in flight; mutated by the router, its nodes and the driver, in turn."""

    rec: RequestRecord
    session: Session
    index: int  # the turn's position in its session
    turn: Turn
    prompt_len: int
    max_new: int
    keys: list[bytes]  # chained page keys of the prompt's full pages
    pages: list[int]  # their page tokens
    answer_pages: list[int]  # page tokens of prompt + answer but its last token (full pages)
    released_s: float  # when the client sent it
    page_size: int
    route: Route | None = None
    # prefill
    stored_start: int = 0  # the first prompt page the storage prefetch read
    stored_end: int = 0  # pages up to which it covered the prompt
    stored_decode_flags: tuple[bool, ...] = ()  # per page read: written by a decode node
    prefetch_done_s: float | None = None  # best_effort: when the read ends
    ready_s: float = 0.0  # when its prefetch let it be scheduled
    queued_first: int = 0  # device + host pages its prefetch started after (restarts)
    restarts_left: int = 0  # prefetch restarts left (`[cache] prefetch_restarts`)
    prefetch_deadline_s: float = float("inf")  # the first read's deadline (`timeout`)
    prefetch_late: bool = False  # the read was still running at its deadline
    gated: bool = False  # PD: waits for its decode node's K/V request before computing
    prefill_hold: Hold | None = None
    computed: int = 0  # prompt tokens computed so far
    to_compute: int = 0
    load_s: float = 0.0  # host -> device load time charged to its first chunk
    prefill_done_s: float | None = None
    # decode
    decode_hold: Hold | None = None
    decode_held_pages: int = 0  # prompt pages the decode node already held (not sent)
    generated: int = 0  # output tokens so far
    first_token_s: float | None = None
    tpot_s: float | None = None
    finished: bool = False
    # the engine's page accounting (unified and decode nodes)
    admit_seq: int = 0  # admission order on its node: retraction takes the newest
    retractions: int = 0  # times a unified node retracted it (it re-prefills its fill)

    @property
    def total_prompt_pages(self) -> int:
        return -(-self.prompt_len // self.page_size)

    @property
    def total_pages(self) -> int:
        """Pages of the prompt and the whole answer."""
        return -(-(self.prompt_len + self.max_new) // self.page_size)

    @property
    def reuse_cap(self) -> int:
        """Pages that may count as reused: the last prompt token is always computed."""
        return max(0, (self.prompt_len - 1) // self.page_size)

    @property
    def fill_len(self) -> int:
        """Tokens a (re-)prefill computes K/V for: the prompt and the answer so far."""
        return self.prompt_len + self.generated

    @property
    def kv_len(self) -> int:
        """Decoding: tokens with K/V (the newest sampled token's is computed next)."""
        return self.prompt_len + self.generated - 1

    @property
    def context(self) -> int:
        """Tokens in the request's KV now (prompt computed or reused, answer so far)."""
        return self.prompt_len + self.generated
