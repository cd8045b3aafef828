"""In-process PD stacks for tests: prefill and decode apps on uvicorn threads (127.0.0.1, free
ports), driven over real HTTP exactly as the router drives them (docs/pd-protocol.md)."""

from __future__ import annotations

import concurrent.futures
import os
import secrets
import socket
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import httpx
import uvicorn

from pdcache.config import NodeSetup, OffloadSettings, process_environment
from pdcache.decode_node.runtime import DecodeRuntime
from pdcache.engine.config import CacheConfig, EngineConfig
from pdcache.engine.loader import load_model
from pdcache.engine.presets import PRESETS
from pdcache.engine.scheduler_config import SchedulerConfig
from pdcache.offload_manager.builder import (
    TierConfig,
    fingerprint_for,
    model_identity,
    storage_config_for,
)
from pdcache.offload_manager.hicache import HiCacheConfig
from pdcache.offload_manager.tier_settings import TierSettings
from pdcache.prefill_node.runtime import PrefillRuntime
from pdcache.transfer.config import TransferConfig
from tests.polling import poll


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class ServerThread:
    """A uvicorn server on a thread; `stop()` runs the app's shutdown."""

    def __init__(self, app: Any, port: int) -> None:
        config = uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning",
                                lifespan="on")
        self.server = uvicorn.Server(config)
        self.server.install_signal_handlers = lambda: None
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.url = f"http://127.0.0.1:{port}"
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise RuntimeError("server did not start")
            time.sleep(0.01)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(30)


@dataclass
class PDStack:
    prefill: ServerThread
    decode: ServerThread
    prefill_server: Any
    decode_server: Any
    bootstrap: str
    client: httpx.Client = field(default_factory=lambda: httpx.Client(timeout=120))

    def generate(self, input_ids: list[int], max_new_tokens: int, salt: str = "",
                 stream: bool = False, room: int | None = None) -> tuple[dict, dict]:
        """Send one request to P and D at once; returns (P's answer, D's answer)."""
        room = secrets.randbits(63) if room is None else room
        sampling = {"max_new_tokens": max_new_tokens, "ignore_eos": True}
        base = {"input_ids": input_ids, "sampling_params": sampling, "cache_salt": salt}
        p_body = {**base, "pd": {"room": room, "role": "prefill", "decode_node": "d0"}}
        d_body = {**base, "pd": {"room": room, "role": "decode", "bootstrap": self.bootstrap,
                                 "prefill_node": "p0"}}
        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            p = pool.submit(self.client.post, f"{self.prefill.url}/generate", json=p_body)
            d = pool.submit(self.client.post, f"{self.decode.url}/generate", json=d_body)
            return p.result().json(), d.result().json()

    def offload_idle(self, timeout_s: float = 30) -> bool:
        offload = self.decode_server_app.state.offload
        return offload is None or offload.wait_idle(timeout_s)

    def close(self) -> None:
        self.client.close()
        self.decode.stop()
        self.prefill.stop()


def node_setups(tmp_path, model, page_size: int, engine: str, offload: bool,
                write_policy: str = "write_through", backend: str = "hf3fs",
                storage_settings: dict | None = None,
                decode_prefix_cache: bool = False,
                window_tiers: bool = False) -> tuple[NodeSetup, NodeSetup]:
    """A prefill and a decode setup over shared storage; decode's prefix cache is off unless
    asked for (these tests count what prefill sends and what decode frees). `window_tiers`:
    `[cache] window_tiers` (a sliding-window model's stored format, both nodes)."""
    fp = fingerprint_for(model.config, model_identity(_preset_of(model), 0), page_size,
                         window_tiers)
    settings = storage_settings or {"path": str(tmp_path / "storage"), "capacity_pages": 4096,
                                    "metadata": "inproc"}
    storage = storage_config_for(model.config, page_size, fp, window_tiers, backend=backend,
                                 **settings)
    cache_tiers = TierSettings(window_tiers=window_tiers)
    transfer = TransferConfig(engine=engine, bootstrap_timeout_s=10, room_timeout_s=20,
                              heartbeat_interval_s=0.5)
    sched = SchedulerConfig(chunked_prefill_tokens=256)
    p_engine = EngineConfig(model.config, CacheConfig(page_size, 256), sched)
    d_engine = EngineConfig(model.config, CacheConfig(page_size, 256,
                                                      enable_prefix_cache=decode_prefix_cache),
                            sched)
    tiers = TierConfig(512, HiCacheConfig(write_policy=write_policy,
                                          prefetch_policy="wait_complete"), storage)
    prefill = NodeSetup("p0", "prefill", "127.0.0.1", 0, p_engine, tiers, fp, storage, transfer,
                        free_port(), cache_tiers=cache_tiers)
    decode = NodeSetup("d0", "decode", "127.0.0.1", 0, d_engine, None, fp, storage, transfer,
                       offload=OffloadSettings(staging_pages=64) if offload else None,
                       cache_tiers=cache_tiers)
    return prefill, decode


def _preset_of(model) -> str:
    """The preset a test model was loaded from ("tiny" unless its config names another)."""
    name = model.config.name.removeprefix("pdcache-")
    return name if name in PRESETS else "tiny"


def start_stack(prefill: NodeSetup, decode: NodeSetup, preset: str = "tiny") -> PDStack:
    model, tokenizer = load_model(preset, seed=0)
    return start_model_stack(prefill, decode, model, tokenizer)


def start_model_stack(prefill: NodeSetup, decode: NodeSetup, model: Any, tokenizer: Any,
                      decode_model: Any = None) -> PDStack:
    """A PD stack serving `model` (decode: `decode_model` when given) on uvicorn threads."""
    os.environ.update(process_environment(prefill, os.environ))  # as a node process's entry does
    p_server = PrefillRuntime(prefill, model, tokenizer)
    d_server = DecodeRuntime(decode, decode_model or model, tokenizer)
    p_app, d_app = p_server.app(), d_server.app()
    p_thread = ServerThread(p_app, free_port())
    d_thread = ServerThread(d_app, free_port())
    stack = PDStack(p_thread, d_thread, p_server, d_server, p_server.sender.bootstrap_addr)
    stack.decode_server_app = d_app
    return stack


class MetadataService:
    """`pdcache metadata-server` as a subprocess on a free loopback port."""

    def __init__(self, state_dir, secret_file: str | None = None) -> None:
        import subprocess
        import sys

        self.port = free_port()
        secret = ["--secret-file", secret_file] if secret_file else []
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "pdcache", "metadata-server", "--host", "127.0.0.1",
             "--port", str(self.port), "--state-dir", str(state_dir), *secret],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 30
        while True:
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=0.5).close()
                break
            except OSError:
                if time.monotonic() > deadline or self.proc.poll() is not None:
                    self.stop()
                    raise RuntimeError("metadata service did not start") from None
                time.sleep(0.05)
        self.address = f"tcp://127.0.0.1:{self.port}"

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except Exception:
                self.proc.kill()
                self.proc.wait(5)


# ---- multi-turn sessions and end-of-test accounting (decode offload tests) ---------------

def page_floor(n: int, page_size: int) -> int:
    return n // page_size * page_size


@dataclass
class Turn:
    prompt: list[int]
    answer: list[int]
    meta: dict


def run_session(stack: PDStack, first_prompt: list[int], messages: list[list[int]],
                answer_tokens: int, reference=None) -> list[Turn]:
    """Greedy turns: turn t+1's prompt = prompt_t + answer_t + messages[t]. With `reference`
    (prompt, n) -> tokens, every answer is checked against it. Waits for decode's offload
    after each turn, so the next turn sees every page decode wrote."""
    turns: list[Turn] = []
    prompt = list(first_prompt)
    for t in range(len(messages) + 1):
        p, d = stack.generate(prompt, answer_tokens)
        assert "output_ids" in d, (p, d)
        answer = d["output_ids"]
        assert p["output_ids"] == answer[:1]
        assert 0 < p["pd"]["push_s"] <= p["pd"]["transfer_s"], p["pd"]
        if reference is not None:
            assert answer == reference(prompt, answer_tokens), f"turn {t} differs from unified"
        turns.append(Turn(prompt, answer, d["meta_info"]))
        assert stack.offload_idle(30), "decode offload did not drain"
        if t < len(messages):
            prompt = prompt + answer + messages[t]
    return turns


def rooms_active(client: httpx.Client, url: str) -> int:
    return int(client.get(f"{url}/health").json()["transfer"]["rooms"]["active"])


def assert_stack_idle(stack: PDStack) -> None:
    """Invariant 3 at the end of a test: nothing held for offload, staging empty, page
    accounting exact on both engines, no room in flight on either node."""
    offload = stack.decode_server_app.state.offload
    if offload is not None:
        assert offload.wait_idle(30)
        offload.check()
        snap = offload.snapshot()
        assert snap["staging_pages_used"] == 0 and snap["queued_pages"] == 0, snap
    decode_engine = stack.decode_server.engine
    # held pages go back through the engine's inbox: wait until they are free
    assert poll(lambda: decode_engine.check_accounting()["used"] == 0, 10), \
        decode_engine.check_accounting()
    stack.prefill_server.engine.check_accounting()
    assert poll(lambda: rooms_active(stack.client, stack.prefill.url) == 0, 10)
    assert poll(lambda: rooms_active(stack.client, stack.decode.url) == 0, 10)


def metric_value(text: str, name: str, **labels: str) -> float:
    """The value of one sample in a Prometheus exposition (0.0 when absent)."""
    from prometheus_client.parser import text_string_to_metric_families

    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                return float(sample.value)
    return 0.0


def assert_answers_reused(turns: list[Turn], messages: list[list[int]], page_size: int) -> None:
    """Invariant 2: turn t+1 reuses prompt_t and answer_t (the answer from decode's pages) and
    computes about only the new message."""
    for prev, turn, message in zip(turns, turns[1:], messages):
        meta, details = turn.meta, turn.meta["cached_tokens_details"]
        assert len(prev.answer) >= 3 * page_size
        reused_floor = page_floor(len(prev.prompt) + len(prev.answer), page_size) - page_size
        assert meta["cached_tokens"] >= reused_floor, meta
        # everything past prompt_t's pages exists only because decode wrote it
        answer_part = meta["cached_tokens"] - page_floor(len(prev.prompt), page_size)
        assert details["storage_from_decode"] >= answer_part > 0, meta
        assert meta["computed_tokens"] == len(turn.prompt) - meta["cached_tokens"]
        assert meta["computed_tokens"] <= len(message) + page_size, meta


class UnifiedReference:
    """A unified engine without any cache: `tokens(prompt, n)` -> its greedy tokens."""

    def __init__(self, model, tokenizer, page_size: int) -> None:
        from pdcache.engine.engine import Engine

        config = EngineConfig(model.config, CacheConfig(page_size, 256,
                                                        enable_prefix_cache=False))
        self.engine = Engine(config, model, tokenizer)
        self.engine.start()
        self._memo: dict[tuple, list[int]] = {}

    def __call__(self, prompt: list[int], n: int) -> list[int]:
        from pdcache.engine.api import GenerateRequest, SamplingParams

        key = (tuple(prompt), n)
        if key not in self._memo:
            params = SamplingParams(max_new_tokens=n, ignore_eos=True)
            outputs = self.engine.generate(GenerateRequest("ref", prompt, params), timeout=120)
            self._memo[key] = [t for o in outputs for t in o.new_token_ids]
        return self._memo[key]

    def close(self) -> None:
        self.engine.shutdown()
