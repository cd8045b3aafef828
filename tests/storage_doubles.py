"""Test doubles for storage: an in-memory backend with switchable faults."""

from __future__ import annotations

import threading
from collections.abc import Sequence

import torch

from pdcache.offload_manager.storage.base import StorageBackend


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
