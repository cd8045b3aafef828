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
- `prefill_warmup_s`: the same gap on the PD run (the prefill node's first step; absent
  without `--serving-pd`, and the simulator then uses `warmup_s`);
- `step_s`: the real median TPOT minus the simulated one (one decode step per token);
- `request_s`: the real median TTFT minus the simulated one with `step_s` charged (unified);
- `handoff_s`: the same gap on the PD config, with `request_s`, `step_s` and `warmup_s`
  charged (0 without `--serving-pd`);
- `decode_warmup_s`: on the PD config, the first request's time after its first token minus
  the others' median (0 without `--serving-pd`).

Each gap is clamped at 0 (a model already slower than the real stack gains no negative cost).

Then one run **under load** (`LOAD_TRACE`: 16 one-turn requests of 32 answer tokens, 4 at a
time; on the PD config when given, else the unified one), for what only concurrency shows:

- `relay_token_s`: the router's CPU seconds (its process, `/proc`) plus the client's (this
  process: the replay is the client), measured in the load run and in the same config's
  one-at-a-time run; cpu = requests × R + tokens × T solved for T, the per-token part (the
  per-request part is the `request_s` hop's) — measured, not fitted;
- `token_s`: the per-token part of the node's output path. One request at a time a step
  streams one token, so the idle gap `step_s` holds both; under load a step streams one per
  running request. `token_s` is the value (bisection) whose simulation of the load run gives
  its real median TPOT, with `step_s` = the idle gap − `token_s` (≥ 0), so the idle run
  still comes out as measured.
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


# under load: 16 one-turn requests of 32 answer tokens, 4 in flight, nothing reused
LOAD_TRACE = ("synthetic:sessions=16,turns=1,system_prompt=0,user=32,answer=32,think=0,"
              "seed=11")
LOAD_CONCURRENCY = 4
_TOKEN_FIT_ROUNDS = 24  # bisection rounds for token_s (the interval shrinks 2^24 times)


def serving_replay(page_size: int, loaded: bool = False) -> Any:
    from pdcache.bench.replay_config import ReplayConfig

    if loaded:
        return ReplayConfig(trace=LOAD_TRACE, mode="afap", concurrency=LOAD_CONCURRENCY,
                            page_size=page_size, progress=False, plots=False)
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


def _real(args: argparse.Namespace, config_arg: str, out: Path, loaded: bool = False
          ) -> tuple[list[dict[str, Any]], float]:
    """A real run of the serving trace (`loaded`: the load trace, in `LABEL-load`) on
    `config_arg`: its records and the relay's CPU seconds during it (the router process's,
    read from `/proc`, plus this process's: the replay is the client)."""
    import time
    import uuid

    from pdcache.bench.replay import replay
    from pdcache.bench.stack import LaunchError, launched, parse_config_arg

    run = parse_config_arg(config_arg, args.serving_set)
    run_dir = out / (f"{run.label}-load" if loaded else run.label)
    config = replace(serving_replay(args.page_size, loaded),
                     cache_salt=f"calibrate-{uuid.uuid4().hex[:12]}")
    try:
        with launched(run, run_dir, args.startup_timeout, args.stop_timeout) as stack:
            pid = router_pid(run_dir / "logs" / "processes.json")
            router_before, client_before = process_cpu_s(pid), time.process_time()
            result = replay(replace(config, url=stack.front), run_dir)
            relay_cpu = (process_cpu_s(pid) - router_before) \
                + (time.process_time() - client_before)
    except (LaunchError, OSError) as exc:
        raise ValueError(f"serving calibration: {run.label}: {exc}") from exc
    if result.failure:
        raise ValueError(f"serving calibration: {run.label}: {result.failure}")
    return [dict(r.__dict__) for r in result.records], relay_cpu


def _simulated(args: argparse.Namespace, config_arg: str, profile: Profile,
               loaded: bool = False) -> list[dict[str, Any]]:
    from pdcache.bench.stack import parse_config_arg
    from pdcache.config.parse import load_topology
    from pdcache.sim.simulation import SimOptions, Simulation, local_host_slots

    run = parse_config_arg(config_arg, args.serving_set)
    options = SimOptions(shared_host_slots=local_host_slots(args.node_threads))
    sim = Simulation(load_topology(run.path, list(run.overrides)), profile,
                     serving_replay(args.page_size, loaded), options)
    sim.run()
    return sim.records


def process_cpu_s(pid: int) -> float:
    """CPU seconds (user + system) process `pid` used so far, from `/proc` (Linux);
    ValueError when it cannot be read."""
    import os

    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError as exc:
        raise ValueError(f"cannot read the CPU time of process {pid}: {exc}") from exc
    fields = stat[stat.rindex(")") + 2:].split()  # after "pid (comm) ": field 3 onwards
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def router_pid(processes_json: Path) -> int:
    """The router's pid in a launcher's processes.json; ValueError without one."""
    import json

    try:
        processes = json.loads(processes_json.read_text())["processes"]
    except (OSError, ValueError, KeyError) as exc:
        raise ValueError(f"{processes_json}: no process list ({exc})") from exc
    for proc in processes:
        if proc.get("role") == "router" and proc.get("pid"):
            return int(proc["pid"])
    raise ValueError(f"{processes_json}: the topology has no running router")


def _streamed_tokens(records: list[dict[str, Any]]) -> int:
    return sum(int(r.get("output_tokens") or 0) for r in records if r.get("ok"))


def relay_per_token(idle: tuple[int, int, float], loaded: tuple[int, int, float]) -> float:
    """The relay's CPU per streamed token from two runs of (requests, tokens, CPU seconds):
    cpu = requests × R + tokens × T solved for T, so the per-request part (HTTP, routing,
    already in `request_s`) is not charged per token. With runs that do not separate the two
    (the same tokens per request), all of the loaded run's CPU per token. Never negative."""
    (n1, t1, c1), (n2, t2, c2) = idle, loaded
    if n1 and n2 and t2 and t1 * n2 != t2 * n1:
        return max(0.0, (c2 - c1 * n2 / n1) / (t2 - t1 * n2 / n1))
    return max(0.0, c2 / t2) if t2 else 0.0


def fit_token_s(simulate_tpot: Any, target_tpot: float, idle_gap: float,
                upper: float = 0.05) -> float:
    """The `token_s` (0..`upper`) whose simulated TPOT, with `step_s` = max(0, `idle_gap`
    − `token_s`), meets `target_tpot`: bisection (the TPOT of batches of more than one
    request grows with it). 0 when even 0 is too slow; `upper` when nothing reaches it."""
    low, high = 0.0, upper
    if simulate_tpot(low, idle_gap) >= target_tpot:
        return 0.0
    if simulate_tpot(high, max(0.0, idle_gap - high)) <= target_tpot:
        return high
    for _ in range(_TOKEN_FIT_ROUNDS):
        mid = (low + high) / 2
        if simulate_tpot(mid, max(0.0, idle_gap - mid)) < target_tpot:
            low = mid
        else:
            high = mid
    return (low + high) / 2


def measure_serving(args: argparse.Namespace, profile: Profile, out: Path,
                    log: Any) -> dict[str, float]:
    """The `[serving]` table: real runs of `--serving-unified` (and `--serving-pd`) against
    the simulator's prediction from `profile`'s compute tables."""
    u_records, u_cpu = _real(args, args.serving_unified, out)
    first, real_ttft, real_tpot = _medians(u_records)
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
    prefill_warmup: float | None = None
    idle_run = (u_records, u_cpu)  # the load run's config, one request at a time
    if args.serving_pd:
        pd_records, pd_cpu = idle_run = _real(args, args.serving_pd, out)
        pd_first, pd_real_ttft, _ = _medians(pd_records)
        decode_warmup = _decode_warmup(pd_records)
        # the prefill node's own first step (here 28 ms, against 120 on the unified node)
        prefill_warmup = max(0.0, pd_first - pd_real_ttft)
        charged = replace(profile, serving=ServingCost(request, step, 0.0, warmup,
                                                       prefill_warmup_s=prefill_warmup))
        _, pd_sim_ttft, _ = _medians(_simulated(args, args.serving_pd, charged))
        handoff = max(0.0, pd_real_ttft - pd_sim_ttft)
        log(f"serving pd: median TTFT real {pd_real_ttft * 1e3:.2f} / modelled "
            f"{pd_sim_ttft * 1e3:.2f} ms")
    token, relay = _measure_load(args, profile, out, log, idle_run,
                                 ServingCost(request, step, handoff, warmup, decode_warmup,
                                             prefill_warmup_s=prefill_warmup))
    table = {"request_s": request, "step_s": max(0.0, step - token), "handoff_s": handoff,
             "warmup_s": warmup, "decode_warmup_s": decode_warmup, "token_s": token,
             "relay_token_s": relay}
    if prefill_warmup is not None:
        table["prefill_warmup_s"] = prefill_warmup
    return table


def _run_totals(records: list[dict[str, Any]], relay_cpu: float) -> tuple[int, int, float]:
    """(requests answered, tokens streamed, router + client CPU seconds) of one real run:
    what `relay_per_token` solves the per-token relay cost from."""
    return sum(1 for r in records if r.get("ok")), _streamed_tokens(records), relay_cpu


def _measure_load(args: argparse.Namespace, profile: Profile, out: Path, log: Any,
                  idle_run: tuple[list[dict[str, Any]], float], idle: ServingCost
                  ) -> tuple[float, float]:
    """(`token_s`, `relay_token_s`) from the load run and the same config's idle run
    (module docstring)."""
    config_arg = args.serving_pd or args.serving_unified
    records, relay_cpu = _real(args, config_arg, out, loaded=True)
    idle_records, idle_cpu = idle_run
    relay = relay_per_token(_run_totals(idle_records, idle_cpu), _run_totals(records, relay_cpu))
    _, real_ttft, real_tpot = _medians(records)

    def simulate_tpot(token: float, step: float) -> float:
        costs = replace(idle, step_s=step, token_s=token, relay_token_s=relay)
        return _medians(_simulated(args, config_arg, replace(profile, serving=costs),
                                   loaded=True))[2]

    token = fit_token_s(simulate_tpot, real_tpot, idle.step_s)
    fitted = replace(idle, step_s=max(0.0, idle.step_s - token), token_s=token,
                     relay_token_s=relay)
    _, sim_ttft, sim_tpot = _medians(_simulated(args, config_arg,
                                                replace(profile, serving=fitted), loaded=True))
    log(f"serving under load ({LOAD_CONCURRENCY} at a time): relay {relay * 1e3:.3f} ms per "
        f"token (router + client CPU {relay_cpu:.2f} s, {idle_cpu:.2f} s idle); TPOT real {real_tpot * 1e3:.2f} / "
        f"modelled {sim_tpot * 1e3:.2f} ms with token_s {token * 1e3:.3f} ms; median TTFT real "
        f"{real_ttft * 1e3:.2f} / modelled {sim_ttft * 1e3:.2f} ms (not fitted)")
    return token, relay
