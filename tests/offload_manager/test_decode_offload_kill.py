"""kill -9 of a real decode process (`python -m pdcache decode`) in the middle of offloading:
no partial or corrupt page is ever readable from the shared hf3fs storage, and the next turn,
served by a new decode process, still produces the unified run's tokens, reusing the pages the
dead decode managed to commit and recomputing the rest."""

from __future__ import annotations

import argparse
import concurrent.futures
import os
import signal
import subprocess
import sys
import threading

import httpx
import pytest

from pdcache.config import process_environment, setup_for, topology_from_flags
from pdcache.config.storage_cli import verify
from pdcache.engine.loader import load_model
from pdcache.engine.page_keys import chain_page_keys, make_salt
from pdcache.offload_manager.storage import create_backend
from pdcache.prefill_node import cli as prefill_cli
from pdcache.prefill_node.runtime import PrefillRuntime
from tests.pd_harness import (
    MetadataService,
    ServerThread,
    UnifiedReference,
    free_port,
    rooms_active,
)
from tests.polling import poll

pytest.importorskip("mooncake.engine", reason="mooncake wheel not installed")

PAGE = 4
ANSWER = 320  # 80 answer pages: decode is still offloading when it dies
PROMPT = [(3 * i + 2) % 250 for i in range(30)]
MESSAGE = [17, 18, 19, 20, 21]
READY = "pdcache decode: ready at "


def storage_flags(tmp_path, metadata: str) -> list[str]:
    return ["--model", "tiny", "--seed", "0", "--page-size", str(PAGE), "--device-pages", "512",
            "--transfer-engine", "mooncake", "--storage-backend", "hf3fs",
            "--storage-path", str(tmp_path / "storage"), "--storage-capacity", "16MiB",
            "--storage-metadata", metadata, "--log-level", "warning"]


class DecodeProcess:
    """`python -m pdcache decode` on a free port; `url` once it printed its ready line."""

    def __init__(self, flags: list[str], timeout_s: float = 60.0) -> None:
        env = {**os.environ, "MC_TCP_BIND_ADDRESS": "127.0.0.1", "MC_LOG_LEVEL": "ERROR"}
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "pdcache", "decode", *flags, "--port", str(free_port())],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
        self.output: list[str] = []
        ready = threading.Event()
        self.url = ""

        def read() -> None:
            for line in self.proc.stdout:
                self.output.append(line)
                if line.startswith(READY):
                    self.url = line[len(READY):].strip()
                    ready.set()

        threading.Thread(target=read, daemon=True).start()
        if not ready.wait(timeout_s):
            self.kill()
            raise RuntimeError("decode did not start:\n" + "".join(self.output[-30:]))

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(10)


def pd_request(client: httpx.Client, prefill_url: str, decode_url: str, bootstrap: str,
               room: int, prompt: list[int], n: int) -> tuple[concurrent.futures.Future, ...]:
    base = {"input_ids": prompt, "sampling_params": {"max_new_tokens": n, "ignore_eos": True}}
    p_body = {**base, "pd": {"room": room, "role": "prefill", "decode_node": "d0"}}
    d_body = {**base, "pd": {"room": room, "role": "decode", "bootstrap": bootstrap,
                             "prefill_node": "p0"}}
    pool = concurrent.futures.ThreadPoolExecutor(2)
    futures = (pool.submit(client.post, f"{prefill_url}/generate", json=p_body),
               pool.submit(client.post, f"{decode_url}/generate", json=d_body))
    pool.shutdown(wait=False)
    return futures


@pytest.fixture()
def env(monkeypatch):
    monkeypatch.setenv("MC_TCP_BIND_ADDRESS", "127.0.0.1")
    monkeypatch.setenv("MC_LOG_LEVEL", "ERROR")


def test_kill_decode_mid_offload_leaves_only_whole_pages(env, tmp_path) -> None:
    service = MetadataService(tmp_path / "metadata")
    flags = storage_flags(tmp_path, service.address)
    parser = argparse.ArgumentParser()
    prefill_cli.add_arguments(parser)
    p_args = parser.parse_args([*flags, "--host-pages", "1024", "--prefetch-policy",
                                "wait_complete"])
    model, tokenizer = load_model("tiny", seed=0)
    setup = setup_for(topology_from_flags(p_args, "prefill"), p_args.name, model.config)
    os.environ.update(process_environment(setup, os.environ))  # as `pdcache prefill` does
    p_server = PrefillRuntime(setup, model, tokenizer)
    p_app = p_server.app()
    prefill = ServerThread(p_app, free_port())
    reference = UnifiedReference(model, tokenizer, PAGE)
    backend = create_backend(setup.storage)
    client = httpx.Client(timeout=120)
    decodes: list[DecodeProcess] = []
    try:
        answer = reference(PROMPT, ANSWER)
        keys = chain_page_keys((PROMPT + answer)[:-1], PAGE, make_salt(setup.fingerprint, ""))
        prompt_pages = len(PROMPT) // PAGE
        bootstrap = p_server.sender.bootstrap_addr

        offload_flags = ["--offload-stride-pages", "1", "--offload-staging-pages", "64"]
        decodes.append(DecodeProcess([*flags, *offload_flags]))
        p_fut, d_fut = pd_request(client, prefill.url, decodes[0].url, bootstrap, 1, PROMPT,
                                  ANSWER)
        # decode's own pages are landing in storage: kill it while it is still going
        assert poll(lambda: backend.exists_prefix(keys) >= prompt_pages + 8, 60, 0.005)
        decodes[0].kill()
        stored_at_kill = backend.exists_prefix(keys)
        assert stored_at_kill < len(keys), "decode finished offloading before it was killed"
        assert p_fut.result(60).status_code == 200  # prefill's part was over: it succeeded
        try:  # the client usually loses the connection; offload lagging behind an answer
            d_fut.result(60)  # that already went out is just as much "mid-offload"
        except httpx.TransportError:
            pass

        # every committed page reads back whole (header and checksum checked)
        result = verify(backend)
        assert result["bad"] == 0 and result["good"] == result["pages"] > prompt_pages, result
        stored = backend.exists_prefix(keys)
        assert stored < len(keys)

        # next turn through a new decode process: exact tokens, reuse up to the last whole
        # page the dead decode committed, the rest recomputed
        decodes.append(DecodeProcess(flags))
        turn2 = PROMPT + answer + MESSAGE
        p_fut, d_fut = pd_request(client, prefill.url, decodes[1].url, bootstrap, 2, turn2, 8)
        assert p_fut.result(60).status_code == 200
        d2 = d_fut.result(60).json()
        assert d2["output_ids"] == reference(turn2, 8)
        meta = d2["meta_info"]
        print(f"pages of the chain: {len(keys)}, stored at kill: {stored_at_kill}, "
              f"before turn 2: {stored}; turn 2 meta: {meta}")
        assert stored * PAGE - PAGE <= meta["cached_tokens"] <= stored * PAGE, meta
        assert meta["cached_tokens_details"]["storage_from_decode"] > 0, meta
        # the answer pages that never reached storage are computed again
        assert meta["computed_tokens"] == len(turn2) - meta["cached_tokens"]
        assert meta["computed_tokens"] >= len(turn2) - stored * PAGE > len(MESSAGE) + PAGE
        health = client.get(f"{decodes[1].url}/health").json()
        assert health["transfer"]["rooms"]["active"] == 0
        p_server.engine.check_accounting()
        assert poll(lambda: rooms_active(client, prefill.url) == 0, 30)
    finally:
        client.close()
        for proc in decodes:
            proc.kill()
        prefill.stop()
        backend.close()
        reference.close()
        service.stop()
