"""`pdcache bench compare`: two real topologies launched in turn, one side-by-side table."""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from pdcache.bench.compare import compare_rows
from pdcache.bench.stack import healthy, parse_config_arg, port_in_use
from pdcache.cli import main as pdcache_main
from tests.net_support import free_ports, unified_topology
from tests.polling import poll, scaled_limit

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


# the owner of a launched stack: SIGTERM to it must stop the stack (its own process group)
_OWNER = """
import os, signal, sys, time
from pathlib import Path
from pdcache.bench.stack import launched, parse_config_arg
if sys.argv[3] == "dies-at-once":  # the protection not in effect: a handler of its own
    signal.signal(signal.SIGTERM, lambda *_: os._exit(143))
with launched(parse_config_arg(sys.argv[1], []), Path(sys.argv[2]), 120, 30, announce=False):
    print("up", flush=True)
    time.sleep(600)
"""


def _stack_pids(run_dir: Path) -> list[int]:
    listing = json.loads((run_dir / "logs" / "processes.json").read_text())
    return [listing["launcher_pid"], *(p["pid"] for p in listing["processes"] if p["pid"])]


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


@pytest.mark.parametrize("owner", ["default", "dies-at-once"])
def test_sigterm_to_the_owner_stops_the_launched_stack(tmp_path: Path, owner: str) -> None:
    port = free_ports(1)[0]
    config = unified_topology(tmp_path, "u", port)
    run_dir = tmp_path / "run"
    proc = subprocess.Popen([sys.executable, "-c", _OWNER, str(config), str(run_dir), owner],
                            stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "up"
        pids = _stack_pids(run_dir)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=scaled_limit(60)) == 143
        launcher, stopped_line = pids[0], "stopped 1 of 1 processes"
        if owner == "default":  # its `finally` stopped the stack before it exited
            assert not _alive(launcher)
            assert poll(lambda: not any(_alive(p) for p in pids), 30, scaled=True)
            assert not port_in_use(f"http://127.0.0.1:{port}")
            assert stopped_line in (run_dir / "launch.log").read_text()
        else:  # an owner that dies without its `finally`: nothing stopped the stack
            assert _alive(launcher) and healthy(f"http://127.0.0.1:{port}")
            assert stopped_line not in (run_dir / "launch.log").read_text()
    finally:
        proc.kill()
        proc.wait(timeout=10)
        for pid in _stack_pids(run_dir) if (run_dir / "logs").is_dir() else []:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pid, signal.SIGKILL)
