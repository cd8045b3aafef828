"""`pdcache bench hybrid`: hybrid models on a multi-turn agentic trace, one row per model
preset and state checkpoint policy, in one run, in-process (a unified engine with HiCache:
host pool + file storage, write_through; no HTTP).

The trace is `pdcache.bench.traces.synthetic_trace` (a shared system prompt, then a task per
session, a tool result per later turn, each turn's prompt = the previous prompt + its answer
+ the new tokens), replayed turn by turn round robin over the sessions, one request at a time
(hit counts are deterministic). Each row replays it on a fresh engine with one
`[cache] state_checkpoints` policy (docs/design.md §4.14): hit_points (ours), every_page
(vLLM's `all`), chunk_ends (SGLang's `no_buffer`); a model without recurrent state (gpt-oss)
gets one row, the policy does not apply (its tiers carry window tails, checkpoints at the hit
points: its state bytes are the tails'). It reports:
- the prompt tokens served from cache against two theoretical hits (docs/benchmarks.md
  "Theoretical hit, hybrid models"): the dense one (the longest page-aligned prefix computed
  before, what `bench replay` counts; every_page's upper bound) and the hybrid one at hit
  points (cut to the deepest point where an earlier request's prompt end, answer end or an
  already-seen branch point puts a checkpoint);
- the mean TTFT of turns ≥ 2 against the same turns recomputed (a no-prefix-cache engine);
- per turn: the device checkpoint bytes copied, and the state vs KV bytes written to host
  and to storage; the bytes stored in total (storage, state + KV).
"""

from __future__ import annotations

import argparse
import tempfile
import time
from dataclasses import dataclass
from typing import Any

import numpy as np

from pdcache.bench.table import emit
from pdcache.bench.tokens import BlockExpander, ReuseTracker
from pdcache.bench.traces import SyntheticSpec, Trace, Turn, synthetic_trace

POLICIES = "hit_points,every_page,chunk_ends"
STATELESS = "n/a"  # the policy column of a model without recurrent state
# a sliding-window model's rows (gpt-oss): its tiers' two formats, `[cache] window_tiers` off
# (every layer of every page) and on (full-layer pages + window tails at the hit points)
WINDOW_FORMATS = ("one_space", "window_tails")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--presets", default="small-qwen3-next,small-gpt-oss",
                        help="comma-separated model presets (random weights)")
    parser.add_argument("--policies", default=POLICIES,
                        help="comma-separated [cache] state_checkpoints policies")
    parser.add_argument("--sessions", type=int, default=4)
    parser.add_argument("--turns", type=int, default=3)
    parser.add_argument("--system", type=int, default=240, help="shared system prompt tokens")
    parser.add_argument("--user", type=int, default=64, help="first turn's task tokens")
    parser.add_argument("--tool", type=int, default=96, help="later turns' new tokens")
    parser.add_argument("--answer", type=int, default=32, help="generated tokens per turn")
    parser.add_argument("--page-size", type=int, default=16)
    parser.add_argument("--chunk", type=int, default=128,
                        help="[scheduler] chunked_prefill_tokens (chunk_ends' chunk size)")
    parser.add_argument("--checkpoint-slots", type=int, default=256,
                        help="[cache] state_checkpoint_slots (the host keeps twice as many)")
    parser.add_argument("--seed", type=int, default=0)


@dataclass
class Tally:
    """One row's sums over the trace."""

    prompt_tokens: int = 0
    cached_tokens: int = 0
    dense_theoretical: int = 0
    hybrid_theoretical: int = 0
    later_ttft_s: float = 0.0  # turns >= 2
    later_turns: int = 0
    requests: int = 0
    device_state_bytes: int = 0  # device checkpoint copies
    host_state_bytes: int = 0
    host_kv_bytes: int = 0
    storage_state_bytes: int = 0
    storage_kv_bytes: int = 0
    checkpoints_lost: int = 0  # dropped or skipped for want of a slot


class HybridReuse:
    """The offline theoretical hits of one trace (docs/benchmarks.md): a `ReuseTracker` of
    every computed page (dense) and the page keys that carry a checkpoint at hit points (an
    earlier request's prompt end, its answer end, a branch point seen before). Not
    thread-safe; one per replay."""

    def __init__(self, page_size: int) -> None:
        self.page_size = page_size
        self.dense = ReuseTracker(page_size)
        self.checkpointed: set[bytes] = set()

    def admit(self, prompt: np.ndarray) -> tuple[list[bytes], int, int]:
        """`prompt`'s page keys and its (dense, hybrid) reusable tokens; records its pages
        and the checkpoints its prefill takes (prompt end, branch point)."""
        keys = self.dense.keys(prompt)
        dense = self.dense.reusable_tokens(keys, len(prompt)) // self.page_size
        hybrid = next((n for n in range(dense, 0, -1) if keys[n - 1] in self.checkpointed), 0)
        self.dense.add(keys)
        if dense > hybrid:  # the branch point the engine checkpoints on the way
            self.checkpointed.add(keys[dense - 1])
        if keys:
            self.checkpointed.add(keys[-1])  # the prompt's last full page
        return keys, dense * self.page_size, hybrid * self.page_size

    def finish(self, keys: list[bytes], computed: np.ndarray) -> None:
        """The request computed `computed` (prompt + answer but its last token): its pages
        and its answer-end checkpoint."""
        full = self.dense.extend_keys(keys, computed)
        self.dense.add(full)
        if full:
            self.checkpointed.add(full[-1])


def _order(trace: Trace) -> list[Turn]:
    """Turn by turn, round robin over the sessions (every turn's parent ran before it)."""
    rank = {s.session_id: i for i, s in enumerate(trace.sessions)}
    return sorted(trace.turns(), key=lambda t: (t.turn, rank[t.session_id]))


def _engine_config(args: argparse.Namespace, model: Any, policy: str, prefix_cache: bool) -> Any:
    from pdcache.engine.config import CacheConfig, EngineConfig
    from pdcache.engine.scheduler_config import SchedulerConfig

    cache = CacheConfig(page_size=args.page_size, num_device_pages=4096,
                        state_checkpoint_slots=args.checkpoint_slots,
                        state_checkpoints=policy if policy in POLICIES.split(",")
                        else "hit_points",
                        enable_prefix_cache=prefix_cache)
    return EngineConfig(model=model.config, seed=args.seed, cache=cache,
                        scheduler=SchedulerConfig(chunked_prefill_tokens=args.chunk))


def _stats(engine: Any, hicache: Any) -> dict[str, int]:
    """The counters a turn's bytes are the difference of."""
    stats = engine.stats()
    tiers = vars(hicache.stats)
    return {
        "device_state": stats.get("state_checkpoint_bytes_total", 0),
        "host_state": tiers["backup_host_state_bytes"], "host_kv": tiers["backup_host_kv_bytes"],
        "storage_state": tiers["backup_storage_state_bytes"],
        "storage_kv": tiers["backup_storage_kv_bytes"],
        "lost": stats.get("state_checkpoints_dropped_total", 0)
        + stats.get("state_checkpoints_skipped_total", 0),
    }


def _replay(args: argparse.Namespace, model: Any, trace: Trace, policy: str,
            answers: dict[str, list[int]]) -> Tally:
    """Replay `trace` on a fresh HiCache engine under `policy`; `answers` (request id →
    generated ids) is filled by the first replay and checked by the others (greedy: the
    tokens do not depend on the cache)."""
    from pdcache.engine.api import GenerateRequest, SamplingParams
    from pdcache.offload_manager.builder import (
        TierConfig,
        build_tiered_engine,
        fingerprint_for,
        storage_config_for,
    )
    from pdcache.offload_manager.hicache import HiCacheConfig

    expander = BlockExpander(trace.block_size, model.config.vocab_size, 3, args.seed)
    reuse = HybridReuse(args.page_size)
    tally = Tally()
    with tempfile.TemporaryDirectory(prefix="pdcache-hybrid-") as path:
        tails = policy == "window_tails"
        fingerprint = fingerprint_for(model.config, "bench-hybrid", args.page_size, tails)
        storage = storage_config_for(model.config, args.page_size, fingerprint, tails,
                                     backend="file", path=path, capacity_pages=65536)
        tiers = TierConfig(host_pages=4096, storage=storage,
                           hicache=HiCacheConfig(prefetch_policy="wait_complete"))
        built = build_tiered_engine(_engine_config(args, model, policy, True), model, None,
                                    tiers, window_pages=tails)
        built.engine.start()
        try:
            _warm_up(built.engine, expander)
            if not built.hicache.wait_idle(60) or not built.engine.drop_cache().flushed:
                raise RuntimeError("the tiers did not empty after the warm-up request")
            history: dict[str, np.ndarray] = {}
            for turn in _order(trace):
                new = expander.turn_tokens(turn)
                prompt = np.concatenate([history[turn.session_id], new]) if turn.dependent else new
                keys, dense, hybrid = reuse.admit(prompt)
                before = _stats(built.engine, built.hicache)
                params = SamplingParams(max_new_tokens=turn.output_len, temperature=0.0,
                                        ignore_eos=True)
                outputs = built.engine.generate(GenerateRequest(
                    turn.request_id, [int(t) for t in prompt], params,
                    session_id=turn.session_id), timeout=300)
                if not built.hicache.wait_idle(60):
                    raise RuntimeError("HiCache's writes did not end")
                after = _stats(built.engine, built.hicache)
                answer = [t for out in outputs for t in out.new_token_ids]
                if answers.setdefault(turn.request_id, answer) != answer:
                    raise RuntimeError(f"{turn.request_id}: tokens differ under {policy}")
                full = np.concatenate([prompt, np.asarray(answer, dtype=np.int64)])
                reuse.finish(keys, full[:-1])  # the last token has no KV
                history[turn.session_id] = full
                _count(tally, turn, len(prompt), outputs[-1], dense, hybrid, before, after)
            built.engine.check_accounting()
        finally:
            built.close()
    return tally


def _count(tally: Tally, turn: Turn, prompt_len: int, last: Any, dense: int, hybrid: int,
           before: dict[str, int], after: dict[str, int]) -> None:
    tally.requests += 1
    tally.prompt_tokens += prompt_len
    tally.cached_tokens += last.cached.device + last.cached.host + last.cached.storage
    tally.dense_theoretical += dense
    tally.hybrid_theoretical += hybrid
    if turn.turn >= 1:
        tally.later_ttft_s += last.ttft_s or 0.0
        tally.later_turns += 1
    delta = {key: after[key] - before[key] for key in after}
    tally.device_state_bytes += delta["device_state"]
    tally.host_state_bytes += delta["host_state"]
    tally.host_kv_bytes += delta["host_kv"]
    tally.storage_state_bytes += delta["storage_state"]
    tally.storage_kv_bytes += delta["storage_kv"]
    tally.checkpoints_lost += delta["lost"]


def _recompute_ttft(args: argparse.Namespace, model: Any, trace: Trace,
                    answers: dict[str, list[int]]) -> float:
    """Mean TTFT of turns >= 2 with no prefix cache (the same prompts, recomputed)."""
    from pdcache.engine.api import GenerateRequest, SamplingParams
    from pdcache.engine.engine import Engine

    engine = Engine(_engine_config(args, model, STATELESS, False), model).start()
    expander = BlockExpander(trace.block_size, model.config.vocab_size, 3, args.seed)
    history: dict[str, np.ndarray] = {}
    total, count = 0.0, 0
    try:
        _warm_up(engine, expander)
        for turn in _order(trace):
            new = expander.turn_tokens(turn)
            prompt = np.concatenate([history[turn.session_id], new]) if turn.dependent else new
            history[turn.session_id] = np.concatenate(
                [prompt, np.asarray(answers[turn.request_id], dtype=np.int64)])
            if turn.turn == 0:
                continue
            params = SamplingParams(max_new_tokens=1, temperature=0.0, ignore_eos=True)
            outputs = engine.generate(GenerateRequest(f"re-{turn.request_id}",
                                                      [int(t) for t in prompt], params),
                                      timeout=300)
            total += outputs[-1].ttft_s or 0.0
            count += 1
    finally:
        engine.shutdown()
    return total / count if count else 0.0


def _warm_up(engine: Any, expander: BlockExpander) -> None:
    """One request of tokens no turn starts with: a process's first forwards are slow, so
    every engine serves one before the trace, and TTFTs compare like with like."""
    from pdcache.engine.api import GenerateRequest, SamplingParams

    prompt = [int(t) for t in expander.block(1 << 40)] * 4
    engine.generate(GenerateRequest("warm-up", prompt, SamplingParams(max_new_tokens=2)),
                    timeout=300)


def _row(preset: str, policy: str, tally: Tally, recompute_s: float) -> dict[str, Any]:
    turns = tally.requests
    ttft = tally.later_ttft_s / tally.later_turns if tally.later_turns else 0.0
    stored = tally.storage_state_bytes + tally.storage_kv_bytes
    return {
        "preset": preset, "policy": policy,
        "hit_rate": round(tally.cached_tokens / tally.prompt_tokens, 3),
        "of_dense_theoretical": _ratio(tally.cached_tokens, tally.dense_theoretical),
        # window tails (gpt-oss) are checkpoints at the same hit points as states
        "of_hybrid_theoretical": _ratio(tally.cached_tokens, tally.hybrid_theoretical),
        "ttft_turn2plus_ms": round(1000 * ttft, 1),
        "recompute_ttft_ms": round(1000 * recompute_s, 1),
        "ttft_speedup": _ratio(recompute_s, ttft),
        "device_state_B_per_turn": tally.device_state_bytes // turns,
        "storage_state_B_per_turn": tally.storage_state_bytes // turns,
        "storage_kv_B_per_turn": tally.storage_kv_bytes // turns,
        "state_to_kv_stored": _ratio(tally.storage_state_bytes, tally.storage_kv_bytes),
        "stored_B_total": stored,
        "checkpoints_lost": tally.checkpoints_lost,
    }


def _ratio(a: float, b: float) -> float:
    return round(a / b, 3) if b else 0.0


def run(args: argparse.Namespace) -> int:
    from pdcache.engine.loader import load_model
    from pdcache.engine.window_pages import can_split

    spec = SyntheticSpec(sessions=args.sessions, turns=args.turns, system_prompt=args.system,
                         user=args.user, tool_result=args.tool, answer=args.answer,
                         block=args.page_size, seed=args.seed)
    trace = synthetic_trace(spec)
    rows, extra = [], {}
    for preset in filter(None, args.presets.split(",")):
        started = time.perf_counter()
        model, _ = load_model(preset, seed=args.seed)
        hybrid = model.config.state_geometry is not None
        policies = (args.policies.split(",") if hybrid
                    else list(WINDOW_FORMATS) if can_split(model.config.kv_geometry)
                    else [STATELESS])
        answers: dict[str, list[int]] = {}
        tallies = {policy: _replay(args, model, trace, policy, answers) for policy in policies}
        recompute = _recompute_ttft(args, model, trace, answers)
        rows += [_row(preset, policy, tally, recompute) for policy, tally in tallies.items()]
        first = next(iter(tallies.values()))
        extra[preset] = {
            "dense_theoretical_hit_rate": _ratio(first.dense_theoretical, first.prompt_tokens),
            "hybrid_theoretical_hit_rate":
                _ratio(first.hybrid_theoretical, first.prompt_tokens),
            "state_bytes": model.config.state_geometry.state_bytes() if hybrid else 0,
            "kv_page_bytes": model.config.kv_geometry.page_bytes(args.page_size),
            "seconds": round(time.perf_counter() - started, 1),
        }
    extra["trace"] = (f"synthetic: {args.sessions} sessions x {args.turns} turns round robin, "
                      f"system {args.system}, task {args.user}, tool {args.tool}, answer "
                      f"{args.answer} tokens; page {args.page_size}, chunk {args.chunk}")
    emit("hybrid models: hits, TTFT and state vs KV bytes, by checkpoint policy", rows,
         args.json_path, extra=extra)
    return 0
