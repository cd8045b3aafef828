"""`SchedulerConfig`: the engine's continuous-batching limits, and the topology's `[scheduler]`.

One dataclass serves both: `pdcache.config.schema` embeds it as the `[scheduler]` table (and
`[node.scheduler]` overrides), `pdcache.config.parse` builds it from TOML, and the engine reads
the very object the node's topology holds. It imports nothing but the standard library, so
the launcher and the schema stay free of torch.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class SchedulerConfig:
    """`[scheduler]` (and per-node `[node.scheduler]` overrides): continuous-batching limits.

    The token budget bounds each prefill chunk. `max_pending_reservations` bounds the decode
    node's admission queue: PD requests whose pages cannot be reserved yet wait there, in
    arrival order, until running requests free them (`Engine.reserve_when_free`); 0 refuses
    at once when the pool is short. `decode_reserve_tokens` is how much of a request's answer
    an admission keeps room for (at most its `max_new_tokens`): a client that sends no
    `max_tokens` asks for the whole context, and keeping room for all of it would admit one
    such request at a time. Past it, decoding takes pages as they free (retraction where
    offload allows it), as SGLang's reserved decode tokens do; with offload on and every
    request past its reserve, decoding can stall until requests finish or reach their
    deadline.

    `decode_step_interval_ms` (0: off) is the least time from the start of one decode step to
    the next (`DecodePacer.pace`): a decode node that shares its host's CPU with prefill
    trades TPOT for the prefill's TTFT, as a unified engine does when it puts prefill chunks
    between decode steps.

    `compute_share` (None: off) names the file through which engines that share compute (one
    host's cores, one GPU) order their work as one unified engine would: an engine announces
    while it has prefill work (queued or computing), and one about to run a decode step holds
    it back while another announces, at most `decode_yield_max_ms`
    (`pdcache.engine.compute_share`, docs/design.md §4.13).

    Plain data: a topology's values are checked, with its stricter bounds, by
    `pdcache.config.validate`; `check` holds what the engine itself needs and runs when an
    `EngineConfig` is built."""

    max_running_requests: int = 64  # requests decoding at once
    chunked_prefill_tokens: int = 2048  # token budget of one prefill chunk
    # requests waiting for admission before new ones are refused (503)
    max_queued_requests: int = 1024
    max_pending_reservations: int = 256  # decode: reservations waiting for pages (0: refuse)
    decode_reserve_tokens: int = 512  # decode: answer tokens an admission keeps room for
    decode_step_interval_ms: int = 0  # least time between decode step starts (0: off)
    # a file (local filesystem) every node sharing this node's compute names too: decode steps
    # wait while prefill has work (docs/design.md §4.13); unset: off
    compute_share: str | None = None
    decode_yield_max_ms: int = 300  # the longest a decode step waits for prefill there

    def check(self) -> None:
        """Raise ValueError for values no engine can run with."""
        if self.decode_step_interval_ms < 0:
            raise ValueError("decode_step_interval_ms must be >= 0")
        if self.decode_yield_max_ms < 1:
            raise ValueError("decode_yield_max_ms must be >= 1")
        if self.compute_share == "":
            raise ValueError("compute_share must name a file (None: off)")
