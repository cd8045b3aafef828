"""Replay hygiene: two `pdcache bench replay` runs against ONE running stack (a
router in front of a real `tiny` unified node, both in-process on 127.0.0.1 free ports).

- Default: each run gets its own session-id prefix, so the second run's prompts on the server
  equal the first run's (the router never continues the first run's sessions).
- Forced mismatch: the same `--session-prefix` twice makes the router prepend run 1's history
  to run 2's first turns; the replay notices (`meta.prompt_tokens` != what it sent), fails
  those requests as `prompt_mismatch`, counts them and exits non-zero naming the first.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from pdcache.cli import main as pdcache_main
from pdcache.router.app import create_app
from pdcache.router.config import RouterConfig
from pdcache.router.nodes import NodeEndpoint
from tests.router_support import PAGE, RouterUnderTest, UnifiedNode

pytestmark = pytest.mark.slow

SESSIONS, TURNS, SYSTEM, USER, TOOL, ANSWER = 2, 3, 32, 8, 16, 4
TRACE = (f"synthetic:sessions={SESSIONS},turns={TURNS},system_prompt={SYSTEM},user={USER},"
         f"tool_result={TOOL},answer={ANSWER},seed=3")
FIRST_TURNS = {f"s{s}/0" for s in range(SESSIONS)}


@pytest.fixture(scope="module")
def router_url() -> Iterator[str]:
    node = UnifiedNode("u0")
    config = RouterConfig(nodes=(NodeEndpoint("u0", "unified", node.url),), page_size=PAGE,
                          request_timeout_s=60, health_interval_s=30)
    try:
        with RouterUnderTest(create_app(config)) as client:
            yield str(client.base_url).rstrip("/")
    finally:
        node.stop()


def replay(url: str, out: Path, *extra: str) -> tuple[int, dict[str, Any], dict[str, dict]]:
    code = pdcache_main(["bench", "replay", "--url", url, "--trace", TRACE, "--out", str(out),
                         "--concurrency", "2", "--page-size", str(PAGE), "--no-progress",
                         "--no-plots", "--max-duration", "120", "--request-timeout", "60",
                         *extra])
    summary = json.loads((out / "summary.json").read_text())
    lines = (out / "requests.jsonl").read_text().splitlines()
    records = {r["request_id"]: r for r in map(json.loads, lines)}
    return code, summary, records


def test_two_runs_send_fresh_session_ids_and_the_server_sees_the_same_prompts(
    router_url: str, tmp_path: Path
) -> None:
    runs = [replay(router_url, tmp_path / f"run{i}") for i in range(2)]
    prefixes = [summary["session_prefix"] for _, summary, _ in runs]
    assert all(re.fullmatch(r"r[0-9a-f]{8}", p) for p in prefixes) and prefixes[0] != prefixes[1]
    for code, summary, records in runs:
        assert code == 0, summary["errors"]
        assert summary["requests_ok"] == SESSIONS * TURNS
        assert summary["requests_prompt_mismatch"] == 0
        assert all(r["server_prompt_tokens"] == r["prompt_tokens"] for r in records.values())
        assert {r["sent_session_id"] for r in records.values()} == {
            f"{summary['session_prefix']}-s{s}" for s in range(SESSIONS)}
    first, second = runs[0][2], runs[1][2]
    assert {k: r["server_prompt_tokens"] for k, r in second.items()} == {
        k: r["server_prompt_tokens"] for k, r in first.items()}


def test_a_reused_session_prefix_is_a_loud_prompt_mismatch(
    router_url: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    fixed = ("--session-prefix", "reused")
    code, summary, _ = replay(router_url, tmp_path / "first", *fixed)
    assert code == 0 and summary["requests_prompt_mismatch"] == 0, summary["errors"]
    capsys.readouterr()
    code, summary, records = replay(router_url, tmp_path / "second", *fixed)
    err = capsys.readouterr().err
    assert code != 0, "a prepended history must fail the run"
    # every session's first turn got run 1's history in front of it; later turns are skipped
    assert summary["requests_prompt_mismatch"] == SESSIONS
    assert summary["errors"] == {"prompt_mismatch": SESSIONS}
    assert summary["requests_ok"] == 0 and summary["skip_reasons"] == {
        "parent_failed": SESSIONS * (TURNS - 1)}
    assert set(records) == FIRST_TURNS
    for rec in records.values():
        assert not rec["ok"] and rec["error"].startswith("prompt_mismatch: ")
        assert rec["server_prompt_tokens"] > rec["prompt_tokens"] == SYSTEM + USER
    assert summary["first_prompt_mismatch"].split(":")[0] in FIRST_TURNS
    assert "FAILED" in err and summary["first_prompt_mismatch"] in err
