"""`TierSettings`: the host and storage tiers' policies that the topology's `[cache]` names
and a node's HiCache runs with, declared once.

`pdcache.config.schema.CacheSpec` (the `[cache]` table) and
`pdcache.offload_manager.hicache.HiCacheConfig` both inherit them; a node's `HiCacheConfig` is
made from its `CacheSpec` with `field_values` (`pdcache.config.node_setup.tiers_for`).
Standard library only, so the schema stays free of torch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, get_args

from pdcache.engine.cache_settings import EvictionPolicy

WritePolicy = Literal["write_through", "write_through_selective", "write_back"]
HostMode = Literal["inclusive", "exclusive"]
PrefetchPolicy = Literal["best_effort", "wait_complete", "timeout"]
PendingPull = Literal["auto", "never", "always"]  # pdcache.offload_manager.page_pull.PULL_MODES
KeyScheme = Literal["pdcache", "sglang"]  # pdcache.engine.page_keys.KEY_SCHEMES
WRITE_POLICIES: tuple[str, ...] = get_args(WritePolicy)
PREFETCH_POLICIES: tuple[str, ...] = get_args(PrefetchPolicy)
HOST_MODES: tuple[str, ...] = get_args(HostMode)


@dataclass(frozen=True, kw_only=True)
class TierSettings:
    """When pages are backed up, which host pages go first, how long a request waits for its
    storage prefetch and for pages a decode node announced, and how stored pages are named.
    Keyword-only, so subclasses keep their own positional fields. Holds no state; the checks
    of a value are `HiCacheConfig`'s (a topology's are `pdcache.config.parse`'s)."""

    # when pages are backed up to host and storage
    write_policy: WritePolicy = "write_through"
    write_through_threshold: int = 2  # hits before backup under write_through_selective
    # which host pages are evicted first: lru or session
    host_eviction: EvictionPolicy = "lru"
    # inclusive: host mirrors the device; exclusive: host holds what it evicted
    host_mode: HostMode = "inclusive"
    # how long a request waits for its storage prefetch
    prefetch_policy: PrefetchPolicy = "timeout"
    prefetch_timeout_base_s: float = 2.0  # timeout policy: base wait for a prefetch
    # timeout policy: extra wait per 1k prefetched tokens
    prefetch_timeout_per_1k_tokens_s: float = 0.1
    # timeout policy: the longest wait; wait_complete: admitted at this whatever is still read
    prefetch_timeout_max_s: float = 30.0
    # a queued request whose device + host match shrank before its admission (tier pressure
    # evicted pages its storage prefetch continues) has its prefetch restarted from the
    # shorter match, at most this many times, instead of recomputing the gap and every
    # prefetched page after it (docs/design.md §4.9, "Prefetch restarts"); 0: off
    prefetch_restarts: int = 1
    # prefill: wait (within the prefetch policy) for pages a decode node announced as being
    # written instead of recomputing them (docs/design.md §4.10, "A durable next turn")
    pending_wait: bool = True
    # prefill: a decode's pending mark lives at most this long here, whatever TTL it announced
    # (bounds the wait under `wait_complete`, which has no deadline of its own)
    pending_max_ttl_s: float = 30.0
    # prefill: pull pending pages from the announcing decode's host staging when that beats
    # waiting for the write by measured costs ("auto"), never ("never": wait), or whenever the
    # decode offers it ("always", for tests) (docs/design.md §4.10)
    pending_pull: PendingPull = "auto"
    # How stored pages are named (pdcache.engine.page_keys.PageKeyScheme): "pdcache", or
    # "sglang" to share pages with SGLang servers running the pdcache storage plugin (whose
    # `key_namespace` must equal this one).
    key_scheme: KeyScheme = "pdcache"
    # appended to the page-key salt: deployments with different ones never share
    key_namespace: str = ""
    # a sliding-window model (gpt-oss) under host/storage tiers: true keeps only its windows
    # on device there too, and stores pages of the full layers plus window tails at hit
    # points (docs/design.md §4.14); false stores every layer of every page (a hit at any
    # page, fewer stored bytes on turns under ~256 new tokens). Deployment-wide: the stored
    # format, prefill's and decode's alike
    window_tiers: bool = False

    def prefetch_timeout_s(self, num_tokens: int) -> float:
        """The `timeout` policy's deadline for a prefetch of `num_tokens` tokens."""
        per_tokens = self.prefetch_timeout_per_1k_tokens_s * num_tokens / 1000
        return min(self.prefetch_timeout_base_s + per_tokens, self.prefetch_timeout_max_s)
