"""`pdcache bench goodput CONFIG...`: per topology, the highest request rate whose TTFT p90
stays under an SLO, on a multi-turn trace with Poisson arrivals.

Load (`bench replay --mode poisson-sessions`): sessions start as a Poisson process and each
next turn of a session is sent its think time after the previous turn completed (open loop:
no gate on later turns, `--concurrency` only a safety cap, 256 by default). **Request rate**
R is the *offered* rate: sessions start at R / (mean turns per session) per second, so R
requests/s are offered in the long run; the achieved rate (ok requests / wall time) is
reported beside it. **Goodput** is the highest R tried at which every request succeeded and
the TTFT p`--slo-percentile` (90) was <= the SLO.

For each CONFIG (`[LABEL=]PATH[+KEY=VALUE...]`, as `bench compare`), launched once
(`compare.launched`), every pass begins with `/flush_cache` (device and host tiers emptied)
and sends a fresh `cache_salt` and session prefix, so no pass hits pages of another:

0. warm-up: `--warmup-requests` requests, not measured (a process's first forwards are slow).
1. unloaded: the first `--unloaded-requests` requests, one at a time. The SLO is `--slo-ms`,
   or `--slo-factor` x the first config's unloaded TTFT p90.
2. reference (unless `--no-reference`): the whole trace as fast as possible at
   `--reference-concurrency` (hit rate per tier, TTFT p50/p90: `bench compare`'s numbers, with
   ratios to the first config), and the latency breakdown: the mean of every `*_seconds`
   histogram of every node's `/metrics` over this pass (router, prefill, decode TTFT, the
   prefill's wait for decode, admission waits).
3. the sweep: from `--rate-start` (default: the config's unloaded request throughput) the rate
   is multiplied by `--step` while points pass (divided while they fail), then bisected
   (geometric midpoint) between the best pass and the lowest failure until they are within
   `--tolerance` or `--max-points` points ran. An overloaded point is bounded: dispatch stops
   at `--point-duration-factor` x its arrival span (+10 s), and unsent requests fail it. A
   passing point whose achieved rate is below TRACE_BOUND x the offered one ends the step-up:
   the trace's sessions all overlap already and cannot offer more load, so the goodput is
   only a lower bound (`lower_bound` in the table; use more sessions).

Writes `DIR/goodput.json`, `DIR/goodput.png` (TTFT p90 vs rate per config, the SLO line) and
one folder per config and pass (`requests.jsonl`, `summary.json`, the replay's tables).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import sys
import urllib.request
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tqdm import tqdm

from pdcache.bench import replay
from pdcache.bench.compare import (
    ConfigRun,
    LaunchError,
    add_launch_options,
    endpoints_of,
    launched,
    parse_config_arg,
)
from pdcache.bench.table import emit

TABLE_COLUMNS = (
    "config",
    "unloaded_ttft_p90_s",
    "ref_hit_rate",
    "ref_of_theoretical",
    "ref_host_share",
    "ref_ttft_p50_s",
    "ref_ttft_p90_s",
    "ref_ttft_p50_x",
    "ref_ttft_p90_x",
    "goodput_rps",
    "goodput_x",
    "lower_bound",
    "points",
)
POINT_COLUMNS = (
    "config",
    "rate_rps",
    "achieved_rps",
    "ok",
    "failed",
    "skipped",
    "ttft_p50_s",
    "ttft_p90_s",
    "ttft_p99_s",
    "hit_rate",
    "passed",
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "configs",
        nargs="+",
        metavar="CONFIG",
        help="[LABEL=]PATH[+KEY=VALUE...] topology file to launch; the first "
        "is the ideal: the SLO and the ratios refer to it",
    )
    parser.add_argument("--out", required=True, help="output directory")
    add_launch_options(parser)
    parser.add_argument(
        "--slo-ms",
        type=float,
        default=None,
        help="TTFT SLO in ms (default: --slo-factor x the first config's unloaded TTFT p90)",
    )
    parser.add_argument("--slo-factor", type=float, default=3.0)
    parser.add_argument("--slo-percentile", type=float, default=90.0)
    parser.add_argument(
        "--unloaded-requests",
        type=int,
        default=20,
        help="requests of the unloaded pass (whole sessions in start order)",
    )
    parser.add_argument(
        "--warmup-requests",
        type=int,
        default=2,
        help="requests sent (and not measured) before the unloaded pass",
    )
    parser.add_argument(
        "--no-reference",
        dest="reference",
        action="store_false",
        help="skip the as-fast-as-possible reference pass",
    )
    parser.add_argument("--reference-concurrency", type=int, default=4)
    parser.add_argument(
        "--rate-start",
        type=float,
        default=None,
        help="first rate tried, requests/s (default: the config's unloaded request throughput)",
    )
    parser.add_argument("--step", type=float, default=2.0, help="rate factor before bisecting")
    parser.add_argument(
        "--tolerance",
        type=float,
        default=0.15,
        help="stop when the lowest failure / best pass <= 1 + this",
    )
    parser.add_argument("--max-points", type=int, default=6, help="rate points per config")
    parser.add_argument(
        "--point-duration-factor",
        type=float,
        default=2.0,
        help="a point dispatches for at most this x its arrival span + 10 s",
    )
    replay.add_replay_options(parser)
    parser.set_defaults(concurrency=256, mode="poisson-sessions")


# ---- the search ---------------------------------------------------------------------------

TRACE_BOUND = 0.5  # achieved / offered rate of a pass below which the trace is the limit


@dataclass
class RateSearch:
    """Step up (or down) by `step` until a pass and a failure bracket the goodput, then bisect
    geometrically; `next_rate()` is None when done. Pure: the caller runs each point."""

    start: float
    step: float = 2.0
    tolerance: float = 0.15
    max_points: int = 6
    best_pass: float | None = None
    lowest_fail: float | None = None
    trace_bound: bool = False  # a pass whose achieved rate fell far short of the offered one
    tried: list[tuple[float, bool]] = field(default_factory=list)

    def next_rate(self) -> float | None:
        if len(self.tried) >= self.max_points or (self.trace_bound and self.lowest_fail is None):
            return None
        if not self.tried:
            return self.start
        lo, hi = self.best_pass, self.lowest_fail
        if lo is None:
            return hi / self.step if hi is not None else self.start
        if hi is None:
            return lo * self.step
        if hi / lo <= 1.0 + self.tolerance:
            return None
        return math.sqrt(lo * hi)

    def record(self, rate: float, passed: bool, achieved: float | None = None) -> None:
        """`achieved` (requests/s): a pass below TRACE_BOUND x `rate` means the trace's
        sessions cannot offer more load (they all overlap already): stepping up stops."""
        self.tried.append((rate, passed))
        if passed and achieved is not None and achieved < TRACE_BOUND * rate:
            self.trace_bound = True
        if passed and (self.best_pass is None or rate > self.best_pass):
            self.best_pass = rate
        if not passed and (self.lowest_fail is None or rate < self.lowest_fail):
            self.lowest_fail = rate


def point_passes(summary: dict[str, Any], slo_s: float, percentile: float) -> bool:
    """Every request of the trace succeeded and the TTFT at `percentile` is within the SLO."""
    ttft = ttft_percentile(summary, percentile)
    complete = summary.get("requests_ok") == summary.get("requests_total") and not summary.get(
        "requests_failed"
    )
    return complete and ttft is not None and ttft <= slo_s


def ttft_percentile(summary: dict[str, Any], percentile: float) -> float | None:
    """TTFT at `percentile` over the pass's successful requests (its requests.jsonl)."""
    import numpy as np

    values = summary.get("_ttfts") or []
    return float(np.percentile(values, percentile)) if values else None


# ---- one pass -------------------------------------------------------------------------------


def flush(front: str, timeout_s: float = 60.0) -> None:
    """Empty the device and host tiers of every node (`/flush_cache`, waits for idle)."""
    req = urllib.request.Request(f"{front}/flush_cache?timeout={timeout_s:g}", method="POST")
    with urllib.request.urlopen(req, timeout=timeout_s + 30) as resp:
        if resp.status != 200:
            raise RuntimeError(f"/flush_cache answered {resp.status}")


def run_pass(args: argparse.Namespace, front: str, out: Path, **changes: Any) -> dict[str, Any]:
    """One replay against `front` into `out` (its tables go to out/replay.txt): the summary,
    with `_ttfts` (the successful requests' TTFTs) and `error` when it did not complete."""
    flush(front)
    values = {
        **vars(args),
        "url": front,
        "out": str(out),
        "json_path": None,
        "plots": False,
        "progress": False,
        "cache_salt": f"goodput-{uuid.uuid4().hex[:12]}",
        "session_prefix": None,
        **changes,
    }
    out.mkdir(parents=True, exist_ok=True)
    summary_path = out / "summary.json"
    summary_path.unlink(missing_ok=True)
    with (
        (out / "replay.txt").open("w") as log,
        contextlib.redirect_stdout(log),
        contextlib.redirect_stderr(log),
    ):
        code = replay.run(argparse.Namespace(**values))
    if not summary_path.is_file():
        return {"error": f"replay exited {code} without a summary (see {out / 'replay.txt'})"}
    summary = json.loads(summary_path.read_text())
    records = [
        json.loads(line)
        for line in (out / "requests.jsonl").read_text().splitlines()
        if line.strip()
    ]
    summary["_ttfts"] = [r["ttft_s"] for r in records if r["ok"] and r["ttft_s"] is not None]
    if code != 0:
        summary["error"] = f"replay exited {code}"
    return summary


def scrape_latencies(urls: list[str]) -> dict[str, tuple[float, float]]:
    """Every `*_seconds` histogram and summary of every endpoint's `/metrics`, summed over
    labels: "HOST:PORT metric" -> (sum, count). Endpoints that do not answer are skipped."""
    from prometheus_client.parser import text_string_to_metric_families

    totals: dict[str, tuple[float, float]] = {}
    for url in urls:
        try:
            with urllib.request.urlopen(f"{url}/metrics", timeout=10) as resp:
                text = resp.read().decode()
        except OSError:
            continue
        where = url.removeprefix("http://")
        for family in text_string_to_metric_families(text):
            if not family.name.endswith("_seconds"):
                continue
            acc_sum = acc_count = 0.0
            for sample in family.samples:
                if sample.name.endswith("_sum"):
                    acc_sum += sample.value
                elif sample.name.endswith("_count"):
                    acc_count += sample.value
            if acc_count:
                totals[f"{where} {family.name}"] = (acc_sum, acc_count)
    return totals


def latency_breakdown(
    before: dict[str, tuple[float, float]], after: dict[str, tuple[float, float]]
) -> dict[str, float]:
    """Mean seconds per observation of every latency that moved between two scrapes."""
    out = {}
    for key, (total, count) in after.items():
        prev_total, prev_count = before.get(key, (0.0, 0.0))
        if count > prev_count:
            out[key] = (total - prev_total) / (count - prev_count)
    return dict(sorted(out.items()))


def _trace_requests(args: argparse.Namespace) -> int:
    return replay.prepare_trace(args).num_requests


# ---- one config -------------------------------------------------------------------------------


@dataclass
class ConfigResult:
    label: str
    unloaded: dict[str, Any] = field(default_factory=dict)
    reference: dict[str, Any] = field(default_factory=dict)
    # mean seconds of each node's latency histograms over the reference pass (the profile)
    breakdown: dict[str, float] = field(default_factory=dict)
    points: list[dict[str, Any]] = field(default_factory=list)
    goodput_rps: float | None = None
    trace_bound: bool = False  # no failure found: the goodput is at least goodput_rps
    error: str = ""


class Sweep:
    """Runs every config in turn; owns the progress bar and the SLO (set by the first)."""

    def __init__(self, args: argparse.Namespace, out: Path) -> None:
        self.args = args
        self.out = out
        self.slo_s: float | None = None if args.slo_ms is None else args.slo_ms / 1000.0
        self.num_requests = _trace_requests(args)
        passes = 2 + int(args.reference) + args.max_points
        self.pbar = tqdm(
            total=passes * len(args.configs),
            unit="pass",
            file=sys.stderr,
            disable=not args.progress,
            desc="goodput",
        )

    def run_config(self, run: ConfigRun) -> ConfigResult:
        result = ConfigResult(run.label)
        run_dir = self.out / run.label
        planned = 2 + int(self.args.reference) + self.args.max_points
        start_n = self.pbar.n
        try:
            urls = endpoints_of(run)[1]
            with launched(self.args, run, run_dir) as front:
                self._config_passes(front, urls, run_dir, result)
        except (LaunchError, OSError, RuntimeError, ValueError) as exc:
            result.error = str(exc)
        self.pbar.update(start_n + planned - self.pbar.n)  # skipped passes count as done
        return result

    def _config_passes(
        self, front: str, urls: list[str], run_dir: Path, result: ConfigResult
    ) -> None:
        args = self.args
        self.pbar.set_postfix_str(f"{result.label}: warm-up")
        run_pass(
            args,
            front,
            run_dir / "warmup",
            mode="afap",
            concurrency=1,
            max_requests=args.warmup_requests,
        )  # first forwards of a process are slow
        self.pbar.update(1)
        self.pbar.set_postfix_str(f"{result.label}: unloaded")
        result.unloaded = run_pass(
            args,
            front,
            run_dir / "unloaded",
            mode="afap",
            concurrency=1,
            max_requests=args.unloaded_requests,
        )
        self.pbar.update(1)
        if result.unloaded.get("error"):
            raise RuntimeError(f"unloaded pass: {result.unloaded['error']}")
        if self.slo_s is None:
            p90 = ttft_percentile(result.unloaded, 90.0)
            if p90 is None:
                raise RuntimeError("unloaded pass: no TTFT to derive the SLO from")
            self.slo_s = args.slo_factor * p90
        if args.reference:
            self.pbar.set_postfix_str(f"{result.label}: reference")
            before = scrape_latencies(urls)
            result.reference = run_pass(
                args,
                front,
                run_dir / "reference",
                mode="afap",
                concurrency=args.reference_concurrency,
            )
            result.breakdown = latency_breakdown(before, scrape_latencies(urls))
            self.pbar.update(1)
        search = RateSearch(
            args.rate_start or result.unloaded["request_throughput_rps"],
            args.step,
            args.tolerance,
            args.max_points,
        )
        while (rate := search.next_rate()) is not None:
            self.pbar.set_postfix_str(f"{result.label}: {rate:.3g} req/s")
            span_s = self.num_requests / rate
            summary = run_pass(
                args,
                front,
                run_dir / f"rate-{rate:.4g}",
                mode="poisson-sessions",
                rate=rate,
                max_duration=args.point_duration_factor * span_s + 10,
                drain_timeout=10.0,
            )
            passed = not summary.get("error") and point_passes(
                summary, self.slo_s, args.slo_percentile
            )
            search.record(rate, passed, summary.get("request_throughput_rps"))
            result.points.append(point_row(result.label, rate, summary, passed))
            self.pbar.update(1)
        result.goodput_rps = search.best_pass
        result.trace_bound = search.trace_bound and search.lowest_fail is None


def point_row(label: str, rate: float, s: dict[str, Any], passed: bool) -> dict[str, Any]:
    return {
        "config": label,
        "rate_rps": rate,
        "achieved_rps": s.get("request_throughput_rps"),
        "ok": s.get("requests_ok"),
        "failed": s.get("requests_failed"),
        "skipped": s.get("requests_skipped"),
        "ttft_p50_s": s.get("ttft_p50_s"),
        "ttft_p90_s": s.get("ttft_p90_s"),
        "ttft_p99_s": s.get("ttft_p99_s"),
        "hit_rate": s.get("hit_rate"),
        "passed": passed,
        "error": s.get("error", ""),
    }


# ---- report -----------------------------------------------------------------------------------


def _ratio(value: float | None, base: float | None) -> float | None:
    return value / base if value is not None and base else None


def _host_share(summary: dict[str, Any]) -> float | None:
    tiers = summary.get("hit_rate_by_tier") or {}
    total = sum(tiers.values())
    return tiers.get("host", 0.0) / total if total else None


def summary_rows(results: list[ConfigResult]) -> list[dict[str, Any]]:
    base = results[0]
    rows = []
    for r in results:
        ref, ref_base = r.reference, base.reference
        rows.append(
            {
                "config": r.label,
                "unloaded_ttft_p90_s": ttft_percentile(r.unloaded, 90.0) if r.unloaded else None,
                "ref_hit_rate": ref.get("hit_rate"),
                "ref_of_theoretical": ref.get("achieved_over_theoretical"),
                "ref_host_share": _host_share(ref),
                "ref_ttft_p50_s": ref.get("ttft_p50_s"),
                "ref_ttft_p90_s": ref.get("ttft_p90_s"),
                "ref_ttft_p50_x": _ratio(ref.get("ttft_p50_s"), ref_base.get("ttft_p50_s")),
                "ref_ttft_p90_x": _ratio(ref.get("ttft_p90_s"), ref_base.get("ttft_p90_s")),
                "goodput_rps": r.goodput_rps,
                "goodput_x": _ratio(r.goodput_rps, base.goodput_rps),
                "points": len(r.points),
                # no failing rate found: the goodput is at least goodput_rps
                "lower_bound": r.trace_bound or all(p["passed"] for p in r.points),
                "error": r.error,
            }
        )
    return rows


def plot(
    out: Path, results: list[ConfigResult], slo_s: float | None, percentile: float
) -> str | None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print(
            "goodput: matplotlib not installed, no plot (pip install pdcache[plots])",
            file=sys.stderr,
        )
        return None
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for r in results:
        pts = sorted(
            (p for p in r.points if p["ttft_p90_s"] is not None), key=lambda p: p["rate_rps"]
        )
        if not pts:
            continue
        (line,) = ax.plot(
            [p["rate_rps"] for p in pts],
            [p["ttft_p90_s"] for p in pts],
            marker="o",
            label=f"{r.label} (goodput {r.goodput_rps or 0:.3g} req/s)",
        )
        failed = [p for p in pts if not p["passed"]]
        ax.plot(
            [p["rate_rps"] for p in failed],
            [p["ttft_p90_s"] for p in failed],
            "x",
            color=line.get_color(),
            markersize=9,
        )
    if slo_s is not None:
        ax.axhline(slo_s, color="k", linestyle="--", linewidth=1, label=f"SLO {slo_s * 1e3:.0f} ms")
    ax.set(
        xscale="log",
        yscale="log",
        xlabel="offered request rate (req/s)",
        ylabel=f"TTFT p{percentile:g} (s)",
        title="TTFT vs request rate (x: failed point)",
    )
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=8)
    fig.tight_layout()
    path = out / "goodput.png"
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return str(path)


def _public(summary: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in summary.items() if not k.startswith("_")}


def run(args: argparse.Namespace) -> int:
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    runs = [parse_config_arg(c, args.overrides) for c in args.configs]
    if len({r.label for r in runs}) != len(runs):
        print(
            "pdcache bench goodput: config labels must be unique (use LABEL=PATH)", file=sys.stderr
        )
        return 2
    try:
        sweep = Sweep(args, out)
    except ValueError as exc:
        print(f"pdcache bench goodput: {exc}", file=sys.stderr)
        return 2
    results = [sweep.run_config(r) for r in runs]
    sweep.pbar.close()
    rows = summary_rows(results)
    points = [p for r in results for p in r.points]
    picture = plot(out, results, sweep.slo_s, args.slo_percentile)
    extra = {
        "trace": args.trace,
        "requests_per_pass": sweep.num_requests,
        "slo_ms": None if sweep.slo_s is None else sweep.slo_s * 1000,
        "slo_percentile": args.slo_percentile,
        "plot": picture,
    }
    payload = {
        **extra,
        "rows": rows,
        "points": points,
        "configs": {r.label: {"path": str(r.path), "overrides": list(r.overrides)} for r in runs},
        "summaries": {
            res.label: {
                "unloaded": _public(res.unloaded),
                "reference": _public(res.reference),
                "reference_latency_breakdown_s": res.breakdown,
            }
            for res in results
        },
    }
    (out / "goodput.json").write_text(json.dumps(payload, indent=2, default=str))
    emit("goodput: rate points", points, columns=POINT_COLUMNS, out=sys.stdout)
    profile = [
        {"config": res.label, "endpoint metric": key, "mean_s": value}
        for res in results
        for key, value in res.breakdown.items()
        if "inter_token" not in key and "sglang:" not in key
    ]
    if profile:
        emit(
            "latency breakdown over the reference pass (mean per observation)",
            profile,
            out=sys.stdout,
        )
    emit(
        f"goodput at TTFT p{args.slo_percentile:g} <= SLO (x: to {runs[0].label})",
        rows,
        columns=TABLE_COLUMNS,
        json_path=args.json_path,
        extra=extra,
        out=sys.stdout,
    )
    for row in rows:
        if row["error"]:
            print(f"{row['config']}: {row['error']}")
    return 0 if all(not row["error"] for row in rows) else 1
