"""`pdcache bench KIND ...`: every benchmark prints a table and, with --json PATH, writes JSON."""

from __future__ import annotations

import argparse
import importlib

# kind -> (module, help). Each module defines `add_arguments(parser)` and `run(args) -> int`.
BENCHMARKS: dict[str, tuple[str, str]] = {
    "engine": ("pdcache.bench.engine_bench", "prefill/decode tokens/s vs transformers"),
    "kv-bytes": ("pdcache.bench.kv_bytes", "KV cache bytes per token and page, by model"),
    "kernels": ("pdcache.bench.kernel_bench", "KV copy GB/s vs memcpy, attention tokens/s"),
    "storage": ("pdcache.bench.storage_bench", "storage read/write GB/s vs memcpy and file I/O"),
    "cache": ("pdcache.bench.cache_bench", "TTFT by cache tier vs recompute"),
    "tiers": ("pdcache.bench.tier_bench", "hits per cache tier by eviction policy / host mode"),
    "hybrid": ("pdcache.bench.hybrid_bench",
               "hybrid models: hits, TTFT and state vs KV bytes by state checkpoint policy"),
    "metadata": ("pdcache.bench.metadata_bench",
                 "hf3fs metadata ops/s and failover: SQLite vs replicated on etcd"),
    "transfer": ("pdcache.bench.transfer_bench", "P->D transfer GB/s per engine vs memcpy"),
    "offload": ("pdcache.bench.offload_bench", "decode offload on vs off: ITL and next-turn TTFT"),
    "durable": ("pdcache.bench.durable_bench",
                "next turn finds the previous answer: pending-page wait on vs off"),
    "pd": ("pdcache.bench.pd_bench", "TTFT of PD vs unified, P->D transfer GB/s in that path"),
    "sglang-plugin": ("pdcache.bench.sglang_plugin_bench",
                      "SGLang storage plugin GB/s vs the same backend used natively"),
    "router": ("pdcache.bench.router_bench",
               "router overhead: the same requests direct to a node and through the router"),
    "replay": ("pdcache.bench.replay", "replay a multi-turn trace against a running stack"),
    "compare": ("pdcache.bench.compare", "launch topologies in turn and replay the same trace"),
    "goodput": ("pdcache.bench.goodput",
                "highest Poisson request rate within a TTFT p90 SLO, per topology"),
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.set_defaults(_accepts_extra=True)
    sub = parser.add_subparsers(dest="bench", required=True, metavar="KIND")
    for name, (module, help_text) in BENCHMARKS.items():
        # add_help=False: --help reaches the benchmark's own parser (in `run`) with its options
        sp = sub.add_parser(name, help=help_text, add_help=False)
        sp.set_defaults(_bench_module=module)
        sp.add_argument("--json", dest="json_path", default=None, help="also write results here")


def run(args: argparse.Namespace) -> int:
    mod = importlib.import_module(args._bench_module)
    # Benchmark-specific options are parsed here, once the module is known.
    parser = argparse.ArgumentParser(prog=f"pdcache bench {args.bench}")
    mod.add_arguments(parser)
    parser.add_argument("--json", dest="json_path", default=None)
    bench_args = parser.parse_args(args._rest)
    if bench_args.json_path is None:
        bench_args.json_path = args.json_path
    return int(mod.run(bench_args) or 0)
