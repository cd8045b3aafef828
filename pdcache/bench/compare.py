"""`pdcache bench compare CONFIG...`: the same trace replayed on several topologies, side by side.

For each CONFIG in turn: start it with `pdcache launch` (`pdcache.bench.stack.launched`: its
own process group, its own logs), wait until every HTTP endpoint of the topology answers
`/health`, replay the trace against the front door (the router, or the first node without
one; `pdcache.bench.replay.replay`), stop the launcher (SIGTERM: it tears its processes
down), and keep the replay summary. Then one table with every config and its
ratios to the first one, `DIR/compare.json` and `DIR/compare.png`.

CONFIG is `[LABEL=]PATH[+KEY=VALUE...]`: a topology file, an optional label (default: the
file's stem) and `--set` overrides for this config only; `--set` on the command line applies
to every config. Each replay sends its own fresh `cache_salt`, so pages that a previous config
(or an earlier run) left in shared storage never count as hits.
"""

from __future__ import annotations

import argparse
import json
import sys
import urllib.request
import uuid
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from pdcache.bench.replay import add_replay_options, print_report, replay
from pdcache.bench.replay_config import ReplayConfig
from pdcache.bench.replay_records import RequestRecord
from pdcache.bench.stack import (
    ConfigRun,
    LaunchError,
    add_launch_options,
    launched,
    parse_config_arg,
)
from pdcache.bench.table import emit

COLUMNS = ("config", "ok", "failed", "hit_rate", "theoretical", "achieved/theo", "ttft_p50_s",
           "ttft_p99_s", "itl_p50_s", "e2e_p50_s", "out_tok/s", "kv_MB/req", "decode_had",
           "ttft_p50_x", "out_tok/s_x")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("configs", nargs="+", metavar="CONFIG",
                        help="[LABEL=]PATH[+KEY=VALUE...] topology file to launch; the first one "
                             "is the baseline of the ratios")
    parser.add_argument("--out", required=True, help="output directory (one folder per config)")
    add_launch_options(parser)
    add_replay_options(parser)


def kv_transfer_totals(urls: list[str]) -> dict[str, int]:
    """What the prefill nodes' KV senders sent (bytes, pages) and left out because the decode
    node's prefix cache held them (pages), from their `/health` (no credential needed)."""
    totals = {"kv_bytes_sent": 0, "kv_pages_sent": 0, "kv_pages_decode_had": 0}
    for url in urls:
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=10) as resp:
                health = json.loads(resp.read())
        except (OSError, ValueError):
            continue
        if health.get("role") != "prefill":
            continue
        transfer = health.get("transfer") or {}
        totals["kv_bytes_sent"] += int(transfer.get("bytes_sent", 0))
        totals["kv_pages_sent"] += int(transfer.get("pages_sent", 0))
        totals["kv_pages_decode_had"] += int(transfer.get("pages_decode_had", 0))
    return totals


@dataclass(frozen=True)
class ConfigOutcome:
    """One config's launch and replay: the replay summary with what the prefill nodes sent
    ({} when the replay never ran), every request's record, and why it failed ("" if not)."""

    summary: dict[str, Any]
    records: list[RequestRecord] = field(default_factory=list)
    error: str = ""

    def as_json(self) -> dict[str, Any]:
        """The summary, with `error` when the config failed (compare.json's `summaries`)."""
        return {**self.summary, "error": self.error} if self.error else self.summary


def run_one(args: argparse.Namespace, config: ReplayConfig, run: ConfigRun,
            out: Path) -> ConfigOutcome:
    """Launch `run` (`--startup-timeout`, `--stop-timeout` from `args`), replay `config`
    against it (its report printed), tear it down."""
    run_dir = out / run.label
    salt = config.cache_salt or f"compare-{run.label}-{uuid.uuid4().hex[:12]}"
    try:
        with launched(run, run_dir, args.startup_timeout, args.stop_timeout) as stack:
            try:
                result = replay(replace(config, url=stack.front, cache_salt=salt), run_dir)
            except ValueError as exc:
                return ConfigOutcome({}, error=f"replay: {exc}")
            print_report(result)
            summary = {**result.summary, **kv_transfer_totals(stack.urls)}
            error = f"replay failed: {result.failure}" if result.failure else ""
            return ConfigOutcome(summary, result.records, error)
    except LaunchError as exc:
        return ConfigOutcome({}, error=str(exc))
    except OSError as exc:
        return ConfigOutcome({}, error=f"{exc} (logs: {run_dir / 'logs'})")


def _share(had: int | None, sent: int | None) -> float | None:
    """The share of the prompt pages that decode's prefix cache held (not sent)."""
    total = (had or 0) + (sent or 0)
    return had / total if had is not None and total else None


def _ratio(value: float | None, base: float | None) -> float | None:
    return value / base if value is not None and base else None


def compare_rows(results: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    base = next(iter(results.values()))
    rows = []
    for label, s in results.items():
        rows.append({
            "config": label, "ok": s.get("requests_ok"), "failed": s.get("requests_failed"),
            "hit_rate": s.get("hit_rate"), "theoretical": s.get("theoretical_hit_rate"),
            "achieved/theo": s.get("achieved_over_theoretical"),
            "ttft_p50_s": s.get("ttft_p50_s"), "ttft_p99_s": s.get("ttft_p99_s"),
            "itl_p50_s": s.get("itl_p50_s"), "e2e_p50_s": s.get("e2e_p50_s"),
            "out_tok/s": s.get("output_token_throughput"),
            "kv_MB/req": (s["kv_bytes_sent"] / 1e6 / s["requests_ok"]
                          if s.get("requests_ok") and "kv_bytes_sent" in s else None),
            "decode_had": _share(s.get("kv_pages_decode_had"), s.get("kv_pages_sent")),
            "ttft_p50_x": _ratio(s.get("ttft_p50_s"), base.get("ttft_p50_s")),
            "out_tok/s_x": _ratio(s.get("output_token_throughput"),
                                  base.get("output_token_throughput")),
            "error": s.get("error", ""),
        })
    return rows


def plot(out: Path, results: dict[str, dict[str, Any]]) -> str | None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    fig, (ax_turn, ax_hit) = plt.subplots(1, 2, figsize=(11, 4))
    for label, s in results.items():
        turns = s.get("per_turn") or []
        ax_turn.plot([r["turn"] for r in turns], [r["ttft_p50_s"] or 0.0 for r in turns],
                     marker="o", label=label)
    turn_ids = sorted({r["turn"] for s in results.values() for r in s.get("per_turn") or []})
    ax_turn.set(xlabel="turn", ylabel="TTFT p50 (s)", title="TTFT per turn", xticks=turn_ids)
    ax_turn.legend(fontsize=8)
    labels = list(results)
    xs = range(len(labels))
    ax_hit.bar(xs, [results[c].get("hit_rate") or 0.0 for c in labels], label="achieved")
    ax_hit.plot(xs, [results[c].get("theoretical_hit_rate") or 0.0 for c in labels], "k_",
                markersize=30, label="theoretical")
    ax_hit.set(xticks=list(xs), xticklabels=labels, ylim=(0, 1.05), ylabel="cache hit rate",
               title="Hit rate")
    ax_hit.legend(fontsize=8)
    fig.tight_layout()
    path = out / "compare.png"
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return str(path)


def run(args: argparse.Namespace) -> int:
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    runs = [parse_config_arg(c, args.overrides) for c in args.configs]
    if len({r.label for r in runs}) != len(runs):
        print("pdcache bench compare: config labels must be unique (use LABEL=PATH)",
              file=sys.stderr)
        return 2
    config = ReplayConfig.from_args(args)
    results = {r.label: run_one(args, config, r, out).as_json() for r in runs}
    rows = compare_rows(results)
    picture = plot(out, results)
    payload = {"trace": args.trace, "configs": {r.label: {"path": str(r.path),
                                                          "overrides": list(r.overrides)}
                                                for r in runs},
               "rows": rows, "plot": picture, "summaries": results}
    (out / "compare.json").write_text(json.dumps(payload, indent=2, default=str))
    emit(f"compare on {args.trace} (ratios x: to {runs[0].label})", rows, columns=COLUMNS,
         json_path=args.json_path, out=sys.stdout)
    for row in rows:
        if row["error"]:
            print(f"{row['config']}: {row['error']}")
    return 0 if all(not row["error"] for row in rows) else 1
