"""Replay report: hit rates per tier/origin/turn, percentiles, summary.json and plots."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pdcache.bench.replay_records import RequestRecord
from pdcache.bench.report import main as report_main
from pdcache.bench.report import summarize, write_report


def _record(rid: str, turn: int, prompt: int, device: int = 0, host: int = 0, storage: int = 0,
            from_decode: int = 0, theoretical: int = 0, ttft: float = 0.1, ok: bool = True,
            itl: tuple[float, ...] = (0.01, 0.02)) -> dict:
    rec = RequestRecord(rid, rid.split("/")[0], turn, ok=ok, prompt_tokens=prompt,
                        output_tokens=len(itl) + 1, theoretical_cached_tokens=theoretical,
                        ttft_s=ttft, e2e_s=ttft + sum(itl), itl_s=list(itl))
    rec.apply_meta({"cached_tokens": device + host + storage, "cached_tokens_details": {
        "device": device, "host": host, "storage": storage, "storage_from_decode": from_decode}})
    if not ok:
        rec.error = "HttpError: HTTP 503: busy"
    return rec.__dict__


RECORDS = [
    _record("a/0", 0, 100, theoretical=0, ttft=0.4),
    _record("b/0", 0, 100, device=64, theoretical=96, ttft=0.2),
    _record("a/1", 1, 200, device=96, storage=80, from_decode=48, theoretical=192, ttft=0.1),
    _record("b/1", 1, 200, host=128, storage=32, from_decode=32, theoretical=192, ttft=0.3),
    _record("c/0", 0, 500, ok=False),
]


def test_summary_hit_rates_are_token_weighted_over_ok_requests() -> None:
    s = summarize(RECORDS, {"duration_s": 2.0, "requests_total": 6, "requests_skipped": 1})
    assert (s["requests_ok"], s["requests_failed"], s["requests_skipped"]) == (4, 1, 1)
    assert s["prompt_tokens"] == 600
    assert s["hit_rate"] == pytest.approx((64 + 96 + 80 + 128 + 32) / 600)
    assert s["hit_rate_by_tier"] == pytest.approx(
        {"device": 160 / 600, "host": 128 / 600, "storage": 112 / 600})
    assert s["hit_rate_by_origin"] == pytest.approx(
        {"storage_from_decode": 80 / 600, "storage_from_prefill": 32 / 600})
    assert s["theoretical_hit_rate"] == pytest.approx(480 / 600)
    assert s["achieved_over_theoretical"] == pytest.approx(400 / 480)
    assert s["errors"] == {"HttpError": 1}
    assert s["request_throughput_rps"] == pytest.approx(2.0)
    assert s["output_token_throughput"] == pytest.approx(12 / 2.0)
    assert s["ttft_p50_s"] == pytest.approx(0.25)
    assert s["ttft_mean_s"] == pytest.approx(0.25)
    assert s["itl_p50_s"] == pytest.approx(0.015)


def test_per_turn_curves() -> None:
    s = summarize(RECORDS, {})
    t0, t1 = s["per_turn"]
    assert (t0["turn"], t0["requests"], t1["requests"]) == (0, 2, 2)
    assert t0["hit_rate"] == pytest.approx(64 / 200)
    assert t0["theoretical_hit_rate"] == pytest.approx(96 / 200)
    assert t1["hit_rate"] == pytest.approx(336 / 400)
    assert t1["hit_storage_from_decode"] == pytest.approx(80 / 400)
    assert t0["ttft_p50_s"] == pytest.approx(0.3)


def test_write_report_files_and_rerender(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "requests.jsonl").write_text("".join(json.dumps(r) + "\n" for r in RECORDS))
    run = {"duration_s": 2.0, "trace": "unit", "stopped_early": True,
           "skip_reasons": {"max_duration": 2}, "replayer_errors": 0, "config": {"mode": "afap"}}
    summary = write_report(tmp_path, run, plots=True)
    on_disk = json.loads((tmp_path / "summary.json").read_text())
    for key in ("requests_ok", "requests_failed", "hit_rate", "theoretical_hit_rate",
                "ttft_p50_s", "ttft_p99_s", "hit_rate_by_tier"):
        assert on_disk[key] == summary[key]
    for name in ("per_turn.png", "ttft_cdf.png"):
        assert (tmp_path / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    out = capsys.readouterr().out
    assert "== replay unit ==" in out and "== per turn ==" in out
    assert report_main([str(tmp_path), "--no-plots"]) == 0
    rerendered = json.loads((tmp_path / "summary.json").read_text())
    # every run field survives a re-render (stopped_early and the rest were lost)
    assert {k: rerendered[k] for k in run} == run
