"""`pdcache bench goodput`: the rate search, Poisson session arrivals, and one real sweep."""

from __future__ import annotations

import importlib.util
import json
import math
from pathlib import Path

import numpy as np
import pytest

from pdcache.bench.goodput import (
    ConfigResult,
    RateSearch,
    derive_slos,
    failed_on,
    live_pages,
    live_sessions,
    one_noisy_window,
    point_passes,
    point_sessions,
    request_tpot,
    retry_window,
    slow_requests_to_fail,
    summary_rows,
    tpot_percentile,
    trace_rate_cap,
    windows_over_slo,
)
from pdcache.bench.replay_records import RequestRecord
from pdcache.bench.replay_run import poisson_session_starts
from pdcache.bench.traces import SyntheticSpec, synthetic_trace
from pdcache.cli import main as pdcache_main
from tests.net_support import free_ports, unified_topology


def _run_search(search: RateSearch, capacity: float) -> list[float]:
    """Drive the search against a server that passes every rate <= capacity."""
    while (rate := search.next_rate()) is not None:
        search.record(rate, rate <= capacity)
    return [r for r, _ in search.tried]


def test_search_steps_up_then_bisects_to_the_tolerance() -> None:
    search = RateSearch(start=1.0, step=2.0, tolerance=0.15, max_points=10)
    tried = _run_search(search, capacity=5.0)
    assert tried[:4] == [1.0, 2.0, 4.0, 8.0]  # steps up to the first failure
    assert tried[4] == pytest.approx(np.sqrt(32.0))  # geometric midpoint of 4 and 8
    assert search.best_pass is not None and search.lowest_fail is not None
    assert search.best_pass <= 5.0 < search.lowest_fail
    assert search.lowest_fail / search.best_pass <= 1.15
    assert len(tried) < 10 and search.bound(trace_cap=100.0) == ""


def test_search_steps_down_when_the_first_rate_fails_and_honours_max_points() -> None:
    search = RateSearch(start=8.0, step=2.0, tolerance=0.01, max_points=4)
    tried = _run_search(search, capacity=1.5)
    assert tried[:3] == [8.0, 4.0, 2.0]
    assert len(tried) == 4 and search.best_pass == 1.0


def test_search_steps_down_no_lower_than_the_minimum_rate() -> None:
    search = RateSearch(start=8.0, step=2.0, max_points=10, min_rate=1.0)
    assert _run_search(search, capacity=0.1) == [8.0, 4.0, 2.0, 1.0]
    assert search.best_pass is None and search.bound(trace_cap=100.0) == ""


@pytest.mark.parametrize(
    ("trace_cap", "expected", "bound"),
    [(10.0, [3.0, 6.0, 10.0], "trace"), (1000.0, [3.0, 6.0, 12.0, 20.0], "max-rate")],
    ids=["trace", "max-rate"],
)
def test_search_stops_at_the_rate_cap_and_names_it(
    trace_cap: float, expected: list[float], bound: str
) -> None:
    """A config that passes everything is stepped up to the cap (not past it), tried there
    once, and its goodput is flagged as a lower bound set by whichever cap was lower
    (`--max-rate` 20 here)."""
    search = RateSearch(start=3.0, step=2.0, max_points=10, max_rate=min(trace_cap, 20.0))
    assert _run_search(search, capacity=math.inf) == expected
    assert search.best_pass == expected[-1] and search.bound(trace_cap) == bound


def test_search_flags_a_lower_bound_when_points_run_out_before_a_failure() -> None:
    search = RateSearch(start=1.0, step=2.0, max_points=3)
    assert _run_search(search, capacity=100.0) == [1.0, 2.0, 4.0]
    assert search.bound(trace_cap=1000.0) == "max-points"
    search.record(8.0, False)  # a failure brackets it: an exact goodput, no bound
    assert search.bound(trace_cap=1000.0) == ""


@pytest.mark.parametrize("requests", [1, 2, 3, 9, 10, 11, 12, 20, 57, 100])
@pytest.mark.parametrize("percentile", [50.0, 90.0, 99.0])
def test_slow_requests_to_fail_is_the_fewest_that_settle_the_percentile(
    requests: int, percentile: float
) -> None:
    slow = slow_requests_to_fail(requests, percentile)
    fast_rest = [0.0] * (requests - slow) + [1.0] * slow  # the rest as fast as can be
    assert np.percentile(fast_rest, percentile) > 0.5  # slow ones alone fail it
    if slow > 1:  # one fewer, and fast others can still pass it
        fewer = [0.0] * (requests - slow + 1) + [1.0] * (slow - 1)
        assert np.percentile(fewer, percentile) < 1.0


def test_a_point_replays_enough_sessions_to_span_its_seconds() -> None:
    turns = [5] * 100
    # 10 req/s at 5 turns a session: 2 sessions/s, 20 s of starts = 40 sessions
    assert point_sessions(turns, rate=10.0, seconds=20.0, minimum=4) == 40
    assert point_sessions(turns, rate=0.5, seconds=20.0, minimum=4) == 4  # the floor
    assert point_sessions(turns, rate=100.0, seconds=20.0, minimum=4) == 100  # all there is
    assert trace_rate_cap(turns, seconds=20.0) == 25.0  # 500 requests over 20 s
    assert point_sessions(turns, trace_rate_cap(turns, 20.0), 20.0, 4) == 100


def _windows(p90s: list[float], per_window: int = 10) -> tuple[list[float], list[float]]:
    """Requests dispatched through consecutive 5 s windows, the TTFTs of window w all p90s[w]."""
    dispatch = [5.0 * w + 5.0 * i / per_window for w in range(len(p90s)) for i in range(per_window)]
    ttfts = [p90s[w] for w in range(len(p90s)) for _ in range(per_window)]
    return dispatch, ttfts


def test_one_stalled_window_is_told_from_a_growing_queue() -> None:
    # one ~5 s stall in the middle: 1 of 4 windows over, the p90 over all requests fails
    dispatch, ttfts = _windows([0.1, 0.1, 3.0, 0.1])
    assert not point_passes(
        {"requests_ok": 40, "requests_total": 40, "requests_failed": 0, "_ttfts": ttfts}, 0.3, 90
    )
    assert one_noisy_window(dispatch, ttfts, slo_s=0.3, percentile=90, window_s=5.0) == 2
    assert windows_over_slo(dispatch, ttfts, 0.3, 90, 5.0) == 1
    # a queue that grows: every window from the second on is over the SLO, no retry
    dispatch, ttfts = _windows([0.1, 0.5, 1.0, 2.0])
    assert one_noisy_window(dispatch, ttfts, 0.3, 90, 5.0) is None
    assert windows_over_slo(dispatch, ttfts, 0.3, 90, 5.0) == 3
    # one window over, but the rest also fails the SLO on its own: not one window's doing
    dispatch, ttfts = _windows([0.25, 0.25, 3.0, 0.25])
    ttfts[0:2] = [1.0, 1.0]  # two slow requests in window 0 (its p90 is 1.0 > 0.3)
    assert one_noisy_window(dispatch, ttfts, 0.3, 90, 5.0) is None


def test_live_sessions_is_the_mean_number_of_sessions_in_flight() -> None:
    def rec(sid: str, t: float, e2e: float) -> RequestRecord:
        return RequestRecord("r", sid, 0, dispatch_s=t, e2e_s=e2e)

    # a: 0-4 s (two turns), b: 2-6 s; over 6 s of pass: 8 session-seconds / 6 s
    records = [rec("a", 0.0, 1.0), rec("a", 3.0, 1.0), rec("b", 2.0, 4.0)]
    assert live_sessions(records) == pytest.approx(8.0 / 6.0)
    assert live_sessions([]) is None


def test_live_pages_is_the_time_mean_working_set_with_the_shared_prefix_once() -> None:
    def rec(sid: str, t: float, e2e: float, prompt: int, out: int, shared: int) -> RequestRecord:
        return RequestRecord("r", sid, 0, dispatch_s=t, e2e_s=e2e, prompt_tokens=prompt,
                             output_tokens=out, theoretical_cached_tokens=shared)

    # page 16; b's first turn found a's 32-token prefix cached (2 pages, counted once, a's
    # included): a holds 64+16-32 tokens (3 pages) 0-3 s, then 128+16-32 (7 pages) 3-4 s;
    # b 96+32-32 (6 pages) 2-6 s. (3*3 + 7*1 + 6*4) page-seconds over 6 s + 2 shared pages
    records = [rec("a", 0.0, 1.0, 64, 16, 0), rec("a", 3.0, 1.0, 128, 16, 0),
               rec("b", 2.0, 4.0, 96, 32, 32)]
    assert live_pages(records, 16) == pytest.approx(2 + (9 + 7 + 24) / 6.0)
    assert live_pages([], 16) is None


def test_summary_rows_give_ratios_to_the_ideal_and_the_baseline_and_tier_shares() -> None:
    def result(label: str, goodput: float | None, p50: float, tiers: dict[str, float]):
        ref = {"ttft_p50_s": p50, "ttft_p90_s": 2 * p50, "hit_rate_by_tier": tiers}
        return ConfigResult(label, reference=ref, goodput_rps=goodput)

    rows = summary_rows(
        [
            result("ideal", 10.0, 0.1, {"device": 0.8, "host": 0.0, "storage": 0.0}),
            result("pd-device", 2.0, 0.4, {"device": 0.5, "host": 0.0, "storage": 0.0}),
            result("new", 9.0, 0.11, {"device": 0.6, "host": 0.15, "storage": 0.05}),
        ],
        baseline="pd-device",
    )
    new = rows[2]
    assert new["goodput_x"] == pytest.approx(0.9) and new["goodput_x_baseline"] == 4.5
    assert new["ref_ttft_p50_x"] == pytest.approx(1.1) and new["ref_ttft_p90_x"] == pytest.approx(
        1.1
    )
    assert (new["ref_device_share"], new["ref_host_share"], new["ref_storage_share"]) == (
        pytest.approx(0.75),
        pytest.approx(0.1875),
        pytest.approx(0.0625),
    )
    assert rows[1]["goodput_x_baseline"] == 1.0 and rows[0]["bound"] == ""
    assert new["goodput_live_pages"] is None  # no points: nothing measured at the goodput
    assert summary_rows([result("a", 1.0, 0.1, {})])[0]["goodput_x_baseline"] is None


def test_the_goodput_row_reports_the_pressure_at_its_own_passing_point() -> None:
    points = [{"rate_rps": 2.0, "passed": True, "hit_rate": 0.7, "live_pages": 900.0},
              {"rate_rps": 4.0, "passed": False, "hit_rate": 0.5, "live_pages": 2000.0},
              {"rate_rps": 3.0, "passed": False, "hit_rate": 0.6, "live_pages": 1500.0},
              {"rate_rps": 3.0, "passed": True, "hit_rate": 0.65, "live_pages": 1400.0}]
    row = summary_rows([ConfigResult("pd", goodput_rps=3.0, points=points)])[0]
    assert (row["goodput_hit_rate"], row["goodput_live_pages"]) == (0.65, 1400.0)


def test_a_point_passes_only_complete_and_within_the_slo() -> None:
    ok = {
        "requests_ok": 10,
        "requests_total": 10,
        "requests_failed": 0,
        "_ttfts": [0.1] * 9 + [0.5],
    }
    assert point_passes(ok, slo_s=0.2, percentile=90)  # p90 of 9x0.1 + 0.5 is 0.14
    assert not point_passes(ok, slo_s=0.2, percentile=99)
    assert not point_passes({**ok, "requests_ok": 9, "requests_failed": 1}, 1.0, 90)
    assert not point_passes({**ok, "_ttfts": []}, 1.0, 90)


def test_a_tpot_slo_fails_a_point_whose_ttft_passes() -> None:
    ok = {"requests_ok": 10, "requests_total": 10, "requests_failed": 0, "_ttfts": [0.1] * 10,
          "_tpots": [0.02] * 9 + [0.5]}
    assert point_passes(ok, slo_s=0.2, percentile=90, tpot_slo_s=0.1)  # TPOT p90 0.068
    assert not point_passes(ok, slo_s=0.2, percentile=90, tpot_slo_s=0.05)
    assert point_passes(ok, slo_s=0.2, percentile=90)  # no TPOT SLO: the TTFT alone
    assert not point_passes({**ok, "_ttfts": [1.0] * 10}, 0.2, 90, tpot_slo_s=1.0)
    # one-token answers have no TPOT: the point is judged on its TTFT
    assert point_passes({**ok, "_tpots": []}, 0.2, 90, tpot_slo_s=0.001)
    assert tpot_percentile(ok, 50) == pytest.approx(0.02)


def test_both_slos_come_from_the_unloaded_pass_or_neither() -> None:
    unloaded = {"_ttfts": [0.1] * 10, "_tpots": [0.02] * 10}
    assert derive_slos(unloaded, None, None, 5.0, None) == (pytest.approx(0.5), None)
    assert derive_slos(unloaded, None, None, 5.0, 3.0) == (pytest.approx(0.5), pytest.approx(0.06))
    assert derive_slos(unloaded, 2.0, 0.1, 5.0, 3.0) == (2.0, 0.1)  # given ones win
    with pytest.raises(RuntimeError, match="no TPOT"):  # one-token answers: no TPOT SLO
        derive_slos({**unloaded, "_tpots": []}, None, None, 5.0, 3.0)
    with pytest.raises(RuntimeError, match="no TTFT"):
        derive_slos({"_ttfts": []}, None, None, 5.0, None)


def test_a_point_failing_on_its_tpot_alone_is_not_retried_for_a_slow_window() -> None:
    # window 0 (dispatch 0-5 s) is slow, the rest fast: the TTFT p90 of all is within 1 s
    summary = {"requests_ok": 20, "requests_total": 20, "requests_failed": 0,
               "_dispatch": [0.5] * 2 + [7.0 + i for i in range(18)],
               "_ttfts": [3.0] * 2 + [0.1] * 18, "_tpots": [0.5] * 20}
    assert point_passes(summary, 1.0, 90) and not point_passes(summary, 1.0, 90, 0.1)
    assert failed_on(summary, passed=False, tpot_failed=True) == "tpot"
    assert retry_window(summary, "tpot", 1.0, 90, 5.0) is None
    # the same slow window failing the TTFT (a tighter SLO) is one stalled window: retried
    assert retry_window(summary, "ttft", 0.5, 80, 5.0) == 0
    assert failed_on(summary, passed=True, tpot_failed=False) == ""
    assert failed_on({**summary, "requests_ok": 19, "requests_failed": 1}, False, False) == (
        "incomplete")
    assert failed_on({"error": "boom"}, False, False) == "error"


def test_request_tpot_is_the_time_per_output_token_after_the_first() -> None:
    def rec(tokens: int, ttft: float | None, e2e: float) -> RequestRecord:
        return RequestRecord("r", "s", 0, output_tokens=tokens, ttft_s=ttft, e2e_s=e2e)

    assert request_tpot(rec(5, 0.2, 1.0)) == pytest.approx(0.2)
    assert request_tpot(rec(1, 0.2, 0.2)) is None
    assert request_tpot(rec(3, None, 1.0)) is None


def test_poisson_sessions_offer_the_request_rate() -> None:
    trace = synthetic_trace(SyntheticSpec(sessions=4000, turns=4))
    starts = poisson_session_starts(trace, request_rate=8.0, seed=1)
    times = np.asarray([starts[s.session_id] for s in trace.sessions])
    assert times[0] == 0.0 and np.all(np.diff(times) >= 0)
    # 8 requests/s at 4 turns a session: sessions start at 2/s, a mean gap of 0.5 s
    assert np.diff(times).mean() == pytest.approx(0.5, rel=0.05)
    assert starts == poisson_session_starts(trace, 8.0, seed=1)  # seeded


NEEDED = ("pdcache.server.app", "pdcache.launch.launcher")


@pytest.mark.slow
@pytest.mark.skipif(
    any(importlib.util.find_spec(m) is None for m in NEEDED),
    reason="needs pdcache.server.app and pdcache.launch.launcher",
)
@pytest.mark.parametrize(
    ("slo_ms", "passes", "early_stop", "tpot_factor"),
    [(60_000.0, True, True, None), (0.001, False, True, None), (0.001, False, False, None),
     (60_000.0, False, False, 1e-6)],
    ids=["loose-slo", "impossible-slo", "impossible-slo-no-early-stop", "impossible-tpot-slo"],
)
def test_goodput_sweeps_a_real_server(
    tmp_path: Path, slo_ms: float, passes: bool, early_stop: bool, tpot_factor: float | None
) -> None:
    port = free_ports(1)[0]
    out = tmp_path / "out"
    trace = "synthetic:sessions=6,turns=2,system_prompt=32,user=16,tool_result=16,answer=4"
    code = pdcache_main(
        [
            "bench",
            "goodput",
            f"u={unified_topology(tmp_path, 'u', port)}",
            "--trace",
            trace,
            "--out",
            str(out),
            "--slo-ms",
            str(slo_ms),
            "--max-points",
            "2",
            "--rate-start",
            "4",
            "--point-seconds",
            "1",
            "--min-point-sessions",
            "6",
            "--unloaded-requests",
            "2",
            "--no-progress",
            "--startup-timeout",
            "120",
            *([] if early_stop else ["--no-early-stop"]),
            *([] if tpot_factor is None else ["--tpot-slo-factor", str(tpot_factor)]),
        ]
    )
    assert code == 0
    result = json.loads((out / "goodput.json").read_text())
    [row] = result["rows"]
    points = result["points"]
    assert [p["rate_rps"] for p in points] == ([4.0, 8.0] if passes else [4.0, 2.0])
    assert all(p["passed"] is passes for p in points)
    if passes or not early_stop:  # every request answered
        assert all(p["ok"] == 12 and p["stopped_early"] is False for p in points)
    else:  # 3 TTFTs over the SLO settle a p90 of 12 (12 - floor(0.9 x 11)): the point stops
        assert all(p["stopped_early"] and 3 <= p["ok"] < 12 for p in points), points
    assert row["goodput_rps"] == (8.0 if passes else None)
    assert row["failed_at_rps"] == (None if passes else 2.0)
    assert all(p["sessions"] == 6 and p["retry"] is False for p in points)
    # 4-token answers: every point measures a TPOT, and the loose-TTFT, impossible-TPOT run
    # fails every point on it alone (no retry: the one-window check reads TTFTs)
    assert all(p["tpot_p50_s"] > 0 and p["tpot_p90_s"] >= p["tpot_p50_s"] for p in points)
    assert row["unloaded_tpot_p90_s"] > 0
    if tpot_factor is None:
        assert result["tpot_slo_ms"] is None
        assert all(p["failed_on"] == ("" if passes else "ttft") for p in points)
    else:  # the factor x the unloaded TPOT p90; every point fails on its TPOT alone
        assert result["tpot_slo_ms"] == pytest.approx(tpot_factor * row["unloaded_tpot_p90_s"] * 1e3)
        assert all(p["failed_on"] == "tpot" for p in points)
    # all passed: the points ran out before a failure (12 requests / 1 s caps rates at 12)
    assert row["bound"] == ("max-points" if passes else "") and row["error"] == ""
    assert result["trace_rate_cap_rps"] == 12.0 and result["estimated_max_s"] > 0
    assert row["ref_hit_rate"] > 0 and result["slo_ms"] == pytest.approx(slo_ms)
    breakdown = result["summaries"]["u"]["reference_latency_breakdown_s"]
    node_ttft = f"127.0.0.1:{port} pdcache_time_to_first_token_seconds"
    assert 0 < breakdown[node_ttft] < 60  # the node's own TTFT over the reference pass
    assert (out / "goodput.png").is_file()
    assert (out / "u" / "rate-4" / "requests.jsonl").is_file()
