"""`pdcache sim TOPOLOGY --trace TRACE --profile PROFILE`: simulate a topology on a trace.

The trace options are `bench replay`'s (`add_replay_options`: the same specs, pacing modes,
rescaling and limits, read by the same code); `--set KEY=VALUE` changes the topology as for
`pdcache launch`, and `--set sim.prefill=N` / `sim.decode=N` / `sim.unified=N` scales a role
to N nodes (copies of its first node). Prints the replay's tables and the simulator's, writes
`requests.jsonl` and `summary.json` to `--out` (docs/simulator.md).

`pdcache sim calibrate|plan|validate ...` are the subcommands of `SUBCOMMANDS` (their own
modules). The command's options are parsed here, once the first word says which one it is
(`add_arguments` only collects the words), as `pdcache bench` does.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence
from pathlib import Path

from pdcache.bench.replay import add_replay_options
from pdcache.bench.replay_config import ReplayConfig
from pdcache.config.parse import load_topology
from pdcache.config.schema import TopologyError
from pdcache.sim.profile import ProfileError, load_profile
from pdcache.sim.simulation import (
    ROLE_KEYS,
    SimOptions,
    Simulation,
    scale_roles,
    seeded_trace_spec,
)

# name -> (module, help); each module defines `add_arguments(parser)` and `run(args) -> int`
SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "calibrate": ("pdcache.sim.calibrate", "measure this machine's profile and write it"),
    "plan": ("pdcache.sim.plan", "search P:D counts and tier sizes for the cheapest topology "
                                 "meeting an SLO"),
    "validate": ("pdcache.sim.validate", "run bench compare and the simulator on the same "
                                         "trace and report every error"),
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The `pdcache` entry point: the words are kept and parsed by `run` (`simulate_parser`
    or a subcommand's parser); the help shows every form."""
    parser.set_defaults(_accepts_extra=True)
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.usage = "pdcache sim TOPOLOGY --trace T --profile P ... | pdcache sim SUBCOMMAND ..."
    parser.epilog = simulate_parser().format_help() + "\nsubcommands:\n" + "".join(
        f"  pdcache sim {name}: {text}\n" for name, (_, text) in SUBCOMMANDS.items())
    parser.add_argument("argv", nargs=argparse.REMAINDER, help=argparse.SUPPRESS)


def simulate_parser(prog: str = "pdcache sim") -> argparse.ArgumentParser:
    """The parser of one simulation's command line."""
    parser = argparse.ArgumentParser(prog=prog)
    add_run_arguments(parser)
    return parser


def add_run_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of one simulation (`pdcache sim TOPOLOGY ...`)."""
    parser.add_argument("topology", help="topology TOML (as for pdcache launch)")
    parser.add_argument("--profile", default=None,
                        help="the cost profile TOML (docs/simulator.md); none ships with pdcache")
    parser.add_argument("--set", dest="overrides", action="append", default=[],
                        metavar="KEY=VALUE",
                        help="override a topology key; sim.prefill=N, sim.decode=N, "
                             "sim.unified=N scale a role to N nodes")
    parser.add_argument("--out", default=None, help="directory for summary.json, requests.jsonl")
    parser.add_argument("--ttft-slo", type=float, default=None, metavar="S",
                        help="goodput: requests with a TTFT of at most S seconds")
    parser.add_argument("--tpot-slo", type=float, default=None, metavar="S",
                        help="goodput: ... and a TPOT of at most S seconds")
    parser.add_argument("--bucket", type=float, default=1.0, metavar="S",
                        help="storage bandwidth over time: bucket width (simulated seconds)")
    parser.add_argument("--shared-host", type=int, default=0, metavar="SLOTS",
                        help="every node runs on the one host the profile was measured on, "
                             "SLOTS of them computing at once at full speed (cores / threads "
                             "per node); 0 (default): each node has compute of its own")
    add_replay_options(parser)


def split_overrides(overrides: Sequence[str]) -> tuple[list[str], dict[str, int]]:
    """(topology overrides, role -> node count from `sim.ROLE=N`)."""
    topology, counts = [], {}
    for item in overrides:
        key, _, value = item.partition("=")
        if not key.strip().startswith("sim."):
            topology.append(item)
            continue
        role = key.strip().removeprefix("sim.")
        if role not in ROLE_KEYS or not value.strip().isdigit():
            raise ValueError(f"--set {item}: expected sim.ROLE=N with ROLE in "
                             f"{', '.join(ROLE_KEYS)}")
        counts[role] = int(value)
    return topology, counts


def build(args: argparse.Namespace) -> Simulation:
    """The simulation the command line describes (ValueError, TopologyError, ProfileError)."""
    profile = load_profile(args.profile)
    overrides, counts = split_overrides(args.overrides)
    topology = scale_roles(load_topology(args.topology, overrides), counts)
    replay = ReplayConfig.from_args(args)
    replay = ReplayConfig(**{**replay.__dict__, "trace": seeded_trace_spec(replay.trace,
                                                                           replay.seed)})
    options = SimOptions(ttft_slo_s=args.ttft_slo, tpot_slo_s=args.tpot_slo,
                         bucket_s=args.bucket, progress=args.progress,
                         shared_host_slots=args.shared_host)
    return Simulation(topology, profile, replay, options)


def run(args: argparse.Namespace) -> int:
    argv = [*getattr(args, "_rest", []), *args.argv]
    if argv and argv[0] in SUBCOMMANDS:
        name = argv[0]
        mod = importlib.import_module(SUBCOMMANDS[name][0])
        parser = argparse.ArgumentParser(prog=f"pdcache sim {name}")
        mod.add_arguments(parser)
        sub_args = parser.parse_args(argv[1:])
        sub_args.argv = argv
        return int(mod.run(sub_args) or 0)
    return simulate(simulate_parser().parse_args(argv))


def simulate(args: argparse.Namespace) -> int:
    """One simulation: tables printed, `--out` written."""
    from pdcache.sim import report

    try:
        sim = build(args)
    except (ValueError, TopologyError, ProfileError) as exc:
        print(f"pdcache sim: {exc}", file=sys.stderr)
        return 2
    sim.run()
    summary = report.summarize(sim)
    report.print_tables(summary)
    if args.out:
        report.write(Path(args.out), sim, summary)
        print(f"wrote {Path(args.out) / 'summary.json'}")
        if args.plots:
            from pdcache.sim.plots import write_plots

            plots = write_plots(Path(args.out), summary, sim.records)
            print(plots if isinstance(plots, str) else f"wrote {', '.join(plots)}")
    return 0
