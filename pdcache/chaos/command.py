"""`pdcache chaos CONFIG`: launch a topology, drive steady multi-turn traffic through its
router while seeded faults strike, check every answer against the token oracle, and give the
verdict (docs/chaos.md).

Order: faults `prepare` (their `--set` overrides join the command line's) -> `pdcache launch`
(with restarts) -> healthy -> oracle thread, fault scheduler thread, load on this thread for
`--duration` -> scheduler stopped (active faults healed) -> stack healthy again -> each node's
idle accounting -> the oracle finishes its checks -> launcher stopped -> faults `cleanup` ->
table, `OUT/chaos.json` (and `--json`), exit 1 with the seed and the command to replay it
when an invariant broke.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import shlex
import sys
import time
import uuid
from dataclasses import asdict
from pathlib import Path
from typing import Any

import numpy as np

from pdcache.bench.stack import (
    ConfigRun,
    LaunchedStack,
    LaunchError,
    add_launch_options,
    launched,
)
from pdcache.bench.table import emit
from pdcache.chaos.accounting import pd_nodes, settle
from pdcache.chaos.faults import Fault, FaultContext
from pdcache.chaos.load import AttemptRecord, LoadSettings, SteadyLoad
from pdcache.chaos.oracle import AnswerCheck, TokenOracle
from pdcache.chaos.registry import FAULTS, parse_fault_list
from pdcache.chaos.schedule import (
    FaultScheduler,
    PlanSettings,
    min_holds,
    plan_faults,
    wall_clock,
)
from pdcache.chaos.stale import clean_stale
from pdcache.chaos.verdict import broken_invariants, verdict

DEFAULT_TRACE = (
    "synthetic:sessions=16,turns=4,system_prompt=256,user=32,tool_result=48,answer=16,dist=uniform"
)
FAULT_COLUMNS = (
    "fault",
    "planned",
    "injected",
    "overlapped",
    "max_error_window_s",
    "p50_error_window_s",
    "alone_p50_error_window_s",
    "unrecovered",
    "errors",
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("config", metavar="CONFIG", help="topology file (configs/)")
    add_launch_options(parser, startup_timeout_s=300.0, set_help="topology override (repeatable)")
    parser.add_argument("--duration", type=float, default=120.0, help="seconds of traffic")
    parser.add_argument(
        "--faults",
        default="all",
        help=f"comma-separated kinds or 'all' (known: {', '.join(FAULTS)})",
    )
    parser.add_argument("--seed", type=int, default=0, help="seeds the fault plan and targets")
    parser.add_argument(
        "--trace",
        default=DEFAULT_TRACE,
        help="trace spec as for bench replay (sessions repeat with new tokens)",
    )
    parser.add_argument("--concurrency", type=int, default=4, help="conversations in flight")
    parser.add_argument("--out", required=True, help="output directory")
    parser.add_argument(
        "--mean-gap",
        type=float,
        default=8.0,
        help="mean seconds between fault arrivals (exponential)",
    )
    parser.add_argument(
        "--hold",
        type=float,
        nargs=2,
        default=(2.0, 8.0),
        metavar=("MIN", "MAX"),
        help="a fault is healed after a uniform hold in [MIN, MAX] seconds",
    )
    parser.add_argument("--warmup", type=float, default=5.0, help="seconds before the first fault")
    parser.add_argument(
        "--quiet-tail",
        type=float,
        default=20.0,
        help="no fault in the last S seconds: the last outages end under traffic",
    )
    parser.add_argument(
        "--request-deadline",
        type=float,
        default=120.0,
        help="an attempt without an answer by then is unanswered",
    )
    parser.add_argument("--retries", type=int, default=3, help="retries of a failed turn")
    parser.add_argument(
        "--max-tokens-cap",
        type=int,
        default=2048,
        help="prompt + answer tokens of a session's turn (then a new session)",
    )
    parser.add_argument(
        "--idle-timeout",
        type=float,
        default=60.0,
        help="seconds for every node to hold nothing once the load stopped",
    )
    parser.add_argument(
        "--oracle-timeout",
        type=float,
        default=None,
        help="seconds for the oracle to finish its checks after the load "
        "(default: max(600, --duration))",
    )
    parser.add_argument("--progress-interval", type=float, default=5.0)
    parser.add_argument("--json", dest="json_path", default=None,
                        help="also write the verdict here")


def replay_command(args: argparse.Namespace, kinds: list[str]) -> str:
    """The command line that replays this soak (same seed, faults, trace and load)."""
    argv = ["pdcache", "chaos", str(args.config)]
    for item in args.overrides:
        argv += ["--set", item]
    argv += [
        "--duration",
        f"{args.duration:g}",
        "--faults",
        ",".join(kinds),
        "--seed",
        str(args.seed),
        "--trace",
        args.trace,
        "--concurrency",
        str(args.concurrency),
        "--mean-gap",
        f"{args.mean_gap:g}",
        "--hold",
        f"{args.hold[0]:g}",
        f"{args.hold[1]:g}",
        "--warmup",
        f"{args.warmup:g}",
        "--quiet-tail",
        f"{args.quiet_tail:g}",
        "--out",
        str(args.out),
    ]
    return shlex.join(argv)


class Soak:
    """One soak: owns the launcher process, the oracle, the scheduler and the faults."""

    def __init__(self, args: argparse.Namespace, kinds: list[str]) -> None:
        from pdcache.config import load_topology

        self.args = args
        self.out = Path(args.out).resolve()
        self.state_dir = self.out / "logs"
        self.work_dir = self.out / "work"
        self.work_dir.mkdir(parents=True, exist_ok=True)
        for leftover in clean_stale(self.work_dir):  # of a soak on this OUT that was SIGKILLed
            self.say(f"removed the leftover {leftover}")
        topology = load_topology(args.config, args.overrides)
        self.ctx = FaultContext(
            topology,
            self.state_dir,
            self.work_dir,
            random.Random(f"pdcache-chaos-targets:{args.seed}"),
            self.say,
            {},
        )
        self.faults: dict[str, Fault] = {}
        self.unavailable: dict[str, str] = {}
        for kind in kinds:
            fault = FAULTS[kind]()
            why = fault.unavailable(self.ctx)
            if why:
                self.unavailable[kind] = why
            else:
                self.faults[kind] = fault
        self.t0 = time.monotonic()
        self.clock = wall_clock(self.t0)

    def say(self, text: str) -> None:
        """One progress line; any thread (one write call, so lines never interleave)."""
        sys.stderr.write(f"[chaos] {text}\n")
        sys.stderr.flush()

    # ---- phases

    def prepare(self) -> list[str]:
        """Every fault's prepare(); the overrides the stack is launched with."""
        extra: dict[str, str] = {}
        for fault in self.faults.values():
            extra.update(fault.prepare(self.ctx))
        self.ctx.overrides.update(extra)
        return [*self.args.overrides, *(f"{k}={v}" for k, v in extra.items())]

    def run(self) -> dict[str, Any]:
        from pdcache.config import load_topology

        overrides = self._secret_overrides(self.prepare())
        run = ConfigRun("chaos", Path(self.args.config), tuple(overrides))
        self.ctx.topology = load_topology(self.args.config, overrides)  # as launched
        oracle: TokenOracle | None = None
        try:
            self.say(f"starting {self.args.config} (logs {self.state_dir}) ...")
            with launched(run, self.out, self.args.startup_timeout, self.args.stop_timeout,
                          restart=True, announce=False) as stack:
                oracle = self._oracle(self.ctx.topology)
                oracle.start()
                outcome = self._soak_and_settle(stack, oracle)
        finally:
            for fault in self.faults.values():
                try:
                    fault.cleanup(self.ctx)
                except Exception as exc:  # noqa: BLE001 - cleanup of one must not skip others
                    self.say(f"{fault.kind}: cleanup failed: {exc}")
            if oracle is not None:
                oracle.close()
        return outcome

    def _soak_and_settle(self, stack: LaunchedStack, oracle: TokenOracle) -> dict[str, Any]:
        """The load under faults, then the stack healthy and idle again and the oracle done."""
        topology = self.ctx.topology
        results, scheduler, plan = self._soak(stack.front, topology, oracle)
        self.say("load stopped; waiting for the stack to be healthy and idle ...")
        stack.wait_healthy(self.args.startup_timeout)
        accounting = settle(pd_nodes(topology), self.args.idle_timeout, self._token(topology))
        self._drain(oracle)
        return {
            "results": results,
            "faults": scheduler.records,
            "plan": plan,
            "oracle": oracle.report(),
            "accounting": accounting,
        }

    def _drain(self, oracle: TokenOracle) -> None:
        """Let the oracle finish its backlog (bounded), with a progress line every 10 s."""
        timeout = self.args.oracle_timeout
        budget = timeout if timeout is not None else max(600.0, self.args.duration)
        deadline = time.monotonic() + budget
        while time.monotonic() < deadline:
            self.say(f"oracle: {oracle.pending()} checks pending ...")
            if oracle.drain(min(10.0, deadline - time.monotonic())):
                return

    def _secret_overrides(self, overrides: list[str]) -> list[str]:
        """`overrides` + a cluster secret of the soak's own (OUT/secret/cluster.secret) unless
        the topology names one: the harness needs the node credential for /metrics."""
        from pdcache.config import load_topology
        from pdcache.utils.secret import create_secret

        if load_topology(self.args.config, overrides).security.enabled:
            return overrides
        path = self.out / "secret" / "cluster.secret"
        if not path.exists():
            create_secret(path)
        return [*overrides, f"security.secret_file={json.dumps(str(path))}"]

    @staticmethod
    def _token(topology: Any) -> str | None:
        from pdcache.config.security import security_for

        return security_for(topology.security, topology.source).node_http_token

    def _oracle(self, topology: Any) -> TokenOracle:
        from pdcache.engine.loader import load_model

        spec = topology.model
        model, tokenizer = load_model(spec.ref, dtype=spec.dtype, seed=spec.seed)
        self.max_tokens = min(self.args.max_tokens_cap, model.config.max_position_embeddings)
        self.vocab = (0, int(model.config.vocab_size))
        return TokenOracle(
            model,
            tokenizer,
            seed=spec.seed,
            page_size=topology.cache.page_size,
            max_tokens=self.max_tokens,
            batch=8,
        )

    def _soak(
        self, front: str, topology: Any, oracle: TokenOracle
    ) -> tuple[list[AttemptRecord], FaultScheduler, list[dict[str, Any]]]:
        from pdcache.bench.traces import load_trace

        args = self.args
        trace = load_trace(args.trace)
        settings = PlanSettings(
            args.duration, args.mean_gap, tuple(args.hold), args.warmup, args.quiet_tail
        )
        plan = plan_faults(list(self.faults), args.seed, settings, min_holds(self.faults, self.ctx))
        self.say(
            f"plan: {len(plan)} faults over {args.duration:g}s (seed {args.seed}): "
            + ", ".join(f"{p.kind}@{p.at_s:.0f}s" for p in plan[:12])
            + (" ..." if len(plan) > 12 else "")
        )
        load_settings = LoadSettings(
            url=front,
            duration_s=args.duration,
            concurrency=args.concurrency,
            deadline_s=args.request_deadline,
            retries=args.retries,
            max_tokens=self.max_tokens,
            vocab=self.vocab,
            token_seed=args.seed,
            cache_salt=f"chaos-{uuid.uuid4().hex[:12]}",
            session_prefix=f"chaos{args.seed}-{uuid.uuid4().hex[:6]}",
        )

        def on_success(rec: AttemptRecord, prompt: np.ndarray, output: list[int]) -> None:
            oracle.submit(AnswerCheck(rec.request_id, prompt.astype(np.int32), rec.max_new_tokens,
                                      tuple(output)))

        self.t0 = time.monotonic()
        self.clock = wall_clock(self.t0)
        scheduler = FaultScheduler(plan, self.faults, self.ctx, self.clock)
        with (self.out / "requests.jsonl").open("w") as sink:
            load = SteadyLoad(load_settings, trace, sink, on_success, self.clock)
            scheduler.start()
            try:
                asyncio.run(self._drive(load, scheduler, oracle))
            finally:
                scheduler.stop()
        return load.results, scheduler, [asdict(p) for p in plan]

    async def _drive(
        self, load: SteadyLoad, scheduler: FaultScheduler, oracle: TokenOracle
    ) -> None:
        task = asyncio.ensure_future(load.run())
        while not task.done():
            await asyncio.wait({task}, timeout=self.args.progress_interval)
            self._progress(load, scheduler, oracle)
        task.result()

    def _progress(self, load: SteadyLoad, scheduler: FaultScheduler, oracle: TokenOracle) -> None:
        results = load.results
        ok = sum(r.ok for r in results)
        unanswered = sum(r.code == "unanswered" for r in results)
        report = oracle.report()
        injected = sum(r.injected_at_s is not None for r in scheduler.records)
        active = ",".join(scheduler.active_kinds()) or "-"
        self.say(
            f"t={self.clock():.0f}/{self.args.duration:g}s ok {ok} failed "
            f"{len(results) - ok} (unanswered {unanswered}) | oracle checked "
            f"{report['checked']} wrong {report['wrong']} pending {report['pending']} | "
            f"faults {injected}/{len(scheduler.records)} active {active}"
        )


def markdown_verdict(v: dict[str, Any]) -> str:
    """The verdict as a README-ready Markdown table, the totals and the replay command."""

    def cell(value: Any) -> str:
        return "—" if value is None else f"{value:g}" if isinstance(value, float) else str(value)

    lines = ["| " + " | ".join(FAULT_COLUMNS) + " |", "|" + "---|" * len(FAULT_COLUMNS)]
    for kind, row in v["faults"].items():
        values = [kind, *(row.get(c) for c in FAULT_COLUMNS[1:])]
        lines.append("| " + " | ".join(cell(x) for x in values) + " |")
    pages = sum(n or 0 for n in v["leaked_pages"].values())
    rooms = sum(n or 0 for n in v["leaked_rooms"].values())
    states = sum(n or 0 for n in v.get("leaked_states", {}).values())
    failed = ", ".join(f"{k} {n}" for k, n in v["requests_failed_by_code"].items()) or "none"
    lines += [
        "",
        f"{v['duration_s']:g} s, seed {v['seed']}: requests ok {v['requests_ok']}, failed "
        f"{v['requests_failed']} ({failed}); wrong tokens **{v['wrong_tokens']}** of "
        f"{v['oracle_checked']} checked; unanswered **{v['unanswered']}**; leaked pages "
        f"**{pages}**, rooms **{rooms}**, state slots **{states}** on "
        f"{len(v['leaked_pages'])} nodes; hit rate "
        f"{v['hit_rate']:.3f}; faults injected {v['faults_injected']}.",
        "",
        f"`{v['replay']}`",
    ]
    return "\n".join(lines) + "\n"


def print_verdict(v: dict[str, Any], json_path: str | None) -> None:
    rows = [{"fault": kind, **row} for kind, row in v["faults"].items()]
    summary = {
        k: v[k]
        for k in (
            "requests_ok",
            "requests_failed",
            "unanswered",
            "wrong_tokens",
            "oracle_checked",
            "faults_injected",
            "max_error_window_s",
            "hit_rate",
        )
    }
    summary["requests_failed_by_code"] = v["requests_failed_by_code"]
    summary["leaked_pages"] = v["leaked_pages"]
    summary["leaked_rooms"] = v["leaked_rooms"]
    summary["leaked_states"] = v["leaked_states"]
    emit(
        f"chaos (seed {v['seed']}, {v['duration_s']:g}s)",
        rows,
        json_path=None,
        columns=FAULT_COLUMNS,
        extra=summary,
    )
    if json_path:
        Path(json_path).parent.mkdir(parents=True, exist_ok=True)
        Path(json_path).write_text(json.dumps(v, indent=2, default=str))
        Path(json_path).with_suffix(".md").write_text(markdown_verdict(v))
        print(f"wrote {json_path} and {Path(json_path).with_suffix('.md')}")


def run(args: argparse.Namespace) -> int:
    try:
        kinds = parse_fault_list(args.faults)
        soak = Soak(args, kinds)
    except ValueError as exc:  # unknown fault kinds, TopologyError
        print(f"pdcache chaos: {exc}", file=sys.stderr)
        return 2
    for kind, why in soak.unavailable.items():
        soak.say(f"{kind}: not on this machine/topology ({why}): skipped")
    try:
        outcome = soak.run()
    except LaunchError as exc:  # names the logs
        print(f"pdcache chaos: {exc}", file=sys.stderr)
        return 1
    except (RuntimeError, TimeoutError, OSError) as exc:
        print(f"pdcache chaos: {exc} (logs: {soak.state_dir})", file=sys.stderr)
        return 1
    v = verdict(outcome["results"], outcome["faults"], outcome["oracle"], outcome["accounting"])
    replay = replay_command(args, list(soak.faults))
    v.update(
        seed=args.seed,
        duration_s=args.duration,
        config=str(args.config),
        overrides=list(args.overrides),
        faults_unavailable=soak.unavailable,
        plan=outcome["plan"],
        fault_records=[f.as_json() for f in outcome["faults"]],
        replay=replay,
    )
    v["broken"] = broken_invariants(v)
    print_verdict(v, str(soak.out / "chaos.json"))
    if args.json_path:
        Path(args.json_path).write_text(json.dumps(v, indent=2, default=str))
    if v["broken"]:
        print("pdcache chaos: FAILED:\n  " + "\n  ".join(v["broken"]), file=sys.stderr)
        print(f"seed {args.seed}; replay with:\n  {replay}", file=sys.stderr)
        return 1
    print(f"all invariants hold (seed {args.seed}; rerun: {replay})")
    return 0
