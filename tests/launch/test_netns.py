"""Multi-host for real on one machine: two network namespaces joined by a veth pair.

Namespace A holds the metadata service, the prefill node and the router; namespace B holds the
decode node. Their only link is the veth pair, addressed in a private /30 that exists inside
those two namespaces alone (nothing is routed anywhere else). KV moves from A to B with
`mooncake` tcp bound to each side's veth address; hf3fs pages are shared through the metadata
service on A's address and one data directory on the common filesystem. A client inside A runs
a 2-turn session through the router: exact tokens against an in-process unified engine, and
turn 2 reuses the pages decode wrote over there (`storage_from_decode > 0`).

Skipped, with the reason, where `ip` is missing or network namespaces are not permitted.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.pd_harness import UnifiedReference

pytest.importorskip("mooncake.engine", reason="mooncake wheel not installed")

PAGE = 4
PROMPT = [(5 * i + 3) % 240 + 2 for i in range(30)]
ANSWER = 24
MESSAGE = [11, 12, 13, 14, 15]
SUBNET = "10.251.7"  # a /30: .1 in namespace A, .2 in namespace B, nowhere else
ADDR_A, ADDR_B = f"{SUBNET}.1", f"{SUBNET}.2"
METADATA_PORT, PREFILL_PORT, BOOTSTRAP_PORT, DECODE_PORT, ROUTER_PORT = (
    18000, 30001, 8998, 30002, 8000)  # fresh namespaces: every port is free
START_TIMEOUT_S = 90.0


def ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, timeout=20,
                          check=check)


@dataclass
class Namespaces:
    a: str
    b: str


def add_namespace(name: str) -> None:
    if name in ip("netns", "list", check=False).stdout.split():
        ip("netns", "del", name, check=False)  # left by a killed run that had our pid
    result = ip("netns", "add", name, check=False)
    if result.returncode != 0:
        pytest.skip(f"network namespaces not permitted here (`ip netns add {name}`: "
                    f"{result.stderr.strip()})")


def link_namespaces(ns: Namespaces) -> None:
    """The veth pair is created inside A and its peer moved to B: it never exists in the
    machine's own namespace, and neither do its addresses."""
    ip("netns", "exec", ns.a, "ip", "link", "add", "pdc0", "type", "veth",
       "peer", "name", "pdc1", "netns", ns.b)
    for name, dev, addr in ((ns.a, "pdc0", ADDR_A), (ns.b, "pdc1", ADDR_B)):
        ip("netns", "exec", name, "ip", "addr", "add", f"{addr}/30", "dev", dev)
        ip("netns", "exec", name, "ip", "link", "set", dev, "up")
        ip("netns", "exec", name, "ip", "link", "set", "lo", "up")


def kill_namespace_processes(name: str) -> None:
    """Our own processes only: nothing else runs in a namespace this test created."""
    listed = ip("netns", "pids", name, check=False).stdout.split()
    for pid in listed:
        try:
            os.kill(int(pid), signal.SIGKILL)
        except (ProcessLookupError, ValueError):
            pass


@pytest.fixture()
def namespaces() -> Iterator[Namespaces]:
    if shutil.which("ip") is None:
        pytest.skip("`ip` (iproute2) is not installed: apt-get install -y iproute2")
    if os.geteuid() != 0:
        pytest.skip("network namespaces need root (CAP_NET_ADMIN and CAP_SYS_ADMIN)")
    ns = Namespaces(f"pdc-a-{os.getpid()}", f"pdc-b-{os.getpid()}")
    created: list[str] = []
    try:
        for name in (ns.a, ns.b):
            add_namespace(name)
            created.append(name)
        link_namespaces(ns)
        yield ns
    finally:
        for name in created:
            kill_namespace_processes(name)
            ip("netns", "del", name, check=False)  # deleting A also removes the veth pair


class NsProcess:
    """`ip netns exec NS python -m pdcache ...` (ip execs, so the pid is python's), output to
    a log file; `wait_line` waits for a line that starts with a prefix."""

    def __init__(self, ns: str, bind_addr: str, log: Path, *argv: str) -> None:
        env = {**os.environ, "MC_TCP_BIND_ADDRESS": bind_addr, "MC_LOG_LEVEL": "ERROR",
               "PYTHONUNBUFFERED": "1"}
        self.log = log
        self.name = argv[0]
        with log.open("w") as out:
            self.proc = subprocess.Popen(
                ["ip", "netns", "exec", ns, sys.executable, "-m", "pdcache", *argv],
                stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)

    def wait_line(self, prefix: str, timeout_s: float = START_TIMEOUT_S) -> str:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            for line in self.log.read_text().splitlines():
                if line.startswith(prefix):
                    return line[len(prefix):].strip()
            if self.proc.poll() is not None:
                break
            time.sleep(0.1)
        raise RuntimeError(f"{self.name}: no {prefix!r} (exit {self.proc.poll()}):\n"
                           + self.tail())

    def tail(self, lines: int = 30) -> str:
        return "\n".join(self.log.read_text().splitlines()[-lines:])

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(10)


# Runs inside namespace A: the session through the router, waiting between turns until the
# decode node in B has written every page it scheduled (its /metrics, across the veth).
CLIENT = textwrap.dedent("""
    import json, re, sys, time
    import httpx

    router, prefill, decode = sys.argv[1], sys.argv[2], sys.argv[3]
    spec = json.loads(sys.argv[4])
    params = {"max_new_tokens": spec["answer"], "temperature": 0, "ignore_eos": True}

    def offload_settled(client):
        text = client.get(decode + "/metrics").text
        value = lambda name: float(re.search(
            "^pdcache_decode_offload_" + name + r"(?:_total)?\\{[^}]*\\} (\\S+)$",
            text, re.M).group(1))
        done = sum(value(n) for n in ("pages_offloaded", "pages_skipped", "pages_dropped",
                                      "pages_failed"))
        pending = value("pending_copies") + value("pending_writes")
        return value("pages_scheduled") > 0 and done >= value("pages_scheduled") and not pending

    turns, prompt = [], spec["prompt"]
    with httpx.Client(timeout=120) as client:
        for t in range(2):
            reply = client.post(router + "/generate",
                                json={"input_ids": prompt, "sampling_params": params})
            body = reply.json()
            turns.append({"status": reply.status_code, "prompt": prompt, "body": body})
            if reply.status_code != 200:
                break
            deadline = time.monotonic() + 30
            while not offload_settled(client) and time.monotonic() < deadline:
                time.sleep(0.05)
            prompt = prompt + body["output_ids"] + spec["message"]
        turns.append({"decode_metrics": client.get(decode + "/metrics").text,
                      "prefill_health": client.get(prefill + "/health").json()})
    print(json.dumps(turns))
""")


def start_deployment(ns: Namespaces, tmp_path: Path) -> list[NsProcess]:
    """Metadata service, then prefill (A) and decode (B) together, then the router (A)."""
    procs: list[NsProcess] = []
    storage = ["--model", "tiny", "--seed", "0", "--page-size", str(PAGE),
               "--device-pages", "256", "--transfer-engine", "mooncake",
               "--transfer-timeout", "20", "--storage-backend", "hf3fs",
               "--storage-path", str(tmp_path / "storage"), "--storage-capacity", "16MiB",
               "--storage-metadata", f"tcp://{ADDR_A}:{METADATA_PORT}", "--log-level", "warning"]
    meta = NsProcess(ns.a, ADDR_A, tmp_path / "metadata.log", "metadata-server",
                     "--host", ADDR_A, "--port", str(METADATA_PORT),
                     "--state-dir", str(tmp_path / "metadata"), "--log-level", "WARNING")
    procs.append(meta)
    meta.wait_line("pdcache metadata-server listening on ")
    prefill = NsProcess(ns.a, ADDR_A, tmp_path / "prefill.log", "prefill", *storage,
                        "--name", "p0", "--host", ADDR_A, "--port", str(PREFILL_PORT),
                        "--bootstrap-port", str(BOOTSTRAP_PORT), "--host-pages", "512",
                        "--prefetch-policy", "wait_complete")
    procs.append(prefill)
    decode = NsProcess(ns.b, ADDR_B, tmp_path / "decode.log", "decode", *storage,
                       "--name", "d0", "--host", ADDR_B, "--port", str(DECODE_PORT),
                       "--offload-staging-pages", "64")
    procs.append(decode)
    bootstrap = prefill.wait_line("pdcache prefill: KV bootstrap at ")
    prefill_url = prefill.wait_line("pdcache prefill: ready at ")
    decode_url = decode.wait_line("pdcache decode: ready at ")
    assert bootstrap.removeprefix("tcp://") == f"{ADDR_A}:{BOOTSTRAP_PORT}", bootstrap
    assert decode_url == f"http://{ADDR_B}:{DECODE_PORT}", decode_url
    router = NsProcess(ns.a, ADDR_A, tmp_path / "router.log", "router",
                       "--prefill", f"{prefill_url}@{bootstrap}", "--decode", decode_url,
                       "--model", "tiny", "--seed", "0", "--page-size", str(PAGE),
                       "--host", ADDR_A, "--port", str(ROUTER_PORT))
    procs.append(router)
    router.wait_line("pdcache router: ready at ")
    return procs


def run_client(ns: Namespaces, tmp_path: Path) -> list[dict]:
    script = tmp_path / "client.py"
    script.write_text(CLIENT)
    spec = json.dumps({"prompt": PROMPT, "answer": ANSWER, "message": MESSAGE})
    result = subprocess.run(
        ["ip", "netns", "exec", ns.a, sys.executable, str(script),
         f"http://{ADDR_A}:{ROUTER_PORT}", f"http://{ADDR_A}:{PREFILL_PORT}",
         f"http://{ADDR_B}:{DECODE_PORT}", spec],
        capture_output=True, text=True, timeout=180)
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout)


def rx_bytes(ns: str, dev: str) -> int:
    """Bytes the namespace's veth end has received (the kernel's counter)."""
    shown = json.loads(ip("netns", "exec", ns, "ip", "-s", "-j", "link", "show",
                          dev).stdout)
    return int(shown[0]["stats64"]["rx"]["bytes"])


def isolated(ns: str) -> bool:
    """The namespace sees only lo and its veth end, with no default route."""
    routes = ip("netns", "exec", ns, "ip", "-4", "route", "show").stdout
    return "default" not in routes and all(SUBNET in line for line in routes.splitlines())


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_prefill_and_decode_in_two_namespaces_serve_a_session(namespaces, tmp_path) -> None:
    from pdcache.engine.loader import load_model

    assert isolated(namespaces.a) and isolated(namespaces.b)
    model, tokenizer = load_model("tiny", seed=0)
    reference = UnifiedReference(model, tokenizer, PAGE)
    procs: list[NsProcess] = []
    started = time.monotonic()
    try:
        procs = start_deployment(namespaces, tmp_path)
        up_s = time.monotonic() - started
        rx_before = rx_bytes(namespaces.b, "pdc1")
        *turns, metrics = run_client(namespaces, tmp_path)
        rx_in_b = rx_bytes(namespaces.b, "pdc1") - rx_before
        for t, turn in enumerate(turns):
            assert turn["status"] == 200, (t, turn["body"])
        assert len(turns) == 2
        for turn in turns:
            assert turn["body"]["output_ids"] == reference(turn["prompt"], ANSWER)
        meta1, meta2 = turns[0]["body"]["meta_info"], turns[1]["body"]["meta_info"]
        print(f"up in {up_s:.1f}s, session in {time.monotonic() - started - up_s:.1f}s; "
              f"turn 1 meta {meta1}; turn 2 meta {meta2}")
        # turn 2 finds the prompt and most of the answer in the shared storage, the answer's
        # pages written by decode from the other namespace
        history = len(turns[0]["prompt"]) + ANSWER
        assert meta2["cached_tokens"] >= (history - 1) // PAGE * PAGE - PAGE, meta2
        assert meta2["cached_tokens_details"]["storage_from_decode"] > 0, meta2
        assert "pdcache_decode_offload_pages_offloaded" in metrics["decode_metrics"]
        # mooncake moved the prompts' K/V from A to B, and it went through the veth (B's only
        # link): at least turn 1's full prompt pages arrived there, besides the HTTP bodies
        pushed = len(PROMPT) // PAGE * PAGE * model.config.kv_bytes_per_token
        sender = metrics["prefill_health"]["transfer"]
        print(f"veth bytes into B during the session: {rx_in_b}, turn 1 prompt KV: {pushed}, "
              f"prefill sender: {sender}")
        assert sender["transfers"] >= 2 and sender["engine_errors"] == 0, sender
        assert sender["bytes_sent"] >= pushed, sender
        assert rx_in_b >= sender["bytes_sent"], (rx_in_b, sender)
    except Exception:
        for proc in procs:
            print(f"---- {proc.name} log ----\n{proc.tail()}")
        raise
    finally:
        for proc in reversed(procs):
            proc.stop()
        reference.close()
