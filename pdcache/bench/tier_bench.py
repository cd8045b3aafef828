"""`pdcache bench tiers`: hits per cache tier under pressure, one row per tier policy, in one
run, in-process (a tiered engine, no storage, no HTTP).

The trace: `--sessions` conversations take `--turns` turns round robin (the cyclic pattern of
agentic sessions); turn t's prompt is turn t-1's prompt + its answer + `--turn-tokens` new
tokens. The device pool holds `--device-ratio` of the last round's working set (all sessions'
final contexts), the host pool `--host-ratio` of the device pool. Each row replays the same
trace on a fresh engine with one (device_eviction, host_eviction, host_mode) and reports the
prompt tokens served by each tier against the theoretical reuse (every previous turn's prompt
+ answer, in whole pages). Requests run one at a time, so hit counts are deterministic; each engine serves one warm-up
request first (then its tiers are emptied), so TTFTs compare like with like.
"""

from __future__ import annotations

import argparse
import random
import time
from dataclasses import dataclass
from typing import Any

from pdcache.bench.table import emit

DEFAULT_POLICIES = (
    "lru/lru/inclusive,lru/lru/exclusive,session/session/inclusive,session/session/exclusive"
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--preset", default="tiny", help="model preset (random weights)")
    parser.add_argument("--sessions", type=int, default=16)
    parser.add_argument("--turns", type=int, default=5)
    parser.add_argument("--turn-tokens", type=int, default=96, help="new user tokens per turn")
    parser.add_argument("--answer-tokens", type=int, default=16, help="generated per turn")
    parser.add_argument("--page-size", type=int, default=16)
    parser.add_argument(
        "--device-ratio", type=float, default=0.5, help="device pool / the last round's working set"
    )
    parser.add_argument("--host-ratio", type=float, default=1.0, help="host pool / device pool")
    parser.add_argument(
        "--policies", default=DEFAULT_POLICIES, help="comma-separated DEVICE/HOST/MODE triples"
    )
    parser.add_argument("--seed", type=int, default=0)


@dataclass
class Tally:
    prompt_tokens: int = 0
    theoretical: int = 0
    device: int = 0
    host: int = 0
    ttft_s: float = 0.0
    requests: int = 0


def _pages(tokens: int, page_size: int) -> int:
    return tokens // page_size


def _device_pages(args: argparse.Namespace) -> int:
    final_context = args.turns * (args.turn_tokens + args.answer_tokens)
    working_set = args.sessions * (final_context // args.page_size + 1)
    # at least one request's prompt + answer, so every turn can run
    return max(int(working_set * args.device_ratio), final_context // args.page_size + 4)


def _replay(args: argparse.Namespace, model: Any, device: str, host: str, mode: str) -> Tally:
    from pdcache.engine.api import GenerateRequest, SamplingParams
    from pdcache.engine.config import CacheConfig, EngineConfig
    from pdcache.offload_manager.builder import TierConfig, build_tiered_engine
    from pdcache.offload_manager.hicache import HiCacheConfig

    device_pages = _device_pages(args)
    config = EngineConfig(
        model=model.config,
        seed=args.seed,
        cache=CacheConfig(
            page_size=args.page_size, num_device_pages=device_pages, device_eviction=device
        ),
    )
    hicache = HiCacheConfig(host_mode=mode, host_eviction=host)
    tiers = TierConfig(max(1, int(device_pages * args.host_ratio)), hicache)
    built = build_tiered_engine(config, model, None, tiers)
    built.engine.start()
    rng = random.Random(args.seed)
    vocab = model.config.vocab_size
    # warm-up (first forwards of a process are slow), then empty tiers so counts start at 0
    warm = [rng.randrange(3, vocab) for _ in range(args.turn_tokens)]
    built.engine.generate(GenerateRequest("warm-up", warm, SamplingParams(max_new_tokens=2)))
    if not built.engine.drop_cache().flushed:
        raise RuntimeError("the tiers did not empty after the warm-up request")
    histories: list[list[int]] = [[] for _ in range(args.sessions)]
    params = SamplingParams(max_new_tokens=args.answer_tokens, ignore_eos=True)
    tally = Tally()
    try:
        for turn in range(args.turns):
            for session in range(args.sessions):
                reusable = len(histories[session])
                prompt = histories[session] + [
                    rng.randrange(3, vocab) for _ in range(args.turn_tokens)
                ]
                req = GenerateRequest(
                    f"s{session}-t{turn}", prompt, params, session_id=f"s{session}"
                )
                start = time.perf_counter()
                outputs = built.engine.generate(req, timeout=120)
                tally.ttft_s += outputs[-1].ttft_s or (time.perf_counter() - start)
                last = outputs[-1]
                answer = [t for out in outputs for t in out.new_token_ids]
                histories[session] = prompt + answer
                tally.requests += 1
                tally.prompt_tokens += len(prompt)
                tally.theoretical += (
                    _pages(min(reusable, len(prompt) - 1), args.page_size) * args.page_size
                )
                tally.device += last.cached.device
                tally.host += last.cached.host
        built.engine.check_accounting()
    finally:
        built.close()
    return tally


def run(args: argparse.Namespace) -> int:
    from pdcache.engine.loader import load_model

    model, _ = load_model(args.preset, seed=args.seed)
    rows = []
    for triple in args.policies.split(","):
        device, host, mode = triple.split("/")
        tally = _replay(args, model, device, host, mode)
        hits = tally.device + tally.host
        rows.append(
            {
                "device_eviction": device,
                "host_eviction": host,
                "host_mode": mode,
                "device_hit_tokens": tally.device,
                "host_hit_tokens": tally.host,
                "host_share": round(tally.host / hits, 3) if hits else 0.0,
                "hit_rate": round(hits / tally.prompt_tokens, 3),
                "of_theoretical": round(hits / tally.theoretical, 3) if tally.theoretical else 0.0,
                "mean_ttft_ms": round(1000 * tally.ttft_s / tally.requests, 2),
            }
        )
    device_pages = _device_pages(args)
    extra = {
        "device_pages": device_pages,
        "host_pages": max(1, int(device_pages * args.host_ratio)),
        "trace": f"{args.sessions} sessions x {args.turns} turns round robin, "
        f"{args.turn_tokens} new + {args.answer_tokens} answer tokens a turn",
        "theoretical_hit_rate": round(tally.theoretical / tally.prompt_tokens, 3),
    }
    emit("cache hits per tier, by tier policy", rows, args.json_path, extra=extra)
    return 0
