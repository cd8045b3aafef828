"""Summary, tables and plots of a replay directory (`requests.jsonl` -> `summary.json`).

Hit rates are token-weighted over successful requests: sum(cached) / sum(prompt tokens).
Per tier: `device`, `host`, `storage` (they add up to the overall rate); per origin:
`storage_from_decode` (storage pages written by a decode node, a subset of `storage`) and
`storage_from_prefill` (the rest of `storage`). The theoretical rate is the same ratio with
`theoretical_cached_tokens` (`pdcache.bench.tokens` defines it), over the same requests.

Re-render a directory with `python -m pdcache.bench.report DIR`.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import Counter
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any, TextIO

import numpy as np

from pdcache.bench.table import emit

TIERS = ("device", "host", "storage")


def load_records(out_dir: Path) -> list[dict[str, Any]]:
    path = out_dir / "requests.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def percentiles(values: Iterable[float | None], prefix: str) -> dict[str, float | None]:
    data = np.asarray([v for v in values if v is not None], dtype=float)
    stats: dict[str, float | None] = {}
    for name, q in (("mean", None), ("p50", 50), ("p90", 90), ("p99", 99)):
        if data.size == 0:
            stats[f"{prefix}_{name}_s"] = None
        else:
            value = data.mean() if q is None else np.percentile(data, q)
            stats[f"{prefix}_{name}_s"] = float(value)
    return stats


def _ratio(num: float, den: float) -> float:
    return num / den if den else 0.0


def hit_rates(records: Sequence[dict[str, Any]]) -> dict[str, Any]:
    prompt = sum(r["prompt_tokens"] for r in records)
    storage = sum(r["cached_storage"] for r in records)
    from_decode = sum(r["cached_storage_from_decode"] for r in records)
    theoretical = _ratio(sum(r["theoretical_cached_tokens"] for r in records), prompt)
    achieved = _ratio(sum(r["cached_tokens"] for r in records), prompt)
    return {
        "prompt_tokens": prompt,
        "cached_tokens": sum(r["cached_tokens"] for r in records),
        "hit_rate": achieved,
        "hit_rate_by_tier": {t: _ratio(sum(r[f"cached_{t}"] for r in records), prompt)
                             for t in TIERS},
        "hit_rate_by_origin": {"storage_from_decode": _ratio(from_decode, prompt),
                               "storage_from_prefill": _ratio(storage - from_decode, prompt)},
        "theoretical_hit_rate": theoretical,
        "achieved_over_theoretical": _ratio(achieved, theoretical) if theoretical else None,
    }


def per_turn(records: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    rows = []
    for turn in sorted({r["turn"] for r in records}):
        group = [r for r in records if r["turn"] == turn]
        rates = hit_rates(group)
        ttft = percentiles((r["ttft_s"] for r in group), "ttft")
        rows.append({
            "turn": turn, "requests": len(group),
            "prompt_tokens_mean": rates["prompt_tokens"] / len(group),
            "ttft_p50_s": ttft["ttft_p50_s"], "ttft_mean_s": ttft["ttft_mean_s"],
            "hit_rate": rates["hit_rate"], "theoretical_hit_rate": rates["theoretical_hit_rate"],
            **{f"hit_{t}": v for t, v in rates["hit_rate_by_tier"].items()},
            "hit_storage_from_decode": rates["hit_rate_by_origin"]["storage_from_decode"],
        })
    return rows


def _duration(records: Sequence[dict[str, Any]], run_info: dict[str, Any]) -> float:
    if run_info.get("duration_s"):
        return float(run_info["duration_s"])
    ends = [r["dispatch_s"] + (r["e2e_s"] or 0.0) for r in records]
    return max(ends, default=0.0)


# what a summary takes from the run (`run_info`) over what its records say
RUN_FIELDS = ("requests_total", "requests_sent", "requests_skipped", "duration_s")


def summarize(records: Sequence[dict[str, Any]], run_info: dict[str, Any]) -> dict[str, Any]:
    ok = [r for r in records if r["ok"]]
    failed = [r for r in records if not r["ok"]]
    duration = _duration(records, run_info)
    errors = Counter((r.get("error") or "?").split(":")[0] for r in failed)
    summary: dict[str, Any] = {
        "requests_total": run_info.get("requests_total", len(records)),
        "requests_sent": run_info.get("requests_sent", len(records)),
        "requests_ok": len(ok),
        "requests_failed": len(failed),
        "requests_skipped": run_info.get("requests_skipped", 0),
        "duration_s": duration,
        "request_throughput_rps": _ratio(len(ok), duration),
        "input_token_throughput": _ratio(sum(r["prompt_tokens"] for r in ok), duration),
        "output_token_throughput": _ratio(sum(r["output_tokens"] for r in ok), duration),
        **hit_rates(ok),
        **percentiles((r["ttft_s"] for r in ok), "ttft"),
        **percentiles((g for r in ok for g in r["itl_s"]), "itl"),
        **percentiles((r["e2e_s"] for r in ok), "e2e"),
        **percentiles((r.get("queued_s", 0.0) for r in ok), "client_queue"),
        **percentiles((r["ttft_s"] + r.get("queued_s", 0.0) for r in ok
                       if r["ttft_s"] is not None), "ttft_from_due"),
        "server_ttft_p50_s": percentiles((r["server_ttft_s"] for r in ok), "x")["x_p50_s"],
        "errors": dict(errors),
        "per_turn": per_turn(ok),
    }
    summary.update({k: v for k, v in run_info.items() if k not in summary})
    return summary


SUMMARY_ROWS = (
    "session_prefix", "requests_ok", "requests_failed", "requests_prompt_mismatch",
    "requests_skipped", "duration_s",
    "request_throughput_rps", "output_token_throughput", "ttft_p50_s", "ttft_p90_s",
    "ttft_p99_s", "itl_p50_s", "itl_p99_s", "e2e_p50_s", "e2e_p99_s", "hit_rate",
    "theoretical_hit_rate", "achieved_over_theoretical",
)


def print_tables(summary: dict[str, Any], out: TextIO | None = None) -> None:
    """The replay's summary and per-turn tables on `out` (stdout at call time)."""
    out = out or sys.stdout
    rows = [{"metric": k, "value": summary.get(k)} for k in SUMMARY_ROWS]
    rows += [{"metric": f"hit_rate[{t}]", "value": v}
             for t, v in {**summary["hit_rate_by_tier"], **summary["hit_rate_by_origin"]}.items()]
    emit(f"replay {summary.get('trace', '')}", rows, out=out)
    columns = ["turn", "requests", "prompt_tokens_mean", "ttft_p50_s", "hit_rate",
               "theoretical_hit_rate", "hit_device", "hit_host", "hit_storage",
               "hit_storage_from_decode"]
    emit("per turn", summary["per_turn"], columns=columns, out=out)


def write_plots(
    out_dir: Path, summary: dict[str, Any], records: Sequence[dict[str, Any]]
) -> list[str]:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:  # plots are optional (extra "plots")
        print("report: matplotlib not installed, no plots (pip install pdcache[plots])",
              file=sys.stderr)
        return []
    turns = summary["per_turn"]
    xs = [row["turn"] for row in turns]
    fig, (ax_ttft, ax_hit) = plt.subplots(1, 2, figsize=(11, 4))
    ax_ttft.plot(xs, [row["ttft_p50_s"] or 0.0 for row in turns], marker="o", label="p50")
    ax_ttft.plot(xs, [row["ttft_mean_s"] or 0.0 for row in turns], marker=".", label="mean")
    ax_ttft.set(xlabel="turn", ylabel="TTFT (s)", title="TTFT per turn", xticks=xs)
    ax_ttft.legend()
    bottom = np.zeros(len(turns))
    for tier in TIERS:
        values = np.asarray([row[f"hit_{tier}"] for row in turns])
        ax_hit.bar(xs, values, bottom=bottom, label=f"achieved: {tier}")
        bottom += values
    ax_hit.plot(xs, [row["theoretical_hit_rate"] for row in turns], "k--o", label="theoretical")
    ax_hit.set(xlabel="turn", ylabel="cache hit rate", ylim=(0, 1.05), xticks=xs,
               title="Hit rate per turn")
    ax_hit.legend(fontsize=8)
    fig.tight_layout()
    paths = [out_dir / "per_turn.png"]
    fig.savefig(paths[0], dpi=100)
    plt.close(fig)
    ttfts = np.sort([r["ttft_s"] for r in records if r["ok"] and r["ttft_s"] is not None])
    if ttfts.size:
        fig, ax = plt.subplots(figsize=(5.5, 4))
        ax.plot(ttfts, np.arange(1, ttfts.size + 1) / ttfts.size)
        ax.set(xlabel="TTFT (s)", ylabel="fraction of requests", title="TTFT CDF")
        fig.tight_layout()
        paths.append(out_dir / "ttft_cdf.png")
        fig.savefig(paths[-1], dpi=100)
        plt.close(fig)
    return [str(p) for p in paths]


def write_summary(
    out_dir: Path, run_info: dict[str, Any] | None = None, plots: bool = True
) -> dict[str, Any]:
    """Reads `out_dir/requests.jsonl`, writes `summary.json` (+ plots); prints nothing."""
    records = load_records(out_dir)
    summary = summarize(records, run_info or {})
    if plots:
        summary["plots"] = write_plots(out_dir, summary, records)
    (out_dir / "summary.json").write_text(json.dumps(summary, indent=2, default=str))
    return summary


def write_report(
    out_dir: Path, run_info: dict[str, Any] | None = None, plots: bool = True
) -> dict[str, Any]:
    """`write_summary`, then the tables on stdout."""
    summary = write_summary(out_dir, run_info, plots)
    print_tables(summary)
    print(f"wrote {out_dir / 'summary.json'}")
    return summary


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="re-render the report of a replay directory")
    parser.add_argument("out_dir")
    parser.add_argument("--no-plots", dest="plots", action="store_false")
    args = parser.parse_args(argv)
    out_dir = Path(args.out_dir)
    previous = out_dir / "summary.json"
    run_info = json.loads(previous.read_text()) if previous.is_file() else {}
    # every run field summarize does not compute from the records again (a re-render kept a
    # short list and lost stopped_early, skip_reasons, replayer_errors, config, ...)
    computed = set(summarize([], {})) - set(RUN_FIELDS)
    kept = {k: v for k, v in run_info.items() if k not in computed}
    write_report(out_dir, kept, plots=args.plots)
    return 0


if __name__ == "__main__":
    sys.exit(main())
