"""`pdcache chaos`, part by part: the seeded fault plan and its scheduler, the process
faults on real processes, the token oracle against a real engine, the idle accounting and the
verdict (each check shown failing on the bad input it exists for)."""

from __future__ import annotations

import json
import random
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from pdcache.chaos.accounting import node_accounting
from pdcache.chaos.faults import Fault, FaultContext, Injection
from pdcache.chaos.load import AttemptRecord
from pdcache.chaos.oracle import AnswerCheck, TokenOracle, check_answer, first_difference
from pdcache.chaos.process_faults import FreezeNode, KillPrefill, healthy_targets
from pdcache.chaos.registry import FAULTS, parse_fault_list
from pdcache.chaos.schedule import (
    FaultRecord,
    FaultScheduler,
    PlanSettings,
    plan_faults,
    wall_clock,
)
from pdcache.chaos.verdict import broken_invariants, error_window_s, verdict
from pdcache.config import load_topology

KINDS = ["kill-prefill", "kill-decode", "kill-metadata", "freeze-node"]
CONFIG = Path(__file__).resolve().parents[2] / "configs" / "local-1p1d.toml"


# ---- the plan --------------------------------------------------------------------------------


def test_same_seed_same_plan_and_another_seed_another() -> None:
    settings = PlanSettings(duration_s=300.0)
    a = plan_faults(KINDS, 7, settings, {"freeze-node": 8.0})
    assert a == plan_faults(KINDS, 7, settings, {"freeze-node": 8.0})
    assert a != plan_faults(KINDS, 8, settings, {"freeze-node": 8.0})


@pytest.mark.parametrize("seed", range(5))
def test_plan_covers_every_kind_and_never_overlaps_a_kind_with_itself(seed: int) -> None:
    settings = PlanSettings(
        duration_s=50.0, mean_gap_s=8.0, hold_s=(2.0, 6.0), warmup_s=5.0, quiet_tail_s=18.0
    )
    plan = plan_faults(KINDS, seed, settings, {"freeze-node": 8.0})
    assert sorted(p.kind for p in plan[: len(KINDS)]) == sorted(KINDS)  # first round
    assert all(5.0 <= p.at_s < 50.0 - 18.0 for p in plan)
    assert all(p.hold_s >= 8.0 for p in plan if p.kind == "freeze-node")
    for kind in KINDS:
        mine = sorted((p for p in plan if p.kind == kind), key=lambda p: p.at_s)
        assert all(b.at_s >= a.at_s + a.hold_s for a, b in zip(mine, mine[1:]))


def test_a_long_plan_overlaps_different_kinds() -> None:
    plan = plan_faults(KINDS, 0, PlanSettings(duration_s=1800.0))
    overlapping = [
        (a, b)
        for a in plan
        for b in plan
        if a.kind != b.kind and a.at_s < b.at_s < a.at_s + a.hold_s
    ]
    alone = [
        a
        for a in plan
        if not any(
            b is not a
            and (a.at_s <= b.at_s < a.at_s + a.hold_s or b.at_s <= a.at_s < b.at_s + b.hold_s)
            for b in plan
        )
    ]
    assert len(plan) > 150 and overlapping and alone


# ---- the scheduler, with faults that record what happens to them ----------------------------


class Recorded(Fault):
    """A fault whose effect is a line in a shared log; not ready until `ready_after_s`."""

    def __init__(self, kind: str, log: list[str], clock, ready_after_s: float = 0.0) -> None:
        self.kind = kind  # type: ignore[misc]
        self.log, self.clock, self.ready_after_s = log, clock, ready_after_s

    def ready(self, ctx: FaultContext) -> bool:
        return self.clock() >= self.ready_after_s

    def inject(self, ctx: FaultContext) -> Injection:
        self.log.append(f"inject {self.kind}")
        return Injection(self.kind, f"prefill:{self.kind}")

    def heal(self, ctx: FaultContext) -> None:
        self.log.append(f"heal {self.kind}")


def _ctx(tmp_path: Path) -> FaultContext:
    return FaultContext(
        load_topology(CONFIG, ["model.preset=tiny"]),
        tmp_path,
        tmp_path,
        random.Random(0),
        lambda text: None,
    )


def test_scheduler_injects_heals_defers_and_heals_at_stop(tmp_path: Path) -> None:
    from pdcache.chaos.schedule import PlannedFault

    clock = wall_clock()
    log: list[str] = []
    faults = {
        "a": Recorded("a", log, clock),
        "b": Recorded("b", log, clock, ready_after_s=0.8),
        "c": Recorded("c", log, clock),
    }
    plan = [PlannedFault(0.1, "a", 0.5), PlannedFault(0.2, "b", 0.2), PlannedFault(0.3, "c", 60.0)]
    scheduler = FaultScheduler(plan, faults, _ctx(tmp_path), clock)
    scheduler.start()
    deadline = time.monotonic() + 10
    while "heal b" not in log and time.monotonic() < deadline:
        time.sleep(0.05)
    scheduler.stop()
    assert log == ["inject a", "inject c", "heal a", "inject b", "heal b", "heal c"]
    a, b, c = scheduler.records
    assert b.deferred_s >= 0.4 and b.injected_at_s >= 0.8  # waited for ready()
    assert c.overlapped == ["a"] and b.overlapped == ["c"]
    assert c.healed_at_s < 30  # healed by stop(), not after its hold


# ---- process faults on real processes --------------------------------------------------------


def _processes_json(tmp_path: Path, procs: dict[str, tuple[str, int]]) -> None:
    table = {
        "processes": [
            {"name": n, "role": r, "pid": pid, "state": "healthy"} for n, (r, pid) in procs.items()
        ]
    }
    (tmp_path / "processes.json").write_text(json.dumps(table))


def _sleeper() -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-c", "import time; time.sleep(60)"], start_new_session=True
    )


def _state(pid: int) -> str:
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]


def test_kill_prefill_kills_the_healthy_prefill_of_processes_json(tmp_path: Path) -> None:
    prefill, decode = _sleeper(), _sleeper()
    try:
        ctx = _ctx(tmp_path)
        fault = KillPrefill()
        assert not fault.ready(ctx)  # no processes.json yet: nothing to kill
        _processes_json(tmp_path, {"p0": ("prefill", prefill.pid), "d0": ("decode", decode.pid)})
        assert [t.name for t in healthy_targets(ctx, ("prefill",))] == ["p0"]
        injection = fault.inject(ctx)
        assert (injection.kind, injection.target) == ("kill-prefill", "prefill:p0")
        assert prefill.wait(10) == -9 and decode.poll() is None
    finally:
        for proc in (prefill, decode):
            proc.kill()
            proc.wait()


def test_freeze_node_stops_its_group_past_the_heartbeat_deadline_and_heal_continues(
    tmp_path: Path,
) -> None:
    node = _sleeper()
    try:
        ctx = _ctx(tmp_path)
        _processes_json(tmp_path, {"d0": ("decode", node.pid)})
        fault = FreezeNode()
        assert fault.min_hold_s(ctx) == pytest.approx(5.0 + 3.0)  # 1 s heartbeat x 5 misses + 3
        assert fault.inject(ctx).target == "decode:d0"
        deadline = time.monotonic() + 5
        while _state(node.pid) != "T" and time.monotonic() < deadline:
            time.sleep(0.02)
        assert _state(node.pid) == "T"
        fault.heal(ctx)
        while _state(node.pid) == "T" and time.monotonic() < deadline:
            time.sleep(0.02)
        assert _state(node.pid) in ("S", "R")
    finally:
        node.kill()
        node.wait()


def test_registry_has_every_process_fault_and_refuses_unknown_kinds() -> None:
    assert {
        "kill-prefill",
        "kill-decode",
        "kill-metadata",
        "kill-mooncake-master",
        "freeze-node",
    } <= set(FAULTS)
    assert parse_fault_list("kill-decode, freeze-node") == ["kill-decode", "freeze-node"]
    with pytest.raises(ValueError, match="kill-router"):
        parse_fault_list("kill-decode,kill-router")


def test_kill_metadata_and_mooncake_master_are_unavailable_without_their_service(
    tmp_path: Path,
) -> None:
    ctx = _ctx(tmp_path)  # hf3fs with a metadata service, no Mooncake Store
    assert FAULTS["kill-metadata"]().unavailable(ctx) is None
    assert "mooncake_master" in FAULTS["kill-mooncake-master"]().unavailable(ctx)


# ---- the oracle ------------------------------------------------------------------------------


def test_first_difference() -> None:
    assert first_difference((1, 2, 3), (1, 2, 3)) is None
    assert first_difference((1, 2, 3), (1, 5, 3)) == 1
    assert first_difference((1, 2, 3), (1, 2)) == 2  # a short answer differs at its end
    check = AnswerCheck("r", np.arange(4, dtype=np.int32), 3, (1, 2, 4))
    wrong = check_answer(check, (1, 2, 3))
    assert wrong is not None and (wrong.first_diff, wrong.expected, wrong.got) == (
        2,
        (1, 2, 3),
        (1, 2, 4),
    )


@pytest.mark.slow
def test_oracle_agrees_with_a_caching_engine_and_catches_one_wrong_token() -> None:
    from pdcache.engine.api import GenerateRequest, SamplingParams
    from pdcache.engine.config import CacheConfig, EngineConfig
    from pdcache.engine.engine import Engine
    from pdcache.engine.loader import load_model

    model, tokenizer = load_model("tiny", seed=0)
    rng = np.random.default_rng(0)
    shared = rng.integers(0, 256, 64)
    prompts = [
        np.concatenate([shared, rng.integers(0, 256, 20)]).astype(np.int32) for _ in range(3)
    ]
    served = []  # answers of an engine with a prefix cache, as a node would give them
    config = EngineConfig(model.config, CacheConfig(16, 64))
    with Engine(config, model, tokenizer) as engine:
        for i, prompt in enumerate(prompts):
            outs = engine.generate(
                GenerateRequest(
                    f"r{i}", prompt.tolist(), SamplingParams(max_new_tokens=12, ignore_eos=True)
                ),
                60,
            )
            served.append(tuple(t for o in outs for t in o.new_token_ids))
    assert engine.stats()["tokens_cached_total"] > 0  # the later prompts hit the cache
    oracle = TokenOracle(model, tokenizer, seed=0, page_size=16, max_tokens=128, batch=2)
    oracle.start()
    try:
        for i, (prompt, answer) in enumerate(zip(prompts, served)):
            oracle.submit(AnswerCheck(f"ok{i}", prompt, 12, answer))
        bad = list(served[1])
        bad[5] = (bad[5] + 1) % 256
        oracle.submit(AnswerCheck("bad", prompts[1], 12, tuple(bad)))
        oracle.submit(AnswerCheck("again", prompts[0], 12, served[0]))  # from the oracle's cache
        assert oracle.drain(120)
    finally:
        oracle.close()
    report = oracle.report()
    assert (report["checked"], report["wrong"], report["errors"]) == (5, 1, [])
    assert report["first_wrong"][0]["request_id"] == "bad"
    assert report["first_wrong"][0]["first_diff"] == 5
    assert report["cache_hits"] == 2


# ---- accounting and verdict ------------------------------------------------------------------

METRICS = """# TYPE pdcache_host_pages gauge
pdcache_host_pages{server="p0",state="free"} 90.0
pdcache_host_pages{server="p0",state="in_flight"} %d
# TYPE pdcache_decode_offload_staging_pages_used gauge
pdcache_decode_offload_staging_pages_used{server="p0"} %d
"""


def _health(used: int, evictable: int, rooms: int, pd_rooms: int) -> dict:
    return {
        "engine": {"pages_used": used, "pages_evictable": evictable},
        "transfer": {"rooms": {"active": rooms}},
        "pd_rooms_open": pd_rooms,
    }


def test_node_accounting_counts_what_an_idle_node_still_holds() -> None:
    assert node_accounting(_health(40, 40, 0, 0), METRICS % (0, 0))["leaked_pages"] == 0
    leaked = node_accounting(_health(40, 33, 1, 2), METRICS % (4, 2))
    assert (leaked["leaked_pages"], leaked["leaked_rooms"]) == (7 + 4 + 2, 1 + 2)
    assert leaked["leaked_states"] == 0  # not a hybrid model: no state slots at all


HYBRID_METRICS = METRICS + """# TYPE pdcache_state_host_slots gauge
pdcache_state_host_slots{server="p0",state="used"} 6.0
pdcache_state_host_slots{server="p0",state="pinned"} %d
"""


def test_node_accounting_counts_state_slots_of_hybrid_models() -> None:
    """Device state slots that are neither free nor a tree checkpoint, and host state slots
    still pinned by a write, are leaks once idle; tree checkpoints and used host slots are
    the cache."""
    health = _health(40, 40, 0, 0)
    health["engine"].update(state_slots_total=16, state_slots_free=10, state_checkpoints=6)
    assert node_accounting(health, HYBRID_METRICS % (0, 0, 0))["leaked_states"] == 0
    health["engine"]["state_slots_free"] = 8  # two slots held by nothing idle
    assert node_accounting(health, HYBRID_METRICS % (0, 0, 1))["leaked_states"] == 2 + 1


def _ok(t: float, prefill: str = "p0", decode: str = "d0") -> AttemptRecord:
    return AttemptRecord(
        f"r{t}",
        "s",
        0,
        dispatch_s=t,
        done_s=t + 0.5,
        ok=True,
        prefill_node=prefill,
        decode_node=decode,
        prompt_tokens=100,
        cached_tokens=50,
    )


def _failed(t: float, code: str) -> AttemptRecord:
    return AttemptRecord(f"f{t}", "s", 0, dispatch_s=t, done_s=t + 0.1, code=code)


def _fault(kind: str, target: str, at: float) -> FaultRecord:
    return FaultRecord(kind, at, 3.0, injected_at_s=at, healed_at_s=at + 3, target=target)


CLEAN_ACCOUNTING = {
    "p0": {"leaked_pages": 0, "leaked_rooms": 0},
    "d0": {"leaked_pages": 0, "leaked_rooms": 0},
}


def test_error_window_is_injection_to_the_next_success_on_the_path() -> None:
    results = [_ok(1.0), _failed(10.5, "http_503:no_healthy_node"), _ok(11.0, "p1"), _ok(14.0)]
    assert error_window_s(_fault("kill-prefill", "prefill:p0", 10.0), results) == 4.5
    assert error_window_s(_fault("kill-prefill", "prefill:p1", 10.0), results) == 1.5
    assert error_window_s(_fault("kill-metadata", "metadata", 10.0), results) == 1.5
    assert error_window_s(_fault("kill-decode", "decode:d0", 20.0), results) is None


def _verdict(results=None, faults=None, oracle=None, accounting=None) -> dict:
    results = results if results is not None else [_ok(1.0), _ok(12.0)]
    faults = faults if faults is not None else [_fault("kill-decode", "decode:d0", 10.0)]
    checked = sum(r.ok for r in results)
    return verdict(
        results, faults, oracle or {"checked": checked, "wrong": 0}, accounting or CLEAN_ACCOUNTING
    )


def test_a_clean_soak_breaks_nothing() -> None:
    v = _verdict()
    assert broken_invariants(v) == []
    assert (v["requests_ok"], v["hit_rate"], v["max_error_window_s"]) == (2, 0.5, 2.5)


def test_a_wrong_token_breaks_the_verdict() -> None:
    oracle = {"checked": 2, "wrong": 1, "first_wrong": [{"request_id": "r12.0"}]}
    assert any("wrong_tokens = 1" in b for b in broken_invariants(_verdict(oracle=oracle)))


def test_an_unchecked_answer_breaks_the_verdict() -> None:
    assert any("unchecked" in b for b in broken_invariants(_verdict(oracle={"checked": 1})))


@pytest.mark.parametrize("leak", ["leaked_pages", "leaked_rooms", "leaked_states"])
def test_a_leak_on_any_node_breaks_the_verdict(leak: str) -> None:
    accounting = {**CLEAN_ACCOUNTING, "d0": {"leaked_pages": 0, "leaked_rooms": 0, leak: 3}}
    assert any(
        b.startswith("d0:") and f"{leak} = 3" in b
        for b in broken_invariants(_verdict(accounting=accounting))
    )


def test_an_unreadable_node_breaks_the_verdict() -> None:
    accounting = {**CLEAN_ACCOUNTING, "p0": {"error": "ConnectError"}}
    assert any("unreadable" in b for b in broken_invariants(_verdict(accounting=accounting)))


def test_an_unanswered_request_breaks_the_verdict() -> None:
    v = _verdict(results=[_ok(1.0), _failed(5.0, "unanswered"), _ok(12.0)])
    assert v["requests_failed_by_code"] == {"unanswered": 1}
    assert broken_invariants(v) == ["unanswered = 1"]


def test_a_fault_without_recovery_or_never_injected_breaks_the_verdict() -> None:
    late = _fault("kill-decode", "decode:d0", 20.0)
    never = FaultRecord("freeze-node", 30.0, 8.0, error="not ready within 120s: skipped")
    broken = broken_invariants(_verdict(faults=[late, never]))
    assert any("never followed by a success" in b for b in broken)
    assert any(b.startswith("freeze-node: 1 of 1 planned faults not injected") for b in broken)


def test_a_window_with_another_fault_in_it_counts_as_overlapped() -> None:
    results = [_ok(1.0), _ok(16.0), _ok(30.0)]
    kill = _fault("kill-prefill", "prefill:p0", 10.0)  # healed at 13, recovered at 16.5
    freeze = _fault("freeze-node", "decode:d0", 14.0)  # in the kill's window, not it in its
    late = _fault("kill-metadata", "metadata", 25.0)  # alone
    rows = _verdict(results=results, faults=[kill, freeze, late])["faults"]
    assert [rows[k]["overlapped"] for k in ("kill-prefill", "freeze-node", "kill-metadata")] == [
        1,
        0,
        0,
    ]
    assert rows["kill-prefill"]["alone_p50_error_window_s"] is None  # its one window overlapped
    assert rows["kill-metadata"]["alone_p50_error_window_s"] == 5.5


def test_an_answer_to_another_prompt_breaks_the_verdict() -> None:
    v = _verdict(results=[_ok(1.0), _failed(5.0, "prompt_mismatch"), _ok(12.0)])
    assert broken_invariants(v) == ["prompt_mismatch = 1"]
    other = _verdict(results=[_ok(1.0), _failed(5.0, "http_503:no_healthy_node"), _ok(12.0)])
    assert broken_invariants(other) == []  # an error answer is an answer


def test_the_markdown_verdict_has_a_row_per_kind_the_totals_and_the_replay() -> None:
    from pdcache.chaos.command import markdown_verdict

    v = _verdict(faults=[_fault("kill-decode", "decode:d0", 10.0)])
    v.update(seed=7, duration_s=60.0, replay="pdcache chaos X --seed 7")
    text = markdown_verdict(v)
    assert "| kill-decode | 1 | 1 | 0 | 2.5 | 2.5 | 2.5 | 0 | 0 |" in text
    assert "wrong tokens **0** of 2 checked" in text and "leaked pages **0**" in text
    assert text.rstrip().endswith("`pdcache chaos X --seed 7`")


def test_bench_chaos_still_names_the_chaos_command() -> None:
    from pdcache.cli import build_parser, resolve_alias

    argv = resolve_alias(["bench", "chaos", "configs/local-1p1d.toml", "--out", "OUT"])
    assert argv == ["chaos", "configs/local-1p1d.toml", "--out", "OUT"]
    assert resolve_alias(["bench", "replay", "--url", "U"]) == ["bench", "replay", "--url", "U"]
    args = build_parser(argv).parse_args(argv)
    assert (args.command, args.config, args.out, args.json_path) == (
        "chaos", "configs/local-1p1d.toml", "OUT", None)
