"""`pdcache bench transfer` runs end to end (tiny sizes) and writes the table as JSON."""

from __future__ import annotations

import argparse
import json

import pytest

import tests.transfer_support  # noqa: F401 - engine environment defaults
from pdcache.bench import transfer_bench

pytestmark = pytest.mark.slow


def test_transfer_bench_reports_every_path_verified(tmp_path, capsys) -> None:
    parser = argparse.ArgumentParser()
    transfer_bench.add_arguments(parser)
    out = tmp_path / "transfer.json"
    args = parser.parse_args(["--engines", "zmq,no-such-engine", "--layers", "2",
                              "--pages-per-room", "8", "--rooms", "2", "--repeats", "1",
                              "--kv-heads", "2", "--head-dim", "16", "--control-rounds", "40"])
    args.json_path = str(out)
    assert transfer_bench.run(args) == 0
    report = json.loads(out.read_text())
    paths = [(r["engine"], r["layout"], r["path"]) for r in report["rows"]]
    assert paths == [("zmq", layout, path) for layout in ("random", "contiguous")
                     for path in ("memcpy", "raw engine", "KVSender->KVReceiver")]
    protocol_rows = [r for r in report["rows"] if r["path"] == "KVSender->KVReceiver"]
    assert all(r["verified"] == "yes" and r["GiB/s"] > 0 for r in protocol_rows)
    assert "no-such-engine" in report["skipped"]
    assert "KVSender->KVReceiver" in capsys.readouterr().out
    control = json.loads((tmp_path / "transfer.control.json").read_text())["rows"]
    assert [(r["path"], r["auth"].split()[0]) for r in control] == [
        ("KVSender ping", "none"), ("KVSender ping", "hmac"),
        ("echo in another process", "none"), ("echo in another process", "hmac"),
        ("echo in another process", "curve")]
    assert all(r["rtt_p50_us"] > 0 for r in control)
