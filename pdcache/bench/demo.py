"""`pdcache demo`: the main job — launch a local PD topology (router + prefill with HiCache +
decode with offload, 3FS-style storage), replay a multi-turn agentic trace against it, print
what each turn reused and the replay summary, and tear everything down.

Built from the bench's shared parts: `pdcache.bench.stack` launches the topology,
`pdcache.bench.replay.replay` drives it over HTTP only and returns every request's record.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from pdcache.bench.compare import run_one
from pdcache.bench.replay import add_replay_options
from pdcache.bench.replay_config import ReplayConfig
from pdcache.bench.replay_records import RequestRecord
from pdcache.bench.stack import ConfigRun, add_launch_options
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
    parser.add_argument("--out", default=".pdcache/demo", help="replay output directory")
    add_launch_options(parser, set_help="topology override (repeatable)")
    add_replay_options(parser)
    parser.set_defaults(trace=DEFAULT_TRACE, concurrency=2)
    for action in parser._actions:  # the demo has a default trace
        if action.dest == "trace":
            action.required = False


def turn_rows(records: list[RequestRecord]) -> list[dict[str, Any]]:
    rows = [{
        "session": r.session_id, "turn": r.turn, "prompt": r.prompt_tokens,
        "cached": r.cached_tokens, "device": r.cached_device, "host": r.cached_host,
        "storage": r.cached_storage, "from_decode": r.cached_storage_from_decode,
        "computed": r.computed_tokens, "ttft_s": r.ttft_s or 0.0,
        "P": r.prefill_node, "D": r.decode_node,
    } for r in records]
    return sorted(rows, key=lambda row: (str(row["session"]), row["turn"] or 0))


def run(args: argparse.Namespace) -> int:
    out = Path(args.out)
    config = ConfigRun("demo", Path(args.config), tuple(args.overrides))
    print(f"[demo] launching {args.config} and replaying {args.trace}", file=sys.stderr)
    result = run_one(args, ReplayConfig.from_args(args), config, out)
    if result.error:
        print(f"[demo] failed: {result.error}", file=sys.stderr)
        return 1
    summary = result.summary
    run_dir = out / "demo"
    emit("what each turn reused (tokens)", turn_rows(result.records), columns=TURN_COLUMNS)
    keys = ("requests_ok", "requests_failed", "hit_rate", "theoretical_hit_rate",
            "ttft_p50_s", "ttft_p99_s")
    emit("replay summary", [{k: summary.get(k) for k in keys}],
         extra={"hit_rate_by_tier": summary.get("hit_rate_by_tier"),
                "details": str(run_dir / "summary.json")})
    return 0 if summary.get("requests_failed", 1) == 0 else 1
