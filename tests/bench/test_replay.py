"""Replay scheduling and failure accounting (the real-server run: tests/bench/test_replay_e2e.py)."""

from __future__ import annotations

import asyncio
import json
import socket
from pathlib import Path

import numpy as np
import pytest

from pdcache.bench.replay_http import StreamErrorChunk, StreamState
from pdcache.bench.replay_run import PoissonGate, RoundBarrier
from pdcache.bench.traces import Blocks, Session, Turn
from pdcache.cli import main as pdcache_main


def _session(sid: str, turns: int) -> Session:
    return Session(sid, tuple(Turn(f"{sid}/{t}", sid, t, (Blocks((t,), 1),), 1)
                              for t in range(turns)))


def test_round_barrier_opens_a_round_when_the_previous_one_is_done() -> None:
    async def scenario() -> list[str]:
        barrier = RoundBarrier((_session("a", 3), _session("b", 1), _session("c", 2)))
        assert barrier.pending == [3, 2, 1]
        log: list[str] = []

        async def waiter(k: int) -> None:
            await barrier.wait(k)
            log.append(f"round{k}")

        tasks = [asyncio.create_task(waiter(k)) for k in (0, 1, 2)]
        await asyncio.sleep(0.01)
        assert log == ["round0"]
        for _ in range(2):
            barrier.finish(0)
        await asyncio.sleep(0.01)
        assert log == ["round0"], "one session has not finished round 0"
        barrier.finish(0)
        await asyncio.sleep(0.01)
        assert log == ["round0", "round1"]
        barrier.finish(1)
        barrier.finish(1)
        await asyncio.wait_for(asyncio.gather(*tasks), 5)
        return log

    assert asyncio.run(scenario()) == ["round0", "round1", "round2"]


def test_round_barrier_counts_the_turns_of_a_branching_trace() -> None:
    """A Bailian session branches: two turns of one depth. The barrier counted rounds by
    position and was finished by depth, so a round stayed pending for good."""
    def branching(sid: str, depths: list[int]) -> Session:
        return Session(sid, tuple(Turn(f"{sid}/{i}", sid, d, (Blocks((i,), 1),), 1)
                                  for i, d in enumerate(depths)))

    async def scenario() -> None:
        sessions = (branching("a", [0, 1, 1]), branching("b", [0, 1, 2, 3]))
        barrier = RoundBarrier(sessions)
        assert barrier.pending == [2, 3, 1, 1]
        for session in sessions:
            for turn in session.turns:
                barrier.finish(turn.turn)
        await asyncio.wait_for(barrier.wait(4), 5)  # every round opened

    asyncio.run(scenario())


def test_poisson_gate_releases_in_order_no_earlier_than_its_ticks() -> None:
    rate, n, seed = 400.0, 20, 3

    async def scenario() -> list[tuple[int, float]]:
        gate = PoissonGate(rate, seed)
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        released: list[tuple[int, float]] = []

        async def one(i: int) -> None:
            await gate.wait()
            released.append((i, loop.time() - t0))

        await asyncio.wait_for(asyncio.gather(*(one(i) for i in range(n))), 10)
        return released

    released = asyncio.run(scenario())
    assert [i for i, _ in released] == list(range(n)), "FIFO"
    gaps = np.random.default_rng(seed).exponential(1.0 / rate, n)
    ticks = np.concatenate([[0.0], np.cumsum(gaps)[:-1]])
    slack = 2e-3  # event-loop clock granularity
    assert all(t >= tick - slack for (_, t), tick in zip(released, ticks))


def test_stream_state_measures_first_token_and_spreads_chunk_gaps() -> None:
    state = StreamState(start=10.0)
    state.on_chunk({"output_ids": [5, 6]}, now=10.5)
    state.on_chunk({"output_ids": []}, now=10.6)
    state.on_chunk({"output_ids": [7, 8]}, now=11.5)
    state.on_chunk({"output_ids": [9], "meta_info": {"completion_tokens": 5}}, now=11.75)
    assert state.output_ids == [5, 6, 7, 8, 9]
    assert state.first_token_at == 10.5
    assert state.itl_s == [0.0, 0.5, 0.5, 0.25]
    assert state.meta == {"completion_tokens": 5}
    with pytest.raises(StreamErrorChunk, match="engine overloaded"):
        state.on_chunk({"error": {"message": "engine overloaded", "type": "server_error"}}, 12.0)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _replay(tmp_path: Path, trace: str, *extra: str) -> tuple[int, dict, list[dict]]:
    # nothing listens on this port: every request fails to connect, for real
    url = f"http://127.0.0.1:{_free_port()}"
    out = tmp_path / "out"
    code = pdcache_main(["bench", "replay", "--url", url, "--trace", trace, "--out", str(out),
                         "--no-plots", "--no-progress", "--request-timeout", "10", *extra])
    summary = json.loads((out / "summary.json").read_text())
    lines = (out / "requests.jsonl").read_text().splitlines()
    return code, summary, [json.loads(line) for line in lines]


def test_failures_are_counted_and_dependent_turns_skipped(tmp_path: Path) -> None:
    code, summary, records = _replay(
        tmp_path, "synthetic:sessions=3,turns=3,system_prompt=32,user=8,tool_result=8,answer=4")
    assert code == 1, "no request succeeded"
    assert (summary["requests_total"], summary["requests_sent"]) == (9, 3)
    assert (summary["requests_ok"], summary["requests_failed"]) == (0, 3)
    assert summary["requests_skipped"] == 6
    assert summary["skip_reasons"] == {"parent_failed": 6}
    assert summary["errors"] == {"ConnectError": 3}
    assert sorted(r["request_id"] for r in records) == ["s0/0", "s1/0", "s2/0"]
    assert all(not r["ok"] and r["prompt_tokens"] == 40 for r in records)


def test_run_time_is_bounded_by_max_duration(tmp_path: Path) -> None:
    code, summary, records = _replay(
        tmp_path, "synthetic:sessions=4,turns=2,system_prompt=16,stagger=600",
        "--mode", "trace", "--max-duration", "0.5", "--drain-timeout", "1")
    assert summary["duration_s"] < 30, "sessions 1-3 start at 600 s and must not be waited for"
    assert summary["requests_sent"] == 1 and summary["requests_failed"] == 1
    assert summary["skip_reasons"] == {"parent_failed": 1, "max_duration": 6}


def test_context_cap_stops_sessions_before_sending(tmp_path: Path) -> None:
    code, summary, records = _replay(
        tmp_path, "synthetic:sessions=2,turns=3,system_prompt=64,user=8,answer=8",
        "--max-tokens-cap", "64")
    assert code == 1 and records == []  # nothing measured is a failed run (it exited 0)
    assert summary["requests_sent"] == 0
    assert summary["skip_reasons"] == {"max_tokens_cap": 6}


def test_the_client_s_own_queueing_is_recorded(tmp_path: Path) -> None:
    """Open-loop modes: a turn due while --concurrency is full waits in the client, and its
    TTFT and e2e (timed from dispatch) leave that wait out; `queued_s` records it (and the
    summary's client_queue percentiles), so a run that measured its own queue says so."""
    from tests.router_support import RawServer

    server = RawServer("hang")  # every request takes its whole 0.5 s timeout
    try:
        out = tmp_path / "out"
        pdcache_main(["bench", "replay", "--url", server.url, "--trace",
                      "synthetic:sessions=3,turns=1,system_prompt=16,user=8", "--mode",
                      "trace", "--concurrency", "1", "--request-timeout", "0.5", "--out",
                      str(out), "--no-plots", "--no-progress"])
        records = [json.loads(line) for line in (out / "requests.jsonl").read_text().splitlines()]
    finally:
        server.stop()
    queued = sorted(r["queued_s"] for r in records)
    assert queued[0] < 0.3 and queued[1] >= 0.45 and queued[2] >= 0.95, queued


def test_a_negative_rate_is_a_bad_setting(tmp_path: Path) -> None:
    """--rate -1 crashed every session task (numpy: scale < 0) and exited 0."""
    code = pdcache_main(["bench", "replay", "--url", "http://127.0.0.1:1", "--trace",
                         "synthetic:sessions=1,turns=1", "--rate", "-1", "--out",
                         str(tmp_path), "--no-progress"])
    assert code == 2


def test_bad_trace_spec_exits_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code = pdcache_main(["bench", "replay", "--url", "http://127.0.0.1:1", "--trace",
                         "synthetic:nope=1", "--out", str(tmp_path)])
    assert code == 2
    assert "bad item 'nope=1'" in capsys.readouterr().err
