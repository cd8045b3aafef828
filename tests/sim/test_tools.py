"""`pdcache sim calibrate`, `plan`, `validate`, the plots, and `Backup`'s storage-writer seam."""

from __future__ import annotations

import importlib.util
import json
import time
from pathlib import Path

import pytest

from pdcache.cli import main
from pdcache.offload_manager.backup import Backup
from pdcache.sim.cache import SimStorageWriter
from pdcache.sim.calibrate import fit_nonnegative
from pdcache.sim.plan import parse_search
from pdcache.sim.profile import load_profile
from pdcache.sim.simulation import Simulation
from tests.sim.test_simulation import PD, PROFILE, TINY, simulate

TRACE = ["--trace", "synthetic:sessions=8,turns=3", "--concurrency", "8"]


@pytest.fixture(scope="module")
def profile_path(tmp_path_factory: pytest.TempPathFactory) -> str:
    path = tmp_path_factory.mktemp("tools") / "profile.toml"
    path.write_text(PROFILE)
    return str(path)


def test_calibrate_quick_writes_a_profile_that_loads(tmp_path: Path,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "tiny.toml"
    started = time.monotonic()
    assert main(["sim", "calibrate", "--out", str(out), "--preset", "tiny", "--quick",
                 "--dir", str(tmp_path)]) == 0
    assert time.monotonic() - started < 90  # ~60 s budget, with slack for a loaded machine
    profile = load_profile(out)
    assert profile.prefill.per_token_s > 0 and profile.decode.base_s >= 0
    assert profile.transfer.bandwidth_Bps > 0 and profile.storage.read_bandwidth_Bps > 0
    text = out.read_text()
    assert "[source]" in text and 'preset = "tiny"' in text and "fit_prefill_rms_rel_error" in text
    printed = capsys.readouterr()
    assert "fit prefill: rms relative error" in printed.out
    assert "calibrate: prefill batch=" in printed.err  # progress on stderr


def test_fit_recovers_a_linear_model() -> None:
    features = [[1.0, t, t * c] for t in (16, 64, 256) for c in (0, 512, 2048)]
    seconds = [0.002 + 1e-5 * f[1] + 1e-9 * f[2] for f in features]
    fit = fit_nonnegative(features, seconds)
    assert fit.coefficients == pytest.approx((0.002, 1e-5, 1e-9), rel=1e-6)
    assert fit.rms_rel_error < 1e-9
    # a negative slope is not a cost: that column is dropped, the rest refitted
    assert fit_nonnegative([[1.0, 1.0], [1.0, 2.0]], [2.0, 1.0]).coefficients[1] == 0.0


def test_search_space() -> None:
    assert parse_search("prefill=1..3,decode=2,4,host_ratio=0.5") == {
        "prefill": ["1", "2", "3"], "decode": ["2", "4"], "host_ratio": ["0.5"]}
    with pytest.raises(ValueError, match="expected one of"):
        parse_search("gpus=1..2")


def test_plan_tries_the_cheapest_first_and_is_deterministic(
        profile_path: str, tmp_path: Path) -> None:
    base = ["sim", "plan", PD, *TINY, *TRACE, "--profile", profile_path,
            "--search", "prefill=1..2,decode=1..2"]
    # an SLO nothing meets: every candidate is tried, cheapest first
    assert main([*base, "--ttft-slo", "1e-9", "--out", str(tmp_path / "none")]) == 1
    tried = json.loads((tmp_path / "none" / "plan.json").read_text())
    assert tried["winner"] is None
    assert [r["nodes"] for r in tried["candidates"]] == [2, 3, 3, 4]
    # an SLO between: the winner is the first candidate meeting it, and a second run agrees
    ttfts = [r["ttft_p90_s"] for r in tried["candidates"]]
    slo = sorted(ttfts)[1] * 1.0001
    for name in ("a", "b"):
        assert main([*base, "--ttft-slo", str(slo), "--out", str(tmp_path / name)]) == 0
    first, again = (json.loads((tmp_path / n / "plan.json").read_text()) for n in ("a", "b"))
    assert first == again
    winner = first["winner"]
    assert winner["meets"] and winner["ttft_p90_s"] <= slo
    assert all(not r["meets"] for r in first["candidates"][:-1])
    assert winner == first["candidates"][-1]


def test_run_writes_plots(profile_path: str, tmp_path: Path,
                          capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "run"
    assert main(["sim", PD, *TINY, *TRACE, "--profile", profile_path, "--out", str(out),
                 "--no-progress"]) == 0
    if importlib.util.find_spec("matplotlib") is None:
        assert "plots skipped: matplotlib is not installed" in capsys.readouterr().out
    else:
        assert (out / "storage_bandwidth.png").stat().st_size > 0
        assert (out / "ttft_cdf.png").stat().st_size > 0


def test_the_simulated_write_policy_uses_backups_public_seam(profile_path: str) -> None:
    sim, summary = simulate(profile_path, [PD, *TINY, *TRACE])
    assert isinstance(sim, Simulation)
    backups = [n.cache.backup for n in sim.nodes.values() if n.cache.backup is not None]
    assert backups and all(type(b) is Backup for b in backups)  # no subclass
    assert all(isinstance(b.storage_writer, SimStorageWriter) for b in backups)
    assert summary["storage"]["bytes"]["write_prefill"] > 0


NEEDED = ("pdcache.server.app", "pdcache.launch.launcher")


@pytest.mark.slow
@pytest.mark.skipif(any(importlib.util.find_spec(m) is None for m in NEEDED),
                    reason="needs pdcache.server.app and pdcache.launch.launcher")
def test_validate_runs_the_real_compare_and_the_simulator(profile_path: str,
                                                          tmp_path: Path) -> None:
    from tests.net_support import free_ports, unified_topology

    topology = unified_topology(tmp_path, "u", free_ports(1)[0])
    out = tmp_path / "out"
    trace = "synthetic:sessions=2,turns=3,system_prompt=48,user=16,tool_result=16,answer=4"
    code = main(["sim", "validate", f"u={topology}", "--profile", profile_path, "--trace", trace,
                 "--out", str(out), "--concurrency", "2", "--no-progress",
                 "--startup-timeout", "120", "--max-duration", "120", "--ttft-slo", "0.5",
                 "--repeat", "2"])
    result = json.loads((out / "validate.json").read_text())
    assert code == 0, [r["error"] for r in result["rows"]]
    (row,) = result["rows"]
    for key in ("ttft_p50_rel_err", "ttft_p90_rel_err", "goodput_rel_err"):
        assert isinstance(row[key], float)
    # two real runs, each with its own errors; the row compares against their median
    first, second = result["every_run"]
    assert (first["config"], second["config"], row["real_runs"]) == ("u", "u.2", 2)
    assert (out / "u.2" / "requests.jsonl").is_file()
    median = (first["ttft_p50_real_s"] + second["ttft_p50_real_s"]) / 2
    assert row["ttft_p50_real_s"] == pytest.approx(median)
    assert row["ttft_p50_rel_err"] == pytest.approx(
        (row["ttft_p50_sim_s"] - median) / median)
    # a roomy cache: the simulator reaches the theoretical rate, as the real server does
    assert row["hit_rate_abs_err"] <= 0.01


def test_plan_keeps_a_role_count_the_user_fixed(profile_path: str, tmp_path: Path) -> None:
    """`--set sim.decode=2` reached the topology loader: `sim: unknown key`, exit 2."""
    assert main(["sim", "plan", PD, *TINY, *TRACE, "--profile", profile_path,
                 "--set", "sim.decode=2", "--search", "prefill=1..2", "--ttft-slo", "1e-9",
                 "--out", str(tmp_path)]) == 1  # nothing meets it: every candidate is tried
    tried = json.loads((tmp_path / "plan.json").read_text())
    assert [r["nodes"] for r in tried["candidates"]] == [3, 4]  # 1P2D, 2P2D
