"""`pdcache sim calibrate --serving-unified CFG [--serving-pd CFG]`: the profile's `[serving]`
table, measured on real running stacks.

The compute tables time the model's forward in process; a real request also pays the client's
HTTP, the router's hop, the node's HTTP and tokeniser, the engine's step loop (scheduling,
sampling, streaming each token) and, once per node, the first forward's warm-up; a PD request
also pays the decode side's handling of the handoff. Those costs are read here as the gap
between a real run and the simulator's prediction of the same run from the compute tables
alone, on a trivial trace (`SERVING_TRACE`: one-turn requests of 32 tokens and 8 answer
tokens, 17 of them, sent one at a time, so no queueing and no reuse enter either side):

- `warmup_s`: the first request's TTFT minus the median of the others (real run);
- `step_s`: the real median TPOT minus the simulated one (one decode step per token);
- `request_s`: the real median TTFT minus the simulated one with `step_s` charged (unified);
- `handoff_s`: the same gap on the PD config, with `request_s`, `step_s` and `warmup_s`
  charged (0 without `--serving-pd`);
- `decode_warmup_s`: on the PD config, the first request's time after its first token minus
  the others' median (0 without `--serving-pd`).

Each gap is clamped at 0 (a model already slower than the real stack gains no negative cost).
"""

from __future__ import annotations

import argparse
import statistics
from dataclasses import replace
from pathlib import Path
from typing import Any

from pdcache.sim.profile import Profile, ServingCost

# one-turn requests, one at a time: a fixed prompt, a few answer tokens, nothing reused
SERVING_TRACE = ("synthetic:sessions=17,turns=1,system_prompt=0,user=32,answer=8,think=0,"
                 "seed=7")


def serving_replay(page_size: int) -> Any:
    from pdcache.bench.replay_config import ReplayConfig

    return ReplayConfig(trace=SERVING_TRACE, mode="afap", concurrency=1, page_size=page_size,
                        progress=False, plots=False)


def _ordered(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    ok = sorted((r for r in records if r.get("ok")), key=lambda r: r["dispatch_s"])
    if len(ok) < 3:
        raise ValueError(f"serving calibration: {len(ok)} requests succeeded, need 3 or more")
    return ok


def _decode_warmup(records: list[dict[str, Any]]) -> float:
    """The first request's time after its first token minus the others' median: the
    decode node's first step (its first K/V receive and decode forward)."""
    ok = _ordered(records)
    tails = [r["e2e_s"] - r["ttft_s"] for r in ok]
    return max(0.0, tails[0] - statistics.median(tails[1:]))


def _medians(records: list[dict[str, Any]]) -> tuple[float, float, float]:
    """(first request's TTFT, median TTFT of the others, median TPOT of the others)."""
    ok = _ordered(records)
    rest = ok[1:]
    tpots = [_tpot(r) for r in rest]
    return (float(ok[0]["ttft_s"]), statistics.median(r["ttft_s"] for r in rest),
            statistics.median(t for t in tpots if t is not None) if any(
                t is not None for t in tpots) else 0.0)


def _tpot(record: dict[str, Any]) -> float | None:
    if record.get("tpot_s") is not None:
        return float(record["tpot_s"])
    out, e2e, ttft = record.get("output_tokens") or 0, record.get("e2e_s"), record.get("ttft_s")
    if out < 2 or e2e is None or ttft is None:
        return None
    return (e2e - ttft) / (out - 1)


def _real(args: argparse.Namespace, config_arg: str, out: Path) -> list[dict[str, Any]]:
    from pdcache.bench.compare import run_one
    from pdcache.bench.stack import parse_config_arg

    run = parse_config_arg(config_arg, args.serving_set)
    outcome = run_one(args, serving_replay(args.page_size), run, out)
    if outcome.error:
        raise ValueError(f"serving calibration: {run.label}: {outcome.error}")
    return [dict(r.__dict__) for r in outcome.records]


def _simulated(args: argparse.Namespace, config_arg: str, profile: Profile
               ) -> list[dict[str, Any]]:
    from pdcache.bench.stack import parse_config_arg
    from pdcache.config.parse import load_topology
    from pdcache.sim.simulation import SimOptions, Simulation, local_host_slots

    run = parse_config_arg(config_arg, args.serving_set)
    options = SimOptions(shared_host_slots=local_host_slots(args.node_threads))
    sim = Simulation(load_topology(run.path, list(run.overrides)), profile,
                     serving_replay(args.page_size), options)
    sim.run()
    return sim.records


def measure_serving(args: argparse.Namespace, profile: Profile, out: Path,
                    log: Any) -> dict[str, float]:
    """The `[serving]` table: real runs of `--serving-unified` (and `--serving-pd`) against
    the simulator's prediction from `profile`'s compute tables."""
    first, real_ttft, real_tpot = _medians(_real(args, args.serving_unified, out))
    warmup = max(0.0, first - real_ttft)
    bare = replace(profile, serving=ServingCost())
    _, _, sim_tpot = _medians(_simulated(args, args.serving_unified, bare))
    step = max(0.0, real_tpot - sim_tpot)
    with_step = replace(profile, serving=ServingCost(step_s=step))
    _, sim_ttft, _ = _medians(_simulated(args, args.serving_unified, with_step))
    request = max(0.0, real_ttft - sim_ttft)
    log(f"serving unified: first TTFT {first * 1e3:.1f} ms, median TTFT real "
        f"{real_ttft * 1e3:.2f} / modelled {sim_ttft * 1e3:.2f} ms, TPOT real "
        f"{real_tpot * 1e3:.2f} / modelled {sim_tpot * 1e3:.2f} ms")
    handoff = decode_warmup = 0.0
    if args.serving_pd:
        pd_records = _real(args, args.serving_pd, out)
        _, pd_real_ttft, _ = _medians(pd_records)
        decode_warmup = _decode_warmup(pd_records)
        charged = replace(profile, serving=ServingCost(request, step, 0.0, warmup))
        _, pd_sim_ttft, _ = _medians(_simulated(args, args.serving_pd, charged))
        handoff = max(0.0, pd_real_ttft - pd_sim_ttft)
        log(f"serving pd: median TTFT real {pd_real_ttft * 1e3:.2f} / modelled "
            f"{pd_sim_ttft * 1e3:.2f} ms")
    return {"request_s": request, "step_s": step, "handoff_s": handoff, "warmup_s": warmup,
            "decode_warmup_s": decode_warmup}
