"""End to end: `pdcache bench replay` against a real unified server on the `tiny` preset."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from pdcache.cli import main as pdcache_main

try:
    import pdcache.server.app  # noqa: F401
except ImportError as exc:  # a build without the server
    pytest.skip(f"pdcache.server.app is not importable yet: {exc}", allow_module_level=True)

pytestmark = pytest.mark.slow

PAGE = 16
SESSIONS, TURNS, SYSTEM, USER, TOOL, ANSWER = 3, 3, 64, 16, 32, 8
TRACE = (f"synthetic:sessions={SESSIONS},turns={TURNS},system_prompt={SYSTEM},user={USER},"
         f"tool_result={TOOL},answer={ANSWER},seed=1")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_healthy(url: str, proc: subprocess.Popen, log: Path, timeout_s: float = 120) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited ({proc.returncode}):\n{log.read_text()[-3000:]}")
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=2) as resp:
                if resp.status == 200:
                    return
        except OSError:
            time.sleep(0.3)
    raise TimeoutError(f"server not healthy in {timeout_s}s:\n{log.read_text()[-3000:]}")


@pytest.fixture(scope="module")
def server_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    port = _free_port()
    log = tmp_path_factory.mktemp("server") / "server.log"
    cmd = [sys.executable, "-m", "pdcache", "serve", "--model", "tiny", "--host", "127.0.0.1",
           "--port", str(port), "--log-level", "warning"]
    with log.open("w") as sink:
        proc = subprocess.Popen(cmd, stdout=sink, stderr=subprocess.STDOUT,
                                start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        _wait_healthy(url, proc, log)
        yield url
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(20)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(10)


def _replay(url: str, out: Path, *extra: str) -> tuple[int, dict, list[dict]]:
    code = pdcache_main(["bench", "replay", "--url", url, "--trace", TRACE, "--out", str(out),
                         "--concurrency", "2", "--page-size", str(PAGE), "--no-progress",
                         "--max-duration", "240", *extra])
    summary = json.loads((out / "summary.json").read_text())
    records = [json.loads(x) for x in (out / "requests.jsonl").read_text().splitlines()]
    return code, summary, records


def _check_run(code: int, summary: dict, records: list[dict]) -> None:
    n = SESSIONS * TURNS
    assert code == 0
    assert (summary["requests_total"], summary["requests_sent"]) == (n, n)
    assert (summary["requests_ok"], summary["requests_failed"]) == (n, 0), summary["errors"]
    assert summary["requests_skipped"] == 0
    expected_ids = {f"s{s}/{t}" for s in range(SESSIONS) for t in range(TURNS)}
    assert {r["request_id"] for r in records} == expected_ids and len(records) == n
    by_id = {r["request_id"]: r for r in records}
    for s in range(SESSIONS):
        turns = [by_id[f"s{s}/{t}"] for t in range(TURNS)]
        assert all(r["output_tokens"] == ANSWER for r in turns)  # ignore_eos: exact length
        # token-exact history: previous prompt + generated answer + the new tool result
        assert [r["prompt_tokens"] for r in turns] == [
            SYSTEM + USER + t * (ANSWER + TOOL) for t in range(TURNS)]
        for prev, cur in zip(turns, turns[1:]):
            # the server reuses (at least) the previous turn's prompt, one page of slack
            assert cur["cached_tokens"] >= PAGE * (prev["prompt_tokens"] // PAGE) - PAGE
    assert summary["hit_rate"] > 0
    assert 0 < summary["theoretical_hit_rate"] <= 1
    # the unified server's device cache holds every page of this small run (answers included)
    assert summary["hit_rate"] >= 0.9 * summary["theoretical_hit_rate"]
    turn_rates = {row["turn"]: row["hit_rate"] for row in summary["per_turn"]}
    assert turn_rates[1] > 0 and turn_rates[2] > 0
    assert summary["ttft_p50_s"] > 0 and summary["ttft_p99_s"] >= summary["ttft_p50_s"]


def test_streaming_replay_against_real_server(server_url: str, tmp_path: Path) -> None:
    code, summary, records = _replay(server_url, tmp_path / "stream", "--cache-salt", "run-a")
    _check_run(code, summary, records)
    assert summary["itl_p50_s"] is not None  # streamed: inter-token latencies measured
    assert all(len(r["itl_s"]) == ANSWER - 1 for r in records)
    assert (tmp_path / "stream" / "per_turn.png").is_file()


def test_non_streaming_replay_against_real_server(server_url: str, tmp_path: Path) -> None:
    code, summary, records = _replay(server_url, tmp_path / "plain", "--no-stream",
                                     "--cache-salt", "run-b", "--round-barrier", "--no-plots")
    _check_run(code, summary, records)
    # round barrier: every turn-k request was dispatched after every turn-(k-1) one finished
    by_turn = {t: [r for r in records if r["turn"] == t] for t in range(TURNS)}
    for t in range(1, TURNS):
        prev_done = max(r["dispatch_s"] + r["e2e_s"] for r in by_turn[t - 1])
        assert min(r["dispatch_s"] for r in by_turn[t]) >= prev_done - 0.05


MOONCAKE_REAL = Path(__file__).resolve().parents[2].parent / "shared/data/mooncake-fast25/synthetic_trace.jsonl"


@pytest.mark.skipif(not MOONCAKE_REAL.is_file(), reason="Mooncake FAST'25 trace not present")
def test_real_mooncake_rows_hit_exactly_the_theoretical_reuse(
    server_url: str, tmp_path: Path
) -> None:
    # The last 16 rows of the real trace share prefixes among themselves (~50% of tokens).
    # Each 512-token block is replayed as 16 tokens (sharing kept, 1/32 of the compute).
    # One request at a time, a fresh cache namespace and no answers in later prompts: a
    # prefix cache that holds every page must reuse exactly the theoretical amount.
    trace_file = tmp_path / "tail16.jsonl"
    trace_file.write_text("\n".join(MOONCAKE_REAL.read_text().splitlines()[-16:]) + "\n")
    out = tmp_path / "mooncake"
    code = pdcache_main(["bench", "replay", "--url", server_url, "--trace",
                         f"mooncake:{trace_file}", "--scale-block-size", "16", "--out", str(out),
                         "--concurrency", "1", "--page-size", str(PAGE), "--no-progress",
                         "--no-plots", "--cache-salt", "mooncake-tail", "--max-duration", "240"])
    summary = json.loads((out / "summary.json").read_text())
    records = [json.loads(x) for x in (out / "requests.jsonl").read_text().splitlines()]
    assert code == 0 and (summary["requests_ok"], summary["requests_failed"]) == (16, 0)
    assert summary["theoretical_hit_rate"] > 0.3
    assert [r["cached_tokens"] for r in records] == [
        r["theoretical_cached_tokens"] for r in records]
    assert summary["achieved_over_theoretical"] == pytest.approx(1.0)
