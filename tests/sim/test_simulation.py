"""The simulator: deterministic, driving pdcache's real policy code, keeping its invariants."""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import pytest

from pdcache.cli import main
from pdcache.engine.eviction import LruPolicy, SessionPolicy
from pdcache.offload_manager.hiradix import HiRadixTree
from pdcache.router.policy import PairSelector
from pdcache.sim import report
from pdcache.sim.command import add_run_arguments, build, split_overrides
from pdcache.sim.profile import NO_PROFILE, ProfileError, load_profile
from pdcache.sim.simulation import Simulation, seeded_trace_spec

ROOT = Path(__file__).resolve().parents[2]
PD = str(ROOT / "configs" / "local-1p1d.toml")
UNIFIED = str(ROOT / "configs" / "unified.toml")
TINY = ["--set", "model.preset=tiny"]
NO_STORAGE = ["--set", "storage.backend=none"]

PROFILE = """
[prefill]
base_s = 0.002
per_token_s = 1e-5
per_token_context_s = 1e-10
[decode]
base_s = 0.005
per_request_s = 1e-4
per_context_token_s = 1e-8
[transfer]
bandwidth_Bps = 1e10
per_room_s = 0.001
[host]
h2d_bandwidth_Bps = 2e10
d2h_bandwidth_Bps = 2e10
[storage]
read_bandwidth_Bps = 5e9
write_bandwidth_Bps = 3e9
node_nic_Bps = 1.25e9
op_latency_s = 0.0005
metadata_op_s = 0.0002
"""


@pytest.fixture(scope="module")
def profile_path(tmp_path_factory: pytest.TempPathFactory) -> str:
    path = tmp_path_factory.mktemp("sim") / "profile.toml"
    path.write_text(PROFILE)
    return str(path)


def simulate(profile_path: str, argv: list[str]) -> tuple[Simulation, dict]:
    parser = argparse.ArgumentParser()
    add_run_arguments(parser)
    args = parser.parse_args([*argv, "--profile", profile_path, "--no-progress"])
    sim = build(args)
    sim.run()
    sim.check()  # every request finished once; the real trees' and allocators' checks
    return sim, report.summarize(sim)


SERIAL = ["--trace", "synthetic:sessions=3,turns=3", "--concurrency", "1"]
RANDOM = ["--trace", "synthetic:sessions=8,turns=3,dist=lognormal,think=1",
          "--mode", "poisson-sessions", "--rate", "6", "--concurrency", "8"]


def test_same_seed_same_summary_other_seed_other_summary(profile_path: str) -> None:
    runs = [simulate(profile_path, [PD, *TINY, *RANDOM, "--seed", str(seed)])[1]
            for seed in (1, 1, 2)]
    first, again, other = (json.dumps(s, sort_keys=True, default=str) for s in runs)
    assert first == again
    assert first != other
    assert runs[0]["requests_ok"] == 24


@pytest.mark.parametrize("topology, extra", [
    (UNIFIED, []),
    (PD, []),  # turn t+1's answer pages come from the decode write-back
])
def test_roomy_cache_reaches_the_replays_theoretical_hit_rate(
        profile_path: str, topology: str, extra: list[str]) -> None:
    _, summary = simulate(profile_path, [topology, *TINY, *extra, *SERIAL])
    assert summary["theoretical_hit_rate"] > 0.5
    assert summary["hit_rate"] == pytest.approx(summary["theoretical_hit_rate"], abs=1e-12)
    assert summary["requests_ok"] == 9


def test_decode_write_back_is_what_turn_t_plus_1_hits_in_storage(profile_path: str) -> None:
    sim, summary = simulate(profile_path, [PD, *TINY, *SERIAL])
    later = [r for r in sim.records if r["turn"] > 0]
    assert later and all(r["cached_storage_from_decode"] > 0 for r in later)
    assert all(r["cached_storage_from_decode"] == 0 for r in sim.records if r["turn"] == 0)
    assert summary["hit_rate_by_origin"]["storage_from_decode"] > 0
    assert summary["storage"]["bytes"]["write_decode"] > 0
    # without the write-back the answers are computed again: no storage hit from decode
    _, off = simulate(profile_path, [PD, *TINY, "--set", "node.d0.offload=false", *SERIAL])
    assert off["hit_rate_by_origin"]["storage_from_decode"] == 0
    assert off["hit_rate"] < summary["hit_rate"]


PRESSURE = [UNIFIED, *TINY, *NO_STORAGE, "--set", "cache.host_pages=0",
            "--set", "cache.device_pages=300", "--trace",
            "synthetic:sessions=12,turns=6,system=256,think=2", "--mode", "poisson-sessions",
            "--rate", "4"]


def test_the_device_eviction_policy_is_the_engines(profile_path: str) -> None:
    rates = {}
    for name, cls in (("lru", LruPolicy), ("session", SessionPolicy)):
        sim, summary = simulate(profile_path, [*PRESSURE, "--set",
                                               f"cache.device_eviction={name}"])
        (node,) = sim.nodes.values()
        assert isinstance(node.cache.tree.policy, cls)
        assert summary["nodes"][0]["device_evicted_pages"] > 0
        rates[name] = summary["hit_rate"]
    assert rates["lru"] != rates["session"]


def test_the_routing_policy_is_the_routers(profile_path: str) -> None:
    rates, used = {}, {}
    for policy in ("cache_aware", "round_robin"):
        sim, summary = simulate(profile_path, [
            PD, *TINY, *NO_STORAGE, "--set", "node.d0.offload=false",
            "--set", f"router.prefill_policy={policy}", "--set", "sim.prefill=2",
            # 8 in flight: at 4 the decode node's admission happens to pin every session to
            # one prefill node under round robin too
            "--trace", "synthetic:sessions=8,turns=4", "--concurrency", "8"])
        assert isinstance(sim.router.selector, PairSelector)
        used[policy] = {r["prefill_node"] for r in sim.records}
        rates[policy] = summary["hit_rate"]
    assert used["round_robin"] == {"p0", "p0-1"}
    assert rates["cache_aware"] > rates["round_robin"]


def test_host_tier_and_storage_under_pressure_keep_the_invariants(profile_path: str) -> None:
    for write_policy, host_mode in (("write_through", "inclusive"), ("write_back", "exclusive"),
                                    ("write_through_selective", "inclusive")):
        sim, summary = simulate(profile_path, [
            PD, *TINY, "--set", "cache.device_pages=200", "--set", "cache.host_pages=300",
            "--set", f"cache.write_policy={write_policy}", "--set",
            f"cache.host_mode={host_mode}", "--trace",
            "synthetic:sessions=10,turns=5,system=256,think=1", "--mode",
            "poisson-sessions", "--rate", "5"])
        assert isinstance(sim.nodes["p0"].cache.tree, HiRadixTree)
        assert summary["requests_ok"] == 50
        assert summary["nodes"][0]["device_evicted_pages"] > 0
        assert summary["hit_rate_by_tier"]["host"] > 0
        assert summary["hit_rate_by_tier"]["storage"] > 0
    # a unified node without storage still backs its pages up to its host tier
    _, summary = simulate(profile_path, [
        UNIFIED, *TINY, *NO_STORAGE, "--set", "cache.device_pages=200", "--set",
        "cache.host_pages=400", "--trace", "synthetic:sessions=10,turns=5,system=256,think=1",
        "--mode", "poisson-sessions", "--rate", "5"])
    assert summary["hit_rate_by_tier"]["host"] > 0 and summary["storage"] is None


def test_64_nodes_run_quickly(profile_path: str) -> None:
    # round_robin: under cache_aware (PairSelector) a prompt sharing a known prefix goes to
    # the node that has it whatever its load, and misses go to the least loaded (the first
    # of ties), so a light load stays on a few nodes
    start = time.monotonic()
    sim, summary = simulate(profile_path, [
        PD, *TINY, "--set", "sim.prefill=32", "--set", "sim.decode=32",
        "--set", "router.prefill_policy=round_robin", "--trace",
        "synthetic:sessions=256,turns=4,system=0,user=512,think=1", "--mode",
        "poisson-sessions", "--rate", "80", "--concurrency", "256"])
    assert time.monotonic() - start < 30
    assert len(sim.nodes) == 64 and summary["requests_ok"] == 1024
    assert len({r["prefill_node"] for r in sim.records}) == 32
    assert len({r["decode_node"] for r in sim.records}) == 32


def test_goodput_counts_requests_within_the_slo(profile_path: str) -> None:
    _, summary = simulate(profile_path, [PD, *TINY, *RANDOM, "--ttft-slo", "1e9"])
    assert summary["slo_attainment"] == 1.0
    assert summary["goodput_rps"] == pytest.approx(
        summary["requests_ok"] / summary["duration_s"])
    _, tight = simulate(profile_path, [PD, *TINY, *RANDOM, "--ttft-slo", "1e-9"])
    assert tight["slo_attainment"] == 0.0 and tight["goodput_rps"] == 0.0


def test_command_writes_the_summary_and_needs_a_profile(
        profile_path: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "out"
    rc = main(["sim", PD, *TINY, *SERIAL, "--profile", profile_path, "--out", str(out),
               "--ttft-slo", "0.5"])
    assert rc == 0
    summary = json.loads((out / "summary.json").read_text())
    assert summary["requests_ok"] == 9 and summary["storage"]["bandwidth_over_time"]
    assert len((out / "requests.jsonl").read_text().splitlines()) == 9
    printed = capsys.readouterr()
    assert "== nodes ==" in printed.out and "hit_rate[storage_from_decode]" in printed.out
    assert "sim: t=" in printed.err and "requests 9/9" in printed.err  # the progress line
    assert main(["sim", PD, *SERIAL]) == 2
    assert NO_PROFILE in capsys.readouterr().err


def test_profile_errors_name_the_key(tmp_path: Path) -> None:
    with pytest.raises(ProfileError, match="--profile"):
        load_profile(None)
    path = tmp_path / "p.toml"
    path.write_text(PROFILE.replace("per_room_s = 0.001\n", ""))
    with pytest.raises(ProfileError, match=r"transfer\.per_room_s is missing"):
        load_profile(path)
    path.write_text(PROFILE + "\n[gpu]\nx = 1\n")
    with pytest.raises(ProfileError, match=r"\[gpu\]: unknown table"):
        load_profile(path)
    path.write_text(PROFILE.replace("node_nic_Bps = 1.25e9", "node_nic_Bps = 0"))
    with pytest.raises(ProfileError, match="bandwidth must be > 0"):
        load_profile(path)


def test_overrides_and_seeds() -> None:
    assert split_overrides(["cache.page_size=32", "sim.decode=4"]) == (
        ["cache.page_size=32"], {"decode": 4})
    with pytest.raises(ValueError, match="sim.ROLE=N"):
        split_overrides(["sim.gpu=3"])
    assert seeded_trace_spec("synthetic:sessions=2", 7) == "synthetic:sessions=2,seed=7"
    assert seeded_trace_spec("synthetic:seed=1", 7) == "synthetic:seed=1"
    assert seeded_trace_spec("mooncake:/x.jsonl", 7) == "mooncake:/x.jsonl"


def test_router_admission_limits_queue_and_refuse(profile_path: str) -> None:
    argv = [PD, *TINY, "--set", "router.max_inflight_per_node=1", *RANDOM]
    sim, summary = simulate(profile_path, argv)
    assert summary["router"]["peak_queue"] > 0 and summary["requests_ok"] == 24
    refusing = [*argv[:-len(RANDOM)], "--set", "router.max_queue=0", *RANDOM]
    parser = argparse.ArgumentParser()
    add_run_arguments(parser)
    sim = build(parser.parse_args([*refusing, "--profile", profile_path, "--no-progress"]))
    sim.run()
    summary = report.summarize(sim)
    assert summary["router"]["refused"] > 0
    assert summary["errors"] == {"RouterBusyError": summary["router"]["refused"]}
    assert summary["requests_skipped"] > 0  # the later turns of a refused session


def _write_trace(tmp_path: Path, fmt: str) -> str:
    if fmt == "sessions":
        rows = [{"session_id": f"s{s}", "input_length": 200, "output_length": 20,
                 "delay": 100, "hash_ids": [s * 100 + t for t in range(13)]} for s in range(3)
                for _ in range(2)]
        path = tmp_path / "t.jsonl"
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    elif fmt == "sharegpt":
        conv = [{"id": f"c{i}", "conversations": [
            {"from": "human", "value": "question " * 40}, {"from": "gpt", "value": "a " * 30},
            {"from": "human", "value": "more " * 30}, {"from": "gpt", "value": "b " * 20}]}
            for i in range(3)]
        path = tmp_path / "t.json"
        path.write_text(json.dumps(conv))
    else:
        rows = [{"timestamp": 10 * i, "input_length": 300, "output_length": 8,
                 "hash_ids": [0, 1, 2 + i]} for i in range(4)]
        path = tmp_path / "t.jsonl"
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return f"{fmt}:{path}"


@pytest.mark.parametrize("fmt, extra", [
    ("sessions", ["--block-size", "16"]),
    ("sharegpt", []),
    ("mooncake", ["--scale-block-size", "16", "--mode", "trace"]),
])
def test_every_replay_trace_format(profile_path: str, tmp_path: Path, fmt: str,
                                   extra: list[str]) -> None:
    sim, summary = simulate(profile_path, [PD, *TINY, "--trace", _write_trace(tmp_path, fmt),
                                           *extra, "--concurrency", "1"])
    assert summary["requests_ok"] == sim.trace.num_requests > 0
    assert summary["hit_rate"] == pytest.approx(summary["theoretical_hit_rate"], abs=1e-12)


MOONCAKE = ROOT.parent / "shared" / "data" / "mooncake-fast25" / "synthetic_trace.jsonl"


@pytest.mark.skipif(not MOONCAKE.is_file(), reason="the Mooncake FAST'25 trace is not here")
def test_mooncake_fast25_trace(profile_path: str) -> None:
    _, summary = simulate(profile_path, [
        PD, *TINY, "--set", "cache.device_pages=8192", "--trace", f"mooncake:{MOONCAKE}",
        "--max-requests", "60", "--scale-block-size", "16", "--mode", "trace"])
    assert summary["requests_ok"] == 60 and summary["theoretical_hit_rate"] > 0


@pytest.mark.parametrize("policy, uses_storage", [
    ("wait_complete", True), ("timeout", False), ("best_effort", False)])
def test_prefetch_policy_against_a_slow_store(tmp_path: Path, policy: str,
                                              uses_storage: bool) -> None:
    slow = tmp_path / "slow.toml"
    slow.write_text(PROFILE.replace("read_bandwidth_Bps = 5e9", "read_bandwidth_Bps = 1e6"))
    sim, summary = simulate(str(slow), [
        PD, *TINY, "--set", f"cache.prefetch_policy={policy}",
        "--set", "cache.prefetch_timeout_base_s=0.01",
        "--set", "cache.prefetch_timeout_max_s=0.05", *SERIAL])
    assert (summary["hit_rate_by_tier"]["storage"] > 0) == uses_storage
    later = [r for r in sim.records if r["turn"] > 0]
    waited = min(r["ttft_s"] for r in later)
    # the answer pages take ~0.1 s to read at 1 MB/s: only wait_complete waits that long
    assert (waited > 0.1) == uses_storage


def test_max_duration_stops_sending_and_unsimulated_options_are_refused(
        profile_path: str, capsys: pytest.CaptureFixture[str]) -> None:
    sim, summary = simulate(profile_path, [PD, *TINY, *RANDOM, "--max-duration", "1.0"])
    assert 0 < summary["requests_ok"] < 24
    assert summary["skip_reasons"] == {"max_duration": 24 - summary["requests_ok"]}
    assert main(["sim", PD, *SERIAL, "--profile", profile_path, "--round-barrier"]) == 2
    assert "not simulated" in capsys.readouterr().err


def test_a_refused_turn_lets_its_session_go_on(profile_path: str, tmp_path: Path) -> None:
    """A turn the router refuses (its queue full) in a session whose later turns do not carry
    its answer: those turns were neither sent nor counted, lost from every total (the replay
    goes on with them)."""
    rows = [{"chat_id": 3 * s + t, "parent_chat_id": 3 * s + t - 1 if t else -1, "turn": t,
             "timestamp": 0.001 * (3 * s + t), "input_length": 64, "output_length": 8,
             "hash_ids": [1000 * s + i for i in range(4)]} for s in range(2) for t in range(3)]
    trace = tmp_path / "bailian.jsonl"
    trace.write_text("".join(json.dumps(row) + "\n" for row in rows))
    _, summary = simulate(profile_path, [PD, *TINY, "--trace", f"bailian:{trace}",
                                         "--set", "router.max_inflight_per_node=1",
                                         "--set", "router.max_queue=0"])
    assert summary["requests_failed"] >= 1  # refused: the router's queue holds none
    assert summary["requests_ok"] + summary["requests_failed"] + summary["requests_skipped"] \
        == summary["requests_total"] == 6


def test_the_client_s_queue_is_recorded_and_counts_against_the_slo(profile_path: str) -> None:
    """Requests due while every --concurrency slot was busy waited uncounted: TTFT timed from
    dispatch said 1P1D met an SLO that a far larger cluster misses (`plan` chose it)."""
    from pdcache.sim.plan import meets

    sim, summary = simulate(profile_path, [PD, *TINY, "--trace",
                                           "synthetic:sessions=4,turns=1,stagger=0",
                                           "--mode", "trace", "--concurrency", "1"])
    queued = sorted(r["queued_s"] for r in sim.records)
    assert queued[0] == 0.0 and queued[-1] > 0  # the last one waited for three before it
    assert summary["ttft_from_due_p99_s"] > summary["ttft_p99_s"]
    slo = (summary["ttft_p99_s"] + summary["ttft_from_due_p99_s"]) / 2
    assert not meets(summary, slo, None, 99)
