"""`pdcache bench compare CONFIG...`: the same trace replayed on several topologies, side by side.

For each CONFIG in turn: start it with `pdcache launch` (its own process group, its own logs),
wait until every HTTP endpoint of the topology answers `/health`, replay the trace against the
front door (the router, or the first node without one), stop the launcher (SIGTERM: it tears
its processes down), and keep the replay summary. Then one table with every config and its
ratios to the first one, `DIR/compare.json` and `DIR/compare.png`.

CONFIG is `[LABEL=]PATH[+KEY=VALUE...]`: a topology file, an optional label (default: the
file's stem) and `--set` overrides for this config only; `--set` on the command line applies
to every config. Each replay sends its own fresh `cache_salt`, so pages that a previous config
(or an earlier run) left in shared storage never count as hits.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pdcache.bench import replay
from pdcache.bench.table import emit

COLUMNS = ("config", "ok", "failed", "hit_rate", "theoretical", "achieved/theo", "ttft_p50_s",
           "ttft_p99_s", "itl_p50_s", "e2e_p50_s", "out_tok/s", "kv_MB/req", "decode_had",
           "ttft_p50_x", "out_tok/s_x")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("configs", nargs="+", metavar="CONFIG",
                        help="[LABEL=]PATH[+KEY=VALUE...] topology file to launch; the first one "
                             "is the baseline of the ratios")
    parser.add_argument("--out", required=True, help="output directory (one folder per config)")
    add_launch_options(parser)
    replay.add_replay_options(parser)


def add_launch_options(parser: argparse.ArgumentParser, startup_timeout_s: float = 600.0,
                       set_help: str = "override for every config (repeatable)") -> None:
    """The options of every bench that launches topologies (`launched`): `--set` overrides
    (args.overrides), `--startup-timeout`, `--stop-timeout`."""
    parser.add_argument("--set", dest="overrides", action="append", default=[],
                        metavar="KEY=VALUE", help=set_help)
    parser.add_argument("--startup-timeout", type=float, default=startup_timeout_s,
                        help="seconds for a topology to become healthy")
    parser.add_argument("--stop-timeout", type=float, default=60.0,
                        help="seconds for the launcher to stop the topology")


@dataclass(frozen=True)
class ConfigRun:
    label: str
    path: Path
    overrides: tuple[str, ...]


def parse_config_arg(text: str, common: list[str]) -> ConfigRun:
    head, *own = text.split("+")
    label, sep, path = head.partition("=")
    if not sep:
        label, path = Path(head).stem, head
    return ConfigRun(label, Path(path), (*common, *own))


def endpoints_of(run: ConfigRun) -> tuple[str, list[str]]:
    """(front door URL, every HTTP endpoint URL) of the topology."""
    from pdcache.config import load_topology

    topology = load_topology(run.path, run.overrides)
    urls = [n.url for n in topology.nodes if n.health == "http"]
    front = topology.router.url if topology.router is not None else topology.nodes[0].url
    return front, sorted({*urls, front})


def port_in_use(url: str) -> bool:
    host, port = url.removeprefix("http://").rsplit(":", 1)
    with socket.socket() as s:
        s.settimeout(1.0)
        return s.connect_ex((host, int(port))) == 0


def kv_transfer_totals(urls: list[str]) -> dict[str, int]:
    """What the prefill nodes' KV senders sent (bytes, pages) and left out because the decode
    node's prefix cache held them (pages), from their `/health` (no credential needed)."""
    totals = {"kv_bytes_sent": 0, "kv_pages_sent": 0, "kv_pages_decode_had": 0}
    for url in urls:
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=10) as resp:
                health = json.loads(resp.read())
        except (OSError, ValueError):
            continue
        if health.get("role") != "prefill":
            continue
        transfer = health.get("transfer") or {}
        totals["kv_bytes_sent"] += int(transfer.get("bytes_sent", 0))
        totals["kv_pages_sent"] += int(transfer.get("pages_sent", 0))
        totals["kv_pages_decode_had"] += int(transfer.get("pages_decode_had", 0))
    return totals


def healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(f"{url}/health", timeout=2) as resp:
            return resp.status == 200
    except OSError:
        return False


def start_launcher(run: ConfigRun, run_dir: Path, restart: bool = False) -> subprocess.Popen:
    """`pdcache launch` of `run` (logs and processes.json in RUN_DIR/logs). Without `restart` a
    process that dies stops the stack (a benchmark must not measure a restart); `bench chaos`
    kills processes on purpose and wants them back."""
    cmd = [sys.executable, "-m", "pdcache", "launch", str(run.path),
           *([] if restart else ["--no-restart"]), "--log-dir", str(run_dir / "logs")]
    for item in run.overrides:
        cmd += ["--set", item]
    env = {**os.environ}
    env.setdefault("MC_TCP_BIND_ADDRESS", "127.0.0.1")
    env.setdefault("MC_LOG_LEVEL", "ERROR")
    run_dir.mkdir(parents=True, exist_ok=True)
    with (run_dir / "launch.log").open("w") as log:
        return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env,
                                start_new_session=True)


def wait_ready(proc: subprocess.Popen, urls: list[str], timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"launcher exited with {proc.returncode} before the stack was up")
        if all(healthy(u) for u in urls):
            return
        time.sleep(0.5)
    raise TimeoutError(f"not healthy after {timeout_s:.0f}s: {', '.join(urls)}")


def stop_launcher(proc: subprocess.Popen, timeout_s: float) -> None:
    """SIGTERM lets the launcher stop its own process groups; SIGKILL if it does not exit."""
    if proc.poll() is not None:
        return
    os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(10)


def replay_args(args: argparse.Namespace, url: str, out: Path, label: str) -> argparse.Namespace:
    values = {**vars(args), "url": url, "out": str(out), "json_path": None}
    if values.get("cache_salt") is None:
        values["cache_salt"] = f"compare-{label}-{uuid.uuid4().hex[:12]}"
    return argparse.Namespace(**values)


class LaunchError(Exception):
    """A topology could not be started (bad file, ports taken, not healthy in time)."""


@contextlib.contextmanager
def launched(args: argparse.Namespace, run: ConfigRun, run_dir: Path) -> Iterator[str]:
    """Start `run`'s topology (`pdcache launch`, logs under `run_dir`), wait until every HTTP
    endpoint is healthy, yield the front door URL, and stop it on exit. LaunchError names the
    problem (and the logs) when it cannot start. Shared with `bench goodput`."""
    try:
        front, urls = endpoints_of(run)
    except ValueError as exc:  # TopologyError names file, key and problem
        raise LaunchError(str(exc)) from exc
    busy = [u for u in urls if port_in_use(u)]
    if busy:
        raise LaunchError(f"already in use before launch (another stack?): {', '.join(busy)}")
    proc = start_launcher(run, run_dir)
    try:
        print(f"[compare] {run.label}: starting {run.path} ...", file=sys.stderr, flush=True)
        try:
            wait_ready(proc, urls, args.startup_timeout)
        except (RuntimeError, TimeoutError, OSError) as exc:
            raise LaunchError(f"{exc} (logs: {run_dir / 'logs'})") from exc
        yield front
    finally:
        stop_launcher(proc, args.stop_timeout)


def run_one(args: argparse.Namespace, run: ConfigRun, out: Path) -> dict[str, Any]:
    """Launch, replay, tear down; the summary, or {"error": ...} when the config failed."""
    run_dir = out / run.label
    try:
        with launched(args, run, run_dir) as front:
            summary_path = run_dir / "summary.json"
            summary_path.unlink(missing_ok=True)  # never report a previous run's numbers
            code = replay.run(replay_args(args, front, run_dir, run.label))
            if not summary_path.is_file():
                return {"error": f"replay exited {code} without a summary"}
            summary = {**json.loads(summary_path.read_text()),
                       **kv_transfer_totals(endpoints_of(run)[1])}
            return summary if code == 0 else {**summary, "error": f"replay exited {code}"}
    except LaunchError as exc:
        return {"error": str(exc)}
    except OSError as exc:
        return {"error": f"{exc} (logs: {run_dir / 'logs'})"}


def _share(had: int | None, sent: int | None) -> float | None:
    """The share of the prompt pages that decode's prefix cache held (not sent)."""
    total = (had or 0) + (sent or 0)
    return had / total if had is not None and total else None


def _ratio(value: float | None, base: float | None) -> float | None:
    return value / base if value is not None and base else None


def compare_rows(results: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    base = next(iter(results.values()))
    rows = []
    for label, s in results.items():
        rows.append({
            "config": label, "ok": s.get("requests_ok"), "failed": s.get("requests_failed"),
            "hit_rate": s.get("hit_rate"), "theoretical": s.get("theoretical_hit_rate"),
            "achieved/theo": s.get("achieved_over_theoretical"),
            "ttft_p50_s": s.get("ttft_p50_s"), "ttft_p99_s": s.get("ttft_p99_s"),
            "itl_p50_s": s.get("itl_p50_s"), "e2e_p50_s": s.get("e2e_p50_s"),
            "out_tok/s": s.get("output_token_throughput"),
            "kv_MB/req": (s["kv_bytes_sent"] / 1e6 / s["requests_ok"]
                          if s.get("requests_ok") and "kv_bytes_sent" in s else None),
            "decode_had": _share(s.get("kv_pages_decode_had"), s.get("kv_pages_sent")),
            "ttft_p50_x": _ratio(s.get("ttft_p50_s"), base.get("ttft_p50_s")),
            "out_tok/s_x": _ratio(s.get("output_token_throughput"),
                                  base.get("output_token_throughput")),
            "error": s.get("error", ""),
        })
    return rows


def plot(out: Path, results: dict[str, dict[str, Any]]) -> str | None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    fig, (ax_turn, ax_hit) = plt.subplots(1, 2, figsize=(11, 4))
    for label, s in results.items():
        turns = s.get("per_turn") or []
        ax_turn.plot([r["turn"] for r in turns], [r["ttft_p50_s"] or 0.0 for r in turns],
                     marker="o", label=label)
    turn_ids = sorted({r["turn"] for s in results.values() for r in s.get("per_turn") or []})
    ax_turn.set(xlabel="turn", ylabel="TTFT p50 (s)", title="TTFT per turn", xticks=turn_ids)
    ax_turn.legend(fontsize=8)
    labels = list(results)
    xs = range(len(labels))
    ax_hit.bar(xs, [results[c].get("hit_rate") or 0.0 for c in labels], label="achieved")
    ax_hit.plot(xs, [results[c].get("theoretical_hit_rate") or 0.0 for c in labels], "k_",
                markersize=30, label="theoretical")
    ax_hit.set(xticks=list(xs), xticklabels=labels, ylim=(0, 1.05), ylabel="cache hit rate",
               title="Hit rate")
    ax_hit.legend(fontsize=8)
    fig.tight_layout()
    path = out / "compare.png"
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return str(path)


def run(args: argparse.Namespace) -> int:
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    runs = [parse_config_arg(c, args.overrides) for c in args.configs]
    if len({r.label for r in runs}) != len(runs):
        print("pdcache bench compare: config labels must be unique (use LABEL=PATH)",
              file=sys.stderr)
        return 2
    results = {r.label: run_one(args, r, out) for r in runs}
    rows = compare_rows(results)
    picture = plot(out, results)
    payload = {"trace": args.trace, "configs": {r.label: {"path": str(r.path),
                                                          "overrides": list(r.overrides)}
                                                for r in runs},
               "rows": rows, "plot": picture, "summaries": results}
    (out / "compare.json").write_text(json.dumps(payload, indent=2, default=str))
    emit(f"compare on {args.trace} (ratios x: to {runs[0].label})", rows, columns=COLUMNS,
         json_path=args.json_path, out=sys.stdout)
    for row in rows:
        if row["error"]:
            print(f"{row['config']}: {row['error']}")
    return 0 if all(not row["error"] for row in rows) else 1
