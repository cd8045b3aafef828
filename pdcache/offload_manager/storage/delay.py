"""`DelayedWrites`: any backend whose writes take `StorageConfig.write_delay_s` longer.

A configured store, not a test double: `[storage] write_delay_s` emulates a slow or distant
store (a loaded 3FS cluster, Mooncake Store across a WAN) on a laptop, so benchmarks and the
tests of the durable next turn (docs/design.md §4.10) can make the decode node's storage
write lose the race against the next turn deterministically. Reads, lookups and everything
else go straight to the wrapped backend.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

from pdcache.offload_manager.storage.base import StorageBackend
from pdcache.offload_manager.storage.page_format import HostPage


class DelayedWrites(StorageBackend):
    """`inner` with every `put_from` call starting `delay_s` late (thread-safe as `inner`)."""

    def __init__(self, inner: StorageBackend, delay_s: float) -> None:
        self.inner = inner
        self.delay_s = delay_s

    def exists_prefix(self, keys: Sequence[bytes]) -> int:
        return self.inner.exists_prefix(keys)

    def get_into(self, keys: Sequence[bytes], host_pages: Sequence[HostPage],
                 origins: list[str | None] | None = None) -> list[bool]:
        return self.inner.get_into(keys, host_pages, origins)

    def put_from(self, keys: Sequence[bytes], host_pages: Sequence[HostPage],
                 origin: str = "prefill", namespace: str = "") -> list[bool]:
        time.sleep(self.delay_s)  # the emulated latency of the store, on the writer's thread
        return self.inner.put_from(keys, host_pages, origin, namespace)

    def delete(self, keys: Sequence[bytes]) -> None:
        self.inner.delete(keys)

    def stats(self) -> dict[str, int | float]:
        return self.inner.stats()

    def close(self) -> None:
        self.inner.close()

    def __getattr__(self, name: str) -> Any:  # backend-specific helpers (inspection, tests)
        return getattr(self.inner, name)
