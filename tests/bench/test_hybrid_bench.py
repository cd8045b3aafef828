"""`pdcache bench hybrid` on the tiny presets and a 2-session, 2-turn trace (a 64-token shared
system prompt, page size 4, prefill chunks of 48): one row per checkpoint policy for
tiny-qwen3-next and one for tiny-gpt-oss, in one run.

Session 2's first turn shares the 64-token system prompt with session 1: every_page restores
all of it (its hit is the dense theoretical one), chunk_ends the 48 before its first chunk's
end, hit_points (and gpt-oss's window tails) nothing (the branch point is checkpointed on the way, for the next session:
its hit is the hybrid theoretical one). Every second turn hits its answer's end under each.
The tokens are the same under every policy (the bench checks it)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from pdcache.bench import hybrid_bench
from pdcache.bench.cli import BENCHMARKS


def test_hybrid_bench_rows(tmp_path: Path) -> None:
    assert "hybrid" in BENCHMARKS
    parser = argparse.ArgumentParser()
    hybrid_bench.add_arguments(parser)
    out = tmp_path / "hybrid.json"
    args = parser.parse_args([
        "--presets", "tiny-qwen3-next,tiny-gpt-oss", "--sessions", "2", "--turns", "2",
        "--system", "64", "--user", "16", "--tool", "24", "--answer", "8",
        "--page-size", "4", "--chunk", "48", "--checkpoint-slots", "64"])
    args.json_path = str(out)
    assert hybrid_bench.run(args) == 0
    result = json.loads(out.read_text())
    rows = {(r["preset"], r["policy"]): r for r in result["rows"]}
    assert set(rows) == {("tiny-qwen3-next", p) for p in hybrid_bench.POLICIES.split(",")} | {
        ("tiny-gpt-oss", f) for f in hybrid_bench.WINDOW_FORMATS}
    ours, every, chunks = (rows[("tiny-qwen3-next", p)]
                           for p in ("hit_points", "every_page", "chunk_ends"))
    assert every["of_dense_theoretical"] == 1.0
    assert ours["of_hybrid_theoretical"] == 1.0
    assert ours["hit_rate"] < chunks["hit_rate"] < every["hit_rate"]
    # gpt-oss with window tails on its tiers: its hits are the hit points' as hit_points'
    # are (session 2 misses the shared system prompt's branch point, seen for the first
    # time); with every layer of every page stored, the dense theoretical hit, no tails
    oss = rows[("tiny-gpt-oss", "window_tails")]
    assert oss["of_hybrid_theoretical"] == 1.0 and oss["of_dense_theoretical"] < 1.0
    assert oss["storage_state_B_per_turn"] > 0
    one_space = rows[("tiny-gpt-oss", "one_space")]
    assert one_space["of_dense_theoretical"] == 1.0 and one_space["storage_state_B_per_turn"] == 0
    # the window-tail format stores the full layers' half of each page
    assert oss["storage_kv_B_per_turn"] * 2 == one_space["storage_kv_B_per_turn"]
    # every page's state is copied and stored: more state bytes than at hit points; the KV
    # pages written are the same under each policy
    assert every["device_state_B_per_turn"] > chunks["device_state_B_per_turn"]
    assert chunks["device_state_B_per_turn"] >= ours["device_state_B_per_turn"] > 0
    assert every["storage_state_B_per_turn"] > ours["storage_state_B_per_turn"] > 0
    assert len({r["storage_kv_B_per_turn"] for r in (ours, every, chunks)}) == 1
    assert ours["stored_B_total"] < every["stored_B_total"]
    assert all(r["checkpoints_lost"] == 0 for r in (ours, every, chunks))
    assert result["tiny-qwen3-next"]["state_bytes"] == 58368
