"""`pdcache demo`: the main job — launch a local PD topology (router + prefill with HiCache +
decode with offload, 3FS-style storage), replay a multi-turn agentic trace against it, print
what each turn reused and the replay summary, and tear everything down.

Built from `bench compare`'s pieces: the launcher runs the topology, `bench replay` drives it
over HTTP only.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from pdcache.bench import replay
from pdcache.bench.compare import ConfigRun, run_one
from pdcache.bench.table import emit

DEFAULT_CONFIG = "configs/local-1p1d.toml"
DEFAULT_TRACE = (
    "synthetic:sessions=4,turns=4,system_prompt=512,tool_result=64,answer=64,"
    "think_time=0,seed=0"
)
TURN_COLUMNS = ("session", "turn", "prompt", "cached", "device", "host", "storage",
                "from_decode", "computed", "ttft_s", "P", "D")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", default=DEFAULT_CONFIG, help="topology file to launch")
    parser.add_argument("--set", dest="overrides", action="append", default=[],
                        metavar="KEY=VALUE", help="topology override (repeatable)")
    parser.add_argument("--out", default=".pdcache/demo", help="replay output directory")
    parser.add_argument("--startup-timeout", type=float, default=600.0)
    parser.add_argument("--stop-timeout", type=float, default=60.0)
    replay.add_replay_options(parser)
    parser.set_defaults(trace=DEFAULT_TRACE, concurrency=2)
    for action in parser._actions:  # the demo has a default trace
        if action.dest == "trace":
            action.required = False


def turn_rows(run_dir: Path) -> list[dict]:
    rows = []
    for line in (run_dir / "requests.jsonl").read_text().splitlines():
        r = json.loads(line)
        rows.append({
            "session": r.get("session_id"), "turn": r.get("turn"),
            "prompt": r.get("prompt_tokens"), "cached": r.get("cached_tokens"),
            "device": r.get("cached_device"), "host": r.get("cached_host"),
            "storage": r.get("cached_storage"), "from_decode": r.get("cached_storage_from_decode"),
            "computed": r.get("computed_tokens"), "ttft_s": r.get("ttft_s") or 0.0,
            "P": r.get("prefill_node"), "D": r.get("decode_node"),
        })
    return sorted(rows, key=lambda row: (str(row["session"]), row["turn"] or 0))


def run(args: argparse.Namespace) -> int:
    out = Path(args.out)
    config = ConfigRun("demo", Path(args.config), tuple(args.overrides))
    print(f"[demo] launching {args.config} and replaying {args.trace}", file=sys.stderr)
    summary = run_one(args, config, out)
    if "error" in summary:
        print(f"[demo] failed: {summary['error']}", file=sys.stderr)
        return 1
    run_dir = out / "demo"
    emit("what each turn reused (tokens)", turn_rows(run_dir), columns=TURN_COLUMNS)
    keys = ("requests_ok", "requests_failed", "hit_rate", "theoretical_hit_rate",
            "ttft_p50_s", "ttft_p99_s")
    emit("replay summary", [{k: summary.get(k) for k in keys}],
         extra={"hit_rate_by_tier": summary.get("hit_rate_by_tier"),
                "details": str(run_dir / "summary.json")})
    return 0 if summary.get("requests_failed", 1) == 0 else 1
