"""Token-exact prompts from block ids, and the theoretical reusable fraction of a replay.

Expansion. Block id `h` expands to `block_size` tokens drawn from
`numpy.random.default_rng([seed, h])` uniformly in `[vocab_low, vocab_high)`. Equal ids give
equal blocks whatever the tokenizer (the server only ever sees token ids), different ids give
different blocks (with overwhelming probability), and a run of blocks with `num_tokens`
tokens is the concatenation trimmed to `num_tokens` (only the run's last block is partial).

Theoretical reusable fraction (page granularity). A request's *cacheable sequences* are its
prompt, cacheable once the request's first output token has arrived (its prefill is done;
without streaming: once it completed), and its prompt followed by the ids the server
generated for it except the last one, cacheable once it completed (the last sampled token
was never run through the model, so no server holds its KV). For a request `r` with prompt
`p` (P = page_size), evaluated at the moment `r` is dispatched:

    seen_pages(r) = the largest k such that the first k*P tokens of p equal the first k*P
                    tokens of a sequence that was cacheable at that moment
    reusable(r)   = P * min(seen_pages(r), floor((len(p) - 1) / P))

The cap keeps at least the last prompt token computed: a server must run it to produce the
first output token, so even a fully cached prompt cannot reuse its last page when the prompt is
page-aligned. The theoretical hit rate of a run is sum(reusable) / sum(len(prompt)) over the
same requests as the measured one. It is the hit rate of an infinite, instantly filled cache
holding prompts and (decode-offloaded) answers, filled the moment each part exists: a prompt
still being prefilled by a concurrent request does not count, since no server can reuse it
either. Chained page keys (`engine.page_keys`, the same function the servers use) make
"page k seen" equivalent to "prefix up to page k seen".

Offline (`theoretical_reuse`), requests are ordered by round (turn index of dependent turns,
0 for independent ones), then by arrival time, and each one completes before the next starts;
generated output is stood in for by pseudo-random tokens of the trace's output length unique
to the request (chained keys make only the prefix relation matter, not the token values).
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np

from pdcache.bench.traces import Blocks, Trace, Turn
from pdcache.engine.page_keys import chain_page_keys

BENCH_SALT = b"pdcache-bench-theoretical"


@dataclass
class BlockExpander:
    """Expands block ids into token ids; owns a small cache of expanded blocks."""

    block_size: int
    vocab_high: int
    vocab_low: int = 0
    seed: int = 0
    cache_limit: int = 65536

    def __post_init__(self) -> None:
        if not 0 <= self.vocab_low < self.vocab_high:
            raise ValueError(f"bad vocab range [{self.vocab_low}, {self.vocab_high})")
        self._cache: dict[int, np.ndarray] = {}

    def block(self, block_id: int) -> np.ndarray:
        tokens = self._cache.get(block_id)
        if tokens is None:
            rng = np.random.default_rng([self.seed, int(block_id)])
            tokens = rng.integers(self.vocab_low, self.vocab_high, self.block_size, dtype=np.int64)
            if len(self._cache) >= self.cache_limit:
                self._cache.clear()
            self._cache[block_id] = tokens
        return tokens

    def expand(self, blocks: Blocks) -> np.ndarray:
        if blocks.num_tokens > len(blocks.ids) * self.block_size:
            raise ValueError(
                f"{blocks.num_tokens} tokens need more than {len(blocks.ids)} blocks of "
                f"{self.block_size}"
            )
        if not blocks.ids:
            return np.zeros(0, dtype=np.int64)
        return np.concatenate([self.block(h) for h in blocks.ids])[: blocks.num_tokens]

    def turn_tokens(self, turn: Turn) -> np.ndarray:
        """This turn's new input (or whole prompt when it carries no history)."""
        parts = [self.expand(b) for b in turn.inputs]
        return np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)

    def placeholder_output(self, request_id: str, length: int) -> np.ndarray:
        """Stand-in for generated ids in offline computations: unique to the request."""
        digest = hashlib.sha256(request_id.encode()).digest()
        rng = np.random.default_rng([self.seed, 1 << 40, int.from_bytes(digest[:8], "little")])
        return rng.integers(self.vocab_low, self.vocab_high, length, dtype=np.int64)


class ReuseTracker:
    """Set of page keys of everything cacheable so far; answers `reusable_tokens(prompt)`.

    Not thread-safe: one tracker per replay, used from the event loop only.
    """

    def __init__(self, page_size: int, salt: bytes = BENCH_SALT) -> None:
        self.page_size = page_size
        self.salt = salt
        self._seen: set[bytes] = set()

    def keys(self, tokens: np.ndarray | Sequence[int]) -> list[bytes]:
        return chain_page_keys(np.asarray(tokens, dtype=np.int64), self.page_size, self.salt)

    def reusable_tokens(self, prompt_keys: list[bytes], prompt_len: int) -> int:
        seen = 0
        for key in prompt_keys:
            if key not in self._seen:
                break
            seen += 1
        return self.page_size * min(seen, max(0, (prompt_len - 1) // self.page_size))

    def add(self, keys: Iterable[bytes]) -> None:
        self._seen.update(keys)

    def extend_keys(self, prompt_keys: list[bytes], sequence: np.ndarray) -> list[bytes]:
        """Keys of `sequence` (= prompt + more) reusing the prompt's full-page keys."""
        done = len(prompt_keys)
        prev = prompt_keys[-1] if prompt_keys else None
        rest = np.asarray(sequence[done * self.page_size :], dtype=np.int64)
        return prompt_keys + chain_page_keys(rest, self.page_size, self.salt, prev_key=prev)


@dataclass(frozen=True)
class TurnReuse:
    request_id: str
    session_id: str
    turn: int
    prompt_tokens: int
    reusable_tokens: int


def _offline_order(trace: Trace) -> list[Turn]:
    turns = list(trace.turns())
    session_rank = {s.session_id: i for i, s in enumerate(trace.sessions)}
    return sorted(turns, key=lambda t: (
        t.turn if t.with_history else 0, t.arrival_s, session_rank[t.session_id], t.turn))


def theoretical_reuse(
    trace: Trace, page_size: int, expander: BlockExpander
) -> list[TurnReuse]:
    """Per-request reusable tokens of `trace` replayed offline (see the module docstring)."""
    tracker = ReuseTracker(page_size)
    history: dict[str, np.ndarray] = {}  # session -> prompt + output of its last turn
    result = []
    for turn in _offline_order(trace):
        new = expander.turn_tokens(turn)
        prompt = np.concatenate([history[turn.session_id], new]) if turn.dependent else new
        keys = tracker.keys(prompt)
        reusable = tracker.reusable_tokens(keys, len(prompt))
        tracker.add(keys)
        full = np.concatenate([prompt, expander.placeholder_output(turn.request_id,
                                                                   turn.output_len)])
        tracker.add(tracker.extend_keys(keys, full[:-1]))  # the last token has no KV
        history[turn.session_id] = full
        result.append(TurnReuse(turn.request_id, turn.session_id, turn.turn, len(prompt),
                                reusable))
    return result


def hit_rate(reuse: Sequence[TurnReuse]) -> float:
    prompt = sum(r.prompt_tokens for r in reuse)
    return sum(r.reusable_tokens for r in reuse) / prompt if prompt else 0.0
