"""The decode reservation book: device pages a prefill node writes a prompt's K/V into.

A decode node `reserve`s the pages (at once, or through the FIFO `pending` queue:
`queue_reservation`, bounded by `SchedulerConfig.max_pending_reservations`, granted in arrival
order by `grant_pending`, which the engine runs after every change that can free pages); then
`Scheduler.add_prefilled` `take`s them to start decoding, or `release` gives them back. A
grant keeps back, besides its own pages, the pages every running and reserved request (itself
included) still needs to decode min(`max_new_tokens`, `decode_reserve_tokens`) answer tokens,
so what is granted never waits for a page within that budget, even with retraction off.
With a prefix tree, a grant's leading prompt pages that the tree holds are reused (locked in
`prefix`; decode's prefix cache, docs/design.md §4.12) and only the rest allocated. That
match is page-only (`RadixTree.match_pages`): a hybrid model's restore rule (a state
checkpoint at the hit's end) does not apply, since a prefilled request's recurrent state
comes from prefill with its pages, never from the tree.

A hybrid model (`PageSource.states`) has only `max_running_requests` request state slots: a
grant (or `reserve`) also needs one left for it beside those of the running, waiting and
already reserved requests, so every granted request finds a slot at `add_prefilled`; until
then it waits in the queue as it does for pages (backpressure, never a failed start).

Each reservation gets exactly one answer, an `Admission` (`admit`, `grant_queued`, `cancel`
build them; the engine hands them to the reservation's `on_done`).

Owned by the scheduler of a role that takes reservations (`RolePolicy.takes_reservations`);
it allocates, locks and frees through that scheduler (`PageSource`). Engine thread only;
nothing here locks.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from pdcache.engine.radix import MatchResult, RadixNode, RadixTree
from pdcache.engine.request import Req, pages_for
from pdcache.engine.scheduler_config import SchedulerConfig
from pdcache.engine.state_cache import StateSlots
from pdcache.engine.window_pages import WindowPages

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Admission:
    """The one answer to `Engine.reserve_when_free` (engine thread). `page_ids` is None when
    no pages were reserved: `reason` is "queue_full", "cancelled" (`cancel_reservation` /
    `abort`) or "shutdown". Granted, the prompt's first `cached_pages` pages are the prefix
    tree's (they hold its K/V already) and `page_ids` are the pages for the rest, in order: the
    ones a prefill node writes. `queued`: it waited in the admission queue, for `waited_s`
    seconds. With window pages (a sliding-window model, docs/design.md §4.14)
    `window_page_ids` are the sliding layers' pages of the prompt's window tail, its pages
    from `window_first_page` on (`WindowPages.tail_pages`): the only sliding pages a prefill
    node writes; empty otherwise."""

    rid: str
    page_ids: list[int] | None
    reason: str = ""
    waited_s: float = 0.0
    queued: bool = False
    cached_pages: int = 0
    window_page_ids: list[int] = field(default_factory=list)
    window_first_page: int = 0

    @property
    def ok(self) -> bool:
        return self.page_ids is not None


@dataclass
class PendingReservation:
    """A reservation waiting for pages: `num_pages` for the prompt, `growth_pages` more that
    its decoding will need; `on_done` is the engine's, called once when it leaves the queue."""

    rid: str
    num_pages: int
    growth_pages: int
    since: float
    on_done: Callable[..., Any]
    # the prompt's leading full pages that the prefix tree may serve (decode's prefix cache:
    # prefill then writes only the pages after them), under `salt`; empty: reserve them all
    prefix_ids: Sequence[int] = ()
    salt: str = ""
    num_tokens: int = 0  # the prompt's tokens: where its window tail is (window pages)


@dataclass(frozen=True)
class ReservedPrefix:
    """The tree's leading pages of a reservation (locked at `match.last_node`) and what they
    hold: `tokens` under `salt`. `add_prefilled` checks the request against both, since its
    release inserts its pages under the request's own tokens and salt."""

    match: MatchResult
    salt: str
    tokens: tuple[int, ...]


class PageSource(Protocol):
    """The scheduler's memory, as the book uses it (engine thread)."""

    tree: RadixTree | None
    running: list[Req]
    waiting: deque[Req]
    states: StateSlots | None  # a hybrid model's recurrent-state slots
    window: WindowPages | None  # a sliding-window model's sliding layers' own pages

    def alloc_pages(self, num_pages: int, reserve: int = 0) -> list[int] | None: ...

    def free_pages(self, page_ids: list[int]) -> None: ...

    def alloc_window_pages(self, num_pages: int) -> list[int] | None: ...

    def free_window_pages(self, page_ids: list[int]) -> None: ...

    def lock(self, node: RadixNode | None) -> None: ...

    def unlock(self, node: RadixNode | None) -> None: ...


class ReservationBook:
    """Reserved pages by rid (`reserved`, plus `prefix` and `growth`), the FIFO `pending`
    queue, and `prefix_pages`: reserved pages the tree served, counted at grant. Mutated by
    the engine thread only (see the module docstring)."""

    def __init__(self, config: SchedulerConfig, page_size: int, max_context: int,
                 memory: PageSource) -> None:
        self.config = config
        self.page_size = page_size
        self.max_context = max_context
        self.memory = memory
        self.reserved: dict[str, list[int]] = {}  # rid -> pages awaiting a K/V transfer
        # rid -> the sliding pages of its prompt's window tail (window pages), awaiting it too
        self.reserved_window: dict[str, list[int]] = {}
        # rid -> the tree's pages that lead a reservation (decode's prefix cache), locked
        self.prefix: dict[str, ReservedPrefix] = {}
        self.growth: dict[str, int] = {}  # rid -> pages its decoding will still need
        self.pending: dict[str, PendingReservation] = {}  # FIFO: waiting for pages
        self.num_tokens: dict[str, int] = {}  # rid -> prompt tokens (window pages only)
        self.prefix_pages = 0

    # ---- what the engine reports -------------------------------------------------------
    @property
    def num_reserved_pages(self) -> int:
        """Pages reserved and not yet taken (the tree's prefix pages are the tree's)."""
        return sum(len(pages) for pages in self.reserved.values())

    @property
    def num_pending_pages(self) -> int:
        return sum(p.num_pages for p in self.pending.values())

    def __len__(self) -> int:
        """Reservations held or waiting (each keeps an engine from being idle)."""
        return len(self.reserved) + len(self.pending)

    # ---- answers ---------------------------------------------------------------------------
    def admit(self, pending: PendingReservation) -> Admission | None:
        """Reserve `pending` now or queue it (`queue_reservation`); its answer when it has one
        now (granted, "queue_full", or "cancelled" for a rid that already has pages or a place
        in the queue), None while it waits in the queue."""
        try:
            decision = self.queue_reservation(pending)
        except ValueError:  # the rid already has pages or a place in the queue
            logger.exception("reservation of %s refused", pending.rid)
            return Admission(pending.rid, None, "cancelled")
        if decision == "granted":
            return self._granted(pending.rid)
        if decision == "queue_full":
            return Admission(pending.rid, None, "queue_full")
        return None

    def grant_queued(self) -> list[tuple[PendingReservation, Admission]]:
        """Grant what fits now from the queue (`grant_pending`), each with its answer."""
        now = time.monotonic()
        return [(pending, self._granted(pending.rid, waited_s=now - pending.since, queued=True))
                for pending in self.grant_pending()]

    def cancel(self, rid: str, reason: str = "cancelled"
               ) -> tuple[PendingReservation, Admission] | None:
        """Take queued `rid` out of the queue, with its answer (`reason`); None if it is not
        waiting."""
        pending = self.cancel_pending(rid)
        if pending is None:
            return None
        return pending, Admission(rid, None, reason, waited_s=time.monotonic() - pending.since,
                                  queued=True)

    def _granted(self, rid: str, waited_s: float = 0.0, queued: bool = False) -> Admission:
        prefix = self.prefix.get(rid)
        window = self.reserved_window.get(rid)
        return Admission(rid, list(self.reserved[rid]), waited_s=waited_s, queued=queued,
                         cached_pages=len(prefix.match.page_ids) if prefix else 0,
                         window_page_ids=list(window or []),
                         window_first_page=self._tail(self.num_tokens.get(rid, 0)).start)

    # ---- reserving -----------------------------------------------------------------------
    def reserve(self, rid: str, num_tokens: int) -> list[int] | None:
        """Pages for `num_tokens` tokens of request `rid`, evicting cache when short; None
        (nothing taken) when they cannot be had."""
        if rid in self.reserved:
            raise ValueError(f"request {rid!r} already has reserved pages")
        if self.memory.window is not None:  # its window tail's pages need an Admission
            raise ValueError(f"request {rid!r}: a sliding-window model with window pages "
                             f"reserves through reserve_when_free")
        if not self._state_slot_left():
            return None
        page_ids = self.memory.alloc_pages(pages_for(num_tokens, self.page_size))
        if page_ids is not None:
            self.reserved[rid] = page_ids
        return page_ids

    def queue_reservation(self, pending: PendingReservation) -> str:
        """Reserve `pending`'s pages now ("granted": they are in `reserved`), or queue it
        behind the others ("queued"), or refuse it ("queue_full"). Nothing is granted out of
        arrival order: with anyone waiting, a newcomer waits too."""
        rid = pending.rid
        if rid in self.reserved or rid in self.pending:
            raise ValueError(f"request {rid!r} already has reserved or pending pages")
        if not self.pending and self._grant(pending):
            return "granted"
        if len(self.pending) >= self.config.max_pending_reservations:
            return "queue_full"
        self.pending[rid] = pending
        return "queued"

    def grant_pending(self) -> list[PendingReservation]:
        """Grant waiting reservations in arrival order while the head fits; the granted."""
        granted: list[PendingReservation] = []
        while self.pending:
            head = next(iter(self.pending.values()))
            if not self._grant(head):
                break
            del self.pending[head.rid]
            granted.append(head)
        return granted

    def cancel_pending(self, rid: str) -> PendingReservation | None:
        """Take `rid` out of the queue (its caller left); None if it is not waiting."""
        return self.pending.pop(rid, None)

    def growth_headroom(self) -> int:
        """Pages the running and reserved requests still need to decode the answer tokens
        their admission kept room for (min(max_new_tokens, decode_reserve_tokens))."""
        need = sum(self.growth.values())
        reserve_tokens = self.config.decode_reserve_tokens
        for req in self.memory.running:
            answer = min(req.sampling.max_new_tokens, reserve_tokens)
            target = min(len(req.prompt_ids) + answer, self.max_context)
            need += max(0, pages_for(target, self.page_size) - len(req.page_ids))
        return need

    def _grant(self, pending: PendingReservation) -> bool:
        """Reserve `pending`'s pages: the tree's leading pages of its prefix (locked, in
        `prefix`) and fresh ones for the rest (in `reserved`)."""
        memory = self.memory
        if not self._state_slot_left():
            return False
        match = self._match_prefix(pending)
        memory.lock(match.last_node)  # before allocating: eviction must not take them
        # its own growth too: everything granted can decode its reserved answer tokens
        reserve = self.growth_headroom() + pending.growth_pages
        page_ids = memory.alloc_pages(pending.num_pages - len(match.page_ids), reserve=reserve)
        if page_ids is None:
            memory.unlock(match.last_node)
            return False
        window_ids = memory.alloc_window_pages(len(self._tail(pending.num_tokens)))
        if window_ids is None:
            memory.free_pages(page_ids)
            memory.unlock(match.last_node)
            return False
        self.reserved[pending.rid] = page_ids
        if memory.window is not None:
            self.reserved_window[pending.rid] = window_ids
            self.num_tokens[pending.rid] = pending.num_tokens
        self.growth[pending.rid] = pending.growth_pages
        if match.page_ids:
            tokens = tuple(pending.prefix_ids[: match.cached_len])
            self.prefix[pending.rid] = ReservedPrefix(match, pending.salt, tokens)
            self.prefix_pages += len(match.page_ids)
        else:
            memory.unlock(match.last_node)
        return True

    def _state_slot_left(self) -> bool:
        """Whether a hybrid model has a request state slot for one more reservation: one
        that no waiting request (re-admitted first) or reservation will take. Always True
        without recurrent state."""
        states = self.memory.states
        if states is None:
            return True
        return states.free_request_slots > len(self.reserved) + len(self.memory.waiting)

    def _match_prefix(self, pending: PendingReservation) -> MatchResult:
        """The tree's pages for `pending.prefix_ids`, leaving at least the prompt's last page
        to prefill (whose forward computes the last token: its page always comes new).
        Page-only: no restore rule applies (a hybrid model's state comes from prefill).
        With window pages it stops before the prompt's window tail, whose sliding pages
        prefill sends (the tree's may be tombstones there)."""
        tree = self.memory.tree
        if tree is None or not pending.prefix_ids:
            return MatchResult([], 0, None)
        limit = min(len(pending.prefix_ids), (pending.num_pages - 1) * self.page_size)
        if self.memory.window is not None:
            limit = min(limit, self._tail(pending.num_tokens).start * self.page_size)
        return tree.match_pages(pending.prefix_ids[:limit], pending.salt)

    # ---- leaving the book ------------------------------------------------------------------
    def release(self, rid: str) -> bool:
        """Free `rid`'s reserved pages and unlock its tree prefix; False if it had none."""
        self.growth.pop(rid, None)
        page_ids = self.reserved.pop(rid, None)
        if page_ids is not None:
            self.memory.free_pages(page_ids)
        self.num_tokens.pop(rid, None)
        self.memory.free_window_pages(self.reserved_window.pop(rid, []))
        prefix = self.prefix.pop(rid, None)
        if prefix is not None:
            self.memory.unlock(prefix.match.last_node)
        return page_ids is not None

    def take(self, req: Req) -> tuple[list[int], MatchResult, list[int | None]]:
        """Hand `req` its reservation to decode on: all its prompt's pages (the tree's prefix,
        then the reserved ones), the tree's prefix match, whose lock `req` now holds, and
        with window pages the sliding page of each (the prefix's, tombstones up to the
        window tail, the tail's reserved ones; empty without window pages).
        Raises ValueError, leaving the reservation in place, when `rid` has none, the page
        count is not the prompt's, or the prompt or salt is not the one its prefix was
        reserved for."""
        own = self.reserved.get(req.rid)
        if own is None:
            raise ValueError(f"request {req.rid!r} has no reserved pages")
        reserved = self.prefix.get(req.rid)
        prefix = reserved.match if reserved else MatchResult([], 0, None)
        page_ids = prefix.page_ids + own
        need = pages_for(len(req.prompt_ids), self.page_size)
        if len(page_ids) != need:
            raise ValueError(
                f"request {req.rid!r} reserved {len(page_ids)} pages, its prompt needs {need}")
        if reserved is not None and (
                reserved.salt != req.salt
                or tuple(req.prompt_ids[: len(reserved.tokens)]) != reserved.tokens):
            # its release would insert the tree's own pages under other tokens or another
            # tenant's salt
            raise ValueError(f"request {req.rid!r} is not the prompt its pages were reserved for")
        window_ids = self._window_ids(req, prefix)
        del self.reserved[req.rid]
        self.reserved_window.pop(req.rid, None)
        self.num_tokens.pop(req.rid, None)
        self.prefix.pop(req.rid, None)
        self.growth.pop(req.rid, None)
        return page_ids, prefix, window_ids

    def prefix_window_pages(self) -> set[int]:
        """The tree's sliding pages the reserved prefixes hold (window pages): they reach
        their requests at `take`, so the tree keeps them (`Scheduler._reclaim_window_pages`)."""
        return {page for reserved in self.prefix.values()
                for page in reserved.match.window_page_ids if page is not None}

    def _window_ids(self, req: Req, prefix: MatchResult) -> list[int | None]:
        """`req`'s sliding pages at `take` (empty without window pages). Raises ValueError
        when its prompt is not as long as the one its window tail was reserved for."""
        if self.memory.window is None:
            return []
        reserved_tokens = self.num_tokens.get(req.rid, 0)
        if reserved_tokens != len(req.prompt_ids):
            raise ValueError(f"request {req.rid!r}: its window tail was reserved for "
                             f"{reserved_tokens} tokens, its prompt has {len(req.prompt_ids)}")
        tail = self._tail(reserved_tokens)
        gap = tail.start - len(prefix.page_ids)
        return [*prefix.window_page_ids, *([None] * gap), *self.reserved_window[req.rid]]

    def _tail(self, num_tokens: int) -> range:
        """The window tail of a prompt of `num_tokens` tokens (empty without window pages)."""
        window = self.memory.window
        return range(0) if window is None else window.tail_pages(num_tokens)
