"""Test doubles for storage: an in-memory backend and a file backend with switchable faults."""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from typing import Any

import torch

from pdcache.offload_manager.storage.base import StorageBackend
from pdcache.offload_manager.storage.file import FileBackend


class DictBackend(StorageBackend):
    """In-memory backend with switchable faults, to drive the worker's error paths."""

    def __init__(self) -> None:
        self.pages: dict[bytes, bytes] = {}
        self.origin: dict[bytes, str] = {}
        self.down = False
        self.gate = threading.Event()
        self.gate.set()

    def _check(self) -> None:
        self.gate.wait(10)
        if self.down:
            raise ConnectionError("storage down")

    def exists_prefix(self, keys: Sequence[bytes]) -> int:
        n = 0
        while n < len(keys) and keys[n] in self.pages:
            n += 1
        return n

    def get_into(self, keys, host_pages, origins=None) -> list[bool]:
        self._check()
        ok = []
        for i, (key, page) in enumerate(zip(keys, host_pages)):
            data = self.pages.get(key)
            if data is not None:
                page.copy_(torch.frombuffer(bytearray(data), dtype=torch.uint8))
                if origins is not None:
                    origins[i] = self.origin[key]
            ok.append(data is not None)
        return ok

    def put_from(self, keys, host_pages, origin="prefill", namespace="", session="") -> list[bool]:
        self._check()
        for key, page in zip(keys, host_pages):
            self.pages.setdefault(key, page.numpy().tobytes())
            self.origin.setdefault(key, origin)
        return [True] * len(keys)

    def delete(self, keys) -> None:
        for key in keys:
            self.pages.pop(key, None)

    def stats(self) -> dict[str, int | float]:
        return {"pages": len(self.pages)}

    def close(self) -> None:
        pass


class FaultyFileBackend(FileBackend):
    """The file backend with faults a test switches on through public fields, for code that
    opens its backend itself from a config (register it in `BACKENDS`, name it in the config,
    then reach the instance through its owner):

    - `down`: `exists_prefix`, `get_into` and `put_from` raise OSError("storage is down");
    - `read_gate`: each `get_into` first waits for this event (at most `gate_timeout_s`, then
      raises TimeoutError);
    - `read_delay_s`: each `get_into` first sleeps this long;
    - `reads_started` / `reads_finished`: `get_into` calls that began / ended (returned or
      raised), under a lock (the caller's IO threads read concurrently)."""

    gate_timeout_s = 10.0

    def __init__(self, config: Any) -> None:
        super().__init__(config)
        self.down = False
        self.read_gate: threading.Event | None = None
        self.read_delay_s = 0.0
        self.reads_started = 0
        self.reads_finished = 0
        self._calls_lock = threading.Lock()

    def _fail_if_down(self) -> None:
        if self.down:
            raise OSError("storage is down")

    def exists_prefix(self, keys: Sequence[bytes]) -> int:
        self._fail_if_down()
        return super().exists_prefix(keys)

    def put_from(self, keys, host_pages, origin="prefill", namespace="", session="") -> list[bool]:
        self._fail_if_down()
        return super().put_from(keys, host_pages, origin, namespace, session)

    def get_into(self, keys, host_pages, origins=None) -> list[bool]:
        self._fail_if_down()
        with self._calls_lock:
            self.reads_started += 1
        try:
            gate = self.read_gate
            if gate is not None and not gate.wait(self.gate_timeout_s):
                raise TimeoutError("the test never opened the read gate")
            if self.read_delay_s > 0:
                time.sleep(self.read_delay_s)
            return super().get_into(keys, host_pages, origins)
        finally:
            with self._calls_lock:
                self.reads_finished += 1
