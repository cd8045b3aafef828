"""Internal per-request state of the engine (`Req`), owned by the scheduler, and the
`RequestOutput`s built from it (`Req.take_output`).

A request's tokens are `fill_ids = prompt_ids + output_ids`. Its K/V for `fill_ids[:kv_len]`
lives in `page_ids` (page i holds tokens `[i*S, (i+1)*S)`). The first `num_tree_pages` of
them are borrowed from the radix tree (kept alive by locking `last_node`); the rest are the
request's own, allocated from the pool. Engine thread only.

Phases: WAITING → RUNNING (prefill: `kv_len < len(fill_ids)`, in chunks; then decode: each step
computes the K/V of the last sampled token and samples the next, so `kv_len == len(fill_ids)-1`
between steps) → FINISHED. A retracted request goes back to WAITING with its output kept and
re-prefills `fill_ids` (mostly from the cache its retraction inserted).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import Enum
from typing import Protocol

import torch

from pdcache.engine.api import (
    CachedTokens,
    LogprobRequest,
    RequestOutput,
    SamplingParams,
    TokenConstraint,
    TokenLogprob,
)
from pdcache.engine.radix import RadixNode

OutputCallback = Callable[[RequestOutput], None]


class KVLoad(Protocol):
    """A copy of reused K/V into some of a request's device pages that the forward pass
    waits on layer by layer (HiCache host → device load). A load may also have a `failed`
    attribute, True once done when what it copied turned out not to verify (HiCache's
    layer-streamed prefetch) or its copy raised (`copy_error`): `Scheduler.requeue_failed_loads`
    then discards the request's forward and recomputes it."""

    @property
    def done(self) -> bool: ...

    def wait(self, layer: int) -> None: ...

    def finish(self) -> None: ...


class ReqStatus(Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


def pages_for(num_tokens: int, page_size: int) -> int:
    return (num_tokens + page_size - 1) // page_size


@dataclass(eq=False)
class Req:
    rid: str
    prompt_ids: list[int]
    sampling: SamplingParams
    salt: str
    on_output: OutputCallback
    generator: torch.Generator
    page_size: int
    arrival_time: float = field(default_factory=time.perf_counter)
    output_ids: list[int] = field(default_factory=list)
    status: ReqStatus = ReqStatus.WAITING
    page_ids: list[int] = field(default_factory=list)
    num_tree_pages: int = 0
    last_node: RadixNode | None = None
    kv_len: int = 0
    prefill_done: bool = False
    cached_len: int | None = None  # prompt tokens reused at first admission (all tiers)
    cached: CachedTokens | None = None  # ... split by tier
    kv_load: KVLoad | None = None  # pending load into page_ids; every forward completes it
    holding_pages: bool = False  # finished, but its pages stay until the scheduler releases them
    # set by the scheduler's `hold_after_finish`: the finished request's last output is handed
    # to `on_output` through it (`gate(deliver)` calls deliver once it may go, on any thread);
    # decode's answer waits until prefill recorded its pending pages (docs/design.md §4.10)
    output_gate: Callable[[Callable[[], None]], None] | None = None
    # a held request's pages the tree already had copies of: swapped out of page_ids by
    # cache_prompt but still read by whoever holds them (the KV sender), freed on release
    deferred_free_page_ids: list[int] = field(default_factory=list)
    computed_tokens: int = 0  # tokens run through an extend forward (recomputation included)
    session_id: str = ""  # the conversation it is a turn of ("" = none; eviction policies)
    num_emitted: int = 0  # output tokens already handed to on_output
    admit_seq: int = -1
    num_retractions: int = 0
    # a copy of lower-tier K/V into its pages raised: it recomputes instead of loading again
    # (a copy that fails every time would requeue it for good)
    skip_lower_tiers: bool = False
    first_token_time: float | None = None
    finish_reason: str | None = None
    error: str | None = None
    logprobs: LogprobRequest | None = None
    constraint: TokenConstraint | None = None
    prefill_leader: str | None = None  # not admitted before that request's prompt is cached
    output_logprobs: list[TokenLogprob] = field(default_factory=list)  # with `logprobs`
    input_logprobs: list[TokenLogprob] | None = None  # filled by the first prefill
    input_logprobs_sent: bool = False
    # hybrid models (pdcache.engine.state_cache): its recurrent-state slot while running (the
    # state after `kv_len` tokens), the page-aligned lengths where a prefill chunk ends to
    # take a checkpoint (ascending), and its pending decode checkpoint (a slot holding the
    # state after `pending_checkpoint_len` tokens, its last full page so far)
    state_slot: int | None = None
    checkpoint_at: list[int] = field(default_factory=list)
    pending_checkpoint: int | None = None
    pending_checkpoint_len: int = 0
    # window pages (pdcache.engine.window_pages): the sliding layers' page of each of
    # `page_ids` up to the last page scheduled (given a prefill chunk at a time; the first
    # `num_tree_pages` the tree's), None where no window needs it any
    # more and it was freed; empty for other models
    window_page_ids: list[int | None] = field(default_factory=list)

    @property
    def wants_input_logprobs(self) -> bool:
        """Prompt logprobs asked for and not complete yet: the prefill must compute the
        logits of every prompt position from `logprobs.input_start` on."""
        # complete once the first prefill sampled a token (a retraction re-prefills without)
        return self.logprobs is not None and self.logprobs.input_start is not None and (
            not self.output_ids)

    @property
    def max_reuse_len(self) -> int:
        """Tokens of the fill whose cached K/V admission may reuse: all but the last (its
        logits give the next token), and none from `input_start` on while prompt logprobs are
        wanted (those positions need their logits, so cached pages there are recomputed)."""
        limit = self.fill_len - 1
        if self.wants_input_logprobs and self.logprobs is not None:
            limit = min(limit, self.logprobs.input_start or 0)
        return limit

    def input_logprob_positions(self, start: int, end: int) -> tuple[int, int]:
        """The positions in `[start, end)` (a chunk being computed) whose logits give a prompt
        logprob: `[input_start, len(prompt) - 1)`; an empty range `(x, x)` when none."""
        if not self.wants_input_logprobs or self.logprobs is None:
            return (start, start)
        first = max(start, self.logprobs.input_start or 0)
        last = min(end, len(self.prompt_ids) - 1)
        return (first, max(first, last))

    @property
    def fill_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    def fill_slice(self, start: int, end: int) -> list[int]:
        """`fill_ids[start:end]` without building the whole fill (decode reads one token)."""
        num_prompt = len(self.prompt_ids)
        if end <= num_prompt:
            return self.prompt_ids[start:end]
        if start >= num_prompt:
            return self.output_ids[start - num_prompt : end - num_prompt]
        return self.prompt_ids[start:] + self.output_ids[: end - num_prompt]

    @property
    def fill_len(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def num_own_pages(self) -> int:
        return len(self.page_ids) - self.num_tree_pages

    @property
    def own_page_ids(self) -> list[int]:
        return self.page_ids[self.num_tree_pages :]

    @property
    def own_window_page_ids(self) -> list[int]:
        """The sliding pages this request owns (present ones after the tree's)."""
        return [page for page in self.window_page_ids[self.num_tree_pages :] if page is not None]

    @property
    def finished(self) -> bool:
        return self.status is ReqStatus.FINISHED

    def admit(
        self,
        page_ids: list[int],
        num_tree_pages: int,
        node: RadixNode | None,
        reused_len: int,
        seq: int,
        cached: CachedTokens | None = None,
        kv_load: KVLoad | None = None,
        window_page_ids: list[int | None] | None = None,
    ) -> None:
        """WAITING → RUNNING holding `page_ids`, the first `num_tree_pages` borrowed from the
        tree (alive while `node` is locked), with the K/V of `reused_len` tokens reused (and
        `window_page_ids`, the sliding layers' pages, with window pages)."""
        assert self.status is ReqStatus.WAITING and not self.page_ids, "admit of a running req"
        assert reused_len % self.page_size == 0 and reused_len < self.fill_len, reused_len
        self.page_ids, self.num_tree_pages, self.last_node = page_ids, num_tree_pages, node
        self.window_page_ids = list(window_page_ids or [])
        self.kv_len = reused_len
        self.kv_load = kv_load
        if self.wants_input_logprobs and self.logprobs is not None:
            # (re)start the prompt logprobs: a retraction mid-prefill recomputes them
            start = self.logprobs.input_start or 0
            assert reused_len <= start, (reused_len, start)
            self.input_logprobs = (
                [TokenLogprob(self.prompt_ids[start], None)] if start < len(self.prompt_ids) else [])
        if self.cached_len is None:
            self.cached_len = reused_len
            self.cached = cached or CachedTokens(device=reused_len)
        self.status = ReqStatus.RUNNING
        self.admit_seq = seq
        self.check()

    def admit_prefilled(self, page_ids: list[int], first_token: int, seq: int,
                        first_logprob: TokenLogprob | None = None, *,
                        num_tree_pages: int = 0, last_node: RadixNode | None = None,
                        window_page_ids: list[int | None] | None = None) -> None:
        """WAITING → RUNNING in decode state: the K/V of the whole prompt is already in
        `page_ids` (the first `num_tree_pages` the tree's, locked at `last_node`; the rest
        written by a prefill node) and `first_token` was sampled there (with `first_logprob`,
        when it sent one); with window pages, its sliding layers' in `window_page_ids`
        (None: a tombstone; the prompt's window tail is there)."""
        assert self.status is ReqStatus.WAITING and not self.output_ids, "not a fresh request"
        assert len(page_ids) == pages_for(len(self.prompt_ids), self.page_size), "page count"
        self.page_ids, self.num_tree_pages, self.last_node = page_ids, num_tree_pages, last_node
        self.window_page_ids = list(window_page_ids or [])
        self.kv_len = len(self.prompt_ids)
        self.cached_len, self.cached = 0, CachedTokens()
        self.append_token(first_token, first_logprob)
        self.prefill_done = True
        self.status = ReqStatus.RUNNING
        self.admit_seq = seq
        self.check()

    def release_pages(self) -> None:
        """Forget all pages (the scheduler has already freed or handed them to the tree)."""
        assert self.kv_load is None or self.kv_load.done, "pages released under a pending load"
        self.kv_load = None
        self.page_ids, self.num_tree_pages, self.last_node = [], 0, None
        self.window_page_ids = []
        self.kv_len, self.prefill_done = 0, False

    def append_token(self, token_id: int, logprob: TokenLogprob | None = None) -> None:
        if self.first_token_time is None:
            self.first_token_time = time.perf_counter()
        self.output_ids.append(token_id)
        if self.logprobs is not None:
            self.output_logprobs.append(logprob or TokenLogprob(token_id, None))

    def take_new_tokens(self) -> list[int]:
        """Output tokens not yet emitted; marks them emitted (see `take_new_logprobs`)."""
        new = self.output_ids[self.num_emitted :]
        self.num_emitted = len(self.output_ids)
        return new

    def take_new_logprobs(self, num_new: int) -> list[TokenLogprob]:
        """The logprobs of the `num_new` tokens `take_new_tokens` just returned."""
        if self.logprobs is None or num_new == 0:
            return []
        return self.output_logprobs[len(self.output_logprobs) - num_new :]

    def take_output(self) -> RequestOutput:
        """The output of this step: the tokens (and logprobs) not yet emitted, marked emitted,
        and the prompt logprobs on the first output that has them. Once the prompt is matched
        every output carries the prompt's numbers (SGLang's first stream chunk carries
        prompt_tokens and cached_tokens; its clients read them there); the finished one also
        the statistics. Engine thread (the thread that owns the request)."""
        new_tokens = self.take_new_tokens()
        new_logprobs = self.take_new_logprobs(len(new_tokens))
        prompt_logprobs = None
        if self.input_logprobs is not None and not self.input_logprobs_sent:
            prompt_logprobs, self.input_logprobs_sent = list(self.input_logprobs), True
        if not self.finished:
            if self.cached is None:
                return RequestOutput(rid=self.rid, new_token_ids=new_tokens,
                                     new_logprobs=new_logprobs, input_logprobs=prompt_logprobs)
            return RequestOutput(rid=self.rid, new_token_ids=new_tokens,
                                 new_logprobs=new_logprobs, input_logprobs=prompt_logprobs,
                                 prompt_tokens=len(self.prompt_ids), cached=self.cached,
                                 computed_tokens=self.computed_tokens)
        now = time.perf_counter()
        first = self.first_token_time
        return RequestOutput(
            rid=self.rid,
            new_token_ids=new_tokens,
            finished=True,
            finish_reason=self.finish_reason,
            error=self.error,
            prompt_tokens=len(self.prompt_ids),
            completion_tokens=len(self.output_ids),
            cached=self.cached or CachedTokens(),
            computed_tokens=self.computed_tokens,
            ttft_s=None if first is None else first - self.arrival_time,
            e2e_s=now - self.arrival_time,
            new_logprobs=new_logprobs,
            input_logprobs=prompt_logprobs,
        )

    def check(self) -> None:
        """Assert the length invariants that tie tokens, K/V and pages together."""
        size = self.page_size
        assert 0 <= self.kv_len <= self.fill_len, (self.rid, self.kv_len, self.fill_len)
        assert len(self.page_ids) * size >= self.kv_len, "K/V beyond the request's pages"
        assert 0 <= self.num_tree_pages <= len(self.page_ids), "tree pages beyond page_ids"
        assert self.num_tree_pages * size <= self.kv_len, "reused pages not counted in kv_len"
        assert len(self.output_ids) <= self.sampling.max_new_tokens, "too many output tokens"
        if self.status is ReqStatus.RUNNING:
            assert len(self.page_ids) <= pages_for(self.fill_len, size), "over-allocated"
            if self.prefill_done:
                assert self.kv_len == self.fill_len - 1, "decode state out of step"
        else:
            # a held request keeps its pending decode checkpoint until its pages go
            assert self.state_slot is None and (
                self.pending_checkpoint is None or self.holding_pages), (
                "a state slot held while not running")
            if not self.holding_pages:
                assert not self.page_ids and self.last_node is None, (
                    "pages held while not running")
        if self.window_page_ids:  # allocated a chunk at a time: every computed page has one
            assert len(self.window_page_ids) <= len(self.page_ids), "window pages > pages"
            assert len(self.window_page_ids) * size >= self.kv_len, "K/V without sliding pages"
            assert None not in self.window_page_ids[self.kv_len // size :], (
                "a sliding page freed inside the window")
        if self.pending_checkpoint is not None:
            assert self.pending_checkpoint_len % size == 0, "unaligned decode checkpoint"
            assert 0 < self.pending_checkpoint_len <= self.kv_len, "checkpoint past the K/V"
