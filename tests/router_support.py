"""Helpers for the router tests: real HTTP servers (uvicorn) in background threads on free
loopback ports, real `tiny` unified nodes, and raw sockets that misbehave on purpose."""

from __future__ import annotations

import json
import random
import socket
import threading
import time
from typing import Any

import httpx
import uvicorn

from pdcache.engine.config import CacheConfig
from pdcache.engine.engine import Engine
from pdcache.server.app import ServerConfig, create_app
from tests.process_support import PdcacheProcess

PAGE = 16
GREEDY = {"temperature": 0.0, "ignore_eos": True}


class ThreadedServer:
    """A uvicorn server for `app` in a daemon thread, listening on 127.0.0.1:free port."""

    def __init__(self, app: Any, startup_timeout_s: float = 60.0, port: int = 0) -> None:
        self.sock = socket.create_server(("127.0.0.1", port))
        self.port = self.sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        config = uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=2)
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]},
                                       daemon=True)
        self.thread.start()
        deadline = time.monotonic() + startup_timeout_s
        while not self.server.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise RuntimeError(f"server on {self.url} did not start")
            time.sleep(0.02)

    def stop(self, timeout_s: float = 15.0) -> None:
        self.server.should_exit = True
        self.thread.join(timeout_s)
        self.sock.close()


class UnifiedNode:
    """A real unified server around its own `tiny` engine."""

    def __init__(self, name: str, device_pages: int = 512) -> None:
        self.name = name
        self.engine = Engine.from_spec("tiny", cache=CacheConfig(page_size=PAGE,
                                                                 num_device_pages=device_pages))
        self.server = ThreadedServer(create_app(self.engine, ServerConfig(
            name=f"{name}-self", request_timeout_s=60)))
        self.url = self.server.url

    def running(self) -> int:
        return int(self.engine.stats().get("num_running", 0))

    def stop(self) -> None:
        self.server.stop()


def prompt(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(256) for _ in range(n)]


def sse_events(text: str) -> list[Any]:
    """Parsed `data:` payloads of an SSE body; asserts it ends with exactly one [DONE]."""
    datas = [line[len("data: "):] for line in text.split("\n") if line.startswith("data: ")]
    assert datas and datas[-1] == "[DONE]" and datas.count("[DONE]") == 1, text[-300:]
    return [json.loads(d) for d in datas[:-1]]


def page_floor(n: int) -> int:
    return n // PAGE * PAGE


class RawServer:
    """A TCP server that accepts and then either hangs (`mode="hang"`) or answers `reply`
    bytes and closes. For bounded-time and garbage tests."""

    def __init__(self, mode: str = "hang", reply: bytes = b"") -> None:
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.sock.settimeout(0.2)
        self.port = self.sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.mode, self.reply = mode, reply
        self._stop = threading.Event()
        self._conns: list[socket.socket] = []
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self.sock.accept()
            except OSError:
                continue
            self._conns.append(conn)
            if self.mode == "reply":
                threading.Thread(target=self._answer, args=(conn,), daemon=True).start()

    def _answer(self, conn: socket.socket) -> None:
        try:
            conn.settimeout(2)
            conn.recv(65536)
            conn.sendall(self.reply)
        except OSError:
            pass
        finally:
            conn.close()

    def stop(self) -> None:
        self._stop.set()
        self.thread.join(5)
        for conn in self._conns:
            conn.close()
        self.sock.close()


class RouterUnderTest:
    """A router app served by uvicorn on loopback plus an httpx client to it (real streaming,
    real disconnects). `app` is the FastAPI app (its router object in `app.state.router`)."""

    def __init__(self, app: Any, timeout_s: float = 60.0) -> None:
        self.app = app
        self._server: ThreadedServer | None = None
        self._timeout_s = timeout_s

    def __enter__(self) -> httpx.Client:
        self._server = ThreadedServer(self.app)
        self.url = self._server.url
        self.http = httpx.Client(base_url=self.url, timeout=self._timeout_s, trust_env=False)
        self.http.app = self.app  # type: ignore[attr-defined]
        return self.http

    def __exit__(self, *exc: object) -> None:
        self.http.close()
        assert self._server is not None
        self._server.stop()


class ServeProcess(PdcacheProcess):
    """`python -m pdcache serve --model tiny --port 0 --name NAME`, ready once it prints its
    URL (or a `pdcache router ...` command line: any pdcache command with a ready line)."""

    def __init__(self, args: list[str], ready_prefix: str, timeout_s: float = 120.0) -> None:
        super().__init__(args, ready_prefix, timeout_s)

    def terminate(self, timeout_s: float = 15.0) -> int:
        """SIGTERM and the exit code; raises (after a kill) if it does not exit in time."""
        if self.proc.poll() is None:
            self.proc.terminate()
        try:
            code = self.proc.wait(timeout_s)
        except Exception:
            self.kill()
            raise
        self.drain()
        return code
