"""`pdcache bench compare`: two real topologies launched in turn, one side-by-side table."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

from pdcache.bench.compare import compare_rows
from pdcache.bench.stack import parse_config_arg, port_in_use
from pdcache.cli import main as pdcache_main
from tests.net_support import free_ports, unified_topology

NEEDED = ("pdcache.server.app", "pdcache.launch.launcher")
pytestmark = pytest.mark.slow


def test_config_args_and_ratio_rows() -> None:
    run = parse_config_arg("pd=configs/local-1p1d.toml+node.d0.offload=false",
                           ["model.preset=tiny"])
    assert (run.label, run.path) == ("pd", Path("configs/local-1p1d.toml"))
    assert run.overrides == ("model.preset=tiny", "node.d0.offload=false")
    assert parse_config_arg("configs/unified.toml", []).label == "unified"
    rows = compare_rows({
        "base": {"ttft_p50_s": 2.0, "output_token_throughput": 10.0, "hit_rate": 0.0},
        "fast": {"ttft_p50_s": 0.5, "output_token_throughput": 30.0, "hit_rate": 0.8},
        "broken": {"error": "not healthy"},
    })
    assert [r["ttft_p50_x"] for r in rows] == [1.0, 0.25, None]
    assert [r["out_tok/s_x"] for r in rows] == [1.0, 3.0, None]
    assert rows[2]["error"] == "not healthy"


@pytest.mark.skipif(any(importlib.util.find_spec(m) is None for m in NEEDED),
                    reason="needs pdcache.server.app and pdcache.launch.launcher")
def test_compare_launches_each_config_and_tears_it_down(tmp_path: Path) -> None:
    port = free_ports(1)[0]  # both configs use the same port: the first must be gone for the second
    nocache = unified_topology(tmp_path, "nocache", port, "--no-prefix-cache")
    cached = unified_topology(tmp_path, "cached", port)
    out = tmp_path / "out"
    trace = "synthetic:sessions=2,turns=3,system_prompt=48,user=16,tool_result=16,answer=4"
    code = pdcache_main(["bench", "compare", f"nocache={nocache}", f"cached={cached}",
                         "--trace", trace, "--out", str(out), "--concurrency", "2",
                         "--no-progress", "--startup-timeout", "120", "--max-duration", "120"])
    result = json.loads((out / "compare.json").read_text())
    assert code == 0, [r["error"] for r in result["rows"]]
    rows = {r["config"]: r for r in result["rows"]}
    assert list(rows) == ["nocache", "cached"]
    assert all((r["ok"], r["failed"], r["error"]) == (6, 0, "") for r in rows.values())
    assert rows["nocache"]["hit_rate"] == 0.0
    assert rows["cached"]["hit_rate"] > 0.3
    # the same trace, so the same theoretical reuse (prompt lengths are identical: ignore_eos)
    assert rows["nocache"]["theoretical"] == pytest.approx(rows["cached"]["theoretical"])
    assert rows["nocache"]["ttft_p50_x"] == 1.0
    assert (out / "compare.png").is_file() and (out / "cached" / "requests.jsonl").is_file()
    assert not port_in_use(f"http://127.0.0.1:{port}"), "the last stack was torn down"
