"""Failure semantics of the whole PD stack with real processes: kill -9 of a
decode process during a KV transfer and of a prefill process before `done`, and 200 mixed
requests, all through `pdcache router` in front of `pdcache prefill` / `pdcache decode`
(tiny preset, page size 16, Mooncake TE over loopback TCP).

One cluster of 2 prefill + 2 decode nodes and a router is shared by the module: each kill test
kills one node of its role and checks the survivors; a healthy pair is always left. Every
assertion about idleness reads the nodes' own `/health` (engine and transfer stats)."""

from __future__ import annotations

import concurrent.futures
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from tests.polling import poll

pytest.importorskip("mooncake.engine", reason="mooncake wheel not installed")

pytestmark = pytest.mark.slow

PAGE = 16
LONG_PROMPT = [(7 * i + 3) % 250 for i in range(4000)]  # ~1 s of prefill on tiny: a wide window
GREEDY = {"temperature": 0.0, "ignore_eos": True}
CHILD_ENV = {"MC_TCP_BIND_ADDRESS": "127.0.0.1", "MC_LOG_LEVEL": "ERROR", "OMP_NUM_THREADS": "1",
             "PYTHONUNBUFFERED": "1"}
NODE_FLAGS = ["--model", "tiny", "--seed", "0", "--page-size", str(PAGE), "--device-pages", "1024",
              "--transfer-engine", "mooncake", "--transfer-timeout", "5", "--request-timeout",
              "60", "--log-level", "warning"]


class Proc:
    """`python -m pdcache ARGS` in its own session; `url` (and `bootstrap`) once ready."""

    def __init__(self, name: str, args: list[str], ready_prefix: str) -> None:
        self.name, self.ready_prefix = name, ready_prefix
        self.url, self.bootstrap = "", ""
        self.output: list[str] = []
        self._ready = threading.Event()
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "pdcache", *args], stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT, text=True, env={**os.environ, **CHILD_ENV},
            start_new_session=True)
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.output.append(line)
            if "KV bootstrap at " in line:
                self.bootstrap = line.split("KV bootstrap at ", 1)[1].strip()
            if line.startswith(self.ready_prefix):
                self.url = line[len(self.ready_prefix):].strip()
                self._ready.set()

    def wait_ready(self, timeout_s: float = 90.0) -> None:
        if not self._ready.wait(timeout_s):
            raise RuntimeError(f"{self.name} did not start:\n" + "".join(self.output[-30:]))

    def alive(self) -> bool:
        return self.proc.poll() is None

    def kill9(self) -> None:
        if self.alive():
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait(10)


class Cluster:
    """p0, p1 (prefill), d0, d1 (decode) and a router naming them in that order."""

    def __init__(self) -> None:
        self.procs: list[Proc] = []
        self.http = httpx.Client(timeout=30, trust_env=False)

    def start(self) -> None:
        for name in ("p0", "p1"):
            self.procs.append(Proc(name, ["prefill", *NODE_FLAGS, "--name", name],
                                   "pdcache prefill: ready at "))
        for name in ("d0", "d1"):
            self.procs.append(Proc(name, ["decode", *NODE_FLAGS, "--name", name],
                                   "pdcache decode: ready at "))
        for proc in self.procs:
            proc.wait_ready()
        args = ["router", "--port", "0", "--model", "tiny", "--page-size", str(PAGE),
                "--prefill-policy", "round_robin", "--decode-policy", "round_robin",
                "--request-timeout", "30", "--connect-timeout", "2", "--health-interval", "0.3",
                "--log-level", "warning"]
        for p in self.prefills():
            args += ["--prefill", f"{p.url}@{p.bootstrap.removeprefix('tcp://')}"]
        for d in self.decodes():
            args += ["--decode", d.url]
        self.router = Proc("router", args, "pdcache router: ready at ")
        self.procs.append(self.router)
        self.router.wait_ready()

    def prefills(self) -> list[Proc]:
        return [p for p in self.procs if p.name.startswith("p")]

    def decodes(self) -> list[Proc]:
        return [p for p in self.procs if p.name.startswith("d")]

    def alive(self, procs: list[Proc]) -> list[Proc]:
        return [p for p in procs if p.alive()]

    def health(self, proc: Proc) -> dict[str, Any]:
        return self.http.get(f"{proc.url}/health", timeout=5).json()

    def router_sees_only_living(self) -> None:
        """Waits until the router marks exactly the living nodes healthy."""
        expected = [p.alive() for p in self.procs if p is not self.router]

        def seen() -> bool:
            nodes = self.http.get(f"{self.router.url}/health", timeout=5).json()["nodes"]
            return [n["healthy"] for n in nodes] == expected
        assert poll(seen, 15), self.http.get(f"{self.router.url}/health").json()

    def close(self) -> None:
        self.http.close()
        for proc in reversed(self.procs):
            try:
                proc.kill9()
            except Exception:  # keep killing the others
                pass


@pytest.fixture(scope="module")
def cluster() -> Iterator[Cluster]:
    nodes = Cluster()
    try:
        nodes.start()
        yield nodes
    finally:
        nodes.close()


# ---- idleness as each node reports it -----------------------------------------------------

def prefill_idle(health: dict[str, Any]) -> bool:
    """No room in flight; every used page belongs to the radix cache (none held by a request)."""
    engine, rooms = health["engine"], health["transfer"]["rooms"]
    return (rooms["active"] == 0 and engine["num_running"] == 0 and engine["queued"] == 0
            and engine["pages_reserved"] == 0 and engine["requests_held"] == 0
            and engine["pages_used"] == engine["cached_pages"])


def decode_idle(health: dict[str, Any]) -> bool:
    """No room in flight, no page reserved for incoming KV or held for offload; every used page
    belongs to decode's prefix cache (finished turns kept for their next turn)."""
    engine, rooms = health["engine"], health["transfer"]["rooms"]
    return (rooms["active"] == 0 and engine["num_running"] == 0 and engine["queued"] == 0
            and engine["pages_reserved"] == 0 and engine["requests_held"] == 0
            and engine["pages_used"] == engine["cached_pages"]
            and engine["pages_evictable"] == engine["cached_pages"])  # no lock left behind


def assert_survivors_idle(cluster: Cluster, timeout_s: float = 30.0) -> float:
    """Waits until every living node is idle; returns how long that took."""
    start = time.monotonic()
    checks = [(p, prefill_idle) for p in cluster.alive(cluster.prefills())]
    checks += [(d, decode_idle) for d in cluster.alive(cluster.decodes())]
    for proc, idle in checks:
        assert poll(lambda p=proc, f=idle: f(cluster.health(p)), timeout_s, 0.1), \
            (proc.name, cluster.health(proc))
    return time.monotonic() - start


def generate_body(ids: list[int], n: int, **extra: Any) -> dict[str, Any]:
    return {"input_ids": ids, "sampling_params": {"max_new_tokens": n, **GREEDY}, **extra}


def assert_healthy_pair_serves(cluster: Cluster) -> None:
    """A new request (twice, so round robin passes every living node) succeeds on survivors."""
    cluster.router_sees_only_living()
    living = {p.name for p in cluster.alive(cluster.procs)}
    for seed in range(2):
        ids = [(11 * i + seed) % 250 for i in range(40)]
        r = cluster.http.post(f"{cluster.router.url}/generate", json=generate_body(ids, 5))
        assert r.status_code == 200, r.text
        meta = r.json()["meta_info"]
        assert len(r.json()["output_ids"]) == 5
        assert {meta["prefill_node"], meta["decode_node"]} <= living, meta


def send_long_request(cluster: Cluster) -> concurrent.futures.Future:
    pool = concurrent.futures.ThreadPoolExecutor(1)

    def post() -> tuple[httpx.Response, float]:
        start = time.monotonic()
        r = cluster.http.post(f"{cluster.router.url}/generate",
                              json=generate_body(LONG_PROMPT, 4), timeout=60)
        return r, time.monotonic() - start

    future = pool.submit(post)
    pool.shutdown(wait=False)
    return future


def node_with_active_room(cluster: Cluster, procs: list[Proc], timeout_s: float = 20.0) -> Proc:
    """The first of `procs` whose /health shows a room in flight (polled every 10 ms)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for proc in procs:
            if cluster.health(proc)["transfer"]["rooms"]["active"] > 0:
                return proc
        time.sleep(0.01)
    raise AssertionError(f"no room became active on {[p.name for p in procs]}")


def assert_json_error(r: httpx.Response) -> None:
    assert 500 <= r.status_code < 600, (r.status_code, r.text)
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}, error


# ---- the tests --------------------------------------------------------------------------

def test_200_mixed_requests_leave_nothing_in_flight(cluster: Cluster) -> None:
    """Plain, streamed, OpenAI with stop strings, stop tokens and client-side timeouts (the
    client walks away mid-answer) at concurrency 8: afterwards no room and no page is held."""
    cluster.router_sees_only_living()
    url = cluster.router.url
    outcomes: dict[str, int] = {}
    lock = threading.Lock()

    def one(i: int) -> str:
        ids = [(13 * i + 5 * j) % 250 for j in range(8 + (i * 37) % 120)]
        kind = ("plain", "stream", "completion_stop", "stop_token", "client_timeout")[i % 5]
        with httpx.Client(base_url=url, timeout=60, trust_env=False) as client:
            if kind == "plain":
                r = client.post("/generate", json=generate_body(ids, 1 + i % 12))
                assert r.status_code == 200, r.text
                assert len(r.json()["output_ids"]) == 1 + i % 12
            elif kind == "stream":
                r = client.post("/generate", json=generate_body(ids, 1 + i % 16, stream=True))
                assert r.status_code == 200 and r.text.rstrip().endswith("data: [DONE]"), r.text
            elif kind == "completion_stop":
                r = client.post("/v1/completions", json={
                    "prompt": "tell me " * (1 + i % 20), "max_tokens": 12, "stop": ["e", "a"],
                    "stream": i % 2 == 0, **GREEDY})
                assert r.status_code == 200, r.text
            elif kind == "stop_token":
                body = generate_body(ids, 30)
                body["sampling_params"]["stop_token_ids"] = list(range(0, 250, 3))
                r = client.post("/generate", json=body)
                assert r.status_code == 200, r.text
            else:
                try:  # long enough to still be decoding when the client gives up
                    client.post("/generate", json=generate_body(ids, 400, stream=i % 2 == 0),
                                timeout=0.2 + (i % 3) * 0.15)
                    kind = "client_timeout_finished"
                except httpx.TimeoutException:
                    pass
        with lock:
            outcomes[kind] = outcomes.get(kind, 0) + 1
        return kind

    start = time.monotonic()
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        list(pool.map(one, range(200)))
    elapsed = time.monotonic() - start
    print(f"200 mixed requests in {elapsed:.1f} s: {outcomes}")
    assert sum(outcomes.values()) == 200
    assert outcomes.get("client_timeout", 0) >= 20, outcomes  # most walked away mid-answer
    assert_survivors_idle(cluster)
    for proc in cluster.alive(cluster.procs[:-1]):
        rooms = cluster.health(proc)["transfer"]["rooms"]
        assert rooms["created"] == rooms["succeeded"] + rooms["failed"], (proc.name, rooms)
    # the router drops a walked-away request's count when its handler unwinds, which can come
    # a moment after the nodes went idle: wait for it, bounded (a leak still fails here)
    def router_idle() -> bool:
        nodes = cluster.http.get(f"{url}/health").json()["nodes"]
        return [n["in_flight"] for n in nodes] == [0] * len(nodes)

    assert poll(router_idle, 30.0, 0.1), [
        (n["name"], n["role"], n["in_flight"])
        for n in cluster.http.get(f"{url}/health").json()["nodes"]]


def test_kill9_decode_during_transfer(cluster: Cluster) -> None:
    decodes = cluster.alive(cluster.decodes())
    if len(decodes) < 2:
        pytest.skip("needs two living decode nodes")
    cluster.router_sees_only_living()
    prefills = cluster.alive(cluster.prefills())
    failed_before = {p.name: cluster.health(p)["transfer"]["rooms"]["failed"] for p in prefills}
    future = send_long_request(cluster)
    # decode registered the room and told prefill its pages: prefill is computing 4k tokens
    victim = node_with_active_room(cluster, decodes)
    pushing = node_with_active_room(cluster, prefills)  # P holds the room too
    assert not future.done()
    victim.kill9()
    r, elapsed = future.result(60)
    print(f"killed {victim.name}: router answered {r.status_code} after {elapsed:.2f} s")
    assert_json_error(r)
    assert elapsed < 30, elapsed
    print(f"survivors idle {assert_survivors_idle(cluster):.2f} s after the answer")
    # the push to the dead decode failed (it did not complete before the kill)
    rooms = cluster.health(pushing)["transfer"]["rooms"]
    assert rooms["failed"] > failed_before[pushing.name], rooms
    assert_healthy_pair_serves(cluster)
    assert_survivors_idle(cluster)


def test_kill9_prefill_before_done(cluster: Cluster) -> None:
    prefills = cluster.alive(cluster.prefills())
    if len(prefills) < 2:
        pytest.skip("needs two living prefill nodes")
    cluster.router_sees_only_living()
    decodes = cluster.alive(cluster.decodes())
    future = send_long_request(cluster)
    victim = node_with_active_room(cluster, prefills)
    assert not future.done()  # killed before its answer (and before `done`)
    victim.kill9()
    r, elapsed = future.result(60)
    print(f"killed {victim.name}: router answered {r.status_code} after {elapsed:.2f} s")
    assert_json_error(r)
    assert elapsed < 30, elapsed
    print(f"survivors idle {assert_survivors_idle(cluster):.2f} s after the answer")
    for proc in decodes:
        assert cluster.health(proc)["engine"]["pages_reserved"] == 0
    assert_healthy_pair_serves(cluster)
    assert_survivors_idle(cluster)


def test_caller_gone_before_kv_frees_decode_room_promptly(cluster: Cluster) -> None:
    """The router cancels D's request (client disconnect) while D waits for KV and P never got
    its request: D must abort the room (telling P) and free its pages, not wait it out."""
    prefill = cluster.alive(cluster.prefills())[0]
    decode = cluster.alive(cluster.decodes())[0]
    assert poll(lambda: decode_idle(cluster.health(decode)), 30, 0.1)
    body = generate_body(list(range(100)), 4)
    body["pd"] = {"room": 4242, "role": "decode", "bootstrap": prefill.bootstrap,
                  "prefill_node": prefill.name}
    with pytest.raises(httpx.TimeoutException):  # P never sends: D cannot answer
        cluster.http.post(f"{decode.url}/generate", json=body, timeout=0.5)
    # D reserved pages and opened the room; it must let both go without waiting for room_timeout
    # well before room_timeout_s (20 s here): at the latest when the abort ack times out (10 s)
    assert poll(lambda: decode_idle(cluster.health(decode)), 15, 0.1), cluster.health(decode)
