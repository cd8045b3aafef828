"""Router overhead: the same requests sent straight to a unified node and through the router,
side by side in one run (latency medians and p90, TTFT of streamed requests, the ratio).

    python -m pdcache.bench.router_bench [--requests 40] [--prompt-tokens 256]
                                         [--new-tokens 16] [--node-auth off|both] [--json PATH]

Starts `pdcache serve` (a unified node) and `pdcache router` in front of it as separate
processes on loopback (free ports). Requests alternate direct / routed so both see the same
machine load; every prompt is random (no prefix reuse), so both paths compute the same work.
`--node-auth both` adds a second node + router pair with a cluster secret (a fresh one in a
temporary directory): the node checks the bearer credential derived from it on every request
and the router sends it, so `direct+auth` / `router+auth` against `direct` / `router`, in the
same interleaved run, is the cost of node HTTP authentication.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

from pdcache.bench.stack import StackProcess
from pdcache.bench.table import emit
from pdcache.utils.secret import create_secret, derive_key, load_secret


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--requests", type=int, default=40, help="requests per path and mode")
    parser.add_argument("--prompt-tokens", type=int, default=256)
    parser.add_argument("--new-tokens", type=int, default=16)
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--node-auth", choices=["off", "both"], default="off",
                        help="both: also measure a node + router pair with a cluster secret")


async def _one(client: httpx.AsyncClient, url: str, ids: list[int], new_tokens: int,
               stream: bool, headers: dict[str, str]) -> tuple[float, float]:
    """(e2e seconds, time to the first streamed event or e2e) of one request."""
    body = {"input_ids": ids, "stream": stream,
            "sampling_params": {"max_new_tokens": new_tokens, "temperature": 0.0,
                                "ignore_eos": True}}
    start = time.perf_counter()
    if not stream:
        resp = await client.post(f"{url}/generate", json=body, headers=headers)
        resp.raise_for_status()
        end = time.perf_counter()
        return end - start, end - start
    first = None
    async with client.stream("POST", f"{url}/generate", json=body, headers=headers) as resp:
        resp.raise_for_status()
        async for line in resp.aiter_lines():
            if line.startswith("data:") and first is None:
                first = time.perf_counter()
    end = time.perf_counter()
    return end - start, (first or end) - start


Target = tuple[str, dict[str, str]]  # (url, headers of every request)


async def _measure(paths: dict[str, Target], args: argparse.Namespace) -> list[dict[str, Any]]:
    rng = random.Random(0)
    samples: dict[tuple[str, bool], list[tuple[float, float]]] = {}
    async with httpx.AsyncClient(timeout=120, trust_env=False) as client:
        for stream in (False, True):
            for _ in range(args.requests):
                for name, (url, headers) in paths.items():
                    ids = [rng.randrange(256) for _ in range(args.prompt_tokens)]
                    sample = await _one(client, url, ids, args.new_tokens, stream, headers)
                    samples.setdefault((name, stream), []).append(sample)
    return _rows(samples, list(paths))


def _rows(samples: dict[tuple[str, bool], list[tuple[float, float]]],
          names: list[str]) -> list[dict[str, Any]]:
    rows = []
    for stream in (False, True):
        direct = statistics.median(e for e, _ in samples[("direct", stream)])
        for name in names:
            e2e = sorted(e for e, _ in samples[(name, stream)])
            ttft = sorted(t for _, t in samples[(name, stream)])
            rows.append({
                "mode": "stream" if stream else "plain", "path": name,
                "e2e_p50_ms": 1e3 * statistics.median(e2e),
                "e2e_p90_ms": 1e3 * e2e[int(0.9 * (len(e2e) - 1))],
                "ttft_p50_ms": 1e3 * statistics.median(ttft),
                "e2e_vs_direct": statistics.median(e2e) / direct,
            })
    return rows


def run(args: argparse.Namespace) -> int:
    from pdcache.router.cli import READY_PREFIX as ROUTER_READY
    from pdcache.server.cli import READY_PREFIX as SERVE_READY

    started: list[StackProcess] = []

    def start(argv: list[str], ready: str) -> str:
        """Start `pdcache ARGV`; its URL once it printed `ready` + the URL."""
        started.append(StackProcess(argv, watch=(ready,), env={"PYTHONUNBUFFERED": "1"}))
        return started[-1].wait_for(ready, 180.0)

    def pair(name: str, secret_argv: list[str]) -> tuple[str, str]:
        """(node URL, router URL) of a unified node and a router in front of it."""
        node = start(["serve", "--model", args.model, "--port", "0", "--name", name,
                      "--log-level", "warning", *secret_argv], SERVE_READY)
        router = start(["router", "--unified", node, "--model", args.model, "--port", "0",
                        "--log-level", "warning", *secret_argv], ROUTER_READY)
        return node, router

    with tempfile.TemporaryDirectory(prefix="pdcache-bench-") as tmp:
        try:
            node, router = pair("u0", [])
            paths: dict[str, Target] = {"direct": (node, {}), "router": (router, {})}
            if args.node_auth == "both":
                secret_file = create_secret(Path(tmp) / "cluster.secret")
                token = derive_key(load_secret(secret_file), "node-http").hex()
                node2, router2 = pair("u1", ["--secret-file", str(secret_file)])
                paths["direct+auth"] = (node2, {"Authorization": f"Bearer {token}"})
                paths["router+auth"] = (router2, {})
            rows = asyncio.run(_measure(paths, args))
        finally:
            for proc in reversed(started):
                proc.stop()
    emit(f"router overhead ({args.model}, {args.prompt_tokens} prompt + {args.new_tokens} new "
         f"tokens, {args.requests} requests per row, alternating)", rows,
         getattr(args, "json_path", None))
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m pdcache.bench.router_bench",
                                     description=__doc__)
    add_arguments(parser)
    parser.add_argument("--json", dest="json_path", default=None)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
