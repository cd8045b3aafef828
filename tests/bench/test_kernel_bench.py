"""`pdcache bench kernels` on tiny shapes: every op and backend gets a row, and the JSON holds
the same numbers as the printed tables."""

from __future__ import annotations

import argparse
import importlib.util
import json

from pdcache.bench import kernel_bench


def _args(tmp_path, *extra: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    kernel_bench.add_arguments(parser)
    parser.add_argument("--json", dest="json_path", default=None)
    return parser.parse_args([
        "--mib", "1", "--layers", "2,3", "--page-sizes", "4", "--kv-heads", "2",
        "--head-dim", "16", "--q-heads", "4", "--decode-batch", "2", "--context", "40",
        "--extend-tokens", "8", "--repeat", "1", "--json", str(tmp_path / "k.json"), *extra,
    ])


def test_kernel_bench_rows_and_json(tmp_path, capfd):
    assert kernel_bench.run(_args(tmp_path, "--backends", "reference,torch")) == 0
    printed = capfd.readouterr().out
    payload = json.loads((tmp_path / "k.json").read_text())
    copies = [r for r in payload["rows"] if r["kind"] == "copy"]
    attention = [r for r in payload["rows"] if r["kind"] == "attention"]
    assert len(copies) == 2 * 2 * len(kernel_bench.COPY_OPS)  # layer counts x backends x ops
    assert {r["op"] for r in copies} == set(kernel_bench.COPY_OPS)
    assert {(r["backend"], r["op"]) for r in attention} == {
        (b, op) for b in ("reference", "torch") for op in ("decode", "extend")}
    for row in copies:
        assert row["GB/s"] > 0 and row["memcpy GB/s"] > 0
        assert abs(row["vs memcpy"] - row["GB/s"] / row["memcpy GB/s"]) < 1e-9
        assert row["MiB"] == row["pages"] * row["layers"] * 2 * 4 * 2 * 16 * 2 / 2**20
    assert "KV copy kernels vs memcpy" in printed and "paged attention vs SDPA" in printed


def test_kernel_bench_process_clock_runs_single_threaded(tmp_path):
    args = _args(tmp_path, "--clock", "process", "--skip-attention")
    assert kernel_bench.run(args) == 0
    payload = json.loads((tmp_path / "k.json").read_text())
    assert payload["torch_threads"] == 1 and payload["clock"] == "process"
    default = {"torch", "numba"} if importlib.util.find_spec("numba") else {"torch"}
    assert {r["backend"] for r in payload["rows"]} == default


def test_numba_rows_are_copies_only_beside_torch(tmp_path):
    """numba's attention is torch's: with both backends it gets copy rows only."""
    import pytest

    pytest.importorskip("numba", reason="numba not installed (pip install numba)")
    assert kernel_bench.run(_args(tmp_path, "--backends", "torch,numba")) == 0
    payload = json.loads((tmp_path / "k.json").read_text())
    rows = {(r["kind"], r["backend"]) for r in payload["rows"]}
    assert rows == {("copy", "torch"), ("copy", "numba"), ("attention", "torch")}
