"""The serving-path terms of the latency model: the profile's optional `[serving]` table, the
PD decode-admission gate, a shared host's cores, and how `calibrate` reads `[serving]`."""

from __future__ import annotations

from pathlib import Path

import pytest

from pdcache.sim.calibrate_serving import _decode_warmup, _medians
from pdcache.sim.profile import ProfileError, ServingCost, load_profile
from tests.sim.test_simulation import PD, PROFILE, TINY, UNIFIED, simulate

ONE = ["--trace", "synthetic:sessions=1,turns=1,system_prompt=0,user=32,answer=4",
       "--concurrency", "1"]
TWO = ["--trace", "synthetic:sessions=2,turns=1,system_prompt=0,user=32,answer=4",
       "--concurrency", "1"]
SERVING = "\n[serving]\nrequest_s = 0.01\nstep_s = 0.002\nhandoff_s = 0.03\nwarmup_s = 0.5\n" \
          "decode_warmup_s = 0.7\n"


def _write(tmp_path: Path, text: str, name: str = "p.toml") -> str:
    path = tmp_path / name
    path.write_text(text)
    return str(path)


def _ttfts(sim: object) -> list[float]:
    records = sorted(sim.records, key=lambda r: r["dispatch_s"])  # type: ignore[attr-defined]
    return [r["ttft_s"] for r in records]


def test_serving_table_is_optional_and_checked(tmp_path: Path) -> None:
    assert load_profile(_write(tmp_path, PROFILE)).serving == ServingCost()
    serving = load_profile(_write(tmp_path, PROFILE + SERVING)).serving
    assert serving == ServingCost(0.01, 0.002, 0.03, 0.5, 0.7)
    with pytest.raises(ProfileError, match="serving.decode_warmup_s is missing"):
        load_profile(_write(tmp_path, PROFILE + SERVING.replace("decode_warmup_s = 0.7\n", "")))
    with pytest.raises(ProfileError, match="serving.http_s: unknown key"):
        load_profile(_write(tmp_path, PROFILE + SERVING + "http_s = 1\n"))


def test_request_step_and_warmup_costs_add_to_ttft_exactly(tmp_path: Path) -> None:
    no_storage = ["--set", "storage.backend=none"]
    bare, _ = simulate(_write(tmp_path, PROFILE), [UNIFIED, *TINY, *no_storage, *TWO])
    costed, _ = simulate(_write(tmp_path, PROFILE + SERVING, "s.toml"),
                         [UNIFIED, *TINY, *no_storage, *TWO])
    base, served = _ttfts(bare), _ttfts(costed)
    # first request: request_s + its prefill step's step_s + the node's warm-up
    assert served[0] - base[0] == pytest.approx(0.01 + 0.002 + 0.5)
    # the second: no warm-up any more
    assert served[1] - base[1] == pytest.approx(0.01 + 0.002)


def test_pd_prefill_waits_for_the_decode_gate_and_handoff(tmp_path: Path) -> None:
    handoff_only = PROFILE + SERVING.replace("request_s = 0.01", "request_s = 0") \
        .replace("step_s = 0.002", "step_s = 0").replace("warmup_s = 0.5", "warmup_s = 0") \
        .replace("decode_warmup_s = 0.7", "decode_warmup_s = 0")
    # the prefetch's lookup (metadata_op_s) overlaps the gate: max(gate, prefetch ready)
    bare, _ = simulate(_write(tmp_path, PROFILE), [PD, *TINY, *ONE])
    gated, _ = simulate(_write(tmp_path, handoff_only, "h.toml"), [PD, *TINY, *ONE])
    assert _ttfts(gated)[0] - _ttfts(bare)[0] == pytest.approx(0.03 - 0.0002)


def test_a_decode_nodes_warmup_delays_the_gate_it_holds(tmp_path: Path) -> None:
    """The second request arrives while decode's first step (its warm-up) runs: its
    reservation waits for that step's end, and so does its prefill (the gate)."""
    warm = PROFILE + "\n[serving]\nrequest_s = 0\nstep_s = 0\nhandoff_s = 0\nwarmup_s = 0\n" \
                     "decode_warmup_s = 0.7\n"
    two = ["--trace", "synthetic:sessions=2,turns=1,system_prompt=0,user=32,answer=4,"
                      "stagger=0.05", "--mode", "trace", "--concurrency", "2"]
    bare, _ = simulate(_write(tmp_path, PROFILE), [PD, *TINY, *two])
    slow, _ = simulate(_write(tmp_path, warm, "w.toml"), [PD, *TINY, *two])
    assert max(_ttfts(slow)) > max(_ttfts(bare)) + 0.5


def test_shared_host_stretches_concurrent_steps(tmp_path: Path) -> None:
    from pdcache.sim.events import EventLoop
    from pdcache.sim.nodes import Cluster

    profile = load_profile(_write(tmp_path, PROFILE))
    cluster = Cluster(EventLoop(), profile, 1, None, None, print, print, print,
                      shared_host_slots=2)
    assert cluster.step_seconds(0.01, 0.0) == pytest.approx(0.01)  # alone
    cluster.busy_nodes = 1
    assert cluster.step_seconds(0.01, 0.0) == pytest.approx(0.01)  # two nodes, two slots
    cluster.busy_nodes = 3
    assert cluster.step_seconds(0.01, 0.0) == pytest.approx(0.02)  # four nodes, two slots
    cluster.shared_host_slots = 0
    assert cluster.step_seconds(0.01, 0.0) == pytest.approx(0.01)  # compute of its own


def test_pd_on_one_shared_slot_is_slower(tmp_path: Path) -> None:
    profile_path = _write(tmp_path, PROFILE)
    argv = [PD, *TINY, "--trace", "synthetic:sessions=4,turns=3", "--concurrency", "4"]
    _, own_summary = simulate(profile_path, argv)
    _, shared_summary = simulate(profile_path, [*argv, "--shared-host", "1"])
    assert shared_summary["duration_s"] > own_summary["duration_s"]
    assert shared_summary["hit_rate"] == pytest.approx(own_summary["hit_rate"])


def test_serving_calibration_reads_the_gaps() -> None:
    records = [
        {"ok": True, "dispatch_s": 0.0, "ttft_s": 0.30, "e2e_s": 1.00, "output_tokens": 8},
        {"ok": True, "dispatch_s": 1.0, "ttft_s": 0.01, "e2e_s": 0.08, "output_tokens": 8},
        {"ok": True, "dispatch_s": 2.0, "ttft_s": 0.02, "e2e_s": 0.09, "output_tokens": 8},
        {"ok": True, "dispatch_s": 3.0, "ttft_s": 0.03, "e2e_s": 0.10, "output_tokens": 8},
        {"ok": False, "dispatch_s": 4.0, "ttft_s": None, "e2e_s": None},
    ]
    first, ttft, tpot = _medians(records)
    assert (first, ttft) == (0.30, 0.02)
    assert tpot == pytest.approx(0.01)  # (0.09 - 0.02) / 7
    assert _decode_warmup(records) == pytest.approx(0.70 - 0.07)
    with pytest.raises(ValueError, match="need 3 or more"):
        _medians(records[:2])
