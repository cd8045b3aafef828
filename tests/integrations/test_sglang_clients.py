"""SGLang's own clients, unmodified, against pdcache on an exported `tiny` checkpoint: a unified
server, a 1P1D stack behind pdcache's router, and the same P/D pair behind SGLang's own
router (`sglang-router` from PyPI, PD mode). `sglang.bench_serving` (backends `sglang` and
`sglang-oai`, a local ShareGPT-format file: no downloads) completes with 0 failures, and
`sglang.test.kits.cache_hit_kit`'s multi-turn test passes its own assertions (round r caches
the previous prompt and answer, never more than the prompt). Slow: starts processes (the
servers side by side; the clients all in one `sglang_client_runner.py serve` process, which
imports SGLang once and runs each client invocation as its own process would)."""

from __future__ import annotations

import json
import os
import queue
import random
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from pdcache.engine.export import export_preset
from tests.process_support import PdcacheProcess
from tests.sglang_client_runner import DONE, READY

pytestmark = pytest.mark.slow
pytest.importorskip("sglang.benchmark.datasets.random")  # SGLang's client code (no-deps install)

ROOT = Path(__file__).resolve().parents[2]
RUNNER = ROOT / "tests" / "sglang_client_runner.py"
PAGE = 16
CLIENT_TIMEOUT_S = 240
ENV = {"MC_TCP_BIND_ADDRESS": "127.0.0.1", "MC_LOG_LEVEL": "ERROR", "OMP_NUM_THREADS": "1",
       "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
       "NO_PROXY": "127.0.0.1,localhost"}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start(args: list[str], command: str, wait: bool = True) -> PdcacheProcess:
    return PdcacheProcess(args, f"pdcache {command}: ready at ", 180, env=ENV, wait=wait)


@dataclass
class Stack:
    model_dir: Path
    dataset: Path  # the cache-hit kit's
    bench_dataset: Path  # bench_serving's: other prompts, so the kit's round 0 is cold
    unified: str
    router: str
    sglang_router: str | None
    sglang_router_log: Path


def sharegpt_file(path: Path, seed: int, count: int = 24) -> Path:
    """A ShareGPT-format dataset of random words (bench_serving's `random` dataset and the
    cache-hit kit draw their token ids from one; they download it when none is given)."""
    rng = random.Random(seed)
    words = [f"{w}{seed}" for w in ("alpha", "beta", "gamma", "delta", "omega", "kappa")]
    rows = [{"conversations": [
        {"from": "human", "value": " ".join(rng.choice(words) for _ in range(40))},
        {"from": "gpt", "value": " ".join(rng.choice(words) for _ in range(20))}]}
        for _ in range(count)]
    path.write_text(json.dumps(rows))
    return path


def start_sglang_router(prefill: str, bootstrap_port: int, decode: str, log: Path
                        ) -> tuple[subprocess.Popen[bytes] | None, str | None]:
    try:
        import sglang_router  # noqa: F401
    except ImportError:
        return None, None
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "sglang_router.launch_router", "--pd-disaggregation",
         "--prefill", prefill, str(bootstrap_port), "--decode", decode,
         "--host", "127.0.0.1", "--port", str(port)],
        stdout=log.open("wb"), stderr=subprocess.STDOUT, env={**os.environ, **ENV})
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and proc.poll() is None:
        try:
            if httpx.get(f"{url}/health", timeout=2, trust_env=False).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        time.sleep(0.3)
    proc.kill()
    raise AssertionError(f"sglang-router did not start:\n{log.read_text()[-3000:]}")


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    base = tmp_path_factory.mktemp("sglang-clients")
    model_dir = base / "tiny"
    export_preset("tiny", model_dir)
    storage = base / "storage"
    common = ["--model", str(model_dir), "--host", "127.0.0.1", "--port", "0",
              "--page-size", str(PAGE), "--log-level", "warning"]
    tiers = ["--storage-backend", "file", "--storage-path", str(storage)]
    procs: list[PdcacheProcess] = []
    extra: list[subprocess.Popen[bytes]] = []
    try:
        # the three servers start side by side (each waits on its own ready line)
        unified = start(["serve", *common, "--device-pages", "1024"], "serve", wait=False)
        procs.append(unified)
        prefill = start(["prefill", *common, "--name", "p0", "--transfer-engine", "zmq",
                         "--host-pages", "256", *tiers], "prefill", wait=False)
        procs.append(prefill)
        decode = start(["decode", *common, "--name", "d0", "--transfer-engine", "zmq",
                        *tiers], "decode", wait=False)
        procs.append(decode)
        for proc in procs:
            proc.wait_ready()
        info = httpx.get(f"{prefill.url}/server_info", trust_env=False).json()
        bootstrap = info["disaggregation_bootstrap_addr"]
        router = start(["router", "--model", str(model_dir), "--page-size", str(PAGE),
                        "--host", "127.0.0.1", "--port", "0", "--log-level", "warning",
                        "--prefill", f"{prefill.url}@{bootstrap}", "--decode", decode.url],
                       "router", wait=False)
        procs.append(router)
        log = base / "sglang-router.log"  # SGLang's router starts beside ours
        sgl_proc, sgl_url = start_sglang_router(
            prefill.url, int(info["disaggregation_bootstrap_port"]), decode.url, log)
        if sgl_proc is not None:
            extra.append(sgl_proc)
        router.wait_ready()
        yield Stack(model_dir, sharegpt_file(base / "kit.json", 5),
                    sharegpt_file(base / "bench.json", 6), unified.url, router.url, sgl_url, log)
    finally:
        for proc in extra:
            proc.terminate()
            proc.wait(15)
        for node in reversed(procs):
            node.stop()


class ClientRunner:
    """One `sglang_client_runner.py serve` process for the module: SGLang's clients are
    imported once, and each `run` is one client invocation, as a process of its own would
    run it (its output, its exit status). Started before the servers so its imports overlap
    their start-up; `run` restarts it if an earlier run timed out."""

    def __init__(self, out_dir: Path) -> None:
        self.out_dir, self.count = out_dir, 0
        self.proc: subprocess.Popen[str] | None = None
        self.lines: queue.Queue[str | None] = queue.Queue()
        self.start()

    def start(self) -> None:
        self.proc = subprocess.Popen([sys.executable, str(RUNNER), "serve"], text=True,
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     env={**os.environ, **ENV}, cwd=ROOT)
        self.lines = queue.Queue()
        threading.Thread(target=self._pump, args=(self.proc, self.lines), daemon=True).start()
        self.ready = False

    @staticmethod
    def _pump(proc: subprocess.Popen[str], lines: queue.Queue[str | None]) -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.put(line)
        lines.put(None)  # exited

    def _line(self, prefix: str, deadline: float, out: Path | None) -> str:
        while True:
            try:
                line = self.lines.get(timeout=max(deadline - time.monotonic(), 0.0))
            except queue.Empty:
                self.close()
                line = None
            if line is None:
                text = out.read_text()[-4000:] if out is not None and out.exists() else ""
                raise AssertionError(f"client runner gave no {prefix.strip()}:\n{text}")
            if line.startswith(prefix):
                return line[len(prefix):].strip()

    def run(self, *args: str) -> str:
        if self.proc is None or self.proc.poll() is not None:
            self.start()
        assert self.proc is not None and self.proc.stdin is not None
        deadline = time.monotonic() + CLIENT_TIMEOUT_S
        if not self.ready:
            self._line(READY, deadline, None)
            self.ready = True
        self.count += 1
        out = self.out_dir / f"client-{self.count}.log"
        self.proc.stdin.write(json.dumps({"argv": list(args), "out": str(out)}) + "\n")
        self.proc.stdin.flush()
        status = int(self._line(DONE, deadline, out))
        text = out.read_text()
        assert status == 0, text[-4000:]
        return text

    def close(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
        if self.proc is not None:
            self.proc.wait(10)


@pytest.fixture(scope="module")
def clients(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ClientRunner]:
    runner = ClientRunner(tmp_path_factory.mktemp("sglang-client-runs"))
    try:
        yield runner
    finally:
        runner.close()


def bench_serving(clients: ClientRunner, stack: Stack, url: str, backend: str,
                  tmp_path: Path) -> dict:
    result = tmp_path / f"{backend}.jsonl"
    clients.run("bench_serving", "--backend", backend, "--base-url", url,
               "--dataset-name", "random", "--dataset-path", str(stack.bench_dataset),
               "--tokenizer", str(stack.model_dir), "--model", str(stack.model_dir),
               "--num-prompts", "6", "--random-input-len", "48", "--random-output-len", "8",
               "--random-range-ratio", "1.0", "--request-rate", "inf", "--max-concurrency", "3",
               "--warmup-requests", "0", "--disable-tqdm", "--seed", "1",
               "--output-file", str(result))
    return json.loads(result.read_text().strip().splitlines()[-1])


@pytest.mark.parametrize("backend", ["sglang", "sglang-oai"])
@pytest.mark.parametrize("target", ["unified", "router"])
def test_bench_serving_completes_without_failures(clients: ClientRunner, stack: Stack,
                                                  backend: str, target: str,
                                                  tmp_path: Path) -> None:
    summary = bench_serving(clients, stack, getattr(stack, target), backend, tmp_path)
    assert summary["completed"] == 6, summary
    assert summary["total_output_tokens"] == 6 * 8, summary  # bench_serving sets ignore_eos
    assert summary.get("failed", 0) in (0, None) or summary["failed"] == 0


@pytest.mark.parametrize("target", ["unified", "router"])
def test_cache_hit_kit_multiturn(clients: ClientRunner, stack: Stack, target: str) -> None:
    out = clients.run("cache_hit", getattr(stack, target), str(stack.model_dir),
                     str(stack.dataset))
    result = json.loads(out.split("CACHE_HIT_RESULT ", 1)[1].splitlines()[0])
    rounds = result["rounds"]
    assert rounds["round_0"]["total_cached_tokens"] == 0
    assert rounds["round_1"]["cache_hit_rate"] > 0.3 and rounds["round_2"]["cache_hit_rate"] > 0.3


def test_sglang_router_drives_a_pdcache_pair(clients: ClientRunner, stack: Stack,
                                            tmp_path: Path) -> None:
    """SGLang's router in PD mode (the same body to P and D, bootstrap_* injected) answers
    what pdcache's own router answers, JSON and stream; bench_serving through it: 0 failures."""
    if stack.sglang_router is None:
        pytest.skip("sglang-router is not installed (pip install sglang-router --no-deps)")
    body = {"text": "alpha beta gamma delta " * 4,
            "sampling_params": {"max_new_tokens": 6, "temperature": 0.0, "ignore_eos": True}}
    with httpx.Client(timeout=60, trust_env=False) as client:
        ours = client.post(f"{stack.router}/generate", json=body).json()
        r = client.post(f"{stack.sglang_router}/generate", json=body)
        assert r.status_code == 200, (r.text, stack.sglang_router_log.read_text()[-2000:])
        theirs = r.json()
        assert theirs["output_ids"] == ours["output_ids"] and theirs["text"] == ours["text"]
        assert theirs["meta_info"]["finish_reason"] == {"type": "length", "length": 6}
        assert theirs["meta_info"]["prefill_node"] == "p0"
        streamed = client.post(f"{stack.sglang_router}/generate", json={**body, "stream": True})
        datas = [line[6:] for line in streamed.text.split("\n") if line.startswith("data: ")]
        assert datas[-1] == "[DONE]"
        assert json.loads(datas[-2])["output_ids"] == ours["output_ids"]
    summary = bench_serving(clients, stack, stack.sglang_router, "sglang", tmp_path)
    assert summary["completed"] == 6, summary
