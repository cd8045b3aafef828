"""The serving-path terms of the latency model: the profile's optional `[serving]` table, the
PD decode-admission gate, a shared host's cores, and how `calibrate` reads `[serving]`."""

from __future__ import annotations

import time
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
    # the keys added later may be left out (0: not modelled), and are read when given
    later = load_profile(_write(tmp_path, PROFILE + SERVING + "token_s = 0.001\n"
                                "relay_token_s = 0.002\n", "later.toml")).serving
    assert (later.token_s, later.relay_token_s) == (0.001, 0.002)
    assert (serving.token_s, serving.relay_token_s) == (0.0, 0.0)
    assert serving.prefill_warmup == 0.5  # absent: a prefill node warms up as a unified one
    own = load_profile(_write(tmp_path, PROFILE + SERVING + "prefill_warmup_s = 0.25\n",
                              "own.toml")).serving
    assert (own.prefill_warmup, own.warmup_s) == (0.25, 0.5)


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
    # the prefill node's own warm-up, not the unified one's, delays the first PD request
    warm = handoff_only.replace("handoff_s = 0.03", "handoff_s = 0").replace(
        "warmup_s = 0\n", "warmup_s = 9\nprefill_warmup_s = 0.25\n", 1)
    warmed, _ = simulate(_write(tmp_path, warm, "pw.toml"), [PD, *TINY, *ONE])
    assert _ttfts(warmed)[0] - _ttfts(bare)[0] == pytest.approx(0.25, abs=0.0003)


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


def _finish_times(slots: int, jobs: list[tuple[float, float]]) -> list[float]:
    """When each job (start, work) completes on a `SharedHost` of `slots` slots."""
    from pdcache.sim.events import EventLoop
    from pdcache.sim.host import SharedHost

    loop = EventLoop()
    host = SharedHost(loop, slots)
    done: list[float] = [0.0] * len(jobs)

    def start(index: int, work: float) -> None:
        host.run(work, lambda: done.__setitem__(index, loop.now))

    for index, (at, work) in enumerate(jobs):
        loop.at(at, lambda i=index, w=work: start(i, w))
    loop.run()
    assert host.running == 0
    return done


def test_shared_host_shares_its_cores_among_the_jobs_running() -> None:
    assert _finish_times(2, [(0.0, 0.01)]) == pytest.approx([0.01])  # alone: full speed
    assert _finish_times(2, [(0.0, 0.01), (0.0, 0.01)]) == pytest.approx([0.01, 0.01])
    # four jobs on two slots: each at half speed
    assert _finish_times(2, [(0.0, 0.01)] * 4) == pytest.approx([0.02] * 4)
    # re-shared when a job joins and when it ends: A runs alone for 0.5 s (0.5 done), shares
    # one slot with B for 0.5 s (B's 0.25 done, A's 0.25 more), then runs alone again
    assert _finish_times(1, [(0.0, 1.0), (0.5, 0.25)]) == pytest.approx([1.25, 1.0])


def test_own_compute_runs_every_job_at_full_speed(tmp_path: Path) -> None:
    from pdcache.sim.events import EventLoop
    from pdcache.sim.nodes import Cluster

    profile = load_profile(_write(tmp_path, PROFILE))
    cluster = Cluster(EventLoop(), profile, 1, None, None, print, print, print)
    ends: list[float] = []
    for _ in range(4):
        cluster.run(0.01, lambda: ends.append(cluster.loop.now))
    cluster.relay(100)  # the router and the clients have machines of their own: no job
    cluster.loop.run()
    assert ends == pytest.approx([0.01] * 4)


def test_token_costs_add_to_each_step_and_relay_takes_shared_cores(tmp_path: Path) -> None:
    base = PROFILE + SERVING.replace("warmup_s = 0.5", "warmup_s = 0") \
        .replace("decode_warmup_s = 0.7", "decode_warmup_s = 0")
    tokens = base + "token_s = 0.003\n"
    relay = base + "relay_token_s = 0.02\n"
    one = [UNIFIED, *TINY, "--set", "storage.backend=none", *ONE]

    def tpot(text: str, name: str, extra: list[str]) -> float:
        sim, _ = simulate(_write(tmp_path, text, name), [*one, *extra])
        (record,) = sim.records
        return (record["e2e_s"] - record["ttft_s"]) / (record["output_tokens"] - 1)

    plain = tpot(base, "b.toml", [])
    assert tpot(tokens, "t.toml", []) - plain == pytest.approx(0.003)  # one token a step
    # relay work only costs where the router and client share the nodes' cores
    assert tpot(relay, "r.toml", []) == pytest.approx(plain)
    assert tpot(relay, "r1.toml", ["--shared-host", "1"]) > plain + 0.005


def test_pd_on_one_shared_slot_is_slower(tmp_path: Path) -> None:
    profile_path = _write(tmp_path, PROFILE)
    argv = [PD, *TINY, "--trace", "synthetic:sessions=4,turns=3", "--concurrency", "4"]
    _, own_summary = simulate(profile_path, argv)
    _, shared_summary = simulate(profile_path, [*argv, "--shared-host", "1"])
    assert shared_summary["duration_s"] > own_summary["duration_s"]
    assert shared_summary["hit_rate"] == pytest.approx(own_summary["hit_rate"])


def test_token_fit_keeps_the_idle_gap_and_meets_the_loaded_tpot() -> None:
    from pdcache.sim.calibrate_serving import fit_token_s

    calls: list[tuple[float, float]] = []

    def tpot(token: float, step: float) -> float:  # a batch of 4: step_s + 4 token_s
        calls.append((token, step))
        return 0.002 + step + 4 * token

    assert fit_token_s(tpot, 0.006, idle_gap=0.001) == pytest.approx(0.001, rel=1e-5)
    assert all(step == pytest.approx(max(0.0, 0.001 - token)) for token, step in calls)
    assert fit_token_s(tpot, 0.002, idle_gap=0.001) == 0.0  # the model is slow enough already
    assert fit_token_s(tpot, 10.0, idle_gap=0.001, upper=0.05) == 0.05  # out of reach


def test_relay_per_token_leaves_the_per_request_part_out() -> None:
    from pdcache.sim.calibrate_serving import relay_per_token

    # R = 5 ms a request, T = 0.4 ms a token: 17 × 8 tokens idle, 16 × 32 under load
    idle, loaded = (17, 136, 17 * 0.005 + 136 * 0.0004), (16, 512, 16 * 0.005 + 512 * 0.0004)
    assert relay_per_token(idle, loaded) == pytest.approx(0.0004)
    # runs that cannot separate the two: all of the CPU per token; never negative
    assert relay_per_token((16, 512, 0.5), (16, 512, 0.5)) == pytest.approx(0.5 / 512)
    assert relay_per_token((10, 10, 1.0), (10, 100, 0.1)) == 0.0


def test_relay_cpu_is_read_from_proc_and_the_routers_pid(tmp_path: Path) -> None:
    import json
    import os

    from pdcache.sim.calibrate_serving import process_cpu_s, router_pid

    before = process_cpu_s(os.getpid())
    deadline = time.process_time() + 0.05
    while time.process_time() < deadline:  # burn 50 ms of CPU
        pass
    assert process_cpu_s(os.getpid()) - before >= 0.03  # clock ticks: 10 ms granularity
    listing = tmp_path / "processes.json"
    listing.write_text(json.dumps({"processes": [{"role": "prefill", "pid": 11},
                                                 {"role": "router", "pid": 42}]}))
    assert router_pid(listing) == 42
    listing.write_text(json.dumps({"processes": [{"role": "unified", "pid": 11}]}))
    with pytest.raises(ValueError, match="no running router"):
        router_pid(listing)


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


def test_shared_host_ends_its_jobs_late_in_simulated_time() -> None:
    """Past ~16,000 s a leftover of ~1e-12 s of work ended at `now` itself (the clock's float
    resolution): its completion event came back to the same instant, for good (a long
    simulation with a shared host never ended)."""
    import random

    from pdcache.sim.events import EventLoop
    from pdcache.sim.host import SharedHost

    loop = EventLoop()
    host = SharedHost(loop, 2)
    rng = random.Random(0)
    done = []
    for _ in range(60):
        loop.at(20000.0 + rng.uniform(0, 5.0),
                lambda: host.run(rng.uniform(0.01, 1.0), lambda: done.append(loop.now)))

    def bounded() -> None:
        assert loop.events_run < 100_000, f"stuck at t={loop.now}: {len(done)}/60 jobs done"

    loop.run(bounded)
    assert len(done) == 60 and host.running == 0
