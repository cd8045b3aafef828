"""`pdcache bench durable`: does turn t+1 find turn t's answer, with and without the wait for
pending pages (docs/design.md §4.10)?

One prefill and one decode node (real processes on loopback, file storage), driven
like the router drives them: `--sessions` conversations at once, each turn sent the moment the
previous one answered (zero think time), answers of `--answer-len` tokens. Decode writes each
whole answer at its end (`--stride-pages` above the answer: the worst case for the race), to a
store whose writes take `--write-delays` seconds longer (`storage.write_delay_s`, given to the
decode node only; 0 = the store as it is). For every delay, a fresh stack per
`--pending-pulls` mode with prefill's `pending_wait` on (`never`: wait for the writes; `auto`:
pull the awaited pages from decode's host staging when decode's expected write time exceeds
the pull's estimate, docs/design.md §4.10), then one with the wait off (`--no-pending-wait`);
prefill's prefetch policy is `timeout` with its default deadline (2 s + 0.1 s per 1k tokens).
Every stack shares a fresh cluster secret (`--secret-file`: a pull needs one, docs/security.md).
Each stack first serves one short warm-up request and waits for decode to have written it,
so decode's marks carry a measured write latency from the first session on (a node that has
served anything has; one that has not announces "unknown" and its first answers are waited
for).

Per row: the next turns' hit rate on the previous answers (storage_from_decode over the page
floor of the answer), pages waited, pulled and raced, the mean wait of the requests that met
pending pages, how long decode held an answer for prefill to record its marks (mean, and
how many gave up at `pending_ack_timeout_s`),
next-turn TTFT, decode's storage write latency, and what pulling the awaited pages from
decode's host staging over the transfer engine would have cost instead (their bytes at the
P→D push rate measured in the same run, plus one control round trip), the estimate the
pull rule started from.
"""

from __future__ import annotations

import argparse
import random
import statistics
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx

from pdcache.bench.pd_bench import RunningNode, pd_flags, pd_request, random_prompt, start_node
from pdcache.bench.table import emit
from pdcache.config.security import SecuritySettings
from pdcache.utils.secret import create_secret, load_secret

CONTROL_RTT_S = 0.0005  # one ZMQ request/answer on loopback (`pdcache bench` control RTT)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--preset", default="tiny", help="model preset")
    parser.add_argument("--sessions", type=int, default=8, help="concurrent conversations")
    parser.add_argument("--turns", type=int, default=2,
                        help="turns per session (the last one only probes its prompt)")
    parser.add_argument("--answer-len", type=int, default=1024)
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--message-len", type=int, default=8)
    parser.add_argument("--write-delays", default="0,0.2",
                        help="decode's storage write delays to run (seconds, comma-separated)")
    parser.add_argument("--page-size", type=int, default=16)
    parser.add_argument("--device-pages", type=int, default=2048)
    parser.add_argument("--host-pages", type=int, default=2048)
    parser.add_argument("--stride-pages", type=int, default=256)
    parser.add_argument("--storage-backend", default="file", choices=["file"],
                        help="file: shared by both node processes without a metadata service")
    parser.add_argument("--transfer-engine", default="zmq", choices=["mooncake", "zmq"])
    parser.add_argument("--storage-dir", default=None, help="default: a temporary directory")
    parser.add_argument("--timeout", type=float, default=600.0, help="per request (s)")
    parser.add_argument("--pending-pulls", default="never,auto",
                        help="prefill's pending_pull modes to run with the wait on "
                             "(comma-separated: never, auto, always)")


def run(args: argparse.Namespace) -> int:
    rows = []
    pulls = [x.strip() for x in args.pending_pulls.split(",") if x.strip()]
    for delay in [float(x) for x in args.write_delays.split(",") if x.strip()]:
        for wait, pull in [*((True, mode) for mode in pulls), (False, "never")]:
            with tempfile.TemporaryDirectory(dir=args.storage_dir) as tmp:
                rows.append(_measure(args, Path(tmp), delay, wait, pull))
    extra = {"preset": args.preset, "sessions": args.sessions, "turns": args.turns,
             "answer_len": args.answer_len, "storage_backend": args.storage_backend,
             "transfer_engine": args.transfer_engine, "stride_pages": args.stride_pages,
             "pull_est": "awaited bytes / measured P->D push rate + one control RTT"}
    emit("Durable next turn: next-turn hits on the previous answer; pending wait on (pull "
         "never / auto) vs off",
         rows, args.json_path, extra=extra)
    return 0


def _measure(args: argparse.Namespace, tmp: Path, delay: float, wait: bool,
             pull: str) -> dict[str, Any]:
    storage = ["--storage-backend", args.storage_backend, "--storage-path", str(tmp / "s"),
               "--storage-capacity", "4GiB"]
    # a cluster secret, as a pull needs one (docs/security.md): MAC'd pages, an authenticated
    # control plane, and the node credential on every request (the same for both modes)
    secret_file = create_secret(tmp / "cluster.secret")
    headers = SecuritySettings.from_secret(load_secret(secret_file)).node_headers()
    common = [*pd_flags(args), *storage, "--secret-file", str(secret_file)]
    nodes: list[RunningNode] = []
    try:
        nodes.append(start_node("prefill", [
            *common, "--name", "p0", "--host-pages", str(args.host_pages),
            "--prefetch-policy", "timeout", "--pending-pull", pull,
            *([] if wait else ["--no-pending-wait"])]))
        nodes.append(start_node("decode", [
            *common, "--name", "d0", "--storage-write-delay", str(delay),
            "--offload-stride-pages", str(args.stride_pages),
            "--offload-staging-pages", str(args.host_pages)]))
        prefill, decode = nodes
        with httpx.Client(timeout=args.timeout, headers=headers) as client:
            _warm_up(args, client, prefill, decode, delay)
            with ThreadPoolExecutor(args.sessions) as pool:
                turns = [t for s in pool.map(lambda i: _session(args, client, prefill, decode, i),
                                             range(args.sessions)) for t in s]
            p_metrics = client.get(f"{prefill.url}/metrics").text
            d_metrics = client.get(f"{decode.url}/metrics").text
            d_transfer = client.get(f"{decode.url}/health").json()["transfer"]
    finally:
        for node in reversed(nodes):
            node.stop()
    return _row(args, delay, wait, pull, turns, p_metrics, d_metrics, d_transfer)


def _warm_up(args: argparse.Namespace, client: httpx.Client, prefill: RunningNode,
             decode: RunningNode, delay_s: float) -> None:
    """One short request (not measured) whose pages decode writes, waited for until decode
    has measured that write (bounded: the store's delay plus a minute)."""
    rng = random.Random("durable-warm-up")
    pd_request(client, prefill.url, decode.url, prefill.bootstrap,
               random_prompt(rng, args.page_size * 2), args.page_size + 1)
    deadline = time.monotonic() + delay_s + 60.0
    while time.monotonic() < deadline:
        text = client.get(f"{decode.url}/metrics").text
        if _metric(text, "pdcache_decode_offload_write_latency_seconds_count") >= 1:
            return
        time.sleep(0.05)  # polled: a write of the emulated slow store takes delay_s
    raise RuntimeError("decode did not write the warm-up request's pages")


def _metric(text: str, name: str, **labels: str) -> float:
    from prometheus_client.parser import text_string_to_metric_families

    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                return float(sample.value)
    return 0.0


def _session(args: argparse.Namespace, client: httpx.Client, prefill: RunningNode,
             decode: RunningNode, index: int) -> list[dict[str, Any]]:
    rng = random.Random(f"durable-{index}")
    prompt = random_prompt(rng, args.prompt_len + index)
    out = []
    previous: tuple[list[int], list[int]] | None = None
    for turn in range(args.turns):
        answer_len = args.answer_len if turn < args.turns - 1 else 1
        _, p, d = pd_request(client, prefill.url, decode.url, prefill.bootstrap, prompt,
                             answer_len)
        meta = d["meta_info"]
        record = {"ttft_s": meta["ttft_s"], "push_bytes": p["pd"]["bytes"],
                  "push_s": p["pd"]["push_s"]}
        if previous is not None:
            prev_prompt, prev_answer = previous
            size = args.page_size
            record["expected"] = ((len(prev_prompt) + len(prev_answer) - 1) // size
                                  - len(prev_prompt) // size) * size
            record["found"] = meta["cached_tokens_details"]["storage_from_decode"]
        out.append(record)
        previous = (prompt, d["output_ids"])
        prompt = prompt + d["output_ids"] + random_prompt(rng, args.message_len)
    return out


def _row(args: argparse.Namespace, delay: float, wait: bool, pull: str,
         turns: list[dict[str, Any]], p_metrics: str, d_metrics: str,
         d_transfer: dict[str, Any]) -> dict[str, Any]:
    value = _metric

    nexts = [t for t in turns if "expected" in t]
    expected = sum(t["expected"] for t in nexts)
    found = sum(t["found"] for t in nexts)
    waited_requests = value(p_metrics, "pdcache_pending_wait_requests_total")
    wait_s = value(p_metrics, "pdcache_pending_wait_seconds_total")
    writes = value(d_metrics, "pdcache_decode_offload_write_latency_seconds_count")
    write_s = value(d_metrics, "pdcache_decode_offload_write_latency_seconds_sum")
    push_rate = sum(t["push_bytes"] for t in turns) / max(1e-9, sum(t["push_s"] for t in turns))
    found_pages = value(p_metrics, "pdcache_pending_pages_total", outcome="found")
    awaited_bytes = _page_bytes(args) * found_pages / max(1.0, waited_requests)
    return {
        "write_delay_s": delay,
        "pending_wait": "on" if wait else "off",
        "pending_pull": pull if wait else "-",
        "next_turn_hit": found / expected if expected else 0.0,
        "pages_found_pending": int(found_pages),
        "pages_waited": int(value(p_metrics, "pdcache_pending_pages_total", outcome="waited")),
        "pages_pulled": int(value(p_metrics, "pdcache_pending_pages_total", outcome="pulled")),
        "pages_raced": int(value(p_metrics, "pdcache_pending_pages_total", outcome="raced")),
        "pull_rejected": int(value(p_metrics, "pdcache_pending_pull_pages_total",
                                   outcome="rejected")),
        "wait_ms_per_req": 1e3 * wait_s / waited_requests if waited_requests else 0.0,
        "next_ttft_p50_s": statistics.median(t["ttft_s"] for t in nexts) if nexts else 0.0,
        "decode_write_ms": 1e3 * write_s / writes if writes else 0.0,
        "pull_est_ms_per_req": 1e3 * (awaited_bytes / push_rate + CONTROL_RTT_S)
        if waited_requests else 0.0,
        "pull_MBps": value(p_metrics, "pdcache_pending_pull_rate_bytes_per_second") / 1e6
        if value(p_metrics, "pdcache_pending_pulls_total", outcome="sent") else 0.0,
        # what the answers waited for prefill to record their marks (design §4.10, Delivery)
        "mark_ack_ms": 1e3 * d_transfer["pending_ack_seconds_total"]
        / max(1, d_transfer["pending_marks_acked"]),
        "mark_ack_timeouts": int(d_transfer["pending_ack_timeouts"]),
    }


def _page_bytes(args: argparse.Namespace) -> int:
    """Bytes of one KV page of the preset (all layers' K and V)."""
    from pdcache.engine.presets import PRESETS

    return args.page_size * PRESETS[args.preset].kv_bytes_per_token
