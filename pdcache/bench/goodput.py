"""`pdcache bench goodput CONFIG...`: per topology, the highest request rate whose TTFT p90
stays under an SLO, on a multi-turn trace with Poisson arrivals.

Load (`bench replay --mode poisson-sessions`): sessions start as a Poisson process and each
next turn of a session is sent its think time after the previous turn completed (open loop:
no gate on later turns, `--concurrency` only a safety cap, 256 by default). **Request rate**
R is the *offered* rate: sessions start at R / (mean turns per session) per second, so R
requests/s are offered in the long run; the achieved rate (ok requests / wall time) is
reported beside it. **Goodput** is the highest R tried at which every request succeeded and
the TTFT p`--slo-percentile` (90) was <= the SLO. With a TPOT SLO (`--tpot-slo-ms`, or
`--tpot-slo-factor` x the first config's unloaded TPOT p90) a point must also keep the TPOT
(time per output token after the first: (e2e - TTFT) / (output tokens - 1), per request, as
vLLM's `--goodput tpot:` and DistServe count it) at that percentile within it: a unified server
that keeps its TTFT by starving its running decodes then fails where it stops serving them.
Off by default (a TTFT-only goodput); every point reports its TPOT p50 / p90.

For each CONFIG (`[LABEL=]PATH[+KEY=VALUE...]`, as `bench compare`), launched once
(`pdcache.bench.stack.launched`), every pass begins with `/flush_cache` (device and host tiers emptied)
and sends a fresh `cache_salt` and session prefix, so no pass hits pages of another:

0. warm-up: `--warmup-requests` requests, not measured (a process's first forwards are slow).
1. unloaded: the first `--unloaded-requests` requests, one at a time. The SLO is `--slo-ms`,
   or `--slo-factor` x the first config's unloaded TTFT p90.
2. reference (unless `--no-reference`): the first `--reference-requests` requests (default:
   the whole trace) as fast as possible at `--reference-concurrency` (hit rate per tier and
   its share of the hits, TTFT p50/p90: `bench compare`'s numbers, with ratios to the first
   config), and the latency breakdown: the mean of every `*_seconds`
   histogram of every node's `/metrics` over this pass (router, prefill, decode TTFT, the
   prefill's wait for decode, admission waits).
3. the sweep: from `--rate-start` (default: the config's unloaded request throughput) the rate
   is multiplied by `--step` while points pass (divided while they fail), up to `--max-rate`,
   then bisected (geometric midpoint) between the best pass and the lowest failure until they
   are within `--tolerance` or `--max-points` points ran.

A point is sized by time, not by the trace: at rate R it replays the first k sessions of the
trace, k = max(`--min-point-sessions`, R x `--point-seconds` / mean turns per session), so its
session starts span `--point-seconds` at every rate and the offered rate is sustained that
long (a 16-session trace could not: at 14 req/s all its sessions overlapped and the point
measured a ramp, not a load). The trace must hold enough sessions for the top rate: the rates
a point may offer are capped at (trace requests / `--point-seconds`). A point's verdict is
the TTFT p90 over *all* its successful requests (not a per-window p90), and a failure that one
window of `--window-seconds` explains alone (that window's p90 is over the SLO, every other
window's and the rest's p90 within it: a stall of the machine, not a queue that grows) is run
again once (`--noisy-retries` per config); the retry's verdict counts. An overloaded point is
bounded: dispatch stops at `--point-duration-factor` x its arrival span (+10 s), and unsent
requests fail it; and a point stops early (`stopped_early`; `--no-early-stop` to run it out)
once so many of its requests missed the SLO that its TTFT p90 must exceed it. When a config still passes at the top rate it may offer (`--max-rate` or the
trace's cap) or at its last point, its goodput is a lower bound: `bound` names why
(`max-rate`, `trace`, `max-points`), else it is empty. The run prints its estimated duration
first (every config using all its points; and the most, if every point overloads).

The table gives goodput ratios to the first config (`goodput_x`) and to `--baseline`
(`goodput_x_baseline`); what those ratios should reach is the reader's call (the README's
goodput sections say what we aimed for and met), not the benchmark's.

Writes `DIR/goodput.json`, `DIR/goodput.png` (TTFT p90 vs rate per config, the SLO line; with a
TPOT SLO, TPOT p90 vs rate beside it) and
one folder per config and pass (`requests.jsonl`, `summary.json`, the replay's tables).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
import urllib.request
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from tqdm import tqdm

from pdcache.bench.replay import (
    ReplayResult,
    add_replay_options,
    prepare_trace,
    print_report,
    replay,
)
from pdcache.bench.replay_config import ReplayConfig
from pdcache.bench.replay_records import RequestRecord
from pdcache.bench.stack import (
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
    "unloaded_tpot_p90_s",
    "ref_hit_rate",
    "ref_of_theoretical",
    "ref_device_share",
    "ref_host_share",
    "ref_storage_share",
    "ref_ttft_p50_s",
    "ref_ttft_p90_s",
    "ref_ttft_p50_x",
    "ref_ttft_p90_x",
    "goodput_rps",
    "failed_at_rps",
    "goodput_x",
    "goodput_x_baseline",
    "goodput_hit_rate",
    "goodput_live_pages",
    "bound",
    "points",
)
POINT_COLUMNS = (
    "config",
    "rate_rps",
    "sessions",
    "live_sessions",
    "live_pages",
    "achieved_rps",
    "ok",
    "failed",
    "skipped",
    "ttft_p50_s",
    "ttft_p90_s",
    "ttft_p99_s",
    "tpot_p50_s",
    "tpot_p90_s",
    "hit_rate",
    "windows_over_slo",
    "stopped_early",
    "retry",
    "passed",
    "failed_on",
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
    parser.add_argument(
        "--tpot-slo-ms",
        type=float,
        default=None,
        help="also require TPOT (time per output token after the first) p<percentile> <= "
        "this, in ms (default: no TPOT SLO)",
    )
    parser.add_argument(
        "--tpot-slo-factor",
        type=float,
        default=None,
        help="TPOT SLO = this x the first config's unloaded TPOT p90 (when --tpot-slo-ms is "
        "not given)",
    )
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
        "--reference-requests",
        type=int,
        default=None,
        help="requests of the reference pass (whole sessions in start order; default: all)",
    )
    parser.add_argument(
        "--baseline",
        default=None,
        metavar="LABEL",
        help="config the goodput_x_baseline column refers to (default: pd-device if present)",
    )
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
        "--max-rate", type=float, default=64.0, help="highest offered rate tried, requests/s"
    )
    parser.add_argument(
        "--point-seconds",
        type=float,
        default=20.0,
        help="a point's session starts span this long at every rate (sessions it replays: "
        "rate x this / mean turns per session)",
    )
    parser.add_argument(
        "--min-point-sessions", type=int, default=4, help="sessions of a point at least"
    )
    parser.add_argument(
        "--window-seconds",
        type=float,
        default=5.0,
        help="window of the one-noisy-window check (requests by dispatch time)",
    )
    parser.add_argument(
        "--no-early-stop",
        dest="early_stop",
        action="store_false",
        help="run failing points to the end (default: a point stops once enough of its "
        "requests missed the SLO that it cannot pass)",
    )
    parser.add_argument(
        "--noisy-retries",
        type=int,
        default=1,
        help="per config: failed points that one noisy window explains, run again",
    )
    parser.add_argument(
        "--point-duration-factor",
        type=float,
        default=2.0,
        help="a point dispatches for at most this x its arrival span + 10 s",
    )
    add_replay_options(parser)
    parser.set_defaults(concurrency=256, mode="poisson-sessions")


# ---- the search ---------------------------------------------------------------------------


@dataclass
class RateSearch:
    """Step up (or down) by `step` until a pass and a failure bracket the goodput, then bisect
    geometrically; `next_rate()` is None when done. Rates stay within [`min_rate`,
    `max_rate`]. Pure: the caller runs each point and `record`s its verdict."""

    start: float
    step: float = 2.0
    tolerance: float = 0.15
    max_points: int = 6
    max_rate: float = math.inf
    min_rate: float = 0.0
    best_pass: float | None = None
    lowest_fail: float | None = None
    tried: list[tuple[float, bool]] = field(default_factory=list)

    def next_rate(self) -> float | None:
        if len(self.tried) >= self.max_points:
            return None
        if not self.tried:
            return min(self.start, self.max_rate)
        lo, hi = self.best_pass, self.lowest_fail
        if lo is None:  # failures only: step down
            down = hi / self.step if hi is not None else self.start
            return down if down >= self.min_rate else None
        if hi is None:  # passes only: step up, to the cap at most
            return min(lo * self.step, self.max_rate) if lo < self.max_rate else None
        if hi / lo <= 1.0 + self.tolerance:
            return None
        return math.sqrt(lo * hi)

    def record(self, rate: float, passed: bool) -> None:
        self.tried.append((rate, passed))
        if passed and (self.best_pass is None or rate > self.best_pass):
            self.best_pass = rate
        if not passed and (self.lowest_fail is None or rate < self.lowest_fail):
            self.lowest_fail = rate

    def bound(self, trace_cap: float) -> str:
        """Why the goodput is only a lower bound ("" when a failure brackets it): it passed
        at the highest rate allowed, set by the trace ("trace") or `--max-rate`, or the
        points ran out while it still passed ("max-points")."""
        if self.best_pass is None or self.lowest_fail is not None:
            return ""
        if self.best_pass >= self.max_rate * (1 - 1e-9):
            return "trace" if trace_cap <= self.max_rate * (1 + 1e-9) else "max-rate"
        return "max-points"


def point_sessions(session_turns: list[int], rate: float, seconds: float, minimum: int) -> int:
    """Sessions a point at `rate` replays so that its session starts (at rate / mean turns
    per session) span `seconds`: at least `minimum`, at most the trace's."""
    if not session_turns:
        return 0
    mean_turns = sum(session_turns) / len(session_turns)
    wanted = max(minimum, math.ceil(rate * seconds / mean_turns))
    return min(wanted, len(session_turns))


def slow_requests_to_fail(requests: int, percentile: float) -> int:
    """How many of `requests` TTFTs over the SLO make the TTFT at `percentile` (numpy's
    linear interpolation) over the SLO whatever the others are: the sorted values at both
    ends of its interpolation are then slow ones."""
    return requests - math.floor(percentile / 100.0 * (requests - 1))


def trace_rate_cap(session_turns: list[int], seconds: float) -> float:
    """The highest rate at which the whole trace still spans `seconds` of session starts."""
    return sum(session_turns) / seconds


def one_noisy_window(
    dispatch_s: list[float], ttfts: list[float], slo_s: float, percentile: float, window_s: float
) -> int | None:
    """The window (index of `window_s` slices of dispatch time) that alone fails the point:
    its TTFT percentile is over the SLO, no other window's is, and the percentile over all
    requests outside it is within the SLO. None when the failure is not one window's (a
    queue that grows fails every later window)."""
    import numpy as np

    windows: dict[int, list[float]] = {}
    for t, ttft in zip(dispatch_s, ttfts):
        windows.setdefault(int(t // window_s), []).append(ttft)
    over = [w for w, vals in windows.items() if float(np.percentile(vals, percentile)) > slo_s]
    if len(over) != 1:
        return None
    rest = [v for w, vals in windows.items() if w != over[0] for v in vals]
    if not rest or float(np.percentile(rest, percentile)) > slo_s:
        return None
    return over[0]


def windows_over_slo(
    dispatch_s: list[float], ttfts: list[float], slo_s: float, percentile: float, window_s: float
) -> int:
    """How many `window_s` windows of dispatch time have a TTFT percentile over the SLO."""
    import numpy as np

    windows: dict[int, list[float]] = {}
    for t, ttft in zip(dispatch_s, ttfts):
        windows.setdefault(int(t // window_s), []).append(ttft)
    return sum(float(np.percentile(v, percentile)) > slo_s for v in windows.values())


def estimate_seconds(
    args: argparse.Namespace, num_configs: int, session_turns: list[int], think_s: float
) -> tuple[float, float]:
    """The run's duration when every config uses all its points and retries: (estimate, most).
    Per config: startup ~12 s, ~0.5 s per warm-up and unloaded request, ~0.3 s per reference
    request / its concurrency, and per point its span + one session's think times + ~0.6 s
    per turn (the tail after the last start) + 2 s (flush, replay start); at most, a point
    runs `--point-duration-factor` x its span + 10 s + the 10 s drain (calibrated on the
    2-core machine, tiny preset, 2026-12: a 3 s point took 8.5 s, a startup 9 s)."""
    mean_turns = sum(session_turns) / max(1, len(session_turns))
    reference = args.reference_requests or sum(session_turns)
    fixed = 12 + 0.5 * (args.unloaded_requests + args.warmup_requests)
    if args.reference:
        fixed += 0.3 * reference / max(1, args.reference_concurrency)
    points = args.max_points + args.noisy_retries
    typical = args.point_seconds + think_s + 0.6 * mean_turns + 2
    longest = args.point_duration_factor * args.point_seconds + 22
    return num_configs * (fixed + points * typical), num_configs * (fixed + points * longest)


def derive_slos(
    unloaded: dict[str, Any],
    slo_s: float | None,
    tpot_slo_s: float | None,
    slo_factor: float,
    tpot_slo_factor: float | None,
) -> tuple[float, float | None]:
    """The TTFT and TPOT SLOs: the given ones, else their factor x the unloaded pass's p90 (no
    TPOT SLO without a factor). Both from the same pass, or RuntimeError and neither."""
    if slo_s is None:
        p90 = ttft_percentile(unloaded, 90.0)
        if p90 is None:
            raise RuntimeError("unloaded pass: no TTFT to derive the SLO from")
        slo_s = slo_factor * p90
    if tpot_slo_s is None and tpot_slo_factor is not None:
        tpot_p90 = tpot_percentile(unloaded, 90.0)
        if tpot_p90 is None:
            raise RuntimeError(
                "unloaded pass: no TPOT (answers of 2+ tokens) to derive the TPOT SLO from"
            )
        tpot_slo_s = tpot_slo_factor * tpot_p90
    return slo_s, tpot_slo_s


def failed_on(summary: dict[str, Any], passed: bool, tpot_failed: bool) -> str:
    """Why a point failed: "" (it passed), "error", "incomplete" (a request failed or was not
    sent), "ttft" or "tpot" (its TTFT was within the SLO, its TPOT not)."""
    if passed:
        return ""
    if summary.get("error"):
        return "error"
    if tpot_failed:
        return "tpot"
    return "ttft" if _complete(summary) or summary.get("stopped_early") else "incomplete"


def retry_window(
    summary: dict[str, Any], failed: str, slo_s: float, percentile: float, window_s: float
) -> int | None:
    """The one window of dispatch time that alone failed the point on its TTFT (so the point
    is run again), or None: it passed, it failed on its TPOT (the one-window check reads
    TTFTs), on an error, or on requests that failed (cancelled ones of an early stop are no
    failures of the stack)."""
    if failed not in ("ttft", "incomplete") or (
        summary.get("requests_failed") and not summary.get("stopped_early")
    ):
        return None
    dispatch, ttfts = summary.get("_dispatch") or [], summary.get("_ttfts") or []
    return one_noisy_window(dispatch, ttfts, slo_s, percentile, window_s)


def point_passes(
    summary: dict[str, Any], slo_s: float, percentile: float, tpot_slo_s: float | None = None
) -> bool:
    """Every request of the trace succeeded, the TTFT at `percentile` is within the SLO and,
    with a TPOT SLO, so is the TPOT at `percentile` (a pass without a TPOT, every answer one
    token long, passes on its TTFT)."""
    ttft = ttft_percentile(summary, percentile)
    if not (_complete(summary) and ttft is not None and ttft <= slo_s):
        return False
    tpot = tpot_percentile(summary, percentile)
    return tpot_slo_s is None or tpot is None or tpot <= tpot_slo_s


def _complete(summary: dict[str, Any]) -> bool:
    """Every request of the pass was sent and answered."""
    return summary.get("requests_ok") == summary.get("requests_total") and not summary.get(
        "requests_failed"
    )


def ttft_percentile(summary: dict[str, Any], percentile: float) -> float | None:
    """TTFT at `percentile` over the pass's successful requests (its requests.jsonl)."""
    return _percentile(summary.get("_ttfts") or [], percentile)


def tpot_percentile(summary: dict[str, Any], percentile: float) -> float | None:
    """TPOT at `percentile` over the pass's successful requests with two tokens or more."""
    return _percentile(summary.get("_tpots") or [], percentile)


def request_tpot(record: RequestRecord) -> float | None:
    """Seconds per output token after the first: (e2e - TTFT) / (output tokens - 1)."""
    tokens, ttft, e2e = record.output_tokens or 0, record.ttft_s, record.e2e_s
    if tokens < 2 or ttft is None or e2e is None:
        return None
    return max(0.0, e2e - ttft) / (tokens - 1)


def _percentile(values: list[float], percentile: float) -> float | None:
    import numpy as np

    return float(np.percentile(values, percentile)) if values else None


# ---- one pass -------------------------------------------------------------------------------


def flush(front: str, timeout_s: float = 60.0) -> None:
    """Empty the device and host tiers of every node (`/flush_cache`, waits for idle)."""
    req = urllib.request.Request(f"{front}/flush_cache?timeout={timeout_s:g}", method="POST")
    with urllib.request.urlopen(req, timeout=timeout_s + 30) as resp:
        if resp.status != 200:
            raise RuntimeError(f"/flush_cache answered {resp.status}")


def run_pass(config: ReplayConfig, front: str, out: Path, **changes: Any) -> dict[str, Any]:
    """One replay of `config` (with `changes`) against `front` into `out` (its tables go to
    out/replay.txt): the summary, with `_ttfts` (the successful requests' TTFTs) and `error`
    when it did not complete."""
    flush(front)
    pass_config = replace(
        config, url=front, plots=False, progress=False,
        cache_salt=f"goodput-{uuid.uuid4().hex[:12]}", session_prefix=None, **changes)
    out.mkdir(parents=True, exist_ok=True)
    with (out / "replay.txt").open("w") as log:
        try:
            result = replay(pass_config, out)
        except ValueError as exc:
            print(f"pdcache bench replay: {exc}", file=log)
            return {"error": f"replay: {exc} (see {out / 'replay.txt'})"}
        print_report(result, out=log)
        if result.failure:
            print(f"pdcache bench replay: FAILED: {result.failure}", file=log)
    return pass_summary(result, pass_config.page_size)


def pass_summary(result: ReplayResult, page_size: int) -> dict[str, Any]:
    """The replay's summary with what the verdict and the point's row read from its records
    (`_ttfts`, `_dispatch`, `_tpots`, `_live_sessions`, `_live_pages`) and `error`."""
    summary = dict(result.summary)
    timed = [r for r in result.records if r.ok and r.ttft_s is not None]
    summary["_ttfts"] = [r.ttft_s for r in timed]
    summary["_dispatch"] = [r.dispatch_s for r in timed]
    summary["_tpots"] = [t for r in timed if (t := request_tpot(r)) is not None]
    summary["_live_sessions"] = live_sessions(result.records)
    summary["_live_pages"] = live_pages(result.records, page_size)
    if result.failure:
        summary["error"] = f"replay failed: {result.failure}"
    return summary


def live_sessions(records: Sequence[RequestRecord]) -> float | None:
    """Mean sessions in flight over the pass (Little's law: the sessions' spans from first
    dispatch to last answer, summed, over the pass's span): with the pages per session, the
    live working set the device pool had to hold."""
    spans: dict[str, list[float]] = {}
    for r in records:
        end = r.dispatch_s + (r.e2e_s or 0.0)
        span = spans.setdefault(r.session_id, [r.dispatch_s, end])
        span[0], span[1] = min(span[0], r.dispatch_s), max(span[1], end)
    if not spans:
        return None
    wall = max(e for _, e in spans.values()) - min(b for b, _ in spans.values())
    return sum(e - b for b, e in spans.values()) / wall if wall > 0 else None


def live_pages(records: Sequence[RequestRecord], page_size: int) -> float | None:
    """Mean pages the live sessions' contexts hold over the pass: the working set a cache must
    keep for every next turn to hit. A session holds its latest request's prompt + answer from
    that request's dispatch to the next one's (to its answer, for the last); the prefix its
    first turns share (the system prompt: the longest prefix a first turn found cached, taken
    as common to every session) is counted once, not per session, so this is the working set,
    not the sum of the contexts."""
    by_session: dict[str, list[RequestRecord]] = {}
    for r in records:
        by_session.setdefault(r.session_id, []).append(r)
    for turns in by_session.values():
        turns.sort(key=lambda r: r.dispatch_s)
    # the prefix first turns found cached before them: the system prompt every session shares
    # (assumed common to all, the first session's included, which found nothing cached)
    shared = max((t[0].theoretical_cached_tokens or 0 for t in by_session.values()), default=0)
    held_page_seconds = 0.0
    begin, end = float("inf"), float("-inf")
    for turns in by_session.values():
        for i, r in enumerate(turns):
            context = r.prompt_tokens + (r.output_tokens or 0) - shared
            until = (turns[i + 1].dispatch_s if i + 1 < len(turns)
                     else r.dispatch_s + (r.e2e_s or 0.0))
            held_page_seconds += max(context, 0) // page_size * (until - r.dispatch_s)
            begin, end = min(begin, r.dispatch_s), max(end, until)
    if end <= begin:
        return None
    return shared // page_size + held_page_seconds / (end - begin)


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


def _trace_shape(config: ReplayConfig) -> tuple[list[int], float]:
    """Turns of every session of the trace, in start order, and the mean think time a
    session spends (seconds, summed over its turns)."""
    trace = prepare_trace(config)
    turns = [len(s.turns) for s in trace.sessions]
    think = sum(t.delay_s for s in trace.sessions for t in s.turns) / max(1, len(turns))
    return turns, think


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
    lowest_fail_rps: float | None = None  # the goodput is below this (None: none failed)
    bound: str = ""  # why the goodput is only a lower bound (RateSearch.bound), "" if not
    error: str = ""


class Sweep:
    """Runs every config in turn; owns the progress bar and the SLO (set by the first)."""

    def __init__(self, args: argparse.Namespace, out: Path) -> None:
        self.args = args
        self.out = out
        self.slo_s: float | None = None if args.slo_ms is None else args.slo_ms / 1000.0
        self.tpot_slo_s: float | None = (
            None if args.tpot_slo_ms is None else args.tpot_slo_ms / 1000.0
        )
        self.config = ReplayConfig.from_args(args)
        self.session_turns, self.think_s = _trace_shape(self.config)
        self.num_requests = sum(self.session_turns)
        self.trace_cap = trace_rate_cap(self.session_turns, args.point_seconds)
        self.max_rate = min(args.max_rate, self.trace_cap)
        self.estimate_s = estimate_seconds(
            args, len(args.configs), self.session_turns, self.think_s
        )
        self.pbar = tqdm(
            total=self.planned * len(args.configs),
            unit="pass",
            file=sys.stderr,
            disable=not args.progress,
            desc="goodput",
        )

    @property
    def planned(self) -> int:
        """Passes of one config at most: warm-up, unloaded, reference, points, retries."""
        args = self.args
        return 2 + int(args.reference) + args.max_points + args.noisy_retries

    def run_config(self, run: ConfigRun) -> ConfigResult:
        result = ConfigResult(run.label)
        run_dir = self.out / run.label
        planned = self.planned
        start_n = self.pbar.n
        try:
            urls = endpoints_of(run)[1]
            with launched(run, run_dir, self.args.startup_timeout,
                          self.args.stop_timeout) as stack:
                self._config_passes(stack.front, urls, run_dir, result)
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
            self.config,
            front,
            run_dir / "warmup",
            mode="afap",
            concurrency=1,
            max_requests=args.warmup_requests,
        )  # first forwards of a process are slow
        self.pbar.update(1)
        self.pbar.set_postfix_str(f"{result.label}: unloaded")
        result.unloaded = run_pass(
            self.config,
            front,
            run_dir / "unloaded",
            mode="afap",
            concurrency=1,
            max_requests=args.unloaded_requests,
        )
        self.pbar.update(1)
        if result.unloaded.get("error"):
            raise RuntimeError(f"unloaded pass: {result.unloaded['error']}")
        self.slo_s, self.tpot_slo_s = derive_slos(
            result.unloaded, self.slo_s, self.tpot_slo_s, args.slo_factor, args.tpot_slo_factor
        )
        if args.reference:
            self.pbar.set_postfix_str(f"{result.label}: reference")
            before = scrape_latencies(urls)
            result.reference = run_pass(
                self.config,
                front,
                run_dir / "reference",
                mode="afap",
                concurrency=args.reference_concurrency,
                max_requests=args.reference_requests or args.max_requests,
            )
            result.breakdown = latency_breakdown(before, scrape_latencies(urls))
            self.pbar.update(1)
        search = RateSearch(
            args.rate_start or result.unloaded["request_throughput_rps"],
            args.step,
            args.tolerance,
            args.max_points,
            max_rate=self.max_rate,
        )
        retries = args.noisy_retries
        while (rate := search.next_rate()) is not None:
            summary, row = self._point(front, run_dir, result.label, rate, retry=False)
            if not row["passed"] and row["noisy_window"] is not None and retries > 0:
                retries -= 1  # one stalled window alone failed it: run it again
                result.points.append(row)
                summary, row = self._point(front, run_dir, result.label, rate, retry=True)
            search.record(rate, row["passed"])
            result.points.append(row)
        result.goodput_rps = search.best_pass
        result.lowest_fail_rps = search.lowest_fail
        result.bound = search.bound(self.trace_cap)

    def _point(
        self, front: str, run_dir: Path, label: str, rate: float, retry: bool
    ) -> tuple[dict[str, Any], dict[str, Any]]:
        """One rate point: the first sessions of the trace that span --point-seconds."""
        args = self.args
        sessions = point_sessions(
            self.session_turns, rate, args.point_seconds, args.min_point_sessions
        )
        requests = sum(self.session_turns[:sessions])
        self.pbar.set_postfix_str(f"{label}: {rate:.3g} req/s{' (retry)' if retry else ''}")
        assert self.slo_s is not None  # set by the first config's unloaded pass
        summary = run_pass(
            self.config,
            front,
            run_dir / f"rate-{rate:.4g}{'-retry' if retry else ''}",
            mode="poisson-sessions",
            rate=rate,
            max_requests=requests,
            max_duration_s=args.point_duration_factor * requests / rate + 10,
            drain_timeout_s=10.0,
            # the verdict is settled once this many missed the SLO: stop there
            stop_after_slow=slow_requests_to_fail(requests, args.slo_percentile)
            if args.early_stop
            else None,
            slow_ttft_s=self.slo_s,
        )
        passed = not summary.get("error") and point_passes(
            summary, self.slo_s, args.slo_percentile, self.tpot_slo_s
        )
        row = point_row(label, rate, summary, passed)
        tpot_failed = not passed and point_passes(summary, self.slo_s, args.slo_percentile)
        failed = failed_on(summary, passed, tpot_failed)
        dispatch, ttfts = summary.get("_dispatch") or [], summary.get("_ttfts") or []
        row.update(
            sessions=sessions,
            live_sessions=summary.get("_live_sessions"),
            live_pages=summary.get("_live_pages"),
            retry=retry,
            windows_over_slo=windows_over_slo(
                dispatch, ttfts, self.slo_s, args.slo_percentile, args.window_seconds
            ),
            stopped_early=bool(summary.get("stopped_early")),
            failed_on=failed,
            noisy_window=retry_window(
                summary, failed, self.slo_s, args.slo_percentile, args.window_seconds
            ),
        )
        self.pbar.update(1)
        return summary, row


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
        "tpot_p50_s": tpot_percentile(s, 50.0),
        "tpot_p90_s": tpot_percentile(s, 90.0),
        "hit_rate": s.get("hit_rate"),
        "passed": passed,
        "error": s.get("error", ""),
    }


# ---- report -----------------------------------------------------------------------------------


def _ratio(value: float | None, base: float | None) -> float | None:
    return value / base if value is not None and base else None


def _tier_share(summary: dict[str, Any], tier: str) -> float | None:
    """The share of the pass's hits (cached prompt tokens) that `tier` served."""
    tiers = summary.get("hit_rate_by_tier") or {}
    total = sum(tiers.values())
    return tiers.get(tier, 0.0) / total if total else None


def summary_rows(results: list[ConfigResult], baseline: str | None = None) -> list[dict[str, Any]]:
    """One row per config; the `_x` ratios refer to the first config (the ideal), and
    `goodput_x_baseline` to the config labelled `baseline` (PD with a device-only cache). The
    goodput is the best passing rate; the true one lies below `failed_at_rps`, the lowest
    failing one (within 1 + --tolerance of it when the search converged)."""
    base = results[0]
    by_label = {r.label: r for r in results}
    base_goodput = by_label[baseline].goodput_rps if baseline in by_label else None
    rows = []
    for r in results:
        ref, ref_base = r.reference, base.reference
        at_goodput = _goodput_point(r)
        rows.append(
            {
                "config": r.label,
                "unloaded_ttft_p90_s": ttft_percentile(r.unloaded, 90.0) if r.unloaded else None,
                "unloaded_tpot_p90_s": tpot_percentile(r.unloaded, 90.0) if r.unloaded else None,
                "ref_hit_rate": ref.get("hit_rate"),
                "ref_theoretical_hit_rate": ref.get("theoretical_hit_rate"),
                "ref_of_theoretical": ref.get("achieved_over_theoretical"),
                **{f"ref_{t}_share": _tier_share(ref, t) for t in ("device", "host", "storage")},
                "ref_ttft_p50_s": ref.get("ttft_p50_s"),
                "ref_ttft_p90_s": ref.get("ttft_p90_s"),
                "ref_ttft_p50_x": _ratio(ref.get("ttft_p50_s"), ref_base.get("ttft_p50_s")),
                "ref_ttft_p90_x": _ratio(ref.get("ttft_p90_s"), ref_base.get("ttft_p90_s")),
                "goodput_rps": r.goodput_rps,
                "failed_at_rps": r.lowest_fail_rps,
                "goodput_x": _ratio(r.goodput_rps, base.goodput_rps),
                "goodput_x_baseline": _ratio(r.goodput_rps, base_goodput),
                # the pressure at the goodput: the hit rate there and the live working set
                # (`live_pages`) the prefill's pools had to hold
                "goodput_hit_rate": at_goodput.get("hit_rate"),
                "goodput_live_pages": at_goodput.get("live_pages"),
                "points": len(r.points),
                # passed at the highest rate it could be offered: the goodput is at least this
                "bound": r.bound,
                "lower_bound": bool(r.bound),
                "error": r.error,
            }
        )
    return rows


def _goodput_point(result: ConfigResult) -> dict[str, Any]:
    """The passing point at the goodput rate (its last run, if retried); {} when none."""
    passing = [p for p in result.points if p["passed"] and p["rate_rps"] == result.goodput_rps]
    return passing[-1] if passing else {}


def plot(
    out: Path,
    results: list[ConfigResult],
    slo_s: float | None,
    tpot_slo_s: float | None = None,
) -> str | None:
    """`out/goodput.png`: TTFT p90 vs offered rate per config (x: failed points), and beside it
    TPOT p90 vs rate when the run had a TPOT SLO (a point may fail on either)."""
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
    panels = [("ttft_p90_s", "TTFT", slo_s)]
    if tpot_slo_s is not None:
        panels.append(("tpot_p90_s", "TPOT", tpot_slo_s))
    fig, axes = plt.subplots(1, len(panels), figsize=(7 * len(panels), 4.5), squeeze=False)
    for ax, (key, name, slo) in zip(axes[0], panels):
        _plot_metric(ax, results, key, slo)
        ax.set(
            xscale="log",
            yscale="log",
            xlabel="offered request rate (req/s)",
            ylabel=f"{name} p90 (s)",  # the points' p90 columns, whatever --slo-percentile
            title=f"{name} vs request rate (x: failed point)",
        )
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=8)
    fig.tight_layout()
    path = out / "goodput.png"
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return str(path)


def _plot_metric(ax: Any, results: list[ConfigResult], key: str, slo_s: float | None) -> None:
    for r in results:
        pts = sorted((p for p in r.points if p.get(key) is not None), key=lambda p: p["rate_rps"])
        if not pts:
            continue
        (line,) = ax.plot(
            [p["rate_rps"] for p in pts],
            [p[key] for p in pts],
            marker="o",
            label=f"{r.label} (goodput {r.goodput_rps or 0:.3g} req/s)",
        )
        failed = [p for p in pts if not p["passed"]]
        ax.plot(
            [p["rate_rps"] for p in failed],
            [p[key] for p in failed],
            "x",
            color=line.get_color(),
            markersize=9,
        )
    if slo_s is not None:
        ax.axhline(slo_s, color="k", linestyle="--", linewidth=1, label=f"SLO {slo_s * 1e3:.0f} ms")


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
    labels = [r.label for r in runs]
    baseline = args.baseline or ("pd-device" if "pd-device" in labels else None)
    if baseline is not None and baseline not in labels:
        print(f"pdcache bench goodput: --baseline {baseline!r} is no config label", file=sys.stderr)
        return 2
    try:
        sweep = Sweep(args, out)
    except ValueError as exc:
        print(f"pdcache bench goodput: {exc}", file=sys.stderr)
        return 2
    print(
        f"goodput: {len(runs)} configs x at most {sweep.planned} passes; rates up to "
        f"{sweep.max_rate:.3g} req/s (trace cap {sweep.trace_cap:.3g}); estimated "
        f"{sweep.estimate_s[0] / 60:.1f} min (at most {sweep.estimate_s[1] / 60:.1f} if every "
        "point overloads)",
        file=sys.stderr,
    )
    started = time.monotonic()
    results = [sweep.run_config(r) for r in runs]
    sweep.pbar.close()
    elapsed_s = time.monotonic() - started
    rows = summary_rows(results, baseline)
    points = [p for r in results for p in r.points]
    picture = plot(out, results, sweep.slo_s, sweep.tpot_slo_s)
    extra = {
        "trace": args.trace,
        "requests_per_pass": sweep.num_requests,
        "slo_ms": None if sweep.slo_s is None else sweep.slo_s * 1000,
        "slo_percentile": args.slo_percentile,
        "tpot_slo_ms": None if sweep.tpot_slo_s is None else sweep.tpot_slo_s * 1000,
        "baseline": baseline,
        "point_seconds": args.point_seconds,
        "max_rate_rps": sweep.max_rate,
        "trace_rate_cap_rps": sweep.trace_cap,
        "reference_requests": args.reference_requests or sweep.num_requests,
        "estimated_s": round(sweep.estimate_s[0]),
        "estimated_max_s": round(sweep.estimate_s[1]),
        "elapsed_s": round(elapsed_s),
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
    slos = "TTFT" if sweep.tpot_slo_s is None else "TTFT and TPOT"
    emit(
        f"goodput at {slos} p{args.slo_percentile:g} <= SLO (x: to {runs[0].label})",
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
