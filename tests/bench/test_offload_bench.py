"""`pdcache bench offload` end to end on the tiny preset: offload on vs off in one run; with
offload the next turn reuses the answer (from decode's pages), without it recomputes it."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

pytest.importorskip("mooncake.engine", reason="mooncake wheel not installed")


@pytest.mark.slow
def test_bench_offload_smoke(tmp_path) -> None:
    out = tmp_path / "offload.json"
    done = subprocess.run(
        [sys.executable, "-m", "pdcache", "bench", "offload", "--preset", "tiny",
         "--answer-lens", "64", "--prompt-len", "64", "--message-len", "16", "--repeats", "1",
         "--prefetch-policy", "wait_complete", "--storage-dir", str(tmp_path),
         "--json", str(out)],
        capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    result = json.loads(out.read_text())
    (row,) = result["rows"]
    assert row["answer_tokens"] == 64
    assert row["itl_on_ms"] > 0 and row["itl_off_ms"] > 0
    # turn 2 = 64 prompt + 64 answer + 16 new: with offload, the answer's full pages are
    # reused (16-token pages; the last answer token has no KV); without, only the prompt
    assert row["next_cached_on"] >= 112 and row["next_from_decode_on"] >= 48
    assert row["next_cached_off"] <= 64
    assert result["pages_offloaded"] >= 4 and result["pages_dropped"] == 0
    assert row["cpu_ms_per_token_on"] > 0 and row["cpu_ms_per_token_off"] > 0
    assert result["manager_pages"] == 256 and result["manager_cpu_ms_per_page"] > 0
