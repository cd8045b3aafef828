"""`pdcache demo`: start a local stack, replay a multi-turn trace against it, print a summary.

The stack is started by the launcher from a topology file (default: the local 1 prefill +
1 decode topology); `--unified` starts a single unified server instead. Everything started
is stopped on exit, whatever happens.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

DEFAULT_TRACE = (
    "synthetic:sessions=4,turns=4,system_prompt=1024,tool_result=96,answer=64,think_time=0,seed=0"
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="small", help="preset or checkpoint path")
    parser.add_argument("--trace", default=DEFAULT_TRACE, help="trace spec for bench replay")
    parser.add_argument("--out", default=".pdcache/demo", help="replay output directory")
    parser.add_argument("--concurrency", type=int, default=2)
    parser.add_argument("--port", type=int, default=0, help="server port (0: a free one)")
    parser.add_argument("--startup-timeout", type=float, default=300.0)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_healthy(url: str, proc: subprocess.Popen, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with code {proc.returncode} before becoming healthy")
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=2) as resp:
                if resp.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.5)
    raise TimeoutError(f"server at {url} not healthy after {timeout_s:.0f}s")


def start_unified(args: argparse.Namespace, log_path: Path) -> tuple[subprocess.Popen, str]:
    port = args.port or free_port()
    cmd = [sys.executable, "-m", "pdcache", "serve", "--model", args.model,
           "--host", "127.0.0.1", "--port", str(port)]
    log_path.parent.mkdir(parents=True, exist_ok=True)
    log = open(log_path, "w")  # noqa: SIM115 - closed with the process
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    return proc, f"http://127.0.0.1:{port}"


def stop(proc: subprocess.Popen) -> None:
    if proc.poll() is not None:
        return
    os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(15)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(5)


def print_turns(out_dir: Path) -> None:
    rows = [json.loads(line) for line in (out_dir / "requests.jsonl").read_text().splitlines()]
    print("\nper request: session turn prompt cached computed ttft_s")
    for r in rows:
        print(f"  {r.get('session_id')!s:>8} {r.get('turn')!s:>4} {r.get('prompt_tokens')!s:>6} "
              f"{r.get('cached_tokens')!s:>6} {r.get('computed_tokens')!s:>8} "
              f"{r.get('ttft_s', 0) or 0:.3f}")


def run(args: argparse.Namespace) -> int:
    out_dir = Path(args.out)
    proc, url = start_unified(args, out_dir / "server.log")
    try:
        print(f"[demo] starting unified server ({args.model}) at {url} ...", flush=True)
        wait_healthy(url, proc, args.startup_timeout)
        print(f"[demo] healthy; replaying {args.trace}", flush=True)
        replay = [sys.executable, "-m", "pdcache", "bench", "replay", "--url", url,
                  "--trace", args.trace, "--out", str(out_dir),
                  "--concurrency", str(args.concurrency)]
        code = subprocess.call(replay)
        if code == 0:
            print_turns(out_dir)
        return code
    finally:
        stop(proc)
