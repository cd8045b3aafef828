"""`pdcache sim calibrate --out PROFILE.toml [--preset P] [--quick]`: measure this machine's
cost profile with the benches' own code paths and write it as a profile file.

- prefill and decode steps: `bench.engine_bench.batch_step_seconds` (the model's real forward
  over a paged pool, on `--device`) on a small grid of batch tokens x context, fitted to the
  profile's linear models by least squares (non-negative coefficients);
- P -> D transfer: `bench.transfer_bench.room_push_seconds` (KVSender -> KVReceiver, decode in
  a child process) for a one-page and a large room: per-room cost and bytes/s;
- host <-> device copies: the engine's own copy kernels (`KernelSet`) over the preset's KV
  geometry, a few page counts;
- storage: `bench.storage_bench.backend_op_seconds` on the `file` backend (one client):
  read / write bytes/s and per-operation latency;
- metadata: `bench.metadata_bench.measure_ops` on the SQLite hf3fs metadata service: the
  mean p50 of reserve, commit and lookup;
- with `--serving-unified` (and `--serving-pd`): the optional `[serving]` table, from real
  running stacks on a trivial trace (`pdcache.sim.calibrate_serving`).

Every fit's error (root mean square of the relative residuals) is printed and written to the
profile's `[source]` table. On one machine the store and a node's link to it are the same
measurement (one client): the store's bandwidths and `node_nic_Bps` come out equal; for a
cluster, write them from `bench storage` with many clients (docs/simulator.md).
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import shlex
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from pdcache.sim.profile import load_profile

Log = Callable[[str], None]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--out", required=True, help="the profile TOML to write")
    parser.add_argument("--preset", default="small",
                        help="model preset whose compute and KV geometry to measure")
    parser.add_argument("--page-size", type=int, default=16, help="tokens per KV page")
    parser.add_argument("--quick", action="store_true",
                        help="a small grid (seconds on the tiny preset, at most a minute)")
    parser.add_argument("--transfer-engine", default="zmq",
                        help="P->D transfer engine to time (as `bench transfer --engines`)")
    parser.add_argument("--dir", default=None, help="where the storage bench writes (tmp)")
    parser.add_argument("--device", default=None,
                        help="where the model and the device KV pool live (default: cuda when "
                             "available, else cpu)")
    parser.add_argument("--serving-unified", default=None, metavar="CONFIG",
                        help="also measure [serving] (sim.calibrate_serving): launch this "
                             "unified topology ([LABEL=]PATH[+KEY=VALUE...]) on a trivial trace")
    parser.add_argument("--serving-pd", default=None, metavar="CONFIG",
                        help="... and this PD topology, for [serving] handoff_s")
    parser.add_argument("--node-threads", type=int, default=1, metavar="N",
                        help="torch threads each launched node uses (the OMP_NUM_THREADS it "
                             "runs with; scripts/test.sh and the demo use 1): how many nodes "
                             "compute at once on this host's cores")
    parser.add_argument("--serving-set", action="append", default=[], metavar="KEY=VALUE",
                        help="override for the serving topologies (e.g. model.preset=tiny)")
    parser.add_argument("--serving-out", default=None,
                        help="where the serving runs write (default: next to --out)")
    parser.add_argument("--startup-timeout", type=float, default=600.0,
                        help="seconds for a serving topology to become healthy")
    parser.add_argument("--stop-timeout", type=float, default=60.0,
                        help="seconds for the launcher to stop a serving topology")


@dataclass(frozen=True)
class Grid:
    """The points measured."""

    prefill_tokens: tuple[int, ...]
    prefill_prefix: tuple[int, ...]
    prefill_batches: tuple[int, ...]
    decode_batches: tuple[int, ...]
    decode_contexts: tuple[int, ...]
    room_pages: tuple[int, ...]
    copy_pages: tuple[int, ...]
    storage_pages: tuple[int, ...]
    repeats: int


QUICK = Grid(prefill_tokens=(16, 64, 256), prefill_prefix=(0, 256), prefill_batches=(1, 2),
             decode_batches=(1, 4, 16), decode_contexts=(64, 512), room_pages=(1, 32),
             copy_pages=(4, 64), storage_pages=(1, 16), repeats=3)
FULL = Grid(prefill_tokens=(32, 128, 512, 1024), prefill_prefix=(0, 1024, 4096),
            prefill_batches=(1, 4), decode_batches=(1, 4, 16, 64),
            decode_contexts=(128, 1024, 4096), room_pages=(1, 16, 256), copy_pages=(8, 64, 512),
            storage_pages=(1, 8, 64), repeats=3)


@dataclass(frozen=True)
class Fit:
    """Least-squares coefficients (>= 0) of a linear model and its relative error."""

    coefficients: tuple[float, ...]
    rms_rel_error: float
    points: int


def fit_nonnegative(features: Sequence[Sequence[float]], seconds: Sequence[float]) -> Fit:
    """`seconds ~ features @ c` with every c >= 0, minimising the relative residuals (each
    row weighted by 1 / its time, so short steps count as much as long ones): a column whose
    coefficient comes out negative is dropped (c = 0) and the rest refitted."""
    x = np.asarray(features, dtype=float)
    y = np.asarray(seconds, dtype=float)
    weight = 1.0 / np.maximum(y, 1e-12)
    active = list(range(x.shape[1]))
    coef = np.zeros(x.shape[1])
    while active:
        sol, *_ = np.linalg.lstsq(x[:, active] * weight[:, None], y * weight, rcond=None)
        if (sol >= 0).all():
            coef[active] = sol
            break
        active = [c for c, v in zip(active, sol, strict=True) if v >= 0]
    rel = (x @ coef - y) * weight
    return Fit(tuple(float(c) for c in coef), float(np.sqrt(np.mean(rel ** 2))), len(y))


def bandwidth_fit(nbytes: Sequence[float], seconds: Sequence[float]) -> tuple[float, float, Fit]:
    """(latency s, bytes/s, fit) of `seconds ~ latency + bytes / bandwidth`; with no slope
    left (noise), the bandwidth of the largest operation."""
    fit = fit_nonnegative([[1.0, b] for b in nbytes], seconds)
    latency, per_byte = fit.coefficients
    if per_byte <= 0:
        largest = int(np.argmax(nbytes))
        per_byte = seconds[largest] / nbytes[largest]
    return latency, 1.0 / per_byte, fit


def measure_prefill(model: object, grid: Grid, page_size: int, log: Log) -> tuple[dict, Fit]:
    from pdcache.bench.engine_bench import batch_step_seconds

    rows, times = [], []
    for batch in grid.prefill_batches:
        for tokens in grid.prefill_tokens:
            for prefix in grid.prefill_prefix:
                t = batch_step_seconds(model, tokens, prefix, batch, page_size,  # type: ignore[arg-type]
                                       grid.repeats)
                log(f"prefill batch={batch} tokens={tokens} prefix={prefix}: {t * 1e3:.2f} ms")
                rows.append([1.0, batch * tokens, batch * tokens * (prefix + tokens)])
                times.append(t)
    fit = fit_nonnegative(rows, times)
    names = ("base_s", "per_token_s", "per_token_context_s")
    return dict(zip(names, fit.coefficients, strict=True)), fit


def measure_decode(model: object, grid: Grid, page_size: int, log: Log) -> tuple[dict, Fit]:
    from pdcache.bench.engine_bench import batch_step_seconds

    rows, times = [], []
    for batch in grid.decode_batches:
        for context in grid.decode_contexts:
            t = batch_step_seconds(model, 1, context, batch, page_size,  # type: ignore[arg-type]
                                   grid.repeats)
            log(f"decode batch={batch} context={context}: {t * 1e3:.2f} ms")
            rows.append([1.0, batch, batch * (context + 1)])
            times.append(t)
    fit = fit_nonnegative(rows, times)
    names = ("base_s", "per_request_s", "per_context_token_s")
    return dict(zip(names, fit.coefficients, strict=True)), fit


def measure_host(config: object, grid: Grid, page_size: int, device: str,
                 log: Log) -> tuple[dict, list[Fit]]:
    """Host <-> device page copies with the engine's kernels (device pool on `device`)."""
    from pdcache.engine.loader import allocate_device_kv
    from pdcache.kernels import KernelSet
    from pdcache.offload_manager.host_pool import HostKVPool

    most = max(grid.copy_pages)
    geometry = config.kv_geometry  # type: ignore[attr-defined]
    device_kv = allocate_device_kv(config, most, page_size, device)  # type: ignore[arg-type]
    host_kv = HostKVPool(most, geometry, page_size).host_kv
    kernels = KernelSet()
    page_bytes = geometry.page_bytes(page_size)
    out, fits = {}, []
    for name, copy in (("d2h", lambda ids: kernels.device_to_host(device_kv, host_kv, ids, ids)),
                       ("h2d", lambda ids: kernels.host_to_device(host_kv, device_kv, ids, ids))):
        sizes, times = [], []
        for n in grid.copy_pages:
            ids = torch.arange(n, dtype=torch.long)
            copy(ids)
            samples = []
            for _ in range(max(grid.repeats, 3)):
                t0 = time.perf_counter()
                copy(ids)
                if device.startswith("cuda"):
                    torch.cuda.synchronize()
                samples.append(time.perf_counter() - t0)
            sizes.append(float(n * page_bytes))
            times.append(statistics.median(samples))
            log(f"host {name} {n} pages: {times[-1] * 1e3:.3f} ms")
        _, bandwidth, fit = bandwidth_fit(sizes, times)
        out[f"{name}_bandwidth_Bps"] = bandwidth
        fits.append(fit)
    return out, fits


def measure_transfer(preset: str, engine: str, grid: Grid, page_size: int,
                     log: Log) -> tuple[dict, Fit]:
    from pdcache.bench.transfer_bench import room_push_seconds

    log(f"transfer: {engine}, rooms of {', '.join(map(str, grid.room_pages))} pages ...")
    points = room_push_seconds(engine, preset, page_size, list(grid.room_pages),
                               max(grid.repeats, 2))
    for nbytes, seconds in points:
        log(f"transfer room {nbytes} B: {seconds * 1e3:.2f} ms")
    latency, bandwidth, fit = bandwidth_fit([p[0] for p in points], [p[1] for p in points])
    return {"bandwidth_Bps": bandwidth, "per_room_s": latency}, fit


def measure_storage(page_bytes: int, grid: Grid, base: Path | None,
                    log: Log) -> tuple[dict, list[Fit]]:
    from pdcache.bench.storage_bench import backend_op_seconds

    rows = backend_op_seconds("file", page_bytes, list(grid.storage_pages),
                              max(grid.repeats, 2), base=base)
    for row in rows:
        log(f"storage {int(row['pages'])} pages: write {row['write_s'] * 1e3:.2f} ms, "
            f"read {row['read_s'] * 1e3:.2f} ms, exists {row['exists_s'] * 1e6:.0f} us")
    sizes = [r["bytes"] for r in rows]
    w_lat, w_bw, w_fit = bandwidth_fit(sizes, [r["write_s"] for r in rows])
    r_lat, r_bw, r_fit = bandwidth_fit(sizes, [r["read_s"] for r in rows])
    return {"read_bandwidth_Bps": r_bw, "write_bandwidth_Bps": w_bw,
            "node_nic_Bps": max(r_bw, w_bw), "op_latency_s": (w_lat + r_lat) / 2,
            "metadata_op_s": measure_metadata(grid, base, log)}, [w_fit, r_fit]


def measure_metadata(grid: Grid, base: Path | None, log: Log) -> float:
    """The mean of the p50 latencies of hf3fs metadata reserve, commit and lookup (16 keys an
    operation, one client) on the SQLite metadata service (`bench.metadata_bench`)."""
    import tempfile

    from pdcache.bench.metadata_bench import measure_ops, sqlite_stack

    ops = 200 if grid.repeats > 1 else 50
    with tempfile.TemporaryDirectory(dir=base, prefix="pdcache-calibrate-") as tmp, \
            sqlite_stack(Path(tmp)) as (address, _):
        rows = measure_ops("sqlite", address, 1, ops, 16)
    for row in rows:
        log(f"metadata {row['op']}: p50 {row['p50_ms']} ms")
    return statistics.mean(row["p50_ms"] for row in rows) / 1e3


FIELD_NOTES = {
    "prefill": {
        "base_s": "fixed cost of one prefill step",
        "per_token_s": "per token computed in the step",
        "per_token_context_s": "per (chunk token x context after the chunk), summed",
    },
    "decode": {
        "base_s": "fixed cost of one decode step",
        "per_request_s": "per request in the batch",
        "per_context_token_s": "per context token, summed over the batch",
    },
    "transfer": {
        "bandwidth_Bps": "P->D bytes per second out of one prefill node",
        "per_room_s": "fixed cost of one request's push",
    },
    "host": {
        "h2d_bandwidth_Bps": "host -> device copy bytes per second",
        "d2h_bandwidth_Bps": "device -> host copy bytes per second",
    },
    "serving": {
        "request_s": "per request before its first token: HTTP, router, tokeniser",
        "step_s": "per engine step: the step loop (scheduling, sampling, output)",
        "handoff_s": "per PD request: decode's reservation to the prefill computing",
        "warmup_s": "once per prefill / unified node: its first step (warm-up)",
        "decode_warmup_s": "once per decode node: its first step (first receive + forward)",
        "token_s": "per token a step streams: the node's output path (under load)",
        "relay_token_s": "CPU per streamed token in the router and the client",
        "prefill_warmup_s": "once per prefill node: its first step (warm-up)",
    },
    "storage": {
        "read_bandwidth_Bps": "the store's read bytes/s (one client here)",
        "write_bandwidth_Bps": "the store's write bytes/s (one client here)",
        "node_nic_Bps": "one node's link to the store (one client's best here)",
        "op_latency_s": "per read or write operation",
        "metadata_op_s": "per metadata operation (hf3fs reserve / commit / lookup)",
    },
}


def profile_text(tables: dict[str, dict[str, float]], source: dict[str, str]) -> str:
    """The profile file: every cost with a comment saying what it is, then `[source]`."""
    lines = ["# A pdcache sim profile measured by `pdcache sim calibrate` (docs/simulator.md).",
             "# Seconds and bytes per second."]
    for table, notes in FIELD_NOTES.items():
        if table not in tables:
            continue  # [serving] is optional
        lines.append(f"\n[{table}]")
        for key, note in notes.items():
            if key in tables[table]:  # an optional key calibration did not measure is left out
                lines.append(f"{key} = {tables[table][key]:.6e}  # {note}")
    lines.append("\n[source]  # where these numbers come from")
    lines.extend(f"{key} = {_toml_string(value)}" for key, value in source.items())
    return "\n".join(lines) + "\n"


def _toml_string(text: str) -> str:
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"') + '"'


def _machine() -> str:
    device = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"
    return (f"{platform.node()} ({platform.machine()}, {os.cpu_count()} CPUs, {device}, "
            f"load {os.getloadavg()[0]:.1f})")


def default_device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def calibrate(preset: str, page_size: int, grid: Grid, engine: str, base: Path | None,
              device: str, log: Log) -> tuple[dict[str, dict[str, float]], dict[str, Fit]]:
    """Every table of the profile, measured, and each fit."""
    from pdcache.engine.loader import load_model

    torch.manual_seed(0)
    model, _ = load_model(preset, device=device)
    config = model.config
    prefill, prefill_fit = measure_prefill(model, grid, page_size, log)
    decode, decode_fit = measure_decode(model, grid, page_size, log)
    host, host_fits = measure_host(config, grid, page_size, device, log)
    transfer, transfer_fit = measure_transfer(preset, engine, grid, page_size, log)
    page_bytes = config.kv_geometry.page_bytes(page_size)
    storage, storage_fits = measure_storage(page_bytes, grid, base, log)
    tables = {"prefill": prefill, "decode": decode, "transfer": transfer, "host": host,
              "storage": storage}
    fits = {"prefill": prefill_fit, "decode": decode_fit, "host_d2h": host_fits[0],
            "host_h2d": host_fits[1], "transfer": transfer_fit,
            "storage_write": storage_fits[0], "storage_read": storage_fits[1]}
    return tables, fits


def run(args: argparse.Namespace) -> int:
    def log(line: str) -> None:
        print(f"calibrate: {line}", file=sys.stderr, flush=True)

    grid = QUICK if args.quick else FULL
    started = time.monotonic()
    device = args.device or default_device()
    log(f"{args.preset} on {device}, {'quick' if args.quick else 'full'} grid")
    tables, fits = calibrate(args.preset, args.page_size, grid, args.transfer_engine,
                             Path(args.dir) if args.dir else None, device, log)
    for name, fit in fits.items():
        print(f"fit {name}: rms relative error {fit.rms_rel_error:.3f} over {fit.points} points")
    if args.serving_unified:
        from pdcache.sim.calibrate_serving import measure_serving
        from pdcache.sim.profile import profile_from_dict

        serving_out = Path(args.serving_out or Path(args.out).with_suffix(".serving"))
        tables["serving"] = measure_serving(args, profile_from_dict(tables), serving_out, log)
        log("serving: " + ", ".join(f"{k} {v * 1e3:.2f} ms"
                                    for k, v in tables["serving"].items()))
    source = {
        "machine": _machine(), "preset": args.preset, "device": device,
        "page_size": str(args.page_size),
        "grid": "quick" if args.quick else "full",
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "command": "pdcache sim " + shlex.join(getattr(args, "argv", ["calibrate"])),
        "seconds": f"{time.monotonic() - started:.1f}",
        **{f"fit_{k}_rms_rel_error": f"{f.rms_rel_error:.4f}" for k, f in fits.items()},
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(profile_text(tables, source))
    load_profile(out)  # what was written loads
    print(f"wrote {out}")
    return 0
