"""`pdcache bench pd` end to end on the tiny preset (real serve/prefill/decode processes):
the JSON has one row per prompt length with PD and unified TTFT and the PD path's GB/s."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

pytest.importorskip("mooncake.engine", reason="mooncake wheel not installed")


@pytest.mark.slow
def test_bench_pd_smoke(tmp_path) -> None:
    out = tmp_path / "pd.json"
    done = subprocess.run(
        [sys.executable, "-m", "pdcache", "bench", "pd", "--preset", "tiny", "--prompt-lens",
         "64,200", "--repeats", "1", "--warmup", "0", "--no-raw", "--json", str(out)],
        capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "PD vs unified" in done.stdout
    result = json.loads(out.read_text())
    rows = result["rows"]
    assert [r["prompt_tokens"] for r in rows] == [64, 200]
    for row in rows:
        assert row["unified_ttft_s"] > 0 and row["pd_ttft_s"] > 0
        assert row["pd_ttft_s"] >= row["pd_prefill_s"]  # decode answers after prefill's token
        assert row["pd_path_gbps"] > 0
    # the room moves every page of the prompt: 64 and 200 tokens, 8 KiB/token... for tiny
    # (4 layers x K,V x 2 heads x 32 dims x 4 bytes = 2 KiB/token, 16-token pages)
    assert rows[0]["kv_mib"] == pytest.approx(64 * 2048 / 2**20)
    assert rows[1]["kv_mib"] == pytest.approx(13 * 16 * 2048 / 2**20)
