"""`pdcache sim validate NAME=CONFIG... --trace T --profile P --out DIR`: the simulator's
fidelity, measured against real runs.

For each CONFIG (`[LABEL=]PATH[+KEY=VALUE...]`, as `bench compare` takes them) in turn: the
real `bench compare` path (`pdcache.bench.compare.run_one`: launch, replay, tear down), then
the simulator on the same topology, overrides, trace and seed with the given profile; one row
per config with every error, never only the best:

- `hit_rate_abs_err`: |simulated hit rate - measured hit rate|;
- `ttft_p50_rel_err`, `ttft_p90_rel_err`: (simulated - measured) / measured;
- `goodput_rel_err`: the same for goodput (requests per second within `--ttft-slo`; without
  an SLO, every successful request counts).

With `--repeat N` the real side runs N times (`DIR/LABEL`, `DIR/LABEL.2`, ...): the row
compares the simulation with the **median** of the N real values of each metric (the column
`real_runs` says how many ran; a failed run is left out and named), and a second table gives
every real run's own errors, so the spread of the real runs themselves is in view: on a
loaded 2-core host two identical runs differ by more than the 15 % a TTFT target allows.

The real runs are local: every node of the topology on this host, sharing its cores; the
simulator models that (`SimOptions.shared_host_slots` = `local_host_slots(args.node_threads)`). A synthetic
trace without its own `seed=` is drawn with `--seed` for both runs. Writes
`DIR/validate.json` (both summaries per config) and each side's outputs under `DIR/LABEL/`
(the replay's) and `DIR/LABEL/sim/`.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

from pdcache.bench.table import emit
from pdcache.config.parse import load_topology
from pdcache.config.schema import TopologyError
from pdcache.sim.profile import ProfileError, load_profile

COLUMNS = ("config", "hit_rate_real", "hit_rate_sim", "hit_rate_abs_err", "ttft_p50_real_s",
           "ttft_p50_sim_s", "ttft_p50_rel_err", "ttft_p90_real_s", "ttft_p90_sim_s",
           "ttft_p90_rel_err", "goodput_real_rps", "goodput_sim_rps", "goodput_rel_err",
           "real_runs")
REAL_KEYS = ("hit_rate_real", "ttft_p50_real_s", "ttft_p90_real_s", "goodput_real_rps")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from pdcache.bench.compare import add_arguments as add_compare_arguments

    add_compare_arguments(parser)
    parser.add_argument("--profile", required=True, help="the cost profile TOML")
    parser.add_argument("--node-threads", type=int, default=1, metavar="N",
                        help="torch threads each launched node uses (the OMP_NUM_THREADS it "
                             "runs with; scripts/test.sh and the demo use 1): how many nodes "
                             "compute at once on this host's cores")
    parser.add_argument("--ttft-slo", type=float, default=None, metavar="S",
                        help="goodput counts requests with a TTFT of at most S seconds")
    parser.add_argument("--repeat", type=int, default=1, metavar="N",
                        help="run each real config N times: errors against the median of "
                             "the N real values, and every run's own errors in a second table")


def rel_err(sim: float | None, real: float | None) -> float | None:
    if sim is None or real is None or real == 0:
        return None
    return (sim - real) / real


def measured_goodput(summary: dict[str, Any], records: list[dict[str, Any]],
                     ttft_slo: float | None) -> float | None:
    """Requests per second within the TTFT SLO (every successful one without an SLO)."""
    duration = summary.get("duration_s")
    if not duration:
        return None
    ok = [r for r in records if r.get("ok")]
    good = [r for r in ok if ttft_slo is None or (r.get("ttft_s") is not None
                                                  and r["ttft_s"] <= ttft_slo)]
    return len(good) / duration


def error_row(label: str, real: dict[str, Any], real_records: list[dict[str, Any]],
              sim: dict[str, Any], sim_records: list[dict[str, Any]],
              ttft_slo: float | None) -> dict[str, Any]:
    """One config's measured and simulated values and every error between them."""
    row: dict[str, Any] = {"config": label}
    hit_real, hit_sim = real.get("hit_rate"), sim.get("hit_rate")
    row.update(hit_rate_real=hit_real, hit_rate_sim=hit_sim,
               hit_rate_abs_err=(abs(hit_sim - hit_real) if hit_real is not None
                                 and hit_sim is not None else None))
    for p in ("p50", "p90"):
        real_v, sim_v = real.get(f"ttft_{p}_s"), sim.get(f"ttft_{p}_s")
        row.update({f"ttft_{p}_real_s": real_v, f"ttft_{p}_sim_s": sim_v,
                    f"ttft_{p}_rel_err": rel_err(sim_v, real_v)})
    good_real = measured_goodput(real, real_records, ttft_slo)
    good_sim = measured_goodput(sim, sim_records, ttft_slo)
    row.update(goodput_real_rps=good_real, goodput_sim_rps=good_sim,
               goodput_rel_err=rel_err(good_sim, good_real))
    return row


def median_row(label: str, run_rows: list[dict[str, Any]]) -> dict[str, Any]:
    """The row of a repeated config: each real value the median over `run_rows` (the runs'
    rows against the one simulation; None values left out), its errors recomputed."""
    import statistics

    row = dict(run_rows[0], config=label, real_runs=len(run_rows))
    for key in REAL_KEYS:
        values = [r[key] for r in run_rows if r.get(key) is not None]
        row[key] = statistics.median(values) if values else None
    if row["hit_rate_real"] is not None and row["hit_rate_sim"] is not None:
        row["hit_rate_abs_err"] = abs(row["hit_rate_sim"] - row["hit_rate_real"])
    for p in ("p50", "p90"):
        row[f"ttft_{p}_rel_err"] = rel_err(row[f"ttft_{p}_sim_s"], row[f"ttft_{p}_real_s"])
    row["goodput_rel_err"] = rel_err(row["goodput_sim_rps"], row["goodput_real_rps"])
    return row


def simulate(args: argparse.Namespace, path: Path, overrides: tuple[str, ...],
             out: Path) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """The simulator on one config (progress off): its summary and records."""
    from pdcache.bench.replay_config import ReplayConfig
    from pdcache.sim import report
    from pdcache.sim.command import split_overrides
    from pdcache.sim.simulation import SimOptions, Simulation, local_host_slots, scale_roles

    topo_overrides, counts = split_overrides(overrides)
    topology = scale_roles(load_topology(path, topo_overrides), counts)
    sim = Simulation(topology, load_profile(args.profile), ReplayConfig.from_args(args),
                     SimOptions(ttft_slo_s=args.ttft_slo, progress=False,
                                shared_host_slots=local_host_slots(args.node_threads)))
    sim.run()
    summary = report.summarize(sim)
    report.write(out, sim, summary)
    return summary, sim.records


def validate(args: argparse.Namespace) -> list[dict[str, Any]]:
    from pdcache.bench.compare import run_one
    from pdcache.bench.replay_config import ReplayConfig
    from pdcache.bench.stack import parse_config_arg

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    runs = [parse_config_arg(c, args.overrides) for c in args.configs]
    if len({r.label for r in runs}) != len(runs):
        raise ValueError("config labels must be unique (use LABEL=PATH)")
    load_profile(args.profile)  # a bad profile stops before anything is launched
    config = ReplayConfig.from_args(args)
    repeat = max(1, getattr(args, "repeat", 1))
    rows, every_run, summaries = [], [], {}
    for run in runs:
        print(f"validate: {run.label}: simulation ...", file=sys.stderr, flush=True)
        sim_summary, sim_records = simulate(args, run.path, run.overrides, out / run.label / "sim")
        run_rows, errors, reals = [], [], []
        for index in range(repeat):
            label = run.label if index == 0 else f"{run.label}.{index + 1}"
            print(f"validate: {label}: real run ...", file=sys.stderr, flush=True)
            outcome = run_one(args, config, replace(run, label=label), out)
            reals.append(outcome.as_json())
            if outcome.error:
                errors.append(f"{label}: {outcome.error}")
                continue
            run_rows.append(error_row(label, outcome.summary,
                                      [dict(r.__dict__) for r in outcome.records],
                                      sim_summary, sim_records, args.ttft_slo))
        every_run.extend(run_rows)
        row = median_row(run.label, run_rows) if run_rows else {"config": run.label,
                                                                   "real_runs": 0}
        row["error"] = "; ".join(errors)
        rows.append(row)
        summaries[run.label] = {"real": reals[0] if repeat == 1 else reals, "sim": sim_summary}
    payload = {"trace": args.trace, "profile": args.profile, "ttft_slo_s": args.ttft_slo,
               "repeat": repeat, "rows": rows, "every_run": every_run, "summaries": summaries}
    (out / "validate.json").write_text(json.dumps(payload, indent=2, default=str))
    return rows, every_run


def run(args: argparse.Namespace) -> int:
    from pdcache.sim.simulation import seeded_trace_spec

    args.trace = seeded_trace_spec(args.trace, args.seed)  # the same trace for both runs
    if args.repeat < 1:
        print("pdcache sim validate: --repeat must be at least 1", file=sys.stderr)
        return 2
    try:
        rows, every_run = validate(args)
    except (ValueError, TopologyError, ProfileError) as exc:
        print(f"pdcache sim validate: {exc}", file=sys.stderr)
        return 2
    against = "the median of the real runs" if args.repeat > 1 else "the real run"
    emit(f"simulator fidelity on {args.trace} (every config, every error; against {against})",
         rows, columns=COLUMNS)
    if args.repeat > 1:
        emit("every real run against the same simulation", every_run, columns=COLUMNS[:-1])
    for row in rows:
        if row["error"]:
            print(f"{row['config']}: {row['error']}")
    print(f"wrote {Path(args.out) / 'validate.json'}")
    return 0 if all(not row["error"] for row in rows) else 1

