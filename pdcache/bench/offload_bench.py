"""`pdcache bench offload`: the DecodeOffloadManager on vs off, in the same run.

One prefill node (HiCache over hf3fs storage shared through `pdcache metadata-server`) and
two decode nodes, one writing its KV back to storage (offload on) and one not (`--no-offload`),
all real processes on loopback, driven like the router drives them. Per answer length, each
repeat plays a two-turn session on each decode node (order alternating, distinct random
prompts so neither session reuses the other's pages):

  turn 1: prompt (random) -> answer of N tokens    decode inter-token latency (ITL), and
                                                    decode process CPU time per token
          wait until decode's offload drained       (reported: drain time after the answer)
  turn 2: prompt + answer + new message -> 1 token  next-turn TTFT (client latency)

Beside it, the manager alone in this process (`--intrinsic-pages`): its CPU time per page,
shown per row as a share of the offload-off ITL — the cost offload adds, free of machine load.

Targets: ITL overhead of offload <= 5%; next-turn TTFT with offload <= 0.5x without at 1024.
On an oversubscribed CPU wall-clock ITL swings with other processes; the decode process's CPU
time per token (every thread of it, offload drain included) is the steadier cost measure.
"""

from __future__ import annotations

import argparse
import collections
import os
import random
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

from pdcache.bench.pd_bench import (
    RunningNode,
    pd_flags,
    pd_request,
    random_prompt,
    start_metadata,
    start_node,
)
from pdcache.bench.table import emit


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--preset", default="small", help="model preset (small; tiny to smoke)")
    parser.add_argument("--answer-lens", default="256,1024")
    parser.add_argument("--prompt-len", type=int, default=512, help="turn 1 prompt tokens")
    parser.add_argument("--message-len", type=int, default=32, help="turn 2 new message")
    parser.add_argument("--repeats", type=int, default=2, help="median of this many")
    parser.add_argument("--page-size", type=int, default=16)
    parser.add_argument("--device-pages", type=int, default=1024)
    parser.add_argument("--host-pages", type=int, default=2048)
    parser.add_argument("--transfer-engine", default="mooncake", choices=["mooncake", "zmq"])
    parser.add_argument("--prefetch-policy", default="timeout",
                        choices=["best_effort", "wait_complete", "timeout"])
    parser.add_argument("--storage-dir", default=None, help="default: a temporary directory")
    parser.add_argument("--timeout", type=float, default=900.0, help="per request (s)")
    parser.add_argument("--intrinsic-pages", type=int, default=256,
                        help="pages for the in-process cost of the manager alone (0: skip)")


def run(args: argparse.Namespace) -> int:
    with tempfile.TemporaryDirectory(dir=args.storage_dir) as tmp:
        return _run(args, Path(tmp))


def _run(args: argparse.Namespace, tmp: Path) -> int:
    load_before = os.getloadavg()[0]
    metadata = start_metadata(tmp / "metadata")
    nodes: list[RunningNode] = []
    try:
        storage = ["--storage-backend", "hf3fs", "--storage-path", str(tmp / "storage"),
                   "--storage-capacity", "2GiB", "--storage-metadata", metadata.url]
        prefill = _start(nodes, "prefill", [*pd_flags(args), "--name", "p0", *storage,
                                            "--host-pages", str(args.host_pages),
                                            "--prefetch-policy", args.prefetch_policy])
        decodes = {"on": _start(nodes, "decode", [*pd_flags(args), "--name", "d-on", *storage]),
                   "off": _start(nodes, "decode", [*pd_flags(args), "--name", "d-off",
                                                   "--no-offload"])}
        with httpx.Client(timeout=args.timeout) as client:
            _session(args, client, prefill, decodes["on"], random.Random(-1), 64)  # warm-up
            _session(args, client, prefill, decodes["off"], random.Random(-2), 64)
            rows = [_measure(args, client, prefill, decodes, n)
                    for n in _ints(args.answer_lens)]
            offload = _offload_counters(client, decodes["on"])
    finally:
        for node in reversed(nodes):
            node.stop()
        metadata.stop()
    intrinsic = _manager_cost(args, tmp) if args.intrinsic_pages else {}
    if intrinsic:
        per_token_ms = intrinsic["manager_cpu_ms_per_page"] / args.page_size
        for row in rows:
            row["manager_cpu_pct_of_itl_off"] = 100.0 * per_token_ms / row["itl_off_ms"]
    extra = {"preset": args.preset, "prompt_len": args.prompt_len,
             "message_len": args.message_len, "repeats": args.repeats,
             "transfer_engine": args.transfer_engine, "prefetch_policy": args.prefetch_policy,
             **offload, **intrinsic, "load_avg_before": round(load_before, 2),
             "load_avg_after": round(os.getloadavg()[0], 2)}
    emit("Decode offload on vs off: decode ITL and next-turn TTFT", rows, args.json_path,
         extra=extra)
    return 0


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def _start(nodes: list[RunningNode], command: str, flags: list[str]) -> RunningNode:
    nodes.append(start_node(command, flags))
    return nodes[-1]


def _measure(args: argparse.Namespace, client: httpx.Client, prefill: RunningNode,
             decodes: dict[str, RunningNode], answer_len: int) -> dict[str, Any]:
    samples: dict[str, list[float]] = collections.defaultdict(list)
    for rep in range(args.repeats):
        order = ("on", "off") if rep % 2 == 0 else ("off", "on")
        for mode in order:
            rng = random.Random(f"{answer_len}-{rep}-{mode}")
            result = _session(args, client, prefill, decodes[mode], rng, answer_len)
            for key, value in result.items():
                samples[f"{key}_{mode}"].append(value)
    med = {key: statistics.median(values) for key, values in samples.items()}
    return {
        "answer_tokens": answer_len,
        "itl_off_ms": 1e3 * med["itl_off"],
        "itl_on_ms": 1e3 * med["itl_on"],
        "itl_overhead_pct": 100.0 * (med["itl_on"] / med["itl_off"] - 1.0),
        "cpu_ms_per_token_off": 1e3 * med["cpu_off"],
        "cpu_ms_per_token_on": 1e3 * med["cpu_on"],
        "cpu_overhead_pct": 100.0 * (med["cpu_on"] / med["cpu_off"] - 1.0),
        "next_ttft_off_s": med["ttft_off"],
        "next_ttft_on_s": med["ttft_on"],
        "next_ttft_on_over_off": med["ttft_on"] / med["ttft_off"],
        "next_cached_off": int(med["cached_off"]),
        "next_cached_on": int(med["cached_on"]),
        "next_from_decode_on": int(med["from_decode_on"]),
        "next_computed_on": int(med["computed_on"]),
        "drain_on_s": med["drain_on"],
    }


def _session(args: argparse.Namespace, client: httpx.Client, prefill: RunningNode,
             decode: RunningNode, rng: random.Random, answer_len: int) -> dict[str, float]:
    prompt = random_prompt(rng, args.prompt_len)
    cpu_before = process_cpu_s(decode.process.proc.pid)
    _, _, d1 = pd_request(client, prefill.url, decode.url, prefill.bootstrap, prompt,
                          answer_len)
    meta = d1["meta_info"]
    decoded = max(1, len(d1["output_ids"]) - 1)
    itl = (meta["e2e_latency"] - meta["ttft_s"]) / decoded
    answered = time.perf_counter()
    _wait_drained(client, decode, deadline_s=120.0)
    drain = time.perf_counter() - answered
    # all of decode's threads (engine, offload copy, storage writer), drain included
    cpu_per_token = (process_cpu_s(decode.process.proc.pid) - cpu_before) / decoded
    turn2 = prompt + d1["output_ids"] + random_prompt(rng, args.message_len)
    ttft, _, d2 = pd_request(client, prefill.url, decode.url, prefill.bootstrap, turn2, 1)
    meta2 = d2["meta_info"]
    return {"itl": itl, "cpu": cpu_per_token, "ttft": ttft, "drain": drain, "cached": meta2["cached_tokens"],
            "from_decode": meta2["cached_tokens_details"]["storage_from_decode"],
            "computed": meta2["computed_tokens"]}


def process_cpu_s(pid: int) -> float:
    """User + system CPU seconds of process `pid`, all threads (Linux /proc)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _wait_drained(client: httpx.Client, decode: RunningNode, deadline_s: float) -> None:
    """Until the decode node has no offload copy or write in flight (no-op without offload)."""
    deadline = time.monotonic() + deadline_s
    while time.monotonic() < deadline:
        counters = _offload_counters(client, decode)
        if not counters or counters["pending_copies"] + counters["pending_writes"] == 0:
            return
        time.sleep(0.01)
    raise RuntimeError(f"decode offload of {decode.url} did not drain in {deadline_s:.0f}s")


def _offload_counters(client: httpx.Client, decode: RunningNode) -> dict[str, float]:
    """pdcache_decode_offload_* of one decode node's /metrics ({} when offload is off)."""
    from prometheus_client.parser import text_string_to_metric_families

    text = client.get(f"{decode.url}/metrics").text
    prefix = "pdcache_decode_offload_"
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name.startswith(prefix):
                out[sample.name[len(prefix):].removesuffix("_total")] = float(sample.value)
    return out


def _manager_cost(args: argparse.Namespace, tmp: Path) -> dict[str, float]:
    """CPU time of the DecodeOffloadManager alone per page (this process, nothing else running
    in it): scheduling, exists_prefix, device->staging copy, checksum and write to an hf3fs
    store (in-process metadata) — what offload adds to a decode node, free of machine load."""
    import threading

    import torch

    from pdcache.engine.loader import load_model_config
    from pdcache.offload_manager.builder import fingerprint_for, model_identity, storage_config_for
    from pdcache.offload_manager.decode_offload import DecodeOffloadManager
    from pdcache.offload_manager.storage import create_backend

    config, page, pages = load_model_config(args.preset), args.page_size, args.intrinsic_pages
    fingerprint = fingerprint_for(config, model_identity(args.preset, 0), page)
    storage = create_backend(storage_config_for(
        config, page, fingerprint, backend="hf3fs", path=str(tmp / "intrinsic"),
        capacity_pages=2 * pages, metadata="inproc"))
    device_kv = torch.randn(config.kv_geometry.device_shape(pages, page))
    manager = DecodeOffloadManager(device_kv, storage, fingerprint, staging_pages=256).start()
    tokens = random_prompt(random.Random(7), pages * page)
    try:
        cpu, wall = time.process_time(), time.perf_counter()
        manager.track("intrinsic")
        for n in range(1, pages + 1):  # one page completes every `page` decode steps
            manager.on_step("intrinsic", tokens[: n * page], list(range(n)))
        released = threading.Event()
        manager.finish("intrinsic", tokens, list(range(pages)), released.set)
        if not (released.wait(120) and manager.wait_idle(120)):
            raise RuntimeError("intrinsic offload run did not drain")
        cpu, wall = time.process_time() - cpu, time.perf_counter() - wall
        written = manager.stats.pages_offloaded
    finally:
        manager.close()
        storage.close()
    return {"manager_pages": written, "manager_cpu_ms_per_page": 1e3 * cpu / pages,
            "manager_wall_ms_per_page": 1e3 * wall / pages}
