"""`pdcache bench pd`: TTFT of prefill/decode disaggregation vs the unified server, and the
P→D transfer GB/s seen in that path beside the transfer layer's raw numbers.

Every server is a real `pdcache serve | prefill | decode` process on loopback. The requests
are driven the way the router drives them (docs/pd-protocol.md): one room id, the same body
to P and D at once. TTFT is what a client sees: the latency of a request for one token
(unified: the /generate answer; PD: decode's answer, which arrives once prefill computed the
prompt, pushed its K/V and decode emitted prefill's first token). Prompts are random and
distinct, so no cache tier helps either side; unified and PD requests alternate so machine
load hits both alike. The PD path's transfer GB/s is P's pushed bytes over `pd.push_s`, the
time from the prompt's K/V being complete to the room's release (transfer and `done`);
`--raw` also runs `pdcache bench transfer` with the same page geometry for the engine alone
and memcpy.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import random
import secrets
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from pdcache.bench.stack import StackProcess
from pdcache.bench.table import emit

GIB = float(1 << 30)


# ---- processes ---------------------------------------------------------------------------

def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def child_env() -> dict[str, str]:
    return {**os.environ, "MC_TCP_BIND_ADDRESS": "127.0.0.1",
            "MC_LOG_LEVEL": os.environ.get("MC_LOG_LEVEL", "ERROR")}


READY_AT, BOOTSTRAP_AT = ": ready at ", "KV bootstrap at "


@dataclass(frozen=True)
class RunningNode:
    """A started `pdcache` node or service: its process, its URL (a metadata server's
    `tcp://` address) and, for a prefill node, its KV bootstrap address (from its output)."""

    process: StackProcess
    url: str

    @property
    def bootstrap(self) -> str:
        return self.process.found.get(BOOTSTRAP_AT, "")

    def stop(self) -> None:
        self.process.stop()


def start_node(command: str, flags: list[str], timeout_s: float = 300.0) -> RunningNode:
    """`python -m pdcache COMMAND FLAGS --port P`, once it printed that it is ready (a prefill
    node's KV bootstrap address is read from its output too)."""
    process = StackProcess([command, *flags, "--port", str(free_port())],
                           watch=(f"pdcache {command}{READY_AT}", BOOTSTRAP_AT), env=child_env())
    url = process.wait_for(f"pdcache {command}{READY_AT}", timeout_s)
    return RunningNode(process, url)


def start_metadata(state_dir: Path, timeout_s: float = 60.0) -> RunningNode:
    """`pdcache metadata-server` (the global KV manager shared by P and D) on a free port."""
    port = free_port()
    process = StackProcess(["metadata-server", "--host", "127.0.0.1", "--port", str(port),
                            "--state-dir", str(state_dir)], quiet=True)
    process.wait_port("127.0.0.1", port, timeout_s)
    return RunningNode(process, f"tcp://127.0.0.1:{port}")


def model_flags(args: argparse.Namespace) -> list[str]:
    return ["--model", args.preset, "--seed", "0", "--page-size", str(args.page_size),
            "--device-pages", str(args.device_pages), "--log-level", "warning"]


def pd_flags(args: argparse.Namespace) -> list[str]:
    return [*model_flags(args), "--transfer-engine", args.transfer_engine]


# ---- requests ----------------------------------------------------------------------------

def random_prompt(rng: random.Random, n: int, vocab: int = 250) -> list[int]:
    return [rng.randrange(1, vocab) for _ in range(n)]


def body(prompt: list[int], max_new_tokens: int) -> dict[str, Any]:
    return {"input_ids": prompt,
            "sampling_params": {"max_new_tokens": max_new_tokens, "ignore_eos": True}}


def unified_request(client: httpx.Client, url: str, prompt: list[int],
                    max_new_tokens: int) -> tuple[float, dict]:
    """(client latency, answer)"""
    started = time.perf_counter()
    response = client.post(f"{url}/generate", json=body(prompt, max_new_tokens))
    elapsed = time.perf_counter() - started
    response.raise_for_status()
    return elapsed, response.json()


def pd_request(client: httpx.Client, prefill_url: str, decode_url: str, bootstrap: str,
               prompt: list[int], max_new_tokens: int) -> tuple[float, dict, dict]:
    """Like the router: one room, P and D at once. (latency of D's answer, P's, D's)."""
    room = secrets.randbits(63)
    base = body(prompt, max_new_tokens)
    p_body = {**base, "pd": {"room": room, "role": "prefill", "decode_node": "d0"}}
    d_body = {**base, "pd": {"room": room, "role": "decode", "bootstrap": bootstrap,
                             "prefill_node": "p0"}}
    with ThreadPoolExecutor(2) as pool:
        started = time.perf_counter()
        p_future = pool.submit(client.post, f"{prefill_url}/generate", json=p_body)
        d_response = pool.submit(client.post, f"{decode_url}/generate", json=d_body).result()
        elapsed = time.perf_counter() - started
        p_response = p_future.result()
    for response in (p_response, d_response):
        if response.status_code != 200:
            raise RuntimeError(f"PD request failed: {response.status_code} {response.text}")
    return elapsed, p_response.json(), d_response.json()


# ---- the benchmark -----------------------------------------------------------------------

def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--preset", default="small", help="model preset (small; tiny to smoke)")
    parser.add_argument("--prompt-lens", default="1024,4096")
    parser.add_argument("--repeats", type=int, default=3, help="median of this many")
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--page-size", type=int, default=16)
    parser.add_argument("--device-pages", type=int, default=1024)
    parser.add_argument("--transfer-engine", default="mooncake", choices=["mooncake", "zmq"])
    parser.add_argument("--raw", action=argparse.BooleanOptionalAction, default=True,
                        help="also run `pdcache bench transfer` with this page geometry")
    parser.add_argument("--timeout", type=float, default=600.0, help="per request (s)")


def run(args: argparse.Namespace) -> int:
    lens = [int(x) for x in args.prompt_lens.split(",") if x.strip()]
    load_before = os.getloadavg()[0]
    nodes: list[RunningNode] = []
    try:
        unified = _start(nodes, "serve", [*model_flags(args), "--name", "unified"])
        prefill = _start(nodes, "prefill", [*pd_flags(args), "--name", "p0"])
        decode = _start(nodes, "decode", [*pd_flags(args), "--name", "d0"])
        with httpx.Client(timeout=args.timeout) as client:
            rows = [_measure(args, client, n, unified, prefill, decode) for n in lens]
    finally:
        for node in reversed(nodes):
            node.stop()
    raw = _raw_transfer(args, lens) if args.raw else {}
    for row in rows:
        row.update(raw.get(row["prompt_tokens"], {}))
    extra = {"preset": args.preset, "transfer_engine": args.transfer_engine,
             "page_size": args.page_size, "repeats": args.repeats,
             "load_avg_before": round(load_before, 2),
             "load_avg_after": round(os.getloadavg()[0], 2)}
    emit("PD vs unified: TTFT and P->D transfer in the PD path", rows, args.json_path,
         extra=extra)
    return 0


def _start(nodes: list[RunningNode], command: str, flags: list[str]) -> RunningNode:
    nodes.append(start_node(command, flags))
    return nodes[-1]


def _measure(args: argparse.Namespace, client: httpx.Client, prompt_len: int,
             unified: RunningNode, prefill: RunningNode, decode: RunningNode) -> dict[str, Any]:
    rng = random.Random(prompt_len)
    samples: dict[str, list[float]] = collections.defaultdict(list)
    nbytes = 0
    for i in range(args.warmup + args.repeats):
        u_s, _ = unified_request(client, unified.url, random_prompt(rng, prompt_len), 1)
        pd_s, p, _ = pd_request(client, prefill.url, decode.url, prefill.bootstrap,
                                random_prompt(rng, prompt_len), 1)
        if i < args.warmup:
            continue
        handoff = max(pd_s - p["meta_info"]["ttft_s"], 0.0)
        transfer = max(p["pd"]["push_s"], 1e-9)  # prompt K/V complete -> room released
        nbytes = int(p["pd"]["bytes"])
        for key, value in (("unified", u_s), ("pd", pd_s), ("prefill", p["meta_info"]["ttft_s"]),
                           ("handoff", handoff), ("transfer", transfer)):
            samples[key].append(value)
    med = {key: statistics.median(values) for key, values in samples.items()}
    return {
        "prompt_tokens": prompt_len,
        "unified_ttft_s": med["unified"],
        "pd_ttft_s": med["pd"],
        "pd_over_unified": med["pd"] / med["unified"],
        "pd_overhead_pct": 100.0 * (med["pd"] / med["unified"] - 1.0),
        "pd_prefill_s": med["prefill"],
        "pd_handoff_s": med["handoff"],
        "kv_mib": nbytes / (1 << 20),
        "pd_path_gbps": nbytes / med["transfer"] / GIB,
    }


def _raw_transfer(args: argparse.Namespace, lens: list[int]) -> dict[int, dict[str, float]]:
    """`pdcache bench transfer` for the same bytes per room: raw engine and memcpy GB/s."""
    from pdcache.engine.loader import load_model_config

    config = load_model_config(args.preset)
    out: dict[int, dict[str, float]] = {}
    for n in lens:
        with tempfile.TemporaryDirectory() as tmp:
            path = Path(tmp) / "transfer.json"
            cmd = [sys.executable, "-m", "pdcache", "bench", "transfer",
                   "--engines", args.transfer_engine, "--layouts", "random",
                   "--layers", str(config.num_hidden_layers),
                   "--page-tokens", str(args.page_size),
                   "--kv-heads", str(config.num_key_value_heads),
                   "--head-dim", str(config.head_dim),
                   "--pages-per-room", str(max(1, n // args.page_size)),
                   "--rooms", "2", "--repeats", str(args.repeats), "--json", str(path)]
            done = subprocess.run(cmd, env=child_env(), capture_output=True, text=True,
                                  timeout=600)
            if done.returncode != 0 or not path.exists():
                print(f"bench transfer failed:\n{done.stdout[-2000:]}{done.stderr[-2000:]}",
                      file=sys.stderr)
                continue
            out[n] = _raw_columns(json.loads(path.read_text())["rows"])
    return out


def _raw_columns(rows: list[dict[str, Any]]) -> dict[str, float]:
    """memcpy / raw engine / KVSender->KVReceiver GiB/s from `bench transfer` rows."""
    names = {"memcpy": "memcpy_gbps", "raw engine": "raw_engine_gbps",
             "KVSender->KVReceiver": "protocol_gbps"}
    return {names[row["path"]]: float(row["GiB/s"]) for row in rows if row.get("path") in names}
