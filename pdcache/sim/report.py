"""The answers of one simulated run: `summary.json` and the printed tables.

The request part is `pdcache.bench.report.summarize` over the simulated `RequestRecord`s:
hit rates by tier and origin, the theoretical rate, TTFT and e2e percentiles, per turn, with
the same definitions as a measured replay. Added here: TPOT percentiles, goodput at the SLO
(`--ttft-slo`, `--tpot-slo`), every node's utilisation and cache counters, the store's bytes
and its bandwidth over time, the router's queue. Every number is simulated time; the summary
holds nothing of the wall clock, so one seed gives one file.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any, TextIO

from pdcache.bench import report
from pdcache.bench.table import emit
from pdcache.sim.io import STORAGE_KINDS
from pdcache.sim.simulation import Simulation


def goodput(ok: list[dict[str, Any]], duration: float, ttft_slo: float | None,
            tpot_slo: float | None) -> dict[str, Any]:
    """Requests per second within the SLOs (`ok`: the successful records, as dicts), and
    their share; both None without an SLO."""
    if ttft_slo is None and tpot_slo is None:
        return {"goodput_rps": None, "slo_attainment": None}
    good = [r for r in ok
            if (ttft_slo is None or r["ttft_s"] <= ttft_slo)
            and (tpot_slo is None or r["tpot_s"] is None or r["tpot_s"] <= tpot_slo)]
    return {"goodput_rps": len(good) / duration if duration else 0.0,
            "slo_attainment": len(good) / len(ok) if ok else 0.0,
            "ttft_slo_s": ttft_slo, "tpot_slo_s": tpot_slo}


def _storage(sim: Simulation) -> dict[str, Any] | None:
    if sim.store is None or sim.io is None:
        return None
    kinds = STORAGE_KINDS
    return {
        "bytes": dict(sim.io.totals),
        "operations": sim.io.operations,
        "pages_stored": len(sim.store),
        "pages_written": dict(sim.store.written_pages),
        "evicted_pages": sim.store.evicted_pages,
        "bucket_s": sim.io.timeline.bucket_s,
        "bandwidth_over_time": sim.io.timeline.rows(kinds),
    }


def summarize(sim: Simulation) -> dict[str, Any]:
    """The run's summary (what `summary.json` holds)."""
    records = sim.records
    duration = max((r["dispatch_s"] + (r["e2e_s"] or 0.0) for r in records), default=0.0)
    run_info = {
        "duration_s": duration,
        "requests_total": sim.trace.num_requests,
        "requests_sent": sim.counts["sent"],
        "requests_skipped": sim.counts["skipped"],
        "requests_prompt_mismatch": 0,
        "skip_reasons": sim.skip_reasons,
        "trace": sim.cfg.trace, "trace_name": sim.trace.name,
        "block_size": sim.trace.block_size, "sessions": len(sim.trace.sessions),
    }
    summary = report.summarize(records, run_info)
    ok = [r for r in records if r["ok"]]
    opts = sim.options
    summary.update(report.percentiles((r["tpot_s"] for r in ok), "tpot"))
    summary.update(goodput(ok, duration, opts.ttft_slo_s, opts.tpot_slo_s))
    summary["simulated"] = {
        "topology": str(sim.topology.source), "overrides": list(sim.topology.overrides),
        "mode": sim.cfg.mode, "concurrency": sim.cfg.concurrency, "rate": sim.cfg.rate,
        "seed": sim.cfg.seed, "page_size": sim.page_size, "page_bytes": sim.page_bytes,
        "nodes": {role: sum(1 for n in sim.nodes.values() if n.role == role)
                  for role in ("prefill", "decode", "unified")},
        "events": sim.loop.events_run,
    }
    summary["nodes"] = [node.stats(duration) for node in sim.nodes.values()]
    summary["router"] = {"peak_queue": sim.router.peak_queue, "refused": sim.router.refused}
    summary["requests_stuck"] = sim.stuck
    summary["storage"] = _storage(sim)
    return summary


def write(out_dir: Path, sim: Simulation, summary: dict[str, Any]) -> None:
    """`requests.jsonl` (one simulated record per request) and `summary.json` in `out_dir`."""
    out_dir.mkdir(parents=True, exist_ok=True)
    with (out_dir / "requests.jsonl").open("w") as sink:
        for row in sim.records:
            sink.write(json.dumps(row) + "\n")
    (out_dir / "summary.json").write_text(json.dumps(summary, indent=2, default=str))


NODE_COLUMNS = ("name", "role", "utilisation", "prefill_tokens", "decode_steps",
                "device_evicted_pages", "host_evicted_pages")
EXTRA_ROWS = ("tpot_p50_s", "tpot_p90_s", "tpot_p99_s", "ttft_p90_s", "e2e_p90_s",
              "goodput_rps", "slo_attainment")


def print_tables(summary: dict[str, Any], out: TextIO | None = None) -> None:
    """The replay's tables (same rows as `bench replay`), then the simulator's."""
    out = out or sys.stdout
    report.print_tables(summary, out=out)
    emit("simulated latency and goodput",
         [{"metric": k, "value": summary.get(k)} for k in EXTRA_ROWS], out=out)
    emit("nodes", summary["nodes"], columns=NODE_COLUMNS, out=out)
    storage = summary.get("storage")
    if storage:
        rows = [{"kind": k, "bytes": v} for k, v in storage["bytes"].items()]
        rows.append({"kind": "pages_stored", "bytes": storage["pages_stored"]})
        emit("storage", rows, out=out)
