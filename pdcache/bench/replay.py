"""`pdcache bench replay`: replay a multi-turn trace against a running stack over HTTP.

Every request goes to `POST {url}/generate` with token ids (docs/design.md §4.1). Turns that carry
history send the session's previous prompt + the ids the server actually generated + the new
tokens, so the server sees exactly what a real conversation would send it; `session_id` is
sent too for the router's affinity. Outputs are forced to the trace's length (`ignore_eos`).

Modes: `afap` (as fast as possible under `--concurrency`; think times ignored), `poisson`
(requests released at Poisson times of rate `--rate`, think times honoured), `poisson-sessions`
(sessions start as a Poisson process of rate `--rate` / mean turns per session, so `--rate` is
the offered request rate; each next turn is sent its think time after the previous turn
completed, not gated again: the open-loop multi-turn load of `bench goodput`), `trace` (trace
timestamps honoured). `--speedup` divides timestamps and think times. `--round-barrier` releases turn k of every
session only once turn k-1 of every session has finished. The run is bounded by
`--max-duration` (then in-flight requests get `--drain-timeout` before being cancelled), or
ends at once after `--stop-after-slow N` requests had a TTFT over `--slow-ttft` (in-flight
requests cancelled, `stopped_early` in the summary: `bench goodput` settling a point);
failures are recorded and counted, never fatal. Writes `DIR/requests.jsonl` as requests
complete, then `DIR/summary.json`, a table and plots (`pdcache.bench.report`).

Hygiene: the `session_id`s sent are `RUN-SID` with a fresh run id `r<8 hex>` per run (or
`--session-prefix`), so a second run against the same router never continues the first run's
sessions. Every answer's `meta.prompt_tokens` must equal the prompt length the replay sent: a
mismatch (the server prepended another history) fails that request (`prompt_mismatch`), is
counted in the summary, and makes the command exit 1 naming the first one.

This module is the command and the call every launching bench uses: its options (shared with
`bench compare`, `bench goodput` and `pdcache demo`), the trace preparation, `replay` (typed
settings in, `ReplayResult` out: the records and the summary; it runs the replay on a fresh
event loop and writes the files) and `run`, the command, which prints the report. The parts: `replay_config` (`ReplayConfig`), `replay_run`
(`Replayer`, the run loop), `replay_http` (one request over HTTP), `replay_records`
(`RequestRecord`, the prompt check).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO

from pdcache.bench.replay_config import MODES, ReplayConfig
from pdcache.bench.replay_records import RequestRecord
from pdcache.bench.replay_run import Replayer
from pdcache.bench.tokens import BlockExpander
from pdcache.bench.traces import Trace, limit_requests, load_trace, rescale_blocks


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--url", required=True, help="base URL of the stack (router or server)")
    parser.add_argument("--out", required=True, help="output directory")
    add_replay_options(parser)


def add_replay_options(parser: argparse.ArgumentParser) -> None:
    """Every replay option but the target (--url) and --out: shared with `bench compare`."""
    parser.add_argument("--trace", required=True,
                        help="FORMAT:PATH (mooncake, bailian, sharegpt, sessions) or "
                             "synthetic:key=value,... (see pdcache.bench.traces.SyntheticSpec)")
    parser.add_argument("--mode", choices=MODES, default=None,
                        help="default: poisson with --rate, else afap")
    parser.add_argument("--concurrency", type=int, default=4, help="max requests in flight")
    parser.add_argument("--rate", type=float, default=None, help="poisson, poisson-sessions: offered requests per second")
    parser.add_argument("--speedup", type=float, default=1.0, help="trace: time compression")
    parser.add_argument("--round-barrier", action="store_true",
                        help="turn k of every session waits for turn k-1 of all sessions")
    parser.add_argument("--max-requests", type=int, default=None,
                        help="keep the first N requests (whole sessions in start order)")
    parser.add_argument("--max-duration", type=float, default=1800.0,
                        help="stop dispatching after S seconds")
    parser.add_argument("--drain-timeout", type=float, default=60.0,
                        help="after --max-duration, wait this long for in-flight requests")
    parser.add_argument("--request-timeout", type=float, default=600.0)
    parser.add_argument("--page-size", type=int, default=16,
                        help="page size of the theoretical reuse computation")
    parser.add_argument("--max-tokens-cap", type=int, default=None,
                        help="cap prompt + output tokens per request (the model's context): "
                             "independent prompts are cut at the end, a session stops at the "
                             "turn that would exceed it (counted as skipped)")
    parser.add_argument("--vocab-size", type=int, default=256,
                        help="token ids are drawn from [--vocab-low, --vocab-size)")
    parser.add_argument("--vocab-low", type=int, default=0)
    parser.add_argument("--token-seed", type=int, default=0, help="seed of block expansion")
    parser.add_argument("--block-size", type=int, default=None,
                        help="block size of the trace's ids (default: the format's)")
    parser.add_argument("--scale-block-size", type=int, default=None,
                        help="replay each block id as this many tokens (shrinks real traces)")
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--no-stream", dest="stream", action="store_false",
                        help="non-streaming requests (no ITL; TTFT from the server's meta)")
    parser.add_argument("--no-session-id", dest="session_id", action="store_false",
                        help="do not send session_id")
    parser.add_argument("--session-prefix", default=None, metavar="PREFIX",
                        help="session ids sent are PREFIX-SID (default: a fresh run id "
                             "r<8 hex> per run, so runs never share router sessions; '' sends "
                             "the trace's ids as they are)")
    parser.add_argument("--cache-salt", default=None,
                        help="send this cache_salt (a fresh one isolates the run from pages "
                             "earlier runs left in the stack's caches)")
    parser.add_argument("--seed", type=int, default=0, help="poisson arrivals seed")
    parser.add_argument("--stop-after-slow", type=int, default=None, metavar="N",
                        help="stop the run once N requests had a TTFT over --slow-ttft "
                             "(in-flight requests are cancelled, the rest not sent)")
    parser.add_argument("--slow-ttft", type=float, default=None, metavar="S",
                        help="seconds: the TTFT that --stop-after-slow counts")
    parser.add_argument("--no-plots", dest="plots", action="store_false")
    parser.add_argument("--no-progress", dest="progress", action="store_false")


def prepare_trace(config: ReplayConfig) -> Trace:
    """The trace `config` names, rescaled and cut as it says."""
    trace = load_trace(config.trace, block_size=config.block_size)
    if config.scale_block_size:
        trace = rescale_blocks(trace, config.scale_block_size)
    if config.max_requests is not None:
        trace = limit_requests(trace, config.max_requests)
    return trace


@dataclass(frozen=True)
class ReplayResult:
    """What one replay left: every request's record (also in `out_dir/requests.jsonl`) and
    the summary (also in `out_dir/summary.json`)."""

    out_dir: Path
    records: list[RequestRecord]
    summary: dict[str, Any]

    @property
    def failure(self) -> str | None:
        """Why the replay failed as a whole (the command exits 1), or None."""
        s = self.summary
        if s["requests_prompt_mismatch"]:
            return (f"{s['requests_prompt_mismatch']} answer(s) saw another prompt than the one "
                    f"sent; first: {s['first_prompt_mismatch']}")
        if s["requests_ok"] == 0 and s["requests_sent"] > 0:
            return "no request succeeded"
        if s.get("replayer_errors"):  # a session task raised: its turns were never played
            return f"{s['replayer_errors']} session task(s) failed (see the log above)"
        if s["requests_sent"] == 0 and s["requests_total"] > 0:
            reasons = s.get("skip_reasons") or {}
            return f"no request was sent: every one was skipped ({reasons})"
        return None


def replay(config: ReplayConfig, out_dir: Path) -> ReplayResult:
    """Replay `config.trace` against `config.url` on a fresh event loop (`asyncio.run`, so
    call it from a thread without a running loop), writing `out_dir/requests.jsonl` as
    requests complete, then `summary.json` (and plots with `config.plots`). Prints nothing
    (`print_report` does). ValueError names a bad setting or trace."""
    from pdcache.bench import report

    cfg = config.resolved()
    trace = prepare_trace(cfg)
    out_dir.mkdir(parents=True, exist_ok=True)
    expander = BlockExpander(trace.block_size, vocab_high=cfg.vocab_size,
                             vocab_low=cfg.vocab_low, seed=cfg.token_seed)
    with (out_dir / "requests.jsonl").open("w") as sink:
        replayer = Replayer(cfg, trace, expander, sink)
        run_info = asyncio.run(replayer.run())
    run_info.update(trace=cfg.trace, trace_name=trace.name, block_size=trace.block_size,
                    sessions=len(trace.sessions), config=cfg.run_settings())
    summary = report.write_summary(out_dir, run_info, plots=cfg.plots)
    return ReplayResult(out_dir, replayer.records, summary)


def print_report(result: ReplayResult, out: TextIO | None = None) -> None:
    """The replay's tables and where its summary is, on `out` (stdout at call time)."""
    from pdcache.bench import report

    out = out or sys.stdout
    report.print_tables(result.summary, out=out)
    print(f"wrote {result.out_dir / 'summary.json'}", file=out)


def run(args: argparse.Namespace) -> int:
    try:
        result = replay(ReplayConfig.from_args(args), Path(args.out))
    except ValueError as exc:
        print(f"pdcache bench replay: {exc}", file=sys.stderr)
        return 2
    json_path = getattr(args, "json_path", None)
    if json_path:
        Path(json_path).parent.mkdir(parents=True, exist_ok=True)
        Path(json_path).write_text(json.dumps(result.summary, indent=2, default=str))
    print_report(result)
    if result.summary["requests_prompt_mismatch"]:
        print(f"pdcache bench replay: FAILED: {result.failure}", file=sys.stderr)
    return 1 if result.failure else 0
