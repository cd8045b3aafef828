"""`pdcache bench goodput`: the rate search, Poisson session arrivals, and one real sweep."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import numpy as np
import pytest

from pdcache.bench.goodput import RateSearch, point_passes
from pdcache.bench.replay_run import poisson_session_starts
from pdcache.bench.traces import SyntheticSpec, synthetic_trace
from pdcache.cli import main as pdcache_main
from tests.net_support import free_ports, unified_topology


def _run_search(search: RateSearch, capacity: float) -> list[float]:
    """Drive the search against a server that passes every rate <= capacity."""
    while (rate := search.next_rate()) is not None:
        search.record(rate, rate <= capacity, achieved=rate)
    return [r for r, _ in search.tried]


def test_search_steps_up_then_bisects_to_the_tolerance() -> None:
    search = RateSearch(start=1.0, step=2.0, tolerance=0.15, max_points=10)
    tried = _run_search(search, capacity=5.0)
    assert tried[:4] == [1.0, 2.0, 4.0, 8.0]  # steps up to the first failure
    assert tried[4] == pytest.approx(np.sqrt(32.0))  # geometric midpoint of 4 and 8
    assert search.best_pass is not None and search.lowest_fail is not None
    assert search.best_pass <= 5.0 < search.lowest_fail
    assert search.lowest_fail / search.best_pass <= 1.15
    assert len(tried) < 10


def test_search_steps_down_when_the_first_rate_fails_and_honours_max_points() -> None:
    search = RateSearch(start=8.0, step=2.0, tolerance=0.01, max_points=4)
    tried = _run_search(search, capacity=1.5)
    assert tried[:3] == [8.0, 4.0, 2.0]
    assert len(tried) == 4 and search.best_pass == 1.0


def test_search_stops_stepping_up_when_the_trace_cannot_offer_more() -> None:
    search = RateSearch(start=1.0, step=2.0, max_points=10)
    search.record(1.0, True, achieved=0.9)
    search.record(2.0, True, achieved=0.8)  # all sessions overlap already: far below 2.0
    assert search.trace_bound and search.next_rate() is None


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
    ("slo_ms", "passes"), [(60_000.0, True), (0.001, False)], ids=["loose-slo", "impossible-slo"]
)
def test_goodput_sweeps_a_real_server(tmp_path: Path, slo_ms: float, passes: bool) -> None:
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
            "--unloaded-requests",
            "2",
            "--no-progress",
            "--startup-timeout",
            "120",
        ]
    )
    assert code == 0
    result = json.loads((out / "goodput.json").read_text())
    [row] = result["rows"]
    points = result["points"]
    assert [p["rate_rps"] for p in points] == ([4.0, 8.0] if passes else [4.0, 2.0])
    assert all(p["passed"] is passes and p["ok"] == 12 for p in points)
    assert row["goodput_rps"] == (8.0 if passes else None)
    assert row["lower_bound"] is passes and row["error"] == ""
    assert row["ref_hit_rate"] > 0 and result["slo_ms"] == pytest.approx(slo_ms)
    breakdown = result["summaries"]["u"]["reference_latency_breakdown_s"]
    node_ttft = f"127.0.0.1:{port} pdcache_time_to_first_token_seconds"
    assert 0 < breakdown[node_ttft] < 60  # the node's own TTFT over the reference pass
    assert (out / "goodput.png").is_file()
    assert (out / "u" / "rate-4" / "requests.jsonl").is_file()
