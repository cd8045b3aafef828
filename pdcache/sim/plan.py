"""`pdcache sim plan TOPOLOGY --trace T --profile P --ttft-slo S [--tpot-slo S] [--search ...]`:
the cheapest topology that meets an SLO on a trace at its load.

The search space is the product of `--search`'s values (`prefill=1..8,decode=1..8,
host_ratio=0,1,2,storage=1GiB,4GiB`; a unified topology searches `unified=`). Candidates are
simulated cheapest first — cost is (nodes, then host memory of every node, then storage
bytes), ties broken by the order of the space — and the first that meets the SLO wins: every
cheaper candidate was tried and missed it, so it is the cheapest that meets it. A candidate
meets the SLO when no request failed and its TTFT (and TPOT, with `--tpot-slo`) at
`--percentile` is within the SLO. Deterministic: the simulations are, and so is the order.
Prints the candidates tried and the winner; `--out DIR` writes `DIR/plan.json`.
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pdcache.bench.table import emit
from pdcache.config.parse import load_topology
from pdcache.config.schema import Topology, TopologyError, parse_size
from pdcache.engine.loader import load_model_config
from pdcache.sim.profile import ProfileError
from pdcache.sim.simulation import ROLE_KEYS, node_host_pages, scale_roles

# --search key -> the topology override it sets (role counts are `sim.ROLE=N`)
SEARCH_KEYS = {"prefill": "sim.prefill", "decode": "sim.decode", "unified": "sim.unified",
               "host_ratio": "cache.host_ratio", "storage": "storage.capacity"}
DEFAULT_SEARCH = "prefill=1..4,decode=1..4"
DEFAULT_SEARCH_UNIFIED = "unified=1..8"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from pdcache.sim.command import add_run_arguments

    add_run_arguments(parser)
    parser.add_argument("--search", default=None,
                        help="the space: KEY=VALUES,... with KEY in prefill, decode, unified, "
                             "host_ratio, storage and VALUES a..b (integers) or a list "
                             f"(default: {DEFAULT_SEARCH}, or {DEFAULT_SEARCH_UNIFIED})")
    parser.add_argument("--percentile", type=int, default=90, choices=(50, 90, 99),
                        help="the SLO percentile of TTFT (and TPOT)")
    parser.add_argument("--max-candidates", type=int, default=64,
                        help="stop after simulating this many candidates")


def parse_search(text: str) -> dict[str, list[str]]:
    """`prefill=1..8,decode=2,4,host_ratio=0,1.5` -> {key: [values]} (a word without `=`
    continues the previous key's list)."""
    space: dict[str, list[str]] = {}
    key = None
    for word in (w.strip() for w in text.split(",") if w.strip()):
        if "=" in word:
            key, _, word = word.partition("=")
            key = key.strip()
            if key not in SEARCH_KEYS:
                raise ValueError(f"--search {key}: expected one of {', '.join(SEARCH_KEYS)}")
            space[key] = []
        if key is None:
            raise ValueError(f"--search {text!r}: expected KEY=VALUES")
        low, dots, high = word.partition("..")
        if dots:
            if not (low.strip().isdigit() and high.strip().isdigit()):
                raise ValueError(f"--search {key}={word}: a range is of integers, a..b")
            space[key].extend(str(n) for n in range(int(low), int(high) + 1))
        else:
            space[key].append(word.strip())
    return space


@dataclass(frozen=True)
class Candidate:
    """One point of the space: its settings, overrides and cost."""

    settings: tuple[tuple[str, str], ...]
    overrides: tuple[str, ...]
    nodes: int
    host_bytes: int
    storage_bytes: int

    @property
    def cost(self) -> tuple[int, int, int]:
        return (self.nodes, self.host_bytes, self.storage_bytes)


def candidate_cost(topology: Topology) -> tuple[int, int, int]:
    """(nodes, host bytes of every node, storage bytes) of a scaled topology."""
    model = load_model_config(topology.model.ref, dtype=topology.model.dtype)
    page_size = topology.cache.page_size
    page_bytes = model.kv_geometry.page_bytes(page_size)
    host = sum(node_host_pages(n, model, page_size) for n in topology.nodes) * page_bytes
    storage = topology.storage.capacity if topology.storage.enabled else 0
    return len(topology.nodes), host, storage


def candidates(path: str, overrides: Sequence[str],
               space: dict[str, list[str]]) -> list[Candidate]:
    """Every point of `space`, cheapest first (ties: the order of the space). A role the user
    fixed (`--set sim.ROLE=N`) keeps its count unless the space searches it (such an override
    reached the topology loader: `sim: unknown key`)."""
    from pdcache.sim.command import split_overrides

    topology_overrides, fixed = split_overrides(overrides)
    keys = list(space)
    out = []
    for values in itertools.product(*(space[k] for k in keys)):
        settings = tuple(zip(keys, values, strict=True))
        counts = {**fixed, **{k: int(v) for k, v in settings if k in ROLE_KEYS}}
        topo_overrides = [f"{SEARCH_KEYS[k]}={_toml_value(k, v)}" for k, v in settings
                          if k not in ROLE_KEYS]
        topology = scale_roles(load_topology(path, [*topology_overrides, *topo_overrides]),
                               counts)
        nodes, host, storage = candidate_cost(topology)
        sim_overrides = [*topo_overrides, *(f"sim.{k}={v}" for k, v in counts.items())]
        out.append(Candidate(settings, tuple(sim_overrides), nodes, host, storage))
    return sorted(out, key=lambda c: c.cost)  # stable: ties keep the space's order


def _toml_value(key: str, value: str) -> str:
    if key == "storage":
        parse_size(value)  # a bad size is an error here, not deep in a run
        return f'"{value}"'
    return value


def meets(summary: dict[str, Any], ttft_slo: float, tpot_slo: float | None,
          percentile: int) -> bool:
    if summary.get("requests_failed") or not summary.get("requests_ok"):
        return False
    # from when the request was due: a client that could not send (every --concurrency slot
    # busy: the cluster does not keep up) waited before TTFT was timed, and a 1P1D then
    # "met" an SLO a far larger cluster misses
    ttft = summary.get(f"ttft_from_due_p{percentile}_s", summary.get(f"ttft_p{percentile}_s"))
    if ttft is None or ttft > ttft_slo:
        return False
    tpot = summary.get(f"tpot_p{percentile}_s")
    return tpot_slo is None or tpot is None or tpot <= tpot_slo


def evaluate(args: argparse.Namespace, candidate: Candidate) -> dict[str, Any]:
    """Simulate one candidate; its table row."""
    from pdcache.sim import report
    from pdcache.sim.command import build

    run_args = argparse.Namespace(**{**vars(args), "progress": False,
                                     "overrides": [*args.overrides, *candidate.overrides]})
    sim = build(run_args)
    sim.run()
    summary = report.summarize(sim)
    p = args.percentile
    return {**dict(candidate.settings), "nodes": candidate.nodes,
            "host_GiB": round(candidate.host_bytes / 2**30, 3),
            "storage_GiB": round(candidate.storage_bytes / 2**30, 3),
            f"ttft_p{p}_s": summary.get(f"ttft_p{p}_s"), f"tpot_p{p}_s": summary.get(f"tpot_p{p}_s"),
            "hit_rate": summary.get("hit_rate"), "failed": summary.get("requests_failed"),
            "meets": meets(summary, args.ttft_slo, args.tpot_slo, p)}


def search(args: argparse.Namespace) -> tuple[list[dict[str, Any]], dict[str, Any] | None]:
    """(rows of the candidates tried, cheapest first; the winner's row or None)."""
    topology = load_topology(args.topology, [o for o in args.overrides
                                             if not o.startswith("sim.")])
    unified = any(n.role == "unified" for n in topology.nodes)
    space = parse_search(args.search or (DEFAULT_SEARCH_UNIFIED if unified else DEFAULT_SEARCH))
    rows = []
    for candidate in candidates(args.topology, args.overrides, space)[: args.max_candidates]:
        row = evaluate(args, candidate)
        rows.append(row)
        print(f"plan: tried {dict(candidate.settings)}: "
              f"{'meets' if row['meets'] else 'misses'} the SLO", file=sys.stderr, flush=True)
        if row["meets"]:
            return rows, row
    return rows, None


def run(args: argparse.Namespace) -> int:
    if args.ttft_slo is None:
        print("pdcache sim plan: --ttft-slo S is required", file=sys.stderr)
        return 2
    try:
        rows, winner = search(args)
    except (ValueError, TopologyError, ProfileError) as exc:
        print(f"pdcache sim plan: {exc}", file=sys.stderr)
        return 2
    slo = f"TTFT p{args.percentile} <= {args.ttft_slo} s" + (
        f", TPOT p{args.percentile} <= {args.tpot_slo} s" if args.tpot_slo else "")
    emit(f"plan: candidates tried, cheapest first ({slo})", rows)
    emit("plan: winner", [winner] if winner else [{"winner": "none of the candidates tried"}])
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        payload = {"slo": {"ttft_s": args.ttft_slo, "tpot_s": args.tpot_slo,
                           "percentile": args.percentile},
                   "topology": args.topology, "trace": args.trace,
                   "search": args.search, "candidates": rows, "winner": winner}
        (out / "plan.json").write_text(json.dumps(payload, indent=2, default=str))
        print(f"wrote {out / 'plan.json'}")
    return 0 if winner else 1


